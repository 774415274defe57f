"""Exercise 2 of lesson 02: fsdp_transformer.py with only the root wrapped, beside one unit per block.

Launch (from the repository root):
    torchrun --nproc_per_node=2 02-fsdp/solutions/ex2_root_only.py
    torchrun --nproc_per_node=2 02-fsdp/solutions/ex2_root_only.py --steps 4 \\
        --metrics-out runs/02-fsdp/ex2_root_only.json

Takes every flag of fsdp_transformer.py (its parser, loaded with the script by path) and trains
`--strategy full` twice in one launch, from the same weights on the same batches: with the
lesson's shard_model (fully_shard on each block, then on the root) and with the per-block
fully_shard removed, so that the root is the only FSDP unit. It prints, for both, the final loss,
the collectives of one step as the lesson counts them, and what one all-gather brings in at most.
"""

from pathlib import Path

import torch
import torch.distributed as dist

from dtcourse import launch, lessons, report
from dtcourse.models import GPT

SCRIPT = "02-fsdp/solutions/ex2_root_only.py"
LESSON = Path(__file__).resolve().parents[1]



transformer = lessons.load(LESSON / "fsdp_transformer.py")
per_block_shard_model = transformer.shard_model


def root_only_shard_model(model, strategy, mesh, args, device) -> None:
    """The lesson's shard_model without the loop over the blocks: one unit, the whole model, with
    the options the lesson gives its root (kept after forward; --mixed-precision and
    --cpu-offload as in the lesson)."""
    kw = {"mesh": mesh, "reshard_after_forward": False}
    if args.mixed_precision == "bf16":
        kw["mp_policy"] = transformer.MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                           reduce_dtype=torch.float32)
    if args.cpu_offload:
        kw["offload_policy"] = transformer.CPUOffloadPolicy(pin_memory=device.type == "cuda")
    transformer.fully_shard(model, **kw)


def unit_bytes(args) -> dict:
    """fp32 bytes of the largest FSDP unit each way: a block or the root (embeddings, final
    norm, head), or the whole model (shapes only: built on the meta device)."""
    with torch.device("meta"):
        model = GPT(args.vocab, args.seq_len, args.dim, args.heads, args.layers)
    total = sum(p.numel() for p in model.parameters())
    block = sum(p.numel() for p in model.blocks[0].parameters())
    return {"per block": 4 * max(block, total - args.layers * block), "root only": 4 * total}


def run(args, d) -> None:
    rows, largest = {}, unit_bytes(args)
    for wrap, shard_model in (("per block", per_block_shard_model),
                              ("root only", root_only_shard_model)):
        transformer.shard_model = shard_model  # build() looks it up in the lesson's module
        metrics, _ = transformer.train(args, "full", d)
        rows[wrap] = {**metrics, "largest_unit_bytes": largest[wrap]}
    transformer.shard_model = per_block_shard_model
    report.print0(f"\n{'wrap':10} {'loss':>7} {'all_gather':>11} {'reduce_scatter':>15} "
                  f"{'all-gathered B':>15} {'largest unit B':>15}  (one step, rank 0)")
    for wrap, m in rows.items():
        comms = m["comms_per_step"]
        report.print0(f"{wrap:10} {m['losses'][-1]:7.4f} {comms['all_gather']['calls']:11} "
                      f"{comms['reduce_scatter']['calls']:15} "
                      f"{comms['all_gather']['tensor_bytes']:15,} {m['largest_unit_bytes']:15,}")
    if d.rank == 0 and args.metrics_out:
        report.write_json(args.metrics_out, {"script": SCRIPT, "runs": rows})
    dist.barrier()  # the file is complete before any rank exits


def parse_args(argv=None):
    # fsdp_transformer.py's flags, its parser described by this script's docstring
    transformer.__doc__ = __doc__
    args = transformer.parse_args(argv)
    args.strategy = ["full"]
    return args


def main(argv=None):
    args = parse_args(argv)
    # --cpu-offload: gradient shards on the CPU, so on GPUs the group needs gloo beside NCCL
    with launch.distributed(args.device, args.timeout_s, cpu_collectives=args.cpu_offload) as d:
        run(args, d)


if __name__ == "__main__":
    main()

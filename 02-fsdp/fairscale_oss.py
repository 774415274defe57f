"""Where FSDP comes from: fairscale's OSS sharded optimizer with ShardedDataParallel, next to
torch's ZeroRedundancyOptimizer and plain DDP, on the same model and data; they must end with the
same weights. fairscale's own FullyShardedDataParallel runs only on CUDA.

Launch (from the repository root):
    torchrun --nproc_per_node=2 02-fsdp/fairscale_oss.py                  # ddp, zero, oss
    torchrun --nproc_per_node=2 02-fsdp/fairscale_oss.py --impl oss
    torchrun --nproc_per_node=2 02-fsdp/fairscale_oss.py --device cuda    # adds fairscale FSDP

The lineage (ZeRO, Rajbhandari et al. 2019, stage by stage):
    fairscale OSS (2020)          ZeRO-1: each rank keeps the Adam state of 1/N of the params,
                                  steps them, then broadcasts the updated params to the others.
    + ShardedDataParallel         each gradient is *reduced* (not all-reduced) to the one rank
                                  that owns it. ZeRO-2's gradient memory needs
                                  reduce_buffer_size=0: then the other ranks drop each gradient
                                  once it is sent. By default (2**23 elements) the gradients that
                                  fit a reduce bucket (one per owner rank) are views into it and
                                  stay on every rank: on this small model, all of them (the
                                  grads column of the output).
    torch ZeroRedundancyOptimizer OSS upstreamed into torch (1.8): ZeRO-1 beside plain DDP.
    fairscale FSDP (2021)         ZeRO-3: params sharded too -> upstreamed as torch FSDP (FSDP1,
                                  flat parameters), rewritten as FSDP2 (per-parameter DTensors).

The model and data are lesson 01's classifier: dtcourse.models.MLP and
dtcourse.data.classification_batch.
"""

from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from dtcourse import cli, launch, report, timing
from dtcourse.data import classification_batch, rank_rows
from dtcourse.models import MLP

SCRIPT = "02-fsdp/fairscale_oss.py"
IMPLS = ("ddp", "zero", "oss", "fsdp")
FSDP_NEEDS_CUDA = ("fairscale's FullyShardedDataParallel needs CUDA: it runs its all-gather and "
                   "gradient reduce-scatter on CUDA streams (torch.cuda.Stream)")


# --------------------------------------------------------------------------------------------------
# Four ways to shard less or more of the training state, on one model


def build(impl: str, args, device):
    """(wrapped model, optimizer, the optimizer whose .state this rank holds, plain module)."""
    torch.manual_seed(args.seed)  # every implementation starts from the same weights
    model = MLP(args.hidden).to(device)
    adamw = {"lr": args.lr, "weight_decay": 0.01}
    ids = [device.index] if device.type == "cuda" else None
    if impl == "ddp":  # all-reduce every gradient; every rank steps everything
        opt = torch.optim.AdamW(model.parameters(), **adamw)
        return DDP(model, device_ids=ids), opt, opt, model
    if impl == "zero":  # DDP's all-reduce + a sharded optimizer step, then broadcast the params
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW,
                                      **adamw)
        return DDP(model, device_ids=ids), opt, opt.optim, model
    if impl == "oss":
        from fairscale.nn.data_parallel import ShardedDataParallel
        from fairscale.optim.oss import OSS
        opt = OSS(model.parameters(), optim=torch.optim.AdamW, **adamw)  # partitions by size
        # Default reduce_buffer_size=2**23 elements (fairscale 0.4.13's code; its docstring says
        # 0): every rank keeps a bucket per owner rank, so the gradients that fit stay whole on
        # every rank (here all of them). reduce_buffer_size=0 reduces tensor by tensor and frees
        # the ones this rank does not own: ZeRO-2's gradient memory.
        return ShardedDataParallel(model, opt), opt, opt.optim, model
    from fairscale.nn import FullyShardedDataParallel as FairscaleFSDP  # impl == "fsdp", CUDA
    wrapped = FairscaleFSDP(model, flatten_parameters=True, mixed_precision=False)
    opt = torch.optim.AdamW(wrapped.parameters(), **adamw)  # the flat shards
    return wrapped, opt, opt, None


def train_step(impl: str, args, d, wrapped, opt, step: int) -> torch.Tensor:
    """One AdamW step on this rank's rows of the global batch; returns the global mean loss."""
    x, y = classification_batch(args.seed, step, d.world_size * args.batch_size)
    rows = rank_rows(d.rank, args.batch_size)
    if impl == "oss":
        # ShardedDataParallel's own zero_grad: the grads that fit its reduce buckets are views
        # into them, and it zeroes the buckets. torch's set_to_none=True would drop the views:
        # from step 2 on each .grad would be a fresh tensor that the reduction (of the buckets)
        # never touches, and each owner would step with its own un-averaged gradient
        # (silently wrong weights; 02-fsdp/solutions/ex6_oss_zero_grad.py shows it).
        wrapped.zero_grad()
    else:
        opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(wrapped(x[rows].to(d.device)), y[rows].to(d.device))
    loss.backward()  # ddp/zero: all-reduce; oss: reduce to the owner; fsdp: reduce-scatter
    opt.step()  # zero/oss: step the own partition, then broadcast it to the other ranks
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    return mean / d.world_size


def run(impl: str, args, d):
    """Train one implementation from the same start; (its metrics, its plain state dict)."""
    wrapped, opt, local_opt, plain = build(impl, args, d.device)
    losses, t0 = [], None
    for step in range(args.steps):
        if step == 1:
            t0 = timing.clock(d.device)  # the first step pays for warm-up; time the rest
        losses.append(train_step(impl, args, d, wrapped, opt, step).item())
    elapsed = timing.clock(d.device) - t0 if t0 else float("nan")
    global_bs = d.world_size * args.batch_size
    per_rank = report.gather(report.held_bytes(params=wrapped.parameters(), optimizer=local_opt,
                                               device=d.device))
    # fairscale FSDP: state_dict() all-gathers the full parameters (a collective)
    state = (plain if plain is not None else wrapped).state_dict()
    metrics = report.metrics(d, script=SCRIPT, strategy=impl, steps=args.steps,
                             global_batch=global_bs, losses=losses,
                             samples_per_s=(args.steps - 1) * global_bs / elapsed,
                             per_rank=per_rank)
    return metrics, {k: v.detach().cpu().clone() for k, v in state.items()}


def compare(args, d):
    impls = list(IMPLS) if args.impl == "all" else [args.impl]
    skipped = {}
    if "fsdp" in impls and d.device.type != "cuda":
        impls.remove("fsdp")
        skipped["fsdp"] = f"skipped on {d.device.type}: {FSDP_NEEDS_CUDA}"
    if {"oss", "fsdp"} & set(impls):
        try:
            import fairscale  # noqa: F401
        except ImportError:
            cli.fail("fairscale is not installed: pip install fairscale==0.4.13")
    report.print0(f"world {d.world_size} | device {d.device} | global batch "
                  f"{d.world_size * args.batch_size} | {args.steps} AdamW steps | "
                  f"{', '.join(impls)}")
    for impl, why in skipped.items():
        report.print0(f"{impl}: {why}")
    runs, states = {}, {}
    for impl in impls:
        runs[impl], states[impl] = run(impl, args, d)
    if d.is_main:
        print_table(impls, runs, states)
    write(args, d, impls, runs, states, skipped)


# --------------------------------------------------------------------------------------------------
# The report: each implementation against the first, and the bytes each rank holds


def print_table(impls, runs, states) -> None:
    ref = states[impls[0]]
    print(f"{'impl':5} {'final loss':>10} {'max |w - w_' + impls[0] + '|':>15}   bytes held by "
          f"each rank: params | grads | optimizer state")
    for impl in impls:
        diff = max((states[impl][k] - ref[k]).abs().max().item() for k in ref) \
            if states[impl].keys() == ref.keys() else float("nan")
        held = " | ".join("/".join(f"{h[k]:,}" for h in runs[impl]["per_rank"])
                          for k in ("param_bytes", "grad_bytes", "optim_bytes"))
        print(f"{impl:5} {runs[impl]['losses'][-1]:10.4f} {diff:15.3g}   {held}", flush=True)


def write(args, d, impls, runs, states, skipped) -> None:
    """Rank 0: one export per implementation (out.pt -> out.oss.pt; out.pt itself when only one
    ran) and the metrics of all."""
    if d.is_main:
        if args.export:
            for impl, state in states.items():
                report.save_state_dict(
                    report.variant_path(args.export, impl, several=len(states) > 1), state)
        if args.metrics_out:
            report.write_json(args.metrics_out, {
                "script": SCRIPT, "strategy": "+".join(impls), "world_size": d.world_size,
                "steps": args.steps, "global_batch": d.world_size * args.batch_size,
                "device": str(d.device), "torch_version": torch.__version__, "runs": runs,
                "skipped": skipped})
    dist.barrier()


# --------------------------------------------------------------------------------------------------
# Arguments and launch


def parse_args(argv=None):
    p = cli.parser(__doc__)
    cli.add_run_args(p)
    cli.add_train_args(p, steps=20, batch_size=32, lr=3e-3, grad_accum=False,
                       batch_help="samples per rank")
    cli.add_output_args(p, export=False)
    p.add_argument("--export", type=Path,
                   help="rank 0 writes each run's plain state_dict to PATH with the "
                        "implementation's name before the suffix (out.pt -> out.oss.pt)")
    p.add_argument("--impl", choices=[*IMPLS, "all"], default="all",
                   help="all: ddp, zero, oss, and fsdp where CUDA is available")
    p.add_argument("--hidden", type=int, default=128, help="width of the MLP")
    args = p.parse_args(argv)
    cli.check_positive(args, "steps", "batch_size", "hidden", "lr", "timeout_s")
    return args


def main(argv=None):
    args = parse_args(argv)
    with launch.distributed(args.device, args.timeout_s) as d:
        compare(args, d)


if __name__ == "__main__":
    main()

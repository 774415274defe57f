"""LoRA fine-tuning on a frozen, fully sharded base: low-rank adapters on the attention and MLP
projections of the course's GPT, the base frozen, the whole model sharded with FSDP2; what each rank
then holds and sends, measured beside full fine-tuning of the same model.

Launch (from the repository root):
    torchrun --nproc_per_node=2 02-fsdp/fsdp_lora.py                      # lora, then full
    torchrun --nproc_per_node=2 02-fsdp/fsdp_lora.py --method lora --rank 4 --targets q v
    python 02-fsdp/fsdp_lora.py --batch-size 16                           # one process
    torchrun --nproc_per_node=2 02-fsdp/fsdp_lora.py --method lora --export runs/lora.pt \
        --export-merged runs/merged.pt --export-adapters runs/adapters.pt

LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models") keeps a pre-trained
weight W (out, in) frozen and learns a low-rank update: y = W x + (alpha / r) B A x, with
A (r, in) random and B (out, r) zero, so training starts from the base model exactly. Only A and B
get gradients and AdamW state: 16 bytes per trainable parameter, 4 per frozen one (its weight).
After training, W + (alpha / r) B A is one plain matrix again (the merged export).

Sharding: fully_shard on each block and then the root, as in fsdp_transformer.py. A block holds
frozen (W) and trainable (A, B) parameters in one unit. FSDP2 shards each parameter on its own
(a DTensor each), all-gathers all of them (backward needs W to pass gradients down), and
reduce-scatters only the gradients that exist: A's and B's. Nothing else is needed.

The base here is the GPT at its seeded initial weights (dtcourse.models.init_gpt), trained on
dtcourse.data.token_batch, as in fsdp_transformer.py. The output is in 02-fsdp/fsdp_lora.md.
"""

import contextlib
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh

from dtcourse import cli, launch, report, timing
from dtcourse.comm import CollectiveCounter
from dtcourse.data import rank_rows, token_batch
from dtcourse.models import GPT, gpt_init_value, init_gpt

try:  # public since torch 2.6; torch.distributed._composable.fsdp before
    from torch.distributed.fsdp import fully_shard
except ImportError:
    from torch.distributed._composable.fsdp import fully_shard

SCRIPT = "02-fsdp/fsdp_lora.py"
# The projections of a GPT block that can take an adapter: attention's q, k, v and output
# projection, the MLP's two layers.
TARGETS = ("q", "k", "v", "proj", "fc1", "fc2")


# --------------------------------------------------------------------------------------------------
# The mechanism: adapters on a frozen base, each block one FSDP unit of both


def build(args, method: str, d):
    """A GPT (with adapters for lora), fully sharded per block, then materialised and filled."""
    with torch.device("meta"):
        model = GPT(args.vocab, args.seq_len, args.dim, args.heads, args.layers)
        adapted = add_lora(model, args.rank, args.alpha, args.targets) if method == "lora" else []
    mesh = init_device_mesh(d.device.type, (d.world_size,), mesh_dim_names=("shard",))
    # One unit per block holds its frozen W's and its trainable A's and B's together: FSDP2 keeps
    # requires_grad per parameter, so only A and B get gradient shards and reduce-scatters.
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)  # embeddings, final norm, head
    model.to_empty(device=d.device)
    if adapted:
        init_lora_gpt(model, args.seed, args.layers, adapted)
    else:
        init_gpt(model, args.seed)
    trainable = [p for p in model.parameters() if p.requires_grad]
    # AdamW on the trainable parameters only: the frozen base has no optimizer state at all
    optimizer = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.01)
    return model, optimizer, adapted


class LoRALinear(nn.Module):
    """A frozen nn.Linear plus a trainable low-rank update: (..., in) -> (..., out),
    y = base(x) + scale * (x A^T) B^T with A (r, in), B (out, r), scale = alpha / r.
    B starts at zero, so the layer starts as the base layer exactly."""

    def __init__(self, base: nn.Linear, r: int, alpha: float):
        super().__init__()
        self.base, self.r, self.scale = base, r, alpha / r
        for p in base.parameters():
            p.requires_grad_(False)  # frozen: no gradient, no optimizer state
        device = base.weight.device
        self.lora_a = nn.Parameter(torch.empty(r, base.in_features, device=device))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, r, device=device))

    def forward(self, x):
        # (..., in) -> (..., r) -> (..., out): two thin matmuls, never the (out, in) product
        return self.base(x) + F.linear(F.linear(x, self.lora_a), self.lora_b) * self.scale


def add_lora(model: GPT, r: int, alpha: float, targets) -> list:
    """Replace every target projection of every block by a LoRALinear around it, and freeze every
    other parameter of the model (embeddings, norms, head). Returns the adapted layers' names."""
    for p in model.parameters():
        p.requires_grad_(False)
    adapted = []
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if child_name in targets and isinstance(child, nn.Linear) and name.startswith("blocks"):
                setattr(module, child_name, LoRALinear(child, r, alpha))
                adapted.append(f"{name}.{child_name}")
    return adapted


# --------------------------------------------------------------------------------------------------
# Initial weights and the merged export


@torch.no_grad()
def init_lora_gpt(model: GPT, seed: int, layers: int, adapted: list) -> None:
    """Every base weight to its value in the plain GPT (init_gpt by the plain GPT's names, so the
    base is the model lesson 02 trains), A ~ N(0, 0.02^2) drawn by name like every GPT weight,
    B = 0. Works on DTensors: each rank fills its own rows."""
    init_gpt(model, seed, layers)  # everything, the adapted bases under their LoRA names
    for name in adapted:
        lora = model.get_submodule(name)
        init_gpt(lora.base, seed, layers, prefix=f"{name}.")  # blocks.0.attn.q.weight, ...
        lora.lora_b.zero_()


def merge_lora(state_dict: dict, scale: float) -> dict:
    """The plain GPT state dict of a trained LoRA model: W + scale * B A for every adapted layer
    (one matrix again, no adapter at inference), every other tensor as it is."""
    merged = {}
    for key, value in state_dict.items():
        if ".lora_" in key:
            continue
        if ".base." in key:
            layer, _, leaf = key.rpartition(".base.")
            if leaf == "weight":
                a, b = state_dict[f"{layer}.lora_a"], state_dict[f"{layer}.lora_b"]
                value = value + scale * (b @ a)  # (out, r) @ (r, in) = (out, in)
            key = f"{layer}.{leaf}"
        merged[key] = value
    return merged


# --------------------------------------------------------------------------------------------------
# Train and measure


def train(args, method: str, d):
    """Returns (metrics, full state dict on rank 0)."""
    report.reset_peak(d.device)  # the previous method's model freed: this one's own peak
    model, optimizer, adapted = build(args, method, d)
    n_total = sum(p.numel() for p in model.parameters())  # global shapes of the DTensors
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if method == "lora":
        report.print0(f"lora: rank {args.rank}, alpha {args.alpha:g} (scale "
                      f"{args.alpha / args.rank:g}) on {' '.join(args.targets)} of every block: "
                      f"{len(adapted)} projections, {n_train:,} trainable parameters (T) of "
                      f"{n_total:,}, {n_train / n_total:.1%}; the base frozen "
                      f"(requires_grad=False), each block one FSDP unit of both")
    else:
        report.print0(f"full: every parameter trainable, {n_train:,} (T = P)")
    global_bs = d.world_size * args.batch_size
    rows = rank_rows(d.rank, args.batch_size)
    losses = []
    # Timed: steps 2 to S-1 of S. Step 1 pays for lazy initialisation; step S is counted
    # (CollectiveCounter runs Python after every operation), so it is not timed.
    timed, t_start, elapsed = list(range(2, args.steps)), None, None
    for step in range(args.steps):
        if timed and step == 1:  # start the clock before step 2
            t_start = timing.clock(d.device)
        if timed and step == args.steps - 1:  # ... and stop it before step S, the counted one
            elapsed = timing.clock(d.device) - t_start
        x_all, y_all = token_batch(args.seed, step, global_bs, args.seq_len, args.vocab)
        x, y = x_all[rows].to(d.device), y_all[rows].to(d.device)
        comm = CollectiveCounter() if step == args.steps - 1 else contextlib.nullcontext()
        with comm:
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())  # logits (B, T, vocab)
            loss.backward()  # all-gather every unit again; reduce-scatter trainable grads only
        optimizer.step()
        if step < args.steps - 1:  # the last step's gradients stay, for the report
            optimizer.zero_grad(set_to_none=True)
        step_loss = loss.detach()
        dist.all_reduce(step_loss)  # sum of the ranks' means -> mean over the global batch
        losses.append(step_loss.item() / d.world_size)
        done = step + 1
        if done % args.log_every == 0 or done in (1, args.steps):
            report.print0(f"step {done:4d}/{args.steps} | loss {losses[-1]:.4f}")
    per_rank = report.gather(report.held_bytes(params=model.parameters(), optimizer=optimizer,
                                               device=d.device))
    full_sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                   cpu_offload=True))
    comms = comm.summary()
    metrics = report.metrics(
        d, script=SCRIPT, strategy=method, steps=args.steps, global_batch=global_bs,
        losses=losses, samples_per_s=len(timed) * global_bs / elapsed if timed else None,
        tokens_per_s=len(timed) * global_bs * args.seq_len / elapsed if timed else None,
        timed_steps=timed, counted_step=args.steps, per_rank=per_rank, method=method,
        params=n_total, trainable=n_train, adapted=adapted, rank=args.rank, alpha=args.alpha,
        trainable_tensors=len(optimizer.param_groups[0]["params"]), comms_per_step=comms)
    if d.is_main and method == "lora":
        unchanged = base_unchanged(full_sd, args)
        print(f"frozen base after {args.steps} steps: {unchanged} of {count_base(full_sd)} "
              f"tensors bitwise equal to their initial values", flush=True)
    return metrics, full_sd


def count_base(state_dict: dict) -> int:
    return sum(".lora_" not in k for k in state_dict)


def base_unchanged(state_dict: dict, args) -> int:
    """How many frozen tensors equal, bit for bit, what init_gpt gave them."""
    return sum(torch.equal(v, gpt_init_value(k.replace(".base.", "."), v.shape, args.seed,
                                             args.layers))
               for k, v in state_dict.items() if ".lora_" not in k)


# --------------------------------------------------------------------------------------------------
# Report and export


def write_results(args, d, results) -> None:
    """A side-by-side table of what rank 0 holds and what one step sends; the exports."""
    report.print0(f"\n{'method':6} {'trainable':>9} {'loss':>7} {'params B':>9} {'grads B':>9} "
                  f"{'optim B':>9} {'total B':>9} {'all-gather B':>12} {'reduce-scatter B':>16}"
                  f"  (rank 0; collectives: one step, whole tensors)")
    for metrics, _ in results:
        held, comms = metrics["per_rank"][0], metrics["comms_per_step"]
        total = held["param_bytes"] + held["grad_bytes"] + held["optim_bytes"]
        report.print0(f"{metrics['method']:6} {metrics['trainable']:9,} "
                      f"{metrics['losses'][-1]:7.4f} {held['param_bytes']:9,} "
                      f"{held['grad_bytes']:9,} {held['optim_bytes']:9,} {total:9,} "
                      f"{comms.get('all_gather', {}).get('tensor_bytes', 0):12,} "
                      f"{comms.get('reduce_scatter', {}).get('tensor_bytes', 0):16,}")
    for metrics, _ in results:
        n, t, k = d.world_size, metrics["trainable"], metrics["trainable_tensors"]
        grads = sum(h["grad_bytes"] for h in metrics["per_rank"])
        optim = sum(h["optim_bytes"] for h in metrics["per_rank"])
        report.print0(f"{metrics['method']}: grads over all ranks {grads:,} B = 4T = {4 * t:,} B; "
                      f"AdamW state over all ranks {optim:,} B = 8T + {n} ranks x {k} step "
                      f"counters x 4 B = {8 * t + 4 * k * n:,} B")
    several = len(results) > 1
    if d.is_main:
        for metrics, full_sd in results:
            tag = metrics["method"]
            if args.export:  # the model as trained (lora: frozen base + adapters)
                report.save_state_dict(report.variant_path(args.export, tag, several), full_sd)
            if tag == "lora" and args.export_merged:
                report.save_state_dict(args.export_merged,
                                       merge_lora(full_sd, args.alpha / args.rank))
            if tag == "lora" and args.export_adapters:
                report.save_state_dict(args.export_adapters,
                                       {k: v for k, v in full_sd.items() if ".lora_" in k})
        if args.metrics_out:
            report.write_json(args.metrics_out, {
                "script": SCRIPT, "runs": {m["method"]: m for m, _ in results}}
                if several else results[0][0])
    dist.barrier()


# --------------------------------------------------------------------------------------------------
# Arguments and launch


def parse_args(argv=None):
    p = cli.parser(__doc__)
    cli.add_run_args(p)
    cli.add_train_args(p, steps=8, batch_size=8, lr=3e-3, grad_accum=False,
                       batch_help="sequences per rank")
    cli.add_output_args(p, export=False)
    p.add_argument("--method", nargs="+", choices=["lora", "full"], default=["lora", "full"],
                   help="lora: adapters on a frozen base; full: every parameter trained; both: "
                        "one after the other, then a table")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank r")
    p.add_argument("--alpha", type=float, default=16.0, help="LoRA alpha: the update is scaled "
                                                             "by alpha / r")
    p.add_argument("--targets", nargs="+", choices=TARGETS, default=list(TARGETS),
                   help="the projections of each block that get an adapter")
    cli.add_gpt_args(p)
    p.add_argument("--log-every", type=int, default=4)
    p.add_argument("--export", type=Path,
                   help="rank 0 writes the trained model's state_dict here: lora the base and "
                        "its adapters (keys ...q.base.weight, ...q.lora_a, ...q.lora_b; loads "
                        "into a GPT after add_lora), full a plain GPT (both methods: "
                        "w.pt -> w.lora.pt, w.full.pt)")
    p.add_argument("--export-merged", type=Path,
                   help="lora: rank 0 writes W + (alpha/r) B A, a plain GPT state_dict, here")
    p.add_argument("--export-adapters", type=Path,
                   help="lora: rank 0 writes the adapters alone (every lora_a and lora_b) here")
    args = p.parse_args(argv)
    cli.check_gpt_args(args)
    cli.check_positive(args, "steps", "batch_size", "lr", "rank", "alpha", "log_every",
                       "timeout_s")
    if len(set(args.method)) != len(args.method):
        cli.fail(f"--method lists a method twice: {' '.join(args.method)}")
    if (args.export_merged or args.export_adapters) and "lora" not in args.method:
        cli.fail("--export-merged and --export-adapters need --method lora")
    if args.rank > args.dim:
        cli.fail(f"--rank {args.rank} is larger than --dim {args.dim}: a low-rank update has "
                 f"rank at most the layer's smaller side")
    return args


def main(argv=None):
    args = parse_args(argv)
    with launch.distributed(args.device, args.timeout_s) as d:
        report.print0(f"GPT: {args.layers} layers, dim {args.dim}, {args.heads} heads, seq "
                      f"{args.seq_len}, vocab {args.vocab} | world {d.world_size} | device "
                      f"{d.device} | global batch {d.world_size * args.batch_size} sequences "
                      f"({d.world_size} ranks x {args.batch_size})")
        write_results(args, d, [train(args, method, d)
                                for method in args.method])


if __name__ == "__main__":
    main()

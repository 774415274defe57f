"""A GPT trained fully sharded with FSDP2 (`fully_shard`): sharding strategies, bf16 mixed
precision, activation checkpointing, CPU offload, and plain DDP on the same model.

Launch (from the repository root):
    python 02-fsdp/fsdp_transformer.py                                     # 1 process
    torchrun --nproc_per_node=2 02-fsdp/fsdp_transformer.py                # full sharding
    torchrun --nproc_per_node=2 02-fsdp/fsdp_transformer.py --strategy grad-op
    torchrun --nproc_per_node=4 02-fsdp/fsdp_transformer.py --strategy hybrid --shard-size 2
    torchrun --nproc_per_node=2 02-fsdp/fsdp_transformer.py --strategy ddp  # the same model, DDP
    torchrun --nproc_per_node=2 02-fsdp/fsdp_transformer.py --strategy full grad-op no-shard ddp
        # ^ one after the other (fresh model each), then a table side by side
    torchrun --nproc_per_node=8 02-fsdp/fsdp_transformer.py --device cuda --mixed-precision bf16 \
        --layers 24 --dim 1024 --heads 16 --seq-len 1024 --vocab 50304 --batch-size 8

What happens in one step (fully_shard on each block and at the root):
    forward:  before each block, all-gather its parameter shards into full tensors (FSDP unit =
              one block); after the block, free them again (reshard_after_forward=True);
    backward: all-gather each block's parameters again (in reverse order), compute its gradients,
              then reduce-scatter them: every rank receives the average of its own shard only;
    step:     the optimizer updates the local shards: Adam state exists for 1/N of the model.

The model is the course's GPT (dtcourse.models: GPT, init_gpt), trained on dtcourse.data's
token_batch: the same model and data as lessons 03 and 05, so their runs compare with these.
"""

import contextlib
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from dtcourse import cli, launch, report, timing
from dtcourse.comm import CollectiveCounter
from dtcourse.data import rank_rows, token_batch
from dtcourse.models import GPT, init_gpt
from dtcourse.profiling import nvtx_range

try:  # public since torch 2.6; the same objects lived in torch.distributed._composable.fsdp before
    from torch.distributed.fsdp import (CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy,
                                        fully_shard)
except ImportError:
    from torch.distributed._composable.fsdp import (CPUOffloadPolicy, FSDPModule,
                                                    MixedPrecisionPolicy, fully_shard)

SCRIPT = "02-fsdp/fsdp_transformer.py"


# --------------------------------------------------------------------------------------------------
# The mechanism: one FSDP unit per block, the mixed-precision policy, one step


def shard_model(model: GPT, strategy: str, mesh, args, device) -> None:
    """fully_shard every block, then the root (embeddings, final norm, head become its unit).

    Why per block: FSDP gathers a unit when it is needed and frees it after, so peak memory holds
    the shards plus a few units' full parameters (the root, the block computing, the next one
    prefetched); wrapping only the root would gather the whole model at once.
    Children first: a parameter belongs to the innermost fully_shard'ed module that owns it.
    The root (embeddings, final norm, head) stays unsharded after forward, as torch recommends
    and as FSDP2's default (None) and FSDP1's FULL_SHARD both do: backward needs the head first,
    so resharding it would only buy an immediate second all-gather.
    """
    # reshard_after_forward: True frees a block's gathered parameters after its forward and
    # gathers them again in backward; False keeps them (grad-op). The table is STRATEGIES below.
    kw = {"mesh": mesh, "reshard_after_forward": STRATEGIES[strategy][1]}
    if args.mixed_precision == "bf16":
        # all-gather and compute in bf16; gradients reduced (and kept) in fp32
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                               reduce_dtype=torch.float32)
    if args.cpu_offload:
        # shards, grads and the optimizer step live in CPU memory; pinned memory needs CUDA.
        # clip_grad_norm_ then all-reduces on the CPU: on GPUs, gloo beside NCCL (see main)
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    for block in model.blocks:
        fully_shard(block, **kw)
    fully_shard(model, **{**kw, "reshard_after_forward": False})


def build(args, strategy: str, d):
    """A fresh GPT under `strategy`, the same initial weights for every strategy and world size;
    returns (model, mesh or None, optimizer)."""
    # Build on the meta device: shapes only, no memory. A model too big for one device never
    # exists in full anywhere; each rank allocates its shards after fully_shard.
    with torch.device("meta"):
        model = GPT(args.vocab, args.seq_len, args.dim, args.heads, args.layers)
    model.activation_checkpointing = args.activation_checkpointing
    mesh = build_mesh(strategy, args.shard_size, d)
    if mesh is not None:
        shard_model(model, strategy, mesh, args, d.device)
    # Materialise: allocate (sharded) storage, then fill it: init_gpt draws each full tensor from
    # a generator seeded by (seed, name) and copies the rows this rank's shard holds. With CPU
    # offload the shards live on the CPU and FSDP copies them to the GPU for each all-gather.
    model.to_empty(device="cpu" if args.cpu_offload else d.device)
    init_gpt(model, args.seed)
    if mesh is None:  # DDP: every rank holds the whole model; gradients all-reduced in buckets
        # gradient_as_bucket_view: .grad are views into DDP's all-reduce buckets, so DDP holds
        # the 16 bytes per parameter of the formulas, not 20 (see 01-ddp-basics/README.md).
        # DDP's own (C++) all-reduce, no comm hook: CollectiveCounter sees it at the dispatcher.
        model = DDP(model, device_ids=[d.device.index] if d.device.type == "cuda" else None,
                    gradient_as_bucket_view=True)
    else:  # what fully_shard did: every parameter is now a DTensor holding this rank's rows
        p = next(iter(model.parameters()))
        assert isinstance(p, DTensor) and p.placements[-1].is_shard(), p
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    return model, mesh, optimizer


def train_step(args, d, model, mesh, optimizer, x_local, y_local, comm, between=None):
    """One optimizer step over this rank's rows, in grad_accum micro-steps, with the collectives
    of forward and backward recorded by `comm`; `between()`, if given, runs after each backward
    but the last. Returns (this rank's mean loss, the global gradient norm before clipping)."""
    autocast = mesh is None and args.mixed_precision == "bf16"  # FSDP casts by its own policy
    optimizer.zero_grad(set_to_none=True)  # here, so the grads still exist for the report
    step_loss = torch.zeros((), device=d.device)
    with comm:
        for micro in range(args.grad_accum):
            last = micro == args.grad_accum - 1
            if mesh is not None:
                # FSDP's no_sync(): keep unsharded grads, reduce-scatter on the last only
                model.set_requires_gradient_sync(last)
                sync = contextlib.nullcontext()
            else:
                sync = contextlib.nullcontext() if last else model.no_sync()
            mb = slice(micro * args.batch_size, (micro + 1) * args.batch_size)
            with sync, torch.autocast(d.device.type, dtype=torch.bfloat16, enabled=autocast):
                with nvtx_range("forward"):  # FSDP: each block's all-gather
                    logits = model(x_local[mb])  # (B, T, vocab)
                    loss = F.cross_entropy(logits.float().flatten(0, 1), y_local[mb].flatten())
                with nvtx_range("backward"):  # FSDP: all-gathers, reduce-scatters; DDP: buckets
                    (loss / args.grad_accum).backward()
            step_loss += loss.detach().float() / args.grad_accum
            if between is not None and not last:
                between()
    # The global gradient norm: on DTensor grads the local sums of squares are all-reduced over
    # the shard group, so every rank clips by the same factor as one process would.
    with nvtx_range("clip_grad_norm"):
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
    with nvtx_range("optimizer"):
        optimizer.step()
    return step_loss, (norm.full_tensor() if isinstance(norm, DTensor) else norm).item()


# --------------------------------------------------------------------------------------------------
# The strategies: what each rank keeps, and the mesh each one shards over


# --strategy -> (FSDP1 ShardingStrategy it reproduces, reshard_after_forward, what each rank keeps)
STRATEGIES = {
    "full": ("FULL_SHARD", True, "params, grads and optimizer state sharded over all ranks"),
    "grad-op": ("SHARD_GRAD_OP", False, "as full, but params stay gathered from forward to "
                                        "backward (ZeRO-2-like: fewer all-gathers, more memory)"),
    "no-shard": ("NO_SHARD", True, "a 2-D mesh (world, 1): shard groups of one rank, so every "
                                   "rank keeps everything and gradients are all-reduced (DDP)"),
    "hybrid": ("HYBRID_SHARD", True, "a 2-D mesh (world/S, S): shard inside groups of S ranks "
                                     "(a node), replicate across groups (all-reduce)"),
    "ddp": ("-", None, "torch DistributedDataParallel on the same model, for comparison"),
}


def build_mesh(strategy: str, shard_size: int, d):
    """The device mesh of the strategy; None for DDP."""
    if strategy == "ddp":
        return None
    if strategy in ("full", "grad-op"):
        return init_device_mesh(d.device.type, (d.world_size,), mesh_dim_names=("shard",))
    shard = 1 if strategy == "no-shard" else shard_size
    return init_device_mesh(d.device.type, (d.world_size // shard, shard),
                            mesh_dim_names=("replicate", "shard"))


# --------------------------------------------------------------------------------------------------
# The loop


def train(args, strategy: str, d):
    """Train a fresh model with one strategy; return (metrics, full state dict on rank 0)."""
    report.reset_peak(d.device)  # the previous strategy's model freed: this one's own peak
    model, mesh, optimizer = build(args, strategy, d)
    global_bs = d.world_size * args.batch_size * args.grad_accum  # every rank is data-parallel
    print_header(args, strategy, d, mesh, sum(p.numel() for p in model.parameters()), global_bs)
    rows = rank_rows(d.rank, args.batch_size * args.grad_accum)
    losses, grad_norms, accum_grads = [], [], []
    # Timed: steps 2 to S-1 of S. Step 1 pays for lazy initialisation and warm-up; step S is
    # counted (CollectiveCounter runs Python after every operation), so it is not timed.
    timed, t_start, elapsed = list(range(2, args.steps)), None, None
    bar = report.progress(args.steps, strategy)
    for step in range(args.steps):
        if timed and step == 1:  # start the clock before step 2
            t_start = timing.clock(d.device)
        if timed and step == args.steps - 1:  # ... and stop it before step S, the counted one
            elapsed = timing.clock(d.device) - t_start
        x_all, y_all = token_batch(args.seed, step, global_bs, args.seq_len, args.vocab)
        # Count the collectives of the last step (a complete, steady-state step).
        comm = CollectiveCounter() if step == args.steps - 1 else contextlib.nullcontext()
        # ... and, for --metrics-out, the gradient bytes held between its micro-steps
        between = (lambda: accum_grads.append(accumulating_grad_bytes(model))) \
            if step == args.steps - 1 and args.metrics_out else None
        with nvtx_range(f"step {step + 1}"):  # nsys --capture-range=nvtx --nvtx-capture="step N"
            step_loss, norm = train_step(args, d, model, mesh, optimizer,
                                         x_all[rows].to(d.device), y_all[rows].to(d.device), comm,
                                         between)
        with nvtx_range("all_reduce: loss"):
            dist.all_reduce(step_loss)  # sum of the ranks' means -> mean over the global batch
        losses.append(step_loss.item() / d.world_size)
        grad_norms.append(norm)
        bar.update(1)
        done = step + 1
        if d.is_main and (done % args.log_every == 0 or done in (1, args.steps)):
            bar.write(f"step {done:4d}/{args.steps} | loss {losses[-1]:.4f} | grad norm "
                      f"{grad_norms[-1]:.3f}")
    bar.close()
    tokens_per_s = len(timed) * global_bs * args.seq_len / elapsed if timed else None
    return report_run(args, strategy, d, model, mesh, optimizer, losses, grad_norms,
                      comm.summary(), tokens_per_s, timed,
                      None if None in accum_grads else max(accum_grads, default=None))


def accumulating_grad_bytes(model) -> int | None:
    """Gradient bytes this rank holds between two micro-steps of one optimizer step.

    DDP under no_sync(): its full .grad (the buckets). FSDP2 under
    set_requires_gradient_sync(False): each unit's full, unsharded gradient, kept on the
    unsharded parameter (or, with a reduce dtype, in `unsharded_accumulated_grad`) until the last
    micro-step reduce-scatters it. FSDP2's attributes are private (torch 2.14's names): if a
    torch renames them, this measures nothing (None) rather than stop the job."""
    if not isinstance(model, FSDPModule):
        return report.tensor_bytes(p.grad for p in model.parameters())
    held = []
    try:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                group = module._get_fsdp_state()._fsdp_param_group
                for fsdp_param in group.fsdp_params if group else []:
                    held.append(getattr(fsdp_param, "unsharded_accumulated_grad", None))
                    unsharded = getattr(fsdp_param, "_unsharded_param", None)
                    held.append(None if unsharded is None else unsharded.grad)
    except AttributeError:
        return None
    return report.tensor_bytes(held)


# --------------------------------------------------------------------------------------------------
# The report: what each rank holds, what one step sent, throughput


# Dense bf16 tensor-core peaks (TFLOP/s) from NVIDIA's data sheets; the first name that matches
# torch.cuda.get_device_name() wins (the NVL parts, at lower clocks, before the plain names).
# Anything else: pass --peak-tflops.
PEAK_BF16_TFLOPS = [("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H200 NVL", 835.0),
                    ("H100", 989.0), ("H200", 989.0), ("A100", 312.0)]


def print_header(args, strategy: str, d, mesh, n_params: int, global_bs: int) -> None:
    report.print0(f"GPT: {args.layers} layers, dim {args.dim}, {args.heads} heads, seq "
                  f"{args.seq_len}, vocab {args.vocab}: {n_params:,} parameters (P)")
    layout = "no sharding" if mesh is None else (
        f"mesh {tuple(mesh.shape)} {mesh.mesh_dim_names}, reshard_after_forward="
        f"{STRATEGIES[strategy][1]} (root: False)")
    name = "torch DDP" if strategy == "ddp" else f"FSDP1 {STRATEGIES[strategy][0]}"
    report.print0(f"strategy {strategy} = {name}: {layout} | world {d.world_size} | device "
                  f"{d.device} | {args.mixed_precision}"
                  f"{' + act. ckpt' * args.activation_checkpointing}"
                  f"{' + cpu offload' * args.cpu_offload} | global batch {global_bs} sequences "
                  f"({d.world_size} ranks x {args.batch_size} x accum {args.grad_accum}) = "
                  f"{global_bs * args.seq_len} tokens")


def report_run(args, strategy: str, d, model, mesh, optimizer, losses, grad_norms, comms,
               tokens_per_s, timed, accum_grad_bytes):
    """Print rank 0's view of the run and return (metrics, full state dict on rank 0)."""
    n_params = sum(p.numel() for p in model.parameters())  # a DTensor counts its global shape
    # Model state each rank holds right after the last step (grads not yet zeroed). Adam's
    # `step` is a 4-byte scalar per parameter tensor that every rank keeps whole.
    # With --grad-accum above 1, also the gradient bytes held between micro-steps.
    per_rank = report.gather({**report.held_bytes(params=model.parameters(), optimizer=optimizer,
                                                  device=d.device),
                              "accum_grad_bytes": accum_grad_bytes})
    # Export: gather the full, unsharded state dict to rank 0's CPU (a collective: every rank).
    full_sd = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)) \
        if args.export else None
    mfu = model_flops_utilization(args, n_params, tokens_per_s, d)
    held, group = per_rank[0], 1 if mesh is None else mesh.size(mesh.ndim - 1)
    report.print0("one step's collectives (rank 0; MB = whole tensors, sent = this rank's ring "
                  "share): " + (" | ".join(
                      f"{kind} {s['calls']} call{'s' * (s['calls'] != 1)} "
                      f"{s['tensor_bytes'] / 1e6:.2f} MB {'/'.join(s['dtypes'])} (sent "
                      f"{s['sent_bytes'] / 1e6:.2f} MB)" for kind, s in comms.items())
                      or "none (a group of one rank skips them)"))
    if timed:
        span = f"step {timed[0]}" if len(timed) == 1 else f"steps {timed[0]}-{timed[-1]}"
        speed = f"{span} timed, {tokens_per_s:,.0f} tokens/s" + \
            ("" if mfu is None else f", MFU {mfu:.1%}")
    else:
        speed = "no step timed (step 1 warms up and the last is counted: time with --steps 3 or more)"
    report.print0(f"done: {speed} | rank 0 holds params "
                  f"{held['param_bytes']:,} B, grads {held['grad_bytes']:,} B, optimizer "
                  f"{held['optim_bytes']:,} B (16P/{group} = {16 * n_params // group:,} B + "
                  f"{'' if mesh is None else 'padding + '}Adam step counters)")  # DDP: no shards
    global_bs = d.world_size * args.batch_size * args.grad_accum
    metrics = report.metrics(
        d, script=SCRIPT, strategy=strategy, steps=args.steps, global_batch=global_bs,
        losses=losses, per_rank=per_rank,
        samples_per_s=None if tokens_per_s is None else tokens_per_s / args.seq_len,
        tokens_per_s=tokens_per_s, mfu=mfu, timed_steps=timed, counted_step=args.steps,
        grad_norms=grad_norms, comms_per_step=comms,
        # DDP: the comm hook its logging data records (None: DDP's built-in all-reduce)
        comm_hook=None if mesh is not None else model._get_ddp_logging_data().get("comm_hook"),
        fsdp1_name=STRATEGIES[strategy][0], mesh=None if mesh is None else list(mesh.shape),
        grad_accum=args.grad_accum, seq_len=args.seq_len, params=n_params,
        param_tensors=len(list(model.parameters())), mixed_precision=args.mixed_precision,
        activation_checkpointing=args.activation_checkpointing, cpu_offload=args.cpu_offload)
    return metrics, full_sd


def model_flops_utilization(args, n_params: int, tokens_per_s: float, d):
    """MFU = achieved FLOP/s / peak. FLOPs per token = 6N + 12*L*H*Q*T (PaLM, Chowdhery et al.
    2022, appendix B), N = parameters that multiply (the embedding look-ups do not), H*Q = dim,
    T = seq_len."""
    if d.device.type != "cuda" or tokens_per_s is None:
        return None
    name = torch.cuda.get_device_name(d.device)
    peak = args.peak_tflops or (next((v for k, v in PEAK_BF16_TFLOPS if k in name), None)
                                if args.mixed_precision == "bf16" else None)
    if peak is None:
        return None  # unknown device, or fp32 without --peak-tflops
    n_matmul = n_params - (args.vocab + args.seq_len) * args.dim
    flops_per_token = 6 * n_matmul + 12 * args.layers * args.dim * args.seq_len
    return tokens_per_s * flops_per_token / (d.world_size * peak * 1e12)


def write_results(args, d, results) -> None:
    """Rank 0: with several strategies a side-by-side table, one export each and one metrics file
    holding every run; then every rank waits until the files are complete."""
    if len(results) == 1:
        return report.finish(args, *results[0])
    # tokens/s carries a leading `~`: it depends on the machine's speed, the other columns do not
    report.print0(f"\n{'strategy':9} {'loss':>7} {'tokens/s':>9} {'params B':>10} "
                  f"{'grads B':>10} {'optim B':>10}  collectives per step (whole-tensor bytes; "
                  f"bytes held by rank 0; ~: depends on the machine's speed)")
    for metrics, _ in results:
        held = metrics["per_rank"][0]
        comms = ", ".join(f"{kind} {s['tensor_bytes']:,}"
                          for kind, s in metrics["comms_per_step"].items())
        speed = "-" if metrics["tokens_per_s"] is None else f"~{metrics['tokens_per_s']:,.0f}"
        report.print0(f"{metrics['strategy']:9} {metrics['losses'][-1]:7.4f} "
                      f"{speed:>9} {held['param_bytes']:10,} "
                      f"{held['grad_bytes']:10,} {held['optim_bytes']:10,}  {comms or '-'}")
    if d.is_main:
        for metrics, full_sd in results:
            if args.export:  # w.pt -> w.full.pt, w.ddp.pt, ...
                report.save_state_dict(
                    report.variant_path(args.export, metrics["strategy"], several=True), full_sd)
        if args.metrics_out:
            report.write_json(args.metrics_out, {"script": SCRIPT,
                                                 "runs": {m["strategy"]: m for m, _ in results}})
    dist.barrier()


# --------------------------------------------------------------------------------------------------
# Arguments and launch


def parse_args(argv=None):
    p = cli.parser(__doc__)
    cli.add_run_args(p)
    cli.add_train_args(p, steps=12, batch_size=8, lr=3e-3,
                       batch_help="sequences per rank per micro-step")
    cli.add_output_args(p, export=False)
    p.add_argument("--export", type=Path,
                   help="rank 0 writes the plain model state_dict here (several strategies: "
                        "one file each, the strategy before the suffix: w.pt -> w.ddp.pt)")
    p.add_argument("--strategy", nargs="+", choices=list(STRATEGIES), default=["full"],
                   help="one or more: several train one after the other in the same launch "
                        "(fresh model each) and end with a comparison table")
    p.add_argument("--shard-size", type=int, default=None,
                   help="hybrid: ranks per shard group (default: ranks per node)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--grad-clip", type=float, default=1.0, help="max global gradient L2 norm")
    p.add_argument("--mixed-precision", choices=["fp32", "bf16"], default="fp32",
                   help="bf16: compute in bf16 (FSDP: MixedPrecisionPolicy, bf16 params, fp32 "
                        "reduce; DDP: autocast); master weights and Adam stay fp32")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="keep only each block's input; recompute the block in backward")
    p.add_argument("--cpu-offload", action="store_true",
                   help="FSDP: keep sharded params, grads and Adam state in CPU memory")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="device peak for MFU (default: bf16 peaks of known GPUs)")
    p.add_argument("--log-every", type=int, default=4)
    args = p.parse_args(argv)
    cli.check_positive(args, "layers", "dim", "heads", "seq_len", "vocab", "steps",
                       "batch_size", "grad_accum", "log_every", "lr", "grad_clip", "timeout_s")
    if args.dim % args.heads:
        cli.fail(f"--heads {args.heads} must divide --dim {args.dim}: each head takes dim/heads "
                 f"features ({args.dim}/{args.heads} is not a whole number)")
    if "ddp" in args.strategy and args.cpu_offload:
        cli.fail("--cpu-offload is an FSDP feature: use it with --strategy full, grad-op, "
                 "no-shard or hybrid, not ddp")
    if args.shard_size is not None and "hybrid" not in args.strategy:
        cli.fail(f"--shard-size applies to --strategy hybrid only, not "
                 f"{' '.join(args.strategy)}")
    if len(set(args.strategy)) != len(args.strategy):
        cli.fail(f"--strategy lists a strategy twice: {' '.join(args.strategy)}")
    return args


def check_shard_size(args, d) -> None:
    """hybrid: the mesh (replicas, shard) needs shard-size to divide the world size."""
    if "hybrid" not in args.strategy:
        return
    if args.shard_size is None:
        args.shard_size = d.local_world_size or d.world_size
    if args.shard_size < 1 or d.world_size % args.shard_size:
        cli.fail(f"--strategy hybrid needs the world size ({d.world_size}) to be a multiple of "
                 f"the shard group size --shard-size ({args.shard_size}): the mesh is "
                 f"(replicas, shard) = (world / shard-size, shard-size)")


def main(argv=None):
    args = parse_args(argv)
    # CPU offload keeps gradient shards on the CPU: on GPUs the group needs gloo beside NCCL
    with launch.distributed(args.device, args.timeout_s, cpu_collectives=args.cpu_offload) as d:
        check_shard_size(args, d)
        write_results(args, d, [train(args, strategy, d) for strategy in args.strategy])


if __name__ == "__main__":
    main()

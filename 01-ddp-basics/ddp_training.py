"""DDP production template: mixed precision, gradient accumulation, LR scaling with warmup,
checkpoints with automatic resume, preemption (SIGTERM) handling, export and metrics.

Launch (from the repository root):
    python 01-ddp-basics/ddp_training.py                                  # 1 process
    torchrun --nproc_per_node=2 01-ddp-basics/ddp_training.py             # 2 ranks, one node
    torchrun --nproc_per_node=2 01-ddp-basics/ddp_training.py --grad-accum 2 --ckpt-dir runs/ddp
    python 01-ddp-basics/ddp_training.py --spawn 2                        # mp.spawn, no torchrun
    srun -N 1 -n 8 --gpus-per-node=8 --cpus-per-task=8 python 01-ddp-basics/ddp_training.py  # SLURM
    torchrun --nproc_per_node=8 01-ddp-basics/ddp_training.py --device cuda --precision bf16

What DDP does each optimizer step (and where this file does it):
    forward on the local batch -> loss / grad_accum -> backward: as each bucket of gradients is
    ready, DDP all-reduces (averages) it across the ranks while backward continues; on the
    accumulation micro-steps before the last, `no_sync()` skips that all-reduce and gradients just
    add up locally -> optimizer.step() on identical averaged gradients keeps every replica equal.

From here on the set-up written out in ddp_mnist.py (launcher variables, device, backend, process
group) comes from the course's shared module, dtcourse.launch.
"""

import contextlib
import os
import random
import re
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from dtcourse import cli, comm, launch, report, timing
from dtcourse.data import classification_batch, rank_rows
from dtcourse.models import MLP
from dtcourse.profiling import nvtx_range

SCRIPT = "01-ddp-basics/ddp_training.py"


# --------------------------------------------------------------------------------------------------
# The model under DDP, its optimizer, and one optimizer step

AUTOCAST = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def build(args, d):
    """The model wrapped in DDP, AdamW at the scaled LR, its warmup schedule, the fp16 scaler."""
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    model = MLP(args.hidden).to(d.device)
    # DDP broadcasts rank 0's weights at construction, so all replicas start equal; in backward
    # it averages the gradients across the ranks in flat buckets with its own (C++) all-reduce.
    # gradient_as_bucket_view: each .grad becomes a view into its bucket (see train_step).
    ddp = DDP(model, device_ids=[d.device.index] if d.device.type == "cuda" else None,
              gradient_as_bucket_view=True)
    # Linear scaling rule (Goyal et al. 2017, derived for SGD): LR grows with the global batch;
    # warmup avoids the early instability that a large LR causes on random weights.
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=peak_lr(args), weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_at(s, 1.0, args.warmup_steps))
    # fp16 gradients can underflow: scale the loss up, unscale before the step (bf16 needs none).
    scaler = torch.amp.GradScaler(d.device.type, enabled=args.precision == "fp16")
    return model, ddp, optimizer, scheduler, scaler


def train_step(args, d, ddp, optimizer, scheduler, scaler, step: int) -> torch.Tensor:
    """One optimizer step over this rank's rows of step `step`'s global batch, in `grad_accum`
    micro-steps; returns this rank's mean loss."""
    x_all, y_all = classification_batch(args.seed, step, args.global_batch)
    # This rank's rows: r*B*A .. (r+1)*B*A - 1, cut into grad_accum micro-batches of B.
    rows = rank_rows(d.rank, args.batch_size * args.grad_accum)
    x_local, y_local = x_all[rows].to(d.device), y_all[rows].to(d.device)
    dtype = AUTOCAST[args.precision]

    step_loss = torch.zeros((), device=d.device)
    for micro in range(args.grad_accum):
        x = x_local[micro * args.batch_size:(micro + 1) * args.batch_size]
        y = y_local[micro * args.batch_size:(micro + 1) * args.batch_size]
        last = micro == args.grad_accum - 1
        # no_sync(): no all-reduce on this backward; gradients accumulate locally in .grad
        # and are averaged once, with the last micro-step's all-reduce.
        with contextlib.nullcontext() if last else ddp.no_sync():
            # Mixed precision: only the forward and the loss run under autocast.
            with nvtx_range("forward"), torch.autocast(d.device.type, dtype=dtype,
                                                       enabled=dtype is not None):
                loss = F.cross_entropy(ddp(x), y)
            # Divide by the micro-steps: the accumulated gradient is then the gradient of the
            # mean loss over all of this rank's samples, not grad_accum times it. DDP launches
            # each bucket's all-reduce from inside backward, as the bucket's gradients are ready.
            with nvtx_range("backward"):
                scaler.scale(loss / args.grad_accum).backward()
        step_loss += loss.detach().float() / args.grad_accum

    with nvtx_range("optimizer"):
        scaler.step(optimizer)  # unscales first when fp16; a plain optimizer.step() otherwise
        scaler.update()
        # set_to_none=False zeroes each .grad in place, so it stays a view into its DDP bucket
        # and the next backward accumulates into the bucket itself. With set_to_none=True
        # autograd allocates a fresh .grad every step, which DDP copies into the bucket in the
        # synced backward before pointing .grad back at it: an allocation and a copy per
        # parameter per step, and 4 more bytes per parameter through no_sync() micro-steps.
        optimizer.zero_grad(set_to_none=False)
        scheduler.step()
    return step_loss


def peak_lr(args) -> float:
    """The LR after warmup: --lr, given for --base-batch samples, times global batch / base."""
    return args.lr * args.global_batch / args.base_batch


def lr_at(step: int, peak: float, warmup: int) -> float:
    """Linear warmup to the scaled LR over `warmup` steps, then constant."""
    return peak * min(1.0, (step + 1) / warmup) if warmup else peak


# --------------------------------------------------------------------------------------------------
# Checkpoints: rank 0 writes to a temporary name and renames, so a kill never leaves half a file


def checkpoints(ckpt_dir: Path) -> list[Path]:
    """The step_N.pt files, oldest first, by step number (as names, step_1000000.pt would sort
    before step_999999.pt). Other files, step_10.old.pt say, are not checkpoints of this run."""
    steps = {path: re.fullmatch(r"step_(\d+)\.pt", path.name) for path in ckpt_dir.iterdir()}
    return sorted((path for path, m in steps.items() if m), key=lambda path: int(steps[path][1]))


def load(path: Path) -> dict:
    # weights_only: tensors, numbers, strings and containers only (all that is saved here), so a
    # file planted in a shared --ckpt-dir cannot call arbitrary functions on every rank
    return torch.load(path, map_location="cpu", weights_only=True)


def remove_interrupted_writes(ckpt_dir: Path) -> None:
    """Delete the temporary files of writes that a kill interrupted (a model's size each)."""
    for stale in ckpt_dir.glob(".step_*.pt.tmp"):
        stale.unlink()


def latest_checkpoint(ckpt_dir: Path):
    """(path, state) of the newest checkpoint that loads (a corrupt newest one is skipped), or
    None."""
    for path in reversed(checkpoints(ckpt_dir)):
        try:
            return path, load(path)
        except Exception as exc:  # noqa: BLE001 - any unreadable file: fall back to an older one
            print(f"warning: skipping unreadable checkpoint {path}: {exc}", file=sys.stderr)
    return None


def rng_states(device: torch.device) -> dict:
    """The random generators' states: CPU torch, Python, and on CUDA this rank's GPU alone.
    (torch.cuda.get_rng_state_all() would save one state per visible GPU, which a run resumed
    with fewer GPUs visible cannot restore, and would start CUDA in a CPU run on a GPU machine.)"""
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}


def set_rng_states(states: dict, device: torch.device) -> None:
    """Restore rng_states() on every rank. Rank 0's CUDA state suits every rank's GPU:
    torch.manual_seed seeds every GPU alike, and the ranks draw the same numbers there."""
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    if states["cuda"] is not None and device.type == "cuda":
        torch.cuda.set_rng_state(states["cuda"], device)


def save_checkpoint(args, d, step: int, model, optimizer, scheduler, scaler, recent_losses: list):
    ckpt_dir = args.ckpt_dir
    if d.rank == 0:
        state = {
            "step": step,
            "recent_losses": recent_losses,  # so the smoothed loss goes on across a resume
            # what the LR was scaled for: a resume at another world size rescales it (rescale_lr)
            "world_size": d.world_size,
            "global_batch": args.global_batch,
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "scaler": scaler.state_dict(),
            "rng": rng_states(d.device),
        }
        tmp = ckpt_dir / f".step_{step:06d}.pt.tmp"
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the name points at them
        os.replace(tmp, ckpt_dir / f"step_{step:06d}.pt")  # atomic on POSIX
        # ... and the rename itself: fsync the directory. A killed process never leaves a
        # truncated step_N.pt (the rename alone does that); with both fsyncs neither does a node
        # crash or power loss, on a local filesystem that honours fsync (ext4, xfs) and a disk
        # that does not lie about its cache. Network and parallel filesystems give their own
        # guarantees (an NFS client may see another node's rename late, through its attribute
        # cache); whatever they do, resume takes the newest file that loads on rank 0, and
        # every rank loads that one file or stops (resume).
        dir_fd = os.open(ckpt_dir, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        for old in checkpoints(ckpt_dir)[:-args.keep_ckpts]:  # after the new one is in place
            old.unlink()
    # Nobody reads or moves on before the file is complete. The other ranks wait here while rank
    # 0 writes, and this barrier is bounded by --timeout-s like every collective: on NCCL the
    # watchdog aborts every rank whose barrier outlasts it. --timeout-s must exceed the longest
    # checkpoint write (a large model to a shared filesystem can take minutes).
    dist.barrier()


def resume(args, d, model, optimizer, scheduler, scaler) -> tuple[int, list]:
    """Load the newest checkpoint of --ckpt-dir into every rank; return the step to start from
    and the losses of the steps before it that the smoothed loss still averages.

    Rank 0 alone chooses the file and sends its name to the others. Ranks that each looked for
    themselves could find different files (a directory that is not shared by every node, an NFS
    client that sees the newest file late) and resume different steps without a word; DDP
    broadcast rank 0's weights at construction, before this, and not again."""
    name, ckpt = [None], None
    if d.rank == 0:
        args.ckpt_dir.mkdir(parents=True, exist_ok=True)
        remove_interrupted_writes(args.ckpt_dir)
        found = latest_checkpoint(args.ckpt_dir)
        if found is not None:
            name, ckpt = [found[0].name], found[1]
    dist.broadcast_object_list(name, src=0)
    if name[0] is None:
        return 0, []
    path = args.ckpt_dir / name[0]
    if ckpt is None:
        try:
            ckpt = load(path)
        except Exception as exc:  # noqa: BLE001 - reported once the ranks have compared steps
            ckpt, error = None, str(exc).splitlines()[0]
    # Every rank holds the same step, or every rank stops: one all-reduce gives the largest step
    # and the smallest (as minus the largest of -step); a rank that could not read says -1.
    step = ckpt["step"] if ckpt is not None else -1
    bounds = torch.tensor([step, -step], device=d.device)
    dist.all_reduce(bounds, op=dist.ReduceOp.MAX)
    high, low = bounds[0].item(), -bounds[1].item()
    shared = "--ckpt-dir must be on a filesystem that every node shares"
    if ckpt is None:
        cli.fail(f"cannot read {path}, the checkpoint rank 0 resumes from ({error}): {shared}")
    if low < 0:
        cli.fail(f"another rank cannot read {path}, the checkpoint rank 0 resumes from: {shared}")
    if low != high:
        cli.fail(f"the ranks read different steps ({low} to {high}) from {path}: {shared}")
    if ckpt["step"] > args.steps:  # every rank read the same step: every rank stops here
        cli.fail(f"the newest checkpoint in {args.ckpt_dir} is at step {ckpt['step']}, past "
                 f"--steps {args.steps}: raise --steps, or use another --ckpt-dir")
    model.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    scheduler.load_state_dict(ckpt["scheduler"])
    scaler.load_state_dict(ckpt["scaler"])
    set_rng_states(ckpt["rng"], d.device)
    report.print0(f"resumed from step {ckpt['step']} in {path}")
    rescale_lr(args, d, ckpt, optimizer, scheduler)
    return ckpt["step"], ckpt["recent_losses"]


def rescale_lr(args, d, ckpt, optimizer, scheduler) -> None:
    """The restored optimizer and scheduler carry the LR scaled for the checkpoint's global batch.
    A job resumed at another world size (an elastic --nnodes=MIN:MAX job that lost a node, a
    requeue on fewer nodes) trains another global batch: give it its own peak LR, keeping the
    step count (so the warmup goes on where it was) and AdamW's moments."""
    old_peak, new_peak = scheduler.base_lrs[0], peak_lr(args)
    new = f"world {d.world_size} (global batch {args.global_batch}, peak lr {new_peak:g})"
    if "world_size" not in ckpt or "global_batch" not in ckpt:
        report.print0(f"warning: the checkpoint does not record its world size and global batch "
                      f"(an older one): cannot check its peak lr {old_peak:g} against this run's "
                      f"{new}; training on at the checkpoint's")
        return
    old = (f"world {ckpt['world_size']} (global batch {ckpt['global_batch']}, peak lr "
           f"{old_peak:g})")
    if old_peak == new_peak:
        if old != new:
            report.print0(f"resized: checkpoint of {old} -> {new}: the same peak lr")
        return
    for group, lr_lambda in zip(optimizer.param_groups, scheduler.lr_lambdas):
        group["initial_lr"] = new_peak
        group["lr"] = new_peak * lr_lambda(scheduler.last_epoch)  # what LambdaLR would set
    scheduler.base_lrs = [new_peak] * len(optimizer.param_groups)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
    report.print0(f"resized: checkpoint of {old} -> {new}: lr rescaled; step count and AdamW "
                  f"state kept")


# --------------------------------------------------------------------------------------------------
# The loop


def loop(args, d, model, ddp, optimizer, scheduler, scaler, start_step: int, recent: list,
         stop: dict):
    """Steps start_step+1 .. --steps. Returns (losses, samples/s or None when no step was timed,
    the last step's collectives with --count-allreduces, else None), or None when the ranks
    stopped on a SIGTERM.

    Each step's loss is that of one batch, and batches differ: printed every 10 steps, it jumps
    up and down around its trend. Beside it goes the mean of the last --log-every steps' losses
    (`recent`, kept in the checkpoints, so a resumed run prints the same figures as one that
    never stopped)."""
    losses, t_start, timed_samples, comms = [], None, 0, None
    bar = report.progress(args.steps, "train", initial=start_step)
    for step in range(start_step, args.steps):
        if step == start_step + 1:
            t_start = timing.clock(d.device)  # the first step pays for warm-up; time the rest
        launch.inject_failure(args, d.rank, step)
        lr = optimizer.param_groups[0]["lr"]  # the LR this step uses; the scheduler then moves it
        with measure(step, args.steps, args.count_allreduces) as counter:
            step_loss = train_step(args, d, ddp, optimizer, scheduler, scaler, step)
        comms = counter.summary() if counter else comms

        # Report the mean loss over the global batch, and agree on a pending SIGTERM.
        # One small all-reduce: [sum of rank losses, number of ranks that received SIGTERM].
        flags = torch.stack([step_loss, torch.tensor(float(stop["requested"]), device=d.device)])
        with nvtx_range("all_reduce: loss, SIGTERM flag"):
            dist.all_reduce(flags, op=dist.ReduceOp.SUM)
        losses.append(flags[0].item() / d.world_size)
        recent = (recent + losses[-1:])[-args.log_every:]
        timed_samples += args.global_batch if step >= start_step + 1 else 0
        done = step + 1
        bar.update(1)
        if d.rank == 0 and (done % args.log_every == 0 or done in (1, args.steps)):
            bar.write(f"step {done:4d}/{args.steps} | loss {losses[-1]:.4f} | mean of last "
                      f"{len(recent):2d} {sum(recent) / len(recent):.4f} | lr {lr:.5f}")

        preempted = flags[1].item() > 0  # every rank stops at the same step
        if args.ckpt_dir and ((args.ckpt_every and done % args.ckpt_every == 0)
                              or done == args.steps or preempted):
            save_checkpoint(args, d, done, model, optimizer, scheduler, scaler, recent)
        if preempted:
            report.print0(f"SIGTERM: checkpointed step {done} to {args.ckpt_dir}; exiting"
                          if args.ckpt_dir else
                          f"SIGTERM at step {done}: nothing saved (no --ckpt-dir was given), "
                          f"so the {done} steps since the start are lost; exiting")
            bar.close()
            return None
    bar.close()
    samples_per_s = timed_samples / (timing.clock(d.device) - t_start) if timed_samples else None
    return losses, samples_per_s, comms


@contextlib.contextmanager
def measure(step: int, steps: int, count: bool):
    """A range per step (`nsys profile --capture-range=nvtx --nvtx-capture="step N"` records that
    step only; 05-advanced/c-data-parallel-techniques/README.md, Profiling), and with `count`
    (--count-allreduces), on the last step, a count of what it sends: DDP's bucket all-reduces,
    as the dispatcher sees them (yields the counter then, None otherwise). The counter is a
    dispatch mode, off by default: it keeps references to the process group (dtcourse.launch,
    teardown), and a training job has no use for it."""
    counted = count and step == steps - 1
    with nvtx_range(f"step {step + 1}"), \
            (comm.CollectiveCounter() if counted else contextlib.nullcontext()) as counter:
        yield counter


def train(args, d):
    args.global_batch = d.world_size * args.batch_size * args.grad_accum
    model, ddp, optimizer, scheduler, scaler = build(args, d)
    allreduces = None
    if args.count_allreduces:
        # Replace DDP's built-in all-reduce by a Python comm hook that does the same (average
        # each bucket with one all-reduce) and counts: no_sync() at work, in numbers.
        allreduces = comm.counting_allreduce(d.world_size)
        ddp.register_comm_hook(None, allreduces)
    start_step, recent = resume(args, d, model, optimizer, scheduler, scaler) if args.ckpt_dir \
        else (0, [])

    # Preemption: SLURM (or torchrun on shutdown) sends SIGTERM. We only set a flag here; the
    # training loop agrees on it across ranks (one all-reduce), checkpoints and exits cleanly.
    stop = {"requested": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(requested=True))

    report.print0(f"world {d.world_size} | device {d.device} | global batch {args.global_batch} "
                  f"({d.world_size} ranks x {args.batch_size} x accum {args.grad_accum}) | lr "
                  f"{optimizer.param_groups[0]['initial_lr']:g} (base {args.lr:g} x "
                  f"{args.global_batch}/{args.base_batch})")
    if start_step == args.steps:  # a finished run launched again: export what it ended with
        report.print0(f"nothing to train: {args.ckpt_dir} is already at step {start_step} "
                      f"(--steps {args.steps})")
        losses, samples_per_s, comms = [], None, None
    else:
        result = loop(args, d, model, ddp, optimizer, scheduler, scaler, start_step, recent, stop)
        if result is None:
            return
        losses, samples_per_s, comms = result
        rate = f"{samples_per_s:.0f} samples/s" if samples_per_s else \
            "samples/s not measured (the first step is not timed)"
        counted = f", all-reduce calls {allreduces.calls}" if allreduces else ""
        report.print0(f"done: {args.steps - start_step} steps, {rate}{counted}")
        if comms and "all_reduce" in comms:
            # A ring all-reduce of the gradient bytes G sends 2(N-1)/N x G from every rank.
            s, n = comms["all_reduce"], d.world_size
            G = sum(p.numel() * p.element_size() for p in model.parameters())
            report.print0(f"last step: all-reduced {s['tensor_bytes']:,} B of gradients in "
                          f"{s['calls']} bucket(s); this rank sent {s['sent_bytes']:,} B = "
                          f"2(N-1)/N x {G:,} B")
    finish(args, d, model, ddp, optimizer, allreduces, losses, samples_per_s, start_step, comms)


def bucket_bytes(ddp) -> int:
    """Bytes of DDP's flat gradient buckets, as DDP's own logger reports them."""
    sizes = str(ddp._get_ddp_logging_data().get("bucket_sizes", ""))
    return sum(int(size) for size in sizes.split(",") if size.strip())


def finish(args, d, model, ddp, optimizer, allreduces, losses, samples_per_s, start_step,
           comms):
    """Rank 0 writes --metrics-out and --export; every rank waits until they are complete."""
    # Every rank holds a full replica: fp32 weights, Adam's two moments, and the gradients, which
    # live in DDP's buckets (each .grad a view into them). 4 + 8 + 4 = 16 bytes per parameter.
    held = report.held_bytes(params=model.parameters(), optimizer=optimizer, device=d.device)
    held["grad_bytes"] = bucket_bytes(ddp)
    metrics = report.metrics(d, script=SCRIPT, strategy="ddp", steps=args.steps,
                             global_batch=args.global_batch, losses=losses,
                             samples_per_s=samples_per_s, per_rank=report.gather(held),
                             start_step=start_step, grad_accum=args.grad_accum,
                             precision=args.precision,
                             # DDP's own record of a registered comm hook (None: its built-in
                             # all-reduce); with --count-allreduces the hook's count and the
                             # last step's collectives (None without)
                             comm_hook=ddp._get_ddp_logging_data().get("comm_hook"),
                             allreduce_calls=allreduces.calls if allreduces else None,
                             comms_per_step=comms)
    report.finish(args, metrics, model.state_dict())


# --------------------------------------------------------------------------------------------------
# Arguments and launch


def parse_args(argv=None):
    p = cli.parser(__doc__)
    cli.add_run_args(p)
    cli.add_train_args(p, steps=40, batch_size=32, lr=1e-2)
    cli.add_output_args(p)
    cli.add_template_args(p)
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32",
                   help="autocast dtype of the forward; fp16 adds a GradScaler")
    p.add_argument("--count-allreduces", action="store_true",
                   help="count DDP's all-reduce calls with a Python comm hook in place of "
                        "its built-in all-reduce (the same averages, through Python), and the "
                        "last step's collectives and bytes at the dispatcher")
    cli.add_ckpt_args(p, keep=True)
    p.add_argument("--spawn", type=int, default=0, metavar="N",
                   help="start N local ranks with torch.multiprocessing.spawn instead of torchrun")
    p.add_argument("--log-every", type=int, default=10)
    args = p.parse_args(argv)
    cli.check_positive(args, "steps", "batch_size", "grad_accum", "log_every", "lr", "timeout_s")
    cli.check_template_args(args)
    if args.spawn and ("RANK" in os.environ or args.spawn < 1):
        cli.fail("--spawn N starts N ranks itself: use it with plain python, N >= 1")
    cli.check_ckpt_args(args, args.spawn or launch.launched().world_size)
    return args


def spawn_worker(local_rank: int, nprocs: int, port: int, argv: list):
    """mp.spawn calls this in each child with its index: set the variables torchrun would have
    set for it and that the set-up reads."""
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(nprocs),
                      LOCAL_WORLD_SIZE=str(nprocs), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    main(argv)


def spawn(args, argv):
    """The alternative to torchrun: this process starts the ranks itself, on this machine only
    (several machines would each need a spawn with a rank offset: what torchrun does for you)."""
    import socket

    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(os.environ.get("MASTER_PORT", s.getsockname()[1]))
    # torchrun sets OMP_NUM_THREADS=1 when it starts more than one process per node and the
    # variable is unset; so do we, before the children start, so that their torch reads it.
    if args.spawn > 1 and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = "1"
    i = argv.index("--spawn") if "--spawn" in argv else None
    child_argv = argv[:i] + argv[i + 2:] if i is not None else \
        [a for a in argv if not a.startswith("--spawn=")]
    mp.spawn(spawn_worker, args=(args.spawn, port, child_argv), nprocs=args.spawn)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.spawn:
        return spawn(args, argv)
    with launch.distributed(args.device, args.timeout_s) as d:
        train(args, d)


if __name__ == "__main__":
    main()

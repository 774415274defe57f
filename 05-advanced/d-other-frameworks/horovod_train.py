"""Lesson 05d: the DDP template's training (01-ddp-basics/ddp_training.py) with Horovod: the same
MLP, initial weights, batches, AdamW and warmup, with Horovod's DistributedOptimizer where the
template has DDP.

Launch (from the repository root; Horovod comes from install_frameworks.sh in this folder):
    python 05-advanced/d-other-frameworks/horovod_train.py                  # 1 process
    horovodrun -np 2 -H localhost:2 --gloo python 05-advanced/d-other-frameworks/horovod_train.py
    horovodrun -np 2 -H localhost:2 --gloo python .../horovod_train.py --grad-accum 2 \\
        --compression fp16
    HOROVOD_TIMELINE=runs/05d/timeline.json horovodrun -np 2 -H localhost:2 --gloo python ...
    horovodrun -np 16 -H node1:8,node2:8 python .../horovod_train.py --device cuda  # 2 nodes
    mpirun -np 16 -H node1:8,node2:8 -bind-to none -map-by slot python ...  # an MPI build
    srun --ntasks=16 --mpi=pmix python ...                                  # an MPI build

What DDP does, and where Horovod does it:
    dist.init_process_group      -> hvd.init(): rank, size and local rank from horovodrun (which
                                    also starts the gloo rendezvous) or from MPI
    DDP(model) broadcasts rank 0's weights at construction
                                 -> hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    DDP's backward hooks all-reduce gradient buckets (25 MB) while backward goes on
                                 -> DistributedOptimizer's hook on each parameter submits its
                                    gradient's all-reduce as soon as it is ready. A background
                                    thread wakes every HOROVOD_CYCLE_TIME ms (1), the ranks agree
                                    which tensors are ready on all of them, and those are packed
                                    into one buffer of up to HOROVOD_FUSION_THRESHOLD bytes (128
                                    MiB) for one all-reduce: "tensor fusion", Horovod's buckets
    DDP averages                 -> op=hvd.Average (the all-reduce's sum, divided by size)
    no_sync() on accumulation micro-steps
                                 -> backward_passes_per_step=A: the hook all-reduces on every
                                    A-th backward only; the others accumulate locally
    register_comm_hook(fp16_compress_hook)
                                 -> compression=hvd.Compression.fp16: sent as float16, cast back
    optimizer.step()             -> step() first waits for every all-reduce (synchronize())
The defaults in brackets are Horovod 0.28.1's (horovod/common/operations.cc).
"""

import os
import sys

import torch
import torch.nn.functional as F

from dtcourse import cli, report, timing
from dtcourse.data import classification_batch, rank_rows
from dtcourse.models import MLP

SCRIPT = "05-advanced/d-other-frameworks/horovod_train.py"


def lr_at(step: int, peak_lr: float, warmup: int) -> float:
    """The template's schedule: linear warmup to the scaled LR over `warmup` steps."""
    return peak_lr * min(1.0, (step + 1) / warmup) if warmup else peak_lr


# --------------------------------------------------------------------------------------------------
# The model, Horovod's optimizer, and one optimizer step


def build(hvd, args, device):
    torch.manual_seed(args.seed)
    model = MLP(args.hidden).to(device)
    # Every rank built the same weights from the seed; the broadcast makes that true whatever
    # each rank did before (a different seed, a checkpoint only rank 0 read), as DDP's does.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)

    peak_lr = args.lr * args.global_batch / args.base_batch  # the template's linear scaling
    optimizer = torch.optim.AdamW(model.parameters(), lr=peak_lr, weight_decay=0.01)
    compression = hvd.Compression.fp16 if args.compression == "fp16" else hvd.Compression.none
    # A subclass of AdamW whose hooks all-reduce the gradients, and whose step() waits for them.
    # named_parameters names each all-reduce, so the ranks can match them up (and the timeline
    # shows the names).
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression, op=hvd.Average,
                                         backward_passes_per_step=args.grad_accum)
    # hvd.broadcast_optimizer_state(optimizer, root_rank=0) belongs after loading a checkpoint
    # into rank 0. On a fresh optimizer, as here, every rank's state is equally empty, and the
    # call would first fill it by taking one step() with zero gradients: for AdamW that decays
    # every weight by lr * weight_decay and counts a step, so the run would no longer be the
    # template's (tests/test_05d_other_frameworks.py measures it).
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_at(s, 1.0, args.warmup_steps))
    return model, optimizer, scheduler, peak_lr


def train_step(args, rank, device, model, optimizer, scheduler, step: int):
    """One optimizer step over this rank's rows of the global batch, in grad_accum micro-steps.
    Returns (this rank's mean loss, the L2 norm of the averaged gradient the optimizer applied)."""
    x_all, y_all = classification_batch(args.seed, step, args.global_batch)
    rows = rank_rows(rank, args.batch_size * args.grad_accum)  # the template's rows, in order
    x_local, y_local = x_all[rows].to(device), y_all[rows].to(device)
    step_loss = torch.zeros((), device=device)
    for micro in range(args.grad_accum):
        x = x_local[micro * args.batch_size:(micro + 1) * args.batch_size]
        y = y_local[micro * args.batch_size:(micro + 1) * args.batch_size]
        loss = F.cross_entropy(model(x), y)
        # As in the template: / grad_accum makes the accumulated gradient that of the mean loss
        # over this rank's rows. The hooks count backward passes and all-reduce on the last.
        (loss / args.grad_accum).backward()
        step_loss += loss.detach() / args.grad_accum
    optimizer.synchronize()  # wait for the all-reduces: .grad now holds the average over ranks
    grad_norm = torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(p.grad) for p in model.parameters()]))
    with optimizer.skip_synchronize():  # already synchronised: step() must not wait again
        optimizer.step()
    optimizer.zero_grad()  # Horovod's zero_grad takes no set_to_none; torch's default is True
    scheduler.step()
    return step_loss, grad_norm.item()


# --------------------------------------------------------------------------------------------------
# The loop and the report


def train(hvd, args, device):
    import horovod
    rank, size = hvd.rank(), hvd.size()
    args.global_batch = size * args.batch_size * args.grad_accum
    model, optimizer, scheduler, peak_lr = build(hvd, args, device)
    print0 = (lambda msg: print(msg, flush=True)) if rank == 0 else (lambda msg: None)
    print0(f"horovod {horovod.__version__} | {size} process(es), controller "
           f"{'gloo' if hvd.gloo_enabled() else 'mpi'} | device {device} | global batch "
           f"{args.global_batch} ({size} x {args.batch_size} x accum {args.grad_accum}) | lr "
           f"{peak_lr:g} | compression {args.compression} | fusion threshold "
           f"{os.environ.get('HOROVOD_FUSION_THRESHOLD', str(128 * 1024 * 1024))} B")

    losses, grad_norms, t_start = [], [], None
    bar = report.progress(args.steps, "train", show=rank == 0)
    for step in range(args.steps):
        if step == 1:
            t_start = timing.clock(device)  # the first step pays for warm-up; time the rest
        lr = optimizer.param_groups[0]["lr"]
        step_loss, grad_norm = train_step(args, rank, device, model, optimizer, scheduler, step)
        # The mean loss over the global batch: one more (small) all-reduce, for the report.
        losses.append(hvd.allreduce(step_loss.cpu(), op=hvd.Average, name="loss").item())
        grad_norms.append(grad_norm)
        done = step + 1
        bar.update(1)
        if rank == 0 and (done % args.log_every == 0 or done in (1, args.steps)):
            bar.write(f"step {done:4d}/{args.steps} | loss {losses[-1]:.4f} | grad norm "
                      f"{grad_norm:.4f} | lr {lr:.5f}")
    bar.close()
    elapsed = timing.clock(device) - t_start if t_start else None
    samples_per_s = (args.steps - 1) * args.global_batch / elapsed if elapsed else None
    print0(f"done: {args.steps} steps, "
           + (f"{samples_per_s:.0f} samples/s" if samples_per_s else "samples/s not measured"))

    # Every rank holds the whole model: weights, gradients and AdamW's two moments (16 B/param).
    # (zero_grad freed the gradients; each backward allocates them again: count them.)
    held = report.held_bytes(params=model.parameters(), optimizer=optimizer, device=device)
    held["grad_bytes"] = held["param_bytes"]
    per_rank = hvd.allgather_object(held)
    if rank == 0:
        metrics = report.metrics(
            Dist(size, device), script=SCRIPT, strategy="horovod", steps=args.steps,
            global_batch=args.global_batch, losses=losses, samples_per_s=samples_per_s,
            per_rank=per_rank, grad_norms=grad_norms, grad_accum=args.grad_accum,
            compression=args.compression, horovod_version=horovod.__version__)
        if args.metrics_out:
            report.write_json(args.metrics_out, metrics)
        if args.export:
            report.save_state_dict(args.export, model.state_dict())
    hvd.barrier()  # nobody exits before rank 0's files are complete


class Dist:
    """What report.metrics reads of a process group: its size and device."""

    def __init__(self, world_size: int, device: torch.device):
        self.world_size, self.device = world_size, device


# --------------------------------------------------------------------------------------------------
# Arguments and launch


def parse_args(argv=None):
    p = cli.parser(__doc__)
    cli.add_run_args(p, timeout_s=60.0)
    cli.add_train_args(p, steps=40, batch_size=32, lr=1e-2)
    cli.add_output_args(p)
    cli.add_template_args(p)
    p.add_argument("--compression", choices=["none", "fp16"], default="none",
                   help="send gradients as they are, or as float16 (Horovod's Compression.fp16)")
    p.add_argument("--log-every", type=int, default=10)
    args = p.parse_args(argv)
    cli.check_positive(args, "steps", "batch_size", "grad_accum", "log_every", "lr", "timeout_s")
    cli.check_template_args(args)
    return args


def choose_device(hvd, device_arg: str) -> torch.device:
    """--device auto|cpu|cuda, checked before hvd.init() so that every rank fails alike; a GPU
    rank's device index comes from hvd.local_rank() once hvd.init() has run (in main)."""
    if device_arg == "cuda" and not torch.cuda.is_available():
        cli.fail("--device cuda was asked for, but CUDA is not available on this machine")
    if device_arg == "cpu" or not torch.cuda.is_available():
        torch.set_num_threads(1)  # as the course's setup does: the same sums on every machine
        return torch.device("cpu")
    if not hvd.nccl_built():
        cli.fail("this Horovod was built without GPU support (hvd.nccl_built() is False): "
                 "rebuild it with HOROVOD_GPU_OPERATIONS=NCCL, or use --device cpu")
    return torch.device("cuda")


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        import horovod.torch as hvd
    except ImportError as exc:
        cli.fail(f"Horovod is not installed ({exc}): run "
                 f"bash 05-advanced/d-other-frameworks/install_frameworks.sh")
    device = choose_device(hvd, args.device)
    # Gloo's collectives (and its rendezvous) give up after this many seconds instead of 30.
    os.environ.setdefault("HOROVOD_GLOO_TIMEOUT_SECONDS", str(int(args.timeout_s)))
    hvd.init()
    if device.type == "cuda":  # one GPU per rank: horovodrun, mpirun or srun set the local rank
        device = torch.device("cuda", hvd.local_rank())
        torch.cuda.set_device(device)
    try:
        train(hvd, args, device)
    finally:
        if os.environ.get("HOROVOD_TIMELINE"):
            # shutdown() stops the timeline's writer thread at once, dropping the events it has
            # not written yet (most of a short run's, on a busy machine); stop_timeline() returns
            # once they are all in the file.
            hvd.stop_timeline()
        hvd.shutdown()


if __name__ == "__main__":
    main()

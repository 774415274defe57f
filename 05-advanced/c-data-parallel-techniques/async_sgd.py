"""Synchronous SGD vs asynchronous SGD with a parameter server vs local SGD, with a straggler.

Launch (from the repository root; rank 0 is the parameter server, ranks 1.. are the workers):
    torchrun --nproc_per_node=3 05-advanced/c-data-parallel-techniques/async_sgd.py  # 2 workers
    torchrun --nproc_per_node=3 05-advanced/c-data-parallel-techniques/async_sgd.py \\
        --local-steps 1 --modes sync local
    torchrun --nproc_per_node=5 05-advanced/c-data-parallel-techniques/async_sgd.py \\
        --worker-delay-ms 0 0 0 40

    sync   every step: all workers all-reduce their gradients, then step together. The slowest
           worker sets the pace: everyone waits for it at each all-reduce.
    local  every worker steps on its own gradients; every H steps the workers average their
           weights (one all-reduce per H steps). H = 1 is exactly synchronous SGD.
    async  (a parameter server as in Downpour SGD, Dean et al. 2012, "Large Scale Distributed
           Deep Networks"; Hogwild!, Niu et al. 2011, is its lock-free shared-memory cousin)
           each worker loops on its own:
             push (gradient, version of the weights it used) -> server applies it at once
             pull the server's newest weights
           nobody waits for anybody, but a gradient may have been computed on weights that
           other workers have since updated: staleness = server version at apply time - version
           the gradient was computed on.

The parameter server is written with plain point-to-point messages on gloo: it receives from
whichever worker is first (`recv` without a source), which NCCL does not offer, so everything here
runs on CPU tensors (a parameter server usually lives on CPU hosts anyway); the workers' compute
is a tiny MLP, the point is the protocol and its staleness.
"""

import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from dtcourse import cli, launch, report, timing
from dtcourse.data import classification_batch, rank_rows
from dtcourse.models import MLP

SCRIPT = "05-advanced/c-data-parallel-techniques/async_sgd.py"
# CPU and gloo only: the parameter server receives from any source, which NCCL does not offer.
GLOO_ONLY = "the parameter server receives from any source, which only gloo offers"
MODES = ("sync", "local", "async")


def local_batch(args, worker: int, workers: int, step: int):
    """Worker `worker` (0-based) takes rows worker*B..(worker+1)*B-1 of step `step`'s batch."""
    x, y = classification_batch(args.seed, step, workers * args.batch_size)
    rows = rank_rows(worker, args.batch_size)
    return x[rows], y[rows]


def new_model(args) -> MLP:
    torch.manual_seed(args.seed)  # every mode and every rank starts from the same weights
    return MLP(args.hidden, depth=1)


def loss_and_grad(model, x, y):
    model.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    return loss.item(), torch.cat([p.grad.reshape(-1) for p in model.parameters()])


# --------------------------------------------------------------------------------------------------
# Synchronous and local SGD: the workers only, in their own process group


def run_sync_or_local(args, mode, worker, workers, group):
    """Returns (model, per-step mean losses, all-reduces done). H = 1 for sync."""
    model = new_model(args)
    H = 1 if mode == "sync" else args.local_steps
    delay = args.worker_delay_ms[worker] / 1e3
    losses, allreduces = [], 0
    for step in range(args.steps):
        x, y = local_batch(args, worker, workers, step)
        loss, grad = loss_and_grad(model, x, y)
        time.sleep(delay)  # this worker is slower (a straggler)
        if mode == "sync":
            # Average the gradients: every worker then applies the same update.
            dist.all_reduce(grad, group=group)
            grad /= workers
            allreduces += 1
        params = parameters_to_vector(model.parameters()).detach()
        params -= args.lr * grad
        if mode == "local" and ((step + 1) % H == 0 or step + 1 == args.steps):
            # Average the weights: the replicas drifted apart for H steps, now they agree again.
            dist.all_reduce(params, group=group)
            params /= workers
            allreduces += 1
        vector_to_parameters(params, model.parameters())
        mean_loss = torch.tensor([loss])
        dist.all_reduce(mean_loss, group=group)  # reporting only
        losses.append(mean_loss.item() / workers)
    return model, losses, allreduces


# --------------------------------------------------------------------------------------------------
# Asynchronous SGD with a parameter server (rank 0)

STOP = -1.0  # version field of the server's reply that tells a worker to stop


def parameter_server(args, workers):
    """Apply each worker's gradient the moment it arrives, in arrival order; reply with the newest
    weights. Ends after workers * steps updates: every worker's next push is answered with STOP.

    Messages (float32): push = [version used, loss, gradient...], reply = [version, weights...].
    """
    model = new_model(args)
    weights = parameters_to_vector(model.parameters()).detach()
    version = 0
    for w in range(workers):  # initial pull
        dist.send(torch.cat([torch.tensor([0.0]), weights]), dst=w + 1)
    push = torch.empty(2 + weights.numel())
    updates, staleness, losses = workers * args.steps, {w: [] for w in range(workers)}, []
    stopped = 0
    while stopped < workers:
        src = dist.recv(push)  # from whichever worker is first: no one waits for the others
        if version < updates:
            staleness[src - 1].append(version - int(push[0]))
            losses.append(push[1].item())
            weights -= args.lr * push[2:]
            version += 1
            dist.send(torch.cat([torch.tensor([float(version)]), weights]), dst=src)
        else:  # enough updates: this worker's gradient is dropped and it is told to stop
            dist.send(torch.cat([torch.tensor([STOP]), weights]), dst=src)
            stopped += 1
    vector_to_parameters(weights, model.parameters())
    return model, losses, staleness


def async_worker(args, worker, workers):
    """Push a gradient, pull the newest weights, repeat until STOP; returns the pushes made."""
    model = new_model(args)
    delay = args.worker_delay_ms[worker] / 1e3
    reply = torch.empty(1 + parameters_to_vector(model.parameters()).numel())
    dist.recv(reply, src=0)
    step = 0
    while reply[0] != STOP:
        vector_to_parameters(reply[1:].clone(), model.parameters())
        x, y = local_batch(args, worker, workers, step)
        loss, grad = loss_and_grad(model, x, y)
        time.sleep(delay)
        dist.send(torch.cat([torch.tensor([reply[0].item(), loss]), grad]), dst=0)
        dist.recv(reply, src=0)  # the server's newest weights (or STOP)
        step += 1
    return model, step


# --------------------------------------------------------------------------------------------------
# The three modes, one after the other, on the same workers


def eval_loss(args, model) -> float:
    """Loss on a fixed held-out batch: the comparable end point of the three modes."""
    x, y = classification_batch(args.seed, 10**6, 1024)  # a step no run reaches: unseen samples
    with torch.no_grad():
        return F.cross_entropy(model(x), y).item()


def run_mode(args, mode, d, group) -> tuple:
    """This rank's part of one mode; returns (final weights on rank 0, this rank's record)."""
    workers, worker = d.world_size - 1, d.rank - 1  # rank 0 is the server / coordinator
    dist.barrier()
    t0 = timing.clock(d.device)
    model, row = new_model(args), {}
    if mode == "async":
        if d.rank == 0:
            model, losses, staleness = parameter_server(args, workers)
            row = {"losses": losses, "staleness": staleness}
        else:
            model, row["pushes"] = async_worker(args, worker, workers)
    elif d.rank > 0:
        model, losses, allreduces = run_sync_or_local(args, mode, worker, workers, group)
        row = {"losses": losses, "allreduces": allreduces}
    row["wall_s"] = timing.clock(d.device) - t0
    # The final weights: the server holds them (async), every worker does (sync, local: the last
    # step averaged them). Rank 0 gets them from rank 1 for the held-out loss and the export.
    holder = 0 if mode == "async" else 1
    weights = parameters_to_vector(model.parameters()).detach()
    dist.broadcast(weights, src=holder)
    vector_to_parameters(weights, model.parameters())
    return model, row


def summarize(args, mode, rows, workers, model) -> dict:
    """What rank 0 reports of one mode, from every rank's record."""
    if mode == "async":
        server, stale = rows[0], rows[0]["staleness"]
        s = {"losses": server["losses"], "gradients_applied": len(server["losses"]),
             "pushes_per_worker": [r["pushes"] for r in rows[1:]],
             "staleness_per_worker": {str(w): v for w, v in stale.items()},
             "mean_staleness_per_worker": [statistics.mean(stale[w]) if stale[w] else 0.0
                                           for w in range(workers)],
             "max_staleness": max((max(v) for v in stale.values() if v), default=0)}
    else:
        s = {"losses": rows[1]["losses"], "gradients_applied": args.steps * workers,
             "allreduces": rows[1]["allreduces"]}
    s["wall_s"] = max(r["wall_s"] for r in (rows if mode == "async" else rows[1:]))
    s["samples_per_s"] = s["gradients_applied"] * args.batch_size / s["wall_s"]
    s["eval_loss"] = eval_loss(args, model)
    return s


def print_summary(summary: dict) -> None:
    """The synchronous modes are deterministic; what the asynchronous one applies depends on
    which worker pushes first, so its losses, counts and staleness are marked `~`."""
    for mode, s in summary.items():
        curve = s["losses"]
        marks = sorted({0, len(curve) // 2, len(curve) - 1})
        t = "~" if mode == "async" else ""
        line = " ".join(f"{t}{curve[i]:.3f}" for i in marks)
        extra = (f"all-reduces {s['allreduces']}" if mode != "async" else
                 f"gradients by worker [{', '.join(f'~{n}' for n in s['pushes_per_worker'])}] "
                 f"(last one dropped at STOP)")
        report.print0(f"{mode:<5} | {s['wall_s']:5.2f} s | train loss {line} | held-out loss "
                      f"{t}{s['eval_loss']:.4f} | {extra}")
    if "async" in summary:
        s = summary["async"]
        means = " ".join(f"w{w}: ~{m:.2f}" for w, m in enumerate(s["mean_staleness_per_worker"]))
        report.print0(f"async staleness (server updates between a worker's pull and its push): "
                      f"mean {means} | max ~{s['max_staleness']}")


def run(args, d):
    torch.set_num_threads(1)  # tiny model; the ranks share the cores
    workers = d.world_size - 1
    group = dist.new_group(list(range(1, d.world_size)))  # every rank calls it; workers use it
    report.print0(f"1 parameter server + {workers} workers | delays "
                  f"{' '.join(f'{v:g}' for v in args.worker_delay_ms)} ms/step | {args.steps} "
                  f"steps x batch {args.batch_size} per worker | lr {args.lr:g}")
    summary, models = {}, {}
    for mode in args.modes:
        models[mode], row = run_mode(args, mode, d, group)
        rows = report.gather(row)
        if d.rank == 0:
            summary[mode] = summarize(args, mode, rows, workers, models[mode])
    print_summary(summary)
    write_outputs(args, d, models, summary)


# --------------------------------------------------------------------------------------------------
# Outputs, arguments and launch


def write_outputs(args, d, models, summary) -> None:
    """--export: one plain state dict per mode (PATH itself when there is one mode, else PATH with
    the mode before the suffix); --metrics-out: every mode, with the contract's top-level fields
    taken from the first."""
    for mode, model in models.items():
        path = None if args.export is None else \
            report.variant_path(args.export, mode, several=len(models) > 1)
        if d.rank == 0:
            summary[mode]["export"] = None if path is None else str(path)
            if path is not None:
                report.save_state_dict(path, model.state_dict())
    first = models[args.modes[0]]
    per_rank = report.gather(report.held_bytes(params=first.parameters(), device=d.device))
    metrics = None
    if d.rank == 0:
        top = summary[args.modes[0]]
        metrics = report.metrics(d, script=SCRIPT, strategy=f"{args.modes[0]} sgd",
                                 steps=args.steps, global_batch=(d.world_size - 1) *
                                 args.batch_size, losses=top["losses"],
                                 samples_per_s=top["samples_per_s"], per_rank=per_rank,
                                 workers=d.world_size - 1, local_steps=args.local_steps,
                                 worker_delay_ms=args.worker_delay_ms, modes=summary)
    report.finish(args, metrics)


def parse_args(argv=None):
    p = cli.parser(__doc__)
    cli.add_run_args(p)
    cli.add_train_args(p, steps=30, batch_size=16, lr=0.3, grad_accum=False,
                       batch_help="samples per worker per step")
    cli.add_output_args(p)
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--local-steps", type=int, default=4, help="H: local SGD averages every H steps")
    p.add_argument("--worker-delay-ms", type=float, nargs="+", default=[0.0, 20.0],
                   help="extra time per step for each worker (a straggler); one value per worker")
    p.add_argument("--hidden", type=int, default=64, help="width of the MLP")
    args = p.parse_args(argv)
    cli.check_positive(args, "steps", "local_steps", "batch_size", "hidden", "lr", "timeout_s")
    if min(args.worker_delay_ms) < 0:
        cli.fail(f"--worker-delay-ms must be >= 0, got {min(args.worker_delay_ms)}")
    if args.device == "cuda":
        cli.fail(f"--device cuda: {GLOO_ONLY}; this script runs on the CPU")
    return args


def check_world(args, world: int) -> None:
    """Before the first collective: a server and at least one worker, one delay per worker."""
    if world < 2:
        cli.fail("needs a parameter server and at least one worker: torchrun --nproc_per_node=3 "
                 f"{SCRIPT}")
    if len(args.worker_delay_ms) not in (1, world - 1):
        cli.fail(f"--worker-delay-ms needs one value per worker ({world - 1}) or one for all, "
                 f"got {len(args.worker_delay_ms)}")
    if len(args.worker_delay_ms) == 1:
        args.worker_delay_ms *= world - 1


def main(argv=None):
    args = parse_args(argv)
    with launch.distributed("cpu", args.timeout_s) as d:
        check_world(args, d.world_size)
        run(args, d)


if __name__ == "__main__":
    main()

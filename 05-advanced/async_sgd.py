"""Synchronous SGD vs asynchronous SGD with a parameter server vs local SGD, with a straggler.

Launch (from the repository root; rank 0 is the parameter server, ranks 1.. are the workers):
    torchrun --nproc_per_node=3 05-advanced/async_sgd.py                    # 2 workers
    torchrun --nproc_per_node=3 05-advanced/async_sgd.py --local-steps 1 --modes sync local
    torchrun --nproc_per_node=5 05-advanced/async_sgd.py --worker-delay-ms 0 0 0 40

Expected output (the first command, 2-core AMD EPYC CPU (shared), torch 2.14.1, gloo;
milliseconds move from run to run on a shared CPU, see 05-advanced/README.md, part 05c):
    sync  |  0.79 s | train loss 2.299 2.022 1.808 | held-out loss 1.7477 | all-reduces 30
    local |  0.72 s | train loss 2.299 2.013 1.807 | held-out loss 1.7510 | all-reduces 8
    async |  0.30 s | train loss 2.309 1.765 1.102 | held-out loss 1.1964 | gradients by worker [50 ...
    async staleness (server updates between a worker's pull and its push): mean w0: 0.22 w1: 4.09 | ...

    sync   every step: all workers all-reduce their gradients, then step together. The slowest
           worker sets the pace: everyone waits for it at each all-reduce.
    local  every worker steps on its own gradients; every H steps the workers average their
           weights (one all-reduce per H steps). H = 1 is exactly synchronous SGD.
    async  (Hogwild-style parameter server, Dean et al. 2012) each worker loops on its own:
             push (gradient, version of the weights it used) -> server applies it at once
             pull the server's newest weights
           nobody waits for anybody, but a gradient may have been computed on weights that
           other workers have since updated: staleness = server version at apply time - version
           the gradient was computed on.

The parameter server is written with plain point-to-point messages (send / recv from any source)
on the default gloo process group, so it needs nothing beyond what the rest of the course uses.
Everything here runs on CPU tensors (a parameter server usually lives on CPU hosts anyway); the
workers' compute is a tiny MLP, the point is the protocol and its staleness.
"""

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import parameters_to_vector, vector_to_parameters


def fail(msg: str) -> None:
    """Bad input: one line on stderr and exit status 2, on every rank, before any collective."""
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID"))
    prefix = f"[rank {rank}] " if rank is not None else ""
    print(f"{prefix}error: {msg}", file=sys.stderr, flush=True)
    sys.exit(2)


MODES = ("sync", "local", "async")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.error = fail
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--steps", type=int, default=30,
                   help="steps per worker (async: the server applies workers x steps gradients)")
    p.add_argument("--local-steps", type=int, default=4, help="H: local SGD averages every H steps")
    p.add_argument("--worker-delay-ms", type=float, nargs="+", default=[0.0, 20.0],
                   help="extra time per step for each worker (a straggler); one value per worker")
    p.add_argument("--batch-size", type=int, default=16, help="samples per worker per step")
    p.add_argument("--hidden", type=int, default=64, help="width of the MLP")
    p.add_argument("--lr", type=float, default=0.3, help="SGD learning rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=120, help="collective timeout")
    p.add_argument("--json-out", type=Path, help="rank 0 writes the curves and staleness here")
    p.add_argument("--export-dir", type=Path, help="final weights of each mode as <mode>.pt")
    args = p.parse_args(argv)
    for name in ("steps", "local_steps", "batch_size", "hidden"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.lr <= 0 or args.timeout_s <= 0 or min(args.worker_delay_ms) < 0:
        fail("--lr and --timeout-s must be positive and --worker-delay-ms >= 0")
    return args


def launcher_ranks():
    """(rank, world) from torchrun's or srun's variables (explained in
    01-ddp-basics/ddp_training.py); the gloo group is created once the input is checked."""
    env = os.environ
    if "RANK" not in env and "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env:
        env["RANK"], env["WORLD_SIZE"] = env["SLURM_PROCID"], env["SLURM_STEP_NUM_TASKS"]
        env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
        if "MASTER_ADDR" not in env:
            nodes = env.get("SLURM_STEP_NODELIST", env.get("SLURM_JOB_NODELIST", "127.0.0.1"))
            out = subprocess.run(["scontrol", "show", "hostnames", nodes], capture_output=True,
                                 text=True, check=False).stdout.split()
            env["MASTER_ADDR"] = out[0] if out else nodes
        env.setdefault("MASTER_PORT", str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000))
    rank, world = int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1))
    return rank, world


class MLP(nn.Module):
    """32 features -> 10 classes."""

    def __init__(self, hidden: int, features: int = 32, classes: int = 10):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.GELU(),
                                 nn.Linear(hidden, classes))

    def forward(self, x):
        return self.net(x)


def global_batch(seed: int, step: int, size: int, features: int = 32, classes: int = 10):
    """Step `step`'s batch for all workers together, a pure function of (seed, step)."""
    teacher = torch.randn(features, classes, generator=torch.Generator().manual_seed(seed + 12345))
    x = torch.randn(size, features, generator=torch.Generator().manual_seed(seed * 100003 + step))
    return x, (x @ teacher).argmax(dim=1)


def local_batch(args, worker: int, workers: int, step: int):
    """Worker `worker` (0-based) takes rows worker*B..(worker+1)*B-1 of step `step`'s batch."""
    x, y = global_batch(args.seed, step, workers * args.batch_size)
    rows = slice(worker * args.batch_size, (worker + 1) * args.batch_size)
    return x[rows], y[rows]


def new_model(args) -> MLP:
    torch.manual_seed(args.seed)  # every mode and every rank starts from the same weights
    return MLP(args.hidden)


def loss_and_grad(model, x, y):
    model.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    return loss.item(), torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def eval_loss(args, model) -> float:
    """Loss on a fixed held-out batch: the comparable end point of the three modes."""
    x, y = global_batch(args.seed, 10**6, 1024)  # a step no run reaches: unseen samples
    with torch.no_grad():
        return F.cross_entropy(model(x), y).item()


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
    return step


# --------------------------------------------------------------------------------------------------


def main(argv=None):
    args = parse_args(argv)
    rank, world = launcher_ranks()
    if world < 2:
        fail("needs a parameter server and at least one worker: "
             "torchrun --nproc_per_node=3 05-advanced/async_sgd.py")
    if len(args.worker_delay_ms) not in (1, world - 1):
        fail(f"--worker-delay-ms needs one value per worker ({world - 1}) or one for all, got "
             f"{len(args.worker_delay_ms)}")
    if len(args.worker_delay_ms) == 1:
        args.worker_delay_ms *= world - 1
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=timedelta(seconds=args.timeout_s))
    try:
        run(args, rank, world)
    finally:
        gc.collect()  # free reference cycles holding the group while Python is alive
        dist.destroy_process_group()


def run(args, rank, world):
    torch.set_num_threads(1)  # tiny model; the ranks share the cores
    workers, worker = world - 1, rank - 1  # rank 0 is the server / coordinator
    group = dist.new_group(list(range(1, world)))  # collective calls by every rank, used by workers
    results = {}
    if rank == 0:
        print(f"1 parameter server + {workers} workers | delays "
              f"{' '.join(f'{d:g}' for d in args.worker_delay_ms)} ms/step | {args.steps} steps "
              f"x batch {args.batch_size} per worker | lr {args.lr:g}", flush=True)
    for mode in args.modes:
        dist.barrier()
        t0 = time.perf_counter()
        row = {}
        if mode == "async":
            if rank == 0:
                model, losses, staleness = parameter_server(args, workers)
                row = {"losses": losses, "staleness": staleness}
            else:
                row = {"pushes": async_worker(args, worker, workers)}
        elif rank > 0:
            model, losses, allreduces = run_sync_or_local(args, mode, worker, workers, group)
            row = {"losses": losses, "allreduces": allreduces}
        row["wall_s"] = time.perf_counter() - t0
        holder = 0 if mode == "async" else 1  # the rank that holds the final weights
        if rank == holder:
            row["eval_loss"] = eval_loss(args, model)
            if args.export_dir:
                args.export_dir.mkdir(parents=True, exist_ok=True)
                torch.save({k: v.detach().clone() for k, v in model.state_dict().items()},
                           args.export_dir / f"{mode}.pt")
        gathered = [None] * world
        dist.all_gather_object(gathered, row)
        results[mode] = gathered
    if rank == 0:
        report(args, workers, results)
    dist.barrier()


def report(args, workers, results):
    summary = {}
    for mode, rows in results.items():
        if mode == "async":
            server = rows[0]
            stale = server["staleness"]
            summary[mode] = {
                "losses": server["losses"], "eval_loss": server["eval_loss"],
                "wall_s": max(r["wall_s"] for r in rows),
                "gradients_applied": len(server["losses"]),
                "pushes_per_worker": [r["pushes"] for r in rows[1:]],
                "staleness_per_worker": {str(w): s for w, s in stale.items()},
                "mean_staleness_per_worker": [statistics.mean(stale[w]) if stale[w] else 0.0
                                              for w in range(workers)],
                "max_staleness": max((max(s) for s in stale.values() if s), default=0)}
        else:
            first = rows[1]
            summary[mode] = {"losses": first["losses"], "eval_loss": first["eval_loss"],
                             "wall_s": max(r["wall_s"] for r in rows[1:]),
                             "gradients_applied": args.steps * workers,
                             "allreduces": first["allreduces"]}
    for mode, s in summary.items():
        curve = s["losses"]
        marks = sorted({0, len(curve) // 2, len(curve) - 1})
        line = " ".join(f"{curve[i]:.3f}" for i in marks)
        extra = (f"all-reduces {s['allreduces']}" if mode != "async" else
                 f"gradients by worker {s['pushes_per_worker']} (last one dropped at STOP)")
        print(f"{mode:<5} | {s['wall_s']:5.2f} s | train loss {line} | held-out loss "
              f"{s['eval_loss']:.4f} | {extra}", flush=True)
    if "async" in summary:
        s = summary["async"]
        means = " ".join(f"w{w}: {m:.2f}" for w, m in enumerate(s["mean_staleness_per_worker"]))
        print(f"async staleness (server updates between a worker's pull and its push): mean "
              f"{means} | max {s['max_staleness']}", flush=True)
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps({"workers": workers, "steps": args.steps,
                                             "local_steps": args.local_steps,
                                             "worker_delay_ms": args.worker_delay_ms,
                                             "modes": summary}, indent=1))


if __name__ == "__main__":
    main()

"""Point-to-point communication: blocking send/recv, isend/irecv, batch_isend_irecv, and the
classic deadlock (behind --deadlock) with its two fixes.

Launch (from the repository root):
    torchrun --nproc_per_node=2 04-nccl-operations/point_to_point.py             # any n from 2
    torchrun --nproc_per_node=4 04-nccl-operations/point_to_point.py --device cuda
    torchrun --nproc_per_node=2 04-nccl-operations/point_to_point.py --deadlock --timeout-s 3
                                                          # the patterns, then the bug: exits 1

Expected output (the --deadlock command above, 2-core AMD EPYC CPU (shared), torch 2.14.1, gloo):
    point_to_point | world 2 | device cpu | backend gloo | 1048576 floats per message
    pattern                              what every rank checks                   check
    send/recv ping-pong (0 <-> 1)        rank 0 gets back 10 x what it sent       PASS
    isend/irecv ring shift               got rank-1's message                     PASS
    blocking ring, even sends first      got rank-1's message                     PASS
    batch_isend_irecv ring all-gather    holds all n blocks, row k = k            PASS
    --deadlock: every rank now calls send() before recv(); waiting up to 3 s ...
    [rank 0] error: deadlock: send to rank 1 did not complete within 3 s (Timed out waiting 3000ms
    for send operation to complete). Every rank is in a blocking send and nobody receives; ...

Unlike a collective, a point-to-point call involves two ranks: the sender names the receiver
(dst) and the receiver names the sender (src), and the two calls must match in size and dtype.
A blocking send returns once its data is handed over; on gloo that is when the receiver has
posted the matching recv, on NCCL small messages may be buffered but large ones wait too. So:

    every rank:  send(to right)  -> recv(from left)      DEADLOCK: nobody is receiving
    fix 1:       even ranks send first, odd ranks receive first (the chain is broken)
    fix 2:       isend + irecv posted together, then wait (batch_isend_irecv: one group launch)
"""

import argparse
import gc
import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist


def fail(msg: str) -> None:
    """Bad input: one line on stderr and exit status 2, on every rank, before any collective."""
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID"))
    prefix = f"[rank {rank}] " if rank is not None else ""
    print(f"{prefix}error: {msg}", file=sys.stderr, flush=True)
    sys.exit(2)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.error = fail
    p.add_argument("--numel", type=int, default=1 << 20,
                   help="float32 elements per message in the exchanges (4 MiB by default)")
    p.add_argument("--deadlock", action="store_true",
                   help="after the patterns, every rank sends first with blocking calls: hangs "
                        "until --timeout-s, then exits 1")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--timeout-s", type=float, default=120, help="collective timeout")
    p.add_argument("--json-out", type=Path, help="rank 0 writes the checks here")
    args = p.parse_args(argv)
    if args.numel < 1 or args.timeout_s <= 0:
        fail(f"--numel must be >= 1 and --timeout-s > 0, got {args.numel} and {args.timeout_s}")
    return args


def init_distributed(device_arg: str, timeout_s: float):
    """(rank, world, device); gloo on CPU, NCCL on CUDA; a one-process group under plain python."""
    env = os.environ
    if "RANK" not in env and "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env:
        env["RANK"], env["WORLD_SIZE"] = env["SLURM_PROCID"], env["SLURM_STEP_NUM_TASKS"]
        env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
        if "MASTER_ADDR" not in env:  # the first host of the step's allocation
            nodes = env.get("SLURM_STEP_NODELIST", env.get("SLURM_JOB_NODELIST", "127.0.0.1"))
            out = subprocess.run(["scontrol", "show", "hostnames", nodes], capture_output=True,
                                 text=True, check=False).stdout.split()
            env["MASTER_ADDR"] = out[0] if out else nodes
        env.setdefault("MASTER_PORT", str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000))
    rank, world = int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1))
    local_rank = int(env.get("LOCAL_RANK", 0))
    if world < 2:  # checked before the process group exists: nobody is left waiting
        fail("point-to-point needs at least 2 ranks: torchrun --nproc_per_node=2 "
             "04-nccl-operations/point_to_point.py")
    if device_arg == "cuda" and not torch.cuda.is_available():
        fail("--device cuda was asked for, but CUDA is not available on this machine")
    if device_arg == "cuda" or (device_arg == "auto" and torch.cuda.is_available()):
        if local_rank >= torch.cuda.device_count():
            fail(f"local rank {local_rank} has no GPU: only {torch.cuda.device_count()} visible")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    return rank, world, device


# --------------------------------------------------------------------------------------------------
# The patterns. Each runs on every rank and returns whether this rank got what it should.


def message(rank: int, numel: int, device) -> torch.Tensor:
    """What `rank` sends: numel floats, all equal to its rank, so a receiver can tell who sent."""
    return torch.full((numel,), float(rank), device=device)


def ping_pong(rank, world, numel, device) -> bool:
    """Blocking send/recv between ranks 0 and 1; the others are not involved and return at once."""
    if rank == 0:
        x = torch.arange(3.0, device=device)
        dist.send(x, dst=1)  # returns once rank 1 has taken the data
        back = torch.empty(3, device=device)
        dist.recv(back, src=1)
        return torch.equal(back, x * 10)
    if rank == 1:
        x = torch.empty(3, device=device)
        dist.recv(x, src=0)
        dist.send(x * 10, dst=0)
    return True


def ring_shift_isend_irecv(rank, world, numel, device) -> bool:
    """Every rank sends to rank+1 and receives from rank-1; both calls return at once and the
    transfers run while this rank is free to compute, until wait()."""
    right, left = (rank + 1) % world, (rank - 1) % world
    got = torch.empty(numel, device=device)
    # gloo accepts either order. NCCL queues the p2p calls between two ranks in issue order on
    # one CUDA stream, so "isend, then irecv" on both ranks of a pair could still wait on each
    # other; the even/odd order below is safe everywhere (batch_isend_irecv is the other way).
    if rank % 2 == 0:
        works = [dist.isend(message(rank, numel, device), dst=right), dist.irecv(got, src=left)]
    else:
        works = [dist.irecv(got, src=left), dist.isend(message(rank, numel, device), dst=right)]
    for work in works:
        work.wait()
    return torch.equal(got, message(left, numel, device))


def ordered_blocking_ring(rank, world, numel, device) -> bool:
    """Fix 1: the deadlocking ring with blocking calls, but even ranks send first and odd ranks
    receive first. Rank 1 receives from rank 0 before sending, so the cycle of waits is broken
    (also for odd n: rank n-1 and rank 0 are both even, and rank 0 finishes its send to rank 1
    before it posts its receive from rank n-1)."""
    right, left = (rank + 1) % world, (rank - 1) % world
    got = torch.empty(numel, device=device)
    if rank % 2 == 0:
        dist.send(message(rank, numel, device), dst=right)
        dist.recv(got, src=left)
    else:
        dist.recv(got, src=left)
        dist.send(message(rank, numel, device), dst=right)
    return torch.equal(got, message(left, numel, device))


def ring_all_gather(rank, world, numel, device) -> bool:
    """Fix 2 at work: an all-gather built from n-1 batch_isend_irecv steps around the ring.

    Step s: send the block that arrived at step s-1 (at step 0, our own) to the right and receive
    the next block from the left. After n-1 steps every rank holds every block - exactly the
    second phase of the ring all-reduce in ring_allreduce.py.
    """
    right, left = (rank + 1) % world, (rank - 1) % world
    blocks = torch.empty(world, numel, device=device)  # row k: rank k's block
    blocks[rank] = message(rank, numel, device)
    for s in range(world - 1):
        send_row, recv_row = (rank - s) % world, (rank - s - 1) % world
        ops = [dist.P2POp(dist.isend, blocks[send_row], right),
               dist.P2POp(dist.irecv, blocks[recv_row], left)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    want = torch.arange(world, dtype=torch.float32, device=device)[:, None].expand(world, numel)
    return torch.equal(blocks, want)


PATTERNS = [
    ("send/recv ping-pong (0 <-> 1)", ping_pong, "rank 0 gets back 10 x what it sent"),
    ("isend/irecv ring shift", ring_shift_isend_irecv, "got rank-1's message"),
    ("blocking ring, even sends first", ordered_blocking_ring, "got rank-1's message"),
    ("batch_isend_irecv ring all-gather", ring_all_gather, "holds all n blocks, row k = k"),
]


def run_patterns(rank, world, numel, device) -> list[dict]:
    rows = []
    for label, fn, what in PATTERNS:
        ok = torch.tensor([float(fn(rank, world, numel, device))], device=device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # PASS only if every rank passed
        rows.append({"pattern": label, "check": what, "world_size": world, "numel": numel,
                     "pass": bool(ok.item())})
    return rows


def deadlock(rank, world, numel, device, timeout_s) -> None:
    """The bug: every rank calls a blocking send first. Each send waits for a receiver, every
    receiver is itself stuck in send, and the process group's timeout ends it."""
    right, left = (rank + 1) % world, (rank - 1) % world
    got = torch.empty(numel, device=device)
    try:
        dist.send(message(rank, numel, device), dst=right)  # gloo: blocks here, on every rank
        dist.recv(got, src=left)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # NCCL only queued the calls: the wait shows up here
    except RuntimeError as exc:
        reason = str(exc).strip().splitlines()[0].split("] ")[-1]  # drop gloo's [file:line]
        if "Connection closed by peer" in reason:  # the peer timed out first and exited
            reason = "the peer gave up first and closed the connection"
        sys.stderr.write(
            f"[rank {rank}] error: deadlock: send to rank {right} did not complete within "
            f"{timeout_s:g} s ({reason}). Every rank is in a blocking send and nobody receives; "
            "the patterns above show the two fixes\n")
        sys.stderr.flush()
        sys.exit(1)


def main(argv=None):
    args = parse_args(argv)
    rank, world, device = init_distributed(args.device, args.timeout_s)
    try:
        rows = run_patterns(rank, world, args.numel, device)
        if rank == 0:
            print(f"point_to_point | world {world} | device {device} | backend "
                  f"{dist.get_backend()} | {args.numel} floats per message")
            print(f"{'pattern':<36} {'what every rank checks':<40} check")
            for row in rows:
                print(f"{row['pattern']:<36} {row['check']:<40} "
                      f"{'PASS' if row['pass'] else 'FAIL'}", flush=True)
            if args.json_out:
                args.json_out.parent.mkdir(parents=True, exist_ok=True)
                args.json_out.write_text(json.dumps(rows, indent=1))
        if args.deadlock:
            if rank == 0:
                print(f"--deadlock: every rank now calls send() before recv(); waiting up to "
                      f"{args.timeout_s:g} s ...", flush=True)
            deadlock(rank, world, args.numel, device, args.timeout_s)
    finally:
        gc.collect()  # free reference cycles holding the group while Python is alive
        dist.destroy_process_group()
    if not all(row["pass"] for row in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()

"""Point-to-point communication: blocking send/recv, isend/irecv, batch_isend_irecv, and the
classic deadlock (behind --deadlock) with its two fixes.

Launch (from the repository root):
    torchrun --nproc_per_node=2 04-nccl-operations/point_to_point.py             # any n from 2
    torchrun --nproc_per_node=4 04-nccl-operations/point_to_point.py --device cuda
    torchrun --nproc_per_node=2 04-nccl-operations/point_to_point.py --deadlock --timeout-s 3
                                                          # the patterns, then the bug: exits 1

Unlike a collective, a point-to-point call involves two ranks: the sender names the receiver
(dst) and the receiver names the sender (src), and the two calls must match in size and dtype.
"Blocking" does not mean the same on every backend. On gloo dist.send returns once the receiver
has posted the matching recv and taken the data. On NCCL dist.send usually returns to Python at
once: it queues the send on the process group's one NCCL stream, which all its unbatched sends and
receives share, and the stream waits for the receiver whenever NCCL cannot buffer the message (a
later recv, queued behind it, waits too). So on gloo always, and on NCCL with messages it cannot
buffer (in Python or on the GPU):

    every rank:  send(to right)  -> recv(from left)      DEADLOCK: nobody is receiving
    fix 1:       even ranks send first, odd ranks receive first (the chain is broken)
    fix 2:       isend + irecv posted together, then wait (batch_isend_irecv: one group launch)
"""

import sys
import time

import torch
import torch.distributed as dist

from dtcourse import cli, launch, report

# --------------------------------------------------------------------------------------------------
# The patterns. Each runs on every rank and returns whether this rank got what it should.


def message(rank: int, numel: int, device) -> torch.Tensor:
    """What `rank` sends: numel floats, all equal to its rank, so a receiver can tell who sent."""
    return torch.full((numel,), float(rank), device=device)


def ping_pong(rank, world, numel, device) -> bool:
    """Blocking send/recv between ranks 0 and 1; the others are not involved and return at once."""
    if rank == 0:
        x = torch.arange(3.0, device=device)
        dist.send(x, dst=1)  # gloo: returns once rank 1 has taken the data; NCCL: at once
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
    # gloo accepts either order. On NCCL every unbatched send and recv of the process group is
    # queued, in issue order, on the group's one NCCL stream (the communicator is created at
    # start-up, and torch then serialises unbatched p2p ops with all the group's other ops), so
    # "isend, then irecv" on both ranks could still wait on each other; the even/odd order below
    # is safe everywhere (batch_isend_irecv is the other way).
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
    ("fix 1: blocking ring, even sends first", ordered_blocking_ring, "got rank-1's message"),
    ("fix 2: batch_isend_irecv ring all-gather", ring_all_gather, "holds all n blocks, row k = k"),
]


def run_patterns(rank, world, numel, device) -> list[dict]:
    rows = []
    for label, fn, what in PATTERNS:
        ok = torch.tensor([float(fn(rank, world, numel, device))], device=device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # PASS only if every rank passed
        rows.append({"pattern": label, "check": what, "world_size": world, "numel": numel,
                     "pass": bool(ok.item())})
    return rows


# --------------------------------------------------------------------------------------------------
# The deadlock


def deadlock(rank, world, numel, device, timeout_s) -> None:
    """The bug: every rank calls a blocking send first. Each send waits for a receiver, every
    receiver is itself stuck in send, and the process group's timeout ends it.

    That is gloo's behaviour, which the except below reports. On NCCL the process group's
    communicator exists from start-up (dtcourse.launch passes device_id to init_process_group),
    and the group's unbatched sends and receives share its one NCCL stream: the send makes the
    stream wait for it and the recv waits behind it, so a message NCCL can buffer gets through and
    a larger one waits for a receive that is never posted. On a pair's first exchange NCCL also
    sets up the connection between the two ranks, which can itself block inside dist.send on the
    host. That hang ends, by default, with NCCL's watchdog tearing the process down after the
    timeout, not with an exception here."""
    right, left = (rank + 1) % world, (rank - 1) % world
    got = torch.empty(numel, device=device)
    try:
        dist.send(message(rank, numel, device), dst=right)  # gloo: blocks here, on every rank
        dist.recv(got, src=left)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # NCCL: the hang, if any, is here (see above)
    except RuntimeError as exc:
        reason = str(exc).strip().splitlines()[0].split("] ")[-1]  # drop gloo's [file:line]
        if "Connection closed by peer" in reason:  # the peer timed out first and exited
            reason = "the peer gave up first and closed the connection"
        sys.stderr.write(
            f"[rank {rank}] error: deadlock: send to rank {right} did not complete within "
            f"{timeout_s:g} s. Every rank is in a blocking send and nobody receives; "
            f"the patterns above show the two fixes\n[rank {rank}]   ({dist.get_backend()}: "
            f"{reason})\n")
        sys.stderr.flush()
        # torchrun stops the other ranks as soon as one exits: stay a little, so that they
        # too have reported (their call fails moments after this one's).
        time.sleep(2)
        sys.exit(1)


# --------------------------------------------------------------------------------------------------
# Report, arguments and launch


def print_table(args, d, rows) -> None:
    """Rank 0 prints the checks and writes --json-out."""
    if d.rank != 0:
        return
    print(f"point_to_point | world {d.world_size} | device {d.device} | backend {d.backend} | "
          f"{args.numel} floats per message")
    print(f"{'pattern':<41} {'what every rank checks':<36} check")
    for row in rows:
        print(f"{row['pattern']:<41} {row['check']:<36} {'PASS' if row['pass'] else 'FAIL'}",
              flush=True)
    if args.json_out:
        report.write_json(args.json_out, rows)


def parse_args(argv=None):
    p = cli.parser(__doc__)
    cli.add_run_args(p, seed=False)
    cli.add_output_args(p, metrics=False, export=False, json_out=True)
    p.add_argument("--numel", type=int, default=1 << 20,
                   help="float32 elements per message in the exchanges (4 MiB by default)")
    p.add_argument("--deadlock", action="store_true",
                   help="after the patterns, every rank sends first with blocking calls: hangs "
                        "until --timeout-s, then exits 1")
    args = p.parse_args(argv)
    if args.numel < 1:
        cli.fail(f"--numel must be >= 1, got {args.numel}")
    cli.check_positive(args, "timeout_s")
    return args


def main(argv=None):
    args = parse_args(argv)
    with launch.distributed(args.device, args.timeout_s) as d:
        if d.world_size < 2:  # every rank sees the same world: all fail, none waits
            cli.fail("point-to-point needs at least 2 ranks: torchrun --nproc_per_node=2 "
                     "04-nccl-operations/point_to_point.py")
        rows = run_patterns(d.rank, d.world_size, args.numel, d.device)
        print_table(args, d, rows)
        if args.deadlock:
            report.print0(f"--deadlock: every rank now calls send() before recv(); waiting up to "
                          f"{args.timeout_s:g} s ...")
            deadlock(d.rank, d.world_size, args.numel, d.device, args.timeout_s)
    if not all(row["pass"] for row in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()

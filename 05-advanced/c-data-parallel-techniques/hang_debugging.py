"""Four ways a distributed job hangs, each turned into a clear error within --timeout-s.

Launch (from the repository root); each command fails on purpose, exit status 1:
    torchrun --nproc_per_node=2 05-advanced/c-data-parallel-techniques/hang_debugging.py \\
        --bug mismatch
    torchrun --nproc_per_node=2 05-advanced/c-data-parallel-techniques/hang_debugging.py \\
        --bug missing-rank
    torchrun --nproc_per_node=2 05-advanced/c-data-parallel-techniques/hang_debugging.py \\
        --bug shape --debug off
    torchrun --nproc_per_node=2 05-advanced/c-data-parallel-techniques/hang_debugging.py \\
        --bug p2p-deadlock

    mismatch       ranks disagree on the order of two collectives (all_reduce vs broadcast)
    missing-rank   one rank never reaches the collective (stuck reading a batch)
    shape          ranks all-reduce tensors of different sizes (an uneven last batch)
    p2p-deadlock   two pipeline stages both wait to receive before they send

What turns a silent hang into a message, all shown here:
  * the process-group timeout (`init_process_group(timeout=...)`, our --timeout-s): a collective
    that waits longer raises instead of blocking forever (NCCL: TORCH_NCCL_ASYNC_ERROR_HANDLING's
    default, 3, tears the process down without aborting the communicators, so that an abort that
    itself hangs cannot keep the job alive; 2 aborts the communicators and keeps the process, 1
    does both);
  * TORCH_DISTRIBUTED_DEBUG=DETAIL (--debug detail, the default): before every collective the
    ranks compare what they are about to run (op, shapes, dtypes) and a monitored barrier names
    the rank that did not arrive. It costs an extra round trip per collective: debugging only;
  * a stack dump of every rank that is still stuck (faulthandler here; `py-spy dump --pid PID`
    from outside on a live job), which shows *where* each rank waits;
  * on NCCL, the flight recorder: each rank keeps its last collectives in a ring buffer (2000
    entries by default) and writes them when the watchdog times out, to files named by
    TORCH_FR_DUMP_TEMP_FILE (older name TORCH_NCCL_DEBUG_INFO_TEMP_FILE; default prefix
    /tmp/nccl_trace_rank_, one file per rank); `torchfrtrace DIR` (python -m
    torch.distributed.flight_recorder.fr_trace) reads the ranks' files together and names the
    collective they disagree on. On NCCL a py-spy stack shows where the host next waits (a
    .item(), a synchronize), not the collective that hung: the host only queued it.

The bugs run on gloo (CPU) and the errors quoted are gloo's; the same tools apply on NCCL.
"""

import faulthandler
import os
import re
import sys
import time

import torch
import torch.distributed as dist

from dtcourse import cli, launch

SCRIPT = "05-advanced/c-data-parallel-techniques/hang_debugging.py"
# CPU and gloo only (no --device): the stuck ranks are shown with gloo's per-collective timeout
# and DETAIL's monitored barrier (a gloo feature); on NCCL the watchdog tears the process down
# instead. The device check and the GPU tier read this name: the script refuses CUDA by design.
GLOO_ONLY = "the hangs are shown with gloo's timeouts and its monitored barrier"


# --------------------------------------------------------------------------------------------------
# The bugs: each function is what a training loop does wrong on some rank


def bug_mismatch(rank, world, timeout_s):
    loss, stop = torch.ones(1), torch.zeros(1)
    if rank == 0:  # rank 0 reports the loss first, then shares the stop flag...
        dist.all_reduce(loss)
        dist.broadcast(stop, src=0)
    else:  # ...the others check the flag first: the first collectives do not match
        dist.broadcast(stop, src=0)
        dist.all_reduce(loss)


def bug_missing_rank(rank, world, timeout_s):
    if rank == 1:
        # Stuck, e.g. reading a batch from a hung filesystem. (It gives up on its own after a
        # while so the demo ends even without a launcher that kills the others' peers.)
        time.sleep(timeout_s + 30)
        raise RuntimeError(f"rank 1 was stuck for {timeout_s + 30:g} s (simulated)")
    dist.all_reduce(torch.ones(4))


def bug_shape(rank, world, timeout_s):
    # Per-sample losses of an uneven last batch: 4 samples on rank 0, 3 on the others.
    per_sample = torch.ones(4 if rank == 0 else 3)
    dist.all_reduce(per_sample)


def bug_p2p_deadlock(rank, world, timeout_s):
    # Stages 0 and 1 exchange activations / gradients; both post a blocking recv first, so
    # neither reaches its send. (Collective checks do not cover point-to-point: only the timeout
    # ends this one.)
    peer = 1 - rank if rank < 2 else None
    if peer is None:
        return
    incoming = torch.empty(8)
    dist.recv(incoming, src=peer)
    dist.send(torch.ones(8), dst=peer)


BUGS = {"mismatch": bug_mismatch, "missing-rank": bug_missing_rank, "shape": bug_shape,
        "p2p-deadlock": bug_p2p_deadlock}
HINTS = {
    "mismatch": "every rank must issue the same collectives in the same order; look for a "
                "collective inside `if rank == ...` or a rank-dependent loop",
    "missing-rank": "the named rank never arrived: dump its stack (py-spy dump) to see where it "
                    "waits: data loading, a filesystem, an exception swallowed on that rank",
    "shape": "all ranks must pass tensors of the same shape; pad or drop an uneven last batch "
             "(DistributedSampler(drop_last=True)) or all-reduce a fixed-size [sum, count]",
    "p2p-deadlock": "both sides wait in recv: post the receives and sends together with "
                    "dist.batch_isend_irecv (or order them: even ranks send first)",
}


# --------------------------------------------------------------------------------------------------
# Turning the hang into one line: the timeout raises, the stack dump shows where each rank waits


def short(message: str) -> str:
    """The informative part of a c10d error: the first line, without TensorOptions noise."""
    line = message.strip().splitlines()[0] if message.strip() else repr(message)
    return re.sub(r", TensorDeviceTypes=TensorOptions\(.*?\(nullopt\)\)\)", ")", line)


def run_bug(args, d) -> int:
    """Run the bug on this rank; 1 (and the error and a hint on stderr) when it raised."""
    # Where to look from outside while a job hangs (py-spy is `pip install py-spy`).
    pids = [None] * d.world_size
    dist.all_gather_object(pids, os.getpid())
    if d.rank == 0:
        print(f"bug {args.bug} | TORCH_DISTRIBUTED_DEBUG={os.environ['TORCH_DISTRIBUTED_DEBUG']}"
              f" | timeout {args.timeout_s:g} s | stacks of waiting ranks dumped after "
              f"{args.stack_dump_s:g} s", flush=True)
        print("a live hang is inspected with: " + " ; ".join(
            f"py-spy dump --pid {pid}  # rank {r}" for r, pid in enumerate(pids)), flush=True)
    # Rank r dumps 0.1 r s later than rank 0: the ranks share one stderr, and dumps written at
    # the same moment interleave character by character.
    faulthandler.dump_traceback_later(args.stack_dump_s + 0.1 * d.rank, exit=False)
    t0 = time.perf_counter()  # host clock: how long the host waits before an error
    try:
        BUGS[args.bug](d.rank, d.world_size, args.timeout_s)
    except Exception as exc:  # noqa: BLE001 - the point: turn any hang into one clear line
        faulthandler.cancel_dump_traceback_later()
        # One write for both lines: the ranks share stderr, and a single small write to a pipe is
        # not interleaved with another process's.
        waited = time.perf_counter() - t0  # host clock: as above
        sys.stderr.write(f"[rank {d.rank}] error after {waited:.1f} s "
                         f"(--timeout-s {args.timeout_s:g}): {type(exc).__name__}: "
                         f"{short(str(exc))}\n[rank {d.rank}] hint: {HINTS[args.bug]}\n")
        sys.stderr.flush()
        # The other ranks usually fail at the same moment; torchrun stops every rank as soon as
        # one exits, so wait a little for theirs to print their lines too.
        time.sleep(0.5)
        return 1
    faulthandler.cancel_dump_traceback_later()
    if d.rank == 0:
        print("no error: this rank finished its part of the bug", flush=True)
    return 0


# --------------------------------------------------------------------------------------------------
# Arguments and launch


def parse_args(argv=None):
    p = cli.parser(__doc__)
    p.add_argument("--bug", choices=list(BUGS), required=True)
    p.add_argument("--debug", choices=["detail", "off"], default="detail",
                   help="detail sets TORCH_DISTRIBUTED_DEBUG=DETAIL before the group is created")
    p.add_argument("--timeout-s", type=float, default=5, help="process-group timeout")
    p.add_argument("--stack-dump-s", type=float,
                   help="dump the Python stack of every rank still waiting after this many "
                        "seconds (default: half of --timeout-s)")
    args = p.parse_args(argv)
    cli.check_positive(args, "timeout_s", "stack_dump_s")
    if args.stack_dump_s is None:
        args.stack_dump_s = args.timeout_s / 2
    return args


def main(argv=None):
    args = parse_args(argv)
    # The debug level must be set before the group is created: DETAIL wraps it in a checker.
    os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL" if args.debug == "detail" else "OFF"
    dist.set_debug_level_from_env()  # torch read the variable at import; read it again
    with launch.distributed("cpu", args.timeout_s) as d:
        if d.world_size < 2:
            cli.fail(f"these bugs need at least 2 ranks: torchrun --nproc_per_node=2 {SCRIPT} "
                     f"--bug ...")
        status = run_bug(args, d)
    sys.exit(status)


if __name__ == "__main__":
    main()

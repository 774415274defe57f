"""Four ways a distributed job hangs, each turned into a clear error within --timeout-s.

Launch (from the repository root); each command fails on purpose, exit status 1:
    torchrun --nproc_per_node=2 05-advanced/hang_debugging.py --bug mismatch
    torchrun --nproc_per_node=2 05-advanced/hang_debugging.py --bug missing-rank
    torchrun --nproc_per_node=2 05-advanced/hang_debugging.py --bug shape --debug off
    torchrun --nproc_per_node=2 05-advanced/hang_debugging.py --bug p2p-deadlock

Expected output (stderr of rank 0, 2-core AMD EPYC CPU (shared), torch 2.14.1, gloo; full runs
with the stack dumps in 05-advanced/README.md, part 05c):
    --bug mismatch:      error after 0.0 s (--timeout-s 5): RuntimeError: Detected mismatch
                         between collectives on ranks. ... Op type: ALLREDUCEvs BROADCAST
    --bug missing-rank:  error after 5.0 s (--timeout-s 5): RuntimeError: [Rank 0]: Ranks 1
                         failed to pass monitoredBarrier in 5000 ms
    --bug shape:         error after 0.0 s (--timeout-s 5): RuntimeError: Detected mismatch
                         between collectives on ranks. ... Tensor Tensor shapes: 4vs 3
    --bug p2p-deadlock:  error after 5.0 s (--timeout-s 5): RuntimeError: [...] Timed out
                         waiting 5000ms for recv operation to complete

    mismatch       ranks disagree on the order of two collectives (all_reduce vs broadcast)
    missing-rank   one rank never reaches the collective (stuck reading a batch)
    shape          ranks all-reduce tensors of different sizes (an uneven last batch)
    p2p-deadlock   two pipeline stages both wait to receive before they send

What turns a silent hang into a message, all shown here:
  * the process-group timeout (`init_process_group(timeout=...)`, our --timeout-s): a collective
    that waits longer raises instead of blocking forever (NCCL: also keep
    TORCH_NCCL_ASYNC_ERROR_HANDLING at its default, which aborts the communicator);
  * TORCH_DISTRIBUTED_DEBUG=DETAIL (--debug detail, the default): before every collective the
    ranks compare what they are about to run (op, shapes, dtypes) and a monitored barrier names
    the rank that did not arrive. It costs an extra round trip per collective: debugging only;
  * a stack dump of every rank that is still stuck (faulthandler here; `py-spy dump --pid PID`
    from outside on a live job), which shows *where* each rank waits;
  * on NCCL, the flight recorder: TORCH_NCCL_TRACE_BUFFER_SIZE=2000 TORCH_NCCL_DUMP_ON_TIMEOUT=1
    write the last collectives of every rank when one times out.
"""

import argparse
import faulthandler
import gc
import os
import re
import subprocess
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def fail(msg: str) -> None:
    """Bad input: one line on stderr and exit status 2, on every rank, before any collective."""
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID"))
    prefix = f"[rank {rank}] " if rank is not None else ""
    print(f"{prefix}error: {msg}", file=sys.stderr, flush=True)
    sys.exit(2)


BUGS = ("mismatch", "missing-rank", "shape", "p2p-deadlock")
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


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.error = fail
    p.add_argument("--bug", choices=BUGS, required=True)
    p.add_argument("--debug", choices=["detail", "off"], default="detail",
                   help="detail sets TORCH_DISTRIBUTED_DEBUG=DETAIL before the group is created")
    p.add_argument("--timeout-s", type=float, default=5, help="process-group timeout")
    p.add_argument("--stack-dump-s", type=float,
                   help="dump the Python stack of every rank still waiting after this many "
                        "seconds (default: half of --timeout-s)")
    args = p.parse_args(argv)
    if args.timeout_s <= 0:
        fail(f"--timeout-s must be positive, got {args.timeout_s}")
    if args.stack_dump_s is None:
        args.stack_dump_s = args.timeout_s / 2
    return args


def init_distributed(timeout_s: float, debug: str):
    """(rank, world) on gloo. The debug level must be set before the group is created: DETAIL
    wraps the process group in a checker. Works under torchrun and srun (explained in
    01-ddp-basics/ddp_training.py)."""
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
    if world < 2:
        fail("these bugs need at least 2 ranks: torchrun --nproc_per_node=2 "
             "05-advanced/hang_debugging.py --bug ...")
    env["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL" if debug == "detail" else "OFF"
    dist.set_debug_level_from_env()  # torch read the variable at import; read it again
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    return rank, world


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


BUG_FUNCTIONS = {"mismatch": bug_mismatch, "missing-rank": bug_missing_rank, "shape": bug_shape,
                 "p2p-deadlock": bug_p2p_deadlock}


def short(message: str) -> str:
    """The informative part of a c10d error: the first line, without TensorOptions noise."""
    line = message.strip().splitlines()[0] if message.strip() else repr(message)
    return re.sub(r", TensorDeviceTypes=TensorOptions\(.*?\(nullopt\)\)\)", ")", line)


def main(argv=None):
    args = parse_args(argv)
    rank, world = init_distributed(args.timeout_s, args.debug)
    status = 0
    try:
        # Where to look from outside while a job hangs (py-spy is `pip install py-spy`).
        pids = [None] * world
        dist.all_gather_object(pids, os.getpid())
        if rank == 0:
            level = os.environ["TORCH_DISTRIBUTED_DEBUG"]
            print(f"bug {args.bug} | TORCH_DISTRIBUTED_DEBUG={level} | timeout "
                  f"{args.timeout_s:g} s | stacks of waiting ranks dumped after "
                  f"{args.stack_dump_s:g} s", flush=True)
            print("a live hang is inspected with: " + " ; ".join(
                f"py-spy dump --pid {pid}  # rank {r}" for r, pid in enumerate(pids)), flush=True)
        # Rank r dumps 0.1 r s later than rank 0: the ranks share one stderr, and dumps written at
        # the same moment interleave character by character.
        faulthandler.dump_traceback_later(args.stack_dump_s + 0.1 * rank, exit=False)
        t0 = time.perf_counter()
        try:
            BUG_FUNCTIONS[args.bug](rank, world, args.timeout_s)
        except Exception as exc:  # noqa: BLE001 - the point: turn any hang into one clear line
            faulthandler.cancel_dump_traceback_later()
            print(f"[rank {rank}] error after {time.perf_counter() - t0:.1f} s "
                  f"(--timeout-s {args.timeout_s:g}): {type(exc).__name__}: {short(str(exc))}",
                  file=sys.stderr, flush=True)
            print(f"[rank {rank}] hint: {HINTS[args.bug]}", file=sys.stderr, flush=True)
            status = 1
        else:
            faulthandler.cancel_dump_traceback_later()
            if rank == 0:
                print("no error: this rank finished its part of the bug", flush=True)
    finally:
        gc.collect()  # free reference cycles holding the group while Python is alive
        dist.destroy_process_group()
    sys.exit(status)


if __name__ == "__main__":
    main()

"""Every collective once, with inputs you can predict and the expected result in closed form.

Launch (from the repository root):
    python 04-nccl-operations/collective_ops.py                          # 1 process: n = 1
    torchrun --nproc_per_node=4 04-nccl-operations/collective_ops.py     # any n from 1 to 8 on CPU
    torchrun --nproc_per_node=8 04-nccl-operations/collective_ops.py --device cuda
    torchrun --nproc_per_node=2 04-nccl-operations/collective_ops.py --mismatch-demo --timeout-s 5

Each row of the table runs one collective on every rank r of n with a rank-dependent input, and
every rank compares its own result with the closed form; PASS means all n ranks matched. The
values are small integers stored as float32, so the comparison is exact. The script exits 1 if
any row fails.

--mismatch-demo reproduces the most common hang (nccl_debugging.md walks through it): rank 0
enters an all_reduce the other ranks never call, and everybody waits until --timeout-s.
"""

import re
import sys
import time

import torch
import torch.distributed as dist

from dtcourse import cli, launch, report

# torch 2.14 deprecates all_gather_into_tensor / reduce_scatter_tensor for the *_single names.
all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# --------------------------------------------------------------------------------------------------
# The collectives. Each function runs on every rank r of n and returns (result on this rank,
# expected result on this rank); expected is None where the collective defines no result (the
# non-root ranks of reduce and gather).


def vec(values, device):
    return torch.tensor(values, dtype=torch.float32, device=device)


def broadcast(r, n, dev):
    x = vec([r, r], dev)
    dist.broadcast(x, src=n - 1)  # the last rank's tensor overwrites everybody's
    return x, vec([n - 1, n - 1], dev)


def reduce(r, n, dev):
    x = vec([r + 1], dev)
    dist.reduce(x, dst=0, op=dist.ReduceOp.SUM)  # only rank 0's tensor is defined afterwards
    return x, vec([n * (n + 1) / 2], dev) if r == 0 else None


def all_reduce_sum(r, n, dev):
    x = vec([r + 1, 1], dev)
    dist.all_reduce(x, op=dist.ReduceOp.SUM)
    return x, vec([n * (n + 1) / 2, n], dev)


def all_reduce_avg(r, n, dev):
    x = vec([r + 1], dev)
    try:
        dist.all_reduce(x, op=dist.ReduceOp.AVG)  # NCCL >= 2.10; gloo since torch 2.7
    except (RuntimeError, ValueError):  # refused locally, on every rank, before any traffic
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
        x /= n
    return x, vec([(n + 1) / 2], dev)


def all_reduce_max(r, n, dev):
    x = vec([r, -r], dev)
    dist.all_reduce(x, op=dist.ReduceOp.MAX)  # element-wise: [max r, max -r]
    return x, vec([n - 1, 0], dev)


def all_gather(r, n, dev):
    out = torch.empty(n, device=dev)
    all_gather_tensor(out, vec([r], dev))  # out[k] = rank k's input, on every rank
    return out, vec(list(range(n)), dev)


def reduce_scatter(r, n, dev):
    x = vec([r + j for j in range(n)], dev)  # element j is destined for rank j
    out = torch.empty(1, device=dev)
    reduce_scatter_tensor(out, x, op=dist.ReduceOp.SUM)  # rank r gets sum over k of x_k[r]
    return out, vec([n * r + n * (n - 1) / 2], dev)


def all_to_all(r, n, dev):
    x = vec([10 * r + j for j in range(n)], dev)  # element j goes to rank j
    out = torch.empty(n, device=dev)
    dist.all_to_all_single(out, x)  # out[k] = rank k's element r: a transpose across ranks
    return out, vec([10 * k + r for k in range(n)], dev)


def gather(r, n, dev):
    outs = [torch.empty(1, device=dev) for _ in range(n)] if r == 0 else None
    dist.gather(vec([r], dev), gather_list=outs, dst=0)
    return (torch.cat(outs), vec(list(range(n)), dev)) if r == 0 else (vec([], dev), None)


def scatter(r, n, dev):
    pieces = [vec([10 * k], dev) for k in range(n)] if r == 0 else None
    out = torch.empty(1, device=dev)
    dist.scatter(out, scatter_list=pieces, src=0)  # rank k receives piece k of rank 0
    return out, vec([10 * r], dev)


def barrier(r, n, dev):
    """The last rank arrives 0.2 s late; nobody may leave before it has arrived.

    Result [1] when every rank left after the last arrival, by this host's wall clock gathered
    from every rank. Clocks of different hosts differ by their NTP skew, so departures up to 0.1 s
    "before" the arrival are accepted: half the delay, while a barrier that did not wait would
    let the other ranks leave about 0.2 s early.
    """
    if r == n - 1:
        time.sleep(0.2)
    arrive = time.time()  # host clock: when this host arrives at the barrier and leaves it
    dist.barrier()
    leave = time.time()  # host clock: as above
    times = torch.zeros(n, 2, dtype=torch.float64, device=dev)
    times[r, 0], times[r, 1] = arrive, leave
    dist.all_reduce(times)  # every rank learns every rank's (arrive, leave)
    nobody_early = times[:, 1].min() >= times[:, 0].max() - 0.1
    return vec([float(nobody_early)], dev), vec([1], dev)


def all_reduce_async(r, n, dev):
    x = vec([r + 1], dev)
    work = dist.all_reduce(x, async_op=True)  # returns at once; the reduction runs meanwhile
    torch.arange(1000.0, device=dev).sum()  # independent work, overlapping the communication
    work.wait()  # x is only valid after wait() (on CUDA: the current stream waits for it)
    return x, vec([n * (n + 1) / 2], dev)


# (label, function, input on rank r, expected on rank r): the table, in the order it is run.
COLLECTIVES = [
    ("broadcast(src=n-1)", broadcast, "[r, r]", "[n-1, n-1]"),
    ("reduce(SUM, dst=0)", reduce, "[r+1]", "r=0: [n(n+1)/2]"),
    ("all_reduce(SUM)", all_reduce_sum, "[r+1, 1]", "[n(n+1)/2, n]"),
    ("all_reduce(AVG)", all_reduce_avg, "[r+1]", "[(n+1)/2]"),
    ("all_reduce(MAX)", all_reduce_max, "[r, -r]", "[n-1, 0]"),
    ("all_gather", all_gather, "[r]", "[0, 1, ..., n-1]"),
    ("reduce_scatter(SUM)", reduce_scatter, "x[j] = r + j, j < n", "[n*r + n(n-1)/2]"),
    ("all_to_all", all_to_all, "x[j] = 10r + j, j < n", "y[k] = 10k + r"),
    ("gather(dst=0)", gather, "[r]", "r=0: [0, 1, ..., n-1]"),
    ("scatter(src=0)", scatter, "r=0: [0, 10, ..., 10(n-1)]", "[10r]"),
    ("barrier", barrier, "r=n-1 arrives 0.2 s late", "[1]: none left early"),
    ("all_reduce(async)+wait", all_reduce_async, "[r+1]", "[n(n+1)/2]"),
]


def run_all(rank, world, device) -> list[dict]:
    """Run every collective; return one row per collective with every rank's result."""
    local = []
    for _, fn, _, _ in COLLECTIVES:
        got, want = fn(rank, world, device)
        ok = want is None or torch.equal(got, want)
        local.append({"got": got.tolist(), "want": None if want is None else want.tolist(),
                      "ok": ok})
    everyone = report.gather(local)  # rank k's list of rows, on every rank
    rows = []
    for i, (label, _, inp, exp) in enumerate(COLLECTIVES):
        rows.append({"op": label, "input": inp, "expected": exp, "world_size": world,
                     "results": [everyone[k][i]["got"] for k in range(world)],
                     "expected_values": [everyone[k][i]["want"] for k in range(world)],
                     "pass": all(everyone[k][i]["ok"] for k in range(world))})
    return rows


# --------------------------------------------------------------------------------------------------
# A reproducible hang: ranks that do not run the same collectives in the same order


def say(line: str) -> None:
    """One stderr line in one write, so lines of ranks sharing a terminal do not interleave."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def mismatch_demo(rank, world, device, timeout_s) -> None:
    """Rank 0 averages a metric for its log line; the other ranks go straight on to the broadcast
    of the next step. On gloo nobody can finish (NCCL behaves otherwise: see the end)."""
    calling = "all_reduce"
    try:
        loss = vec([rank], device)
        if rank == 0:  # BUG: a collective inside a rank-0-only branch
            dist.all_reduce(loss)
            print(f"mean loss {loss.item() / world:.3f}", flush=True)
        calling = "broadcast"
        weights = torch.zeros(4, device=device)
        dist.broadcast(weights, src=0)
        if device.type == "cuda":
            # NCCL only queued the calls (what it does here: see the end of this file)
            torch.cuda.synchronize(device)
    except RuntimeError as exc:
        msg = str(exc)
        fingerprints = re.findall(r"Rank (\d+) is running collective: .*?OpType=(\w+)", msg)
        if fingerprints:  # TORCH_DISTRIBUTED_DEBUG=DETAIL compared the ranks' collectives
            detail = ", ".join(f"rank {k} runs {op}" for k, op in sorted(set(fingerprints)))
            say(f"[rank {rank}] error: collective mismatch detected: {detail}")
        else:  # a plain timeout: the backend's own words, without its source-file prefix
            reason = re.sub(r"^\[[^\]]*\]\s*", "", msg.strip().splitlines()[0])
            if "Connection closed by peer" in reason:  # the peer timed out first and exited
                reason = "the peer gave up first and closed the connection"
            say(f"[rank {rank}] error: hang: {calling} did not complete within {timeout_s:g} s; "
                f"see 04-nccl-operations/nccl_debugging.md\n"
                f"[rank {rank}]   ({dist.get_backend()}: {reason})")
            # torchrun stops the other ranks as soon as one exits: stay a little, so that they
            # too have reported (their call fails moments after this one's).
            time.sleep(2)
        sys.exit(1)


# --------------------------------------------------------------------------------------------------
# Report, arguments and launch


def fmt(values) -> str:
    return "[" + ", ".join(f"{v:g}" for v in values) + "]"


def print_table(args, d, rows) -> None:
    """Rank 0 prints the table and writes --json-out."""
    if d.rank != 0:
        return
    print(f"collective_ops | world {d.world_size} | device {d.device} | backend {d.backend}")
    table = [("op", "input on rank r", "expected on rank r", "rank 0 got", "test")] + [
        (row["op"], row["input"], row["expected"], fmt(row["results"][0]),
         "PASS" if row["pass"] else "FAIL") for row in rows]
    widths = [max(len(line[i]) for line in table) for i in range(5)]
    for line in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip())
    failed = [row["op"] for row in rows if not row["pass"]]
    print(f"FAIL: {', '.join(failed)}" if failed else
          f"all {len(rows)} collectives match their closed form on every rank", flush=True)
    if args.json_out:
        report.write_json(args.json_out, rows)


def parse_args(argv=None):
    p = cli.parser(__doc__)
    cli.add_run_args(p, seed=False)
    cli.add_output_args(p, metrics=False, export=False, json_out=True)
    p.add_argument("--mismatch-demo", action="store_true",
                   help="hang on purpose: rank 0 calls an all_reduce the others skip")
    args = p.parse_args(argv)
    cli.check_positive(args, "timeout_s")
    return args


def main(argv=None):
    args = parse_args(argv)
    with launch.distributed(args.device, args.timeout_s) as d:
        if args.mismatch_demo:
            if d.world_size < 2:
                cli.fail("--mismatch-demo needs at least 2 ranks: torchrun --nproc_per_node=2 ...")
            mismatch_demo(d.rank, d.world_size, d.device, args.timeout_s)
            return
        rows = run_all(d.rank, d.world_size, d.device)
        print_table(args, d, rows)
    if not all(row["pass"] for row in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()


# The mismatch demo on NCCL. NCCL matches collectives only by their order on the communicator,
# not by kind or size: rank 0's all_reduce and the others' broadcast can pair up into one malformed
# collective, which either hangs (rank 0 then blocks in loss.item()) or completes with wrong data,
# after which rank 0's broadcast waits alone. TORCH_DISTRIBUTED_DEBUG=DETAIL raises a mismatch
# error before the collective runs; TORCH_NCCL_BLOCKING_WAIT=1 raises a timeout error. By default
# a hang ends in no Python exception: after the timeout NCCL's watchdog logs "Watchdog caught
# collective operation timeout" and tears the process down (nccl_debugging.md). The error report
# of mismatch_demo is gloo's.

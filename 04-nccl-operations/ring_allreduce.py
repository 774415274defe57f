"""Ring all-reduce by hand: the plain ring, then the pipelined ring, beside the naive algorithm
and the library's dist.all_reduce.

Launch (from the repository root):
    torchrun --nproc_per_node=2 04-nccl-operations/ring_allreduce.py     # checks, then timings
    torchrun --nproc_per_node=4 04-nccl-operations/ring_allreduce.py --sizes 64M --iters 10
    torchrun --nproc_per_node=8 04-nccl-operations/ring_allreduce.py --device cuda --sizes 256M
    torchrun --nproc_per_node=4 04-nccl-operations/ring_allreduce.py --trace-out runs/ring.json
        # ^ the plain ring, step by step: who sends which chunk, whose inputs each chunk then sums

The ring is the bandwidth-optimal all-reduce on equal links (Patarasuk & Yuan, 2009), and the one
gloo runs. NCCL has it too, but picks an algorithm per message size and topology: inside a node
the ring, or on an NVSwitch node (H100, H200, B200 SXM) NVLS, the reduction done in the switch,
from about 2 MiB; across nodes the tree for small messages, and for large ones the tree on two
nodes, the ring on three or more, NVLSTree (NVLS inside each node, a tree between nodes) on
NVSwitch clusters. NCCL_ALGO forces one.

The plain ring (plain_ring_all_reduce). The n ranks form a ring: rank r sends to r+1 and
receives from r-1. The tensor is cut into n chunks c0..c(n-1), of unequal size when n does not
divide numel, and every step moves one whole chunk:

    reduce-scatter, n-1 steps: at step s rank r sends chunk (r - s) and receives chunk (r - s - 1),
        which it adds to its own copy. After n-1 steps rank r holds chunk (r + 1) fully reduced.
    all-gather, n-1 steps: at step s rank r sends chunk (r + 1 - s), which is final, and receives
        chunk (r - s) straight into place.

    n = 3, after the reduce-scatter ("abc" = a+b+c of that chunk):
        rank 0: [ c0, c1=abc, c2 ]   rank 1: [ c0, c1, c2=abc ]   rank 2: [ c0=abc, c1, c2 ]

Every step each rank sends one chunk and receives one chunk at the same time, so every rank's link
is busy in both directions (out to the right, in from the left) in both phases. Each rank sends
2(n-1) chunks of S/n bytes: 2(n-1)/n * S in each direction, which tends to 2S whatever n is - this
is why a ring's bandwidth does not fall as ranks are added, and where nccl-tests' bus-bandwidth
factor 2(n-1)/n comes from.
The naive algorithm (send all to rank 0, add, send the result back) puts (n-1) * S on rank 0's
link in each direction (n-1 tensors in, then n-1 out): that link is the bottleneck, and the time
grows linearly with n.

The pipelined ring (ring_all_reduce). A plain reduce-scatter step receives a whole chunk and then
adds it: the link idles during the add and the add waits for the link. Cutting the chunk into
segments (--segment, 4 MiB) lets segment k+1 travel while segment k is added, as gloo does with
1 MiB segments; with --segment 0 it is the plain ring again. The README measures what this buys.
"""

import re
import statistics
import sys
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from dtcourse import cli, launch, report, timing

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
          "float16": torch.float16}


# --------------------------------------------------------------------------------------------------
# The algorithms: each reduces `tensor` in place on every rank of `group` and returns it. The plain
# ring first, then the pipelined ring (the same steps, with each reduce-scatter step overlapped).


def chunk_bounds(numel: int, n: int) -> list[int]:
    """Offsets of n chunks covering numel elements: the first numel % n chunks get one extra.

    chunk i is [bounds[i], bounds[i+1]); e.g. numel 10, n 4 -> sizes 3, 3, 2, 2. When numel < n
    some chunks are empty, and the ring simply skips sending and receiving them.
    """
    base, extra = divmod(numel, n)
    bounds = [0]
    for i in range(n):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return bounds


def _check(tensor: torch.Tensor, op: str) -> None:
    if op not in ("sum", "avg"):
        raise ValueError(f"op must be 'sum' or 'avg', got {op!r}")
    if not tensor.is_floating_point():
        raise TypeError(f"expected a floating-point tensor, got {tensor.dtype}")
    if not tensor.is_contiguous():
        raise ValueError("tensor must be contiguous: the chunks are views of its storage")


def _exchange(send: torch.Tensor, right: int, recv: torch.Tensor, left: int, group) -> None:
    """Send `send` to `right` while receiving `recv` from `left`; return when both are done.

    batch_isend_irecv posts both before waiting. Two blocking calls (send, then recv) would
    deadlock: every rank would sit in send() waiting for a receiver that is itself sending. On
    NCCL the batch also becomes one fused group launch. Empty chunks (numel < n) are skipped on
    both sides: sender and receiver compute the same chunk sizes, so they agree on what is skipped.
    """
    ops = []
    if send.numel():
        ops.append(dist.P2POp(dist.isend, send, right, group))
    if recv.numel():
        ops.append(dist.P2POp(dist.irecv, recv, left, group))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def _ring_peers(group):
    """(rank in group, group size, global rank of the right neighbour, of the left one)."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    # p2p calls name peers by their global rank; inside a sub-group these differ from r +- 1.
    glob = (lambda g: g) if group is None else (lambda g: dist.get_global_rank(group, g))
    return r, n, glob((r + 1) % n), glob((r - 1) % n)


def _chunks(tensor: torch.Tensor, n: int):
    """(flat view of `tensor`, chunk_bounds, chunk(i)): chunk(i) is chunk i mod n, a view, so
    every write into a chunk lands in `tensor` itself."""
    flat = tensor.view(-1)
    bounds = chunk_bounds(flat.numel(), n)

    def chunk(i):
        i %= n
        return flat[bounds[i]:bounds[i + 1]]

    return flat, bounds, chunk


def plain_ring_all_reduce(tensor: torch.Tensor, op: str = "sum", group=None) -> torch.Tensor:
    """All-reduce `tensor` in place with the plain ring: n chunks, 2(n-1) steps, and in every
    step each rank sends one whole chunk to its right neighbour while it receives one from its
    left (reduce-scatter, then all-gather)."""
    for _ in plain_ring_steps(tensor, op, group):
        pass  # each step has already exchanged its chunks; the trace (below) looks in between
    return tensor


def plain_ring_steps(tensor: torch.Tensor, op: str = "sum", group=None):
    """The plain ring one step at a time: after each of its 2(n-1) steps, yield (phase, step,
    chunk sent to the right neighbour, chunk received from the left one), with `tensor` as that
    step left it. `plain_ring_all_reduce` runs it to the end; `trace_ring` stops at every step
    to record what each rank holds."""
    _check(tensor, op)
    r, n, right, left = _ring_peers(group)
    if n == 1 or tensor.numel() == 0:
        return
    flat, bounds, chunk = _chunks(tensor, n)

    # One chunk's room for what arrives (chunk 0 is never smaller than any other).
    incoming = torch.empty(bounds[1] - bounds[0], dtype=flat.dtype, device=flat.device)

    # Phase 1, reduce-scatter: n-1 steps; at step s send chunk r-s, receive chunk r-s-1, add it.
    for s in range(n - 1):
        mine = chunk(r - s - 1)
        got = incoming[:mine.numel()]
        _exchange(chunk(r - s), right, got, left, group)  # the whole chunk crosses, then ...
        mine.add_(got)  # ... it is added, while the link idles (the pipelined ring overlaps them)
        yield "reduce-scatter", s, (r - s) % n, (r - s - 1) % n

    yield from _all_gather_phase(chunk, r, n, right, left, op, group)


def _all_gather_phase(chunk, r, n, right, left, op, group):
    """Both rings end alike: (for avg) divide the chunk this rank finished, then phase 2."""
    if op == "avg":  # divide the one chunk this rank owns: each element is divided exactly once
        chunk(r + 1).div_(n)

    # Phase 2, all-gather: n-1 steps; at step s send the finished chunk r+1-s, receive chunk r-s
    # directly into place (no buffer, no add).
    for s in range(n - 1):
        _exchange(chunk(r + 1 - s), right, chunk(r - s), left, group)
        yield "all-gather", s, (r + 1 - s) % n, (r - s) % n


def ring_all_reduce(tensor: torch.Tensor, op: str = "sum", group=None,
                    segment_bytes: int = 4 << 20) -> torch.Tensor:
    """All-reduce `tensor` in place with the pipelined ring: the plain ring's steps, with each
    reduce-scatter step cut into segments of at most segment_bytes: segment k+1 travels while
    segment k is being added (see `_send_and_accumulate`). 0 turns pipelining off: the whole
    chunk is exchanged, then added, as in the plain ring.
    """
    for _ in ring_steps(tensor, op, group, segment_bytes):
        pass
    return tensor


def ring_steps(tensor: torch.Tensor, op: str = "sum", group=None, segment_bytes: int = 4 << 20):
    """The pipelined ring of `ring_all_reduce`, one step at a time, yielding what
    `plain_ring_steps` yields: only the reduce-scatter step differs from the plain ring."""
    _check(tensor, op)
    r, n, right, left = _ring_peers(group)
    if n == 1 or tensor.numel() == 0:
        return
    flat, bounds, chunk = _chunks(tensor, n)

    largest = bounds[1] - bounds[0]  # chunk 0 is never smaller than any other
    seg = min(largest, max(segment_bytes // flat.element_size(), 1)) if segment_bytes else largest
    # Two receive buffers of one segment each: one is being filled while the other is added.
    bufs = torch.empty(2, max(seg, 1), dtype=flat.dtype, device=flat.device)

    # Phase 1, reduce-scatter: n-1 steps; at step s send chunk r-s, receive chunk r-s-1 and add.
    for s in range(n - 1):
        _send_and_accumulate(chunk(r - s), right, chunk(r - s - 1), left, bufs, seg, group)
        yield "reduce-scatter", s, (r - s) % n, (r - s - 1) % n

    yield from _all_gather_phase(chunk, r, n, right, left, op, group)


def _send_and_accumulate(send, right, mine, left, bufs, seg, group) -> None:
    """One reduce-scatter step: send `send` to the right neighbour; receive the left neighbour's
    partial sum of `mine` and add it in - segment by segment, with one segment in flight while
    the previous one is added:

        time ->   recv seg 0 | recv seg 1 | recv seg 2 |
                             | add  seg 0 | add  seg 1 | add seg 2

    Without this the add (a pass over 3 x chunk bytes of memory) waits for the whole chunk and
    the link then idles while the add runs; gloo does the same with 1 MiB segments. The sender
    and its receiver cut the same chunk with the same `seg`, so their segments match one to one.
    """
    send_segs = send.split(seg) if send.numel() else ()  # an empty chunk sends nothing
    mine_segs = mine.split(seg) if mine.numel() else ()
    pending = None  # (works, segment of `mine`, buffer) received but not yet added
    for k in range(max(len(send_segs), len(mine_segs))):
        ops = []
        if k < len(send_segs):
            ops.append(dist.P2POp(dist.isend, send_segs[k], right, group))
        if k < len(mine_segs):
            buf = bufs[k % 2][:mine_segs[k].numel()]
            ops.append(dist.P2POp(dist.irecv, buf, left, group))
        works = dist.batch_isend_irecv(ops)  # segment k is now in flight ...
        if pending is not None:  # ... while segment k-1 is added
            _wait_and_add(*pending)
        pending = (works, mine_segs[k], buf) if k < len(mine_segs) else None
        if pending is None:  # nothing to receive this round: just finish the send
            for w in works:
                w.wait()
    if pending is not None:
        _wait_and_add(*pending)


def _wait_and_add(works, target, buf) -> None:
    for w in works:
        w.wait()
    target.add_(buf)  # the partial sum of this segment now includes one more rank


def naive_all_reduce(tensor: torch.Tensor, op: str = "sum", group=None) -> torch.Tensor:
    """All-reduce `tensor` in place the naive way: everything to rank 0, add, send back.

    Rank 0 receives n-1 full tensors one after another and then sends n-1 full tensors: its
    link carries (n-1) * S bytes in each direction (in, then out), against 2(n-1)/n * S in each
    direction on every link of the ring.
    """
    _check(tensor, op)
    n, r = dist.get_world_size(group), dist.get_rank(group)
    if n == 1:
        return tensor
    root = 0 if group is None else dist.get_global_rank(group, 0)
    if r == 0:
        buf = torch.empty_like(tensor)
        for peer in range(1, n):  # one full tensor from every rank, in turn
            dist.recv(buf, src=peer if group is None else dist.get_global_rank(group, peer),
                      group=group)
            tensor.add_(buf)
        if op == "avg":
            tensor.div_(n)
        sends = [dist.isend(tensor, dst=p if group is None else dist.get_global_rank(group, p),
                            group=group) for p in range(1, n)]
        for work in sends:  # the result goes back to every rank: n-1 more full tensors
            work.wait()
    else:
        dist.send(tensor, dst=root, group=group)
        dist.recv(tensor, src=root, group=group)
    return tensor


def library_all_reduce(tensor: torch.Tensor, op: str = "sum", group=None) -> torch.Tensor:
    """dist.all_reduce with the same interface (gloo and NCCL pick their own algorithm)."""
    if op == "sum":
        dist.all_reduce(tensor, group=group)
        return tensor
    try:
        dist.all_reduce(tensor, op=dist.ReduceOp.AVG, group=group)
    except (RuntimeError, ValueError):  # gloo before torch 2.7 has no AVG (checked before sending)
        dist.all_reduce(tensor, group=group)
        tensor.div_(dist.get_world_size(group))
    return tensor


# The columns of the checks and timings, in this order: the plain ring first.
ALGORITHMS = {"plain_ring": plain_ring_all_reduce, "pipelined_ring": ring_all_reduce,
              "library": library_all_reduce, "naive": naive_all_reduce}


# --------------------------------------------------------------------------------------------------
# The ring step by step (--trace-out): what each rank sends, and whose inputs each chunk then sums


def contributions(chunk: torch.Tensor, n: int) -> list[int] | None:
    """The ranks whose inputs `chunk` sums, read from its values; None for an empty chunk.

    Rank r's input is (n+1)^r in every element, so a sum of inputs, written in base n+1, has one
    digit per rank counting how often that rank's input is in it: [0, 3] is x0 + x3, and a rank
    added twice would show twice ([0, 0, 3]). Exact in float64 for the world sizes traced here.
    """
    values = chunk.unique().tolist()
    if not values:
        return None
    if len(values) > 1:  # every element of a chunk takes the same path round the ring
        raise RuntimeError(f"the elements of one chunk hold different sums: {values}")
    value, ranks = int(values[0]), []
    for rank in range(n):
        value, count = divmod(value, n + 1)
        ranks += [rank] * count
    return ranks


def trace_ring(numel: int, d) -> dict:
    """Run `plain_ring_steps` once on inputs whose sums name their ranks, recording after every step
    what this rank sent and received and what each of its chunks holds; every rank's record is
    gathered (on every rank), one row per step, each row listing the ranks in order."""
    n, r = d.world_size, d.rank
    x = torch.full((numel,), float((n + 1) ** r), dtype=torch.float64, device=d.device)
    bounds = chunk_bounds(numel, n)
    sizes = [bounds[i + 1] - bounds[i] for i in range(n)]

    def holdings():
        return [contributions(x[bounds[i]:bounds[i + 1]], n) for i in range(n)]

    _, _, right, left = _ring_peers(None)
    mine = [{"phase": "start", "step": None, "send": None, "recv": None, "chunks": holdings()}]
    for phase, s, sent, received in plain_ring_steps(x, "sum", None):
        mine.append({"phase": phase, "step": s,
                     "send": {"chunk": sent, "to": right, "elements": sizes[sent]},
                     "recv": {"chunk": received, "from": left, "elements": sizes[received]},
                     "chunks": holdings()})
    every = report.gather(mine)  # [rank][row]
    rows = [{"phase": row["phase"], "step": row["step"],
             "ranks": [{k: every[rank][i][k] for k in ("send", "recv", "chunks")}
                       for rank in range(n)]} for i, row in enumerate(mine)]
    return {"script": "04-nccl-operations/ring_allreduce.py", "world_size": n, "numel": numel,
            "chunk_sizes": sizes, "algorithm": "plain ring", "device": d.device.type,
            "backend": d.backend, "torch_version": torch.__version__,
            "input": "rank r holds (n+1)^r in every element", "steps": rows}


def print_trace(trace: dict) -> None:
    """Rank 0 prints the trace as a table: for every step, who sends which chunk, then each
    rank's chunks, named by the inputs they sum (a, b, c, ... = the inputs of ranks 0, 1, 2...)."""
    n = trace["world_size"]
    letters = "abcdefghijklmnopqrstuvwxyz"
    width = max(5 * n, 12)

    def held(ranks):
        return "-" if ranks is None else "".join(letters[k] for k in ranks)

    report.print0(f"ring trace | world {n} | numel {trace['numel']} in chunks of "
                  f"{', '.join(map(str, trace['chunk_sizes']))} | "
                  f"{', '.join(letters[:n])} = the inputs of ranks 0..{n - 1}")

    def line(label, cells):
        report.print0((f"{label:<22}" + "".join(f"{c:<{width}}" for c in cells)).rstrip())

    line("step", [f"rank {k}" for k in range(n)])
    line("", [" ".join(f"{'c' + str(i):<{n}}" for i in range(n))] * n)
    for row in trace["steps"]:
        label = "start" if row["step"] is None else f"{row['phase']} s={row['step']}"
        if row["step"] is not None:
            line(label, [f"sends c{c['send']['chunk']} -> {c['send']['to']}" for c in row["ranks"]])
            label = ""
        line(label, [" ".join(f"{held(ch):<{n}}" for ch in c["chunks"]) for c in row["ranks"]])


# --------------------------------------------------------------------------------------------------
# Check the four against an exact sum, then time them


def rank_input(numel: int, rank: int, seed: int, dtype, device) -> torch.Tensor:
    """The input of `rank`: any rank can rebuild any other rank's input (to check the result)."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randn(numel, generator=g, dtype=torch.float64).to(dtype).to(device)


def compensated_sum(rows: torch.Tensor) -> torch.Tensor:
    """Sum of float64 rows with Neumaier's compensation: error <= u|S| + O(n^2 u^2) sum|x|, so
    even float64 inputs get a reference that is (almost) exactly rounded."""
    s, c = rows[0].clone(), torch.zeros_like(rows[0])
    for v in rows[1:]:
        t = s + v
        c += torch.where(s.abs() >= v.abs(), (s - t) + v, (v - t) + s)  # what t lost
        s = t
    return s + c


def check_case(fn, numel: int, op: str, dtype, world: int, rank: int, seed: int, device):
    """Run one algorithm on one case; return (max |result - reference| / bound, reduced in place).

    reference: the sum (or mean) of every rank's input, in float64 with compensation. bound:
    gamma_n * sum_r |x_r| with gamma_n = n*u / (1 - n*u), u the unit roundoff of dtype - the
    worst case of n-1 additions in any order plus the division of avg (Higham, "Accuracy and
    Stability of Numerical Algorithms", 2nd ed., eq. 4.4) - plus 3 float64 roundoffs for the
    reference itself. A value <= 1 is correct; a misplaced chunk or a missing rank is far above.
    """
    inputs = torch.stack([rank_input(numel, r, seed, dtype, "cpu").double() for r in range(world)])
    reference, magnitude = compensated_sum(inputs), inputs.abs().sum(0)
    if op == "avg":
        reference, magnitude = reference / world, magnitude / world
    u = torch.finfo(dtype).eps / 2
    gamma = world * u / (1 - world * u)
    bound = (gamma + 3 * 2.0 ** -53) * magnitude + torch.finfo(torch.float64).tiny

    x = rank_input(numel, rank, seed, dtype, device)
    storage = x.data_ptr()
    out = fn(x, op=op)
    in_place = out is x and x.data_ptr() == storage
    err = (out.double().cpu() - reference).abs() / bound
    return err.max().item(), in_place


def check_all(args, d, algos: dict) -> list[dict]:
    """Every algorithm on numel 1 (chunks mostly empty), world-1 (one short), a prime (unequal
    chunks) and a power of two, for sum and avg: one row per case, printed by rank 0."""
    dtype = DTYPES[args.dtype]
    rows = []
    report.print0("max |error| / rounding bound, worst rank (<= 1 passes):")
    report.print0(f"{'check':<6} {'numel':>6} {'op':>4} " + " ".join(f"{a:>16}" for a in algos))
    for numel in sorted({1, max(d.world_size - 1, 1), 1009, 2 ** 16}):
        for op in ("sum", "avg"):
            res = [check_case(fn, numel, op, dtype, d.world_size, d.rank, args.seed, d.device)
                   for fn in algos.values()]
            worst = torch.tensor([[e, -float(ok)] for e, ok in res], dtype=torch.float64,
                                 device=d.device)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # worst error; any rank not in place
            err = worst[:, 0].tolist()
            in_place = bool((worst[:, 1] == -1).all())
            passed = all(e <= 1 for e in err) and in_place
            rows.append({"kind": "check", "numel": numel, "op": op, "dtype": args.dtype,
                         "world_size": d.world_size, "error_over_bound": dict(zip(algos, err)),
                         "in_place": in_place, "pass": passed})
            report.print0(f"{'PASS' if passed else 'FAIL':<6} {numel:>6} {op:>4} "
                          + " ".join(f"{e:>16.3f}" for e in err))
    return rows


def time_algorithms(algos: dict, numel: int, dtype, args, device) -> dict[str, float]:
    """Median over iterations of the slowest rank's time, per algorithm, in microseconds.

    The algorithms are interleaved within each iteration (plain ring, pipelined ring, library,
    naive, plain ring, ...) so that load from other jobs on a shared machine falls on all alike.
    """
    source = rank_input(numel, dist.get_rank(), args.seed, dtype, device)
    work = torch.empty_like(source)
    times = {name: [] for name in algos}
    for it in range(args.warmup + args.iters):
        for name, fn in algos.items():
            work.copy_(source)  # fresh input: repeated in-place sums would overflow
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dist.barrier()  # everybody starts together; the barrier itself is not timed
            t0 = timing.clock(device)
            fn(work)
            took = timing.clock(device) - t0  # on CUDA: once the queued kernels have run
            if it >= args.warmup:
                times[name].append(took)
    # A collective is finished when its slowest rank is: take the max over ranks per iteration.
    t = torch.tensor([times[name] for name in algos], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return {name: statistics.median(row) * 1e6 for name, row in zip(algos, t.tolist())}


def approx(value: float, fmt: str) -> str:
    """A measured number, marked with a leading ~: it depends on the machine's speed."""
    return f"~{value:{fmt}}"


def time_all(args, d, algos: dict) -> list[dict]:
    """Each size of --sizes: the median time of every algorithm and the pipelined ring's busbw."""
    dtype = DTYPES[args.dtype]
    esize = torch.tensor([], dtype=dtype).element_size()
    factor = 2 * (d.world_size - 1) / d.world_size  # nccl-tests' all-reduce bus-bandwidth factor
    report.print0(f"\ntime (ms), median of {args.iters}; busbw of the pipelined ring in GB/s "
                  "(~: depends on the machine's speed)")
    report.print0(f"{'size':>6} " + " ".join(f"{a:>16}" for a in algos)
                  + f" {'plain/library':>13} {'pipelined/library':>17} {'naive/pipelined':>15}"
                  f" {'pipelined_busbw':>15}")
    rows = []
    for nbytes in args.size_list:
        numel = max(nbytes // esize, 1)
        t = time_algorithms(algos, numel, dtype, args, d.device)
        busbw = {k: numel * esize / (v * 1e-6) * factor / 1e9 for k, v in t.items()}
        rows += [{"kind": "time", "algo": k, "bytes": numel * esize, "dtype": args.dtype,
                  "world_size": d.world_size, "time_us": v, "busbw_GBps": busbw[k],
                  "backend": d.backend, "device": d.device.type} for k, v in t.items()]
        # Every number of this table is a timing: printed with a leading ~ (see the header).
        report.print0(f"{human(numel * esize):>6} "
                      + " ".join(f"{approx(v / 1e3, '.3f'):>16}" for v in t.values())
                      + f" {approx(t['plain_ring'] / t['library'], '.2f'):>13}"
                      f" {approx(t['pipelined_ring'] / t['library'], '.2f'):>17}"
                      f" {approx(t['naive'] / t['pipelined_ring'], '.2f'):>15}"
                      f" {approx(busbw['pipelined_ring'], '.3f'):>15}")
    return rows


def run(args, d) -> bool:
    """Check, then time; rank 0 writes --json-out. True when every check passed."""
    # The pipelined ring with --segment; the other three as defined above.
    algos = dict(ALGORITHMS, pipelined_ring=partial(ring_all_reduce, segment_bytes=args.segment))
    segments = human(args.segment) if args.segment else "a chunk"
    report.print0(f"ring_allreduce | world {d.world_size} | device {d.device} | backend "
                  f"{d.backend} | {args.dtype} | pipelined ring segments of {segments}")
    checks = check_all(args, d, algos)
    rows = checks + time_all(args, d, algos)
    if d.rank == 0 and args.json_out:
        report.write_json(args.json_out, rows)
    dist.barrier()  # the file is complete before any rank exits
    ok = all(row["pass"] for row in checks)
    if d.rank == 0 and not ok:
        print("FAIL: an all-reduce disagrees with the reference sum", file=sys.stderr)
    return ok


def write_trace(args, d) -> None:
    """--trace-out: the traced plain ring, printed and written by rank 0."""
    if d.world_size > 12:  # (n+1)^(n-1) * n must stay exact in float64
        cli.fail(f"--trace-out traces at most 12 ranks, not {d.world_size}")
    trace = trace_ring(args.trace_numel, d)
    print_trace(trace)
    if d.rank == 0:
        report.write_json(args.trace_out, trace)
    dist.barrier()  # the file is complete before any rank exits


# --------------------------------------------------------------------------------------------------
# Arguments and launch


def human(nbytes: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return f"{nbytes}B"


def parse_size(text: str) -> int:
    """'4096', '64K', '1M', '2G' -> bytes (binary suffixes: 1K = 1024)."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)i?B?\s*", text, flags=re.IGNORECASE)
    if not m:
        cli.fail(f"cannot read the size {text!r}: use a byte count with an optional K/M/G suffix")
    return int(m.group(1)) * 1024 ** " KMG".index(m.group(2).upper() or " ")


def parse_args(argv=None):
    p = cli.parser(__doc__)
    cli.add_run_args(p)
    cli.add_output_args(p, metrics=False, export=False, json_out=True)
    p.add_argument("--sizes", default="4K,256K,4M",
                   help="comma-separated message sizes in bytes (K/M/G suffixes) to time")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--segment", default="4M",
                   help="segment of the pipelined ring's reduce-scatter (bytes, K/M "
                        "suffixes); 0: whole chunks, as the plain ring")
    p.add_argument("--iters", type=int, default=5, help="timed repetitions per size")
    p.add_argument("--warmup", type=int, default=1, help="untimed repetitions per size")
    p.add_argument("--trace-out", type=Path,
                   help="instead of the checks and timings, run the plain ring once on "
                        "--trace-numel "
                        "elements, print what every rank sends and holds after each step, and "
                        "write it as JSON here (rank 0); figures/ring_figure.py draws it")
    p.add_argument("--trace-numel", type=int, default=10,
                   help="elements of the traced tensor (10 on 4 ranks: chunks of 3, 3, 2, 2)")
    args = p.parse_args(argv)
    args.size_list = [parse_size(s) for s in args.sizes.split(",")]
    args.segment = parse_size(args.segment)
    cli.check_positive(args, "iters", "timeout_s", "trace_numel")
    if args.warmup < 0:
        cli.fail(f"--warmup must be at least 0, got {args.warmup}")
    return args


def main(argv=None):
    args = parse_args(argv)
    with launch.distributed(args.device, args.timeout_s) as d:
        if args.trace_out:
            write_trace(args, d)
            return
        ok = run(args, d)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

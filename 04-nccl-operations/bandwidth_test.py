"""Collective bandwidth test: time, algbw and busbw per op and message size, with a correctness
check of every result, in the manner of nccl-tests - and the answer to "is my number normal?".

Launch (from the repository root):
    torchrun --nproc_per_node=2 04-nccl-operations/bandwidth_test.py --sizes 4K,1M --iters 5
    torchrun --nproc_per_node=4 04-nccl-operations/bandwidth_test.py --sizes 64M --json-out bw.json
    torchrun --nproc_per_node=8 04-nccl-operations/bandwidth_test.py --device cuda --link nvlink4
    srun -N 2 --ntasks-per-node=8 python 04-nccl-operations/bandwidth_test.py --link ib-ndr --nics 8

Definitions (nccl-tests doc/PERFORMANCE.md): algbw = S / t, with S the bytes of the op's largest
buffer (the full tensor; for all_gather the gathered output, for reduce_scatter the input, for
all_to_all one rank's whole send buffer). busbw = algbw x factor, the factor being the share of S
that the busiest link must carry in each direction with an optimal algorithm: all_reduce
2(n-1)/n, all_gather, reduce_scatter and all_to_all (n-1)/n, broadcast, reduce and sendrecv 1.
busbw is what you compare with the link's one-way bandwidth, whatever n is: --link prints it as a
share of the link's realistic peak (80% of the spec for NVLink, 70% for PCIe, 92% for a NIC).
Across nodes the link is the node's network: NCCL spreads its rings over all of a node's NICs, so
the reference is --nics x the per-NIC speed. Across nodes, compare against the NICs with
NCCL_ALGO=Ring: a tree on two nodes, or NVLSTree on an NVSwitch cluster at any node count,
reduces inside the node first and reports more than the network carries.

Time: each iteration starts after a barrier (and device synchronisation); its time is the slowest
rank's; the row shows the median over --iters. nccl-tests instead averages back-to-back launches,
which hides launch latency: expect our small-message times to be higher than theirs. For the same
reason this loop (a barrier, a launch from Python and a synchronisation per sample) cannot show
the few microseconds by which NCCL's algorithms and protocols differ at small sizes (Ring against
Tree, LL against Simple): measure those with nccl-tests, `all_reduce_perf -b 8 -e 1M` with
NCCL_ALGO set, or by timing many back-to-back ops between two CUDA events.
"""

import re
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from dtcourse import cli, launch, report, timing

# torch 2.14 deprecates all_gather_into_tensor / reduce_scatter_tensor for the *_single names.
all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

OPS = ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all",
       "sendrecv"]

# busbw / algbw per op for n ranks (nccl-tests doc/PERFORMANCE.md, "Summary").
BUSBW_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
    "sendrecv": lambda n: 1.0,
}

# Bandwidth in one direction per GPU (GB/s = 1e9 B/s) of each link from its vendor specification,
# and the link's kind (which sets its realistic share, below); the same table, with sources, is in
# 04-nccl-operations/README.md ("Is my number normal?"). A network link's figure is per NIC.
LINKS = {
    "pcie3": (15.75, "PCIe 3.0 x16", "pcie"),
    "pcie4": (31.5, "PCIe 4.0 x16", "pcie"),
    "pcie5": (63.0, "PCIe 5.0 x16", "pcie"),
    "nvlink2": (150.0, "NVLink 2 (V100 SXM2: 6 links)", "nvlink"),
    "nvlink3": (300.0, "NVLink 3 (A100 SXM: 12 links)", "nvlink"),
    "nvlink4": (450.0, "NVLink 4 (H100/H200 SXM: 18 links)", "nvlink"),
    "nvlink5": (900.0, "NVLink 5 (B200: 18 links)", "nvlink"),
    "ib-edr": (12.5, "InfiniBand EDR, 100 Gb/s per NIC", "nic"),
    "ib-hdr": (25.0, "InfiniBand HDR, 200 Gb/s per NIC", "nic"),
    "ib-ndr": (50.0, "InfiniBand NDR, 400 Gb/s per NIC", "nic"),
    "ib-xdr": (100.0, "InfiniBand XDR, 800 Gb/s per NIC", "nic"),
    "eth25": (3.125, "Ethernet 25 Gb/s per NIC", "nic"),
    "eth100": (12.5, "Ethernet 100 Gb/s per NIC", "nic"),
    "eth400": (50.0, "Ethernet 400 Gb/s per NIC", "nic"),
}
# The "realistic peak" --link compares busbw with: the share of the one-way spec that a healthy
# system reaches with large messages (1 GiB), per kind of link. It is not one figure for all:
# - nvlink: nccl-tests ring collectives reach 78-82% of the spec (A100 NVLink 3, H200 NVLink 4;
#   the README's "How we know" gives the runs). NVLS on an NVSwitch node reduces in the switch
#   and can print more than 100%: that is the formula, not a faster wire.
# - pcie: 70%, the top of the 35-45 GB/s (56-71% of Gen5's 63 GB/s) that a healthy 8x H100 PCIe
#   node reaches in benchmarks/README.md section 3 (a reference figure, not a measurement): PCIe's
#   packet headers and framing take about a tenth of the raw rate at a 256-byte payload, and a
#   ring over many GPUs crosses PCIe switches or the CPU, which its hops share.
# - nic: NCCL's developers expect 92-96% of a NIC's line rate from nccl-tests (about 24 of 25 GB/s
#   per HDR NIC, nccl-tests issue #119; 46-48 of 50 per NDR NIC, #290); 92%, the low end, as
#   05-advanced/cost_model.md uses. With 80% a healthy 8-NIC NDR node would print 115-120% and a
#   node with one rail down (7 of 8 NICs' worth) still over 100%; with 92% they print about
#   100-104% and 88-91%.
REALISTIC_FRACTION = {"nvlink": 0.80, "pcie": 0.70, "nic": 0.92}
# The links between nodes: their speed is per NIC, and a node has --nics of them. Across nodes the
# ring collectives reach the node's total NIC bandwidth; an all-to-all cannot aggregate a node's
# NICs (nccl-tests issue #267) and a send/recv pair takes one path, so for those (and broadcast and
# reduce, not checked) no network reference is printed.
NETWORK_LINKS = tuple(name for name, (_, _, kind) in LINKS.items() if kind == "nic")
NIC_AGGREGATING_OPS = ("all_reduce", "all_gather", "reduce_scatter")

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float64": torch.float64}
DEFAULT_SIZES = ",".join(f"{4 ** k * 4}K" for k in range(9))  # 4K, 16K, ..., 256M: x4 steps
CHECK_BLOCK = 1 << 22  # elements per slice of the correctness check (bounds its memory)


# --------------------------------------------------------------------------------------------------
# Data with a known answer. Element i of rank r's input is p(i, r) = (i + 3r) % 5 - 2, an integer
# in [-2, 2]: every sum of n of them is exact in float32 for any n, and in bfloat16 (8 significant
# bits: integers up to 256) for n <= 128, so the check can demand equality, like nccl-tests -c.


def pattern(index: torch.Tensor, rank, dtype) -> torch.Tensor:
    return ((index + 3 * rank) % 5 - 2).to(dtype)


def fill(count: int, rank: int, dtype, device) -> torch.Tensor:
    return pattern(torch.arange(count, device=device), rank, dtype)


def expected(op: str, i: torch.Tensor, rank: int, n: int, chunk: int) -> torch.Tensor:
    """The exact result at output positions `i` on `rank` (as int64; chunk = count / n)."""
    if op in ("all_reduce", "reduce"):
        return sum(pattern(i, k, torch.int64) for k in range(n))
    if op == "broadcast":  # root 0's input
        return pattern(i, 0, torch.int64)
    if op == "all_gather":  # block k of the output is rank k's input
        return pattern(i % chunk, i // chunk, torch.int64)
    if op == "reduce_scatter":  # this rank's block of the sum
        return sum(pattern(rank * chunk + i, k, torch.int64) for k in range(n))
    if op == "all_to_all":  # block j of the output is block `rank` of rank j's input
        return pattern(rank * chunk + i % chunk, i // chunk, torch.int64)
    if op == "sendrecv":  # the left neighbour's input
        return pattern(i, (rank - 1) % n, torch.int64)
    raise ValueError(op)


def count_wrong(op, out, rank, n, chunk) -> int:
    if op == "reduce" and rank != 0:
        return 0  # reduce defines the result on the root only
    wrong = 0
    for start in range(0, out.numel(), CHECK_BLOCK):
        part = out[start:start + CHECK_BLOCK]
        i = torch.arange(start, start + part.numel(), device=out.device)
        wrong += int((part != expected(op, i, rank, n, chunk).to(out.dtype)).sum())
    return wrong


# --------------------------------------------------------------------------------------------------
# The ops: buffers of S bytes in total, and one call of the collective on them


def make_op(op: str, count: int, rank: int, n: int, dtype, device):
    """Return (run, out, reset): run() does one collective, out is the buffer to check, reset()
    refills the inputs (in-place ops such as all_reduce overwrite them). count is a multiple of n.
    """
    chunk = count // n
    if op in ("all_reduce", "broadcast", "reduce"):
        x = torch.empty(count, dtype=dtype, device=device)
        run = {"all_reduce": lambda: dist.all_reduce(x),
               "broadcast": lambda: dist.broadcast(x, src=0),
               "reduce": lambda: dist.reduce(x, dst=0)}[op]
        return run, x, lambda: x.copy_(fill(count, rank, dtype, device))
    if op == "all_gather":  # in: this rank's chunk; out: all n chunks (S bytes)
        inp = fill(chunk, rank, dtype, device)
        out = torch.empty(count, dtype=dtype, device=device)
        return lambda: all_gather_tensor(out, inp), out, lambda: None
    if op == "reduce_scatter":  # in: S bytes; out: this rank's reduced chunk
        inp = fill(count, rank, dtype, device)
        out = torch.empty(chunk, dtype=dtype, device=device)
        return lambda: reduce_scatter_tensor(out, inp), out, lambda: None
    if op == "all_to_all":  # in and out: S bytes; chunk j of the input goes to rank j
        inp = fill(count, rank, dtype, device)
        out = torch.empty(count, dtype=dtype, device=device)
        return lambda: dist.all_to_all_single(out, inp), out, lambda: None
    if op == "sendrecv":  # S bytes to the right neighbour while S bytes come from the left
        inp = fill(count, rank, dtype, device)
        out = torch.empty(count, dtype=dtype, device=device)

        def run():
            works = dist.batch_isend_irecv([dist.P2POp(dist.isend, inp, (rank + 1) % n),
                                            dist.P2POp(dist.irecv, out, (rank - 1) % n)])
            for w in works:
                w.wait()
        return run, out, lambda: None
    raise ValueError(op)


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(op, nbytes, dtype_name, args, rank, n, device) -> dict:
    """One row: median time over --iters (slowest rank per iteration), bandwidths, wrong count."""
    dtype = DTYPES[dtype_name]
    esize = torch.tensor([], dtype=dtype).element_size()
    count = max(nbytes // esize // n, 1) * n  # whole chunks: at least one element per rank
    run, out, reset = make_op(op, count, rank, n, dtype, device)
    reset()
    times = []
    for it in range(args.warmup + args.iters):
        sync(device)
        dist.barrier()  # start together; the barrier is outside the timed region
        t0 = timing.clock(device)
        run()
        took = timing.clock(device) - t0  # NCCL calls return before the GPU has finished
        if it >= args.warmup:
            times.append(took)
    slowest = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # a collective ends when its last rank does

    reset()
    run()  # one more call on fresh inputs, checked element by element
    sync(device)
    wrong = torch.tensor([count_wrong(op, out, rank, n, count // n)], device=device)
    dist.all_reduce(wrong)  # summed over ranks, like nccl-tests' #wrong

    t = statistics.median(slowest.tolist())
    total = count * esize
    algbw = total / t / 1e9
    return {"op": op, "bytes": total, "dtype": dtype_name, "world_size": n, "time_us": t * 1e6,
            "algbw_GBps": algbw, "busbw_GBps": algbw * BUSBW_FACTOR[op](n), "wrong": int(wrong),
            "backend": dist.get_backend(), "device": device.type}


def approx(value: float, fmt: str) -> str:
    """A measured number, marked with a leading ~: it depends on the machine's speed."""
    return f"~{value:{fmt}}"


def run(args, d) -> list[dict]:
    """Every (dtype, op, size) of the arguments: rank 0 prints each row as it is measured, then
    writes --json-out and --plot."""
    ops = list(args.op_list)
    if d.world_size == 1 and "sendrecv" in ops and d.device.type == "cpu":
        ops.remove("sendrecv")  # gloo cannot send to itself (NCCL can: a copy on the GPU)
        report.print0("note: sendrecv skipped: gloo cannot send to its own rank at world size 1")
    report.print0(f"bandwidth_test | world {d.world_size} | device {d.device} | backend "
                  f"{d.backend} | warmup {args.warmup}, iters {args.iters} (median; "
                  "~: depends on the machine's speed)")
    if args.link in NETWORK_LINKS and d.local_world_size == d.world_size:
        report.print0(f"note: all {d.world_size} ranks are on one node, so no byte crosses a NIC; "
                      f"--link {args.link} describes a link this run does not use")
    link = (f"  % of {link_name(args.link, args.nics)} "
            f"({realistic(args.link, args.nics):g} GB/s)" if args.link else "")
    report.print0(f"{'op':<15} {'dtype':<9} {'bytes':>10} {'time_us':>10} {'algbw_GBps':>11} "
                  f"{'busbw_GBps':>11} {'wrong':>6}{link}")
    rows = []
    for dtype_name in args.dtype_list:
        for op in ops:
            for nbytes in args.size_list:
                row = measure(op, nbytes, dtype_name, args, d.rank, d.world_size, d.device)
                if args.link:  # added keys only: rows without --link keep the schema they had
                    ref = reference_for(op, args.link, args.nics)
                    row.update(link=args.link, nics=args.nics, reference_GBps=ref,
                               pct_of_reference=100 * row["busbw_GBps"] / ref if ref else None)
                rows.append(row)
                pct = "" if not args.link else "        -" if row["pct_of_reference"] is None \
                    else f" {approx(row['pct_of_reference'], '.1f') + '%':>8}"
                # time, algbw, busbw and % are measured: a leading ~ marks them (see the header).
                report.print0(f"{op:<15} {dtype_name:<9} {row['bytes']:>10} "
                              f"{approx(row['time_us'], '.1f'):>10} "
                              f"{approx(row['algbw_GBps'], '.3f'):>11} "
                              f"{approx(row['busbw_GBps'], '.3f'):>11} {row['wrong']:>6}{pct}")
    if d.rank == 0:
        if any(row["wrong"] for row in rows):
            print("FAIL: some results are wrong (column 'wrong')", file=sys.stderr, flush=True)
        if args.json_out:
            report.write_json(args.json_out, rows)
        if args.plot:
            plot(rows, args.plot, d.world_size, d.device)
    dist.barrier()  # files are complete before any rank exits
    return rows


def realistic(link: str, nics: int | None = None) -> float:
    """The busbw a healthy system reaches on `link` (GB/s): its kind's share of the spec
    (REALISTIC_FRACTION). A network link's spec is per NIC; across nodes NCCL's channels, each a
    ring carrying a share of the data, leave the node through all of its `nics` NICs, so
    all-reduce busbw reaches the node's NIC total, not one NIC's (nccl-tests issues #119 and
    #290), as long as the links inside the node are faster."""
    spec, _, kind = LINKS[link]
    return spec * (nics or 1) * REALISTIC_FRACTION[kind]


def reference_for(op: str, link: str, nics: int | None) -> float | None:
    """The realistic busbw `op` should reach on `link`, or None where the table says nothing."""
    if link in NETWORK_LINKS and op not in NIC_AGGREGATING_OPS:
        return None
    return realistic(link, nics)


def link_name(link: str, nics: int | None) -> str:
    return f"{nics} x {link}" if nics else link



# --------------------------------------------------------------------------------------------------
# The plot, arguments and launch


def plot(rows, path: Path, world: int, device) -> None:
    """busbw against message size, one line per op (and dtype): a PNG at `path`."""
    import matplotlib
    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key in dict.fromkeys((r["op"], r["dtype"]) for r in rows):
        mine = [r for r in rows if (r["op"], r["dtype"]) == key]
        label = key[0] if len({r["dtype"] for r in rows}) == 1 else f"{key[0]} ({key[1]})"
        ax.plot([r["bytes"] for r in mine], [r["busbw_GBps"] for r in mine], marker="o",
                label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("busbw (GB/s)")
    ax.set_title(f"busbw vs size, {world} ranks, {device.type}, {rows[0]['backend']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)


def parse_size(text: str) -> int:
    """'4096', '64K', '1M', '2G' -> bytes (binary suffixes: 1K = 1024)."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)i?B?\s*", text, flags=re.IGNORECASE)
    if not m or int(m.group(1)) == 0:
        cli.fail(f"cannot read the size {text!r}: use a positive byte count with an optional K/M/G "
             "suffix, e.g. --sizes 4096,1M,64M")
    return int(m.group(1)) * 1024 ** " KMG".index(m.group(2).upper() or " ")


def parse_list(text: str, allowed, flag: str) -> list[str]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in items if s not in allowed]
    if unknown or not items:
        cli.fail(f"{flag}: unknown {', '.join(unknown) or '(empty)'}; choose from "
             f"{', '.join(allowed)}")
    return items


def parse_args(argv=None):
    p = cli.parser(__doc__)
    cli.add_run_args(p, seed=False, timeout_s=300)
    cli.add_output_args(p, metrics=False, export=False, json_out=True)
    p.add_argument("--sizes", default=DEFAULT_SIZES,
                   help="comma-separated message sizes in bytes, K/M/G suffixes allowed")
    p.add_argument("--ops", default=",".join(OPS), help="comma-separated subset of: "
                   + ", ".join(OPS))
    p.add_argument("--dtypes", default="float32", help="comma-separated subset of: "
                   + ", ".join(DTYPES))
    p.add_argument("--iters", type=int, default=20, help="timed iterations per row")
    p.add_argument("--warmup", type=int, default=5, help="untimed iterations per row")
    p.add_argument("--link", help="print busbw as %% of this link's realistic peak: "
                   + ", ".join(LINKS))
    p.add_argument("--nics", type=int, help="with a network --link (ib-*, eth*): the NICs of each "
                   "node, which NCCL spreads inter-node traffic over; the peak is NICs x per-NIC")
    p.add_argument("--plot", type=Path, help="rank 0 writes a PNG of busbw vs size per op")
    args = p.parse_args(argv)
    args.size_list = [parse_size(s) for s in args.sizes.split(",")]
    args.op_list = parse_list(args.ops, OPS, "--ops")
    args.dtype_list = parse_list(args.dtypes, list(DTYPES), "--dtypes")
    if args.link is not None and args.link not in LINKS:
        cli.fail(f"--link {args.link!r} is not in the table; choose from {', '.join(LINKS)}")
    if args.link in NETWORK_LINKS and args.nics is None:
        cli.fail(f"--link {args.link} is a speed per NIC: give the NICs per node with --nics N "
                 f"(NCCL spreads inter-node traffic over all of them)")
    if args.nics is not None and args.link not in NETWORK_LINKS:
        cli.fail(f"--nics goes with a network --link ({', '.join(NETWORK_LINKS)})")
    cli.check_positive(args, "nics")
    cli.check_positive(args, "iters", "timeout_s")
    if args.warmup < 0:
        cli.fail(f"--warmup must be at least 0, got {args.warmup}")
    return args


def main(argv=None):
    args = parse_args(argv)
    with launch.distributed(args.device, args.timeout_s) as d:
        rows = run(args, d)
    if any(row["wrong"] for row in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()

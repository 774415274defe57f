"""The collectives the course runs on, shown on tensors small enough to read: who holds what before
and after each one, where the lessons use it, and how many bytes each rank sends for it in the ring
model of NCCL's algorithms (modelled, not measured: gloo runs its own algorithms).

Launch (from the repository root):
    torchrun --nproc_per_node=4 01-ddp-basics/collectives_primer.py      # collectives.md's run
    torchrun --nproc_per_node=2 01-ddp-basics/collectives_primer.py      # any n from 1 to 4 on CPU
    torchrun --nproc_per_node=8 01-ddp-basics/collectives_primer.py --device cuda    # NCCL

Rank r of n starts with x_r = [10r, 10r+1, ..., 10r+n-1]: the tens digit names the rank, the units
digit the position, so every sum and every gathered tensor can be read off its digits. Each
collective works on a copy of x_r; rank 0 gathers every rank's before and after and prints them.

Lesson 04 (04-nccl-operations: collective_ops.py, ring_allreduce.py, bandwidth_test.py) covers the
algorithms behind these calls and the bandwidth they reach.
"""

import textwrap

import torch
import torch.distributed as dist

from dtcourse import cli, launch, report

# torch 2.12 renamed the single-tensor collectives; the older names, all_gather_into_tensor and
# reduce_scatter_tensor (torch 1.13 on), remain in 2.14 as deprecated aliases.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# --------------------------------------------------------------------------------------------------
# The collectives. Each runs on every rank with this rank's x (n elements) and returns what this
# rank holds afterwards, or None where the collective leaves nothing defined.


def broadcast(x, rank, n):
    y = x.clone()
    dist.broadcast(y, src=0)  # rank 0's tensor overwrites everybody's
    return y


def reduce(x, rank, n):
    y = x.clone()
    dist.reduce(y, dst=0, op=dist.ReduceOp.SUM)  # the sum lands on rank 0 only
    return y if rank == 0 else None  # elsewhere the backend may have used y as scratch space


def all_reduce(x, rank, n):
    y = x.clone()
    dist.all_reduce(y, op=dist.ReduceOp.SUM)  # the element-wise sum, on every rank
    return y


def all_gather(x, rank, n):
    out = torch.empty(n * x.numel(), dtype=x.dtype, device=x.device)
    all_gather_single(out, x)  # (n,) per rank -> (n*n,): [x_0 | x_1 | ... | x_(n-1)] everywhere
    return out


def reduce_scatter(x, rank, n):
    out = torch.empty(x.numel() // n, dtype=x.dtype, device=x.device)
    reduce_scatter_single(out, x, op=dist.ReduceOp.SUM)  # (n,) -> (1,): chunk r of the sum
    return out


def all_to_all(x, rank, n):
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x)  # chunk j of rank r goes to rank j, where it lands at place r
    return out


# --------------------------------------------------------------------------------------------------
# Bytes each rank sends in a model: the ring (and chain) algorithms NCCL uses, not what gloo runs
# here. The ring's order follows the topology, not the rank numbers. S is the size nccl-tests
# reports for the collective: the whole tensor; for all-gather the gathered output, for
# reduce-scatter the input, for all-to-all one rank's send buffer.


def sent_on_ring(kind: str, size: int, n: int, rank: int, root: int = 0) -> float:
    """Bytes rank `rank` sends for one collective of S = `size` bytes over n ranks, in the ring
    model (a ring in rank order)."""
    if kind == "broadcast":  # a pipelined chain root -> root+1 -> ...; its end forwards nothing
        return 0 if (rank - root) % n == n - 1 else size
    if kind == "reduce":  # the chain runs the other way and ends at the root, which sends nothing
        return 0 if rank == root else size
    if kind == "all_reduce":  # reduce-scatter then all-gather: 2(n-1) steps of S/n each
        return 2 * (n - 1) * size / n
    return (n - 1) * size / n  # all-gather, reduce-scatter: n-1 steps of S/n; all-to-all: direct


# (name, call as written, function, S as a multiple of x's bytes, what S is, ring formula,
#  what it does, where the course uses it)
COLLECTIVES = [
    ("broadcast", "dist.broadcast(x, src=0)", broadcast, 1, "the tensor", "S",
     "rank 0's tensor is copied to every rank",
     "DDP(model) broadcasts rank 0's weights so every replica starts equal (lesson 01); the "
     "hand-written ZeRO broadcasts each updated parameter from its owner (lesson 03)"),
    ("reduce", "dist.reduce(x, dst=0, op=SUM)", reduce, 1, "the tensor", "S",
     "the element-wise sum lands on rank 0 only",
     "the hand-written ZeRO-2 reduces each gradient onto the rank that owns it (lesson 03, "
     "zero_from_scratch.py)"),
    ("all_reduce", "dist.all_reduce(x, op=SUM)", all_reduce, 1, "the tensor", "2(n-1)/n x S",
     "every rank ends with the element-wise sum",
     "DDP averages the gradients with it during every backward (lesson 01); NO_SHARD and the "
     "replica groups of HYBRID_SHARD (lesson 02); a loss or an accuracy averaged for the log"),
    ("all_gather", "all_gather_single(out, x)", all_gather, "n", "the gathered output",
     "(n-1)/n x S",
     "every rank ends with every rank's tensor, in rank order",
     "FSDP and ZeRO-3 gather a block's weight shards into full weights just before the block "
     "runs, in forward and in backward (lessons 02, 03); ZeRO-1/2 gather the updated weights "
     "after the optimizer step (lesson 03)"),
    ("reduce_scatter", "reduce_scatter_single(out, x, op=SUM)", reduce_scatter, 1, "the input",
     "(n-1)/n x S",
     "rank r ends with chunk r of the element-wise sum",
     "FSDP and ZeRO-3 reduce-scatter the gradients: each rank keeps the summed gradient of its "
     "own shard only (lessons 02, 03); sequence parallelism after a row-parallel layer (lesson "
     "05a)"),
    ("all_to_all", "dist.all_to_all_single(out, x)", all_to_all, 1, "one rank's send buffer",
     "(n-1)/n x S",
     "chunk j of rank r goes to rank j: a transpose across the ranks",
     "expert parallelism sends each token to the rank of its expert and back (lesson 05b, "
     "expert_parallel.py)"),
]


def run_all(rank: int, n: int, device) -> tuple[list[dict], dict]:
    """Every collective on this rank's x, then every rank's x and results gathered on every rank."""
    x = torch.tensor([10.0 * rank + j for j in range(n)], device=device)  # float32, n elements
    mine = {"x": x.tolist()}
    for name, _, fn, *_ in COLLECTIVES:
        after = fn(x, rank, n)
        mine[name] = None if after is None else after.tolist()
    # An all-reduce is a reduce-scatter followed by an all-gather: what a ring all-reduce runs.
    composed = all_gather(reduce_scatter(x, rank, n), rank, n)
    mine["reduce_scatter_then_all_gather"] = composed.tolist()
    everyone = report.gather(mine)  # rank k's dict, in rank order, on every rank

    x_bytes = x.numel() * x.element_size()
    rows = []
    for name, call, _, times, s_is, formula, does, used in COLLECTIVES:
        size = x_bytes * (n if times == "n" else times)
        rows.append({"name": name, "call": call, "does": does, "used_in": used,
                     "before": [e["x"] for e in everyone], "after": [e[name] for e in everyone],
                     "S_bytes": size, "S_is": s_is, "ring_formula": formula,
                     "sent_bytes": [sent_on_ring(name, size, n, k) for k in range(n)]})
    extra = {"reduce_scatter_then_all_gather": [e["reduce_scatter_then_all_gather"]
                                                for e in everyone]}
    return rows, extra


# --------------------------------------------------------------------------------------------------
# Report, arguments and launch


def fmt(values, block: int | None = None) -> str:
    """[0, 1, 2, 3]; with `block`, a bar between the blocks of a gathered tensor."""
    if values is None:
        return "(undefined)"
    cells = [f"{v:g}" for v in values]
    if block:
        return "[" + " | ".join(", ".join(cells[i:i + block])
                                for i in range(0, len(cells), block)) + "]"
    return "[" + ", ".join(cells) + "]"


def fmt_bytes(b: float) -> str:
    return f"{b:g} B"


def traffic(row: dict, n: int) -> str:
    """The line under a table: who sends what, and the formula with this run's numbers."""
    name, size = row["name"], fmt_bytes(row["S_bytes"])
    if name == "broadcast":
        chain = " -> ".join(str(k) for k in range(n))
        return (f"modelled as a pipelined chain {chain} along the ring (its order follows the "
                f"topology): every rank but the last sends S = {size}")
    if name == "reduce":
        chain = " -> ".join(str(k % n) for k in range(1, n + 1))
        return (f"modelled as a chain {chain} that ends at the root: every rank but the root "
                f"sends S = {size}")
    factor = sent_on_ring(name, 1.0, n, 0)
    how = "directly to the other ranks" if name == "all_to_all" else "around the ring"
    return (f"modelled: each rank sends {row['ring_formula']} = {factor:.3g} x {size} = "
            f"{fmt_bytes(row['sent_bytes'][0])} {how}; S = {row['S_is']}")


def print_report(d, rows, extra) -> None:
    n = d.world_size
    x_bytes = next(r["S_bytes"] for r in rows if r["name"] == "all_reduce")
    print(f"collectives_primer | world {n} | device {d.device} | backend {d.backend} | "
          f"x: {n} float32 per rank ({x_bytes} bytes)")
    print(f"rank r starts with x_r[j] = 10r + j, j < {n}: the tens digit names the rank")
    for row in rows:
        block = n if row["name"] == "all_gather" else None
        print(f"\n{row['name']}: {row['call']}: {row['does']}")
        table = [("rank", "before", "after", "sent (ring model)")] + [
            (str(k), fmt(row["before"][k]), fmt(row["after"][k], block),
             fmt_bytes(row["sent_bytes"][k])) for k in range(n)]
        widths = [max(len(line[i]) for line in table) for i in range(4)]
        for line in table:
            print("  " + "  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip())
        print(f"  traffic: {traffic(row, n)}")
        print("\n".join(textwrap.wrap(f"used: {row['used_in']}", 100, initial_indent="  ",
                                       subsequent_indent="        ", break_on_hyphens=False)))
    composed = extra["reduce_scatter_then_all_gather"]
    same = all(c == rows[2]["after"][k] for k, c in enumerate(composed))
    verdict = "the all_reduce result" if same else "NOT the all_reduce result"
    print()
    print("\n".join(textwrap.wrap(
        f"reduce_scatter, then all_gather of its output: {fmt(composed[0])} on every rank, "
        f"{verdict}. A ring all-reduce runs exactly these two phases, (n-1)/n x S each: "
        f"2(n-1)/n x S in all.", 100, break_on_hyphens=False)), flush=True)


def parse_args(argv=None):
    p = cli.parser(__doc__)
    cli.add_run_args(p, seed=False)
    cli.add_output_args(p, metrics=False, export=False, json_out=True)
    args = p.parse_args(argv)
    cli.check_positive(args, "timeout_s")
    return args


def main(argv=None):
    args = parse_args(argv)
    with launch.distributed(args.device, args.timeout_s) as d:
        rows, extra = run_all(d.rank, d.world_size, d.device)
        if d.rank == 0:
            print_report(d, rows, extra)
            if args.json_out:
                report.write_json(args.json_out, {
                    "script": "01-ddp-basics/collectives_primer.py", "world_size": d.world_size,
                    "device": str(d.device), "backend": d.backend, "dtype": "float32",
                    "collectives": rows, **extra})
        dist.barrier()  # the file is complete before any rank exits


if __name__ == "__main__":
    main()

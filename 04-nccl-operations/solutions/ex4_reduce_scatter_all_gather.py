"""Exercise 4 of lesson 04: all-reduce as two library calls, reduce_scatter then all_gather.

Launch (from the repository root):
    torchrun --nproc_per_node=2 04-nccl-operations/solutions/ex4_reduce_scatter_all_gather.py
    torchrun --nproc_per_node=4 04-nccl-operations/solutions/ex4_reduce_scatter_all_gather.py \\
        --sizes 4M,64M
    torchrun --nproc_per_node=8 04-nccl-operations/solutions/ex4_reduce_scatter_all_gather.py \\
        --device cuda --sizes 64M,1G

all-reduce = reduce-scatter + all-gather: the ring in ring_allreduce.py runs exactly these two
phases by hand. Here each phase is one library call: `reduce_scatter` leaves rank r with piece r
of the sum, `all_gather` gives every rank all n pieces. Both need n equal pieces, so a tensor
whose size n does not divide is padded with zeros first (and the padding dropped after). The new
function takes ring_allreduce.py's interface and goes through its checks (error against the exact
sum, in place) and its timing loop, beside dist.all_reduce and the hand-written ring.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from dtcourse import cli, launch, lessons, report

SCRIPT = "04-nccl-operations/solutions/ex4_reduce_scatter_all_gather.py"
LESSON = Path(__file__).resolve().parents[1]

# torch 2.14 marks reduce_scatter_tensor / all_gather_into_tensor deprecated in favour of
# reduce_scatter_single / all_gather_single; where those are missing, the older names serve.
all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor



ring = lessons.load(LESSON / "ring_allreduce.py")


def reduce_scatter_all_gather(tensor: torch.Tensor, op: str = "sum", group=None) -> torch.Tensor:
    """All-reduce `tensor` in place with two library collectives."""
    ring._check(tensor, op)
    n = dist.get_world_size(group)
    if n == 1 or tensor.numel() == 0:
        return tensor
    flat = tensor.view(-1)
    piece = -(-flat.numel() // n)  # ceil(numel / n): n equal pieces cover the tensor
    pad = piece * n - flat.numel()
    # (n * piece,): the tensor itself when n divides it, else a padded copy
    full = torch.cat([flat, flat.new_zeros(pad)]) if pad else flat
    mine = torch.empty(piece, dtype=flat.dtype, device=flat.device)  # (piece,)
    reduce_scatter_tensor(mine, full, op=dist.ReduceOp.SUM, group=group)  # piece r of the sum
    if op == "avg":
        mine.div_(n)  # each element divided once, by the rank that owns it
    all_gather_tensor(full, mine, group=group)  # (n * piece,): every piece, in rank order
    if pad:
        flat.copy_(full[:flat.numel()])
    return tensor


ALGORITHMS = {"library": ring.library_all_reduce, "ring": ring.ring_all_reduce,
              "rs+ag": reduce_scatter_all_gather}


def run(args, d) -> bool:
    dtype = ring.DTYPES[args.dtype]
    report.print0(f"all-reduce as reduce_scatter + all_gather (rs+ag) | world {d.world_size} | "
                  f"device {d.device} | backend {d.backend} | {args.dtype}")
    checks = ring.check_all(args, d, ALGORITHMS)  # the lesson's checks, the new column added
    esize = torch.tensor([], dtype=dtype).element_size()
    factor = 2 * (d.world_size - 1) / d.world_size  # all-reduce's bus-bandwidth factor
    report.print0(f"\ntime (ms), median of {args.iters}; busbw in GB/s "
                  "(~: depends on the machine's speed)")
    report.print0(f"{'size':>6}" + "".join(f"{a:>14}" for a in ALGORITHMS)
                  + f"{'rs+ag/library':>15}{'ring/library':>14}{'rs+ag busbw':>13}")
    rows = []
    for nbytes in args.size_list:
        numel = max(nbytes // esize, 1)
        t = ring.time_algorithms(ALGORITHMS, numel, dtype, args, d.device)
        busbw = numel * esize / (t["rs+ag"] * 1e-6) * factor / 1e9
        rows += [{"kind": "time", "algo": k, "bytes": numel * esize, "time_us": v,
                  "world_size": d.world_size} for k, v in t.items()]
        report.print0(f"{ring.human(numel * esize):>6}"
                      + "".join(f"{ring.approx(v / 1e3, '.3f'):>14}" for v in t.values())
                      + f"{ring.approx(t['rs+ag'] / t['library'], '.2f'):>15}"
                      f"{ring.approx(t['ring'] / t['library'], '.2f'):>14}"
                      f"{ring.approx(busbw, '.3f'):>13}")
    if d.rank == 0 and args.json_out:
        report.write_json(args.json_out, {"script": SCRIPT, "rows": checks + rows})
    dist.barrier()  # the file is complete before any rank exits
    ok = all(row["pass"] for row in checks)
    if d.rank == 0 and not ok:
        print("FAIL: an all-reduce disagrees with the reference sum", file=sys.stderr)
    return ok


def parse_args(argv=None):
    p = cli.parser(__doc__)
    cli.add_run_args(p)
    cli.add_output_args(p, metrics=False, export=False, json_out=True)
    p.add_argument("--sizes", default="64M",
                   help="comma-separated message sizes in bytes (K/M/G suffixes) to time")
    p.add_argument("--dtype", choices=sorted(ring.DTYPES), default="float32")
    p.add_argument("--iters", type=int, default=5, help="timed repetitions per size")
    p.add_argument("--warmup", type=int, default=1, help="untimed repetitions per size")
    args = p.parse_args(argv)
    args.size_list = [ring.parse_size(s) for s in args.sizes.split(",")]
    cli.check_positive(args, "iters", "timeout_s")
    if args.warmup < 0:
        cli.fail(f"--warmup must be at least 0, got {args.warmup}")
    return args


def main(argv=None):
    args = parse_args(argv)
    with launch.distributed(args.device, args.timeout_s) as d:
        ok = run(args, d)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

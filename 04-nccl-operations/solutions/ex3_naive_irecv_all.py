"""Exercise 3 of lesson 04: the naive all-reduce with every receive posted at once.

Launch (from the repository root):
    torchrun --nproc_per_node=4 04-nccl-operations/solutions/ex3_naive_irecv_all.py
    torchrun --nproc_per_node=4 04-nccl-operations/solutions/ex3_naive_irecv_all.py --sizes 64M
    torchrun --nproc_per_node=8 04-nccl-operations/solutions/ex3_naive_irecv_all.py --device cuda

ring_allreduce.py's `naive_all_reduce` has rank 0 receive the other ranks' tensors one after
another into one buffer: rank 2's data cannot move until rank 1's has arrived and been added. Here
rank 0 posts all n-1 receives at once with `dist.irecv`, each into its own buffer, so every peer
can send immediately, then adds the buffers in rank order (the same additions in the same order
as the lesson's version, so the two results are identical). The price is memory: n-1 buffers of
the tensor's size alive together on rank 0 instead of one.

The script checks the new function against the exact sum with ring_allreduce.py's own check
(beside dist.all_reduce and the lesson's naive version), times the three with its timing loop, and
measures the bytes each one allocates on every rank through torch during one call
(`Allocations`: every tensor an op returns in new storage; the backend's own buffers inside gloo
or NCCL are not torch tensors and are not seen).
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from dtcourse import cli, launch, lessons, report

SCRIPT = "04-nccl-operations/solutions/ex3_naive_irecv_all.py"
LESSON = Path(__file__).resolve().parents[1]



ring = lessons.load(LESSON / "ring_allreduce.py")


def naive_all_reduce_irecv_all(tensor: torch.Tensor, op: str = "sum", group=None):
    """All-reduce `tensor` in place: every rank sends to rank 0, which posts all n-1 receives at
    once (one buffer each: (n-1) x S bytes), adds them in rank order and sends the result back."""
    ring._check(tensor, op)
    n, r = dist.get_world_size(group), dist.get_rank(group)
    if n == 1:
        return tensor

    def peer(k):  # p2p calls name global ranks
        return k if group is None else dist.get_global_rank(group, k)

    if r == 0:
        bufs = [torch.empty_like(tensor) for _ in range(1, n)]  # all alive at once
        works = [dist.irecv(buf, src=peer(k), group=group) for k, buf in enumerate(bufs, 1)]
        for work, buf in zip(works, bufs):  # rank order: the lesson's additions, its order
            work.wait()
            tensor.add_(buf)
        if op == "avg":
            tensor.div_(n)
        for work in [dist.isend(tensor, dst=peer(k), group=group) for k in range(1, n)]:
            work.wait()
    else:
        dist.send(tensor, dst=peer(0), group=group)
        dist.recv(tensor, src=peer(0), group=group)
    return tensor


ALGORITHMS = {"library": ring.library_all_reduce, "naive": ring.naive_all_reduce,
              "naive_irecv_all": naive_all_reduce_irecv_all}


class Allocations(TorchDispatchMode):
    """While active, adds up the bytes of every tensor an op returns in storage that none of its
    inputs had: what torch allocates (empty_like, out-of-place results)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0
        self._seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in _tensors((args, kwargs))}
        for t in _tensors(out):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in inputs and ptr not in self._seen and t.untyped_storage().nbytes():
                self._seen.add(ptr)
                self.bytes += t.untyped_storage().nbytes()
        return out


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item)


def allocated_bytes(fn, numel: int, dtype, args, device) -> list[int]:
    """Bytes each rank allocates through torch during one call of `fn` (every rank's, in rank
    order). The buffers stay alive until the call returns, so this is also its extra peak."""
    x = ring.rank_input(numel, dist.get_rank(), args.seed, dtype, device)
    with Allocations() as meter:
        fn(x)
    return report.gather(meter.bytes)


def run(args, d) -> bool:
    dtype = ring.DTYPES[args.dtype]
    report.print0(f"naive all-reduce, receives one by one vs all at once | world {d.world_size} "
                  f"| device {d.device} | backend {d.backend} | {args.dtype}")
    checks = ring.check_all(args, d, ALGORITHMS)
    esize = torch.tensor([], dtype=dtype).element_size()
    report.print0(f"\ntime (ms), median of {args.iters} (~: depends on the machine's speed); "
                  "bytes allocated by one call on rank 0")
    report.print0(f"{'size':>6}" + "".join(f"{a:>17}" for a in ALGORITHMS)
                  + f"{'irecv_all/naive':>17}{'naive B':>14}{'irecv_all B':>14}")
    rows = []
    for nbytes in args.size_list:
        numel = max(nbytes // esize, 1)
        t = ring.time_algorithms(ALGORITHMS, numel, dtype, args, d.device)
        alloc = {name: allocated_bytes(fn, numel, dtype, args, d.device)
                 for name, fn in ALGORITHMS.items()}
        rows.append({"bytes": numel * esize, "world_size": d.world_size, "time_us": t,
                     "allocated_bytes_per_rank": alloc})
        report.print0(f"{ring.human(numel * esize):>6}"
                      + "".join(f"{ring.approx(v / 1e3, '.3f'):>17}" for v in t.values())
                      + f"{ring.approx(t['naive_irecv_all'] / t['naive'], '.2f'):>17}"
                      f"{alloc['naive'][0]:>14,}{alloc['naive_irecv_all'][0]:>14,}")
    report.print0(f"rank 0 holds (n-1) = {d.world_size - 1} receive buffers at once instead of "
                  "one; the other ranks allocate nothing in either version")
    if d.rank == 0 and args.json_out:
        report.write_json(args.json_out, {"script": SCRIPT, "checks": checks, "sizes": rows})
    dist.barrier()  # the file is complete before any rank exits
    return all(row["pass"] for row in checks)


def parse_args(argv=None):
    p = cli.parser(__doc__)
    cli.add_run_args(p)
    cli.add_output_args(p, metrics=False, export=False, json_out=True)
    p.add_argument("--sizes", default="16M",
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

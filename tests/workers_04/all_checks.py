"""Test worker for lesson 04, launched once per world size by tests/test_04_nccl.py:

    torchrun --nproc_per_node=N tests/workers_04/all_checks.py OUT_DIR

One launch runs every lesson-04 check at that world size (starting torch costs 2-4 CPU seconds per
process, so one launch instead of four keeps the suite inside its budget). It imports the lesson
scripts by path - test code may; lesson scripts never import each other - starts one gloo process
group with the scripts' own set-up (dtcourse.launch) and calls, with it:

- collective_ops.run_all: every collective against its closed form, every rank's result;
- ring_allreduce's plain_ring_all_reduce / ring_all_reduce (pipelined) / naive_all_reduce against
  dist.all_reduce and a numpy float64 reference, over numel x dtype x op, plus a sub-group that
  excludes rank 0;
- point_to_point.run_patterns: the p2p patterns;
- bandwidth_test.run with --json-out and --plot (the script's own output path), once more with
  --link ib-ndr --nics 2 (what it prints and the reference it adds to each row), and a check that
  its element-wise checker does count corrupted elements;
- every script's argument checks on bad input (exit status 2 and one stderr line).

Rank 0 writes OUT_DIR/result.json; the test asserts on it.
"""

import contextlib
import importlib.util
import io
import json
import sys
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from dtcourse import launch

LESSON = Path(__file__).resolve().parents[2] / "04-nccl-operations"
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"lesson04_{name}", LESSON / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rank_inputs(numel: int, world: int) -> list[torch.Tensor]:
    """Every rank's float64 input, uniform in [-1, 1): each rank can rebuild all of them."""
    return [torch.from_numpy(np.random.default_rng([7, r, numel]).random(numel) * 2 - 1)
            for r in range(world)]


def compensated_sum(rows: np.ndarray) -> np.ndarray:
    """Neumaier's summation over axis 0: t = s + v loses (s - t) + v exactly when |s| >= |v|."""
    s, c = rows[0].copy(), np.zeros_like(rows[0])
    for v in rows[1:]:
        t = s + v
        c += np.where(np.abs(s) >= np.abs(v), (s - t) + v, (v - t) + s)
        s = t
    return s + c


def allreduce_cases(ra, rank: int, world: int) -> list[dict]:
    """Errors of every all-reduce implementation against numpy, relative to the rounding bound.

    reference: numpy float64 with Neumaier's compensated summation (error <= u64*|S| plus
    O(n^2 u64^2) sum|x|; a plain float64 sum would be as inexact as the float64 results it judges).
    bound = (gamma_n + 3*u64) * sum_r |x_r| (divided by n for avg), gamma_n = n*u / (1 - n*u), u the
    unit roundoff of the dtype: the worst-case error of n-1 additions in any order plus one
    division (Higham, Accuracy and Stability of Numerical Algorithms, eq. 4.4), and 3 float64
    roundoffs for the reference (its sum, its compensation, the division of avg). An
    implementation that drops, repeats or misplaces a chunk is off by O(|x|), far above it.
    """
    # At these sizes a chunk (<= 2 MiB) is smaller than the default 4 MiB segment, so "ring" runs
    # whole-chunk steps; 64 KiB segments exercise the pipelined path, with unequal last segments.
    algos = {"plain_ring": ra.plain_ring_all_reduce, "library": ra.library_all_reduce,
             "ring": ra.ring_all_reduce,
             "ring_64KiB_segments": partial(ra.ring_all_reduce, segment_bytes=64 << 10),
             "naive": ra.naive_all_reduce}
    cases = []
    for numel in sorted({1, max(world - 1, 1), 1_000_003, 2 ** 20}):
        base = rank_inputs(numel, world)
        for dtype_name, dtype in DTYPES.items():
            inputs = [x.to(dtype) for x in base]
            x64 = np.stack([t.double().numpy() for t in inputs])
            u = torch.finfo(dtype).eps / 2
            gamma = world * u / (1 - world * u)
            for op in ("sum", "avg"):
                ref, mag = compensated_sum(x64), np.abs(x64).sum(0)
                if op == "avg":
                    ref, mag = ref / world, mag / world
                bound = (gamma + 3 * 2.0 ** -53) * mag + np.finfo(np.float64).tiny
                errs, in_place, results = [], [], {}
                for name, fn in algos.items():
                    x = inputs[rank].clone()
                    ptr = x.data_ptr()
                    out = fn(x, op=op)
                    in_place.append(float(out is x and x.data_ptr() == ptr))
                    results[name] = x.double().numpy()
                    errs.append(float(np.max(np.abs(results[name] - ref) / bound)))
                for name in ("ring", "plain_ring"):
                    errs.append(float(np.max(np.abs(results[name] - results["library"])
                                             / (2 * bound))))
                # Segments do not change which values an element adds, nor in which order: the
                # pipelined ring must equal the plain one bit for bit (1.0: not equal somewhere).
                errs += [float(not np.array_equal(results[name], results["plain_ring"]))
                         for name in ("ring", "ring_64KiB_segments")]
                stats = torch.tensor(errs + [-v for v in in_place], dtype=torch.float64)
                dist.all_reduce(stats, op=dist.ReduceOp.MAX)  # worst rank; min of in_place
                k = len(algos)
                cases.append({"numel": numel, "dtype": dtype_name, "op": op,
                              "error_over_bound": dict(zip(algos, stats[:k].tolist())),
                              "ring_vs_library_over_bound": stats[k].item(),
                              "plain_ring_vs_library_over_bound": stats[k + 1].item(),
                              "pipelined_differs_from_plain": stats[k + 2:k + 4].tolist(),
                              "in_place": dict(zip(algos, (-stats[k + 4:]).tolist()))})
    return cases


def subgroup_case(ra, rank: int, world: int) -> dict | None:
    """ring and naive inside a group that leaves rank 0 out (group rank k is global rank k+1):
    error against dist.all_reduce on that group, over 2 * gamma_m * sum |x| (both sides round)."""
    if world < 3:
        return None
    members = list(range(1, world))
    group = dist.new_group(members)  # every rank must call new_group, members or not
    worst = torch.zeros(3, dtype=torch.float64)
    if rank in members:
        inputs = [x.float() for x in rank_inputs(1009, world)]
        want = inputs[rank].clone()
        dist.all_reduce(want, group=group)
        u, m = 2.0 ** -24, len(members)
        bound = 2 * m * u / (1 - m * u) * torch.stack([inputs[k] for k in members]).abs().sum(0)
        for i, fn in enumerate((ra.ring_all_reduce, ra.naive_all_reduce,
                                ra.plain_ring_all_reduce)):
            worst[i] = ((fn(inputs[rank].clone(), group=group) - want).abs() / bound).max()
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # rank 0 contributes zeros
    dist.destroy_process_group(group)
    return {"members": members, "ring": worst[0].item(), "naive": worst[1].item(),
            "plain_ring": worst[2].item()}


def input_errors(ra) -> dict:
    """ring_all_reduce refuses what it cannot do, before any communication."""
    seen = {}
    ints = torch.ones(4, dtype=torch.int32)
    for label, call in [("op max", lambda: ra.ring_all_reduce(torch.ones(4), op="max")),
                        ("int tensor", lambda: ra.ring_all_reduce(ints)),
                        ("non-contiguous", lambda: ra.ring_all_reduce(torch.ones(4, 4).t())),
                        ("plain: op max", lambda: ra.plain_ring_all_reduce(torch.ones(4),
                                                                           op="max")),
                        ("plain: int tensor", lambda: ra.plain_ring_all_reduce(ints))]:
        try:
            call()
            seen[label] = None
        except (ValueError, TypeError) as exc:
            seen[label] = type(exc).__name__
    return seen


def bad_inputs(modules: dict) -> list[dict]:
    """Each script's argument checks (the same parse_args and fail() as on the command line):
    exit status and what lands on stderr, without paying a process start-up per case."""
    cases = [("bandwidth_test", ["--sizes", "4K,12Q"]), ("bandwidth_test", ["--ops", "all_sum"]),
             ("bandwidth_test", ["--link", "nvlink9"]), ("bandwidth_test", ["--link", "ib-ndr"]),
             ("bandwidth_test", ["--link", "nvlink4", "--nics", "8"]),
             ("bandwidth_test", ["--link", "ib-ndr", "--nics", "0"]),
             ("ring_allreduce", ["--iters", "0"]),
             ("point_to_point", ["--numel", "0"]), ("collective_ops", ["--timeout-s", "0"])]
    seen = []
    for name, argv in cases:
        err = io.StringIO()
        code = None
        with contextlib.redirect_stderr(err):
            try:
                modules[name].parse_args(argv)
            except SystemExit as exc:
                code = exc.code
        seen.append({"script": name, "argv": argv, "exit": code, "stderr": err.getvalue()})
    return seen


def wrong_detector(bw, rank: int, world: int) -> dict:
    """Corrupt k elements of a correct all_gather output: count_wrong must report exactly k."""
    count = 4 * world
    out = torch.cat([bw.fill(count // world, r, torch.float32, "cpu") for r in range(world)])
    clean = bw.count_wrong("all_gather", out, rank, world, count // world)
    out[[0, count - 1]] += 1
    return {"clean": clean, "corrupted_2": bw.count_wrong("all_gather", out, rank, world,
                                                           count // world)}


def main():
    out_dir = Path(sys.argv[1])
    d = launch.setup("cpu", timeout_s=120)  # the lesson scripts' own set-up: gloo on CPU
    rank, world, device = d.rank, d.world_size, d.device
    try:
        modules = {n: load(n) for n in ("collective_ops", "point_to_point", "ring_allreduce",
                                        "bandwidth_test")}
        co, p2p, ra, bw = modules.values()
        result = {"world_size": world,
                  "collectives": co.run_all(rank, world, device),
                  "p2p": p2p.run_patterns(rank, world, 4099, device),
                  "allreduce": allreduce_cases(ra, rank, world),
                  "subgroup": subgroup_case(ra, rank, world),
                  "input_errors": input_errors(ra),
                  "wrong_detector": wrong_detector(bw, rank, world),
                  "bad_inputs": bad_inputs(modules)}
        args = bw.parse_args(["--sizes", "4K,1000003", "--iters", "1", "--warmup", "0",
                              "--json-out", str(out_dir / "bandwidth.json"),
                              "--plot", str(out_dir / "bandwidth.png")])
        bw.run(args, d)
        # --link with a per-NIC network speed: rows gain the reference (2 NICs x 92% of 50 GB/s)
        # and the percentage; what rank 0 prints is kept to check the header and the note.
        args = bw.parse_args(["--ops", "all_reduce,all_to_all", "--sizes", "4K", "--iters", "1",
                              "--warmup", "0", "--link", "ib-ndr", "--nics", "2"])
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            result["link_rows"] = bw.run(args, d)
        result["link_printed"] = printed.getvalue()
        result["references"] = {f"{op} {link} x{nics}": bw.reference_for(op, link, nics)
                                for op, link, nics in [("all_reduce", "ib-ndr", 8),
                                                       ("reduce_scatter", "ib-hdr", 4),
                                                       ("all_to_all", "ib-ndr", 8),
                                                       ("all_reduce", "nvlink4", None),
                                                       ("all_to_all", "nvlink4", None)]}
        if rank == 0:
            (out_dir / "result.json").write_text(json.dumps(result, indent=1))
        dist.barrier()
    finally:
        launch.teardown()


if __name__ == "__main__":
    main()

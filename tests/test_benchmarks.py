"""benchmarks/: the memory estimator and the benchmark suite.

- memory_estimator.py reproduces the published figures (16 bytes per parameter with fp32 Adam;
  the ZeRO paper's 7.5B model on 64 GPUs), and its library accounting states what DeepSpeed and
  FSDP2 really hold (lesson 03's table);
- its per-rank bytes equal those the lesson scripts measure at world 2: exactly from the
  parameter shapes (02-fsdp's uneven shards included), and from P alone within the padding;
- `distributed_benchmarks.py comm|train|memory --quick` write JSON in the stated schema and a PNG;
- bad input exits 2 with one line.

Cost: the three documented quick commands are run here (so tests/test_readmes.py skips them) and
share their outputs through module-scoped fixtures: `train --quick` launches the lessons 6 times
(worlds 1 and 2; DDP + FSDP in one launch, ZeRO-2, ZeRO-3) and `memory --quick` reuses its runs.
The estimator is pure Python and is checked in-process.
"""

import json
import math
import re
from pathlib import Path

import pytest
from conftest import (
    REPO,
    assert_bad_input,
    load_script,
    read_json,
    readme_mentions,
    run_python,
    run_readme_command,
    run_torchrun,
)

from dtcourse.models import gpt_parameter_count

README = REPO / "benchmarks" / "README.md"
OUT = REPO / "runs" / "bench-quick"
COMM = "python benchmarks/distributed_benchmarks.py comm --quick --out runs/bench-quick"
TRAIN = "python benchmarks/distributed_benchmarks.py train --quick --out runs/bench-quick"
MEMORY = ("python benchmarks/distributed_benchmarks.py memory --quick "
          "--from runs/bench-quick/train.json --out runs/bench-quick")
LAUNCH_TIMEOUT = 280  # 6 launches take ~80 s of wall time on 2 idle cores, more when shared


me = load_script("benchmarks/memory_estimator.py")
bench = load_script("benchmarks/distributed_benchmarks.py")

# The GPT both lessons train at the quick runs' default shape flags.
GPT_SHAPES = bench.gpt_shapes(bench.parse_args(["train", "--quick"]))
P_GPT = gpt_parameter_count(vocab=64, seq_len=32, dim=64, layers=2)


# --------------------------------------------------------------------------------------------------
# The published figures (GB = 1e9 bytes)


def test_sixteen_bytes_per_parameter_with_fp32_adam():
    ddp = me.estimate(7e9, 4, "ddp", "fp32")
    assert ddp["total_bytes"] == 112e9  # 7B x 16 B: every GPU holds everything
    assert (ddp["params_bytes"], ddp["grads_bytes"], ddp["optim_bytes"]) == (28e9, 28e9, 56e9)
    for strategy in ("fsdp-full", "zero3"):
        assert me.estimate(7e9, 4, strategy, "fp32")["total_bytes"] == 28e9  # 112 / 4
    assert me.estimate(70e9, 1, "ddp", "fp32")["total_bytes"] == 1.12e12  # 70B: 1.12 TB
    assert me.estimate(7e9, 4, "ddp", "mixed")["total_bytes"] == 112e9  # 2 + 2 + 12: 16 again


def test_zero_paper_figure_7_5b_on_64_gpus():
    """Rajbhandari et al. 2020, figure 1: Psi = 7.5B, N = 64, K = 12 (mixed-precision Adam)."""
    P, N = 7.5e9, 64
    exact = {"ddp": 16 * P, "zero1": 4 * P + 12 * P / N, "zero2": 2 * P + 14 * P / N,
             "zero3": 16 * P / N}
    published = {"ddp": 120, "zero1": 31.4, "zero2": 16.6, "zero3": 1.9}
    for strategy, expected in exact.items():
        total = me.estimate(P, N, strategy, "mixed")["total_bytes"]
        assert total == round(expected), strategy
        # the paper prints one decimal: 31.41, 16.64, 1.875 GB
        assert abs(total / 1e9 - published[strategy]) <= 0.05, (strategy, total)


def test_library_accounting_is_what_deepspeed_and_fsdp_hold():
    """03-deepspeed/README.md's fp32 column: ZeRO 1-3 keep an fp32 master partition (4P/N) even
    when the weights are fp32; in mixed precision that master is the paper's K = 12 already.
    FSDP2 keeps fp32 shards: 16P/N in both precisions, split 4 + 4 + 8 instead of 2 + 2 + 12."""
    P, N = 8_000_000, 4  # divisible by 2N: no flat-buffer padding

    def held(strategy, precision):  # model states, device and host, without the transients
        e = me.estimate(P, N, strategy, precision, "library")
        return e["total_bytes"] - e["transient_bytes"] + e["host_bytes"]

    assert held("zero1", "fp32") == 4 * P + 4 * P + 12 * P / N
    assert held("zero2", "fp32") == 4 * P + 4 * P / N + 12 * P / N
    assert held("zero3", "fp32") == 20 * P / N
    paper = me.estimate(P, N, "zero3", "mixed")["total_bytes"]
    assert held("zero3", "mixed") == 16 * P / N == paper
    fsdp = me.estimate(P, N, "fsdp-full", "mixed", "library")
    assert (fsdp["params_bytes"], fsdp["grads_bytes"], fsdp["optim_bytes"]) == \
        (4 * P / N, 4 * P / N, 8 * P / N)
    # FSDP shards over all N ranks; hybrid over groups of S (a node), replicated across them
    assert me.estimate(P, 16, "fsdp-full", "fp32", "library")["total_bytes"] == 16 * P / 16
    assert me.estimate(P, 16, "fsdp-hybrid", "fp32", "library",
                       shard_size=4)["total_bytes"] == 16 * P / 4
    # Offload: the device keeps the working weights (ZeRO-2) or nothing (ZeRO-3, whose gradient
    # partition DeepSpeed allocates in host memory) between steps. ZeRO-2's host also keeps a
    # W-byte copy of the weight partition: 18P/N in bf16, 20P/N in fp32, plus a gradient buffer
    # the size of the largest parameter on the host and one on the device. ZeRO-3's host holds
    # 20P/N (bf16) or 24P/N (fp32); its gathered parameters are transient.
    L = 1_000_000  # the largest parameter's elements
    for precision, W in (("mixed", 2), ("fp32", 4)):
        z2 = me.estimate(P, N, "zero2-offload", precision, "library", largest_param=L)
        assert (z2["params_bytes"], z2["grads_bytes"], z2["transient_bytes"]) == (W * P, W * L, 0)
        assert z2["host_bytes"] == (16 + W) * P / N + W * L
        assert z2["host"] == {"params_bytes": W * P / N, "grads_bytes": 4 * P / N + W * L,
                              "optim_bytes": 12 * P / N}
        z3 = me.estimate(P, N, "zero3-offload", precision, "library")
        assert (z3["total_bytes"] - z3["transient_bytes"], z3["host_bytes"]) == \
            (0, (W + 4 + W + 12) * P / N)
    # Transients: without offload every stage's optimizer step makes a new fp32 copy of the
    # gradient partition (4P/N, both precisions); ZeRO-3 (the configs' reuse distance R = 1e9)
    # keeps the last R/2 parameter elements gathered from forward to backward, the whole of a
    # model below R/2; these two never coexist, so the column holds the larger.
    for precision, W in (("mixed", 2), ("fp32", 4)):
        t = {s: me.estimate(P, N, s, precision, "library")["transient_bytes"]
             for s in ("zero1", "zero2", "zero3", "zero2-offload", "zero3-offload")}
        assert t == {"zero1": 4 * P / N, "zero2": 4 * P / N, "zero3": W * P,
                     "zero2-offload": 0, "zero3-offload": W * P}, (precision, t)
        big = 7 * 10**9
        assert me.estimate(big, N, "zero3", precision, "library")["transient_bytes"] == \
            max(4 * big / N, W * 0.5e9)
        assert me.estimate(big, N, "zero3-offload", precision, "library",
                           reuse_distance=0)["transient_bytes"] == 0
        # the paper's accounting keeps its per-layer gathers
        assert me.estimate(P, N, "zero3", precision, "paper")["transient_bytes"] == 0
    # ZeRO-2 offload under gradient accumulation also keeps host buffers holding the whole
    # gradients of the parameters overlapping each partition. Shapes of 24, 10 and 16 elements:
    # the flat buffer pads 50 to 52, partitions [0, 26) and [26, 52); rank 0 overlaps the first
    # two tensors (34 elements), rank 1 the last two (26).
    shapes = [(6, 4), (10,), (4, 4)]
    for rank, overlap in enumerate((34, 26)):
        for precision, W in (("fp32", 4), ("mixed", 2)):
            one, two = (me.estimate(50, 2, "zero2-offload", precision, "library", shapes=shapes,
                                    rank=rank, grad_accum=a)["host_bytes"] for a in (1, 2))
            # host: (16 + W) per partition element, the largest parameter's 24-element
            # buffer, and while accumulating the overlapping gradients
            base = (16 + W) * 26 + W * 24
            assert (one, two) == (base, base + W * overlap), (rank, precision)


def test_activations_shrink_with_checkpointing():
    kw = {"layers": 32, "hidden": 4096, "heads": 32, "seq_len": 2048, "batch_size": 1}
    full = me.estimate(7e9, 8, "zero3", "mixed", **kw)["activations_bytes"]
    ckpt = me.estimate(7e9, 8, "zero3", "mixed", activation_checkpointing=True,
                       **kw)["activations_bytes"]
    s, b, h, a, L = 2048, 1, 4096, 32, 32
    per_layer = s * b * h * (34 + 5 * a * s / h)  # Korthikanti et al. 2022, 16-bit
    assert full == round(L * per_layer)
    assert ckpt == round(L * 2 * s * b * h + per_layer)  # inputs kept + one layer recomputed


# --------------------------------------------------------------------------------------------------
# The benchmark suite's quick runs (the documented commands, run once here)


@pytest.fixture(scope="module")
def comm():
    run_readme_command(COMM, timeout=LAUNCH_TIMEOUT)
    return read_json(OUT / "comm.json")


@pytest.fixture(scope="module")
def train():
    run_readme_command(TRAIN, timeout=LAUNCH_TIMEOUT)
    return read_json(OUT / "train.json")


@pytest.fixture(scope="module")
def memory(train):
    run_readme_command(MEMORY, timeout=60)  # reuses the train runs: no launch
    return read_json(OUT / "memory.json")


def assert_png(path: Path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    assert 5_000 < len(data) < 200_000, (path, len(data))


def assert_machine(result: dict):
    machine = result["machine"]
    for key in ("cpu", "cpu_cores", "gpus", "torch", "deepspeed", "platform"):
        assert key in machine, key
    assert machine["cpu_cores"] >= 1 and machine["torch"]
    assert (result["device"], result["backend"]) == ("cpu", "gloo")  # the suite hides GPUs


def test_comm_quick_writes_busbw_rows_and_a_plot(comm):
    assert comm["kind"] == "comm"
    assert_machine(comm)
    assert {(r["op"], r["bytes"]) for r in comm["rows"]} == {
        (op, size) for op in ("all_reduce", "all_gather") for size in (4096, 262144)}
    for row in comm["rows"]:
        assert row["world_size"] == 2 and row["wrong"] == 0, row
        factor = 2 * (2 - 1) / 2 if row["op"] == "all_reduce" else (2 - 1) / 2  # nccl-tests
        assert row["busbw_GBps"] == pytest.approx(row["algbw_GBps"] * factor, rel=1e-12)
        assert row["algbw_GBps"] == pytest.approx(row["bytes"] / row["time_us"] / 1e3, rel=1e-9)
    assert_png(OUT / "comm.png")


def test_train_quick_reports_throughput_efficiency_and_memory(train):
    assert train["kind"] == "train"
    assert_machine(train)
    strategies = ["ddp", "fsdp-full", "zero2", "zero3"]
    assert train["config"]["worlds"] == [1, 2] and train["config"]["strategies"] == strategies
    assert len(train["runs"]) == len(strategies) * 2
    for row in train["summary"]:
        assert row["tokens_per_s_median"] > 0 and len(row["per_rank"]) == row["world_size"]
        run1 = next(r for r in train["summary"] if r["strategy"] == row["strategy"]
                    and r["world_size"] == 1)
        if row["world_size"] == 1:
            assert row["scaling_efficiency"] is None
        else:  # one repeat: exactly tokens/s(2) / (2 x tokens/s(1))
            assert row["scaling_efficiency"] == pytest.approx(
                row["tokens_per_s_median"] / (2 * run1["tokens_per_s_median"]), rel=1e-12)
    # Both lessons train the course's GPT from the same shape flags: the same P, reported by each
    # script, equal to the formula of dtcourse.models.
    params = {r["script"]: r["params"] for r in train["runs"]}
    assert params == {"02-fsdp/fsdp_transformer.py": P_GPT,
                      "03-deepspeed/deepspeed_train.py": P_GPT}
    assert_png(OUT / "train.png")


# --------------------------------------------------------------------------------------------------
# The estimator against the bytes the lesson scripts measure, at world 2


def per_rank_runs(train, world=2):
    return [r for r in train["runs"] if r["world_size"] == world]


def test_estimator_equals_measured_per_rank_bytes_at_world_2(train):
    """Library accounting, fed the model's exact shapes, equals every rank's `per_rank` bytes
    (params, grads, optimizer state) as written by 02-fsdp and 03-deepspeed, to the byte."""
    runs = per_rank_runs(train)
    assert {r["strategy"] for r in runs} == {"ddp", "fsdp-full", "zero2", "zero3"}
    for run in runs:
        shapes = GPT_SHAPES
        P = sum(math.prod(s) for s in shapes)
        assert P == run["params"], run["strategy"]  # the shapes are the script's model
        for rank, held in enumerate(run["per_rank"]):
            est = me.estimate(P, 2, run["strategy"], "fp32", "library", shapes=shapes, rank=rank)
            # grad_bytes: at grad-accum 1 DeepSpeed's only micro-step is its last one
            assert [held["param_bytes"], held["grad_bytes"], held["optim_bytes"]] == \
                [est["params_bytes"], est["grads_bytes"], est["optim_bytes"]], \
                (run["strategy"], rank, held, est)


def test_estimator_from_p_alone_is_within_the_padding(train):
    """Without the shapes the estimator splits P evenly; the measured bytes may exceed that by
    the padding of uneven shards only: FSDP ceil(rows/N) rows per tensor, DeepSpeed stage 3
    ceil(numel/N) elements per tensor, stages 1-2 a flat buffer padded to a multiple of 2N."""
    for run in per_rank_runs(train):
        fsdp = run["script"] == "02-fsdp/fsdp_transformer.py"
        shapes = GPT_SHAPES
        P, N = run["params"], 2
        # bytes the padding can add to one rank (fp32: 4 per weight/grad, 12 or 8 optimizer)
        if fsdp:  # rows padded to ceil(rows/N) per tensor: 4 + 4 + 8 bytes per element
            bound = 16 * (sum(math.ceil(s[0] / N) * math.prod(s[1:]) for s in shapes) - P / N)
        elif run["strategy"] == "zero3":  # ceil(numel/N) per tensor: 4 + 4 + 4 + 8 bytes
            bound = 20 * (sum(math.ceil(math.prod(s) / N) for s in shapes) - P / N)
        else:  # a flat buffer padded to a multiple of 2N: whole on every rank, partitioned
            flat = math.ceil(P / (2 * N)) * 2 * N
            bound = 4 * (flat - P) + 16 * (flat - P) / N
        # torch Adam's step counters are known from the tensor count (DDP and FSDP only)
        tensors = len(shapes) if fsdp else 0
        est = me.estimate(P, N, run["strategy"], "fp32", "library", tensors=tensors)
        states = est["total_bytes"] - est["transient_bytes"]  # the model states only
        for held in run["per_rank"]:
            measured = held["param_bytes"] + held["grad_bytes"] + held["optim_bytes"]
            assert abs(measured - states) <= bound, (run["strategy"], measured, est)


def test_deepspeed_bf16_bytes_equal_the_library_accounting(tmp_path):
    """DeepSpeed in bf16 (CPU), stages 1-3 at world 2 with 2 micro-steps: every byte of every
    tensor each rank holds (working weights, gradients, fp32 master, moments) equals the
    estimator's `--accounting library --precision mixed`, and, as the ZeRO paper says for mixed
    precision, its 2 + 2 + 12 split (K = 12 counts the master). Then offload and the
    transients, measured by lesson 03's census (assert_offload_and_transients_measured)."""
    run_python("benchmarks/distributed_benchmarks.py", "memory", "--precision", "bf16",
               # 2 steps: the bytes are taken in the last one, after Adam's state exists
               "--strategies", "zero1,zero2,zero3", "--steps", "2", "--out", tmp_path,
               timeout=LAUNCH_TIMEOUT)
    data = read_json(tmp_path / "memory.json")
    rows = {(r["strategy"], r["rank"]): r for r in data["rows"]}
    assert set(rows) == {(s, r) for s in ("zero1", "zero2", "zero3") for r in (0, 1)}
    for key, row in rows.items():
        assert row["library_minus_measured"] == 0, (key, row)
        assert row["paper_minus_measured"] == 0, (key, row)
    assert_offload_and_transients_measured(tmp_path)


def assert_offload_and_transients_measured(tmp_path):
    """03-deepspeed/zero_offload.py in bf16 at world 2 (one launch, four configs, a 2 x
    Linear(64, 64) MLP): what offload keeps on each side equals the estimator's library
    accounting, the pinned 16-bit weight copy and the largest-parameter gradient buffers of
    ZeRO-2 offload included (host 18P/N + one parameter, not 16P/N), and so do the transients:
    the fp32 gradient copy each stage's step makes without offload (4P/N) and the parameters
    ZeRO-3 keeps gathered from forward to backward (reuse distance 1e9: the whole model)."""
    out = tmp_path / "offload.json"
    configs = ["zero1_config", "zero2_offload_config", "zero3_config", "zero3_offload_config"]
    run_torchrun("03-deepspeed/zero_offload.py", "--precision", "bf16", "--configs", *configs,
                 "--steps", "2", "--layers", "2", "--width", "64", "--metrics-out", out,
                 nproc=2, timeout=LAUNCH_TIMEOUT)
    data = read_json(out)
    shapes = [(64, 64), (64,)] * 2
    P = sum(math.prod(s) for s in shapes)
    assert data["n_params"] == P
    strategy = {"zero1_config": "zero1", "zero2_offload_config": "zero2-offload",
                "zero3_config": "zero3", "zero3_offload_config": "zero3-offload"}
    for config in configs:
        run = data["runs"][config]
        assert run["precision"] == "bf16"
        for rank, held in enumerate(run["per_rank"]):
            est = me.estimate(P, 2, strategy[config], "mixed", "library", shapes=shapes,
                              rank=rank)
            side = {home: sum(b for b, h in held["census"].values() if h == home)
                    for home in ("device", "host")}
            t = held["transient"]
            # the step's copy comes after backward has released the gathered parameters
            assert held["gathered_in_step_bytes"] == 0, (config, rank)
            assert est["transient_bytes"] == \
                max(t["gathered after forward"], t["fp32 gradient copy in step"]), \
                (config, rank, t, est)
            assert t["fp32 gradient copy in step"] == (0 if "offload" in config else 4 * P // 2)
            if config == "zero1_config":
                continue  # its model states: deepspeed_train.py's census, the test above
            states = est["total_bytes"] - est["transient_bytes"]
            assert (side["device"], side["host"]) == (states, est["host_bytes"]), \
                (config, rank, held["census"], est)
    # ZeRO-2 offload, by name: host 18P/N + the largest parameter, device the weights + it
    census = data["runs"]["zero2_offload_config"]["per_rank"][0]["census"]
    assert census["weights, host copy"] == [2 * P // 2, "host"]
    assert census["largest-param grad, host"] == [2 * 64 * 64, "host"]
    assert census["largest-param grad, dev."] == [2 * 64 * 64, "device"]
    host = sum(b for b, h in census.values() if h == "host")
    assert host == 18 * P // 2 + 2 * 64 * 64


def test_uneven_fsdp_shards_match_to_the_byte(tmp_path):
    """02-fsdp/fsdp_basics.py's MLP has a 25-row layer: 13 rows on rank 0, 12 on rank 1. The
    estimator, given the shapes the script reports, predicts each rank's different bytes."""
    out = tmp_path / "basics.json"
    run_torchrun("02-fsdp/fsdp_basics.py", "--json-out", out, nproc=2, timeout=LAUNCH_TIMEOUT)
    data = read_json(out)
    shapes = [tuple(s) for s in data["parameters"].values()]
    per_rank = data["per_rank"]
    assert per_rank[0] != per_rank[1]  # the uneven split is really there
    for rank, held in enumerate(per_rank):
        est = me.estimate(data["params"], 2, "fsdp-full", "fp32", "library", shapes=shapes,
                          rank=rank)
        assert [held["param_bytes"], held["grad_bytes"], held["optim_bytes"]] == \
            [est["params_bytes"], est["grads_bytes"], est["optim_bytes"]], (rank, held, est)
    # From P alone: 16P/N + the step counters, off by at most the padding, 16 bytes per row
    # element that ceil(rows/N) adds: rank 0 holds 788 elements, rank 1 757, P/N = 772.5.
    even = me.estimate(data["params"], 2, "fsdp-full", "fp32", "library", tensors=len(shapes))
    padded = sum(math.ceil(s[0] / 2) * math.prod(s[1:]) for s in shapes)
    for held in per_rank:
        measured = held["param_bytes"] + held["grad_bytes"] + held["optim_bytes"]
        assert abs(measured - even["total_bytes"]) <= 16 * (padded - data["params"] / 2)


def test_memory_quick_compares_measured_library_and_paper(memory, train):
    assert memory["kind"] == "memory" and memory["source"] == "runs/bench-quick/train.json"
    assert_machine(memory)
    rows = {(r["strategy"], r["rank"]): r for r in memory["rows"]}
    assert set(rows) == {(s, r) for s in ("ddp", "fsdp-full", "zero2", "zero3") for r in (0, 1)}
    for run in per_rank_runs(train):  # the table shows exactly the train runs' bytes
        for rank, held in enumerate(run["per_rank"]):
            row = rows[(run["strategy"], rank)]
            assert row["measured"]["held_bytes"] == \
                held["param_bytes"] + held["grad_bytes"] + held["optim_bytes"]
            assert row["library_minus_measured"] == 0
    # What the paper's formula leaves out (fp32, N = 2): DeepSpeed's fp32 master partition 4P/N;
    # torch Adam's 4-byte step counter per parameter tensor.
    for strategy in ("zero2", "zero3"):
        assert rows[(strategy, 0)]["paper_minus_measured"] == -4 * P_GPT // 2
    for strategy in ("ddp", "fsdp-full"):
        assert rows[(strategy, 0)]["paper_minus_measured"] == -4 * len(GPT_SHAPES)
    assert_png(OUT / "memory.png")


# --------------------------------------------------------------------------------------------------
# Bad input and the README


@pytest.mark.parametrize("script,args,pattern", [
    ("memory_estimator", ["--params", "-1"], r"--params must be a positive number"),
    ("memory_estimator", ["--params", "gpt5"], r"neither a number .* nor a preset"),
    ("memory_estimator", ["--params", "7e9", "--strategy", "zero4"], r"invalid choice: 'zero4'"),
    ("memory_estimator", ["--params", "7e9", "--world-size", "0"], r"--world-size must be at"),
    ("memory_estimator", ["--params", "7e9", "--world-size", "6", "--strategy", "fsdp-hybrid",
                          "--shard-size", "4"], r"--shard-size 4 must .* divide --world-size 6"),
    ("memory_estimator", ["--fits", "0"], r"--fits must be a positive number of GB"),
    ("memory_estimator", ["--fits", "80", "--params", "7e9"], r"--fits finds the largest model"),
    ("memory_estimator", ["--fits", "80", "--accounting", "library"], r"--fits uses the paper's"),
    ("memory_estimator", ["--params", "1e6", "--largest-param", "2e6", "--accounting", "library"],
     r"--largest-param must be a number of elements up to --params 1,000,000"),
    ("memory_estimator", ["--params", "1e6", "--largest-param", "1e3"],
     r"add --accounting library"),
    ("memory_estimator", ["--params", "1e6", "--reuse-distance", "-1"],
     r"--reuse-distance must be"),
])
def test_bad_input_exits_2_with_one_line(script, args, pattern):
    result = run_python(f"benchmarks/{script}.py", *args, check=False, timeout=60)
    assert_bad_input(result, pattern)


BENCH_BAD_INPUT = [
    (["train", "--worlds", "0"], r"world sizes must be at least 1"),
    (["train", "--strategies", "zero4"], r"zero4 not among ddp, "),
    (["memory", "--from", "missing.json"], r"no such file"),
]


def test_benchmark_bad_input_exits_2_with_one_line(capsys):
    """The first case as a process (each one imports torch: 2-3 s), every case in this process:
    the script's own parse_args, which writes the line and exits before anything is launched."""
    args, pattern = BENCH_BAD_INPUT[0]
    assert_bad_input(run_python("benchmarks/distributed_benchmarks.py", *args, check=False,
                                timeout=60), pattern)
    for args, pattern in BENCH_BAD_INPUT:
        with pytest.raises(SystemExit) as exit_:
            bench.parse_args(args)
        assert exit_.value.code == 2, args
        lines = capsys.readouterr().err.splitlines()
        assert len(lines) == 1 and re.search(pattern, lines[0]), (args, lines)


def test_readme_documents_the_quick_and_the_sample_runs():
    for command in (COMM, TRAIN, MEMORY):
        assert readme_mentions(README, command), command
    text = README.read_text()
    for name in ("comm", "train", "memory"):  # the committed sample run, shown in the README
        assert f"results/{name}.png" in text
        assert_png(REPO / "benchmarks" / "results" / f"{name}.png")
        assert json.loads((REPO / "benchmarks" / "results" / f"{name}.json").read_text())["kind"] \
            == name


def test_which_strategy_boundaries_come_from_the_estimator():
    """The course map's "Which strategy?" table quotes its boundaries from `--fits` (the quoted
    output itself is re-checked by the README check): DDP 16 B/param, ZeRO-2 4 + 12/N in fp32 and
    2 + 14/N mixed, ZeRO-3 16/N."""
    lines = me.largest_models(80, 8)
    rows = {line.split()[0]: line.split()[1:] for line in lines[2:]}
    assert rows["ddp"][:4] == ["16.00", "5.0B", "16.00", "5.0B"]
    assert rows["zero2"][:4] == ["5.50", "14.5B", "3.75", "21.3B"]
    assert rows["zero3"][:4] == ["2.00", "40.0B", "2.00", "40.0B"]
    table = (REPO / "README.md").read_text().split("## Which strategy?")[1].split("```")[0]
    for figure in ("under 5B", "5B to 14.5B", "21.3B", "up to 40B on 8 GPUs"):
        assert figure in table, figure

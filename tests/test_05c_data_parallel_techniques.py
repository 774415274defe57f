"""Lesson 05c: the techniques that make data parallelism fast and debuggable
(05-advanced/c-data-parallel-techniques/).

Each fixture is one launch of a lesson script (module-scoped, shared by several asserts), so the
whole file costs about a dozen process launches on a 2-core CPU. The tests read what a reader's
run writes (--metrics-out, --export); two hand-written mechanisms (the gradients of the --buggy
accumulation, top-k's error feedback) are checked through the scripts' own functions by one
worker, tests/workers_05c/mechanisms.py. The README's quoted outputs that do not depend on the
machine's speed are compared with a fresh run of the command above them.
"""

import importlib
import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import (
    REPO,
    assert_state_dicts_close,
    load_export,
    load_script,
    read_json,
    readme_mentions,
    run_python,
    run_readme_command,
    run_torchrun,
)

from dtcourse.models import MLP

LESSON = "05-advanced/c-data-parallel-techniques"
DOCS = sorted((REPO / LESSON).rglob("*.md"))

ACCUM = f"{LESSON}/gradient_accumulation.py"
OVERLAP = f"{LESSON}/communication_overlap.py"
COMPRESS = f"{LESSON}/gradient_compression.py"
ASYNC = f"{LESSON}/async_sgd.py"
PROFILE = f"{LESSON}/profiling.py"
DATA = f"{LESSON}/data_loading.py"
HANG = f"{LESSON}/hang_debugging.py"
FIGURES = f"{LESSON}/figures/dp_figures.py"
MECHANISMS = "tests/workers_05c/mechanisms.py"
README = REPO / LESSON / "README.md"

# float32 on CPU: the same samples, summed in a different order (per rank, then all-reduced)
# differ by a few ulps per step; 1e-5 relative / 1e-6 absolute leaves a margin of ~10x over
# the measured ~2e-7 after a few steps and still catches any real difference (a missing
# average, a gradient reduced twice, an unsynchronised replica all give errors >= 1e-3).
RTOL, ATOL = 1e-5, 1e-6


# --------------------------------------------------------------------------------------------------
# Gradient accumulation


@pytest.fixture(scope="module")
def accumulation(tmp_path_factory):
    d = tmp_path_factory.mktemp("accum")
    common = ["--steps", "3", "--hidden", "32"]
    # One process with the full batch of 32 per step vs 2 ranks x micro-batch 8 x accumulation 2.
    run_python(ACCUM, *common, "--batch-size", "32", "--grad-accum", "1",
               "--export", d / "w1.pt", "--metrics-out", d / "w1.json")
    run_torchrun(ACCUM, *common, "--batch-size", "8", "--grad-accum", "2",
                 "--export", d / "w2.pt", "--metrics-out", d / "w2.json")
    return d


@pytest.fixture(scope="module")
def mechanisms(tmp_path_factory):
    """The worker's results: step 1's gradients both ways (world 2, micro-batch 8, accumulation
    2, --hidden 32, as the accumulation fixture's first step) and top-k's bookkeeping after 30
    steps of gradient_compression.py's defaults."""
    out = tmp_path_factory.mktemp("mechanisms") / "mechanisms.pt"
    run_torchrun(MECHANISMS, "--out", out, "--topk-steps", "30")
    return torch.load(out, weights_only=True)


def test_accumulation_world2_equals_one_process_full_batch(accumulation):
    d = accumulation
    assert_state_dicts_close(load_export(d / "w2.pt"), load_export(d / "w1.pt"), rtol=RTOL,
                             atol=ATOL, msg="world 2 x accum 2 vs world 1 full batch:")
    w1, w2 = read_json(d / "w1.json"), read_json(d / "w2.json")
    assert w1["global_batch"] == w2["global_batch"] == 32
    torch.testing.assert_close(torch.tensor(w2["losses"]), torch.tensor(w1["losses"]),
                               rtol=RTOL, atol=ATOL)
    # no_sync(): one all-reduce per optimizer step although there are two backward passes.
    assert w2["allreduces_per_step"] == 1


def test_buggy_accumulation_gradients_are_exactly_accum_times_larger(accumulation,
                                                                    mechanisms):
    grads = mechanisms["grads"]
    assert set(grads) == {"correct", "buggy"}
    # Bitwise: step 1 computed both ways by the script's first_step_both_ways(), on the same
    # weights and samples, through the same accumulate() that --buggy trains with; the only
    # difference is the factor 1/2 on each micro-step loss, and scaling by a power of two is
    # exact in binary floating point (backward is linear in the loss gradient, and the
    # all-reduce sums the scaled values), so every gradient is exactly 2x.
    for name, correct in grads["correct"].items():
        torch.testing.assert_close(grads["buggy"][name], 2 * correct, rtol=0, atol=0,
                                   msg=lambda m, n=name: f"{n}: {m}")
    assert read_json(accumulation / "w2.json")["buggy"] is False


# --------------------------------------------------------------------------------------------------
# Communication overlap: naive / flat / overlap / bucketed / ddp

OVERLAP_ARGS = ["--dim", "32", "--depth", "2", "--steps", "3", "--warmup", "1",
                "--bucket-cap-mb", "0.01", "1"]
VARIANT_FILES = ["naive", "flat", "overlap", "bucketed_0.01mb", "bucketed_1mb", "ddp_0.01mb",
                 "ddp_1mb"]


@pytest.fixture(scope="module")
def overlap(tmp_path_factory):
    d = tmp_path_factory.mktemp("overlap")
    # The one-process reference needs no wrapper at all: the naive variant on the full batch.
    # With one variant --export writes PATH itself; with several, PATH with each variant's tag
    # before the suffix (w2.naive.pt, w2.bucketed_0.01mb.pt, ...), listed in the metrics.
    run_python(OVERLAP, *OVERLAP_ARGS, "--batch-size", "8", "--variants", "naive",
               "--export", d / "w1.pt")
    run_torchrun(OVERLAP, *OVERLAP_ARGS, "--batch-size", "4", "--export", d / "w2.pt",
                 "--metrics-out", d / "m.json")
    return d


def test_every_variant_equals_one_process(overlap):
    # The model has a frozen parameter (pos), a buffer (feature_scale) and tied weights
    # (head.weight is embed.weight); each rank initialises with its own seed, so only the
    # wrappers' broadcast from rank 0 can make world 2 match world 1.
    reference = load_export(overlap / "w1.pt")
    exports = {r["tag"]: r["export"] for r in read_json(overlap / "m.json")["variants"]}
    assert sorted(exports) == sorted(VARIANT_FILES)
    for name in VARIANT_FILES:
        assert exports[name] == str(overlap / f"w2.{name}.pt")
        sd = load_export(exports[name])
        assert_state_dicts_close(sd, reference, rtol=RTOL, atol=ATOL,
                                 msg=f"world 2 {name} vs world 1:")
        assert sd["head.weight"].data_ptr() == sd["embed.weight"].data_ptr(), \
            "the tie must survive training and export"


def test_collectives_skip_frozen_and_reduce_tied_once(overlap):
    rows = read_json(overlap / "m.json")["variants"]
    assert {r["variant"] for r in rows} == {"naive", "flat", "overlap", "bucketed", "ddp"}
    for r in rows:
        assert set(r) >= {"variant", "bucket_cap_mb", "step_time_s", "exposed_comm_s",
                          "collectives"}
        assert (r["bucket_cap_mb"] is None) == (r["variant"] in ("naive", "flat", "overlap"))
    by = {(r["variant"], r["bucket_cap_mb"]): r for r in rows}
    sd = load_export(overlap / "w1.pt")
    # Trainable tensors: everything in the state dict except the frozen `pos`, the buffer and
    # the second name of the tied tensor. A wrapper that reduced the tie twice or waited for the
    # frozen parameter would show a different count (or hang).
    trainable = len(sd) - 3
    assert by[("naive", None)]["collectives"] == trainable
    assert by[("overlap", None)]["collectives"] == trainable
    assert by[("flat", None)]["collectives"] == 1
    assert 1 < by[("bucketed", 0.01)]["collectives"] < trainable
    assert by[("bucketed", 1.0)]["collectives"] == 1


def test_overlapped_allreduces_start_before_backward_ends(overlap):
    rows = read_json(overlap / "m.json")["variants"]
    by = {(r["variant"], r["bucket_cap_mb"]): r for r in rows}
    # Offsets are each launch minus the moment the step's last gradient was accumulated (both
    # stamps measured from the step's start), the same reference for every variant.
    for key in (("overlap", None), ("bucketed", 0.01), ("ddp", 0.01)):
        offsets = by[key]["launch_offsets_s"]
        assert len(offsets) > 1 and all(t < 0 for t in offsets[:-1]), (key, offsets)
        assert offsets[0] < offsets[-1], "launches follow backward through the layers"
        # the last one carries the last gradient (the tied embedding's): launched after it
        assert offsets[-1] >= 0, (key, offsets)
        assert by[key]["first_launch_s"] < 0, key
    # One bucket holds every gradient: it is full only at the last gradient, in DDP as in the
    # hand-written version. (Measured from the end of backward(), DDP's one bucket looked launched
    # before it, because DDP's backward() returns only after waiting for its all-reduces.)
    for key in (("naive", None), ("flat", None), ("bucketed", 1.0), ("ddp", 1.0)):
        assert all(t >= 0 for t in by[key]["launch_offsets_s"]), key


def test_bucketed_uses_ddps_bucket_rule(overlap):
    # DDPBucketed closes a bucket once it holds the cap or more, as DDP's bucket assignment
    # does, so the two issue the same number of all-reduces at the same cap. (Closing a bucket
    # before it would exceed the cap gave more buckets than DDP at the same size.)
    rows = read_json(overlap / "m.json")["variants"]
    by = {(r["variant"], r["bucket_cap_mb"]): r["collectives"] for r in rows}
    for cap in (0.01, 1.0):
        assert by[("bucketed", cap)] == by[("ddp", cap)], (cap, by)


def test_timed_ddp_makes_only_gradient_collectives():
    # By default DDP broadcasts every buffer before every forward: a collective the hand-written
    # wrappers do not make and the collectives column (the comm hook's calls) does not count.
    # The timed DDP broadcasts TiedLM's constant buffer once and no more, so its rows time what
    # the others time. One process, a one-rank gloo group: the broadcast still goes through the
    # dispatcher, where CollectiveCounter sees it.
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dtcourse.comm import CollectiveCounter
    co = load_script(OVERLAP)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        def forward_collectives(model):
            with CollectiveCounter() as counter:
                model(torch.zeros(2, 4, dtype=torch.long))
            return counter.summary()
        assert forward_collectives(DDP(co.TiedLM(16, 8, 1, 4), bucket_cap_mb=1)) != {}
        timed = co.wrap_ddp(co.TiedLM(16, 8, 1, 4), 1.0, torch.device("cpu"), [])
        assert forward_collectives(timed) == {}
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="no CUDA GPU on this machine: the GPU tier runs where one is")
def test_overlap_timings_on_cuda(tmp_path):
    # On CUDA a host clock read after queueing the work times the queueing: the script's step
    # times wait for the GPU (timing.clock) and its launch offsets are CUDA events on the compute
    # stream (timing.stamp). With those, the offsets keep their meaning on a GPU: per-tensor and
    # 1 MB buckets launch while backward still computes, one 64 MB bucket (every gradient) at
    # the last gradient, in DDP as by hand; and 27 blocking all-reduces cost time.
    # the GPUs this process may use (an outer CUDA_VISIBLE_DEVICES is kept); on one GPU the
    # all-reduces are local copies, and the offsets and the naive step's cost still hold
    gpus = {"CUDA_VISIBLE_DEVICES": os.environ.get(
        "CUDA_VISIBLE_DEVICES", ",".join(map(str, range(torch.cuda.device_count()))))}
    world = min(2, torch.cuda.device_count())
    run_torchrun(OVERLAP, "--device", "cuda", "--dim", "512", "--steps", "8", "--warmup", "3",
                 "--bucket-cap-mb", "1", "64", "--metrics-out", tmp_path / "m.json",
                 nproc=world, timeout=300, env=gpus)
    rows = read_json(tmp_path / "m.json")["variants"]
    by = {(r["variant"], r["bucket_cap_mb"]): r for r in rows}
    for key in (("overlap", None), ("bucketed", 1.0), ("ddp", 1.0)):
        assert by[key]["first_launch_s"] < 0, (key, by[key]["launch_offsets_s"])
    for key in (("naive", None), ("flat", None), ("bucketed", 64.0), ("ddp", 64.0)):
        assert all(t >= 0 for t in by[key]["launch_offsets_s"]), key
    naive = by[("naive", None)]
    assert naive["step_time_s"] > naive["compute_step_time_s"], naive


def test_overlap_figure(overlap, tmp_path):
    run_python(FIGURES, overlap / "m.json", "--out", tmp_path / "o.png")
    assert (tmp_path / "o.png").stat().st_size > 10_000


# --------------------------------------------------------------------------------------------------
# Gradient compression


@pytest.fixture(scope="module")
def compression(tmp_path_factory):
    d = tmp_path_factory.mktemp("compression")
    run_torchrun(COMPRESS, "--steps", "30", "--metrics-out", d / "m.json",
                 "--export", d / "w.pt")
    return d


def test_fp16_bf16_hooks_track_uncompressed_training(compression):
    rows = {r["method"]: r for r in read_json(compression / "m.json")["methods"]}
    base = rows["none"]["losses"]
    decrease = base[0] - min(base)
    # Each step's gradient is rounded once to the narrow type (unit roundoff u = 2^-11 for fp16,
    # 2^-8 for bf16), so each update, and the loss decrease it buys, is off by at most a
    # fraction u: the curves may differ by u x the total decrease (measured: ~50x below).
    for method, u in (("fp16", 2**-11), ("bf16", 2**-8)):
        assert rows[method]["compression_ratio"] == 2.0
        diff = max(abs(a - b) for a, b in zip(rows[method]["losses"], base))
        assert diff <= u * decrease, f"{method}: loss differs by {diff} > {u * decrease}"


def test_powersgd_and_topk_compress_and_still_learn(compression):
    rows = {r["method"]: r for r in read_json(compression / "m.json")["methods"]}
    assert rows["none"]["compression_ratio"] == 1.0
    for method in ("powersgd", "topk"):
        r = rows[method]
        assert r["compression_ratio"] > 10, (method, r["compression_ratio"])
        # Within the 30-step budget the loss falls by at least half of what uncompressed
        # training achieves.
        drop, base_drop = r["losses"][0] - r["final_loss"], \
            rows["none"]["losses"][0] - rows["none"]["final_loss"]
        assert drop > 0.5 * base_drop, (method, drop, base_drop)


def test_wire_ratio_of_topk_shrinks_with_the_world_size_and_powersgds_does_not(tmp_path):
    """On a ring an all-reduce sends 2(W-1)/W x its payload per rank, an all-gather (W-1) x: at
    W = 4 top-k's ratio on the wire is half its payload ratio (2/W), PowerSGD's (all-reduces)
    equals its payload ratio. At W = 2 the two formulas coincide, so this needs 4 ranks."""
    run_torchrun(COMPRESS, "--steps", "4", "--methods", "none", "powersgd", "topk",
                 "--powersgd-start", "2", "--metrics-out", tmp_path / "m.json", nproc=4)
    rows = {r["method"]: r for r in read_json(tmp_path / "m.json")["methods"]}
    assert rows["none"]["wire_ratio"] == pytest.approx(1.0)
    assert rows["topk"]["wire_ratio"] == pytest.approx(rows["topk"]["compression_ratio"] / 2,
                                                       rel=1e-6)
    assert rows["powersgd"]["wire_ratio"] == pytest.approx(rows["powersgd"]["compression_ratio"],
                                                           rel=1e-6)


def test_compression_exports_and_figure(compression, tmp_path):
    m = read_json(compression / "m.json")
    assert m["world_size"] == 2 and m["global_batch"] == 64 and len(m["losses"]) == 30
    # One plain state dict per method; each loads strictly into the MLP it trained.
    for r in m["methods"]:
        assert r["export"] == str(compression / f"w.{r['method']}.pt")
        MLP(256).load_state_dict(load_export(r["export"]), strict=True)
    run_python(FIGURES, compression / "m.json", "--out", tmp_path / "c.png")
    assert (tmp_path / "c.png").stat().st_size > 10_000


def test_error_feedback_conserves_the_gradient(mechanisms):
    check = mechanisms["error_feedback"]
    assert check["sum_grads"], "the top-k hook saw no gradients"
    for name, total in check["sum_grads"].items():
        # Each step splits grad + residual exactly into (sent, new residual); the only error is
        # the float32 rounding of grad + residual, once per step: 30 x 2^-24 relative on values
        # below 1 is < 2e-6.
        torch.testing.assert_close(check["sum_sent"][name] + check["residual"][name].double(),
                                   total, rtol=0, atol=2e-6, msg=lambda m, n=name: f"{n}: {m}")
        assert check["residual"][name].abs().sum() > 0, "top-k must leave something behind"


# --------------------------------------------------------------------------------------------------
# Asynchronous and local SGD


@pytest.fixture(scope="module")
def async_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("async")
    # 1 server + 2 workers taking 5 and 20 ms per step; local SGD with H = 1. The fast worker's
    # 5 ms keeps it pushing all through the slow worker's steps (with 0 ms it could finish its 10
    # steps before the slow worker's first push on a busy machine, and show no staleness).
    run_torchrun(ASYNC, "--steps", "10", "--local-steps", "1", "--worker-delay-ms", "5", "20",
                 "--export", d / "w.pt", "--metrics-out", d / "run.json", nproc=3)
    return d


def test_local_sgd_with_h1_equals_synchronous_sgd(async_run):
    assert_state_dicts_close(load_export(async_run / "w.local.pt"),
                             load_export(async_run / "w.sync.pt"), rtol=RTOL, atol=ATOL,
                             msg="local SGD H=1 vs sync SGD:")
    run = read_json(async_run / "run.json")
    assert run["modes"]["local"]["allreduces"] == run["modes"]["sync"]["allreduces"] == 10


def test_parameter_server_measures_staleness(async_run):
    a = read_json(async_run / "run.json")["modes"]["async"]
    assert a["gradients_applied"] == 2 * 10
    # The slow worker's gradients arrive after the fast one has already updated the weights.
    assert a["mean_staleness_per_worker"][1] > 0 and a["max_staleness"] >= 1
    assert sum(a["pushes_per_worker"]) == 2 * 10 + 2  # + the one push each worker lost at STOP


# --------------------------------------------------------------------------------------------------
# Profiling


def test_profiler_traces_and_summary(tmp_path):
    run_torchrun(PROFILE, "--trace-dir", tmp_path / "traces", "--metrics-out",
                 tmp_path / "p.json", "--export", tmp_path / "p.pt", "--hidden", "128")
    summary = read_json(tmp_path / "p.json")
    for rank in range(2):
        trace = json.loads((tmp_path / "traces" / f"trace_rank{rank}.json").read_text())
        names = {e.get("name", "") for e in trace["traceEvents"]}
        assert any("all_reduce" in n for n in names), f"rank {rank}: no all_reduce op in trace"
        assert {"forward", "backward", "barrier", "allreduce"} <= names
        fractions = summary["per_rank"][rank]["fractions"]
        assert abs(sum(fractions.values()) - 1) < 1e-9
        # `other` >= 0: the labelled regions nest inside the profiler's steps.
        assert all(0 <= f <= 1 for f in fractions.values()), fractions
    # A barrier before the all-reduce takes the waiting for the slowest rank (`barrier`), so the
    # all-reduce starts on all ranks together: communication is the `allreduce` share, averaged
    # over the ranks, and each rank's `barrier` share is its waiting, reported apart. Per step,
    # the last rank to arrive is the one that waited least.
    f = summary["comm_fraction"]
    per_rank = summary["per_rank"]
    assert 0 < f < 1
    assert f == pytest.approx(sum(r["fractions"]["allreduce"] for r in per_rank) / 2)
    assert summary["wait_fraction"] == [r["fractions"]["barrier"] for r in per_rank]
    steps = [r["steps"] for r in per_rank]  # steps[rank][k]: ms of recorded step k
    assert [s["step"] for s in steps[0]] == [s["step"] for s in steps[1]] == [2, 3, 4]
    assert summary["last_rank_per_step"] == [int(b["barrier"] < a["barrier"])
                                             for a, b in zip(*steps)]
    for rank, rows in enumerate(steps):  # the shares are the per-step times, summed
        total = sum(s["step_ms"] for s in rows)
        assert per_rank[rank]["fractions"]["barrier"] == pytest.approx(
            sum(s["barrier"] for s in rows) / total)
    assert summary["weak_scaling_efficiency"] == pytest.approx(1 - f)
    # Amdahl for this run's global batch on n ranks: one process computes it in 2 (1 - f) steps'
    # worth of time, n ranks in 2 (1 - f) / n plus the all-reduce f, which does not shrink.
    for n, bound in summary["amdahl_bound"].items():
        assert bound == pytest.approx(2 * (1 - f) / (2 * (1 - f) / int(n) + f))
    # It trains (wait + warmup + active = 5 steps) and exports the plain MLP.
    assert len(summary["losses"]) == 5 and summary["global_batch"] == 2 * 256
    MLP(128).load_state_dict(load_export(tmp_path / "p.pt"), strict=True)


# --------------------------------------------------------------------------------------------------
# Data loading


def test_data_loading_shards_and_memmap(tmp_path):
    run_torchrun(DATA, "--images", "64", "--epochs", "1", "--batch-size", "8", "--workers", "1",
                 "--metrics-out", tmp_path / "m.json", "--cache-dir", tmp_path / "cache")
    m = read_json(tmp_path / "m.json")
    # The memory-mapped rows rank 0 wrote (kept under --cache-dir) are exactly the decoded +
    # resized images (uint8, bit for bit), decoded here by the script's own functions, on one
    # thread as the script runs them (on other thread counts the float interpolation that draws
    # the synthetic images can round a pixel the other way, which changes the JPEG bytes).
    lesson = load_script(DATA)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        jpegs, _ = lesson.synthetic_jpegs(64, 128, 0)  # --images 64, default --raw-size, --seed
        decoded = lesson.preprocess(jpegs, 64)
    finally:
        torch.set_num_threads(threads)
    memmap = torch.from_numpy(np.array(np.memmap(m["cache_file"], dtype=np.uint8, mode="r",
                                                 shape=(64, 3, 64, 64))))
    torch.testing.assert_close(memmap, decoded, rtol=0, atol=0)
    # DistributedSampler: the two ranks' shards are disjoint and cover the dataset.
    seen = m["indices_per_rank"]
    assert not set(seen[0]) & set(seen[1])
    assert sorted(seen[0] + seen[1]) == list(range(64))
    rows = m["settings"]
    assert [r["num_workers"] for r in rows] == [0, 1, 0, 1]
    # The workers start from the fork server, never by forking a rank that runs threads (a fork
    # there can copy a lock another thread holds, and the worker then never delivers a batch).
    assert [r["start_method"] for r in rows] == [None, "forkserver", None, "forkserver"]
    for r in rows:
        assert 0 <= r["data_wait_fraction"] <= 1
        assert r["data_wait_fraction"] == pytest.approx(
            r["data_wait_s"] / (r["data_wait_s"] + r["compute_s"]))
    run_python(FIGURES, tmp_path / "m.json", "--out", tmp_path / "d.png")
    assert (tmp_path / "d.png").stat().st_size > 10_000


# --------------------------------------------------------------------------------------------------
# Hang debugging: every bug ends with its message, inside the timeout, never hangs

TIMEOUT_S = 5  # hang_debugging.py's default --timeout-s, as in the README commands
# In-script margin: the error must come within the timeout plus 2 s (gloo's timer and the
# monitored barrier fire at the timeout; 2 s covers scheduling on a loaded 2-core machine).
MARGIN_S = 2
# Whole launch: plus start-up of torchrun and two Python processes importing torch, which takes
# up to ~30 s on this shared 2-core machine; a real hang would run into the 240 s kill instead.
LAUNCH_MARGIN_S = 90
HANG_CASES = {
    "mismatch": r"Detected mismatch between collectives.*Op type: (ALLREDUCE ?vs ?BROADCAST|"
                r"BROADCAST ?vs ?ALLREDUCE)",
    "missing-rank": r"Ranks? 1 failed to pass monitoredBarrier in 5000 ms",
    "shape": r"Detected mismatch between collectives.*shapes: (4 ?vs ?3|3 ?vs ?4)",
    "p2p-deadlock": r"Timed out waiting 5000ms for recv operation",
}
# The section's commands, run verbatim (so test_readmes.py does not run them again).
HANG_COMMANDS = {
    "mismatch": "torchrun --nproc_per_node=2 05-advanced/c-data-parallel-techniques/"
                "hang_debugging.py --bug mismatch  # exits 1",
    "missing-rank": "torchrun --nproc_per_node=2 05-advanced/c-data-parallel-techniques/"
                    "hang_debugging.py --bug missing-rank  # exits 1",
    "shape": "torchrun --nproc_per_node=2 05-advanced/c-data-parallel-techniques/"
             "hang_debugging.py --bug shape  # exits 1",
    "p2p-deadlock": "torchrun --nproc_per_node=2 05-advanced/c-data-parallel-techniques/"
                    "hang_debugging.py --bug p2p-deadlock  # exits 1",
}


@pytest.mark.parametrize("bug", list(HANG_CASES))
def test_hang_bug_exits_with_its_message_within_timeout(bug):
    command = HANG_COMMANDS[bug]
    assert any(readme_mentions(doc, command) for doc in DOCS), command
    result = run_readme_command(command, timeout=240)  # asserts exit status 1
    assert result.elapsed < TIMEOUT_S + LAUNCH_MARGIN_S, result.describe()
    errors = [line for line in result.stderr_lines() if re.match(r"\[rank \d\] error after", line)]
    assert errors, result.describe()
    assert any(re.search(HANG_CASES[bug], line) for line in errors), result.describe()
    for line in errors:
        seconds = float(re.search(r"error after ([\d.]+) s", line).group(1))
        assert seconds <= TIMEOUT_S + MARGIN_S, line
    if bug in ("missing-rank", "p2p-deadlock"):
        # The stack dump shows where the waiting ranks are stuck.
        assert result.stderr.count(f"in bug_{bug.replace('-', '_')}") >= 2, result.describe()


# --------------------------------------------------------------------------------------------------
# README: the outputs that do not depend on the machine's speed are those of a fresh run

ACCUM_DOC = "torchrun --nproc_per_node=2 05-advanced/c-data-parallel-techniques/" \
            "gradient_accumulation.py"
COMPRESS_DOC = "torchrun --nproc_per_node=2 05-advanced/c-data-parallel-techniques/" \
               "gradient_compression.py --metrics-out runs/dp_compression.json && python " \
               "05-advanced/c-data-parallel-techniques/figures/dp_figures.py " \
               "runs/dp_compression.json"
NUMBER = re.compile(r"\d+\.\d+")


def quoted_output(command: str) -> list[str]:
    """The lines of the ```text block that follows the ```bash block holding `command` (its
    continuation lines joined) in the README."""
    blocks = re.findall(r"^```bash\n(.*?)^```\n+```text\n(.*?)^```", README.read_text(),
                        flags=re.S | re.M)
    for commands, output in blocks:
        if re.sub(r"\\\n\s*", "", commands).strip() == command:
            return output.splitlines()
    raise AssertionError(f"no quoted output after {command!r} in {README}")


def assert_same_output(fresh: list[str], quoted: list[str], command: str) -> None:
    """Line by line equal, except that a decimal number may differ by one in its fourth decimal
    (another CPU's kernels sum in another order; the weights-equality tests bound the real
    difference). Whole numbers (bytes, steps, calls) must be equal."""
    assert len(fresh) == len(quoted), f"{command}\nfresh:\n" + "\n".join(fresh)
    for f, q in zip(fresh, quoted):
        assert NUMBER.sub("#", f) == NUMBER.sub("#", q), (command, f, q)
        for a, b in zip(NUMBER.findall(f), NUMBER.findall(q)):
            assert abs(float(a) - float(b)) <= 1.5e-4, (command, f, q)


@pytest.mark.parametrize("command", [ACCUM_DOC, COMPRESS_DOC], ids=["accumulation", "compression"])
def test_readme_outputs_are_those_of_a_fresh_run(command):
    assert readme_mentions(README, command), f"not in {README}: {command}"
    result = run_readme_command(command, timeout=240)
    assert_same_output(result.stdout.splitlines(), quoted_output(command), command)


# --------------------------------------------------------------------------------------------------
# NCCL's error handling and flight recorder, as the lesson describes them, against installed torch


def test_nccl_error_handling_and_flight_recorder_are_described_as_torch_defines_them():
    """hang_debugging.py and hang_forensics.md name TORCH_NCCL_ASYNC_ERROR_HANDLING's default and
    what 2 does as torch's own header defines them, the flight recorder's default buffer as its
    header sets it, and a reader for the dumps that this torch installs. The header is read from
    torch's include directory (shipped with every wheel), not from a GPU run."""
    include = Path(torch.__file__).parent / "include/torch/csrc/distributed/c10d"
    pg = (include / "ProcessGroupNCCL.hpp").read_text()
    modes = dict((int(v), k) for k, v in re.findall(r"^\s*(\w+) = (\d),?$", pg, flags=re.M))
    default = int(re.search(r"default value \((\d) - (\w+)\)", pg).group(1))
    assert (default, modes[default], modes[2]) == (3, "SkipCleanUp", "CleanUpOnly")
    fr = (include / "FlightRecorder.hpp").read_text()
    buffer = int(re.search(r'"TORCH_NCCL_TRACE_BUFFER_SIZE"\},\s*(\d+)\)', fr).group(1))
    script = (REPO / HANG).read_text()
    forensics = (REPO / LESSON / "hang_forensics.md").read_text()
    for text in (" ".join(script.split()), " ".join(forensics.split())):
        assert f"default, {default}, tears the process down without aborting the" in text
        assert "2 aborts the communicators" in text or "2 only aborts them" in text
        assert "torchfrtrace" in text and "TORCH_FR_DUMP_TEMP_FILE" in text
    assert f"the buffer holds {buffer} entries" in " ".join(forensics.split())
    fr_trace = importlib.import_module("torch.distributed.flight_recorder.fr_trace")
    assert callable(fr_trace.main)

"""Named ranges for every profiler (dtcourse.profiling.nvtx_range) and the Perfetto trace of lesson
05c's Profiling section.

- The helper: on a CPU it records a torch.profiler range and never asks CUDA for anything (it
  neither initialises CUDA nor calls NVTX); in a process that uses CUDA it pushes and pops an
  NVTX range of the same name around the block, also when the block raises.
- The training scripts of lessons 01-03 open their ranges in the order a step runs: `step N`
  around forward, backward (FSDP: clip_grad_norm) and optimizer, then the loss all-reduce. One
  process runs all three at world 1 with the helper replaced by a recorder (the scripts import it
  by name, so the recorder goes in before they are loaded).
- The README's profiling command, run verbatim (its quoted output re-checked), writes Chrome
  traces that are valid JSON: every recorded step holds data, forward, backward, barrier,
  allreduce and optimizer once each, in that order, inside the step, and gloo runs the all-reduce
  on a worker thread inside the `allreduce` range. The drawing command of profiling_traces.md
  draws those files; given a CUDA run's trace instead (NCCL kernels on a GPU stream, no gloo
  threads), the drawing gives the NCCL kernels their own lane.
"""

import json
import struct

import pytest
import torch

import dtcourse.profiling
from conftest import PYTHON, REPO, launch, load_script, readme_mentions, run_documented

README = REPO / "05-advanced/c-data-parallel-techniques/README.md"
TRACES_PAGE = REPO / "05-advanced/c-data-parallel-techniques/profiling_traces.md"  # the drawing
REGIONS = ["data", "forward", "backward", "barrier", "allreduce", "optimizer"]

# The README commands, verbatim (held here, so tests/test_readmes.py does not run them again).
PROFILE_DOC = ("torchrun --nproc_per_node=2 05-advanced/c-data-parallel-techniques/profiling.py "
               "--trace-dir runs/traces")
DRAW_DOC = ("python 05-advanced/c-data-parallel-techniques/figures/trace_timeline.py runs/traces "
            "05-advanced/c-data-parallel-techniques/figures/profiling_timeline.png")
TRACES = ["runs/traces/trace_rank0.json", "runs/traces/trace_rank1.json"]

# Kineto writes timestamps in microseconds with three decimals (nanoseconds): a range nested in
# another can end up to a rounding step past its parent's printed end. 1 us of slack covers that
# many times over; a range in the wrong place is off by at least the length of a labelled region
# (tens of microseconds for `data` or `optimizer`, milliseconds for the rest).
SLACK_US = 1.0


# --------------------------------------------------------------------------------------------------
# The helper


@pytest.fixture
def nvtx_calls(monkeypatch):
    """Every NVTX push/pop the helper makes, and every attempt to initialise CUDA (which fails)."""
    calls = []
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda name: calls.append(("push", name)))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: calls.append(("pop",)))

    def no_cuda(*args, **kwargs):
        calls.append(("cuda init",))
        raise AssertionError("nvtx_range tried to initialise CUDA")
    monkeypatch.setattr(torch.cuda, "_lazy_init", no_cuda)
    monkeypatch.setattr(torch.cuda, "init", no_cuda)
    return calls


def test_on_cpu_the_helper_is_a_profiler_range_and_never_touches_cuda(nvtx_calls):
    if torch.cuda.is_initialized():
        pytest.skip("this test process has initialised CUDA already")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with dtcourse.profiling.nvtx_range("outer"):
            with dtcourse.profiling.nvtx_range("inner"):
                torch.ones(4).sum()
    assert nvtx_calls == [], "NVTX called, or CUDA initialised, on a CPU run"
    assert not torch.cuda.is_initialized()
    spans = {e.name: e.time_range for e in prof.events() if e.name in ("outer", "inner")}
    assert set(spans) == {"outer", "inner"}, "the ranges are not in the profile"
    assert spans["outer"].start <= spans["inner"].start <= spans["inner"].end \
        <= spans["outer"].end, "inner is not nested in outer"


def test_with_cuda_in_use_the_helper_pushes_and_pops_nvtx(nvtx_calls, monkeypatch):
    # "CUDA in use" is what torch.cuda.is_initialized() says; pretend it, so that this runs
    # without a GPU (the pushes and pops are recorded, not made).
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(ValueError, match="inside"):
        with dtcourse.profiling.nvtx_range("step 3"):
            with dtcourse.profiling.nvtx_range("backward"):
                raise ValueError("raised inside the range")
    assert nvtx_calls == [("push", "step 3"), ("push", "backward"), ("pop",), ("pop",)]


# --------------------------------------------------------------------------------------------------
# The training scripts of lessons 01-03

SCRIPTS = {
    "01-ddp-basics/ddp_training.py": ["--steps", "2", "--hidden", "16", "--batch-size", "4"],
    "02-fsdp/fsdp_transformer.py": ["--steps", "2", "--layers", "1", "--dim", "16", "--heads",
                                    "2", "--seq-len", "8", "--batch-size", "2"],
    "03-deepspeed/deepspeed_train.py": ["--deepspeed_config",
                                        "03-deepspeed/configs/zero2_config.json", "--steps", "2",
                                        "--layers", "1", "--dim", "16", "--heads", "2",
                                        "--seq-len", "8"],
}
# Runs each script's main() in one process at world 1 with nvtx_range replaced by a recorder
# that still opens the real range, and prints what was opened and closed, in order.
RECORD = """
import contextlib, json, sys
import torch
import dtcourse.profiling
from dtcourse import lessons
real, log = dtcourse.profiling.nvtx_range, []
@contextlib.contextmanager
def recording(name):
    log.append(["enter", name])
    with real(name):
        yield
    log.append(["exit", name])
dtcourse.profiling.nvtx_range = recording
runs = {}
for path, argv in json.loads(sys.argv[1]).items():
    module = lessons.load(path)
    log.clear()
    module.main(argv)
    runs[path] = list(log)
print("RANGES " + json.dumps({"runs": runs, "cuda_initialised": torch.cuda.is_initialized()}))
"""


def expected_ranges(script: str, steps: int) -> list:
    inside = ["forward", "backward"] + (["clip_grad_norm"] if "fsdp" in script else []) \
        + ["optimizer"]
    loss = "all_reduce: loss" if "fsdp" in script else "all_reduce: loss, SIGTERM flag"
    out = []
    for step in range(1, steps + 1):
        out += [["enter", f"step {step}"]]
        out += [[what, name] for name in inside for what in ("enter", "exit")]
        out += [["exit", f"step {step}"], ["enter", loss], ["exit", loss]]
    return out


def test_the_training_scripts_open_their_ranges_in_step_order():
    result = launch([PYTHON, "-c", RECORD, json.dumps(SCRIPTS)], timeout=240)
    line = next(x for x in result.stdout.splitlines() if x.startswith("RANGES "))
    recorded = json.loads(line.removeprefix("RANGES "))
    for script in SCRIPTS:
        assert recorded["runs"][script] == expected_ranges(script, steps=2), script
    assert recorded["cuda_initialised"] is False


# --------------------------------------------------------------------------------------------------
# The README's trace, and the picture drawn from it


@pytest.fixture(scope="module")
def traces():
    run_documented(README, PROFILE_DOC, *TRACES)
    return [json.loads((REPO / path).read_text()) for path in TRACES]


def complete_events(trace: dict) -> list:
    return [e for e in trace["traceEvents"] if e.get("ph") == "X"]


def end(e: dict) -> float:
    return e["ts"] + e["dur"]


def test_each_rank_writes_a_chrome_trace_perfetto_opens(traces):
    """The format ui.perfetto.dev reads: a JSON object whose traceEvents are Chrome trace events;
    torch.distributed's rank and world, and what profiling.py adds ("course")."""
    for rank, trace in enumerate(traces):
        assert isinstance(trace["traceEvents"], list) and trace["traceEvents"]
        assert all({"ph", "name", "pid", "tid", "ts"} <= set(e) for e in complete_events(trace))
        assert trace["distributedInfo"]["rank"] == rank
        assert trace["distributedInfo"]["world_size"] == 2
        assert trace["course"]["script"] == "05-advanced/c-data-parallel-techniques/profiling.py"
        assert trace["course"]["steps"] == {"wait": 1, "warmup": 1, "active": 3}


def test_every_recorded_step_holds_the_six_ranges_in_order(traces):
    for rank, trace in enumerate(traces):
        events = complete_events(trace)
        steps = sorted((e for e in events if e["name"].startswith("ProfilerStep#")),
                       key=lambda e: e["ts"])
        # wait 1, warmup 1: steps 0 and 1 are not recorded, steps 2, 3 and 4 are.
        assert [s["name"] for s in steps] == ["ProfilerStep#2", "ProfilerStep#3",
                                              "ProfilerStep#4"], f"rank {rank}"
        main = steps[0]["tid"]
        labels = sorted((e for e in events if e["name"] in REGIONS), key=lambda e: e["ts"])
        assert all(e["tid"] == main for e in labels), f"rank {rank}: a range on another thread"
        assert len(labels) == len(REGIONS) * len(steps), f"rank {rank}: {len(labels)} ranges"
        for step in steps:
            inside = [e for e in labels if step["ts"] - SLACK_US <= e["ts"] <= end(step)]
            where = f"rank {rank} {step['name']}"
            assert [e["name"] for e in inside] == REGIONS, where
            assert end(inside[-1]) <= end(step) + SLACK_US, f"{where}: optimizer ends late"
            for before, after in zip(inside, inside[1:]):
                assert end(before) <= after["ts"] + SLACK_US, \
                    f"{where}: {before['name']} overlaps {after['name']}"
            # gloo runs the all-reduce on one of its worker threads, while the main thread waits
            # in the `allreduce` range (the call, c10d::allreduce_, on the main thread, first).
            allreduce = inside[REGIONS.index("allreduce")]
            within = [e for e in events if allreduce["ts"] - SLACK_US <= e["ts"]
                      and end(e) <= end(allreduce) + SLACK_US]
            assert [e["tid"] for e in within if e["name"] == "c10d::allreduce_"] == [main], where
            gloo = [e for e in within if e["name"] == "gloo:all_reduce"]
            assert len(gloo) == 1 and gloo[0]["tid"] != main, where


def png_size(path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR", f"{path} is not a PNG"
    return struct.unpack(">II", head[16:24])


def test_the_readme_figure_is_drawn_from_the_trace_files(traces, tmp_path):
    """profiling_traces.md's drawing command, into a temporary file (the committed PNG stays as
    it is): a PNG of the committed one's size, drawn from the trace files just written."""
    assert readme_mentions(TRACES_PAGE, DRAW_DOC)
    _, script, trace_dir, committed = DRAW_DOC.split()
    out = tmp_path / "timeline.png"
    result = launch([PYTHON, script, trace_dir, out], timeout=120)
    assert f"wrote {out}" in result.stdout, result.describe()
    assert png_size(out) == png_size(REPO / committed)


def test_a_cuda_trace_draws_nccl_kernels_as_the_collective_lane(traces, tmp_path):
    """On CUDA there are no gloo threads: the collectives are NCCL kernels on a stream of the GPU
    (the barrier too: ProcessGroupNCCL runs it as an all-reduce of one float). Kineto writes a GPU
    kernel as a complete event of category "kernel" whose pid is the GPU and tid the stream
    (libkineto's output_json.cpp). Rank 0's trace with each gloo event turned into such a kernel,
    and a compute kernel on another stream beside them: the NCCL kernels get one lane (their
    stream), the compute kernel none, and the main thread keeps its ranges."""
    timeline = load_script(DRAW_DOC.split()[1])
    trace = json.loads(json.dumps(traces[0]))  # a copy
    gloo = [e for e in complete_events(trace) if e["name"].startswith("gloo:")]
    assert sorted({e["name"] for e in gloo}) == ["gloo:all_reduce", "gloo:barrier"]
    for e in gloo:
        e.update(cat="kernel", pid=0, tid=20,
                 name="ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)")
    trace["traceEvents"].append({"ph": "X", "cat": "kernel", "pid": 0, "tid": 7,
                                 "name": "void at::native::vectorized_elementwise_kernel<4>",
                                 "ts": gloo[0]["ts"], "dur": 3.0})
    trace["distributedInfo"]["backend"] = "nccl"
    path = tmp_path / "trace_rank0.json"
    path.write_text(json.dumps(trace))
    drawn = timeline.read_trace(path)
    assert [name for name, _ in drawn["collective"]] == ["GPU 0, stream 20"]
    assert sorted(e["ts"] for e in drawn["collective"][0][1]) == sorted(e["ts"] for e in gloo)
    assert [e["name"] for e in sorted(drawn["labels"], key=lambda e: e["ts"])] == REGIONS * 3
    timeline.draw([drawn], tmp_path / "cuda.png", "a CUDA-like trace")
    width, height = png_size(tmp_path / "cuda.png")
    assert width > 0 and height > 0

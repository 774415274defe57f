"""The three pictures drawn from real runs: the ring all-reduce step by step (lesson 04), DDP's
bucket all-reduces beside backward (lesson 01) and one FSDP2 step (lesson 02).

Each README shows a committed PNG and the two commands that regenerate it: a run that writes a
JSON, and a drawing script that turns the JSON into the PNG. This file holds those commands (so
tests/test_readmes.py does not run them again, into the committed files) and runs each once, with
its outputs in a temporary directory; it then checks that:

- the ring trace is an all-reduce, step by step: who sends which chunk to whom, what every chunk
  holds after every step, the README's quoted trace, and the committed JSON (the trace does not
  depend on timing, so a fresh one must equal it);
- the DDP step has one all-reduce per bucket, with the bucket layout computed here from the layer
  sizes and the cap, launched in bucket order as each bucket's gradients become ready, and main-
  thread clocks that fit its boxes; the committed run shows what the README says of it, the numbers
  its text quotes included;
- the FSDP step has 2 x blocks + 1 all-gathers and blocks + 1 reduce-scatters, for the units and
  in the order FSDP2 issues them, with each block gathered before its forward compute and the
  next unit prefetched before the current one's gradients;
- each drawing script draws the committed JSON into a PNG of the committed PNG's size.

What a timing decides is asserted only on the committed JSON, which is what the README
describes: on a shared 2-core machine a gloo worker thread can wait for a core for milliseconds,
so whether a bucket's all-reduce *starts running* before backward's last gradient is not certain
in a fresh run (that it is *launched* before is, and is asserted on every run).
"""

import json
import re
import struct
from pathlib import Path

import pytest

import quoted_output
from conftest import (PYTHON, REPO, launch, load_script, quoted_outputs_of, read_json,
                      readme_mentions, torchrun_cmd)

RING = "04-nccl-operations/ring_allreduce.py"
RING_FIGURE = "04-nccl-operations/figures/ring_figure.py"
DDP = "01-ddp-basics/figures/ddp_overlap.py"
DDP_FIGURE = "01-ddp-basics/figures/ddp_overlap_figure.py"
FSDP = "02-fsdp/figures/fsdp_timeline.py"
FSDP_FIGURE = "02-fsdp/figures/fsdp_timeline_figure.py"

# The README commands, verbatim.
RING_DOC = ("torchrun --nproc_per_node=4 04-nccl-operations/ring_allreduce.py --trace-out "
            "04-nccl-operations/figures/ring_trace.json")
RING_DRAW_DOC = ("python 04-nccl-operations/figures/ring_figure.py "
                 "04-nccl-operations/figures/ring_trace.json "
                 "04-nccl-operations/figures/ring_allreduce_steps.png")
# A reader's run of the DDP step depends on timing: the lesson's commands draw it under runs/, and
# CONTRIBUTING's redraw the committed picture that the lesson's text describes.
DDP_DOC = ("torchrun --nproc_per_node=2 01-ddp-basics/figures/ddp_overlap.py --json-out "
           "runs/01-ddp-basics/ddp_overlap.json --trace-out "
           "runs/01-ddp-basics/ddp_overlap_trace.json")
DDP_DRAW_DOC = ("python 01-ddp-basics/figures/ddp_overlap_figure.py "
                "runs/01-ddp-basics/ddp_overlap.json runs/01-ddp-basics/ddp_overlap.png")
DDP_COMMITTED_DOC = ("torchrun --nproc_per_node=2 01-ddp-basics/figures/ddp_overlap.py --json-out "
                     "01-ddp-basics/figures/ddp_overlap.json --trace-out "
                     "01-ddp-basics/figures/ddp_overlap_trace.json")
DDP_COMMITTED_DRAW_DOC = ("python 01-ddp-basics/figures/ddp_overlap_figure.py "
                          "01-ddp-basics/figures/ddp_overlap.json "
                          "01-ddp-basics/figures/ddp_overlap.png")
FSDP_DOC = ("torchrun --nproc_per_node=2 02-fsdp/figures/fsdp_timeline.py --json-out "
            "02-fsdp/figures/fsdp_timeline.json --trace-out runs/fsdp_timeline_trace.json")
FSDP_DRAW_DOC = ("python 02-fsdp/figures/fsdp_timeline_figure.py "
                 "02-fsdp/figures/fsdp_timeline.json 02-fsdp/figures/fsdp_timeline.png")

DOCS = {"04-nccl-operations/README.md": [RING_DOC, RING_DRAW_DOC],
        "01-ddp-basics/README.md": [DDP_DOC, DDP_DRAW_DOC],
        "CONTRIBUTING.md": [DDP_COMMITTED_DOC, DDP_COMMITTED_DRAW_DOC],
        "02-fsdp/README.md": [FSDP_DOC, FSDP_DRAW_DOC]}
# The README drawing commands, each naming (script, committed JSON, committed PNG)
DRAWINGS = {"ring": RING_DRAW_DOC, "ddp": DDP_COMMITTED_DRAW_DOC, "fsdp": FSDP_DRAW_DOC}


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) of a PNG, from its IHDR chunk; fails on anything else."""
    head = Path(path).read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR", f"{path} is not a PNG"
    return struct.unpack(">II", head[16:24])


def draw(script: str, json_in: Path, png_out: Path) -> tuple[int, int]:
    result = launch([PYTHON, script, json_in, png_out], timeout=120)
    assert f"wrote {png_out}" in result.stdout, result.describe()
    return png_size(png_out)


def test_the_commands_are_in_the_readmes():
    for readme, commands in DOCS.items():
        for command in commands:
            assert readme_mentions(REPO / readme, command), f"{readme} must show: {command}"


@pytest.mark.parametrize("name", DRAWINGS)
def test_each_drawing_script_draws_the_committed_json(name, tmp_path):
    """The README's drawing command, into a temporary file: a PNG of the committed one's size
    (pixels are not compared: another matplotlib may draw them differently)."""
    _, script, json_in, png = DRAWINGS[name].split()
    assert draw(script, REPO / json_in, tmp_path / "out.png") == png_size(REPO / png)


@pytest.mark.parametrize("script", [RING, RING_FIGURE, DDP, DDP_FIGURE, FSDP, FSDP_FIGURE])
def test_every_new_script_answers_help(script, capsys):
    module = load_script(script)
    entry = getattr(module, "parse_args", None) or module.main
    with pytest.raises(SystemExit) as exc:
        entry(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "usage:" in out
    if script == RING:
        assert "--trace-out" in out


@pytest.mark.parametrize("script,minimum", [(DDP, 3), (FSDP, 2)])
def test_too_few_steps_to_profile_a_steady_step_are_refused(script, minimum, capsys):
    """Refused before any process group, in one line: FSDP's first step pays its lazy
    initialisation; DDP's first step runs with one bucket and its logger reports the rebuilt
    buckets only from step 3 (with --steps 2, ddp_overlap.py used to end in a KeyError on
    'rebuilt_bucket_sizes')."""
    with pytest.raises(SystemExit) as exc:
        load_script(script).parse_args(["--steps", str(minimum - 1)])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--steps must be at least {minimum}" in err[0], err


@pytest.mark.parametrize("script", [DDP, FSDP])
def test_the_figure_scripts_refuse_cuda(script, capsys):
    """They draw CPU runs only (gloo's worker threads): --device cuda ends in one line and exit
    status 2 before any process group, and their default device is the CPU, so the README command
    draws the same picture on a GPU machine."""
    module = load_script(script)
    assert module.parse_args([]).device == "cpu"
    with pytest.raises(SystemExit) as exc:
        module.parse_args(["--device", "cuda"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "CPU runs only" in err[0], err


# --------------------------------------------------------------------------------------------------
# The ring, step by step


@pytest.fixture(scope="module")
def ring(tmp_path_factory):
    out = tmp_path_factory.mktemp("ring") / "ring.json"
    result = launch(torchrun_cmd(RING, "--trace-out", out, nproc=4), timeout=180)
    return result, read_json(out)


def test_ring_trace_is_an_all_reduce_step_by_step(ring):
    _, trace = ring
    n, steps = trace["world_size"], trace["steps"]
    assert n == 4 and trace["numel"] == 10 and trace["chunk_sizes"] == [3, 3, 2, 2]
    # The start, then n-1 reduce-scatter steps and n-1 all-gather steps: 2(n-1) in all.
    assert [(s["phase"], s["step"]) for s in steps] == [("start", None)] + [
        (phase, k) for phase in ("reduce-scatter", "all-gather") for k in range(n - 1)]
    assert [cell["chunks"] for cell in steps[0]["ranks"]] == [[[r]] * n for r in range(n)]
    sends = {(r, phase): 0 for r in range(n) for phase in ("reduce-scatter", "all-gather")}
    for before, row in zip(steps, steps[1:]):
        s = row["step"]
        for r, cell in enumerate(row["ranks"]):
            send, recv = cell["send"], cell["recv"]
            # To the right neighbour, from the left one; the chunks of ring_allreduce.py's
            # docstring: reduce-scatter sends r-s and receives r-s-1, all-gather r+1-s and r-s.
            assert (send["to"], recv["from"]) == ((r + 1) % n, (r - 1) % n)
            shift = 0 if row["phase"] == "reduce-scatter" else 1
            assert (send["chunk"], recv["chunk"]) == ((r + shift - s) % n, (r + shift - s - 1) % n)
            assert send["elements"] == trace["chunk_sizes"][send["chunk"]]
            sends[r, row["phase"]] += 1
            # What arrived is what the left neighbour held of that chunk before the step: added
            # to this rank's partial sum in the reduce-scatter, copied over it in the all-gather.
            left = before["ranks"][(r - 1) % n]["chunks"][recv["chunk"]]
            mine = before["ranks"][r]["chunks"][recv["chunk"]]
            expect = sorted(mine + left) if row["phase"] == "reduce-scatter" else left
            assert cell["chunks"][recv["chunk"]] == expect, (row["phase"], s, r)
            for c in range(n):  # nothing else changes
                if c != recv["chunk"]:
                    assert cell["chunks"][c] == before["ranks"][r]["chunks"][c]
    assert set(sends.values()) == {n - 1}  # n-1 chunks sent per rank and phase
    # After the reduce-scatter rank r owns chunk r+1, fully reduced; after the all-gather every
    # chunk of every rank holds every rank's input exactly once: an all-reduce.
    for r, cell in enumerate(steps[n - 1]["ranks"]):
        assert cell["chunks"][(r + 1) % n] == list(range(n))
    assert all(ch == list(range(n)) for cell in steps[-1]["ranks"] for ch in cell["chunks"])


def test_ring_trace_is_the_committed_one_and_the_readme_quotes_it(ring):
    """No timing enters the trace: a fresh run equals the committed JSON, and prints the
    README's quoted table (re-checked here, the way run_readme_command checks quotes)."""
    result, trace = ring
    committed = read_json(REPO / RING_DRAW_DOC.split()[2])
    assert trace["steps"] == committed["steps"]
    assert (trace["world_size"], trace["chunk_sizes"]) == (committed["world_size"],
                                                           committed["chunk_sizes"])
    # Every other field too (the torch version aside), so that the README's command, which
    # writes over the committed file, leaves it unchanged.
    assert ({k: v for k, v in trace.items() if k != "torch_version"}
            == {k: v for k, v in committed.items() if k != "torch_version"})
    quotes = quoted_outputs_of(RING_DOC)
    assert len(quotes) == 1, "the README quotes the trace under its command"
    problems = quoted_output.check(quotes[0]["quote"], result.stdout, quotes[0]["rel"])
    assert not problems, "\n".join(problems)


# --------------------------------------------------------------------------------------------------
# DDP: bucket all-reduces beside backward

LAYERS, WIDTH, CAP_MB = 8, 256, 0.5  # ddp_overlap.py's defaults, which the README describes


def expected_buckets(layers: int, width: int, cap_mb: float) -> list[list[str]]:
    """DDP's buckets from step 2 on: gradients in the order backward produces them (the last
    layer first), a bucket closing once it reaches the cap (the tensor that crosses it included);
    with bucket_cap_mb given, the first bucket has the same cap as the others."""
    cap, buckets, current, size = cap_mb * 2 ** 20, [], [], 0
    for i in reversed(range(layers)):
        current.append(f"layers.{i}")
        size += width * width * 4  # float32, no bias
        if size >= cap:
            buckets.append(current)
            current, size = [], 0
    return buckets + ([current] if current else [])


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    launch(torchrun_cmd(DDP, "--json-out", out / "t.json", "--trace-out", out / "trace.json"),
           timeout=180)
    return out


LAG_MS = 0.2  # what a box's CPU time may exceed its length by (check_ddp_step says why)


def check_ddp_step(t: dict) -> None:
    """What holds in every run, whatever the machine's load."""
    layout = expected_buckets(LAYERS, WIDTH, CAP_MB)
    assert len(layout) == 4
    assert [b["layers"] for b in t["buckets"]] == layout
    assert [b["bytes"] for b in t["buckets"]] == [len(b) * WIDTH * WIDTH * 4 for b in layout]
    assert [r["rank"] for r in t["ranks"]] == list(range(t["world_size"])) == [0, 1]
    for r in t["ranks"]:
        where = f"rank {r['rank']}"
        ready = {g["name"]: g["ready_ms"] for g in r["gradients"]}
        # Backward produces the gradients from the last layer to the first.
        assert [g["name"] for g in r["gradients"]] == [f"layers.{i}"
                                                       for i in reversed(range(LAYERS))], where
        # One all-reduce per bucket and no other in the step, each of the bucket's length.
        assert r["all_reduce_launches"] == r["all_reduce_runs"] == len(layout), where
        for b, spec in zip(r["buckets"], t["buckets"]):
            elements = spec["bytes"] // 4
            assert b["launch"]["elements"] == b["all_reduce"]["elements"] == elements, where
            # Launched once the bucket's last gradient is ready, and run after the launch.
            assert b["launch"]["start_ms"] >= max(ready[name] for name in spec["layers"]), where
            assert b["all_reduce"]["start_ms"] >= b["launch"]["start_ms"], where
        launches = [b["launch"]["start_ms"] for b in r["buckets"]]
        assert launches == sorted(launches), f"{where}: buckets launched out of order"
        # The overlap DDP sets up: every bucket but the last is launched while backward still
        # has gradients to compute.
        last = max(ready.values())
        assert all(x < last for x in launches[:-1]), where
        assert r["forward"]["end_ms"] <= r["backward"]["start_ms"] < r["gradients"][0]["ready_ms"]
        assert r["backward"]["end_ms"] <= r["optimizer_step"]["start_ms"], where
        # backward() returns after DDP has waited for every bucket: after every launch and after
        # every all-reduce began (gloo ends an all-reduce's profiler event only after completing
        # the future DDP waits on, so the event may end a little after backward returns).
        assert all(r["backward"]["end_ms"] >= max(b["launch"]["end_ms"],
                                                  b["all_reduce"]["start_ms"])
                   for b in r["buckets"]), where
        # The main thread's clocks, read inside each mark after the profiler's timestamp: the CPU
        # time of a box cannot exceed its length by more than the CPU the thread runs in that lag
        # (returning from record_function, one pread of schedstat, whose return path also runs
        # pending softirqs, the ranks' loopback traffic, on this thread's account). Idle that is
        # microseconds; a CI run on a loaded 2-core machine measured 0.053 ms beyond a 0.88 ms
        # box. LAG_MS is 0.2 ms. Samples shifted by one box put forward's CPU time (2 ms and more
        # here) in the first box, and a clock of the whole process adds the gloo threads' time
        # to every box: both break it by far more. Run-queue waits only grow.
        for g in r["gradients"]:
            assert 0 <= g["cpu_ms"] <= g["end_ms"] - g["start_ms"] + LAG_MS, (where, g)
            assert g["waited_ms"] is None or g["waited_ms"] >= 0, (where, g)
        m = r["main_thread_until_last_gradient"]
        assert m["cpu_ms"] == pytest.approx(sum(g["cpu_ms"] for g in r["gradients"]), abs=1e-6)


def test_ddp_step_has_one_all_reduce_per_bucket_launched_during_backward(ddp):
    t = read_json(ddp / "t.json")
    assert (t["layers"], t["width"], t["bucket_cap_mb"]) == (LAYERS, WIDTH, CAP_MB)
    check_ddp_step(t)
    # The Chrome trace the README points to: the same events, for Perfetto.
    events = json.loads((ddp / "trace.json").read_text())["traceEvents"]
    names = [e.get("name", "") for e in events if e.get("ph") == "X"]
    assert names.count("c10d::allreduce_") == names.count("gloo:all_reduce") == 4
    assert sum(n.startswith("grad ready: layers.") for n in names) == LAYERS
    draw(DDP_FIGURE, ddp / "t.json", ddp / "t.png")


def readme_says(readme: Path, fragment: str) -> bool:
    """The README holds `fragment`, whatever its line breaks."""
    return " ".join(fragment.split()) in " ".join(readme.read_text().split())


def test_ddp_committed_step_shows_what_the_readme_says():
    """The committed run is the README's: the same checks, the overlap it describes, and the
    numbers its text quotes, recomputed here from the committed JSON."""
    t = read_json(REPO / DDP_COMMITTED_DRAW_DOC.split()[2])
    check_ddp_step(t)
    readme = REPO / "01-ddp-basics/README.md"
    r0, r1 = t["ranks"]
    for r in t["ranks"]:
        last = max(g["ready_ms"] for g in r["gradients"])
        assert r["worker_threads"] == 2
        # on both ranks buckets 0, 1 and 2 start running before the last gradient is ready
        assert [b["all_reduce"]["start_ms"] < last for b in r["buckets"]] == [True] * 3 + [False]
        assert r["backward"]["end_ms"] >= max(b["all_reduce"]["end_ms"] for b in r["buckets"])
        # Never blocked: from backward's start to the last gradient, every moment the main thread
        # did not run it waited runnable for a core (the two agree to 0.02 ms in every run seen;
        # a thread blocked on a lock or a wait would open a gap of the blocked time).
        m = r["main_thread_until_last_gradient"]
        assert abs(m["wall_ms"] - m["cpu_ms"] - m["waited_ms"]) < 0.05, m
    # rank 0's bucket 2 waits for a free worker: it starts on bucket 0's thread, after bucket 0
    b0, b2 = r0["buckets"][0], r0["buckets"][2]
    assert b2["all_reduce"]["thread"] == b0["all_reduce"]["thread"]
    assert b2["all_reduce"]["start_ms"] >= b0["all_reduce"]["end_ms"]
    assert b2["all_reduce"]["start_ms"] - b2["launch"]["start_ms"] > 1.0
    assert readme_says(readme, f"rank 0's bucket 2, launched at {b2['launch']['start_ms']:.1f} "
                               f"ms, starts only when bucket 0 leaves its worker, at "
                               f"{b2['all_reduce']['start_ms']:.1f} ms")
    # The two hatched boxes the README describes; rank 0's holds the long launch of bucket 0.
    box = {(r["rank"], g["name"]): g for r in t["ranks"] for g in r["gradients"]}
    g12, g05 = box[1, "layers.2"], box[0, "layers.5"]
    for g in (g12, g05):
        assert g["end_ms"] - g["start_ms"] - g["cpu_ms"] > 0.5 * (g["end_ms"] - g["start_ms"])
    launch0 = b0["launch"]
    assert g05["start_ms"] <= launch0["start_ms"] < launch0["end_ms"] <= g05["end_ms"]
    others = [b["launch"] for r in t["ranks"] for b in r["buckets"] if b["launch"] is not launch0]
    assert max(x["end_ms"] - x["start_ms"] for x in others) < 0.15  # "about 0.1 ms or less"
    assert not any(g12["start_ms"] <= b["launch"]["start_ms"] <= g12["end_ms"]
                   for b in r1["buckets"])  # "rank 1's layer 2 holds none"
    m0, m1 = (r["main_thread_until_last_gradient"] for r in t["ranks"])
    for fragment in (
            f"rank 1's layer 2 lasted {g12['end_ms'] - g12['start_ms']:.1f} ms, of which the "
            f"thread ran {g12['cpu_ms']:.1f}",
            f"rank 0's layer 5 lasted {g05['end_ms'] - g05['start_ms']:.1f} ms, of which it ran "
            f"{g05['cpu_ms']:.1f}, and {launch0['end_ms'] - launch0['start_ms']:.1f} ms of that "
            "box went by inside DDP's launch call for bucket 0",
            f"rank 0's main thread was off its core for {m0['wall_ms'] - m0['cpu_ms']:.1f} ms and "
            f"waited runnable for a core for {m0['waited_ms']:.1f} ms of them (rank 1: "
            f"{m1['waited_ms']:.1f} of {m1['wall_ms'] - m1['cpu_ms']:.1f} ms)"):
        assert readme_says(readme, fragment), fragment


# --------------------------------------------------------------------------------------------------
# FSDP2: all-gathers, prefetch and reduce-scatters


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    launch(torchrun_cmd(FSDP, "--json-out", out / "t.json", "--trace-out", out / "trace.json"),
           timeout=180)
    return out


def check_fsdp_step(t: dict) -> None:
    blocks = [f"blocks.{i}" for i in range(t["layers"])]
    assert t["units"] == ["root"] + blocks
    for r in t["ranks"]:
        where = f"rank {r['rank']}"
        coll = r["collectives"]
        gathers = [c for c in coll if c["kind"] == "all_gather"]
        reduces = [c for c in coll if c["kind"] == "reduce_scatter"]
        # reshard_after_forward=True on the blocks, False on the root: each block gathered for
        # its forward and again for its backward, the root once; one reduce-scatter per unit.
        assert len(gathers) == 2 * len(blocks) + 1 and len(reduces) == len(blocks) + 1, where
        assert [(c["pass"], c["unit"], c["prefetch"]) for c in gathers] == \
            [("forward", u, False) for u in ["root"] + blocks] + \
            [("backward", u, True) for u in reversed(blocks)], where
        assert [c["unit"] for c in reduces] == list(reversed(blocks)) + ["root"], where
        # ... then the gradient norm's all-reduce (clip_grad_norm_), and nothing else.
        assert [c["unit"] for c in coll if c["kind"] == "all_reduce"] == ["clip_grad_norm_"]
        assert r["runs"] == len(coll), f"{where}: a collective without its backend event"
        # Sizes: every gather of a unit is the same padded tensor, and its reduce-scatter
        # reduces a tensor of that size.
        size = {}
        for c in gathers + reduces:
            assert size.setdefault(c["unit"], c["elements"]) == c["elements"], (where, c)
        compute = {(c["pass"], c["unit"]): c for c in r["compute"] if c["unit"] != "root"}
        for i, u in enumerate(blocks):
            fwd_gather = next(c for c in gathers if c["unit"] == u and c["pass"] == "forward")
            # Each block's forward all-gather begins before its forward compute.
            assert fwd_gather["issued"]["start_ms"] < compute["forward", u]["start_ms"], (where, u)
            assert fwd_gather["ran"]["start_ms"] < compute["forward", u]["start_ms"], (where, u)
            # Backward prefetch: block i-1 is gathered before block i's gradients are computed.
            if i > 0:
                prev = next(c for c in gathers if c["unit"] == blocks[i - 1]
                            and c["pass"] == "backward")
                assert prev["issued"]["start_ms"] < compute["backward", u]["start_ms"], (where, u)
            # The unit's reduce-scatter follows its gradients.
            rs = next(c for c in reduces if c["unit"] == u)
            assert rs["issued"]["start_ms"] >= compute["backward", u]["end_ms"], (where, u)


def test_fsdp_step_gathers_prefetches_and_reduce_scatters_in_fsdp2_order(fsdp):
    t = read_json(fsdp / "t.json")
    assert (t["layers"], t["world_size"], t["strategy"]) == (2, 2, "full")
    check_fsdp_step(t)
    events = json.loads((fsdp / "trace.json").read_text())["traceEvents"]
    names = {e.get("name", "") for e in events}
    assert {"FSDP::all_gather (blocks.0)", "FSDP::backward_prefetch for blocks.0",
            "FSDP::post_backward_reduce (blocks.1)"} <= names
    draw(FSDP_FIGURE, fsdp / "t.json", fsdp / "t.png")


def test_fsdp_committed_step_shows_what_the_readme_says():
    """The committed run is the README's: the same checks, and the sizes it quotes: gloo runs
    a block's reduce-scatter as an all-reduce of the whole 49,920-element tensor (shard 24,960)."""
    t = read_json(REPO / FSDP_DRAW_DOC.split()[2])
    check_fsdp_step(t)
    for r in t["ranks"]:
        for c in r["collectives"]:
            if c["unit"] == "blocks.0" and c["kind"] == "reduce_scatter":
                assert (c["elements"], c["ran"]["event"], c["ran"]["elements"]) == \
                    (49920, "gloo:all_reduce", 49920)
            if c["unit"] == "blocks.0" and c["kind"] == "all_gather":
                assert (c["elements"], c["ran"]["elements"]) == (49920, 24960)
    readme = (REPO / "02-fsdp/README.md").read_text()
    assert re.search(r"49,920 elements for a block, whose shard is\s+24,960", readme)

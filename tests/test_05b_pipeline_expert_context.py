"""Lesson 05b: pipeline schedules, expert parallelism and ring attention compute what one process
computes, the pipeline bubble and activation memory follow their formulas, and bad settings stop
with one line.

Costs are kept down by sharing launches: one sweep launch of 4 ranks measures every
implementation, schedule and micro-batch count at p = 2 and p = 4 (the README's sweep command with
a short list), and one worker launch of 4 ranks computes the same configurations' gradients, and
those of the two zero-bubble schedules (whose other tests are in test_05b_zero_bubble.py); one
launch per world size serves the MoE equivalence and training checks; one launch of 4 ranks runs
rings of 2, 3 and 4 with both masks and two uneven lengths. The workers (tests/workers_05b/)
import the lesson scripts and save the tensors a test needs, which the scripts themselves do not
write; the MoE and ring workers then call the script's own training or measuring function (what
its main() runs once the group is up) with the same flags, in the same group.
"""

import math
import re

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    REPO,
    assert_bad_input,
    assert_adamw_close,
    assert_state_dicts_close,
    launch,
    load_export,
    load_script,
    read_json,
    readme_mentions,
    run_python,
    run_readme_command,
    run_torchrun,
    torchrun_cmd,
)

from dtcourse.data import classification_batch
from dtcourse.models import ResidualMLP

LESSON = "05-advanced/b-pipeline-expert-context"
PP = f"{LESSON}/pipeline_parallel.py"
SWEEP = f"{LESSON}/pipeline_sweep.py"
FIGURES = f"{LESSON}/figures/pp_figures.py"
MOE = f"{LESSON}/expert_parallel.py"
RING = f"{LESSON}/ring_attention.py"
WORKERS = "tests/workers_05b"
SECTION = REPO / LESSON / "README.md"
SCHEDULES_PAGE = REPO / LESSON / "pipeline_schedules.md"  # the sweep and its plot

# float32 on CPU: a split run adds the same terms in another order (micro-batch by micro-batch,
# rank by rank, block by block), which moves results by a few ulps of values of order 1 (observed
# up to 1e-7 on gradients); 1e-5 relative / 1e-6 absolute leaves a 10x margin and still fails on
# any real mistake (a dropped micro-batch or a wrong scale changes gradients by >= 1e-2).
RTOL, ATOL = 1e-5, 1e-6
# Weights after AdamW steps are another matter: AdamW divides each coordinate by sqrt(v), so where
# a gradient is itself at rounding level, those ulps decide the step (seen: 2.3e-6 on one of 8,192
# weights with ATEN_CPU_CAPABILITY=default): conftest.assert_adamw_close. Both scripts: lr 3e-3.
ADAMW = {"lr": 3e-3, "steps": 4}


@pytest.fixture(autouse=True)
def one_thread():
    """References computed in this process use one thread, like the launched ranks: tiny ops on
    several threads of a busy shared 2-core machine spend their time waiting for each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --------------------------------------------------------------------------------------------------
# Pipeline parallelism

SWEEP_DOC = (f"torchrun --nproc_per_node=4 {SWEEP} --microbatches 1-16 --pipeline-sizes 2,4 "
             f"--layer-ms 25 --json-out {LESSON}/figures/pp_sweep.json")
PLOT_DOC = f"python {FIGURES} {LESSON}/figures/pp_sweep.json {LESSON}/figures/pp_bubble.png"
# m = 1, 4 and 3, which neither p = 2 nor p = 4 divides.
SWEEP_M = [1, 3, 4]
# The zero-bubble schedules (gradient worker only): m = 3, inside both formulas' ranges at p = 2
# (zb1p: m >= p; zbv: m >= 2p - 1) and outside both at p = 4, and m = 8, inside both at p = 4.
ZERO_BUBBLE_M = [3, 8]
# Fixed cost, the README's own: 25 ms per layer forward, 50 backward: a stage of 8 / p layers
# works 100 ms (p = 2) or 50 ms (p = 4) per micro-batch forward, so the schedule, not the tiny
# model's compute, sets the bubble.
LAYER_MS = 25
# Between two boxes on the critical path, a transfer and a wake-up. Measured from the excess of
# every configuration's bubble over its formula (hop = excess * 3 T / (2 v)): ~1 ms on an idle
# machine, at most 1.5 ms beside a 2-thread matmul loop and two busy processes (load 4 to 6 on
# 2 cores), ~1 ms in a CI run of the whole suite at -n 2. 5 ms leaves a 3x margin; a stall far
# longer than a hop is what the second measurement below is for.
HOP_S = 0.005


@pytest.fixture(scope="module")
def pp_sweep(tmp_path_factory):
    """The README's sweep command with a short list: p = 2 (ranks 0-1, ranks 2-3 wait) and p = 4
    in one launch; then the README's command that draws it."""
    assert readme_mentions(SCHEDULES_PAGE, SWEEP_DOC), "the sweep command must be on the page"
    assert readme_mentions(SCHEDULES_PAGE, PLOT_DOC), "the command drawing it must be on the page"
    out = tmp_path_factory.mktemp("pp")
    cmd = torchrun_cmd(SWEEP, "--microbatches", ",".join(map(str, SWEEP_M)),
                       "--pipeline-sizes", "2,4", "--layer-ms", LAYER_MS,
                       "--json-out", out / "sweep.json", nproc=4)
    launch(cmd, timeout=280)
    run_python(FIGURES, out / "sweep.json", out / "bubble.png")
    assert (out / "bubble.png").read_bytes()[:4] == b"\x89PNG"
    return read_json(out / "sweep.json")["runs"]


@pytest.fixture(scope="module")
def pp_gradients(tmp_path_factory):
    """Loss and gradients of one step of every configuration the sweep measures (p = 2 and 4, the
    same m), from the worker that drives pipeline_parallel.py's Pipeline."""
    out = tmp_path_factory.mktemp("pp_grads") / "grads.pt"
    launch(torchrun_cmd(f"{WORKERS}/pp_gradients.py", "--pipeline-sizes", "2,4",
                        "--microbatches", ",".join(map(str, SWEEP_M)),
                        "--zero-bubble-microbatches", ",".join(map(str, ZERO_BUBBLE_M)),
                        "--out", out, nproc=4),
           timeout=240)
    return torch.load(out, weights_only=True)


def test_every_schedule_gives_the_unsplit_models_loss_and_gradients(pp_sweep, pp_gradients):
    runs, checks = pp_sweep, pp_gradients
    pp = load_script(PP)
    # the worker also runs the zero-bubble schedules (the sweep, by default, does not)
    expected = {f"p{p}/{impl}/{s}/m{m}" for p in (2, 4) for impl in ("manual", "torch")
                for s in pp.SCHEDULES + pp.ZERO_BUBBLE
                for m in (ZERO_BUBBLE_M if s in pp.ZERO_BUBBLE else SWEEP_M)}
    # Refused by design: the hand-written code covers gpipe and 1f1b; torch's Schedule1F1B
    # needs m >= p. Everything else must have run.
    refused = {f"p{p}/manual/interleaved/m{m}" for p in (2, 4) for m in SWEEP_M} | \
              {f"p{p}/manual/{s}/m{m}" for p in (2, 4) for m in ZERO_BUBBLE_M
               for s in pp.ZERO_BUBBLE} | \
              {f"p{p}/torch/1f1b/m{m}" for p in (2, 4) for m in SWEEP_M if m < p}
    assert set(checks) == expected - refused
    assert {f"p{r['p']}/{r['impl']}/{r['schedule']}/m{r['m']}" for r in runs
            if "skipped" in r} == {k for k in refused if k.split("/")[2] in pp.SCHEDULES}
    for key, got in checks.items():
        torch.manual_seed(0)  # the script's --seed default: the same initial weights
        model = ResidualMLP(hidden=64, depth=8)
        x, y = classification_batch(0, 0, got["batch"])
        loss = F.cross_entropy(model(x), y)  # the whole batch at once, no pipeline
        loss.backward()
        # one rank returns the loss: the last stage's, rank p - 1, or rank 0 for zbv's V
        p = int(key.split("/")[0][1:])
        assert got["loss_ranks"] == ([0] if "/zbv/" in key else [p - 1]), key
        assert got["loss"] == pytest.approx(loss.item(), rel=RTOL, abs=ATOL), key
        # The gradients themselves, not weights after an AdamW step, which divides each by
        # sqrt(v) and would hide a gradient off by a constant factor (a stage's weight
        # gradients doubled by its W pass, say).
        assert_state_dicts_close(got["grads"], {n: q.grad for n, q in model.named_parameters()},
                                 rtol=RTOL, atol=ATOL, msg=key)


def bubble_window(p: int, v: int, m: int) -> tuple[float, float, float]:
    """(formula, lowest, highest) bubble a measurement of a correct schedule can give, with boxes of
    LAYER_MS per layer. Below: the measured bubble cannot beat the formula, up to the skew of the
    two barriers that bound the step on each rank (a few ms of a step >= 0.6 s): 0.02. Above: the
    critical path of an ideal schedule is 2 (v m + p - 1) boxes of a stage (forward T / v,
    backward 2 T / v) with a hop between boxes, so the hops add at most 2 HOP_S (v m + p - 1) to a
    step of 3 T / v (v m + p - 1): an idle share of 2 HOP_S v / (3 T): 0.033 v at p = 2, 0.067 v
    at p = 4 (v = 2 for interleaved: twice the hops per unit of work)."""
    formula = (p - 1) / (v * m + p - 1)
    stage_fwd_s = LAYER_MS / 1000 * 8 / p
    return formula, formula - 0.02, formula + 2 * HOP_S * v / (3 * stage_fwd_s)


def bubble_checked(r) -> bool:
    """The formula assumes equal stages and a schedule that fills whole rounds; torch's interleaved
    schedule runs partial rounds when p does not divide m: no formula there."""
    return "skipped" not in r and not (r["schedule"] == "interleaved" and r["m"] % r["p"])


def test_the_bubble_window_tells_the_lessons_schedules_apart(pp_sweep):
    """A measurement inside the window of one schedule is outside every other schedule's formula
    at the same p and m: GPipe and 1F1B (v = 1) against interleaved (v = 2) and back, the zero-
    bubble schedules ((p - 1) / (3 m + p - 1), (p - 1) / (6 m + p - 1)), micro-batches that do not
    overlap at all ((p - 1) / p), and, for GPipe and 1F1B, a schedule whose bubble is that of one
    micro-batch more or fewer. (Interleaved's window is wider, its boxes half as long: there one
    micro-batch fewer, 0.143 at p = 2 and 0.333 at p = 4, or one extra box of fill, fall inside;
    the drawn schedule's length in slots, 2 (v m + p - 1), is held exactly by
    test_every_configurations_drawn_schedule_respects_its_dependencies.)"""
    checked = 0
    for r in filter(bubble_checked, pp_sweep):
        p, v, m = r["p"], r["v"], r["m"]
        formula, low, high = bubble_window(p, v, m)
        others = {"v=1": (p - 1) / (m + p - 1), "v=2": (p - 1) / (2 * m + p - 1),
                  "zb1p": (p - 1) / (3 * m + p - 1), "zbv": (p - 1) / (6 * m + p - 1),
                  "no overlap": (p - 1) / p}
        if v == 1:
            others |= {"m + 1": (p - 1) / (m + p), "m - 1": (p - 1) / (m + p - 2)}
        for name, other in others.items():
            if not math.isclose(other, formula):  # m = 1: one micro-batch never overlaps
                assert not low <= other <= high, (r["schedule"], p, m, name, other)
                checked += 1
    assert checked > 0


@pytest.mark.parametrize("p", [2, 4])
def test_bubble_with_fixed_cost_stages_matches_the_formula(pp_sweep, p, tmp_path):
    """Every measured bubble lies in its window (bubble_window). A step is a wall-clock measurement
    on a shared machine: a rank that the system stops for a moment (another test's processes, a
    page fault storm) stalls every rank behind it, and that step's bubble grows by the stall (once
    seen: 0.668 for a formula of 0.273, every other configuration of the same run within 0.01 of
    its formula). A stall only adds idle time, a wrong schedule adds it to every step: so a
    configuration above its window is measured once more, in a launch of its own, and the lower
    of its two bubbles must lie in the window; every measurement, the first included, must still
    be above the window's floor."""
    runs = [r for r in pp_sweep if r["p"] == p and bubble_checked(r)]
    # gpipe and 1f1b of both implementations (torch's 1f1b for m >= p), interleaved for m = 4
    assert len(runs) == {2: 12, 4: 11}[p]
    key = lambda r: (r["impl"], r["schedule"], r["m"])  # noqa: E731
    again = {}
    high_runs = [r for r in runs if r["bubble"] > bubble_window(p, r["v"], r["m"])[2]]
    if high_runs:
        out = tmp_path / "again.json"
        launch(torchrun_cmd(SWEEP, "--pipeline-sizes", p, "--layer-ms", LAYER_MS,
                            "--schedules", ",".join(sorted({r["schedule"] for r in high_runs})),
                            "--microbatches", ",".join(sorted({str(r["m"]) for r in high_runs})),
                            "--json-out", out, nproc=4), timeout=200)
        again = {key(r): r for r in read_json(out)["runs"] if "skipped" not in r}
    for r in runs:
        formula, low, high = bubble_window(p, r["v"], r["m"])
        assert r["formula"] == pytest.approx(formula)
        bubbles = [r["bubble"]] + ([again[key(r)]["bubble"]] if r in high_runs else [])
        assert min(bubbles) <= high and all(b >= low for b in bubbles), (r, bubbles)


@pytest.mark.parametrize("p", [2, 4])
def test_1f1b_holds_at_most_p_microbatches_and_gpipe_holds_m(pp_sweep, p):
    runs = pp_sweep
    by = {(r["impl"], r["schedule"], r["m"]): r["per_rank"] for r in runs
          if "skipped" not in r and r["p"] == p}
    for impl in ("manual", "torch"):
        one = by[(impl, "gpipe", 1)]  # one micro-batch: the activations of one, per rank
        for m in SWEEP_M:
            gpipe = by[(impl, "gpipe", m)]
            assert [r["peak_held_microbatches"] for r in gpipe] == [m] * p
            for rank in range(p):
                assert gpipe[rank]["peak_activation_bytes"] == \
                    m * one[rank]["peak_activation_bytes"]
            if (impl, "1f1b", m) not in by:
                continue
            f1b = by[(impl, "1f1b", m)]
            # rank r runs p - r - 1 warm-up forwards, then holds one more before its first backward
            assert [r["peak_held_microbatches"] for r in f1b] == \
                [min(m, p - rank) for rank in range(p)]
            for rank in range(p):
                assert f1b[rank]["peak_activation_bytes"] == \
                    min(m, p - rank) * one[rank]["peak_activation_bytes"]


# The README's schedule diagrams: what the script prints after its last step, p = 4, m = 4.
DIAGRAM_DOCS = {
    "gpipe": "torchrun --nproc_per_node=4 05-advanced/b-pipeline-expert-context/pipeline_parallel.py"
             " --schedule gpipe --microbatches 4 --steps 2",
    "1f1b": "torchrun --nproc_per_node=4 05-advanced/b-pipeline-expert-context/pipeline_parallel.py"
            " --schedule 1f1b --microbatches 4 --steps 2",
}
OP = re.compile(r"^([FBW])(\d+)(?:s(\d+))?$")


def printed_schedule(stdout: str) -> list[str]:
    """The lines `rank r  F0 F1 ...` the script prints under "last step's schedule"."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("last step's schedule"))
    rows = []
    for line in lines[start + 1:]:
        if not line.startswith("rank "):
            break
        rows.append(line)
    return rows


def check_schedule(rows: list[str], p: int, m: int, stages: int, kinds: str = "FB",
                   on_rank=lambda s, p: s % p) -> int:
    """A drawn schedule: every rank runs the forward and backward (zero bubble: B and W) of each
    micro-batch on each of its stages (stage s on rank on_rank(s, p)) exactly once, one op per
    slot, and no op comes before its input: F_i on stage s after F_i on stage s - 1, B_i on stage
    s after B_i on stage s + 1, B_i on the last stage after F_i there, W_i after B_i. Returns its
    length in slots."""
    assert [r.split()[:2] for r in rows] == [["rank", str(r)] for r in range(p)], rows
    at = {}
    for rank, row in enumerate(rows):
        for slot, token in enumerate(row.split()[2:]):
            if token == ".":
                continue
            kind, mb, stage = OP.match(token).groups()
            op = (kind, rank if stage is None else int(stage), int(mb))
            assert op not in at, f"{op} drawn twice"
            at[op] = slot
            assert on_rank(op[1], p) == rank, f"stage {op[1]} drawn on rank {rank}"
    assert set(at) == {(k, s, i) for k in kinds for s in range(stages) for i in range(m)}, rows
    for (kind, s, i), slot in at.items():
        if kind == "F" and s > 0:
            assert slot > at[("F", s - 1, i)], (kind, s, i)
        if kind == "B":
            assert slot > (at[("B", s + 1, i)] if s < stages - 1 else at[("F", s, i)]), \
                (kind, s, i)
        if kind == "W":
            assert slot > at[("B", s, i)], (kind, s, i)
    return 1 + max(at.values())


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_the_printed_schedule_respects_every_dependency_and_lasts_2_m_plus_p_minus_1(schedule):
    """GPipe and 1F1B: 2 (m + p - 1) slots, the m forwards and m backwards of a rank plus p - 1
    slots of fill and p - 1 of drain; the README quotes exactly what the run prints."""
    command = DIAGRAM_DOCS[schedule]
    assert readme_mentions(SECTION, command), f"not in the README: {command}"
    rows = printed_schedule(run_readme_command(command, timeout=120).stdout)
    assert check_schedule(rows, p=4, m=4, stages=4) == 2 * (4 + 4 - 1)
    assert "\n".join(rows) in SECTION.read_text(), "the README's diagram is not the printed one"


def test_every_configurations_drawn_schedule_respects_its_dependencies(pp_gradients):
    """The order each rank ran its ops in, for every implementation, schedule, p and m of the
    worker, drawn by the script's draw_schedule: GPipe and 1F1B last 2 (m + p - 1) slots, the
    interleaved schedule 2 (v m + p - 1) when p divides m (whole rounds); zero bubble runs W after
    B, zbv's stages lie in a V (rank r: r and 2p - 1 - r), and zb1p lasts 3m + p - 1 slots, zbv
    6m + p - 1, where formula_holds says so (m >= p, m >= 2p - 1), longer where it does not."""
    pp = load_script(PP)
    for key, got in pp_gradients.items():
        size, _, schedule, micro = key.split("/")  # p{p}/{impl}/{schedule}/m{m}
        p, m, stages = int(size[1:]), int(micro[1:]), got["stages"]
        rows = pp.draw_schedule(got["orders"], stages).splitlines()
        if schedule in pp.ZERO_BUBBLE:
            length = check_schedule(rows, p, m, stages, kinds="FBW",
                                    on_rank=lambda s, p: min(s, 2 * p - 1 - s) if
                                    schedule == "zbv" else s)
            slots = {"zb1p": 3 * m + p - 1, "zbv": 6 * m + p - 1}[schedule]
            if pp.formula_holds(schedule, p, m):
                assert length == slots, (key, rows)
            else:  # the script marks the formula with a *
                assert length > slots, (key, rows)
            continue
        length = check_schedule(rows, p, m, stages)
        if schedule != "interleaved":
            assert length == 2 * (m + p - 1), (key, rows)
        elif m % p == 0:
            assert length == 2 * (stages // p * m + p - 1), (key, rows)


def test_pipeline_training_export_equals_the_unsplit_model_trained_in_one_process(tmp_path):
    # world 2, the hand-written 1F1B: 8 micro-batches of 6 rows. (torch's schedules are held to
    # the same gradients by the sweep above; they share this script's export code.) No simulated
    # compute time: it changes no number here, and would sleep ~4 s.
    result = run_torchrun(PP, "--steps", "4", "--layer-ms", "0", "--export", tmp_path / "w2.pt",
                          "--metrics-out", tmp_path / "w2.json", nproc=2)
    # the schedule it printed: 1F1B at p = 2, m = 8
    assert check_schedule(printed_schedule(result.stdout), p=2, m=8, stages=2) == 2 * (8 + 2 - 1)
    run_python(FIGURES, tmp_path / "w2.json", tmp_path / "t.png")  # the last step's timeline
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"
    got, sd = read_json(tmp_path / "w2.json"), load_export(tmp_path / "w2.pt")
    # What `python pipeline_parallel.py --steps 4` does, without any pipeline code: the script's
    # defaults (seed 0, batch 48, AdamW lr 3e-3, weight decay 0.01) on the whole model.
    torch.manual_seed(0)
    model = ResidualMLP(hidden=64, depth=8)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    losses = []
    for step in range(4):
        x, y = classification_batch(0, step, 48)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert got["losses"] == pytest.approx(losses, rel=RTOL, abs=ATOL)
    assert (got["world_size"], got["pipeline_stages"], got["microbatches"]) == (2, 2, 8)
    # Each rank holds half the blocks: together exactly the unsplit model's parameters.
    assert len(got["per_rank"]) == 2
    assert sum(r["param_bytes"] for r in got["per_rank"]) == \
        sum(t.numel() * 4 for t in sd.values())
    ResidualMLP(hidden=64, depth=8).load_state_dict(sd, strict=True)
    assert_adamw_close(sd, model.state_dict(), **ADAMW)


# --------------------------------------------------------------------------------------------------
# Expert parallelism

MOE_TOKENS = 64  # global tokens per step: 64 / world per rank, in groups of 16
MOE_STEPS = 4


@pytest.fixture(scope="module")
def moe_runs(tmp_path_factory):
    """Per world size, one launch of the worker: the first step through the script's own code
    (weights, tokens, MoE outputs, drops, gradients), then the script's training run (export,
    metrics)."""
    out = tmp_path_factory.mktemp("moe")
    runs = {}
    for world in (1, 2, 4):
        files = {k: out / f"w{world}.{k}" for k in ("pt", "check", "json")}
        batch = ["--batch-size", MOE_TOKENS // world]
        args = ["--steps", MOE_STEPS, *batch, "--export", files["pt"], "--metrics-out",
                files["json"]]
        # the first step's check, then the script's train() with the same flags, in one launch
        worker = [f"{WORKERS}/moe_first_step.py", files["check"], *args]
        if world == 1:
            run_python(*worker)  # every expert in one process; the all-to-alls are identities
        else:
            run_torchrun(*worker, nproc=world)
        runs[world] = {"export": load_export(files["pt"]), "metrics": read_json(files["json"]),
                       "check": torch.load(files["check"], weights_only=True)}
    return runs


def naive_moe(model, h, top_k, capacity, group_size):
    """The MoE layer of one process, token by token: in each group of tokens every expert fills
    `capacity` slots, all first choices before any second choice, in token order; a choice that
    finds its expert full is dropped. Returns the output, the dropped mask and the Switch
    load-balancing loss summed over groups."""
    probs = F.softmax(model.moe.router(h), dim=-1)
    E = probs.shape[-1]
    rows, dropped, aux = [], torch.zeros(len(h), top_k, dtype=torch.bool), 0
    for g0 in range(0, len(h), group_size):
        used, out = [0] * E, [0] * group_size
        for j in range(top_k):
            for t in range(g0, g0 + group_size):
                weight, expert = (a[j] for a in probs[t].topk(top_k))
                if used[expert] == capacity:
                    dropped[t, j] = True
                    continue
                used[expert] += 1
                out[t - g0] = out[t - g0] + weight * model.moe.experts[str(int(expert))](h[t])
        rows += [o if torch.is_tensor(o) else torch.zeros_like(h[0]) for o in out]
        group = probs[g0:g0 + group_size]
        first = F.one_hot(group.argmax(-1), E).float().mean(0)
        aux = aux + E * (first * group.mean(0)).sum()
    return torch.stack(rows), dropped, aux


@pytest.fixture(scope="module")
def moe_reference():
    """The script's defaults (seed 0, 8 experts, top-2, capacity factor 1.25, groups of 16,
    aux weight 0.01, AdamW lr 3e-3 / weight decay 0.01) trained in this process, token by token:
    step 1's tensors and the losses of every step."""
    moe = load_script(MOE)
    torch.manual_seed(0)
    model = moe.MoEModel()
    capacity = model.moe.capacity
    assert capacity == math.ceil(2 * 16 * 1.25 / 8) == 5
    ref = {"weights": {k: v.clone() for k, v in model.state_dict().items()}, "losses": []}
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    for step in range(MOE_STEPS):
        x, y = classification_batch(0, step, MOE_TOKENS)
        h = model.embed(x)
        out, dropped, aux = naive_moe(model, model.norm(h), 2, capacity, 16)
        loss = F.cross_entropy(model.head(h + out), y) + 0.01 * aux / (MOE_TOKENS // 16)
        loss.backward()
        if step == 0:
            ref.update(x=x, moe_out=out.detach(), dropped=dropped,
                       grads={n: q.grad.clone() for n, q in model.named_parameters()})
        opt.step()
        opt.zero_grad()
        ref["losses"].append(loss.item())
    assert ref["dropped"].any() and not ref["dropped"].all()  # the capacity limit is exercised
    return ref


@pytest.mark.parametrize("world", [1, 2, 4])
def test_expert_parallel_equals_a_single_process_moe(moe_runs, moe_reference, world):
    ref, got, check = moe_reference, moe_runs[world], moe_runs[world]["check"]
    assert_state_dicts_close(check["weights"], ref["weights"], rtol=0, atol=0)  # same start
    assert torch.equal(check["x"], ref["x"])
    # step 1: the same tokens dropped, the same MoE outputs and gradients
    assert torch.equal(check["dropped"], ref["dropped"])
    torch.testing.assert_close(check["moe_out"], ref["moe_out"], rtol=RTOL, atol=ATOL)
    assert_state_dicts_close(check["grads"], ref["grads"], rtol=RTOL, atol=ATOL)
    # training: the same losses, and after 4 AdamW steps the same weights as the one-process run
    # of the script. (Not as the token loop: AdamW divides by sqrt(v), so where a gradient is at
    # rounding level, e.g. an expert few tokens reach, the loop's different summation order
    # changes the update itself; the script's one-process run does the same arithmetic.)
    assert got["metrics"]["losses"] == pytest.approx(ref["losses"], rel=RTOL, abs=ATOL)
    assert_adamw_close(got["export"], moe_runs[1]["export"], **ADAMW)
    load_script(MOE).MoEModel().load_state_dict(got["export"], strict=True)
    # each rank holds 8 / world experts: expert bytes are split, the rest replicated
    per_rank = got["metrics"]["per_rank"]
    expert = sum(t.numel() * 4 for k, t in got["export"].items() if k.startswith("moe.experts."))
    shared = sum(t.numel() * 4 for k, t in got["export"].items()
                 if not k.startswith("moe.experts."))
    assert [r["param_bytes"] for r in per_rank] == [shared + expert // world] * world


def test_load_balancing_loss_is_1_at_uniform_first_choices_and_can_fall_below_it():
    # The script's Switch loss E sum_e f_e P_e (the dropless script calls the same function):
    # 1 whenever the first choices are uniform, but 1 is not its minimum. Three tokens routed
    # (0.51, 0.49), (0.51, 0.49), (0, 1): f = (2/3, 1/3), P = (0.34, 0.66), so
    # 2 (2/3 x 0.34 + 1/3 x 0.66) = 0.8933, below the uniform router's 1.
    ep = load_script(MOE)
    below = torch.tensor([[[0.51, 0.49], [0.51, 0.49], [0.0, 1.0]]])
    assert ep.load_balancing_loss(below).item() == pytest.approx(2 * (2 / 3 * 0.34 + 1 / 3 * 0.66))
    assert ep.load_balancing_loss(below).item() == pytest.approx(0.893, abs=5e-4)
    uniform = torch.full((1, 4, 2), 0.5)
    skewed_but_balanced = torch.tensor([[[0.9, 0.1], [0.2, 0.8], [0.6, 0.4], [0.3, 0.7]]])
    assert ep.load_balancing_loss(uniform).item() == pytest.approx(1)
    assert ep.load_balancing_loss(skewed_but_balanced).item() == pytest.approx(1)
    # summed over groups: two groups, twice one group's value
    assert ep.load_balancing_loss(torch.cat([below, below])).item() == pytest.approx(2 * 0.8933,
                                                                                     abs=1e-3)


# --------------------------------------------------------------------------------------------------
# Ring attention

RING_LENS = (37, 50)  # 37 splits unevenly over 2, 3 and 4 ranks, 50 over 3 and 4


@pytest.fixture(scope="module")
def ring_run(tmp_path_factory):
    """Rings of 2, 3 and 4 ranks in one launch of 4 (a ring of W runs on ranks 0..W-1): the
    worker's tensors of the cases, then the script's run() of the same cases (JSON)."""
    out = tmp_path_factory.mktemp("ring")
    cases = ["--ring-sizes", "2,3,4", "--seq-lens", ",".join(map(str, RING_LENS))]
    run_torchrun(f"{WORKERS}/ring_cases.py", out / "check.pt", *cases, "--repeats", "1",
                 "--json-out", out / "ring.json", nproc=4)
    return torch.load(out / "check.pt", weights_only=True), read_json(out / "ring.json")


def test_ring_attention_equals_full_attention(ring_run):
    checks, _ = ring_run
    assert set(checks) == {f"W{w}/T{t}/{m}" for w in (2, 3, 4) for t in RING_LENS
                           for m in ("full", "causal")}
    for key, c in checks.items():
        # reference in float64 on the whole sequence: the (T, T) scores the ring never builds
        q, k, v = (c[n].double().requires_grad_() for n in ("q", "k", "v"))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=c["causal"])
        out.backward(c["dout"].double())
        # float32 ring vs float64 truth: sums over <= 50 keys and the online-softmax rescaling
        # leave errors of a few 1e-7 (observed <= 3e-6 on values of order 1): 1e-5 is a 3x margin
        for name, want in (("out", out), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
            torch.testing.assert_close(c[name], want.float(), rtol=1e-5, atol=1e-5,
                                       msg=lambda m, n=name, k=key: f"{k} {n}: {m}")
        # without overlap the ring does the same arithmetic in the same order: bitwise equal
        for a, b in zip(c["plain"], (c["out"], c["dq"], c["dk"], c["dv"])):
            assert torch.equal(a, b), key


def test_ring_reports_its_traffic(ring_run):
    _, result = ring_run
    row_bytes = result["batch"] * result["heads"] * result["head_dim"] * 4
    for row in result["results"]:
        T, world = row["seq_len"], row["ring_size"]
        # Forward: k and v make W - 1 hops; every block but rank 0's successor's passes rank 0.
        # Backward: the same hops again, plus (dk, dv) of every block once: W hops in all.
        passing = T - ((2 * T) // world - T // world)  # positions of all blocks but block 1
        assert row["rank0_bytes_sent_fwd"] == 2 * passing * row_bytes
        assert row["rank0_bytes_sent_bwd"] == 2 * passing * row_bytes + 2 * T * row_bytes
        assert row["overlap_s"] > 0 and row["no_overlap_s"] > 0


# --------------------------------------------------------------------------------------------------
# Bad settings: one line per rank, exit status 2, before any collective


def test_bad_settings_exit_2_with_one_line():
    # Too few layers for the stages and experts not divisible by the world size are checked on
    # every rank in tests/test_10_bad_inputs.py.
    r = run_python(PP, "--microbatches", "0", check=False)
    assert_bad_input(r, r"^error: --microbatches must be at least 1, got 0$")

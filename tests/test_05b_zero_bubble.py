"""Lesson 05b, zero bubble: torch's zero-bubble schedules in pipeline_parallel.py (zb1p, one stage
per rank in the pattern of the paper's ZB-H1; zbv, ZB-V, two stages per rank in a V) train as one
process does, run the schedule they print, and, with the default simulated compute time
(--layer-ms 10), the measured bubble of GPipe and 1F1B follows (p - 1)/(m + p - 1) while zero
bubble's lies below 1F1B's.

Their gradients after one step, at p = 2 and 4 with m = 1, 3, 4 and 8, are compared with the
unsplit model's in test_05b_pipeline_expert_context.py, by the gradient worker that launch
already runs for the other schedules (tests/workers_05b/pp_gradients.py), with their drawn
schedules.

Costs: three launches, all README commands run verbatim (run_documented re-checks their quoted
outputs, and test_readmes does not run them again): zb1p and zbv at p = 2 (m = 4, 3 steps, with
--metrics-out and --export) and one sweep at p = 4, m = 8 of gpipe, 1f1b, zb1p and zbv.
"""

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    REPO,
    assert_adamw_close,
    load_export,
    load_script,
    read_json,
    run_documented,
)

from dtcourse.data import classification_batch
from dtcourse.models import ResidualMLP

LESSON = "05-advanced/b-pipeline-expert-context"
PP = f"{LESSON}/pipeline_parallel.py"
README = REPO / LESSON / "zero_bubble.md"  # the lesson's zero-bubble page

# float32 on CPU. A pipeline adds the same terms in another order (micro-batch by micro-batch;
# zero bubble also computes the weight gradients in a separate autograd pass from saved
# intermediate gradients, the same products summed in another order): a few ulps of values of
# order 1, observed up to 1e-7 on gradients and losses. 1e-5 relative / 1e-6 absolute leaves a
# 10x margin; a dropped or doubled micro-batch moves the gradients by a quarter (m = 4), a missed
# weight pass or a weight gradient counted twice by all of it.
RTOL, ATOL = 1e-5, 1e-6
# The script's defaults: seed 0, 8 layers of hidden 64, batch 48, AdamW lr 3e-3, weight decay 0.01.
LR, BATCH = 3e-3, 48

RUNS = {
    "zb1p": "torchrun --nproc_per_node=2 05-advanced/b-pipeline-expert-context/pipeline_parallel.py"
            " --impl torch --schedule zb1p --microbatches 4 --steps 3"
            " --metrics-out runs/pp_zb1p.json --export runs/pp_zb1p.pt",
    "zbv": "torchrun --nproc_per_node=2 05-advanced/b-pipeline-expert-context/pipeline_parallel.py"
           " --impl torch --schedule zbv --microbatches 4 --steps 3"
           " --metrics-out runs/pp_zbv.json --export runs/pp_zbv.pt",
}
SWEEP = ("torchrun --nproc_per_node=4 05-advanced/b-pipeline-expert-context/pipeline_sweep.py"
         " --microbatches 8 --schedules gpipe,1f1b,zb1p,zbv --json-out runs/pp_zero_bubble.json")

# Margin above the formula (the sweep: p = 4, --layer-ms 10, 2 layers per stage: a forward box of
# T = 20 ms, a backward of 2T). Between two boxes on the critical path the next rank must receive
# the tensor and wake up from its sleep; the 2 (m + p - 1) hops of that path add 2 (m + p - 1) h to
# a step of 3 T (m + p - 1), an idle share of 2 h / (3 T) for a mean hop h. Mean hops measured on
# this shared 2-core machine: 1 to 2 ms, at load averages up to 13 (single hops up to ~10 ms);
# h <= 5 ms gives 2 x 5 / 60 = 0.167. Below the formula: the two barriers that bound the step on
# each rank leave a skew of a few ms of a step of ~0.7 s: 0.02. A schedule that did not pipeline
# (one micro-batch's forward at a time through the whole pipe) would measure 1 - 1/p = 0.75.
HOP_S, STAGE_FWD_S = 0.005, 2 * 0.010
ABOVE, BELOW = 2 * HOP_S / (3 * STAGE_FWD_S), 0.02


@pytest.fixture(autouse=True)
def one_thread():
    """References computed in this process use one thread, like the launched ranks."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def unsplit_model():
    torch.manual_seed(0)  # the script's --seed: the same initial weights as every rank builds
    return ResidualMLP(hidden=64, depth=8)


# --------------------------------------------------------------------------------------------------
# Two ranks: the README's runs, their exports and the schedule they ran


@pytest.fixture(scope="module")
def zero_bubble_runs():
    """The README's zb1p and zbv runs (p = 2, m = 4, 3 steps): {schedule: (stdout, metrics,
    exported state_dict)}."""
    out = {}
    for schedule, command in RUNS.items():
        result = run_documented(README, command, f"runs/pp_{schedule}.json",
                                f"runs/pp_{schedule}.pt")
        out[schedule] = (result.stdout, read_json(REPO / f"runs/pp_{schedule}.json"),
                         load_export(REPO / f"runs/pp_{schedule}.pt"))
    return out


@pytest.mark.parametrize("schedule", ["zb1p", "zbv"])
def test_zero_bubble_export_equals_the_unsplit_model_trained_in_one_process(zero_bubble_runs,
                                                                            schedule):
    _, metrics, sd = zero_bubble_runs[schedule]
    model = unsplit_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    losses = []
    for step in range(3):
        x, y = classification_batch(0, step, BATCH)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert metrics["losses"] == pytest.approx(losses, rel=RTOL, abs=ATOL)
    assert (metrics["world_size"], metrics["microbatches"]) == (2, 4)
    assert metrics["pipeline_stages"] == {"zb1p": 2, "zbv": 4}[schedule]
    ResidualMLP(hidden=64, depth=8).load_state_dict(sd, strict=True)
    # Weights after 3 AdamW steps: conftest.assert_adamw_close says which rounding-level
    # differences AdamW can grow (where a gradient is itself at rounding level) and bounds them.
    assert_adamw_close(sd, model.state_dict(), lr=LR, steps=3, msg=schedule)


def unit_length(pp, metrics) -> int:
    """Slots of the schedule the run drew (pipeline_parallel.draw_schedule of its last step)."""
    orders = [pp.ran(r["events"]) for r in metrics["per_rank"]]
    slots = pp.unit_slots(orders, metrics["pipeline_stages"])
    return 1 + max(t for row in slots for t in row)


@pytest.mark.parametrize("schedule", ["zb1p", "zbv"])
def test_zero_bubble_runs_the_schedule_it_prints(zero_bubble_runs, schedule):
    """Every rank runs F, B and W of each micro-batch on each of its stages once, zbv's stages lie
    in a V (rank r: stages r and 2p - 1 - r), and the step lasts 3m + p - 1 unit slots (zb1p:
    (p - 1)(t_F + t_B - t_W) idle, t = 1) or 6m + p - 1 half-slots (zbv, m >= 2p - 1): the
    formulas the script prints beside the measured bubble."""
    pp = load_script(PP)
    stdout, metrics, _ = zero_bubble_runs[schedule]
    p, m, stages = 2, 4, metrics["pipeline_stages"]
    layout = {"zb1p": [[0], [1]], "zbv": [[0, 3], [1, 2]]}[schedule]
    for rank, r in enumerate(metrics["per_rank"]):
        ops = pp.ran(r["events"])
        assert sorted({s for _, s, _ in ops}) == layout[rank]
        assert sorted(ops) == sorted((k, s, i) for k in "FBW" for s in layout[rank]
                                     for i in range(m))
    length = unit_length(pp, metrics)
    assert length == {"zb1p": 3 * m + p - 1, "zbv": 6 * m + p - 1}[schedule]
    formula = {"zb1p": (p - 1) / (3 * m + p - 1), "zbv": (p - 1) / (6 * m + p - 1)}[schedule]
    assert metrics["bubble_formula"] == pytest.approx(formula)
    assert metrics["bubble_formula_holds"]  # m = 4 >= p and >= 2p - 1: printed without a *
    # the printed schedule is that drawing, one row per rank
    rows = pp.draw_schedule([pp.ran(r["events"]) for r in metrics["per_rank"]],
                            stages).splitlines()
    assert all(row in stdout for row in rows)


# --------------------------------------------------------------------------------------------------
# Four ranks: the bubble of every schedule with the default simulated compute time


def test_bubble_with_the_default_compute_time_follows_the_formulas():
    run_documented(README, SWEEP, "runs/pp_zero_bubble.json")
    sweep = read_json(REPO / "runs/pp_zero_bubble.json")
    assert sweep["layer_ms"] == 10  # the default
    runs = {(r["impl"], r["schedule"]): r for r in sweep["runs"] if "skipped" not in r}
    assert set(runs) == {("manual", "gpipe"), ("manual", "1f1b"), ("torch", "gpipe"),
                         ("torch", "1f1b"), ("torch", "zb1p"), ("torch", "zbv")}
    p, m = 4, 8
    for (impl, schedule), r in runs.items():
        assert (r["p"], r["m"]) == (p, m)
        if schedule in ("gpipe", "1f1b"):
            assert r["formula"] == pytest.approx((p - 1) / (m + p - 1))
            assert r["formula"] - BELOW <= r["bubble"] <= r["formula"] + ABOVE, r
    plain = min(runs[(impl, "1f1b")]["bubble"] for impl in ("manual", "torch"))
    for schedule, formula in (("zb1p", (p - 1) / (3 * m + p - 1)),
                              ("zbv", (p - 1) / (6 * m + p - 1))):
        r = runs[("torch", schedule)]
        assert r["formula"] == pytest.approx(formula)
        # no schedule beats its formula; zero bubble's idle time is below 1F1B's
        assert formula - BELOW <= r["bubble"] < plain, (schedule, r["bubble"], plain)


"""Lesson 05a, bugs that only appear at scale (05-advanced/a-tensor-sequence-hybrid/scale_bugs.py).

The README's two commands (world 2: all three bugs; world 4: the 2-D clipping layouts) run once
each through `run_documented`, which also re-checks the output the README quotes, and every test
below reads the `--json-out` they write. The references are computed again here, in this process,
from the course's model and data, not taken from the script:

- clipping: the right norm of every layout equals one process's `clip_grad_norm_`, and so do the
  clipped gradients; each wrong norm equals its own formula from the one-process gradients (a
  rank's TP slices, a stage's layers, a shard's rows; every square all-reduced) and misses the
  right norm by at least 8%;
- vocabulary-parallel cross-entropy: loss and gradients equal dense `F.cross_entropy`; the
  own-slice loss equals its formula; the counted bytes equal the formulas;
- recomputation: gradients bitwise equal in every mode; saved bytes and FLOPs equal the formulas,
  which reduce to Korthikanti et al.'s sbh(34 + 5as/h) once dropout and 16-bit are taken out.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import REPO, load_script, read_json, run_documented

from dtcourse.data import token_batch
from dtcourse.models import GPT, init_gpt

LESSON = "05-advanced/a-tensor-sequence-hybrid"
README = REPO / LESSON / "README.md"
SCRIPT = f"{LESSON}/scale_bugs.py"
# The README's commands, verbatim (so tests/test_readmes.py does not run them again).
WORLD2_CMD = ("torchrun --nproc_per_node=2 05-advanced/a-tensor-sequence-hybrid/scale_bugs.py "
              "--json-out runs/scale_bugs_world2.json")
WORLD4_CMD = ("torchrun --nproc_per_node=4 05-advanced/a-tensor-sequence-hybrid/scale_bugs.py "
              "--bug clip --json-out runs/scale_bugs_world4.json")

# The script's defaults, which both commands use.
VOCAB, SEQ, DIM, HEADS, LAYERS, BATCH, MAX_NORM, SEED = 256, 64, 64, 8, 2, 4, 0.5, 0

# Tolerances, float32 on CPU.
# The norm: a sum of squares of up to 16,384 elements per tensor, summed per tensor and then over
# tensors, in another order than clip_grad_norm_'s (per-tensor norms, then the norm of those), and
# over gradients that TP / FSDP / PP compute in another order than one process: each of these is a
# relative error of ~1e-7 (float32's 6e-8 per rounding, a few roundings deep); measured, the right
# norms agree with one process's to the last printed digit. rtol 1e-5 leaves 100x of margin; the
# nearest wrong norm (TP rank 1's own slices) misses by 8.3%, 8000x the tolerance.
NORM_RTOL = 1e-5
# Clipped gradients: at most 0.044 in magnitude here, so float32 rounding is ~3e-9 and measured
# differences are at most 1.9e-8. atol 1e-6 is 50x that; the wrong factors move them by at
# least 4.0e-3 (TP rank 0's norm), 4000x the tolerance.
GRAD_ATOL = 1e-6
# Cross-entropy: the loss (6.15, a mean of 256 log-sum-exps) agrees to 4.8e-7 (float32 rounding of
# numbers of that size); atol 1e-5. The gradients are at most ~1/256 per logit: measured
# differences at most 2.8e-9 (head weight); atol 1e-7. The own-slice softmax moves the loss by
# 0.70 and the gradients by at least 6.6e-4, far beyond both.
LOSS_ATOL, CE_GRAD_ATOL = 1e-5, 1e-7


@pytest.fixture(scope="module")
def world2():
    run_documented(README, WORLD2_CMD, "runs/scale_bugs_world2.json")
    return read_json(REPO / "runs/scale_bugs_world2.json")


@pytest.fixture(scope="module")
def world4():
    run_documented(README, WORLD4_CMD, "runs/scale_bugs_world4.json")
    return read_json(REPO / "runs/scale_bugs_world4.json")


@pytest.fixture(scope="module")
def dense():
    """One process: the GPT's gradients on the step's batch, their norm, and clipped."""
    model = GPT(VOCAB, SEQ, DIM, HEADS, LAYERS)
    init_gpt(model, SEED)
    x, y = token_batch(SEED, 0, BATCH, SEQ, VOCAB)
    F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item()
    return {"grads": grads, "norm": norm}


def layouts(run) -> dict:
    return {r["layout"]: r for r in run["clip"]["layouts"]}


# --------------------------------------------------------------------------------------------------
# 1. The gradient norm for clipping


def tp_split_dim(name: str):
    """The dimension the hand-written TP layers cut a GPT parameter along (None: replicated)."""
    if name.endswith(("attn.q.weight", "attn.q.bias", "attn.k.weight", "attn.v.weight",
                      "attn.v.bias", "mlp.fc1.weight", "mlp.fc1.bias")):
        return 0   # column-parallel: output features
    if name.endswith(("attn.proj.weight", "mlp.fc2.weight")):
        return 1   # row-parallel: input features
    return None    # embeddings, LayerNorms, head, row-parallel biases


def held(grad, name, *, tp=1, tp_rank=0, dp=1, dp_rank=0):
    """What a rank holds of a one-process gradient: its TP slice, then its FSDP rows."""
    dim = tp_split_dim(name)
    if tp > 1 and dim is not None:
        grad = grad.chunk(tp, dim=dim)[tp_rank]
    return grad.chunk(dp, dim=0)[dp_rank] if dp > 1 else grad


def stage_of(name: str, stages: int) -> int:
    """Pipeline stage holding a parameter: blocks split evenly, embeddings first, head last."""
    if name.startswith("emb."):
        return 0
    if name.startswith("blocks."):
        return int(name.split(".")[1]) // (LAYERS // stages)
    return stages - 1


def sq(tensors) -> float:
    return sum(t.double().square().sum().item() for t in tensors)


def own_norms(grads, *, pp=1, dp=1, tp=1) -> list:
    """Each rank's own norm (what clip_grad_norm_ sees on that rank), in rank order of the mesh
    (pp, dp, tp), tp fastest."""
    out = []
    for p in range(pp):
        for d in range(dp):
            for t in range(tp):
                out.append(math.sqrt(sq(held(g, n, tp=tp, tp_rank=t, dp=dp, dp_rank=d)
                                        for n, g in grads.items() if stage_of(n, pp) == p)))
    return out


def test_clip_right_norm_and_clipped_gradients_equal_one_process(world2, world4, dense):
    assert set(layouts(world2)) == {"tp 2", "pp 2", "fsdp 2"}
    assert set(layouts(world4)) == {"pp 2 x tp 2", "fsdp 2 x tp 2", "fsdp 2 x tp 2, DTensor"}
    for run in (world2, world4):
        # The script's own one-process reference agrees with this process's.
        assert math.isclose(run["clip"]["one_process_norm"], dense["norm"], rel_tol=NORM_RTOL)
        for name, r in layouts(run).items():
            assert math.isclose(r["right_norm"], dense["norm"], rel_tol=NORM_RTOL), name
            assert r["right_clipped_error"] <= GRAD_ATOL, name
    # FSDP2 alone: clip_grad_norm_ on DTensor gradients is the global norm (torch 2.14).
    fsdp = layouts(world2)["fsdp 2"]
    assert math.isclose(fsdp["fsdp2_clip_grad_norm"], dense["norm"], rel_tol=NORM_RTOL)
    assert fsdp["fsdp2_clipped_error"] <= GRAD_ATOL
    # The norm clips: max_norm 0.5 is below it, so a wrong norm changes the factor.
    assert dense["norm"] > 2 * MAX_NORM


def test_clip_wrong_norms_equal_their_formulas_and_miss_by_more_than_rounding(world2, world4,
                                                                             dense):
    grads, norm = dense["grads"], dense["norm"]
    replicated = sq(g for n, g in grads.items() if tp_split_dim(n) is None)
    expected_own = {("world2", "tp 2"): own_norms(grads, tp=2),
                    ("world2", "pp 2"): own_norms(grads, pp=2),
                    ("world2", "fsdp 2"): own_norms(grads, dp=2),
                    ("world4", "pp 2 x tp 2"): own_norms(grads, pp=2, tp=2),
                    ("world4", "fsdp 2 x tp 2"): own_norms(grads, dp=2, tp=2)}
    runs = {"world2": layouts(world2), "world4": layouts(world4)}
    for (run, name), want in expected_own.items():
        r = runs[run][name]
        for got, expect in zip(r["own_norm_per_rank"], want, strict=True):
            assert math.isclose(got, expect, rel_tol=NORM_RTOL), (run, name, got, expect)
            assert abs(got - norm) > 0.08 * norm, (run, name, got)   # measured: 8.3% at least
        assert r["own_clipped_error"] > 1000 * GRAD_ATOL, (run, name)
        if r["tp"] > 1:
            # Every square all-reduced: the replicated tensors counted t times.
            every = math.sqrt(norm ** 2 + (r["tp"] - 1) * replicated)
            assert math.isclose(r["every_square_norm"], every, rel_tol=NORM_RTOL), (run, name)
            assert r["every_square_norm"] > 1.2 * norm
            assert r["every_square_clipped_error"] > 1000 * GRAD_ATOL
    # FSDP2 beside hand-written TP: reduced over dp only, so rank 0 gets TP rank 0's norm.
    hand = runs["world4"]["fsdp 2 x tp 2"]
    assert math.isclose(hand["fsdp2_clip_grad_norm"], own_norms(grads, tp=2)[0],
                        rel_tol=NORM_RTOL)
    assert hand["fsdp2_clipped_error"] > 1000 * GRAD_ATOL
    # DTensor TP + FSDP2: parameters on two meshes; clip_grad_norm_ cannot stack their norms.
    dtensor = runs["world4"]["fsdp 2 x tp 2, DTensor"]
    assert dtensor["meshes"] == 2
    assert "must have the same mesh" in dtensor["clip_grad_norm_error"]


# --------------------------------------------------------------------------------------------------
# 2. Vocabulary-parallel cross-entropy


def test_vocab_parallel_cross_entropy_equals_dense_and_sends_its_formula(world2):
    ce = world2["vocab_ce"]
    script = load_script(SCRIPT)
    hidden, weight, target = script.vocab_inputs(script.parse_args([]), torch.device("cpu"))
    logits, y = (hidden @ weight.t()).flatten(0, 1), target.flatten()   # (N, V), (N,)
    dense = F.cross_entropy(logits, y).item()
    for key in ("right", "gathered"):
        assert abs(ce[key]["loss"] - dense) <= LOSS_ATOL, key
        for what, err in ce[key]["grad_error"].items():
            assert err <= CE_GRAD_ATOL, (key, what, err)
    assert abs(ce["one_process_loss"] - dense) <= LOSS_ATOL

    # The own-slice version: log-sum-exp over the slice (of t = 2) that holds the target.
    t, N = 2, BATCH * SEQ
    per = VOCAB // t
    owner = y // per
    slices = logits.view(N, t, per)[torch.arange(N), owner]                 # (N, V/t)
    wrong = (torch.logsumexp(slices, dim=-1) - logits[torch.arange(N), y]).mean().item()
    assert abs(ce["wrong"]["loss"] - wrong) <= LOSS_ATOL
    # Each slice holds about half of the softmax's mass: low by about log 2 = 0.69.
    assert 0.5 < dense - ce["wrong"]["loss"] < 0.9
    for what, err in ce["wrong"]["grad_error"].items():
        assert err > 1000 * CE_GRAD_ATOL, (what, err)

    # Bytes each rank sends (ring algorithms, fp32), counted by the CollectiveCounter.
    r = (t - 1) / t
    measured = ce["measured"]
    assert measured["vocab-parallel/forward"] == {"calls": 3, "sent_bytes": 3 * 2 * r * N * 4}
    assert measured["gathered/forward"] == {"calls": 1, "sent_bytes": r * N * VOCAB * 4}
    for key in ("vocab-parallel/backward", "gathered/backward"):  # f: d hidden, (b, s, h)
        assert measured[key] == {"calls": 1, "sent_bytes": 2 * r * N * DIM * 4}


# --------------------------------------------------------------------------------------------------
# 3. Activation recomputation


def test_recomputation_modes_equal_gradients_and_the_formulas(world2):
    rec = world2["recompute"]
    b, s, h, a, L = BATCH, SEQ, DIM, HEADS, LAYERS
    modes = ("none", "full", "full, no early stop", "selective")
    for mode in modes:
        assert rec[mode]["grads_equal_none"] is True, mode   # bitwise

    # Saved for backward, fp32: 16 tensors of s*b*h per layer, the softmax a*s*s*b, and
    # LayerNorm's mean and 1/std (2 x 2 x s*b); full keeps each layer's input only; selective
    # keeps q, k, v (already among the 16) instead of the softmax.
    linear, core = 16 * s * b * h + 4 * s * b, a * s * s * b
    saved = {"none": 4 * L * (linear + core), "full": 4 * L * s * b * h,
             "full, no early stop": 4 * L * s * b * h, "selective": 4 * L * linear}
    # FLOPs (matmuls): forward F = 24bsh^2 + 4bs^2h per layer, backward 2F. Recomputed with
    # torch's early stop: everything but fc2 (8bsh^2) for a layer, q k^T (2bs^2h) for the core.
    fwd = 24 * b * s * h * h + 4 * b * s * s * h
    extra = {"none": 0, "full": fwd - 8 * b * s * h * h, "full, no early stop": fwd,
             "selective": 2 * b * s * s * h}
    for mode in modes:
        assert rec[mode]["saved_bytes"] == saved[mode], mode
        assert rec[mode]["forward_flops"] == L * fwd, mode
        assert rec[mode]["step_flops"] == L * (3 * fwd + extra[mode]), mode
    assert saved["full"] < saved["selective"] < saved["none"]
    assert extra["selective"] < extra["full"] < extra["full, no early stop"]

    # The paper's per layer, 16-bit with dropout: sbh(34 + 5as/h). Take out the two (s, b, h)
    # dropout masks (1 byte each), the attention dropout's mask (as^2b) and its output (2as^2b,
    # the softmax itself without dropout); double for fp32; add LayerNorm's statistics.
    paper = s * b * h * (34 + 5 * a * s / h)
    no_dropout_fp32 = 2 * (paper - 2 * s * b * h - 3 * a * s * s * b)
    assert no_dropout_fp32 + 4 * 4 * s * b == rec["none"]["saved_bytes"] / L
    assert rec["formula"]["paper_16bit_per_layer"] == paper


# --------------------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize("world, flags, message", [
    (2, ["--layers", "3"], "--layers 3 is not divisible by 2"),
    (4, ["--batch-size", "3"], "--batch-size 3 is not divisible by 2"),
    (2, ["--vocab", "255"], "--vocab 255 is not divisible by 2"),
])
def test_degrees_that_do_not_divide_fail_before_any_process_group(monkeypatch, capsys, world,
                                                                  flags, message):
    """parse_args reads the launcher's world size and fails with one line and exit status 2, so
    every rank fails alike before a collective (no group is started here)."""
    script = load_script(SCRIPT)
    for key, value in {"RANK": 0, "LOCAL_RANK": 0, "WORLD_SIZE": world,
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": 29500}.items():
        monkeypatch.setenv(key, str(value))
    with pytest.raises(SystemExit) as exit_status:
        script.parse_args(flags)
    assert exit_status.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err

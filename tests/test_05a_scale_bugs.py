"""Lesson 05a, bugs that only appear at scale (05-advanced/a-tensor-sequence-hybrid/scale_bugs.py).

The lesson's two commands (world 2, in its README: both bugs and the recomputation modes; world
4, in its deep dive scale_bugs.md: the 2-D clipping layouts) run once each through
`run_documented`, which also re-checks the output each page quotes. Every test below reads the `--json-out` they write and the tensor file beside it
(`.pt`: every rank's clipped gradients and cross-entropy gradients, each recomputation mode's
gradients). The references are computed again here, in this process, from the course's model and
data, not taken from the script:

- clipping: the right norm of every layout equals one process's `clip_grad_norm_`, and every
  rank's clipped gradients equal the matching slice of this process's clipped gradients; each
  wrong norm equals its own formula from the one-process gradients (a rank's TP slices, a stage's
  layers, a shard's rows; every square all-reduced) and misses the right norm by at least 8%;
  FSDP2's `clip_grad_norm_` beside hand-written TP clips each TP rank by its own slices' norm, so
  the copies of a replicated tensor differ; with every parameter on one mesh, DTensor's
  `clip_grad_norm_` is right as it is;
- vocabulary-parallel cross-entropy: every rank's loss and gradients (logits, head weight, hidden
  states) equal this process's `F.cross_entropy` backward; the own-slice loss and its gradients
  equal their formula; the counted bytes equal the formulas;
- recomputation: the gradients of every mode are bitwise equal here; saved bytes and FLOPs equal
  the formulas, which reduce to Korthikanti et al.'s sbh(34 + 5as/h) once dropout and 16-bit are
  taken out.
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
# The pages' commands, verbatim (so tests/test_readmes.py does not run them again).
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
# Clipped gradients: at most 0.044 in magnitude here, so float32 rounding is ~3e-9; measured
# against this process's clipped gradients (another thread count, another summation order), every
# rank's differ by at most 2.1e-8. atol 1e-6 is 50x that; the wrong factors move them by at least
# 4.0e-3 (TP rank 0's norm), 4000x the tolerance.
GRAD_ATOL = 1e-6
# Cross-entropy: the loss (6.15, a mean of 256 log-sum-exps) agrees to 9.5e-7 (float32 rounding of
# numbers of that size); atol 1e-5. The gradients are at most ~1/256 per logit: every rank's
# differ from this process's backward by at most 7.5e-9 (head weight, a sum over 256 tokens);
# atol 1e-7, 13x that. The own-slice softmax moves the loss by 0.70 and the gradients by at least
# 6.6e-4, far beyond both.
LOSS_ATOL, CE_GRAD_ATOL = 1e-5, 1e-7


@pytest.fixture(scope="module")
def world2():
    run_documented(README, WORLD2_CMD, "runs/scale_bugs_world2.json", "runs/scale_bugs_world2.pt")
    return (read_json(REPO / "runs/scale_bugs_world2.json"),
            torch.load(REPO / "runs/scale_bugs_world2.pt", weights_only=True))


@pytest.fixture(scope="module")
def world4():
    run_documented(REPO / LESSON / "scale_bugs.md", WORLD4_CMD, "runs/scale_bugs_world4.json",
                   "runs/scale_bugs_world4.pt")
    return (read_json(REPO / "runs/scale_bugs_world4.json"),
            torch.load(REPO / "runs/scale_bugs_world4.pt", weights_only=True))


@pytest.fixture(scope="module")
def dense():
    """One process: the GPT's gradients on the step's batch, their norm, and clipped."""
    model = GPT(VOCAB, SEQ, DIM, HEADS, LAYERS)
    init_gpt(model, SEED)
    x, y = token_batch(SEED, 0, BATCH, SEQ, VOCAB)
    F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item()
    return {"grads": grads, "norm": norm,
            "clipped": {n: p.grad.clone() for n, p in model.named_parameters()}}


def layouts(run) -> dict:
    return {r["layout"]: r for r in run[0]["clip"]["layouts"]}


def per_rank(tensors: dict, prefix: str) -> dict:
    """{rank: {name: tensor}} of the entries f"{prefix}/rank{r}/{name}" of a tensor file."""
    out = {}
    for key, value in tensors.items():
        if key.startswith(prefix + "/rank"):
            rank, name = key[len(prefix) + 5:].split("/", 1)
            out.setdefault(int(rank), {})[name] = value
    return out


def under(named: dict, prefix: str) -> dict:
    return {k[len(prefix):]: v for k, v in named.items() if k.startswith(prefix)}


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


def assert_rank_holds(got: dict, want: dict, coord, r: dict, what: str) -> None:
    """A rank's tensors `got` are its slices of the one-process tensors `want`: the parameters of
    its stage, each cut to its TP slice and FSDP rows."""
    p, d, t = coord
    names = {n for n in want if stage_of(n, r["pp"]) == p}
    assert set(got) == names, (what, sorted(set(got) ^ names))
    for n in names:
        torch.testing.assert_close(got[n], held(want[n], n, tp=r["tp"], tp_rank=t, dp=r["dp"],
                                                dp_rank=d), rtol=0, atol=GRAD_ATOL,
                                   msg=lambda m, n=n: f"{what} {n}: {m}")


def test_clip_right_norm_and_clipped_gradients_equal_one_process(world2, world4, dense):
    assert set(layouts(world2)) == {"tp 2", "pp 2", "fsdp 2"}
    assert set(layouts(world4)) == {"pp 2 x tp 2", "fsdp 2 x tp 2", "fsdp 2 x tp 2, DTensor",
                                    "fsdp 2 x tp 2, DTensor, one mesh"}
    for run in (world2, world4):
        # The script's own one-process reference agrees with this process's.
        assert math.isclose(run[0]["clip"]["one_process_norm"], dense["norm"], rel_tol=NORM_RTOL)
        tensors = run[1]
        for name, r in layouts(run).items():
            assert math.isclose(r["right_norm"], dense["norm"], rel_tol=NORM_RTOL), name
            if "DTensor" in name:      # full_tensor() of every clipped gradient, from rank 0
                full = under(tensors, f"clip/{name}/full/")
                assert set(full) == set(dense["clipped"]), name
                for n, g in full.items():
                    torch.testing.assert_close(g, dense["clipped"][n], rtol=0, atol=GRAD_ATOL,
                                               msg=lambda m, n=n: f"{name} {n}: {m}")
                continue
            ranks = per_rank(tensors, f"clip/{name}")
            assert len(ranks) == r["pp"] * r["dp"] * r["tp"], name
            for rank, held_by in ranks.items():
                # Every rank's gradients, clipped by the right norm, are its slices of this
                # process's clipped gradients.
                assert_rank_holds(under(held_by, "right/"), dense["clipped"],
                                  held_by["coord"].tolist(), r, f"{name} rank {rank}")
    # FSDP2 alone: clip_grad_norm_ on DTensor gradients is the global norm (torch 2.14), and the
    # gradients it clipped in place are this process's.
    fsdp = layouts(world2)["fsdp 2"]
    assert math.isclose(fsdp["fsdp2_clip_grad_norm"], dense["norm"], rel_tol=NORM_RTOL)
    for rank, held_by in per_rank(world2[1], "clip/fsdp 2").items():
        assert_rank_holds(under(held_by, "fsdp2/"), dense["clipped"], held_by["coord"].tolist(),
                          fsdp, f"fsdp 2, clip_grad_norm_, rank {rank}")
    # DTensor with every parameter on the (dp, tp) mesh: clip_grad_norm_ as it is.
    one_mesh = layouts(world4)["fsdp 2 x tp 2, DTensor, one mesh"]
    assert one_mesh["meshes"] == 1 and one_mesh["clip_grad_norm_error"] is None
    assert math.isclose(one_mesh["clip_grad_norm"], dense["norm"], rel_tol=NORM_RTOL)
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
        if r["tp"] > 1:
            # Every square all-reduced: the replicated tensors counted t times.
            every = math.sqrt(norm ** 2 + (r["tp"] - 1) * replicated)
            assert math.isclose(r["every_square_norm"], every, rel_tol=NORM_RTOL), (run, name)
            assert r["every_square_norm"] > 1.2 * norm
    # The replicated tensors' part of the squared norm, as the README splits it (percentage
    # points, one decimal): embeddings, head, row-parallel biases, LayerNorms.
    part = {what: round(100 * sq(g for n, g in grads.items() if pick(n)) / norm ** 2, 1)
            for what, pick in (("embeddings", lambda n: n.startswith("emb.")),
                               ("head", lambda n: n == "head.weight"),
                               ("row biases", lambda n: n.endswith(("proj.bias", "fc2.bias"))),
                               ("norms", lambda n: ".ln" in f".{n}"))}
    assert part == {"embeddings": 18.6, "head": 19.6, "row biases": 29.6, "norms": 0.0}, part
    assert round(100 * replicated / norm ** 2, 1) == 67.8

    # FSDP2 beside hand-written TP: reduced over dp only, so each rank gets its TP rank's norm
    # (rank = dp_index * 2 + tp_index) and clips by it: the two TP ranks' copies of every tensor
    # TP replicates are scaled differently, and an optimizer step would make them drift apart.
    hand = runs["world4"]["fsdp 2 x tp 2"]
    tp_norms = own_norms(grads, tp=2)
    for got, t in zip(hand["fsdp2_clip_grad_norm_per_rank"], (0, 1, 0, 1), strict=True):
        assert math.isclose(got, tp_norms[t], rel_tol=NORM_RTOL)
    ranks = per_rank(world4[1], "clip/fsdp 2 x tp 2")
    for rank, held_by in ranks.items():
        _, _, t = held_by["coord"].tolist()
        factor = MAX_NORM / (tp_norms[t] + 1e-6)      # clip_grad_norm_'s factor, less than 1
        assert_rank_holds(under(held_by, "fsdp2/"), {n: g * factor for n, g in grads.items()},
                          held_by["coord"].tolist(), hand, f"FSDP2 beside TP, rank {rank}")
    # The copies on TP ranks 0 and 1 (ranks 0 and 1: dp 0) are in the ratio of the two factors,
    # 1.0014 here, to float32 rounding (two products and a quotient: ~2e-7 relative; rtol 1e-5),
    # where replicas would be equal: a relative gap 100x that tolerance.
    ratio = (tp_norms[1] + 1e-6) / (tp_norms[0] + 1e-6)
    assert abs(ratio - 1) > 100 * 1e-5
    for n in ("head.weight", "emb.tok.weight", "blocks.0.mlp.fc2.bias"):
        torch.testing.assert_close(ranks[0][f"fsdp2/{n}"], ranks[1][f"fsdp2/{n}"] * ratio,
                                   rtol=1e-5, atol=0)
    # DTensor TP as apply_tp leaves it + FSDP2: parameters on two meshes; clip_grad_norm_ cannot
    # stack their norms.
    dtensor = runs["world4"]["fsdp 2 x tp 2, DTensor"]
    assert dtensor["meshes"] == 2
    assert "must have the same mesh" in dtensor["clip_grad_norm_error"]


# --------------------------------------------------------------------------------------------------
# 2. Vocabulary-parallel cross-entropy


def test_vocab_parallel_cross_entropy_equals_dense_and_sends_its_formula(world2):
    ce, tensors = world2[0]["vocab_ce"], world2[1]
    t, N = 2, BATCH * SEQ
    per = VOCAB // t
    script = load_script(SCRIPT)
    hidden, weight, target = script.vocab_inputs(script.parse_args([]), torch.device("cpu"))
    y = target.flatten()

    def backward(loss_of_logits):
        """This process's loss and gradients (logits, head weight, hidden states)."""
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        logits = (h @ w.t()).flatten(0, 1)                                 # (N, V)
        logits.retain_grad()
        loss = loss_of_logits(logits)
        loss.backward()
        return loss.detach(), {"logits": logits.grad, "weight": w.grad, "hidden": h.grad}

    def own_slice(logits):
        """The wrong loss: log-sum-exp over the slice (of t) that holds the target."""
        slices = logits.view(N, t, per)[torch.arange(N), y // per]          # (N, V/t)
        return (torch.logsumexp(slices, dim=-1) - logits[torch.arange(N), y]).mean()

    dense = backward(lambda z: F.cross_entropy(z, y))
    wrong = backward(own_slice)
    cut = {"logits": lambda g, i: g.chunk(t, dim=-1)[i],    # rank i: its vocabulary columns
           "weight": lambda g, i: g.chunk(t, dim=0)[i],     # its rows of the head
           "hidden": lambda g, i: g}                        # whole, after f's all-reduce
    for kind, (loss, grads) in (("right", dense), ("gathered", dense), ("wrong", wrong)):
        ranks = per_rank(tensors, f"vocab_ce/{kind}")
        assert sorted(ranks) == [0, 1], kind
        for i, got in ranks.items():
            assert abs(got["loss"].item() - loss.item()) <= LOSS_ATOL, (kind, i)
            for what, g in grads.items():
                torch.testing.assert_close(got[what], cut[what](g, i), rtol=0, atol=CE_GRAD_ATOL,
                                           msg=lambda m, k=kind, w=what: f"{k} d{w}: {m}")
    assert abs(ce["right"]["loss"] - dense[0].item()) <= LOSS_ATOL
    # The wrong version is wrong: low by about log 2 = 0.69 here (a near-uniform softmax at
    # initialisation puts about half its mass in each slice), every gradient off.
    assert 0.5 < dense[0].item() - ce["wrong"]["loss"] < 0.9
    for what, g in wrong[1].items():
        assert (g - dense[1][what]).abs().max() > 1000 * CE_GRAD_ATOL, what

    # Bytes each rank sends (ring algorithms, fp32), counted by the CollectiveCounter: the calls
    # it saw x their tensors' sizes x the ring algorithm's share, not bytes timed on a wire.
    r = (t - 1) / t
    counted = ce["measured"]
    assert counted["vocab-parallel/forward"] == {"calls": 3, "sent_bytes": 3 * 2 * r * N * 4}
    assert counted["gathered/forward"] == {"calls": 1, "sent_bytes": r * N * VOCAB * 4}
    for key in ("vocab-parallel/backward", "gathered/backward"):  # f: d hidden, (b, s, h)
        assert counted[key] == {"calls": 1, "sent_bytes": 2 * r * N * DIM * 4}


# --------------------------------------------------------------------------------------------------
# 3. Activation recomputation


def test_recomputation_modes_equal_gradients_and_the_formulas(world2):
    rec, tensors = world2[0]["recompute"], world2[1]
    b, s, h, a, L = BATCH, SEQ, DIM, HEADS, LAYERS
    modes = ("none", "full", "full, no early stop", "selective")
    grads = {mode: under(tensors, f"recompute/{mode}/") for mode in modes}
    # The input's gradient and every parameter's of the L layers: the same names in every mode,
    # none of them zero, and bitwise equal to those kept without recomputation.
    assert len(grads["none"]) == 1 + L * 15 and "input" in grads["none"]   # 15 per block
    for n, g in grads["none"].items():
        assert g.abs().sum() > 0, n
    for mode in modes:
        assert set(grads[mode]) == set(grads["none"]), mode
        for n, g in grads[mode].items():
            assert torch.equal(g, grads["none"][n]), (mode, n)

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
    # At this model selective saves a third of what full saves (as^2b of 16sbh + as^2b + 4sb,
    # against all but sbh of it): not "most of it", which needs a large a*s/h.
    share = (saved["none"] - saved["selective"]) / (saved["none"] - saved["full"])
    assert round(share, 3) == 0.347

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

"""Lesson 02, FSDP in practice: the FSDP1 API computes what FSDP2 computes (bit for bit where the
arithmetic is the same) and what one process computes; the wrapping policy's measured peak of
gathered parameters is the formula computed here from the model's parameter shapes; LoRA on a
sharded frozen base equals LoRA in one process, leaves the base bit for bit as it was, and holds
gradients and AdamW state for the adapters only.

Each configuration is launched once, on first use, and its metrics and exports serve every test
that reads them (five launches in all).
"""

import math

import pytest
import torch

from conftest import (assert_adamw_close, assert_state_dicts_equal, load_export, load_script,
                      read_json, run_python, run_torchrun)
from dtcourse.models import GPT, gpt_parameter_count, init_gpt

API = "02-fsdp/fsdp1_api.py"
LORA = "02-fsdp/fsdp_lora.py"
STEPS, LR = 3, 3e-3  # the scripts' default lr
# The course's GPT at dim 64, 4 heads, with a vocabulary (251) that splits unevenly over 2 ranks:
# FSDP2 pads the embedding and the head by one row each (per parameter, torch.chunk), FSDP1 pads
# the root's flat parameter as a whole (not at all here: 34,176 elements). Three blocks, so that
# one block's unit, the MLPs' units and the whole model differ.
SHAPE = {"vocab": 251, "seq_len": 30, "dim": 64, "layers": 3}
GPT_ARGS = ["--steps", STEPS, "--vocab", 251, "--seq-len", 30, "--layers", 3]
# Gradients are not clipped in these runs (--grad-clip 0): the global norm is still computed and
# reported, and the clip factor is exactly 1. With clipping, FSDP1 and FSDP2 sum the squares in
# other groupings (a flat shard per unit vs a DTensor per parameter), so their norms, and the
# clipped gradients, differ in the last bit (measured 1.1e-7 in 1.06), and AdamW grows that.
NO_CLIP = ["--grad-clip", 0]
MIN_PARAMS = 20_000  # fsdp1_api.py's default --min-params


class Runs:
    """Launch each named configuration once, on first use; keep its metrics JSON and every .pt
    it wrote (by file name)."""

    def __init__(self, root, specs):
        self.root, self.specs, self.done = root, specs, {}

    def __call__(self, name):
        if name not in self.done:
            script, nproc, args = self.specs[name]
            out = self.root / name
            out.mkdir()
            cmd = [script, *[str(a).replace("{out}", str(out)) for a in args],
                   "--metrics-out", out / "metrics.json"]
            if nproc == 1:
                run_python(*cmd, timeout=240)
            else:
                run_torchrun(*cmd, nproc=nproc, timeout=240)
            self.done[name] = (read_json(out / "metrics.json"),
                               {p.name: load_export(p) for p in out.glob("*.pt")})
        return self.done[name]


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    """get(launch, "fsdp1-block") -> (metrics, exported weights) of one run of fsdp1_api.py."""
    specs = {
        # every wrap policy under both APIs, FULL_SHARD, 2 ranks x 4 sequences
        "full": (API, 2, [*GPT_ARGS, *NO_CLIP, "--batch-size", 4, "--wrap", "block", "size",
                          "none", "--export", "{out}/w.pt"]),
        "grad-op": (API, 2, [*GPT_ARGS, *NO_CLIP, "--batch-size", 4, "--strategy", "grad-op",
                             "--export", "{out}/w.pt"]),
        # one process, the same global batch of 8 (FSDP1 runs NO_SHARD at world 1)
        "one": (API, 1, [*GPT_ARGS, *NO_CLIP, "--batch-size", 8, "--export", "{out}/w.pt"]),
    }
    runs = Runs(tmp_path_factory.mktemp("api"), specs)

    def get(launch, run):
        metrics, exports = runs(launch)
        return metrics["runs"][run], exports[f"w.{run}.pt"]
    return get


@pytest.fixture(scope="module")
def lora(tmp_path_factory):
    """get(launch) -> (metrics of every method, every export) of fsdp_lora.py: the script's GPT
    (2 blocks) with the uneven vocabulary."""
    args = ["--steps", STEPS, "--vocab", 251, "--seq-len", 30, "--export", "{out}/w.pt",
            "--export-merged", "{out}/merged.pt", "--export-adapters", "{out}/adapters.pt"]
    specs = {"w2": (LORA, 2, [*args, "--batch-size", 4, "--method", "lora", "full"]),
             "one": (LORA, 1, [*args, "--batch-size", 8, "--method", "lora"])}
    runs = Runs(tmp_path_factory.mktemp("lora"), specs)

    def get(launch):
        metrics, exports = runs(launch)
        return metrics.get("runs", {metrics.get("method"): metrics}), exports
    return get


def initial_gpt(vocab=251, seq_len=30, dim=64, heads=4, layers=2) -> dict:
    model = GPT(vocab, seq_len, dim, heads, layers)
    init_gpt(model, 0)
    return {k: v.detach() for k, v in model.state_dict().items()}


# --------------------------------------------------------------------------------------------------
# FSDP1 = FSDP2 = one process


@pytest.mark.parametrize("launch,wrap", [("full", "block"), ("full", "size"), ("full", "none"),
                                         ("grad-op", "block")])
def test_fsdp1_and_fsdp2_export_the_same_weights(api, launch, wrap):
    """The same arithmetic, so bit for bit: each rank computes its gradient from the same gathered
    weights on the same rows; the mean over 2 ranks is exact in both (FSDP1 halves, then sums;
    FSDP2 averages; halving is exact in binary floating point, and a sum of two terms has one
    order); AdamW is element-wise, so the shard boundaries (a flat shard per unit vs rows of each
    parameter) do not change any element's arithmetic. A difference of a single bit would show a
    different computation, not rounding."""
    m1, w1 = api(launch, f"fsdp1-{wrap}")
    m2, w2 = api(launch, f"fsdp2-{wrap}")
    assert (m1["api"], m2["api"]) == ("fsdp1", "fsdp2")
    assert m1["strategy"] == m2["strategy"] == launch and m1["world_size"] == 2
    assert m1["units"] == m2["units"]  # the same units from FSDP1's policy and FSDP2's calls
    assert_state_dicts_equal(w1, w2, msg=f"{launch} {wrap}: fsdp1 vs fsdp2")
    assert m1["losses"] == m2["losses"]
    # The global gradient norm: FSDP1's clip_grad_norm_ all-reduces the squares of its flat
    # shards, FSDP2's torch.nn.utils.clip_grad_norm_ reduces DTensors per parameter: the same sum
    # in other groupings, so agreement to float32 rounding (1e-6 relative).
    torch.testing.assert_close(torch.tensor(m1["grad_norms"]), torch.tensor(m2["grad_norms"]),
                               rtol=1e-6, atol=0)


@pytest.mark.parametrize("which", ["fsdp1", "fsdp2"])
@pytest.mark.parametrize("launch", ["full", "grad-op"])
def test_each_api_equals_one_process(api, launch, which):
    """World 2 against one process with the same global batch: the gradient is the same sum in
    another order (two half-batches averaged vs one batch), so AdamW's argued bound
    (conftest.assert_adamw_close) with this run's lr and steps."""
    metrics, weights = api(launch, f"{which}-block")
    one_metrics, one = api("one", f"{which}-block")
    assert one_metrics["world_size"] == 1 and metrics["world_size"] == 2
    assert one_metrics["global_batch"] == metrics["global_batch"] == 8
    assert_adamw_close(weights, one, lr=LR, steps=STEPS, msg=f"{which} {launch} vs one process")
    # A norm of this rank's shard only (torch.nn.utils' on FSDP1's plain shards) would be ~1/sqrt(2)
    # of the global one; float32 reduction order gives ~1e-6 relative.
    for key in ("grad_norms", "losses"):
        torch.testing.assert_close(torch.tensor(metrics[key]), torch.tensor(one_metrics[key]),
                                   rtol=1e-5, atol=0)


def test_one_process_fsdp1_equals_fsdp2(api):
    # World 1: FSDP1 replaces FULL_SHARD by NO_SHARD, FSDP2 keeps a mesh of one; the same
    # arithmetic on the same batch, bit for bit.
    m1, w1 = api("one", "fsdp1-block")
    m2, w2 = api("one", "fsdp2-block")
    assert_state_dicts_equal(w1, w2, msg="world 1: fsdp1 vs fsdp2")
    assert m1["losses"] == m2["losses"]


def test_exports_load_strictly_into_the_plain_gpt(api):
    model = GPT(**{k: SHAPE[k] for k in ("vocab", "seq_len", "dim")}, heads=4,
                layers=SHAPE["layers"])
    for launch, run in (("full", "fsdp1-size"), ("full", "fsdp2-none"), ("one", "fsdp1-block"),
                        ("grad-op", "fsdp2-block")):
        model.load_state_dict(api(launch, run)[1], strict=True)


# --------------------------------------------------------------------------------------------------
# The wrapping policy and the peak of gathered parameters


def unit_params(model, wrap: str) -> tuple[list, list]:
    """(root's parameter shapes, [shapes of each other unit] in forward order). block: each Block;
    size (min_num_params 20,000): each block's MLP (8 dim^2 + 5 dim = 33,088 parameters) is large
    enough on its own, its attention (16,576) and norms are not, and a ModuleList is never a unit,
    so they stay with the root; none: the root holds everything."""
    if wrap == "block":
        units = list(model.blocks)
    elif wrap == "size":
        units = [block.mlp for block in model.blocks]
        assert sum(p.numel() for p in units[0].parameters()) >= MIN_PARAMS > \
            sum(p.numel() for p in model.blocks[0].attn.parameters())
    else:
        units = []
    inside = {id(p) for u in units for p in u.parameters()}
    root = [tuple(p.shape) for p in model.parameters() if id(p) not in inside]
    return root, [[tuple(p.shape) for p in u.parameters()] for u in units]


def gathered_bytes(shapes, api_name: str, n: int = 2) -> int:
    """Bytes of one unit's all-gather output (fp32) on n ranks. FSDP1: one flat parameter padded
    to a multiple of n elements (its 16-byte alignment of each parameter adds nothing here: every
    size is a multiple of 4 elements). FSDP2: each parameter padded to a multiple of n rows."""
    if api_name == "fsdp1":
        assert all(math.prod(s) % 4 == 0 for s in shapes)
        return 4 * math.ceil(sum(math.prod(s) for s in shapes) / n) * n
    return 4 * sum(math.ceil(s[0] / n) * n * math.prod(s[1:]) for s in shapes)


def expected_peak(root: int, units: list, api_name: str, strategy: str) -> int:
    """Gathered bytes held at once, from the unit sizes (units in forward order).

    full, FSDP1: the root stays gathered from forward to backward; in forward one unit at a time,
    in backward the unit computing its gradients and the next one, prefetched (BACKWARD_PRE).
    full, FSDP2: the same, plus its all-gather buffers: a unit is gathered into one buffer and
    copied out into its parameters (both exist during the copy-out), and in forward the buffer is
    freed only when the next unit's all-gather is waited on, before that unit's copy-out
    (FSDPParamGroup.wait_for_unshard, torch 2.14): the root's buffer and parameters meet the first
    unit's buffer.
    grad-op: every unit stays gathered from forward to backward; FSDP2 adds the last buffer."""
    if strategy == "grad-op":
        return root + sum(units) + (max(units) if api_name == "fsdp2" else 0)
    pairs = [a + b for a, b in zip(units, units[1:])]
    if api_name == "fsdp1":
        return root + max([0, *units, *pairs])
    if not units:
        return 2 * root
    return max(2 * root + units[0], *(root + 2 * u for u in units), *(root + p for p in pairs))


@pytest.mark.parametrize("which", ["fsdp1", "fsdp2"])
def test_wrap_policy_peaks_are_the_formula_and_in_the_documented_order(api, which):
    model = GPT(SHAPE["vocab"], SHAPE["seq_len"], SHAPE["dim"], 4, SHAPE["layers"])
    peaks = {}
    for wrap in ("block", "size", "none"):
        metrics, _ = api("full", f"{which}-{wrap}")
        root_shapes, unit_shapes = unit_params(model, wrap)
        root = gathered_bytes(root_shapes, which)
        units = [gathered_bytes(u, which) for u in unit_shapes]
        names = {"block": [f"blocks.{i}" for i in range(3)],
                 "size": [f"blocks.{i}.mlp" for i in range(3)], "none": []}[wrap]
        assert metrics["units"] == names + ["root"]
        held = metrics["per_rank"][0]
        # the all-gathers the run counted are these units, padding included
        assert held["root_gather_bytes"] == root
        assert held["unit_gather_bytes"] == max(units, default=0)
        assert metrics["comms_per_step"]["all_gather"]["calls"] == 1 + 2 * len(units)
        for rank_held in metrics["per_rank"]:  # the same units on every rank
            assert rank_held["gathered_peak_bytes"] == expected_peak(root, units, which, "full")
        peaks[wrap] = held["gathered_peak_bytes"]
    # Documented order: one unit per block holds the least; size-based leaves attention and the
    # norms to the root, which stays gathered; the whole model as one unit holds it all.
    assert peaks["block"] < peaks["size"] < peaks["none"], peaks
    assert peaks["none"] == (1 if which == "fsdp1" else 2) * gathered_bytes(
        unit_params(model, "none")[0], which)


@pytest.mark.parametrize("which", ["fsdp1", "fsdp2"])
def test_grad_op_keeps_the_whole_model_gathered(api, which):
    model = GPT(SHAPE["vocab"], SHAPE["seq_len"], SHAPE["dim"], 4, SHAPE["layers"])
    metrics, _ = api("grad-op", f"{which}-block")
    root_shapes, unit_shapes = unit_params(model, "block")
    root = gathered_bytes(root_shapes, which)
    units = [gathered_bytes(u, which) for u in unit_shapes]
    assert metrics["per_rank"][0]["gathered_peak_bytes"] == expected_peak(root, units, which,
                                                                          "grad-op")
    # forward only: no unit is gathered again for backward
    assert metrics["comms_per_step"]["all_gather"]["calls"] == 1 + len(units)
    full_metrics, _ = api("full", f"{which}-block")
    assert metrics["per_rank"][0]["gathered_peak_bytes"] > \
        full_metrics["per_rank"][0]["gathered_peak_bytes"]


# --------------------------------------------------------------------------------------------------
# Bytes per rank


def shard_rows(rows: int, parts: int, index: int) -> int:
    """Rows of dim 0 on shard `index` of `parts` (torch.chunk's split, as FSDP2's Shard(0))."""
    size = math.ceil(rows / parts)
    start = min(index * size, rows)
    return min(start + size, rows) - start


def fsdp1_local(units: list, rank: int, n: int = 2) -> tuple[int, int]:
    """(elements, parameters) of rank `rank`'s FSDP1 flat shards: each unit's parameters laid end
    to end in module order (no alignment padding: every size is a multiple of 4 elements), padded
    to a multiple of n, rank r holding elements [r c, (r + 1) c). A parameter counts when some of
    it lies in the shard: the others are empty views, with no gradient and no AdamW state."""
    elements = params = 0
    for shapes in units:
        sizes = [math.prod(s) for s in shapes]
        c = math.ceil(sum(sizes) / n)
        lo, hi, start = rank * c, (rank + 1) * c, 0
        for size in sizes:
            inside = max(0, min(start + size, hi) - max(start, lo))
            elements, params, start = elements + inside, params + (inside > 0), start + size
    return elements, params


def test_per_rank_bytes_are_the_shards(api):
    """Both APIs hold 1/2 of every parameter, gradient and Adam moment, counted to the byte per
    rank: FSDP1 a contiguous piece of each unit's flat parameter, FSDP2 rows of every parameter.
    AdamW adds a 4-byte step counter per parameter it has a gradient for."""
    P = gpt_parameter_count(**SHAPE)
    model = GPT(SHAPE["vocab"], SHAPE["seq_len"], SHAPE["dim"], 4, SHAPE["layers"])
    for run in ("fsdp1-block", "fsdp2-block", "fsdp1-none", "fsdp1-size", "fsdp2-size"):
        metrics, _ = api("full", run)
        which, wrap = run.split("-")
        root, units = unit_params(model, wrap)
        assert metrics["params"] == P
        held = metrics["per_rank"]
        assert sum(h["param_bytes"] for h in held) == sum(h["grad_bytes"] for h in held) == 4 * P
        for rank, h in enumerate(held):
            if which == "fsdp1":
                elements, tensors = fsdp1_local([root, *units], rank)
            else:
                shapes = [s for u in [root, *units] for s in u]
                elements = sum(shard_rows(s[0], 2, rank) * math.prod(s[1:]) for s in shapes)
                tensors = sum(shard_rows(s[0], 2, rank) > 0 for s in shapes)
            assert h["param_bytes"] == h["grad_bytes"] == 4 * elements, (run, rank)
            assert h["optim_bytes"] == 8 * elements + 4 * tensors, (run, rank)


# --------------------------------------------------------------------------------------------------
# LoRA on a sharded frozen base


def test_lora_on_two_ranks_equals_one_process_and_the_base_is_unchanged(lora):
    runs, exports = lora("w2")
    one_runs, one_exports = lora("one")
    assert runs["lora"]["world_size"] == 2 and one_runs["lora"]["world_size"] == 1
    assert runs["lora"]["global_batch"] == one_runs["lora"]["global_batch"] == 8
    w2, w1 = exports["w.lora.pt"], one_exports["w.pt"]
    adapters = sorted(k for k in w2 if ".lora_" in k)
    assert len(adapters) == 2 * 6 * 2  # A and B on 6 projections of 2 blocks
    # The adapters: AdamW steps from gradients summed in another order (2 x 4 rows vs 8 rows).
    assert_adamw_close({k: w2[k] for k in adapters}, {k: w1[k] for k in adapters}, lr=LR,
                       steps=STEPS, msg="lora world 2 vs one process")
    # The frozen base: no gradient, no optimizer state, so not one bit moved, at any world size
    init = initial_gpt()
    base = sorted(k for k in w2 if ".lora_" not in k)
    assert len(base) == len(init)
    for key in base:
        plain = key.replace(".base.", ".")
        assert torch.equal(w2[key], init[plain]), key
        assert torch.equal(w1[key], init[plain]), key
    # B starts at zero: the first loss is the base model's, the same as full fine-tuning's
    assert runs["lora"]["losses"][0] == runs["full"]["losses"][0]
    torch.testing.assert_close(torch.tensor(runs["lora"]["losses"]),
                               torch.tensor(one_runs["lora"]["losses"]), rtol=1e-5, atol=0)


def test_lora_merged_and_adapter_exports(lora):
    runs, exports = lora("w2")
    trained, merged, adapters = exports["w.lora.pt"], exports["merged.pt"], exports["adapters.pt"]
    scale = runs["lora"]["alpha"] / runs["lora"]["rank"]
    assert sorted(adapters) == sorted(k for k in trained if ".lora_" in k)
    for key, value in adapters.items():
        assert torch.equal(value, trained[key])
    model = GPT(251, 30, 64, 4, 2)
    model.load_state_dict(merged, strict=True)  # a plain GPT again
    for key in merged:
        layer, leaf = key.rsplit(".", 1)
        if f"{layer}.lora_a" in trained and leaf == "weight":
            delta = scale * (trained[f"{layer}.lora_b"] @ trained[f"{layer}.lora_a"])
            torch.testing.assert_close(merged[key], trained[f"{layer}.base.weight"] + delta)
            assert delta.abs().max() > 0, f"{layer}: the adapter did not train"
        else:
            src = f"{layer}.base.{leaf}" if f"{layer}.base.{leaf}" in trained else key
            assert torch.equal(merged[key], trained[src]), key


def test_lora_grads_and_adam_state_are_the_adapters_only(lora):
    """Per rank, to the byte: parameters are the shards of base and adapters; gradients and AdamW's
    two moments exist for the adapters' shards only (plus AdamW's 4-byte step per adapter
    tensor); full fine-tuning holds them for everything. The reduce-scatters carry the adapters'
    gradients only, the all-gathers every parameter."""
    runs, _ = lora("w2")
    dim, r = 64, runs["lora"]["rank"]
    model = GPT(251, 30, dim, 4, 2)
    base = [tuple(p.shape) for p in model.parameters()]
    # A (r, in) and B (out, r) for q, k, v, proj (64 -> 64), fc1 (64 -> 256), fc2 (256 -> 64)
    sides = [(dim, dim)] * 4 + [(dim, 4 * dim), (4 * dim, dim)]
    adapter = [s for _ in range(2) for i, o in sides for s in ((r, i), (o, r))]
    T = sum(math.prod(s) for s in adapter)
    assert T == 2 * r * sum(i + o for i, o in sides) == runs["lora"]["trainable"]
    assert runs["full"]["trainable"] == gpt_parameter_count(251, 30, dim, 2)

    def local(shapes, rank):
        return sum(shard_rows(s[0], 2, rank) * math.prod(s[1:]) for s in shapes)

    for method, trainable in (("lora", adapter), ("full", base)):
        held_all = runs[method]["per_rank"]
        stored = base + (adapter if method == "lora" else [])
        for rank, held in enumerate(held_all):
            assert held["param_bytes"] == 4 * local(stored, rank)
            assert held["grad_bytes"] == 4 * local(trainable, rank)
            assert held["optim_bytes"] == 8 * local(trainable, rank) + 4 * len(trainable)
        assert sum(h["grad_bytes"] for h in held_all) == 4 * sum(math.prod(s) for s in trainable)
    comms = runs["lora"]["comms_per_step"]
    assert comms["reduce_scatter"]["tensor_bytes"] == 4 * T  # no padding: every dim 0 is even
    assert comms["all_gather"]["tensor_bytes"] > runs["full"]["comms_per_step"]["all_gather"][
        "tensor_bytes"]
    lora_total = sum(runs["lora"]["per_rank"][0][k] for k in ("param_bytes", "grad_bytes",
                                                              "optim_bytes"))
    full_total = sum(runs["full"]["per_rank"][0][k] for k in ("param_bytes", "grad_bytes",
                                                              "optim_bytes"))
    assert lora_total < 0.45 * full_total


def test_the_lora_merge_function_is_the_formula():
    """merge_lora on a hand-made state dict: W + (alpha/r) B A, biases and other tensors kept."""
    merge = load_script(LORA).merge_lora
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(3, 4, generator=g), torch.randn(3, generator=g)
    a, bb = torch.randn(2, 4, generator=g), torch.randn(3, 2, generator=g)
    sd = {"x.base.weight": w, "x.base.bias": b, "x.lora_a": a, "x.lora_b": bb, "y.weight": w}
    out = merge(sd, 0.5)
    assert sorted(out) == ["x.bias", "x.weight", "y.weight"]
    torch.testing.assert_close(out["x.weight"], w + 0.5 * bb @ a)
    assert torch.equal(out["x.bias"], b) and torch.equal(out["y.weight"], w)

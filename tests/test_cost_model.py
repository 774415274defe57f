"""Lesson 05's cost model (05-advanced/cost_model.py): every figure it prints and writes equals the
formulas, worked out here by hand for three layouts; a case whose answer is forced (70B does not
fit on 80 GB GPUs with data parallelism alone) gets sharding or TP; the walkthrough's commands run
and reproduce their quoted outputs; bad input stops with one line.

The script is arithmetic (no torch, no process group), so each launch takes a fraction of a
second; the walkthrough's commands are run here once (tests/test_readmes.py then skips them).

Tolerances: the script and this file compute the same float64 expressions in a different order,
which moves a result by a few ulps (1e-15 relative); a wrong formula (a missing factor (g-1)/g, a
ring step too many, the wrong link) moves a term by 1e-3 or more. So JSON figures are compared at
1e-9 relative, and printed figures to half a unit of their last printed digit.
"""

import math
import re

import pytest
from conftest import REPO, assert_bad_input, read_json, run_documented, run_python

SCRIPT = "05-advanced/cost_model.py"
DOC = REPO / "05-advanced" / "cost_model.md"
OUT = "runs/cost_model"
REL = 1e-9

# Inputs the hand arithmetic uses, from their sources (not read from the script): H100 SXM dense
# bf16 989 TFLOP/s, NVLink 450 GB/s one way, HBM 3.35 TB/s and 80 GB; NDR NICs of 50 GB/s, one per
# GPU; NCCL's ring-step latencies 3.4 us (NVLink) and 9.6 us (network); the defaults MFU 0.40,
# links at 80% of spec, 90% of HBM usable.
PEAK, NVLINK, NIC, HBM_BW, HBM = 989e12, 450e9, 50e9, 3.35e12, 80e9
A_NV, A_NET = 3.4e-6, 9.6e-6
MFU, EFF, USABLE = 0.40, 0.8, 0.9

# Llama 3.1 8B (config.json): 32 layers, h 4096, ffn 14336, 32 heads, 8 KV heads of 128, vocab
# 128256, untied output layer.
L, H, F, KV, V = 32, 4096, 14336, 8 * 128, 128256
LAYER_MATRICES = 2 * H * H + 2 * H * KV + 3 * H * F     # q, o; k, v; gate, up, down
P_8B = L * (LAYER_MATRICES + 2 * H) + 2 * V * H + H     # + 2 norms a layer, embedding, head, norm
N_8B = P_8B - V * H                                      # the embedding look-up does not multiply


def ring(steps_nvlink: int, steps_net: int, sent: float, busbw: float) -> float:
    """alpha-beta: every ring step pays its link's latency; the bytes go at the bus bandwidth,
    80% of spec."""
    return steps_nvlink * A_NV + steps_net * A_NET + sent / (busbw * EFF)


def close(actual: float, expected: float, what: str) -> None:
    assert math.isclose(actual, expected, rel_tol=REL, abs_tol=1e-12), \
        f"{what}: script {actual!r}, by hand {expected!r}"


def printed(stdout: str, label: str) -> list[float]:
    """The numbers of the table row that starts with `label` (commas removed)."""
    line = next(x for x in stdout.splitlines() if x.startswith(label))
    return [float(v.replace(",", "")) for v in re.findall(r"-?\d[\d,]*\.?\d*", line[len(label):])]


def assert_printed(values: list[float], expected: list[float], decimals: list[int], what: str):
    for got, want, dec in zip(values, expected, decimals, strict=True):
        assert abs(got - want) <= 0.5 * 10 ** -dec + 1e-9, f"{what}: printed {got}, by hand {want}"


# --------------------------------------------------------------------------------------------------
# Layout A: every term at once. 16 GPUs (2 nodes of 8), sequences of 16384, 16 per step; TP 2,
# CP 2, PP 2 interleaved with 2 chunks per rank, DP 2, FSDP, full activation checkpointing,
# micro-batches of 1 sequence. Ranks: TP innermost, then CP, PP, DP: the 16-GPU example of the
# Llama 3 paper (section 3.3.2), where GPU 0 shares its TP group with GPU 1, CP with 2, PP with 4
# and DP with 8.

LAYOUT_A = ["--model", "llama3.1-8b", "--gpus", "16", "--seq-len", "16384",
            "--global-batch-tokens", "256Ki", "--tp", "2", "--cp", "2", "--pp", "2",
            "--virtual-stages", "2", "--dp", "2", "--sharding", "fsdp",
            "--activation-checkpointing", "full", "--batch-size", "1"]


def by_hand_a() -> dict:
    s, t, c, p, v, d, b = 16384, 2, 2, 2, 2, 2, 1
    m = 16 // (d * b)                       # 8 micro-batches per DP rank
    tokens = b * s // c                     # 8192 tokens per GPU per micro-batch
    layers = v * math.ceil(L / (p * v))     # 16 layers per rank: 2 chunks of 8
    rate = PEAK * MFU
    per_token = 6 * N_8B + 12 * L * H * s
    flops = b * s * per_token * layers / L / (t * c)
    fwd = flops / 3 / rate
    bwd = (2 * flops / 3 + flops / 3) / rate               # + the recomputed forward
    attention = b * s * 12 * layers * H * s / (t * c) * 4 / 3 / rate
    # TP 2: ranks {0, 1}, one node, NVLink. All-reduce of (1, 8192, 4096) bf16: each GPU sends
    # 2 (t-1)/t = 1 times it in 2 ring steps; 6 per layer (2 forward, 2 backward, 2 recomputed).
    act = tokens * H * 2
    tp_one = ring(2, 0, act, NVLINK)
    tp_mb = 6 * layers * tp_one
    # CP 2: ranks {0, 2} (stride t), one node. K and V of the whole sequence on this TP rank:
    # 16384 x 2 x 512 x 2 bytes; an all-gather or reduce-scatter sends half of it in 1 step.
    # Per layer: gathered forward, again backward, again in the recomputed forward; dK,dV
    # reduce-scattered once.
    kv_all = b * s * 2 * (KV // t) * 2
    cp_one = ring(1, 0, kv_all / 2, NVLINK)
    cp_mb = layers * 4 * cp_one
    cp_exposed = max(0.0, cp_mb - attention)
    # PP 2: ranks {0, 4} (stride t c = 4), one node. Each chunk sends its (1, 8192, 4096/2)
    # slice forward and a gradient back: 2 v = 4 sends per micro-batch, 1 step each.
    pp_one = A_NV + (tokens * H * 2 / t) / (NVLINK * EFF)
    pp_mb = 2 * v * pp_one
    stage = fwd + bwd + tp_mb + cp_exposed + pp_mb
    bubble = (p - 1) / v * stage
    pipeline = m * stage + bubble
    # Parameters on the busiest GPU: 16 layers of which TP holds half of every matrix (norms
    # whole), half of the embedding (or of the output layer) and the final norm.
    params = layers * (LAYER_MATRICES / t + 2 * H) + V * H / t + H
    # FSDP over the d c = 4 ranks {0, 2, 8, 10}: 2 per node, 2 nodes. With a pipeline, one
    # all-gather and one reduce-scatter per step, one per layer and one for the embedding: 17
    # each of W / 17 bf16 bytes, 3/4 of it sent, 3 ring steps of which 1 crosses the network,
    # at 2 GPUs x 50 GB/s of NICs (less than NVLink's 450).
    W = 2 * params
    dp_one = ring(2, 1, 0.75 * W / 17, 2 * NIC)
    dp_time = 17 * 2 * dp_one
    dp_exposed = max(0.0, dp_time - (fwd + bwd))
    optimizer = 28 * params / 4 / HBM_BW
    memory = {"weights": 2 * params / 4, "grads": 2 * params / 4, "optimizer": 12 * params / 4,
              "gathered": 4 * params,        # the stage's unsharded weights and grads, bf16
              # layer inputs (2h bytes a token) of 2 micro-batches x (1 + 1/4) in flight, plus one
              # layer rebuilt: (12h + 4kv + 6f) / t bytes a token
              "activations": layers * tokens * 2 * H / t * 2 * (1 + (p - 1) / (p * v))
              + tokens * (12 * H + 4 * KV + 6 * F) / t,
              "logits": tokens * V / t * 6}
    memory["total"] = sum(memory.values())
    return {"m": m, "compute": m * (fwd + bwd), "attention_mb": attention, "bubble": bubble,
            "bubble_fraction": (p - 1) / (v * m + p - 1), "pipeline": pipeline,
            "tp": {"count": 6 * layers * m, "bytes": 6 * layers * m * act, "mb": tp_mb},
            "cp": {"count": 4 * layers * m, "bytes": 4 * layers * m * kv_all / 2, "mb": cp_mb,
                   "exposed_mb": cp_exposed},
            "pp": {"count": 2 * v * m, "bytes": 2 * v * m * tokens * H * 2 / t, "mb": pp_mb},
            "dp": {"count": 34, "bytes": 2 * 0.75 * W, "time": dp_time, "exposed": dp_exposed},
            "params": params, "optimizer": optimizer, "memory": memory,
            "step": pipeline + dp_exposed + optimizer}


@pytest.fixture(scope="module")
def layout_a():
    r = run_python(SCRIPT, *LAYOUT_A, "--json-out", f"{OUT}/layout_a.json", timeout=60)
    return r.stdout, read_json(REPO / OUT / "layout_a.json")


def test_every_term_of_a_layout_equals_the_formulas(layout_a):
    stdout, out = layout_a
    want, got = by_hand_a(), out["chosen"]
    assert out["parameters"] == P_8B == 8_030_261_248      # the published count of Llama 3.1 8B
    assert out["flops_n"] == N_8B
    assert out["flops_per_token"] == 6 * N_8B + 12 * L * H * 16384
    assert got["layout"] == {"tp": 2, "cp": 2, "pp": 2, "v": 2, "dp": 2, "sharding": "fsdp",
                             "ac": "full", "b": 1}
    assert got["microbatches"] == want["m"] == 8 and got["dp_group"] == 4
    close(got["params_per_gpu"], want["params"], "parameters per GPU")
    for key in ("compute", "attention_mb", "bubble", "bubble_fraction", "pipeline", "optimizer",
                "step"):
        close(got[key], want[key], key)
    for term in ("tp", "cp", "pp", "dp"):
        for key, value in want[term].items():
            if key == "count":
                assert got["terms"][term][key] == value, term
            else:
                close(got["terms"][term][key], value, f"{term} {key}")
    assert got["terms"]["cp"]["exposed_mb"] == 0.0  # attention at 16K tokens hides the ring
    for key, value in want["memory"].items():
        close(got["memory"][key], value, f"memory {key}")
    assert got["fits"] == (want["memory"]["total"] <= USABLE * HBM) is True

    # The printed table: counts exactly, GB to 2 decimals, milliseconds to 1.
    ms = 1e3
    assert_printed(printed(stdout, "compute, micro-batches"), [8, want["compute"] * ms,
                   want["compute"] * ms], [0, 1, 1], "compute")
    assert_printed(printed(stdout, "pipeline bubble")[-2:], [want["bubble"] * ms] * 2, [1, 1],
                   "bubble")
    for label, term, exposed in (("TP all-reduce", "tp", want["tp"]["mb"]),
                                 ("CP ring", "cp", want["cp"]["exposed_mb"]),
                                 ("PP send", "pp", want["pp"]["mb"])):
        w = want[term]
        assert_printed(printed(stdout, label)[-4:], [w["count"], w["bytes"] / 1e9,
                       w["mb"] * 8 * ms, exposed * 8 * ms], [0, 2, 1, 1], label)
    dp = want["dp"]
    assert_printed(printed(stdout, "DP fsdp over 4 ranks")[-4:], [dp["count"], dp["bytes"] / 1e9,
                   dp["time"] * ms, dp["exposed"] * ms], [0, 2, 1, 1], "DP")
    assert_printed(printed(stdout, "step")[:2], [want["step"] * ms, 262144 * (
        6 * N_8B + 12 * L * H * 16384) / (16 * PEAK * want["step"])], [1, 3], "step, MFU")
    mem = want["memory"]
    assert_printed(printed(stdout, "memory per GPU (GB):")[:8],
                   [mem[k] / 1e9 for k in ("weights", "grads", "optimizer", "gathered",
                                           "activations", "logits", "total")] + [72.0],
                   [2] * 7 + [1], "memory")


# --------------------------------------------------------------------------------------------------
# Layout B: FSDP without a pipeline gathers for every micro-batch; layout C: DDP's buckets, with
# --overlap off (every byte exposed).

LAYOUT_B = ["--model", "llama3.1-8b", "--gpus", "16", "--global-batch-tokens", "256Ki",
            "--tp", "1", "--cp", "1", "--pp", "1", "--sharding", "fsdp", "--batch-size", "1",
            "--activation-checkpointing", "none"]
LAYOUT_C = ["--model", "llama3.2-1b", "--gpus", "16", "--global-batch-tokens", "256Ki",
            "--tp", "1", "--cp", "1", "--pp", "1", "--sharding", "ddp", "--batch-size", "2",
            "--activation-checkpointing", "none", "--overlap", "off"]


def test_fsdp_gathers_every_micro_batch_and_ddp_reduces_once_per_bucket():
    s, seqs = 8192, 32                      # 256Ki tokens: 32 sequences of 8192 over DP 16
    rate = PEAK * MFU
    # 16 ranks = 2 nodes of 8: 15 ring steps, 1 of them across the network, at 8 x 50 GB/s of
    # NICs (less than NVLink's 450).
    r = run_python(SCRIPT, *LAYOUT_B, "--json-out", f"{OUT}/layout_b.json", timeout=60)
    got = read_json(REPO / OUT / "layout_b.json")["chosen"]
    m = seqs // 16                          # 2 micro-batches of 1 sequence
    compute_mb = s * (6 * N_8B + 12 * L * H * s) / rate
    units = L + 1                           # one all-gather per layer, one for embedding + head
    W = 2 * P_8B
    ag = ring(14, 1, 15 / 16 * W / units, 8 * NIC)
    per_mb = units * 3 * ag                 # gather for forward, again for backward, scatter
    assert got["microbatches"] == m and got["terms"]["dp"]["count"] == 3 * units * m
    close(got["terms"]["dp"]["time"], m * per_mb, "FSDP time")
    close(got["terms"]["dp"]["bytes"], m * 3 * 15 / 16 * W, "FSDP bytes")
    close(got["terms"]["dp"]["exposed"], m * max(0.0, per_mb - compute_mb), "FSDP exposed")
    assert got["terms"]["dp"]["exposed"] == 0.0  # 0.37 s of gathers behind 1.2 s of compute
    close(got["memory"]["gathered"], 2 * 2 * (LAYER_MATRICES + 2 * H), "two gathered layers")
    close(got["memory"]["activations"], L * s * (12 * H + 4 * KV + 6 * F), "activations")
    close(got["step"], m * compute_mb + 28 * P_8B / 16 / HBM_BW, "FSDP step")
    assert_printed(printed(r.stdout, "DP fsdp over 16 ranks")[-4:],
                   [3 * units * m, m * 3 * 15 / 16 * W / 1e9, m * per_mb * 1e3, 0.0],
                   [0, 2, 1, 1], "FSDP row")

    # Llama 3.2 1B (tied): 16 layers, h 2048, ffn 8192, 32 heads / 8 KV heads of 64.
    p_1b = 16 * (2 * 2048**2 + 2 * 2048 * 512 + 3 * 2048 * 8192 + 2 * 2048) + 128256 * 2048 + 2048
    r = run_python(SCRIPT, *LAYOUT_C, "--json-out", f"{OUT}/layout_c.json", timeout=60)
    out = read_json(REPO / OUT / "layout_c.json")
    got = out["chosen"]
    assert out["parameters"] == p_1b == 1_235_814_400 and out["flops_n"] == p_1b
    W = 2 * p_1b
    buckets = math.ceil(W / (25 * 2**20))   # 25 MiB buckets: 95
    assert buckets == 95 and got["terms"]["dp"]["count"] == buckets
    one = ring(28, 2, 2 * 15 / 16 * W / buckets, 8 * NIC)  # all-reduce: 2 (g-1) steps
    close(got["terms"]["dp"]["time"], buckets * one, "DDP time")
    assert got["terms"]["dp"]["exposed"] == got["terms"]["dp"]["time"]  # --overlap off
    compute = s * 2 * (6 * p_1b + 12 * 16 * 2048 * s) / rate              # 1 micro-batch of 2
    close(got["step"], compute + buckets * one + 28 * p_1b / HBM_BW, "DDP step")
    close(got["memory"]["total"], 16 * p_1b + 16 * 2 * s * (12 * 2048 + 4 * 512 + 6 * 8192)
          + 2 * s * 128256 * 6, "DDP memory")
    assert_printed(printed(r.stdout, "step")[:1], [got["step"] * 1e3], [1], "DDP step")


# --------------------------------------------------------------------------------------------------
# The walkthrough: its commands, each run once here; the forced case checked in its JSON.

LLAMA_1B = "python 05-advanced/cost_model.py --model llama3.2-1b"
LLAMA_8B = "python 05-advanced/cost_model.py --model llama3.1-8b"
LLAMA_70B = ("python 05-advanced/cost_model.py --model llama3.1-70b "
             "--json-out runs/cost_model/70b.json")
LLAMA_70B_DDP = "python 05-advanced/cost_model.py --model llama3.1-70b --tp 1 --pp 1 --sharding ddp"
TITAN_70B = ("python 05-advanced/cost_model.py --model llama3.1-70b --gpu a100-sxm-80gb "
             "--global-batch-tokens 512Ki --tp 8 --dp 8 --sharding fsdp --batch-size 8 "
             "--activation-checkpointing full")
LLAMA3_405B = ("python 05-advanced/cost_model.py --model llama3.1-405b --gpus 8192 "
               "--network roce-400 --global-batch-tokens 16Mi")
LLAMA3_405B_PAPER = ("python 05-advanced/cost_model.py --model llama3.1-405b --gpus 8192 "
                     "--network roce-400 --global-batch-tokens 16Mi --tp 8 --pp 16 --dp 64 "
                     "--activation-checkpointing none")
LLAMA3_405B_NO_OVERLAP = ("python 05-advanced/cost_model.py --model llama3.1-405b --gpus 8192 "
                          "--network roce-400 --global-batch-tokens 16Mi --overlap off")
LLAMA3_405B_LONG = ("python 05-advanced/cost_model.py --model llama3.1-405b --gpus 16384 "
                    "--network roce-400 --global-batch-tokens 16Mi --seq-len 131072")
BAD_TP = "python 05-advanced/cost_model.py --model llama3.1-8b --tp 3  # exits 2"
# LLAMA_70B runs in the test below, which also reads its JSON.
WALKTHROUGH = [LLAMA_1B, LLAMA_8B, LLAMA_70B_DDP, TITAN_70B, LLAMA3_405B, LLAMA3_405B_PAPER,
               LLAMA3_405B_NO_OVERLAP, LLAMA3_405B_LONG, BAD_TP]


@pytest.mark.parametrize("command", WALKTHROUGH, ids=lambda c: c[len("python 05-advanced/"):60])
def test_the_walkthrough_commands_reproduce_their_quoted_output(command):
    run_documented(DOC, command, timeout=120)  # BAD_TP: exit status 2 and its quoted line


def test_70b_cannot_train_with_data_parallelism_alone_on_80_gb():
    """The walkthrough's 70B run: 16 bytes per parameter of weights, gradients and Adam is 1.13 TB
    on every GPU under DDP, more than 80 GB by far; every layout without sharding or model
    parallelism is out, and the recommendation shards or splits."""
    run_documented(DOC, LLAMA_70B, "runs/cost_model/70b.json")
    out = read_json(REPO / "runs/cost_model/70b.json")
    assert out["parameters"] == 70_553_706_496
    plain = [r for r in out["layouts"]
             if r["layout"]["tp"] * r["layout"]["cp"] * r["layout"]["pp"] == 1
             and r["layout"]["sharding"] == "ddp"]
    assert plain and not any(r["fits"] for r in plain)
    assert all(r["memory"] >= 16 * out["parameters"] for r in plain)
    lay = out["chosen"]["layout"]
    assert out["chosen"]["fits"] and (lay["sharding"] != "ddp" or lay["tp"] * lay["pp"] > 1)
    fastest = min(r["step"] for r in out["layouts"] if r["fits"])
    assert out["chosen"]["step"] <= fastest * 1.01  # within the model's 1% tie


# --------------------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize("args,pattern", [
    (["--gpu", "v100"], r"argument --gpu: invalid choice: 'v100'"),
    (["--pp", "3"], r"--pp 3 = 3 does not divide --gpus 64"),
    (["--tp", "8", "--pp", "2", "--dp", "8"], r"--tp 8 x --pp 2 x --dp 8 = 128 does not divide"),
    (["--tp", "8", "--cp", "1", "--pp", "2", "--dp", "2"], r"= 32, not --gpus 64"),
    (["--global-batch-tokens", "1000"], r"not a whole number of sequences of --seq-len 8192"),
    (["--gpus", "12"], r"--gpus 12 is not a whole number of nodes"),
    (["--batch-size", "3"], r"no layout of 64 GPUs has --batch-size 3"),
    (["--mfu", "1.5"], r"--mfu is a fraction"),
])
def test_bad_input_exits_2_with_one_line(args, pattern):
    assert_bad_input(run_python(SCRIPT, *args, check=False, timeout=60), pattern)


def test_help():
    r = run_python(SCRIPT, "--help", timeout=60)
    assert "--virtual-stages" in r.stdout and "alpha-beta" in r.stdout

r"""Which layout should I train with? A cost model: for a Llama-shaped model on a GPU cluster, the
time of one training step and the memory of one GPU under every split into tensor (TP), context
(CP), pipeline (PP) and data parallelism (DDP, ZeRO-1 or FSDP), each collective costed with the
alpha-beta model; then the fastest layout that fits, with the comparisons that make it so.

Launch (from the repository root; plain arithmetic: no torch, no GPU, under a second):
    python 05-advanced/cost_model.py --model llama3.1-8b                 # 64 x H100, InfiniBand
    python 05-advanced/cost_model.py --model llama3.1-70b --gpus 256 --json-out runs/cost.json
    python 05-advanced/cost_model.py --model llama3.1-70b --tp 8 --sharding fsdp   # constrained
    python 05-advanced/cost_model.py --model llama3.1-405b --gpus 8192 --network roce-400 \
        --global-batch-tokens 16Mi --overlap off

A flag that names part of a layout (--tp --cp --pp --virtual-stages --dp --sharding --batch-size
--activation-checkpointing) restricts the search to layouts with that value, and the
unconstrained best is printed beside the result. The walkthrough, with its outputs checked against
the layouts of published training runs, is 05-advanced/cost_model.md.

The model of one step (s = sequence length, b = sequences per micro-batch, m = micro-batches per
data-parallel rank, t/c/p/d = TP/CP/PP/DP degrees; ranks laid out TP innermost, then CP, PP, DP,
the order of Llama 3):
    compute  FLOPs per token 6N + 12*L*h*s (the course's MFU formula) at peak x --mfu; full
             activation checkpointing adds a forward (x 4/3)
    TP       4 all-reduces of (b, s/c, h) per layer and micro-batch (6 when the forward is
             recomputed), inside a node, never hidden
    PP       2 sends of (b, s/c, h/t) per micro-batch and chunk; the bubble (p-1)/(v m + p-1)
             (v = 1: 1F1B; v > 1: interleaved 1F1B) is lost time
    CP       K,V chunks all-gathered round the ring forward and again backward, dK,dV
             reduce-scattered, per layer and micro-batch: hidden behind attention (--overlap on)
    DP       over the d x c ranks that hold the same weights: DDP all-reduces bf16 gradients
             once per step, 2(g-1)/g of their bytes; ZeRO-1 reduce-scatters them and all-gathers
             the weights (the same bytes); FSDP all-gathers the weights before forward and
             backward and reduce-scatters the gradients, 3(g-1)/g, for every micro-batch (once per
             step with a pipeline): hidden behind compute (--overlap on)
    a collective: t = alpha x ring steps + bytes per GPU / bus bandwidth
    memory   weights, gradients and Adam (16 bytes per parameter, DESIGN section 5, sharded as the
             layout says), activations (12h + 4kv + 6f bytes per token and layer), logits
"""

import json
import math
import os
import re
from pathlib import Path

from dtcourse import cli
from dtcourse.cli import fail

SCRIPT = "05-advanced/cost_model.py"

# --------------------------------------------------------------------------------------------------
# Inputs: models, GPUs, networks (each with its source)

# The Hugging Face config.json of each model (meta-llama/Llama-3.2-1B, Llama-3.1-8B, Llama-3.1-70B,
# Llama-3.1-405B), the same shapes as table 3 of "The Llama 3 Herd of Models" (2024). GQA: K and V
# have kv_heads heads of hidden/heads features. The 1B model ties its output layer to its embedding.
MODELS = {
    "llama3.2-1b": dict(layers=16, hidden=2048, ffn=8192, heads=32, kv_heads=8, vocab=128256,
                        tied=True),
    "llama3.1-8b": dict(layers=32, hidden=4096, ffn=14336, heads=32, kv_heads=8, vocab=128256,
                        tied=False),
    "llama3.1-70b": dict(layers=80, hidden=8192, ffn=28672, heads=64, kv_heads=8, vocab=128256,
                         tied=False),
    "llama3.1-405b": dict(layers=126, hidden=16384, ffn=53248, heads=128, kv_heads=8,
                          vocab=128256, tied=False),
}

# NVIDIA's data sheets (H100, H200, A100 Tensor Core GPU): dense BF16 tensor-core TFLOP/s (the
# sheets print twice this "with sparsity"), HBM in GB and TB/s, NVLink GB/s per GPU one way (the
# sheets print both directions together: 900 GB/s for H100/H200, 600 GB/s for A100).
GPUS = {
    "h100-sxm": dict(name="H100 SXM", tflops=989.0, hbm_gb=80.0, hbm_tbps=3.35, nvlink=450.0),
    "h200-sxm": dict(name="H200 SXM", tflops=989.0, hbm_gb=141.0, hbm_tbps=4.8, nvlink=450.0),
    "a100-sxm-80gb": dict(name="A100 SXM 80GB", tflops=312.0, hbm_gb=80.0, hbm_tbps=2.039,
                          nvlink=300.0),
}

# One NIC's speed, GB/s one way (InfiniBand Trade Association: NDR 4 x 100 Gb/s, HDR 4 x 50 Gb/s;
# IEEE 802.3bs 400 GbE), and the latency of one ring step across the network: 9.6 us, the value
# NCCL's own tuning model gives a network hop of a Ring/Simple collective (hwLat in
# src/graph/tuning.cc). NCCL has one latency for every network, so RoCE gets the same alpha here:
# an assumption (a RoCE fabric's switches add latency that this model does not count).
NETWORKS = {
    "ib-ndr": dict(name="InfiniBand NDR 400 Gb/s", nic=50.0),
    "ib-hdr": dict(name="InfiniBand HDR 200 Gb/s", nic=25.0),
    "roce-400": dict(name="RoCE v2 over 400 GbE", nic=50.0),
}
ALPHA_NVLINK_US = 3.4   # NCCL tuning.cc, hwLat[NVLINK][Ring][Simple]: one ring step inside a node
ALPHA_NET_US = 9.6      # NCCL tuning.cc, hwLat[NET][Ring][Simple]: one ring step across nodes

BF16 = 2                          # bytes of a bf16 activation, weight or gradient element
DDP_BUCKET = 25 * 1024 * 1024  # torch DDP's default bucket_cap_mb = 25 (MiB): one all-reduce each
ADAM_BYTES_PER_PARAM = 28      # the optimizer step reads fp32 master, m, v (12) and the bf16 grad
#                                (2), writes master, m, v (12) and the bf16 weight (2)
SHARDINGS = ("ddp", "zero1", "fsdp")
CHECKPOINTING = ("none", "full")
MAX_MICRO_BATCH = 16  # sequences per micro-batch considered: 1, 2, 4, 8, 16
TIE = 0.01           # step times within 1% of the fastest count as equal
# the layout's keys and the flags that set them
FLAGS = {"tp": "--tp", "cp": "--cp", "pp": "--pp", "v": "--virtual-stages", "dp": "--dp",
         "sharding": "--sharding", "ac": "--activation-checkpointing", "b": "--batch-size"}


def param_counts(m: dict) -> dict:
    """Parameters of the model, of one layer, and N (those that multiply: the input embedding is a
    look-up, so it is left out unless it is tied to the output layer, which does multiply)."""
    h, kv = m["hidden"], m["kv_heads"] * (m["hidden"] // m["heads"])
    matrices = 2 * h * h + 2 * h * kv + 3 * h * m["ffn"]  # q, o: h x h; k, v: h x kv; gate/up/down
    layer = matrices + 2 * h                                 # + two RMSNorm weights
    embedding = m["vocab"] * h
    total = m["layers"] * layer + embedding * (1 if m["tied"] else 2) + h  # + the final norm
    return {"total": total, "layer": layer, "layer_matrices": matrices, "kv": kv,
            "embedding": embedding, "flops_n": total if m["tied"] else total - embedding}


# --------------------------------------------------------------------------------------------------
# One collective, alpha-beta


def spread(group: list, gpus_per_node: int) -> tuple:
    """(members per node, nodes) of a process group given as [(size, stride), ...] in ranks laid
    out TP, CP, PP, DP from the innermost: a dimension of stride >= the node size has one member
    per node, a smaller stride packs ceil(node / stride) of its members into each node."""
    size = math.prod(n for n, _ in group)
    per_node = math.prod(min(n, math.ceil(gpus_per_node / s)) if s < gpus_per_node else 1
                         for n, s in group)
    return per_node, size // per_node


def collective(kind: str, group: list, payload: float, cl: dict) -> dict:
    """Time of one ring collective (NCCL's algorithm for large messages) of `payload` bytes (the
    whole tensor: the all-reduced one, or the all-gathered result) over `group`.
    Bytes each GPU sends: all-reduce 2(g-1)/g x payload, all-gather and reduce-scatter
    (g-1)/g x payload (nccl-tests' busbw factors). Steps: 2(g-1) and g-1; the steps that cross a
    node boundary, 2(nodes-1) and nodes-1, cost the network's alpha, the others NVLink's (NCCL's
    latency model, tuning.cc). Bus bandwidth: NVLink inside a node; across nodes the group's
    members in one node share that node's NICs with the other groups doing the same at the same
    time, so g_node members get g_node x (NIC bandwidth per GPU), at most NVLink's."""
    per_node, nodes = spread(group, cl["gpus_per_node"])
    g = per_node * nodes
    if g == 1:
        return {"bytes": 0.0, "steps": 0, "time": 0.0}
    factor, steps, inter = {"all_reduce": (2 * (g - 1) / g, 2 * (g - 1), 2 * (nodes - 1)),
                            "all_gather": ((g - 1) / g, g - 1, nodes - 1),
                            "reduce_scatter": ((g - 1) / g, g - 1, nodes - 1)}[kind]
    busbw = cl["nvlink"] if nodes == 1 else min(cl["nvlink"], per_node * cl["net_per_gpu"])
    sent = factor * payload
    alpha = (steps - inter) * cl["alpha_nvlink"] + inter * cl["alpha_net"]
    return {"bytes": sent, "steps": steps, "time": alpha + sent / (busbw * cl["efficiency"])}


def send(group: list, payload: float, cl: dict) -> dict:
    """One point-to-point send to the neighbour in `group` (a pipeline boundary): one step, the
    whole payload, over NVLink when the group sits in one node, else over this GPU's NIC share."""
    _, nodes = spread(group, cl["gpus_per_node"])
    bw, alpha = (cl["nvlink"], cl["alpha_nvlink"]) if nodes == 1 else \
        (min(cl["nvlink"], cl["net_per_gpu"]), cl["alpha_net"])
    return {"bytes": payload, "steps": 1, "time": alpha + payload / (bw * cl["efficiency"])}


# --------------------------------------------------------------------------------------------------
# One layout: its step time and its memory per GPU


def evaluate(lay: dict, mdl: dict, cl: dict, run: dict) -> dict:
    """Every term of one layout. lay: tp cp pp v dp sharding ac b; run: seq, sequences, mfu,
    overlap. Times in seconds, bytes per GPU."""
    t, c, p, d, b, v = lay["tp"], lay["cp"], lay["pp"], lay["dp"], lay["b"], lay["v"]
    L, h, f, V, s = mdl["layers"], mdl["hidden"], mdl["ffn"], mdl["vocab"], run["seq"]
    pc = mdl["counts"]
    m = run["sequences"] // (d * b)               # micro-batches per step, per DP rank
    tokens = b * s // c                           # tokens of one micro-batch on one GPU (CP chunk)
    # The layers of the busiest rank (it sets the pace and the memory): with interleaving, v
    # chunks of L/(p v) layers each.
    stage_layers = v * math.ceil(L / (p * v))
    recompute = lay["ac"] == "full"
    rate = cl["tflops"] * 1e12 * run["mfu"]       # FLOP/s one GPU achieves

    # Compute of one micro-batch on one GPU: its stage's share of the layers, its 1/t of every
    # matrix and its 1/c of the tokens. Backward is twice forward; recomputing adds a forward.
    flops = b * s * run["flops_per_token"] * stage_layers / L / (t * c)
    fwd, bwd = flops / 3 / rate, (2 * flops / 3 + (flops / 3 if recompute else 0)) / rate
    attention = b * s * 12 * stage_layers * h * s / (t * c) * (4 / 3 if recompute else 1) / rate

    tp_group, cp_group = [(t, 1)], [(c, t)]
    pp_group, dp_group = [(p, t * c)], [(c, t), (d, t * c * p)]
    terms = {}
    # TP: per layer, 2 all-reduces forward (after attention and after the MLP) and 2 backward
    # (their conjugates), each of the whole (b, s/c, h) activation; the recomputed forward repeats
    # its 2. Sequence parallelism turns each into a reduce-scatter + all-gather: the same bytes.
    per_layer = 4 + (2 if recompute else 0)
    ar = collective("all_reduce", tp_group, tokens * h * BF16, cl)
    n = per_layer * stage_layers if t > 1 else 0
    terms["tp"] = {"count": n * m, "bytes": n * m * ar["bytes"], "mb": n * ar["time"]}
    terms["tp"]["exposed_mb"] = terms["tp"]["mb"]  # on the critical path of every layer
    # CP: each rank's K and V chunk (kv/t features each, bf16) visits the c-1 other ranks:
    # an all-gather's bytes and steps, in forward and again in backward (plus once in a recomputed
    # forward), and the gradients dK, dV come back: a reduce-scatter. Overlapped with attention.
    kv_chunk = c * tokens * 2 * pc["kv"] / t * BF16  # K and V of the whole sequence, this TP rank
    ag = collective("all_gather", cp_group, kv_chunk, cl)
    rs = collective("reduce_scatter", cp_group, kv_chunk, cl)
    gathers = 2 + (1 if recompute else 0)
    cp_mb = stage_layers * (gathers * ag["time"] + rs["time"])
    terms["cp"] = {"count": stage_layers * (gathers + 1) * m if c > 1 else 0,
                   "bytes": stage_layers * (gathers * ag["bytes"] + rs["bytes"]) * m, "mb": cp_mb,
                   "exposed_mb": max(0.0, cp_mb - attention) if run["overlap"] else cp_mb}
    # PP: each of a rank's v chunks sends its micro-batch's activations forward and its input's
    # gradient back: 2v sends per micro-batch of (b, s/c, h) split over the TP ranks (each sends
    # its 1/t, as with sequence parallelism). Not overlapped.
    if p > 1:
        pp = send(pp_group, tokens * h * BF16 / t, cl)
        terms["pp"] = {"count": 2 * v * m, "bytes": 2 * v * m * pp["bytes"],
                       "mb": 2 * v * pp["time"]}
    else:
        terms["pp"] = {"count": 0, "bytes": 0.0, "mb": 0.0}
    terms["pp"]["exposed_mb"] = terms["pp"]["mb"]

    stage_mb = fwd + bwd + terms["tp"]["exposed_mb"] + terms["cp"]["exposed_mb"] \
        + terms["pp"]["exposed_mb"]
    # 1F1B: m micro-batches and p-1 slots of fill and drain; interleaved 1F1B: slots 1/v as long
    # (Narayanan et al. 2021, section 2.2.2): bubble (p-1)/(v m + p-1) of the pipeline's time.
    bubble = (p - 1) / v * stage_mb
    pipeline = m * stage_mb + bubble

    # Parameters this GPU holds before data-parallel sharding: the largest stage's layers, 1/t of
    # each matrix (norms replicated), the embedding or the output layer split over the vocabulary,
    # and the final norm; one stage holds them all when p = 1.
    layer_tp = pc["layer_matrices"] / t + 2 * h
    heads = 1 if (p > 1 or mdl["tied"]) else 2
    params = stage_layers * layer_tp + heads * pc["embedding"] / t + h
    g = d * c                                     # ranks that hold the same weights
    W = params * BF16                             # bf16 gradients (or weights) of this GPU
    sh = lay["sharding"] if g > 1 else "ddp"
    if sh == "ddp":
        # One all-reduce per 25 MiB bucket, on the last micro-batch (no_sync before it), started
        # as its buckets fill during that micro-batch's backward.
        buckets = math.ceil(W / DDP_BUCKET)
        one = collective("all_reduce", dp_group, W / buckets, cl)
        dp = {"count": buckets, "bytes": buckets * one["bytes"], "time": buckets * one["time"]}
        window = bwd
    elif sh == "zero1" or p > 1:
        # ZeRO-1: reduce-scatter the gradients (behind the last backward), all-gather the updated
        # weights (behind the next forward). FSDP with a pipeline: torch.distributed.pipelining
        # keeps the stage's weights and gradients unsharded from the first micro-batch to the last
        # (stage.py: set_reshard_after_backward / set_requires_gradient_sync False), so it also
        # gathers once and reduce-scatters once per step.
        buckets = math.ceil(W / DDP_BUCKET) if sh == "zero1" else stage_layers + 1
        a = collective("all_gather", dp_group, W / buckets, cl)
        r = collective("reduce_scatter", dp_group, W / buckets, cl)
        dp = {"count": 2 * buckets, "bytes": buckets * (a["bytes"] + r["bytes"]),
              "time": buckets * (a["time"] + r["time"])}
        window = fwd + bwd
    else:
        # FSDP without a pipeline: for every micro-batch, one all-gather per layer (and one for
        # the embedding and output layer) before forward, again before backward, and one
        # reduce-scatter of the gradients, each prefetched behind the previous layer's compute.
        units = stage_layers + 1
        a = collective("all_gather", dp_group, W / units, cl)
        r = collective("reduce_scatter", dp_group, W / units, cl)
        per_mb = units * (2 * a["time"] + r["time"])
        dp = {"count": 3 * units * m, "bytes": units * (2 * a["bytes"] + r["bytes"]) * m,
              "time": m * per_mb}
        window = None
    if not run["overlap"]:
        dp["exposed"] = dp["time"]
    elif window is None:
        dp["exposed"] = m * max(0.0, per_mb - (fwd + bwd))
    else:
        dp["exposed"] = max(0.0, dp["time"] - window)
    terms["dp"] = dp

    # The optimizer step reads and writes every byte of Adam's state: bound by HBM bandwidth.
    opt_params = params if sh == "ddp" else params / g
    optimizer = ADAM_BYTES_PER_PARAM * opt_params / (cl["hbm_tbps"] * 1e12)
    step = pipeline + dp["exposed"] + optimizer

    # Memory (bytes per GPU). Model states, mixed precision with Adam (DESIGN section 5): bf16
    # weights 2 + bf16 gradients 2 + fp32 master and moments 12 = 16 per parameter; ZeRO-1 shards
    # the 12, FSDP all 16 (plus, with a pipeline, the unsharded bf16 weights and gradients it
    # keeps through the step; without, the two layers it holds gathered: the current and the
    # prefetched one).
    if sh == "ddp":
        states = {"weights": 2 * params, "grads": 2 * params, "optimizer": 12 * params}
        transient = 0.0
    elif sh == "zero1":
        states = {"weights": 2 * params, "grads": 2 * params, "optimizer": 12 * params / g}
        transient = 0.0
    else:
        states = {"weights": 2 * params / g, "grads": 2 * params / g, "optimizer": 12 * params / g}
        transient = 4 * params if p > 1 else 2 * layer_tp * BF16
    # Activations kept for backward, per token and layer, bf16, split over TP with sequence
    # parallelism: the inputs of the two norms (h each), of q/k/v and of the MLP (h each), q (h),
    # k and v (kv each), the attention output (h; FlashAttention keeps no score matrix) and the
    # MLP's gate, up and their product (f each): 12h + 4kv + 6f bytes. 1F1B keeps min(p, m)
    # micro-batches in flight on the first stage. Interleaved, the first rank runs
    # 2(p-1) + (v-1)p warm-up chunk forwards (Megatron-LM, pipeline_parallel/schedules.py) and
    # holds one more: chunks of L/(p v) layers, 1 + (p-1)/(p v) times 1F1B's p stages of L/p
    # (05b counts 11 chunks held at p = 4, v = 2). Full checkpointing keeps only each layer's
    # input (2h bytes) and rebuilds one layer at a time.
    per_token_layer = (12 * h + 4 * pc["kv"] + 6 * f) / t
    in_flight = min(p, m) * (1 + (p - 1) / (p * v) if v > 1 else 1)
    if recompute:
        acts = stage_layers * tokens * 2 * h / t * in_flight + tokens * per_token_layer
    else:
        acts = stage_layers * tokens * per_token_layer * in_flight
    logits = tokens * V / t * (BF16 + 4)  # the last stage's bf16 logits and fp32 loss input
    memory = {**states, "gathered": transient, "activations": acts, "logits": logits}
    memory["total"] = sum(memory.values())
    return {"layout": dict(lay, dp=d, sharding=sh), "microbatches": m, "params_per_gpu": params,
            "dp_group": g, "compute_mb": fwd + bwd, "attention_mb": attention,
            "compute": m * (fwd + bwd), "stage_mb": stage_mb, "pipeline": pipeline,
            "bubble": bubble, "bubble_fraction": (p - 1) / (v * m + p - 1), "terms": terms,
            "optimizer": optimizer, "step": step, "memory": memory,
            "fits": memory["total"] <= cl["usable_bytes"]}


# --------------------------------------------------------------------------------------------------
# The search: every layout, the fastest that fits


def powers_of_two(limit: int) -> list:
    return [1 << i for i in range(limit.bit_length()) if (1 << i) <= limit]


def candidates(mdl: dict, cl: dict, run: dict) -> list:
    """Every layout of the cluster's GPUs: TP inside a node (a power of two dividing the heads and
    KV heads), CP chunks of at least --min-cp-chunk tokens (the sequence cut into 2c pieces for a
    balanced causal ring), PP up to one layer per stage, interleaved with v chunks per rank when
    p divides m (Megatron-LM's condition), DP the rest (dividing the step's sequences),
    micro-batches of b sequences, each sharding and checkpointing."""
    n, L, out = cl["gpus"], mdl["layers"], []
    tps = [t for t in powers_of_two(cl["gpus_per_node"])
           if mdl["heads"] % t == 0 and mdl["kv_heads"] % t == 0 and n % t == 0]
    for t in tps:
        cps = [c for c in powers_of_two(n // t) if c == 1 or (
            run["seq"] % (2 * c) == 0 and run["seq"] // c >= run["min_cp_chunk"])]
        for c in cps:
            for p in [p for p in range(1, L + 1) if (n // (t * c)) % p == 0]:
                d = n // (t * c * p)
                if run["sequences"] % d:
                    continue
                per_rank = run["sequences"] // d
                for b in [b for b in powers_of_two(min(per_rank, MAX_MICRO_BATCH))
                          if per_rank % b == 0]:
                    m = per_rank // b
                    vs = [1] + [v for v in powers_of_two(L // p)[1:] if p > 1 and m % p == 0]
                    for v in vs:
                        for sh in SHARDINGS if d * c > 1 else ("ddp",):
                            for ac in CHECKPOINTING:
                                out.append({"tp": t, "cp": c, "pp": p, "v": v, "dp": d,
                                            "sharding": sh, "ac": ac, "b": b})
    return out


def traffic_time(r: dict) -> float:
    """Seconds of communication per step, hidden or not."""
    T = r["terms"]
    return r["microbatches"] * (T["tp"]["mb"] + T["cp"]["mb"] + T["pp"]["mb"]) + T["dp"]["time"]


def best(results: list, **where):
    """The recommended layout among those with the given values: of the layouts that fit, those
    within TIE of the fastest count as equally fast (the model is not more precise than that), and
    of those the simplest wins: the fewest GPUs per model replica (tp x cp x pp), then the least
    communication (the less a layout relies on overlap, the less a wrong overlap assumption
    costs), then the least memory. If none fits: the one that needs the least memory."""
    rows = [r for r in results if all(r["layout"][k] == v for k, v in where.items())]
    fitting = [r for r in rows if r["fits"]]
    if not fitting:
        return min(rows, key=lambda r: r["memory"]["total"]) if rows else None
    fastest = min(r["step"] for r in fitting)
    near = [r for r in fitting if r["step"] <= fastest * (1 + TIE)]
    return min(near, key=lambda r: (r["layout"]["tp"] * r["layout"]["cp"] * r["layout"]["pp"],
                                    round(traffic_time(r), 9), r["memory"]["total"]))


# --------------------------------------------------------------------------------------------------
# Report


def describe(lay: dict, m: int) -> str:
    ac = "full activation checkpointing" if lay["ac"] == "full" else "no activation checkpointing"
    pp = f"pp {lay['pp']}" + (f" (interleaved, v {lay['v']})" if lay["v"] > 1 else "")
    return (f"tp {lay['tp']} x cp {lay['cp']} x {pp} x dp {lay['dp']}, "
            f"{lay['sharding']}, batch-size {lay['b']} ({m} micro-batch{'es' if m > 1 else ''}), "
            f"{ac}")


def table(r: dict, cl: dict) -> list:
    """The step of one layout, term by term, and its memory."""
    ms, gb = 1e3, 1e9
    lay, m, T = r["layout"], r["microbatches"], r["terms"]
    p = lay["pp"]
    v = f"{lay['v']}*" if lay["v"] > 1 else ""
    bubble = f"pipeline bubble ({p}-1)/({v}{m}+{p}-1) = {r['bubble_fraction']:.3f}"
    lines = [f"{'per GPU and step':38}{'count':>9}{'GB sent':>10}{'time (ms)':>12}"
             f"{'exposed (ms)':>14}",
             f"{'compute, micro-batches (fwd + bwd)':38}{m:>9}{'-':>10}{r['compute'] * ms:>12.1f}"
             f"{r['compute'] * ms:>14.1f}",
             f"{bubble:38}"
             f"{'-':>9}{'-':>10}{r['bubble'] * ms:>12.1f}{r['bubble'] * ms:>14.1f}"]
    names = {"tp": "TP all-reduce (b, s/c, h)", "cp": "CP ring K,V and dK,dV",
             "pp": "PP send activations / gradients"}
    for key, label in names.items():
        # exposed per step: every micro-batch's exposed part (the bubble row holds the p-1 idle
        # slots, communication included)
        exposed = m * T[key]["exposed_mb"]
        lines.append(f"{label:38}{T[key]['count']:>9}{T[key]['bytes'] / gb:>10.2f}"
                     f"{m * T[key]['mb'] * ms:>12.1f}{exposed * ms:>14.1f}")
    dp = T["dp"]
    lines.append(f"{'DP ' + lay['sharding'] + ' over ' + str(r['dp_group']) + ' ranks':38}"
                 f"{dp['count']:>9}{dp['bytes'] / gb:>10.2f}{dp['time'] * ms:>12.1f}"
                 f"{dp['exposed'] * ms:>14.1f}")
    lines.append(f"{'optimizer step (HBM-bound)':38}{'-':>9}{'-':>10}{r['optimizer'] * ms:>12.1f}"
                 f"{r['optimizer'] * ms:>14.1f}")
    mfu = cl["step_flops"] / (cl["gpus"] * cl["tflops"] * 1e12 * r["step"])
    per_gpu = cl["step_tokens"] / r["step"] / cl["gpus"]
    lines.append(f"{'step':38}{'':9}{'':10}{'':12}{r['step'] * ms:>14.1f}"
                 f"   MFU {mfu:.3f}, {per_gpu:,.0f} tokens/s per GPU")
    mem = r["memory"]
    parts = " + ".join(f"{k} {mem[k] / gb:.2f}" for k in
                       ("weights", "grads", "optimizer", "gathered", "activations", "logits"))
    verdict = "fits" if r["fits"] else "DOES NOT FIT"
    lines.append(f"memory per GPU (GB): {parts} = {mem['total'] / gb:.2f} of "
                 f"{cl['usable_bytes'] / gb:.1f} usable: {verdict}")
    return lines


def why(results: list, chosen: dict) -> list:
    """For each choice, the best layout that fits with every other value of it: the comparisons
    that make the recommendation the best one."""
    base = chosen["step"]
    lines = ["why: the best layout that fits for each value of each choice, step in ms "
             "(+% over the recommended)"]
    for key, label in (("tp", "tp"), ("cp", "cp"), ("pp", "pp"), ("v", "virtual-stages"),
                       ("sharding", "sharding"),
                       ("ac", "checkpointing"), ("b", "batch-size")):
        values = sorted({r["layout"][key] for r in results}, key=lambda v: (str(type(v)), v))
        cells = []
        for v in values:
            r = best(results, **{key: v})
            if not r["fits"]:
                cells.append(f"{v}: no fit (least {r['memory']['total'] / 1e9:.1f} GB)")
            elif r is chosen:
                cells.append(f"{v}: {r['step'] * 1e3:.1f}")
            else:
                cells.append(f"{v}: {r['step'] * 1e3:.1f} ({(r['step'] / base - 1) * 100:+.1f}%)")
        lines.append(f"  {label:16}" + " | ".join(cells))
    return lines


def header(args, mdl: dict, cl: dict, run: dict) -> list:
    pc = mdl["counts"]
    gpu, net = GPUS[args.gpu], NETWORKS[args.network]
    nodes = cl["gpus"] // cl["gpus_per_node"]
    tied = "tied" if mdl["tied"] else "untied"
    return [
        f"cost model | {args.model} on {cl['gpus']} x {args.gpu} ({nodes} node"
        f"{'s' if nodes > 1 else ''} of {cl['gpus_per_node']}, {args.network}) | "
        f"{run['sequences']} sequences x {run['seq']} = {run['sequences'] * run['seq']:,} tokens "
        f"per step | MFU {run['mfu']:.2f} | overlap {'on' if run['overlap'] else 'off'}",
        f"model    {pc['total']:,} parameters: {mdl['layers']} layers, h {mdl['hidden']}, "
        f"ffn {mdl['ffn']}, {mdl['heads']} heads, {mdl['kv_heads']} KV heads, vocab "
        f"{mdl['vocab']}, {tied} embedding",
        f"flops    6N + 12*L*h*s = 6 x {pc['flops_n']:,} + 12 x {mdl['layers']} x {mdl['hidden']}"
        f" x {run['seq']} = {run['flops_per_token']:,} per token",
        f"gpu      {gpu['name']}: {gpu['tflops']:g} dense bf16 TFLOP/s x {run['mfu']:.2f} | HBM "
        f"{gpu['hbm_gb']:g} GB ({args.usable_memory:.0%} usable), {gpu['hbm_tbps']:g} TB/s | "
        f"NVLink {gpu['nvlink']:g} GB/s each way",
        f"network  {net['name']}: {args.nics_per_node} NICs per node = "
        f"{cl['net_per_gpu'] / 1e9:g} GB/s per GPU each way | links at {cl['efficiency']:.0%} of "
        f"spec | alpha per ring step: NVLink {cl['alpha_nvlink'] * 1e6:g} us, network "
        f"{cl['alpha_net'] * 1e6:g} us",
        "overlap  " + ("on: DP/FSDP traffic hidden behind compute, CP behind attention, up to "
                       "their length; TP, PP and the optimizer step exposed" if run["overlap"]
                       else "off: every collective and send adds to the step"),
    ]


# --------------------------------------------------------------------------------------------------
# Command line


def parse_tokens(text: str) -> int:
    """4194304, 4Mi (= 4 x 2^20) or 512Ki."""
    m = re.fullmatch(r"\s*(\d+)\s*(Ki|Mi|Gi)?\s*", text)
    if not m:
        fail(f"--global-batch-tokens {text!r}: give a whole number of tokens, e.g. 4194304 or 4Mi")
    return int(m.group(1)) * {None: 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30}[m.group(2)]


def parse_args(argv=None):
    p = cli.parser(__doc__)
    p.add_argument("--model", choices=list(MODELS), default="llama3.1-8b")
    p.add_argument("--gpu", choices=list(GPUS), default="h100-sxm")
    p.add_argument("--gpus", type=int, default=64, help="GPUs in the job")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs joined by NVLink")
    p.add_argument("--network", choices=list(NETWORKS), default="ib-ndr",
                   help="the network between nodes")
    p.add_argument("--nics-per-node", type=int, default=8, help="NICs of that network per node "
                   "(8: one per GPU, as in NVIDIA's DGX H100)")
    p.add_argument("--seq-len", type=int, default=8192, help="tokens per sequence")
    p.add_argument("--global-batch-tokens", default="4Mi",
                   help="tokens per optimizer step (4194304, 4Mi, 512Ki)")
    p.add_argument("--mfu", type=float, default=0.40, help="fraction of the GPU's dense bf16 "
                   "peak that its compute achieves (Llama 3 reports 38-43%% on H100)")
    p.add_argument("--overlap", choices=["on", "off"], default="on",
                   help="on: DP/FSDP traffic hides behind compute (backward, or forward too), CP "
                        "behind attention; TP and PP never do. off: every byte is exposed")
    p.add_argument("--link-efficiency", type=float, default=0.8, help="fraction of each link's "
                   "spec bandwidth that collectives reach (lesson 04, section 5: about 80%%)")
    p.add_argument("--usable-memory", type=float, default=0.9, help="fraction of HBM a layout may "
                   "fill (the rest: CUDA context, NCCL buffers, allocator fragmentation)")
    p.add_argument("--min-cp-chunk", type=int, default=8192, help="the fewest tokens per GPU a "
                   "context-parallel layout may leave (published CP runs keep 8192 or more: the "
                   "fixed MFU of this model would not hold for small attention blocks)")
    p.add_argument("--tp", type=int, help="only layouts with this tensor-parallel degree")
    p.add_argument("--cp", type=int, help="only layouts with this context-parallel degree")
    p.add_argument("--pp", type=int, help="only layouts with this many pipeline stages")
    p.add_argument("--virtual-stages", type=int, help="only layouts with this many pipeline "
                   "chunks per rank (1: plain 1F1B; v > 1: interleaved 1F1B)")
    p.add_argument("--dp", type=int, help="only layouts with this data-parallel degree")
    p.add_argument("--sharding", choices=SHARDINGS, help="only layouts with this data parallelism")
    p.add_argument("--activation-checkpointing", choices=CHECKPOINTING,
                   help="only layouts with (full) or without (none) activation checkpointing")
    p.add_argument("--batch-size", type=int, help="only layouts with this many sequences per "
                   "data-parallel rank per micro-step")
    p.add_argument("--json-out", type=Path, help="write the inputs, the recommended layout's "
                   "terms and every layout's step time and memory here as JSON")
    args = p.parse_args(argv)
    check(args)
    return args


def check(args) -> None:
    """Bad input ends here, with one line naming the numbers involved."""
    cli.check_positive(args, "gpus", "gpus_per_node", "nics_per_node", "seq_len", "mfu",
                       "link_efficiency", "usable_memory", "min_cp_chunk", "tp", "cp", "pp",
                       "virtual_stages", "dp", "batch_size")
    for name in ("mfu", "link_efficiency", "usable_memory"):
        if getattr(args, name) > 1:
            fail(f"--{name.replace('_', '-')} is a fraction (at most 1), got {getattr(args, name)}")
    if args.gpus > args.gpus_per_node and args.gpus % args.gpus_per_node:
        fail(f"--gpus {args.gpus} is not a whole number of nodes of --gpus-per-node "
             f"{args.gpus_per_node}")
    args.tokens = parse_tokens(args.global_batch_tokens)
    if args.tokens % args.seq_len:
        fail(f"--global-batch-tokens {args.tokens} is not a whole number of sequences of "
             f"--seq-len {args.seq_len}")
    mdl, node = MODELS[args.model], min(args.gpus, args.gpus_per_node)
    if args.tp is not None:
        if node % args.tp:
            fail(f"--tp {args.tp} must divide the {node} GPUs of a node: TP stays on NVLink")
        if mdl["heads"] % args.tp or mdl["kv_heads"] % args.tp:
            fail(f"--tp {args.tp} must divide {args.model}'s {mdl['heads']} heads and "
                 f"{mdl['kv_heads']} KV heads")
    if args.cp is not None and args.seq_len % (2 * args.cp):
        fail(f"--cp {args.cp}: --seq-len {args.seq_len} must split into 2 x {args.cp} equal "
             "chunks (a balanced causal ring)")
    if args.pp is not None and args.pp > mdl["layers"]:
        fail(f"--pp {args.pp} is more stages than {args.model}'s {mdl['layers']} layers")
    given = [(k, getattr(args, k)) for k in ("tp", "cp", "pp", "dp") if getattr(args, k)]
    prod = math.prod(v for _, v in given)
    names = " x ".join(f"--{k} {v}" for k, v in given)
    if given and args.gpus % prod:
        fail(f"{names} = {prod} does not divide --gpus {args.gpus}")
    if len(given) == 4 and prod != args.gpus:
        fail(f"{names} = {prod}, not --gpus {args.gpus}")


def inputs(args) -> tuple:
    """The model (with its parameter counts), the cluster and the step, from the flags."""
    mdl = dict(MODELS[args.model], counts=param_counts(MODELS[args.model]))
    gpu, net = GPUS[args.gpu], NETWORKS[args.network]
    cl = {"gpus": args.gpus, "gpus_per_node": min(args.gpus, args.gpus_per_node),
          "tflops": gpu["tflops"], "hbm_tbps": gpu["hbm_tbps"], "nvlink": gpu["nvlink"] * 1e9,
          # the node's NICs shared by its GPUs: GB/s one way per GPU
          "net_per_gpu": args.nics_per_node * net["nic"] * 1e9 / args.gpus_per_node,
          "efficiency": args.link_efficiency, "alpha_nvlink": ALPHA_NVLINK_US * 1e-6,
          "alpha_net": ALPHA_NET_US * 1e-6,
          "usable_bytes": args.usable_memory * gpu["hbm_gb"] * 1e9}
    run = {"seq": args.seq_len, "sequences": args.tokens // args.seq_len, "mfu": args.mfu,
           "min_cp_chunk": args.min_cp_chunk, "overlap": args.overlap == "on",
           "flops_per_token": 6 * mdl["counts"]["flops_n"]
           + 12 * mdl["layers"] * mdl["hidden"] * args.seq_len}
    cl["step_flops"], cl["step_tokens"] = run["flops_per_token"] * args.tokens, args.tokens
    return mdl, cl, run


def report(args, mdl, cl, run, every, chosen, overall, fixed) -> None:
    lines = header(args, mdl, cl, run) + [""]
    if fixed:
        given = ", ".join(f"{FLAGS[k]} {v}" for k, v in fixed.items())
        lines.append(f"best layout with {given}: "
                     + describe(chosen["layout"], chosen["microbatches"]))
    else:
        lines.append("recommended: " + describe(chosen["layout"], chosen["microbatches"]))
    lines += table(chosen, cl)
    if fixed:
        delta = (chosen["step"] / overall["step"] - 1) * 100
        lines.append(f"unconstrained best: {describe(overall['layout'], overall['microbatches'])}"
                     f" | step {overall['step'] * 1e3:.1f} ms"
                     + (f": the layout above takes {delta:+.1f}%" if chosen["fits"] else ""))
    else:
        lines += [""] + why(every, chosen)
    print("\n".join(lines))


def write_json(path: Path, args, mdl, run, every, chosen, overall, fixed) -> None:
    """Inputs, the chosen layout's every term (seconds, bytes per GPU), the unconstrained best,
    and each layout's step time and memory."""
    out = {"script": SCRIPT, "model": args.model, "gpu": args.gpu, "network": args.network,
           "gpus": args.gpus, "gpus_per_node": args.gpus_per_node,
           "nics_per_node": args.nics_per_node, "seq_len": args.seq_len,
           "global_batch_tokens": args.tokens, "mfu": args.mfu, "overlap": args.overlap,
           "link_efficiency": args.link_efficiency, "usable_memory": args.usable_memory,
           "parameters": mdl["counts"]["total"], "flops_n": mdl["counts"]["flops_n"],
           "flops_per_token": run["flops_per_token"], "constraints": fixed,
           "chosen": chosen, "best": overall,
           "layouts": [{"layout": r["layout"], "step": r["step"],
                        "memory": r["memory"]["total"], "fits": r["fits"]} for r in every]}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(out, indent=1))
    os.replace(tmp, path)


def main(argv=None):
    args = parse_args(argv)
    mdl, cl, run = inputs(args)
    fixed = {key: getattr(args, attr) for key, attr in
             (("tp", "tp"), ("cp", "cp"), ("pp", "pp"), ("v", "virtual_stages"), ("dp", "dp"),
              ("sharding", "sharding"), ("ac", "activation_checkpointing"), ("b", "batch_size"))
             if getattr(args, attr) is not None}
    every = [evaluate(lay, mdl, cl, run) for lay in candidates(mdl, cl, run)]
    chosen = best(every, **fixed)
    if chosen is None:
        given = ", ".join(f"{FLAGS[k]} {v}" for k, v in fixed.items()) or "no constraint"
        fail(f"no layout of {args.gpus} GPUs has {given}: the {run['sequences']} sequences of a "
             "step must split over dp x batch-size x micro-batches, interleaving needs pp > 1 "
             f"dividing the micro-batches, CP chunks at least {args.min_cp_chunk} tokens")
    overall = best(every)
    report(args, mdl, cl, run, every, chosen, overall, fixed)
    if args.json_out:
        write_json(args.json_out, args, mdl, run, every, chosen, overall, fixed)


if __name__ == "__main__":
    main()

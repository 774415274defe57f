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
    python 05-advanced/cost_model.py --model llama3.1-8b --gpu h100-96gb --gpus 8 \
        --global-batch-tokens 128Ki --tp 1 --pp 1 --batch-size 2 --activation-checkpointing selective

A flag that names part of a layout (--tp --cp --pp --virtual-stages --dp --sharding --batch-size
--activation-checkpointing) restricts the search to layouts with that value, and the
unconstrained best is printed beside the result. The walkthrough, which sets the outputs beside
the layouts of published training runs, is 05-advanced/cost_model.md.

The model of one step (s = sequence length, b = sequences per micro-batch, m = micro-batches per
data-parallel rank, t/c/p/d = TP/CP/PP/DP degrees; ranks laid out TP innermost, then CP, PP, DP,
the order of Llama 3):
    compute  FLOPs per token 6N + 12*L*h*s (the MFU formula of 02-fsdp/fsdp_transformer.py) at
             peak x --compute-efficiency (the compute phases alone; the MFU printed for the step is
             end to end: bubble, exposed communication and optimizer included); full activation
             checkpointing adds a forward (x 4/3), selective (torchtitan's per-operator policy)
             the forward of every second matmul of a layer (k, o, up)
    TP       with sequence parallelism: per layer and micro-batch, 2 all-gathers and 2
             reduce-scatters of (b, s/c, h) forward, 4 backward, 4 more when the forward is
             recomputed (2 under selective recomputation); inside a node, exposed, as in a plain
             DTensor plan (Megatron-LM, Transformer Engine and torch's async TP hide some of them)
    PP       2 sends of (b, s/c, h/t) per micro-batch and chunk; the bubble (p-1)/(v m + p-1)
             (v = 1: 1F1B; v > 1: interleaved 1F1B, p v dividing the layers, or the layers + 2
             with the first and last stage one layer short, as Llama 3 and Megatron-Core's
             uneven stages do) is lost time
    CP       K,V chunks all-gathered round the ring forward and again backward, dK,dV
             reduce-scattered, per layer and micro-batch: hidden behind attention (--overlap on)
    DP       over the d x c ranks that hold the same weights, gradients reduced in
             --grad-reduce-dtype (fp32 by default): DDP all-reduces them once per step; ZeRO-1
             reduce-scatters them and all-gathers the bf16 weights; FSDP (torch's fully_shard on
             torchtitan's units) all-gathers each unit before forward and again before backward and
             reduce-scatters its gradient for every micro-batch, or once per step under a pipeline
             with reshard_after_forward=False: hidden behind compute (--overlap on), less the time
             the CP ring holds the same NICs
    a collective: t = base latency + alpha x ring steps + bytes per GPU / bus bandwidth (NCCL's
             model; PAT instead of a ring where NCCL would time it faster)
    memory   weights, gradients and Adam (bytes per parameter as Megatron-LM and FSDP2 keep them,
             sharded as the layout says), FSDP's gathered units, activations
             ((12h + 4kv + 8f)/t + 4h(t-1)/t bytes per token and layer; kept between forward
             and backward under recomputation: full 2h/t, selective 2(4h + kv + f) at t = 1 and
             2((5h + kv + f)/t + h) under TP), logits
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
# sheets print both directions together: 900 GB/s for H100/H200, 600 GB/s for A100). network: the
# default fabric of the GPU's DGX system, one NIC per GPU (DGX H100/H200: ConnectX-7 at 400 Gb/s
# NDR; DGX A100: ConnectX-6 at 200 Gb/s HDR; NVIDIA's DGX user guides).
GPUS = {
    "h100-sxm": dict(name="H100 SXM", tflops=989.0, hbm_gb=80.0, hbm_tbps=3.35, nvlink=450.0,
                     network="ib-ndr"),
    "h200-sxm": dict(name="H200 SXM", tflops=989.0, hbm_gb=141.0, hbm_tbps=4.8, nvlink=450.0,
                     network="ib-ndr"),
    "a100-sxm-80gb": dict(name="A100 SXM 80GB", tflops=312.0, hbm_gb=80.0, hbm_tbps=2.039,
                          nvlink=300.0, network="ib-hdr"),
    # The GPUs of torchtitan's H100 benchmarks (benchmarks/llama3_h100_202412_torchtitan.md, on
    # Meta's Grand Teton hosts): H100 with 96 GB of HBM2e at 2.4 TB/s, run at a 500 W power
    # limit (the SXM's 700 W peak is the data sheet's: what 500 W costs is left to
    # --compute-efficiency), 400 Gb/s of RDMA network per GPU.
    "h100-96gb": dict(name="H100 96GB HBM2e", tflops=989.0, hbm_gb=96.0, hbm_tbps=2.4,
                      nvlink=450.0, network="ib-ndr"),
}

# One NIC's speed, GB/s one way (InfiniBand Trade Association: NDR 4 x 100 Gb/s, HDR 4 x 50 Gb/s;
# IEEE 802.3bs 400 GbE).
NETWORKS = {
    "ib-ndr": dict(name="InfiniBand NDR 400 Gb/s", nic=50.0),
    "ib-hdr": dict(name="InfiniBand HDR 200 Gb/s", nic=25.0),
    "roce-400": dict(name="RoCE v2 over 400 GbE", nic=50.0),
}
# NCCL's latency model for a Ring/Simple collective (src/graph/tuning.cc of NCCL 2.30.7, the NCCL
# that torch 2.14.1's CUDA wheels install as nvidia-nccl-cu13): baseLatencies[Ring][Simple] once
# per collective, then hwLatencies[hw][Ring][Simple] per ring step: 3.4 us over NVLink, 14.0 us
# across the network (9.6 us up to NCCL 2.17; 14.0 since 2.18.1). NCCL has one network figure, so
# RoCE gets InfiniBand's: an assumption (a RoCE fabric's switches add latency this does not count).
# NCCL raises the NVLink steps of a ring that crosses nodes to 3 x its host overhead: 3.0 us on
# Intel hosts (DGX H100's Xeons), below 3.4; 6.0 us on AMD hosts, which this model does not take.
BASE_LATENCY_US = 8.4
ALPHA_NVLINK_US = 3.4
ALPHA_NET_US = 14.0
NCCL_VERSION = "2.30"
# An all-gather or reduce-scatter over a group of one GPU per node may run PAT instead (NCCL
# 2.23+, the same tuning.cc): base 8.0 us + floor(log2 nodes) x 14.0/3.5 us + 2.8 us per rank, at
# 0.75 of the ring's bus bandwidth; NCCL's tuner takes whichever its model times faster.
PAT_BASE_US, PAT_PER_RANK_US, PAT_BW = 8.0, 2.8, 0.75

BF16 = 2                       # bytes of a bf16 activation, weight or gradient element
GRAD_BYTES = {"fp32": 4, "bf16": 2}  # --grad-reduce-dtype: bytes of a reduced gradient element
DDP_BUCKET = 25 * 1024 * 1024  # torch DDP's default bucket_cap_mb = 25 (MiB): one all-reduce each
SHARDINGS = ("ddp", "zero1", "fsdp")
CHECKPOINTING = ("none", "selective", "full")
# Compute efficiency, a fitted compute-phase efficiency: the rate of the step's compute phases as a
# fraction of the dense peak (not the end-to-end MFU, which also loses the bubble, the exposed
# communication and the optimizer step). Fitted end to end, so it also absorbs what the model does
# not count (eager memory-bound operators, PP sends the run hid, kernel speed on small matrices).
# Fitted to Llama 3's first 405B pretraining layout (table 4 of "The Llama 3 Herd of Models": 8,192
# H100s, TP 8 x PP 16 x DP 64, no activation checkpointing, 430 TFLOP/s per GPU, 43% BF16 MFU),
# where this model, given that layout, prints MFU 0.43, though its eager activation count says the
# layout does not fit; tests/test_cost_model.py checks that the same value gives the second 8K
# layout's MFU within a stated margin, and brackets the 128K layout's between two FLOP counts.
COMPUTE_EFFICIENCY = 0.55
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


def recomputed_weights(m: dict) -> int:
    """Weights of one layer whose matmuls torchtitan's selective (per-operator) recomputation
    re-runs in backward: every second matmul in the order q, k, v, o, gate, up, down, that is k,
    o and up."""
    h, kv = m["hidden"], m["kv_heads"] * (m["hidden"] // m["heads"])
    return h * kv + h * h + h * m["ffn"]


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
    (g-1)/g x payload (nccl-tests' busbw factors). Latency, NCCL's model (tuning.cc): the base
    latency once, then 2(g-1) and g-1 steps, of which 2(nodes-1) and nodes-1 cross a node boundary
    and cost the network's alpha, the others NVLink's. Bus bandwidth: NVLink's inside a node; across
    nodes the group's members in one node share that node's NICs with the other groups doing the
    same at the same time, so g_node members get g_node x (NIC bandwidth per GPU), at most NVLink's;
    each link at its efficiency. With one GPU per node an all-gather or reduce-scatter takes PAT
    where NCCL's model times it faster (latency growing with log2 of the nodes)."""
    per_node, nodes = spread(group, cl["gpus_per_node"])
    g = per_node * nodes
    if g == 1:
        return {"bytes": 0.0, "steps": 0, "time": 0.0}
    factor, steps, inter = {"all_reduce": (2 * (g - 1) / g, 2 * (g - 1), 2 * (nodes - 1)),
                            "all_gather": ((g - 1) / g, g - 1, nodes - 1),
                            "reduce_scatter": ((g - 1) / g, g - 1, nodes - 1)}[kind]
    busbw = cl["nvlink_bw"] if nodes == 1 else min(cl["nvlink_bw"], per_node * cl["nic_bw"])
    sent = factor * payload
    alpha = cl["base"] + (steps - inter) * cl["alpha_nvlink"] + inter * cl["alpha_net"]
    ring = {"bytes": sent, "steps": steps, "time": alpha + sent / busbw, "algo": "ring"}
    if kind != "all_reduce" and per_node == 1 and nodes > 1:
        pat = (PAT_BASE_US * 1e-6 + int(math.log2(nodes)) * cl["alpha_net"] / 3.5
               + g * PAT_PER_RANK_US * 1e-6 + sent / (PAT_BW * busbw))
        if pat < ring["time"]:
            return dict(ring, time=pat, algo="pat")
    return ring


def send(group: list, payload: float, cl: dict) -> dict:
    """One point-to-point send to the neighbour in `group` (a pipeline boundary): one step of its
    link's alpha (a send is not one of the collectives NCCL's tuning model times, so no base
    latency), the whole payload, over NVLink when the group sits in one node, else over this GPU's
    NIC."""
    _, nodes = spread(group, cl["gpus_per_node"])
    bw, alpha = (cl["nvlink_bw"], cl["alpha_nvlink"]) if nodes == 1 else \
        (min(cl["nvlink_bw"], cl["nic_bw"]), cl["alpha_net"])
    return {"bytes": payload, "steps": 1, "time": alpha + payload / bw}


def context_parallel_bytes(kind: str, p: int, heads: int, kv_heads: int, head_dim: int,
                           seq_len: int, batch: int = 1, bytes_per_el: int = 4,
                           step: str = "forward") -> int:
    """Bytes one rank of a context-parallel group of p ranks sends in one attention forward
    (step="forward"), its backward ("backward") or both ("step", a training step), the sequence
    of seq_len positions split evenly (p divides seq_len), q with `heads` heads, k and v with
    `kv_heads` (grouped-query attention; kv_heads = heads is multi-head attention).
    With S = batch x seq_len / p x head_dim x bytes_per_el, one head of one rank's positions:
        ulysses  forward  (p - 1) / p x (2 heads + 2 kv) x S   4 all-to-alls (q, k, v, out), each
                                                                keeping 1 / p of its block at home
                 backward the same (dout in; dq, dk, dv out)
        ring     forward  2 (p - 1) x kv_heads x S             k and v passed p - 1 hops
                 backward (2 (p - 1) + 2 p) x kv_heads x S     the same hops, then dk and dv
                                                                once round the ring (p hops)
    so a training step sends 2 (p - 1) / p (2 heads + 2 kv) S under Ulysses and
    (6 p - 4) kv_heads S on the ring (nothing at p = 1).
    Ulysses gives every rank whole heads: p must divide heads. kv = kv_heads when p divides
    kv_heads; when p exceeds kv_heads and is a multiple of it, every key/value head is repeated
    p / kv_heads times before the all-to-alls so that each rank receives one (DeepSpeed's
    UlyssesSPAttentionHF does this), and kv = p. With heads = kv_heads = H and no repetition these
    are the lesson 05b multi-head counts: Ulysses 4 (p - 1) / p blocks of H heads each way, the
    ring 2 (p - 1) forward and 2 (p - 1) + 2 p backward."""
    if step not in ("forward", "backward", "step"):
        raise ValueError(f"step must be 'forward', 'backward' or 'step', got {step!r}")
    if seq_len % p:
        raise ValueError(f"the group of p = {p} ranks must divide seq_len = {seq_len}: "
                         f"every rank holds seq_len / p positions")
    if heads % kv_heads:
        raise ValueError(f"kv_heads = {kv_heads} must divide heads = {heads}: every key/value "
                         f"head serves a whole group of query heads")
    s = batch * (seq_len // p) * head_dim * bytes_per_el
    if kind == "ulysses":
        if heads % p:
            raise ValueError(f"Ulysses needs p = {p} to divide heads = {heads}: every rank "
                             f"attends with heads / p whole query heads")
        if kv_heads % p and p % kv_heads:
            raise ValueError(f"Ulysses needs p = {p} to divide kv_heads = {kv_heads}, or to be "
                             f"a multiple of it (each key/value head then repeated p / kv_heads "
                             f"times)")
        kv = max(kv_heads, p)
        forward = (p - 1) * (2 * heads + 2 * kv) * s // p
        return {"forward": forward, "backward": forward, "step": 2 * forward}[step]
    if kind == "ring":
        forward = 2 * (p - 1) * kv_heads * s
        backward = (2 * (p - 1) + 2 * p) * kv_heads * s if p > 1 else 0
        return {"forward": forward, "backward": backward, "step": forward + backward}[step]
    raise ValueError(f"kind must be 'ring' or 'ulysses', got {kind!r}")


# --------------------------------------------------------------------------------------------------
# One layout: its step time and its memory per GPU


def fsdp_units(mdl: dict, t: int, p: int, stage_layers: int) -> tuple:
    """The FSDP units of the busiest rank, as torchtitan wraps them (distributed/fsdp.py): each
    layer; the embedding; the final norm with the output layer, or, tied, the embedding, norm and
    output together. Returns (units, head): parameters per unit after TP (1/t of each matrix, and
    of the embedding and output layer, split over the vocabulary), and the unit holding the output
    layer, which torchtitan does not reshard after forward. Under a pipeline the busiest rank
    holds its layers and one of the embedding or the output layer."""
    h, pc = mdl["hidden"], mdl["counts"]
    layer = pc["layer_matrices"] / t + 2 * h  # norms replicated over TP
    head = pc["embedding"] / t + h            # output layer (or tied embedding) + final norm
    embedding = [pc["embedding"] / t] if p == 1 and not mdl["tied"] else []
    return embedding + [layer] * stage_layers + [head], head


def evaluate(lay: dict, mdl: dict, cl: dict, run: dict) -> dict:
    """Every term of one layout. lay: tp cp pp v dp sharding ac b; run: seq, sequences,
    efficiency, overlap, grad_bytes. Times in seconds, bytes per GPU."""
    t, c, p, d, b, v = lay["tp"], lay["cp"], lay["pp"], lay["dp"], lay["b"], lay["v"]
    L, h, f, V, s = mdl["layers"], mdl["hidden"], mdl["ffn"], mdl["vocab"], run["seq"]
    pc, G = mdl["counts"], run["grad_bytes"]
    m = run["sequences"] // (d * b)               # micro-batches per step, per DP rank
    tokens = b * s // c                           # tokens of one micro-batch on one GPU (CP chunk)
    # The layers of the busiest rank (it sets the pace and the memory). Interleaving cuts them
    # into v chunks of L/(p v) layers; it is offered only where p v divides L (Megatron-LM
    # requires it), so the busiest rank holds exactly L/p layers then.
    stage_layers = math.ceil(L / p)
    recompute, selective = lay["ac"] == "full", lay["ac"] == "selective"
    rate = cl["tflops"] * 1e12 * run["efficiency"]  # FLOP/s one GPU's kernels achieve

    # Compute of one micro-batch on one GPU: its stage's share of the layers, its 1/t of every
    # matrix and its 1/c of the tokens. Backward is twice forward; full recomputation adds a
    # forward; selective recomputation (torchtitan's per-operator policy: every matmul output
    # saved except every second one, the attention output saved) re-runs the forward of the k, o
    # and up projections of each layer (2 FLOPs per weight and token).
    flops = b * s * run["flops_per_token"] * stage_layers / L / (t * c)
    redo = flops / 3 if recompute else \
        2 * b * s * recomputed_weights(mdl) * stage_layers / (t * c) if selective else 0.0
    fwd, bwd = flops / 3 / rate, (2 * flops / 3 + redo) / rate
    attention = b * s * 12 * stage_layers * h * s / (t * c) * (4 / 3 if recompute else 1) / rate

    tp_group, cp_group = [(t, 1)], [(c, t)]
    pp_group, dp_group = [(p, t * c)], [(c, t), (d, t * c * p)]
    terms = {}
    # TP with sequence parallelism (Korthikanti et al. 2022; torch's DTensor plan in torchtitan):
    # per layer, forward all-gathers the sequence-sharded normed input before attention and before
    # the MLP and reduce-scatters each block's output: 4 collectives of the whole (b, s/c, h)
    # activation; backward runs their conjugates, 4 more; a recomputed forward repeats its 4. Each
    # is costed as an all-gather: a ring reduce-scatter of the same tensor sends as many bytes in
    # as many steps. Selective recomputation re-runs the two all-gathers (their outputs are not
    # among the saved operators, and the k and up projections read them). All are exposed: a
    # plain DTensor plan runs each collective before or after its matmul, on the critical path.
    # (Megatron-LM overlaps the backward reduce-scatter of the input gradient with the
    # weight-gradient GEMM and the re-gather with the input-gradient GEMM; Transformer Engine's
    # userbuffers and torch's async TP under torch.compile split the forward ones into chunks
    # that overlap their matmul: this model hides none of them.)
    per_layer = 8 + (4 if recompute else 2 if selective else 0)
    tp = collective("all_gather", tp_group, tokens * h * BF16, cl)
    n = per_layer * stage_layers if t > 1 else 0
    terms["tp"] = {"count": n * m, "bytes": n * m * tp["bytes"], "mb": n * tp["time"]}
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

    # Parameters this GPU holds before data-parallel sharding, unit by unit.
    units, head = fsdp_units(mdl, t, p, stage_layers)
    layer_tp = units[-2]
    params = sum(units)
    g = d * c                                     # ranks that hold the same weights
    sh = lay["sharding"] if g > 1 else "ddp"
    # When the CP ring and the DP group both cross nodes they share each GPU's NIC: while the ring
    # runs behind attention, the NIC is not free to hide DP traffic.
    shared_nic = c > 1 and g > 1 and spread(cp_group, cl["gpus_per_node"])[1] > 1 \
        and spread(dp_group, cl["gpus_per_node"])[1] > 1
    cp_busy = min(cp_mb, attention) if shared_nic and run["overlap"] else 0.0
    if sh == "ddp":
        # One all-reduce of the gradients (G bytes each) per 25 MiB bucket, on the last
        # micro-batch (no_sync before it), started as its buckets fill during its backward.
        buckets = math.ceil(G * params / DDP_BUCKET)
        one = collective("all_reduce", dp_group, G * params / buckets, cl)
        dp = {"count": buckets if g > 1 else 0, "bytes": buckets * one["bytes"],
              "time": buckets * one["time"]}
        window = bwd
    elif sh == "zero1":
        # ZeRO-1 (Megatron-LM's distributed optimizer): reduce-scatter the gradients (behind the
        # last backward), all-gather the updated bf16 weights (behind the next forward), in as
        # many buckets as DDP's.
        buckets = math.ceil(G * params / DDP_BUCKET)
        r = collective("reduce_scatter", dp_group, G * params / buckets, cl)
        a = collective("all_gather", dp_group, BF16 * params / buckets, cl)
        dp = {"count": 2 * buckets, "bytes": buckets * (a["bytes"] + r["bytes"]),
              "time": buckets * (a["time"] + r["time"])}
        window = fwd + bwd
    else:
        # FSDP2 (fully_shard): a unit's bf16 weights all-gathered, its gradient reduce-scattered
        # in the reduce dtype. Sizes: every layer alike, the embedding and the head (vocabulary
        # split over TP) apart.
        sizes = sorted(set(units))
        ag = {u: collective("all_gather", dp_group, BF16 * u, cl) for u in sizes}
        rs = {u: collective("reduce_scatter", dp_group, G * u, cl) for u in sizes}
        if p > 1:
            # Under a pipeline with fully_shard(reshard_after_forward=False) (torchtitan's default
            # with PP, distributed/fsdp.py): torch.distributed.pipelining (torch 2.14, stage.py)
            # sets reshard_after_backward and requires_gradient_sync False for every backward
            # micro-batch, then, after the last one, turns both on and runs FSDP's post-backward
            # once (perform_reduce_grad, the schedule's REDUCE_GRAD action): each unit is gathered
            # once and reduce-scattered once per step. (With the default
            # reshard_after_forward=True it would re-gather every micro-batch's forward.)
            dp = {"count": 2 * len(units),
                  "bytes": sum(ag[u]["bytes"] + rs[u]["bytes"] for u in units),
                  "time": sum(ag[u]["time"] + rs[u]["time"] for u in units)}
            window = fwd + bwd
        else:
            # Without a pipeline, for every micro-batch: each unit gathered before forward, again
            # before backward (except the head, which torchtitan keeps unsharded from its forward
            # to its backward), and its gradient reduce-scattered, each prefetched behind the
            # previous unit's compute.
            regathered = list(units)
            regathered.remove(head)
            per_mb = sum(ag[u]["time"] + rs[u]["time"] for u in units) \
                + sum(ag[u]["time"] for u in regathered)
            mb_bytes = sum(ag[u]["bytes"] + rs[u]["bytes"] for u in units) \
                + sum(ag[u]["bytes"] for u in regathered)
            dp = {"count": (2 * len(units) + len(regathered)) * m, "bytes": m * mb_bytes,
                  "time": m * per_mb}
            window = None
    # Exposed: what the window it overlaps (less the CP ring's time on a shared NIC) cannot hide.
    # DDP's window is the last backward alone, so charging it a whole micro-batch's ring time is
    # conservative.
    if not run["overlap"]:
        dp["exposed"] = dp["time"]
    elif window is None:
        dp["exposed"] = m * max(0.0, per_mb - max(0.0, fwd + bwd - cp_busy))
    else:
        dp["exposed"] = max(0.0, dp["time"] - max(0.0, window - cp_busy))
    terms["dp"] = dp

    # The optimizer step reads and writes every byte of Adam's state: bound by HBM bandwidth.
    # DDP and ZeRO-1 (Megatron-LM): read the fp32 master weight, m, v (12) and the gradient (G),
    # write master, m, v (12) and the bf16 weight (2). FSDP2: the fp32 shard is the master: read
    # it, its fp32 gradient, m, v (16), write weight, m, v (12).
    if sh == "fsdp":
        opt_bytes = 28 * params / g
    else:
        opt_bytes = (26 + G) * (params if sh == "ddp" else params / g)
    optimizer = opt_bytes / (cl["hbm_tbps"] * 1e12)
    step = pipeline + dp["exposed"] + optimizer

    # Memory (bytes per GPU). Model states, mixed precision with Adam: DDP and ZeRO-1 as
    # Megatron-LM keeps them (docs/user-guide/features/dist_optimizer.md: bf16 weights 2, main
    # gradients G, fp32 master and moments 12: 18 per parameter with fp32 gradients, ZeRO-1
    # 6 + 12/g); FSDP2 keeps fp32 shards of the weights (Adam's master) and of the gradients
    # (reduced in G, stored in the weights' dtype) and the moments: 16/g. FSDP's gathered units:
    # under a pipeline the stage's bf16 weights and its unsharded gradients, accumulated in the
    # reduce dtype (FSDPParam.to_accumulated_grad_if_needed); without, the largest unit with its
    # neighbour prefetched, and the largest unit's bf16 gradient and its copy in the reduce dtype
    # that the reduce-scatter reads (2 + G bytes a parameter).
    if sh == "ddp":
        states = {"weights": BF16 * params, "grads": G * params, "optimizer": 12 * params}
        transient = 0.0
    elif sh == "zero1":
        states = {"weights": BF16 * params, "grads": G * params, "optimizer": 12 * params / g}
        transient = 0.0
    else:
        states = {"weights": 4 * params / g, "grads": 4 * params / g, "optimizer": 8 * params / g}
        largest = max(units)
        transient = (BF16 + G) * params if p > 1 else \
            BF16 * (largest + layer_tp) + (BF16 + G) * largest
    # Activations kept for backward, per token and layer, bf16, measured with eager torch
    # (tests/test_cost_model.py): the inputs of the two norms (h each; the fused CUDA RMSNorm keeps
    # its input and a per-token fp32 scale), of q/k/v and of the MLP (h each), q after RoPE (h), k
    # and v (kv each), the attention output (h; FlashAttention keeps no score matrix, only fp32
    # row statistics, left out), and the SwiGLU's gate, silu(gate), up and their product (f each):
    # 12h + 4kv + 8f bytes. Under TP with sequence parallelism each is split over the t ranks
    # (by sequence, heads or features), except the inputs of q/k/v and of the MLP: torch's plan
    # all-gathers them (PrepareModuleInput to Replicate) and the linear layers save them whole,
    # 4h(t-1)/t bytes more than a split. 1F1B keeps min(p, m) micro-batches in flight on the first
    # stage. Interleaved, the first rank runs 2(p-1) + (v-1)p warm-up chunk forwards (Megatron-LM,
    # pipeline_parallel/schedules.py) and holds one more: chunks of L/(p v) layers,
    # 1 + (p-1)/(p v) times 1F1B's p stages of L/p (05b counts 11 chunks held at p = 4, v = 2).
    # Full checkpointing keeps only each layer's input (2h/t bytes, sequence-sharded) and rebuilds
    # one layer at a time; selective (torchtitan's policy: every second matmul's output, the
    # attention kernel's and the reduce-scatters') keeps the layer's input and q, v, the attention
    # output, gate and down (h, kv, h, f, h: 2(4h + kv + f) bytes a token with the input), and
    # rebuilds the rest one layer at a time. Under TP (t > 1) all but one of these are split over
    # the t ranks, plus the two reduce-scatters' sequence-sharded outputs (h/t each), but down is
    # the row-parallel matmul's Partial output: the whole (tokens, h) on every rank, before its
    # reduce-scatter. So 2((5h + kv + f)/t + h) bytes a token, 2.2 times a split of everything
    # for 405B at t = 8 (tests/test_cost_model.py measures what the policy saves at t = 2).
    per_token_layer = (12 * h + 4 * pc["kv"] + 8 * f) / t + 4 * h * (t - 1) / t
    in_flight = min(p, m) * (1 + (p - 1) / (p * v) if v > 1 else 1)
    if recompute:
        acts = stage_layers * tokens * 2 * h / t * in_flight + tokens * per_token_layer
    elif selective:
        kept = 2 * (4 * h + pc["kv"] + f) if t == 1 else 2 * ((5 * h + pc["kv"] + f) / t + h)
        acts = stage_layers * tokens * kept * in_flight + tokens * per_token_layer
    else:
        acts = stage_layers * tokens * per_token_layer * in_flight
    logits = tokens * V / t * (BF16 + 4)  # the last stage's bf16 logits and fp32 loss input
    memory = {**states, "gathered": transient, "activations": acts, "logits": logits}
    memory["total"] = sum(memory.values())
    return {"layout": dict(lay, dp=d, sharding=sh), "microbatches": m, "params_per_gpu": params,
            "dp_group": g, "shared_nic": shared_nic, "compute_mb": fwd + bwd,
            "attention_mb": attention, "compute": m * (fwd + bwd), "stage_mb": stage_mb,
            "pipeline": pipeline, "bubble": bubble, "bubble_fraction": (p - 1) / (v * m + p - 1),
            "terms": terms, "optimizer": optimizer, "step": step, "memory": memory,
            "fits": memory["total"] <= cl["usable_bytes"]}


# --------------------------------------------------------------------------------------------------
# The search: every layout, the fastest that fits


def interleavable(layers: int, p: int, v: int) -> bool:
    """p x v chunks of equal layers, or of layers + 2 slots where the embedding and the output
    layer take a layer's slot each in the first and last chunk (Megatron-Core's
    --account-for-embedding-in-pipeline-split and --account-for-loss-in-pipeline-split)."""
    return layers % (p * v) == 0 or (layers + 2) % (p * v) == 0


def powers_of_two(limit: int) -> list:
    return [1 << i for i in range(limit.bit_length()) if (1 << i) <= limit]


def candidates(mdl: dict, cl: dict, run: dict) -> list:
    """Every layout of the cluster's GPUs: TP inside a node (a power of two dividing the heads and
    KV heads), CP chunks of at least --min-cp-chunk tokens (the sequence cut into 2c pieces for a
    balanced causal ring), PP up to one layer per stage, interleaved with v chunks per rank when
    p v divides the layers, or the layers + 2 with the first chunk and the last one layer short
    (Llama 3's balancing for the embedding and the output layer; Megatron-Core's uneven first and
    last stages; the busiest rank holds ceil(L/p) layers either way), and
    p divides m (the
    condition of Megatron-LM's first interleaved schedule; Megatron-LM now takes any m >= p,
    through microbatch_group_size_per_vp_stage, and Llama 3 lifted it too: this model keeps it, so
    that every micro-batch group fills the pipeline and the bubble is (p-1)/(v m + p-1)), DP the
    rest (dividing the step's sequences), micro-batches of b sequences, each sharding and
    checkpointing."""
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
                    vs = [1] + [v for v in range(2, (L + 2) // p + 1)
                                if p > 1 and m % p == 0 and interleavable(L, p, v)]
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
    ac = {"full": "full", "selective": "selective", "none": "no"}[lay["ac"]] \
        + " activation checkpointing"
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
    names = {"tp": "TP all-gather/reduce-scatter (b,s/c,h)", "cp": "CP ring K,V and dK,dV",
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
                pct = (r["step"] / base - 1) * 100
                pct = 0.0 if round(pct, 1) == 0 else pct  # no "-0.0%" for a tie
                cells.append(f"{v}: {r['step'] * 1e3:.1f} ({pct:+.1f}%)")
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
        f"per step | compute efficiency {run['efficiency']:.2f} | overlap "
        f"{'on' if run['overlap'] else 'off'}",
        f"model    {pc['total']:,} parameters: {mdl['layers']} layers, h {mdl['hidden']}, "
        f"ffn {mdl['ffn']}, {mdl['heads']} heads, {mdl['kv_heads']} KV heads, vocab "
        f"{mdl['vocab']}, {tied} embedding",
        f"flops    6N + 12*L*h*s = 6 x {pc['flops_n']:,} + 12 x {mdl['layers']} x {mdl['hidden']}"
        f" x {run['seq']} = {run['flops_per_token']:,} per token",
        f"gpu      {gpu['name']}: {gpu['tflops']:g} dense bf16 TFLOP/s, compute at "
        f"{run['efficiency']:.2f} | HBM "
        f"{gpu['hbm_gb']:g} GB ({args.usable_memory:.0%} usable), {gpu['hbm_tbps']:g} TB/s | "
        f"NVLink {gpu['nvlink']:g} GB/s each way",
        f"network  {net['name']}: {args.nics_per_node} NICs per node = "
        f"{cl['net_per_gpu'] / 1e9:g} GB/s per GPU each way | NVLink at "
        f"{args.nvlink_efficiency:.0%}, NICs at {args.nic_efficiency:.0%} of spec",
        f"latency  NCCL {NCCL_VERSION} Ring/Simple: {cl['base'] * 1e6:g} us per collective + "
        f"{cl['alpha_nvlink'] * 1e6:g} us per NVLink step, {cl['alpha_net'] * 1e6:g} us per "
        "network step",
        f"training bf16 compute, gradients reduced in {args.grad_reduce_dtype}, Adam | "
        "activations: eager SwiGLU, FlashAttention, sequence parallelism under TP",
        "overlap  " + ("on: DP/FSDP traffic hidden behind compute, CP behind attention, up to "
                       "their length (DP less the CP ring's time on a shared NIC); TP, PP and the "
                       "optimizer step exposed" if run["overlap"]
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
    p.add_argument("--network", choices=["auto", *NETWORKS], default="auto",
                   help="the network between nodes (auto: that of the GPU's DGX system, ib-ndr "
                   "for H100 and H200, ib-hdr for A100)")
    p.add_argument("--nics-per-node", type=int, default=8, help="NICs of that network per node "
                   "(8: one per GPU, as in NVIDIA's DGX H100 and DGX A100)")
    p.add_argument("--seq-len", type=int, default=8192, help="tokens per sequence")
    p.add_argument("--global-batch-tokens", default="4Mi",
                   help="tokens per optimizer step (4194304, 4Mi, 512Ki)")
    p.add_argument("--compute-efficiency", type=float, default=COMPUTE_EFFICIENCY,
                   help="fitted compute-phase efficiency: the rate of the compute phases as a "
                   "fraction of the GPU's dense bf16 peak (not the end-to-end MFU the step line "
                   "prints, which also loses the bubble, exposed communication and the optimizer; "
                   "fitted end to end, it also absorbs what the model does not count; default: "
                   "fitted to Llama 3's 405B layout of 43%% MFU)")
    p.add_argument("--overlap", choices=["on", "off"], default="on",
                   help="on: DP/FSDP traffic hides behind compute (backward, or forward too), CP "
                        "behind attention; TP and PP are exposed, as in a plain DTensor plan and "
                        "torch's pipelining (Megatron-LM hides some TP traffic, and its "
                        "overlap_p2p_comm and Llama 3's asynchronous sends hide PP's). "
                        "off: every byte is exposed")
    p.add_argument("--grad-reduce-dtype", choices=list(GRAD_BYTES), default="fp32",
                   help="the dtype gradients are reduced (and, under a pipeline, accumulated) in: "
                   "fp32 is torchtitan's, OLMo's, Megatron-LM's and DDP-with-autocast's default")
    p.add_argument("--nvlink-efficiency", type=float, default=0.8, help="fraction of NVLink's "
                   "spec bandwidth that collectives reach (lesson 04, section 5: 78-82%%)")
    p.add_argument("--nic-efficiency", type=float, default=0.92, help="fraction of a NIC's spec "
                   "bandwidth that collectives across nodes reach (lesson 04, section 5: 46-48 of "
                   "50 GB/s per NDR NIC, 24 of 25 per HDR NIC)")
    p.add_argument("--usable-memory", type=float, default=0.9, help="fraction of HBM a layout may "
                   "fill (the rest: CUDA context, NCCL buffers, allocator fragmentation)")
    p.add_argument("--min-cp-chunk", type=int, default=8192, help="the fewest tokens per GPU a "
                   "context-parallel layout may leave (published CP runs keep 8192 or more: the "
                   "fixed compute efficiency of this model would not hold for small attention blocks)")
    p.add_argument("--tp", type=int, help="only layouts with this tensor-parallel degree")
    p.add_argument("--cp", type=int, help="only layouts with this context-parallel degree")
    p.add_argument("--pp", type=int, help="only layouts with this many pipeline stages")
    p.add_argument("--virtual-stages", type=int, help="only layouts with this many pipeline "
                   "chunks per rank (1: plain 1F1B; v > 1: interleaved 1F1B)")
    p.add_argument("--dp", type=int, help="only layouts with this data-parallel degree")
    p.add_argument("--sharding", choices=SHARDINGS, help="only layouts with this data parallelism")
    p.add_argument("--activation-checkpointing", choices=CHECKPOINTING,
                   help="only layouts with this activation checkpointing: none, selective "
                   "(torchtitan's per-operator policy) or full")
    p.add_argument("--batch-size", type=int, help="only layouts with this many sequences per "
                   "data-parallel rank per micro-step")
    p.add_argument("--json-out", type=Path, help="write the inputs, the recommended layout's "
                   "terms and every layout's step time and memory here as JSON")
    args = p.parse_args(argv)
    check(args)
    return args


def check(args) -> None:
    """Bad input ends here, with one line naming the numbers involved."""
    cli.check_positive(args, "gpus", "gpus_per_node", "nics_per_node", "seq_len",
                       "compute_efficiency",
                       "nvlink_efficiency", "nic_efficiency", "usable_memory", "min_cp_chunk",
                       "tp", "cp", "pp", "virtual_stages", "dp", "batch_size")
    if args.network == "auto":
        args.network = GPUS[args.gpu]["network"]
    for name in ("compute_efficiency", "nvlink_efficiency", "nic_efficiency", "usable_memory"):
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
    if args.pp and args.virtual_stages and args.virtual_stages > 1 \
            and not interleavable(mdl["layers"], args.pp, args.virtual_stages):
        fail(f"--pp {args.pp} x --virtual-stages {args.virtual_stages} = "
             f"{args.pp * args.virtual_stages} does not divide {args.model}'s {mdl['layers']} "
             "layers (or the layers + 2, first and last chunk one short) into equal chunks")
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
          "tflops": gpu["tflops"], "hbm_tbps": gpu["hbm_tbps"],
          "nvlink_bw": gpu["nvlink"] * 1e9 * args.nvlink_efficiency,
          # the node's NICs shared by its GPUs: bytes/s one way per GPU, at spec and reached
          "net_per_gpu": args.nics_per_node * net["nic"] * 1e9 / args.gpus_per_node,
          "nic_bw": args.nics_per_node * net["nic"] * 1e9 / args.gpus_per_node
          * args.nic_efficiency,
          "base": BASE_LATENCY_US * 1e-6, "alpha_nvlink": ALPHA_NVLINK_US * 1e-6,
          "alpha_net": ALPHA_NET_US * 1e-6,
          "usable_bytes": args.usable_memory * gpu["hbm_gb"] * 1e9}
    run = {"seq": args.seq_len, "sequences": args.tokens // args.seq_len,
           "efficiency": args.compute_efficiency,
           "min_cp_chunk": args.min_cp_chunk, "overlap": args.overlap == "on",
           "grad_bytes": GRAD_BYTES[args.grad_reduce_dtype],
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
           "global_batch_tokens": args.tokens,
           "compute_efficiency": args.compute_efficiency, "overlap": args.overlap,
           "grad_reduce_dtype": args.grad_reduce_dtype,
           "nvlink_efficiency": args.nvlink_efficiency, "nic_efficiency": args.nic_efficiency,
           "usable_memory": args.usable_memory,
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
             "dividing the micro-batches and pp x virtual-stages dividing the layers, CP chunks "
             f"at least {args.min_cp_chunk} tokens")
    overall = best(every)
    report(args, mdl, cl, run, every, chosen, overall, fixed)
    if args.json_out:
        write_json(args.json_out, args, mdl, run, every, chosen, overall, fixed)


if __name__ == "__main__":
    main()

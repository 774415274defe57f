r"""Will my model fit? Bytes per GPU of weights, gradients, optimizer state and activations for
every data-parallel strategy of the course, from the ZeRO paper's formulas or exactly as
DeepSpeed 0.19 and torch's FSDP2 hold them.

Launch (from the repository root; pure Python, no torch import, instant):
    python benchmarks/memory_estimator.py --params 7e9 --world-size 4 --compare
    python benchmarks/memory_estimator.py --params 7.5e9 --world-size 64 --precision mixed --compare
    python benchmarks/memory_estimator.py --params llama-7b --world-size 8 --strategy zero3 \
        --precision mixed --batch-size 1 --activation-checkpointing
    python benchmarks/memory_estimator.py --shapes 30x16,30,25x30,25,10x25,10 --world-size 2 \
        --strategy fsdp-full --accounting library        # every rank, uneven shards to the byte

Expected output (the first command; arithmetic, the same on every machine):
    P = 7,000,000,000 parameters | world 4 | fp32 Adam | accounting paper | GB = 1e9 bytes, per GPU
                       params     grads     optim    activ. transient     total      host  bytes/P
    ddp                 28.00     28.00     56.00      0.00      0.00    112.00      0.00    16.00
    ...
    zero3                7.00      7.00     14.00      0.00      0.00     28.00      0.00     4.00

The model (Rajbhandari et al. 2020, "ZeRO", section 3; Ren et al. 2021, "ZeRO-Offload"), for P
parameters, N data-parallel ranks and Adam:
    fp32:  4 bytes of weights + 4 of gradients + 8 of Adam moments = 16P (DDP), 16P/N fully sharded.
    mixed: 2 (bf16 weights) + 2 (bf16 grads) + K = 12 (fp32 master 4 + moments 8) = 16P again;
           ZeRO-1 shards the K bytes (4P + 12P/N), ZeRO-2 also the gradients (2P + 14P/N),
           ZeRO-3 / FSDP everything (16P/N).
--accounting library counts what the libraries really keep (see the README): DeepSpeed's ZeRO 1-3
keep an fp32 master partition even in fp32 training (ZeRO-3 fp32: 20P/N, not 16P/N) and pad
their flat buffers; with offload_optimizer, ZeRO-2 keeps a host copy of its weight partition and
two gradient buffers the size of the largest parameter (host 18P/N in bf16, 20P/N in fp32, plus
one parameter; --largest-param or --shapes), under gradient accumulation host buffers for whole
gradients, and ZeRO-3 keeps its gradient partition in host memory. Transient, in the `transient`
column: DeepSpeed's step makes a new fp32 copy of the gradient partition (4P/N, without offload)
and ZeRO-3 keeps the last stage3_max_reuse_distance/2 parameter elements gathered from forward to
backward (--reuse-distance, 1e9 in the course's configs). FSDP2 keeps fp32 shards of
torch.chunk's uneven sizes and torch's Adam keeps a 4-byte step counter per parameter tensor on
every rank. For the lessons' models these figures equal a measured DeepSpeed 0.19.8 run's, to
the byte (tests/test_benchmarks.py). Not counted: communication buckets, the 16-bit flattened
gradient the step's fp32 copy is cast from (it lives for an instant), and above R/2 parameters
ZeRO-3's gathered bytes are an estimate to the granularity of a module.
"""

import json
import math
import os
import re
from pathlib import Path

from dtcourse import cli
from dtcourse.cli import fail

# name -> (parameters, layers, hidden, heads, seq_len, where the count comes from). Counts are
# exact sums of the published architectures (embeddings and heads included; tied weights once).
PRESETS = {
    "resnet50": (25_557_032, None, None, None, None, "torchvision resnet50"),
    "bert-large": (335_141_888, 24, 1024, 16, 512, "BERT-large, 30,522 vocab, with pooler"),
    "gpt2-xl": (1_557_611_200, 48, 1600, 25, 1024, "GPT-2 XL, tied embedding"),
    "llama-7b": (6_738_415_616, 32, 4096, 32, 2048, "LLaMA 7B, untied output layer"),
    "llama-70b": (68_976_648_192, 80, 8192, 64, 4096, "Llama 2 70B, grouped-query attention"),
    "gpt3-175b": (175_000_000_000, 96, 12288, 96, 2048, "GPT-3 paper, table 2.1"),
}

STRATEGIES = {
    "ddp": "DDP: every rank holds everything",
    "zero1": "ZeRO-1: optimizer state sharded",
    "zero2": "ZeRO-2: + gradients sharded",
    "zero3": "ZeRO-3: + parameters sharded",
    "fsdp-full": "FSDP FULL_SHARD (= ZeRO-3)",
    "fsdp-grad-op": "FSDP SHARD_GRAD_OP: full params from forward to backward",
    "fsdp-hybrid": "FSDP HYBRID_SHARD: sharded inside groups of S ranks",
    "zero2-offload": "ZeRO-2 + optimizer state in host memory",
    "zero3-offload": "ZeRO-3 + optimizer state and parameters in host memory",
}
SHARDS_PARAMS = ("zero3", "fsdp-full", "fsdp-hybrid", "zero3-offload")  # gather layer by layer
KEYS = ("params_bytes", "grads_bytes", "optim_bytes", "activations_bytes", "transient_bytes",
        "total_bytes", "host_bytes")


# --------------------------------------------------------------------------------------------------
# How many elements of each partitioning one rank holds


def chunk_rows(rows: int, parts: int, index: int) -> int:
    """Rows of dim 0 that shard `index` of `parts` holds under torch.chunk's split, which FSDP2
    uses: chunks of c = ceil(rows/parts) rows, rank r gets [r*c, min((r+1)*c, rows))."""
    c = math.ceil(rows / parts)
    return max(0, min((index + 1) * c, rows) - index * c)


def held_elements(P: int, N: int, S: int, shapes, rank: int, exact: bool) -> dict:
    """Elements this rank holds in each layout. exact=False: the ideal P/N of the formulas."""
    if not exact:
        return {"fsdp": P / S, "flat": P, "part12": P / N, "zero3": P / N}
    # DeepSpeed stages 1-2: one flat buffer of all parameters, padded to a multiple of 2N
    # elements (its alignment), cut into N equal partitions.
    flat = math.ceil(P / (2 * N)) * 2 * N
    out = {"flat": flat, "part12": flat // N}
    if shapes:  # FSDP2: each tensor's rows split unevenly; DeepSpeed stage 3: ceil(numel/N) each
        out["fsdp"] = sum(chunk_rows(s[0], S, rank % S) * math.prod(s[1:]) for s in shapes)
        out["zero3"] = sum(math.ceil(math.prod(s) / N) for s in shapes)
        # Stages 1-2: whole tensors of the parameters whose elements overlap this rank's
        # partition [rank*p, (rank+1)*p) of the flat buffer (parameters flattened in order).
        lo, hi, start, out["overlap"] = rank * out["part12"], (rank + 1) * out["part12"], 0, 0
        for s in shapes:
            end = start + math.prod(s)
            out["overlap"] += end - start if start < hi and end > lo else 0
            start = end
    else:  # shapes unknown: the even split (the padding, at most one row per tensor, is unknown)
        out["fsdp"], out["zero3"], out["overlap"] = P / S, P / N, out["part12"]
    return out


# --------------------------------------------------------------------------------------------------
# Model states: bytes per rank, on the device and in host memory


def model_states(P: int, N: int, strategy: str, precision: str, accounting: str, *, S: int,
                 shapes=None, rank: int = 0, tensors: int = 0, grad_accum: int = 1,
                 largest: int = 0) -> dict:
    """Bytes of weights, gradients and optimizer state on the device, and what offload keeps in
    host memory, for one rank. W = bytes of a working weight or gradient element; largest = the
    element count of the largest parameter tensor (0: unknown)."""
    W = 2 if precision == "mixed" else 4
    library = accounting == "library"
    group = S if strategy == "fsdp-hybrid" else N  # ranks one FSDP replica is sharded over
    e = held_elements(P, N, group, shapes, rank, exact=library)
    dev, host = {"params": 0, "grads": 0, "optim": 0}, {"params": 0, "grads": 0, "optim": 0}

    if not library:
        # The ZeRO paper: the optimizer keeps K bytes per parameter: the moments (8), plus the
        # fp32 master copy (4) when the weights are 16-bit; fp32 weights are their own master.
        K = 12 if precision == "mixed" else 8
        sharded = {"ddp": (1, 1, 1), "zero1": (1, 1, N), "zero2": (1, N, N), "zero3": (N, N, N),
                   "fsdp-full": (N, N, N), "fsdp-grad-op": (N, N, N), "fsdp-hybrid": (S, S, S)}
        if strategy in sharded:
            dp, dg, do = sharded[strategy]
            dev.update(params=W * P / dp, grads=W * P / dg, optim=K * P / do)
        else:  # offload: the CPU steps an fp32 partition: fp32 grads 4 + master/params 4 + Adam 8
            host.update(grads=4 * P / N, optim=K * P / N, params=(16 - 4 - K) * P / N)
            if strategy == "zero2-offload":
                dev["params"] = W * P  # the working weights stay on the GPU
            else:  # zero3-offload: the 16-bit partition of the working weights lives on the host
                host["params"] += (W if precision == "mixed" else 0) * P / N
    elif strategy == "ddp" or strategy.startswith("fsdp"):
        # torch DDP (autocast for mixed) and FSDP2 keep fp32 weights, fp32 grads and torch Adam's
        # two fp32 moments, plus its 4-byte `step` tensor per parameter, on every rank.
        n = P if strategy == "ddp" else e["fsdp"]
        dev.update(params=4 * n, grads=4 * n, optim=8 * n + 4 * tensors)
    else:
        # DeepSpeed: the optimizer always steps an fp32 master partition (4) with Adam (8): 12 per
        # element of this rank's partition, in fp32 training too.
        part = e["zero3"] if strategy.startswith("zero3") else e["part12"]
        if strategy == "zero1":  # full gradients while accumulating, partition after reduction
            dev.update(params=W * e["flat"], grads=W * P, optim=12 * part)
        elif strategy == "zero2":
            dev.update(params=W * e["flat"], grads=W * part, optim=12 * part)
        elif strategy == "zero3":
            dev.update(params=W * part, grads=W * part, optim=12 * part)
        elif strategy == "zero2-offload":  # reduced grads go straight into the host fp32 buffer
            # stage_1_and_2.py's __init__ with offload_optimizer also allocates: a pinned host
            # copy of the weight partition in the working dtype (`param_buffer_of_bit16_for_cpu_
            # offload_groups`: the step writes the new master into it, then copies it to the
            # device), and two gradient buffers of the working dtype the size of the largest
            # parameter, one pinned on the host (`temp_grad_buffer_for_cpu_offload`), one on the
            # device (`temp_grad_buffer_for_gpu_offload`). Host: (W + 16) P/N + W x largest.
            dev.update(params=W * e["flat"], grads=W * largest)
            # With gradient accumulation DeepSpeed also keeps, in host memory and from step to
            # step, whole W-byte gradients of the parameters overlapping the partition
            # (`accumulated_grads_in_cpu` in stage_1_and_2.py).
            buffers = W * e["overlap"] if grad_accum > 1 else 0
            host.update(params=W * part, grads=4 * part + buffers + W * largest, optim=12 * part)
        else:
            # zero3-offload: with offload_optimizer, DeepSpeed allocates the gradient partition
            # buffer in host memory (stage3.py), beside the fp32 gradient the CPU optimizer
            # steps with; the device keeps no model state between layers (24P/N in fp32, 20P/N
            # with 16-bit weights and gradients: lesson 03 measures the fp32 case).
            host.update(params=W * part, grads=(W + 4) * part, optim=12 * part)
    return {"device": dev, "host": host}


def activation_bytes(precision: str, layers, hidden, heads, seq_len, batch_size,
                     checkpointing: bool) -> float:
    """Activations kept for backward by a GPT-style stack, per rank and micro-batch (Korthikanti
    et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", table 2):
    s*b*h*(34 + 5*a*s/h) bytes per layer with 16-bit activations; fp32 roughly doubles it.
    Full checkpointing keeps each layer's input (2*s*b*h) plus one layer recomputed in backward.
    Not counted: embeddings and the logits of the loss (s*b*vocab)."""
    if batch_size is None:
        return 0.0
    s, b, h, a = seq_len, batch_size, hidden, heads
    scale = 1 if precision == "mixed" else 2
    per_layer = s * b * h * (34 + 5 * a * s / h) * scale
    if checkpointing:
        return layers * 2 * s * b * h * scale + per_layer
    return layers * per_layer


def transient_bytes(P: int, N: int, strategy: str, precision: str, accounting: str, *,
                    shapes=None, rank: int = 0, layers=None, reuse_distance=1e9) -> float:
    """Device bytes that exist for part of a step only (the most at any one moment).

    Paper: gathered parameters. grad-op keeps the whole model from forward to backward; the
    per-layer strategies hold the layer in use + one prefetched (when the layer count is known).
    Library, DeepSpeed (measured by 03-deepspeed/zero_offload.py, the tests compare):
    - without offload, the optimizer step of every stage flattens the gradient partition into a
      new fp32 tensor, the master's .grad during the step (`stage_1_and_2.py` step,
      `stage3.py` _prepare_fp32_grad_for_sub_group): 4 bytes per partition element, in fp32 and
      in mixed precision (a W-byte flattened copy it is cast from lives for an instant before,
      not counted); with offload the master's .grad is a host buffer kept from step to step;
    - ZeRO-3 keeps a parameter gathered after forward when its next use (in backward) comes
      within `stage3_max_reuse_distance` R elements (1e9 in the course's configs). The next use of
      the element x elements from the end of the model is about 2x elements away, so at the end
      of forward the last R/2 elements are still gathered: W x min(P, R/2) (the whole model of
      the lessons, measured; above R/2 an estimate to the granularity of a module). Backward
      has released them by the time the step makes its copy: the most of the two.
    FSDP2 in library accounting: as the paper."""
    W = 2 if precision == "mixed" else 4
    if accounting == "library" and strategy.startswith("zero"):
        part = held_elements(P, N, N, shapes, rank, exact=True)[
            "zero3" if strategy.startswith("zero3") else "part12"]
        copy = 0 if strategy.endswith("offload") else 4 * part
        gathered = W * min(P, reuse_distance / 2) if strategy.startswith("zero3") else 0
        return max(copy, gathered)
    if strategy == "fsdp-grad-op":
        return W * P
    if strategy in SHARDS_PARAMS and layers:
        return 2 * W * P / layers
    return 0.0


def estimate(params: int, world: int, strategy: str, precision: str = "fp32",
             accounting: str = "paper", *, shard_size=None, shapes=None, rank: int = 0,
             tensors=None, layers=None, hidden=None, heads=None, seq_len=None, batch_size=None,
             activation_checkpointing: bool = False, grad_accum: int = 1,
             largest_param=None, reuse_distance=1e9) -> dict:
    """Per-rank bytes with the keys of --json-out (params/grads/optim are on the GPU)."""
    S = shard_size or math.gcd(world, 8)  # one node of 8 GPUs when the world allows it
    if tensors is None:
        tensors = len(shapes) if shapes else 0
    if largest_param is None:
        largest_param = max(math.prod(s) for s in shapes) if shapes else 0
    states = model_states(params, world, strategy, precision, accounting, S=S, shapes=shapes,
                          rank=rank, tensors=tensors, grad_accum=grad_accum,
                          largest=largest_param)
    dev, host = states["device"], states["host"]
    transient = transient_bytes(params, world, strategy, precision, accounting, shapes=shapes,
                                rank=rank, layers=layers, reuse_distance=reuse_distance)
    act = activation_bytes(precision, layers, hidden, heads, seq_len, batch_size,
                           activation_checkpointing)
    out = {"params_bytes": dev["params"], "grads_bytes": dev["grads"], "optim_bytes": dev["optim"],
           "activations_bytes": act, "transient_bytes": transient}
    out["total_bytes"] = sum(out.values())
    out["host_bytes"] = sum(host.values())
    out = {k: round(v) for k, v in out.items()}
    out["host"] = {f"{k}_bytes": round(v) for k, v in host.items()}
    return out


# --------------------------------------------------------------------------------------------------
# Command line


def parse_count(text: str):
    """'7e9', '7B', '1.5e9', '335M' or a preset name -> (parameters, preset or None)."""
    key = text.strip().lower()
    if key in PRESETS:
        return PRESETS[key][0], key
    m = re.fullmatch(r"(-?[0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmbt]?)", key)
    if not m:
        fail(f"--params {text!r} is neither a number (7e9, 1.5B) nor a preset: "
             f"{', '.join(PRESETS)}")
    value = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}[m.group(2)]
    if value < 1:
        fail(f"--params must be a positive number of parameters (at least 1), got {text!r}")
    return round(value), None


def parse_shapes(text: str) -> list:
    """'30x16,30,25x30' -> [(30, 16), (30,), (25, 30)]; '1' is a scalar-sized tensor."""
    shapes = []
    for item in text.split(","):
        if not re.fullmatch(r"\s*\d+(x\d+)*\s*", item) or any(
                int(d) < 1 for d in item.split("x")):
            fail(f"--shapes: cannot read {item!r}: write each tensor as dims joined by x, "
                 "e.g. --shapes 30x16,30")
        shapes.append(tuple(int(d) for d in item.split("x")))
    return shapes


def parse_args(argv=None):
    p = cli.parser(__doc__)
    p.add_argument("--params", help="parameter count (7e9, 1.5B) or a preset: "
                   + ", ".join(PRESETS))
    p.add_argument("--world-size", type=int, default=1, help="data-parallel ranks (GPUs) N")
    p.add_argument("--strategy", choices=list(STRATEGIES), default="ddp")
    p.add_argument("--precision", choices=["fp32", "mixed"], default="fp32",
                   help="mixed: bf16/fp16 weights and gradients, fp32 master weights and Adam")
    p.add_argument("--accounting", choices=["paper", "library"], default="paper",
                   help="paper: the ZeRO paper's formulas; library: what DeepSpeed 0.19 / FSDP2 / "
                        "torch DDP hold (fp32 master in ZeRO fp32, padding, Adam step counters)")
    p.add_argument("--shard-size", type=int, help="fsdp-hybrid: ranks per shard group S "
                   "(default: gcd(N, 8), one node of 8 GPUs when N allows it)")
    p.add_argument("--shapes", help="library: the parameter shapes, e.g. 30x16,30,25x30: every "
                   "rank's bytes exactly, uneven shards included (sets --params)")
    p.add_argument("--param-tensors", type=int, help="library: number of parameter tensors, for "
                   "torch Adam's 4-byte step counters (default: from --shapes, else 0)")
    p.add_argument("--grad-accum", type=int, default=1, help="library: micro-steps per optimizer "
                   "step (above 1, zero2-offload keeps host buffers for the whole gradients of "
                   "the parameters overlapping its partition)")
    p.add_argument("--largest-param", metavar="N", help="library: elements "
                   "of the largest parameter tensor, for zero2-offload's two gradient buffers of "
                   "that size (default: from --shapes, else not counted)")
    p.add_argument("--reuse-distance", type=float, default=1e9, help="library: ZeRO-3's "
                   "stage3_max_reuse_distance (default 1e9, the course's configs): the last R/2 "
                   "parameter elements stay gathered from forward to backward")
    p.add_argument("--layers", type=int, help="transformer layers (activations; presets set it)")
    p.add_argument("--hidden", type=int, help="hidden size h")
    p.add_argument("--heads", type=int, help="attention heads a (default h/128)")
    p.add_argument("--seq-len", type=int, help="sequence length s")
    p.add_argument("--batch-size", type=int, help="sequences per rank per micro-step b: "
                   "activations are counted when given")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="keep only each layer's input; recompute the layer in backward")
    p.add_argument("--compare", action="store_true", help="every strategy side by side")
    p.add_argument("--fits", type=float, metavar="GB", help="instead of one model: for each "
                   "strategy, the largest model whose model states fit in GB (1e9 bytes) per GPU "
                   "at --world-size, in fp32 and in mixed precision (paper accounting)")
    p.add_argument("--json-out", type=Path, help="write the estimate(s) here as JSON")
    args = p.parse_args(argv)

    args.shape_list = parse_shapes(args.shapes) if args.shapes else None
    if args.fits is not None:
        if args.fits <= 0:
            fail(f"--fits must be a positive number of GB, got {args.fits}")
        if args.params is not None or args.shapes is not None:
            fail("--fits finds the largest model itself: leave out --params and --shapes")
        if args.accounting != "paper":
            fail("--fits uses the paper's formulas (linear in P): leave out --accounting")
        if args.world_size < 1:
            fail(f"--world-size must be at least 1, got {args.world_size}")
        return args
    if args.params is None and args.shape_list is None:
        fail("give --params (a number or a preset) or --shapes")
    preset = None
    if args.params is not None:
        args.P, preset = parse_count(args.params)
    if args.shape_list is not None:
        total = sum(math.prod(s) for s in args.shape_list)
        if args.params is not None and total != args.P:
            fail(f"--shapes add up to {total:,} parameters but --params says {args.P:,}")
        args.P = total
    args.preset = preset
    if args.world_size < 1:
        fail(f"--world-size must be at least 1, got {args.world_size}")
    if args.shard_size is not None and (args.shard_size < 1 or args.world_size % args.shard_size):
        fail(f"--shard-size {args.shard_size} must be >= 1 and divide --world-size "
             f"{args.world_size}: the mesh is (world / shard-size, shard-size)")
    if args.largest_param is not None:
        if args.accounting != "library":
            fail("--largest-param describes what DeepSpeed holds: add --accounting library")
        args.largest_param, named = parse_count(args.largest_param)
        if named or args.largest_param > args.P:
            fail(f"--largest-param must be a number of elements up to --params {args.P:,}")
    if args.reuse_distance < 0:
        fail(f"--reuse-distance must be >= 0, got {args.reuse_distance:g}")
    if args.param_tensors is not None and args.param_tensors < 0:
        fail(f"--param-tensors must be >= 0, got {args.param_tensors}")
    if (args.shape_list or args.param_tensors is not None) and args.accounting != "library":
        fail("--shapes and --param-tensors describe what the libraries hold: add "
             "--accounting library")
    # Transformer shape: a preset fills in what the flags leave out.
    if preset and PRESETS[preset][1] is not None:
        for name, value in zip(("layers", "hidden", "heads", "seq_len"), PRESETS[preset][1:5]):
            if getattr(args, name) is None:
                setattr(args, name, value)
    if args.hidden and args.heads is None:
        args.heads = max(1, args.hidden // 128)
    for name in ("layers", "hidden", "heads", "seq_len", "batch_size", "grad_accum"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    needed = ("layers", "hidden", "seq_len")
    if args.batch_size is not None and any(getattr(args, n) is None for n in needed):
        missing = [f"--{n.replace('_', '-')}" for n in needed if getattr(args, n) is None]
        fail(f"activations for --batch-size need the transformer's shape: give "
             f"{', '.join(missing)} (or a transformer preset)")
    if args.activation_checkpointing and args.batch_size is None:
        fail("--activation-checkpointing changes activations: give --batch-size too")
    return args


def run_estimate(args, strategy: str, rank: int = 0) -> dict:
    return estimate(args.P, args.world_size, strategy, args.precision, args.accounting,
                    shard_size=args.shard_size, shapes=args.shape_list, rank=rank,
                    tensors=args.param_tensors, layers=args.layers, hidden=args.hidden,
                    heads=args.heads, seq_len=args.seq_len, batch_size=args.batch_size,
                    activation_checkpointing=args.activation_checkpointing,
                    grad_accum=args.grad_accum,
                    largest_param=args.largest_param, reuse_distance=args.reuse_distance)


def header(args) -> str:
    name = f" ({args.preset}: {PRESETS[args.preset][5]})" if args.preset else ""
    prec = "fp32 Adam" if args.precision == "fp32" else "mixed precision Adam"
    act = ""
    if args.batch_size:
        act = (f" | activations: {args.layers} layers, h {args.hidden}, {args.heads} heads, "
               f"seq {args.seq_len}, batch {args.batch_size}/rank"
               f"{', checkpointed' if args.activation_checkpointing else ''}")
    accum = f" | grad-accum {args.grad_accum}" if args.grad_accum > 1 else ""
    return (f"P = {args.P:,} parameters{name} | world {args.world_size} | {prec} | accounting "
            f"{args.accounting}{accum}{act}")


def table(rows: list, P: int, in_bytes: bool) -> list[str]:
    """rows: (label, estimate). Bytes (exact) for small models, else GB."""
    unit, fmt = (1, "{:>10,}") if in_bytes else (1e9, "{:>10.2f}")
    cols = ("params", "grads", "optim", "activ.", "transient", "total", "host")
    lines = [f"{'':15}" + "".join(f"{c:>10}" for c in cols) + f"{'bytes/P':>9}"]
    for label, est in rows:
        vals = [est[k] for k in KEYS]
        lines.append(f"{label:15}" + "".join(fmt.format(v / unit if unit != 1 else v)
                                             for v in vals)
                     + f"{(est['total_bytes'] + est['host_bytes']) / P:>9.2f}")
    return lines


def largest_models(gb: float, world: int, shard_size=None) -> list[str]:
    """Per strategy, bytes per parameter on each GPU and the largest P whose model states fit in
    `gb` GB per GPU: weights, gradients and Adam, before activations and buffers. The formulas
    are linear in P, so the largest P is gb / (bytes per parameter)."""
    S = shard_size or math.gcd(world, 8)
    lines = [f"largest model whose model states fit in {gb:g} GB per GPU | world {world} | paper "
             f"accounting | fsdp-hybrid: shard groups of {S} | before activations, buffers and "
             "fragmentation",
             f"{'':15}{'fp32 B/param':>13}{'largest P':>11}{'mixed B/param':>15}{'largest P':>11}"
             "   host B/param (fp32 / mixed)"]
    for strategy in STRATEGIES:
        row, host = f"{strategy:15}", []
        for precision, width in (("fp32", 13), ("mixed", 15)):
            est = estimate(10**9, world, strategy, precision, "paper", shard_size=shard_size)
            # total_bytes: what the GPU holds, the full weights grad-op keeps from forward to
            # backward included
            per_param = est["total_bytes"] / 10**9
            largest = "no limit" if per_param == 0 else f"{gb / per_param:.1f}B"
            row += f"{per_param:>{width}.2f}{largest:>11}"
            host.append(f"{est['host_bytes'] / 10**9:.2f}")
        lines.append(row + ("   " + " / ".join(host) if "offload" in strategy else ""))
    return lines


def main(argv=None):
    args = parse_args(argv)
    if args.fits is not None:
        print("\n".join(largest_models(args.fits, args.world_size, args.shard_size)))
        return
    strategies = list(STRATEGIES) if args.compare else [args.strategy]
    in_bytes = args.P < 1e7  # a toy model: show every byte
    print(header(args) + (" | bytes per rank" if in_bytes else " | GB = 1e9 bytes, per GPU"))
    out = {"params": args.P, "preset": args.preset, "world_size": args.world_size,
           "precision": args.precision, "accounting": args.accounting,
           "grad_accum": args.grad_accum,
           "shard_size": args.shard_size or math.gcd(args.world_size, 8)}
    if args.shape_list is not None:
        # Every rank: FSDP2's uneven shards give different ranks different bytes.
        rows, per_strategy = [], {}
        for strategy in strategies:
            per_rank = [run_estimate(args, strategy, r) for r in range(args.world_size)]
            per_strategy[strategy] = per_rank
            rows += [(f"{strategy} r{r}" if len(strategies) > 1 else f"rank {r}", est)
                     for r, est in enumerate(per_rank)]
        print("\n".join(table(rows, args.P, in_bytes)))
        out["shapes"] = [list(s) for s in args.shape_list]
        out.update({"per_rank": per_strategy[strategies[0]]} if not args.compare else
                   {"strategies": {s: {"per_rank": v} for s, v in per_strategy.items()}})
    else:
        ests = {s: run_estimate(args, s) for s in strategies}
        print("\n".join(table(list(ests.items()), args.P, in_bytes)))
        if args.accounting == "library" and "zero2-offload" in strategies \
                and args.largest_param is None:
            print("zero2-offload: without --largest-param (or --shapes) its two gradient "
                  "buffers the size of the largest parameter are not counted")
        if args.compare:
            out["strategies"] = ests
        else:
            out.update(strategy=args.strategy, **ests[args.strategy])
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.json_out.with_name(args.json_out.name + ".tmp")
        tmp.write_text(json.dumps(out, indent=1))
        os.replace(tmp, args.json_out)


if __name__ == "__main__":
    main()

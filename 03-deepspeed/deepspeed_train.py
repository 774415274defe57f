"""DeepSpeed ZeRO stages 0-3 and offload on one small GPT: engine.backward / engine.step,
checkpoints with automatic resume, preemption handling, fp32 export and per-rank memory.

Launch (from the repository root):
    deepspeed --num_gpus 2 03-deepspeed/deepspeed_train.py \
        --deepspeed_config 03-deepspeed/configs/zero2_config.json        # 2 ranks, one node
    python 03-deepspeed/deepspeed_train.py --deepspeed_config 03-deepspeed/configs/zero0_config.json
    torchrun --nproc_per_node=2 03-deepspeed/deepspeed_train.py --deepspeed_config ...
    srun -n 2 python 03-deepspeed/deepspeed_train.py --deepspeed_config ...   # SLURM
    deepspeed --num_gpus 8 03-deepspeed/deepspeed_train.py \
        --deepspeed_config 03-deepspeed/configs/zero3_config.json --layers 12 --width 768

Expected output (deepspeed --num_gpus 2 ... zero2_config.json, 2-core AMD EPYC CPU (shared),
torch 2.14.1, deepspeed 0.19.8, gloo; DeepSpeed's own log lines omitted, see the README):
    note: running on cpu: the config's bf16 section is turned off (fp32); --precision bf16 keeps it
    zero2 | world 2 | cpu fp32 | 106,112 parameters | global batch 16 (2 ranks x 8 x accum 1)
    step    1/40 | loss 4.1879 | lr 0.00000
    step   10/40 | loss 3.6495 | lr 0.01000
    ...
    step   40/40 | loss 1.1881 | lr 0.01000
    done: 40 steps, 527 samples/s
    rank 0 holds: params 414.5 KiB | grads 207.2 KiB | optimizer 621.8 KiB (fp32 master 207.2 KiB)

What a DeepSpeed engine does each optimizer step (the config's "stage" picks the sharding):
    loss = engine(x, y)      forward; ZeRO-3 all-gathers each layer's parameters just in time
    engine.backward(loss)    scales by 1/grad_accum; stage 0/1 keep full gradients until the last
                             micro-step, stage 2/3 reduce each bucket to the rank owning it
    engine.step()            on the last micro-step only: clip, step the optimizer on this rank's
                             shard, all-gather the updated parameters (stage 1/2), LR schedule
"""

import argparse
import gc
import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

# Preemption: SLURM, torchrun and the deepspeed launcher all send SIGTERM. The handler only sets
# this flag; the training loop agrees on it across ranks, checkpoints and exits. It is installed
# before the heavy imports below because the launchers also SIGTERM every rank when one rank
# exits: a rank still importing torch must survive that long enough to print its own error.
SIGTERM_RECEIVED = threading.Event()
if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda signum, frame: SIGTERM_RECEIVED.set())

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

try:
    from tqdm import tqdm
except ImportError:  # progress bars are optional
    tqdm = None

HERE = Path(__file__).resolve().parent
VOCAB, SEQ_LEN = 64, 32


def fail(msg: str) -> None:
    """Bad input: one line on stderr and exit status 2, on every rank, before any collective."""
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID"))
    prefix = f"[rank {rank}] " if rank is not None else ""
    print(f"{prefix}error: {msg}", file=sys.stderr, flush=True)
    sys.exit(2)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.error = fail  # argparse's own errors too: one line, exit 2
    p.add_argument("--deepspeed_config", "--deepspeed-config", type=Path,
                   default=HERE / "configs" / "zero2_config.json", help="DeepSpeed JSON config")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps (total, resume included)")
    p.add_argument("--batch-size", type=int,
                   help="samples per rank per micro-step (overrides the config's "
                        "train_micro_batch_size_per_gpu)")
    p.add_argument("--grad-accum", type=int,
                   help="micro-steps per optimizer step (overrides gradient_accumulation_steps)")
    p.add_argument("--lr", type=float, help="peak LR (overrides the optimizer's and scheduler's)")
    p.add_argument("--precision", choices=["auto", "fp32", "bf16", "fp16"], default="auto",
                   help="auto: the config's bf16/fp16 section on CUDA, fp32 on CPU")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks")
    p.add_argument("--width", type=int, default=64, help="model width (a multiple of 16)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--timeout-s", type=float, default=120, help="collective timeout")
    p.add_argument("--ckpt-dir", type=Path, help="checkpoint here and resume from the newest")
    p.add_argument("--ckpt-every", type=int, default=0, help="checkpoint every K steps (0: end)")
    p.add_argument("--fail-at-step", type=int, default=0,
                   help="fault injection: --fail-rank raises once at this step (needs --ckpt-dir)")
    p.add_argument("--fail-rank", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--metrics-out", type=Path, help="rank 0 writes the run's metrics JSON here")
    p.add_argument("--export", type=Path, help="rank 0 writes the plain fp32 state_dict here")
    p.add_argument("--export-source", choices=["engine", "checkpoint"], default="engine",
                   help="gather the fp32 weights from the live engine, or convert the final "
                        "checkpoint with DeepSpeed's zero_to_fp32 (needs --ckpt-dir)")
    # The deepspeed launcher appends --local_rank=N; the rank is read from the environment.
    p.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "grad_accum", "layers", "width", "log_every"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.width % 16:
        fail(f"--width must be a multiple of 16 (the head size), got {args.width}")
    if (args.lr is not None and args.lr <= 0) or args.timeout_s <= 0:
        fail(f"--lr and --timeout-s must be positive, got {args.lr} and {args.timeout_s}")
    if args.ckpt_every < 0:
        fail(f"--ckpt-every must be >= 0, got {args.ckpt_every}")
    if args.fail_at_step and not args.ckpt_dir:
        fail("--fail-at-step needs --ckpt-dir (the restart resumes from it)")
    if args.ckpt_dir and args.ckpt_dir.exists() and not args.ckpt_dir.is_dir():
        fail(f"--ckpt-dir {args.ckpt_dir} is a file, not a directory of checkpoints")
    if args.export_source == "checkpoint" and not (args.export and args.ckpt_dir):
        fail("--export-source checkpoint needs --export and --ckpt-dir")
    return args


# --------------------------------------------------------------------------------------------------
# The DeepSpeed config: read and checked here, before deepspeed is imported (its import logs and
# picks an accelerator) and before any collective, so a bad file is one line and exit 2 everywhere.


def env_world_size() -> int:
    """World size from torchrun / the deepspeed launcher, or SLURM under srun, or 1."""
    env = os.environ
    return int(env.get("WORLD_SIZE", env.get("SLURM_STEP_NUM_TASKS", env.get("SLURM_NTASKS", 1))))


def load_config(args, world: int) -> dict:
    path = args.deepspeed_config
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        fail(f"--deepspeed_config {path}: file not found")
    except (OSError, UnicodeDecodeError) as exc:
        fail(f"--deepspeed_config {path}: cannot read it ({exc})")
    except json.JSONDecodeError as exc:
        fail(f"--deepspeed_config {path}: malformed JSON: {exc}")
    if not isinstance(config, dict):
        fail(f"{path}: the top level must be a JSON object, got {type(config).__name__}")

    zero = config.setdefault("zero_optimization", {})
    stage = zero.get("stage", 0) if isinstance(zero, dict) else None
    if stage not in (0, 1, 2, 3):
        fail(f"{path}: zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}")

    # One config serves every world size: the flags override the per-rank numbers and the global
    # batch is derived. A train_batch_size written in the file must agree with them.
    def positive_int(key, default):
        value = config.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            fail(f"{path}: {key} must be a positive integer, got {value!r}")
        return value

    micro = args.batch_size or positive_int("train_micro_batch_size_per_gpu", 8)
    accum = args.grad_accum or positive_int("gradient_accumulation_steps", 1)
    derived = micro * accum * world
    overridden = args.batch_size or args.grad_accum
    if "train_batch_size" in config and not overridden \
            and positive_int("train_batch_size", None) != derived:
        fail(f"{path}: train_batch_size {config['train_batch_size']} != "
             f"train_micro_batch_size_per_gpu {micro} x gradient_accumulation_steps {accum} "
             f"x world size {world} = {derived}")
    config.update(train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=accum,
                  train_batch_size=derived)

    for key in ("offload_optimizer", "offload_param"):
        offload = zero.get(key) or {}
        device = offload.get("device", "none")
        if device not in ("none", "cpu", "nvme"):
            fail(f"{path}: zero_optimization.{key}.device must be none, cpu or nvme, "
                 f"got {device!r}")
        if device == "nvme" and not Path(offload.get("nvme_path", "")).is_dir():
            fail(f"{path}: zero_optimization.{key}.nvme_path {offload.get('nvme_path')!r} is not "
                 "a directory: set it to a folder on a local NVMe drive")
        if key == "offload_param" and device != "none" and stage != 3:
            fail(f"{path}: zero_optimization.offload_param needs stage 3, got stage {stage}")
    opt_params = config.get("optimizer", {}).get("params", {})
    if offloaded(config, "offload_optimizer") and opt_params.get("torch_adam"):
        fail(f"{path}: offload_optimizer steps on the CPU with DeepSpeedCPUAdam: remove "
             "optimizer.params.torch_adam")
    if args.lr is not None:
        opt_params["lr"] = args.lr
        sched = config.get("scheduler", {}).get("params", {})
        if "warmup_max_lr" in sched:
            sched["warmup_max_lr"] = args.lr
    return config


def offloaded(config: dict, key: str) -> bool:
    return (config["zero_optimization"].get(key) or {}).get("device", "none") != "none"


def set_precision(config: dict, precision: str, device, rank: int) -> str:
    """Resolve --precision against the config's bf16 / fp16 sections; return the dtype used.

    The configs enable bf16 for GPUs. On a CPU, auto turns it off (fp32) with a note, because the
    lesson's tests compare every stage with an fp32 one-process run.
    """
    wanted = {k: bool((config.get(k) or {}).get("enabled")) for k in ("bf16", "fp16")}
    if wanted["bf16"] and wanted["fp16"]:
        fail("the config enables both bf16 and fp16: choose one")
    if precision == "auto":
        if device.type == "cpu":
            if any(wanted.values()) and rank == 0:
                on = "bf16" if wanted["bf16"] else "fp16"
                print(f"note: running on cpu: the config's {on} section is turned off (fp32); "
                      f"--precision {on} keeps it", flush=True)
            precision = "fp32"
        else:
            precision = "bf16" if wanted["bf16"] else "fp16" if wanted["fp16"] else "fp32"
    if precision == "fp16" and device.type != "cuda":
        fail("--precision fp16 needs CUDA (dynamic loss scaling); use bf16 or fp32 on CPU")
    for key in ("bf16", "fp16"):
        config.setdefault(key, {})["enabled"] = precision == key
    return precision


# --------------------------------------------------------------------------------------------------
# Set-up: the same lines run under python, torchrun, srun and the deepspeed launcher


def init_distributed(device_arg: str, timeout_s: float):
    """Return (rank, world_size, device, deepspeed) with the process group started.

    The deepspeed launcher and torchrun set RANK / LOCAL_RANK / WORLD_SIZE / MASTER_ADDR /
    MASTER_PORT; under `srun python` we translate SLURM's variables, and deepspeed.init_distributed
    reads them. With plain `python` we build a one-process gloo/NCCL group on a HashStore first
    (no port needed), and DeepSpeed adopts that group.
    """
    env = os.environ
    if "RANK" not in env and "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env:
        env["RANK"], env["WORLD_SIZE"] = env["SLURM_PROCID"], env["SLURM_STEP_NUM_TASKS"]
        env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
        if "MASTER_ADDR" not in env:  # the first host of the step's allocation
            nodes = env.get("SLURM_STEP_NODELIST", env.get("SLURM_JOB_NODELIST", "127.0.0.1"))
            out = subprocess.run(["scontrol", "show", "hostnames", nodes], capture_output=True,
                                 text=True, check=False).stdout.split()
            env["MASTER_ADDR"] = out[0] if out else nodes
        env.setdefault("MASTER_PORT", str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000))
    rank, world = int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1))
    local_rank = int(env.get("LOCAL_RANK", 0))

    if device_arg == "cuda" and not torch.cuda.is_available():
        fail("--device cuda was asked for, but CUDA is not available on this machine")
    if device_arg == "cuda" or (device_arg == "auto" and torch.cuda.is_available()):
        if local_rank >= torch.cuda.device_count():
            fail(f"local rank {local_rank} has no GPU: only {torch.cuda.device_count()} visible")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")

    # DeepSpeed picks its accelerator when first imported: tell it which one we chose.
    env["DS_ACCELERATOR"] = device.type
    import logging

    import deepspeed
    deepspeed.utils.logger.setLevel(logging.WARNING)  # keep the engine's config dump out

    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s)
    if "RANK" not in env:  # plain `python script.py`: a group of one
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout)
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")  # DeepSpeed reads these too
    deepspeed.init_distributed(dist_backend=backend, timeout=timeout)
    return rank, world, device, deepspeed


# --------------------------------------------------------------------------------------------------
# Model and data: a GPT with the output layer tied to the token embedding


class Attention(nn.Module):
    """Causal self-attention. q, k and v are separate layers and the head count is read from their
    width, so a tensor-parallel split of their columns (deepspeed_inference.py) just works."""

    def __init__(self, width: int, head_dim: int = 16):
        super().__init__()
        self.head_dim = head_dim
        # No bias on k: it adds q.b_k to every score of a query's row, which softmax ignores, so
        # its gradient is zero in exact arithmetic; Adam would turn the rounding noise left in
        # that gradient into full-size random steps, different on every parallel layout.
        self.q, self.v = nn.Linear(width, width), nn.Linear(width, width)
        self.k = nn.Linear(width, width, bias=False)
        self.proj = nn.Linear(width, width)

    def forward(self, x):
        b, t, _ = x.shape
        # (B, T, H) -> (B, heads, T, head_dim)
        q, k, v = (lin(x).view(b, t, -1, self.head_dim).transpose(1, 2)
                   for lin in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(width), Attention(width)
        self.ln2, self.mlp = nn.LayerNorm(width), MLP(width)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token + position embeddings, pre-norm blocks, an output layer sharing the embedding."""

    def __init__(self, layers=2, width=64, vocab=VOCAB, seq_len=SEQ_LEN):
        super().__init__()
        # GPT-2's N(0, 0.02) embeddings (torch's default N(0, 1) would make the tied output
        # layer's first logits huge). Passed in as `_weight` because under ZeRO-3's zero.Init a
        # layer's parameters are partitioned as soon as it is built: no in-place init afterwards.
        self.tok = nn.Embedding(vocab, width, _weight=0.02 * torch.randn(vocab, width))
        self.pos = nn.Embedding(seq_len, width, _weight=0.02 * torch.randn(seq_len, width))
        self.blocks = nn.ModuleList(Block(width) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied: one tensor, two names in the state_dict

    def forward(self, idx, targets=None):
        # idx: (B, T) token ids -> logits (B, T, vocab)
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def global_batch(seed: int, step: int, size: int, vocab: int = VOCAB, seq_len: int = SEQ_LEN):
    """The whole global batch of optimizer step `step`: a pure function of (seed, step).

    Each row walks a fixed random successor table (the 'teacher', the same for every step), with
    one token in ten replaced by a random one, so the task is learnable but not trivial. Every
    rank builds the same tensor and keeps only its own rows: a run with D ranks and batch B sees
    exactly the samples of a one-process run with batch D*B. Returns inputs and targets (B, T).
    """
    successor = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed + 12345))
    g = torch.Generator().manual_seed(seed * 100003 + step)
    tokens = torch.empty(size, seq_len + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(vocab, (size,), generator=g)
    noise = torch.randint(vocab, (size, seq_len), generator=g)
    keep = torch.rand(size, seq_len, generator=g) >= 0.1
    for t in range(seq_len):
        tokens[:, t + 1] = torch.where(keep[:, t], successor[tokens[:, t]], noise[:, t])
    return tokens[:, :-1], tokens[:, 1:]


# --------------------------------------------------------------------------------------------------
# What each rank holds (the `per_rank` metrics): bytes of the tensors DeepSpeed keeps, by role


def held_bytes(tensors) -> int:
    """Bytes of memory the tensors cover, each byte once: views into one flat buffer (how
    DeepSpeed stores parameters and gradients) are merged, so nothing is counted twice."""
    spans = {}
    for t in tensors:
        if torch.is_tensor(t) and t.numel():
            start = t.storage_offset() * t.element_size()
            spans.setdefault(t.untyped_storage().data_ptr(), []).append(
                (start, start + t.numel() * t.element_size()))
    total = 0
    for intervals in spans.values():
        intervals.sort()
        lo, hi = intervals[0]
        for a, b in intervals[1:]:
            if a > hi:
                total, lo, hi = total + hi - lo, a, b
            else:
                hi = max(hi, b)
        total += hi - lo
    return total


def tensors_in(obj):
    """Every tensor in a (nested) list / tuple / dict, e.g. DeepSpeed's per-group containers."""
    if torch.is_tensor(obj):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from tensors_in(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from tensors_in(item)


def memory_census(engine, model, config) -> dict:
    """Bytes of model state this rank holds now, by role, read from the engine's own tensors.

    weights: the module's parameters (stages 0-2: full, in DeepSpeed's flat buffer including its
      alignment padding) or, at stage 3, this rank's partition of each (`ds_tensor`).
    master: the fp32 copy the optimizer steps. DeepSpeed's ZeRO 1-3 keep one for their partition
      even when training in fp32; at stage 0 in fp32 the optimizer steps the weights themselves.
    moments: Adam's exp_avg and exp_avg_sq (the 0-dim `step` counters are not counted).
    grads: the module's .grad plus the gradient partitions ZeRO accumulates into.
    host: the part of these that offload keeps in CPU memory (on a CPU-only machine host and
      device are the same memory; the split follows where offload puts each tensor).
    Attribute names are DeepSpeed 0.19's; the lesson's tests check the sums against the formulas.
    """
    opt = engine.optimizer
    inner = getattr(opt, "optimizer", opt)  # the torch / DeepSpeedCPUAdam optimizer that steps
    params = list(model.parameters())
    weights = [p.data for p in params] + [getattr(p, "ds_tensor", None) for p in params]
    for name in ("bit16_groups_flat", "fp16_partitioned_groups_flat"):
        weights += tensors_in(getattr(opt, name, None))
    master = list(tensors_in(getattr(opt, "single_partition_of_fp32_groups", None)
                             or getattr(opt, "fp32_partitioned_groups_flat", None)
                             or [p for group in inner.param_groups for p in group["params"]]))
    if held_bytes(master + weights) == held_bytes(weights):
        master = []  # the optimizer steps the module's own parameters
    moments = [v for state in inner.state.values() for v in state.values()
               if torch.is_tensor(v) and v.dim() > 0]
    grads = [p.grad for p in params] + [getattr(p, "grad_accum", None) for p in params]
    grads += [m.grad for m in master]
    for name in ("averaged_gradients", "all_grad_tensors", "grad_partitions_flat_buffer",
                 "fp32_groups_gradients_flat"):
        grads += tensors_in(getattr(opt, name, None))
    on_host = []
    if offloaded(config, "offload_optimizer"):
        on_host += master + moments + [m.grad for m in master]
    if offloaded(config, "offload_param"):
        on_host += [getattr(p, "ds_tensor", None) for p in params]
    return {"param_bytes": held_bytes(weights), "grad_bytes": held_bytes(grads),
            "master_bytes": held_bytes(master), "optim_bytes": held_bytes(master + moments),
            "host_bytes": held_bytes(on_host)}


# --------------------------------------------------------------------------------------------------
# Checkpoints: DeepSpeed writes one folder per tag (each rank its own shards); the `latest` file
# names the newest complete one, and we write it ourselves, atomically, after everybody is done.


def save_checkpoint(engine, ckpt_dir: Path, step: int, rank: int) -> None:
    tag = f"step_{step:06d}"
    engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state={"step": step}, save_latest=False)
    dist.barrier()  # every rank's shards are on disk
    if rank == 0:
        tmp = ckpt_dir / ".latest.tmp"
        tmp.write_text(tag)
        os.replace(tmp, ckpt_dir / "latest")  # atomic: a kill leaves the previous `latest`
    dist.barrier()


def fp32_state_dict(engine, model, deepspeed, args) -> dict:
    """Consolidated fp32 weights on CPU, keyed like the plain model's state_dict (tied weights
    appear under both names). Every rank must call it: at stage 3 each gather is a collective."""
    if args.export_source == "checkpoint":
        if not engine.zero_optimization():  # stage 0 checkpoints hold the whole module
            tag = (args.ckpt_dir / "latest").read_text().strip()
            path = args.ckpt_dir / tag / "mp_rank_00_model_states.pt"
            state = torch.load(path, map_location="cpu", weights_only=False)["module"]
            return {k: v.float() for k, v in state.items()}
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        return get_fp32_state_dict_from_zero_checkpoint(str(args.ckpt_dir)) if engine.global_rank \
            == 0 else {}
    out, done = {}, {}
    for name, p in model.state_dict(keep_vars=True).items():
        if id(p) not in done:
            # ZeRO keeps the fp32 master in shards: gather it (stage 3: an all-gather).
            full = deepspeed.utils.safe_get_full_fp32_param(p)
            done[id(p)] = (full if full is not None else p.detach()).float().cpu().clone()
        out[name] = done[id(p)]
    return out


def main(argv=None):
    args = parse_args(argv)
    config = load_config(args, env_world_size())
    rank, world, device, deepspeed = init_distributed(args.device, args.timeout_s)
    try:
        train(args, config, rank, world, device, deepspeed)
    finally:
        # The engine lives in reference cycles (hooks, optimizer) that hold process groups: free
        # it now, not while the interpreter shuts down, then tear the groups down.
        gc.collect()
        dist.destroy_process_group()


def train(args, config, rank, world, device, deepspeed):
    precision = set_precision(config, args.precision, device, rank)
    if args.fail_at_step and args.fail_rank >= world:
        fail(f"--fail-rank {args.fail_rank} does not exist at world size {world}")
    stage = config["zero_optimization"].get("stage", 0)
    strategy = f"zero{stage}" + ("+offload" if offloaded(config, "offload_optimizer") else "")
    micro, accum = config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]
    global_bs = config["train_batch_size"]

    torch.manual_seed(args.seed)
    # ZeRO-3 partitions each parameter as soon as its layer is built, so no rank ever holds the
    # whole model; zero.Init is a no-op context for the other stages.
    with deepspeed.zero.Init(config_dict_or_path=config, enabled=stage == 3):
        model = GPT(args.layers, args.width)
    n_params = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters())
    # The engine builds the optimizer, the LR scheduler and the ZeRO partitioning from the config.
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config)

    start_step = 0
    if args.ckpt_dir:
        if rank == 0:
            args.ckpt_dir.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        if (args.ckpt_dir / "latest").exists():
            # Each rank reads its own optimizer shard; module weights, LR scheduler and step
            # counters come back too.
            _, client = engine.load_checkpoint(str(args.ckpt_dir))
            start_step = client["step"]
            if rank == 0:
                print(f"resumed from step {start_step} in {args.ckpt_dir}", flush=True)

    if rank == 0:
        print(f"{strategy} | world {world} | {device.type} {precision} | {n_params:,} parameters | "
              f"global batch {global_bs} ({world} ranks x {micro} x accum {accum})", flush=True)

    losses, per_micro, t_start, cpu_start, timed_samples = [], [], None, None, 0
    bar = tqdm(total=args.steps, initial=start_step, disable=(rank != 0) or None,
               desc="train") if tqdm else None
    for step in range(start_step, args.steps):
        if step == start_step + 1:  # the first step pays for warm-up; time the rest
            t_start, cpu_start = time.perf_counter(), time.process_time()
        if args.fail_at_step and step + 1 == args.fail_at_step and rank == args.fail_rank:
            marker = args.ckpt_dir / f"failed_once_at_step_{args.fail_at_step}"
            if not marker.exists():
                marker.touch()  # remembered, so the restarted run does not fail again
                raise RuntimeError(f"injected failure on rank {rank} at step {step + 1}")

        x_all, y_all = global_batch(args.seed, step, global_bs)
        # This rank's rows: r*B*A .. (r+1)*B*A - 1, cut into grad_accum micro-batches of B.
        rows = slice(rank * micro * accum, (rank + 1) * micro * accum)
        x_local, y_local = x_all[rows].to(device), y_all[rows].to(device)
        step_loss = torch.zeros((), device=device)
        for m in range(accum):
            loss = engine(x_local[m * micro:(m + 1) * micro], y_local[m * micro:(m + 1) * micro])
            engine.backward(loss)  # divides by grad_accum itself; reduces gradients (see top)
            if step == args.steps - 1:  # measure what each rank holds in the last step
                per_micro.append(memory_census(engine, model, config))
            engine.step()  # steps the optimizer only on the accumulation boundary
            step_loss += loss.detach().float() / accum

        # Mean loss over the global batch, and whether any rank has received SIGTERM.
        report = torch.stack([step_loss, torch.tensor(float(SIGTERM_RECEIVED.is_set()),
                                                      device=device)])
        dist.all_reduce(report, op=dist.ReduceOp.SUM)
        losses.append(report[0].item() / world)
        if step >= start_step + 1:
            timed_samples += global_bs
        done = step + 1
        if bar is not None:
            bar.update(1)
        if rank == 0 and (done % args.log_every == 0 or done in (1, args.steps)):
            msg = f"step {done:4d}/{args.steps} | loss {losses[-1]:.4f} | lr " \
                  f"{engine.get_lr()[0]:.5f}"
            (bar.write(msg) if bar is not None else print(msg, flush=True))

        preempted = report[1].item() > 0  # every rank stops at the same step
        if args.ckpt_dir and ((args.ckpt_every and done % args.ckpt_every == 0)
                              or done == args.steps or preempted):
            save_checkpoint(engine, args.ckpt_dir, done, rank)
        if preempted:
            if rank == 0:
                print(f"SIGTERM: checkpointed step {done} to {args.ckpt_dir}; exiting", flush=True)
            if bar is not None:
                bar.close()
            engine.destroy()
            return
    if bar is not None:
        bar.close()

    elapsed = time.perf_counter() - t_start if t_start else float("nan")
    samples_per_s = timed_samples / elapsed if timed_samples else float("nan")
    # CPU seconds this process spent per timed step: steadier than samples/s on a shared machine.
    timed_steps = args.steps - start_step - 1
    cpu_per_step = (time.process_time() - cpu_start) / timed_steps if timed_steps > 0 else None
    state = fp32_state_dict(engine, model, deepspeed, args) if args.export else None

    # Largest gradient footprint over the last step's micro-steps (stage 1 keeps full gradients
    # between micro-steps and only its partition after the last one).
    local = {key: max(c[key] for c in per_micro) for key in per_micro[0]} if per_micro else {}
    local["grad_bytes_per_micro_step"] = [c["grad_bytes"] for c in per_micro]
    local["peak_bytes"] = torch.cuda.max_memory_allocated(device) if device.type == "cuda" \
        else None
    local["cpu_s_per_step"] = cpu_per_step
    per_rank = [None] * world
    dist.all_gather_object(per_rank, local)
    if rank == 0:
        print(f"done: {args.steps - start_step} steps, {samples_per_s:.0f} samples/s", flush=True)
        if per_micro:
            kib = {k: v / 1024 for k, v in local.items() if isinstance(v, int)}
            print(f"rank 0 holds: params {kib['param_bytes']:.1f} KiB | grads "
                  f"{kib['grad_bytes']:.1f} KiB | optimizer {kib['optim_bytes']:.1f} KiB "
                  f"(fp32 master {kib['master_bytes']:.1f} KiB)"
                  + (f" | on host {kib['host_bytes']:.1f} KiB" if local["host_bytes"] else ""),
                  flush=True)
        if args.export:
            args.export.parent.mkdir(parents=True, exist_ok=True)
            tmp = args.export.with_suffix(".tmp")
            torch.save(state, tmp)
            os.replace(tmp, args.export)
        if args.metrics_out:
            metrics = {
                "script": "03-deepspeed/deepspeed_train.py", "strategy": strategy,
                "config": str(args.deepspeed_config), "zero_stage": stage,
                "world_size": world, "steps": args.steps, "start_step": start_step,
                "global_batch": global_bs, "micro_batch": micro, "grad_accum": accum,
                "precision": precision, "n_params": n_params, "losses": losses,
                "samples_per_s": samples_per_s, "tokens_per_s": samples_per_s * SEQ_LEN,
                "device": str(device), "torch_version": torch.__version__,
                "deepspeed_version": deepspeed.__version__, "per_rank": per_rank,
            }
            args.metrics_out.parent.mkdir(parents=True, exist_ok=True)
            args.metrics_out.write_text(json.dumps(metrics, indent=1))
    engine.destroy()  # DeepSpeed's hooks and buffers go before the process group does
    dist.barrier()  # files are complete before any rank exits


if __name__ == "__main__":
    main()

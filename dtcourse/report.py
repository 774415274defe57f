"""What a run reports: rank-0 printing, a progress bar, the bytes each rank holds, the metrics JSON
and the plain-state-dict export of the course's script contract.

    print0("step 3 | loss 2.1")                # rank 0 only
    bar = progress(args.steps, "train")         # tqdm on rank 0, a silent stand-in elsewhere
    reset_peak(device)                          # before each model of a multi-model run
    mem = held_bytes(params=model.parameters(), grads=..., optimizer=opt, device=device)
    finish(d, args, metrics(d, script=..., strategy=..., ...), state_dict)  # rank 0 writes
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path
from typing import Iterable

import torch
import torch.distributed as dist


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def print0(*args, sep: str = " ", end: str = "\n", file=None) -> None:
    """print() on rank 0 only, as one write, flushed. Ranks share a terminal (or a launcher's
    pipe): unflushed lines arrive late, and under `python -u` (the deepspeed launcher's) print()
    writes the text and its newline in two calls, so another rank's line can land between them."""
    if _rank() == 0:
        file = file or sys.stdout
        file.write(sep.join(str(a) for a in args) + end)
        file.flush()


class _Silent:
    """The progress bar of the ranks that do not print."""

    def update(self, n: int = 1) -> None: ...

    def write(self, msg: str) -> None: ...

    def close(self) -> None: ...


def progress(total: int, desc: str, *, initial: int = 0, show: bool | None = None):
    """A tqdm bar on rank 0 (or where `show`), drawn only on a terminal; `bar.write(msg)` prints a
    line without breaking it, flushed. Other ranks get an object with the same methods that does
    nothing."""
    if not (show if show is not None else _rank() == 0):
        return _Silent()
    from tqdm import tqdm

    class Bar(tqdm):
        @classmethod
        def write(cls, s, file=None, end="\n", nolock=False):
            super().write(s, file=file, end=end, nolock=nolock)
            (file or sys.stdout).flush()  # a pipe (a log, a launcher) gets the line now

    return Bar(total=total, initial=initial, desc=desc, disable=None)


# --------------------------------------------------------------------------------------------------
# Bytes each rank holds


def tensor_bytes(tensors: Iterable) -> int:
    """Bytes of the tensors this rank stores: a DTensor counts its local shard only; None is 0."""
    from torch.distributed.tensor import DTensor
    total = 0
    for t in tensors:
        if t is None:
            continue
        if isinstance(t, DTensor):
            t = t.to_local()
        total += t.numel() * t.element_size()
    return total


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list:
    """Every tensor of the optimizer's state (Adam: exp_avg, exp_avg_sq and the step counter)."""
    return [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]


def peak_bytes(device: torch.device) -> int | None:
    """CUDA's peak allocated bytes since start (or the last reset); None on CPU, which has no
    allocator statistics."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def reset_peak(device: torch.device) -> int | None:
    """Start a fresh peak-memory measurement: call it before building the next model of a run that
    trains several one after the other, once the caller holds no reference to the previous one.

    Resetting CUDA's peak counter is not enough: the previous model, its gradients and its AdamW
    state may still be alive (FSDP2 modules and DDP's reducer sit in reference cycles, which only
    the cycle collector frees), and the next peak would then include them. So: collect the
    cycles, wait for the GPU's queued work, hand the cached blocks back, then reset. Returns the
    bytes still allocated on the GPU (what the next peak starts from), None on CPU, where only
    the cycles are collected (a CPU has no allocator statistics)."""
    gc.collect()
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def held_bytes(*, params: Iterable, grads: Iterable | None = None,
               optimizer: torch.optim.Optimizer | None = None, device: torch.device) -> dict:
    """This rank's entry of the metrics' `per_rank` list."""
    params = list(params)
    if grads is None:
        grads = [p.grad for p in params]
    return {"param_bytes": tensor_bytes(params), "grad_bytes": tensor_bytes(grads),
            "optim_bytes": tensor_bytes(optimizer_tensors(optimizer)) if optimizer else 0,
            "peak_bytes": peak_bytes(device)}


def gather(obj) -> list:
    """Every rank's `obj`, in rank order, on every rank (all_gather_object: pickled, small)."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


# --------------------------------------------------------------------------------------------------
# Metrics and export


def metrics(d, *, script: str, strategy: str, steps: int, global_batch: int, losses: list,
            samples_per_s: float, per_rank: list, **extra) -> dict:
    """The metrics JSON of the script contract; `extra` adds the script's own fields."""
    return {"script": script, "strategy": strategy, "world_size": d.world_size, "steps": steps,
            "global_batch": global_batch, "losses": [float(x) for x in losses],
            "samples_per_s": samples_per_s, "device": str(d.device),
            "torch_version": torch.__version__, "per_rank": per_rank, **extra}


def _atomic(path: Path, write) -> None:
    """Write to a temporary name beside `path`, then rename: a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    write(tmp)
    os.replace(tmp, path)


def write_json(path: Path, obj) -> None:
    """Write `obj` as JSON (atomically). Call it on the rank that writes, usually rank 0."""
    _atomic(path, lambda tmp: tmp.write_text(json.dumps(obj, indent=1)))


def save_state_dict(path: Path, state_dict: dict) -> None:
    """torch.save a plain state dict: every value a tensor on the CPU, detached (atomically)."""
    plain = {k: v.detach().cpu() for k, v in state_dict.items()}
    _atomic(path, lambda tmp: torch.save(plain, tmp))


def variant_path(path: Path, tag: str, several: bool) -> Path:
    """Where a script that trains several variants in one launch (strategies, methods, settings)
    exports variant `tag`: PATH with the tag before the suffix (w.pt -> w.ddp.pt), or PATH itself
    when only one variant was trained."""
    path = Path(path)
    return path.with_name(f"{path.stem}.{tag}{path.suffix}") if several else path


def finish(args, metrics_dict: dict | None = None, state_dict: dict | None = None) -> None:
    """Rank 0 writes --metrics-out and --export (where the script has them and they were given);
    then every rank waits at a barrier, so the files are complete before any process exits."""
    if _rank() == 0:
        if getattr(args, "metrics_out", None) and metrics_dict is not None:
            write_json(args.metrics_out, metrics_dict)
        if getattr(args, "export", None) and state_dict is not None:
            save_state_dict(args.export, state_dict)
    if dist.is_initialized():
        dist.barrier()

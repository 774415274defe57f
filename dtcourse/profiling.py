"""Named ranges of a training step that every profiler shows under the same name.

    with nvtx_range("forward"):
        loss = F.cross_entropy(model(x), y)
    machine(device)    # '2-core AMD EPYC', or the GPU's name: what a trace or a figure ran on

Two profilers read a distributed step, and each has its own way of naming a stretch of time:

- torch.profiler (CPU, or a GPU through Kineto) records `record_function` ranges: in its Chrome
  trace (https://ui.perfetto.dev opens it) they are boxes on the thread that opened them;
- Nsight Systems (`nsys profile -t cuda,nvtx ...`) records NVTX ranges (NVIDIA Tools Extension):
  it draws them on the CPU thread above the CUDA kernels that thread launched, which is where one
  sees NCCL's kernels run on their own stream beside backward's.

`nvtx_range` opens both, so a step reads the same in either tool. NVTX ranges are pushed only in
a process that has already initialised CUDA (a run on a GPU has, by its first step):
`torch.cuda.is_initialized()` only asks, so a CPU run never starts CUDA here, and a CPU-only
build of torch, which has no NVTX, is never asked for it.
"""

from __future__ import annotations

import contextlib
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
from torch.profiler import record_function


@contextmanager
def nvtx_range(name: str) -> Iterator[None]:
    """A range called `name`: a record_function (torch.profiler) everywhere, and an NVTX range
    (nsys) when this process uses CUDA. Ranges nest; each closes on the thread that opened it,
    also when the block raises."""
    on_cuda = torch.cuda.is_initialized()  # asks; never initialises CUDA
    with record_function(name):
        if on_cuda:
            torch.cuda.nvtx.range_push(name)
        try:
            yield
        finally:
            if on_cuda:
                torch.cuda.nvtx.range_pop()


def machine(device: torch.device) -> str:
    """What ran it, for a trace's metadata and a figure's title: the GPU's name, or '2-core AMD
    EPYC 7B13' (the cores this process may use, and the CPU's model name)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = "CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{cores}-core {name}"

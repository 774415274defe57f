"""Timing that is right on every device.

On CUDA, kernels and NCCL collectives are queued on a stream and the call returns at once; even
`work.wait()` on an NCCL collective makes the stream wait, not the host. A host timestamp taken
then measures how long the host took to queue the work, not how long the device took to do it.
On a CPU with gloo the two are the same, so a CPU run never shows the difference.

    clock(device)    seconds on the host's monotonic clock, taken once the device has finished
                     everything queued so far (torch.cuda.synchronize on CUDA: every stream,
                     NCCL's and DeepSpeed's side streams too): use it in pairs around the work to
                     time, t0 = clock(device) ... clock(device) - t0. Call it where every rank
                     has matched every collective and send queued so far (a step's boundary):
                     a send already queued for a peer that has not yet posted its receive never
                     finishes, and the synchronize with it (inside a pipeline step, drain the
                     current stream instead, as pipeline_parallel.py's device_done does)
    stamp(device)    a point inside the work (a collective's launch from a backward hook),
                     without stopping the device: a CUDA event recorded on the current stream on
                     CUDA, the host clock on a CPU. On CUDA it marks when the compute stream
                     reached that point (the gradient is ready and the collective is handed to
                     NCCL), not when NCCL's own stream ran the collective: an asynchronous
                     all-reduce queued behind another starts later than its stamp
    seconds(a, b)    the time from stamp a to stamp b (on CUDA it waits for b to complete)

The lesson scripts time through these only; tests/device_check.py flags a raw time.perf_counter()
in a script that may run on CUDA unless its line says `# host clock: <why>` (a data loader's wait
on the host, a hang's wall time).
"""

from __future__ import annotations

import time

import torch


def _on_cuda(device) -> bool:
    return torch.device(device).type == "cuda"


def clock(device) -> float:
    """Seconds (time.perf_counter) after the device has finished its queued work."""
    if _on_cuda(device):
        torch.cuda.synchronize(device)
    return time.perf_counter()  # host clock: the device's queue was drained just above


def stamp(device):
    """A timestamp of this point in the device's work: a recorded CUDA event on CUDA (its time is
    when the stream reaches it), a float from the host clock elsewhere. Read with seconds()."""
    if _on_cuda(device):
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(device))  # the compute stream of that device
        return event
    return time.perf_counter()  # host clock: on a CPU the work is done when the call returns


def seconds(start, end) -> float:
    """Seconds from stamp `start` to stamp `end`, both from stamp() on the same device (on CUDA
    both on the same stream, `start` first)."""
    if isinstance(start, float):
        return end - start
    end.synchronize()
    return start.elapsed_time(end) / 1e3  # elapsed_time is in milliseconds

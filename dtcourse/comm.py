"""Count the collectives a piece of code issues: which, how large, in which dtype, over how many
ranks, and how many bytes each rank sends for them.

    with CollectiveCounter() as comm:
        loss.backward()
    comm.summary()   # {'all_reduce': {'calls': 3, 'tensor_bytes': ..., 'sent_bytes': ...}, ...}

It sits at the dispatcher (a TorchDispatchMode), where every collective passes whoever issues it:
`dist.*` calls, DDP's comm hooks, FSDP2, DeepSpeed's torch backend, DTensor's functional
collectives. Sizes follow nccl-tests: `tensor_bytes` is the whole tensor (the all-gather's output,
the reduce-scatter's input, the all-reduced buffer); `sent_bytes` is what one rank sends with ring
algorithms: 2(t-1)/t of it for an all-reduce over t ranks, (t-1)/t for all-gather, reduce-scatter
and all-to-all, all of it for a broadcast or a send, nothing for a receive. A reduce is counted as
(t-1)/t of the tensor: on a ring every rank but the root sends it once, (t-1)/t per rank on
average (t reduces, each rank the root of one, send as much as one reduce-scatter).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

RING_SHARE = {"all_reduce": lambda t: 2 * (t - 1) / t, "all_gather": lambda t: (t - 1) / t,
              "reduce_scatter": lambda t: (t - 1) / t, "all_to_all": lambda t: (t - 1) / t,
              "reduce": lambda t: (t - 1) / t, "broadcast": lambda t: 1.0,
              "send": lambda t: 1.0, "recv": lambda t: 0.0}


def _sizes(tensors) -> tuple[int, torch.dtype]:
    tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors), tensors[0].dtype


def _flat(x) -> list:
    return [t for item in x for t in (_flat(item) if isinstance(item, (list, tuple)) else [item])]


def describe(name: str, args) -> dict | None:
    """(kind, whole-tensor bytes, dtype, group) of one dispatched collective, or None for any other
    op. c10d ops (from dist.*) carry the ProcessGroup; functional ones (DTensor) its name."""
    op = name.split("::")[-1]
    ns = name.split("::")[0]
    if ns == "c10d":
        if op in ("allreduce_", "allreduce_coalesced_"):        # (tensors, group, ...)
            kind, (size, dtype), group = "all_reduce", _sizes(_flat(args[0])), args[1]
        elif op == "_allgather_base_":                          # (output, input, group, ...)
            kind, (size, dtype), group = "all_gather", _sizes([args[0]]), args[2]
        elif op in ("allgather_", "allgather_into_tensor_coalesced_"):  # (outputs, inputs, group)
            kind, (size, dtype), group = "all_gather", _sizes(_flat(args[0])), args[2]
        elif op == "_reduce_scatter_base_":                     # (output, input, group, ...)
            kind, (size, dtype), group = "reduce_scatter", _sizes([args[1]]), args[2]
        elif op in ("reduce_scatter_", "reduce_scatter_tensor_coalesced_"):  # (outputs, inputs, g)
            kind, (size, dtype), group = "reduce_scatter", _sizes(_flat(args[1])), args[2]
        elif op == "broadcast_":                                # (tensors, group, root, ...)
            kind, (size, dtype), group = "broadcast", _sizes(_flat(args[0])), args[1]
        elif op == "reduce_":                                   # (tensors, group, op, root, ...)
            kind, (size, dtype), group = "reduce", _sizes(_flat(args[0])), args[1]
        elif op in ("alltoall_base_", "alltoall_"):             # (output(s), input(s), group, ...)
            kind, (size, dtype), group = "all_to_all", _sizes(_flat([args[1]])), args[2]
        elif op in ("send", "recv_"):                           # (tensors, group, peer, tag)
            kind = "send" if op == "send" else "recv"
            (size, dtype), group = _sizes(_flat(args[0])), args[1]
        else:
            return None
    elif ns == "_c10d_functional":
        if op == "all_reduce":                                  # (input, op, group name)
            kind, (size, dtype), group = "all_reduce", _sizes([args[0]]), args[2]
        elif op == "all_gather_into_tensor":                    # (input, group size, group name)
            (size, dtype), group = _sizes([args[0]]), args[2]
            kind, size = "all_gather", size * args[1]
        elif op == "reduce_scatter_tensor":                     # (input, op, group size, name)
            kind, (size, dtype), group = "reduce_scatter", _sizes([args[0]]), args[3]
        elif op == "all_to_all_single":                         # (input, out splits, in splits, g)
            kind, (size, dtype), group = "all_to_all", _sizes([args[0]]), args[3]
        elif op == "broadcast":                                 # (input, src, group name)
            kind, (size, dtype), group = "broadcast", _sizes([args[0]]), args[2]
        else:
            return None
    else:
        return None
    pg = dist.ProcessGroup.unbox(group) if isinstance(group, torch.ScriptObject) else \
        dist.distributed_c10d._resolve_process_group(group)
    t = pg.size()
    return {"kind": kind, "dtype": str(dtype).removeprefix("torch."), "tensor_bytes": size,
            "group_size": t, "sent_bytes": round(RING_SHARE[kind](t) * size),
            "group": pg.group_name}


def _has_dtensor(types) -> bool:
    module = sys.modules.get("torch.distributed.tensor")  # no DTensor exists if never imported
    return module is not None and any(issubclass(t, module.DTensor) for t in types)


class CollectiveCounter(TorchDispatchMode):
    """While active, appends one record (see `describe`) per collective to `self.records`, tagged
    with `self.phase` (set it to 'forward', 'backward', ... to split a step's traffic)."""

    def __init__(self):
        super().__init__()
        self.records: list[dict] = []
        self.phase = ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _has_dtensor(types):
            # DTensor goes first: it turns the op into local ops and collectives, which come back
            # through this mode on plain tensors and are counted there.
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        record = describe(func._schema.name, args)
        if record is not None:
            self.records.append({**record, "phase": self.phase})
        return out

    def summary(self, records: list[dict] | None = None) -> dict:
        """Per kind: calls, tensor_bytes, sent_bytes, and the dtypes and group sizes seen."""
        out: dict = {}
        for r in self.records if records is None else records:
            s = out.setdefault(r["kind"], {"calls": 0, "tensor_bytes": 0, "sent_bytes": 0,
                                           "dtypes": [], "group_sizes": []})
            s["calls"] += 1
            s["tensor_bytes"] += r["tensor_bytes"]
            s["sent_bytes"] += r["sent_bytes"]
            for key, value in (("dtypes", r["dtype"]), ("group_sizes", r["group_size"])):
                if value not in s[key]:
                    s[key].append(value)
        return out


def counting_allreduce(world_size: int):
    """A DDP comm hook that does what DDP's default hook does, average each gradient bucket with
    one all-reduce, and counts the buckets it sends in its attribute `calls`:

        hook = counting_allreduce(world_size)
        ddp.register_comm_hook(None, hook)
        ...
        hook.calls

    With `no_sync()` on the accumulation micro-steps, the count shows one all-reduce per bucket per
    optimizer step instead of one per micro-step."""

    def hook(state, bucket):
        hook.calls += 1
        grad = bucket.buffer().div_(world_size)  # average = sum / world, as DDP's default
        return dist.all_reduce(grad, async_op=True).get_future().then(lambda fut: fut.value()[0])

    hook.calls = 0
    return hook

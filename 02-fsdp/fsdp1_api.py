"""FSDP1 (`FullyShardedDataParallel`) beside FSDP2 (`fully_shard`): the same GPT, the same data, the
same sharding strategy, written in each API; and what the wrapping policy does to the memory of the
parameters gathered at once.

Launch (from the repository root):
    torchrun --nproc_per_node=2 02-fsdp/fsdp1_api.py                        # both APIs, per block
    torchrun --nproc_per_node=2 02-fsdp/fsdp1_api.py --wrap block size none # the wrap policies
    torchrun --nproc_per_node=2 02-fsdp/fsdp1_api.py --strategy grad-op --api fsdp1
    torchrun --nproc_per_node=4 02-fsdp/fsdp1_api.py --strategy hybrid --shard-size 2
    python 02-fsdp/fsdp1_api.py --batch-size 16                              # one process
    torchrun --nproc_per_node=8 02-fsdp/fsdp1_api.py --device cuda --mixed-precision bf16 \
        --layers 24 --dim 1024 --heads 16 --seq-len 1024 --vocab 50304 --batch-size 8

FSDP1 wraps: `FullyShardedDataParallel(model, sharding_strategy=..., auto_wrap_policy=...)` returns
a new module; the policy decides which submodules become nested FSDP instances (units), and each
unit's parameters are flattened into one FlatParameter, of which every rank keeps 1/N. FSDP2 works
in place: `fully_shard(module, mesh=..., reshard_after_forward=...)` is called by hand on each
unit, children first, then on the root, and returns the same object. It swaps the module's class
for a generated subclass (a GPT becomes an `FSDPGPT`, subclass of both `FSDPModule` and `GPT`, so
isinstance checks still hold) and replaces each parameter by a DTensor holding this rank's rows;
the names and the state_dict keys stay those of the plain model. Both gather each unit with an
all-gather before its forward, another before its backward (unless kept from forward), and
reduce-scatter its gradients. They are not gathered one at a time: besides the root, which stays
gathered, backward holds two units, the one computing its gradients and the next one, prefetched
(and FSDP2's forward briefly holds a unit's all-gather buffer beside the next one's;
02-fsdp/fsdp1_api.md measures both).

The model and data are those of fsdp_transformer.py (dtcourse.models GPT and init_gpt,
dtcourse.data token_batch), so the runs compare with it. The output is in 02-fsdp/fsdp1_api.md.
"""

import contextlib
import functools
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (CPUOffload, FullyShardedDataParallel, MixedPrecision,
                                    ShardingStrategy)
from torch.distributed.fsdp.wrap import ModuleWrapPolicy, size_based_auto_wrap_policy
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from dtcourse import cli, launch, report, timing
from dtcourse.comm import CollectiveCounter
from dtcourse.data import rank_rows, token_batch
from dtcourse.models import GPT, Block, gpt_parameter_count, init_gpt

try:  # public since torch 2.6; the same objects lived in torch.distributed._composable.fsdp before
    from torch.distributed.fsdp import (CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy,
                                        fully_shard)
except ImportError:
    from torch.distributed._composable.fsdp import (CPUOffloadPolicy, FSDPModule,
                                                    MixedPrecisionPolicy, fully_shard)

SCRIPT = "02-fsdp/fsdp1_api.py"
# --strategy -> (FSDP1's ShardingStrategy, FSDP2's reshard_after_forward for the non-root units,
#                FSDP2's mesh: "1d" = (N,), "2d" = (N/S, S) with S ranks per shard group)
STRATEGIES = {
    "full": (ShardingStrategy.FULL_SHARD, True, "1d"),
    "grad-op": (ShardingStrategy.SHARD_GRAD_OP, False, "1d"),
    "no-shard": (ShardingStrategy.NO_SHARD, True, "2d"),  # FSDP2: shard groups of one rank
    "hybrid": (ShardingStrategy.HYBRID_SHARD, True, "2d"),
}


# --------------------------------------------------------------------------------------------------
# The mechanism: the same GPT under either API, and the step's one difference


def build_fsdp1(args, strategy: str, wrap: str, mesh, d):
    """FullyShardedDataParallel: one call wraps the model and, by the policy, its units."""
    with torch.device("meta"):  # shapes only; FSDP1 materialises each unit with param_init_fn
        model = GPT(args.vocab, args.seq_len, args.dim, args.heads, args.layers)
    kw = {}
    if strategy != "no-shard":  # hybrid: a 2-D (replicate, shard) mesh, as FSDP2's
        kw["device_mesh"] = mesh
    if args.mixed_precision == "bf16":
        # gather and compute in bf16, reduce gradients in fp32 (buffers: GPT has none)
        kw["mixed_precision"] = MixedPrecision(param_dtype=torch.bfloat16,
                                               reduce_dtype=torch.float32,
                                               buffer_dtype=torch.bfloat16)
    model = FullyShardedDataParallel(
        model,
        sharding_strategy=STRATEGIES[strategy][0],
        auto_wrap_policy=fsdp1_policy(wrap, args.min_params),
        cpu_offload=CPUOffload(offload_params=args.cpu_offload),
        device_id=d.device,
        # allocate each module's storage on the device before it is flattened and sharded
        param_init_fn=lambda m: m.to_empty(device=d.device, recurse=False),
        # keep the model's own parameters visible (as views into the flat shards): needed for
        # per-parameter optimizer groups, frozen parameters in a unit and torch.compile
        use_orig_params=True,
        **kw)
    # Fill the weights: every unit gathered at once, init_gpt writes the full tensors, writeback
    # copies each rank's part into its flat shard. (Names inside this context are the plain
    # model's: FSDP1 strips its `_fsdp_wrapped_module.` prefixes there.)
    with FullyShardedDataParallel.summon_full_params(model, writeback=True):
        init_gpt(model, args.seed, layers=args.layers)
    return model


def build_fsdp2(args, strategy: str, wrap: str, mesh, d):
    """fully_shard on each unit, then on the root: the model stays a GPT."""
    with torch.device("meta"):
        model = GPT(args.vocab, args.seq_len, args.dim, args.heads, args.layers)
    kw = {"mesh": mesh}
    if args.mixed_precision == "bf16":
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                               reduce_dtype=torch.float32)
    if args.cpu_offload:
        # the shards and their gradients on the CPU: clip() then all-reduces there (see main)
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=d.device.type == "cuda")
    for unit in fsdp2_units(model, wrap, args.min_params):
        fully_shard(unit, reshard_after_forward=STRATEGIES[strategy][1], **kw)
    # The root keeps its parameters from forward to backward, which opens with its head: what
    # FSDP1 does for its root under FULL_SHARD too (_post_forward_reshard skips the root).
    fully_shard(model, reshard_after_forward=False, **kw)
    model.to_empty(device="cpu" if args.cpu_offload else d.device)
    init_gpt(model, args.seed)  # each rank fills its rows of every DTensor
    return model


def clip(model, api: str, max_norm: float) -> float:
    """The global gradient norm, clipped to max_norm (0: not clipped). FSDP1's flat shards are
    plain tensors: only FullyShardedDataParallel.clip_grad_norm_ knows to all-reduce the squares
    over the ranks (torch.nn.utils' would clip by this rank's shard norm). FSDP2's gradients are
    DTensors, so torch.nn.utils.clip_grad_norm_ computes the global norm itself."""
    max_norm = max_norm or float("inf")  # inf: the clip factor clamps to exactly 1
    if api == "fsdp1":
        return model.clip_grad_norm_(max_norm).item()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return (norm.full_tensor() if isinstance(norm, DTensor) else norm).item()


# --------------------------------------------------------------------------------------------------
# Which modules become units: FSDP1 takes a policy, FSDP2 takes a list you compute


WRAPS = ("block", "size", "none")


def fsdp1_policy(wrap: str, min_params: int):
    """FSDP1's auto_wrap_policy. `ModuleWrapPolicy({Block})` is what
    `functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})` does, in the
    class form torch recommends. None: no nested units, the whole model is the root's one unit."""
    if wrap == "block":
        return ModuleWrapPolicy({Block})
    if wrap == "size":
        # a module becomes a unit once the parameters it has not handed to wrapped children
        # number at least min_num_params; what is left goes to its parent, in the end the root
        return functools.partial(size_based_auto_wrap_policy, min_num_params=min_params)
    return None


def fsdp2_units(model: nn.Module, wrap: str, min_params: int) -> list:
    """The modules to call fully_shard on before the root, children first (a parameter belongs to
    the innermost unit that holds it). For "size" this is the walk FSDP1 does with that policy
    (torch.distributed.fsdp.wrap._recursive_wrap), so both APIs form the same units."""
    if wrap == "block":
        return [m for m in model.modules() if isinstance(m, Block)]
    if wrap == "none":
        return []
    policy, units = fsdp1_policy(wrap, min_params), []

    def visit(module) -> int:
        """Wrap what the policy says below `module`; return the parameters now in units."""
        numel = sum(p.numel() for p in module.parameters())
        if not policy(module=module, recurse=True, nonwrapped_numel=numel):
            return 0
        taken = sum(visit(child) for child in module.children())
        if module is not model and policy(module=module, recurse=False,
                                          nonwrapped_numel=numel - taken):
            units.append(module)
            return numel
        return taken

    visit(model)
    return units


def unit_names(model: nn.Module, api: str) -> list:
    """The units of a wrapped model in module order, named as in the plain GPT; `root` last."""
    kind = FullyShardedDataParallel if api == "fsdp1" else FSDPModule
    names = [name.replace("_fsdp_wrapped_module.", "").removesuffix("._fsdp_wrapped_module")
             for name, m in model.named_modules() if isinstance(m, kind)]
    return [n for n in names if n and n != "_fsdp_wrapped_module"] + ["root"]


def build_mesh(strategy: str, shard_size: int, d):
    if STRATEGIES[strategy][2] == "1d":
        return init_device_mesh(d.device.type, (d.world_size,), mesh_dim_names=("shard",))
    shard = 1 if strategy == "no-shard" else shard_size
    return init_device_mesh(d.device.type, (d.world_size // shard, shard),
                            mesh_dim_names=("replicate", "shard"))


def describe(args, api: str, strategy: str, wrap: str, mesh, model) -> str:
    """The call that built the model, in its own API's words."""
    units = unit_names(model, api)
    where = f"{len(units)} unit{'s' * (len(units) != 1)}: {' '.join(units)}"
    mp = args.mixed_precision == "bf16"
    if api == "fsdp1":
        policy = {"block": "ModuleWrapPolicy({Block})",
                  "size": f"size_based_auto_wrap_policy(min_num_params={args.min_params})",
                  "none": "None"}[wrap]
        # FSDP1 at world 1 replaces a sharded strategy by NO_SHARD: show what it runs
        return (f"fsdp1: FullyShardedDataParallel(model, sharding_strategy="
                f"{model.sharding_strategy.name}, auto_wrap_policy={policy}"
                f"{', mixed_precision=MixedPrecision(bf16, reduce fp32)' * mp}"
                f"{', cpu_offload=CPUOffload(offload_params=True)' * args.cpu_offload}"
                f", use_orig_params=True) | {where}")
    pin = mesh.device_type == "cuda"
    calls = "" if wrap == "none" else (
        f"fully_shard(unit, reshard_after_forward={STRATEGIES[strategy][1]}) on each unit, then ")
    return (f"fsdp2: {calls}fully_shard(model, reshard_after_forward=False), mesh "
            f"{tuple(mesh.shape)} {mesh.mesh_dim_names}"
            f"{', mp_policy=MixedPrecisionPolicy(bf16, reduce fp32)' * mp}"
            f"{f', offload_policy=CPUOffloadPolicy(pin_memory={pin})' * args.cpu_offload}"
            f" | {where}")


# --------------------------------------------------------------------------------------------------
# Measure: the gathered parameters that exist at once


# The all-gathers FSDP1 and FSDP2 issue through torch.distributed, each (output(s), input(s), ...):
# all_gather_into_tensor, its coalesced form, and all_gather into a list (FSDP1 on CPU)
ALL_GATHERS = {"c10d::_allgather_base_", "c10d::allgather_into_tensor_coalesced_",
               "c10d::allgather_"}


class GatheredBytes(TorchDispatchMode):
    """While active, after every operation: the bytes of gathered (unsharded) parameters this rank
    holds beside its shards; `peak` keeps the largest. A CPU has no allocator peak to read
    (torch.cuda.max_memory_allocated is CUDA's), and this is the part of the peak that the wrapping
    policy decides: the shards, the gradients' shards and the activations do not depend on it.

    Counted: the output of every all-gather while it is alive, and FSDP2's unsharded parameters.
    FSDP1 all-gathers a unit straight into its padded flat parameter (`_full_param_padded`; on
    CPU through views of it, one per rank), which it frees by resizing the storage to 0. FSDP2
    all-gathers a unit into one buffer, copies it out into one unsharded tensor per parameter
    (registered on the module in place of the sharded DTensor while gathered), then drops the
    buffer; a unit prefetched for backward waits in its buffer until its turn."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.outputs, self.peak = [], 0
        # FSDP2 swaps parameters in and out of the modules' _parameters: look them up there
        self.slots = [(m._parameters, name) for m in model.modules() for name in m._parameters] \
            if isinstance(model, FSDPModule) else []

    def held(self) -> int:
        storages = {}
        alive = [(ref, t) for ref in self.outputs if (t := ref()) is not None]
        self.outputs = [ref for ref, _ in alive]
        gathered = [t for _, t in alive] + [  # FSDP2: a plain tensor where the DTensor was
            p for params, name in self.slots
            if (p := params[name]) is not None and not isinstance(p, DTensor)]
        for t in gathered:
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        return sum(size for ptr, size in storages.items() if ptr)  # a freed storage: no data

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor first; its local ops come back here
        out = func(*args, **(kwargs or {}))
        if func._schema.name in ALL_GATHERS:
            # remember the tensor that owns the output (a view's base), without keeping it alive
            self.outputs += [weakref.ref(t if t._base is None else t._base)
                             for t in _tensors(args[0])]
        self.peak = max(self.peak, self.held())
        return out


def _tensors(x) -> list:
    """The tensors of a (nested) list, or of one tensor."""
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _tensors(item)]
    return [x] if isinstance(x, torch.Tensor) else []


# --------------------------------------------------------------------------------------------------
# Train


def train(args, api: str, strategy: str, wrap: str, d, several: bool):
    """One fresh model under one API and wrap policy; returns (metrics, full state dict)."""
    report.reset_peak(d.device)  # the previous run's model freed: this one's own peak
    mesh = build_mesh(strategy, args.shard_size, d)
    model = (build_fsdp1 if api == "fsdp1" else build_fsdp2)(args, strategy, wrap, mesh, d)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    report.print0(describe(args, api, strategy, wrap, mesh, model))
    global_bs = d.world_size * args.batch_size  # every rank is data-parallel
    rows = rank_rows(d.rank, args.batch_size)
    losses, norms = [], []
    # Timed: steps 2 to S-1 of S. Step 1 pays for lazy initialisation; step S is measured by the
    # probes below, which run Python after every operation, so it is not timed.
    timed, t_start, elapsed = list(range(2, args.steps)), None, None
    for step in range(args.steps):
        if timed and step == 1:  # start the clock before step 2
            t_start = timing.clock(d.device)
        if timed and step == args.steps - 1:  # ... and stop it before step S, the measured one
            elapsed = timing.clock(d.device) - t_start
        x_all, y_all = token_batch(args.seed, step, global_bs, args.seq_len, args.vocab)
        x, y = x_all[rows].to(d.device), y_all[rows].to(d.device)
        # Measure the last step, a complete steady-state one (both probes run Python after every
        # operation): its collectives, forward and backward apart, and its gathered bytes
        last = step == args.steps - 1
        comm = CollectiveCounter() if last else contextlib.nullcontext()
        probe = GatheredBytes(model) if last else contextlib.nullcontext()
        with comm, probe:
            comm.phase = "forward"
            loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
            comm.phase = "backward"
            loss.backward()
        norms.append(clip(model, api, args.grad_clip))
        optimizer.step()
        if step < args.steps - 1:  # the last step's gradients stay, for the report
            optimizer.zero_grad(set_to_none=True)
        step_loss = loss.detach()
        dist.all_reduce(step_loss)  # sum of the ranks' means -> mean over the global batch
        losses.append(step_loss.item() / d.world_size)
        done = step + 1
        if not several and (done % args.log_every == 0 or done in (1, args.steps)):
            report.print0(f"step {done:4d}/{args.steps} | loss {losses[-1]:.4f} | grad norm "
                          f"{norms[-1]:.3f}")
    # What one forward all-gathers, unit by unit: the root's first, then each unit's
    forward = [r["tensor_bytes"] for r in comm.records
               if r["kind"] == "all_gather" and r["phase"] == "forward"]
    per_rank = report.gather({**report.held_bytes(params=model.parameters(), optimizer=optimizer,
                                                  device=d.device),
                              "gathered_peak_bytes": probe.peak,
                              "root_gather_bytes": forward[0] if forward else 0,
                              "unit_gather_bytes": max(forward[1:], default=0)})
    # A collective on every rank: the whole unsharded state dict, on rank 0's CPU. Where the
    # device is the CPU, every rank keeps it where it is gathered instead (only rank 0 uses it):
    # torch 2.11's FSDP1 "moves" a gathered flat parameter that is already on the CPU by keeping
    # its storage, then frees that storage, and the copy into the state dict reads freed memory
    # (rank 0 dies with SIGSEGV); torch 2.14 skips the move for CPU parameters.
    full_sd = get_model_state_dict(model, options=StateDictOptions(
        full_state_dict=True, cpu_offload=d.device.type != "cpu"))
    n_params = gpt_parameter_count(args.vocab, args.seq_len, args.dim, args.layers)
    comms = comm.summary()
    metrics = report.metrics(
        d, script=SCRIPT, strategy=strategy, steps=args.steps, global_batch=global_bs,
        losses=losses, samples_per_s=len(timed) * global_bs / elapsed if timed else None,
        tokens_per_s=len(timed) * global_bs * args.seq_len / elapsed if timed else None,
        timed_steps=timed, counted_step=args.steps, per_rank=per_rank, api=api, wrap=wrap,
        units=unit_names(model, api), grad_norms=norms, comms_per_step=comms, params=n_params,
        mesh=list(mesh.shape), mixed_precision=args.mixed_precision, cpu_offload=args.cpu_offload,
        min_params=args.min_params if wrap == "size" else None)
    held = per_rank[0]
    if not several:
        report.print0(f"rank 0 holds params {held['param_bytes']:,} B, grads "
                      f"{held['grad_bytes']:,} B, optimizer {held['optim_bytes']:,} B | one "
                      f"step: " + ", ".join(f"{kind} {s['calls']}" for kind, s in comms.items()))
        report.print0(f"gathered parameters held at once: at most {held['gathered_peak_bytes']:,} "
                      f"B (all-gathered: root {held['root_gather_bytes']:,} B, largest other unit "
                      f"{held['unit_gather_bytes']:,} B; the whole model in fp32 "
                      f"{4 * n_params:,} B)")
    return metrics, full_sd


# --------------------------------------------------------------------------------------------------
# Report several runs side by side


def write_results(args, d, results) -> None:
    several = len(results) > 1
    if several:
        whole = 4 * results[0][0]["params"]
        report.print0(f"\n{'api':5} {'wrap':5} {'units':>5} {'loss':>7} {'all-gathers':>11} "
                      f"{'root B':>9} {'unit B':>9} {'gathered peak B':>15} {'/ model':>7}  "
                      f"(rank 0; root, unit: one all-gather's output, the largest unit "
                      f"besides the root)")
        for metrics, _ in results:
            held = metrics["per_rank"][0]
            gathers = metrics["comms_per_step"].get("all_gather", {}).get("calls", 0)
            report.print0(f"{metrics['api']:5} {metrics['wrap']:5} {len(metrics['units']):5d} "
                          f"{metrics['losses'][-1]:7.4f} {gathers:11d} "
                          f"{held['root_gather_bytes']:9,} {held['unit_gather_bytes']:9,} "
                          f"{held['gathered_peak_bytes']:15,} "
                          f"{held['gathered_peak_bytes'] / whole:7.2f}")
        if d.is_main:
            for wrap in args.wrap:  # the two APIs, weight by weight, where both ran
                pair = [sd for m, sd in results if m["wrap"] == wrap]
                if len(pair) == 2:
                    diff = max((pair[0][k] - pair[1][k]).abs().max().item() for k in pair[0])
                    print(f"fsdp1 vs fsdp2, wrap {wrap}: max |w1 - w2| = {diff:.1e} after "
                          f"{args.steps} steps", flush=True)
    if d.is_main:
        for metrics, full_sd in results:
            if args.export:  # w.pt -> w.fsdp1-block.pt, ... when several ran
                report.save_state_dict(report.variant_path(
                    args.export, f"{metrics['api']}-{metrics['wrap']}", several), full_sd)
        if args.metrics_out:
            report.write_json(args.metrics_out, {
                "script": SCRIPT, "runs": {f"{m['api']}-{m['wrap']}": m for m, _ in results}}
                if several else results[0][0])
    dist.barrier()


# --------------------------------------------------------------------------------------------------
# Arguments and launch


def parse_args(argv=None):
    p = cli.parser(__doc__)
    cli.add_run_args(p)
    cli.add_train_args(p, steps=4, batch_size=8, lr=3e-3, grad_accum=False,
                       batch_help="sequences per rank")
    cli.add_output_args(p, export=False)
    p.add_argument("--export", type=Path,
                   help="rank 0 writes the plain GPT state_dict here (several runs: one file "
                        "each, w.pt -> w.fsdp1-block.pt, w.fsdp2-block.pt, ...)")
    p.add_argument("--api", nargs="+", choices=["fsdp1", "fsdp2"], default=["fsdp1", "fsdp2"],
                   help="FullyShardedDataParallel (FSDP1), fully_shard (FSDP2), or both")
    p.add_argument("--strategy", choices=list(STRATEGIES), default="full",
                   help="full = FULL_SHARD, grad-op = SHARD_GRAD_OP, no-shard = NO_SHARD, "
                        "hybrid = HYBRID_SHARD (FSDP2: the equivalent mesh and resharding)")
    p.add_argument("--shard-size", type=int, default=None,
                   help="hybrid: ranks per shard group (default: ranks per node)")
    p.add_argument("--wrap", nargs="+", choices=WRAPS, default=["block"],
                   help="units: one per transformer block, by parameter count "
                        "(size_based_auto_wrap_policy), or none (the whole model is one unit)")
    p.add_argument("--min-params", type=int, default=20_000,
                   help="--wrap size: min_num_params of size_based_auto_wrap_policy")
    cli.add_gpt_args(p, layers=4)
    p.add_argument("--grad-clip", type=float, default=1.0,
                   help="max global gradient L2 norm (0: measure it, do not clip)")
    p.add_argument("--mixed-precision", choices=["fp32", "bf16"], default="fp32",
                   help="bf16: gather and compute in bf16, reduce gradients in fp32")
    p.add_argument("--cpu-offload", action="store_true",
                   help="keep the sharded parameters (and gradients, and the optimizer step) "
                        "in CPU memory")
    p.add_argument("--log-every", type=int, default=2)
    args = p.parse_args(argv)
    cli.check_gpt_args(args)
    cli.check_positive(args, "steps", "batch_size", "lr", "min_params", "log_every",
                       "timeout_s")
    if args.grad_clip < 0:
        cli.fail(f"--grad-clip must be >= 0 (0: no clipping), got {args.grad_clip}")
    for flag in ("api", "wrap"):
        values = getattr(args, flag)
        if len(set(values)) != len(values):
            cli.fail(f"--{flag} lists a value twice: {' '.join(values)}")
    on_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if args.cpu_offload and "fsdp1" in args.api and not on_cuda:
        cli.fail("--cpu-offload with --api fsdp1 needs CUDA: FSDP1's CPUOffload pins the "
                 "offloaded shards in page-locked memory, which needs a GPU; FSDP2's "
                 "CPUOffloadPolicy(pin_memory=False) does not: use --api fsdp2")
    if args.shard_size is not None and args.strategy != "hybrid":
        cli.fail(f"--shard-size applies to --strategy hybrid only, not {args.strategy}")
    return args


def check_shard_size(args, d) -> None:
    if args.strategy != "hybrid":
        return
    if args.shard_size is None:
        args.shard_size = d.local_world_size or d.world_size
    if args.shard_size < 1 or d.world_size % args.shard_size:
        cli.fail(f"--strategy hybrid needs the world size ({d.world_size}) to be a multiple of "
                 f"the shard group size --shard-size ({args.shard_size}): the mesh is "
                 f"(replicas, shard) = (world / shard-size, shard-size)")


def main(argv=None):
    args = parse_args(argv)
    # FSDP2's CPU offload keeps gradient shards on the CPU: on GPUs, gloo beside NCCL
    with launch.distributed(args.device, args.timeout_s, cpu_collectives=args.cpu_offload) as d:
        check_shard_size(args, d)
        report.print0(f"GPT: {args.layers} layers, dim {args.dim}, {args.heads} heads, seq "
                      f"{args.seq_len}, vocab {args.vocab} | strategy {args.strategy} | world "
                      f"{d.world_size} | device {d.device} | {args.mixed_precision} | global batch "
                      f"{d.world_size * args.batch_size} sequences ({d.world_size} ranks x "
                      f"{args.batch_size})")
        runs = [(api, wrap) for wrap in args.wrap for api in args.api]
        write_results(args, d, [train(args, api, args.strategy, wrap, d, len(runs) > 1)
                                for api, wrap in runs])


if __name__ == "__main__":
    main()

"""DeepSpeed ZeRO stages 0-3 and offload on one small GPT: engine.backward / engine.step,
checkpoints with automatic resume, preemption handling, fp32 export and per-rank memory.

Launch (from the repository root):
    deepspeed --num_gpus 2 03-deepspeed/deepspeed_train.py \
        --deepspeed_config 03-deepspeed/configs/zero2_config.json        # 2 ranks, one node
    python 03-deepspeed/deepspeed_train.py --deepspeed_config 03-deepspeed/configs/zero0_config.json
    torchrun --nproc_per_node=2 03-deepspeed/deepspeed_train.py --deepspeed_config ...
    srun -n 2 --gpus-per-task=1 --cpus-per-task=8 python 03-deepspeed/deepspeed_train.py \
        --deepspeed_config ...                                            # SLURM: one task a rank
    deepspeed --num_gpus 8 03-deepspeed/deepspeed_train.py \
        --deepspeed_config 03-deepspeed/configs/zero3_config.json --layers 12 --dim 768 --heads 12

What a DeepSpeed engine does each optimizer step (the config's "stage" picks the sharding):
    logits = engine(x)       forward; ZeRO-3 all-gathers each layer's parameters just in time
    engine.backward(loss)    scales by 1/grad_accum; reduces the gradients in buckets. Stages 0-1
                             keep full gradients and all-reduce them at the last micro-step only;
                             stage 2 all-reduces each bucket as it fills, every micro-step, and
                             each rank keeps the slice in its partition (DeepSpeed 0.19: one
                             `reduce` per owner instead with use_multi_rank_bucket_allreduce
                             false); stage 3 reduce-scatters each bucket into the partitions
    engine.step()            on the last micro-step only: clip, step the optimizer on this rank's
                             shard, all-gather the updated parameters (stage 1/2), LR schedule

The process group is started by the course's shared module (dtcourse.launch, under every
launcher); DeepSpeed adopts it. The GPT and its data are the shared ones of lessons 02-05.
"""

import argparse
import json
import signal
import threading
import time
from pathlib import Path

# Preemption: SLURM, torchrun and the deepspeed launcher all send SIGTERM. The handler only sets
# this flag; the training loop agrees on it across ranks, checkpoints and exits. It is installed
# before the heavy imports below because the launchers also SIGTERM every rank when one rank
# exits: a rank still importing torch must survive that long enough to print its own error.
SIGTERM_RECEIVED = threading.Event()
if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda signum, frame: SIGTERM_RECEIVED.set())

import contextlib  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from dtcourse import cli, launch, report  # noqa: E402
from dtcourse import timing
from dtcourse.comm import CollectiveCounter  # noqa: E402
from dtcourse.data import rank_rows, token_batch  # noqa: E402
from dtcourse.models import GPT, gpt_init_value  # noqa: E402
from dtcourse.profiling import nvtx_range  # noqa: E402

SCRIPT = "03-deepspeed/deepspeed_train.py"
HERE = Path(__file__).resolve().parent

# --------------------------------------------------------------------------------------------------
# The config's ZeRO section: which stage, what is offloaded. Checked before DeepSpeed is imported
# and before any collective, so a bad file is one line and exit 2 on every rank.


def zero_stage(config: dict) -> int:
    return config["zero_optimization"].get("stage", 0)


def offloaded(config: dict, key: str) -> bool:
    """Does zero_optimization.`key` (offload_optimizer / offload_param) move tensors off the
    device (to "cpu", or to "nvme" files: ZeRO-Infinity)?"""
    return (config["zero_optimization"].get(key) or {}).get("device", "none") != "none"


def check_zero(path: Path, config: dict) -> None:
    zero = config.setdefault("zero_optimization", {})
    stage = zero.get("stage", 0) if isinstance(zero, dict) else None
    if stage not in (0, 1, 2, 3):
        cli.fail(f"{path}: zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}")
    for key in ("offload_optimizer", "offload_param"):
        offload = zero.get(key) or {}
        device = offload.get("device", "none")
        if device not in ("none", "cpu", "nvme"):
            cli.fail(f"{path}: zero_optimization.{key}.device must be none, cpu or nvme, "
                     f"got {device!r}")
        if device == "nvme" and not Path(offload.get("nvme_path", "")).is_dir():
            cli.fail(f"{path}: zero_optimization.{key}.nvme_path {offload.get('nvme_path')!r} is "
                     "not a directory: set it to a folder on a local NVMe drive")
        # Parameters can only leave the device when they are partitioned: stage 3.
        if key == "offload_param" and device != "none" and stage != 3:
            cli.fail(f"{path}: zero_optimization.offload_param needs stage 3, got stage {stage}")
    # The course's rule, not DeepSpeed's: 0.19.8 would step an offloaded optimizer with
    # torch.optim.AdamW when torch_adam is set; the offload lesson is about DeepSpeedCPUAdam.
    if offloaded(config, "offload_optimizer") and \
            config.get("optimizer", {}).get("params", {}).get("torch_adam"):
        cli.fail(f"{path}: offload_optimizer steps on the CPU with DeepSpeedCPUAdam: remove "
                 "optimizer.params.torch_adam")


# --------------------------------------------------------------------------------------------------
# The engine: model built under zero.Init, optimizer / schedule / partitioning from the config


def build(args, config: dict, deepspeed):
    """(engine, model, P): the shared GPT, its weights from init_gpt's values, wrapped by the
    engine."""
    stage = zero_stage(config)
    # ZeRO-3 partitions each parameter as soon as its layer is built, so the full model is never
    # materialised while it is built; zero.Init is a no-op context for the other stages.
    with deepspeed.zero.Init(config_dict_or_path=config, enabled=stage == 3):
        model = GPT(args.vocab, args.seq_len, args.dim, args.heads, args.layers)
    init_weights(model, args.seed, deepspeed, stage)
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    # The engine builds the optimizer, the LR scheduler and the ZeRO partitioning from the config.
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config)
    return engine, model, n_params


@torch.no_grad()
def init_weights(model, seed: int, deepspeed, stage: int) -> None:
    """Give every parameter its value from init_gpt's scheme (gpt_init_value, per name), one
    parameter at a time.

    Under zero.Init each rank holds 1/N of every parameter (`p.ds_tensor`); `p` itself is an
    empty placeholder. GatheredParameters([p]) all-gathers that one parameter for the length of
    the `with`; on exit rank 0's values (the modifier) are broadcast and partitioned again, so all
    ranks start from the same weights. One parameter at a time, the most any rank holds in full is
    the largest parameter, never the model. At stages 0-2 the parameters are ordinary tensors and
    the context does nothing.
    """
    layers = len(model.blocks)
    for name, p in model.named_parameters():
        with deepspeed.zero.GatheredParameters([p], modifier_rank=0, enabled=stage == 3):
            p.copy_(gpt_init_value(name, p.shape, seed, layers))


def train_step(engine, x_local, y_local, micro: int, accum: int, device, after_backward=None,
               phase=lambda name: None):
    """One optimizer step on this rank's rows, in `accum` micro-steps of `micro` rows; returns
    this rank's mean loss. `after_backward()`, if given, runs after each backward; `phase(name)`
    is told when forward, backward and the step begin (to split the traffic by phase)."""
    step_loss = torch.zeros((), device=device)
    for m in range(accum):
        x, y = x_local[m * micro:(m + 1) * micro], y_local[m * micro:(m + 1) * micro]
        phase("forward")
        with nvtx_range("forward"):
            logits = engine(x)                                  # (B, T) -> (B, T, vocab)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        phase("backward")
        with nvtx_range("backward"):
            engine.backward(loss)  # divides by grad_accum itself; reduces gradients (see the top)
        if after_backward is not None:
            after_backward()
        phase("step")
        with nvtx_range("optimizer"):
            engine.step()  # steps the optimizer only on the accumulation boundary
        step_loss += loss.detach().float() / accum
    return step_loss


# --------------------------------------------------------------------------------------------------
# What each rank holds (the `per_rank` metrics): bytes of the tensors DeepSpeed keeps, by role.
# DeepSpeed stores parameters and gradients as views into flat buffers, so bytes are counted per
# storage, each byte once (a plain sum of tensor sizes would count a view and its buffer twice).


def storage_bytes(tensors) -> int:
    """Bytes of memory the tensors cover, each byte once: overlapping views are merged."""
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

    weights: the module's parameters (stages 1-2: full, in DeepSpeed's flat buffer including its
      alignment padding; stage 0 in fp32: the module's own tensors) or, at stage 3, this rank's
      partition of each (`ds_tensor`); with offload at stages 1-2 also the pinned host copy of
      the partition in the working dtype that the step writes the new weights into.
    master: the fp32 copy the optimizer steps. DeepSpeed's ZeRO 1-3 keep one for their partition
      even when training in fp32; at stage 0 in fp32 the optimizer steps the weights themselves.
    moments: Adam's exp_avg and exp_avg_sq (the 0-dim `step` counters are not counted).
    grads: the module's .grad plus the gradient buffers ZeRO accumulates into and the master's;
      with offload at stages 1-2 also its two buffers the size of the largest parameter.
    secondary: ZeRO++ hpZ's second copy of the parameters, partitioned over the smaller group
      (`ds_secondary_tensor`: every gather after a parameter's first one until the optimizer
      step reads it); 0 without hpZ.
    host: the part of these that offload keeps in CPU memory (on a CPU-only machine host and
      device are the same memory; the split follows where DeepSpeed allocates each tensor).
    Attribute names are DeepSpeed 0.19's; the lesson's tests check the sums against the formulas.
    """
    opt = engine.optimizer
    inner = getattr(opt, "optimizer", opt)  # the torch / DeepSpeedCPUAdam optimizer that steps
    params = list(model.parameters())
    weights = [p.data for p in params] + [getattr(p, "ds_tensor", None) for p in params]
    for name in ("bit16_groups_flat", "fp16_partitioned_groups_flat"):
        weights += tensors_in(getattr(opt, name, None))
    # Stages 1-2 with offload_optimizer (stage_1_and_2.py's __init__) keep a pinned host buffer of
    # the working dtype the size of the partition: the step writes the updated master into it
    # and copies it to the device from there.
    host_weights = list(tensors_in(getattr(opt, "param_buffer_of_bit16_for_cpu_offload_groups",
                                           None)))
    master = list(tensors_in(getattr(opt, "single_partition_of_fp32_groups", None)
                             or getattr(opt, "fp32_partitioned_groups_flat", None)
                             or [p for group in inner.param_groups for p in group["params"]]))
    if storage_bytes(master + weights) == storage_bytes(weights):
        master = []  # the optimizer steps the module's own parameters
    weights += host_weights
    moments = [v for state in inner.state.values() for v in state.values()
               if torch.is_tensor(v) and v.dim() > 0]
    master_grads = [m.grad for m in master]
    # ZeRO's buffers that accumulate gradients over the micro-steps. Stage 3's
    # `grad_partitions_flat_buffer` lives on `self.device`, which stage3.py sets to "cpu" when the
    # optimizer is offloaded; stages 1-2 with offload accumulate in pinned host buffers,
    # `accumulated_grads_in_cpu` (whole tensors of the parameters overlapping the partition).
    # With offload the master's fp32 .grad is in host memory too: every gradient partition is.
    zero_grads = []
    for name in ("grad_partitions_flat_buffer", "accumulated_grads_in_cpu"):
        zero_grads += tensors_in(getattr(opt, name, None))
    # ... and, from start-up, two gradient buffers of the working dtype the size of the largest
    # parameter: one pinned in host memory, one on the device (the running sum of an accumulated
    # gradient comes back through it to be added to).
    host_grad_buffer = [getattr(opt, "temp_grad_buffer_for_cpu_offload", None)]
    device_grad_buffer = [getattr(opt, "temp_grad_buffer_for_gpu_offload", None)]
    grads = [p.grad for p in params] + [getattr(p, "grad_accum", None) for p in params] \
        + zero_grads + master_grads + host_grad_buffer + device_grad_buffer
    for name in ("averaged_gradients", "all_grad_tensors"):  # device-side, stages 1-3
        grads += tensors_in(getattr(opt, name, None))
    on_host = []
    if offloaded(config, "offload_optimizer"):
        on_host += master + moments + master_grads + zero_grads + host_weights + host_grad_buffer
    if offloaded(config, "offload_param"):
        on_host += [getattr(p, "ds_tensor", None) for p in params]
    return {"param_bytes": storage_bytes(weights), "grad_bytes": storage_bytes(grads),
            "master_bytes": storage_bytes(master),
            "secondary_bytes": storage_bytes([getattr(p, "ds_secondary_tensor", None)
                                              for p in params]),
            "optim_bytes": storage_bytes(master + moments), "host_bytes": storage_bytes(on_host)}


# --------------------------------------------------------------------------------------------------
# Checkpoints: DeepSpeed writes one folder per tag (at ZeRO stages each rank its own optimizer
# partition, at stage 3 its own module file too); the `latest` file names the newest complete one,
# and we write it ourselves, atomically, after everybody is done.


def save_checkpoint(engine, ckpt_dir: Path, step: int, rank: int) -> None:
    tag = f"step_{step:06d}"
    engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state={"step": step}, save_latest=False)
    dist.barrier()  # every rank's shards are on disk
    if rank == 0:
        tmp = ckpt_dir / ".latest.tmp"
        tmp.write_text(tag)
        tmp.replace(ckpt_dir / "latest")  # atomic rename: a kill leaves the previous `latest`
    dist.barrier()


def resume(engine, args, d) -> int:
    """Load the checkpoint that --ckpt-dir's `latest` names; return the step to start from."""
    if d.rank == 0:
        args.ckpt_dir.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    if not (args.ckpt_dir / "latest").exists():
        return 0
    # Each rank reads its own optimizer shard; module weights, LR scheduler and step counters
    # come back too.
    _, client = engine.load_checkpoint(str(args.ckpt_dir))
    report.print0(f"resumed from step {client['step']} in {args.ckpt_dir}")
    return client["step"]


def low_precision_masters(optimizer, saved: dict | None = None) -> dict:
    """{id(parameter): its fp32 master} under the optimizers DeepSpeed wraps a stage-0 bf16 / fp16
    run in (FP16_UnfusedOptimizer: one fp32 copy per parameter, `fp32_groups`; FP16_Optimizer,
    with a fused Adam: one flat fp32 buffer per group, `fp32_groups_flat`), read from the live
    optimizer or from its `saved` state_dict (a stage-0 checkpoint's "optimizer"). Empty for
    other optimizers: ZeRO's and BF16_Optimizer's masters are found by safe_get_full_fp32_param.
    """
    from torch._utils import _unflatten_dense_tensors
    low = getattr(optimizer, "fp16_groups", None)
    source = saved if saved is not None else vars(optimizer)
    if low is None:
        return {}
    if "fp32_groups" in source:
        masters = source["fp32_groups"]
    elif "fp32_groups_flat" in source:
        masters = [_unflatten_dense_tensors(flat, group)
                   for flat, group in zip(source["fp32_groups_flat"], low)]
    else:
        return {}
    return {id(p): m for group, fp32 in zip(low, masters) for p, m in zip(group, fp32)}


def fp32_state_dict(engine, model, deepspeed, args) -> dict:
    """Consolidated fp32 weights on CPU, keyed like the plain GPT's state_dict: the optimizer's
    fp32 master where it keeps one, never 16-bit weights upcast. Every rank must call it: at
    stage 3 each gather is a collective."""
    masters = {}
    if args.export_source == "checkpoint":
        if engine.zero_optimization():
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
            return get_fp32_state_dict_from_zero_checkpoint(str(args.ckpt_dir)) \
                if engine.global_rank == 0 else {}
        # Stage 0: one file holds the whole module and, in mixed precision, the fp32 master in
        # the optimizer's state (in the live optimizer's parameter order).
        tag = (args.ckpt_dir / "latest").read_text().strip()
        path = args.ckpt_dir / tag / "mp_rank_00_model_states.pt"
        saved = torch.load(path, map_location="cpu", weights_only=False)
        module = saved["module"]
        masters = low_precision_masters(engine.optimizer, saved["optimizer"])
    else:
        module = model.state_dict(keep_vars=True)
        masters = low_precision_masters(engine.optimizer)
    params = dict(model.named_parameters(remove_duplicate=False))
    out = {}
    for name, value in module.items():
        p = params.get(name)
        # ZeRO keeps the fp32 master in shards: gather it (stage 3: an all-gather). At stage 0
        # safe_get_full_fp32_param returns None: in fp32 the optimizer steps the module's own
        # parameters; in bf16 / fp16 the master sits in the FP16_(Unfused)Optimizer's groups.
        full = None
        if p is not None:
            full = masters.get(id(p))
            if full is None and args.export_source == "engine":
                full = deepspeed.utils.safe_get_full_fp32_param(p)
        if full is None and p is not None and value.dtype != torch.float32:
            cli.fail(f"--export: {name} is {value.dtype} and {type(engine.optimizer).__name__} "
                     "exposes no fp32 master for it; upcasting the 16-bit weights would lose "
                     "what the master holds below their precision")
        out[name] = (full if full is not None else value.detach()).float().cpu().clone()
    return out



# --------------------------------------------------------------------------------------------------
# The loop


def train(args, config: dict, d, deepspeed) -> None:
    engine, model, n_params = build(args, config, deepspeed)
    start_step = resume(engine, args, d) if args.ckpt_dir else 0
    micro, accum = config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]
    report.print0(f"{strategy_name(config)} | world {d.world_size} | {d.device.type} "
                  f"{args.precision} | {n_params:,} parameters | global batch "
                  f"{config['train_batch_size']} ({d.world_size} ranks x {micro} x accum {accum})")
    run = loop(args, config, d, engine, model, start_step)
    if run is not None:  # None: stopped by SIGTERM, checkpointed
        report_run(args, config, d, deepspeed, engine, model, {**run, "n_params": n_params,
                                                               "start_step": start_step})
    engine.destroy()  # DeepSpeed's hooks and buffers go before the process group does


def loop(args, config: dict, d, engine, model, start_step: int) -> dict | None:
    """Optimizer steps start_step .. steps-1; the losses, timings and the last step's census."""
    micro, accum = config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]
    global_bs = config["train_batch_size"]
    losses, census, t_start, cpu_start, timed_samples = [], [], None, None, 0
    comms, comms_by_phase = {}, {}
    bar = report.progress(args.steps, "train", initial=start_step)
    for step in range(start_step, args.steps):
        if step == start_step + 1:  # the first step pays for warm-up; time the rest
            t_start, cpu_start = timing.clock(d.device), time.process_time()
        launch.inject_failure(args, d.rank, step)
        x_all, y_all = token_batch(args.seed, step, global_bs, args.seq_len, args.vocab)
        # This rank's rows: r*B*A .. (r+1)*B*A - 1, cut into grad_accum micro-batches of B.
        rows = rank_rows(d.rank, micro * accum)
        last = step == args.steps - 1  # measured in the last step: what each rank holds
        measure = (lambda: census.append(memory_census(engine, model, config))) if last else None
        # ... and what it sends: every collective the engine issues in one optimizer step
        counter = CollectiveCounter() if last else contextlib.nullcontext()
        # nsys --capture-range=nvtx --nvtx-capture="step N" records the range of step N only
        with nvtx_range(f"step {step + 1}"), counter:
            step_loss = train_step(engine, x_all[rows].to(d.device), y_all[rows].to(d.device),
                                   micro, accum, d.device, measure,
                                   phase=lambda name: setattr(counter, "phase", name))
        if last:
            comms = counter.summary()
            comms_by_phase = {name: counter.summary([r for r in counter.records
                                                     if r["phase"] == name])
                              for name in ("forward", "backward", "step")}

        # Mean loss over the global batch, and whether any rank has received SIGTERM.
        flags = torch.stack([step_loss, torch.tensor(float(SIGTERM_RECEIVED.is_set()),
                                                     device=d.device)])
        with nvtx_range("all_reduce: loss, SIGTERM flag"):
            dist.all_reduce(flags, op=dist.ReduceOp.SUM)
        losses.append(flags[0].item() / d.world_size)
        timed_samples += global_bs if step >= start_step + 1 else 0
        done = step + 1
        bar.update(1)
        if d.rank == 0 and (done % args.log_every == 0 or done in (1, args.steps)):
            bar.write(f"step {done:4d}/{args.steps} | loss {losses[-1]:.4f} | lr "
                      f"{engine.get_lr()[0]:.5f}")

        preempted = flags[1].item() > 0  # every rank stops at the same step
        if args.ckpt_dir and ((args.ckpt_every and done % args.ckpt_every == 0)
                              or done == args.steps or preempted):
            save_checkpoint(engine, args.ckpt_dir, done, d.rank)
        if preempted:
            report.print0(f"SIGTERM: checkpointed step {done} to {args.ckpt_dir}; exiting"
                          if args.ckpt_dir else
                          f"SIGTERM: stopped after step {done}; nothing saved (no --ckpt-dir)")
            bar.close()
            return None
    bar.close()
    elapsed = timing.clock(d.device) - t_start if t_start else float("nan")
    timed_steps = args.steps - start_step - 1
    return {"losses": losses, "census": census, "comms": comms, "comms_by_phase": comms_by_phase,
            "samples_per_s": timed_samples / elapsed if timed_samples else float("nan"),
            # CPU seconds this process spent per timed step: steadier than samples/s when a CPU
            # machine is shared. Not on CUDA: the host spins while it waits for the GPU (and
            # NCCL's proxy thread polls), so the figure tracks wall time, not work
            "cpu_s_per_step": (time.process_time() - cpu_start) / timed_steps
            if timed_steps > 0 and d.device.type == "cpu" else None}


def report_run(args, config: dict, d, deepspeed, engine, model, run: dict) -> None:
    """Rank 0 prints what rank 0 holds and writes --metrics-out and --export."""
    state = fp32_state_dict(engine, model, deepspeed, args) if args.export else None
    census = run["census"]
    # Largest footprint over the last step's micro-steps (stage 1 keeps full gradients between
    # micro-steps and only its partition after the last one).
    local = {key: max(c[key] for c in census) for key in census[0]} if census else {}
    local.update(grad_bytes_per_micro_step=[c["grad_bytes"] for c in census],
                 peak_bytes=report.peak_bytes(d.device), cpu_s_per_step=run["cpu_s_per_step"])
    per_rank = report.gather(local)
    report.print0(f"done: {args.steps - run['start_step']} steps, "
                  f"{run['samples_per_s']:.0f} samples/s")
    if census:
        kib = {k: v / 1024 for k, v in per_rank[0].items() if isinstance(v, int)}
        report.print0(f"rank 0 holds: params {kib['param_bytes']:.1f} KiB | grads "
                      f"{kib['grad_bytes']:.1f} KiB | optimizer {kib['optim_bytes']:.1f} KiB "
                      f"(fp32 master {kib['master_bytes']:.1f} KiB)"
                      + (f" | on host {kib['host_bytes']:.1f} KiB" if kib["host_bytes"] else "")
                      + (f" | hpZ secondary partition {kib['secondary_bytes']:.1f} KiB"
                         if kib["secondary_bytes"] else ""))
    report.print0(traffic_line(run["comms"], d.world_size, run["n_params"], args.precision))
    metrics = report.metrics(
        d, script=SCRIPT, strategy=strategy_name(config), steps=args.steps,
        global_batch=config["train_batch_size"], losses=run["losses"],
        samples_per_s=run["samples_per_s"], per_rank=per_rank,
        tokens_per_s=run["samples_per_s"] * args.seq_len, config=str(args.deepspeed_config),
        zero_stage=zero_stage(config), start_step=run["start_step"],
        micro_batch=config["train_micro_batch_size_per_gpu"],
        grad_accum=config["gradient_accumulation_steps"], precision=args.precision,
        n_params=run["n_params"], deepspeed_version=deepspeed.__version__,
        comms_per_step=run["comms"], comms_by_phase=run["comms_by_phase"])
    report.finish(args, metrics, state)


def traffic_line(comms: dict, world: int, n_params: int, precision: str) -> str:
    """What this rank sent in the last optimizer step, by collective, in units of u = (N-1)/N x
    the gradient bytes (W x P, W = 4 in fp32, 2 in bf16): DDP's all-reduce is 2u, the ZeRO
    paper's stages 1-2 are 2u (reduce-scatter + all-gather) and its stage 3 3u (the parameters
    gathered twice)."""
    def groups(s):  # ZeRO++ hpZ gathers over two group sizes: name them
        sizes = s.get("group_sizes", [])
        return f" (groups of {' and '.join(map(str, sizes))})" if len(sizes) > 1 else ""
    parts = " + ".join(f"{kind} {s['sent_bytes']:,}{groups(s)}" for kind, s in comms.items()
                       if s["sent_bytes"] >= 1024)  # leave out the loss's and norms' scalars
    total = sum(s["sent_bytes"] for s in comms.values())
    if world == 1:
        return "sent per optimizer step: nothing (world 1)"
    W = 4 if precision == "fp32" else 2
    u = (world - 1) / world * W * n_params
    return f"sent per optimizer step by this rank: {parts} B = {total / u:.2f} u " \
           f"(u = (N-1)/N x {W}P = {u:,.0f} B; DDP: 2 u)"


def strategy_name(config: dict) -> str:
    return f"zero{zero_stage(config)}" + ("+offload" if offloaded(config, "offload_optimizer")
                                         else "")


# --------------------------------------------------------------------------------------------------
# Arguments, the rest of the config, and launch


def parse_args(argv=None):
    p = cli.parser(__doc__)
    p.add_argument("--deepspeed_config", "--deepspeed-config", type=Path,
                   default=HERE / "configs" / "zero2_config.json", help="DeepSpeed JSON config")
    cli.add_run_args(p)
    cli.add_output_args(p)
    # The per-rank batch, accumulation and LR live in the config; these flags override it.
    p.add_argument("--steps", type=int, default=40, help="optimizer steps (total, resume included)")
    p.add_argument("--batch-size", type=int,
                   help="samples per rank per micro-step (overrides the config's "
                        "train_micro_batch_size_per_gpu)")
    p.add_argument("--grad-accum", type=int,
                   help="micro-steps per optimizer step (overrides gradient_accumulation_steps)")
    p.add_argument("--lr", type=float, help="peak LR (overrides the optimizer's and scheduler's)")
    p.add_argument("--precision", choices=["auto", "fp32", "bf16", "fp16"], default="auto",
                   help="auto: the config's bf16/fp16 section on CUDA, fp32 on CPU")
    cli.add_gpt_args(p, layers=2, dim=64, heads=4, seq_len=32, vocab=64)
    cli.add_ckpt_args(p)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--export-source", choices=["engine", "checkpoint"], default="engine",
                   help="gather the fp32 weights from the live engine, or convert the final "
                        "checkpoint with DeepSpeed's zero_to_fp32 (needs --ckpt-dir)")
    # The deepspeed launcher appends --local_rank=N; the rank is read from the environment.
    p.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    cli.check_positive(args, "steps", "batch_size", "grad_accum", "log_every", "lr", "timeout_s")
    cli.check_gpt_args(args)
    cli.check_ckpt_args(args, launch.launched().world_size)
    if args.export_source == "checkpoint" and not (args.export and args.ckpt_dir):
        cli.fail("--export-source checkpoint needs --export and --ckpt-dir")
    return args


def read_config(path: Path) -> dict:
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        cli.fail(f"--deepspeed_config {path}: file not found")
    except (OSError, UnicodeDecodeError) as exc:
        cli.fail(f"--deepspeed_config {path}: cannot read it ({exc})")
    except json.JSONDecodeError as exc:
        cli.fail(f"--deepspeed_config {path}: malformed JSON: {exc}")
    if not isinstance(config, dict):
        cli.fail(f"{path}: the top level must be a JSON object, got {type(config).__name__}")
    return config


def fit_config(config: dict, args, d) -> None:
    """Fill in what depends on the flags and the world size, before the first collective.

    One config serves every world size: the flags override the per-rank numbers and the global
    batch is derived. A train_batch_size written in the file must agree with them.
    """
    path, world = args.deepspeed_config, d.world_size

    def positive_int(key, default):
        value = config.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            cli.fail(f"{path}: {key} must be a positive integer, got {value!r}")
        return value

    micro = args.batch_size or positive_int("train_micro_batch_size_per_gpu", 8)
    accum = args.grad_accum or positive_int("gradient_accumulation_steps", 1)
    derived = micro * accum * world
    if "train_batch_size" in config and not (args.batch_size or args.grad_accum) \
            and positive_int("train_batch_size", None) != derived:
        cli.fail(f"{path}: train_batch_size {config['train_batch_size']} != "
                 f"train_micro_batch_size_per_gpu {micro} x gradient_accumulation_steps {accum} "
                 f"x world size {world} = {derived}")
    config.update(train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=accum,
                  train_batch_size=derived)
    if args.lr is not None:
        config.setdefault("optimizer", {}).setdefault("params", {})["lr"] = args.lr
        sched = config.get("scheduler", {}).get("params", {})
        if "warmup_max_lr" in sched:
            sched["warmup_max_lr"] = args.lr
    args.precision = set_precision(config, args.precision, d.device)


def set_precision(config: dict, precision: str, device) -> str:
    """Resolve --precision against the config's bf16 / fp16 sections; return the dtype used.

    The configs enable bf16 for GPUs. On a CPU, auto turns it off (fp32) with a note, because the
    lesson's tests compare every stage with an fp32 one-process run.
    """
    wanted = {k: bool((config.get(k) or {}).get("enabled")) for k in ("bf16", "fp16")}
    if wanted["bf16"] and wanted["fp16"]:
        cli.fail("the config enables both bf16 and fp16: choose one")
    if precision == "auto":
        if device.type == "cpu":
            if any(wanted.values()):
                on = "bf16" if wanted["bf16"] else "fp16"
                report.print0(f"note: running on cpu: the config's {on} section is turned off "
                              f"(fp32); --precision {on} keeps it")
            precision = "fp32"
        else:
            precision = "bf16" if wanted["bf16"] else "fp16" if wanted["fp16"] else "fp32"
    if precision == "fp16" and device.type != "cuda":
        cli.fail("--precision fp16 needs CUDA (dynamic loss scaling); use bf16 or fp32 on CPU")
    for key in ("bf16", "fp16"):
        config.setdefault(key, {})["enabled"] = precision == key
    return precision



def main(argv=None):
    args = parse_args(argv)
    config = read_config(args.deepspeed_config)
    check_zero(args.deepspeed_config, config)
    with launch.distributed(args.device, args.timeout_s) as d:
        fit_config(config, args, d)
        deepspeed = launch.start_deepspeed(d)
        train(args, config, d, deepspeed)


if __name__ == "__main__":
    main()

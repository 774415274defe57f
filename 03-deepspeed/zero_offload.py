"""ZeRO-Offload and ZeRO-Infinity: what moves to CPU memory (or NVMe), measured per rank and set
beside DeepSpeed's own memory estimators.

Launch (from the repository root):
    deepspeed --num_gpus 2 03-deepspeed/zero_offload.py          # zero2/3, with and without offload
    deepspeed --num_gpus 8 03-deepspeed/zero_offload.py --width 4096 --estimate-params 7e9
    python 03-deepspeed/zero_offload.py                          # 1 process

For each config the script trains a few steps of the same MLP and lists the bytes of every kind
of model state rank 0 holds and where it lives (the README shows a run).

What offload moves (DeepSpeed's "ZeRO-Offload", Ren et al. 2021, and "ZeRO-Infinity", 2021):
    offload_optimizer (stage 1-3): the fp32 master partition, the gradient partitions (the
        master's fp32 .grad, and at stage 3 also the buffer the backward accumulates into) and the
        Adam moments live in host memory, and DeepSpeedCPUAdam (a vectorised C++ Adam, compiled on
        first use) runs the update on the CPU. At the last micro-step each backward casts this
        rank's reduced gradient partition to fp32 on the device and copies it device -> host
        into the master's .grad: 4P/N bytes, in bf16 training too (stage 3 first also copies the
        W-byte partition into its host gradient buffer and back to the device; while
        accumulating, the running sum also comes back to the device to be added to, and stage 2
        moves whole W-byte tensors of the parameters overlapping the partition); each step
        copies the updated parameters host -> device (W P/N bytes, through the pinned host
        copy of the weight partition that stages 1-2 keep).
    Host memory: stages 1-2 keep (16 + W) P/N bytes (W = 2 in bf16, 4 in fp32) plus one
        gradient buffer the size of the largest parameter, and one more such buffer on the
        device; stage 3 keeps (16 + W) P/N, with offload_param (16 + 2W) P/N.
    offload_param (stage 3 only): the parameter partitions live in host memory too; each layer's
        full parameters are all-gathered onto the device just in time, as stage 3 always does.
    device "nvme" (ZeRO-Infinity): the same tensors go to files under nvme_path, swapped in and
        out through DeepSpeed's async I/O op (libaio); see configs/zero3_nvme_offload_config.json.

Set-up, metrics and export come from the course's shared module, dtcourse.
"""

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from dtcourse import cli, launch, report, timing

SCRIPT = "03-deepspeed/zero_offload.py"
HERE = Path(__file__).resolve().parent
CONFIGS = ["zero2_config", "zero2_offload_config", "zero3_config", "zero3_offload_config"]


# --------------------------------------------------------------------------------------------------
# The model and its data: a stack of width x width layers, so that every layer is the same size


def build_mlp(layers: int, width: int) -> nn.Module:
    # Each Linear is one "layer" for ZeRO-3's just-in-time gathers: width*width + width params.
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU())
                           for _ in range(layers)])


def batch(seed: int, step: int, size: int, width: int):
    """Regression onto a fixed random linear teacher; a pure function of (seed, step)."""
    teacher = torch.randn(width, width, generator=torch.Generator().manual_seed(seed + 12345)) \
        / width**.5
    x = torch.randn(size, width, generator=torch.Generator().manual_seed(seed * 100003 + step))
    return x, x @ teacher


# --------------------------------------------------------------------------------------------------
# Where every kind of model state lives


def where_is_everything(engine, config) -> dict:
    """{kind of model state: (bytes this rank holds, 'device' or 'host')}, read from the ZeRO
    optimizer's tensors (DeepSpeed 0.19 names; deepspeed_train.py's census explains each)."""
    zero = engine.optimizer
    adam = zero.optimizer  # DeepSpeedCPUAdam when the optimizer is offloaded, torch AdamW if not
    zero_cfg = config["zero_optimization"]
    opt_home = "host" if (zero_cfg.get("offload_optimizer") or {}).get("device") == "cpu" \
        else "device"
    param_home = "host" if (zero_cfg.get("offload_param") or {}).get("device") == "cpu" \
        else "device"
    # ZeRO keeps each kind of state in flat per-group buffers (the module's tensors are views
    # into them), so summing the buffers counts every byte once. The gradient partition lives
    # where the optimizer steps: stage3.py allocates `grad_partitions_flat_buffer` on
    # `self.device`, "cpu" when the optimizer is offloaded; stages 1-2 with offload copy each
    # reduced gradient straight into the master's .grad on the host (and accumulate micro-steps
    # in `accumulated_grads_in_cpu`, host buffers), leaving no partition on the device.
    # Stages 1-2 with offload also allocate, in stage_1_and_2.py's __init__: a pinned host buffer
    # of the working dtype the size of the partition (`param_buffer_of_bit16_for_cpu_offload_
    # groups`: the step writes the updated master into it, then copies it to the device), and
    # two gradient buffers the size of the largest parameter, of the working dtype, one pinned
    # in host memory (`temp_grad_buffer_for_cpu_offload`) and one on the device
    # (`temp_grad_buffer_for_gpu_offload`).
    if hasattr(zero, "fp32_partitioned_groups_flat"):  # stage 3
        master = list(zero.fp32_partitioned_groups_flat)
        weights = list(zero.fp16_partitioned_groups_flat)  # this rank's partition only
        weights_home = param_home
        grads = [zero.grad_partitions_flat_buffer]  # filled during backward, accumulated
    else:  # stages 1 and 2: every rank keeps all weights
        master = list(zero.single_partition_of_fp32_groups)
        weights, weights_home = list(zero.bit16_groups_flat), "device"
        grads = [t for ts in (zero.averaged_gradients or {}).values() for t in (ts or [])] \
            + list(getattr(zero, "accumulated_grads_in_cpu", {}).values())
    moments = [t for t in report.optimizer_tensors(adam) if t.dim()]  # not the step counters
    return {
        "weights (working copy)": (report.tensor_bytes(weights), weights_home),
        "weights, host copy": (report.tensor_bytes(
            getattr(zero, "param_buffer_of_bit16_for_cpu_offload_groups", [])), "host"),
        "gradient partition": (report.tensor_bytes(grads), opt_home),
        "largest-param grad, host": (report.tensor_bytes(
            [getattr(zero, "temp_grad_buffer_for_cpu_offload", None)]), "host"),
        "largest-param grad, dev.": (report.tensor_bytes(
            [getattr(zero, "temp_grad_buffer_for_gpu_offload", None)]), "device"),
        "fp32 master partition": (report.tensor_bytes(master), opt_home),
        "fp32 gradient of master": (report.tensor_bytes([m.grad for m in master]), opt_home),
        "Adam moments": (report.tensor_bytes(moments), opt_home),
    }


def storages(tensors) -> set:
    """The memory blocks the tensors live in (one per storage), None and empty ones left out."""
    return {t.untyped_storage().data_ptr() for t in tensors if torch.is_tensor(t) and t.numel()}


def gathered_bytes(model) -> int:
    """Stage 3: bytes of full parameters gathered on this rank now. A partitioned parameter's
    .data is an empty tensor until its layer gathers it (its own partition is `ds_tensor`)."""
    return sum(p.data.numel() * p.data.element_size() for p in model.parameters()
               if hasattr(p, "ds_tensor"))


class StepCopies:
    """The gradient copy the optimizer step makes: stages 1-3 without offload flatten the
    gradient partition into a new tensor of the master's dtype (fp32) and hang it on the master
    as .grad for the step (stage_1_and_2.py's step, stage3.py's _prepare_fp32_grad_for_sub_group);
    with offload the master's .grad is a host buffer kept from step to step. A pre-hook on the
    inner optimizer's step sees every .grad it steps with; the bytes of those whose memory is
    none of the buffers the census counted are the step's own copy (the most at one call: each
    group's copy is freed before the next group's step). It also notes the stage-3 parameters
    still gathered while the step runs (none: backward released them)."""

    def __init__(self, adam, model):
        self.known, self.most, self.gathered, self.model = set(), 0, 0, model
        self.handle = adam.register_step_pre_hook(self.hook)

    def hook(self, optimizer, args, kwargs):
        fresh = [p.grad for g in optimizer.param_groups for p in g["params"]
                 if p.grad is not None and p.grad.untyped_storage().data_ptr() not in self.known]
        self.most = max(self.most, report.tensor_bytes(fresh))
        self.gathered = max(self.gathered, gathered_bytes(self.model))


def metrics_bytes(census: dict) -> dict:
    """The census in the per_rank terms of every script's metrics."""
    b = {kind: nbytes for kind, (nbytes, _) in census.items()}
    return {"param_bytes": b["weights (working copy)"] + b["weights, host copy"],
            "grad_bytes": b["gradient partition"] + b["fp32 gradient of master"]
            + b["largest-param grad, host"] + b["largest-param grad, dev."],
            "optim_bytes": b["fp32 master partition"] + b["Adam moments"],
            "host_bytes": sum(nbytes for nbytes, home in census.values() if home == "host")}


# --------------------------------------------------------------------------------------------------
# A few steps of each config


def train_one(path: Path, config: dict, args, d, deepspeed) -> dict:
    """A few steps of one config; returns this rank's measurements (and exports on rank 0)."""
    precision = args.precision
    if precision == "auto":  # fp32 on CPU, as deepspeed_train.py
        precision = "bf16" if d.device.type == "cuda" else "fp32"
    config = {**config, "train_micro_batch_size_per_gpu": args.batch_size,
              "gradient_accumulation_steps": 1, "train_batch_size": args.batch_size * d.world_size,
              "bf16": {"enabled": precision == "bf16"}}
    config.pop("scheduler", None)
    stage = config["zero_optimization"]["stage"]
    torch.manual_seed(args.seed)
    with deepspeed.zero.Init(config_dict_or_path=config, enabled=stage == 3):
        model = build_mlp(args.layers, args.width)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    t0, census, losses, gathered = None, None, [], 0
    copies = StepCopies(engine.optimizer.optimizer, model)
    for step in range(args.steps):
        if step == 1:
            t0 = timing.clock(d.device)
        last = step == args.steps - 1
        x, y = batch(args.seed, step, args.batch_size * d.world_size, args.width)
        rows = slice(d.rank * args.batch_size, (d.rank + 1) * args.batch_size)
        out = engine(x[rows].to(d.device, dtype))
        if last:  # stage 3: what forward left gathered for backward (stage3_max_reuse_distance)
            gathered = gathered_bytes(model)
        loss = F.mse_loss(out.float(), y[rows].to(d.device))
        engine.backward(loss)
        if last:  # gradients complete, not yet consumed by the step
            census = where_is_everything(engine, config)
            zero = engine.optimizer
            copies.known = storages(
                [m.grad for m in getattr(zero, "single_partition_of_fp32_groups", None)
                 or zero.fp32_partitioned_groups_flat]
                + [getattr(zero, "grad_partitions_flat_buffer", None)]
                + list(getattr(zero, "accumulated_grads_in_cpu", {}).values()))
            copies.most = copies.gathered = 0
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # the loss over the global batch
        losses.append(mean.item() / d.world_size)
    step_s = (timing.clock(d.device) - t0) / (args.steps - 1) if t0 else float("nan")
    if args.export:
        export(engine, model, deepspeed, args, path.stem, d)
    engine.destroy()
    copies.handle.remove()
    transient = {"gathered after forward": gathered, "fp32 gradient copy in step": copies.most}
    return {"config": path.stem, "stage": stage, "precision": precision, "census": census,
            "transient": transient, "gathered_in_step_bytes": copies.gathered,
            "step_s": step_s, "losses": losses}


def export(engine, model, deepspeed, args, name: str, d) -> None:
    """The consolidated fp32 weights (stage 3: an all-gather per parameter, on every rank);
    rank 0 writes one file per config: PATH with the config's name before the suffix."""
    state = {k: deepspeed.utils.safe_get_full_fp32_param(p).float().cpu()
             for k, p in model.state_dict(keep_vars=True).items()}
    if d.rank == 0:
        report.save_state_dict(
            report.variant_path(args.export, name, several=len(args.config_paths) > 1), state)


def estimate(n_params: int, largest: int, world: int, config: dict, stage: int) -> tuple:
    """DeepSpeed's estimator for this config (it assumes 16-bit weights and gradients)."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    zero_cfg = config["zero_optimization"]
    offload_opt = (zero_cfg.get("offload_optimizer") or {}).get("device") == "cpu"
    offload_param = (zero_cfg.get("offload_param") or {}).get("device") == "cpu"
    if stage == 3:
        host, device, _ = estimate_zero3_model_states_mem_needs(
            n_params, largest, num_gpus_per_node=world, cpu_offload=offload_opt,
            cpu_offload_params=offload_param)
    else:
        host, device = estimate_zero2_model_states_mem_needs(
            n_params, num_gpus_per_node=world, cpu_offload=offload_opt)
    return device, host


def run(args, d, deepspeed) -> None:
    n_params = sum(p.numel() for p in build_mlp(args.layers, args.width).parameters())
    largest = args.width * args.width + args.width
    results = []
    for path, config in args.config_paths:
        mine = train_one(path, config, args, d, deepspeed)
        est_device, est_host = estimate(n_params, largest, d.world_size, config, mine["stage"])
        held = {**metrics_bytes(mine["census"]), "peak_bytes": report.peak_bytes(d.device),
                "census": mine["census"], "transient": mine["transient"],
                "gathered_in_step_bytes": mine["gathered_in_step_bytes"]}
        results.append({**mine, "per_rank": report.gather(held),
                        "estimate_device_bytes": est_device, "estimate_host_bytes": est_host})
    if d.rank == 0:
        print_table(args, d, n_params, results)
        print_estimator(args, d.world_size)
    runs = {r["config"]: report.metrics(
        d, script=SCRIPT, strategy=r["config"].removesuffix("_config"), steps=args.steps,
        global_batch=args.batch_size * d.world_size, losses=r["losses"],
        samples_per_s=args.batch_size * d.world_size / r["step_s"],
        per_rank=r["per_rank"],        precision=r["precision"], zero_stage=r["stage"],
        estimate_device_bytes=r["estimate_device_bytes"],
        estimate_host_bytes=r["estimate_host_bytes"]) for r in results}
    report.finish(args, {"script": SCRIPT, "world_size": d.world_size, "n_params": n_params,
                         "largest_layer_params": largest, "deepspeed_version":
                         deepspeed.__version__, "runs": runs})


# --------------------------------------------------------------------------------------------------
# The printed tables


def print_table(args, d, n_params: int, results: list) -> None:
    print(f"MLP {args.layers} x Linear({args.width}, {args.width}): P = {n_params:,} parameters "
          f"| world {d.world_size} | {results[0]['precision']} on {d.device.type} | bytes held by "
          "rank 0 after the last backward", flush=True)
    kinds = list(results[0]["census"])
    print(f"{'':26}" + "".join(f"{r['config'].replace('_config', ''):>18}" for r in results))
    for kind in kinds:
        cells = "".join(f"{r['census'][kind][0]:>11,} {r['census'][kind][1]:<6}" for r in results)
        print(f"{kind:26}{cells}")
    for label, home in (("total on device", "device"), ("total on host", "host")):
        cells = "".join(f"{sum(b for b, h in r['census'].values() if h == home):>11,}{'':7}"
                        for r in results)
        print(f"{label:26}{cells}")
    for label, key in (("DeepSpeed estimate device", "estimate_device_bytes"),
                       ("DeepSpeed estimate host", "estimate_host_bytes")):
        print(f"{label:26}" + "".join(f"{r[key]:>11,}{'':7}" for r in results))
    # Bytes that exist only for part of a step, on the device (not in the totals above)
    for kind in results[0]["transient"]:
        print(f"{kind:26}" + "".join(f"{r['transient'][kind]:>11,} {'device':<6}"
                                     for r in results))
    # ~: a timing, on whatever else the machine runs
    print(f"{'seconds per step':26}" + "".join(f"{'~' + format(r['step_s'], '.3f'):>11}{'':7}"
                                               for r in results))
    print(f"{'final loss':26}" + "".join(f"{r['losses'][-1]:>11.5f}{'':7}" for r in results),
          flush=True)


def print_estimator(args, world: int) -> None:
    """DeepSpeed's tables for --estimate-params on one node of --estimate-gpus GPUs (default:
    as many as this launch has ranks)."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs_all_cold
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs_all_cold
    world = args.estimate_gpus or world
    print(f"\nDeepSpeed's estimator for a {args.estimate_params / 1e9:g}B-parameter model on "
          f"{world} GPU(s):", flush=True)
    estimate_zero2_model_states_mem_needs_all_cold(int(args.estimate_params),
                                                   num_gpus_per_node=world)
    estimate_zero3_model_states_mem_needs_all_cold(int(args.estimate_params),
                                                   int(args.estimate_largest_layer),
                                                   num_gpus_per_node=world)


# --------------------------------------------------------------------------------------------------
# Arguments and launch


def parse_args(argv=None):
    p = cli.parser(__doc__)
    cli.add_run_args(p)
    cli.add_output_args(p)
    p.add_argument("--configs", nargs="+", default=CONFIGS,
                   help="config names in 03-deepspeed/configs/ (or paths)")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps per config")
    p.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto",
                   help="auto: bf16 on CUDA, fp32 on CPU (bf16 runs on a CPU too, slowly)")
    p.add_argument("--batch-size", type=int, default=8, help="samples per rank per step")
    p.add_argument("--layers", type=int, default=4, help="Linear layers of the MLP")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--estimate-params", type=float, default=1.5e9,
                   help="also print DeepSpeed's estimator tables for a model this size")
    p.add_argument("--estimate-largest-layer", type=float, default=8.0e7,
                   help="its largest layer (default: GPT-2 XL's 50257 x 1600 embedding); the "
                   "stage-3 table reserves 4 bytes per element on each GPU: its 16-bit "
                   "parameter and 16-bit gradient")
    p.add_argument("--estimate-gpus", type=int,
                   help="GPUs on one node for those tables (None: as many as the ranks launched)")
    p.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    cli.check_positive(args, "steps", "batch_size", "layers", "width", "estimate_gpus",
                       "timeout_s")
    args.config_paths = []
    for name in args.configs:
        path = Path(name) if name.endswith(".json") else HERE / "configs" / f"{name}.json"
        try:
            config = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            cli.fail(f"config {path}: {exc}")
        stage = config.get("zero_optimization", {}).get("stage", 0)
        if stage not in (1, 2, 3):
            cli.fail(f"{path}: offload needs ZeRO stage 1, 2 or 3, got zero_optimization.stage "
                     f"{stage!r}")
        if "nvme" in json.dumps(config.get("zero_optimization", {})):
            cli.fail(f"{path}: NVMe offload is not measured by this script (see the README)")
        args.config_paths.append((path, config))
    return args



def main(argv=None):
    args = parse_args(argv)
    with launch.distributed(args.device, args.timeout_s) as d:
        run(args, d, launch.start_deepspeed(d))


if __name__ == "__main__":
    main()

"""ZeRO-Offload and ZeRO-Infinity: what moves to CPU memory (or NVMe), measured per rank and set
beside DeepSpeed's own memory estimators.

Launch (from the repository root):
    deepspeed --num_gpus 2 03-deepspeed/zero_offload.py          # zero2/3, with and without offload
    deepspeed --num_gpus 8 03-deepspeed/zero_offload.py --width 4096 --estimate-params 7e9
    python 03-deepspeed/zero_offload.py                          # 1 process

For each config the script trains a few steps of the same MLP and lists the bytes of every kind
of model state rank 0 holds and where it lives. Expected output (deepspeed --num_gpus 2; 2-core
AMD EPYC CPU (shared), torch 2.14.1, deepspeed 0.19.8, gloo; abridged, the README has it all):
                                   zero2     zero2_offload         zero3     zero3_offload
    weights (working copy)  1,052,672 device  1,052,672 device  526,336 device  526,336 host
    gradient partition        526,336 device          0 device  526,336 device  526,336 device
    fp32 master partition     526,336 device    526,336 host    526,336 device  526,336 host
    fp32 gradient of master         0 device    526,336 host          0 device  526,336 host
    Adam moments            1,052,672 device  1,052,672 host  1,052,672 device 1,052,672 host
    total on device         3,158,016         1,052,672       2,631,680          526,336
    total on host                   0         2,105,344               0        2,631,680

What offload moves (DeepSpeed's "ZeRO-Offload", Ren et al. 2021, and "ZeRO-Infinity", 2021):
    offload_optimizer (stage 1-3): the fp32 master partition, its fp32 gradient partition and the
        Adam moments live in host memory, and DeepSpeedCPUAdam (a vectorised C++ Adam, compiled on
        first use) runs the update on the CPU. Per step: gradients device -> host (4P/N bytes in
        fp32 here, 2P/N in bf16), updated parameters host -> device.
    offload_param (stage 3 only): the parameter partitions live in host memory too; each layer's
        full parameters are all-gathered onto the device just in time, as stage 3 always does.
    device "nvme" (ZeRO-Infinity): the same tensors go to files under nvme_path, swapped in and
        out through DeepSpeed's async I/O op (libaio); see configs/zero3_nvme_offload_config.json.
"""

import argparse
import gc
import json
import logging
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
CONFIGS = ["zero2_config", "zero2_offload_config", "zero3_config", "zero3_offload_config"]


def fail(msg: str) -> None:
    """Bad input: one line on stderr and exit status 2, on every rank, before any collective."""
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID"))
    prefix = f"[rank {rank}] " if rank is not None else ""
    print(f"{prefix}error: {msg}", file=sys.stderr, flush=True)
    sys.exit(2)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.error = fail
    p.add_argument("--configs", nargs="+", default=CONFIGS,
                   help="config names in 03-deepspeed/configs/ (or paths)")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps per config")
    p.add_argument("--batch-size", type=int, default=8, help="samples per rank per step")
    p.add_argument("--layers", type=int, default=4, help="Linear layers of the MLP")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--estimate-params", type=float, default=1.5e9,
                   help="also print DeepSpeed's estimator tables for a model this size")
    p.add_argument("--estimate-largest-layer", type=float, default=8.0e7,
                   help="its largest layer (default: GPT-2 XL's 50257 x 1600 embedding)")
    p.add_argument("--timeout-s", type=float, default=120, help="collective timeout")
    p.add_argument("--json-out", type=Path, help="rank 0 writes the measurements here")
    p.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if min(args.steps, args.batch_size, args.layers, args.width) < 1:
        fail("--steps, --batch-size, --layers and --width must be at least 1")
    args.config_paths = []
    for name in args.configs:
        path = Path(name) if name.endswith(".json") else HERE / "configs" / f"{name}.json"
        try:
            config = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            fail(f"config {path}: {exc}")
        stage = config.get("zero_optimization", {}).get("stage", 0)
        if stage not in (1, 2, 3):
            fail(f"{path}: offload needs ZeRO stage 1, 2 or 3, got zero_optimization.stage "
                 f"{stage!r}")
        if "nvme" in json.dumps(config.get("zero_optimization", {})):
            fail(f"{path}: NVMe offload is not measured by this script (see the README)")
        args.config_paths.append((path, config))
    return args


def init_distributed(timeout_s: float):
    """(rank, world, deepspeed) on the device DeepSpeed detects; see deepspeed_train.py."""
    env = os.environ
    import deepspeed
    deepspeed.utils.logger.setLevel(logging.WARNING)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    timeout = timedelta(seconds=timeout_s)
    if "RANK" not in env:  # plain `python`: a group of one
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout)
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    deepspeed.init_distributed(dist_backend=backend, timeout=timeout)
    return dist.get_rank(), dist.get_world_size(), deepspeed


def build_mlp(layers: int, width: int) -> nn.Module:
    # Each Linear is one "layer" for ZeRO-3's just-in-time gathers: width*width + width params.
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU())
                           for _ in range(layers)])


def batch(step: int, size: int, width: int):
    """Regression onto a fixed random linear teacher; a pure function of the step."""
    teacher = torch.randn(width, width, generator=torch.Generator().manual_seed(12345)) / width**.5
    x = torch.randn(size, width, generator=torch.Generator().manual_seed(step))
    return x, x @ teacher


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


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
    # into them), so summing the buffers counts every byte once.
    if hasattr(zero, "fp32_partitioned_groups_flat"):  # stage 3
        master = list(zero.fp32_partitioned_groups_flat)
        weights = list(zero.fp16_partitioned_groups_flat)  # this rank's partition only
        weights_home = param_home
        grads = [zero.grad_partitions_flat_buffer]  # fp32 partition, filled during backward
    else:  # stages 1 and 2: every rank keeps all weights
        master = list(zero.single_partition_of_fp32_groups)
        weights, weights_home = list(zero.bit16_groups_flat), "device"
        grads = [t for ts in (zero.averaged_gradients or {}).values() for t in (ts or [])]
    moments = [v for s in adam.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()]
    return {
        "weights (working copy)": (nbytes(weights), weights_home),
        "gradient partition": (nbytes(grads), "device"),
        "fp32 master partition": (nbytes(master), opt_home),
        "fp32 gradient of master": (nbytes([m.grad for m in master]), opt_home),
        "Adam moments": (nbytes(moments), opt_home),
    }


def train_one(path, config, args, rank, world, deepspeed):
    """A few steps of one config; returns this rank's measurements."""
    config = {**config, "train_micro_batch_size_per_gpu": args.batch_size,
              "gradient_accumulation_steps": 1, "train_batch_size": args.batch_size * world,
              "bf16": {"enabled": torch.cuda.is_available()}}  # fp32 on CPU, as deepspeed_train
    config.pop("scheduler", None)
    stage = config["zero_optimization"]["stage"]
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=config, enabled=stage == 3):
        model = build_mlp(args.layers, args.width)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config)
    device = engine.device
    t0, census, loss = None, None, None
    for step in range(args.steps):
        if step == 1:
            t0 = time.perf_counter()
        x, y = batch(step, args.batch_size * world, args.width)
        rows = slice(rank * args.batch_size, (rank + 1) * args.batch_size)
        dtype = torch.bfloat16 if config["bf16"]["enabled"] else torch.float32
        out = engine(x[rows].to(device, dtype))
        loss = F.mse_loss(out.float(), y[rows].to(device))
        engine.backward(loss)
        if step == args.steps - 1:  # gradients complete, not yet consumed by the step
            census = where_is_everything(engine, config)
        engine.step()
    step_s = (time.perf_counter() - t0) / (args.steps - 1) if t0 else float("nan")
    engine.destroy()
    return {"config": path.stem, "stage": stage, "census": census, "step_s": step_s,
            "loss": loss.item()}


def main(argv=None):
    args = parse_args(argv)
    rank, world, deepspeed = init_distributed(args.timeout_s)
    try:
        run(args, rank, world, deepspeed)
    finally:
        gc.collect()  # DeepSpeed's engines sit in reference cycles holding process groups
        dist.destroy_process_group()


def run(args, rank, world, deepspeed):
    from deepspeed.runtime.zero.stage3 import (
        estimate_zero3_model_states_mem_needs,
        estimate_zero3_model_states_mem_needs_all_cold,
    )
    from deepspeed.runtime.zero.stage_1_and_2 import (
        estimate_zero2_model_states_mem_needs,
        estimate_zero2_model_states_mem_needs_all_cold,
    )

    n_params = sum(p.numel() for p in build_mlp(args.layers, args.width).parameters())
    largest = args.width * args.width + args.width
    results = []
    for path, config in args.config_paths:
        mine = train_one(path, config, args, rank, world, deepspeed)
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
        zero_cfg = config["zero_optimization"]
        offload_opt = (zero_cfg.get("offload_optimizer") or {}).get("device") == "cpu"
        offload_param = (zero_cfg.get("offload_param") or {}).get("device") == "cpu"
        # DeepSpeed's estimator (it assumes 16-bit weights and gradients; see the README).
        if mine["stage"] == 3:
            est_host, est_device, _ = estimate_zero3_model_states_mem_needs(
                n_params, largest, num_gpus_per_node=world, cpu_offload=offload_opt,
                cpu_offload_params=offload_param)
        else:
            est_host, est_device = estimate_zero2_model_states_mem_needs(
                n_params, num_gpus_per_node=world, cpu_offload=offload_opt)
        results.append({**mine, "per_rank": [e["census"] for e in everyone],
                        "estimate_device_bytes": est_device, "estimate_host_bytes": est_host})

    if rank != 0:
        return
    print(f"MLP {args.layers} x Linear({args.width}, {args.width}): P = {n_params:,} parameters "
          f"| world {world} | fp32 on {'cuda' if torch.cuda.is_available() else 'cpu'} | bytes "
          "held by rank 0 after the last backward", flush=True)
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
    print(f"{'seconds per step':26}" + "".join(f"{r['step_s']:>11.3f}{'':7}" for r in results))
    print(f"{'final loss':26}" + "".join(f"{r['loss']:>11.5f}{'':7}" for r in results), flush=True)

    print(f"\nDeepSpeed's estimator for a {args.estimate_params / 1e9:g}B-parameter model on "
          f"{world} GPU(s):", flush=True)
    estimate_zero2_model_states_mem_needs_all_cold(int(args.estimate_params),
                                                   num_gpus_per_node=world)
    estimate_zero3_model_states_mem_needs_all_cold(int(args.estimate_params),
                                                   int(args.estimate_largest_layer),
                                                   num_gpus_per_node=world)
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps({
            "script": "03-deepspeed/zero_offload.py", "world_size": world, "n_params": n_params,
            "largest_layer_params": largest, "results": results,
            "deepspeed_version": deepspeed.__version__}, indent=1))


if __name__ == "__main__":
    main()

"""Sharded checkpoints of an FSDP2 model with torch.distributed.checkpoint (DCP): every rank writes
its own shards, training resumes from the newest complete checkpoint (also at another world size:
DCP reshards on load), and a full unsharded state dict is exported for inference.

Launch (from the repository root):
    torchrun --nproc_per_node=2 02-fsdp/fsdp_checkpoint.py --ckpt-dir runs/fsdp_ckpt --steps 10
    torchrun --nproc_per_node=2 02-fsdp/fsdp_checkpoint.py --ckpt-dir runs/fsdp_ckpt --steps 20
        # ^ resumes at step 10
    torchrun --nproc_per_node=4 02-fsdp/fsdp_checkpoint.py --ckpt-dir runs/fsdp_ckpt --steps 30 \
        --batch-size 8   # resumes the world-2 checkpoint on 4 ranks (same global batch)
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc_per_node=2 \
        --max-restarts=1 02-fsdp/fsdp_checkpoint.py --ckpt-dir runs/fsdp_ft --ckpt-every 5 \
        --fail-at-step 8 --fail-rank 1
        # ^ rank 1 raises at step 8; torchrun restarts both ranks, which resume from step 5
        #   (the variable works around a torch restart bug: RUNNING_AT_SCALE.md, section 4)

A checkpoint is a directory:
    step_000010/
        .metadata         written last by rank 0: global shapes, and which file holds which chunk
        __0_0.distcp      rank 0's shards (its rows of every parameter and of its Adam state)
        __1_0.distcp      rank 1's shards
It is written as .tmp_step_000010, fsynced, and renamed when every rank has finished, so a
directory named step_* is complete (an existing one is moved aside to .old_step_* first, and put
back if the new one never got its name); the newest one is resumed. Loading maps the saved chunks
onto the shards the *current* ranks hold, whatever the world size that saved them.

On several nodes, --ckpt-dir must be one filesystem that every node mounts (NFS, Lustre, GPFS, ...):
every rank writes its own file into the same directory, and rank 0 alone writes .metadata, renames
the directory and picks the newest step for everyone. On node-local disks each node would hold
only its own ranks' files, and the other nodes would not find the step_* directory rank 0 chose.
"""

import os
import re
import shutil
import signal
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_state_dict, set_state_dict)

from dtcourse import cli, launch, report, timing
from dtcourse.data import classification_batch, rank_rows
from dtcourse.models import ResidualMLP

try:  # public since torch 2.6; torch.distributed._composable.fsdp before
    from torch.distributed.fsdp import fully_shard
except ImportError:
    from torch.distributed._composable.fsdp import fully_shard

SCRIPT = "02-fsdp/fsdp_checkpoint.py"


# --------------------------------------------------------------------------------------------------
# The model: dtcourse.models.ResidualMLP, residual blocks, one FSDP unit each


def build(args, device):
    """The same full model on every rank (same seed), then sharded: fully_shard keeps this rank's
    rows of every parameter, and AdamW's state follows the shards."""
    torch.manual_seed(args.seed)
    model = ResidualMLP(args.hidden, args.depth).to(device)
    # An explicit mesh on the run's device: without one, fully_shard builds a default mesh on
    # the GPU whenever CUDA exists, even for --device cpu
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)


def lr_at(step: int, peak_lr: float, warmup: int) -> float:
    """Linear warmup over `warmup` steps, then constant: a function of the step alone, so a
    resumed run needs no scheduler state."""
    return peak_lr * min(1.0, (step + 1) / warmup) if warmup else peak_lr


# --------------------------------------------------------------------------------------------------
# Sharded checkpoints


def newest_checkpoint(ckpt_dir: Path, rank: int):
    """Rank 0 removes interrupted writes (.tmp_*) and picks the newest complete step_* directory;
    every rank gets its answer, so all of them load the same one. Rank 0 lists the directory for
    every node: on several nodes it must be on a filesystem they all share."""
    choice = [None]
    if rank == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        for old in ckpt_dir.glob(".old_step_*"):  # a replace that stopped halfway (save_checkpoint)
            final = ckpt_dir / old.name.removeprefix(".old_")
            if final.exists():
                shutil.rmtree(old, ignore_errors=True)
            else:
                old.rename(final)  # the new one never got its name: the old one gets it back
        for tmp in ckpt_dir.glob(".tmp_step_*"):
            shutil.rmtree(tmp, ignore_errors=True)
        # step_<N> with DCP's .metadata, by step number (step_1000000 after step_999999); a copy
        # such as step_000010.bak is not a checkpoint of this run
        steps = {p: re.fullmatch(r"step_(\d+)", p.name) for p in ckpt_dir.iterdir()}
        done = sorted((p for p, m in steps.items() if m and (p / ".metadata").exists()),
                      key=lambda p: int(steps[p][1]))
        choice = [str(done[-1]) if done else None]
    dist.broadcast_object_list(choice, src=0)
    return Path(choice[0]) if choice[0] else None


def save_checkpoint(ckpt_dir: Path, step: int, model, optimizer, world: int, rank: int) -> Path:
    """Every rank writes its own shards (no gather to rank 0), into a temporary directory that
    rank 0 renames once all ranks are done: one directory that every node sees (a shared
    filesystem), or the rename would move rank 0's node's files only."""
    # get_state_dict: keys are the plain model's names ("blocks.0.fc1.weight"); values are
    # DTensors, so DCP records each shard's offset in the global tensor. Optimizer state is keyed
    # by parameter name too (not by index), which is what lets another world size load it.
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd,
             "step": torch.tensor(step), "world_size": torch.tensor(world)}
    tmp, final = ckpt_dir / f".tmp_step_{step:06d}", ckpt_dir / f"step_{step:06d}"
    dcp.save(state, checkpoint_id=str(tmp))  # collective: rank 0 writes .metadata last
    dist.barrier()
    if rank == 0:
        old = ckpt_dir / f".old_{final.name}"
        if final.exists():  # an earlier run wrote this step already (a restart): move it aside,
            final.rename(old)  # so that a kill from here on still leaves one of the two
        fsync_dir(tmp)  # every rank's file entry and .metadata's, before the name points there
        tmp.rename(final)  # the name step_* appears only for a whole checkpoint
        fsync_dir(ckpt_dir)  # ... and stays after a node crash (on a filesystem that honours it)
        shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable: the directory's own entry list is flushed to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_checkpoint(path: Path, model, optimizer):
    """Load in place into this rank's shards; returns (step, world size that saved it)."""
    model_sd, optim_sd = get_state_dict(model, optimizer)  # the shapes and shards we hold now
    state = {"model": model_sd, "optim": optim_sd,
             "step": torch.tensor(0), "world_size": torch.tensor(0)}
    dcp.load(state, checkpoint_id=str(path))  # reads only the chunks overlapping our shards
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    return int(state["step"]), int(state["world_size"])


def resume(args, d, model, optimizer):
    """Load the newest checkpoint of --ckpt-dir, if any: (step to start from, what was loaded)."""
    path = newest_checkpoint(args.ckpt_dir, d.rank)
    if path is None:
        return 0, None
    step, saved_world = load_checkpoint(path, model, optimizer)
    report.print0(f"resumed from step {step}: {path} (saved by {saved_world} ranks, loaded on "
                  f"{d.world_size})")
    return step, {"path": str(path), "step": step, "saved_world_size": saved_world}



# --------------------------------------------------------------------------------------------------
# One step and the loop


def train_step(args, d, model, optimizer, step: int, global_bs: int) -> torch.Tensor:
    """One AdamW step on this rank's rows of step `step`'s global batch; returns the loss."""
    for group in optimizer.param_groups:
        group["lr"] = lr_at(step, args.lr, args.warmup_steps)
    x_all, y_all = classification_batch(args.seed, step, global_bs)
    rows = rank_rows(d.rank, args.batch_size)
    optimizer.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x_all[rows].to(d.device)), y_all[rows].to(d.device))
    loss.backward()  # reduce-scatter: each rank ends with the averaged grads of its shards
    optimizer.step()
    return loss.detach()


def train(args, d):
    global_bs = d.world_size * args.batch_size
    model, optimizer = build(args, d.device)
    start_step, resumed = resume(args, d, model, optimizer) if args.ckpt_dir else (0, None)

    # Preemption (SLURM, or torchrun shutting down) sends SIGTERM: only set a flag; the loop
    # agrees on it across ranks, checkpoints and exits at the same step on every rank.
    stop = {"requested": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(requested=True))
    report.print0(f"world {d.world_size} | device {d.device} | global batch {global_bs} | "
                  f"steps {start_step}..{args.steps}")

    losses, saved, t_start = [], [], timing.clock(d.device)
    bar = report.progress(args.steps, "train", initial=start_step)
    for step in range(start_step, args.steps):
        launch.inject_failure(args, d.rank, step)
        loss = train_step(args, d, model, optimizer, step, global_bs)
        # One small all-reduce: [sum of the ranks' losses, ranks that received SIGTERM].
        flags = torch.stack([loss, torch.tensor(float(stop["requested"]), device=d.device)])
        dist.all_reduce(flags)
        losses.append(flags[0].item() / d.world_size)
        done = step + 1
        bar.update(1)
        if d.is_main and (done % args.log_every == 0 or done in (start_step + 1, args.steps)):
            bar.write(f"step {done:4d}/{args.steps} | loss {losses[-1]:.4f}")
        preempted = flags[1].item() > 0  # every rank stops at the same step
        if args.ckpt_dir and ((args.ckpt_every and done % args.ckpt_every == 0)
                              or done == args.steps or preempted):
            saved.append(str(save_checkpoint(args.ckpt_dir, done, model, optimizer,
                                             d.world_size, d.rank)))
            if d.is_main:
                bar.write(f"saved sharded checkpoint {saved[-1]}")
        if preempted:
            report.print0(f"SIGTERM: checkpointed step {done}; exiting")
            bar.close()
            return
    bar.close()
    samples_per_s = (args.steps - start_step) * global_bs / (timing.clock(d.device) - t_start)
    report.print0(f"done: steps {start_step}..{args.steps}, {samples_per_s:.0f} samples/s")
    finish(args, d, model, optimizer, losses, global_bs, samples_per_s, start_step, resumed,
           saved)


def finish(args, d, model, optimizer, losses, global_bs, samples_per_s, start_step, resumed,
           saved) -> None:
    """Metrics and the export: the shards all-gathered into one plain state dict on rank 0."""
    per_rank = report.gather(report.held_bytes(params=model.parameters(), optimizer=optimizer,
                                               device=d.device))
    full_sd = get_model_state_dict(  # a collective: every rank takes part, rank 0 keeps it
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)) \
        if args.export else None
    metrics = report.metrics(d, script=SCRIPT, strategy="full", steps=args.steps,
                             global_batch=global_bs, losses=losses, samples_per_s=samples_per_s,
                             per_rank=per_rank, start_step=start_step, resumed=resumed,
                             checkpoints=saved)
    report.finish(args, metrics, full_sd)
    if args.export:
        report.print0(f"exported the full state dict ({len(full_sd or {})} tensors) to "
                      f"{args.export}")


# --------------------------------------------------------------------------------------------------
# Arguments and launch


def parse_args(argv=None):
    p = cli.parser(__doc__)
    cli.add_run_args(p)
    cli.add_train_args(p, steps=20, batch_size=16, lr=3e-3, grad_accum=False,
                       batch_help="samples per rank")
    cli.add_output_args(p)
    p.add_argument("--warmup-steps", type=int, default=5, help="linear warmup of the LR")
    p.add_argument("--hidden", type=int, default=90, help="width (90 rows split unevenly on 4)")
    p.add_argument("--depth", type=int, default=3, help="residual blocks (one FSDP unit each)")
    cli.add_ckpt_args(p)
    p.add_argument("--log-every", type=int, default=5)
    args = p.parse_args(argv)
    cli.check_positive(args, "steps", "batch_size", "hidden", "depth", "log_every", "lr",
                       "timeout_s")
    if args.warmup_steps < 0:
        cli.fail(f"--warmup-steps must be >= 0, got {args.warmup_steps}")
    cli.check_ckpt_args(args, launch.launched().world_size)
    return args


def main(argv=None):
    args = parse_args(argv)
    with launch.distributed(args.device, args.timeout_s) as d:
        train(args, d)


if __name__ == "__main__":
    main()

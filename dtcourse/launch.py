"""Start and stop the process group, whichever launcher started this process.

Every launcher tells a process who it is through environment variables, each in its own words:

    launcher          rank                  world size            local rank
    torchrun          RANK                  WORLD_SIZE            LOCAL_RANK
    deepspeed         RANK                  WORLD_SIZE            LOCAL_RANK
    srun              SLURM_PROCID          SLURM_STEP_NUM_TASKS  SLURM_LOCALID
    mpirun (OpenMPI)  OMPI_COMM_WORLD_RANK  OMPI_COMM_WORLD_SIZE  OMPI_COMM_WORLD_LOCAL_RANK
    python            0                     1                     0

torchrun and deepspeed also give the rendezvous point (MASTER_ADDR, MASTER_PORT). Under srun the
first host of the step's node list is the master and the port is derived from the job and step
ids, so every task computes the same address without talking to the others. `detect()` reads the
variables and checks them; `setup()` picks the device and backend and starts the group.
"""

from __future__ import annotations

import gc
import os
import re
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Mapping

import torch
import torch.distributed as dist

from dtcourse.cli import fail


class LaunchError(ValueError):
    """The environment does not describe a consistent launch (the message says which variable)."""


@dataclass(frozen=True)
class Launch:
    """Who this process is, as the launcher's variables say."""
    launcher: str                 # python, torchrun, deepspeed, srun, mpirun, or env (RANK by hand)
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int | None  # processes on this node, where the launcher says
    master_addr: str | None       # None for a group of one (python): no rendezvous needed
    master_port: int | None


def _int(env: Mapping[str, str], name: str) -> int:
    value = env.get(name)
    if value is None:
        raise LaunchError(f"{name} is not set")
    try:
        return int(value)
    except ValueError:
        raise LaunchError(f"{name}={value!r} is not a whole number") from None


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list, as `scontrol show hostnames` would print it first:
    'gpu[07-09,12],cpu1' -> 'gpu07', 'rack[1-2]-n[3,5]' -> 'rack1-n3', 'node5' -> 'node5'."""
    depth, end = 0, len(nodelist)
    for i, ch in enumerate(nodelist):  # the first entry ends at the first comma outside brackets
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            end = i
            break
    entry = nodelist[:end].strip()
    # Each bracket holds ranges and single numbers; the first of each, zero padding kept.
    host = re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[-,]", m.group(1))[0], entry)
    if not host or "[" in host or "]" in host:
        raise LaunchError(f"cannot read the first host of the SLURM node list {nodelist!r}")
    return host


def _tasks_on_node(tasks_per_node: str, node_id: int) -> int:
    """SLURM_STEP_TASKS_PER_NODE ('4(x2),3' = 4, 4, 3 tasks on nodes 0, 1, 2) at node `node_id`."""
    counts = []
    for part in tasks_per_node.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            raise LaunchError(f"cannot read SLURM_STEP_TASKS_PER_NODE={tasks_per_node!r}")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    if not 0 <= node_id < len(counts):
        raise LaunchError(f"SLURM_NODEID={node_id} is not one of the {len(counts)} nodes in "
                          f"SLURM_STEP_TASKS_PER_NODE={tasks_per_node!r}")
    return counts[node_id]


def slurm_port(job_id: str, step_id: str) -> int:
    """A port every task of one srun step derives alike: 20000 + (10 x job id + step id) mod
    10000, below Linux's ephemeral ports (32768 and up). Steps 0-9 of a job get different ports;
    two steps can still meet the same port (step 10 of job J and step 0 of job J+1, jobs 1000
    apart, or torchrun's 29400/29500 on the same first node): set MASTER_PORT to choose one."""
    step = int(step_id) if step_id.isdigit() else 0  # 'batch' / 'extern' steps: 0
    return 20000 + (int(job_id) * 10 + step) % 10000


def _check_ranks(rank: int, world: int, local_rank: int, local_world: int | None,
                 names: tuple[str, str, str]) -> None:
    rank_var, world_var, local_var = names
    if world < 1:
        raise LaunchError(f"{world_var}={world}: the world size must be at least 1")
    if not 0 <= rank < world:
        raise LaunchError(f"{rank_var}={rank} is not a rank of a world of {world_var}={world} "
                          f"(ranks are 0..{world - 1})")
    if local_rank < 0 or (local_world is not None and local_rank >= local_world):
        raise LaunchError(f"{local_var}={local_rank} is not a local rank of the {local_world} "
                          f"processes on this node")


def detect(env: Mapping[str, str]) -> Launch:
    """Read the launcher's variables from `env` (os.environ) and check that they agree.

    Order: RANK (torchrun, deepspeed, or set by hand) wins, because torchrun started under srun
    (`srun torchrun ...`, one launcher per node) must use torchrun's numbering; then OpenMPI; then
    an srun task. A batch script's own process has SLURM_PROCID but no SLURM_STEP_NUM_TASKS:
    it is not an srun task, just one process.
    """
    if "RANK" in env or "WORLD_SIZE" in env:
        launcher = "torchrun" if "TORCHELASTIC_RUN_ID" in env else \
            "deepspeed" if "CROSS_RANK" in env else "env"
        if "RANK" not in env or "WORLD_SIZE" not in env:
            have, missing = ("RANK", "WORLD_SIZE") if "RANK" in env else ("WORLD_SIZE", "RANK")
            raise LaunchError(f"{have} is set but {missing} is not: set both (torchrun and "
                              f"deepspeed do), or neither for a single process")
        rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
        _check_ranks(rank, world, 0, None, ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
        if "LOCAL_RANK" not in env and world > 1:
            raise LaunchError(f"RANK and WORLD_SIZE are set (world {world}) but LOCAL_RANK is "
                              f"not: it says which of this node's GPUs the process uses")
        local_rank = _int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0
        size_var = "LOCAL_WORLD_SIZE" if "LOCAL_WORLD_SIZE" in env else "LOCAL_SIZE"
        local_world = _int(env, size_var) if size_var in env else None
        _check_ranks(rank, world, local_rank, local_world, ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
        missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if not env.get(v)]
        if missing:
            raise LaunchError(f"RANK and WORLD_SIZE are set but {' and '.join(missing)} "
                              f"{'is' if len(missing) == 1 else 'are'} not: every process must "
                              f"be told where rank 0 listens")
        return Launch(launcher, rank, world, local_rank, local_world, env["MASTER_ADDR"],
                      _port(env["MASTER_PORT"], "MASTER_PORT"))

    if "OMPI_COMM_WORLD_RANK" in env or "OMPI_COMM_WORLD_SIZE" in env:
        rank, world = _int(env, "OMPI_COMM_WORLD_RANK"), _int(env, "OMPI_COMM_WORLD_SIZE")
        local_rank = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK")
        local_world = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE")
        _check_ranks(rank, world, local_rank, local_world,
                     ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"))
        addr = env.get("MASTER_ADDR")
        if not addr:
            if local_world != world:  # several nodes: only the user knows rank 0's host
                raise LaunchError(f"mpirun started {world} processes on several nodes "
                                  f"({local_world} on this one) and MASTER_ADDR is not set: "
                                  f"pass -x MASTER_ADDR=<rank 0's host> -x MASTER_PORT=<port>")
            addr = "127.0.0.1"
        return Launch("mpirun", rank, world, local_rank, local_world, addr,
                      _port(env.get("MASTER_PORT", "29500"), "MASTER_PORT"))

    if "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env:
        names = ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID")
        rank, world, local_rank = (_int(env, n) for n in names)
        local_world = _tasks_on_node(env["SLURM_STEP_TASKS_PER_NODE"], _int(env, "SLURM_NODEID")) \
            if "SLURM_STEP_TASKS_PER_NODE" in env else None
        _check_ranks(rank, world, local_rank, local_world, names)
        addr = env.get("MASTER_ADDR")
        if not addr:
            nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
            if not nodes:
                raise LaunchError("srun task without SLURM_STEP_NODELIST or SLURM_JOB_NODELIST: "
                                  "cannot tell which host rank 0 is on (set MASTER_ADDR)")
            addr = first_host(nodes)
        if env.get("MASTER_PORT"):
            port = _port(env["MASTER_PORT"], "MASTER_PORT")
        elif "SLURM_JOB_ID" in env:
            port = slurm_port(str(_int(env, "SLURM_JOB_ID")), env.get("SLURM_STEP_ID", "0"))
        else:
            raise LaunchError("srun task without SLURM_JOB_ID: set MASTER_PORT")
        return Launch("srun", rank, world, local_rank, local_world, addr, port)

    return Launch("python", 0, 1, 0, 1, None, None)


def _port(value: str, name: str) -> int:
    if not value.isdigit() or not 0 < int(value) < 65536:
        raise LaunchError(f"{name}={value!r} is not a TCP port (1..65535)")
    return int(value)


def launched() -> Launch:
    """This process's launch as os.environ describes it, or fail() with the reason: for checks
    that need the world size before any process group exists (degrees that must divide it)."""
    try:
        return detect(os.environ)
    except LaunchError as exc:
        fail(str(exc))


# --------------------------------------------------------------------------------------------------
# Device and process group


@dataclass(frozen=True)
class Dist:
    """This process's place in the started group, and the device it computes on."""
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int | None  # processes on this node, where the launcher says
    device: torch.device
    backend: str
    launcher: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def choose_device(device_arg: str, launch: Launch) -> torch.device:
    """--device auto|cpu|cuda: CUDA when asked for or available, the GPU of this local rank.

    auto takes the GPUs only when every process of this node gets one: a lesson's
    `torchrun --nproc_per_node=2` on a one-GPU machine runs on the CPU with gloo (and says so)
    instead of failing; --device cuda asks for the GPUs and fails there. Inside a SLURM job auto
    fails too: a GPU allocation that trains on its CPUs is a mistake, not a fallback."""
    if device_arg == "cuda" and not torch.cuda.is_available():
        fail("--device cuda was asked for, but CUDA is not available on this machine")
    if device_arg == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    count = torch.cuda.device_count()
    local = launch.local_world_size or launch.local_rank + 1
    if device_arg == "auto" and local > count and not (launch.launcher == "srun" and count == 1):
        if os.environ.get("SLURM_JOB_ID"):
            fail(f"--device auto: {local} processes on this node but {count} GPU(s) in SLURM job "
                 f"{os.environ['SLURM_JOB_ID']}: start at most {count} per node, or pass "
                 f"--device cpu to train on the CPUs")
        if launch.local_rank == 0:
            print(f"--device auto: {local} processes on this node but {count} GPU(s): running on "
                  f"the CPU with gloo (start at most {count} processes per node, or pass "
                  f"--device cpu to say so)", file=sys.stderr, flush=True)
        return torch.device("cpu")
    if launch.local_rank < count:
        index = launch.local_rank
    elif launch.launcher == "srun" and count == 1:
        index = 0  # SLURM bound this task to one GPU (--gpus-per-task=1): it is cuda:0 here
    else:
        fail(f"local rank {launch.local_rank} has no GPU: only {count} visible on this node "
             f"(start at most {count} processes per node)")
    return torch.device("cuda", index)


def backend_for(device: torch.device, cpu_collectives: bool = False) -> str:
    """The process group's backend: gloo on CPU; NCCL on CUDA; "cpu:gloo,cuda:nccl" on CUDA when
    the run also has collectives on CPU tensors (`cpu_collectives`).

    NCCL moves GPU memory only. A run that keeps some state in CPU memory and reduces it there
    (FSDP2's CPUOffloadPolicy: the gradient shards are CPU tensors, and clip_grad_norm_ all-reduces
    their sums of squares on the CPU) fails on an NCCL-only group with "No backend type
    associated with device type cpu". A device-mapped backend string gives one group two
    backends: each collective goes to the backend of its tensors' device, gloo for CPU tensors,
    NCCL for CUDA ones; the device mesh's sub-groups inherit both."""
    if device.type != "cuda":
        return "gloo"
    return "cpu:gloo,cuda:nccl" if cpu_collectives else "nccl"


def bound_device(device: torch.device) -> torch.device | None:
    """init_process_group's `device_id`: this rank's GPU on CUDA, None (nothing bound) on CPU.

    Bound to its GPU, the group starts NCCL at once (an error in NCCL's set-up shows at start,
    not at the first collective), creates sub-groups by splitting its communicator, and runs
    barrier() on that GPU instead of guessing one ("using the device under current context").
    With "cpu:gloo,cuda:nccl" the binding is NCCL's; CPU tensors still go to gloo."""
    return device if device.type == "cuda" else None


def setup(device: str = "auto", timeout_s: float = 120.0, cpu_collectives: bool = False) -> Dist:
    """Start the process group: NCCL on CUDA, gloo on CPU, with `timeout_s` for every collective;
    on CUDA with `cpu_collectives` (CPU offload), both: gloo for CPU tensors (see backend_for).

    With no launcher, a group of one on an in-memory store, so that DDP, FSDP and every collective
    run through the same code as on many ranks. The launcher's variables are written back as
    RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE / MASTER_ADDR / MASTER_PORT, which libraries
    built on torch.distributed (DeepSpeed among them) read. LOCAL_RANK is written as the index of
    the GPU chosen, because DeepSpeed uses it as one (the engine's set_device, zero.Init's
    device): an srun task bound to one GPU (--gpus-per-task=1) sees it as cuda:0 whatever its
    SLURM_LOCALID, and cuda:<SLURM_LOCALID> does not exist there.
    """
    launch = launched()
    dev = choose_device(device, launch)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    else:
        # CPU kernels split their reductions by thread: results would then depend on the number
        # of cores (the last digits of a loss, which Adam can grow). One thread per rank, as
        # torchrun sets for several ranks per node, gives every machine the same numbers.
        torch.set_num_threads(1)
    backend = backend_for(dev, cpu_collectives)
    timeout = timedelta(seconds=timeout_s)
    if launch.master_addr is None:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout, device_id=bound_device(dev))
    else:
        local_rank = dev.index if dev.type == "cuda" else launch.local_rank
        os.environ.update(RANK=str(launch.rank), WORLD_SIZE=str(launch.world_size),
                          LOCAL_RANK=str(local_rank), MASTER_ADDR=launch.master_addr,
                          MASTER_PORT=str(launch.master_port))
        if launch.local_world_size is not None:
            os.environ["LOCAL_WORLD_SIZE"] = str(launch.local_world_size)
        dist.init_process_group(backend, init_method="env://", rank=launch.rank,
                                world_size=launch.world_size, timeout=timeout,
                                device_id=bound_device(dev))
    return Dist(launch.rank, launch.world_size, launch.local_rank, launch.local_world_size, dev,
                backend, launch.launcher)


def teardown() -> None:
    """Destroy the group. gc first: DDP's reducer and DeepSpeed's engine hold process groups in
    reference cycles; freed only at interpreter exit, gloo's threads can abort a finished run."""
    gc.collect()
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    if dist.is_initialized():
        dist.destroy_process_group()
        _wait_for_idle_gloo_workers()
    _remove_deepspeed_shm_buffer(rank)


def _remove_deepspeed_shm_buffer(rank: int) -> None:
    """DeepSpeed's CPU communication op (deepspeed_shm_comm, 0.19) maps a shared-memory buffer per
    rank, /dev/shm/deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>, when all
    ranks are on one machine, and never unlinks it: each launch would leave tens of MB per rank
    in /dev/shm (memory) until the machine restarts. Every rank removes its own at the end; the
    other ranks opened it at start, so the name is no longer needed."""
    name = (f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
            f"{os.environ.get('MASTER_PORT', '')}_{rank}")
    try:
        os.unlink(os.path.join("/dev/shm", name))
    except OSError:
        pass  # not a DeepSpeed run on CPU, or not Linux


def _gloo_workers() -> dict[str, tuple[str, str]]:
    """{thread id: (state, nanoseconds run so far)} of gloo's worker threads (Linux /proc)."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() != "pt_gloo_runloop":
                    continue
            with open(f"/proc/self/task/{tid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                out[tid] = (state, f.read().split()[0])
        except OSError:
            continue  # the thread ended while we looked
    return out


def _wait_for_idle_gloo_workers(timeout_s: float = 5.0) -> None:
    """Return once gloo's worker threads are asleep with nothing left to do.

    A TorchDispatchMode that sees a c10d collective (dtcourse.comm.CollectiveCounter) leaves
    references to the ProcessGroup behind (torch 2.14), so destroy_process_group() cannot free it
    and join its threads. A worker that has just finished the last collective then drops its
    tensors on its own thread, which takes the GIL: if the interpreter is already shutting down,
    that thread is killed and the C++ runtime aborts the finished run ("terminate called without an
    active exception"). So wait, sleeping (which frees the GIL), until every worker is asleep and
    has not run for two polls in a row."""
    if not os.path.isdir("/proc/self/task"):
        return
    before, deadline = _gloo_workers(), time.monotonic() + timeout_s  # host clock: a deadline
    while before and time.monotonic() < deadline:  # host clock: as above
        time.sleep(0.01)
        now = _gloo_workers()
        if now == before and all(state == "S" for state, _ in now.values()):
            return
        before = now


@contextmanager
def distributed(device: str = "auto", timeout_s: float = 120.0, cpu_collectives: bool = False):
    """`with distributed(args.device, args.timeout_s) as d:` runs the body in a started group and
    tears it down however the body ends; `cpu_collectives=args.cpu_offload` where the run keeps
    state on the CPU and reduces it there (see backend_for)."""
    d = setup(device, timeout_s, cpu_collectives)
    try:
        yield d
    finally:
        teardown()


def inject_failure(args, rank: int, step: int) -> None:
    """--fail-at-step K --fail-rank R: rank R raises once, at step K, to show torchrun's elastic
    restart resuming from the newest checkpoint. A marker file in --ckpt-dir remembers it, so the
    restarted run does not fail again."""
    if args.fail_at_step and step + 1 == args.fail_at_step and rank == args.fail_rank:
        marker = args.ckpt_dir / f"failed_once_at_step_{args.fail_at_step}"
        if not marker.exists():
            marker.touch()
            raise RuntimeError(f"injected failure on rank {rank} at step {step + 1}")


def start_deepspeed(d: Dist):
    """Import DeepSpeed for the chosen device and let it adopt the group `setup` started.

    DeepSpeed picks its accelerator (CUDA, or CPU with gloo) when first imported, so it is told
    which first; it reads RANK / LOCAL_RANK / WORLD_SIZE from the environment (zero.Init does even
    when disabled), which a group of one (plain `python`) did not need until now. Its INFO
    logging (the config dump) is kept quiet.
    """
    import logging
    for name, value in (("RANK", d.rank), ("LOCAL_RANK", d.local_rank),
                        ("WORLD_SIZE", d.world_size)):
        os.environ.setdefault(name, str(value))
    os.environ.setdefault("DS_ACCELERATOR", d.device.type)
    import deepspeed
    deepspeed.utils.logger.setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend=d.backend)  # an existing group is adopted as it is
    return deepspeed

"""No lesson script sends a CPU tensor to a collective, calls CUDA without a guard, or times GPU
work with the host's clock.

The suite runs on gloo, which accepts tensors on any device; NCCL does not, and a bare CUDA call
fails where no GPU exists. tests/device_check.py reads the source and reports both. It must find
nothing in the course, and it must find each bug of that kind the course once shipped: the three
below are those bugs, reduced to their lines (the end-of-measurement all-reduce of
ddp_benchmark.py, the timing all-reduce of data_loading.py, the hand-written ZeRO that started
gloo and all-reduced a CPU flag tensor).
"""

import pytest

from conftest import REPO
from device_check import check_files, check_source

FOLDERS = ["01-ddp-basics", "02-fsdp", "03-deepspeed", "04-nccl-operations", "05-advanced",
           "benchmarks", "dtcourse"]


def test_no_script_of_the_course_would_break_on_nccl():
    files = sorted(p for folder in FOLDERS for p in (REPO / folder).rglob("*.py"))
    assert len(files) > 30
    assert check_files(files, REPO) == []


def undefined_names(source: str, name: str = "<source>") -> list[str]:
    """pyflakes' undefined-name messages for one file's source."""
    import io

    from pyflakes.api import check
    from pyflakes.reporter import Reporter
    out = io.StringIO()
    check(source, name, Reporter(out, out))
    return [line for line in out.getvalue().splitlines() if "undefined name" in line]


def test_no_script_uses_a_name_it_never_defined():
    """A line that runs only on CUDA is never run by the suite: a name misspelt or out of scope
    there is found by reading the source. pipeline_parallel.py's Recorder once read the device of
    a `d` that only its caller had (its lines as they were are the check's own case)."""
    found = undefined_names("""
from dtcourse import timing
class Recorder:
    def reset(self):
        self.t0 = timing.clock(d.device)
def train(args, d):
    recorder = Recorder()
""")
    assert [m.split("undefined name ")[1] for m in found] == ["'d'"], found
    files = sorted(p for folder in FOLDERS + ["tests"] for p in (REPO / folder).rglob("*.py"))
    assert [m for p in files for m in undefined_names(p.read_text(), str(p))] == []


ONCE_SHIPPED = {
    "ddp_benchmark": ("""
def measure(times):
    medians = torch.tensor([median(times[True]), median(times[False])])
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)
""", ["cpu-tensor"]),
    "data_loading": ("""
def run(wait, compute):
    totals = torch.tensor([wait, compute], dtype=torch.float64)
    dist.all_reduce(totals)
""", ["cpu-tensor"]),
    "zero_from_scratch": ("""
def start():
    dist.init_process_group("gloo", timeout=timeout)
def step(self):
    had_grad = torch.tensor([float(p in self._reduced) for p in self.params])
    dist.all_reduce(had_grad, group=self.group)
""", ["gloo-only", "cpu-tensor"]),
    "bare cuda": ("""
def time_step(model, x, rank):
    out = model(x.cuda())
    w = model.weight.cuda(rank)
    torch.cuda.synchronize()
""", ["bare-cuda", "bare-cuda", "bare-cuda"]),
    "the wrong branch": ("""
def time_step(device):
    if device.type == "cuda":
        pass
    else:
        torch.cuda.synchronize()
    if device.type != "cuda":
        torch.cuda.synchronize()
""", ["bare-cuda", "bare-cuda"]),
    "what only gloo offers": ("""
def serve(buf):
    sender = dist.recv(buf)
    dist.all_reduce(buf, op=dist.ReduceOp.BAND)
""", ["nccl-op", "nccl-op"]),
}


@pytest.mark.parametrize("name", ONCE_SHIPPED)
def test_the_check_finds_each_nccl_bug_the_course_once_had(name):
    source, kinds = ONCE_SHIPPED[name]
    found = check_source(source)
    assert [f.split(": ")[1] for f in found] == kinds, found


# What an earlier version of the check let through (a tensor argument that names the CPU was
# taken for a gloo group; CPU placements other than .cpu(); a collective imported by name;
# irecv; tests that do not decide the branch), each a line that fails on NCCL or without a GPU.
ONCE_MISSED = {
    "cpu tensors": ("""
def gather(out, loss):
    dist.all_gather_into_tensor(out, loss.cpu())
    flags = torch.zeros(3, device="cpu")
    dist.all_reduce(flags)
    dist.broadcast(loss.to("cpu"), 0)
""", ["cpu-tensor"] * 3),
    "imported by name": ("""
from torch.distributed import all_reduce, irecv
def step(buf):
    all_reduce(torch.ones(2))
    irecv(buf)
""", ["cpu-tensor", "nccl-op"]),
    "branches that do not decide": ("""
def sync(device, force):
    if device.type == "cuda" or force:
        torch.cuda.synchronize(device)
    if torch.cuda.device_count() == 0:
        torch.cuda.synchronize(device)
""", ["bare-cuda", "bare-cuda"]),
    "host clocks by other names": ("""
import time as tm
import timeit
def step(model, x):
    t0 = tm.perf_counter()
    model(x)
    return timeit.default_timer() - t0
""", ["raw-clock", "raw-clock"]),
}


@pytest.mark.parametrize("name", ONCE_MISSED)
def test_the_check_finds_what_it_once_missed(name):
    source, kinds = ONCE_MISSED[name]
    found = check_source(source)
    assert sorted(f.split(": ")[1] for f in found) == sorted(kinds), found


def test_what_is_right_on_both_backends_passes():
    assert check_source("""
def measure(times, device):
    medians = torch.tensor([1.0, 2.0], device=device)
    dist.all_reduce(medians)
    dist.all_reduce(torch.zeros(3, device=device))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    n = torch.cuda.device_count()
def cpu_side(x):
    flags = torch.ones(2)
    dist.all_reduce(flags, group=gloo_group)  # a group meant to be gloo
def report(device):
    if device.type != "cuda":
        return None
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.max_memory_allocated(device)
def moved(device, world, gloo_pg):
    t = torch.zeros(3)
    t = t.to(device)
    dist.all_reduce(t)
    flags = torch.ones(2)
    dist.all_reduce(flags, dist.ReduceOp.SUM, gloo_pg)  # a gloo group, passed by position
    torch.cuda.manual_seed_all(0)  # safe without a GPU
    other = torch.zeros(2)
    if device.type != "cuda":
        pass
    else:
        torch.cuda.synchronize(device)
    dist.recv(other.to(device), src=0)
def on_cpu_or_gpu(device, tokens):
    if device.type == "cpu":
        pass
    else:
        torch.cuda.synchronize(device)
    if device.type != "cuda" or tokens is None:
        return None
    return torch.cuda.get_device_name(device)
""") == []


# FSDP's CPU offload on a group with no CPU backend: 02-fsdp's fsdp_transformer.py and
# fsdp1_api.py offloaded before they passed cpu_collectives to the group's setup, and on CUDA the
# first clip_grad_norm_ all-reduced CPU tensors on NCCL alone. Their lines as they were:
OFFLOAD_ONCE_SHIPPED = {
    "fsdp_transformer": """
def shard(model, args, device):
    kw = {}
    if args.cpu_offload:
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
def main(args):
    with launch.distributed(args.device, args.timeout_s) as d:
        model.to_empty(device="cpu" if args.cpu_offload else d.device)
""",
    "fsdp1_api": """
def wrap(model, args, d):
    return FullyShardedDataParallel(
        model,
        cpu_offload=CPUOffload(offload_params=args.cpu_offload),
    )
def main(args):
    d = setup(args.device, args.timeout_s)
    dist.init_process_group("nccl")
""",
}


@pytest.mark.parametrize("name", OFFLOAD_ONCE_SHIPPED)
def test_the_check_finds_cpu_offload_on_an_nccl_only_group(name):
    found = check_source(OFFLOAD_ONCE_SHIPPED[name])
    kinds = [f.split(": ")[1] for f in found]
    assert kinds == ["offload-group"] * (1 if name == "fsdp_transformer" else 2), found


def test_cpu_offload_with_a_cpu_backend_passes():
    assert check_source("""
def main(args):
    kw = {"offload_policy": CPUOffloadPolicy(pin_memory=False)}
    with launch.distributed(args.device, args.timeout_s, cpu_collectives=args.cpu_offload) as d:
        pass
    d = setup(args.device, args.timeout_s, True)
    dist.init_process_group("cpu:gloo,cuda:nccl")
    FullyShardedDataParallel(model, cpu_offload=CPUOffload(offload_params=False))
""") == []
    # no offload: an NCCL-only group is right
    assert check_source("""
def main(args):
    with launch.distributed(args.device, args.timeout_s) as d:
        pass
""") == []


# A host clock around GPU work: communication_overlap.py timed each step and each collective's
# launch with time.perf_counter() and no synchronisation, so on CUDA its step, exposed-
# communication and overlap columns measured how long the host took to queue the kernels. Its
# lines as they were, and the same clock imported by name:
RAW_CLOCK_ONCE_SHIPPED = {
    "communication_overlap": ("""
def sync_naive(params, world, log):
    for p in params:
        log.append(time.perf_counter())
        dist.all_reduce(p.grad)
def measure(variants, records, x, y):
    for v in variants:
        rec = records[v.tag]
        t0 = time.perf_counter()
        loss, t_backward = v.step(x, y)
        rec["times"].append(time.perf_counter() - t0)
""", 3),
    "imported by name": ("""
from time import monotonic as now, perf_counter
def step(model, x):
    t0 = perf_counter()
    model(x).sum().backward()
    return now() - t0
""", 2),
}


@pytest.mark.parametrize("name", RAW_CLOCK_ONCE_SHIPPED)
def test_the_check_finds_a_host_clock_around_device_work(name):
    source, count = RAW_CLOCK_ONCE_SHIPPED[name]
    found = check_source(source)
    assert [f.split(": ")[1] for f in found] == ["raw-clock"] * count, found


def test_the_device_clock_and_a_host_clock_that_says_why_pass():
    assert check_source("""
def measure(step, device, loader):
    t0 = timing.clock(device)
    step()
    seconds = timing.clock(device) - t0
    start, end = timing.stamp(device), timing.stamp(device)
    t_ready = time.perf_counter()  # host clock: the loader's wait is the host's
    batch = next(loader)
    wait = (time.perf_counter()  # host clock: as above
            - t_ready)
    deadline = time.monotonic() + 10  # host clock: a deadline
    cpu = time.process_time()
""") == []

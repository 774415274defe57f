"""The GPU tier: what only a CUDA GPU can show, run with `python -m pytest -m gpu tests`.

On a machine without CUDA every GPU test here is skipped with the reason shown (one test of the
GPU table's lookup runs on any machine). With one GPU:

  * every training script of the course at world 1 on CUDA (bf16 where the script has a
    precision flag; gloo-only scripts aside), a few steps: it must finish, train on the GPU and
    report its peak memory. One rank exercises the CUDA code paths, not NCCL's transports;
  * the `--device cuda` commands of the READMEs that fit the GPUs present;
  * peak CUDA memory of a DDP run printed beside the memory estimator's prediction for the same
    model and batch (asserted: the peak holds at least the model states the estimator counts);
  * tokens/s and MFU of `fsdp_transformer.py` in bf16 (6N + 12LHQT FLOPs per token over the GPU's
    dense bf16 peak), printed with the GPU's name;
  * HBM copy bandwidth, the single-GPU bound for the bandwidth test;
  * dtcourse.timing's clock against the host clock around queued kernels: the host clock alone
    returns before the GPU has finished (what the device check's raw-clock class is about);
  * one strategy's peak memory measured in its own process and again after another strategy ran
    in the same process (as fsdp_transformer.py and distributed_benchmarks.py run them): equal.
    A CPU test beside it checks the sequencing itself: every object of the previous strategy is
    freed when the next one resets its peak.

The figures are printed (run with -s to see them) for the READMEs and benchmarks/results/, and
recorded (`record`) where DTCOURSE_GPU_FIGURES names a file: benchmarks/gpu_check.py collects them
there into its JSON and table.
It needs only what the GPU machine already has (its torch; deepspeed and fairscale installed from
wheels): nothing here installs anything. One GPU cannot run a multi-rank NCCL job; those stay
untested on NCCL until a multi-GPU node runs the READMEs' commands.
"""

import math
import os
import re
import subprocess
import sys

import pytest
import torch

from conftest import (REPO, all_documented_commands, load_script, read_json, run_readme_command,
                      run_torchrun)
from test_launchers import TRAINING_SCRIPTS

NO_GPU = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA GPU on this machine: the GPU tier runs where one is (pytest -m gpu tests)")


def record(test: str, name: str, value) -> None:
    """Append one measured figure to the file DTCOURSE_GPU_FIGURES names (if it does)."""
    import json
    path = os.environ.get("DTCOURSE_GPU_FIGURES")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"test": test, "name": name, "value": value}) + "\n")


def timings(metrics: dict) -> dict:
    """The speed figures of a script's metrics: keys that name a time or a rate."""
    return {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(
        v, bool) and re.search(r"(^time|_s|_ms|_time)$", k) and not k.startswith("timeout")}


def gpu(test):
    """A test of the GPU tier: marked gpu (pytest -m gpu selects it), skipped without CUDA."""
    return pytest.mark.gpu(NO_GPU(test))

# The launches see the GPUs: the suite's launch helpers hide them (CUDA_VISIBLE_DEVICES="") so that
# the CPU tier proves the CPU path.
GPUS = {"CUDA_VISIBLE_DEVICES": os.environ.get(
    "CUDA_VISIBLE_DEVICES", ",".join(map(str, range(torch.cuda.device_count()))))}

# World-1 settings where the CPU suite's world-2 ones need two ranks.
WORLD1_ARGS = {"05-advanced/a-tensor-sequence-hybrid/hybrid_parallelism.py":
               ["--steps", "2", "--pp", "1", "--microbatches", "2"]}

# The flag that turns on bf16, for the scripts that have one.
BF16 = {"01-ddp-basics/ddp_training.py": ["--precision", "bf16"],
        "02-fsdp/fsdp_from_scratch.py": ["--compute-dtype", "bf16"],
        "02-fsdp/fsdp_transformer.py": ["--mixed-precision", "bf16"],
        "02-fsdp/fsdp1_api.py": ["--mixed-precision", "bf16"],
        "03-deepspeed/deepspeed_train.py": ["--precision", "bf16"]}


@gpu
@pytest.mark.parametrize("script,args", TRAINING_SCRIPTS, ids=[s for s, _ in TRAINING_SCRIPTS])
def test_training_script_runs_on_one_gpu(tmp_path, script, args):
    if re.search(r"^GLOO_ONLY = ", (REPO / script).read_text(), flags=re.M):
        pytest.skip("gloo only: it refuses --device cuda (its GLOO_ONLY says why)")
    metrics = tmp_path / "m.json"
    run_torchrun(script, *WORLD1_ARGS.get(script, args), *BF16.get(script, []), "--device", "cuda",
                 "--metrics-out", metrics, nproc=1, timeout=300, env=GPUS)
    m = read_json(metrics)
    runs = list(m["runs"].values()) if "runs" in m else [m]  # several variants in one launch
    for run in runs:
        assert str(run["device"]).startswith("cuda"), run["device"]
        assert all(math.isfinite(x) for x in run.get("losses", [])), run.get("losses")
        peaks = [r["peak_bytes"] for r in run.get("per_rank", [])]
        assert all(p and p > 0 for p in peaks), f"{script}: peak CUDA memory {peaks}"
        tag = script + (f" [{run['strategy']}]" if "strategy" in run and len(runs) > 1 else "")
        for name, value in timings(run).items():
            record(tag, name, value)
        record(tag, "peak_bytes rank 0", peaks[0] if peaks else None)


# Scripts that demonstrate rather than train: each at world 1 on CUDA (every collective a copy,
# the CUDA code paths all taken), results written with --json-out.
DEMOS = ["01-ddp-basics/collectives_primer.py", "01-ddp-basics/ddp_internals.py",
         "02-fsdp/dtensor_primer.py"]


@gpu
@pytest.mark.parametrize("script", DEMOS)
def test_demo_script_runs_on_one_gpu(tmp_path, script):
    out = tmp_path / "r.json"
    run_torchrun(script, "--device", "cuda", "--json-out", out, nproc=1, timeout=300, env=GPUS)
    result = read_json(out)
    if isinstance(result, dict) and "device" in result:
        assert str(result["device"]).startswith("cuda"), result["device"]


def _gpus_needed(command: str) -> int:
    """Processes the command starts on GPUs: nodes x processes per node."""
    def flag(pattern, default=1):
        found = re.search(pattern, command)
        return int(found.group(1)) if found else default
    nodes = flag(r"--nnodes[= ](\d+)") * flag(r"srun[^|;]*?-N\s*(\d+)")
    per_node = flag(r"--nproc_per_node[= ](\d+)") * flag(r"--num_gpus[= ](\d+)") * flag(
        r"--ntasks-per-node[= ](\d+)")
    # distributed_benchmarks.py starts its own ranks: --world N (memory: 2 unless given),
    # --worlds a,b,c
    worlds = re.search(r"--worlds[= ]([\d,]+)", command)
    inner = max(map(int, worlds.group(1).split(","))) if worlds else flag(
        r"--world[= ](\d+)", 2 if re.search(r"distributed_benchmarks\.py memory", command) else 1)
    # launchers that take the total: horovodrun / mpirun -np N, srun --ntasks N; TF_CONFIG's
    # workers (one process per worker, each on its own host)
    total = max(flag(r"(?:^|\s)-np\s+(\d+)"), flag(r"--ntasks[= ](\d+)"))
    tf_config = re.search(r'"worker":\s*\[([^\]]*)\]', command)
    workers = len(re.findall(r'"[^"]+"', tf_config.group(1))) if tf_config else 1
    return max(nodes * per_node * inner, total, workers)


def test_multi_node_commands_are_not_counted_as_one_gpu():
    """What the tier skips on one GPU: launchers that give the total (-np, --ntasks) and
    TF_CONFIG's workers count as well as torchrun's nodes x processes per node."""
    assert _gpus_needed("torchrun --nproc_per_node=1 x.py --device cuda") == 1
    assert _gpus_needed("torchrun --nnodes=2 --nproc_per_node=8 x.py") == 16
    assert _gpus_needed("horovodrun -np 16 -H node1:8,node2:8 python x.py --device cuda") == 16
    assert _gpus_needed("srun --ntasks=16 --ntasks-per-node=8 --mpi=pmix python x.py") == 16
    assert _gpus_needed("""TF_CONFIG='{"cluster": {"worker": ["node0:1", "node1:1"]}, '"""
                        """'"task": {"type": "worker", "index": 0}}' python x.py""") == 2


# Every README command (```bash and ```sh blocks) that asks for CUDA.
CUDA_COMMANDS = sorted({(str(doc.relative_to(REPO)), c) for doc, c in all_documented_commands()
                        if "--device cuda" in c})


@gpu
@pytest.mark.parametrize("doc,command", CUDA_COMMANDS, ids=[f"{d}::{c[:70]}"
                                                            for d, c in CUDA_COMMANDS])
def test_documented_cuda_command_runs(doc, command):
    if _gpus_needed(command) > torch.cuda.device_count():
        pytest.skip(f"needs {_gpus_needed(command)} GPUs, {torch.cuda.device_count()} here")
    run_readme_command(command, timeout=300, env=GPUS)


@gpu
def test_ddp_peak_memory_beside_the_estimator(tmp_path):
    """The estimator's prediction for this model and batch is printed beside the measured peak
    (for the README); asserted is only what must hold on any GPU: the peak holds at least the
    model states (weights, gradients, Adam) the estimator counts for DDP in fp32."""
    me = load_script("benchmarks/memory_estimator.py")
    metrics = tmp_path / "m.json"
    shape = {"layers": 2, "dim": 64, "heads": 4, "seq_len": 64, "batch_size": 8}
    run_torchrun("02-fsdp/fsdp_transformer.py", "--steps", "3", "--strategy", "ddp", "--device",
                 "cuda", "--layers", shape["layers"], "--dim", shape["dim"], "--heads",
                 shape["heads"], "--seq-len", shape["seq_len"], "--batch-size",
                 shape["batch_size"], "--metrics-out", metrics, nproc=1, timeout=300, env=GPUS)
    m = read_json(metrics)
    peak = m["per_rank"][0]["peak_bytes"]
    predicted = me.estimate(m["params"], 1, "ddp", "fp32", layers=shape["layers"],
                            hidden=shape["dim"], heads=shape["heads"], seq_len=shape["seq_len"],
                            batch_size=shape["batch_size"])
    print(f"\n{torch.cuda.get_device_name()}: DDP peak {peak:,} B; estimator: model states "
          f"{predicted['params_bytes'] + predicted['grads_bytes'] + predicted['optim_bytes']:,} B,"
          f" activations {predicted['activations_bytes']:,} B, total {predicted['total_bytes']:,} B")
    record("ddp peak vs estimator", "gpu", torch.cuda.get_device_name())
    record("ddp peak vs estimator", "measured peak_bytes", peak)
    record("ddp peak vs estimator", "estimated total_bytes", predicted["total_bytes"])
    record("ddp peak vs estimator", "estimated model-state bytes",
           predicted["params_bytes"] + predicted["grads_bytes"] + predicted["optim_bytes"])
    assert peak >= predicted["params_bytes"] + predicted["grads_bytes"] + predicted["optim_bytes"]


@gpu
def test_fsdp_transformer_tokens_per_s_and_mfu(tmp_path):
    metrics = tmp_path / "m.json"
    run_torchrun("02-fsdp/fsdp_transformer.py", "--steps", "20", "--strategy", "full",
                 "--mixed-precision", "bf16", "--device", "cuda", "--metrics-out", metrics,
                 nproc=1, timeout=300, env=GPUS)
    m = read_json(metrics)
    print(f"\n{torch.cuda.get_device_name()}: {m['tokens_per_s']:,.0f} tokens/s, MFU "
          f"{m['mfu']}")
    record("fsdp_transformer bf16", "gpu", torch.cuda.get_device_name())
    record("fsdp_transformer bf16", "tokens_per_s", m["tokens_per_s"])
    record("fsdp_transformer bf16", "mfu", m["mfu"])
    assert m["tokens_per_s"] > 0
    assert m["mfu"] is None or 0 < m["mfu"] < 1  # None: a GPU whose peak the script does not know


# HBM bandwidth (GB/s) from NVIDIA's data sheets, by the exact name torch.cuda.get_device_name()
# gives. Exact names, not substrings: "A100" is in "NVIDIA A100 80GB PCIe" (1,935 GB/s, not 1,555)
# and "H200" in "NVIDIA GH200 480GB" (4,000, not 4,800); a MIG slice ("... MIG 1g.10gb") has a share
# of the bandwidth and matches nothing. A name not listed skips the comparison.
HBM_GBPS = {
    "Tesla V100-SXM2-16GB": 900, "Tesla V100-SXM2-32GB": 900,      # V100 data sheet: 900 GB/s
    "Tesla V100-PCIE-16GB": 900, "Tesla V100-PCIE-32GB": 900,
    "NVIDIA A100-SXM4-40GB": 1555, "NVIDIA A100-PCIE-40GB": 1555,  # A100 data sheet: 40GB 1,555,
    "NVIDIA A100-SXM4-80GB": 2039, "NVIDIA A100 80GB PCIe": 1935,  # 80GB SXM 2,039, PCIe 1,935
    "NVIDIA H100 80GB HBM3": 3350, "NVIDIA H100 PCIe": 2000,       # H100 data sheet: SXM 3.35 TB/s,
    "NVIDIA H100 NVL": 3900,                                       # PCIe 2 TB/s, NVL 3.9 TB/s
    "NVIDIA H200": 4800, "NVIDIA H200 NVL": 4800,                  # H200: 4.8 TB/s (SXM and NVL)
    "NVIDIA GH200 480GB": 4000,                                    # GH200 with 96 GB HBM3: 4 TB/s
}


def hbm_peak(name: str) -> int | None:
    """The data sheet's HBM bandwidth of the GPU called `name` (GB/s), None if not in the table."""
    return HBM_GBPS.get(name.strip())


def test_hbm_table_picks_each_gpus_own_entry():
    """Runs without a GPU: every name the table lists finds its own figure, and names that
    contain a listed one (or are contained in one) do not borrow its figure."""
    for name, peak in HBM_GBPS.items():
        assert hbm_peak(name) == peak, name
    assert hbm_peak("NVIDIA A100 80GB PCIe") == 1935      # "A100" alone would give 1,555
    assert hbm_peak("NVIDIA A100-SXM4-40GB") == 1555
    assert hbm_peak("NVIDIA GH200 480GB") == 4000         # "H200" alone would give 4,800
    assert hbm_peak("NVIDIA H200") == 4800
    assert hbm_peak("NVIDIA H100 80GB HBM3") == 3350
    assert hbm_peak("NVIDIA H100 PCIe") == 2000           # "H100" alone would give 3,350
    assert hbm_peak("NVIDIA H100 NVL") == 3900
    for other in ("NVIDIA A100-SXM4-40GB MIG 1g.5gb", "NVIDIA H100 80GB HBM3 MIG 3g.40gb",
                  "NVIDIA GH200 144G HBM3e", "NVIDIA H800", "NVIDIA A10", "NVIDIA L40S",
                  "Tesla V100S-PCIE-32GB", "NVIDIA B200", "H100", "A100"):
        assert hbm_peak(other) is None, other


@gpu
def test_ddp_built_in_allreduce_is_counted_on_cuda(tmp_path):
    """fsdp_transformer.py's DDP strategy runs DDP's own all-reduce (no comm hook) and counts it
    at the dispatcher. On the CPU the reducer launches it from the thread that runs backward; on
    CUDA autograd runs backward on its device thread: the count must still see the one all-reduce
    of the gradient bytes (4 bytes per parameter in fp32)."""
    metrics = tmp_path / "m.json"
    run_torchrun("02-fsdp/fsdp_transformer.py", "--strategy", "ddp", "--steps", "3", "--device",
                 "cuda", "--metrics-out", metrics, nproc=1, timeout=300, env=GPUS)
    m = read_json(metrics)
    run = m["runs"]["ddp"] if "runs" in m else m
    assert run.get("comm_hook") is None, run.get("comm_hook")
    params = run["per_rank"][0]["param_bytes"] // 4
    assert run["comms_per_step"]["all_reduce"]["tensor_bytes"] == 4 * params, run["comms_per_step"]


@gpu
def test_hbm_copy_bandwidth():
    """A device-to-device copy reads and writes every byte: 2 x size / time. A copy reaches most
    of the data sheet's bandwidth (typically 80-90%): asserted between half of it and all of it,
    where the GPU is in the table."""
    name = torch.cuda.get_device_name()
    x = torch.empty(1 << 28, dtype=torch.float32, device="cuda")  # 1 GiB
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        y.copy_(x)
    end.record()
    torch.cuda.synchronize()
    gbps = 10 * 2 * x.numel() * x.element_size() / (start.elapsed_time(end) / 1e3) / 1e9
    peak = hbm_peak(name)
    record("hbm copy", "GB/s", round(gbps, 1))
    record("hbm copy", "data sheet GB/s", peak)
    print(f"\n{name}: HBM copy {gbps:,.0f} GB/s (data sheet: {peak or 'not in the table'})")
    if peak is None:
        pytest.skip(f"{name} is not in HBM_GBPS: measured {gbps:,.0f} GB/s, nothing to compare")
    assert 0.5 * peak < gbps <= 1.02 * peak


# -- peak memory in sequence ------------------------------------------------------------------------
# fsdp_transformer.py trains its strategies one after the other in one process, and
# distributed_benchmarks.py launches it so (all FSDP strategies in one launch). Each strategy's peak
# starts at report.reset_peak; if the previous strategy's model, gradients or optimizer were still
# alive there, every later peak would include them.
SEQ_SHAPE = ["--layers", "2", "--dim", "256", "--heads", "4", "--seq-len", "64", "--batch-size", "4",
             "--steps", "3"]


@gpu
def test_a_strategys_peak_is_the_same_alone_and_after_another(tmp_path):
    """Tolerance: 1% of the peak plus 1 MiB. Both processes allocate the same tensors for the
    measured strategy; what may differ is what the CUDA libraries keep allocated between
    strategies: cuBLAS's workspaces (32 MiB per handle and stream on Hopper by default), taken
    from torch's allocator at the first matmul and kept. Both runs take the same ones (the
    strategy run alone makes the same matmuls on the same handles), so they sit in both peaks
    and cancel. The bug it catches is far larger: DDP's model states left alive are 16
    bytes per parameter (weights, gradients, two Adam moments in fp32), asserted above the
    tolerance."""
    peaks = {}
    for tag, strategies in (("alone", ["full"]), ("after ddp", ["ddp", "full"])):
        metrics = tmp_path / f"{tag.replace(' ', '_')}.json"
        run_torchrun("02-fsdp/fsdp_transformer.py", "--strategy", *strategies, *SEQ_SHAPE,
                     "--device", "cuda", "--metrics-out", metrics, nproc=1, timeout=300, env=GPUS)
        m = read_json(metrics)
        runs = m["runs"] if "runs" in m else {m["strategy"]: m}
        peaks[tag] = runs["full"]["per_rank"][0]["peak_bytes"]
        params = runs["full"]["per_rank"][0]["param_bytes"] // 4
    tolerance = 0.01 * peaks["alone"] + 2**20
    print(f"\n{torch.cuda.get_device_name()}: peak of full alone {peaks['alone']:,} B, after ddp "
          f"{peaks['after ddp']:,} B (tolerance {tolerance:,.0f} B)")
    record("peak in sequence", "full alone peak_bytes", peaks["alone"])
    record("peak in sequence", "full after ddp peak_bytes", peaks["after ddp"])
    assert 16 * params > tolerance  # the bug would show
    assert abs(peaks["after ddp"] - peaks["alone"]) <= tolerance, peaks


SEQUENCE_PROBE = """
import sys, weakref
sys.path[:0] = ["02-fsdp", "."]
import importlib.util
spec = importlib.util.spec_from_file_location("fsdp_transformer", "02-fsdp/fsdp_transformer.py")
ft = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ft)
built, at_reset = [], []
build, reset_peak = ft.build, ft.report.reset_peak
def watched_build(args, strategy, d):
    model, mesh, optimizer = build(args, strategy, d)
    built.append((strategy, [weakref.ref(model), weakref.ref(optimizer)]
                  + [weakref.ref(p) for p in model.parameters()]))
    return model, mesh, optimizer
def watched_reset(device):
    out = reset_peak(device)
    at_reset.append({s: sum(r() is not None for r in refs) for s, refs in built})
    return out
ft.build, ft.report.reset_peak = watched_build, watched_reset
ft.main(sys.argv[1:])
print("ALIVE AT RESET", at_reset)
"""


def test_the_previous_strategy_is_freed_before_the_next_peak_starts():
    """On any machine: fsdp_transformer.py run in one process with two strategies; at the second
    strategy's reset_peak, no module, optimizer or parameter of the first is still alive (held
    by a reference or a cycle the collector has not freed), so the second peak is its own."""
    out = subprocess.run(
        [sys.executable, "-c", SEQUENCE_PROBE, "--strategy", "ddp", "full", "--steps", "3",
         "--layers", "1", "--dim", "32", "--heads", "2", "--seq-len", "16", "--batch-size", "2",
         "--device", "cpu"], cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 0, out.stderr[-3000:]
    alive = eval(out.stdout.split("ALIVE AT RESET", 1)[1])
    assert alive == [{}, {"ddp": 0}], alive


@NO_GPU
@pytest.mark.gpu
def test_the_device_clock_waits_for_the_kernels_the_host_clock_does_not():
    """A chain of matmuls queued on the GPU: time.perf_counter() around the calls alone measures
    the queueing; timing.clock() and two stamps (CUDA events) measure the kernels, and agree."""
    import time

    from dtcourse import timing
    device = torch.device("cuda")
    a = torch.randn(4096, 4096, device=device)
    for _ in range(3):  # warm-up: cuBLAS handles, the allocator
        a @ a
    torch.cuda.synchronize(device)
    t0 = timing.clock(device)
    start = timing.stamp(device)
    host0 = time.perf_counter()  # host clock: the quantity under test
    for _ in range(50):
        b = a @ a
    queued = time.perf_counter() - host0  # host clock: as above
    end = timing.stamp(device)
    measured = timing.clock(device) - t0
    events = timing.seconds(start, end)
    print(f"\n50 matmuls 4096^3: host clock {queued * 1e3:.2f} ms, timing.clock "
          f"{measured * 1e3:.2f} ms, CUDA events {events * 1e3:.2f} ms on "
          f"{torch.cuda.get_device_name()}")
    record("device_clock", "host_clock_ms", round(queued * 1e3, 3))
    record("device_clock", "device_clock_ms", round(measured * 1e3, 3))
    # 50 x 2 x 4096^3 = 6.9 TFLOP: tens of ms at an H100's or H200's fp32 rate, while
    # queueing 50 launches takes well under a millisecond each
    assert measured > 2 * queued
    assert events <= measured * 1.05 and events > 0.5 * measured
    del b


def test_the_device_clock_on_a_cpu_is_the_host_clock():
    """On a CPU the work is done when the call returns: clock() and stamp() read the host clock,
    and seconds() subtracts two stamps."""
    import time

    from dtcourse import timing
    cpu = torch.device("cpu")
    t0, s0 = timing.clock(cpu), timing.stamp(cpu)
    time.sleep(0.05)
    t1, s1 = timing.clock(cpu), timing.stamp(cpu)
    assert isinstance(s0, float) and 0.05 <= t1 - t0 < 5
    assert 0.05 <= timing.seconds(s0, s1) < 5

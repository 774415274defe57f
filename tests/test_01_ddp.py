"""Lesson 01: DDP computes what one process computes, under every launcher.

Tolerances. DDP at world 2 averages two half-batch gradients where one process takes the mean over
the whole batch: the same numbers summed in a different order, so each gradient element differs by
a few float32 ulps (~1e-7 relative). That stays so on almost every weight, but AdamW divides by
sqrt(v) + eps, so on a coordinate whose gradient is itself at rounding level the ulps decide the
update: conftest.assert_adamw_close allows a rare such coordinate and fails on a real bug (a
missing average over ranks, a rank reading the wrong rows), which moves most weights. Runs whose
arithmetic is identical (same world size, a resumed run, another launcher) must match bitwise.

Several launches are the lesson README's own commands, run verbatim, so the README's claims are the
ones checked. They write under runs/ (git-ignored).
"""

import ast
import re
import shutil
import signal
import subprocess
import time
from types import SimpleNamespace

import pytest
import torch
from conftest import (
    PYTHON,
    REPO,
    assert_adamw_close,
    assert_state_dicts_equal,
    base_env,
    finish,
    free_port,
    launch,
    load_export,
    load_script,
    read_json,
    readme_mentions,
    run_python,
    run_readme_command,
    run_together,
    run_torchrun,
    run_torchrun_nodes,
    start,
)

TRAIN = "01-ddp-basics/ddp_training.py"
MNIST = "01-ddp-basics/ddp_mnist.py"
BENCH = "01-ddp-basics/ddp_benchmark.py"
LAUNCH = "01-ddp-basics/launch_ddp.sh"
README = REPO / "01-ddp-basics" / "README.md"
DEEP_DIVE = REPO / "01-ddp-basics" / "scaling_and_resume.md"  # resume, spawn, the benchmark run
RUNS = REPO / "runs"
# AdamW equivalence: see conftest.assert_adamw_close (measured here: every weight within 1e-7;
# on an AVX2-only EPYC one element of 16,384 off by 1.3e-6, the kind of coordinate it allows).
PEAK_LR = 1e-2 * 64 / 32  # ddp_training.py: --lr 1e-2 scaled from --base-batch 32 to batch 64
ADAMW = {"lr": PEAK_LR, "steps": 40}

# The lesson's README commands, run verbatim here (and so not again by test_readmes.py).
FULL = "torchrun --nproc_per_node=2 01-ddp-basics/ddp_training.py --export runs/ddp_full.pt"
ACCUM = ("torchrun --nproc_per_node=2 01-ddp-basics/ddp_training.py --grad-accum 2 --batch-size 16 "
         "--count-allreduces --export runs/ddp_accum.pt --metrics-out runs/ddp_accum.json")
FIRST_HALF = ("torchrun --nproc_per_node=2 01-ddp-basics/ddp_training.py --steps 20 "
              "--ckpt-dir runs/ddp_ckpt")
SECOND_HALF = ("torchrun --nproc_per_node=2 01-ddp-basics/ddp_training.py --ckpt-dir runs/ddp_ckpt "
               "--export runs/ddp_resumed.pt")
SPAWN = "python 01-ddp-basics/ddp_training.py --spawn 2 --export runs/ddp_spawn.pt"
MNIST_W1 = "python 01-ddp-basics/ddp_mnist.py --batch-size 64 --metrics-out runs/mnist_w1.json"
MNIST_W2 = "torchrun --nproc_per_node=2 01-ddp-basics/ddp_mnist.py --metrics-out runs/mnist_w2.json"
BENCHMARK = "python 01-ddp-basics/ddp_benchmark.py --json-out runs/ddp_scaling.json"


def readme_run(command: str, *outputs: str):
    """Run a README command verbatim after removing what an earlier run left behind."""
    doc = DEEP_DIVE if command in (FIRST_HALF, SECOND_HALF, SPAWN, BENCHMARK) else README
    assert readme_mentions(doc, command), f"not in {doc}: {command}"
    for name in outputs:
        path = RUNS / name
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    return run_readme_command(command, timeout=240)


FULL_STDOUT: list[str] = []  # what the full run printed


@pytest.fixture(scope="module")
def full_run():
    """The README's 2-rank, 40-step run: the reference every other launch is compared with."""
    FULL_STDOUT.append(readme_run(FULL, "ddp_full.pt").stdout)
    return load_export(RUNS / "ddp_full.pt")


def test_world2_equals_one_process_with_the_same_global_batch(tmp_path, full_run):
    out = tmp_path / "world1"
    run_python(TRAIN, "--batch-size", "64", "--export", str(out / "model.pt"), "--metrics-out",
               str(out / "metrics.json"))
    m1 = read_json(out / "metrics.json")
    assert m1["world_size"] == 1 and m1["global_batch"] == 64 and len(m1["losses"]) == 40
    assert_adamw_close(full_run, load_export(out / "model.pt"), **ADAMW,
                             msg="world 2 vs world 1:")
    # The model must actually have learned, or equal weights would prove little.
    assert sum(m1["losses"][-5:]) / 5 < 0.5 * sum(m1["losses"][:5]) / 5


@pytest.fixture(scope="module")
def accum_run():
    readme_run(ACCUM, "ddp_accum.pt", "ddp_accum.json")
    return load_export(RUNS / "ddp_accum.pt"), read_json(RUNS / "ddp_accum.json")


def test_accumulation_equals_the_full_batch_and_skips_the_allreduce(tmp_path, full_run,
                                                                   accum_run):
    """2 ranks x 16 x 2 micro-steps = the same 64-sample global batch as the full run: the same
    model. no_sync() skips every other all-reduce: 80 backward passes, 40 all-reduce calls (one
    bucket per synced backward), as the README's --count-allreduces counts them.

    Without the flag the template runs DDP's own (C++) all-reduce: DDP's logging data records no
    comm hook, and no counter watches the last step (no dispatch mode, no `last step:` line). The
    counting flag swaps in a Python comm hook that averages as DDP does (sum, divided by the
    world size: a power of two here, so exact either way) and counts; both must export the same
    model, bitwise."""
    weights, m = accum_run
    assert m["world_size"] == 2 and m["grad_accum"] == 2 and m["global_batch"] == 64
    assert_adamw_close(weights, full_run, **ADAMW, msg="accumulation vs full batch:")
    assert m["comm_hook"] and "counting_allreduce" in m["comm_hook"], m["comm_hook"]
    assert m["allreduce_calls"] == 40, "no_sync() must skip the first micro-step's all-reduce"
    plain = tmp_path / "plain"
    result = run_torchrun(TRAIN, "--grad-accum", "2", "--batch-size", "16",
                          "--export", plain / "model.pt", "--metrics-out", plain / "metrics.json",
                          timeout=240)
    c = read_json(plain / "metrics.json")
    assert c["comm_hook"] is None and c["allreduce_calls"] is None, "a hook on the default path"
    assert c["comms_per_step"] is None and "last step:" not in result.stdout, result.stdout
    assert_state_dicts_equal(load_export(plain / "model.pt"), weights,
                             msg="DDP's all-reduce vs the counting hook:")


def test_traffic_of_a_step_is_one_ring_allreduce_of_the_gradients(accum_run):
    """Measured at the dispatcher in the last optimizer step (2 micro-steps, no_sync on the
    first): one all-reduce of the gradient bytes G = 4P (the bucket), of which every rank sends
    2(N-1)/N x G on a ring: G at N = 2. Nothing else goes over the wire for gradients."""
    weights, m = accum_run
    G = 4 * sum(t.numel() for t in weights.values())
    assert m["comms_per_step"] == {"all_reduce": {
        "calls": 1, "tensor_bytes": G, "sent_bytes": G, "dtypes": ["float32"],
        "group_sizes": [2]}}


def test_metrics_follow_the_contract(accum_run):
    weights, m = accum_run
    for key in ("script", "strategy", "world_size", "steps", "global_batch", "losses",
                "samples_per_s", "device", "torch_version", "per_rank"):
        assert key in m, key
    assert len(m["losses"]) == m["steps"] == 40 and len(m["per_rank"]) == 2
    params = sum(t.numel() for t in weights.values())
    for held in m["per_rank"]:
        # DDP keeps a full replica on every rank: fp32 weights 4P and Adam's two moments 8P (plus
        # a step counter per parameter tensor: 6 tensors x 4 bytes). The gradients live in DDP's
        # flat buckets, 4P as DDP's logger reports them (with gradient_as_bucket_view each .grad
        # is a view into them, and zero_grad(set_to_none=False) keeps it so). 16 bytes per
        # parameter in all.
        assert held["param_bytes"] == 4 * params
        assert held["optim_bytes"] == 8 * params + 6 * 4
        assert held["grad_bytes"] == 4 * params
        assert held["peak_bytes"] is None  # CPU


@pytest.fixture(scope="module")
def first_half(tmp_path_factory):
    """The README's first 20 steps with checkpoints: its stdout, and a copy of its step-20
    checkpoint (the README's second half then trains on in runs/ddp_ckpt)."""
    first = readme_run(FIRST_HALF, "ddp_ckpt")
    saved = tmp_path_factory.mktemp("first_half") / "step_000020.pt"
    shutil.copy(RUNS / "ddp_ckpt" / "step_000020.pt", saved)
    return first, saved


def test_resume_is_bitwise_identical_to_an_uninterrupted_run(full_run, first_half):
    first, _ = first_half
    # The printed LR is the one the step used: step 1 of a 10-step warmup runs at 1/10 of 0.02.
    assert "step    1/20 | loss 2.2772 | mean of last  1 2.2772 | lr 0.00200" in first.stdout, \
        first.stdout
    second = readme_run(SECOND_HALF, "ddp_resumed.pt")
    assert "resumed from step 20 in runs/ddp_ckpt/step_000020.pt" in second.stdout, second.stdout
    # Steps 30 and 40 print what the uninterrupted run printed, smoothed loss included (a lost
    # window would not show here: steps 21-30 fill it again; the next test resumes mid-window).
    steps = [line for line in second.stdout.splitlines() if line.startswith("step ")]
    assert steps and all(line in FULL_STDOUT[0] for line in steps), (steps, FULL_STDOUT[0])
    assert_state_dicts_equal(load_export(RUNS / "ddp_resumed.pt"), full_run,
                             msg="resumed vs uninterrupted:")


def test_a_resume_at_another_world_size_rescales_the_lr(tmp_path, first_half):
    """The step-20 checkpoint of 2 ranks x 32 (global batch 64, peak LR 0.02 = 0.01 x 64/32)
    resumed by one process x 32: another global batch, 32, whose peak LR is 0.01. The restored
    optimizer and scheduler would carry 0.02 on (the banner printing 0.01); the template gives
    them the new peak LR, keeps the step count and Adam's moments, and says so in one line. A
    checkpoint that does not record its world size (an older one) is trained on at its own LR,
    with a line saying that nothing could be checked."""
    _, saved = first_half
    state = torch.load(saved, map_location="cpu", weights_only=False)
    assert (state["world_size"], state["global_batch"]) == (2, 64)
    assert state["rng"]["cuda"] is None  # made on CPU: no CUDA generator to restore
    assert state["scheduler"]["base_lrs"] == [0.02]
    ckpt = tmp_path / "resized"
    ckpt.mkdir()
    shutil.copy(saved, ckpt)
    result = run_python(TRAIN, "--steps", "22", "--log-every", "1", "--ckpt-dir", str(ckpt))
    assert ("resized: checkpoint of world 2 (global batch 64, peak lr 0.02) -> world 1 (global "
            "batch 32, peak lr 0.01): lr rescaled; step count and AdamW state kept"
            in result.stdout), result.stdout
    assert "| lr 0.01 (base 0.01 x 32/32)" in result.stdout
    steps = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 2 and all(line.endswith("| lr 0.01000") for line in steps), steps
    after = torch.load(ckpt / "step_000022.pt", map_location="cpu", weights_only=False)
    assert (after["world_size"], after["global_batch"]) == (1, 32)
    assert after["scheduler"]["base_lrs"] == [0.01]
    assert [g["lr"] for g in after["optimizer"]["param_groups"]] == [0.01]
    # Adam went on from its step-20 state: 22 steps counted, not 2 (a fresh optimizer)
    assert all(float(s["step"]) == 22 for s in after["optimizer"]["state"].values())

    del state["world_size"], state["global_batch"]
    older = tmp_path / "older"
    older.mkdir()
    torch.save(state, older / "step_000020.pt")
    result = run_python(TRAIN, "--steps", "21", "--ckpt-dir", str(older))
    assert ("warning: the checkpoint does not record its world size and global batch (an older "
            "one): cannot check its peak lr 0.02 against this run's world 1 (global batch 32, "
            "peak lr 0.01); training on at the checkpoint's" in result.stdout), result.stdout
    assert "step   21/21 |" in result.stdout and result.stdout.rstrip().count("| lr 0.02000") == 1


def start_nodes(nodes: list, *args) -> list:
    """One rank per simulated node, each started in its own directory (its own local disk), all
    with the same command and the same relative --ckpt-dir; each rank's result."""
    port, procs, t0 = free_port(), [], time.monotonic()
    for rank, node in enumerate(nodes):
        env = {"RANK": rank, "LOCAL_RANK": 0, "WORLD_SIZE": len(nodes), "LOCAL_WORLD_SIZE": 1,
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        procs.append((start([PYTHON, REPO / TRAIN, *args], env=env, cwd=node),
                      [PYTHON, TRAIN, *args]))
    return [finish(proc, cmd, timeout=120, t0=t0, check=False) for proc, cmd in procs]


def test_every_rank_resumes_the_file_rank_0_chose_or_every_rank_stops(tmp_path, first_half):
    """Two nodes whose --ckpt-dir is not one shared directory (the same path on each node's own
    disk): rank 0 finds step_000020.pt; rank 1's directory is empty. Each rank choosing for
    itself, rank 0 would resume at step 20 and rank 1 start from scratch, and the ranks would
    train apart. Rank 0 chooses, sends the name, and every rank loads that file; rank 1 cannot,
    so both stop with one line each that names the file and the cause.

    Then rank 1's file of that name holds another step (here written so by hand; whatever makes
    ranks load different states, the ranks compare the step they read before training): both
    stop, naming the steps."""
    _, saved = first_half
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    for node in nodes:
        (node / "ckpt").mkdir(parents=True)
    shutil.copy(saved, nodes[0] / "ckpt")
    args = ["--steps", "22", "--ckpt-dir", "ckpt", "--timeout-s", "30"]
    path = "ckpt/step_000020.pt"
    shared = "--ckpt-dir must be on a filesystem that every node shares"
    rank0, rank1 = start_nodes(nodes, *args)
    assert rank0.returncode == rank1.returncode == 2, rank0.describe() + rank1.describe()
    assert rank0.stderr_lines() == [f"[rank 0] error: another rank cannot read {path}, the "
                                    f"checkpoint rank 0 resumes from: {shared}"], rank0.describe()
    assert rank1.stderr_lines() == [f"[rank 1] error: cannot read {path}, the checkpoint rank 0 "
                                    f"resumes from ([Errno 2] No such file or directory: "
                                    f"'{path}'): {shared}"], rank1.describe()
    assert "resumed" not in rank0.stdout

    state = torch.load(saved, map_location="cpu", weights_only=False)
    state["step"] = 10
    torch.save(state, nodes[1] / path)
    for rank, result in enumerate(start_nodes(nodes, *args)):
        assert result.returncode == 2 and result.stderr_lines() == [
            f"[rank {rank}] error: the ranks read different steps (10 to 20) from {path}: "
            f"{shared}"], result.describe()


def test_checkpoints_keep_the_cuda_rng_state_of_this_rank_gpu_only(monkeypatch):
    """torch.cuda.get_rng_state_all() saves one state per visible GPU: a run resumed with fewer
    GPUs visible (srun --gpus-per-task=1, a requeue onto a smaller node) fails in
    set_rng_state_all, and a CPU run on a GPU machine starts CUDA to save it. The template
    saves and restores the state of the rank's own GPU, on CUDA only: a CPU run touches no CUDA
    function (all of them fail here, with CUDA said to be available), and a CUDA run (simulated:
    no GPU on the test machine) reads and writes its own device's state, once each."""
    source = (REPO / TRAIN).read_text()
    calls = {node.func.attr for node in ast.walk(ast.parse(source))
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)}
    assert not calls & {"get_rng_state_all", "set_rng_state_all"}
    training = load_script(TRAIN)

    def touched(*args, **kwargs):
        raise AssertionError("a CPU run touched CUDA")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name in ("init", "get_rng_state", "get_rng_state_all", "set_rng_state",
                 "set_rng_state_all"):
        monkeypatch.setattr(torch.cuda, name, touched)
    cpu = torch.device("cpu")
    states = training.rng_states(cpu)
    assert states["cuda"] is None
    training.set_rng_states(states, cpu)

    seen, gpu = [], torch.device("cuda", 1)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device: seen.append(
        ("get", device)) or torch.zeros(16, dtype=torch.uint8))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: seen.append(
        ("set", device)))
    training.set_rng_states(training.rng_states(gpu), gpu)
    assert seen == [("get", gpu), ("set", gpu)]


class Planted:
    """An object whose unpickling would run code: what a hostile file in a shared --ckpt-dir
    holds."""
    def __reduce__(self):
        return (print, ("code ran while loading",))


def test_checkpoints_are_ordered_by_step_and_loaded_as_data_only(tmp_path, capsys):
    """The newest checkpoint is the largest step, not the last name (step_1000000.pt sorts before
    step_999999.pt as text), and a file not named step_<N>.pt is none; a file that needs code to
    load is skipped as unreadable, not run; resume removes the temporary files of interrupted
    writes."""
    training = load_script(TRAIN)
    for step in (999_999, 1_000_000, 99):
        torch.save({"step": step}, tmp_path / f"step_{step:06d}.pt")
    (tmp_path / "step_000010.old.pt").write_bytes(b"a user's copy")  # not a checkpoint name
    assert [p.name for p in training.checkpoints(tmp_path)] == \
        ["step_000099.pt", "step_999999.pt", "step_1000000.pt"]
    assert training.latest_checkpoint(tmp_path)[1] == {"step": 1_000_000}
    torch.save({"step": 1_000_001, "payload": Planted()}, tmp_path / "step_1000001.pt")
    path, state = training.latest_checkpoint(tmp_path)
    assert state == {"step": 1_000_000}
    out = capsys.readouterr()
    assert "skipping unreadable checkpoint" in out.err and "code ran" not in out.out + out.err
    (tmp_path / ".step_1000002.pt.tmp").write_bytes(b"half a file")
    training.remove_interrupted_writes(tmp_path)  # rank 0, as resume starts
    assert not list(tmp_path.glob(".step_*.tmp")) and len(training.checkpoints(tmp_path)) == 4


def test_sigterm_without_a_ckpt_dir_says_that_nothing_was_saved(tmp_path):
    """SIGTERM (a preemption) stops every rank at the same step. With --ckpt-dir the template
    checkpoints that step; without one nothing is saved, and the line says so."""
    log = tmp_path / "run.log"
    with open(log, "w") as f:
        proc = subprocess.Popen([PYTHON, TRAIN, "--steps", "1000000", "--log-every", "1"],
                                cwd=REPO, env=base_env(), stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        t0 = time.monotonic()
        while "step    2/" not in log.read_text():
            assert proc.poll() is None and time.monotonic() - t0 < 120, log.read_text()
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    text = log.read_text()
    stopped = re.search(r"SIGTERM at step (\d+): nothing saved \(no --ckpt-dir was given\), so "
                        r"the (\d+) steps since the start are lost; exiting", text)
    assert proc.returncode == 0 and stopped, text[-2000:]
    assert stopped.group(1) == stopped.group(2) and "checkpointed" not in text


def test_fp16_on_cpu_trains_and_world2_equals_one_process(tmp_path, full_run):
    """--precision fp16 on a CPU: autocast in float16 and a GradScaler on the CPU. Two ranks x 32
    against one process x 64, both fp16, the same global batch.

    Tolerance. fp16 keeps 11 significant bits (unit roundoff u = 2^-11 = 4.9e-4). Both runs round
    every matmul of forward and backward to fp16, but at different places: a rank rounds its half
    batch's gradient sums, one process the whole batch's. Each step's gradients then differ by a
    few u, relative; AdamW turns them into updates of bounded size, so after 40 steps the weights
    differ, relative to how far training moved them, by a few u too. Measured, per tensor
    (|w2 - w1| / |w_end - w_start|): 7.5e-4 to 3.0e-3, with this CPU's kernels and with
    ATEN_CPU_CAPABILITY=default alike. Bound: 20 u = 9.8e-3, 3x the largest; a rank training on
    the wrong rows is 50x past it (a run on half the data: 0.5 to 1.2)."""
    w1_dir, w2_dir = tmp_path / "w1", tmp_path / "w2"
    run_torchrun(TRAIN, "--precision", "fp16", "--export", w2_dir / "model.pt", "--metrics-out",
                 w2_dir / "metrics.json", timeout=240)
    run_python(TRAIN, "--precision", "fp16", "--batch-size", "64", "--export",
               str(w1_dir / "model.pt"), "--metrics-out", str(w1_dir / "metrics.json"))
    m2, m1 = read_json(w2_dir / "metrics.json"), read_json(w1_dir / "metrics.json")
    assert m2["precision"] == m1["precision"] == "fp16" and m2["global_batch"] == 64
    for m in (m1, m2):  # it trains: the loss of the last 5 steps under half that of the first 5
        assert sum(m["losses"][-5:]) < 0.5 * sum(m["losses"][:5]), m["losses"]
    w2, w1 = load_export(w2_dir / "model.pt"), load_export(w1_dir / "model.pt")
    from dtcourse.models import MLP
    torch.manual_seed(0)  # the template's start: MLP(--hidden 128) after torch.manual_seed(0)
    w0 = MLP(128).state_dict()
    u = 2.0 ** -11
    for key in w0:
        moved = (full_run[key] - w0[key]).norm()
        rel = ((w2[key] - w1[key]).norm() / moved).item()
        assert rel <= 20 * u, f"{key}: world 2 vs 1 in fp16 differ by {rel:.2e} of the update"
        # fp16 really ran: against the fp32 run the weights differ by fp16 rounding (1.4e-3 to
        # 3.4e-3 of the update measured), not by fp32's (1e-7)
        assert ((w2[key] - full_run[key]).norm() / moved).item() > u / 10, key


def test_a_finished_run_launched_again_exports_the_same_model(tmp_path):
    """A checkpoint at --steps: nothing to train, the same export. Past --steps: exit 2 on every
    rank, one line (training to step 2 from step 3 is impossible; one rank here, so no "[rank r]"
    prefix). A run of one step times nothing and says so, instead of printing nan."""
    ckpt, first, again = tmp_path / "ckpt", tmp_path / "first.pt", tmp_path / "again.pt"
    common = [TRAIN, "--steps", "3", "--ckpt-dir", str(ckpt)]
    run_python(*common, "--export", str(first), "--metrics-out", str(tmp_path / "first.json"))
    result = run_python(*common, "--export", str(again), "--metrics-out", str(tmp_path / "m.json"))
    assert f"nothing to train: {ckpt} is already at step 3 (--steps 3)" in result.stdout
    assert "done:" not in result.stdout and "nan" not in result.stdout
    assert_state_dicts_equal(load_export(again), load_export(first), msg="launched again:")
    m = read_json(tmp_path / "m.json")
    assert m["losses"] == [] and m["start_step"] == 3 and m["samples_per_s"] is None
    past = run_python(TRAIN, "--steps", "2", "--ckpt-dir", str(ckpt), check=False)
    message = (f"error: the newest checkpoint in {ckpt} is at step 3, past --steps 2: raise "
               f"--steps, or use another --ckpt-dir")
    assert past.returncode == 2 and past.stderr_lines() == [message], past.describe()
    one = run_python(TRAIN, "--steps", "4", "--ckpt-dir", str(ckpt), "--metrics-out",
                     str(tmp_path / "one.json"))
    assert "done: 1 steps, samples/s not measured (the first step is not timed)" in one.stdout
    # The smoothed loss at step 4 averages steps 1-4: the checkpoint carried steps 1-3's losses
    # (a window restarted at the resume would print "mean of last  1" and step 4's loss alone).
    window = (read_json(tmp_path / "first.json")["losses"]
              + read_json(tmp_path / "one.json")["losses"])
    assert len(window) == 4
    assert f"| mean of last  4 {sum(window) / 4:.4f} |" in one.stdout, one.stdout


def test_spawn_and_c10d_launchers_give_the_same_model(tmp_path, full_run):
    """mp.spawn (no torchrun) and two simulated nodes meeting at a c10d rendezvous both compute
    exactly what one-node torchrun computed."""
    readme_run(SPAWN, "ddp_spawn.pt")
    assert_state_dicts_equal(load_export(RUNS / "ddp_spawn.pt"), full_run, msg="spawn:")

    export = tmp_path / "c10d.pt"
    env = {"NNODES": 2, "NPROC_PER_NODE": 1, "RDZV_ENDPOINT": f"127.0.0.1:{free_port()}"}
    node = ["bash", LAUNCH, "c10d", "--export", str(export)]
    run_together([node, node], env=env)  # rank 0, on whichever node it lands, writes the file
    assert_state_dicts_equal(load_export(export), full_run, msg="c10d:")


@pytest.fixture(scope="module")
def mnist_runs(tmp_path_factory):
    """ddp_mnist.py on the same 64-sample global batches: the README's python (1 rank x 64) and
    torchrun (2 ranks x 32) commands, and torchrun as two nodes on localhost (two launchers with
    a static master, 1 rank each)."""
    readme_run(MNIST_W1, "mnist_w1.json")
    readme_run(MNIST_W2, "mnist_w2.json")
    nodes = tmp_path_factory.mktemp("mnist") / "two_nodes.json"
    run_torchrun_nodes(MNIST, "--metrics-out", str(nodes), nnodes=2, nproc_per_node=1,
                       rdzv="static", timeout=240)
    return {"python": read_json(RUNS / "mnist_w1.json"),
            "one_node": read_json(RUNS / "mnist_w2.json"), "two_nodes": read_json(nodes)}


def test_mnist_accuracy_rises_at_world_1_and_2(mnist_runs):
    # Chance is 10%; 128 Adam steps on 4096 synthetic digits reach ~98.8%. Threshold: 95%.
    for name, m in mnist_runs.items():
        assert m["test_accuracy_before"] < 0.2, name
        assert m["test_accuracy"][-1] > 0.95, (name, m["test_accuracy"])


def test_mnist_same_result_under_python_torchrun_and_two_nodes(mnist_runs):
    mp_, m1, m2 = (mnist_runs[k] for k in ("python", "one_node", "two_nodes"))
    assert (mp_["world_size"], m1["world_size"], m2["world_size"]) == (1, 2, 2)
    assert mp_["global_batch"] == m1["global_batch"] == 64 and len(m1["losses"]) == 128
    # Two launchers or one: the same 2 ranks run the same arithmetic -> exactly equal.
    assert m2["losses"] == m1["losses"] and m2["test_accuracy"] == m1["test_accuracy"]
    # DistributedSampler's strided split makes the 2 ranks' batches the one-process batch, so the
    # first steps agree to rounding; a wrong split of the data differs by > 1e-2 from step 1.
    # Rounding differences then grow as the network learns fast, at a rate that depends on the CPU
    # kernels: measured through step 16, <= 1.1e-7 relative both with the machine's vector kernels
    # and with ATEN_CPU_CAPABILITY=default; by step 32, 1.3e-7 with the first, 1.9e-5 with the
    # second. So 16 steps, at 1e-5: 100x the rounding, 1000x below the data bug.
    assert m1["losses"][:16] == pytest.approx(mp_["losses"][:16], rel=1e-5)
    # Later, while the network learns fast, ReLU and max-pool decisions flip on rounding-level
    # differences and the trajectories drift apart (measured: 4e-5 relative at step 48, 1e-2 at
    # step 128, as between any two machines). The end result must still agree: accuracies after
    # each epoch within 1 percentage point (10 of 1024 test digits; borderline digits flip: 1 did
    # with ATEN_CPU_CAPABILITY=default, 4 with avx2, after the first epoch).
    assert abs(m1["test_accuracy"][0] - mp_["test_accuracy"][0]) <= 0.01
    assert abs(m1["test_accuracy"][-1] - mp_["test_accuracy"][-1]) <= 0.01


def test_mnist_under_mpirun_equals_torchrun(tmp_path, mnist_runs):
    """`mpirun -np 2 python ddp_mnist.py`: the script's own set-up reads OpenMPI's variables and
    meets on this machine. Same 2 ranks, same arithmetic as one-node torchrun."""
    if shutil.which("mpirun") is None:
        pytest.skip("OpenMPI is not installed (apt-get install openmpi-bin; .ci/run does)")
    out = tmp_path / "mpirun.json"
    # As root OpenMPI asks for two confirmations; oversubscribe: a machine may count fewer slots.
    env = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_rmaps_base_oversubscribe": "1"}
    launch(["mpirun", "-np", "2", "-x", "OMP_NUM_THREADS", "-x", f"MASTER_PORT={free_port()}",
            PYTHON, MNIST, "--metrics-out", out], timeout=240, env=env)
    m, ref = read_json(out), mnist_runs["one_node"]
    assert m["world_size"] == 2
    assert m["losses"] == ref["losses"] and m["test_accuracy"] == ref["test_accuracy"]


def test_mnist_evaluation_counts_every_test_image_once():
    """5 test images on 2 ranks: rank 0 scores 0, 2, 4 and rank 1 scores 1, 3; none twice (a
    DistributedSampler would pad rank 1 with image 0)."""
    mnist = load_script(MNIST)
    args = SimpleNamespace(seed=0, batch_size=2)
    train_set = mnist.TensorDataset(torch.zeros(8, 1), torch.zeros(8))
    test_set = mnist.TensorDataset(torch.zeros(5, 1), torch.arange(5))
    seen = []
    for rank in range(2):
        d = mnist.Dist(rank, 2, rank, torch.device("cpu"))
        _, _, test_loader = mnist.make_loaders(args, d, train_set, test_set)
        seen += [int(label) for _, labels in test_loader for label in labels]
    assert sorted(seen) == [0, 1, 2, 3, 4]


def test_mnist_under_srun_equals_torchrun(slurm, tmp_path, mnist_runs):
    """`srun -n 2 python ddp_mnist.py`: no torchrun; the script's own set-up reads SLURM's
    variables and meets at the first host of the step's node list. Same 2 ranks, same arithmetic
    as one-node torchrun: exactly the same losses and accuracies."""
    out = tmp_path / "srun.json"
    slurm.run(["srun", "-n", "2", PYTHON, MNIST, "--metrics-out", out])
    m, ref = read_json(out), mnist_runs["one_node"]
    assert m["world_size"] == 2
    assert m["losses"] == ref["losses"] and m["test_accuracy"] == ref["test_accuracy"]


# What each launcher gives a worker (trimmed to what matters), and what the shared module reads
# from it; ddp_mnist.py's written-out set-up must read the same rank, world size, local rank and
# rendezvous point from each.
TORCHRUN_ENV = {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": "29611", "RANK": "1", "TORCHELASTIC_RUN_ID": "none",
                "WORLD_SIZE": "2"}
SRUN_ONE_NODE = {"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "vm", "SLURM_LOCALID": "1",
                 "SLURM_NODEID": "0", "SLURM_NTASKS": "2", "SLURM_PROCID": "1",
                 "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "vm", "SLURM_STEP_NUM_TASKS": "2",
                 "SLURM_STEP_TASKS_PER_NODE": "2"}
# Task 9 of `srun -N 3 --ntasks-per-node=4`, the job's third step, on the third node.
SRUN_NODES = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu[07-09,12],cpu1",
              "SLURM_LOCALID": "1", "SLURM_NODEID": "2", "SLURM_NTASKS": "12",
              "SLURM_PROCID": "9", "SLURM_STEP_ID": "2", "SLURM_STEP_NODELIST": "gpu[07-09]",
              "SLURM_STEP_NUM_TASKS": "12", "SLURM_STEP_TASKS_PER_NODE": "4(x3)"}
# Process 1 of `mpirun -np 2` on one host (no master given: this machine, port 29500), and
# process 5 of `mpirun -np 8 -H a:4,b:4 -x MASTER_ADDR=a -x MASTER_PORT=29400`.
MPIRUN_ONE_NODE = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
                   "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
MPIRUN_NODES = {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8",
                "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
                "MASTER_ADDR": "a", "MASTER_PORT": "29400"}


@pytest.mark.parametrize("env", [
    {}, TORCHRUN_ENV, SRUN_ONE_NODE, SRUN_NODES,
    {**SRUN_NODES, "SLURM_STEP_ID": "batch"},
    {k: v for k, v in SRUN_NODES.items() if k != "SLURM_STEP_NODELIST"},  # the job's list
    {**SRUN_NODES, "SLURM_STEP_NODELIST": "rack[1-2]-n[03-04]"},
    {**SRUN_NODES, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400"},  # given: used as given
    {**SRUN_NODES, **TORCHRUN_ENV},  # `srun torchrun`: torchrun's numbering wins
    {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "vm", "SLURM_PROCID": "0"},  # a batch script
    MPIRUN_ONE_NODE, MPIRUN_NODES,
], ids=["python", "torchrun", "srun-1-node", "srun-3-nodes", "srun-batch-step",
        "srun-job-nodelist", "srun-two-ranges", "srun-with-master", "torchrun-under-srun",
        "sbatch-script", "mpirun-1-node", "mpirun-2-nodes"])
def test_mnist_setup_reads_the_launcher_like_the_shared_module(env):
    from dtcourse.launch import detect
    mnist = load_script(MNIST)
    mine, shared = mnist.who_am_i(env), detect(env)
    assert (mine.rank, mine.world_size, mine.local_rank, mine.master_addr, mine.master_port) == \
        (shared.rank, shared.world_size, shared.local_rank, shared.master_addr,
         shared.master_port)
    # processes on this node, as the shared module's device choice counts them
    assert mine.local_world_size == (shared.local_world_size or shared.local_rank + 1)
    if env is SRUN_NODES:  # the first host of gpu[07-09], a port from job 4242 and step 2
        assert (mine.master_addr, mine.master_port) == ("gpu07", 20000 + (42420 + 2) % 10000)
    if env is MPIRUN_ONE_NODE:
        assert (mine.launcher, mine.master_addr, mine.master_port) == ("mpirun", "127.0.0.1", 29500)


def test_mnist_setup_refuses_mpirun_on_several_nodes_without_a_master(capsys):
    """Only the user knows which host runs rank 0: both set-ups stop with a message saying what
    to pass, instead of N processes each waiting for a master on their own machine."""
    from dtcourse.launch import LaunchError, detect
    env = {k: v for k, v in MPIRUN_NODES.items() if not k.startswith("MASTER_")}
    with pytest.raises(LaunchError, match="MASTER_ADDR is not set"):
        detect(env)
    with pytest.raises(SystemExit) as exit_info:
        load_script(MNIST).who_am_i(env)
    assert exit_info.value.code == 2
    assert "pass -x MASTER_ADDR=<rank 0's host> -x MASTER_PORT=<port>" in capsys.readouterr().err


# Bad input (--batch-size 0, --device tpu, --device cuda without a GPU, missing MNIST, a world
# larger than the data): tests/test_bad_inputs.py, on every rank of a 2-rank job.


def test_benchmark_sweep_reports_consistent_scaling():
    result = readme_run(BENCHMARK, "ddp_scaling.json")
    rows = read_json(RUNS / "ddp_scaling.json")
    assert [r["world_size"] for r in rows] == [1, 2]
    base = rows[0]
    for r in rows:
        assert r["backend"] == "gloo" and r["per_rank_batch"] == 64
        assert r["samples_per_s"] == pytest.approx(r["world_size"] * 64 / r["step_time_s"])
        assert r["exposed_comm_s"] == pytest.approx(max(0.0, r["step_time_s"] - r["compute_s"]))
        assert r["scaling_efficiency"] == pytest.approx(
            r["samples_per_s"] / (r["world_size"] * base["samples_per_s"]))
    assert "efficiency" in result.stdout and "exposed comm ms" in result.stdout


def test_every_script_answers_help():
    for script in (TRAIN, MNIST, BENCH):
        result = launch([PYTHON, script, "--help"], timeout=30)
        assert "--device" in result.stdout and "--timeout-s" in result.stdout


def test_mnist_setup_pins_one_thread_per_rank_whatever_omp_num_threads():
    """ddp_mnist.py writes its set-up out (it teaches it) and pins one CPU thread per rank there,
    as dtcourse.launch does for every other script: with more threads the last digits of its loss
    would depend on the machine's core count, and its README quotes them."""
    code = ("import sys, torch; sys.path.insert(0, '01-ddp-basics'); import ddp_mnist as m; "
            "d = m.init_distributed('cpu', 60); print(torch.get_num_threads()); m.teardown()")
    out = launch([PYTHON, "-c", code], env={"OMP_NUM_THREADS": "2"}, timeout=120)
    assert out.stdout.split() == ["1"], out.stdout


def test_the_gpu_prediction_of_section_6_is_its_own_arithmetic():
    """Section 6's prediction for a 1B-parameter model on one 8-GPU node is arithmetic on stated
    assumptions (25 GB/s PCIe, 400 GB/s NVLink, 300 TFLOP/s sustained, backward two thirds of
    compute): every figure it prints is recomputed here from them, so an edit of one assumption
    or one result that leaves the others behind fails."""
    text = " ".join(README.read_text().split())
    start = text.index("**What to expect on GPUs (a prediction, not a measurement)**")
    paragraph = text[start:text.index("Smaller per-GPU batches", start)]
    P, N, tokens = 1e9, 8, 8 * 2048
    sent = 4 * P * 2 * (N - 1) / N                      # fp32 gradients, ring all-reduce
    pcie, nvlink = sent / 25e9, sent / 400e9
    compute = 6 * tokens * P / 300e12
    backward = compute * 2 / 3
    for figure in (f"{tokens:,} x 10^9", f"{sent / 1e9:.0f} GB", f"{pcie:.2f} s over PCIe",
                   f"{nvlink * 1e3:.0f} ms over NVLink",
                   f"{6 * tokens * P / 1e13:.1f} x 10^13 FLOP",
                   f"{compute:.2f} s at a sustained 300", f"({backward:.2f} s) in backward",
                   f"at least {pcie - backward:.2f} s shows"):
        assert figure in paragraph, figure
    assert nvlink < backward < pcie  # hidden over NVLink, exposed over PCIe, as the text says

"""Lesson 03: the SLURM job file's preemption, the SIGTERM message, and the fp32 export.

- slurm_deepspeed.sbatch (srun starts every rank, no deepspeed launcher) on the one-node test
  cluster: its srun step holds the CPUs the file asks for each rank; SIGUSR1 to the batch script
  (what `#SBATCH --signal=B:USR1@60` sends before the time limit) makes the ranks checkpoint, the
  job is requeued, resumes from that checkpoint, and ends bitwise equal to an uninterrupted
  torchrun run.
- SIGTERM to a run without --ckpt-dir says that nothing was saved.
- Stage 0 in bf16 exports the optimizer's fp32 master (from the live engine and from the
  checkpoint), not the bf16 weights upcast: DeepSpeed's safe_get_full_fp32_param knows nothing of
  the FP16_(Unfused)Optimizer's master and returns None there.

Cost: the job runs twice (before and after the requeue) and is compared with one torchrun run;
the other tests are one-process runs of a few steps.
"""

import re
import signal
import subprocess
import time

import torch
from dtcourse.models import GPT

from conftest import (PYTHON, REPO, assert_state_dicts_equal, base_env, load_export, run_python,
                      run_torchrun)
from test_scale import EXACT, preempt_and_requeue, sbatch, step_cpus

TRAIN = "03-deepspeed/deepspeed_train.py"
SBATCH_DS = "03-deepspeed/slurm_deepspeed.sbatch"
ZERO0 = "03-deepspeed/configs/zero0_config.json"
ZERO2 = "03-deepspeed/configs/zero2_config.json"  # the job file's default CONFIG
STEPS = 300  # ~10 s of training at 2 ranks: long enough to interrupt, short enough for CI
ARGS = ["--steps", str(STEPS), "--log-every", "10"]
TIMEOUT = 280


def test_preempted_deepspeed_job_checkpoints_is_requeued_and_ends_equal(slurm, tmp_path):
    """The job file (its default config, 2 ranks a node, 4 CPUs a rank): srun's step holds 2 x 4
    CPUs; after SIGUSR1 the ranks checkpoint the same step and exit by themselves (the step ends
    without an error: under the deepspeed launcher the step's task, the runner, ended with the
    signal and srun force-terminated the step), the trap requeues the job, and the requeued job
    resumes to the uninterrupted model."""
    reference = tmp_path / "reference.pt"
    run_torchrun(TRAIN, "--deepspeed_config", ZERO2, *ARGS, "--export", reference, nproc=2,
                 timeout=TIMEOUT)
    out, log = tmp_path / "preempted.pt", tmp_path / "job.out"
    job = sbatch(slurm, SBATCH_DS, *ARGS, "--export", out, output=log, wait=False,
                 env={"CKPT_DIR": tmp_path / "ckpt", **EXACT})
    cpus = step_cpus(slurm, job)
    assert cpus == 2 * 4, f"the srun step held {cpus} CPU(s), the job file asks 2 ranks x 4"
    text = preempt_and_requeue(slurm, job, log)
    # No fixed port: the file derives it from the job id, as dtcourse.launch does under srun.
    port = 20000 + int(job) * 10 % 10000
    assert re.search(rf"master \S+:{port}$", text, re.M), text[:2000]
    stopped = re.search(r"SIGTERM: checkpointed step (\d+)", text)
    assert stopped, f"the ranks did not checkpoint on the signal:\n{text[-4000:]}"
    step = int(stopped.group(1))
    assert 10 <= step < STEPS, step
    assert f"resumed from step {step} in" in text, text[-4000:]
    # Every rank ended on its own, with status 0: srun reported no task and killed nothing.
    assert not re.search(r"^srun: (error|Force Terminated)|Terminated", text, re.M), text[-4000:]
    assert_state_dicts_equal(load_export(out), load_export(reference),
                             msg="preempted+requeued sbatch vs uninterrupted torchrun:")


def test_sigterm_without_ckpt_dir_says_nothing_was_saved(tmp_path):
    """The run stops at a step as the ranks agree, and does not claim a checkpoint it did not
    write (it used to print "checkpointed step N to None")."""
    log = tmp_path / "run.log"
    with open(log, "w") as f:
        proc = subprocess.Popen([PYTHON, TRAIN, "--deepspeed_config", ZERO0, "--steps", "1000000",
                                 "--log-every", "1"], cwd=REPO, env=base_env(), stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        t0 = time.monotonic()
        while "step    2/" not in log.read_text():
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() - t0 < TIMEOUT, "training did not start"
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert proc.returncode == 0, text[-3000:]
    stopped = re.search(r"^SIGTERM: stopped after step (\d+); nothing saved \(no --ckpt-dir\)$",
                        text, re.M)
    assert stopped and int(stopped.group(1)) >= 2, text[-3000:]
    assert "checkpointed" not in text, text[-3000:]


def test_stage0_bf16_export_is_the_fp32_master(tmp_path):
    """Stage 0 with bf16 (on CPU with --precision bf16): DeepSpeed wraps the optimizer in
    FP16_UnfusedOptimizer, which steps an fp32 copy of every parameter and writes it to the
    checkpoint as `fp32_groups`. Both exports (live engine, final checkpoint) must be that copy,
    bit for bit, and not the module's bf16 weights upcast (which lose the master's low bits)."""
    ckpt = tmp_path / "ckpt"
    common = ["--deepspeed_config", ZERO0, "--precision", "bf16", "--steps", "4",
              "--ckpt-dir", ckpt]
    run_python(TRAIN, *common, "--export", tmp_path / "engine.pt", timeout=TIMEOUT)
    # Same command again: it resumes at the last step, trains nothing, and converts the checkpoint.
    run_python(TRAIN, *common, "--export", tmp_path / "checkpoint.pt", "--export-source",
               "checkpoint", timeout=TIMEOUT)
    saved = torch.load(ckpt / "step_000004" / "mp_rank_00_model_states.pt", map_location="cpu",
                       weights_only=False)
    names = [name for name, _ in GPT(vocab=64, seq_len=32, dim=64, heads=4,
                                     layers=2).named_parameters()]
    masters = [t for group in saved["optimizer"]["fp32_groups"] for t in group]
    assert len(masters) == len(names)
    master = dict(zip(names, masters))
    assert all(t.dtype == torch.float32 for t in masters)
    assert all(saved["module"][n].dtype == torch.bfloat16 for n in names)
    for source in ("engine", "checkpoint"):
        exported = load_export(tmp_path / f"{source}.pt")
        assert_state_dicts_equal(exported, master, msg=f"{source} export vs fp32 master:")
        # The master is not the bf16 weights upcast: most of its elements have bits below bf16's
        # 8-bit mantissa.
        upcast = sum((exported[n] != saved["module"][n].float()).sum().item() for n in names)
        total = sum(exported[n].numel() for n in names)
        assert upcast > total // 2, f"{source}: only {upcast} of {total} elements differ from " \
                                    "the bf16 weights upcast"

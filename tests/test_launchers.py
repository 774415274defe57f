"""Every training script computes the same thing whichever launcher starts it.

The scripts share one set-up (dtcourse/launch.py) that reads each launcher's variables. The
scripts where the launcher can matter otherwise (DeepSpeed's, which read the environment too;
lesson 01's two, which read it for their own output; DCP checkpoints; the device mesh and the
pipeline's sub-groups; the data loader's worker processes) are launched as 2 tasks by SLURM's
`srun` on the test cluster (no torchrun: the tasks read SLURM_PROCID, SLURM_STEP_NUM_TASKS,
SLURM_LOCALID and SLURM_STEP_NODELIST, and derive the port from the job id) and as 2 ranks by
`torchrun --nproc_per_node=2`; the exported weights must be bitwise equal, because the same ranks
run the same arithmetic (ddp_training.py: in test_scale.py, against the torchrun reference its
SLURM and elastic tests share). `mpirun` (OpenMPI's variables) is checked the same way on lesson
01's template. The deepspeed launcher is covered by lesson 03's tests, python (a group of one) by
every lesson's.

Every other training script is checked on its source: it starts through dtcourse.launch and reads
no launcher variable itself, so the launches above cover it. Each launched script runs a few steps
of its smallest configuration: the point is the launch, not training.
"""

import shutil

import pytest

from conftest import (PYTHON, REPO, assert_state_dicts_equal, launch, load_export,
                      readme_mentions, run_torchrun)

A = "05-advanced/a-tensor-sequence-hybrid"
B = "05-advanced/b-pipeline-expert-context"
C = "05-advanced/c-data-parallel-techniques"
ZERO3 = "03-deepspeed/configs/zero3_config.json"

# (script, arguments): every script of the course that trains and exports a model, each at a few
# steps of its smallest setting. Scripts that train several variants in one launch export one
# file per variant (w.pt -> w.<variant>.pt); every file is compared.
TRAINING_SCRIPTS = [
    ("01-ddp-basics/ddp_mnist.py", ["--epochs", "1", "--train-size", "192", "--test-size", "64"]),
    ("01-ddp-basics/ddp_training.py", ["--steps", "3"]),
    ("02-fsdp/fsdp_from_scratch.py", ["--steps", "2"]),
    ("02-fsdp/fsdp_transformer.py", ["--steps", "2", "--strategy", "full", "ddp"]),
    ("02-fsdp/fsdp_checkpoint.py", ["--steps", "3"]),
    ("02-fsdp/fairscale_oss.py", ["--steps", "2", "--impl", "oss"]),
    ("02-fsdp/fsdp1_api.py", ["--steps", "2"]),
    ("02-fsdp/fsdp_lora.py", ["--steps", "2"]),
    ("03-deepspeed/deepspeed_train.py", ["--deepspeed_config", ZERO3, "--steps", "2"]),
    ("03-deepspeed/zero_from_scratch.py", ["--steps", "2", "--stage", "2"]),
    ("03-deepspeed/zero_offload.py", ["--steps", "2", "--configs", "zero2_offload_config"]),
    (f"{A}/tensor_parallel.py", ["--steps", "2", "--sequence-parallel"]),
    (f"{A}/hybrid_parallelism.py", ["--steps", "2", "--pp", "2", "--microbatches", "2"]),
    (f"{B}/pipeline_parallel.py", ["--steps", "2", "--schedule", "1f1b", "--microbatches", "4"]),
    (f"{B}/expert_parallel.py", ["--steps", "2"]),
    (f"{C}/gradient_accumulation.py", ["--steps", "2"]),
    (f"{C}/communication_overlap.py", ["--steps", "2", "--warmup", "0", "--variants", "bucketed"]),
    (f"{C}/gradient_compression.py", ["--steps", "2", "--methods", "powersgd"]),
    (f"{C}/async_sgd.py", ["--steps", "2", "--modes", "sync", "local", "--worker-delay-ms", "0"]),
    (f"{C}/profiling.py", ["--wait", "0", "--warmup", "0", "--active", "1"]),
    (f"{C}/data_loading.py", ["--images", "32", "--epochs", "1"]),
]


# Launched both ways; the rest of TRAINING_SCRIPTS reach their ranks only through dtcourse.launch,
# which these launches (and tests/test_dtcourse.py's unit tests of every launcher's variables)
# cover.
# ddp_training.py is launched both ways by test_scale.py (test_srun_python_equals_torchrun), and
# under mpirun below.
LAUNCHED = {"01-ddp-basics/ddp_mnist.py", "02-fsdp/fsdp_checkpoint.py",
            "03-deepspeed/deepspeed_train.py", "03-deepspeed/zero_offload.py",
            f"{A}/hybrid_parallelism.py", f"{B}/pipeline_parallel.py", f"{C}/data_loading.py"}
BY_TEST_SCALE = {"01-ddp-basics/ddp_training.py"}
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                      "MASTER_PORT", "GROUP_RANK", "TORCHELASTIC", "SLURM_", "OMPI_", "PMI_")
STARTS = ("setup", "distributed", "start_deepspeed")


def launcher_reads(source: str) -> tuple[list[str], bool]:
    """(launcher variables the source reads itself, whether it starts through dtcourse.launch)."""
    import ast
    reads, starts = [], False
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and node.value.startswith(LAUNCHER_VARIABLES):
            reads.append(node.value)
        if isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            if name.split(".")[-1] in STARTS and ("launch" in name or "." not in name):
                starts = True
    return reads, starts


def test_the_launch_check_flags_a_script_that_reads_its_rank_itself():
    bad = ("import os\nfrom dtcourse import launch\nrank = int(os.environ['RANK'])\n"
           "d = launch.setup()\n")
    assert launcher_reads(bad) == (["RANK"], True)
    raw = "import torch.distributed as dist\ndist.init_process_group('gloo')\n"
    assert launcher_reads(raw)[1] is False


@pytest.mark.parametrize("script",
                         sorted({s for s, _ in TRAINING_SCRIPTS} - LAUNCHED - BY_TEST_SCALE))
def test_every_other_training_script_gets_its_ranks_only_from_dtcourse(script):
    reads, starts = launcher_reads((REPO / script).read_text())
    assert starts, f"{script} does not start through dtcourse.launch"
    assert not reads, f"{script} reads launcher variables itself: {reads}"


def exports(folder) -> dict:
    files = sorted(folder.glob("*.pt"))
    assert files, f"nothing exported in {folder}"
    return {f.name: load_export(f) for f in files}


@pytest.mark.parametrize("script,args", [(s, a) for s, a in TRAINING_SCRIPTS if s in LAUNCHED],
                         ids=[s for s, _ in TRAINING_SCRIPTS if s in LAUNCHED])
def test_srun_exports_what_torchrun_exports(slurm, tmp_path, script, args):
    (tmp_path / "torchrun").mkdir()
    (tmp_path / "srun").mkdir()
    run_torchrun(script, *args, "--export", tmp_path / "torchrun" / "w.pt", nproc=2, timeout=240)
    slurm.run(["srun", "-n", "2", PYTHON, script, *args, "--export", tmp_path / "srun" / "w.pt"],
              timeout=240)
    ref, got = exports(tmp_path / "torchrun"), exports(tmp_path / "srun")
    assert sorted(got) == sorted(ref)
    for name in ref:
        assert_state_dicts_equal(got[name], ref[name], msg=f"{script} {name} srun vs torchrun:")


MPIRUN = "mpirun -np 16 -H node0:8,node1:8 -x MASTER_ADDR=node0 -x MASTER_PORT=29500 python " \
         "01-ddp-basics/ddp_training.py"


def test_mpirun_exports_what_torchrun_exports(tmp_path):
    """`mpirun -np 2 python ddp_training.py` on this machine (the RUNNING_AT_SCALE.md command with
    one host and 2 processes): ranks from OMPI_COMM_WORLD_*, the master on localhost."""
    if shutil.which("mpirun") is None:
        pytest.skip("OpenMPI is not installed (apt-get install openmpi-bin; .ci/run does)")
    assert readme_mentions(REPO / "RUNNING_AT_SCALE.md", MPIRUN)
    script, args = "01-ddp-basics/ddp_training.py", ["--steps", "3"]
    ref, out = tmp_path / "torchrun.pt", tmp_path / "mpirun.pt"
    run_torchrun(script, *args, "--export", ref, nproc=2, timeout=240)
    # As root, OpenMPI asks for these two confirmations; oversubscribe: a machine may count
    # fewer slots than 2.
    env = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_rmaps_base_oversubscribe": "1"}
    from conftest import free_port
    result = launch(["mpirun", "-np", "2", "-x", "OMP_NUM_THREADS", "-x",
                     f"MASTER_PORT={free_port()}", PYTHON, script, *args, "--export", out],
                    timeout=240, env=env)
    assert result.stdout.count("world 2 | device cpu") == 1, result.stdout  # printed by rank 0 only
    assert_state_dicts_equal(load_export(out), load_export(ref), msg="mpirun vs torchrun:")

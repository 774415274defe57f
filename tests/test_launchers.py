"""Every training script computes the same thing whichever launcher starts it.

The scripts share one set-up (dtcourse/launch.py) that reads each launcher's variables. Here every
training script of every lesson is launched as 2 tasks by SLURM's `srun` on the test cluster (no
torchrun: the tasks read SLURM_PROCID, SLURM_STEP_NUM_TASKS, SLURM_LOCALID and SLURM_STEP_NODELIST,
and derive the port from the job id) and as 2 ranks by `torchrun --nproc_per_node=2`; the exported
weights must be bitwise equal, because the same ranks run the same arithmetic. `mpirun` (OpenMPI's
variables) is checked the same way on lesson 01's template. The deepspeed launcher is covered by
lesson 03's tests, python (a group of one) by every lesson's.

Each script runs a few steps of its smallest configuration: the point is the launch, not training.
"""

import shutil

import pytest

from conftest import (PYTHON, REPO, assert_state_dicts_equal, launch, load_export,
                      readme_mentions, run_torchrun)

# (script, arguments): every script that trains and exports a model.
TRAINING_SCRIPTS = [
    ("01-ddp-basics/ddp_mnist.py", ["--epochs", "1", "--train-size", "192", "--test-size", "64"]),
    ("01-ddp-basics/ddp_training.py", ["--steps", "3"]),
]


@pytest.mark.parametrize("script,args", TRAINING_SCRIPTS, ids=[s for s, _ in TRAINING_SCRIPTS])
def test_srun_exports_what_torchrun_exports(slurm, tmp_path, script, args):
    ref, out = tmp_path / "torchrun.pt", tmp_path / "srun.pt"
    run_torchrun(script, *args, "--export", ref, nproc=2, timeout=240)
    slurm.run(["srun", "-n", "2", PYTHON, script, *args, "--export", out], timeout=240)
    assert_state_dicts_equal(load_export(out), load_export(ref), msg=f"{script} srun vs torchrun:")


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

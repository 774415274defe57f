"""The shared module on its own: which launcher started a process and who it is.

Each environment below is what that launcher gives a worker (torchrun, the deepspeed launcher and
srun environments were read from real runs of them; OpenMPI's from its documented variables),
trimmed to what matters. detect() must return the rank, local rank, world size, master address
and port, and say in one message what is wrong when the variables contradict each other.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import PYTHON, REPO, base_env
from dtcourse.launch import Launch, LaunchError, detect, first_host, slurm_port
from dtcourse.models import GPT, MLP, gpt_parameter_count, init_gpt

TORCHRUN = {"GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29611", "RANK": "1", "ROLE_RANK": "1",
            "ROLE_WORLD_SIZE": "2", "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_RUN_ID": "none", "WORLD_SIZE": "2"}
DEEPSPEED = {"CROSS_RANK": "0", "CROSS_SIZE": "1", "LOCAL_RANK": "1", "LOCAL_SIZE": "2",
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29612", "RANK": "1", "WORLD_SIZE": "2"}
SRUN_ONE_NODE = {"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "vm", "SLURM_LOCALID": "1",
                 "SLURM_NNODES": "1", "SLURM_NODEID": "0", "SLURM_NTASKS": "2",
                 "SLURM_PROCID": "1", "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "vm",
                 "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NUM_TASKS": "2",
                 "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_TASKS_PER_NODE": "2"}
# Task 5 of `srun -N 2 --ntasks-per-node=4` as the job's third step: second node, local rank 1.
SRUN_TWO_NODES = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu[07-08]",
                  "SLURM_LOCALID": "1", "SLURM_NNODES": "2", "SLURM_NODEID": "1",
                  "SLURM_NTASKS": "8", "SLURM_PROCID": "5", "SLURM_STEP_ID": "2",
                  "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_STEP_NUM_NODES": "2",
                  "SLURM_STEP_NUM_TASKS": "8", "SLURM_STEP_TASKS_PER_NODE": "4(x2)"}
# What a batch script's own process sees: SLURM_PROCID but no step of tasks.
SBATCH_SCRIPT = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "vm", "SLURM_LOCALID": "0",
                 "SLURM_NODEID": "0", "SLURM_NTASKS": "2", "SLURM_PROCID": "0"}
OPENMPI = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
           "OMPI_COMM_WORLD_LOCAL_RANK": "3", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}


@pytest.mark.parametrize("env,expected", [
    (TORCHRUN, Launch("torchrun", 1, 2, 1, 2, "127.0.0.1", 29611)),
    (DEEPSPEED, Launch("deepspeed", 1, 2, 1, 2, "127.0.0.1", 29612)),
    (SRUN_ONE_NODE, Launch("srun", 1, 2, 1, 2, "vm", 20010)),
    (SRUN_TWO_NODES, Launch("srun", 5, 8, 1, 4, "gpu07", 20000 + (42420 + 2) % 10000)),
    (OPENMPI, Launch("mpirun", 3, 4, 3, 4, "127.0.0.1", 29500)),
    ({**OPENMPI, "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
      "MASTER_ADDR": "n1", "MASTER_PORT": "6000"}, Launch("mpirun", 3, 4, 1, 2, "n1", 6000)),
    ({}, Launch("python", 0, 1, 0, 1, None, None)),
    (SBATCH_SCRIPT, Launch("python", 0, 1, 0, 1, None, None)),
    # torchrun started by srun (one launcher per node): torchrun's numbering wins.
    ({**SRUN_TWO_NODES, **TORCHRUN}, Launch("torchrun", 1, 2, 1, 2, "127.0.0.1", 29611)),
    # MASTER_ADDR / MASTER_PORT given to srun tasks are used as given.
    ({**SRUN_TWO_NODES, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400"},
     Launch("srun", 5, 8, 1, 4, "10.0.0.1", 29400)),
], ids=["torchrun", "deepspeed", "srun-1-node", "srun-2-nodes", "mpirun-1-node", "mpirun-2-nodes",
        "python", "sbatch-script", "torchrun-under-srun", "srun-with-master"])
def test_detect(env, expected):
    assert detect(env) == expected


@pytest.mark.parametrize("env,message", [
    ({"RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, r"RANK is set but WORLD_SIZE is not"),
    ({"WORLD_SIZE": "2"}, r"WORLD_SIZE is set but RANK is not"),
    ({**TORCHRUN, "RANK": "2"}, r"RANK=2 is not a rank of a world of WORLD_SIZE=2"),
    ({**TORCHRUN, "RANK": "one"}, r"RANK='one' is not a whole number"),
    ({**TORCHRUN, "WORLD_SIZE": "0", "RANK": "0"}, r"WORLD_SIZE=0: the world size must be"),
    ({**TORCHRUN, "LOCAL_RANK": "2"}, r"LOCAL_RANK=2 is not a local rank of the 2 processes"),
    ({k: v for k, v in TORCHRUN.items() if k != "LOCAL_RANK"},
     r"RANK and WORLD_SIZE are set \(world 2\) but LOCAL_RANK is not"),
    ({k: v for k, v in TORCHRUN.items() if k != "MASTER_ADDR"}, r"MASTER_ADDR is not"),
    ({k: v for k, v in DEEPSPEED.items() if not k.startswith("MASTER")},
     r"MASTER_ADDR and MASTER_PORT are not"),
    ({**TORCHRUN, "MASTER_PORT": "70000"}, r"MASTER_PORT='70000' is not a TCP port"),
    ({**SRUN_ONE_NODE, "SLURM_PROCID": "2"},
     r"SLURM_PROCID=2 is not a rank of a world of SLURM_STEP_NUM_TASKS=2"),
    ({k: v for k, v in SRUN_ONE_NODE.items() if k != "SLURM_LOCALID"}, r"SLURM_LOCALID is not"),
    ({**SRUN_TWO_NODES, "SLURM_LOCALID": "4"}, r"SLURM_LOCALID=4 is not a local rank of the 4"),
    ({**SRUN_TWO_NODES, "SLURM_NODEID": "2"}, r"SLURM_NODEID=2 is not one of the 2 nodes"),
    ({k: v for k, v in SRUN_ONE_NODE.items() if "NODELIST" not in k}, r"set MASTER_ADDR"),
    ({k: v for k, v in SRUN_ONE_NODE.items() if k != "SLURM_JOB_ID"}, r"set MASTER_PORT"),
    ({"OMPI_COMM_WORLD_RANK": "0"}, r"OMPI_COMM_WORLD_SIZE is not set"),
    ({**OPENMPI, "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1"},
     r"several nodes .* MASTER_ADDR is not set: pass -x MASTER_ADDR"),
])
def test_detect_rejects_contradictions(env, message):
    with pytest.raises(LaunchError, match=message):
        detect(env)


@pytest.mark.parametrize("nodelist,host", [
    ("vm", "vm"), ("gpu[07-09,12],cpu1", "gpu07"), ("a,b", "a"), ("n[3,5]", "n3"),
    ("rack[1-2]-n[03-04]", "rack1-n03"), ("node-10", "node-10")])
def test_first_host_matches_scontrol(nodelist, host):
    assert first_host(nodelist) == host


def test_slurm_port_is_shared_by_a_step_and_differs_between_steps():
    assert slurm_port("4242", "2") == slurm_port("4242", "2")
    assert slurm_port("4242", "2") != slurm_port("4242", "3")
    assert 20000 <= slurm_port("99999999", "batch") < 30000


def test_bad_launch_environment_is_one_line_and_exit_2():
    """setup() turns a LaunchError into the course's bad-input exit: one stderr line, status 2."""
    code = "from dtcourse.launch import setup; setup('cpu', 10)"
    r = subprocess.run([PYTHON, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                       env=base_env({"RANK": "3", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                     "MASTER_PORT": "1234"}))
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        "[rank 3] error: RANK=3 is not a rank of a world of WORLD_SIZE=2 (ranks are 0..1)"]


def test_shared_module_imports_from_any_directory(tmp_path):
    """Installed by requirements.txt (editable), not found through the working directory."""
    r = subprocess.run([sys.executable, "-c", "import dtcourse.launch, dtcourse.models; "
                        "print(dtcourse.__file__)"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=60, env=base_env())
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(REPO / "dtcourse" / "__init__.py")


# --------------------------------------------------------------------------------------------------
# Models


@pytest.mark.parametrize("vocab,seq_len,dim,heads,layers", [(256, 32, 64, 4, 2), (50, 7, 24, 3, 3)])
def test_gpt_parameter_count_formula(vocab, seq_len, dim, heads, layers):
    model = GPT(vocab, seq_len, dim, heads, layers)
    assert sum(p.numel() for p in model.parameters()) == \
        gpt_parameter_count(vocab, seq_len, dim, layers)


def test_init_gpt_is_a_function_of_seed_and_name():
    """Two GPTs built under different global RNG states get the same weights from init_gpt, and
    a different seed gives different ones; biases 0, norms 1, residual projections smaller."""
    torch.manual_seed(1)
    a = GPT(layers=2)
    torch.manual_seed(2)
    b = GPT(layers=2)
    init_gpt(a, seed=5)
    init_gpt(b, seed=5)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    init_gpt(b, seed=6)
    assert not torch.equal(a.blocks[0].attn.q.weight, b.blocks[0].attn.q.weight)
    sd = a.state_dict()
    assert torch.all(sd["blocks.0.attn.q.bias"] == 0) and torch.all(sd["ln_f.weight"] == 1)
    assert sd["blocks.1.mlp.fc2.weight"].std() < 0.6 * sd["blocks.1.mlp.fc1.weight"].std()


def test_mlp_depth_keeps_the_state_dict_names():
    assert list(MLP(16, depth=2).state_dict()) == [f"net.{i}.{k}" for i in (0, 2, 4)
                                                   for k in ("weight", "bias")]
    assert list(MLP(16, depth=1).state_dict()) == [f"net.{i}.{k}" for i in (0, 2)
                                                   for k in ("weight", "bias")]


def test_cpu_runs_use_one_thread_per_rank_whatever_the_cores():
    """CPU kernels split reductions by thread, so the thread count would change a loss's last
    digits (measured: 2.4e-7 after 16 MNIST steps with 1 vs 2 threads), and AdamW grows such
    differences. setup() pins one thread per rank, even when OMP_NUM_THREADS asks for more."""
    code = ("import torch; from dtcourse import launch; d = launch.setup('cpu'); "
            "print(torch.get_num_threads()); launch.teardown()")
    out = subprocess.run([PYTHON, "-c", code], env=base_env({"OMP_NUM_THREADS": "2"}),
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1"], out.stdout


def test_collective_counter_names_every_collective_and_its_bytes():
    """In a group of one (gloo): each dist.* collective is recorded with its kind and the size of
    its whole tensor (nccl-tests' convention); a ring over one rank sends nothing but a broadcast's
    or a send's whole tensor."""
    code = """
import json, torch, torch.distributed as dist
from dtcourse import launch
from dtcourse.comm import CollectiveCounter
d = launch.setup('cpu')
x, out = torch.ones(8), torch.empty(8)
with CollectiveCounter() as c:
    dist.all_reduce(x); dist.reduce(x, dst=0); dist.broadcast(x, src=0)
    dist.all_gather_into_tensor(out, x); dist.reduce_scatter_tensor(out, x)
    dist.all_to_all_single(out, x)
print(json.dumps(c.summary()))
launch.teardown()
"""
    out = subprocess.run([PYTHON, "-c", code], env=base_env(), capture_output=True, text=True,
                         timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout.splitlines()[-1])
    assert {k: (s["calls"], s["tensor_bytes"], s["sent_bytes"]) for k, s in summary.items()} == {
        "all_reduce": (1, 32, 0), "reduce": (1, 32, 0), "broadcast": (1, 32, 32),
        "all_gather": (1, 32, 0), "reduce_scatter": (1, 32, 0), "all_to_all": (1, 32, 0)}


def test_teardown_returns_with_gloo_workers_asleep_when_a_counter_kept_the_group_alive():
    """A dispatch mode that saw a c10d collective keeps the ProcessGroup referenced (torch 2.14),
    so destroy_process_group() cannot join gloo's worker threads; a worker still releasing the
    last collective's tensors when the interpreter shuts down aborts the finished run ("terminate
    called without an active exception", seen at world 2 under load). teardown() therefore waits
    until every worker sleeps. Checked here: the workers do outlive the group (the case the wait
    exists for: if a torch release frees them, this test says the wait can go), and teardown()
    returns with each of them asleep."""
    code = """
import torch, torch.distributed as dist
from dtcourse import launch
from dtcourse.comm import CollectiveCounter
d = launch.setup('cpu')
x = torch.ones(1 << 16)
with CollectiveCounter():
    for _ in range(20):
        dist.all_reduce(x)
launch.teardown()
print(sorted(state for state, _ in launch._gloo_workers().values()))
"""
    out = subprocess.run([PYTHON, "-c", code], env=base_env(), capture_output=True, text=True,
                         timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    states = json.loads(out.stdout.splitlines()[-1].replace("'", '"'))
    assert states and set(states) == {"S"}, out.stdout


def test_lessons_load_imports_a_lesson_script_once_without_running_its_main():
    from dtcourse import lessons
    path = REPO / "04-nccl-operations" / "ring_allreduce.py"
    first = lessons.load(path)
    assert lessons.load(str(path)) is first  # loaded once per process
    assert first.__name__ == "lesson_04_nccl_operations_ring_allreduce"
    assert callable(first.ring_all_reduce) and callable(first.main)


def test_teardown_removes_the_shared_memory_buffer_deepspeed_leaves(monkeypatch):
    """DeepSpeed 0.19's CPU comm op names its per-rank buffer after uid, MASTER_ADDR, MASTER_PORT
    and rank (ops/csrc/cpu/comm/shm.cpp) and never unlinks it; teardown removes this rank's."""
    from pathlib import Path

    from dtcourse import launch
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm on this system")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")  # no real job uses port 1
    monkeypatch.setenv("RANK", "3")
    mine = Path(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_1_3")
    other = Path(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_1_2")
    for path in (mine, other):
        path.write_bytes(b"x")
    try:
        launch.teardown()  # no group here: the rank comes from RANK
        assert not mine.exists() and other.exists()  # only this rank's
    finally:
        other.unlink(missing_ok=True)
        mine.unlink(missing_ok=True)


def test_backend_for_adds_gloo_for_cpu_tensors_when_a_cuda_run_offloads():
    """CPU offload on GPUs keeps FSDP2's gradient shards on the CPU, and clip_grad_norm_
    all-reduces their squares there: an NCCL-only group fails ("No backend type associated with
    device type cpu"). backend_for gives such a run a group with both backends, one per device
    type, and leaves every other run as it was: gloo on CPU (offload or not), NCCL on CUDA."""
    from torch.distributed.distributed_c10d import BackendConfig

    from dtcourse.launch import backend_for
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert backend_for(cpu) == backend_for(cpu, cpu_collectives=True) == "gloo"
    assert backend_for(cuda) == "nccl"
    mixed = backend_for(cuda, cpu_collectives=True)
    assert BackendConfig(mixed).get_device_backend_map() == {"cpu": "gloo", "cuda": "nccl"}


@pytest.mark.parametrize("launched", [Launch("python", 0, 1, 0, 1, None, None),
                                      Launch("torchrun", 1, 2, 1, 2, "127.0.0.1", 29611)],
                         ids=["python", "torchrun"])
def test_setup_binds_the_group_to_the_rank_gpu_on_cuda_and_to_nothing_on_cpu(monkeypatch,
                                                                             launched):
    """init_process_group(device_id=...) binds a group to this rank's GPU: NCCL starts at once,
    sub-groups split its communicator, and barrier() runs on that GPU instead of guessing one.
    setup() passes the chosen GPU on CUDA, with NCCL alone or with "cpu:gloo,cuda:nccl"
    (CPU offload), and None on CPU, on the in-memory store (python) and env:// (torchrun) alike.
    The group itself is not started here (no GPU): init_process_group records what it is given."""
    import inspect

    import torch.distributed as dist

    from dtcourse import launch
    assert "device_id" in inspect.signature(dist.init_process_group).parameters
    calls = []
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.append(
        (backend, kw.get("device_id", "not passed"))))
    monkeypatch.setattr(launch, "launched", lambda: launched)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # setup pins 1 on CPU
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    for name, value in TORCHRUN.items():  # setup writes the launcher's variables back
        monkeypatch.setenv(name, value)
    gpu = torch.device("cuda", 1)
    for device, offload in ((torch.device("cpu"), False), (gpu, False), (gpu, True)):
        monkeypatch.setattr(launch, "choose_device", lambda arg, _, device=device: device)
        d = launch.setup(device.type, 10, cpu_collectives=offload)
        assert d.device == device
    assert calls == [("gloo", None), ("nccl", gpu), ("cpu:gloo,cuda:nccl", gpu)]
    assert launch.bound_device(torch.device("cpu")) is None and launch.bound_device(gpu) == gpu


@pytest.mark.parametrize("visible,index", [(1, 0), (2, 1)], ids=["gpus-per-task-1", "2-gpus"])
def test_setup_exports_the_chosen_gpu_as_local_rank(monkeypatch, visible, index):
    """DeepSpeed takes LOCAL_RANK as a device index (the engine's set_device, zero.Init's
    cuda:<LOCAL_RANK>). An srun task bound to one GPU (--gpus-per-task=1) sees only cuda:0, so
    task 1 of the node must hand DeepSpeed LOCAL_RANK=0, not its SLURM_LOCALID (cuda:1 does not
    exist there: "invalid device ordinal"); with both GPUs visible it uses cuda:1 and says 1.
    No GPU here: CUDA's device count is mocked and the group is not started."""
    import torch.distributed as dist

    from dtcourse import launch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    chosen = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: None)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.setenv(name, "")  # recorded, so that what setup writes is undone after
        monkeypatch.delenv(name)
    for name, value in SRUN_ONE_NODE.items():  # task 1 of 2 on one node: SLURM_LOCALID=1
        monkeypatch.setenv(name, value)
    d = launch.setup("auto")
    gpu = torch.device("cuda", index)
    assert d.device == gpu and chosen == [gpu] and d.local_rank == 1  # the launcher's local rank
    assert {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                       "MASTER_ADDR", "MASTER_PORT")} == \
        {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": str(index), "LOCAL_WORLD_SIZE": "2",
         "MASTER_ADDR": "vm", "MASTER_PORT": "20010"}


@pytest.mark.parametrize("setup", ["dtcourse.launch", "01-ddp-basics/ddp_mnist.py"])
def test_auto_takes_the_gpus_only_when_every_local_process_gets_one(setup, monkeypatch, capsys):
    """A lesson's `torchrun --nproc_per_node=2` on a one-GPU machine: --device auto runs on the
    CPU and says why on local rank 0; --device cuda still fails; with a GPU per process, or an
    srun task bound to its one GPU, auto takes cuda:<its index>; inside a SLURM job auto fails
    (a GPU job that trains on its CPUs is a mistake). The same for the shared module and for
    lesson 01's written-out set-up. CUDA's device count is mocked."""
    if setup == "dtcourse.launch":
        from dtcourse import launch
    else:
        from dtcourse.lessons import load
        launch = load(REPO / setup)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)  # a learner's machine, not a SLURM job

    def at(rank, launcher="torchrun", local=2):
        return launch.Launch(launcher, rank, 2, rank, local, "127.0.0.1", 29500)
    assert launch.choose_device("auto", at(0)) == torch.device("cpu")
    assert "2 processes on this node but 1 GPU(s)" in capsys.readouterr().err
    assert launch.choose_device("auto", at(1)) == torch.device("cpu")
    assert capsys.readouterr().err == ""  # said once, by local rank 0
    with pytest.raises(SystemExit):
        launch.choose_device("cuda", at(1))
    assert launch.choose_device("auto", at(0, local=1)) == torch.device("cuda", 0)
    assert launch.choose_device("auto", at(1, "srun")) == torch.device("cuda", 0)
    monkeypatch.setenv("SLURM_JOB_ID", "77")  # in a SLURM job: a GPU job never trains on CPUs
    with pytest.raises(SystemExit):
        launch.choose_device("auto", at(0))
    assert "2 processes on this node but 1 GPU(s) in SLURM job 77" in capsys.readouterr().err
    assert launch.choose_device("auto", at(1, "srun")) == torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert launch.choose_device("auto", at(1)) == torch.device("cuda", 1)


def test_reset_peak_frees_the_previous_fsdp2_model_before_the_next_measurement():
    """A script that trains several strategies one after the other resets CUDA's peak counter
    before each; if the previous model, its gradients and its AdamW state are still alive then,
    the next peak includes them. FSDP2 modules sit in reference cycles, so dropping the last
    name does not free them (checked here, with the automatic collector off so that it cannot
    run by chance); reset_peak collects them. On CPU it returns None (no allocator statistics)."""
    code = """
import gc, weakref, torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from dtcourse import launch, report
d = launch.setup('cpu')
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
mesh = init_device_mesh('cpu', (1,))
for layer in model:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
optimizer = torch.optim.AdamW(model.parameters())
model(torch.ones(4, 8)).sum().backward()
optimizer.step()
gc.collect()
gc.disable()
ref = weakref.ref(model)
del model, optimizer, layer
alive = ref() is not None
peak = report.reset_peak(d.device)
print(alive, ref() is None, peak)
gc.enable()
launch.teardown()
"""
    out = subprocess.run([PYTHON, "-c", code], env=base_env(), capture_output=True, text=True,
                         timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-3:] == ["True", "True", "None"], out.stdout

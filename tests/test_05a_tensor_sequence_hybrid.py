"""Lesson 05a: tensor and sequence parallelism (by hand and with DTensor) and hybrid DP x TP x PP.

What is proved, each against one process computing the dense model:
- the hand-written column/row-parallel layers and a whole block, and their DTensor versions, give
  the dense forward output and every gradient (each rank's shard = the slice of the dense
  gradient) at TP degrees 2 and 4 (one torchrun launch at world 4, tests/workers_05a/tp_layers.py);
- training with tensor_parallel.py at world 2 (manual / dtensor, with / without sequence
  parallelism) exports the weights of the world-1 run (the four variants run one after the other
  in one torchrun launch, through the script's parse_args and train: tests/workers_05a/
  tp_training.py);
- the bytes its collectives send equal 8*b*s*h*(t-1)/t per layer (plus the sequence-parallel
  extras), counted independently here;
- hybrid_parallelism.py with dp=2 x tp=2 and with tp=2 x pp=2 at world 4 exports the weights of the
  world-1 run with the same global batch (16 sequences), and each rank's traffic per mesh dimension
  equals its formula (tp=2 x pp=2 on the README's multi-node command, as two simulated nodes). Both scripts train the course's GPT
  (dtcourse.models) on the same data with the same optimizer, so one world-1 run is the reference
  for every layout: TP = DP x TP = TP x PP = one process, which also proves the two scripts agree;
- the README's quoted outputs are those of a fresh run of the command above each (all but the
  speed), and its 64-GPU command works as two simulated nodes of two ranks.
Inconsistent degrees and heads that do not split over the TP ranks exit 2 with one line per rank,
before any collective: tests/test_bad_inputs.py.
"""

import re

import pytest
from conftest import (
    REPO,
    assert_state_dicts_close,
    load_export,
    load_script,
    read_json,
    readme_mentions,
    run_python,
    run_readme_command,
    run_torchrun,
    run_torchrun_nodes,
)

from dtcourse.models import GPT

TP = "05-advanced/a-tensor-sequence-hybrid/tensor_parallel.py"
HYBRID = "05-advanced/a-tensor-sequence-hybrid/hybrid_parallelism.py"
WORKER = "tests/workers_05a/tp_layers.py"
TRAINING_WORKER = "tests/workers_05a/tp_training.py"
README = REPO / "05-advanced" / "a-tensor-sequence-hybrid" / "README.md"

# The README's runs, run verbatim by the tests below (and so not again by test_readmes.py).
README_RUNS = [
    "torchrun --nproc_per_node=2 05-advanced/a-tensor-sequence-hybrid/tensor_parallel.py",
    "torchrun --nproc_per_node=2 05-advanced/a-tensor-sequence-hybrid/tensor_parallel.py "
    "--impl dtensor --sequence-parallel",
    "torchrun --nproc_per_node=4 05-advanced/a-tensor-sequence-hybrid/hybrid_parallelism.py "
    "--tp 2 --pp 2",
]
DEGREE_ERROR = ("python 05-advanced/a-tensor-sequence-hybrid/hybrid_parallelism.py --dp 3 --tp 2"
                "  # exits 2")
# The README's cluster-sized command (```sh: it needs 8 nodes of 8 GPUs).
SCALE_DOC = ("torchrun --nnodes=8 --nproc_per_node=8 --rdzv_backend=c10d "
             "--rdzv_endpoint=$HEAD_NODE:29500 05-advanced/a-tensor-sequence-hybrid/"
             "hybrid_parallelism.py --tp 8 --pp 2 --device cuda --dim 4096 --heads 32 "
             "--layers 32 --seq-len 2048 --batch-size 8 --microbatches 8")

# Few steps keep the launches cheap; start-up (importing torch in every rank) dominates anyway.
# Step 2 is the one hybrid_parallelism.py counts, so 3 steps also exercise the counted path.
STEPS = ["--steps", "3"]
B, S, H, L = 16, 16, 64, 2  # global batch; the scripts' default sequence length, width, depth

# Exported weights after 3 AdamW steps (lr 3e-3), float32 on CPU. TP sums the partial matmuls of
# its ranks in another order than one dense matmul, so gradients differ by float rounding (~1e-7
# relative). Adam's step is lr * m / (sqrt(v) + eps): for the few elements whose gradient is
# nearly as small as eps (1e-8), that rounding changes the step by a visible fraction of lr.
# Measured at these settings: worst difference 5.1e-6 (all four tensor_parallel.py variants and
# hybrid dp2 x tp2, on one element of blocks.1.attn.k.weight; 4.9e-6 for tp2 x pp2). A real error
# moves weights by O(lr): measured 1.8e-2 with f's backward all-reduce removed, 1.5e-2 with the
# sequence-parallel bias gradients left unreduced. atol 1e-4 sits 20x above the first and 150x
# below the second.
WEIGHTS_RTOL, WEIGHTS_ATOL = 1e-4, 1e-4


def plain_model(script: str):
    """The model both scripts train (dtcourse.models.GPT) at their shape, built without any
    parallel wrapper: the export must load into it with strict=True."""
    return GPT(vocab=64, seq_len=S, dim=H, heads=4, layers=L)


def formula_bytes(t: int, sequence_parallel: bool, impl: str) -> dict:
    """The traffic one step should send per rank, derived here (fp32: 4 bytes per element).
    Per layer: 4 all-reduces of (b, s, h) (2 forward after attention and MLP, 2 backward), each
    sending 2(t-1)/t of the buffer per rank under a ring algorithm: 8*b*s*h*(t-1)/t elements."""
    r = (t - 1) / t
    out = {"per_layer": 8 * B * S * H * r * 4, "extra": 0.0}
    if sequence_parallel:
        boundary = 2 * B * S * H * r * 4  # all-gather at the embedding (bwd) and the head (fwd)
        norms = 2 * H * (2 * L + 1)       # LayerNorm weight + bias, two per block and a final one
        biases = L * 2 * H if impl == "manual" else 0  # row-parallel biases added after the RS
        out["extra"] = boundary + 2 * r * (norms + biases) * 4
    out["total"] = L * out["per_layer"] + out["extra"]
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, global batch 16: the weights every parallel layout must reproduce."""
    out = tmp_path_factory.mktemp("ref")
    run_python(TP, *STEPS, "--batch-size", str(B), "--export", out / "w1.pt", timeout=120)
    return load_export(out / "w1.pt")


VARIANTS = [("manual", False), ("manual", True), ("dtensor", False), ("dtensor", True)]
IDS = ["manual", "manual-sp", "dtensor", "dtensor-sp"]


@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory):
    """The four world-2 trainings, in one launch: {variant: (rank 0's printed lines of that
    variant, exported weights, metrics)}."""
    out = tmp_path_factory.mktemp("tp")
    res = run_torchrun(TRAINING_WORKER, "--out", out, "--", *STEPS, "--batch-size", str(B),
                       nproc=2, timeout=300)
    sections = re.split(r"^=== variant (\S+)\n", res.stdout, flags=re.M)
    printed = dict(zip(sections[1::2], sections[2::2]))
    assert list(printed) == IDS, res.describe()
    return {name: (printed[name], load_export(out / name / "w.pt"), read_json(out / name / "m.json"))
            for name in IDS}


@pytest.fixture
def tp_run(tp_runs):
    """tp_run(impl, sp) -> (printed lines, weights, metrics) of that variant."""
    return lambda impl, sp: tp_runs[IDS[VARIANTS.index((impl, sp))]]


def test_layers_and_block_equal_dense_at_tp2_and_tp4():
    # Forward and backward of single layers and one block, float32: only the order of the sums
    # differs, measured up to 2.4e-7 relative; rtol 1e-5 leaves 40x margin, atol 1e-6 covers
    # elements that are near zero. The worker asserts and prints one line per check.
    res = run_torchrun(WORKER, "--rtol", "1e-5", "--atol", "1e-6", nproc=4, timeout=240)
    done = re.findall(r"^ok: (.+)$", res.stdout, flags=re.M)
    expected = [f"tp{t} {what}" for t in (4, 2) for what in (
        "column-parallel manual", "column-parallel dtensor", "row-parallel manual",
        "row-parallel dtensor", "block manual", "block manual + sequence parallel",
        "block dtensor", "block dtensor + sequence parallel")]
    assert done == expected, res.describe()


@pytest.mark.parametrize("impl,sp", VARIANTS, ids=IDS)
def test_tensor_parallel_training_matches_one_process(tp_run, reference, impl, sp):
    _, weights, metrics = tp_run(impl, sp)
    assert metrics["world_size"] == 2 and metrics["tp"] == 2 and len(metrics["losses"]) == 3
    assert_state_dicts_close(weights, reference, rtol=WEIGHTS_RTOL, atol=WEIGHTS_ATOL,
                             msg=f"{impl} sp={sp} vs one process:")
    plain_model(TP).load_state_dict(weights, strict=True)


@pytest.mark.parametrize("impl,sp", VARIANTS, ids=IDS)
def test_tp_bytes_equal_formula(tp_run, impl, sp):
    printed, _, metrics = tp_run(impl, sp)
    want = formula_bytes(2, sp, impl)
    traffic = metrics["traffic"]
    # Byte counts are sums of integers: exact equality.
    assert traffic["per_layer_measured"] == want["per_layer"] == 262144
    assert traffic["total_measured"] == want["total"]
    # Every collective went over the 2 TP ranks in fp32, and there are exactly 4 of (b, s, h)
    # per layer plus, with SP, one all-gather at each end of the stack.
    recs = metrics["collectives"]
    assert all(r["group_size"] == 2 and r["dtype"] == "float32" for r in recs)
    whole = [r for r in recs if r["tensor_bytes"] == B * S * H * 4]
    assert len(whole) == (4 * L * 2 + 2 if sp else 4 * L), recs
    # ... and the printed line says so.
    assert re.search(rf"^per layer: {int(want['per_layer'])} B = formula 8\*b\*s\*h\*\(t-1\)/t "
                     rf"\* 4 B = 8\*{B}\*{S}\*{H}\*1/2\*4 = {int(want['per_layer'])} B$",
                     printed, flags=re.M), printed
    if sp:
        assert f"total {int(want['total'])} B = formula {int(want['total'])} B" in printed


def test_hybrid_matches_one_process(tmp_path, reference):
    """dp=2 x tp=2 at world 4 (tp=2 x pp=2: the multi-node test below)."""
    run_torchrun(HYBRID, *STEPS, "--dp", "2", "--tp", "2", "--batch-size", "8", "--export",
                 tmp_path / "w.pt", "--metrics-out", tmp_path / "m.json", nproc=4, timeout=240)
    assert_hybrid_run(load_export(tmp_path / "w.pt"), read_json(tmp_path / "m.json"), reference,
                      "dp2 x tp2:")


def assert_hybrid_run(weights: dict, metrics: dict, reference: dict, msg: str) -> None:
    """The export equals one process's and loads into the plain model; every rank's traffic per
    mesh dimension equals its formula."""
    assert metrics["global_batch"] == B and metrics["world_size"] == 4
    assert_state_dicts_close(weights, reference, rtol=WEIGHTS_RTOL, atol=WEIGHTS_ATOL, msg=msg)
    plain_model(HYBRID).load_state_dict(weights, strict=True)
    # Each rank's traffic per mesh dim equals its formula: TP's and PP's derived here from the
    # degrees; FSDP's from the parameters the rank holds (the script knows their shapes).
    dp, tp, pp = metrics["dp"], metrics["tp"], metrics["pp"]
    b = B // dp  # each data-parallel rank's rows
    for rank, r in enumerate(metrics["per_rank"]):
        stage = rank // (dp * tp)  # mesh (pp, dp, tp), tp innermost
        sent = {dim: sum(v for k, v in r["comm_bytes"].items() if k.startswith(dim + "/"))
                for dim in ("tp", "dp", "pp")}
        assert {k.split("/")[0] for k in r["comm_bytes"]} <= {"tp", "dp", "pp"}, r
        assert sent["tp"] == L // pp * 8 * b * S * H * (tp - 1) / tp * 4 > 0, (rank, r)
        boundaries = 0 if pp == 1 else (stage > 0) + (stage < pp - 1)
        assert sent["pp"] == boundaries * b * S * H * 4, (rank, r)
        assert sent["dp"] == r["comm_formula"]["dp"] and (sent["dp"] > 0) == (dp > 1), (rank, r)


@pytest.mark.parametrize("pp", [1, 2])
def test_printed_fsdp_all_gathers_equal_the_formula(pp):
    """The dp group's line of the mesh printout says how many times FSDP all-gathers the weights
    per step; the dp traffic formula counts them as its passes minus the one reduce-scatter
    (forward and again for backward at pp 1; kept between micro-batches with a pipeline)."""
    import argparse

    import torch
    script = load_script(HYBRID)
    args = argparse.Namespace(dp=2, tp=2, pp=pp, layers=2 * pp, batch_size=8, seq_len=S, dim=H)
    mesh = argparse.Namespace(mesh=torch.arange(2 * 2 * pp).reshape(pp, 2, 2), size=lambda: 4)
    device = argparse.Namespace(local_world_size=4)
    [dp_line] = [line for line in script.layout_advice(mesh, args, device) if "dp groups" in line]
    said = re.search(r"all-gathers weights (once|twice) per step", dp_line)
    assert said, dp_line
    P = 10 * 4  # the bytes of 10 fp32 parameters, a count that the dp degree divides
    passes = script.traffic_formula(args, [(10,)], first=True, last=True)["dp"] / (P / 2)
    assert {"once": 1, "twice": 2}[said.group(1)] == passes - 1 == (2 if pp == 1 else 1), dp_line


# README: the quoted outputs are those of a fresh run, and the multi-node command works


def quoted_output(command: str) -> list[str]:
    """The lines of the ```text block that follows `command`'s ```bash block in the README."""
    m = re.search(r"^```bash\n" + re.escape(command) + r"\n```\n+```text\n(.*?)^```",
                  README.read_text(), flags=re.S | re.M)
    assert m, f"no quoted output after {command!r} in {README}"
    return m.group(1).splitlines()


LOSS = re.compile(r"^(step .* \| loss )(\d+\.\d+)$")


def assert_same_output(fresh: list[str], quoted: list[str], command: str) -> None:
    """Line by line equal, except the speed on the 'done:' line (the machine's), and losses, which
    may differ by one in their last printed digit (another CPU's kernels sum in another order;
    the weights-equality tests above bound the real difference)."""
    assert len(fresh) == len(quoted), f"{command}\nfresh:\n" + "\n".join(fresh)
    for f, q in zip(fresh, quoted):
        if q.startswith("done:"):
            assert f.split(",")[0] == q.split(",")[0], (command, f, q)
        elif LOSS.match(q):
            mf, mq = LOSS.match(f), LOSS.match(q)
            assert mf and mf.group(1) == mq.group(1), (command, f, q)
            assert abs(float(mf.group(2)) - float(mq.group(2))) <= 1.5e-4, (command, f, q)
        else:
            assert f == q, (command, f, q)


@pytest.mark.parametrize("command", README_RUNS, ids=["manual", "dtensor-sp", "tp2-pp2"])
def test_readme_outputs_are_those_of_a_fresh_run(command):
    assert readme_mentions(README, command), f"not in {README}: {command}"
    result = run_readme_command(command, timeout=240)
    assert_same_output(result.stdout.splitlines(), quoted_output(command), command)


def test_readme_degree_error_is_that_of_a_fresh_run():
    assert readme_mentions(README, DEGREE_ERROR), f"not in {README}: {DEGREE_ERROR}"
    result = run_readme_command(DEGREE_ERROR, timeout=60)  # asserts exit status 2
    assert result.stderr_lines() == quoted_output(DEGREE_ERROR), result.describe()


def test_documented_multi_node_command_on_two_simulated_nodes(tmp_path, reference):
    """The README's 64-GPU command (8 nodes of 8 GPUs, c10d rendezvous, --dp inferred) as 2
    simulated nodes of 2 CPU ranks: --tp 2 --pp 2 instead of 8 and 2, the default model and the
    test's 3 steps and global batch; its 8 micro-batches kept. TP groups stay inside a node, and
    the export equals one process, and each rank's traffic per mesh dimension its formula."""
    assert readme_mentions(README, SCALE_DOC), f"not in {README}: {SCALE_DOC}"
    results = run_torchrun_nodes(HYBRID, "--tp", "2", "--pp", "2", "--device", "cpu", *STEPS,
                                 "--batch-size", str(B), "--microbatches", "8",
                                 "--export", tmp_path / "w.pt", "--metrics-out",
                                 tmp_path / "m.json", nnodes=2, nproc_per_node=2,
                                 rdzv="c10d", timeout=240)
    stdout = "".join(r.stdout for r in results)
    assert "mesh pp 2 x dp 1 x tp 2 = 4 ranks" in stdout, stdout
    assert "tp groups [[0, 1], [2, 3]]: consecutive ranks, inside one node" in stdout, stdout
    metrics = read_json(tmp_path / "m.json")
    assert (metrics["dp"], metrics["tp"], metrics["pp"]) == (1, 2, 2), metrics
    assert_hybrid_run(load_export(tmp_path / "w.pt"), metrics, reference, "2 nodes, tp2 x pp2:")


# Degrees that do not multiply to the world size, heads not divisible by --tp:
# tests/test_bad_inputs.py (every rank exits 2 with one line).

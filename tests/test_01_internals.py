"""Lesson 01, DDP internals: each claim of the demos of 01-ddp-basics/internals/ checked against a
fresh 2-rank run.

One torchrun launch of the driver ddp_internals.py, which runs all seven demos (the module
fixture), writes --json-out and --export. The tests read them and rebuild here, in this process and
without the demos' own checks, what each model must equal: one process on the global batch
(find_unused_parameters, static_graph, SyncBatchNorm, the fp32 run of the hooks demo); the model
DDP computes under Join with uneven inputs, written out step by step; the bucket layout, predicted
from the parameter sizes; the rounding bound of the bf16 and fp16 hooks, from the local gradients
computed here. Each demo file also runs on its own, as the page ddp_internals.md shows it, and
prints what the driver printed for it.

Tolerances. The demos train with plain SGD, lr 0.1, 4 steps: w_4 = w_0 - lr (g_1 + ... + g_4).
DDP averages two half-batch gradients where one process takes the mean over the whole batch: the
same numbers summed in another order, so each gradient element differs by a few float32 ulps
(|g| < 0.25 and |w| <= 1 in these models: a few 1e-8), and the weights by lr x 4 x that, fed back
through later gradients at the same scale: ~1e-8 (measured: 1.5e-8). This process may use other
kernels than the ranks (threads, ATEN_CPU_CAPABILITY), which round differently again. So
atol 1e-6 and rtol 1e-5 (1e-5 of a weight of 1: ten float32 ulps). The bugs these demos could hide
move weights by lr x |g| per step, 1e-3 to 1e-2: a missing average (gradients doubled), a rank on
another rank's rows, Join's divisor (0.019 measured), plain BatchNorm where the statistics should
be global (0.07).
"""

import itertools
from types import SimpleNamespace

import pytest
import quoted_output
import torch
import torch.nn.functional as F
from conftest import (
    REPO,
    assert_bad_input,
    assert_state_dicts_close,
    assert_state_dicts_equal,
    load_export,
    load_script,
    read_json,
    run_python,
    run_ranks,
    run_documented,
    run_torchrun,
)

from dtcourse.data import classification_batch, rank_rows
from dtcourse.models import MLP

SCRIPT = "01-ddp-basics/ddp_internals.py"
PAGE = REPO / "01-ddp-basics" / "ddp_internals.md"  # the deep-dive page that runs each demo file
M = load_script(SCRIPT)  # the driver, and through it the demos' model classes, to build them here
TwoHeads, LayerStack, BNNet = M.common.TwoHeads, M.common.LayerStack, M.sync_batchnorm.BNNet
WORLD, BATCH, SEED, LR, STEPS = 2, 8, 0, 0.1, 4  # the script's defaults
SGD_TOL = {"rtol": 1e-5, "atol": 1e-6}  # see the module docstring
MiB = 1024 * 1024


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The references below are tiny: one thread computes them fastest on a shared machine (and
    as the ranks do). Restored afterwards, for the other test files of this worker."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Every demo at world 2, with the default 20 timed steps (the timings are not checked here;
    the default keeps every other line of the output the same as each demo file's own run)."""
    out = tmp_path_factory.mktemp("internals")
    result = run_torchrun(SCRIPT, "--json-out", out / "internals.json", "--export", out / "w.pt",
                          "--timeout-s", "60", timeout=180)
    report = read_json(out / "internals.json")
    assert report["world_size"] == WORLD and report["steps"] == STEPS
    assert report["batch_size"] == BATCH and report["lr"] == LR and report["seed"] == SEED
    return SimpleNamespace(result=result, report=report, demos=report["demos"],
                           export=lambda tag: load_export(report["exports"][tag]))


# --------------------------------------------------------------------------------------------------
# The references, built here


def global_batch(step: int):
    return classification_batch(SEED, step, WORLD * BATCH)


def rows_of(step: int, rank: int):
    x, y = global_batch(step)
    return x[rank_rows(rank, BATCH)], y[rank_rows(rank, BATCH)]


def fresh(make):
    torch.manual_seed(SEED)  # as the script builds every model: same seed, same initial weights
    return make()


def sgd(make, loss_at, steps: int = STEPS):
    """Plain SGD from the seeded initial weights, descending loss_at(model, step) each step."""
    model = fresh(make)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(steps):
        loss_at(model, step).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model


def one_process(make):
    """One process, the whole global batch of every step."""
    return sgd(make, lambda model, step: F.cross_entropy(model(global_batch(step)[0]),
                                                         global_batch(step)[1]))


def max_diff(a: dict, b: dict) -> float:
    return max((a[k].double() - b[k].double()).abs().max().item() for k in b
               if b[k].is_floating_point())


# --------------------------------------------------------------------------------------------------
# find_unused_parameters and static_graph


def test_find_unused_parameters_default_ddp_raises_the_documented_error(run):
    j = run.demos["find_unused_parameters"]
    # DDP cannot finish step 1's reduction (head_b's gradients never arrive) and says so when the
    # next forward starts
    assert j["failed_at_step"] == 2
    assert j["error_first_sentence"] == ("Expected to have finished reduction in the prior "
                                         "iteration before starting a new one.")
    assert "parameters that were not used in producing loss" in j["error"]
    assert "find_unused_parameters=True" in j["error"]
    assert j["unused_names"] == ["head_b.weight", "head_b.bias"] and j["unused_indices"] == [4, 5]
    # the internals page quotes and explains that very error
    text = PAGE.read_text()
    assert j["error_first_sentence"] in text and "head_b.weight, head_b.bias" in text


def test_find_unused_parameters_trains_equal_to_one_process(run):
    trained = run.export("find_unused_parameters")
    assert_state_dicts_close(trained, one_process(TwoHeads).state_dict(), **SGD_TOL,
                             msg="find_unused_parameters=True vs one process:")
    # the unused head never moves (no gradient, SGD skips it), bitwise
    init = fresh(TwoHeads).state_dict()
    assert_state_dicts_equal({k: v for k, v in trained.items() if k.startswith("head_b.")},
                             {k: v for k, v in init.items() if k.startswith("head_b.")})
    # its price: an all-reduce of one int32 "used" flag per parameter tensor, every step
    j = run.demos["find_unused_parameters"]
    assert j["param_tensors"] == len(list(MLP(hidden=64, depth=6).parameters())) == 14
    assert j["allreduces_per_step"] == {"default": 1, "find_unused_parameters": 2}
    assert j["flag_bytes"] == 4 * j["param_tensors"]


def test_static_graph_trains_equal_to_one_process_without_the_per_step_flags(run):
    assert_state_dicts_close(run.export("static_graph"), one_process(TwoHeads).state_dict(),
                             **SGD_TOL, msg="static_graph=True vs one process:")
    per_step = run.demos["static_graph"]["allreduces_per_step"]
    # step 1 learns which parameters are used (gradients + flags); then only the gradients
    assert per_step["static_graph"] == [2, 1, 1, 1]
    assert per_step["find_unused_parameters"] == [2, 2, 2, 2]


# --------------------------------------------------------------------------------------------------
# gradient_as_bucket_view and bucket_cap_mb


def test_gradient_as_bucket_view_lowers_gradient_memory_by_4_bytes_per_parameter(run):
    j = run.demos["gradient_as_bucket_view"]
    params = sum(p.numel() for p in LayerStack().parameters())
    assert j["params"] == params == 753_408
    # without the view: the buckets and, beside them, every .grad (fp32: 4 B per parameter each)
    assert j["without_view"]["bucket_bytes"] == 4 * params
    assert j["without_view"]["separate_grad_bytes"] == 4 * params
    assert not j["without_view"]["grads_are_views"]
    # with it: the .grads are the buckets' storage
    assert j["with_view"] == {"bucket_bytes": 4 * params, "separate_grad_bytes": 0,
                              "total_bytes": 4 * params, "grads_are_views": True}
    assert j["saved_bytes"] == 4 * params and j["saved_bytes_per_param"] == 4
    assert j["max_diff_between_runs"] == 0  # the same arithmetic: bitwise the same weights


def predicted_buckets(cap_mb):
    """DDP's buckets for LayerStack from step 2 on, predicted here: the gradients in the order
    backward produces them (the reverse of the parameters), cut as soon as a bucket reaches its
    cap; the first cap is 1 MiB when bucket_cap_mb is left at None (25 MiB), else the cap."""
    sizes = [p.numel() * 4 for p in reversed(list(LayerStack().parameters()))]
    caps = itertools.chain([MiB if cap_mb is None else cap_mb * MiB],
                           itertools.repeat((25 if cap_mb is None else cap_mb) * MiB))
    buckets, cap, filled = [], next(caps), 0
    for size in sizes:
        filled += size
        if filled >= cap:
            buckets.append(filled)
            cap, filled = next(caps), 0
    return buckets + [filled] * (filled > 0)


def test_bucket_counts_equal_the_layout_predicted_from_the_parameter_sizes(run):
    rows = run.demos["bucket_cap_mb"]["rows"]
    assert [r["bucket_cap_mb"] for r in rows] == [None, 1, 2, 25]
    for row in rows:
        assert row["counted"] == predicted_buckets(row["bucket_cap_mb"]) == row["expected"], row
    counts = {r["bucket_cap_mb"]: len(r["counted"]) for r in rows}
    assert counts == {None: 2, 1: 3, 2: 2, 25: 1}
    # the 1 MiB first bucket exists only when bucket_cap_mb is left at its default
    assert rows[0]["counted"] == [1_195_008, 1_818_624] and rows[3]["counted"] == [3_013_632]


# --------------------------------------------------------------------------------------------------
# SyncBatchNorm


def test_sync_batchnorm_equals_one_process_and_plain_batchnorm_does_not(run):
    """The hand-written sync BN computes var = E[x^2] - mean^2 in float32: for these activations
    (|mean| about their std) that loses a few ulps of the variance, ~1e-7 of the normalised
    outputs, far inside SGD_TOL; batch statistics of 8 rows instead of 16 move the outputs by
    0.47 and the weights after 4 steps by 0.07."""
    j = run.demos["sync_batchnorm"]
    if j["implementation"] == "hand-written sync BN":  # a CPU: torch's SyncBatchNorm refuses it
        assert j["sync_batchnorm_error"].startswith(
            "ValueError: SyncBatchNorm expected input tensor to be on GPU")
    reference = one_process(BNNet).state_dict()  # BatchNorm over all 16 rows of each step
    assert_state_dicts_close(run.export("sync_batchnorm"), reference, **SGD_TOL,
                             msg="sync BatchNorm vs one process:")
    assert j["step1_output_diff"]["sync"] < 1e-5
    assert max_diff(run.export("plain_batchnorm"), reference) > 1e-2
    assert j["step1_output_diff"]["plain"] > 0.1


# --------------------------------------------------------------------------------------------------
# Uneven inputs with Join


def join_expected(divide_by_world: bool):
    """Rank 0 holds 3 batches, rank 1 holds 5. Steps 1-3: both ranks' rows, (g0 + g1) / 2. Steps
    4-5: rank 0 has joined and all-reduces zeros; DDP still divides by the world size 2 (Join's
    default), so the step descends g1 / 2 (divide_by_world=False: g1, the other choice)."""
    def loss_at(model, step):
        losses = [F.cross_entropy(model(x), y) for x, y in
                  (rows_of(step, r) for r in range(WORLD) if step < 3 + 2 * r)]
        return sum(losses) / (WORLD if divide_by_world else len(losses))
    return sgd(lambda: MLP(hidden=32, depth=1), loss_at, steps=5).state_dict()


def test_join_with_uneven_inputs_finishes_and_equals_the_expected_model(run):
    j = run.demos["join"]
    # the launch above finished (a rank left waiting would have failed it at --timeout-s 60)
    assert j["batches_per_rank"] == [3, 5] and j["steps"] == 5 and j["seconds"] < 30
    trained = run.export("join")  # rank 0 writes it: the model Join broadcast from rank 1
    assert_state_dicts_close(trained, join_expected(True), **SGD_TOL, msg="Join vs expected:")
    assert max_diff(trained, join_expected(False)) > 1e-3  # the divisor is visible
    # Join's price: two 4-byte all-reduces per step besides the gradients'
    params = sum(p.numel() for p in MLP(hidden=32, depth=1).parameters())
    assert j["allreduce_bytes_per_step"] == [4, 4, 4 * params]


# --------------------------------------------------------------------------------------------------
# bf16 and fp16 compression hooks


def first_order_bound(u: float) -> dict:
    """lr x u x sum over steps of (|g_0| + |g_1|), per element, along the fp32 trajectory: the
    hook rounds each rank's gradient and the sum of the two, each to u relative, so the averaged
    gradient errs by at most u (|g_0| + |g_1|) to first order, and SGD adds lr x that per step."""
    model = fresh(lambda: MLP(hidden=64, depth=2))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    bound = {name: torch.zeros_like(p) for name, p in model.named_parameters()}
    for step in range(STEPS):
        for rank in range(WORLD):
            model.zero_grad(set_to_none=True)
            x, y = rows_of(step, rank)
            F.cross_entropy(model(x), y).backward()
            for name, p in model.named_parameters():
                bound[name] += LR * u * p.grad.abs()
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(global_batch(step)[0]), global_batch(step)[1]).backward()
        opt.step()
    return bound


@pytest.mark.parametrize("hook,dtype,u", [("bf16", "bfloat16", 2 ** -8),
                                          ("fp16", "float16", 2 ** -11)])
def test_compression_hook_halves_the_bytes_and_stays_within_the_rounding_bound(run, hook, dtype, u):
    j = run.demos["comm_hooks"]
    params = sum(p.numel() for p in MLP(hidden=64, depth=2).parameters())
    # the bytes handed to the all-reduce each step: the whole gradient once, in its dtype
    assert j["none"]["bytes"] == 4 * params and j["none"]["dtypes"] == ["float32"]
    assert j[hook]["bytes"] == 2 * params and j[hook]["dtypes"] == [dtype]
    assert j[hook]["unit_roundoff"] == u  # bf16 keeps 8 significant bits, fp16 11
    # step 1, same weights and data in both runs: every gradient element within the rounding
    # bound (derived in internals/comm_hooks.py's rounding_bound; rigorous, no tolerance needed)
    assert j[hook]["step1_grad_excess_over_bound"] <= 0
    # the fp32 run is plain DDP: one process
    fp32 = run.export("comm_hooks_none")
    assert_state_dicts_close(fp32, one_process(lambda: MLP(hidden=64, depth=2)).state_dict(),
                             **SGD_TOL, msg="DDP without hook vs one process:")
    # after 4 steps: within the bound computed here, per tensor (its largest difference against
    # its largest bound). The bound leaves out a term that is also first order in u but scaled
    # by lr x curvature, a heuristic that holds while that is small: the runs' weights differ
    # by ~5e-5, so their gradients differ by that times the loss curvature, and a
    # step adds lr x that, ~5e-6 per unit of curvature, where the bound grows by ~1.5e-4 (bf16)
    # per step. Measured: each tensor's largest difference is at most 0.35 (bf16) and 0.39 (fp16)
    # of its bound. A hook that skipped the division by the world size would move weights by
    # lr x |g| per step, up to 1 / (2u) = 128 (bf16) or 1024 (fp16) times the bound; one that
    # skipped the all-reduce, by lr x |g_0 - g_1| / 2, as far.
    compressed = run.export(f"comm_hooks_{hook}")
    bound = first_order_bound(u)
    for key, b in bound.items():
        diff = (compressed[key] - fp32[key]).abs().max().item()
        assert diff <= b.max().item(), f"{hook} {key}: {diff:.3g} > bound {b.max().item():.3g}"
    assert max_diff(compressed, fp32) > 0  # the hook did round something


# --------------------------------------------------------------------------------------------------
# Each demo file on its own, as the page runs it


# demo name (the driver's --demo) -> the page's command for its own file
DEMO_COMMANDS = {
    "find_unused_parameters":
        "torchrun --nproc_per_node=2 01-ddp-basics/internals/unused_parameters.py",
    "static_graph": "torchrun --nproc_per_node=2 01-ddp-basics/internals/static_graph.py",
    "gradient_as_bucket_view": "torchrun --nproc_per_node=2 01-ddp-basics/internals/bucket_view.py",
    "bucket_cap_mb": "torchrun --nproc_per_node=2 01-ddp-basics/internals/bucket_cap.py",
    "sync_batchnorm": "torchrun --nproc_per_node=2 01-ddp-basics/internals/sync_batchnorm.py",
    "join": "torchrun --nproc_per_node=2 01-ddp-basics/internals/join.py",
    "comm_hooks": "torchrun --nproc_per_node=2 01-ddp-basics/internals/comm_hooks.py",
}


@pytest.mark.parametrize("demo", DEMO_COMMANDS)
def test_each_demo_file_on_its_own_prints_what_the_driver_printed(run, demo):
    """The page's command for the demo's own file (run here, its quoted output re-checked, instead
    of by test_readmes): every line it prints is a line the driver printed in the fixture's launch,
    every number equal (timings aside), and it holds the driver's checks of that demo."""
    result = run_documented(PAGE, DEMO_COMMANDS[demo])
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert lines[1].startswith(f"[{demo}]"), lines[:2]
    mine = [name for name in run.report["checks"] if name.startswith(demo)]
    assert mine and lines[-1] == f"all {len(mine)} checks hold", lines[-1]
    assert quoted_output.check("\n".join(lines[:-1]), run.result.stdout, rel=0) == []


# --------------------------------------------------------------------------------------------------
# The script contract: one process, --help, bad input


def test_one_process_runs_every_demo_and_the_bucket_layout_does_not_depend_on_the_world(tmp_path):
    out = tmp_path / "w1.json"
    result = run_python(SCRIPT, "--timing-steps", "1", "--json-out", out, timeout=120)
    assert "all 20 checks hold" in result.stdout
    report = read_json(out)
    assert report["world_size"] == 1 and all(report["checks"].values())
    for row in report["demos"]["bucket_cap_mb"]["rows"]:
        assert row["counted"] == predicted_buckets(row["bucket_cap_mb"])
    help_text = run_python(SCRIPT, "--help", timeout=60).stdout
    for flag in ("--device", "--timeout-s", "--json-out", "--export", "--demo", "--bucket-caps"):
        assert flag in help_text


@pytest.mark.parametrize("argv,pattern", [
    (["--bucket-caps", "none,big"], r"--bucket-caps: 'big' is neither a size in MiB nor 'none'"),
    (["--steps", "1"], r"--steps 1: find_unused_parameters needs at least 2"),
], ids=["bucket-caps", "steps"])
def test_bad_input_exits_2_with_one_line_on_every_rank(argv, pattern):
    for rank, result in enumerate(run_ranks(SCRIPT, *argv, world=2, timeout=60)):
        assert_bad_input(result, rf"^\[rank {rank}\] error: {pattern}")

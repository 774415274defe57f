"""Lesson 03 (DeepSpeed), through the real `deepspeed` launcher on CPU (gloo):

- ZeRO stages 0-3 at world 2 end with the weights of a one-process stage-0 run with the same
  global batch, and with each other; both offload configs end with their stage's weights;
- a run resumed from a DeepSpeed checkpoint (under torchrun) ends bitwise equal to the
  uninterrupted run, and the checkpoint's zero_to_fp32 conversion loads strictly into the model;
- the bytes each rank holds follow the ZeRO formulas (DeepSpeed's estimator printed beside them);
- the hand-written ShardedOptimizer equals the plain optimizer and ZeroRedundancyOptimizer;
- deepspeed_inference.py reproduces the plain model's logits;
- bad configs exit 2 with one line per rank naming the field.

Cost: each 2-rank `deepspeed` launch is ~15 CPU seconds (launcher + two interpreters importing
torch and deepspeed), so every launch is shared through module-scoped fixtures: the eight world-2
trainings (stages 0-3, both offload configs, the two traffic variants) run one after the other in
one launch (tests/workers_03/deepspeed_runs.py, through the script's own functions), and the runs
are short (8 optimizer steps of the course's 110k-parameter GPT).
"""

import importlib.util
import itertools
import json
import math
import shutil

import pytest
import torch
from dtcourse.models import GPT

from conftest import (
    REPO,
    assert_bad_input,
    assert_adamw_close,
    assert_state_dicts_close,
    assert_state_dicts_equal,
    launch,
    load_export,
    read_json,
    readme_mentions,
    run_deepspeed,
    run_python,
    run_readme_command,
    torchrun_cmd,
)

LESSON = REPO / "03-deepspeed"
TRAIN = "03-deepspeed/deepspeed_train.py"
STEPS, WORLD = 8, 2
# World 2: 2 ranks x micro-batch 2 x 2 accumulation micro-steps = the reference's one batch of 8.
DIST_ARGS = ["--steps", STEPS, "--batch-size", 2, "--grad-accum", 2]
REF_ARGS = ["--steps", STEPS, "--batch-size", 8, "--grad-accum", 1]
LAUNCH_TIMEOUT = 280  # a 2-rank launch takes ~10 s idle, minutes on a crowded 2-core machine

# Tolerances (float32 on CPU). Between layouts only the order of the gradient sums changes
# (world 1: one mean over 8 rows; world 2: per-rank means of 2-row micro-batches, pre-divided by
# the world size and summed by gloo), a few ulps per gradient, and other CPUs' kernels round
# differently again. AdamW turns that into rare larger differences on coordinates whose gradient is
# at rounding level: conftest.assert_adamw_close allows those and catches a real bug (a lost shard,
# a missed reduction, a rank on the wrong rows), which moves most weights. DeepSpeedCPUAdam
# (offload) is a separate vectorised C++ implementation of the same AdamW update (a different
# operation order): a few more ulps per step, the same rule. The losses barely feel such
# coordinates (their gradient is near zero): they agree to 1e-5 relative.
ADAMW = {"lr": 1e-2, "steps": STEPS}
LOSS_TOL = {"rtol": 1e-5, "atol": 0}


def plain_gpt() -> GPT:
    """The shared GPT at deepspeed_train.py's default shape (--vocab 64 --seq-len 32 --dim 64
    --heads 4 --layers 2), without DeepSpeed: what an exported state dict must load into."""
    return GPT(vocab=64, seq_len=32, dim=64, heads=4, layers=2)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """World 1, stage 0, plain `python` (a one-process group): the result every layout must
    reproduce."""
    out = tmp_path_factory.mktemp("ref")
    run_python(TRAIN, "--deepspeed_config", LESSON / "configs" / "zero0_config.json", *REF_ARGS,
               "--export", out / "model.pt", "--metrics-out", out / "metrics.json",
               timeout=LAUNCH_TIMEOUT)
    return {"export": load_export(out / "model.pt"), "metrics": read_json(out / "metrics.json")}


CONFIGS = ["zero0_config", "zero1_config", "zero2_config", "zero3_config", "zero2_offload_config",
           "zero3_offload_config"]
# The paper's volumes, from two settings of the same configs (test_traffic_per_stage_...).
VARIANTS = {"zero2_reduce": ("zero2_config", {"use_multi_rank_bucket_allreduce": False}),
            "zero3_reuse0": ("zero3_config", {"stage3_max_reuse_distance": 0,
                                              "stage3_prefetch_bucket_size": 0})}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """runs(name) -> that config's (or variant's) world-2 run: every one of them in one launch of
    the deepspeed launcher, started by the first test that asks."""
    cache = {}

    def get(name):
        if not cache:
            out = tmp_path_factory.mktemp("runs")
            specs = [f"{config}={LESSON / 'configs' / f'{config}.json'}" for config in CONFIGS]
            for variant, (config, change) in VARIANTS.items():
                data = json.loads((LESSON / "configs" / f"{config}.json").read_text())
                data["zero_optimization"].update(change)
                (out / f"{variant}.json").write_text(json.dumps(data))
                specs.append(f"{variant}={out / f'{variant}.json'}")
            run_deepspeed("tests/workers_03/deepspeed_runs.py", "--out", out, "--runs", *specs,
                          "--", *DIST_ARGS, "--ckpt-every", STEPS // 2, num_gpus=WORLD,
                          timeout=3 * LAUNCH_TIMEOUT)
            for run in [*CONFIGS, *VARIANTS]:
                cache[run] = {"dir": out / run, "export": load_export(out / run / "model.pt"),
                              "metrics": read_json(out / run / "metrics.json")}
        return cache[name]

    return get


# --------------------------------------------------------------------------------------------------
# Bad input: before deepspeed is imported and before any collective


# Malformed, missing and inconsistent configs: tests/test_10_bad_inputs.py (on every rank).


def test_bad_config_fails_on_every_rank_under_the_launcher(tmp_path):
    """Each rank prints its own line: the launcher SIGTERMs the others when the first exits, and
    the script survives that long enough (see SIGTERM_RECEIVED in deepspeed_train.py)."""
    config = tmp_path / "stage4.json"
    config.write_text('{"zero_optimization": {"stage": 4}}')
    result = run_deepspeed(TRAIN, "--deepspeed_config", config, num_gpus=WORLD, check=False,
                           timeout=LAUNCH_TIMEOUT)
    assert_bad_input(result, r"^\[rank [01]\] error: .*zero_optimization\.stage", ranks=WORLD)
    assert {line.split("]")[0] for line in result.stderr_lines()} == {"[rank 0", "[rank 1"}


# --------------------------------------------------------------------------------------------------
# Equivalence: every stage, every layout, computes what one process computes


def test_reference_export_loads_into_the_plain_model(reference):
    plain_gpt().load_state_dict(reference["export"], strict=True)
    losses = reference["metrics"]["losses"]
    assert len(losses) == STEPS and losses[-1] < losses[0], losses
    assert reference["metrics"]["world_size"] == 1 and reference["metrics"]["global_batch"] == 8


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_stage_at_world_2_equals_one_process(stage, runs, reference):
    run = runs(f"zero{stage}_config")
    metrics = run["metrics"]
    assert (metrics["world_size"], metrics["global_batch"], metrics["zero_stage"]) == \
        (WORLD, 8, stage)
    assert metrics["precision"] == "fp32"  # the config's bf16 section is turned off on CPU
    assert_adamw_close(run["export"], reference["export"], **ADAMW,
                             msg=f"zero{stage} vs one process:")
    torch.testing.assert_close(torch.tensor(metrics["losses"]),
                               torch.tensor(reference["metrics"]["losses"]), **LOSS_TOL)


def test_stages_agree_with_each_other(runs):
    exports = {s: runs(f"zero{s}_config")["export"] for s in range(4)}
    for stage in (1, 2, 3):
        assert_adamw_close(exports[stage], exports[0], **ADAMW,
                                 msg=f"zero{stage} vs zero0:")


@pytest.mark.parametrize("stage", [2, 3])
def test_offload_equals_its_stage(stage, runs):
    offload = runs(f"zero{stage}_offload_config")
    assert offload["metrics"]["strategy"] == f"zero{stage}+offload"
    assert_adamw_close(offload["export"], runs(f"zero{stage}_config")["export"],
                             **ADAMW, msg=f"zero{stage} offload vs zero{stage}:")


def test_resume_from_checkpoint_is_bitwise_and_converts_to_fp32(runs, tmp_path):
    """Resume the stage-3 run from its step-4 checkpoint, under torchrun this time, and export
    through DeepSpeed's zero_to_fp32 conversion of the final checkpoint."""
    full = runs("zero3_config")
    ckpt = tmp_path / "ckpt"
    shutil.copytree(full["dir"] / "ckpt", ckpt)
    half = f"step_{STEPS // 2:06d}"
    assert (ckpt / "latest").read_text() == f"step_{STEPS:06d}"
    shutil.rmtree(ckpt / f"step_{STEPS:06d}")
    (ckpt / "latest").write_text(half)
    launch(torchrun_cmd(TRAIN, "--deepspeed_config", LESSON / "configs" / "zero3_config.json",
                        *DIST_ARGS, "--ckpt-dir", ckpt, "--export", tmp_path / "model.pt",
                        "--export-source", "checkpoint", "--metrics-out", tmp_path / "m.json",
                        nproc=WORLD), timeout=LAUNCH_TIMEOUT)
    resumed = read_json(tmp_path / "m.json")
    assert resumed["start_step"] == STEPS // 2
    assert resumed["losses"] == full["metrics"]["losses"][STEPS // 2:]  # bitwise
    export = load_export(tmp_path / "model.pt")
    assert_state_dicts_equal(export, full["export"], msg="resumed + zero_to_fp32 vs full run:")
    plain_gpt().load_state_dict(export, strict=True)


# --------------------------------------------------------------------------------------------------
# Memory: the bytes each rank holds, against the ZeRO formulas (fp32: 4 bytes per element)


def test_per_rank_bytes_follow_the_zero_formulas(runs):
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    model = plain_gpt()
    params = list(model.parameters())
    P, N = sum(p.numel() for p in params), WORLD
    biggest = max(p.numel() for p in params)
    largest_layer = max(sum(p.numel() for p in m.parameters(recurse=False))
                        for m in model.modules())
    # Stages 1/2 flatten all parameters into one buffer padded to a multiple of 2 x N elements
    # (DeepSpeed's alignment), cut into N equal partitions. Stage 3 cuts each parameter into N
    # pieces of ceil(numel / N).
    flat = math.ceil(P / (2 * N)) * 2 * N
    part12 = flat // N
    part3 = sum(math.ceil(p.numel() / N) for p in params)
    # While it accumulates, stage 2 keeps whole gradients of the parameters whose elements overlap
    # its partition of the flat buffer (with offload: in host buffers, accumulated_grads_in_cpu).
    bounds = list(itertools.pairwise(itertools.accumulate((p.numel() for p in params), initial=0)))
    overlap = [sum(b - a for a, b in bounds if a < (r + 1) * part12 and b > r * part12)
               for r in range(N)]
    B = 4  # bytes per fp32 element
    expected = {  # param, grad (max over micro-steps), fp32 master, master + Adam moments, host
        "zero0_config": (B * P, B * P, 0, 2 * B * P, 0),
        "zero1_config": (B * flat, B * P, B * part12, 3 * B * part12, 0),
        "zero3_config": (B * part3, B * part3, B * part3, 3 * B * part3, 0),
        # weights: the flat buffer and the pinned host copy of the partition (the step writes the
        # new weights into it); grads: the partition, the accumulation buffers and two buffers the
        # size of the biggest parameter, one on the host and one on the device; host: master, its
        # gradient, the moments, the accumulation buffers, the weight copy and the host buffer
        "zero2_offload_config": lambda r: (B * (flat + part12),
                                           B * (part12 + overlap[r] + 2 * biggest), B * part12,
                                           3 * B * part12,
                                           B * (5 * part12 + overlap[r] + biggest)),
        # everything on the host: weights, the gradient partition the backward accumulates into
        # (stage3.py allocates it on the host under offload_optimizer), the master's gradient,
        # the master, the moments: 24P/N bytes in fp32
        "zero3_offload_config": (B * part3, 2 * B * part3, B * part3, 3 * B * part3,
                                 6 * B * part3),
    }
    keys = ("param_bytes", "grad_bytes", "master_bytes", "optim_bytes", "host_bytes")
    header = (f"{'config':22}{'params':>10}{'grads':>10}{'optim':>10}{'host':>10}"
              f"{'device total':>14}   DeepSpeed's estimate (16-bit weights): device / host")
    table = [f"P = {P:,} parameters, N = {N} ranks; bytes per rank (rank 0):", header]
    for config in [*expected, "zero2_config"]:
        metrics = runs(config)["metrics"]
        assert metrics["n_params"] == P
        ranks = metrics["per_rank"]
        for rank, got in enumerate(ranks):
            assert got["peak_bytes"] is None  # CPU: no allocator peak
            if config == "zero2_config":
                # Stage 2 keeps whole gradient tensors of the parameters overlapping its partition
                # while it accumulates; after the last micro-step, exactly its partition.
                assert got["grad_bytes_per_micro_step"][-1] == B * part12
                assert got["grad_bytes_per_micro_step"][0] == B * overlap[rank]
                assert B * part12 <= got["grad_bytes"] <= B * (part12 + 2 * biggest) < B * P
                assert [got[k] for k in keys if k != "grad_bytes"] == \
                    [B * flat, B * part12, 3 * B * part12, 0], (config, rank, got)
            else:
                want = expected[config](rank) if callable(expected[config]) else expected[config]
                assert tuple(got[k] for k in keys) == want, (config, rank, got)
        r0 = ranks[0]
        offload = "offload" in config
        if "zero3" in config:
            host, device, _ = estimate_zero3_model_states_mem_needs(
                P, largest_layer, num_gpus_per_node=N, cpu_offload=offload,
                cpu_offload_params=offload)
            estimate = f"{device:,} / {host:,}"
        elif "zero2" in config:
            host, device = estimate_zero2_model_states_mem_needs(
                P, num_gpus_per_node=N, cpu_offload=offload)
            estimate = f"{device:,} / {host:,}"
        else:
            estimate = "(DeepSpeed has estimators for stages 2 and 3 only)"
        device_total = r0["param_bytes"] + r0["grad_bytes"] + r0["optim_bytes"] - r0["host_bytes"]
        table.append(f"{config:22}{r0['param_bytes']:>10,}{r0['grad_bytes']:>10,}"
                     f"{r0['optim_bytes']:>10,}{r0['host_bytes']:>10,}{device_total:>14,}"
                     f"   {estimate}")
    print("\n".join(table))
    # What each stage shards, in the formulas' words: stage 1 the optimizer state, stage 2 also
    # the gradients, stage 3 also the parameters.
    m = {s: runs(f"zero{s}_config")["metrics"]["per_rank"][0] for s in range(4)}
    assert m[1]["optim_bytes"] < m[0]["optim_bytes"] and m[1]["grad_bytes"] == m[0]["grad_bytes"]
    assert m[2]["grad_bytes_per_micro_step"][-1] < m[1]["grad_bytes_per_micro_step"][0]
    assert m[3]["param_bytes"] < m[2]["param_bytes"] == m[1]["param_bytes"]


def sent(metrics: dict) -> dict:
    """Bytes rank 0 sent in the last optimizer step, per collective, kinds that only carried
    scalars left out."""
    return {kind: s["sent_bytes"] for kind, s in metrics["comms_per_step"].items()
            if s["sent_bytes"] >= 1024}


def assert_sent(measured: dict, expected: dict, config: str) -> None:
    """Equal, up to the scalars DeepSpeed all-reduces beside the gradients (the gradient norm for
    clipping, the overflow flag): 16 bytes at most."""
    assert measured.keys() == expected.keys(), (config, measured, expected)
    for kind, want in expected.items():
        assert 0 <= measured[kind] - want <= 16, (config, kind, measured[kind], want)


def test_traffic_per_stage_measured_against_the_formulas(runs):
    """Bytes sent per optimizer step, in units of u = (N-1)/N x 4P (fp32 gradients), with A = 2
    micro-steps. The ZeRO paper: stages 1-2 move as much as DDP (reduce-scatter + all-gather:
    2u), stage 3 1.5x (the parameters gathered for forward and again for backward: 3u).
    DeepSpeed 0.19 with the course's configs differs, and the test pins down how:
    - stages 1-2 all-reduce whole gradient buckets and keep their partition
      (`use_multi_rank_bucket_allreduce`, default true): 2u where the paper has u, stage 2 every
      micro-step; with it false they reduce to each partition's owner, the paper's volume;
    - stage 3 keeps the parameters gathered in forward for backward (stage3_max_reuse_distance
      1e9 > P): one all-gather per micro-step; with reuse distance 0 it gathers twice."""
    P, N, A = 110_208, WORLD, 2
    u = (N - 1) * 4 * P // N
    measured = {config: sent(runs(config)["metrics"])
                for config in ("zero0_config", "zero1_config", "zero2_config", "zero3_config")}
    expected = {
        "zero0_config": {"all_reduce": 2 * u},                      # DDP: once, at the boundary
        "zero1_config": {"all_reduce": 2 * u, "all_gather": u},     # paper: u + u
        "zero2_config": {"all_reduce": 2 * A * u, "all_gather": u},  # paper: A u + u
        "zero3_config": {"all_gather": A * u, "reduce_scatter": A * u},  # paper: 2A u + A u
    }
    for config, want in expected.items():
        assert_sent(measured[config], want, config)
    # The paper's volumes, from two settings of the same configs (VARIANTS).
    assert_sent(sent(runs("zero2_reduce")["metrics"]), {"reduce": A * u, "all_gather": u},
                "zero2 reduce")
    assert_sent(sent(runs("zero3_reuse0")["metrics"]),
                {"all_gather": 2 * A * u, "reduce_scatter": A * u}, "zero3 reuse 0")


HPZ = ("deepspeed --num_gpus 4 03-deepspeed/deepspeed_train.py --deepspeed_config "
       "03-deepspeed/configs/zeropp_hpz_config.json --steps 8 --batch-size 2 --metrics-out "
       "runs/03-deepspeed/hpz.json --export runs/03-deepspeed/hpz.pt")


def test_zeropp_hpz_gathers_backward_within_the_group_and_equals_one_process(reference):
    """ZeRO++ hpZ at world 4 with zero_hpz_partition_size 2: the step's first all-gather
    (forward) over the 4 ranks (3/4 of the parameter bytes sent per rank), backward's over the
    pair (1/2), from a secondary partition of P/2 parameters per rank; reduce-scatter as
    ZeRO-3's. The command of zeropp.md (the lesson's ZeRO++ page),
    whose global batch (4 x 2) is the reference's 8: the same model as one process."""
    assert readme_mentions(LESSON / "zeropp.md", HPZ)
    run_readme_command(HPZ, timeout=LAUNCH_TIMEOUT)
    metrics = read_json(REPO / "runs/03-deepspeed/hpz.json")
    P, N, S = 110_208, 4, 2
    assert (metrics["world_size"], metrics["global_batch"], metrics["zero_stage"]) == (N, 8, 3)
    comms, phases = metrics["comms_per_step"], metrics["comms_by_phase"]
    assert sorted(comms["all_gather"]["group_sizes"]) == [S, N]
    # The first gather after an optimizer step (forward) over all N ranks; backward's, from the
    # secondary partition, inside the group of S
    assert phases["forward"]["all_gather"]["group_sizes"] == [N]
    assert phases["forward"]["all_gather"]["sent_bytes"] == (N - 1) * 4 * P // N
    assert phases["backward"]["all_gather"]["group_sizes"] == [S]
    assert phases["backward"]["all_gather"]["sent_bytes"] == (S - 1) * 4 * P // S
    assert_sent(sent(metrics), {"all_gather": (N - 1) * 4 * P // N + (S - 1) * 4 * P // S,
                                "reduce_scatter": (N - 1) * 4 * P // N}, "zero3 + hpZ")
    for held in metrics["per_rank"]:  # fp32 on this CPU: 4 bytes per parameter, P/S of them
        assert held["secondary_bytes"] == 4 * P // S
        assert held["param_bytes"] == 4 * P // N
    assert_adamw_close(load_export(REPO / "runs/03-deepspeed/hpz.pt"), reference["export"],
                       **ADAMW, msg="zero3 + hpZ at world 4 vs one process:")
    torch.testing.assert_close(torch.tensor(metrics["losses"]),
                               torch.tensor(reference["metrics"]["losses"]), **LOSS_TOL)


def test_zeropp_config_is_zero3_with_the_three_switches_deepspeed_reads():
    """zeropp_config.json (for GPU nodes; its quantizer has no CPU kernel) is zero3_config.json
    plus qwZ, hpZ over 8 GPUs and qgZ, under the names DeepSpeed's config model reads."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    zpp = json.loads((LESSON / "configs" / "zeropp_config.json").read_text())
    z3 = json.loads((LESSON / "configs" / "zero3_config.json").read_text())
    switches = {"zero_quantized_weights": True, "zero_hpz_partition_size": 8,
                "zero_quantized_gradients": True}
    assert zpp["zero_optimization"] == {**z3["zero_optimization"], **switches}
    assert {k: v for k, v in zpp.items() if k != "zero_optimization"} == \
        {k: v for k, v in z3.items() if k != "zero_optimization"}
    parsed = DeepSpeedZeroConfig(**zpp["zero_optimization"])
    assert all(getattr(parsed, key) == value for key, value in switches.items())
    hpz = json.loads((LESSON / "configs" / "zeropp_hpz_config.json").read_text())
    assert DeepSpeedZeroConfig(**hpz["zero_optimization"]).zero_hpz_partition_size == 2


# --------------------------------------------------------------------------------------------------
# ZeRO by hand


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_optimizer_equals_plain_and_zero_redundancy(world, tmp_path):
    out = tmp_path / "sharded.pt"
    launch(torchrun_cmd("tests/workers_03/sharded_optimizer_check.py", out, nproc=world),
           timeout=LAUNCH_TIMEOUT)
    data = torch.load(out, weights_only=False)
    results = data["results"]
    # SGD: the update is lr x gradient, so only the rounding of the gradient average shows, ~1e-8
    # here. AdamW: see conftest.assert_adamw_close (2.8e-6 seen on an AVX2-only CPU).
    for name in ("adamw", "sgd"):
        plain = results[f"plain-{name}"]
        for run in (f"sharded1-{name}", f"sharded2-{name}", f"zero_redundancy-{name}"):
            if name == "adamw":  # 4 steps at lr 1e-2 (workers_03/sharded_optimizer_check.py)
                assert_adamw_close(results[run], plain, lr=1e-2, steps=4, msg=f"{run} vs plain:")
            else:
                assert_state_dicts_close(results[run], plain, rtol=1e-5, atol=1e-7,
                                         msg=f"{run} vs plain:")
        # The frozen layer never moves; the tied weight is one tensor under two names.
        assert_state_dicts_equal({k: v for k, v in results[f"sharded2-{name}"].items()
                                  if k.startswith("frozen")},
                                 {k: v for k, v in results["initial"].items()
                                  if k.startswith("frozen")})
        assert torch.equal(plain["mix1.weight"], plain["mix2.weight"])

        # Each rank holds about 1/N of the state: together exactly the plain optimizer's, and no
        # rank more than its share plus one parameter's state (greedy largest-first balance).
        per_param = 2 if name == "adamw" else 1  # AdamW: exp_avg + exp_avg_sq; SGD: momentum
        biggest = per_param * 4 * 64 * 64
        for stage in (1, 2):
            shares = [r[f"sharded{stage}-{name}"] for r in data["per_rank_bytes"]]
            assert len(shares) == world and sum(shares) == data["plain_bytes"][name]
            assert max(shares) <= data["plain_bytes"][name] / world + biggest, shares


# --------------------------------------------------------------------------------------------------
# Inference


def test_inference_matches_the_plain_model(runs, tmp_path):
    """On the stage-2 run's trained weights, split 2 ways by DeepSpeed's AutoTP under its launcher
    (AutoTP needs `transformers`, which requirements.txt installs), and on one process, where the
    script runs the engine unsplit and says why."""
    assert importlib.util.find_spec("transformers") is not None, \
        "DeepSpeed's AutoTP needs transformers: pip install -r requirements.txt"
    args = ["03-deepspeed/deepspeed_inference.py", "--weights",
            runs("zero2_config")["dir"] / "model.pt"]
    run_deepspeed(*args, "--json-out", tmp_path / "split.json", "--save-logits",
                  tmp_path / "split.pt", num_gpus=WORLD, timeout=LAUNCH_TIMEOUT)
    run_python(*args, "--json-out", tmp_path / "one.json", "--save-logits", tmp_path / "one.pt",
               timeout=LAUNCH_TIMEOUT)
    split, one = read_json(tmp_path / "split.json"), read_json(tmp_path / "one.json")
    assert split["tensor_parallel"] == WORLD and split["local_qkv_features"] == 64 // WORLD
    assert one["tensor_parallel"] == 1 and one["local_qkv_features"] == 64
    assert "launch with deepspeed --num_gpus N" in one["no_split_reason"]
    # fp32: tensor parallelism only reorders the sums of the row-parallel layers (partial
    # products, then an all-reduce); logits here are O(10), so 1e-4 is ~100 float32 ulps. A
    # wrong split (a head cut in two, a missing all-reduce) changes logits by O(1).
    for name in ("split", "one"):
        logits = torch.load(tmp_path / f"{name}.pt", weights_only=True)
        torch.testing.assert_close(logits["deepspeed"], logits["plain"], rtol=0, atol=1e-4,
                                   msg=lambda m, n=name: f"{n}: {m}")
    # the unsplit engine is the plain model itself: bitwise the same logits
    assert torch.equal(torch.load(tmp_path / "one.pt", weights_only=True)["deepspeed"],
                       torch.load(tmp_path / "one.pt", weights_only=True)["plain"])


# --------------------------------------------------------------------------------------------------
# The README documents the commands these tests run


def test_readme_shows_the_launch_commands():
    readme = LESSON / "README.md"
    for command in [
        ("deepspeed --num_gpus 2 03-deepspeed/deepspeed_train.py --deepspeed_config "
         "03-deepspeed/configs/zero2_config.json"),
        ("python 03-deepspeed/deepspeed_train.py --deepspeed_config "
         "03-deepspeed/configs/zero0_config.json"),
        "torchrun --nproc_per_node=2 03-deepspeed/deepspeed_train.py --deepspeed_config",
        # (not the whole commands: test_readmes.py runs those and checks their quoted outputs)
        "--nproc_per_node=2 03-deepspeed/zero_from_scratch.py",
        "--num_gpus 2 03-deepspeed/zero_offload.py",
    ]:
        assert readme_mentions(readme, command), command
    assert readme_mentions(LESSON / "inference.md", "03-deepspeed/deepspeed_inference.py --weights")
    configs = json.loads((LESSON / "configs" / "zero3_nvme_offload_config.json").read_text())
    assert "CHANGE_ME" in configs["zero_optimization"]["offload_param"]["nvme_path"]


def test_config_aio_keys_are_ones_deepspeed_reads():
    """DeepSpeed reads the `aio` block key by key and silently ignores a name it does not know
    (0.19 renamed thread_count to intra_op_parallelism): every key must be one it reads."""
    from deepspeed.runtime.swap_tensor.aio_config import AIO_DEFAULT_DICT
    for path in sorted((LESSON / "configs").glob("*.json")):
        aio = json.loads(path.read_text()).get("aio", {})
        assert set(aio) <= set(AIO_DEFAULT_DICT), (path.name, set(aio) - set(AIO_DEFAULT_DICT))

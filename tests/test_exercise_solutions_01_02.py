"""The worked solutions of the exercises of lessons 01 and 02 compute what the READMEs' answers say.

The solutions are scripts in 01-ddp-basics/solutions/ and 02-fsdp/solutions/ (each launchable on
its own, reusing the lesson script it changes, loaded by path) and documented commands of the
lessons' own scripts. Each test runs the commands of one exercise verbatim, as the README shows
them (conftest.run_readme_command: the exit status and the quoted output are re-checked, and
test_readmes.py leaves these commands out), then checks the numbers they write against what is
computed here: DistributedSampler's permutation, Adam's invariance to the gradient's scale,
DDP's bucket layout, torch.chunk's rows, FSDP's collective counts and gathered bytes.
"""

import math
import re

import torch

from conftest import (
    run_documented,
    REPO,
    assert_adamw_close,
    assert_state_dicts_equal,
    load_export,
    load_script,
    read_json,
)

README_01 = REPO / "01-ddp-basics" / "README.md"
README_02 = REPO / "02-fsdp" / "README.md"
TIMEOUT = 240  # a 2-rank launch takes seconds, minutes on a crowded 2-core machine

# The documented commands this file runs (test_readmes.py does not run them again).
EX1_01 = ("torchrun --nproc_per_node=2 01-ddp-basics/solutions/ex1_no_set_epoch.py "
          "--json-out runs/01-ddp-basics/ex1_set_epoch.json")
EX2_01 = ("torchrun --nproc_per_node=2 01-ddp-basics/solutions/ex2_no_loss_division.py "
          "--json-out runs/01-ddp-basics/ex2.json --export runs/01-ddp-basics/ex2.pt")
EX3_01 = ("torchrun --nproc_per_node=2 01-ddp-basics/solutions/ex3_rank0_barrier.py "
          "--timeout-s 5 --json-out runs/01-ddp-basics/ex3_barrier.json")
EX4_01 = ("python 01-ddp-basics/ddp_benchmark.py --hidden 128 "
          "--json-out runs/01-ddp-basics/ex4_hidden128.json")
EX5_01_FAIL = ("rm -rf runs/01-ddp-basics/ex5_ckpt && torchrun --nproc_per_node=2 "
               "01-ddp-basics/ddp_training.py --ckpt-dir runs/01-ddp-basics/ex5_ckpt "
               "--ckpt-every 5 --fail-at-step 13  # exits 1")
EX5_01_RESUME = ("torchrun --nproc_per_node=2 01-ddp-basics/ddp_training.py --ckpt-dir "
                 "runs/01-ddp-basics/ex5_ckpt --ckpt-every 5")
EX1_02 = "torchrun --nproc_per_node=4 02-fsdp/fsdp_basics.py"
EX2_02 = ("torchrun --nproc_per_node=2 02-fsdp/solutions/ex2_root_only.py "
          "--metrics-out runs/02-fsdp/ex2_root_only.json")
EX3_02 = ("torchrun --nproc_per_node=2 02-fsdp/fsdp_transformer.py --strategy full grad-op "
          "--grad-accum 4 --steps 4 --metrics-out runs/02-fsdp/ex3_accum.json")
EX4_02 = ("torchrun --nproc_per_node=2 02-fsdp/solutions/ex4_keep_after_reduce.py "
          "--json-out runs/02-fsdp/ex4_free.json --export runs/02-fsdp/ex4.pt")
EX5_02_SAVE = ("rm -rf runs/02-fsdp/ex5_ckpt && torchrun --nproc_per_node=2 "
               "02-fsdp/fsdp_checkpoint.py --ckpt-dir runs/02-fsdp/ex5_ckpt --steps 10")
EX5_02_RESUME = ("torchrun --nproc_per_node=4 02-fsdp/fsdp_checkpoint.py --ckpt-dir "
                 "runs/02-fsdp/ex5_ckpt --steps 20 --batch-size 8 "
                 "--export runs/02-fsdp/ex5_resumed.pt")
EX5_02_WORLD4 = ("torchrun --nproc_per_node=4 02-fsdp/fsdp_checkpoint.py --steps 20 "
                 "--batch-size 8 --export runs/02-fsdp/ex5_world4.pt")
EX6_02 = ("torchrun --nproc_per_node=2 02-fsdp/solutions/ex6_oss_zero_grad.py "
          "--json-out runs/02-fsdp/ex6_zero_grad.json")

# --------------------------------------------------------------------------------------------------
# Lesson 01


def sampler_order(n: int, world: int, rank: int, seed: int, epoch: int) -> list[int]:
    """DistributedSampler(shuffle=True, drop_last=True)'s indices for one rank, written out:
    randperm seeded by seed + epoch, cut to a multiple of the world size, every world-th."""
    g = torch.Generator().manual_seed(seed + epoch)
    perm = torch.randperm(n, generator=g).tolist()
    total = (n // world) * world
    return perm[:total][rank:total:world]


def test_01_ex1_without_set_epoch_every_epoch_repeats_the_first_order():
    run_documented(README_01, EX1_01, "runs/01-ddp-basics/ex1_set_epoch.json")
    data = read_json(REPO / "runs/01-ddp-basics/ex1_set_epoch.json")
    n, world, seed = data["train_size"], data["world_size"], data["seed"]
    with_, without = data["runs"]["with set_epoch"], data["runs"]["without set_epoch"]
    for rank in range(world):
        for epoch in range(data["epochs"]):
            assert with_["orders_per_rank"][rank][epoch] == \
                sampler_order(n, world, rank, seed, epoch)
            assert without["orders_per_rank"][rank][epoch] == \
                sampler_order(n, world, rank, seed, 0)  # the epoch stays 0
    # epoch 1 is the same run both ways, to the bit (same weights, same batches, same order)
    assert with_["losses"][0] == without["losses"][0]
    # epoch 2 sees other batches in each case: the losses part. Two different orders of the
    # same images give losses that differ in the second decimal here (0.04 measured); rounding
    # alone, on one machine, gives none at all.
    assert abs(with_["losses"][1] - without["losses"][1]) > 1e-3


def test_01_ex2_adamw_on_gradients_grad_accum_times_too_large_is_adamw_with_eps_over_it():
    outputs = [f"runs/01-ddp-basics/ex2.{tag}.pt" for tag in
               ("adamw.divided", "adamw.undivided", "sgd.divided", "sgd.undivided",
                "adamw.divided_eps")]
    run_documented(README_01, EX2_01, "runs/01-ddp-basics/ex2.json", *outputs)
    data = read_json(REPO / "runs/01-ddp-basics/ex2.json")
    assert data["grad_accum"] == 4
    w = {tag: load_export(REPO / f"runs/01-ddp-basics/ex2.{tag}.pt") for tag in
         ("adamw.divided", "adamw.undivided", "sgd.divided", "sgd.undivided",
          "adamw.divided_eps")}
    # Without the division every gradient is exactly 4 x the divided one (a power of two scales
    # every product and sum of the backward and the all-reduce without rounding), so Adam's m is
    # 4x and sqrt(v) 4x: the undivided run is the divided one with eps / 4, operation for
    # operation, and the two end bitwise equal.
    assert_state_dicts_equal(w["adamw.undivided"], w["adamw.divided_eps"])
    # ... while against eps 1e-8 they differ where sqrt(v) is not far above eps: some weights
    # visibly (1.5e-2 measured), so the two are not equal, and the losses barely move
    runs = data["runs"]
    assert abs(runs["adamw undivided"]["losses"][-1] - runs["adamw divided"]["losses"][-1]) < 0.01
    assert runs["adamw undivided"]["max_abs_diff_to_divided"] > 0
    # Adam's first step is lr x g / (|g| + eps): the scale of g cancels (1.0001 measured: eps)
    assert abs(runs["adamw undivided"]["first_update_ratio"] - 1) < 1e-2
    # SGD's step is lr x g: 4x. Rounding of w - lr g (relative 6e-8 of |w| ~ 0.1, against
    # updates of ~1e-4 and more) moves the ratio of norms by far less than 1e-3.
    assert abs(runs["sgd undivided"]["first_update_ratio"] - 4) < 1e-3
    assert runs["sgd undivided"]["max_abs_diff_to_divided"] > 0.05


def test_01_ex3_a_barrier_on_one_rank_times_out_on_both():
    outputs = [f"runs/01-ddp-basics/ex3_barrier.rank{r}.json" for r in range(2)]
    run_documented(README_01, EX3_01, *outputs)
    rank0, rank1 = (read_json(REPO / name) for name in outputs)
    # rank 0 waits in the barrier, rank 1 in the next step's DDP all-reduce: neither returns
    # before the 5 s timeout (a little earlier at most, for clock granularity); a missing
    # timeout would leave the test's own 240 s limit to end it.
    assert "barrier" in rank0["where"] and "step 3" in rank0["where"]
    assert "step 4" in rank1["where"] and "all-reduce" in rank1["where"]
    # Both wait on the same gloo connection, their timers started within milliseconds; gloo
    # closes a connection when a wait on it times out, so the rank whose timer fires second may be
    # told "Connection closed by peer" instead of its own timeout: either way after the timeout.
    for outcome in (rank0, rank1):
        assert outcome["error"] == "RuntimeError"
        assert any(told in outcome["message"]
                   for told in ("Timed out", "Connection closed by peer")), outcome["message"]
        assert outcome["waited_s"] >= 0.9 * outcome["timeout_s"]
    assert any("Timed out" in outcome["message"] for outcome in (rank0, rank1))


def ddp_buckets(sizes_in_backward_order: list[int], first_cap: int, cap: int) -> list[int]:
    """DDP's rebuilt buckets: gradients in the order they arrive, a bucket closed once it
    reaches its cap (the tensor that crosses it included); the first bucket's cap is smaller."""
    buckets, current = [], 0
    for size in sizes_in_backward_order:
        current += size
        if current >= (first_cap if not buckets else cap):
            buckets.append(current)
            current = 0
    return buckets + ([current] if current else [])


def test_01_ex4_the_benchmark_reports_ddps_buckets():
    run_documented(REPO / "01-ddp-basics" / "scaling_and_resume.md", EX4_01, "runs/01-ddp-basics/ex4_hidden128.json")
    rows = read_json(REPO / "runs/01-ddp-basics/ex4_hidden128.json")
    bench = load_script("01-ddp-basics/ddp_benchmark.py")
    from dtcourse.models import MLP
    model = MLP(128, depth=4, features=bench.FEATURES)
    sizes = [4 * p.numel() for p in reversed(list(model.parameters()))]
    expected = ddp_buckets(sizes, 1 << 20, 25 << 20)  # bucket_cap_mb left at its default
    assert [r["world_size"] for r in rows] == [1, 2]
    for row in rows:
        assert row["params"] == sum(sizes) // 4
        assert row["bucket_bytes"] == expected
    assert expected == [sum(sizes)]  # 0.34 MB of gradients: one bucket, one all-reduce


def test_01_ex5_a_run_killed_midway_resumes_from_the_last_multiple_of_ckpt_every():
    ckpt = REPO / "runs/01-ddp-basics/ex5_ckpt"
    failed = run_documented(README_01, EX5_01_FAIL)
    assert "injected failure on rank 0 at step 13" in failed.stderr
    assert sorted(p.name for p in ckpt.glob("step_*.pt")) == \
        ["step_000005.pt", "step_000010.pt"]  # step 13 died before step 15's checkpoint
    resumed = run_documented(README_01, EX5_01_RESUME)
    assert "resumed from step 10 in runs/01-ddp-basics/ex5_ckpt" in resumed.stdout
    # --keep-ckpts 3: the newest three
    assert sorted(p.name for p in ckpt.glob("step_*.pt")) == \
        ["step_000030.pt", "step_000035.pt", "step_000040.pt"]


# --------------------------------------------------------------------------------------------------
# Lesson 02


def test_02_ex1_at_world_4_the_last_rank_holds_one_row_and_the_gather_carries_padding():
    out = run_documented(README_02, EX1_02).stdout
    shapes = {"0": (30, 16), "2": (25, 30), "4": (10, 25)}
    for name, (rows, cols) in shapes.items():
        line = next(line for line in out.splitlines() if line.startswith(f"{name}.weight "))
        held = [int(r) for r in re.findall(r"r\d \((\d+), \d+\)", line)]
        assert held == [len(c) for c in torch.arange(rows).chunk(4)]  # torch.chunk's rows
    assert held == [3, 3, 3, 1]  # the 10-row layer: rank 3 gets one row
    # every shard padded to ceil(10/4) = 3 rows: the all-gather of unit 4 carries 12 rows of
    # weight and bias (26 floats a row), 2 of them padding
    padded = 4 * math.ceil(10 / 4) * (25 + 1) * 4
    assert re.search(rf"forward  all_gather\s+float32  tensor\s+{padded:,} B .* unit 4", out)
    assert padded - 10 * 26 * 4 == 208


def gpt_units() -> tuple[int, int, int]:
    """(P, one block's parameters, the root's) of fsdp_transformer.py's default GPT."""
    from dtcourse.models import GPT
    model = GPT(256, 32, 64, 4, 2)
    P = sum(p.numel() for p in model.parameters())
    block = sum(p.numel() for p in model.blocks[0].parameters())
    return P, block, P - 2 * block


def test_02_ex2_wrapping_only_the_root_gathers_the_whole_model_once():
    run_documented(README_02, EX2_02, "runs/02-fsdp/ex2_root_only.json")
    runs = read_json(REPO / "runs/02-fsdp/ex2_root_only.json")["runs"]
    P, block, root = gpt_units()
    per_block, root_only = runs["per block"], runs["root only"]
    L = 2
    # per block: each block gathered for forward and again for backward, the root once
    assert per_block["comms_per_step"]["all_gather"]["calls"] == 2 * L + 1
    assert per_block["comms_per_step"]["reduce_scatter"]["calls"] == L + 1
    # root only: one unit, gathered once (kept from forward to backward), reduced once
    assert root_only["comms_per_step"]["all_gather"]["calls"] == 1
    assert root_only["comms_per_step"]["reduce_scatter"]["calls"] == 1
    assert root_only["comms_per_step"]["all_gather"]["tensor_bytes"] == 4 * P
    assert per_block["comms_per_step"]["all_gather"]["tensor_bytes"] == 4 * (2 * L * block + root)
    assert (per_block["largest_unit_bytes"], root_only["largest_unit_bytes"]) == \
        (4 * max(block, root), 4 * P)
    # the same arithmetic, only grouped otherwise: every element is a sum of 2 terms either way
    assert per_block["losses"] == root_only["losses"]


def test_02_ex3_accumulation_reduces_once_per_step_and_holds_full_gradients_meanwhile():
    run_documented(README_02, EX3_02, "runs/02-fsdp/ex3_accum.json")
    runs = read_json(REPO / "runs/02-fsdp/ex3_accum.json")["runs"]
    P, _, _ = gpt_units()
    L, A = 2, 4
    gathers = {"full": A * (2 * L + 1), "grad-op": A * (L + 1)}
    for strategy, metrics in runs.items():
        comms = metrics["comms_per_step"]
        assert comms["reduce_scatter"]["calls"] == L + 1, strategy  # the last micro-step only
        assert comms["all_gather"]["calls"] == gathers[strategy], strategy
        # between micro-steps each rank keeps every unit's unsharded gradient: 4P, not 4P/N
        assert all(h["accum_grad_bytes"] == 4 * P for h in metrics["per_rank"]), strategy


def test_02_ex4_without_the_free_every_gathered_weight_stays_until_the_step():
    run_documented(README_02, EX4_02, "runs/02-fsdp/ex4_free.json",
                   "runs/02-fsdp/ex4.lesson.pt", "runs/02-fsdp/ex4.no_free.pt")
    data = read_json(REPO / "runs/02-fsdp/ex4_free.json")
    scratch = load_script("02-fsdp/fsdp_from_scratch.py")
    N = data["world_size"]
    numels = {id(p): p.numel() for p in scratch.TiedLM().parameters()}  # the tied weight once
    padded = sum(4 * math.ceil(n / N) * N for n in numels.values())
    lesson, no_free = data["runs"]["lesson"], data["runs"]["no free"]
    # without the free, backward ends with every parameter gathered, padding included
    assert no_free["peak_gathered_bytes"] == no_free["gathered_when_backward_returns"] == padded
    assert lesson["peak_gathered_bytes"] < padded
    assert lesson["gathered_bytes_after_step"] == no_free["gathered_bytes_after_step"] == 0
    # the free changes memory only, not one bit of arithmetic
    assert_state_dicts_equal(load_export(REPO / "runs/02-fsdp/ex4.no_free.pt"),
                             load_export(REPO / "runs/02-fsdp/ex4.lesson.pt"))
    assert lesson["losses"] == no_free["losses"]


def test_02_ex5_resumed_at_world_4_equals_an_uninterrupted_world_4_run():
    run_documented(REPO / "02-fsdp" / "checkpointing.md", EX5_02_SAVE)
    run_documented(REPO / "02-fsdp" / "checkpointing.md", EX5_02_RESUME, "runs/02-fsdp/ex5_resumed.pt")
    run_documented(REPO / "02-fsdp" / "checkpointing.md", EX5_02_WORLD4, "runs/02-fsdp/ex5_world4.pt")
    # steps 1-10 summed the gradient over 2 ranks, the uninterrupted run over 4: another order
    # of the same float32 additions, which AdamW can magnify on coordinates with tiny gradients
    # (conftest.assert_adamw_close argues the bound); fsdp_checkpoint.py's lr is its default.
    lr = load_script("02-fsdp/fsdp_checkpoint.py").parse_args([]).lr
    assert_adamw_close(load_export(REPO / "runs/02-fsdp/ex5_resumed.pt"),
                       load_export(REPO / "runs/02-fsdp/ex5_world4.pt"), lr=lr, steps=20)


def test_02_ex6_after_torchs_zero_grad_each_owner_steps_with_its_own_unaveraged_gradient():
    run_documented(REPO / "02-fsdp" / "lineage.md", EX6_02, "runs/02-fsdp/ex6_zero_grad.json")
    data = read_json(REPO / "runs/02-fsdp/ex6_zero_grad.json")
    drift = data["max_abs_diff_to_ddp"]
    # the wrapper's own zero_grad: bitwise DDP at every step (world 2: sums of two terms)
    assert all(x == 0 for x in drift["oss wrapped.zero_grad()"])
    wrong = drift["oss opt.zero_grad()"]
    # step 1 is exact either way; from step 2 AdamW steps of lr-size go the wrong way, far above
    # rounding (0 above)
    assert wrong[0] == 0
    assert 0 < wrong[1] < wrong[-1]
    assert wrong[-1] > data["lr"]
    # Why, step by step, over the parameters each rank's optimizer steps. Scaling by 1/2 and a
    # sum of two terms round nothing, and the rank's own gradient is recomputed with the same
    # kernels: every "equal" below is bitwise, and a real difference is of the gradients' size.
    right, broken = (data["stepped_with"][name] for name in
                     ("oss wrapped.zero_grad()", "oss opt.zero_grad()"))
    for s in right:  # .grad stays in the buckets, and the owner steps with the ranks' mean
        assert s["bucket_views"] == s["owned"] > 0 and s["max_diff_to_mean"] == 0, s
    first, later = broken[0], broken[1:]
    # step 1: the buckets, and with them the views, are built in the first forward, after the
    # zero_grad call, so that step is the right one
    assert first["bucket_views"] == first["owned"] and first["max_diff_to_mean"] == 0, first
    for s in later:
        # from step 2: set_to_none dropped the views; backward made fresh tensors, outside every
        # bucket, and nothing reduced them: each owner steps with exactly its own gradient, of
        # its half of the batch, which is not the mean of the two halves
        assert s["bucket_views"] == 0 and s["max_diff_to_own"] == 0, s
        assert s["max_diff_to_mean"] > 1e-4, s


def test_02_ex2_root_only_wraps_with_the_lessons_root_options():
    """--mixed-precision and --cpu-offload reach the root-only unit as they reach the lesson's
    root: the same fully_shard options (mesh, reshard_after_forward=False, the mixed-precision and
    offload policies), recorded in-process from both shard_model functions, no process group."""
    solution = load_script("02-fsdp/solutions/ex2_root_only.py")
    lesson = solution.transformer  # the fsdp_transformer module the solution loaded

    class Model:  # what shard_model reads of a GPT: its blocks
        blocks = ["block 0", "block 1"]

    calls = []
    real = lesson.fully_shard
    lesson.fully_shard = lambda module, **kw: calls.append((module, kw))
    try:
        for argv in ([], ["--mixed-precision", "bf16"], ["--cpu-offload"],
                     ["--mixed-precision", "bf16", "--cpu-offload"]):
            args = solution.parse_args(argv)
            model = Model()
            calls.clear()
            solution.per_block_shard_model(model, "full", "mesh", args, torch.device("cpu"))
            lesson_root = [kw for module, kw in calls if module is model]
            assert len(calls) == 3 and len(lesson_root) == 1, calls
            calls.clear()
            solution.root_only_shard_model(model, "full", "mesh", args, torch.device("cpu"))
            assert calls == [(model, lesson_root[0])], (argv, calls, lesson_root)
            assert ("mp_policy" in lesson_root[0]) == ("--mixed-precision" in argv)
            assert ("offload_policy" in lesson_root[0]) == ("--cpu-offload" in argv)
    finally:
        lesson.fully_shard = real

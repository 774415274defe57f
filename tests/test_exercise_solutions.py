"""The worked solutions of the exercises of lessons 03 and 04 compute what the READMEs' answers say.

The solutions are scripts in 03-deepspeed/solutions/ and 04-nccl-operations/solutions/ (each
launchable on its own, reusing the lesson script it extends) and documented commands of the
lessons' own scripts. Each test below runs the commands of one exercise verbatim, as the README
shows them (conftest.run_readme_command: the exit status and the quoted output are re-checked, and
test_readmes.py leaves these commands out), then checks the numbers they write against formulas
computed here: the ZeRO byte counts, the persistence rule, AdamW's tolerance
(conftest.assert_adamw_close), the count and size of the reduces, the closed forms of the
collectives, the bytes of the receive buffers.

Cost: one launch per exercise (two for exercise 5 of lesson 03, which also runs at world 3),
about 2 CPU-minutes in all on the 2-core machine; the DeepSpeed ones share one launch per
exercise by training several engines in one process.
"""

import itertools
import math

import pytest
from dtcourse.models import GPT

from conftest import (
    run_documented,
    REPO,
    assert_adamw_close,
    assert_state_dicts_equal,
    load_export,
    load_script,
    read_json,
    run_torchrun,
)

README_03 = REPO / "03-deepspeed" / "README.md"
INFERENCE_03 = REPO / "03-deepspeed" / "inference.md"  # exercise 6's solution
README_04 = REPO / "04-nccl-operations" / "README.md"
TIMEOUT = 240  # a DeepSpeed launch takes ~15 CPU seconds, minutes on a crowded 2-core machine

# The documented commands this file runs (test_readmes.py does not run them again).
EX1_03 = ("torchrun --nproc_per_node=2 03-deepspeed/solutions/ex1_accumulation_census.py "
          "--json-out runs/03-deepspeed/ex1_census.json")
EX2_03 = ("torchrun --nproc_per_node=2 03-deepspeed/solutions/ex2_persistence_threshold.py "
          "--json-out runs/03-deepspeed/ex2_persistence.json")
EX3_03 = ("torchrun --nproc_per_node=2 03-deepspeed/solutions/ex3_k_bias.py "
          "--json-out runs/03-deepspeed/ex3_k_bias.json --export runs/03-deepspeed/ex3_k_bias.pt")
EX5_03 = ("torchrun --nproc_per_node=2 03-deepspeed/solutions/ex5_bucketed_stage2.py "
          "--json-out runs/03-deepspeed/ex5_buckets.json --export runs/03-deepspeed/ex5.pt")
EX6_03_TRAIN = ("python 03-deepspeed/deepspeed_train.py --deepspeed_config "
                "03-deepspeed/configs/zero0_config.json --batch-size 16 --steps 400 "
                "--log-every 100 --export runs/03-deepspeed/model_400.pt")
EX6_03_INFER = "python 03-deepspeed/deepspeed_inference.py --weights runs/03-deepspeed/model_400.pt"
EX6_03_STRIDES = ("python 03-deepspeed/solutions/ex6_strides.py --weights "
                  "runs/03-deepspeed/model_400.pt --json-out runs/03-deepspeed/ex6_strides.json")
EX1_04 = ("torchrun --nproc_per_node=3 04-nccl-operations/solutions/ex1_all_to_all_100r.py "
          "--json-out runs/04-nccl-operations/ex1_collectives.json")
EX3_04 = ("torchrun --nproc_per_node=4 04-nccl-operations/solutions/ex3_naive_irecv_all.py "
          "--json-out runs/04-nccl-operations/ex3_naive.json")
EX4_04 = ("torchrun --nproc_per_node=2 "
          "04-nccl-operations/solutions/ex4_reduce_scatter_all_gather.py "
          "--json-out runs/04-nccl-operations/ex4_rs_ag.json")

SOLUTIONS = sorted(p.relative_to(REPO).as_posix()
                   for folder in ("01-ddp-basics", "02-fsdp", "03-deepspeed",
                                  "04-nccl-operations")
                   for p in (REPO / folder / "solutions").glob("*.py"))



@pytest.mark.parametrize("script", SOLUTIONS)
def test_every_solution_script_answers_help_with_its_docstring(script, capsys):
    """The script contract's --help, without a launch: the module's own parser, in this process."""
    module = load_script(script)
    with pytest.raises(SystemExit) as exit_:
        module.parse_args(["--help"])
    assert exit_.value.code == 0
    first_line = module.__doc__.split("\n")[0]
    assert " ".join(first_line.split()[:4]) in " ".join(capsys.readouterr().out.split())


def test_the_solutions_cover_every_exercise_that_asks_for_code():
    assert SOLUTIONS == [
        "01-ddp-basics/solutions/ex1_no_set_epoch.py",
        "01-ddp-basics/solutions/ex2_no_loss_division.py",
        "01-ddp-basics/solutions/ex3_rank0_barrier.py",
        "02-fsdp/solutions/ex2_root_only.py",
        "02-fsdp/solutions/ex4_keep_after_reduce.py",
        "02-fsdp/solutions/ex6_oss_zero_grad.py",
        "03-deepspeed/solutions/ex1_accumulation_census.py",
        "03-deepspeed/solutions/ex2_persistence_threshold.py",
        "03-deepspeed/solutions/ex3_k_bias.py",
        "03-deepspeed/solutions/ex5_bucketed_stage2.py",
        "03-deepspeed/solutions/ex6_strides.py",
        "04-nccl-operations/solutions/ex1_all_to_all_100r.py",
        "04-nccl-operations/solutions/ex3_naive_irecv_all.py",
        "04-nccl-operations/solutions/ex4_reduce_scatter_all_gather.py",
    ]


# --------------------------------------------------------------------------------------------------
# Lesson 03


def gpt_sizes() -> list[int]:
    """Element counts of deepspeed_train.py's GPT (vocab 64, seq 32, dim 64, 4 heads, 2 layers),
    in parameter order: the order of DeepSpeed's flat buffer at stages 1-2."""
    return [p.numel() for p in GPT(64, 32, 64, 4, 2).parameters()]


def test_03_ex1_stage1_holds_full_gradients_between_micro_steps_stage2_never():
    run_documented(REPO / "03-deepspeed" / "exercise_solutions.md", EX1_03,
                   "runs/03-deepspeed/ex1_census.json")
    data = read_json(REPO / "runs/03-deepspeed/ex1_census.json")
    sizes = gpt_sizes()
    P, N, B = sum(sizes), data["world_size"], data["bytes_per_element"]
    assert (P, N, B) == (data["n_params"], 2, 4)
    part = P // N  # stages 1-2 pad the flat buffer to a multiple of 2N elements: none here
    # While it accumulates, stage 2 keeps whole gradients of the parameters overlapping its
    # partition of the flat buffer (as tests/test_03_deepspeed.py computes it).
    bounds = list(itertools.pairwise(itertools.accumulate(sizes, initial=0)))
    overlap = [sum(b - a for a, b in bounds if a < (r + 1) * part and b > r * part)
               for r in range(N)]
    rows = {(row["stage"], row["grad_accum"]): row["grad_bytes_per_micro_step"]
            for row in data["rows"]}
    assert set(rows) == {(1, 1), (1, 4), (2, 1), (2, 4)}
    for rank in range(N):
        # stage 1: every backward but the last of the step leaves full gradients (4P)
        assert rows[1, 4][rank] == [B * P] * 3 + [B * part]
        assert rows[1, 1][rank] == [B * part]
        # stage 2: never full gradients; between micro-steps the overlapping tensors, whole
        assert rows[2, 4][rank] == [B * overlap[rank]] * 3 + [B * part]
        assert rows[2, 1][rank] == [B * part]
        assert max(rows[2, 4][rank]) < B * P
    assert overlap == [56_000, 70_592]  # the figures the README's answer quotes


def test_03_ex2_persistence_keeps_every_tensor_up_to_the_threshold_whole():
    run_documented(REPO / "03-deepspeed" / "exercise_solutions.md", EX2_03,
                   "runs/03-deepspeed/ex2_persistence.json")
    data = read_json(REPO / "runs/03-deepspeed/ex2_persistence.json")
    numel, N, B = data["numel"], data["world_size"], 4
    P = sum(numel.values())
    assert P == sum(gpt_sizes()) and max(numel.values()) == 16_384
    partitions = sum(math.ceil(n / N) for n in numel.values())  # every rank keeps its 1/N
    u = (N - 1) * B * P // N
    assert [run["threshold"] for run in data["runs"]] == [0, 5000, 20000]
    for run in data["runs"]:
        # DeepSpeed's rule (_zero_init_param): numel <= threshold persists, whole on every rank
        want = {name: n <= run["threshold"] for name, n in numel.items()}
        assert run["persistent"] == want, run["threshold"]
        whole = sum(n for name, n in numel.items() if want[name])
        assert run["param_bytes_per_rank"] == [B * (whole + partitions)] * N
        # the fp32 master and the two Adam moments stay partitioned whatever the threshold
        assert run["optim_bytes_per_rank"] == [3 * B * partitions] * N
        # the same bytes gathered in every case: before forward, or after the optimizer step
        assert run["all_gather_sent_bytes"] == u
    assert all(data["runs"][2]["persistent"].values())  # 20,000: every tensor of this GPT


def test_03_ex3_k_bias_gradient_is_rounding_and_adam_amplifies_it_below_eps():
    outputs = [f"runs/03-deepspeed/ex3_k_bias.{layout}.eps{eps}.pt"
               for layout in ("one_process", "data_parallel") for eps in ("1e-08", "1e-12")]
    run_documented(REPO / "03-deepspeed" / "exercise_solutions.md", EX3_03,
                   "runs/03-deepspeed/ex3_k_bias.json", *outputs)
    data = read_json(REPO / "runs/03-deepspeed/ex3_k_bias.json")
    grad = data["first_step_max_grad"]
    eps = 1e-8  # the configs' AdamW eps
    # zero in exact arithmetic: at float64 rounding, far below the q bias's gradient
    assert grad["float64"]["k.bias"] < 1e-12 * grad["float64"]["q.bias"]
    # float32's rounding noise is below eps (Adam's step is damped), bfloat16's above it
    assert grad["float32"]["k.bias"] < eps / 10 < eps < grad["bfloat16"]["k.bias"]

    def weights(layout, eps_name):
        return load_export(REPO / f"runs/03-deepspeed/ex3_k_bias.{layout}.eps{eps_name}.pt")

    lr, steps = data["lr"], data["steps"]
    dp8, one8 = weights("data_parallel", "1e-08"), weights("one_process", "1e-08")
    dp, one = weights("data_parallel", "1e-12"), weights("one_process", "1e-12")
    k_bias = [k for k in one if k.endswith("attn.k.bias")]
    assert len(k_bias) == 2
    others = [k for k in one if k not in k_bias]
    # eps 1e-8 (the course's): every tensor but the k biases agrees within the lesson tests'
    # tolerance. The k biases move by about lr x noise / eps per step, noise ~1e-11 in float32:
    # ~lr/1000, so the layouts' k biases end within 2 x steps x lr x 1e-2 of each other (10x
    # the noise ratio, as the noise differs by CPU: 4.6e-5 measured with this machine's
    # kernels, 5.0e-5 with ATEN_CPU_CAPABILITY=default, where 2 of 64 elements cross the
    # tolerance's rounding line and a lesson test would fail), far below the lr-sized steps of
    # eps 1e-12.
    assert_adamw_close({k: dp8[k] for k in others}, {k: one8[k] for k in others}, lr=lr,
                       steps=steps, msg="eps 1e-8, other tensors:")
    for key in k_bias:
        assert (dp8[key] - one8[key]).abs().max() <= 2 * steps * lr * 1e-2, key
    # eps 1e-12, below the noise: the k biases take lr-sized steps chosen by rounding, and the
    # tolerance catches them, while every other tensor still agrees
    assert_adamw_close({k: dp[k] for k in others}, {k: one[k] for k in others}, lr=lr,
                       steps=steps, msg="eps 1e-12, other tensors:")
    for key in k_bias:
        with pytest.raises(AssertionError, match="differ by more than rounding"):
            assert_adamw_close({key: dp[key]}, {key: one[key]}, lr=lr, steps=steps)


def tied_net_gradients(zfs) -> int:
    """Gradient tensors of zero_from_scratch.py's TiedNet per backward: the tied weight once, the
    frozen layer never."""
    model = zfs.TiedNet()
    return len({id(p) for p in model.parameters() if p.requires_grad})


def test_03_ex5_bucketed_stage2_equals_the_lesson_and_plain_adamw_with_fewer_reduces(tmp_path):
    variants = ("plain", "unbucketed", "bucketed16384", "bucketed65536")
    run_documented(README_03, EX5_03, "runs/03-deepspeed/ex5_buckets.json",
                   *[f"runs/03-deepspeed/ex5.{v}.pt" for v in variants])
    data = read_json(REPO / "runs/03-deepspeed/ex5_buckets.json")
    w = {v: load_export(REPO / f"runs/03-deepspeed/ex5.{v}.pt") for v in variants}
    zfs = load_script("03-deepspeed/zero_from_scratch.py")
    N, A = data["world_size"], data["grad_accum"]
    reduces = {v: r["reduce_bytes_last_step"] for v, r in data["variants"].items()}
    unbucketed = reduces["unbucketed"]
    assert len(unbucketed) == tied_net_gradients(zfs) * A  # one reduce per gradient per backward
    for size in data["bucket_bytes"]:
        bucketed = reduces[f"bucketed {size}"]
        assert sum(bucketed) == sum(unbucketed)  # the same bytes ...
        assert N * A <= len(bucketed) < len(unbucketed)  # ... in fewer, larger reduces
        assert max(bucketed) > max(unbucketed)
        # bucketing changes when gradients travel, not what each rank keeps
        assert data["variants"][f"bucketed {size}"]["state_bytes_per_rank"] == \
            data["variants"]["unbucketed"]["state_bytes_per_rank"]
        # World 2: each element is the sum of two numbers either way, and a + b == b + a
        # exactly, so bucketing changes no bit; against one process, AdamW's tolerance.
        assert_state_dicts_equal(w[f"bucketed{size}"], w["unbucketed"])
        assert_adamw_close(w[f"bucketed{size}"], w["plain"], lr=data["lr"], steps=data["steps"])
    assert len(reduces["bucketed 65536"]) == N * A  # a bucket per owner per backward, no fewer
    # the lesson test also runs at world 3: three owners, sums of three in gloo's order
    out = tmp_path / "w3.pt"
    run_torchrun("03-deepspeed/solutions/ex5_bucketed_stage2.py", "--bucket-bytes", "16K",
                 "--export", out, nproc=3, timeout=TIMEOUT)
    w3 = {v: load_export(tmp_path / f"w3.{v}.pt") for v in ("plain", "unbucketed",
                                                             "bucketed16384")}
    assert_adamw_close(w3["bucketed16384"], w3["plain"], lr=data["lr"], steps=data["steps"])
    assert_adamw_close(w3["bucketed16384"], w3["unbucketed"], lr=data["lr"], steps=data["steps"])


def test_03_ex6_after_400_steps_the_model_continues_the_prompts_with_their_strides():
    run_documented(INFERENCE_03, EX6_03_TRAIN, "runs/03-deepspeed/model_400.pt")
    run_documented(INFERENCE_03, EX6_03_INFER)
    run_documented(INFERENCE_03, EX6_03_STRIDES, "runs/03-deepspeed/ex6_strides.json")
    data = read_json(REPO / "runs/03-deepspeed/ex6_strides.json")
    prompts = data["prompts"]
    assert len(prompts) == 8
    for p in prompts:  # the data: arithmetic sequences modulo 64 with strides 1 to 7
        assert 1 <= p["stride"] <= 7
        assert p["data"] == [(p["prompt"][-1] + p["stride"] * (i + 1)) % 64 for i in range(8)]
    # Robust to other CPUs' rounding (which moves a 400-step run visibly, see the README): most
    # continuations follow their stride, and nearly every token after the first is predicted,
    # while the first, which cannot show its stride, mostly is not.
    assert sum(p["follows"] for p in prompts) >= 6
    assert data["later_positions_right"] >= 0.9 * data["later_positions"]
    assert data["first_position_right"] <= len(prompts) // 2


# --------------------------------------------------------------------------------------------------
# Lesson 04


def test_04_ex1_reduce_scatter_and_all_to_all_on_every_rank():
    run_documented(README_04, EX1_04, "runs/04-nccl-operations/ex1_collectives.json")
    rows = {row["op"]: row for row in read_json(REPO / "runs/04-nccl-operations/"
                                                       "ex1_collectives.json")}
    assert all(row["pass"] for row in rows.values()) and len(rows) == 12
    n = 3
    # rank r gets the sum over ranks k of x_k[r] = k + r: n r + n(n-1)/2; rank 2: 9
    assert rows["reduce_scatter(SUM)"]["results"] == [[n * r + n * (n - 1) / 2] for r in range(n)]
    assert rows["reduce_scatter(SUM)"]["results"][2] == [9]
    # rank r gets element r of every rank k's x_k[j] = 100 k + j
    assert rows["all_to_all"]["input"] == "x[j] = 100r + j, j < n"
    assert rows["all_to_all"]["results"] == [[100 * k + r for k in range(n)] for r in range(n)]


def test_04_ex3_all_receives_at_once_equal_naive_and_hold_n_minus_1_buffers():
    run_documented(README_04, EX3_04, "runs/04-nccl-operations/ex3_naive.json")
    data = read_json(REPO / "runs/04-nccl-operations/ex3_naive.json")
    for check in data["checks"]:
        assert check["pass"] and check["in_place"], check
        err = check["error_over_bound"]
        # the same additions in the same order as the lesson's naive version: the same result
        assert err["naive_irecv_all"] == err["naive"], check
    for size in data["sizes"]:
        n, S = size["world_size"], size["bytes"]
        alloc = size["allocated_bytes_per_rank"]
        assert n == 4
        assert alloc["naive_irecv_all"] == [(n - 1) * S] + [0] * (n - 1)
        assert alloc["naive"] == [S] + [0] * (n - 1)
        assert alloc["library"] == [0] * n  # gloo's own buffers are not torch tensors


def test_04_ex4_reduce_scatter_plus_all_gather_equals_all_reduce():
    run_documented(README_04, EX4_04, "runs/04-nccl-operations/ex4_rs_ag.json")
    rows = read_json(REPO / "runs/04-nccl-operations/ex4_rs_ag.json")["rows"]
    checks = [row for row in rows if row["kind"] == "check"]
    # numel 1 and 1009 are not multiples of the world size 2: the padding path runs too
    assert {row["numel"] for row in checks} == {1, 1009, 65536}
    for row in checks:
        assert row["pass"] and row["in_place"], row
        assert row["error_over_bound"]["rs+ag"] <= 1, row
    assert {row["algo"] for row in rows if row["kind"] == "time"} == {"library", "ring", "rs+ag"}

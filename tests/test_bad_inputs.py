"""Bad input across the lessons: each case is started as 2 ranks (or as many as
WORLDS says) with the variables torchrun sets, and EVERY rank must exit with status 2 after one
stderr line that names the problem, within seconds: the checks run before any collective, so no
rank is left waiting for a peer that already gave up (which would otherwise end only at the
collective timeout, minutes later). The table covers each lesson's kinds of bad input: batch,
device, world size against the data, missing data, unreadable checkpoints and weights, DeepSpeed
configs, and parallel degrees and shapes.

Ranks are started directly (`run_ranks`), not under torchrun, so each rank's own exit status and
stderr are visible.
"""

import pytest

from conftest import assert_bad_input, run_ranks

DS_TRAIN = "03-deepspeed/deepspeed_train.py"
HYBRID = "05-advanced/a-tensor-sequence-hybrid/hybrid_parallelism.py"

# (id, script, arguments, what the line must say). "{tmp}" is a per-test directory; files named
# in `FILES` are written there first.
CASES = [
    # bad batch
    ("batch-zero", "01-ddp-basics/ddp_training.py", ["--batch-size", "0"],
     r"--batch-size must be at least 1, got 0"),
    # a device this machine does not have (the suite runs with CUDA hidden)
    ("device-tpu", "01-ddp-basics/ddp_training.py", ["--device", "tpu"], r"invalid choice: 'tpu'"),
    ("device-cuda", "01-ddp-basics/ddp_training.py", ["--device", "cuda"],
     r"--device cuda was asked for, but CUDA is not available on this machine"),
    # world size larger than the data
    ("mnist-world", "01-ddp-basics/ddp_mnist.py", ["--batch-size", "4096"],
     r"4096 training images cannot give 2 ranks a batch of 4096"),
    # missing data
    ("mnist-missing", "01-ddp-basics/ddp_mnist.py",
     ["--dataset", "mnist", "--data-dir", "{tmp}/nowhere"], r"no MNIST in \S*nowhere"),
    # unreadable checkpoint / weights
    ("ckpt-is-a-file", "02-fsdp/fsdp_checkpoint.py", ["--ckpt-dir", "{tmp}/junk.pt"],
     r"--ckpt-dir \S*junk\.pt is a file, not a directory of checkpoints"),
    ("weights-corrupt", "03-deepspeed/deepspeed_inference.py", ["--weights", "{tmp}/junk.pt"],
     r"--weights \S*junk\.pt: not a readable state dict"),
    # bad config (malformed JSON, stage 4, inconsistent batch, a missing file)
    ("ds-json", DS_TRAIN, ["--deepspeed_config", "{tmp}/malformed.json"], r"malformed JSON"),
    ("ds-stage", DS_TRAIN, ["--deepspeed_config", "{tmp}/stage4.json"],
     r"zero_optimization\.stage must be 0, 1, 2 or 3, got 4"),
    ("ds-batch", DS_TRAIN, ["--deepspeed_config", "{tmp}/batch.json"],
     r"train_batch_size 64 != train_micro_batch_size_per_gpu 8 x gradient_accumulation_steps 1"
     r" x world size 2 = 16"),
    ("ds-missing", DS_TRAIN, ["--deepspeed_config", "{tmp}/missing.json"],
     r"--deepspeed_config \S*missing\.json: file not found"),
    # bad degrees and shapes
    ("fsdp-hybrid", "02-fsdp/fsdp_transformer.py", ["--strategy", "hybrid", "--shard-size", "3"],
     r"hybrid needs the world size \(2\) to be a multiple of .*--shard-size \(3\)"),
    ("fsdp-heads", "02-fsdp/fsdp_transformer.py", ["--heads", "5", "--dim", "64"],
     r"--heads 5 must divide --dim 64"),
    ("hybrid-degrees", HYBRID, ["--dp", "3", "--tp", "2"],
     r"--dp 3 x --tp 2 x --pp 1 = 6, but the world size is 4$"),  # at world 4 (WORLDS)
    ("tp-heads", HYBRID, ["--tp", "2", "--heads", "3", "--dim", "48"],
     r"--heads 3 is not divisible by --tp 2"),
    ("pp-layers", "05-advanced/b-pipeline-expert-context/pipeline_parallel.py", ["--layers", "1"],
     r"2 pipeline ranks x 1 stage\(s\) per rank = 2 stages, but --layers 1 gives fewer layers"),
    ("moe-experts", "05-advanced/b-pipeline-expert-context/expert_parallel.py", ["--experts", "3"],
     r"--experts 3 is not divisible by the world size 2"),
    ("bw-op", "04-nccl-operations/bandwidth_test.py", ["--ops", "all_sum"],
     r"--ops: unknown all_sum"),
]

# Cases run at another world size than 2.
WORLDS = {"hybrid-degrees": 4}

FILES = {
    "junk.pt": "not a checkpoint",
    "malformed.json": '{"zero_optimization": {"stage": 2,}}',
    "stage4.json": '{"zero_optimization": {"stage": 4}}',
    "batch.json": '{"train_batch_size": 64, "train_micro_batch_size_per_gpu": 8}',
}

# A rank that fails "within seconds": Python and torch start (~2 s each on this CPU, more when the
# suite runs two tests at once), then the check. A rank that reached a collective instead would
# wait for --timeout-s (120 s by default).
WITHIN_S = 30


def test_the_table_covers_at_least_twelve_cases_across_the_lessons():
    assert len(CASES) >= 12
    assert {script.split("/")[0] for _, script, _, _ in CASES} >= {
        "01-ddp-basics", "02-fsdp", "03-deepspeed", "04-nccl-operations", "05-advanced"}


@pytest.mark.parametrize("case,script,args,pattern", CASES, ids=[c[0] for c in CASES])
def test_bad_input_exits_2_with_one_line_on_every_rank(tmp_path, case, script, args, pattern):
    for name, content in FILES.items():
        (tmp_path / name).write_text(content)
    argv = [a.replace("{tmp}", str(tmp_path)) for a in args]
    world = WORLDS.get(case, 2)
    for rank, result in enumerate(run_ranks(script, *argv, world=world, timeout=WITHIN_S * 2)):
        assert_bad_input(result, rf"^\[rank {rank}\] error: .*{pattern}")
        assert result.elapsed < WITHIN_S, f"rank {rank} took {result.elapsed:.1f}s"

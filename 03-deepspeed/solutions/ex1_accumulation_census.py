"""Exercise 1 of lesson 03: when does each ZeRO stage hold full-size gradients?

Launch (from the repository root):
    torchrun --nproc_per_node=2 03-deepspeed/solutions/ex1_accumulation_census.py
    deepspeed --num_gpus 2 03-deepspeed/solutions/ex1_accumulation_census.py --accums 1,2,8
    python 03-deepspeed/solutions/ex1_accumulation_census.py      # 1 rank: every partition is whole

It trains the lesson's GPT with deepspeed_train.py's own engine (`build`), optimizer step
(`train_step`) and census (`memory_census`), once per ZeRO stage (1 and 2) and accumulation count
(1 and 4 micro-steps per optimizer step), all in one launch, and prints the gradient bytes each
rank holds after each micro-step's backward of the last step: what deepspeed_train.py writes to
its metrics as `grad_bytes_per_micro_step`. The same numbers come from four runs of

    deepspeed --num_gpus 2 03-deepspeed/deepspeed_train.py --deepspeed_config \\
        03-deepspeed/configs/zero1_config.json --grad-accum 4 --metrics-out zero1_accum4.json

and so on; one launch pays for importing DeepSpeed once instead of four times.
"""

import argparse
from pathlib import Path

from dtcourse import cli, launch, lessons, report
from dtcourse.data import rank_rows, token_batch
from dtcourse.models import GPT

SCRIPT = "03-deepspeed/solutions/ex1_accumulation_census.py"
LESSON = Path(__file__).resolve().parents[1]



train = lessons.load(LESSON / "deepspeed_train.py")


def census_of_one_step(args, d, deepspeed, stage: int, accum: int) -> list[int]:
    """Train args.steps optimizer steps of zeroN_config.json with `accum` micro-steps each; return
    this rank's gradient bytes after each backward of the last step."""
    path = LESSON / "configs" / f"zero{stage}_config.json"
    config = train.read_config(path)
    train.check_zero(path, config)
    run_args = argparse.Namespace(**{**vars(args), "deepspeed_config": path,
                                     "grad_accum": accum, "lr": None})
    train.fit_config(config, run_args, d)  # micro-batch, accumulation, derived global batch
    engine, model, _ = train.build(run_args, config, deepspeed)
    micro, global_bs = config["train_micro_batch_size_per_gpu"], config["train_batch_size"]
    census = []
    for step in range(args.steps):
        x, y = token_batch(args.seed, step, global_bs, args.seq_len, args.vocab)
        rows = rank_rows(d.rank, micro * accum)  # this rank's A micro-batches of B rows
        last = step == args.steps - 1
        # after each backward (before the engine's step): what this rank holds, by role
        measure = (lambda: census.append(train.memory_census(engine, model, config))) \
            if last else None
        train.train_step(engine, x[rows].to(d.device), y[rows].to(d.device), micro, accum,
                         d.device, measure)
    engine.destroy()
    return [c["grad_bytes"] for c in census]


def run(args, d, deepspeed) -> None:
    n_params = sum(p.numel() for p in GPT(args.vocab, args.seq_len, args.dim, args.heads,
                                          args.layers).parameters())
    width = 2 if args.precision == "bf16" else 4  # bytes per gradient element
    rows = []
    for stage in args.stage_list:
        for accum in args.accum_list:
            per_rank = report.gather(census_of_one_step(args, d, deepspeed, stage, accum))
            rows.append({"stage": stage, "grad_accum": accum,
                         "grad_bytes_per_micro_step": per_rank})
    full, part = width * n_params, width * n_params // d.world_size
    report.print0(f"gradient bytes after each micro-step's backward | world {d.world_size} | "
                  f"{args.precision} | P = {n_params:,}: full {full:,} B, 1/N {part:,} B")
    report.print0(f"{'config':<8}{'accum':>6}{'rank':>6}   after backward 1, 2, ... "
                  "(the last one ends the optimizer step)")
    for row in rows:
        for rank, sizes in enumerate(row["grad_bytes_per_micro_step"]):
            cells = "".join(f"{b:>10,}" + ("*" if b >= full else " ") for b in sizes)
            report.print0(f"zero{row['stage']:<4}{row['grad_accum']:>6}{rank:>6}   "
                          f"{cells}".rstrip())
    report.print0("* = a full-size gradient of every parameter")
    if d.rank == 0 and args.json_out:
        report.write_json(args.json_out, {
            "script": SCRIPT, "world_size": d.world_size, "n_params": n_params,
            "precision": args.precision, "bytes_per_element": width, "rows": rows})
    report.finish(args)


def parse_args(argv=None):
    p = cli.parser(__doc__)
    cli.add_run_args(p)
    cli.add_output_args(p, metrics=False, export=False, json_out=True)
    p.add_argument("--stages", default="1,2", help="ZeRO stages to measure (configs/zeroN)")
    p.add_argument("--accums", default="1,4", help="micro-steps per optimizer step to measure")
    p.add_argument("--steps", type=int, default=2, help="optimizer steps per run (the last is "
                                                        "measured)")
    p.add_argument("--batch-size", type=int,
                   help="samples per rank per micro-step (default: the config's 8)")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                   help="fp32 gives the lesson's byte table; bf16 halves every gradient")
    cli.add_gpt_args(p, layers=2, dim=64, heads=4, seq_len=32, vocab=64)
    p.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    cli.check_positive(args, "steps", "batch_size", "timeout_s")
    cli.check_gpt_args(args)
    try:
        args.stage_list = [int(s) for s in args.stages.split(",")]
        args.accum_list = [int(a) for a in args.accums.split(",")]
    except ValueError:
        cli.fail(f"--stages {args.stages!r} and --accums {args.accums!r} must be comma-separated "
                 "whole numbers")
    if not set(args.stage_list) <= {0, 1, 2, 3}:
        cli.fail(f"--stages {args.stages}: each must be 0, 1, 2 or 3")
    if min(args.accum_list) < 1:
        cli.fail(f"--accums {args.accums}: each must be at least 1")
    return args


def main(argv=None):
    args = parse_args(argv)
    with launch.distributed(args.device, args.timeout_s) as d:
        run(args, d, launch.start_deepspeed(d))


if __name__ == "__main__":
    main()

"""Exercise 2 of lesson 03: which parameters does stage3_param_persistence_threshold keep whole?

Launch (from the repository root):
    torchrun --nproc_per_node=2 03-deepspeed/solutions/ex2_persistence_threshold.py
    deepspeed --num_gpus 2 03-deepspeed/solutions/ex2_persistence_threshold.py --thresholds 0,100000

For each threshold it trains the lesson's GPT at ZeRO stage 3 (configs/zero3_config.json with only
`stage3_param_persistence_threshold` changed, the "copy" of the exercise), with deepspeed_train.py's
own engine, step and census, all in one launch, and prints, per size of parameter tensor, whether
DeepSpeed keeps it whole on every rank (persistent: `ds_persist`, set where numel <= threshold by
`_zero_init_param` in deepspeed/runtime/zero/partition_parameters.py) or only 1/N of it; then the
`param_bytes` and `optim_bytes` (fp32 master and Adam moments) rank 0 holds after the last
backward, and the all-gathers of the last step.
"""

import argparse
import contextlib
from collections import Counter
from pathlib import Path

from dtcourse import cli, launch, lessons, report
from dtcourse.comm import CollectiveCounter
from dtcourse.data import rank_rows, token_batch

SCRIPT = "03-deepspeed/solutions/ex2_persistence_threshold.py"
LESSON = Path(__file__).resolve().parents[1]
KEY = "stage3_param_persistence_threshold"



train = lessons.load(LESSON / "deepspeed_train.py")


def one_threshold(args, d, deepspeed, threshold: int) -> dict:
    """Train args.steps steps at stage 3 with this persistence threshold; return which parameters
    persisted, this rank's census after the last backward and the last step's all-gathers."""
    path = LESSON / "configs" / "zero3_config.json"
    config = train.read_config(path)
    config["zero_optimization"][KEY] = threshold  # the exercise's copy of the config
    run_args = argparse.Namespace(**{**vars(args), "deepspeed_config": path, "grad_accum": None,
                                     "lr": None})
    train.fit_config(config, run_args, d)
    engine, model, _ = train.build(run_args, config, deepspeed)
    micro, global_bs = config["train_micro_batch_size_per_gpu"], config["train_batch_size"]
    census, comms = [], {}
    for step in range(args.steps):
        x, y = token_batch(args.seed, step, global_bs, args.seq_len, args.vocab)
        rows = rank_rows(d.rank, micro)
        last = step == args.steps - 1
        measure = (lambda: census.append(train.memory_census(engine, model, config))) \
            if last else None
        # the last step's collectives: forward, backward and the optimizer step
        counter = CollectiveCounter() if last else contextlib.nullcontext()
        with counter:
            train.train_step(engine, x[rows].to(d.device), y[rows].to(d.device), micro, 1,
                             d.device, measure)
        if last:
            comms = counter.summary()
    gathers = comms.get("all_gather", {"calls": 0, "sent_bytes": 0})
    persistent = {name: bool(getattr(p, "ds_persist", False))
                  for name, p in model.named_parameters()}
    numel = {name: p.ds_numel for name, p in model.named_parameters()}
    engine.destroy()
    return {"threshold": threshold, "persistent": persistent, "numel": numel,
            "param_bytes": census[-1]["param_bytes"], "optim_bytes": census[-1]["optim_bytes"],
            "all_gather_calls": gathers["calls"],
            "all_gather_sent_bytes": gathers["sent_bytes"]}


def run(args, d, deepspeed) -> None:
    results = [one_threshold(args, d, deepspeed, t) for t in args.threshold_list]
    param_bytes = report.gather([r["param_bytes"] for r in results])  # [rank][threshold]
    optim_bytes = report.gather([r["optim_bytes"] for r in results])
    numel = results[0]["numel"]
    sizes = sorted(Counter(numel.values()).items())
    head = "".join(f"{f'threshold {t:,}':>18}" for t in args.threshold_list)
    report.print0(f"ZeRO-3 | world {d.world_size} | {args.precision} | "
                  f"{sum(numel.values()):,} parameters in {len(numel)} tensors")
    report.print0(f"{'tensor elements':>15}{'tensors':>9}{head}")
    for size, count in sizes:
        names = [n for n, k in numel.items() if k == size]
        cells = ""
        for r in results:
            kept = {r["persistent"][n] for n in names}  # one size: one verdict, see below
            cells += f"{'whole' if kept == {True} else '1/N' if kept == {False} else 'mixed':>18}"
        report.print0(f"{size:>15,}{count:>9}{cells}")
    report.print0(f"{'param_bytes, rank 0':>24}"
                  + "".join(f"{b:>18,}" for b in param_bytes[0]))
    report.print0(f"{'optim_bytes, rank 0':>24}"
                  + "".join(f"{b:>18,}" for b in optim_bytes[0]))
    report.print0(f"{'all-gathers in a step':>24}"
                  + "".join(f"{r['all_gather_calls']:>18}" for r in results))
    report.print0(f"{'all-gather bytes sent':>24}"
                  + "".join(f"{r['all_gather_sent_bytes']:>18,}" for r in results))
    if d.rank == 0 and args.json_out:
        report.write_json(args.json_out, {
            "script": SCRIPT, "world_size": d.world_size, "precision": args.precision,
            "numel": numel,
            "runs": [{"threshold": r["threshold"], "persistent": r["persistent"],
                      "param_bytes_per_rank": [b[i] for b in param_bytes],
                      "optim_bytes_per_rank": [b[i] for b in optim_bytes],
                      "all_gather_calls": r["all_gather_calls"],
                      "all_gather_sent_bytes": r["all_gather_sent_bytes"]}
                     for i, r in enumerate(results)]})
    report.finish(args)


def parse_args(argv=None):
    p = cli.parser(__doc__)
    cli.add_run_args(p)
    cli.add_output_args(p, metrics=False, export=False, json_out=True)
    p.add_argument("--thresholds", default="0,5000,20000",
                   help=f"values of {KEY} to compare (elements)")
    p.add_argument("--steps", type=int, default=2,
                   help="optimizer steps per threshold (the last is measured)")
    p.add_argument("--batch-size", type=int,
                   help="samples per rank per step (default: the config's 8)")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                   help="fp32 gives the lesson's byte table; bf16 halves the weights")
    cli.add_gpt_args(p, layers=2, dim=64, heads=4, seq_len=32, vocab=64)
    p.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    cli.check_positive(args, "steps", "batch_size", "timeout_s")
    cli.check_gpt_args(args)
    try:
        args.threshold_list = [int(float(t)) for t in args.thresholds.split(",")]
    except ValueError:
        cli.fail(f"--thresholds {args.thresholds!r}: give comma-separated element counts")
    if min(args.threshold_list) < 0:
        cli.fail(f"--thresholds {args.thresholds}: a threshold cannot be negative")
    return args


def main(argv=None):
    args = parse_args(argv)
    with launch.distributed(args.device, args.timeout_s) as d:
        run(args, d, launch.start_deepspeed(d))


if __name__ == "__main__":
    main()

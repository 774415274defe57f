"""Exercise 6 of lesson 03: does the trained GPT continue each prompt with that prompt's stride?

Launch (from the repository root; first train and export the model, see the README):
    python 03-deepspeed/deepspeed_train.py --deepspeed_config \\
        03-deepspeed/configs/zero0_config.json --batch-size 16 --steps 400 \\
        --export runs/03-deepspeed/model_400.pt
    python 03-deepspeed/solutions/ex6_strides.py --weights runs/03-deepspeed/model_400.pt
    torchrun --nproc_per_node=2 03-deepspeed/solutions/ex6_strides.py --weights ... --prompts 16

deepspeed_inference.py prints the greedy continuation of its first prompt and one accuracy over
all of them. This script takes --prompts prompts of the same kind, from the same step of the data
(a step no training run reaches: arithmetic sequences modulo the vocabulary, each with its own
stride from 1 to 7). The data draws all starts first, then all strides, so the default 8 share
the inference script's 4 starts but not their strides; --prompts 4 gives exactly its prompts.
For every prompt it continues the first 8 tokens greedily with the plain model (which
deepspeed_inference.py shows equal to DeepSpeed's engine), and splits the next-token accuracy by
position: the first token of a sequence says nothing about its stride, every later one does.
"""

import argparse
from pathlib import Path

import torch

from dtcourse import cli, launch, lessons, report
from dtcourse.data import token_batch

SCRIPT = "03-deepspeed/solutions/ex6_strides.py"
LESSON = Path(__file__).resolve().parents[1]



inference = lessons.load(LESSON / "deepspeed_inference.py")


@torch.no_grad()
def run(args, model, d) -> None:
    model = model.to(d.device)
    prompts, targets = token_batch(args.seed, inference.PROMPT_STEP, args.prompts, args.seq_len,
                                   args.vocab)
    prompts, targets = prompts.to(d.device), targets.to(d.device)
    # teacher-forced next-token predictions, (prompts, T): as deepspeed_inference.py's accuracy
    right = (model(prompts).argmax(-1) == targets).cpu()
    strides = ((prompts[:, 1] - prompts[:, 0]) % args.vocab).tolist()
    given = 8
    continued = inference.greedy(model, prompts[:, :given], given)[:, given:].cpu()
    rows = []
    report.print0(f"GPT from {args.weights} | {args.prompts} prompts of the data's kind | greedy "
                  f"continuation of their first {given} tokens")
    report.print0(f"{'prompt':>6}{'stride':>8}  {'first 8 tokens':34}{'greedy next 8':34}"
                  "follows its stride")
    for i in range(args.prompts):
        want = prompts[i, given:2 * given].cpu()
        follows = bool(torch.equal(continued[i], want))
        rows.append({"stride": strides[i], "prompt": prompts[i, :given].tolist(),
                     "greedy": continued[i].tolist(), "data": want.tolist(), "follows": follows})
        report.print0(f"{i:>6}{strides[i]:>8}  {str(prompts[i, :given].tolist()):34}"
                      f"{str(continued[i].tolist()):34}{'yes' if follows else 'no'}")
    first, later = int(right[:, 0].sum()), int(right[:, 1:].sum())
    # After 400 steps these counts depend on the CPU's kernels (their rounding moves a long run
    # visibly): marked with ~, like a timing.
    report.print0(f"continuations that follow their prompt's stride: "
                  f"~{sum(row['follows'] for row in rows)} of {args.prompts}")
    report.print0(f"next-token accuracy: first position (no stride to see yet) ~{first} of "
                  f"{args.prompts}; positions 2-{args.seq_len}: ~{later} of "
                  f"{right[:, 1:].numel()}; all: ~{(first + later) / right.numel():.1%}")
    if d.rank == 0 and args.json_out:
        report.write_json(args.json_out, {
            "script": SCRIPT, "weights": str(args.weights), "prompts": rows,
            "first_position_right": first, "later_positions_right": later,
            "later_positions": right[:, 1:].numel()})
    report.finish(args)


def parse_args(argv=None):
    p = cli.parser(__doc__)
    p.add_argument("--weights", type=Path, required=True,
                   help="plain fp32 state_dict written by deepspeed_train.py --export")
    cli.add_run_args(p)
    cli.add_output_args(p, metrics=False, export=False, json_out=True)
    cli.add_gpt_args(p, layers=2, dim=64, heads=4, seq_len=32, vocab=64)  # as trained
    p.add_argument("--prompts", type=int, default=8, help="prompts to continue")
    p.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not args.weights.is_file():
        cli.fail(f"--weights {args.weights}: no such file (write it with deepspeed_train.py "
                 "--export)")
    cli.check_positive(args, "prompts", "timeout_s")
    cli.check_gpt_args(args)
    if args.seq_len < 16:
        cli.fail(f"--seq-len {args.seq_len}: the prompts need 16 tokens (8 given, 8 to compare)")
    return args


def main(argv=None):
    args = parse_args(argv)
    model = inference.load_model(args)  # checked before any process group exists
    with launch.distributed(args.device, args.timeout_s) as d:
        run(args, model, d)


if __name__ == "__main__":
    main()

"""Exercise 3 of lesson 03: why a bias on the attention's k projection makes layouts disagree.

Launch (from the repository root):
    torchrun --nproc_per_node=2 03-deepspeed/solutions/ex3_k_bias.py
    torchrun --nproc_per_node=4 03-deepspeed/solutions/ex3_k_bias.py --steps 8 --export runs/kb.pt

The course's GPT (dtcourse.models) has no bias on k. This script gives it one again, in its own
copy of the model (dtcourse is not edited), and trains it two ways from the same weights on the
same global batches: as one process would (every rank computes the whole batch) and data-parallel
(each rank its rows, gradients averaged with an all-reduce, as DDP or ZeRO do). The only difference
between the two is the order in which the gradient's terms are added.

Why k's bias is special: the score of query i for key j is q_i . (k_j + b) = q_i . k_j + q_i . b.
The second term is the same for every key j of row i, and softmax does not change when a constant
is added to a whole row. So the loss does not depend on b: its gradient is exactly zero, and what
float32 computes is the rounding left when the row's softmax gradients (which sum to zero) are
added up. AdamW moves each coordinate by lr x m / (sqrt(v) + eps): for a gradient that is noise of
size sigma, about lr x sigma / (sigma + eps), in a direction the summation order picks. Where sigma
is far above eps (bfloat16 gradients, or a tiny eps) the two layouts move b by lr-sized amounts in
different directions while every other weight agrees to rounding; in float32 with the configs' eps
of 1e-8, sigma is far below eps and the steps shrink to about lr/1000. --eps takes both values.

--export PATH writes each layout's weights for each eps (PATH with .one_process.eps1e-08 and so on
before the suffix); tests/test_exercise_solutions.py holds them to the lesson tests' tolerance.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from dtcourse import cli, launch, report
from dtcourse.data import rank_rows, token_batch
from dtcourse.models import GPT, init_gpt

SCRIPT = "03-deepspeed/solutions/ex3_k_bias.py"
BETAS, WEIGHT_DECAY = (0.9, 0.95), 0.01  # lesson 03's configs (and eps 1e-8)


def gpt_with_k_bias(args, dtype=torch.float32, device="cpu") -> nn.Module:
    """The course's GPT with `attn.k.bias` added back (zeros, as init_gpt sets every bias)."""
    model = GPT(args.vocab, args.seq_len, args.dim, args.heads, args.layers)
    init_gpt(model, args.seed)
    for block in model.blocks:
        block.attn.k.bias = nn.Parameter(torch.zeros(args.dim))  # F.linear adds it from now on
    return model.to(device=device, dtype=dtype)


def loss_on(model, x, y):
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def one_process_grads(model, x, y) -> None:
    """Every rank: the mean loss over the whole global batch, one backward."""
    loss_on(model, x, y).backward()


def data_parallel_grads(model, x, y, d) -> None:
    """This rank's rows, then the average over ranks: the all-reduce DDP and ZeRO issue."""
    rows = rank_rows(d.rank, len(x) // d.world_size)
    loss_on(model, x[rows], y[rows]).backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)  # sum over ranks ...
        p.grad.div_(d.world_size)  # ... of per-rank means = the mean over the global batch


def train(args, d, layout: str, eps: float):
    """args.steps AdamW steps in one layout; the gradients of the first step and the weights."""
    model = gpt_with_k_bias(args, device=d.device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=BETAS, eps=eps,
                            weight_decay=WEIGHT_DECAY)
    first = None
    for step in range(args.steps):
        x, y = global_batch(args, d, step)
        if layout == "one_process":
            one_process_grads(model, x, y)
        else:
            data_parallel_grads(model, x, y, d)
        if first is None:
            first = {n: p.grad.detach().double().cpu() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    return first, {n: t.detach().cpu().clone() for n, t in model.state_dict().items()}


def global_batch(args, d, step: int):
    x, y = token_batch(args.seed, step, args.batch_size * d.world_size, args.seq_len, args.vocab)
    return x.to(d.device), y.to(d.device)


def first_gradient(args, d, dtype) -> dict:
    """max |gradient| per parameter at step 1, one-process layout, computed in `dtype`: float64
    shrinks k's bias to float64 rounding, bfloat16 (the configs' GPU precision) inflates it."""
    model = gpt_with_k_bias(args, dtype=dtype, device=d.device)
    loss_on(model, *global_batch(args, d, 0)).backward()
    return {n: p.grad.abs().max().item() for n, p in model.named_parameters()}


def beyond_rounding(a: torch.Tensor, b: torch.Tensor, args) -> int:
    """Elements whose two layouts differ by more than rounding: the lesson tests' threshold
    (tests/conftest.assert_adamw_close: 1e-6 + 1e-3 lr steps + 1e-5 relative)."""
    return int(((a - b).abs() > 1e-6 + 1e-3 * args.lr * args.steps + 1e-5 * b.abs()).sum())


KINDS = {"k.bias": "attn.k.bias", "q.bias": "attn.q.bias", "v.bias": "attn.v.bias",
         "k.weight": "attn.k.weight", "all others": None}


def names_of(kind: str, names) -> list[str]:
    suffix = KINDS[kind]
    if suffix is None:
        return [n for n in names if not n.endswith("attn.k.bias")]
    return [n for n in names if n.endswith(suffix)]


def run(args, d) -> None:
    grads = {"float64": first_gradient(args, d, torch.float64),
             "bfloat16": first_gradient(args, d, torch.bfloat16)}
    runs, weights = [], {}
    for eps in args.eps_list:
        g_one, w_one = train(args, d, "one_process", eps)
        g_dp, w_dp = train(args, d, "data_parallel", eps)
        weights[eps] = {"one_process": w_one, "data_parallel": w_dp}
        if eps == args.eps_list[0]:
            grads["float32"] = {n: g.abs().max().item() for n, g in g_one.items()}
            grads["float32 DP"] = {n: g.abs().max().item() for n, g in g_dp.items()}
            grads["|one - DP|"] = {n: (g_one[n] - g_dp[n]).abs().max().item() for n in g_one}
        runs.append({"eps": eps, "tensors": [
            {"tensor": kind, "elements": sum(w_one[n].numel() for n in names_of(kind, w_one)),
             "weight_difference": max((w_one[n] - w_dp[n]).abs().max().item()
                                      for n in names_of(kind, w_one)),
             "beyond_rounding": sum(beyond_rounding(w_dp[n], w_one[n], args)
                                    for n in names_of(kind, w_one))} for kind in KINDS]})

    report.print0(f"GPT with a bias on k | world {d.world_size} | {d.device.type} | global batch "
                  f"{args.batch_size * d.world_size} | AdamW lr {args.lr:g}, betas {BETAS}")
    report.print0("step 1, one process unless DP, max |gradient| over the layers "
                  "(~: rounding noise, its digits depend on the CPU):")
    report.print0(f"{'':11}" + "".join(f"{col:>12}" for col in grads))
    for kind in list(KINDS)[:-1]:
        cells = ""
        for col, g in grads.items():
            value = max(g[n] for n in names_of(kind, g))
            noise = kind == "k.bias" or col == "|one - DP|"
            cells += f"{fmt(value, noise):>12}"
        report.print0(f"{kind:11}{cells}")
    report.print0(f"after {args.steps} AdamW steps: max |w_one - w_DP| (elements beyond rounding)")
    report.print0(f"{'':11}" + "".join(f"{'eps ' + format(r['eps'], 'g'):>10}".ljust(28)
                                       for r in runs).rstrip())
    for i, kind in enumerate(KINDS):
        cells = "".join(f"{fmt(t['weight_difference'], True):>10} "
                        + f"(~{t['beyond_rounding']} of {t['elements']:,})".ljust(17)
                        for t in (r["tensors"][i] for r in runs))
        report.print0(f"{kind:11}{cells}".rstrip())
    if d.rank == 0 and args.json_out:
        report.write_json(args.json_out, {
            "script": SCRIPT, "world_size": d.world_size, "steps": args.steps, "lr": args.lr,
            "first_step_max_grad": {col: {kind: max(g[n] for n in names_of(kind, g))
                                          for kind in KINDS} for col, g in grads.items()},
            "runs": runs})
    if args.export and d.rank == 0:  # PATH.one_process.eps1e-08.pt, ...
        for eps, layouts in weights.items():
            for layout, w in layouts.items():
                report.save_state_dict(report.variant_path(args.export, f"{layout}.eps{eps:g}",
                                                           True), w)
    report.finish(args)


def fmt(value: float, noise: bool) -> str:
    return ("~" if noise else "") + f"{value:.1e}"


def parse_args(argv=None):
    p = cli.parser(__doc__)
    cli.add_run_args(p)
    cli.add_train_args(p, steps=4, batch_size=8, lr=1e-2, grad_accum=False)
    cli.add_output_args(p, metrics=False, export=True, json_out=True)
    cli.add_gpt_args(p, layers=2, dim=64, heads=4, seq_len=32, vocab=64)
    p.add_argument("--eps", default="1e-8,1e-12",
                   help="AdamW eps values to compare (the configs use 1e-8)")
    args = p.parse_args(argv)
    cli.check_positive(args, "steps", "batch_size", "lr", "timeout_s")
    cli.check_gpt_args(args)
    try:
        args.eps_list = [float(e) for e in args.eps.split(",")]
    except ValueError:
        cli.fail(f"--eps {args.eps!r}: give comma-separated numbers")
    if min(args.eps_list) < 0:
        cli.fail(f"--eps {args.eps}: eps cannot be negative")
    return args


def main(argv=None):
    args = parse_args(argv)
    with launch.distributed(args.device, args.timeout_s) as d:
        run(args, d)


if __name__ == "__main__":
    main()

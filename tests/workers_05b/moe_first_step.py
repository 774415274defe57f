"""Test worker (launched by tests/test_05b_pipeline_expert_context.py with python or torchrun):
the first training step of expert_parallel.py, through the script's own build() and
forward_backward(), with the script's flags. Rank 0 saves what a one-process MoE must reproduce:
the consolidated initial weights, the tokens of every rank, the MoE layer's outputs, which
(token, choice) assignments were dropped, and the consolidated gradients. Then, in the same group,
the script's own training run with the same flags (its train(), all that its main() does once the
group is up: --steps, --export, --metrics-out), which starts again from the seed: one launch serves
both checks.

    python tests/workers_05b/moe_first_step.py OUT.pt [expert_parallel.py flags]
"""

import importlib.util
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from dtcourse import launch, report

LESSON = Path(__file__).resolve().parents[2] / "05-advanced" / "b-pipeline-expert-context"
spec = importlib.util.spec_from_file_location(
    "expert_parallel", LESSON / "expert_parallel.py")
moe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(moe)


def main():
    out, args = Path(sys.argv[1]), moe.parse_args(sys.argv[2:])
    with launch.distributed(args.device, args.timeout_s) as d:
        model, _, replicated = moe.build(args, d)
        initial = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        _, stats, x = moe.forward_backward(args, d, model, replicated, step=0)
        parts = report.gather({
            "weights": initial, "x": x.cpu(), "moe_out": stats["moe_out"].detach().cpu(),
            "dropped": stats["dropped"].cpu(),
            "grads": {n: p.grad.detach().cpu() for n, p in model.named_parameters()}})
        if d.rank == 0:
            merged = {key: {k: v for part in parts for k, v in part[key].items()}
                      for key in ("weights", "grads")}
            for key in ("x", "moe_out", "dropped"):  # rank order = token order
                merged[key] = torch.cat([part[key] for part in parts])
            torch.save(merged, out)
        dist.barrier()
        moe.train(args, d)  # build() seeds again: the same initial weights as a fresh launch


if __name__ == "__main__":
    main()

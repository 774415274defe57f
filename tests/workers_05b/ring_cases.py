"""Test worker (launched by tests/test_05b_pipeline_expert_context.py with torchrun): ring
attention of ring_attention.py, with and without overlap, for every ring size W (on ranks 0..W-1,
the others waiting), sequence length T and mask. Rank 0 saves, keyed 'W{W}/T{T}/{full|causal}',
the inputs of the whole sequence (q, k, v and the upstream gradient dout), the ring's output and
q, k, v gradients gathered from the ranks, and the same four without overlap ('plain'). Then, in
the same group, the script's own measurement of the same cases with the same flags (its run(), all
that its main() does once the group is up: --repeats, --json-out): one launch serves both checks.

    torchrun --nproc_per_node=4 tests/workers_05b/ring_cases.py OUT.pt --ring-sizes 2,3,4 \
        --seq-lens 37,50 [--repeats 1 --json-out RING.json]
"""

import importlib.util
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from dtcourse import launch, report

LESSON = Path(__file__).resolve().parents[2] / "05-advanced" / "b-pipeline-expert-context"
spec = importlib.util.spec_from_file_location(
    "ring_attention", LESSON / "ring_attention.py")
ring_attention = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ring_attention)


def one_case(args, d, W, T, causal):
    q, k, v, dout = ring_attention.make_inputs(args.seed, T, args.batch, args.heads,
                                               args.head_dim, d.device)
    got = []
    if d.rank < W:
        ring = ring_attention.Ring(d.rank, W)
        lo, hi = ring_attention.bounds(T, W, d.rank)
        mine = [t[:, :, lo:hi] for t in (q, k, v, dout)]
        got = [t.cpu() for overlap in (True, False)
               for t in ring_attention.run_ring(*mine, T, causal, overlap, ring)]
    parts = [p for p in report.gather(got) if p]
    whole = [torch.cat([p[i] for p in parts], dim=2) for i in range(8)]
    return {"q": q.cpu(), "k": k.cpu(), "v": v.cpu(), "dout": dout.cpu(), "causal": causal,
            "out": whole[0], "dq": whole[1], "dk": whole[2], "dv": whole[3], "plain": whole[4:]}


def main():
    out, args = Path(sys.argv[1]), ring_attention.parse_args(sys.argv[2:])
    checks = {}
    with launch.distributed(args.device, args.timeout_s) as d:
        for W in args.ring_sizes or [d.world_size]:
            for T in args.seq_lens:
                for causal in (False, True):
                    checks[f"W{W}/T{T}/{'causal' if causal else 'full'}"] = \
                        one_case(args, d, W, T, causal)
        if d.rank == 0:
            torch.save(checks, out)
        dist.barrier()
        ring_attention.run(args, d)


if __name__ == "__main__":
    main()

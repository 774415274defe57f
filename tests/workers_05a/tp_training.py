"""Test worker (launched by tests/test_05a_tensor_sequence_hybrid.py with torchrun at world size 2):
training with 05-advanced/a-tensor-sequence-hybrid/tensor_parallel.py in its four variants (manual
or DTensor, with or without sequence parallelism), one after the other in one process group.

Each variant goes through the script's own parse_args and train, exactly as its main() does, with
the arguments given after `--`; only the process group is shared (one launch instead of four).
Variant V writes OUT/V/w.pt (--export) and OUT/V/m.json (--metrics-out); rank 0 prints
`=== variant V` before V's own output, so the test can read each variant's printed lines.
"""

import argparse
import importlib.util
import sys
from pathlib import Path

from dtcourse import launch

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location(
    "tensor_parallel", REPO / "05-advanced" / "a-tensor-sequence-hybrid" / "tensor_parallel.py")
tp_lesson = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tp_lesson)

VARIANTS = {"manual": [], "manual-sp": ["--sequence-parallel"],
            "dtensor": ["--impl", "dtensor"],
            "dtensor-sp": ["--impl", "dtensor", "--sequence-parallel"]}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    own, common = p.parse_known_args()
    if common[:1] == ["--"]:
        common = common[1:]
    runs = []
    for name in own.variants:
        (own.out / name).mkdir(parents=True, exist_ok=True)
        runs.append((name, tp_lesson.parse_args(
            [*VARIANTS[name], *common, "--export", str(own.out / name / "w.pt"),
             "--metrics-out", str(own.out / name / "m.json")])))
    first = runs[0][1]
    with launch.distributed(first.device, first.timeout_s) as d:
        for name, args in runs:
            if d.is_main:
                print(f"=== variant {name}", flush=True)
            tp_lesson.train(args, d)
            sys.stdout.flush()


if __name__ == "__main__":
    main()

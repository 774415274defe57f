"""Test worker (launched by tests/test_03_deepspeed.py with the deepspeed launcher at world size 2):
03-deepspeed/deepspeed_train.py trained with several configs, one after the other, in one process
group.

Each run goes through the script's own parse_args, read_config, check_zero, fit_config and train,
exactly as its main() does, with the arguments given after `--`; only the process group (and
DeepSpeed's adoption of it) is shared, one launch instead of one per config. `NAME=CONFIG` runs
CONFIG and writes OUT/NAME/model.pt (--export), OUT/NAME/metrics.json (--metrics-out) and
checkpoints under OUT/NAME/ckpt (--ckpt-dir); rank 0 prints `=== run NAME` before its output.
Each engine is destroyed (by train) before the next is built.
"""

import argparse
import importlib.util
import sys
from pathlib import Path

from dtcourse import launch

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("deepspeed_train",
                                              REPO / "03-deepspeed" / "deepspeed_train.py")
ds_train = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ds_train)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--runs", nargs="+", required=True, metavar="NAME=CONFIG")
    p.add_argument("--local_rank", "--local-rank", type=int)  # appended by the deepspeed launcher
    own, common = p.parse_known_args()
    if common[:1] == ["--"]:
        common = common[1:]
    runs = []
    for spec_ in own.runs:
        name, config_path = spec_.split("=", 1)
        out = own.out / name
        out.mkdir(parents=True, exist_ok=True)
        args = ds_train.parse_args(["--deepspeed_config", config_path, *common,
                                    "--ckpt-dir", str(out / "ckpt"), "--export",
                                    str(out / "model.pt"), "--metrics-out",
                                    str(out / "metrics.json")])
        config = ds_train.read_config(args.deepspeed_config)
        ds_train.check_zero(args.deepspeed_config, config)
        runs.append((name, args, config))
    first = runs[0][1]
    with launch.distributed(first.device, first.timeout_s) as d:
        for name, args, config in runs:
            if d.is_main:
                print(f"=== run {name}", flush=True)
            ds_train.fit_config(config, args, d)
            deepspeed = launch.start_deepspeed(d)
            ds_train.train(args, config, d, deepspeed)
            sys.stdout.flush()


if __name__ == "__main__":
    main()

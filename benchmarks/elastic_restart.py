"""What one failure costs under torchrun's elastic restarts.

Runs 01-ddp-basics/ddp_training.py twice under `torchrun --standalone --max-restarts 1`: once
clean, once with rank --fail-rank raising at --fail-at-step. Every output line is timestamped as it
arrives, which gives:

    detect + restart   from the failing rank's error to the restarted ranks' first step
    wall time lost     elapsed(faulty run) - elapsed(clean run): restart + the steps redone since
                       the last checkpoint

    python benchmarks/elastic_restart.py --json-out runs/elastic_restart.json
"""

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from dtcourse import cli
from dtcourse.cli import fail

SCRIPT = Path(__file__).resolve().parents[1] / "01-ddp-basics" / "ddp_training.py"


def parse_args(argv=None):
    p = cli.parser(__doc__)
    p.add_argument("--nproc", type=int, default=2, help="ranks")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--ckpt-every", type=int, default=100)
    p.add_argument("--fail-at-step", type=int, default=250)
    p.add_argument("--fail-rank", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json-out", type=Path)
    args = p.parse_args(argv)
    if not 0 < args.fail_at_step <= args.steps or args.ckpt_every < 1 or args.repeats < 1:
        fail("need 0 < --fail-at-step <= --steps, --ckpt-every >= 1, --repeats >= 1")
    if not 0 <= args.fail_rank < args.nproc:
        fail(f"--fail-rank {args.fail_rank} does not exist with --nproc {args.nproc}")
    return args


def timed_run(args, ckpt_dir: Path, inject: bool) -> dict:
    """Run torchrun, timestamp every line of stdout/stderr, return the events we need."""
    cmd = ["torchrun", "--standalone", f"--nproc_per_node={args.nproc}", "--max-restarts=1",
           str(SCRIPT), "--steps", str(args.steps), "--log-every", "1", "--ckpt-dir",
           str(ckpt_dir), "--ckpt-every", str(args.ckpt_every)]
    if inject:
        cmd += ["--fail-at-step", str(args.fail_at_step), "--fail-rank", str(args.fail_rank)]
    env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", PYTHONUNBUFFERED="1")
    lines = []  # (time, stream, text)
    t0 = time.monotonic()  # host clock: when the launcher's lines arrive
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)

    def pump(stream, name):
        for line in stream:
            lines.append((time.monotonic() - t0, name, line.rstrip()))  # host clock: as above

    threads = [threading.Thread(target=pump, args=(proc.stdout, "out")),
               threading.Thread(target=pump, args=(proc.stderr, "err"))]
    for t in threads:
        t.start()
    proc.wait()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - t0  # host clock: the whole launch
    if proc.returncode != 0:
        tail = "\n".join(text for _, _, text in lines[-30:])
        sys.exit(f"torchrun failed ({'with' if inject else 'without'} the fault):\n{tail}")
    result = {"elapsed_s": elapsed}
    if inject:
        t_fail = next(t for t, _, text in lines if "injected failure" in text)
        t_resumed = next(t for t, _, text in lines if text.startswith("resumed from step"))
        resumed = int(re.search(r"resumed from step (\d+)", next(
            text for _, _, text in lines if text.startswith("resumed from step"))).group(1))
        t_first = next(t for t, _, text in lines
                       if t > t_resumed and text.startswith("step ") and "|" in text)
        result.update(fail_to_first_step_s=t_first - t_fail, resumed_from_step=resumed,
                      steps_redone=args.fail_at_step - 1 - resumed)
    return result


def main(argv=None):
    args = parse_args(argv)
    rows = []
    for i in range(args.repeats):
        with tempfile.TemporaryDirectory() as clean_dir, tempfile.TemporaryDirectory() as bad:
            clean = timed_run(args, Path(clean_dir), inject=False)
            faulty = timed_run(args, Path(bad), inject=True)
        row = {"repeat": i, "clean_s": clean["elapsed_s"], "faulty_s": faulty["elapsed_s"],
               "lost_s": faulty["elapsed_s"] - clean["elapsed_s"],
               "fail_to_first_step_s": faulty["fail_to_first_step_s"],
               "resumed_from_step": faulty["resumed_from_step"],
               "steps_redone": faulty["steps_redone"]}
        rows.append(row)
        print(f"repeat {i}: clean {row['clean_s']:.1f} s, with one failure "
              f"{row['faulty_s']:.1f} s (lost {row['lost_s']:.1f} s); failure -> first step "
              f"after restart {row['fail_to_first_step_s']:.1f} s; resumed from step "
              f"{row['resumed_from_step']}, {row['steps_redone']} steps redone", flush=True)
    med = {k: statistics.median(r[k] for r in rows)
           for k in ("clean_s", "faulty_s", "lost_s", "fail_to_first_step_s")}
    print(f"median over {args.repeats}: failure -> first step after restart "
          f"{med['fail_to_first_step_s']:.1f} s, wall time lost {med['lost_s']:.1f} s "
          f"(clean run {med['clean_s']:.1f} s)")
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps({"config": vars(args) | {"json_out": None},
                                             "runs": rows, "median": med}, indent=1))


if __name__ == "__main__":
    main()

"""DDP internals, each shown by running it: find_unused_parameters, static_graph,
gradient_as_bucket_view, bucket_cap_mb, SyncBatchNorm, uneven inputs with Join, and the built-in
compression hooks. Every demo trains a tiny model for a few SGD steps and checks what it claims.

Each demo is a file of internals/ that runs on its own (read them there; the page
ddp_internals.md walks through them). This driver runs all of them, or one, in one launch:
    torchrun --nproc_per_node=2 01-ddp-basics/ddp_internals.py                    # every demo
    torchrun --nproc_per_node=2 01-ddp-basics/ddp_internals.py --demo join        # one of them
    torchrun --nproc_per_node=2 01-ddp-basics/ddp_internals.py --json-out runs/ddp_internals.json
    torchrun --nproc_per_node=4 01-ddp-basics/ddp_internals.py --bucket-caps none,0.5,4
    torchrun --nproc_per_node=8 01-ddp-basics/ddp_internals.py --device cuda   # nn.SyncBatchNorm
    python 01-ddp-basics/ddp_internals.py --demo bucket_cap_mb                   # one process

`--export runs/w.pt` writes the plain state dict of each model a demo trains under DDP, one file per
model: runs/w.find_unused_parameters.pt, runs/w.join.pt, runs/w.comm_hooks_bf16.pt, ...

The demos (`--demo NAME`, or all of them), and their files:
    find_unused_parameters   internals/unused_parameters.py: a parameter that forward never uses:
                             default DDP raises at the next step; the flag fixes it, at the price
                             of a graph traversal and one more all-reduce every step
    static_graph             internals/static_graph.py: the same model without that per-step
                             price: DDP learns the unused set in step 1 and reuses it
    gradient_as_bucket_view  internals/bucket_view.py: .grad as views into the all-reduce buckets:
                             4 bytes per parameter fewer, counted from the tensors' storages
    bucket_cap_mb            internals/bucket_cap.py: how many all-reduces a step launches,
                             predicted from the parameter sizes and counted
    sync_batchnorm           internals/sync_batchnorm.py: BatchNorm statistics over the global
                             batch (nn.SyncBatchNorm, or on a CPU, where torch has no kernel for
                             it, the same math written out)
    join                     internals/join.py: ranks with different numbers of batches, under
                             Join: no hang, and the model DDP computes, rebuilt in one process
    comm_hooks               internals/comm_hooks.py: torch's bf16 and fp16 compression hooks:
                             half the bytes, and a weight difference bounded by the format's
                             rounding

Each demo compares with one process where one process is the claim: every rank trains the plain
model on the whole global batch beside DDP, from the same seed, and the difference is printed.
"""

import sys
from pathlib import Path

# The demos live in internals/ and import their shared module as `common` (a script launched by
# path has its own folder on sys.path; this driver puts that folder there too).
sys.path.insert(0, str(Path(__file__).resolve().parent / "internals"))

import bucket_cap  # noqa: E402
import bucket_view  # noqa: E402
import comm_hooks  # noqa: E402
import common  # noqa: E402
import join  # noqa: E402
import static_graph  # noqa: E402
import sync_batchnorm  # noqa: E402
import unused_parameters  # noqa: E402

SCRIPT = "01-ddp-basics/ddp_internals.py"
MODULES = [unused_parameters, static_graph, bucket_view, bucket_cap, sync_batchnorm, join,
           comm_hooks]
DEMOS = [m.DEMO.name for m in MODULES]  # find_unused_parameters, static_graph, ...


def main(argv=None):
    common.main(__doc__, SCRIPT, [m.DEMO for m in MODULES], argv)


if __name__ == "__main__":
    main()

"""What FSDP2 is built from, one piece at a time: a DeviceMesh, a DTensor and its placements
(Shard, Replicate, Partial), redistribute and the collective it runs, a model built on the meta
device and materialised shard by shard, and what torch.distributed.checkpoint (DCP) writes.

Launch (from the repository root):
    torchrun --nproc_per_node=4 02-fsdp/dtensor_primer.py --ckpt-dir runs/dtensor_primer_ckpt
    torchrun --nproc_per_node=2 02-fsdp/dtensor_primer.py                # any n from 1 to 4 on CPU
    torchrun --nproc_per_node=4 02-fsdp/dtensor_primer.py --device cuda  # NCCL

Every rank runs the same program on its own part of each tensor; rank 0 gathers what every rank
holds (all_gather_object) and prints it. The 2-D mesh is (n/2, 2) for an even n, (n, 1) otherwise.
Without --ckpt-dir the checkpoint goes to a temporary directory, removed at the end.
"""

import shutil
import tempfile
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

from dtcourse import cli, launch, report
from dtcourse.comm import CollectiveCounter
from dtcourse.models import GPT, init_gpt

try:  # public since torch 2.6; torch.distributed._composable.fsdp before
    from torch.distributed.fsdp import fully_shard
except ImportError:
    from torch.distributed._composable.fsdp import fully_shard

SCRIPT = "02-fsdp/dtensor_primer.py"


# --------------------------------------------------------------------------------------------------
# 1. DeviceMesh: the ranks arranged as an n-D array; each dimension is a process group


def meshes(d):
    """A 1-D mesh over all ranks and a 2-D one, rows named 'dp' and columns 'tp'."""
    n = d.world_size
    mesh1 = init_device_mesh(d.device.type, (n,), mesh_dim_names=("dp",))
    shape = (n // 2, 2) if n % 2 == 0 else (n, 1)
    mesh2 = init_device_mesh(d.device.type, shape, mesh_dim_names=("dp", "tp"))
    # mesh2["dp"] is this rank's column of the array (the ranks it shares a tp index with), and
    # mesh2["tp"] its row: a collective over one dimension runs inside that group only.
    mine = {"coordinate": list(mesh2.get_coordinate()),
            "dp_group": mesh2["dp"].mesh.tolist(), "tp_group": mesh2["tp"].mesh.tolist()}
    return mesh1, mesh2, mine


# --------------------------------------------------------------------------------------------------
# 2. Placements: what each rank holds of one global tensor


def placements(mesh1, mesh2, device) -> dict:
    """A = arange(16) as (4, 4), distributed four ways; this rank's to_local() of each."""
    a = torch.arange(16.0, device=device).reshape(4, 4)
    # distribute_tensor: rank 0's `a` is the source; every rank receives only its own part.
    cases = {"Shard(0)": distribute_tensor(a, mesh1, [Shard(0)]),       # rows split like chunk
             "Shard(1)": distribute_tensor(a, mesh1, [Shard(1)]),       # columns
             "Replicate()": distribute_tensor(a, mesh1, [Replicate()]),  # a full copy each
             "(Shard(0), Shard(1))": distribute_tensor(a, mesh2, [Shard(0), Shard(1)])}
    mine = {name: t.to_local().tolist() for name, t in cases.items()}
    mine["shapes"] = {name: list(t.to_local().shape) for name, t in cases.items()}
    # 5 rows over 4 ranks: torch.chunk's split, 2 2 1 0 (DTensor does not pad; FSDP2 pads its
    # own flat buffers so that the all-gather gets equal pieces).
    uneven = distribute_tensor(torch.arange(20.0, device=device).reshape(5, 4), mesh1, [Shard(0)])
    mine["uneven_rows"] = uneven.to_local().shape[0]
    assert cases["Shard(0)"].placements == (Shard(0),) and cases["Shard(0)"].shape == (4, 4)
    return mine


# --------------------------------------------------------------------------------------------------
# 3. Partial: a sum still owed, and the collective that settles it


def counted(fn):
    """fn()'s result, and the collectives it ran as two counters see them at the dispatcher: the
    course's CollectiveCounter (kind, bytes, group size) and torch's CommDebugMode (op names)."""
    with CollectiveCounter() as comm, CommDebugMode() as debug:
        out = fn()
    ops = {str(op).split(".")[-1]: int(c) for op, c in debug.get_comm_counts().items() if c}
    return out, {"counter": comm.summary(), "comm_debug_mode": ops}


def partial_sums(mesh1, device) -> dict:
    """y = A @ B with A's columns and B's rows on the same ranks: each rank multiplies its slices
    and holds one term of the sum, so y is Partial(sum) and nothing was sent. Settling it is a
    collective: to Replicate() an all-reduce, to Shard(0) a reduce-scatter. Beside them, the
    transitions of a plain sharded tensor, for comparison."""
    a_full = torch.arange(16.0, device=device).reshape(4, 4)
    a = distribute_tensor(a_full, mesh1, [Shard(1)])
    b = distribute_tensor(torch.ones(4, 1, device=device), mesh1, [Shard(0)])
    y, counts = counted(lambda: a @ b)  # (4, 1): rank r computes A[:, cols r] @ B[rows r, :]
    rows = distribute_tensor(a_full, mesh1, [Shard(0)])
    full = distribute_tensor(a_full, mesh1, [Replicate()])
    redist = {}
    _, redist["Shard(0) -> Replicate()"] = counted(lambda: rows.redistribute(mesh1, [Replicate()]))
    _, redist["Replicate() -> Shard(0)"] = counted(lambda: full.redistribute(mesh1, [Shard(0)]))
    replicated, redist["Partial(sum) -> Replicate()"] = counted(
        lambda: y.redistribute(mesh1, [Replicate()]))  # every rank gets the whole sum
    sharded, redist["Partial(sum) -> Shard(0)"] = counted(
        lambda: y.redistribute(mesh1, [Shard(0)]))  # rank r gets row r of the sum
    return {"placement": repr(y.placements[0]), "matmul": counts,
            "partial": y.to_local().flatten().tolist(),
            "replicated": replicated.to_local().flatten().tolist(),
            "sharded": sharded.to_local().flatten().tolist(), "redistribute": redist}


# --------------------------------------------------------------------------------------------------
# 4. The meta device: shapes without memory, sharded, then materialised shard by shard


def real_bytes(tensors) -> int:
    """Bytes of storage on a real device this rank holds for `tensors` (a DTensor: its shard)."""
    locals_ = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
    return sum(t.numel() * t.element_size() for t in locals_ if t.device.type != "meta")


def meta_init(mesh1, device, seed: int):
    """The GPT of fsdp_transformer.py built on meta, sharded by fully_shard, then to_empty() and
    filled. Returns the model and this rank's numbers at each stage."""
    with torch.device("meta"):  # parameters get shapes and dtypes, and no storage at all
        model = GPT()
    params = list(model.parameters())
    mine = {"numel": sum(p.numel() for p in params),
            "full_bytes": sum(p.numel() * p.element_size() for p in params),
            "bytes_on_meta": real_bytes(params)}
    for block in model.blocks:  # one FSDP unit per block, then the root, as lesson 02 does
        fully_shard(block, mesh=mesh1)
    fully_shard(model, mesh=mesh1)
    params = list(model.parameters())  # fully_shard replaced them by DTensors (still on meta)
    mine["bytes_after_fully_shard"] = real_bytes(params)
    mine["shard_bytes_planned"] = sum(p.to_local().numel() * p.element_size() for p in params)
    model.to_empty(device=device)  # storage for this rank's shards only, uninitialised
    # Fill each shard with its rows of the full initial tensor (dtcourse.models.init_gpt), the
    # same values at every world size. (reset_parameters() would draw random values through
    # DTensor's RNG, which torch 2.14 supports only on devices whose torch module has
    # set_rng_state (CUDA and CUDA-like accelerators; torch.cpu has none): on a CPU mesh every
    # rank draws the same numbers for its own shard.)
    init_gpt(model, seed)
    mine["bytes_after_to_empty"] = real_bytes(model.parameters())
    return model, mine


# --------------------------------------------------------------------------------------------------
# 5. DCP: every rank writes its own shards; a load reshards them to whatever layout asks


def checkpoint(model, mesh2, ckpt: Path, rank: int) -> dict:
    """Save the sharded state dict, list the files, reload it at world n into another layout,
    then on rank 0 alone (world 1) into plain tensors; compare both with the saved values."""
    state = {"model": model.state_dict()}  # name -> DTensor (this rank's rows)
    dcp.save(state, checkpoint_id=str(ckpt))  # collective; rank 0 writes .metadata last
    dist.barrier()
    files = [{"name": f.name, "bytes": f.stat().st_size} for f in sorted(ckpt.iterdir())]
    full = {k: v.full_tensor() for k, v in state["model"].items()}  # all-gather, for comparing

    # The hybrid layout of 2-D mesh: replicated over dp, sharded over tp. Each rank reads only
    # the byte ranges of the saved shards that overlap the rows it now holds.
    target = {"model": {k: distribute_tensor(torch.zeros_like(v), mesh2, [Replicate(), Shard(0)])
                        for k, v in full.items()}}
    dcp.load(target, checkpoint_id=str(ckpt))
    reloaded_n = all(torch.equal(target["model"][k].full_tensor(), full[k]) for k in full)

    reloaded_1 = None
    if rank == 0:  # one process, no process group: the n shards become plain full tensors
        plain = {"model": {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in full.items()}}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process"
            dcp.load(plain, checkpoint_id=str(ckpt), no_dist=True)
        reloaded_1 = all(torch.equal(plain["model"][k], full[k].cpu()) for k in full)
    dist.barrier()
    return {"files": files, "tensors": len(full), "reloaded_world_n": reloaded_n,
            "reloaded_world_1": reloaded_1}


def checkpoint_dir(args, rank: int) -> tuple[Path, bool]:
    """--ckpt-dir (its old DCP files removed first), or a temporary directory that rank 0 makes
    and names to everyone. Returns (path, temporary?)."""
    name = [None]
    if rank == 0:
        if args.ckpt_dir is None:
            name[0] = tempfile.mkdtemp(prefix="dtensor_primer_")
        else:
            args.ckpt_dir.mkdir(parents=True, exist_ok=True)
            for old in [*args.ckpt_dir.glob("*.distcp"), args.ckpt_dir / ".metadata"]:
                old.unlink(missing_ok=True)  # a checkpoint of another world size leaves more files
            name[0] = str(args.ckpt_dir)
    dist.broadcast_object_list(name, src=0)
    return Path(name[0]), args.ckpt_dir is None


# --------------------------------------------------------------------------------------------------
# Report, arguments and launch


def fmt(x) -> str:
    """Nested lists of whole floats as [[0, 1], [4, 5]]."""
    if isinstance(x, list):
        return "[" + ", ".join(fmt(v) for v in x) + "]"
    return f"{x:g}"


def table(rows) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


def summary_words(summary: dict) -> str:
    if not summary:
        return "no collective"
    return ", ".join(f"{s['calls']} {kind} of {s['tensor_bytes']} bytes over "
                     f"{'/'.join(map(str, s['group_sizes']))} ranks" for kind, s in summary.items())


def print_report(d, res) -> None:
    n, ranks = d.world_size, range(d.world_size)
    mesh, place, part, meta, ck = (res[k] for k in ("mesh", "placements", "partial", "meta", "dcp"))
    dp, tp = res["mesh2_shape"]
    print(f"dtensor_primer | world {n} | device {d.device} | backend {d.backend}")

    print(f"\n1. DeviceMesh: 1-D (dp={n}) over ranks {list(ranks)}; 2-D (dp={dp}, tp={tp}) = "
          f"{res['mesh2_ranks']}")
    table([("rank", "coordinate (dp, tp)", "mesh2['dp'] group", "mesh2['tp'] group")] +
          [(str(k), str(tuple(mesh[k]["coordinate"])), fmt(mesh[k]["dp_group"]),
            fmt(mesh[k]["tp_group"])) for k in ranks])

    print("\n2. A = arange(16).reshape(4, 4) distributed with distribute_tensor; each rank's "
          "to_local():")
    for name in ("Shard(0)", "Shard(1)", "Replicate()", "(Shard(0), Shard(1))"):
        where = "the 2-D mesh" if name.startswith("(") else "the 1-D mesh"
        print(f"{name} on {where}")
        table([("rank", "local shape", "local values")] +
              [(str(k), str(tuple(place[k]["shapes"][name])), fmt(place[k][name]))
               for k in ranks])
    rows = [place[k]["uneven_rows"] for k in ranks]
    print(f"Shard(0) of a (5, 4) tensor: local rows per rank {rows} (torch.chunk's split; "
          f"DTensor does not pad)")

    print(f"\n3. y = A @ B, A as Shard(1), B = ones(4, 1) as Shard(0): "
          f"y is {part[0]['placement']}, computed with "
          f"{summary_words(part[0]['matmul']['counter'])}")
    table([("rank", "y.to_local() (a term of the sum)", "after redistribute to Replicate()",
            "to Shard(0)")] +
          [(str(k), fmt(part[k]["partial"]), fmt(part[k]["replicated"]), fmt(part[k]["sharded"]))
           for k in ranks])
    table([("redistribute", "collectives (CollectiveCounter)", "CommDebugMode")] +
          [(move, summary_words(c["counter"]),
            ", ".join(f"{v} {k}" for k, v in c["comm_debug_mode"].items()) or "none")
           for move, c in part[0]["redistribute"].items()])

    m0 = meta[0]
    print(f"\n4. GPT() built under torch.device('meta'): {m0['numel']:,} parameters, "
          f"{m0['full_bytes']:,} bytes once materialised")
    table([("rank", "held: built on meta", "held: fully_shard on meta", "its shard's size (bytes)",
            "held: to_empty + init")] +
          [(str(k), f"{meta[k]['bytes_on_meta']:,}", f"{meta[k]['bytes_after_fully_shard']:,}",
            f"{meta[k]['shard_bytes_planned']:,}", f"{meta[k]['bytes_after_to_empty']:,}")
           for k in ranks])
    held = sum(meta[k]["bytes_after_to_empty"] for k in ranks)
    once = "the model exactly once" if held == m0["full_bytes"] else \
        f"{held / m0['full_bytes']:.3g} x the model"
    print(f"the {n} ranks together hold {held:,} bytes, {once}; rank 0 holds "
          f"{meta[0]['bytes_after_to_empty'] / m0['full_bytes']:.3g} of it")

    where = "--ckpt-dir" if not res["ckpt_temporary"] else "a temporary directory"
    print(f"\n5. dcp.save of the sharded state dict ({ck['tensors']} DTensors) into {where}:")
    # ~: the index's size depends on the directory's name and on Python's pickle; the shard
    # files' sizes only on the tensors
    table([("file", "bytes")] + [(f["name"], ("~" if f["name"] == ".metadata" else "")
                                   + f"{f['bytes']:,}") for f in ck["files"]])
    print(f"reloaded at world {n} as (Replicate(), Shard(0)) on the 2-D mesh: "
          f"{'equal' if ck['reloaded_world_n'] else 'DIFFERENT'} to what was saved")
    print(f"reloaded by rank 0 alone (no process group) into plain tensors: "
          f"{'equal' if ck['reloaded_world_1'] else 'DIFFERENT'} to what was saved", flush=True)


def parse_args(argv=None):
    p = cli.parser(__doc__)
    cli.add_run_args(p)
    cli.add_output_args(p, metrics=False, export=False, json_out=True)
    p.add_argument("--ckpt-dir", type=Path,
                   help="write the DCP checkpoint into this directory (None: a temporary one, "
                        "removed at the end)")
    args = p.parse_args(argv)
    cli.check_positive(args, "timeout_s")
    cli.check_ckpt_dir(args.ckpt_dir)
    return args


def main(argv=None):
    args = parse_args(argv)
    with launch.distributed(args.device, args.timeout_s) as d:
        mesh1, mesh2, mesh_mine = meshes(d)
        mine = {"mesh": mesh_mine, "placements": placements(mesh1, mesh2, d.device),
                "partial": partial_sums(mesh1, d.device)}
        model, mine["meta"] = meta_init(mesh1, d.device, args.seed)
        ckpt, temporary = checkpoint_dir(args, d.rank)
        try:
            ck = checkpoint(model, mesh2, ckpt, d.rank)  # ends at a barrier: all reads are done
        finally:
            if temporary and d.rank == 0:
                shutil.rmtree(ckpt, ignore_errors=True)
        everyone = report.gather(mine)  # rank k's dict, in rank order
        if d.rank == 0:
            res = {k: [e[k] for e in everyone] for k in mine}
            res.update(script=SCRIPT, world_size=d.world_size, device=str(d.device),
                       backend=d.backend, mesh2_shape=list(mesh2.mesh.shape),
                       mesh2_ranks=mesh2.mesh.tolist(), dcp=ck, ckpt_temporary=temporary)
            print_report(d, res)
            if args.json_out:
                report.write_json(args.json_out, res)
        dist.barrier()  # the file is complete before any rank exits


if __name__ == "__main__":
    main()

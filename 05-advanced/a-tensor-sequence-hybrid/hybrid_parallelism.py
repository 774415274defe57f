"""Hybrid parallelism: data x tensor x pipeline parallel on one named device mesh, the 3-D layout
(Megatron-LM, torchtitan) for models that do not fit a node under FSDP alone.

The world is a 3-D grid of ranks, mesh dims ("pp", "dp", "tp"), TP innermost so that a TP group
is consecutive ranks, i.e. GPUs of one node:
    tp: each block's weights split Megatron-style (DTensor ColwiseParallel / RowwiseParallel;
        tensor_parallel.py builds the same by hand) - activations all-reduced in every layer;
    dp: FSDP2 (`fully_shard`) shards what each TP rank holds over the data-parallel ranks, which
        take different rows of the global batch - parameters all-gathered before forward and
        again before backward (once per step with a pipeline, which keeps them between
        micro-batches), gradients reduce-scattered once per step;
    pp: the blocks split into consecutive stages (torch.distributed.pipelining, 1F1B schedule over
        micro-batches) - activations sent point-to-point between neighbouring stages.
dp x tp x pp must equal the world size.

Launch (from the repository root):
    python 05-advanced/a-tensor-sequence-hybrid/hybrid_parallelism.py                  # 1 process
    torchrun --nproc_per_node=4 05-advanced/a-tensor-sequence-hybrid/hybrid_parallelism.py \
        --dp 2 --tp 2                                                                  # FSDP x TP
    torchrun --nproc_per_node=4 05-advanced/a-tensor-sequence-hybrid/hybrid_parallelism.py \
        --tp 2 --pp 2                                                                  # TP x PP
    torchrun --nnodes=8 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=HOST:29500 \
        05-advanced/a-tensor-sequence-hybrid/hybrid_parallelism.py --tp 8 --pp 2 --device cuda
                                                                # 64 GPUs: dp 4, tp 8, pp 2

The model is the course's GPT (dtcourse.models), the same weights and data as tensor_parallel.py,
so one process is the reference for every layout; set-up, metrics, export and the collective
counter come from the shared module dtcourse.
"""

import contextlib
import inspect
import logging
import math
import statistics
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from dtcourse import cli, launch, report, timing
from dtcourse.comm import CollectiveCounter
from dtcourse.data import rank_rows, token_batch
from dtcourse.models import GPT, init_gpt

SCRIPT = "05-advanced/a-tensor-sequence-hybrid/hybrid_parallelism.py"

# FSDP2 warns when the root's output is a view (an in-place op on it would skip a hook; we do
# none), and DTensor when full_tensor() gathers a weight sharded over both dp and tp in two steps.
warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


# --------------------------------------------------------------------------------------------------
# The three dimensions, applied in this order: cut the stage (pp), split the weights (tp), shard
# what is left over the data-parallel ranks (dp).


class Stage(nn.Module):
    """Pipeline stage `stage` of `stages` of a GPT: blocks [s*L/pp, (s+1)*L/pp), the embedding on
    the first stage, the final norm and the head on the last. The parameter names are the GPT's
    (blocks.<i>.*: a ModuleDict keyed by the block's index), so a stage's state_dict is a slice of
    the model's, and the slices of all stages together load into GPT."""

    def __init__(self, model: GPT, stage: int, stages: int):
        super().__init__()
        per_stage = len(model.blocks) // stages
        first, last = stage == 0, stage == stages - 1
        self.emb = model.emb if first else None
        self.blocks = nn.ModuleDict({str(i): model.blocks[i]
                                     for i in range(stage * per_stage, (stage + 1) * per_stage)})
        self.ln_f = model.ln_f if last else None
        self.head = model.head if last else None

    def forward(self, x):
        # GPT.forward, cut: token ids (B, T) in on the first stage, hidden states (B, T, H)
        # between stages, logits (B, T, vocab) out of the last one.
        if self.emb is not None:
            x = self.emb(x)
        for block in self.blocks.values():
            x = block(x)
        if self.head is not None:
            x = self.head(self.ln_f(x))
        return x


def apply_tp(model: Stage, tp_mesh) -> None:
    """Megatron's split of every block over the tp mesh dim (see tensor_parallel.py, where the
    same is written by hand): Q, K, V and fc1 by columns, proj and fc2 by rows; one all-reduce
    after attention and one after the MLP, forward and backward."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, parallelize_module)
    plan = {
        "attn": PrepareModuleInput(input_layouts=(Replicate(),),
                                   desired_input_layouts=(Replicate(),)),  # one f for q, k, v
        "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
        "attn.proj": RowwiseParallel(),
        "mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel(),
    }
    for block in model.blocks.values():
        parallelize_module(block, tp_mesh, plan)


def apply_fsdp(model: Stage, dp_mesh, reshard_after_forward: bool) -> None:
    """FSDP2 over the dp mesh dim: each block is one unit (its parameters all-gathered just before
    it runs, its gradients reduce-scattered as soon as they are ready), the root holds the rest.
    A TP-split weight becomes a 2-D DTensor, sharded over dp and over tp. The root gets the same
    reshard_after_forward as the blocks, on purpose: on torch 2.14, which honours an explicit True
    for the root too, every parameter is then gathered twice per step and the traffic is 3(d-1)/d
    x P plus shard padding, the formula the README compares TP with (lesson
    02 keeps the root gathered after forward, as torch recommends, which saves one all-gather of
    the root)."""
    try:
        from torch.distributed.fsdp import fully_shard  # torch >= 2.6
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard
    for block in model.blocks.values():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)


def build_schedule(stage_model: Stage, stage: int, stages: int, pp_mesh, device,
                   microbatches: int):
    """A 1F1B schedule over this rank's stage. The loss of a micro-batch is divided by their
    number, so the accumulated gradient is that of the mean loss over the whole batch (newer
    torch can do that division itself, `scale_grads`; we turn it off to be explicit)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    def loss_fn(logits, target):
        return F.cross_entropy(logits.flatten(0, 1), target.flatten()) / microbatches

    pipe_stage = PipelineStage(stage_model, stage, stages, device, group=pp_mesh.get_group())
    extra = {"scale_grads": False} if "scale_grads" in inspect.signature(
        Schedule1F1B.__init__).parameters else {}
    return Schedule1F1B(pipe_stage, n_microbatches=microbatches, loss_fn=loss_fn, **extra)


def export_state(model: Stage, mesh, d) -> dict | None:
    """The dense state_dict, on rank 0 only: full_tensor() all-gathers each DTensor over its
    stage's dp x tp ranks (a collective: every rank calls it); then the first rank of each stage
    sends its stage's slice to rank 0 (pickled objects: fine for a lesson-sized model, a real one
    would write a sharded checkpoint instead)."""
    from torch.distributed.tensor import DTensor
    stage_sd = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu()
                for k, v in model.state_dict().items()}
    holder = mesh.get_local_rank("dp") == 0 and mesh.get_local_rank("tp") == 0
    parts = [None] * d.world_size if d.is_main else None
    dist.gather_object(stage_sd if holder else None, parts, dst=0)
    return {k: v for part in parts if part for k, v in part.items()} if d.is_main else None


# --------------------------------------------------------------------------------------------------
# Training


def build(args, d, mesh):
    """This rank's stage of the GPT, TP-split and FSDP-sharded, its schedule and optimizer."""
    # The whole model on the meta device (shapes, no storage); only this stage is materialised,
    # with the values init_gpt gives each parameter name: the weights of tensor_parallel.py and
    # of one process, whichever stage holds them.
    with torch.device("meta"):
        model = GPT(args.vocab, args.seq_len, args.dim, args.heads, args.layers)
    stage = Stage(model, mesh.get_local_rank("pp"), args.pp).to_empty(device=d.device)
    init_gpt(stage, args.seed, layers=args.layers)
    apply_tp(stage, mesh["tp"])
    tp_local_shapes = [tuple(p.to_local().shape if hasattr(p, "to_local") else p.shape)
                       for p in stage.parameters()]  # what FSDP will shard over dp
    # With micro-batches, resharding after each forward would all-gather again for every one.
    apply_fsdp(stage, mesh["dp"], reshard_after_forward=args.pp == 1)
    schedule = build_schedule(stage, mesh.get_local_rank("pp"), args.pp, mesh["pp"], d.device,
                              args.microbatches) if args.pp > 1 else None
    # foreach=False: parameters live on different meshes (2-D dp x tp, 1-D dp).
    optimizer = torch.optim.AdamW(stage.parameters(), lr=args.lr, foreach=False)
    return stage, schedule, optimizer, tp_local_shapes


def train_step(model, schedule, optimizer, x, y, first: bool, last: bool) -> torch.Tensor:
    """One step on this data-parallel rank's rows; returns their mean loss on the last stage."""
    if schedule is None:
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
    else:
        # 1F1B: the first stage feeds the micro-batches of x, the last one scores them against y.
        mb_losses = []
        schedule.step(*([x] if first else []),
                      **({"target": y, "losses": mb_losses} if last else {}))
        loss = torch.stack(mb_losses).sum() if last else torch.zeros((), device=x.device)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def train(args, d):
    from torch.distributed.device_mesh import init_device_mesh
    # rank = (pp_index * dp + dp_index) * tp + tp_index: tp varies fastest.
    mesh = init_device_mesh(d.device.type, (args.pp, args.dp, args.tp),
                            mesh_dim_names=("pp", "dp", "tp"))
    pp_rank, dp_rank = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    first, last = pp_rank == 0, pp_rank == args.pp - 1
    model, schedule, optimizer, tp_local_shapes = build(args, d, mesh)
    print_header(args, d, mesh)

    comm, losses, step_s = CollectiveCounter(), [], []
    global_bs = args.dp * args.batch_size
    bar = report.progress(args.steps, "train")
    for step in range(args.steps):
        # Data-parallel rank r takes rows r*B..(r+1)*B-1; its TP and PP peers take the same rows.
        x, y = token_batch(args.seed, step, global_bs, args.seq_len, args.vocab)
        rows = rank_rows(dp_rank, args.batch_size)
        x, y = x[rows].to(d.device), y[rows].to(d.device)
        t0 = timing.clock(d.device)
        # Step 2 runs under the counter (step 1 also carries the pipeline's one-time exchange of
        # shapes); the steps after it are timed.
        with comm if step == 1 else contextlib.nullcontext():
            loss = train_step(model, schedule, optimizer, x, y, first, last)
        took = timing.clock(d.device) - t0
        if step > 1:
            step_s.append(took)
        # Mean loss over the global batch: the last stage of each data-parallel rank holds its
        # rows' mean (tp times, once per TP rank); everyone else adds zero.
        total = loss.detach().float().reshape(1) if last else torch.zeros(1, device=d.device)
        dist.all_reduce(total)
        losses.append(total.item() / (args.dp * args.tp))
        bar.update(1)
        done = step + 1
        if d.is_main and (done % args.log_every == 0 or done in (1, args.steps)):
            bar.write(f"step {done:4d}/{args.steps} | loss {losses[-1]:.4f}")
    bar.close()

    state = export_state(model, mesh, d) if args.export else None
    comm_bytes = sent_per_dim(comm.records, mesh)
    formula = traffic_formula(args, tp_local_shapes, first, last)
    print_traffic(args, comm_bytes, formula)
    report_run(args, d, model, optimizer, losses, step_s, comm_bytes, formula, state)


# --------------------------------------------------------------------------------------------------
# Where the traffic goes: each collective the counter recorded names its group, hence its mesh dim


def sent_per_dim(records, mesh) -> dict:
    """'dim/kind' -> bytes this rank sent in the counted step (ring algorithms; a receive sends
    nothing)."""
    dim_of_group = {mesh.get_group(dim).group_name: dim for dim in ("pp", "dp", "tp")}
    out = {}
    for r in records:
        key = f"{dim_of_group.get(r['group'], 'world')}/{r['kind']}"
        out[key] = out.get(key, 0) + r["sent_bytes"]
    return out


def fsdp_all_gathers(pp: int) -> int:
    """How many times FSDP all-gathers the weights per step: before forward and again before
    backward (reshard_after_forward frees them after forward); with a pipeline it keeps them
    between the micro-batches instead (reshard_after_forward=False): once."""
    return 2 if pp == 1 else 1


def traffic_formula(args, tp_local_shapes, first: bool, last: bool) -> dict:
    """What this rank should send per step on each mesh dim, in bytes (fp32, 4 per element).
    b = this data-parallel rank's batch; t, d, p = the tp, dp, pp degrees; P = the parameters
    this rank holds after the TP split, before FSDP shards them (dim 0 padded to a multiple of
    d, as FSDP pads it)."""
    b, s, h, e = args.batch_size, args.seq_len, args.dim, 4
    t, d = args.tp, args.dp
    P = sum(-(-shape[0] // d) * d * math.prod(shape[1:]) for shape in tp_local_shapes)
    # FSDP's all-gathers of the weights (fsdp_all_gathers), then one reduce-scatter of gradients.
    passes = fsdp_all_gathers(args.pp) + 1
    # The pipeline sends activations (b, s, h) forward and their gradients backward, per stage
    # boundary: the first stage sends forward only, the last backward only, the others both.
    boundaries = 0 if args.pp == 1 else (not last) + (not first)
    return {"tp": args.layers // args.pp * 8 * b * s * h * (t - 1) / t * e,
            "dp": passes * (d - 1) / d * P * e,
            "pp": boundaries * b * s * h * e}


def print_traffic(args, comm_bytes: dict, formula: dict) -> None:
    """Rank 0's bytes per mesh dim beside their formulas."""
    report.print0("traffic of one step, counted on step 2 (fp32, 4 bytes/element; bytes rank 0 "
                  "sends, ring algorithms):")
    what = {"tp": f"L/p={args.layers // args.pp} x 8*b*s*h*(t-1)/t*4",
            "dp": f"{fsdp_all_gathers(args.pp) + 1}*(d-1)/d*4*P (FSDP: all-gather"
                  f"{' x2' if fsdp_all_gathers(args.pp) == 2 else ''}, reduce-scatter)",
            "pp": "b*s*h*4 per boundary and direction"}
    for dim in ("tp", "dp", "pp"):
        mine = {k.split("/")[1]: v for k, v in comm_bytes.items() if k.startswith(dim + "/")}
        report.print0(f"  {dim}: {', '.join(sorted(mine)) or '-':<26} {sum(mine.values()):>8} B | "
                      f"formula {what[dim]} = {formula[dim]:.0f} B")


def report_run(args, d, model, optimizer, losses, step_s, comm_bytes, formula, state) -> None:
    median_s = statistics.median(step_s) if step_s else float("nan")
    global_bs = args.dp * args.batch_size
    report.print0(f"done: {args.steps} steps, median {1000 * median_s:.1f} ms/step")
    per_rank = report.gather({**report.held_bytes(params=model.parameters(), optimizer=optimizer,
                                                  device=d.device),
                              "comm_bytes": comm_bytes, "comm_formula": formula})
    metrics = report.metrics(
        d, script=SCRIPT, strategy=f"pp{args.pp}-dp{args.dp}-tp{args.tp}", steps=args.steps,
        global_batch=global_bs, losses=losses, samples_per_s=global_bs / median_s,
        per_rank=per_rank, dp=args.dp, tp=args.tp, pp=args.pp,
        microbatches=args.microbatches if args.pp > 1 else 1,
        step_ms=[1000 * t for t in step_s], median_step_ms=1000 * median_s,
        tokens_per_s=global_bs * args.seq_len / median_s)
    report.finish(args, metrics, state)


# --------------------------------------------------------------------------------------------------
# The mesh, printed with where each group belongs on real hardware


def print_header(args, d, mesh) -> None:
    report.print0(f"mesh pp {args.pp} x dp {args.dp} x tp {args.tp} = {d.world_size} ranks (tp "
                  f"innermost) | device {d.device} | global batch {args.dp * args.batch_size} "
                  f"({args.batch_size} per dp rank"
                  f"{f', {args.microbatches} micro-batches' if args.pp > 1 else ''}) | "
                  f"{args.layers} layers, {args.layers // args.pp} per stage")
    report.print0("\n".join(layout_advice(mesh, args, d)))


def layout_advice(mesh, args, d) -> list:
    """Which ranks form each group, and where each kind of group belongs on real hardware."""
    grid = mesh.mesh  # (pp, dp, tp) tensor of global ranks
    groups = {"tp": grid.reshape(-1, args.tp).tolist(),
              "dp": grid.permute(0, 2, 1).reshape(-1, args.dp).tolist(),
              "pp": grid.permute(1, 2, 0).reshape(-1, args.pp).tolist()}
    per_node = d.local_world_size or mesh.size()
    where = {
        "tp": "consecutive ranks, inside one node: keep TP on NVLink, it all-reduces activations "
              "in every layer" if per_node % args.tp == 0 else
              f"WARNING: tp {args.tp} does not fit in the {per_node} ranks of a node, so TP's "
              f"per-layer all-reduces would cross the network",
        "dp": f"FSDP all-gathers weights {('once', 'twice')[fsdp_all_gathers(args.pp) - 1]} "
              f"per step and reduce-scatters gradients once, overlapped with compute: fine "
              f"across nodes",
        "pp": "point-to-point activations at stage boundaries only, the least traffic: fine "
              "across nodes, on the slowest links",
    }
    return [f"  {dim} groups {groups[dim]}: {where[dim]}" if getattr(args, dim) > 1 else
            f"  {dim} degree 1: no {dim} traffic" for dim in ("tp", "dp", "pp")]


# --------------------------------------------------------------------------------------------------
# Arguments and launch



def parse_args(argv=None):
    p = cli.parser(__doc__)
    p.add_argument("--dp", type=int, default=-1,
                   help="data-parallel (FSDP) degree; -1: world size / (tp x pp)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree (stages)")
    p.add_argument("--microbatches", type=int, default=4,
                   help="micro-batches per step when --pp > 1 (1F1B needs at least pp)")
    cli.add_run_args(p)
    cli.add_train_args(p, steps=10, batch_size=8, lr=3e-3, grad_accum=False,
                       batch_help="sequences per data-parallel rank per step (shared by its TP "
                                  "and PP peers)")
    cli.add_output_args(p)
    cli.add_gpt_args(p, layers=2, dim=64, heads=4, seq_len=16, vocab=64)
    p.add_argument("--log-every", type=int, default=5)
    args = p.parse_args(argv)
    cli.check_positive(args, "tp", "pp", "microbatches", "steps", "batch_size", "log_every",
                       "lr", "timeout_s")

    # Shapes, then degrees, checked before any process group exists.
    cli.check_gpt_args(args)
    if args.heads % args.tp:
        cli.fail(f"--heads {args.heads} is not divisible by --tp {args.tp}: each TP rank must own "
                 f"whole attention heads")
    if args.layers % args.pp:
        cli.fail(f"--layers {args.layers} is not divisible by --pp {args.pp}: stages get equal "
                 f"blocks")
    if args.pp > 1 and (args.batch_size % args.microbatches or args.microbatches < args.pp):
        cli.fail(f"--microbatches {args.microbatches} must divide --batch-size {args.batch_size} "
                 f"and be at least --pp {args.pp} (the 1F1B schedule)")
    world = launch.launched().world_size
    if args.dp == -1:
        if world % (args.tp * args.pp):
            cli.fail(f"world size {world} is not divisible by --tp {args.tp} x --pp {args.pp}")
        args.dp = world // (args.tp * args.pp)
    if args.dp < 1 or args.dp * args.tp * args.pp != world:
        cli.fail(f"--dp {args.dp} x --tp {args.tp} x --pp {args.pp} = "
                 f"{args.dp * args.tp * args.pp}, but the world size is {world}")
    return args


def main(argv=None):
    args = parse_args(argv)
    with launch.distributed(args.device, args.timeout_s) as d:
        train(args, d)


if __name__ == "__main__":
    main()

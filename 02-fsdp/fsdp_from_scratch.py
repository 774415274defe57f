"""FSDP written by hand: shard every parameter, all-gather it around each use, reduce-scatter its
gradient, and step an optimizer that only ever sees the shards.

Launch (from the repository root):
    torchrun --nproc_per_node=2 02-fsdp/fsdp_from_scratch.py            # hand-written FSDP
    torchrun --nproc_per_node=2 02-fsdp/fsdp_from_scratch.py --reference runs/single.pt
        # ^ rank 0 also trains the unwrapped model on the whole batch and compares
    torchrun --nproc_per_node=3 02-fsdp/fsdp_from_scratch.py --optimizer sgd
    torchrun --nproc_per_node=2 02-fsdp/fsdp_from_scratch.py --compute-dtype bf16

The mechanism (FSDP1's design, one parameter at a time instead of one flat buffer per unit):

    construction   every parameter p (numel n) is flattened, padded to a multiple of N and cut in
                   N pieces; rank r keeps piece r as an fp32 nn.Parameter (its "shard", n/N
                   elements) and the module's attribute becomes a plain tensor `full` whose
                   storage is empty (0 bytes) except while it is in use.
    forward        pre-hook of each module: all-gather its parameters' shards into `full`
                   (cast to the compute dtype first, so the all-gather moves bf16 when asked);
                   post-hook: free the storage again. Autograd keeps a reference to `full` but no
                   bytes.
    backward       pre-hook (gradients reached the module's output): all-gather again, into the
                   same storage, so the tensors autograd saved are valid again.
    gradient       when autograd has accumulated p's whole gradient (post-accumulate-grad hook),
                   reduce-scatter it in fp32: rank r receives the average over ranks of its own
                   piece -> shard.grad; the full gradient and the full parameter are freed.
    step           any torch optimizer, built on the shards: state for n/N elements per rank.

A parameter shared by two modules (tied embedding and LM head) is one record with two users:
autograd accumulates both uses into the one `full` leaf before its hook fires, so it is reduced
once. A frozen parameter (requires_grad=False) is gathered for forward and backward like any
other, never reduced, and freed by finish_gradient_synchronization().
"""

import hashlib
import math
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from dtcourse import cli, launch, report, timing
from dtcourse.data import rank_rows

SCRIPT = "02-fsdp/fsdp_from_scratch.py"
DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
# The two collectives of FSDP, on flat tensors: (N*k,) <- (k,) from each rank, and (k,) <- the
# sum of everyone's (N*k,) slice. Newer torch renamed them; the arguments are the same.
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# --------------------------------------------------------------------------------------------------
# The hand-written FSDP


class _Sharded:
    """One parameter of the wrapped model: its fp32 shard, and the full tensor the modules use."""

    def __init__(self, name, param, rank, world, compute_dtype):
        self.name, self.shape, self.numel = name, param.shape, param.numel()
        self.padded = math.ceil(self.numel / world) * world  # every shard has the same size
        flat = F.pad(param.detach().reshape(-1).float(), (0, self.padded - self.numel))
        # This rank's piece, elements [r*n/N, (r+1)*n/N) of the padded flat parameter.
        self.shard = nn.Parameter(flat.chunk(world)[rank].clone(),
                                  requires_grad=param.requires_grad)
        # `buffer` (padded, compute dtype) receives the all-gather; `full` is a separate leaf
        # tensor on the same storage with the parameter's shape: autograd sees and saves `full`,
        # our collectives write `buffer`, and the writes do not count as in-place changes of
        # `full` (each tensor has its own version counter).
        dtype = compute_dtype or torch.float32
        self.buffer = torch.empty(self.padded, dtype=dtype, device=param.device)
        self.full = torch.empty(0, dtype=dtype, device=param.device).set_(
            self.buffer.untyped_storage(), 0, self.shape)
        self.full.requires_grad_(param.requires_grad)
        self.nbytes = self.padded * self.buffer.element_size()
        self.free()

    def gathered(self) -> bool:
        return self.buffer.untyped_storage().nbytes() > 0

    def free(self) -> None:
        # Free the bytes, keep the tensor objects: what FSDP1 does with `_free_storage`.
        self.buffer.untyped_storage().resize_(0)


class FullyShardedDataParallel(nn.Module):
    """Shard `module`'s parameters over the default process group (see the module docstring).

    Use: model = FullyShardedDataParallel(module, compute_dtype=None | torch.bfloat16 | ...)
         optimizer = torch.optim.AdamW(model.parameters())     # the shards
         loss = f(model(x)); loss.backward(); model.finish_gradient_synchronization()
         optimizer.step(); optimizer.zero_grad()
    Every rank must run the same modules with the same parameters each step (as for DDP).
    """

    def __init__(self, module: nn.Module, compute_dtype: torch.dtype | None = None):
        super().__init__()
        self.module = module
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.compute_dtype = compute_dtype
        self.gathered_bytes = self.peak_gathered_bytes = 0
        records, by_id = [], {}
        for name, p in module.named_parameters():  # a shared parameter is listed once
            dist.broadcast(p.data, src=0)  # start from rank 0's weights, as DDP does
            by_id[id(p)] = _Sharded(name, p, self.rank, self.world, compute_dtype)
            records.append(by_id[id(p)])
        self.records = records
        self.shards = nn.ParameterList([r.shard for r in records])  # what the optimizer sees

        # Replace each module's Parameter by the record's `full` tensor and hook the module.
        self._users = {}
        for mod in module.modules():
            owned = [(attr, by_id[id(p)]) for attr, p in mod._parameters.items() if p is not None]
            if not owned:
                continue
            for attr, rec in owned:
                del mod._parameters[attr]
                setattr(mod, attr, rec.full)  # a plain attribute: the module code is unchanged
            self._users[mod] = [rec for _, rec in owned]
            mod.register_forward_pre_hook(lambda m, args: self._gather(self._users[m]))
            mod.register_forward_hook(lambda m, args, out: self._free(self._users[m]))
            mod.register_full_backward_pre_hook(lambda m, grad_out: self._gather(self._users[m]))
        for rec in records:
            if rec.shard.requires_grad:
                rec.full.register_post_accumulate_grad_hook(
                    lambda full, rec=rec: self._reduce_scatter_grad(rec))

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    # -- communication ----------------------------------------------------------------------------

    def _gather(self, records) -> None:
        """all-gather: (padded/N,) shard from every rank -> (padded,) in `buffer` -> `full`."""
        for rec in records:
            if rec.gathered():
                continue  # already gathered: a tied parameter its other module gathered
            rec.buffer.untyped_storage().resize_(rec.nbytes)
            shard = rec.shard.detach().to(rec.buffer.dtype)  # cast before sending: bf16 wire
            all_gather(rec.buffer, shard)
            self.gathered_bytes += rec.nbytes
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)

    def _free(self, records) -> None:
        for rec in records:
            if rec.gathered():
                rec.free()
                self.gathered_bytes -= rec.nbytes

    def _reduce_scatter_grad(self, rec) -> None:
        """reduce-scatter: (padded,) full gradient on every rank -> the average of this rank's
        piece. Reduced in fp32 whatever the compute dtype: a bf16 sum of N terms loses bits."""
        grad = F.pad(rec.full.grad.reshape(-1).float(), (0, rec.padded - rec.numel))
        piece = torch.empty_like(rec.shard)
        reduce_scatter(piece, grad, op=dist.ReduceOp.SUM)  # then divide: older gloo lacks AVG
        piece /= self.world
        rec.shard.grad = piece if rec.shard.grad is None else rec.shard.grad + piece
        rec.full.grad = None
        self._free([rec])

    def finish_gradient_synchronization(self) -> None:
        """Call after backward(), before optimizer.step(): check every trainable parameter was
        reduced, and free what is still gathered (frozen parameters, the last module's)."""
        stale = [r.name for r in self.records if r.full.grad is not None]
        if stale:
            raise RuntimeError(f"gradients not reduced (backward hook did not fire): {stale}")
        self._free(self.records)

    @torch.no_grad()
    def gather_full_params(self) -> dict[str, torch.Tensor]:
        """The full fp32 parameters on every rank, keyed by the wrapped module's own names."""
        out = {}
        for rec in self.records:
            flat = torch.empty(rec.padded, device=rec.shard.device)
            all_gather(flat, rec.shard.detach())
            out[rec.name] = flat[:rec.numel].view(rec.shape).clone()
        return out


# --------------------------------------------------------------------------------------------------
# A model with both hard cases: weights tied between two modules, and a frozen parameter


class TiedLM(nn.Module):
    """(B, T) token ids -> (B, T, vocab) logits; the LM head reuses the embedding matrix."""

    def __init__(self, vocab: int = 61, dim: int = 30, seq_len: int = 12):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        # A frozen (fixed, random) position table: gathered for compute, never trained.
        self.pos = nn.Parameter(torch.randn(seq_len, dim) * 0.1, requires_grad=False)
        hidden = 2 * dim + 1  # a 61-element bias: padded when split over 2 or 3 ranks
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied: one Parameter, two modules
        nn.init.normal_(self.tok.weight, std=0.1)  # small, as it also produces the logits

    def forward(self, idx):
        x = self.tok(idx) + self.pos[: idx.shape[1]]  # (B, T, D)
        x = x + self.mlp(x)
        return self.head(self.norm(x))  # (B, T, vocab)


def global_batch(seed: int, step: int, size: int, seq_len: int = 12, vocab: int = 61):
    """Step `step`'s global batch, a pure function of (seed, step): sequences whose next token is
    (3 * token + 1) mod vocab. Rank r keeps rows r*B..(r+1)*B-1."""
    g = torch.Generator().manual_seed(seed * 100003 + step)
    seq = [torch.randint(vocab, (size,), generator=g)]
    for _ in range(seq_len):
        seq.append((3 * seq[-1] + 1) % vocab)
    seq = torch.stack(seq, dim=1)
    return seq[:, :-1], seq[:, 1:]


def make_optimizer(kind: str, params, lr: float):
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


class SingleProcess:
    """The reference: the unwrapped model trained by one process on the whole global batch, with
    the weights cast to the compute dtype the same way (fp32 -> dtype, then a normal forward;
    autograd casts the gradient back to fp32). Rank 0 runs it beside the sharded model."""

    def __init__(self, args, device, cdtype):
        torch.manual_seed(args.seed)  # the same initial weights as the sharded model
        self.model, self.cdtype = TiedLM().to(device), cdtype
        self.optimizer = make_optimizer(args.optimizer, self.model.parameters(), args.lr)
        self.losses = []

    def step(self, x, y):
        weights = {n: p.to(self.cdtype) if self.cdtype else p
                   for n, p in self.model.named_parameters()}
        logits = torch.func.functional_call(self.model, weights, (x,))
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.losses.append(loss.item())


# --------------------------------------------------------------------------------------------------
# Training: the hand-written FSDP in a plain loop


def train_step(args, d, fsdp, optimizer, step: int) -> torch.Tensor:
    """One step on this rank's rows of the global batch; returns the global mean loss."""
    x, y = global_batch(args.seed, step, d.world_size * args.batch_size)
    rows = rank_rows(d.rank, args.batch_size)
    optimizer.zero_grad(set_to_none=True)
    logits = fsdp(x[rows].to(d.device))  # gathers and frees each module's params
    loss = F.cross_entropy(logits.float().flatten(0, 1), y[rows].to(d.device).flatten())
    loss.backward()  # gathers again, reduce-scatters each gradient as soon as it is whole
    fsdp.finish_gradient_synchronization()
    optimizer.step()  # plain torch optimizer, on this rank's shards only
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    return mean / d.world_size


def train(args, d):
    if args.compute_dtype == "fp16" and d.device.type != "cuda":
        cli.fail("--compute-dtype fp16 needs CUDA (CPU fp16 kernels are incomplete); use bf16")
    cdtype = DTYPES[args.compute_dtype]
    torch.manual_seed(args.seed)
    model = TiedLM().to(d.device)
    numels = {n: p.numel() for n, p in model.named_parameters()}  # the tied weight once
    trainable = {n: p.requires_grad for n, p in model.named_parameters()}
    fsdp = FullyShardedDataParallel(model, compute_dtype=cdtype)
    optimizer = make_optimizer(args.optimizer, fsdp.parameters(), args.lr)  # on the shards
    reference = SingleProcess(args, d.device, cdtype) if args.reference and d.is_main else None
    report.print0(f"hand-written FSDP | world {d.world_size} | TiedLM {sum(numels.values()):,} "
                  f"parameters (tied embedding/head, frozen position table) | {args.optimizer} | "
                  f"compute {args.compute_dtype}"
                  f"{' | + single-process reference' * bool(args.reference)}")

    losses, t_start = [], None
    for step in range(args.steps):
        if step == 1:
            t_start = timing.clock(d.device)  # the first step pays for warm-up; time the rest
        losses.append(train_step(args, d, fsdp, optimizer, step).item())
        if reference is not None:
            x, y = global_batch(args.seed, step, d.world_size * args.batch_size)
            reference.step(x.to(d.device), y.to(d.device))
        if (step + 1) % 4 == 0 or step == 0:
            report.print0(f"step {step + 1:3d}/{args.steps} | loss {losses[-1]:.4f}")
    elapsed = timing.clock(d.device) - t_start if t_start else float("nan")
    samples_per_s = (args.steps - 1) * d.world_size * args.batch_size / elapsed \
        if args.steps > 1 else float("nan")
    finish(args, d, fsdp, optimizer, numels, trainable, losses, samples_per_s, reference)


# --------------------------------------------------------------------------------------------------
# The report: bytes held, the comparison with one process, metrics and export


def finish(args, d, fsdp, optimizer, numels, trainable, losses, samples_per_s, reference):
    full = fsdp.gather_full_params()  # every rank: the same full fp32 parameters
    digest = hashlib.sha256(b"".join(full[n].cpu().numpy().tobytes() for n in numels)).hexdigest()
    held = {**report.held_bytes(params=fsdp.parameters(), optimizer=optimizer, device=d.device),
            "peak_gathered_bytes": fsdp.peak_gathered_bytes,
            "gathered_bytes_after_step": fsdp.gathered_bytes, "full_params_sha256": digest}
    per_rank = report.gather(held)
    n_params = sum(numels.values())
    report.print0(f"done: rank 0 holds params {held['param_bytes']:,} B, grads "
                  f"{held['grad_bytes']:,} B, optimizer {held['optim_bytes']:,} B of a "
                  f"{4 * n_params:,} B fp32 model")
    report.print0(f"full parameters materialised at once: at most "
                  f"{per_rank[0]['peak_gathered_bytes']:,} B (all of them: {4 * n_params:,} B "
                  f"fp32); after the step: {per_rank[0]['gathered_bytes_after_step']} B")
    if reference is not None:
        diff = max((full[n] - p.detach()).abs().max().item()
                   for n, p in reference.model.named_parameters())
        report.print0(f"single-process reference: final loss {reference.losses[-1]:.4f}, "
                      f"max |w_fsdp - w_single| = ~{diff:.1e}")
        report.save_state_dict(args.reference, plain_state_dict(
            dict(reference.model.named_parameters())))
    metrics = report.metrics(
        d, script=SCRIPT, strategy="hand-written-fsdp", steps=args.steps,
        global_batch=d.world_size * args.batch_size, losses=losses, samples_per_s=samples_per_s,
        per_rank=per_rank, optimizer=args.optimizer, compute_dtype=args.compute_dtype,
        gathered_dtype=str(fsdp.records[0].buffer.dtype).removeprefix("torch."),
        params=n_params, param_numels=numels, trainable=trainable,
        reference_losses=reference.losses if reference else None)
    report.finish(args, metrics, plain_state_dict(full) if d.is_main else None)


def plain_state_dict(params: dict) -> dict:
    """`params` loaded into the unwrapped class: its state_dict, with both tied names."""
    plain = TiedLM()
    with torch.no_grad():
        for n, p in plain.named_parameters():
            p.copy_(params[n])
    return plain.state_dict()


# --------------------------------------------------------------------------------------------------
# Arguments and launch


def parse_args(argv=None):
    p = cli.parser(__doc__)
    cli.add_run_args(p)
    cli.add_train_args(p, steps=8, batch_size=8, lr=1e-2, grad_accum=False,
                       batch_help="sequences per rank")
    cli.add_output_args(p)
    p.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    p.add_argument("--compute-dtype", choices=list(DTYPES), default="fp32",
                   help="dtype of the gathered weights (compute and all-gather); master "
                        "shards, gradient reduction and optimizer stay fp32")
    p.add_argument("--reference", type=Path,
                   help="rank 0 also trains the unwrapped model on the whole global batch (one "
                        "process's training, no collectives) and writes its state_dict here")
    args = p.parse_args(argv)
    cli.check_positive(args, "steps", "batch_size", "lr", "timeout_s")
    return args


def main(argv=None):
    args = parse_args(argv)
    with launch.distributed(args.device, args.timeout_s) as d:
        train(args, d)


if __name__ == "__main__":
    main()

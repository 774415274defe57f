"""Ring attention (context parallelism): the sequence is split over the ranks; each rank keeps
its block of queries and the key/value blocks travel around the ring, so no rank ever holds the
whole sequence's keys, values or score matrix.

Launch (from the repository root):
    python 05-advanced/b-pipeline-expert-context/ring_attention.py        # 1 rank: plain attention
    torchrun --nproc_per_node=4 05-advanced/b-pipeline-expert-context/ring_attention.py  # T = 512
    torchrun --nproc_per_node=4 05-advanced/b-pipeline-expert-context/ring_attention.py \\
        --ring-sizes 2,3,4 --seq-lens 37,50               # rings of 2, 3 and 4, uneven blocks

Rank r holds positions [r T / W, (r + 1) T / W) of q: (batch, heads, T_r, head_dim), and of k, v:
(batch, kv_heads, T_r, head_dim). With grouped-query attention (--kv-heads below --heads) each key
/value head serves heads / kv_heads query heads, and only the kv_heads travel round the ring.
Forward, W steps; at step s rank r holds the key/value block of rank (r - s) mod W:

    step s:  post isend(k, v -> rank r + 1) and irecv(k', v' <- rank r - 1)     (overlap)
             o_s, lse_s = softmax(q k^T / sqrt(d)) v  on this block, and its log-sum-exp
             merge (online softmax):  lse = log(e^lse + e^lse_s)
                                      o   = o e^(old lse - lse) + o_s e^(lse_s - lse)
             wait for k', v'; they are the next step's block

Causal attention skips the blocks that lie wholly in the future (j > r) and masks the diagonal one.
Backward, W more steps: the same ring carries k, v and their gradients dk, dv; each rank adds its
queries' contribution to the block's dk, dv and passes them on, and after W hops every dk, dv
is home. The k, v hops are overlapped as in forward; each dk, dv hop is waited for at once (the
block's gradients leave only after this rank's share is added). Scores are recomputed from q, k
and the saved lse, as FlashAttention does: the blocks a rank holds are O(T / W), and the score
matrix of one pair of blocks, built whole by attend(), is (T / W)^2 per head (a flash kernel
inside each block would tile it).
"""

import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dtcourse import cli, launch, report, timing

SCRIPT = "05-advanced/b-pipeline-expert-context/ring_attention.py"


# --------------------------------------------------------------------------------------------------
# Blocks and the ring


def bounds(T: int, W: int, j: int):
    """Positions [start, end) of block j: sizes differ by at most one when W does not divide T."""
    return j * T // W, (j + 1) * T // W


def block_mask(T, W, r, j, causal, device):
    """Which keys of block j the queries of block r may see: None (all), or a (T_r, T_j) mask.
    Returns False when causal and block j is wholly in r's future (nothing to compute)."""
    if not causal or j < r:
        return None
    if j > r:
        return False
    q0, q1 = bounds(T, W, r)
    k0, k1 = bounds(T, W, j)
    qpos = torch.arange(q0, q1, device=device)
    kpos = torch.arange(k0, k1, device=device)
    return kpos[None, :] <= qpos[:, None]


class Ring:
    """The ring's transfers: send to rank r + 1, receive from rank r - 1, all posted at once."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world
        self.next, self.prev = (rank + 1) % world, (rank - 1) % world

    def start(self, tensors, shapes):
        """Post isend of `tensors` and irecv of new tensors of `shapes`; returns a handle."""
        received = [torch.empty(s, dtype=tensors[0].dtype, device=tensors[0].device)
                    for s in shapes]
        sent = [t.contiguous() for t in tensors]  # kept alive until the sends complete
        ops = [dist.P2POp(dist.isend, t, self.next) for t in sent]
        ops += [dist.P2POp(dist.irecv, t, self.prev) for t in received]
        return dist.batch_isend_irecv(ops), received, sent

    @staticmethod
    def wait(handle):
        works, received, _ = handle
        for w in works:
            w.wait()
        return received


def expand_kv(x, heads: int):
    """(B, H_kv, T, D) -> (B, H, T, D): key/value head i serves query heads i g .. (i + 1) g - 1,
    g = H / H_kv (grouped-query attention; with H_kv = H, x itself)."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def sum_groups(x, kv_heads: int):
    """(B, H, T, D) -> (B, H_kv, T, D): the gradient of expand_kv, summed over each group."""
    B, H, T, D = x.shape
    return x if H == kv_heads else x.reshape(B, kv_heads, H // kv_heads, T, D).sum(2)


def attend(q, k, v, mask, scale):
    """Softmax attention of q on one key block: output (normalised within the block) and the
    log-sum-exp of the scores per query, (B, H, T_q, 1)."""
    s = (q @ k.transpose(-2, -1)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    return torch.exp(s - lse) @ v, lse


class RingAttention(torch.autograd.Function):
    """out = softmax(q k^T / sqrt(d)) v over the whole sequence, with q, k, v split over ranks."""

    @staticmethod
    def forward(ctx, q, k, v, T, causal, overlap, ring):
        W, r, scale = ring.world, ring.rank, q.shape[-1] ** -0.5
        B, H, _, D = q.shape
        Hkv = k.shape[1]                                      # only these heads travel
        out = torch.zeros_like(q)
        lse = torch.full((*q.shape[:-1], 1), float("-inf"), dtype=q.dtype, device=q.device)
        kv = (k, v)
        for s in range(W):
            j = (r - s) % W                                   # owner of the block we hold
            nxt = (r - s - 1) % W                             # the block that arrives next
            shape = (B, Hkv, bounds(T, W, nxt)[1] - bounds(T, W, nxt)[0], D)
            pending = ring.start(kv, [shape, shape]) if s < W - 1 and overlap else None
            mask = block_mask(T, W, r, j, causal, q.device)
            if mask is not False:
                o_s, lse_s = attend(q, expand_kv(kv[0], H), expand_kv(kv[1], H), mask, scale)
                new = torch.logaddexp(lse, lse_s)             # online-softmax merge
                out = out * torch.exp(lse - new) + o_s * torch.exp(lse_s - new)
                lse = new
            if s < W - 1:
                kv = ring.wait(pending if overlap else ring.start(kv, [shape, shape]))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.T, ctx.causal, ctx.overlap, ctx.ring = T, causal, overlap, ring
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        T, causal, overlap, ring = ctx.T, ctx.causal, ctx.overlap, ctx.ring
        W, r, scale = ring.world, ring.rank, q.shape[-1] ** -0.5
        B, H, _, D = q.shape
        Hkv = k.shape[1]
        delta = (dout * out).sum(-1, keepdim=True)            # rowsum(dO * O), (B, H, T_r, 1)
        dq = torch.zeros_like(q)
        kv = (k, v)
        dkv_in = (torch.zeros_like(k), torch.zeros_like(v))   # our own block starts at zero
        for s in range(W):
            j, nxt = (r - s) % W, (r - s - 1) % W
            shape = (B, Hkv, bounds(T, W, nxt)[1] - bounds(T, W, nxt)[0], D)
            pending = ring.start(kv, [shape, shape]) if s < W - 1 and overlap else None
            kb, vb = expand_kv(kv[0], H), expand_kv(kv[1], H)
            dk, dv = dkv_in
            mask = block_mask(T, W, r, j, causal, q.device)
            if mask is not False:
                sc = (q @ kb.transpose(-2, -1)) * scale
                if mask is not None:
                    sc = sc.masked_fill(~mask, float("-inf"))
                p = torch.exp(sc - lse)                       # the final softmax, recomputed
                dv = dv + sum_groups(p.transpose(-2, -1) @ dout, Hkv)
                ds = p * (dout @ vb.transpose(-2, -1) - delta)
                dq = dq + (ds @ kb) * scale
                dk = dk + sum_groups(ds.transpose(-2, -1) @ q, Hkv) * scale
            if s < W - 1 and not overlap:
                pending = ring.start(kv, [shape, shape])
            if W > 1:  # the block's gradients travel on with it; after W hops they are home
                # (waited for at once, in both modes: this hop is not overlapped)
                dkv_in = ring.wait(ring.start((dk, dv), [shape, shape]))
            else:
                dkv_in = (dk, dv)
            if s < W - 1:
                kv = ring.wait(pending)
        return dq, dkv_in[0], dkv_in[1], None, None, None, None


# --------------------------------------------------------------------------------------------------
# Every case: checked against full attention, timed with and without overlap


def make_inputs(seed, T, batch, heads, head_dim, device, kv_heads=None):
    """q, k, v and the upstream gradient of the whole sequence: a pure function of (seed, T).
    k and v have kv_heads heads (default: heads, multi-head attention)."""
    g = torch.Generator().manual_seed(seed * 1009 + T)
    q, k, v, dout = (torch.randn(batch, h, T, head_dim, generator=g)
                     for h in (heads, kv_heads or heads, kv_heads or heads, heads))
    return [t.to(device) for t in (q, k, v, dout)]


def run_ring(q, k, v, dout, T, causal, overlap, ring):
    """Forward and backward on this rank's block; returns out, dq, dk, dv (detached)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = RingAttention.apply(q, k, v, T, causal, overlap, ring)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def ring_traffic_only(k, T, ring):
    """The transfers of one forward + backward with no compute: W - 1 passes of (k, v) forward,
    W - 1 passes of (k, v) and W of (dk, dv) backward. Its time bounds what overlap can hide."""
    W, r = ring.world, ring.rank
    for phase in ("fwd", "bwd"):
        block = (k, k)  # our own block (k's shape stands in for k, v, dk and dv)
        for s in range(W):
            nxt = (r - s - 1) % W
            shape = (*k.shape[:2], bounds(T, W, nxt)[1] - bounds(T, W, nxt)[0], k.shape[-1])
            if phase == "bwd" and W > 1:
                ring.wait(ring.start(block, [shape, shape]))  # (dk, dv)
            if s < W - 1:
                block = ring.wait(ring.start(block, [shape, shape]))  # (k, v)


def check_case(args, ring, rank, T, causal, device):
    """Ring attention with and without overlap on ranks 0..W-1, gathered, and on rank 0 compared
    with the full attention of one process. Returns this rank's inputs to the ring and, on rank
    0, (max |ring - full|, whether overlap gave bitwise the results of no overlap)."""
    q, k, v, dout = make_inputs(args.seed, T, args.batch, args.heads, args.head_dim, device,
                                args.kv_heads)
    got = plain = []
    mine = None
    if ring is not None:
        lo, hi = bounds(T, ring.world, rank)
        mine = [t[:, :, lo:hi] for t in (q, k, v, dout)]   # this rank's block of the sequence
        got = run_ring(*mine, T, causal, True, ring)
        plain = run_ring(*mine, T, causal, False, ring)    # the same arithmetic, no overlap
    parts = [p for p in report.gather([t.cpu() for t in got + plain]) if p]
    if rank != 0:
        return mine, None
    ring_out = [torch.cat([p[i] for p in parts], dim=2) for i in range(8)]
    # Reference on one process: the full (B, H, T, T) attention, which the ring never builds
    # (fine for checking at these sizes).
    ref = [t.detach().cpu().requires_grad_() for t in (q, k, v)]
    full = F.scaled_dot_product_attention(ref[0], expand_kv(ref[1], args.heads),
                                          expand_kv(ref[2], args.heads), is_causal=causal)
    full.backward(dout.cpu())
    expect = [full.detach()] + [t.grad for t in ref]
    err = max((a - b).abs().max().item() for a, b in zip(ring_out[:4], expect))
    same = all(torch.equal(a, b) for a, b in zip(ring_out[:4], ring_out[4:]))
    return mine, (err, same)


def time_case(args, ring, mine, T, causal, device):
    """Median seconds of forward + backward with overlap, without, and of the transfers alone
    (the slowest rank of each run)."""
    times = {True: [], False: [], "traffic": []}
    for _ in range(args.repeats):                          # alternate, so drift hits all three
        for overlap in (True, False, "traffic"):
            dist.barrier()
            t0 = timing.clock(device)
            if ring is not None and overlap == "traffic":
                ring_traffic_only(mine[1], T, ring)
            elif ring is not None:
                run_ring(*mine, T, causal, overlap, ring)
            took = torch.tensor([timing.clock(device) - t0], device=device)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)    # the slowest rank sets the pace
            times[overlap].append(took.item())
    return (statistics.median(times[True]), statistics.median(times[False]),
            statistics.median(times["traffic"]))


def run_case(args, ring, rank, W, T, causal, device):
    """One (ring size, length, mask): checked, timed, printed; returns rank 0's row of the JSON
    (None on the other ranks)."""
    mine, checked = check_case(args, ring, rank, T, causal, device)
    t_on, t_off, t_comm = time_case(args, ring, mine, T, causal, device)
    if rank != 0:
        return None
    err, same = checked
    # bytes of the block of rank j; rank 0 forwards blocks 0, W-1, ..., 2 (W - 1 hops) of k and
    # v; backward: those again, plus (dk, dv) of every block once
    block = [(bounds(T, W, j)[1] - bounds(T, W, j)[0]) * args.batch * args.kv_heads
             * args.head_dim * 4 for j in range(W)]
    hops = sum(block[(-s) % W] for s in range(W - 1))
    # `~`: the rounding difference depends on the CPU's kernels, the ratio on the machine's speed
    print(f"W={W} T={T:5d} {'causal' if causal else 'full  '} | max |ring - full| (out, dq, dk, "
          f"dv) ~{err:.1e} | overlap == no overlap: {same} | fwd+bwd median of {args.repeats}: "
          f"overlap {t_on * 1e3:.1f} ms, no overlap {t_off * 1e3:.1f} ms, ratio "
          f"~{t_off / t_on:.2f}; transfers alone {t_comm * 1e3:.1f} ms", flush=True)
    return {"ring_size": W, "seq_len": T, "causal": causal, "max_abs_err_vs_full": err,
            "overlap_equals_no_overlap": same, "overlap_s": t_on, "no_overlap_s": t_off,
            "ratio_no_overlap_over_overlap": t_off / t_on, "transfers_only_s": t_comm,
            "rank0_bytes_sent_fwd": 2 * hops,
            "rank0_bytes_sent_bwd": 2 * hops + (2 * sum(block) if W > 1 else 0)}


def run(args, d):
    masks = {"causal": [True], "none": [False], "both": [False, True]}[args.mask]
    kv = f" ({args.kv_heads} key/value heads)" if args.kv_heads != args.heads else ""
    report.print0(f"ring attention | batch {args.batch} x {args.heads} heads{kv} x head_dim "
                  f"{args.head_dim} | float32 | device {d.device}")
    results = []
    for W in args.ring_sizes:
        # The ring is ranks 0 .. W-1; with W < world the other ranks sit this one out (they
        # still join the barriers and gathers, which run over every rank).
        ring = Ring(d.rank, W) if d.rank < W else None
        for T in args.seq_lens:
            for causal in masks:
                results.append(run_case(args, ring, d.rank, W, T, causal, d.device))
    if d.rank == 0 and args.json_out:
        report.write_json(args.json_out, {
            "script": SCRIPT, "world_size": d.world_size, "batch": args.batch,
            "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
            "repeats": args.repeats, "device": str(d.device), "torch_version": torch.__version__,
            "results": results})
    dist.barrier()  # the file is complete before any rank exits


# --------------------------------------------------------------------------------------------------
# Arguments and launch


def parse_args(argv=None):
    p = cli.parser(__doc__)
    cli.add_run_args(p)
    cli.add_output_args(p, metrics=False, export=False, json_out=True)
    p.add_argument("--seq-lens", default="512",
                   help="comma-separated sequence lengths; each is split over the ranks")
    p.add_argument("--mask", choices=["causal", "none", "both"], default="both")
    p.add_argument("--ring-sizes", default="",
                   help="comma-separated ring sizes W, each run on ranks 0..W-1 in turn "
                        "(default: one ring of all ranks)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=None,
                   help="key/value heads, dividing --heads (grouped-query attention; default: "
                        "--heads)")
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3,
                   help="timed forward+backward runs per case, each with and without overlap")
    args = p.parse_args(argv)
    try:
        args.seq_lens = [int(t) for t in args.seq_lens.split(",")]
        args.ring_sizes = [int(w) for w in args.ring_sizes.split(",")] if args.ring_sizes else []
    except ValueError:
        cli.fail(f"--seq-lens and --ring-sizes expect integers like 512 or 37,50, got "
                 f"{args.seq_lens!r} and {args.ring_sizes!r}")
    cli.check_positive(args, "batch", "heads", "kv_heads", "head_dim", "repeats", "timeout_s")
    args.kv_heads = args.kv_heads or args.heads
    if args.heads % args.kv_heads:
        cli.fail(f"--kv-heads {args.kv_heads} does not divide --heads {args.heads}: each "
                 f"key/value head serves a whole group of query heads")
    world = launch.launched().world_size  # before any process group: every rank fails alike
    args.ring_sizes = args.ring_sizes or [world]
    if not all(1 <= w <= world for w in args.ring_sizes):
        cli.fail(f"--ring-sizes {args.ring_sizes} must lie between 1 and the world size {world}")
    if min(args.seq_lens) < max(args.ring_sizes):
        cli.fail(f"--seq-lens {min(args.seq_lens)} is shorter than the ring of "
                 f"{max(args.ring_sizes)} ranks: every rank needs at least one position")
    return args


def main(argv=None):
    args = parse_args(argv)
    with launch.distributed(args.device, args.timeout_s) as d:
        run(args, d)


if __name__ == "__main__":
    main()

"""Ulysses sequence parallelism (DeepSpeed-Ulysses, Jacobs et al. 2023, arXiv 2309.14509): the
sequence is split over P ranks, and attention, the one layer that needs every position, swaps the
split for a split of the heads: an all-to-all turns "my T / P positions of all H heads" into "all
T positions of my H / P heads", each rank runs ordinary attention on whole sequences, and a second
all-to-all turns the result back. The same inputs also go through ring attention
(ring_attention.py), and the bytes each one sends are counted and set beside their formulas.

Launch (from the repository root):
    python 05-advanced/b-pipeline-expert-context/ulysses_attention.py   # 1 rank: plain attention
    torchrun --nproc_per_node=2 05-advanced/b-pipeline-expert-context/ulysses_attention.py
    torchrun --nproc_per_node=4 05-advanced/b-pipeline-expert-context/ulysses_attention.py \\
        --sizes 2,4 --seq-lens 256,512          # P = 2 (ranks 0-1) and P = 4 in one launch
    torchrun --nproc_per_node=4 05-advanced/b-pipeline-expert-context/ulysses_attention.py \
        --sizes 2,4 --seq-lens 256 --heads 8 --kv-heads 4    # grouped-query attention
    python 05-advanced/b-pipeline-expert-context/ulysses_attention.py --formula-only \
        --heads 64 --kv-heads 8 --head-dim 128 --seq-lens 8192 --sizes 2,4,8,16  # no launch

Rank r holds positions [r T / P, (r + 1) T / P) of q, k, v: (batch, heads, T_r, head_dim).

    q, k, v  (B, H, T_r, D)  -- all-to-all -->  (B, H / P, T, D)   heads j H/P .. go to rank j;
                                                                   rank i's positions come back
    o = softmax(q k^T / sqrt(D)) v on (B, H / P, T, D)             any attention kernel, any mask
    o        (B, H / P, T, D) -- all-to-all -->  (B, H, T_r, D)     back to this rank's positions

Forward: 4 all-to-alls (q, k, v, o), each over one rank's share B x T / P x H x D (a "block"): a
rank keeps 1 / P of it and sends (P - 1) / P. Backward: the gradient of an all-to-all is the
reverse all-to-all, 4 more (do in; dq, dk, dv out). Every rank must get whole heads: H % P == 0.

Grouped-query attention (--kv-heads H_kv < H, each key/value head serving H / H_kv query heads):
k and v carry H_kv heads, so their all-to-alls move H_kv / H of a block, and rank j's query heads
j H/P .. find their key/value heads j H_kv/P .. on the same rank if P divides H_kv too. Forward,
one rank sends (P - 1) / P x (2 H + 2 H_kv) x B x T/P x D elements; the ring 2 (P - 1) x H_kv x
B x T/P x D. Per training step Ulysses sends twice that, the ring (6 P - 4) x H_kv x B x T/P x D
(its backward passes dk, dv once round as well): cost_model.context_parallel_bytes, which
--formula-only prints for both, also for P a multiple of H_kv (each key/value head repeated
P / H_kv times before the all-to-alls, as DeepSpeed's UlyssesSPAttentionHF does; this script's
own all-to-alls need P to divide H_kv).
"""

import statistics
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dtcourse import cli, comm, launch, lessons, report, timing

SCRIPT = "05-advanced/b-pipeline-expert-context/ulysses_attention.py"
ring_attention = lessons.load(Path(__file__).resolve().parent / "ring_attention.py")
cost_model = lessons.load(Path(__file__).resolve().parents[1] / "cost_model.py")
bounds = ring_attention.bounds  # the same cut of T positions over the ranks as the ring's


# --------------------------------------------------------------------------------------------------
# The two all-to-alls, each the other's gradient


class SeqGroup:
    """The P ranks of one sequence-parallel group, and how they cut T positions between them."""

    def __init__(self, group, T: int):
        self.group, self.T = group, T
        self.P, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.lengths = [bounds(T, self.P, j)[1] - bounds(T, self.P, j)[0] for j in range(self.P)]


def seq_to_heads(x, g: SeqGroup):
    """(B, H, T_r, D) on rank r -> (B, H / P, T, D): all positions of this rank's heads."""
    B, H, T_r, D = x.shape
    h = H // g.P
    # block j of the input = heads j h .. (j + 1) h - 1 of our positions: (P, B, h, T_r, D)
    send = x.reshape(B, g.P, h, T_r, D).transpose(0, 1).contiguous().reshape(-1)
    # block i of the output = our heads at rank i's positions (T_i may differ by one)
    recv_sizes = [B * h * t * D for t in g.lengths]
    recv = x.new_empty(sum(recv_sizes))
    dist.all_to_all_single(recv, send, recv_sizes, None, group=g.group)
    parts = [p.reshape(B, h, t, D) for p, t in zip(recv.split(recv_sizes), g.lengths)]
    return torch.cat(parts, dim=2)


def heads_to_seq(y, g: SeqGroup):
    """(B, H / P, T, D) -> (B, H, T_r, D) on rank r: every head of this rank's positions."""
    B, h, T, D = y.shape
    T_r = g.lengths[g.rank]
    # block i of the input = rank i's positions of our heads
    send_sizes = [B * h * t * D for t in g.lengths]
    send = torch.cat([p.reshape(-1) for p in y.split(g.lengths, dim=2)])
    recv = y.new_empty(g.P * B * h * T_r * D)
    dist.all_to_all_single(recv, send, None, send_sizes, group=g.group)
    # block j of the output = heads j h .. (j + 1) h - 1 of our positions: (P, B, h, T_r, D)
    return recv.reshape(g.P, B, h, T_r, D).transpose(0, 1).reshape(B, g.P * h, T_r, D)


class SeqToHeads(torch.autograd.Function):
    """seq_to_heads moves every element to one place on one rank; its gradient moves each one
    back: heads_to_seq."""

    @staticmethod
    def forward(ctx, x, g):
        ctx.g = g
        return seq_to_heads(x, g)

    @staticmethod
    def backward(ctx, grad):
        return heads_to_seq(grad.contiguous(), ctx.g), None


class HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, g):
        ctx.g = g
        return heads_to_seq(y, g)

    @staticmethod
    def backward(ctx, grad):
        return seq_to_heads(grad.contiguous(), ctx.g), None


def ulysses_attention(q, k, v, causal: bool, g: SeqGroup):
    """softmax(q k^T / sqrt(d)) v over the whole sequence; q, k, v and the output split by
    position over the group's ranks."""
    qh, kh, vh = (SeqToHeads.apply(t, g) for t in (q, k, v))      # 3 all-to-alls
    # whole sequences of H / P heads (and H_kv / P key/value heads, each serving its group):
    # plain attention, the causal mask needs no block logic
    H = qh.shape[1]
    o = F.scaled_dot_product_attention(qh, ring_attention.expand_kv(kh, H),
                                       ring_attention.expand_kv(vh, H), is_causal=causal)
    return HeadsToSeq.apply(o, g)                                  # the 4th


# --------------------------------------------------------------------------------------------------
# Both layouts on the same inputs: checked, counted, timed


def forward_backward(attend, q, k, v, dout, counter=None):
    """attend(q, k, v) on this rank's positions, then backward; returns out, dq, dk, dv."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = attend(q, k, v)
    if counter is not None:
        counter.phase = "backward"
    out.backward(dout)
    return [out.detach(), q.grad, k.grad, v.grad]


def counted(attend, inputs):
    """forward_backward under a CollectiveCounter: the results, and per phase the calls and the
    bytes this rank sent (all-to-alls for Ulysses, sends for the ring; a receive sends nothing)."""
    with comm.CollectiveCounter() as counter:
        counter.phase = "forward"
        results = forward_backward(attend, *inputs, counter=counter)
    traffic = {}
    for phase in ("forward", "backward"):
        summary = counter.summary([r for r in counter.records if r["phase"] == phase])
        for kind in ("all_to_all", "send"):
            s = summary.get(kind, {"calls": 0, "sent_bytes": 0})
            traffic[f"{kind}_{phase}"] = [s["calls"], s["sent_bytes"]]
    return results, traffic


def formulas(P: int, block: int, kv_block: int) -> dict:
    """Bytes one rank sends per forward and backward; block = B x T/P x H x D x 4 bytes, kv_block
    the same with H_kv heads (= block without grouped KV heads). Ulysses: 4 all-to-alls each way
    (q, out or dout, dq: a block; k, v or dk, dv: a kv block), each sending (P - 1) / P of it.
    Ring (ring_attention.py): forward, k and v make P - 1 hops; backward, the same hops plus dk,
    dv once round (P hops); only kv blocks travel."""
    ulysses = 2 * (P - 1) * (block + kv_block) // P
    ring_back = 2 * (P - 1) + (2 * P if P > 1 else 0)  # one rank: no ring, nothing travels
    return {"ulysses_forward": ulysses, "ulysses_backward": ulysses,
            "ring_forward": 2 * (P - 1) * kv_block, "ring_backward": ring_back * kv_block}


def full_attention_error(parts, inputs, causal):
    """On rank 0: max |result - full attention| over out, dq, dk, dv of the whole sequence."""
    whole = [torch.cat([p[i] for p in parts], dim=2) for i in range(4)]
    q, k, v, dout = (t.detach().cpu() for t in inputs)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    H = q.shape[1]
    out = F.scaled_dot_product_attention(ref[0], ring_attention.expand_kv(ref[1], H),
                                         ring_attention.expand_kv(ref[2], H), is_causal=causal)
    out.backward(dout)
    expect = [out.detach()] + [t.grad for t in ref]
    return max((a - b).abs().max().item() for a, b in zip(whole, expect))


def median_time(fn, repeats, device):
    """Median over `repeats` of fn()'s seconds on the slowest rank (every rank calls this)."""
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = timing.clock(device)
        fn()
        took = torch.tensor([timing.clock(device) - t0], device=device)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
        times.append(took.item())
    return statistics.median(times)


def run_case(args, d, P, group, T, causal):
    """One (P, T, mask) on ranks 0..P-1 (the others wait): Ulysses and the ring on the same
    inputs, each compared on rank 0 with full attention, counted and timed. Returns rank 0's row
    of the JSON (None on the other ranks)."""
    inputs = ring_attention.make_inputs(args.seed, T, args.batch, args.heads, args.head_dim,
                                        d.device, args.kv_heads)
    layouts, got, mine = {}, {}, None
    if d.rank < P:
        lo, hi = bounds(T, P, d.rank)
        mine = [t[:, :, lo:hi] for t in inputs]           # this rank's positions
        g, ring = SeqGroup(group, T), ring_attention.Ring(d.rank, P)
        layouts = {
            "ulysses": lambda q, k, v: ulysses_attention(q, k, v, causal, g),
            "ring": lambda q, k, v: ring_attention.RingAttention.apply(q, k, v, T, causal, True,
                                                                       ring)}
        got = {name: counted(attend, mine) for name, attend in layouts.items()}
    parts = [p for p in report.gather({n: [t.cpu() for t in r] for n, (r, _) in got.items()})
             if p]
    times = {}
    for name in ("ulysses", "ring"):  # ranks outside the group time nothing, but join the barriers
        attend = layouts.get(name)
        times[name] = median_time(lambda: attend and forward_backward(attend, *mine),
                                  args.repeats, d.device)
    if d.rank != 0:
        return None
    err = {n: full_attention_error([p[n] for p in parts], inputs, causal) for n in got}
    # `~`: rounding differences depend on the CPU's kernels, times on the machine's speed
    print(f"P={P} T={T:5d} {'causal' if causal else 'full  '} | max |ulysses - full| "
          f"~{err['ulysses']:.1e}, |ring - full| ~{err['ring']:.1e} | fwd+bwd median of "
          f"{args.repeats}: ulysses {times['ulysses'] * 1e3:.1f} ms, ring "
          f"{times['ring'] * 1e3:.1f} ms", flush=True)
    measured = {f"{n}_{ph}": got[n][1][f"{kind}_{ph}"] for n, kind in
                (("ulysses", "all_to_all"), ("ring", "send")) for ph in ("forward", "backward")}
    block = args.batch * (T // P) * args.heads * args.head_dim * 4
    kv_block = block * args.kv_heads // args.heads
    even = T % P == 0
    return {"size": P, "seq_len": T, "causal": causal, "max_abs_err_vs_full": err,
            "fwd_bwd_s": times, "block_bytes": block if even else None,
            "kv_block_bytes": kv_block if even else None,
            "measured_calls_and_bytes": measured,
            "formula_bytes": formulas(P, block, kv_block) if even else None}


def print_traffic(rows, gqa: bool):
    """Rank 0's bytes against the formulas, one line per (P, T) that P divides (with uneven
    blocks the counter's (P - 1) / P share of an all-to-all is not exact); the mask changes no
    transfer (the ring passes every block, causal or not)."""
    seen, lines = set(), []
    for row in rows:
        if (row["size"], row["seq_len"]) in seen or row["formula_bytes"] is None:
            continue
        seen.add((row["size"], row["seq_len"]))
        m, f = row["measured_calls_and_bytes"], row["formula_bytes"]
        kv = f" kv block {row['kv_block_bytes']:7d}" if gqa else ""
        lines.append(
            f"P={row['size']} T={row['seq_len']:5d} block {row['block_bytes']:7d}{kv} | ulysses "
            f"{m['ulysses_forward'][0]} / {m['ulysses_backward'][0]} all-to-alls: "
            f"{m['ulysses_forward'][1]} ({f['ulysses_forward']}) / {m['ulysses_backward'][1]} "
            f"({f['ulysses_backward']}) | ring {m['ring_forward'][0]} / "
            f"{m['ring_backward'][0]} sends: {m['ring_forward'][1]} ({f['ring_forward']}) / "
            f"{m['ring_backward'][1]} ({f['ring_backward']})")
    if lines and not gqa:
        print("bytes rank 0 sends, forward / backward, measured (formula); block = B x T/P x H x "
              "D x 4; ulysses 4 (P-1)/P blocks each way; ring 2 (P-1) forward, 2 (P-1) + 2P "
              "backward", *lines, sep="\n", flush=True)
    elif lines:
        print("bytes rank 0 sends, forward / backward, measured (formula); block = B x T/P x H x "
              "D x 4, kv block the same with H_kv heads; ulysses 2 (P-1)/P (block + kv block) "
              "each way; ring 2 (P-1) kv blocks forward, 2 (P-1) + 2P backward", *lines,
              sep="\n", flush=True)


def run(args, d):
    masks = {"causal": [True], "none": [False], "both": [False, True]}[args.mask]
    gqa = args.kv_heads != args.heads
    kv = f" ({args.kv_heads} key/value heads)" if gqa else ""
    report.print0(f"ulysses and ring attention | batch {args.batch} x {args.heads} heads{kv} x "
                  f"head_dim {args.head_dim} | float32 | device {d.device}")
    # Ulysses group of P = ranks 0..P-1: every rank takes part in creating every group
    groups = {P: dist.new_group(list(range(P))) for P in args.sizes}
    rows = [run_case(args, d, P, groups[P], T, causal)
            for P in args.sizes for T in args.seq_lens for causal in masks]
    if d.rank == 0:
        print_traffic(rows, gqa)
        if args.json_out:
            report.write_json(args.json_out, {
                "script": SCRIPT, "world_size": d.world_size, "batch": args.batch,
                "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
                "repeats": args.repeats,
                "device": str(d.device), "torch_version": torch.__version__, "results": rows})
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
    p.add_argument("--sizes", default="",
                   help="comma-separated group sizes P, each run on ranks 0..P-1 in turn "
                        "(default: one group of all ranks)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=4, help="H: each rank attends with H / P heads")
    p.add_argument("--kv-heads", type=int, default=None,
                   help="H_kv key/value heads (grouped-query attention; default: H); P must "
                        "divide it too (with --formula-only P may also be a multiple of it)")
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3, help="timed forward+backward runs per case")
    p.add_argument("--formula-only", action="store_true",
                   help="print the bytes one rank sends per the formulas, forward and per "
                        "training step (cost_model.context_parallel_bytes, bf16) for --sizes "
                        "and --seq-lens; no launch (P may then be a multiple of --kv-heads: "
                        "Ulysses repeats each key/value head)")
    args = p.parse_args(argv)
    try:
        args.seq_lens = [int(t) for t in args.seq_lens.split(",")]
        args.sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else []
    except ValueError:
        cli.fail(f"--seq-lens and --sizes expect integers like 512 or 2,4, got "
                 f"{args.seq_lens!r} and {args.sizes!r}")
    cli.check_positive(args, "batch", "heads", "kv_heads", "head_dim", "repeats", "timeout_s")
    args.kv_heads = args.kv_heads or args.heads
    if args.heads % args.kv_heads:
        cli.fail(f"--kv-heads {args.kv_heads} does not divide --heads {args.heads}: each "
                 f"key/value head serves a whole group of query heads")
    world = args.formula_only and max(args.sizes or [1]) or launch.launched().world_size
    args.sizes = args.sizes or [world]  # before any process group: every rank fails alike
    if not all(1 <= s <= world for s in args.sizes):
        cli.fail(f"--sizes {args.sizes} must lie between 1 and the world size {world}")
    for P in args.sizes:
        if args.heads % P:
            cli.fail(f"--heads {args.heads} is not divisible by P = {P}: Ulysses gives every "
                     f"rank H / P whole heads (ring attention has no such limit)")
        # the formulas also cost P a multiple of H_kv (each key/value head repeated P / H_kv
        # times, one per rank); this script's all-to-alls do not repeat heads
        repeats = args.formula_only and P > args.kv_heads and P % args.kv_heads == 0
        if args.kv_heads % P and not repeats:
            cli.fail(f"--kv-heads {args.kv_heads} is not divisible by P = {P}: Ulysses gives "
                     f"every rank H_kv / P whole key/value heads (the ring has no such limit)")
    uneven = [(T, P) for T in args.seq_lens for P in args.sizes if T % P]
    if args.formula_only and uneven:
        cli.fail(f"--seq-lens {uneven[0][0]} is not divisible by P = {uneven[0][1]}: the "
                 f"formulas count equal shares of T / P positions per rank")
    if min(args.seq_lens) < max(args.sizes):
        cli.fail(f"--seq-lens {min(args.seq_lens)} is shorter than a group of {max(args.sizes)} "
                 f"ranks: every rank needs at least one position")
    return args


def print_formulas(args):
    """The bytes per rank of both layouts at each P and T, from the formulas alone, in bf16 (2
    bytes an element): what a GPU run of this shape would send in one attention forward and in a
    training step (forward and backward). Where P exceeds H_kv, Ulysses repeats each key/value
    head P / H_kv times (DeepSpeed's UlyssesSPAttentionHF), and the line says so."""
    print(f"bytes one rank sends (bf16) | {args.heads} heads, {args.kv_heads} key/value heads x "
          f"head_dim {args.head_dim}, batch {args.batch} | cost_model.context_parallel_bytes")
    for T in args.seq_lens:
        for P in args.sizes:
            cols = []
            for step, name in (("forward", "forward"), ("step", "step (fwd + bwd)")):
                u, r = (cost_model.context_parallel_bytes(kind, P, args.heads, args.kv_heads,
                                                          args.head_dim, T, args.batch, 2, step)
                        for kind in ("ulysses", "ring"))
                cols.append(f"{name}: ulysses {u / 2**20:6.1f} MiB, ring {r / 2**20:6.1f} MiB, "
                            f"ring / ulysses {r / u:.2f}")
            repeat = (f" | ulysses repeats each key/value head {P // args.kv_heads}x"
                      if P > args.kv_heads else "")
            print(f"P={P:<2d} T={T} | " + " | ".join(cols) + repeat)


def main(argv=None):
    args = parse_args(argv)
    if args.formula_only:
        print_formulas(args)
        return
    with launch.distributed(args.device, args.timeout_s) as d:
        run(args, d)


if __name__ == "__main__":
    main()

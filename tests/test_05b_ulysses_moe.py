"""Lesson 05b, Ulysses and dropless MoE: Ulysses and ring attention compute full attention, their
bytes follow their formulas, the dropless MoE computes what a token-by-token MoE computes, and the
capacity rule it replaces drops a counted number of tokens.

Four launches serve the equivalence and traffic tests: the README's two commands (run verbatim,
their quoted output re-checked), and one launch per world size (2 and 4) of this file itself as a
worker (the block at the bottom), which drives the two scripts' own functions and saves the
tensors the tests compare (the scripts do not write them).

    torchrun --nproc_per_node=2 tests/test_05b_ulysses_moe.py OUT.pt      (what the fixture runs)
"""

import math
import re
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import REPO, assert_state_dicts_close, run_documented, run_torchrun

from dtcourse import lessons
from dtcourse.data import classification_batch

LESSON = REPO / "05-advanced" / "b-pipeline-expert-context"
README = LESSON / "README.md"
DROPLESS_PAGE = LESSON / "moe_dropless.md"  # the dropless MoE's deep-dive page
ULYSSES_DOC = ("torchrun --nproc_per_node=4 05-advanced/b-pipeline-expert-context/"
               "ulysses_attention.py --sizes 2,4 --seq-lens 256,512")
DROPLESS_DOC = "torchrun --nproc_per_node=2 05-advanced/b-pipeline-expert-context/moe_dropless.py"

# The worker's cases: lengths that split unevenly over 2 and 4 ranks (37) and over 4 (50), both
# masks, the scripts' defaults otherwise (seed 0; 1 x 4 heads x 32; 8 experts, top-2, 64 tokens
# per rank in groups of 16, capacity factor 1.25, aux weight 0.01).
LENS = (37, 50)
HEADS, HEAD_DIM = 4, 32
TOKENS_PER_RANK, GROUP, EXPERTS, TOP_K, AUX = 64, 16, 8, 2, 0.01
CAPACITY = math.ceil(TOP_K * GROUP * 1.25 / EXPERTS)  # 5 slots per expert per group
# Grouped-query attention: 8 query heads sharing 4 key/value heads (P = 2 and 4 divide both, as
# Ulysses needs), causal, over 48 positions (an even split, so the bytes are exact)
GQA_T, GQA_HEADS, GQA_KV = 48, 8, 4


@pytest.fixture(autouse=True)
def one_thread():
    """References computed here use one thread, like the launched ranks."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    """Per world size, the tensors the worker saved (see `work` below)."""
    saved = {}
    for world in (2, 4):
        out = tmp_path_factory.mktemp(f"w{world}") / "cases.pt"
        run_torchrun("tests/test_05b_ulysses_moe.py", out, nproc=world, timeout=180)
        saved[world] = torch.load(out, weights_only=True)
    return saved


# --------------------------------------------------------------------------------------------------
# Attention


@pytest.mark.parametrize("world", [2, 4])
def test_ulysses_and_ring_equal_full_attention(workers, world):
    cases = workers[world]["attention"]
    assert set(cases) == {f"T{t}/{m}" for t in LENS for m in ("full", "causal")}
    for key, c in cases.items():
        # The truth in float64 on the whole sequence: the (T, T) scores neither layout builds.
        q, k, v = (c[n].double().requires_grad_() for n in ("q", "k", "v"))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=c["causal"])
        out.backward(c["dout"].double())
        want = {"out": out, "dq": q.grad, "dk": k.grad, "dv": v.grad}
        for layout in ("ulysses", "ring"):
            for name, got in zip(("out", "dq", "dk", "dv"), c[layout]):
                # float32 against float64: softmax over <= 50 keys of order-1 scores, and in the
                # ring the online-softmax rescaling, round at float32's 6e-8 per operation; seen
                # up to 1.8e-6 (the one-process float32 attention errs as much). 1e-5 keeps a 5x
                # margin; a wrong head, block, position or mask moves results by >= 1e-2.
                torch.testing.assert_close(
                    got, want[name].float(), rtol=1e-5, atol=1e-5,
                    msg=lambda m, n=name, lay=layout, k=key: f"world {world} {k} {lay} {n}: {m}")


@pytest.mark.parametrize("world", [2, 4])
def test_grouped_kv_heads_equal_full_attention_and_send_the_cost_model_bytes(workers, world):
    c = workers[world]["gqa"]
    # the truth in float64: every query head attends with its group's key/value head
    q, k, v = (c[n].double().requires_grad_() for n in ("q", "k", "v"))
    group = GQA_HEADS // GQA_KV
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1),
                                         v.repeat_interleave(group, 1), is_causal=True)
    out.backward(c["dout"].double())
    want = {"out": out, "dq": q.grad, "dk": k.grad, "dv": v.grad}
    assert c["k"].shape[1] == GQA_KV and c["q"].shape[1] == GQA_HEADS
    for layout in ("ulysses", "ring"):
        for name, got in zip(("out", "dq", "dk", "dv"), c[layout]):
            # the tolerance of the multi-head test above, with the same argument: a key/value
            # head matched to the wrong query group moves results by >= 1e-2
            torch.testing.assert_close(got, want[name].float(), rtol=1e-5, atol=1e-5,
                                       msg=lambda m, n=name, lay=layout: f"{lay} {n}: {m}")
    # the bytes rank 0 sent in forward and in backward, counted by the collective counter,
    # against the cost model's formulas: Ulysses (P-1)/P (2H + 2H_kv) D T/P each way, the ring
    # 2 (P-1) H_kv D T/P forward and (2 (P-1) + 2P) H_kv D T/P backward, float32; a training step
    # is their sum
    cost_model = lessons.load(REPO / "05-advanced" / "cost_model.py")
    calls_and_bytes = c["traffic"]
    sent = {}
    for kind, counted_as in (("ulysses", "all_to_all"), ("ring", "send")):
        for phase in ("forward", "backward"):
            expect = cost_model.context_parallel_bytes(kind, world, GQA_HEADS, GQA_KV, HEAD_DIM,
                                                       GQA_T, batch=1, bytes_per_el=4, step=phase)
            assert calls_and_bytes[kind][f"{counted_as}_{phase}"][1] == expect, (kind, phase)
        sent[kind] = sum(calls_and_bytes[kind][f"{counted_as}_{ph}"][1]
                         for ph in ("forward", "backward"))
        assert sent[kind] == cost_model.context_parallel_bytes(
            kind, world, GQA_HEADS, GQA_KV, HEAD_DIM, GQA_T, step="step"), kind
    # H = 8, H_kv = 4, in units of S = D T/P x 4 bytes: per step Ulysses 2 (P-1)/P x 24 S, the
    # ring (6P - 4) x 4 S: 24 against 32 at P = 2 (where the ring sends fewer forward, 8 against
    # 12), 36 against 80 at P = 4
    s = HEAD_DIM * GQA_T // world * 4
    assert (sent["ulysses"], sent["ring"]) == ({2: 24, 4: 36}[world] * s, {2: 32, 4: 80}[world] * s)
    if world == 2:
        assert calls_and_bytes["ring"]["send_forward"][1] == 8 * s
        assert calls_and_bytes["ulysses"]["all_to_all_forward"][1] == 12 * s
    # fewer than the multi-head formulas give: the ring's k, v carry H_kv / H of the heads
    assert calls_and_bytes["ring"]["send_forward"][1] == (
        cost_model.context_parallel_bytes("ring", world, GQA_HEADS, GQA_HEADS, HEAD_DIM, GQA_T)
        * GQA_KV // GQA_HEADS)


def test_formula_only_prints_forward_and_per_step_bytes_with_kv_repetition_past_h_kv(capsys):
    # The README's Llama 3 70B comparison (H 64, H_kv 8, D 128, T 8192, bf16), printed by the
    # script without a launch from cost_model.context_parallel_bytes: forward, the ring sends
    # fewer bytes up to P = 8; per training step only up to P = 4. At P = 16 Ulysses repeats each
    # key/value head twice, so its k, v all-to-alls carry P heads: (P-1)/P (2H + 2P) S.
    ulysses = lessons.load(LESSON / "ulysses_attention.py")
    ulysses.main(["--formula-only", "--heads", "64", "--kv-heads", "8", "--head-dim", "128",
                  "--seq-lens", "8192", "--sizes", "2,4,8,16"])
    rows = re.findall(r"^P=(\d+)\s+T=8192 \| forward: ulysses\s+(\S+) MiB, ring\s+(\S+) MiB, "
                      r"ring / ulysses (\S+) \| step \(fwd \+ bwd\): ulysses\s+(\S+) MiB, "
                      r"ring\s+(\S+) MiB, ring / ulysses (\S+)(.*)$", capsys.readouterr().out,
                      re.M)
    got = {int(r[0]): [float(x) for x in r[1:7]] + [r[7]] for r in rows}
    S = 8192 * 128 * 2 / 2**20  # MiB of one head's whole sequence; a rank's share is S / P
    for P in (2, 4, 8, 16):
        kv = max(8, P)
        u_fwd = (P - 1) / P * (2 * 64 + 2 * kv) * S / P
        r_fwd, r_bwd = 2 * (P - 1) * 8 * S / P, (2 * (P - 1) + 2 * P) * 8 * S / P
        assert got[P][:6] == pytest.approx(
            [u_fwd, r_fwd, round(r_fwd / u_fwd, 2), 2 * u_fwd, r_fwd + r_bwd,
             round((r_fwd + r_bwd) / (2 * u_fwd), 2)], abs=0.051), P
        assert ("repeats each key/value head 2x" in got[P][6]) == (P == 16)
    assert [got[P][5] for P in (2, 4, 8)] == [0.44, 0.74, 1.40]   # the README's per-step ratios
    assert [got[P][2] for P in (2, 4, 8, 16)] == [0.22, 0.44, 0.89, 1.60]
    # a length the group does not divide is refused with one line, not a traceback
    with pytest.raises(SystemExit) as stop:
        ulysses.main(["--formula-only", "--heads", "96", "--kv-heads", "3", "--sizes", "3",
                      "--seq-lens", "8192"])
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip().endswith(
        "--seq-lens 8192 is not divisible by P = 3: the formulas count equal shares of T / P "
        "positions per rank")
    # the function names the condition that fails
    cost_model = lessons.load(REPO / "05-advanced" / "cost_model.py")
    with pytest.raises(ValueError, match="Ulysses needs p = 12 to divide kv_heads = 8, or to be"):
        cost_model.context_parallel_bytes("ulysses", 12, 96, 8, 128, 8184)
    with pytest.raises(ValueError, match="p = 3 ranks must divide seq_len = 8192"):
        cost_model.context_parallel_bytes("ring", 3, 64, 8, 128, 8192)


TRAFFIC = re.compile(
    r"^P=(\d+) T=\s*(\d+) block\s+(\d+) \| ulysses (\d+) / (\d+) all-to-alls: (\d+) \((\d+)\) / "
    r"(\d+) \((\d+)\) \| ring (\d+) / (\d+) sends: (\d+) \((\d+)\) / (\d+) \((\d+)\)$", re.M)
CASE = re.compile(r"^P=(\d+) T=\s*(\d+) (full|causal)\s*\| max \|ulysses - full\| ~(\S+), "
                  r"\|ring - full\| ~(\S+) \|", re.M)


@pytest.fixture(scope="module")
def ulysses_doc():
    return run_documented(README, ULYSSES_DOC).stdout


def test_measured_bytes_equal_the_formulas(ulysses_doc):
    rows = {(int(m[0]), int(m[1])): [int(x) for x in m[2:]]
            for m in TRAFFIC.findall(ulysses_doc)}
    assert set(rows) == {(p, t) for p in (2, 4) for t in (256, 512)}, ulysses_doc
    for (P, T), (block, u_calls_f, u_calls_b, u_f, u_f_formula, u_b, u_b_formula,
                 r_calls_f, r_calls_b, r_f, r_f_formula, r_b, r_b_formula) in rows.items():
        assert block == 1 * (T // P) * HEADS * HEAD_DIM * 4   # one rank's q (or k, v): B T/P H D
        # Ulysses: q, k, v and the output, each rank keeping 1/P of a block; backward the same
        # four in reverse (dout in, dq, dk, dv out)
        assert (u_calls_f, u_calls_b) == (4, 4)
        assert u_f == u_b == 4 * block * (P - 1) // P
        # ring: P - 1 hops of (k, v) forward; backward the same hops and (dk, dv) once round
        assert (r_calls_f, r_calls_b) == (2 * (P - 1), 2 * (P - 1) + 2 * P)
        assert r_f == 2 * (P - 1) * block and r_b == (2 * (P - 1) + 2 * P) * block
        # and the script's printed formulas agree with these, as does the cost model's function
        assert (u_f_formula, u_b_formula, r_f_formula, r_b_formula) == (u_f, u_b, r_f, r_b)
        cost_model = lessons.load(REPO / "05-advanced" / "cost_model.py")
        assert [cost_model.context_parallel_bytes(kind, P, HEADS, HEADS, HEAD_DIM, T, step=ph)
                for kind in ("ulysses", "ring") for ph in ("forward", "backward")] == [
                    u_f, u_b, r_f, r_b]
    # On a fixed share per rank (T / P = 128: P = 2 at T = 256, P = 4 at T = 512) Ulysses sends
    # 2 then 3 blocks forward, bounded by 4; the ring 2 then 6, growing with P.
    assert rows[(4, 512)][0] == rows[(2, 256)][0]
    assert rows[(4, 512)][3] / rows[(2, 256)][3] == 1.5
    assert rows[(4, 512)][9] / rows[(2, 256)][9] == 3
    # the script's own check against full attention, for every case of the command
    cases = CASE.findall(ulysses_doc)
    assert len(cases) == 8, ulysses_doc
    for *_, err_ulysses, err_ring in cases:
        assert float(err_ulysses) < 1e-5 and float(err_ring) < 1e-5


@pytest.mark.parametrize("rank", [0, 1])
def test_heads_that_do_not_divide_among_the_ranks_are_refused_before_any_collective(
        monkeypatch, capsys, rank):
    # Ulysses gives each rank H / P whole heads: 3 heads over 2 ranks is refused by the argument
    # check, which reads the world size from the launcher's variables (no process group yet).
    # Every rank computes the same refusal; here each one's, in this process.
    for name, value in {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": 2,
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": 1}.items():
        monkeypatch.setenv(name, str(value))
    ulysses = lessons.load(LESSON / "ulysses_attention.py")
    with pytest.raises(SystemExit) as stop:
        ulysses.parse_args(["--heads", "3"])
    assert stop.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and re.match(
        rf"^\[rank {rank}\] error: --heads 3 is not divisible by P = 2: ", lines[0]), lines


# --------------------------------------------------------------------------------------------------
# Dropless mixture of experts


def token_by_token(model, x):
    """The MoE model of one process, token by token: each token through each of its top-k
    experts, weighted by its router probability; no capacity. Returns the loss and the MoE
    layer's output."""
    h = model.embed(x)
    n = model.norm(h)
    probs = F.softmax(model.moe.router(n), dim=-1)
    rows = []
    for t in range(len(x)):
        weight, chosen = probs[t].topk(TOP_K)
        rows.append(sum(w * model.moe.experts[str(int(e))](n[t]) for w, e in zip(weight, chosen)))
    out = torch.stack(rows)
    aux = 0
    for g0 in range(0, len(x), GROUP):  # Switch loss per group of 16: E sum_e f_e P_e
        group = probs[g0:g0 + GROUP]
        first = F.one_hot(group.argmax(-1), EXPERTS).float().mean(0)
        aux = aux + EXPERTS * (first * group.mean(0)).sum()
    logits = model.head(h + out)
    return F.cross_entropy(logits, classification_batch(0, 0, len(x))[1]) \
        + AUX * aux / (len(x) // GROUP), out


def seed_weights():
    """The MoE model's weights as every script builds them: seed 0, all 8 experts."""
    torch.manual_seed(0)
    return lessons.load(LESSON / "expert_parallel.py").MoEModel().state_dict()


def routed(weights, x):
    """The MoE model (expert_parallel.MoEModel) with these weights, and each token's top-k
    experts."""
    model = lessons.load(LESSON / "expert_parallel.py").MoEModel()
    model.load_state_dict(weights, strict=True)          # every rank's experts, consolidated
    with torch.no_grad():
        choice = F.softmax(model.moe.router(model.norm(model.embed(x))), -1).topk(TOP_K)[1]
    return model, choice


def capacity_drops(choice):
    """What expert_parallel.py's capacity rule drops from this routing: in each group of 16
    tokens an expert takes C assignments, so max(0, n_e - C) of its n_e are dropped."""
    n = F.one_hot(choice.reshape(-1, GROUP * TOP_K), EXPERTS).sum(1)  # (groups, E)
    return int((n - CAPACITY).clamp(min=0).sum())


@pytest.mark.parametrize("world", [2, 4])
def test_dropless_moe_equals_a_token_by_token_moe(workers, world):
    m = workers[world]["moe"]
    # the run started from the seed's weights (consolidated over the ranks) and step 0's tokens
    assert_state_dicts_close(m["weights"], seed_weights(), rtol=0, atol=0)
    x = m["x"]
    assert torch.equal(x, classification_batch(0, 0, world * TOKENS_PER_RANK)[0])
    model, choice = routed(m["weights"], x)
    loss, out = token_by_token(model, x)
    loss.backward()
    # float32, the same terms summed in another order (expert by expert, rank by rank): a few
    # ulps of order-1 values (seen <= 1.2e-7 on the outputs, 3e-8 on gradients of <= 0.1);
    # 1e-6 absolute is an 8x margin, and a lost or doubled token, a wrong weight or a missing
    # gradient reduction moves results by >= 1e-3.
    torch.testing.assert_close(m["moe_out"], out.detach(), rtol=1e-5, atol=1e-6)
    for name, p in model.named_parameters():
        want = p.grad if p.grad is not None else torch.zeros_like(p)
        torch.testing.assert_close(m["grads"][name], want, rtol=1e-5, atol=1e-6,
                                   msg=lambda msg, n=name: f"world {world} {n}: {msg}")
    # every assignment reached its expert, and the experts ran on exactly those rows
    assert m["computed"] == TOP_K * len(x)
    assert m["capacity_drops"] == capacity_drops(choice) > 0


STEP = re.compile(r"^step\s+(\d+)/20 \| loss \S+ \| tokens per expert \[([\d, ]+)\] \| computed "
                  r"(\d+) of (\d+) \| capacity would drop (\d+) \| all-to-alls send at most "
                  r"(\d+) \(out\) and (\d+) \(back\) bytes per rank$", re.M)


def test_the_capacity_rule_drops_tokens_where_dropless_computes_all():
    stdout = run_documented(DROPLESS_PAGE, DROPLESS_DOC).stdout
    steps = STEP.findall(stdout)
    assert [int(s[0]) for s in steps] == [1, 5, 10, 15, 20], stdout
    for _, per_expert, computed, total, *_ in steps:
        counts = [int(c) for c in per_expert.split(",")]
        assert int(computed) == int(total) == sum(counts) == TOP_K * 2 * TOKENS_PER_RANK
    # Step 1 routes step 0's 128 tokens with the seed's weights: the count the capacity rule
    # drops, computed here from them, is the one the run prints, and it is not zero.
    _, choice = routed(seed_weights(), classification_batch(0, 0, 2 * TOKENS_PER_RANK)[0])
    dropped = capacity_drops(choice)
    assert dropped > 0 and int(steps[0][4]) == dropped
    # Out: rank r sends the rows of its assignments to the other rank's experts (4 each), 64
    # float32 values a row; back: it returns the other rank's rows, what that rank sent out, so
    # on 2 ranks the busiest rank of each all-to-all (printed) sends the same.
    out = [int(((c >= 4) if r == 0 else (c < 4)).sum()) * 64 * 4
           for r, c in enumerate(choice.split(TOKENS_PER_RANK))]
    assert int(steps[0][5]) == int(steps[0][6]) == max(out)


# --------------------------------------------------------------------------------------------------
# The worker: launched by the fixture above with torchrun, not collected by pytest


def work(out: Path):
    from unittest import mock

    import torch.distributed as dist

    from dtcourse import launch, report

    ulysses = lessons.load(LESSON / "ulysses_attention.py")
    dropless = lessons.load(LESSON / "moe_dropless.py")
    ring_attention = ulysses.ring_attention
    saved = {"attention": {}}
    with launch.distributed("cpu", 120) as d:
        W = d.world_size
        for T in LENS:
            for causal in (False, True):
                inputs = ring_attention.make_inputs(0, T, 1, HEADS, HEAD_DIM, d.device)
                lo, hi = ring_attention.bounds(T, W, d.rank)
                mine = [t[:, :, lo:hi] for t in inputs]
                g, ring = ulysses.SeqGroup(dist.group.WORLD, T), ring_attention.Ring(d.rank, W)
                got = {
                    "ulysses": ulysses.forward_backward(
                        lambda q, k, v: ulysses.ulysses_attention(q, k, v, causal, g), *mine),
                    "ring": ulysses.forward_backward(
                        lambda q, k, v: ring_attention.RingAttention.apply(
                            q, k, v, T, causal, True, ring), *mine)}
                parts = report.gather({n: [t.cpu() for t in r] for n, r in got.items()})
                case = dict(zip(("q", "k", "v", "dout"), inputs), causal=causal)
                for n in got:  # the ranks' positions, in order: the whole sequence
                    case[n] = [torch.cat([p[n][i] for p in parts], dim=2) for i in range(4)]
                saved["attention"][f"T{T}/{'causal' if causal else 'full'}"] = case
        # grouped KV heads, causal: results and the bytes each layout sent, counted
        inputs = ring_attention.make_inputs(0, GQA_T, 1, GQA_HEADS, HEAD_DIM, d.device, GQA_KV)
        lo, hi = ring_attention.bounds(GQA_T, W, d.rank)
        mine = [t[:, :, lo:hi] for t in inputs]
        g, ring = ulysses.SeqGroup(dist.group.WORLD, GQA_T), ring_attention.Ring(d.rank, W)
        got = {"ulysses": ulysses.counted(
                   lambda q, k, v: ulysses.ulysses_attention(q, k, v, True, g), mine),
               "ring": ulysses.counted(
                   lambda q, k, v: ring_attention.RingAttention.apply(q, k, v, GQA_T, True, True,
                                                                      ring), mine)}
        parts = report.gather({n: [t.cpu() for t in r] for n, (r, _) in got.items()})
        case = dict(zip(("q", "k", "v", "dout"), inputs),
                    traffic={n: traffic for n, (_, traffic) in got.items()})
        for n in got:
            case[n] = [torch.cat([p[n][i] for p in parts], dim=2) for i in range(4)]
        saved["gqa"] = case
        # The first training step of moe_dropless.py through its own build() and step. It takes
        # no optimizer step, so AdamW is left out: building one imports torch._dynamo, about
        # 1.6 s of CPU per rank on this machine.
        args = dropless.parse_args(["--batch-size", str(TOKENS_PER_RANK)])
        with mock.patch("torch.optim.AdamW"):
            model, _, replicated = dropless.build(args, d)
        initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
        _, stats, x = dropless.ep.forward_backward(args, d, model, replicated, step=0)
        mine = {"weights": initial, "x": x, "moe_out": stats["moe_out"].detach(),
                "grads": {k: (p.grad if p.grad is not None else torch.zeros_like(p)).detach()
                          for k, p in model.named_parameters()},
                "computed": int(stats["computed"]), "drops": int(stats["capacity_drops"])}
        parts = report.gather(mine)
        if d.rank == 0:
            saved["moe"] = {
                "weights": {k: v for p in parts for k, v in p["weights"].items()},
                "grads": {k: v for p in parts for k, v in p["grads"].items()},
                "x": torch.cat([p["x"] for p in parts]),
                "moe_out": torch.cat([p["moe_out"] for p in parts]),
                "computed": sum(p["computed"] for p in parts),
                "capacity_drops": sum(p["drops"] for p in parts)}
            torch.save(saved, out)
        dist.barrier()


if __name__ == "__main__":
    work(Path(sys.argv[1]))

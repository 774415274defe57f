"""The two primers: lesson 01's collectives (collectives_primer.py, collectives.md) and lesson 02's
DTensor pieces (dtensor_primer.py, dtensor_primer.md).

Each primer is launched once, by its documented command run verbatim (run_readme_command also
re-checks the output its page quotes; tests/test_readmes.py then skips the command). The tests
compare what its --json-out holds with values computed here from the inputs alone: the
collectives' results from their definitions, the ring traffic from its formulas, the DTensor
shards by slicing the full tensor, and the checkpoint's contents by loading it in this process.
"""

import warnings

import pytest
import torch

from conftest import REPO, read_json, readme_mentions, run_readme_command
from dtcourse.comm import RING_SHARE
from dtcourse.models import GPT, gpt_init_value, gpt_parameter_count

COLLECTIVES_DOC = REPO / "01-ddp-basics" / "collectives.md"
DTENSOR_DOC = REPO / "02-fsdp" / "dtensor_primer.md"

# Documented commands this file runs verbatim (so test_readmes.py does not run them again).
COLLECTIVES = ("torchrun --nproc_per_node=4 01-ddp-basics/collectives_primer.py "
               "--json-out runs/collectives_primer.json")
DTENSOR = ("torchrun --nproc_per_node=4 02-fsdp/dtensor_primer.py --ckpt-dir "
           "runs/dtensor_primer_ckpt --json-out runs/dtensor_primer.json")
N = 4
CKPT = REPO / "runs" / "dtensor_primer_ckpt"


def run_documented(doc, command: str, json_out: str) -> dict:
    """Run a documented command verbatim (exit status and quoted output checked) and read the
    JSON it writes, after removing the one an earlier run left behind."""
    assert readme_mentions(doc, command), f"not in {doc}: {command}"
    (REPO / json_out).unlink(missing_ok=True)
    run_readme_command(command, timeout=180)
    return read_json(REPO / json_out)


@pytest.fixture(scope="module")
def collectives():
    result = run_documented(COLLECTIVES_DOC, COLLECTIVES, "runs/collectives_primer.json")
    assert result["world_size"] == N
    return {row["name"]: row for row in result["collectives"]}, result


@pytest.fixture(scope="module")
def dtensor():
    result = run_documented(DTENSOR_DOC, DTENSOR, "runs/dtensor_primer.json")
    assert result["world_size"] == N
    return result


# --------------------------------------------------------------------------------------------------
# collectives_primer.py


def inputs(n: int) -> torch.Tensor:
    """x[r] = rank r's tensor: [10r, 10r+1, ..., 10r+n-1]."""
    return 10.0 * torch.arange(n).unsqueeze(1) + torch.arange(n)


def expected_after(name: str, x: torch.Tensor) -> list:
    """What every rank must hold after the collective (None: it defines nothing there)."""
    n, total = x.shape[0], x.sum(dim=0)
    return {
        "broadcast": [x[0]] * n,
        "reduce": [total] + [None] * (n - 1),
        "all_reduce": [total] * n,
        "all_gather": [x.flatten()] * n,
        "reduce_scatter": [total[r:r + 1] for r in range(n)],
        "all_to_all": [x[:, r] for r in range(n)],  # the transpose: rank r gets column r
    }[name]


def test_every_collective_leaves_what_its_definition_says(collectives):
    rows, _ = collectives
    assert list(rows) == ["broadcast", "reduce", "all_reduce", "all_gather", "reduce_scatter",
                          "all_to_all"]
    x = inputs(N)
    for name, row in rows.items():
        assert torch.equal(torch.tensor(row["before"]), x), name
        for r, (got, want) in enumerate(zip(row["after"], expected_after(name, x))):
            if want is None:
                assert got is None, f"{name}: rank {r} should be reported undefined"
                continue
            # Small whole numbers in float32: exact, so no tolerance.
            assert torch.equal(torch.tensor(got), want), f"{name} rank {r}: {got} != {want}"


def test_bytes_sent_on_a_ring_follow_the_formulas(collectives):
    rows, _ = collectives
    x_bytes = N * 4  # n float32 per rank
    size = {"broadcast": x_bytes, "reduce": x_bytes, "all_reduce": x_bytes,
            "all_gather": N * x_bytes, "reduce_scatter": x_bytes, "all_to_all": x_bytes}
    ring = {"broadcast": [x_bytes] * (N - 1) + [0],  # a chain from rank 0: its end sends nothing
            "reduce": [0] + [x_bytes] * (N - 1),  # a chain ending at rank 0: the root sends nothing
            "all_reduce": [2 * (N - 1) * x_bytes / N] * N,
            "all_gather": [(N - 1) * N * x_bytes / N] * N,
            "reduce_scatter": [(N - 1) * x_bytes / N] * N,
            "all_to_all": [(N - 1) * x_bytes / N] * N}
    for name, row in rows.items():
        assert row["S_bytes"] == size[name], name
        assert row["sent_bytes"] == ring[name], name
        # The course's collective counter uses the same shares for what it measures.
        if name not in ("broadcast", "reduce"):
            assert row["sent_bytes"][0] == pytest.approx(RING_SHARE[name](N) * size[name]), name
    assert rows["all_reduce"]["sent_bytes"][0] == 24  # 2 x 3/4 x 16 bytes, as the page says


def test_reduce_scatter_then_all_gather_is_the_all_reduce(collectives):
    rows, result = collectives
    total = inputs(N).sum(dim=0).tolist()
    assert result["reduce_scatter_then_all_gather"] == [total] * N
    assert rows["all_reduce"]["after"] == [total] * N


# --------------------------------------------------------------------------------------------------
# dtensor_primer.py

A = torch.arange(16.0).reshape(4, 4)


def test_the_2d_mesh_groups_rows_and_columns(dtensor):
    assert dtensor["mesh2_ranks"] == [[0, 1], [2, 3]]
    for k, mine in enumerate(dtensor["mesh"]):
        i, j = divmod(k, 2)
        assert mine == {"coordinate": [i, j], "dp_group": [j, j + 2],
                        "tp_group": [2 * i, 2 * i + 1]}, k


def test_each_ranks_local_tensor_is_its_slice_of_the_full_tensor(dtensor):
    for k, mine in enumerate(dtensor["placements"]):
        i, j = divmod(k, 2)
        want = {"Shard(0)": A[k:k + 1], "Shard(1)": A[:, k:k + 1], "Replicate()": A,
                "(Shard(0), Shard(1))": A[2 * i:2 * i + 2, 2 * j:2 * j + 2]}
        for name, block in want.items():
            assert torch.equal(torch.tensor(mine[name]), block), f"{name} on rank {k}"
    # 5 rows over 4 ranks, as torch.chunk splits them: 2, 2, 1 and nothing for the last rank.
    chunks = [len(c) for c in torch.arange(5).chunk(N)]
    assert [m["uneven_rows"] for m in dtensor["placements"]] == chunks + [0] * (N - len(chunks))


def test_partial_settles_with_one_all_reduce_or_one_reduce_scatter(dtensor):
    total = A.sum(dim=1)  # A @ ones(4, 1)
    for k, part in enumerate(dtensor["partial"]):
        assert part["placement"] == "Partial(sum)"
        assert part["partial"] == A[:, k].tolist(), k  # rank k's term: column k of A times 1
        assert part["replicated"] == total.tolist(), k
        assert part["sharded"] == total[k:k + 1].tolist(), k
        assert part["matmul"]["counter"] == {}, "Shard(1) @ Shard(0) needs no communication"
        moves = part["redistribute"]
        # (kind the course's counter sees, op CommDebugMode names, bytes of the whole tensor)
        want = {"Shard(0) -> Replicate()": ("all_gather", "all_gather_into_tensor", 64),
                "Replicate() -> Shard(0)": None,  # each rank keeps its slice: nothing sent
                "Partial(sum) -> Replicate()": ("all_reduce", "all_reduce", 16),
                "Partial(sum) -> Shard(0)": ("reduce_scatter", "reduce_scatter_tensor", 16)}
        assert list(moves) == list(want)
        for move, expected in want.items():
            counter, debug = moves[move]["counter"], moves[move]["comm_debug_mode"]
            if expected is None:
                assert counter == {} and debug == {}, move
                continue
            kind, op, size = expected
            assert list(counter) == [kind] and counter[kind]["calls"] == 1, (move, counter)
            assert counter[kind]["group_sizes"] == [N] and counter[kind]["tensor_bytes"] == size
            assert debug == {op: 1}, (move, debug)


def test_meta_init_allocates_nothing_until_to_empty_then_a_quarter_per_rank(dtensor):
    full = 4 * gpt_parameter_count(vocab=256, seq_len=32, dim=64, layers=2)  # fp32, GPT()'s sizes
    for k, m in enumerate(dtensor["meta"]):
        assert m["full_bytes"] == full, k
        assert m["bytes_on_meta"] == 0 and m["bytes_after_fully_shard"] == 0, k
        # Every sharded dimension of GPT() divides by 4: no rank holds padding or less.
        assert m["bytes_after_to_empty"] == m["shard_bytes_planned"] == full // N, k


def test_dcp_wrote_the_listed_files_and_they_reload_to_the_initial_values(dtensor):
    ck = dtensor["dcp"]
    names = [f["name"] for f in ck["files"]]
    assert names == [".metadata"] + [f"__{r}_0.distcp" for r in range(N)]
    assert sorted(p.name for p in CKPT.iterdir()) == sorted(names)
    for f in ck["files"]:
        assert (CKPT / f["name"]).stat().st_size == f["bytes"], f["name"]
        if f["name"].endswith(".distcp"):  # each rank's file holds at least its quarter
            assert f["bytes"] >= dtensor["meta"][0]["full_bytes"] // N, f
    assert ck["reloaded_world_n"] is True and ck["reloaded_world_1"] is True

    # Loaded here, in one process without a process group, into a plain GPT's tensors: every
    # tensor equals GPT's initial value, computed from its name and the seed (0, the default).
    import torch.distributed.checkpoint as dcp
    shapes = {k: v.shape for k, v in GPT().state_dict().items()}
    state = {"model": {k: torch.empty(s) for k, s in shapes.items()}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process"
        dcp.load(state, checkpoint_id=str(CKPT))
    assert len(state["model"]) == ck["tensors"]
    for name, value in state["model"].items():
        assert torch.equal(value, gpt_init_value(name, shapes[name], seed=0, layers=2)), name

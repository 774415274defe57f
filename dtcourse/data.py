"""Deterministic synthetic data: the global batch of step t is a pure function of (seed, t).

Every rank builds the whole global batch and keeps its own rows, `rank_rows(rank, B)`, so a run
with D data-parallel ranks and batch B sees exactly the samples of one process with batch D x B,
whatever the launcher, and a resumed run sees what an uninterrupted one would have.
"""

from __future__ import annotations

import torch


def classification_batch(seed: int, step: int, size: int, features: int = 32,
                         classes: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    """(size, features) inputs and (size,) labels. A fixed random linear 'teacher' (the same for
    every step) labels each input with its argmax class, so the task is learnable."""
    teacher = torch.randn(features, classes, generator=torch.Generator().manual_seed(seed + 12345))
    x = torch.randn(size, features, generator=torch.Generator().manual_seed(seed * 100003 + step))
    return x, (x @ teacher).argmax(dim=1)


def token_batch(seed: int, step: int, size: int, seq_len: int,
                vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(size, seq_len) input token ids and next-token targets: arithmetic sequences modulo `vocab`
    with a random start and a random stride from 1 to 7, so the next token follows from the
    previous two (a task that needs attention, not only the current token)."""
    g = torch.Generator().manual_seed(seed * 100003 + step)
    start = torch.randint(0, vocab, (size, 1), generator=g)
    stride = torch.randint(1, 8, (size, 1), generator=g)
    tokens = (start + stride * torch.arange(seq_len + 1)) % vocab
    return tokens[:, :-1], tokens[:, 1:]


def rank_rows(rank: int, per_rank: int) -> slice:
    """Rows rank*per_rank .. (rank+1)*per_rank - 1 of the global batch: data-parallel rank r's."""
    return slice(rank * per_rank, (rank + 1) * per_rank)

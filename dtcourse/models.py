"""The models that several lessons train, defined once so that "the same model" is one class.

MLP          the classifier of lessons 01 and 05: 32 features -> `hidden` x `depth` -> 10 classes.
ResidualMLP  the same task through `depth` pre-norm residual blocks: the model lesson 02 shards
             and checkpoints block by block, and lesson 05b cuts into pipeline stages.
GPT          the decoder-only transformer of lessons 02, 03 and 05: token + position
             embeddings, `layers` pre-norm blocks (causal self-attention, then a 4x MLP), a final
             norm and the LM head.

GPT's attention keeps q, k and v as three layers rather than one fused matrix: splitting each by
output rows gives a tensor-parallel rank the same heads in all three, and DeepSpeed's AutoTP
recognises them. Its weights come from `init_gpt(model, seed)`, which draws every parameter's full
tensor from a generator seeded by (seed, name): a model that is whole, sharded (FSDP2's DTensors)
or cut into pipeline stages gets the same values, so any layout can be compared with one process.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


class MLP(nn.Module):
    """(B, features) -> (B, classes): `depth` hidden layers of width `hidden` with GELU. Its
    weights are torch's default initialisation: seed with torch.manual_seed before building."""

    def __init__(self, hidden: int = 128, depth: int = 2, features: int = 32, classes: int = 10):
        super().__init__()
        layers, width = [], features
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.GELU()]
            width = hidden
        self.net = nn.Sequential(*layers, nn.Linear(width, classes))

    def forward(self, x):
        return self.net(x)


class ResidualBlock(nn.Module):
    """x + fc2(GELU(fc1(LayerNorm(x)))), (B, hidden) -> (B, hidden): one FSDP unit, one pipeline
    layer."""

    def __init__(self, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.fc1, self.fc2 = nn.Linear(hidden, 2 * hidden), nn.Linear(2 * hidden, hidden)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class ResidualMLP(nn.Module):
    """(B, features) -> embed -> `depth` residual blocks -> head -> (B, classes). Default
    initialisation: seed with torch.manual_seed before building."""

    def __init__(self, hidden: int, depth: int, features: int = 32, classes: int = 10):
        super().__init__()
        self.embed = nn.Linear(features, hidden)
        self.blocks = nn.ModuleList(ResidualBlock(hidden) for _ in range(depth))
        self.head = nn.Linear(hidden, classes)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Attention(nn.Module):
    """Causal multi-head self-attention, (B, T, dim) -> (B, T, dim)."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.head_dim = dim // heads
        # No bias on k: it adds q.b_k to every score of a query's row, which softmax ignores, so
        # its gradient is exactly zero; Adam turns the float rounding left in it into steps of
        # about lr x noise / (noise + eps) that differ between parallel layouts: small next to
        # lr with fp32 noise (~1e-11) and eps 1e-8, up to lr with bf16's or a smaller eps.
        self.q, self.k, self.v = (nn.Linear(dim, dim, bias=name != "k") for name in "qkv")
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, T = x.shape[:2]
        # The head count is read from the width: all heads here, heads/tp under tensor parallelism.
        q, k, v = (m(x).view(B, T, -1, self.head_dim).transpose(1, 2)   # (B, heads, T, head_dim)
                   for m in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):  # (B, T, dim) -> (B, T, 4 dim) -> (B, T, dim)
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """Pre-norm decoder block: x + attn(ln1(x)), then x + mlp(ln2(x)). The unit that FSDP shards,
    that activation checkpointing recomputes and that a pipeline stage holds several of."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(dim), Attention(dim, heads)
        self.ln2, self.mlp = nn.LayerNorm(dim), FeedForward(dim)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Embedding(nn.Module):
    def __init__(self, vocab: int, dim: int, seq_len: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(seq_len, dim)

    def forward(self, idx):  # (B, T) token ids -> (B, T, dim)
        return self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))


class GPT(nn.Module):
    """(B, T) token ids -> (B, T, vocab) logits. Call `init_gpt(model, seed)` after building it."""

    def __init__(self, vocab: int = 256, seq_len: int = 32, dim: int = 64, heads: int = 4,
                 layers: int = 2):
        super().__init__()
        if dim % heads:
            raise ValueError(f"heads={heads} must divide dim={dim}")
        self.emb = Embedding(vocab, dim, seq_len)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)
        self.activation_checkpointing = False

    def forward(self, idx):
        x = self.emb(idx)
        for block in self.blocks:
            if self.activation_checkpointing:
                # Keep only the block's input; backward runs the block's forward again.
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.head(self.ln_f(x))


def gpt_parameter_count(vocab: int, seq_len: int, dim: int, layers: int) -> int:
    """P of GPT(vocab, seq_len, dim, heads, layers), written out (heads do not change it)."""
    block = 2 * 2 * dim + (4 * dim * dim + 3 * dim) + (8 * dim * dim + 5 * dim)
    return vocab * dim + seq_len * dim + layers * block + 2 * dim + dim * vocab


def gpt_init_value(name: str, shape: torch.Size, seed: int, layers: int) -> torch.Tensor:
    """The full initial tensor of GPT parameter `name` (GPT-2's scheme): biases 0, LayerNorm
    weights 1, other weights N(0, 0.02), the two projections that write into the residual stream
    N(0, 0.02 / sqrt(2 x layers)) so the stream's variance does not grow with depth."""
    if name.endswith(".bias"):
        return torch.zeros(shape)
    if ".ln" in f".{name}":
        return torch.ones(shape)
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    std = 0.02 / math.sqrt(2 * layers) if name.endswith(("attn.proj.weight", "mlp.fc2.weight")) \
        else 0.02
    return torch.randn(shape, generator=g) * std


@torch.no_grad()
def init_gpt(model: nn.Module, seed: int, layers: int | None = None, prefix: str = "") -> None:
    """Set every parameter of `model` (a GPT, or a part of one whose names start after `prefix`)
    to its value from `gpt_init_value`. A DTensor parameter (FSDP2, tensor parallelism) gets
    the part of the full tensor that its placements give this rank."""
    from torch.distributed.tensor import DTensor
    if layers is None:
        layers = len(model.blocks)
    for name, p in model.named_parameters():
        full = gpt_init_value(prefix + name, p.shape, seed, layers)
        if isinstance(p, DTensor):
            local = p.to_local()
            for mesh_dim, placement in enumerate(p.placements):
                if placement.is_shard():  # torch.chunk's split, as DTensor's Shard(d) uses
                    n, i = p.device_mesh.size(mesh_dim), p.device_mesh.get_local_rank(mesh_dim)
                    chunks = full.chunk(n, dim=placement.dim)
                    full = chunks[i] if i < len(chunks) else full.narrow(placement.dim, 0, 0)
            local.copy_(full.to(local.dtype))
        else:
            p.copy_(full.to(p.dtype))

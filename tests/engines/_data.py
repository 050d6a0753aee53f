"""Deterministic prompts, hidden states and KV tensors for the engine tests."""

from __future__ import annotations

import torch

CHUNK = 16
HIDDEN = 32


def tokens(n: int, seed: int = 0) -> torch.Tensor:
    """A prompt of ``n`` token ids, distinct per seed."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50_000, (n,), generator=g)


def hidden(n: int, dim: int = HIDDEN, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + seed)
    return torch.randn(n, dim, generator=g)


def kv_for(n: int, layers: int = 2, dim: int = 8, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(2000 + seed)
    return torch.randn(2, layers, n, dim, generator=g).to(dtype)

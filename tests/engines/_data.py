"""Deterministic prompts, hidden states and KV tensors for the engine tests."""

from __future__ import annotations

import warnings

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


UNSTORABLE_KINDS = ("quantized", "sparse", "nested", "meta")


def unstorable(kind: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor of ``shape`` (``nested``: two of them) that has no dense bytes to store."""
    with warnings.catch_warnings():  # torch warns that quantized and nested tensors are prototypes
        warnings.simplefilter("ignore")
        dense = torch.randn(*shape)
        if kind == "quantized":
            return torch.quantize_per_tensor(dense, 0.1, 0, torch.qint8)
        if kind == "sparse":
            return dense.to_sparse()
        if kind == "nested":
            return torch.nested.nested_tensor([dense, dense])
        if kind == "meta":
            return torch.empty(*shape, device="meta")
    raise ValueError(f"unknown kind {kind!r}")

"""Sizes and payloads shared by the StorageManager contract tests (test_storage_manager*.py)."""

from __future__ import annotations

import torch

MiB = 1 << 20


def t1m(seed: int = 0) -> torch.Tensor:
    return torch.randn(MiB // 4, generator=torch.Generator().manual_seed(seed))

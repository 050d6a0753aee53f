"""Sizes, the outcome record and the tensors every comparison workload stores.

Part of the comparison harness (see ``_harness.py``): standard library and torch only, imported
both as a module of ``lmcache_async_bench.compare`` and, in the LMCache virtual environment, by
plain name from this directory. Do not import ``lmcache_async`` here.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

KiB = 1 << 10
MiB = 1 << 20
SPAN = 128 * MiB  # bytes touched per repetition: DRAM-bound, not cache-hot
EC_HIDDEN = 2048  # encoder outputs: bfloat16 [tokens, 2048]
HS_HIDDEN = 4096  # hidden states: float32 [tokens, 4096]
CHUNK = 256
SM_BATCH = 16  # KV chunks per batched call


@dataclass
class Outcome:
    """One workload run on one system: per-operation seconds of each timed repetition."""

    system: str
    workload: str
    size: int
    ok: bool = True
    error: str = ""
    samples: list[float] = field(default_factory=list)
    ops_per_rep: int = 0
    bytes_per_op: int = 0
    hits: int = 0
    misses: int = 0
    faults: int = 0
    """Minor page faults during the timed repetitions of the workloads that keep results."""
    note: str = ""

    @property
    def median(self) -> float | None:
        return statistics.median(self.samples) if self.samples else None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["median"] = self.median
        return d


# ---- data -------------------------------------------------------------------------------------
def entry_count(size: int, quick: bool, lo: int = 8, hi: int = 512) -> int:
    n = max(lo, min(hi, SPAN // max(size, 1)))
    return max(4, n // 8) if quick else n


def ec_tensor(size: int, seed: int) -> torch.Tensor:
    """An encoder output of ``size`` bytes: bfloat16 ``[size / 4096, 2048]``."""
    rows = max(1, size // (2 * EC_HIDDEN))
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, EC_HIDDEN, generator=g).to(torch.bfloat16)


def source_tensors(size: int, n: int, make: Callable[[int, int], torch.Tensor]) -> list[torch.Tensor]:
    """Source tensors rotating over >= 64 MiB (or ``n`` of them, whichever is fewer)."""
    count = max(2, min(n, (64 * MiB) // max(size, 1)))
    return [make(size, 1000 + i) for i in range(count)]


def kv_tensor(size: int, seed: int) -> torch.Tensor:
    """A KV chunk of ``size`` bytes: bfloat16 ``[2, 1, 256, size / 1024]`` (LMCache's KV_2LTD
    layout: K/V, layers, tokens, hidden)."""
    hidden = max(1, size // (2 * CHUNK * 2))
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 1, CHUNK, hidden, generator=g).to(torch.bfloat16)


def hs_tokens(n_tokens: int, seq: int) -> list[int]:
    """Token ids of prompt number ``seq`` (distinct prompts share no chunk)."""
    base = (seq * 7919 + 13) % 100_000
    return [(base + i * 31) % 151_936 for i in range(n_tokens)]


def touched(nbytes: int) -> torch.Tensor:
    """A uint8 buffer whose pages are all touched (``torch.zeros`` may hand out untouched
    calloc pages, which would put first-touch faults inside a timed copy)."""
    buf = torch.empty(nbytes, dtype=torch.uint8)
    buf.fill_(1)
    return buf

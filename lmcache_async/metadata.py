"""Engine metadata: who the cache belongs to (model, TP layout, KV dtype)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lmcache_async.dtypes import dtype_name

__all__ = ["NEUTRAL_METADATA", "LMCacheEngineMetadata"]


@dataclass(frozen=True)
class LMCacheEngineMetadata:
    """Identity of the model/worker a cache serves; it fills the fields of every key.

    ``kv_dtype`` is the KV-cache dtype (post-quantisation); ``kv_shape`` is LMCache's
    ``(num_layers, 2, chunk_size, num_kv_heads, head_size)`` when known. ``role`` is
    informational (``"worker"`` or ``"scheduler"``); storage is built the same for both.
    """

    model_name: str
    world_size: int = 1
    worker_id: int = 0
    kv_dtype: torch.dtype = torch.bfloat16
    kv_shape: tuple[int, ...] | None = None
    role: str = "worker"
    extra: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.model_name, str):
            raise TypeError(f"model_name must be a str, got {type(self.model_name).__name__}")
        try:
            self.model_name.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"model_name {self.model_name!r} is not valid Unicode text") from None
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {self.world_size!r}")
        if not isinstance(self.worker_id, int) or not 0 <= self.worker_id < self.world_size:
            raise ValueError(f"worker_id must be an int in [0, world_size={self.world_size}), got {self.worker_id!r}")
        if not isinstance(self.kv_dtype, torch.dtype):
            raise TypeError(f"kv_dtype must be a torch.dtype, got {type(self.kv_dtype).__name__}")
        dtype_name(self.kv_dtype)  # raises ValueError for dtypes keys cannot carry


NEUTRAL_METADATA = LMCacheEngineMetadata(model_name="default")
"""Identity used by a token database built without metadata."""

"""Argument checks and plain data of the hidden-state store (:mod:`.hidden_states`).

Pure helpers: no manager, no I/O; any thread. The reference rules are stated per function.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmcache_async.engines._chunks import ChunkPlan, release_all
from lmcache_async.keys import CacheEngineKey
from lmcache_async.memory import MemoryObj

__all__ = ["StoreJob", "check_layer", "check_out", "cut_hits", "well_shaped"]


@dataclass(frozen=True, slots=True)
class StoreJob:
    """A checked HS store: the prompt's plan, the layer, the source rows and their entry keys."""

    plan: ChunkPlan
    layer_idx: int
    src: torch.Tensor
    token_offset: int
    first: int  # the first chunk that starts at or after token_offset
    hkeys: list[CacheEngineKey]  # the entry key of every chunk of the plan

    @property
    def nbytes(self) -> int:
        """Bytes a store of every chunk from ``first`` on would copy."""
        rows = self.plan.n_tokens - self.plan.start(self.first)
        return max(rows, 0) * self.src.shape[1] * self.src.element_size()


def check_layer(layer_idx: object, what: str = "layer_idx") -> int:
    """``layer_idx`` as an int >= 0: ``TypeError`` (not an int, or a bool) or ``ValueError``
    (negative) naming ``what`` otherwise."""
    if not isinstance(layer_idx, int) or isinstance(layer_idx, bool):
        raise TypeError(f"{what} must be an int, got {type(layer_idx).__name__}")
    if layer_idx < 0:
        raise ValueError(f"{what} must be >= 0, got {layer_idx}")
    return layer_idx


def check_out(out: torch.Tensor | None) -> None:
    """A retrieve's ``out``: None or a 2-D float32 tensor (``TypeError``/``ValueError`` naming
    ``out`` otherwise). Its row and column counts are checked against the hit later."""
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
        if out.dtype != torch.float32 or out.dim() != 2:
            raise ValueError(f"out must be a 2-D float32 tensor, got {out.dtype} of shape {tuple(out.shape)}")


def well_shaped(plan: ChunkPlan, objs: list[MemoryObj | None]) -> list[MemoryObj]:
    """The prefix of ``objs`` whose shapes fit the plan (one hidden size), whose references pass
    to the caller; the references of the rest are released here."""
    hits: list[MemoryObj] = []
    hidden = -1
    for i, obj in enumerate(objs):
        if obj is None:
            break
        shape = obj.shape
        if hidden < 0:
            hidden = shape[1]
        if shape != (plan.end(i) - plan.start(i), hidden):
            break
        hits.append(obj)
    release_all(objs[len(hits) :])
    return hits


def cut_hits(hits: list[MemoryObj], n: int) -> list[MemoryObj]:
    """The first ``n`` of ``hits`` (their references pass to the caller); the rest released."""
    release_all(hits[n:])
    return hits[:n]

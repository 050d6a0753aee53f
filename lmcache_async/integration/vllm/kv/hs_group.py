"""vLLM's hidden-state KV-cache group (``extract_hidden_states``) through the hidden-state store.

With the speculative method ``extract_hidden_states`` vLLM adds a ``CacheOnlyAttentionLayer``
whose paged cache holds, per token, the hidden states of the layers named by
``eagle_aux_hidden_state_layer_ids``: ``[num_blocks, num_aux_layers, block_size, hidden]``, in a
KV-cache group of its own (``HiddenStateCacheSpec``) with its own block ids and block size. A
connector that declares ``SupportsHMA`` receives that group's block ids beside the attention
group's. This module is framework-free (tensors and ints only):

* :class:`HiddenStateGroup` reads and writes token rows of that cache by the group's block ids;
* :class:`~.kv_metadata.HSRun` (the scheduler's plan for one request: the chunk hashes it
  derived from the request, the token range to save or load, and the group's block ids) is
  carried by the step metadata;
* :func:`save_hs_run` stores the rows of a run through the connector's
  :class:`~lmcache_async.engines.hidden_states.HiddenStateStore` (one entry per chunk and aux
  layer, published to the KV tiers so another process can restore them);
* :func:`load_hs_run` restores them into the group's blocks, prefix-strict: it returns how many
  tokens of the run it filled for every aux layer, and the caller fails the KV blocks beyond
  that (vLLM then recomputes them, and the forward writes their hidden states). Hidden states
  never run past the restored KV, and KV is never restored without its hidden states.

Runs on the model-runner thread. Storage trouble is a shorter prefix, never an exception.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lmcache_async.engines._chunks import ChunkPlan
from lmcache_async.engines.hidden_states import HiddenStateStore
from lmcache_async.integration.vllm.kv.hidden import publish_hidden_states, restore_hidden_states
from lmcache_async.integration.vllm.kv.metadata import HSRun
from lmcache_async.storage_manager import StorageManager

__all__ = ["HiddenStateGroup", "load_hs_run", "run_plan", "save_hs_run"]


class HiddenStateGroup:
    """The hidden-state group's paged cache ``[num_blocks, num_aux_layers, block_size, hidden]``
    (vLLM owns the tensor) and the layer ids its aux rows stand for."""

    def __init__(self, cache: torch.Tensor, layer_ids: Sequence[int]) -> None:
        if not isinstance(cache, torch.Tensor) or cache.dim() != 4:
            raise ValueError(
                "the hidden-state cache must be [num_blocks, num_aux_layers, block_size, hidden], got "
                f"{tuple(cache.shape) if isinstance(cache, torch.Tensor) else type(cache).__name__}"
            )
        if len(layer_ids) != cache.shape[1]:
            raise ValueError(f"{len(layer_ids)} aux layer ids for a cache of {cache.shape[1]} aux rows")
        self.cache = cache
        self.layer_ids = [int(i) for i in layer_ids]
        self.block_size = int(cache.shape[2])
        self.num_blocks = int(cache.shape[0])

    def _index(self, block_ids: Sequence[int], start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        bs = self.block_size
        if end > len(block_ids) * bs:
            raise ValueError(f"tokens up to {end} need {-(-end // bs)} blocks, the run has {len(block_ids)}")
        pos = torch.arange(start, end, dtype=torch.int64)
        blocks = torch.as_tensor(list(block_ids), dtype=torch.int64)[pos // bs]
        if blocks.numel() and (int(blocks.min()) < 0 or int(blocks.max()) >= self.num_blocks):
            raise ValueError(f"hidden-state block ids outside [0, {self.num_blocks})")
        return blocks.to(self.cache.device), (pos % bs).to(self.cache.device)

    def gather(self, block_ids: Sequence[int], start: int, end: int) -> torch.Tensor:
        """Rows of tokens ``start .. end - 1``: a new ``[n, num_aux_layers, hidden]`` tensor."""
        blocks, offs = self._index(block_ids, start, end)
        return self.cache[blocks, :, offs, :]

    def scatter(self, block_ids: Sequence[int], start: int, rows: torch.Tensor) -> None:
        """Write ``rows`` (``[n, num_aux_layers, hidden]``) as tokens ``start .. start + n - 1``."""
        blocks, offs = self._index(block_ids, start, start + int(rows.shape[0]))
        self.cache[blocks, :, offs, :] = rows.to(device=self.cache.device, dtype=self.cache.dtype)


def run_plan(hs: HiddenStateStore, run: HSRun) -> ChunkPlan:
    """The chunk plan of tokens ``0 .. run.end - 1`` under the run's chunk hashes (its whole
    chunks: hidden states are kept per whole chunk)."""
    return ChunkPlan.of_hashes(hs.token_database, run.chunk_hashes[: run.end // hs.token_database.chunk_size], run.end)


def save_hs_run(group: HiddenStateGroup, hs: HiddenStateStore, kv: StorageManager, run: HSRun) -> int:
    """Store (and publish to ``kv``'s tiers) the run's rows for every aux layer; returns the
    chunks published for the layer that published fewest."""
    if run.end <= run.start:
        return 0
    rows = group.gather(run.block_ids, run.start, run.end)
    plan = run_plan(hs, run)
    published = []
    for j, layer in enumerate(group.layer_ids):
        published.append(publish_hidden_states(hs, kv, plan, rows[:, j, :], layer_idx=layer, token_offset=run.start))
    return min(published)


def load_hs_run(group: HiddenStateGroup, hs: HiddenStateStore, kv: StorageManager, run: HSRun) -> int:
    """Restore the run's tokens into the group's blocks; returns the end of the prefix filled
    for every aux layer (``run.start`` when nothing came back). Tokens from there on are not
    written: the caller recomputes them."""
    if run.end <= run.start:
        return run.end
    got: list[torch.Tensor] = []
    end = run.end
    plan = run_plan(hs, run)
    for layer in group.layer_ids:
        t = restore_hidden_states(hs, kv, plan, layer_idx=layer, max_tokens=run.end)
        n = 0 if t is None else int(t.shape[0])
        if t is not None and (t.dim() != 2 or t.shape[1] != group.cache.shape[3]):
            n = 0  # another model's hidden size: nothing usable
        end = min(end, n)
        if t is not None:
            got.append(t)
    if end <= run.start or len(got) != len(group.layer_ids):
        return run.start
    rows = torch.stack([t[run.start : end] for t in got], dim=1)
    group.scatter(run.block_ids, run.start, rows)
    return end

"""Hidden states beside the connector's KV, shared across processes through the KV tiers.

The :class:`HiddenStateStore` keeps hidden states in its own CPU pool, which another process
cannot see. A serving stack whose stages run in separate processes (a thinker that stores, a
talker or a later run that restores) needs them in the tiers the KV records live in. So the
connector publishes every hidden-state chunk it stores into its KV manager as well, under
:func:`~lmcache_async.engines.hidden_states.hs_entry_key` (the KV chunk key plus the
``hs_layer`` tag: it never collides with a KV record), and a restore first refills the
hidden-state store from those records for the chunks it lacks.

The hidden-state store's prefix rule still decides what comes back: a chunk counts only while
its KV is present too, and the caller may cap the prefix at the KV prefix vLLM restored, so the
restored hidden states never run past the restored KV. Storage trouble is a shorter prefix (or
None), never an exception.

Both functions run under ``torch.inference_mode()``, as vLLM's worker does: the KV manager's
pool is filled by the worker inside inference mode, and mixing modes on the same pool buffers
is refused by torch. What :func:`restore_hidden_states` returns is a normal tensor.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from lmcache_async.engines._chunks import ChunkPlan, plan_of
from lmcache_async.engines.hidden_states import HiddenStateStore, hs_entry_key
from lmcache_async.key_extras import KeyExtras
from lmcache_async.memory import MemoryFormat
from lmcache_async.ratelog import RateLimitedLog
from lmcache_async.storage_manager import StorageManager

logger = logging.getLogger(__name__)
_log = RateLimitedLog(logger)

__all__ = ["publish_hidden_states", "restore_hidden_states"]


@torch.inference_mode()
def publish_hidden_states(
    hs: HiddenStateStore,
    kv: StorageManager,
    token_ids: Any,
    hidden_states: torch.Tensor,
    layer_idx: int = 0,
    token_offset: int = 0,
    extras: KeyExtras | None = None,
) -> int:
    """Store ``hidden_states`` in ``hs`` (:meth:`HiddenStateStore.store_hidden_states`, same
    arguments and errors) and publish each whole chunk it holds for them into ``kv``'s tiers.

    Returns the number of chunks published (already published ones count: puts are
    content-addressed). The rows published are those the hidden-state store holds, in its
    storage dtype. Runs on the caller's thread; the lower-tier writes happen in the
    background (``kv.flush_sync()`` is the barrier). ``extras`` enter the keys as for the KV
    records; ``token_ids`` may be a :class:`~lmcache_async.engines._chunks.ChunkPlan` (keys
    derived already, ``extras`` None).
    """
    plan = plan_of(hs.token_database, token_ids, extras)
    hs.store_hidden_states(plan, hidden_states, layer_idx, token_offset)
    cs = plan.chunk_size
    published = 0
    for i, key in enumerate(plan.keys):
        start = i * cs
        if start < token_offset:
            continue
        if not hs.has_chunk(key, layer_idx):
            break  # not stored (pool full, layer not allowed): nothing to publish from here on
        rows = hidden_states[start - token_offset : start - token_offset + cs]
        record = rows.detach().to(device="cpu", dtype=hs.storage_dtype).contiguous()
        try:
            ok = kv.put_sync(hs_entry_key(key, layer_idx), record, MemoryFormat.HS_TD)
        except Exception as exc:  # storage trouble is a shorter published prefix
            _log.warning("KV connector: publishing hidden states failed: %s", exc, key="publish")
            ok = False
        if not ok:
            break
        published += 1
    return published


def restore_hidden_states(
    hs: HiddenStateStore,
    kv: StorageManager,
    token_ids: Any,
    layer_idx: int = 0,
    max_tokens: int | None = None,
    extras: KeyExtras | None = None,
) -> torch.Tensor | None:
    """The hidden states of the longest restorable prefix of ``token_ids`` for ``layer_idx``,
    as a fresh CPU float32 ``[n_tokens, hidden]`` tensor the caller owns; None when nothing hits.

    Chunks ``hs`` lacks are read from ``kv``'s tiers (as published by
    :func:`publish_hidden_states`) and stored into ``hs`` first; then
    :meth:`HiddenStateStore.retrieve_hidden_states` answers (prefix-strict, KV present for every
    chunk). ``max_tokens`` caps the prefix (pass the KV prefix vLLM restored); ``ValueError``
    when it is negative. ``extras`` and ``token_ids`` as in :func:`publish_hidden_states`.
    """
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 0):
        raise ValueError(f"max_tokens must be an int >= 0 or None, got {max_tokens!r}")
    plan = plan_of(hs.token_database, token_ids, extras)
    with torch.inference_mode():
        got = _restore(hs, kv, plan, layer_idx, max_tokens)
    if got is None:
        return None
    return got.clone()  # outside inference mode: a normal tensor the caller may modify


def _restore(
    hs: HiddenStateStore,
    kv: StorageManager,
    full: ChunkPlan,
    layer_idx: int,
    max_tokens: int | None,
) -> torch.Tensor | None:
    cs = full.chunk_size
    n_chunks = len(full.keys) if max_tokens is None else min(len(full.keys), max_tokens // cs)
    if not n_chunks:
        return None
    keys = full.keys[:n_chunks]
    missing = [i for i, k in enumerate(keys) if not hs.has_chunk(k, layer_idx)]
    first_missing = missing[0] if missing else len(keys)
    if missing:
        # Only the run right after the held prefix can extend it (the prefix stops at a gap).
        run = [i for n, i in enumerate(missing) if i == first_missing + n]
        try:
            objs = kv.batched_get_sync([hs_entry_key(keys[i], layer_idx) for i in run])
        except Exception as exc:
            _log.warning("KV connector: reading published hidden states failed: %s", exc, key="restore")
            objs = [None] * len(run)
        hidden: int | None = None
        try:
            for i, obj in zip(run, objs, strict=True):
                if obj is None:
                    break
                t = obj.tensor
                if t.dim() != 2 or t.shape[0] != cs or not t.dtype.is_floating_point:
                    _log.warning("KV connector: a published hidden-state record has shape %s", tuple(t.shape))
                    break
                if hidden is not None and t.shape[1] != hidden:
                    break
                hidden = int(t.shape[1])
                hs.store_hidden_states(full.head(i + 1), t, layer_idx, token_offset=i * cs)
        finally:
            for obj in objs:
                if obj is not None:
                    obj.ref_count_down()
    return hs.retrieve_hidden_states(full.head(n_chunks), layer_idx)

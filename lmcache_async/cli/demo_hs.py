"""A thinker -> talker walk-through of the hidden-state store (called by ``lmcache-async demo``).

A "thinker" prefills a prompt in two steps (the second with ``token_offset``), storing its KV
and its hidden states; a "talker" restores the hidden states of the cached prefix. Then another
request's KV squeezes the small KV pool: the first prompt loses the KV of its suffix, and the
talker's hidden-state prefix shrinks with it (the orphaned hidden states are dropped).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lmcache_async.config import LMCacheEngineConfig
from lmcache_async.engines.kv import LMCacheEngine
from lmcache_async.memory import GiB
from lmcache_async.metadata import LMCacheEngineMetadata

__all__ = ["CHUNK", "HIDDEN", "KV_DIM", "LAYERS", "N_CHUNKS", "run_hs_demo"]

CHUNK = 16
N_CHUNKS = 8
LAYERS = 2
KV_DIM = 32
HIDDEN = 64


def _bar(tokens: int, total: int) -> str:
    full = tokens // CHUNK
    return "[" + "#" * full + "." * (total // CHUNK - full) + f"] {tokens:>4} tokens"


def run_hs_demo(out: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the walk-through, writing lines to ``out``; returns the figures it printed
    (``kv_tokens_before``/``after``, ``hs_tokens_before``/``after``, ``orphans_dropped``,
    ``kv_evictions``, ``matches``)."""
    per_chunk = 2 * LAYERS * CHUNK * KV_DIM * 4
    config = LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK,
        max_local_cpu_size=(N_CHUNKS * 3 // 2 + 0.5) * per_chunk / GiB,  # room for 12 KV chunks
        enable_hidden_state_cache=True,
        max_hidden_state_cpu_size=1 / 256,
        staging_size=0,
    )
    g = torch.Generator().manual_seed(0)
    n = N_CHUNKS * CHUNK
    prompt = torch.randint(0, 32_000, (n,), generator=g)
    kv = torch.randn(2, LAYERS, n, KV_DIM, generator=g)
    hidden = torch.randn(n, HIDDEN, generator=g)
    other = torch.randint(0, 32_000, (n,), generator=g)
    summary: dict[str, Any] = {}
    with LMCacheEngine(config, LMCacheEngineMetadata("demo/thinker")) as engine:
        hs = engine.hidden_state_store
        assert hs is not None
        out(f"chunk_size={CHUNK}, KV pool holds {N_CHUNKS * 3 // 2} chunks, prompt = {N_CHUNKS} chunks")
        half = n // 2
        out("thinker: prefill step 1 (first half of the prompt)")
        engine.store(prompt[:half], kv[:, :, :half])
        hs.store_hidden_states(prompt[:half], hidden[:half])
        out(f"thinker: prefill step 2 (token_offset={half}: only the new rows are passed)")
        mask = torch.arange(n) >= half
        engine.store(prompt, kv, mask=mask)
        hs.store_hidden_states(prompt, hidden[half:], token_offset=half)
        before_kv = engine.lookup(prompt)
        restored = hs.retrieve_hidden_states(prompt)
        before_hs = 0 if restored is None else restored.shape[0]
        ok_before = restored is not None and torch.equal(restored, hidden[:before_hs])
        out(f"  KV cached        {_bar(before_kv, n)}")
        out(f"  talker restores  {_bar(before_hs, n)}  (matches the thinker: {ok_before})")
        out("another request stores its KV: the small KV pool evicts the least recently used chunks")
        engine.store(other, torch.randn(2, LAYERS, n, KV_DIM, generator=g))
        after_kv = engine.lookup(prompt)
        restored = hs.retrieve_hidden_states(prompt)
        after_hs = 0 if restored is None else restored.shape[0]
        ok_after = restored is not None and torch.equal(restored, hidden[:after_hs])
        st = hs.stats()
        kv_evictions = engine.storage_manager.stats()["tiers"]["cpu"]["evictions"]
        out(f"  KV cached        {_bar(after_kv, n)}  ({kv_evictions} KV chunks evicted: the suffix)")
        out(f"  talker restores  {_bar(after_hs, n)}  (matches the thinker: {ok_after})")
        out(
            f"  hidden states follow KV: {st['orphans_dropped']} orphaned entry dropped at the "
            "boundary; the talker recomputes only the suffix"
        )
        summary.update(
            kv_tokens_before=before_kv,
            hs_tokens_before=before_hs,
            kv_tokens_after=after_kv,
            hs_tokens_after=after_hs,
            orphans_dropped=st["orphans_dropped"],
            kv_evictions=kv_evictions,
            matches=ok_before and ok_after,
        )
    return summary


if __name__ == "__main__":  # pragma: no cover
    run_hs_demo()

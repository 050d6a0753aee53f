"""The thinker's hidden states for a prompt whose prefix was served from the KV cache.

When the thinker's prompt hits the KV cache, its model runs only the uncached suffix, so it
computes hidden states for the suffix alone; the talker needs them for the whole prompt. The
prefix rows come from the :class:`~lmcache_async.engines.hidden_states.HiddenStateStore`
(where the thinker stored them when it first computed that prefix, with
``store_hidden_states``), the suffix rows from the thinker's current step::

    hs = thinker_hidden_states(engine.hidden_state_store, prompt_ids, suffix_hidden, layer_idx)
    if hs is not None:
        connector.put("thinker", "talker", f"{request_id}_0_0", {"hidden_states": hs, ...})
"""

from __future__ import annotations

from typing import Any

import torch

from lmcache_async.engines.hidden_states import HiddenStateStore

__all__ = ["thinker_hidden_states"]


def thinker_hidden_states(
    store: HiddenStateStore,
    token_ids: Any,
    computed: torch.Tensor | None,
    layer_idx: int = 0,
) -> torch.Tensor | None:
    """Hidden states ``[len(token_ids), hidden]`` for the whole prompt, or None.

    ``computed`` holds the rows the thinker computed for the last ``computed.shape[0]`` tokens
    (None or zero rows: the whole prompt was cached). The first ``len(token_ids) - rows`` rows
    are read from ``store`` for ``layer_idx``. None when the store does not cover that prefix
    any more (evicted, or its KV is gone): the caller recomputes it. The result is a fresh
    float32 CPU tensor the caller owns (``computed`` is returned as a float32 CPU copy when no
    prefix is needed). ``TypeError``/``ValueError`` for a ``computed`` that is not a 2-D tensor,
    has more rows than the prompt or a hidden size other than the stored one.
    """
    if not isinstance(store, HiddenStateStore):
        raise TypeError(f"store must be a HiddenStateStore, got {type(store).__name__}")
    n = len(token_ids)
    if computed is not None:
        if not isinstance(computed, torch.Tensor):
            raise TypeError(f"computed must be a torch.Tensor or None, got {type(computed).__name__}")
        if computed.dim() != 2:
            raise ValueError(f"computed must be 2-D [tokens, hidden], got shape {tuple(computed.shape)}")
        if computed.shape[0] > n:
            raise ValueError(f"computed has {computed.shape[0]} rows for a prompt of {n} tokens")
    if n == 0:
        raise ValueError("token_ids must not be empty")
    rows = 0 if computed is None else int(computed.shape[0])
    cached = n - rows
    if cached == 0:
        assert computed is not None
        return computed.detach().to("cpu", torch.float32, copy=True)
    prefix = store.retrieve_hidden_states(token_ids, layer_idx)
    if prefix is None or prefix.shape[0] < cached:
        return None
    if computed is None or rows == 0:
        return prefix[:cached].clone() if prefix.shape[0] > cached else prefix
    if computed.shape[1] != prefix.shape[1]:
        raise ValueError(f"computed has hidden size {computed.shape[1]}, the store holds {prefix.shape[1]}")
    return torch.cat([prefix[:cached], computed.detach().to("cpu", torch.float32)])

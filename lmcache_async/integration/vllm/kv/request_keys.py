"""A vLLM request's chunk hashes: its token ids and everything else vLLM's prefix cache keys on.

vLLM's own block hash mixes into each block what besides the token ids changes its KV
(``generate_block_hash_extra_keys`` in ``vllm/v1/core/kv_cache_utils.py``): the multimodal items
overlapping the block, the LoRA adapter, ``cache_salt`` (first block) and a digest of the
block's prompt embeddings. :func:`request_key_inputs` reads the same from a scheduler-side
``Request`` as a :class:`~lmcache_async.key_extras.KeyExtras`, so two requests share a chunk
key exactly when vLLM would let them share the chunk's blocks.

The token ids are those vLLM hashes: ``all_token_ids`` over the prompt, which holds 0 at every
position a prompt embedding fills (the ids a mixed prompt carries there are placeholders).

Keys are derived only from the ``Request`` (``get_num_new_matched_tokens``,
``update_state_after_alloc``), never from the scheduler output's ``NewRequestData``: that carries
no ``cache_salt`` and its multimodal features are stripped. A request whose extras cannot be
read raises :class:`UnreadableRequest` naming the kind; the caller neither loads nor saves it.

Framework-free: attributes are read by name, nothing of vLLM is imported.
"""

from __future__ import annotations

from typing import Any

import torch

from lmcache_async.key_extras import KeyExtras, MMItem

__all__ = ["UnreadableRequest", "request_key_inputs"]


class UnreadableRequest(Exception):
    """A request whose key extras cannot be read; ``kind`` names which (``tokens``, ``mm``,
    ``lora``, ``cache_salt``, ``prompt_embeds``)."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind


def _tokens(request: Any) -> list[int]:
    ids = getattr(request, "prompt_token_ids", None)
    n = getattr(request, "num_prompt_tokens", None)
    if n is None:
        n = len(ids) if ids is not None else 0
    if not isinstance(n, int) or n < 0:
        raise UnreadableRequest("tokens", f"num_prompt_tokens is {n!r}")
    everything = getattr(request, "all_token_ids", None)
    if everything is not None:
        tokens = list(everything[:n])
    elif ids is not None:
        tokens = list(ids[:n])
    else:
        tokens = []
    if len(tokens) != n:
        raise UnreadableRequest("tokens", f"{len(tokens)} token ids for {n} prompt tokens")
    return tokens


def _mm_items(request: Any) -> tuple[MMItem, ...]:
    features = getattr(request, "mm_features", None)
    if not features:
        return ()
    items = []
    try:
        for f in features:
            pos = f.mm_position
            items.append(MMItem(int(pos.offset), int(pos.length), f.identifier))
    except (AttributeError, TypeError, ValueError) as exc:
        raise UnreadableRequest("mm", f"a multimodal feature without identifier or position ({exc})") from None
    return tuple(items)


def _lora(request: Any) -> tuple[str, str] | None:
    lr = getattr(request, "lora_request", None)
    if not lr:
        return None
    name = getattr(lr, "lora_name", None)
    path = getattr(lr, "lora_path", None) or ""
    if not isinstance(name, str) or not name or not isinstance(path, str):
        raise UnreadableRequest("lora", f"lora_request without a name and path: {lr!r}")
    return name, path


def _salt(request: Any) -> str | None:
    salt = getattr(request, "cache_salt", None)
    if salt is None or salt == "":
        return None
    if not isinstance(salt, str):
        raise UnreadableRequest("cache_salt", f"cache_salt is a {type(salt).__name__}")
    return salt


def _embeds(request: Any, n_tokens: int) -> torch.Tensor | None:
    pe = getattr(request, "prompt_embeds", None)
    if pe is None:
        return None
    if not isinstance(pe, torch.Tensor) or pe.dim() != 2 or pe.shape[0] < n_tokens:
        shape = tuple(pe.shape) if isinstance(pe, torch.Tensor) else type(pe).__name__
        raise UnreadableRequest("prompt_embeds", f"prompt_embeds {shape} for {n_tokens} prompt tokens")
    return pe


def request_key_inputs(request: Any) -> tuple[list[int], KeyExtras | None]:
    """``(prompt token ids as vLLM hashes them, key extras or None)`` of a scheduler-side vLLM
    ``Request``; :class:`UnreadableRequest` when something that must enter the key cannot be
    read. Runs on the scheduler thread; the request is read, never changed."""
    tokens = _tokens(request)
    try:
        extras = KeyExtras(
            mm_items=_mm_items(request),
            lora=_lora(request),
            cache_salt=_salt(request),
            prompt_embeds=_embeds(request, len(tokens)),
        )
    except (TypeError, ValueError) as exc:
        raise UnreadableRequest("extras", str(exc)) from None
    return tokens, None if extras.empty else extras

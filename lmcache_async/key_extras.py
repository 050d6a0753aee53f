"""What besides the token ids changes a chunk's KV: images, adapters, tenants, prompt embeddings.

Two prompts with equal token ids do not always have equal KV. A multimodal prompt holds
placeholder ids where the encoder's output goes, so the same text with another image looks the
same to a token-only key; a LoRA adapter changes every layer's KV; ``cache_salt`` separates
tenants that must never share a prefix; prompt embeddings sit at positions whose ids are
placeholders. :class:`KeyExtras` names these for one request, and :meth:`KeyExtras.chunk_digests`
turns them into one digest per chunk, which :func:`~lmcache_async.token_database.chain_hashes`
mixes into that chunk's hash. Prefix chaining carries each into every later chunk.

Which chunk an extra belongs to (the same membership vLLM's prefix cache gives its blocks):

* a multimodal item: every chunk its placeholder range ``[offset, offset + length)`` overlaps,
  with its identifier and its offset relative to the chunk's first token;
* the LoRA adapter (name and path): every chunk;
* ``cache_salt``: the first chunk (the chain carries it on); an empty salt is no salt;
* prompt embeddings: every chunk, as the SHA-256 of that chunk's rows (dtype, row width and raw
  bytes).

A chunk with none of these gets no digest and its hash is the plain token hash, so a request
without extras keeps its key byte for byte. The byte encoding of a chunk's extras is normative
(docs/formats.md, "Key extras") and stable across releases.

Framework-free: vLLM's request is read elsewhere
(:mod:`lmcache_async.integration.vllm.kv.request_keys`). Instances are immutable and safe to
share between threads; the prompt-embedding tensor is read, never written, and not copied.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from hashlib import sha256
from typing import Any

import torch

__all__ = ["EXTRAS_MAGIC", "KeyExtras", "MMItem"]

EXTRAS_MAGIC = b"LMCX"
"""First bytes of a chunk's extras encoding (then the format version, :data:`EXTRAS_VERSION`)."""

EXTRAS_VERSION = 1

HASH_SUFFIX = b"LMX1"
"""Appended after a chunk's 32-byte extras digest in the chunk-hash input. A plain input is
8 + 8·n bytes long; one with extras is 8 + 8·n + 36, never a multiple of 8: the two can never
be the same bytes, whatever the token ids."""

_TAG_LORA = 1
_TAG_MM = 2
_TAG_SALT = 3
_TAG_EMBEDS = 4


def _text(value: str) -> bytes:
    data = value.encode("utf-8")
    return struct.pack("<I", len(data)) + data


def _check_str(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str, got {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{what} {value!r} is not valid Unicode text") from None
    return value


def _check_int(value: object, what: str, lo: int = 0) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{what} must be an int, got {type(value).__name__}")
    if value < lo or value >= 1 << 62:
        raise ValueError(f"{what} must be in [{lo}, 2**62), got {value}")
    return value


@dataclass(frozen=True, order=True)
class MMItem:
    """One multimodal item of a prompt: its content ``identifier`` (vLLM's
    ``MultiModalFeatureSpec.identifier``: a hash of the item, with the LoRA prefix where vLLM adds
    one) and its placeholder range ``[offset, offset + length)`` in prompt positions.
    ``TypeError``/``ValueError`` naming the field for bad values (``length`` must be ≥ 1)."""

    offset: int
    length: int
    identifier: str

    def __post_init__(self) -> None:
        _check_int(self.offset, "MMItem.offset")
        _check_int(self.length, "MMItem.length", lo=1)
        _check_str(self.identifier, "MMItem.identifier")
        if not self.identifier:
            raise ValueError("MMItem.identifier must not be empty")


@dataclass(frozen=True)
class KeyExtras:
    """Everything besides the token ids that a request's KV depends on (see the module docstring).

    ``mm_items``: the prompt's multimodal items (any order; kept sorted). ``lora``: the adapter as
    ``(name, path)``, or None. ``cache_salt``: the tenant's salt; None or ``""`` is no salt.
    ``prompt_embeds``: a ``[n_tokens, hidden]`` tensor on any device whose row ``i`` is the
    embedding of prompt position ``i`` (None: the prompt is token ids only).
    ``TypeError``/``ValueError`` naming the field for bad values.
    """

    mm_items: tuple[MMItem, ...] = ()
    lora: tuple[str, str] | None = None
    cache_salt: str | None = None
    prompt_embeds: torch.Tensor | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        items = self.mm_items
        if isinstance(items, (str, bytes)) or not isinstance(items, Iterable):
            raise TypeError(f"mm_items must be a sequence of MMItem, got {type(items).__name__}")
        items = tuple(items)
        for i, it in enumerate(items):
            if not isinstance(it, MMItem):
                raise TypeError(f"mm_items[{i}] must be an MMItem, got {type(it).__name__}")
        object.__setattr__(self, "mm_items", tuple(sorted(items)))
        if self.lora is not None:
            if not isinstance(self.lora, tuple) or len(self.lora) != 2:
                raise TypeError(f"lora must be a (name, path) tuple or None, got {self.lora!r}")
            _check_str(self.lora[0], "lora name")
            _check_str(self.lora[1], "lora path")
        if self.cache_salt is not None:
            _check_str(self.cache_salt, "cache_salt")
            if not self.cache_salt:
                object.__setattr__(self, "cache_salt", None)
        pe = self.prompt_embeds
        if pe is not None:
            if not isinstance(pe, torch.Tensor):
                raise TypeError(f"prompt_embeds must be a tensor or None, got {type(pe).__name__}")
            if pe.dim() != 2 or pe.is_sparse or pe.is_quantized or pe.device.type == "meta":
                raise ValueError(f"prompt_embeds must be a dense 2-D [n_tokens, hidden] tensor, got {tuple(pe.shape)}")

    @property
    def empty(self) -> bool:
        """True when nothing here changes a key (the plain token keys apply)."""
        return not self.mm_items and self.lora is None and self.cache_salt is None and self.prompt_embeds is None

    def chunk_digests(self, n_tokens: int, chunk_size: int, include_partial: bool = False) -> list[bytes | None]:
        """One entry per chunk of an ``n_tokens`` prompt (the partial tail only with
        ``include_partial``): the 32-byte SHA-256 of the chunk's extras encoding, or None for a
        chunk without extras. ``ValueError`` when ``prompt_embeds`` has fewer rows than a chunk
        it must cover."""
        n_chunks = n_tokens // chunk_size + (1 if include_partial and n_tokens % chunk_size else 0)
        if self.empty:
            return [None] * n_chunks
        out: list[bytes | None] = []
        items = self.mm_items
        for c in range(n_chunks):
            start = c * chunk_size
            end = min(start + chunk_size, n_tokens)
            enc = self._encode(start, end, [it for it in items if it.offset < end and start < it.offset + it.length])
            out.append(None if enc is None else sha256(enc).digest())
        return out

    def _encode(self, start: int, end: int, items: list[MMItem]) -> bytes | None:
        """The normative encoding of chunk ``[start, end)``'s extras (docs/formats.md), or None."""
        parts: list[bytes] = []
        if self.lora is not None:
            parts.append(bytes([_TAG_LORA]) + _text(self.lora[0]) + _text(self.lora[1]))
        for it in items:
            parts.append(bytes([_TAG_MM]) + _text(it.identifier) + struct.pack("<q", it.offset - start))
        if self.cache_salt is not None and start == 0:
            parts.append(bytes([_TAG_SALT]) + _text(self.cache_salt))
        if self.prompt_embeds is not None:
            parts.append(bytes([_TAG_EMBEDS]) + _embeds_digest(self.prompt_embeds, start, end))
        if not parts:
            return None
        return EXTRAS_MAGIC + bytes([EXTRAS_VERSION]) + b"".join(parts)


def _embeds_digest(embeds: torch.Tensor, start: int, end: int) -> bytes:
    """dtype name, row width, then SHA-256 of rows ``start .. end - 1`` (raw, row-major)."""
    if embeds.shape[0] < end:
        raise ValueError(f"prompt_embeds has {embeds.shape[0]} rows; the prompt's chunks need {end}")
    rows = embeds[start:end].detach().to("cpu").contiguous()
    raw = rows.view(torch.uint8).numpy().data if rows.numel() else b""
    return (
        _text(str(rows.dtype).removeprefix("torch.")) + struct.pack("<I", int(embeds.shape[1])) + sha256(raw).digest()
    )


def extras_or_none(extras: Any) -> KeyExtras | None:
    """``extras`` checked as a public argument: a :class:`KeyExtras` (an empty one becomes None)
    or None; ``TypeError`` naming ``extras`` otherwise."""
    if extras is None:
        return None
    if not isinstance(extras, KeyExtras):
        raise TypeError(f"extras must be a KeyExtras or None, got {type(extras).__name__}")
    return None if extras.empty else extras

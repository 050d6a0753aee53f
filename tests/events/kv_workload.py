"""Prompts, chunks and a cache client for the KV event tests.

Prompts share prefixes (a few system prompts, branches below them; some under a LoRA adapter).
Each chunk holds ``CHUNK_BLOCKS`` vLLM blocks of ``BLOCK_SIZE`` tokens; block hashes chain like
vLLM's (SHA-256 of the parent hash, the block's tokens and its extra keys), and the chunk's key
in the cache is derived from its last block hash. :class:`CacheSide` stores chunks in the node
server (put, then ``DESCRIBE``) and answers the cache's own prefix lookup.
"""

from __future__ import annotations

import hashlib
import random
import struct
from dataclasses import dataclass

import torch

from lmcache_async.events.chunks import Chunk
from lmcache_async.events.describe import DescribeClient
from lmcache_async.keys import CacheEngineKey
from lmcache_async.memory import MemoryFormat, PoolAllocator
from lmcache_async.server.client import ServerClient

BLOCK_SIZE = 16
CHUNK_BLOCKS = 2
CHUNK_TOKENS = BLOCK_SIZE * CHUNK_BLOCKS
MODEL = "events/model"
ENTRY_SHAPE = (16, 256)  # 16 KiB of float32 per chunk: a 1 MiB pool holds ~60


@dataclass(frozen=True)
class Prompt:
    tokens: tuple[int, ...]
    lora_name: str | None
    chunks: tuple[Chunk, ...]
    keys: tuple[bytes, ...]


def _block_hash(parent: bytes | None, tokens: tuple[int, ...], extras: tuple[object, ...] | None) -> bytes:
    h = hashlib.sha256(parent or b"\0" * 32)
    h.update(struct.pack(f"<{len(tokens)}I", *tokens))
    h.update(repr(extras).encode())
    return h.digest()


def chunk_key(chunk: Chunk) -> bytes:
    """The cache key of a chunk (its chunk hash from the last block hash)."""
    tail = int.from_bytes(chunk.block_hashes[-1][:8], "big")
    return CacheEngineKey(MODEL, 1, 0, tail, torch.bfloat16).to_string().encode()


def prompt_of(tokens: tuple[int, ...], lora_name: str | None) -> Prompt:
    assert len(tokens) % CHUNK_TOKENS == 0
    chunks: list[Chunk] = []
    parent: bytes | None = None
    for c in range(len(tokens) // CHUNK_TOKENS):
        ctoks = tokens[c * CHUNK_TOKENS : (c + 1) * CHUNK_TOKENS]
        hashes: list[bytes] = []
        extras = None if lora_name is None else tuple((lora_name,) for _ in range(CHUNK_BLOCKS))
        first_parent = parent
        for b in range(CHUNK_BLOCKS):
            btoks = ctoks[b * BLOCK_SIZE : (b + 1) * BLOCK_SIZE]
            parent = _block_hash(parent, btoks, None if extras is None else extras[b])
            hashes.append(parent)
        chunks.append(Chunk(tuple(hashes), first_parent, ctoks, BLOCK_SIZE, lora_name, extras))
    return Prompt(tokens, lora_name, tuple(chunks), tuple(chunk_key(c) for c in chunks))


def make_prompts(rng: random.Random, n: int, max_chunks: int = 6) -> list[Prompt]:
    """``n`` prompts over 6 system prompts; a third of the trees under a LoRA adapter."""
    roots = []
    for i in range(6):
        toks = tuple(rng.randrange(1, 30000) for _ in range(CHUNK_TOKENS * rng.randint(1, 2)))
        roots.append((toks, "adapter-a" if i % 3 == 2 else None))
    out: list[Prompt] = []
    seen: set[tuple[int, ...]] = set()
    while len(out) < n:
        base, lora = rng.choice(roots)
        if out and rng.random() < 0.5:  # branch off an existing prompt
            other = rng.choice(out)
            cut = rng.randint(1, len(other.chunks)) * CHUNK_TOKENS
            base, lora = other.tokens[:cut], other.lora_name
        extra = rng.randint(0, max(0, max_chunks - len(base) // CHUNK_TOKENS))
        toks = base + tuple(rng.randrange(1, 30000) for _ in range(extra * CHUNK_TOKENS))
        if toks in seen:
            continue
        seen.add(toks)
        out.append(prompt_of(toks, lora))
    return out


class CacheSide:
    """Stores chunks in a node server namespace and asks it what a prompt would hit."""

    def __init__(self, socket_path: str, namespace: str = "events") -> None:
        self.socket_path = socket_path
        self.namespace = namespace
        self.pool = PoolAllocator(8 << 20, name="events-test", pretouch=False)
        self.client = ServerClient(socket_path, namespace, timeout_s=5.0)
        self.describer = DescribeClient(socket_path, namespace)

    def reconnect(self) -> None:
        """After a server restart: a fresh describe connection (the data client reconnects itself)."""
        self.describer.close()
        self.describer = DescribeClient(self.socket_path, self.namespace)

    def store(self, prompt: Prompt, upto: int) -> int:
        """Store the prompt's first ``upto`` chunks that are not there; how many were stored."""
        want = list(range(upto))
        have = self.client.contains([prompt.keys[i] for i in want]) or [False] * len(want)
        todo = [i for i, h in zip(want, have, strict=True) if not h]
        if not todo:
            return 0
        objs = []
        for _ in todo:
            obj = self.pool.allocate(ENTRY_SHAPE, torch.float32, MemoryFormat.KV_2LTD)
            assert obj is not None
            objs.append(obj)
        try:
            res = self.client.put([(prompt.keys[i], o) for i, o in zip(todo, objs, strict=True)]) or []
        finally:
            for o in objs:
                o.ref_count_down()
        stored = [i for i, ok in zip(todo, res, strict=False) if ok]
        if stored:
            self.describer.describe([(prompt.keys[i], prompt.chunks[i]) for i in stored])
        return len(stored)

    def remove(self, keys: list[bytes]) -> None:
        self.client.remove(keys)

    def clear(self) -> None:
        self.client.clear()

    def lookup_blocks(self, prompt: Prompt) -> int:
        """The blocks a prefix lookup of the cache would load for ``prompt`` right now."""
        flags = self.client.contains(list(prompt.keys))
        assert flags is not None, "the server did not answer"
        n = 0
        for f in flags:
            if not f:
                break
            n += 1
        return n * CHUNK_BLOCKS

    def close(self) -> None:
        self.describer.close()
        self.client.close()

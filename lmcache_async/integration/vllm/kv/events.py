"""The KV connector's event source: what its tiers can serve, as vLLM ``KVCacheEvent``s.

vLLM publishes a connector's events with its own (``--kv-events-config``) when the scheduler
side's ``take_events()`` returns them. :class:`KVEventSource` is what that method drains:

* :meth:`chunk_saved` — a chunk's write became **durable** on a tier (never when queued): the
  chunk is advertised there once it is whole and its parent chunk is advertised there
  (:class:`~lmcache_async.events.chunks.ChunkAdvertiser`, one per tier);
* :meth:`tier_removed` — a tier dropped entries (eviction, delete, damage found, a vanished file):
  its signature is the tier contract's removal listener ``(tier name, keys, reason)``, so the
  manager's removal reports can be handed to it as they are; every advertised chunk of those keys,
  and those below it, is withdrawn leaves first with the hashes of its store;
* :meth:`take_events` — the events since the last call, in order (scheduler thread).

``medium`` is ``CPU`` for memory tiers and ``STORAGE`` for the others, the tier in ``ownership``
(``lmcache_async:<tier>``). ``AllBlocksCleared`` is never produced: on an engine's stream it would
wipe the router's view of the engine's own blocks. Events are vLLM's own classes when vLLM is
importable, else the identical ones of :mod:`lmcache_async.events.wire` (needs msgspec).

Thread-safe: saves and removals may be reported from any thread (removal reports come from the
thread that removed); one lock guards the books. Only keys saved through :meth:`chunk_saved` are
known: a removal of another key is ignored.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from lmcache_async.events.chunks import Changes, Chunk, ChunkAdvertiser

__all__ = ["KVEventSource", "event_types"]

MEMORY_TIERS = frozenset({"cpu", "server"})


def event_types() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """``(BlockStored, BlockRemoved)``: vLLM's classes when vLLM imports, else ours."""
    try:
        from vllm.distributed.kv_events import BlockRemoved, BlockStored
    except ImportError:
        from lmcache_async.events.wire import BlockRemoved, BlockStored
    return BlockStored, BlockRemoved


class KVEventSource:
    """See the module docstring. ``max_pending``: events kept between two :meth:`take_events`
    (beyond it the oldest are dropped and counted in ``dropped``; a scheduler drains every step)."""

    def __init__(
        self, *, max_pending: int = 100_000, types: tuple[Callable[..., Any], Callable[..., Any]] | None = None
    ) -> None:
        self._stored_cls, self._removed_cls = types or event_types()
        self._lock = threading.Lock()
        self._tiers: dict[str, ChunkAdvertiser] = {}
        self._held: dict[str, dict[Hashable, Chunk]] = {}  # tier -> key -> chunk
        self._pending: list[Any] = []
        self.max_pending = max_pending
        self.dropped = 0
        self.stored = 0
        self.removed = 0

    def chunk_saved(self, key: Hashable, chunk: Chunk, tiers: Sequence[str]) -> None:
        """The entry ``key`` holding ``chunk`` is durable on ``tiers`` (each once; a second
        report for a key a tier holds changes nothing)."""
        with self._lock:
            for tier in tiers:
                held = self._held.setdefault(tier, {})
                if key in held:
                    continue
                held[key] = chunk
                self._queue(tier, self._tiers.setdefault(tier, ChunkAdvertiser()).add(chunk))

    def tier_removed(self, tier: str, keys: Sequence[Hashable], reason: object = None) -> None:
        """Tier ``tier`` dropped ``keys`` (``reason``: the tier contract's ``RemovalReason``; not
        published, vLLM's events carry none). Unknown keys are ignored; never raises."""
        with self._lock:
            held = self._held.get(tier)
            if not held:
                return
            for key in keys:
                chunk = held.pop(key, None)
                if chunk is not None:
                    self._queue(tier, self._tiers[tier].discard(chunk))

    def holds(self, key: Hashable) -> bool:
        """True when some tier holds ``key`` (a save of it was reported and not removed since)."""
        with self._lock:
            return any(key in held for held in self._held.values())

    def tiers_of(self, key: Hashable) -> list[str]:
        """The tiers holding ``key``."""
        with self._lock:
            return [tier for tier, held in self._held.items() if key in held]

    def take_events(self) -> list[Any]:
        """The events since the last call, in order (removals leaves first, stores parents first)."""
        with self._lock:
            out, self._pending = self._pending, []
        return out

    def advertised(self, tier: str) -> list[Chunk]:
        """The chunks advertised for ``tier`` now (parents first)."""
        with self._lock:
            adv = self._tiers.get(tier)
            return list(adv.advertised()) if adv is not None else []

    def _queue(self, tier: str, changes: Changes) -> None:
        if not changes:
            return
        medium = "CPU" if tier in MEMORY_TIERS else "STORAGE"
        owner = f"lmcache_async:{tier}"
        for c in changes.removed:
            self._pending.append(self._removed_cls(block_hashes=list(c.block_hashes), medium=medium, ownership=owner))
        for c in changes.stored:
            self._pending.append(self._stored_cls(
                block_hashes=list(c.block_hashes), parent_block_hash=c.parent_hash, token_ids=list(c.token_ids),
                block_size=c.block_size, lora_id=None, medium=medium, lora_name=c.lora_name,
                extra_keys=None if c.extra_keys is None else list(c.extra_keys), ownership=owner,
            ))  # fmt: skip
        self.removed += len(changes.removed)
        self.stored += len(changes.stored)
        over = len(self._pending) - self.max_pending
        if over > 0:
            del self._pending[:over]
            self.dropped += over

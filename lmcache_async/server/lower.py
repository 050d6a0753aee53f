"""The server's lower tiers: one StorageManager (disk, remote, NIXL) behind the shared pools.

Committed entries are written through to it in the background; a lookup that misses a
namespace's pool asks it and loads a hit into the pool. Keys are namespaced here: the manager
sees the model name ``<namespace>\\x1f<model>`` (a namespace never contains control characters,
so the split is unique), so an entry one namespace wrote is never served to another, and the
records are still ordinary, self-describing records of the configured tiers.

Thread affinity: called on the server's loop thread; the manager's own loop thread does the I/O
(the server awaits it, bounded by ``blocking_timeout_secs``). Trouble is a miss, never raised.

Clearing: the manager cannot list one namespace's records, so the store keeps the keys of each
namespace it wrote through or found in a lower tier during this server's life (at most
:data:`KNOWN_MAX` per namespace) and ``clear`` removes those. What it cannot vouch for is said: a
tier that already held records when the server started (or that cannot tell: a remote store), or
a namespace past the key bound, is named in ``clear``'s answer.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

import torch

from lmcache_async.keys import CacheEngineKey
from lmcache_async.memory import MemoryFormat, MemoryObj
from lmcache_async.ratelog import RateLimitedLog
from lmcache_async.tiers import configured_tiers

if TYPE_CHECKING:
    from lmcache_async.config import LMCacheEngineConfig
    from lmcache_async.storage_manager import StorageManager

__all__ = ["KNOWN_MAX", "LowerStore", "wants_lower_tiers"]

logger = logging.getLogger(__name__)
_NS_SEP = "\x1f"
#: Keys of one namespace remembered for ``clear``; past it, ``clear`` says it may leave some.
KNOWN_MAX = 1 << 20
_CLEAR_BATCH = 256


def wants_lower_tiers(config: LMCacheEngineConfig) -> bool:
    """True when the configuration turns on a tier below the server's pools (disk, remote, NIXL
    or any registered tier: :func:`~lmcache_async.tiers.configured_tiers`, the manager's own
    answer)."""
    return bool(_lower_names(config))


def _lower_names(config: LMCacheEngineConfig) -> list[str]:
    return [t for t in configured_tiers(_lower_config(config)) if t not in ("cpu", "server")]


def _lower_config(config: LMCacheEngineConfig) -> LMCacheEngineConfig:
    cfg = config.clone()
    cfg.set("local_cpu", False, "cache server (the shared pools are its CPU tier)")
    cfg.set("cache_server_socket", None, "cache server (never a client of itself)")
    order = [t for t in cfg.tier_order if t not in ("cpu", "server")]
    cfg.set("tier_order", order or ["disk", "remote"], "cache server")
    return cfg


class LowerStore:
    """Write-through to, and reads from, the lower tiers of the server's configuration."""

    def __init__(self, config: LMCacheEngineConfig) -> None:
        from lmcache_async.metrics import serve_configured_metrics
        from lmcache_async.storage_manager import StorageManager

        self.manager: StorageManager = StorageManager(_lower_config(config), name="server")
        serve_configured_metrics(self.manager, config)  # the lower tiers' figures, when metrics_port is set
        self._log = RateLimitedLog(logger)
        self.write_failures = 0
        self.read_failures = 0
        self._known: dict[str, set[bytes]] = {}
        self._overflowed: set[str] = set()
        #: Entries each tier reported when the server started (see :meth:`_opaque_tiers`).
        self._start_entries = {name: fig.get("entries") for name, fig in self.manager.stats().get("tiers", {}).items()}

    def _opaque_tiers(self) -> list[str]:
        """Tiers that may hold records this server never saw: one that held records when it
        started (a disk tier's start-up scan says how many it found), or that cannot tell (a
        remote or NIXL store is shared and cannot be listed)."""
        tiers = self.manager.stats().get("tiers", {})
        out = []
        for name in self.manager.tier_names:
            fig = tiers.get(name, {})
            if "rebuild_done" in fig:  # a disk tier: its start-up scan counted the records it found
                empty = fig["rebuild_done"] is True and fig.get("rebuild_entries") == 0
            else:
                empty = self._start_entries.get(name) == 0 and name not in ("remote", "nixl")
            if not empty:
                out.append(name)
        return out

    def _note(self, namespace: str, raw: bytes) -> None:
        """Remember that ``namespace`` has ``raw`` in a lower tier (for :meth:`clear`)."""
        known = self._known.setdefault(namespace, set())
        if len(known) < KNOWN_MAX:
            known.add(raw)
        elif raw not in known:
            self._overflowed.add(namespace)

    @property
    def tier_names(self) -> list[str]:
        return list(self.manager.tier_names)

    @staticmethod
    def key(namespace: str, raw: bytes) -> CacheEngineKey | None:
        """The manager's key of entry ``raw`` of ``namespace``; None for a malformed key string."""
        try:
            k = CacheEngineKey.from_string(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, TypeError):
            return None
        return CacheEngineKey(
            f"{namespace}{_NS_SEP}{k.model_name}", k.world_size, k.worker_id, k.chunk_hash, k.dtype, k.request_configs
        )

    async def put(self, namespace: str, raw: bytes, tensor: torch.Tensor, fmt: MemoryFormat) -> None:
        """Queue the write-through of a committed entry; the manager copies ``tensor`` (a typed
        view of the entry's pool block) before this returns."""
        key = self.key(namespace, raw)
        if key is None:
            return
        self._note(namespace, raw)
        try:
            if not await self.manager.put(key, tensor, fmt):
                self.write_failures += 1
        except Exception as exc:
            self.write_failures += 1
            self._log.warning("cache server: write-through failed: %s: %s", type(exc).__name__, exc, key="put")

    async def contains(self, namespace: str, raws: list[bytes]) -> list[bool]:
        keys = [self.key(namespace, r) for r in raws]
        try:
            res = await asyncio.gather(*(self.manager.contains(k) for k in keys if k is not None))
        except Exception as exc:
            self.read_failures += 1
            self._log.warning("cache server: lower-tier lookup failed: %s: %s", type(exc).__name__, exc, key="get")
            return [False] * len(raws)
        it = iter(res)
        found = [False if k is None else bool(next(it)) for k in keys]
        for raw, f in zip(raws, found, strict=True):
            if f:
                self._note(namespace, raw)
        return found

    async def get(self, namespace: str, raw: bytes) -> MemoryObj | None:
        """The entry read from a lower tier (the caller owns one reference), or None."""
        key = self.key(namespace, raw)
        if key is None:
            return None
        try:
            obj = await self.manager.get(key)
            if obj is not None:
                self._note(namespace, raw)
            return obj
        except Exception as exc:
            self.read_failures += 1
            self._log.warning("cache server: lower-tier read failed: %s: %s", type(exc).__name__, exc, key="get")
            return None

    async def remove(self, namespace: str, raw: bytes) -> bool:
        key = self.key(namespace, raw)
        if key is None:
            return False
        try:
            return bool(await self.manager.remove(key))
        except Exception:
            return False

    async def clear(self, namespace: str) -> list[str]:
        """Remove every record of ``namespace`` this store knows of from every lower tier (the
        write-through is flushed first); the names of the tiers that may still hold some of its
        records (see the module docstring; a failed removal names every tier)."""
        known = self._known.pop(namespace, set())
        failed = False
        try:
            await self.manager.flush()
            keys = [k for k in (self.key(namespace, raw) for raw in known) if k is not None]
            for i in range(0, len(keys), _CLEAR_BATCH):
                await asyncio.gather(*(self.manager.remove(k) for k in keys[i : i + _CLEAR_BATCH]))
        except Exception as exc:
            failed = True
            self._log.warning("cache server: clearing lower tiers failed: %s: %s", type(exc).__name__, exc, key="clr")
        if failed or namespace in self._overflowed:
            self._overflowed.discard(namespace)
            return self.tier_names
        return self._opaque_tiers()

    async def close(self) -> None:
        """Flush the write-through (bounded) and close the manager."""
        await self.manager.close()

    def stats(self) -> dict[str, Any]:
        st = self.manager.stats()
        st["write_failures"] = self.write_failures
        st["read_failures"] = self.read_failures
        return st

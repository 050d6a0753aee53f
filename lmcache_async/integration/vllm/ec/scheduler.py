"""The scheduler side of the encoder-cache connector: which items are cached, holding them.

:class:`ECSchedulerSide` answers vLLM's per-item questions (``has_cache_item``,
``ensure_cache_available``), promotes lower-tier entries on the manager's loop, holds every
verified entry it promised until this step's metadata hands it to the workers, and turns the
workers' failed loads into failed requests. Every method runs on vLLM's scheduler thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lmcache_async.dtypes import dtype_name
from lmcache_async.engines.encoder_cache import ECCacheEngine
from lmcache_async.integration.vllm.ec.counters import ECCounters, describe_error
from lmcache_async.integration.vllm.ec.engines import Handoff, release_entry
from lmcache_async.integration.vllm.ec.server_leases import server_holds_of
from lmcache_async.integration.vllm.ec.vllm_objects import (
    ECLoadMetadata,
    item_count,
    item_identifier,
    safe_item_count,
)
from lmcache_async.keys import CacheEngineKey
from lmcache_async.memory import MemoryObj
from lmcache_async.storage_manager import StorageManager
from lmcache_async.tiers import Presence, PromiseLeases

__all__ = ["ECSchedulerSide", "release_fetched"]


@dataclass
class _Ready:
    """A verified entry held for a promise: the scheduler's reference, when it was taken, and
    its disk lease when workers live in other processes."""

    obj: MemoryObj
    since: float
    lease: str | None = None


_Fetched = tuple[MemoryObj | None, str, str | None]
"""What a promotion yields: ``(entry, why not, lease path)``."""


@dataclass
class _Prefetch:
    """A promotion queued for (then running on) the manager's loop."""

    future: concurrent.futures.Future[_Fetched]
    deadline: float


class _Promise:
    __slots__ = ("lease", "obj", "requests")

    def __init__(self, obj: MemoryObj, lease: str | None) -> None:
        self.obj = obj
        self.lease = lease
        self.requests: set[str] = set()


def release_fetched(res: _Fetched, leases: PromiseLeases | None = None) -> None:
    """Give back what a promotion yielded: its entry reference and its lease (a disk lease
    when ``leases`` is None)."""
    obj, _, lease = res
    if obj is not None:
        release_entry(obj)
    if lease is not None:
        if leases is not None:
            leases.drop(lease)
        else:  # a disk lease is a hard link: dropping it is unlinking it
            with contextlib.suppress(OSError):
                os.unlink(lease)


class ECSchedulerSide(ECCounters):
    """Scheduler-side half of :class:`~lmcache_async.integration.vllm.ec.impl.LMCacheECConnectorImpl`.

    The connector's constructor sets the shared attributes declared below, then calls
    :meth:`_init_scheduler_side`.
    """

    is_consumer: bool
    prefetch_deadline_s: float
    hold_ttl_s: float
    _metadata_cls: type[ECLoadMetadata]
    _engine: ECCacheEngine
    _sm: StorageManager
    _cpu_lookup: Callable[[CacheEngineKey], MemoryObj | None] | None
    _has_lower: bool
    _leases: PromiseLeases | None
    _handoff: Handoff

    def _init_scheduler_side(self) -> None:
        """Empty scheduler-side state: nothing held, promoted, promised or failed.

        With no disk lease directory and a ``server`` tier, promises to workers in other
        processes are backed by server holds (:mod:`.ec_server_leases`)."""
        if self._leases is None:
            self._leases = server_holds_of(self._sm, self.hold_ttl_s)
        self._ensure_mode = False
        self._ready: dict[str, _Ready] = {}
        self._inflight: dict[str, _Prefetch] = {}
        self._to_submit: list[tuple[CacheEngineKey, concurrent.futures.Future[_Fetched], bool]] = []
        self._unusable: dict[str, float] = {}
        self._ready_requests: set[str] = set()
        self._pending: dict[str, _Promise] = {}
        self._promised_to: dict[str, set[str]] = {}
        self._unavailable: set[str] = set()
        self._last_sweep = time.monotonic()

    def _held_locally(self, mm_hash: str) -> MemoryObj | None:
        """A reference to the CPU-tier entry of ``mm_hash`` (no I/O, no loop hop), or None."""
        lookup = self._cpu_lookup
        if lookup is None:
            return None
        return lookup(self._engine.key(mm_hash))

    def _verified_get(self, mm_hash: str) -> MemoryObj | None:
        """The entry read through every tier with its checks (blocking, bounded by the
        manager's timeout); counts a fault when a tier claimed it but could not deliver it."""
        key = self._engine.key(mm_hash)
        obj = self._held_locally(mm_hash)
        if obj is not None or not self._has_lower:
            return obj
        try:
            presence = self._sm.presence_sync(key)
            if presence is Presence.ABSENT:
                return None
            obj = self._sm.get_sync(key)
        except TimeoutError:
            self._count("faults")
            self._log("verify", "encoder-cache connector: lookup of %s timed out; it is encoded", mm_hash)
            return None
        if obj is None:
            self._count("faults")
            self._log("verify", "encoder-cache connector: %s is listed but unreadable; it is encoded", mm_hash)
        return obj

    async def _fetch(self, key: CacheEngineKey, lease: bool) -> _Fetched:
        """On the manager's loop: ``(entry, "", lease)`` or ``(None, why, None)``; why is
        ``"absent"`` or a fault description. With ``lease`` the record is leased on the disk
        (on an executor thread) and only a leased entry counts."""
        presence = await self._sm.presence(key)
        if presence is Presence.ABSENT:
            return None, "absent", None
        obj = await self._sm.get(key)
        if obj is None:
            return None, ("a tier did not answer" if presence is Presence.UNKNOWN else "listed but unreadable"), None
        if not lease:
            return obj, "", None
        path = await asyncio.to_thread(self._take_lease, key)
        if path is None:
            obj.ref_count_down()
            return None, "absent", None  # not on the shared disk: workers elsewhere cannot read it
        return obj, "", path

    def _take_lease(self, key: CacheEngineKey) -> str | None:
        leases = self._leases
        path = leases.take(key) if leases is not None else None
        self._count("leases" if path is not None else "lease_failures")
        return path

    async def _fetch_all(self, batch: list[tuple[CacheEngineKey, concurrent.futures.Future[_Fetched], bool]]) -> None:
        async def one(key: CacheEngineKey, fut: concurrent.futures.Future[_Fetched], lease: bool) -> None:
            try:
                res = await self._fetch(key, lease)
            except BaseException as exc:  # reported through the future, never raised here
                if not fut.set_running_or_notify_cancel():
                    return
                fut.set_exception(exc)
                if not isinstance(exc, Exception):
                    raise
                return
            if fut.set_running_or_notify_cancel():
                fut.set_result(res)
            else:
                self._release_fetched(res)

        await asyncio.gather(*(one(k, f, le) for k, f, le in batch))

    def _submit_prefetches(self) -> None:
        """Hand this step's queued promotions to the loop in one hop (after the hooks ran)."""
        batch, self._to_submit = self._to_submit, []
        if not batch:
            return
        try:
            self._sm.loop_thread.submit(self._fetch_all(batch))
        except Exception as exc:
            for _, fut, _ in batch:
                if fut.set_running_or_notify_cancel():
                    fut.set_exception(exc)
            self._failed("prefetch", exc)

    def _workers_elsewhere(self) -> bool:
        """True when no worker-role connector of this process uses the engine (the workers run
        in other processes and see entries only through a shared tier)."""
        return self._handoff.workers == 0

    # ---- scheduler side ----
    def has_cache_item(self, identifier: str) -> bool:
        """True only when the entry of ``identifier`` is verified readable and held for the
        load vLLM will ask for; False on a miss or any fault (vLLM then encodes the item).

        With vLLM's ``ensure_cache_available`` in use this never does I/O: it answers from what
        that hook prepared, or from the CPU tier. Without it (older vLLM) a CPU miss reads the
        lower tiers once, blocking up to the manager's timeout.
        """
        try:
            with self._lock:
                self._counters["lookups"] += 1
            if identifier in self._ready:
                self._count("hits")
                return True
            if identifier in self._unusable or identifier in self._inflight:
                self._count("misses")
                return False
            lease: str | None = None
            if self._ensure_mode:
                # Workers elsewhere can only use what a promotion leased on the shared disk.
                obj = None if self._workers_elsewhere() and self.is_consumer else self._held_locally(identifier)
            else:
                obj = self._verified_get(identifier)
                if obj is not None and self.is_consumer and self._workers_elsewhere() and self._leases is not None:
                    lease = self._take_lease(self._engine.key(identifier))
        except Exception as exc:
            self._failed("has_cache_item", exc)
            return False
        if obj is None:
            self._count("misses")
            return False
        if self.is_consumer:
            self._ready[identifier] = _Ready(obj, time.monotonic(), lease)
        else:  # a producer only skips encoding; nothing will be loaded
            release_entry(obj)
        self._count("hits")
        return True

    def has_caches(self, request: Any) -> list[bool]:
        """One flag per multimodal item of ``request`` (the vLLM 0.11.1-0.14 API)."""
        try:
            n = item_count(request)
            ids = [item_identifier(request, i) for i in range(n)]
        except Exception as exc:
            self._failed("has_caches", exc)
            return [False] * safe_item_count(request)
        return [self.has_cache_item(h) for h in ids]

    def ensure_cache_available(self, request: Any, num_computed_tokens: int = 0, *args: Any, **kwargs: Any) -> bool:
        """vLLM >= 0.32: make ``request``'s cached items local and held before vLLM asks.

        A CPU-tier entry is held at once; an entry only a lower tier may have is promoted on
        the manager's loop (this returns False at once, so vLLM defers the request and asks
        again next step). A promotion that has not finished after ``prefetch_deadline_s`` is
        given up: the hook returns True and ``has_cache_item`` says False for those items (vLLM
        encodes them). Once every item is settled the request is remembered: later calls cost
        one set lookup. Never raises, never waits on I/O.
        """
        if not self.is_consumer:
            return True
        self._ensure_mode = True
        try:
            rid = request.request_id
            if rid in self._ready_requests:
                return True
            feats = getattr(request, "mm_features", None) or ()
            now = time.monotonic()
            settled = True
            for index, feat in enumerate(feats):
                pos = getattr(feat, "mm_position", None)
                if pos is not None and pos.offset + pos.length <= num_computed_tokens:
                    continue
                if not self._settle(item_identifier(request, index), now):
                    settled = False
        except Exception as exc:
            self._failed("ensure_cache_available", exc)
            return True
        if settled:
            self._ready_requests.add(rid)
            return True
        self._count("deferred")
        return False

    def _settle(self, mm_hash: str, now: float) -> bool:
        """True once ``mm_hash`` is held, known unusable or not cached; starts its promotion
        (and returns False) when only a lower tier may have it."""
        if mm_hash in self._ready or mm_hash in self._unusable:
            return True
        pf = self._inflight.get(mm_hash)
        if pf is None:
            elsewhere = self._workers_elsewhere()
            if not elsewhere:
                obj = self._held_locally(mm_hash)
                if obj is not None:
                    self._ready[mm_hash] = _Ready(obj, now)
                    return True
            if not self._has_lower:
                return True  # nothing below the CPU tier: not cached
            fut: concurrent.futures.Future[_Fetched] = concurrent.futures.Future()
            self._to_submit.append((self._engine.key(mm_hash), fut, elsewhere and self._leases is not None))
            self._inflight[mm_hash] = _Prefetch(fut, now + self.prefetch_deadline_s)
            self._count("prefetches")
            return False
        if pf.future.done():
            del self._inflight[mm_hash]
            try:
                obj, why, lease = pf.future.result()
            except Exception as exc:
                obj, why, lease = None, describe_error(exc), None
            if obj is not None:
                self._ready[mm_hash] = _Ready(obj, now, lease)
                self._count("prefetch_hits")
            elif why == "absent":  # not asked again while this request settles its other items
                self._unusable[mm_hash] = now + self.prefetch_deadline_s
            else:
                self._unusable[mm_hash] = now + self.hold_ttl_s
                self._count("faults")
                self._log("prefetch", "encoder-cache connector: %s: %s; it is encoded", mm_hash, why)
            return True
        if now >= pf.deadline:
            del self._inflight[mm_hash]
            self._unusable[mm_hash] = now + self.hold_ttl_s
            self._count("prefetch_timeouts")
            self._log("prefetch", "encoder-cache connector: promotion of %s timed out; it is encoded", mm_hash)
            pf.future.add_done_callback(self._release_late)
            return True
        return False

    def _release_late(self, fut: concurrent.futures.Future[_Fetched]) -> None:
        """A promotion nobody waits for any more: give its entry and lease back."""
        if fut.cancelled() or fut.exception() is not None:
            return
        self._release_fetched(fut.result())

    def _release_fetched(self, res: _Fetched) -> None:
        release_fetched(res, self._leases)

    def update_state_after_alloc(self, request: Any, index: int) -> None:
        """Queue item ``index`` of ``request`` for loading when ``has_cache_item`` promised it
        (its held entry moves to this step's metadata); items vLLM encodes are not queued.
        No storage lookup happens here."""
        if not self.is_consumer:
            return
        try:
            mm_hash = item_identifier(request, index)
            rid = str(getattr(request, "request_id", ""))
        except Exception as exc:
            self._failed("update_state_after_alloc", exc)
            return
        ready = self._ready.pop(mm_hash, None)
        promise = self._pending.get(mm_hash)
        if ready is not None:
            if promise is None:
                promise = self._pending[mm_hash] = _Promise(ready.obj, ready.lease)
            else:
                self._release_fetched((ready.obj, "", ready.lease))
        if promise is None:
            return
        promise.requests.add(rid)
        self._promised_to.setdefault(mm_hash, set()).add(rid)
        self._count("promised")

    def build_connector_meta(self, scheduler_output: Any = None) -> ECLoadMetadata:
        """This step's promised hashes, sorted, with how a worker reaches each one.

        A worker in this process takes the scheduler's held reference (nothing can evict or
        delete it before the load). For workers in other processes the record is leased on
        the shared disk (a hard link the worker reads when the record itself is gone). The
        queue is emptied every step; holds nobody used within ``hold_ttl_s`` are released.
        """
        pending, self._pending = self._pending, {}
        leases: dict[str, str] = {}
        specs: dict[str, tuple[list[int], str]] = {}
        local_worker = not self._workers_elsewhere()
        for mm_hash, promise in pending.items():
            obj = promise.obj
            try:
                specs[mm_hash] = (list(obj.shape), dtype_name(obj.dtype))
            except Exception:  # pragma: no cover - a pool object always has both
                pass
            if promise.lease is not None:
                leases[mm_hash] = promise.lease
            if local_worker:
                self._handoff.put(mm_hash, obj)
            else:
                release_entry(obj)
        self._sweep()
        self._submit_prefetches()  # last: the loop wakes up after this step's hooks are done
        return self._metadata_cls(mm_hashes=sorted(pending), leases=leases, specs=specs)

    def _sweep(self) -> None:
        now = time.monotonic()
        if now - self._last_sweep < 1.0:
            return
        self._last_sweep = now
        ttl = self.hold_ttl_s
        for h in [h for h, r in self._ready.items() if now - r.since > ttl]:
            r = self._ready.pop(h)
            self._release_fetched((r.obj, "", r.lease))
        for h in [h for h, t in self._unusable.items() if t <= now]:
            del self._unusable[h]
        self._handoff.sweep(ttl, now)

    def update_connector_output(self, connector_output: Any) -> None:
        """Take the workers' report of this step: failed loads (their requests are handed to
        :meth:`take_unavailable_requests`) and the workers' counters."""
        meta = getattr(connector_output, "ec_connector_worker_meta", None)
        if meta is None:
            return
        try:
            for mm_hash in getattr(meta, "failed", ()) or ():
                self._unavailable.update(self._promised_to.get(mm_hash, ()))
            counts = getattr(meta, "counters", None) or {}
            with self._lock:
                for k, v in counts.items():
                    if k in self._worker_reported:
                        self._worker_reported[k] += int(v)
        except Exception as exc:
            self._failed("update_connector_output", exc)

    def take_unavailable_requests(self) -> set[str]:
        """Requests with a promised item no worker could load (vLLM fails them cleanly)."""
        out, self._unavailable = self._unavailable, set()
        if out:
            self._count("unavailable_requests", len(out))
        return out

    def update_state_after_free(self, request: Any, index: int) -> None:
        """vLLM released item ``index`` of ``request`` from its encoder cache."""
        try:
            mm_hash = item_identifier(request, index)
        except Exception:
            return
        reqs = self._promised_to.get(mm_hash)
        if reqs is not None:
            reqs.discard(str(getattr(request, "request_id", "")))
            if not reqs:
                del self._promised_to[mm_hash]

    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        """Forget ``request`` (nothing is sent asynchronously: never delays freeing)."""
        self._ready_requests.discard(str(getattr(request, "request_id", "")))
        return False, None

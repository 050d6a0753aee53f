"""Where a request's chunks lie, asked without blocking vLLM's scheduler thread.

:class:`TierLookups` answers :meth:`TierLookups.where` on the scheduler thread from what that
thread can tell at once (the CPU tier, the queued write-through, the node server's pool, the
disk tier's files: :meth:`StorageManager.locate_here
<lmcache_async.storage_manager.StorageManager.locate_here>`). When a tier that only the
manager's loop can ask (a remote store, NIXL) must be asked, the lookup goes to the connector's
lookup thread (``lmcache-async-kv-lookup``) and :meth:`~TierLookups.where` answers None — vLLM
then skips the request this step and asks again on a later one. A lookup that outlives its
bound is answered as a miss (the thread's own call is bounded by the manager's timeouts).

The same thread calibrates the lower tiers once at start-up (:meth:`TierLookups.start_probe`: a
small and a chunk-sized probe read per tier, timed into the :class:`~.kv_costs.CostBook`) and
reloads the book's state file before each lookup, so a worker in another process that measured
loads is heard. Lookups queue behind the probe: the first request is priced with measured costs.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lmcache_async.integration.vllm.kv.costs import LOAD_POLICIES, CostBook
from lmcache_async.keys import CacheEngineKey
from lmcache_async.ratelog import RateLimitedLog
from lmcache_async.storage_manager import StorageManager

__all__ = ["PROBE_SMALL_BYTES", "LoadSettings", "TierLookups"]

logger = logging.getLogger(__name__)

PROBE_SMALL_BYTES = 64 << 10
"""The small probe read (mostly latency); the large one is a chunk's record, at most
:data:`PROBE_LARGE_MAX_BYTES` (a slow tier must not keep the first lookups waiting long)."""
PROBE_LARGE_MAX_BYTES = 2 << 20
PROBE_ROUNDS = 2


@dataclass(frozen=True)
class LoadSettings:
    """The load-or-recompute settings (from the engine config; ``kv_transfer_params`` may
    override ``policy`` and ``max_load_s`` per request: :meth:`for_request`)."""

    policy: str = "auto"
    max_load_s: float | None = None
    margin: float = 0.1
    deadline_factor: float = 3.0

    def for_request(self, params: Any) -> tuple[LoadSettings, str | None]:
        """These settings with ``params`` (a request's ``kv_transfer_params``: ``load_policy``,
        ``max_load_s``) applied; and a complaint when a value there is invalid (ignored)."""
        if not isinstance(params, dict) or not params:
            return self, None
        policy, max_load = self.policy, self.max_load_s
        bad = None
        p = params.get("load_policy")
        if p is not None:
            if p in LOAD_POLICIES:
                policy = str(p)
            else:
                bad = f"load_policy must be one of {LOAD_POLICIES}, got {p!r}"
        m = params.get("max_load_s")
        if m is not None:
            if isinstance(m, (int, float)) and not isinstance(m, bool) and m > 0:
                max_load = float(m)
            else:
                bad = f"max_load_s must be a number > 0, got {m!r}"
        if (policy, max_load) == (self.policy, self.max_load_s):
            return self, bad
        return LoadSettings(policy, max_load, self.margin, self.deadline_factor), bad


class TierLookups:
    """The scheduler's lookups of where chunks lie; see the module docstring.

    ``manager`` is called for the manager to ask; ``give_up_s`` bounds how long a request waits
    for its lookup (then it is a miss). :meth:`where` is for vLLM's scheduler thread only."""

    def __init__(self, manager: Callable[[], StorageManager], book: CostBook, give_up_s: float) -> None:
        self._manager = manager
        self.book = book
        self.give_up_s = give_up_s
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._inflight: dict[str, tuple[concurrent.futures.Future[list[str | None]], float, int]] = {}
        self._lock = threading.Lock()
        self._log = RateLimitedLog(logger)
        self.counters: dict[str, int] = dict.fromkeys(
            ("lookups_deferred", "lookups_given_up", "lookup_errors", "probes", "probe_failures"), 0
        )

    def _pool(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lmcache-async-kv-lookup")
        return self._executor

    # ---- start-up calibration ----
    def start_probe(self, chunk_bytes: int) -> concurrent.futures.Future[None] | None:
        """Time reads of each lower tier that is not memory, on the lookup thread (bounded by
        the manager's timeouts); later lookups wait behind it. The probe's future (None when
        the lookups are closed): the connector waits for it, bounded, before the engine serves."""
        try:
            return self._pool().submit(self._probe, chunk_bytes)
        except RuntimeError:  # closed meanwhile
            return None

    def _probe(self, chunk_bytes: int) -> None:
        try:
            sm = self._manager()
            for tier, (memory, _) in sm.tier_status().items():
                if memory:
                    continue
                for _ in range(PROBE_ROUNDS):
                    large = min(max(chunk_bytes, PROBE_SMALL_BYTES * 2), PROBE_LARGE_MAX_BYTES)
                    for nbytes in (PROBE_SMALL_BYTES, large):
                        took = sm.probe_read_sync(tier, nbytes)
                        self.counters["probes"] += 1
                        if took is None:
                            self.counters["probe_failures"] += 1
                            break
                        self.book.observe_read(tier, nbytes, took)
            params = {t: self.book.read_params(t) for t in sm.tier_status()}
            logger.info("KV connector: tier read costs (latency s, bytes/s) after probing: %s", params)
        except Exception as exc:  # a probe is advice: trouble leaves the tier unmeasured
            self.counters["probe_failures"] += 1
            self._log.warning("KV connector: probing the tiers failed: %s: %s", type(exc).__name__, exc, key="probe")

    # ---- lookups ----
    def _locate(self, keys: list[CacheEngineKey]) -> list[str | None]:
        self.book.reload()
        return self._manager().locate_sync(keys)

    def where(self, req_id: str, keys: Sequence[CacheEngineKey]) -> list[str | None] | None:
        """The tier of each of ``keys`` (None: not held), or None while the answer is being
        looked up off this thread (ask again on a later step). Scheduler thread; never waits
        on I/O of a loop-side tier. Storage trouble is a miss (counted)."""
        entry = self._inflight.get(req_id)
        if entry is not None:
            fut, since, n = entry
            if fut.done() or n != len(keys):
                del self._inflight[req_id]
                if n == len(keys):
                    try:
                        return fut.result()
                    except Exception as exc:
                        self.counters["lookup_errors"] += 1
                        self._log.warning("KV connector: lookup failed (a miss): %s", exc, key="lookup")
                        return [None] * len(keys)
            elif time.monotonic() - since > self.give_up_s:
                del self._inflight[req_id]
                self.counters["lookups_given_up"] += 1
                self._log.warning("KV connector: a lookup took over %.1f s (a miss)", self.give_up_s, key="slow")
                return [None] * len(keys)
            else:
                return None
        names, need_loop = self._manager().locate_here(keys)
        if not need_loop:
            return names
        try:
            fut = self._pool().submit(self._locate, list(keys))
        except RuntimeError:  # shut down
            return names
        self._inflight[req_id] = (fut, time.monotonic(), len(keys))
        self.counters["lookups_deferred"] += 1
        return None

    def forget(self, req_id: str) -> None:
        """Drop ``req_id``'s lookup in flight (its answer is not used)."""
        self._inflight.pop(req_id, None)

    def close(self) -> None:
        """Stop the lookup thread (bounded: its calls are bounded by the manager's timeouts)."""
        executor, self._executor = self._executor, None
        self._inflight.clear()
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)

"""KV events of the KV connector inside vLLM: what the workers learn, what the scheduler publishes.

Only built when vLLM runs with ``--kv-events-config`` (``enable_kv_cache_events``); otherwise
the connector holds None for both halves and the save path pays one ``is None`` test per run.

* **Worker** (:class:`WorkerEventReports`, model-runner thread plus the manager's threads): a
  chunk's save is reported *stored* on a tier once it is durable there — the CPU tier when the
  put returns (the record is in the pool), every lower tier once the tier itself answers that it
  holds the entry (:meth:`StorageManager.tier_holds`: the disk tier's file is published, the node server's
  entry committed; asked at each step for the chunks still waiting, given up after
  :data:`WATCH_S`). The tiers' removal reports (the manager's removal listeners: eviction,
  delete, damage found) and the connector's own failed reads (a record gone from a tier that
  answers) are reported *removed*. The reports travel to the scheduler in vLLM's channel:
  ``get_kv_connector_kv_cache_events()`` → ``KVConnectorOutput.kv_cache_events`` →
  ``update_connector_output`` (:class:`LMCacheKVReports`; several workers' reports are merged
  by vLLM's output aggregator).
* **Scheduler** (:class:`SchedulerEvents`, scheduler thread): describes each chunk it plans to
  save in vLLM's terms from the ``Request`` (its block hashes, parent hash, token ids, block
  size, LoRA name, extra keys as vLLM fills them), counts stored reports until every worker
  rank has the chunk on a tier, and feeds :class:`~.kv_events.KVEventSource`, which orders the
  events (whole chunks, parent first; removals leaves first) for ``take_events()``. A lookup
  that finds none of a chunk's tiers holding it any more (a file deleted behind the tier's
  back) withdraws it from the tiers that answered.

Nothing here raises into vLLM: a report that cannot be built is counted and dropped.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from vllm.distributed.kv_events import KVConnectorKVEvents

from lmcache_async.events.chunks import Chunk
from lmcache_async.integration.vllm.kv.events import KVEventSource
from lmcache_async.keys import CacheEngineKey
from lmcache_async.storage_manager import StorageManager
from lmcache_async.tiers import UNKNOWN

logger = logging.getLogger(__name__)

__all__ = [
    "WATCH_S",
    "LMCacheKVReports",
    "SchedulerEvents",
    "ServerDescriber",
    "WorkerEventReports",
    "events_enabled",
]

WATCH_S = 60.0
"""How long a worker waits for a lower tier to hold a chunk it saved before giving up on it."""
MAX_REPORTS = 200_000
"""Reports a worker keeps between two steps (the oldest beyond it are dropped and counted)."""
MAX_DESCRIBED = 65_536
"""Chunk descriptions the scheduler keeps for saves not yet durable (the oldest are dropped)."""
CHECKS_PER_STEP = 512
"""Lower-tier presence checks a worker makes per step at most."""
MAX_DESCRIBES_IN_FLIGHT = 64
"""``DESCRIBE`` batches queued for the node server at most (beyond, a batch is dropped, counted)."""

_MASK64 = (1 << 64) - 1

Report = tuple[str, str, int, int]
"""``(kind, tier, chunk hash, worker rank)``; ``kind`` is ``"stored"`` or ``"removed"``."""


def events_enabled(vllm_config: Any) -> bool:
    """True when vLLM publishes KV events (``kv_events_config.enable_kv_cache_events``)."""
    ev = getattr(vllm_config, "kv_events_config", None)
    return bool(ev is not None and getattr(ev, "enable_kv_cache_events", False))


class LMCacheKVReports(KVConnectorKVEvents):
    """vLLM's container for the workers' reports of one step (:data:`Report` tuples)."""

    def __init__(self, reports: list[Report] | None = None) -> None:
        self._reports: list[Any] = list(reports or ())
        self._workers = 1

    def add_events(self, events: list[Any]) -> None:
        self._reports.extend(events)

    def aggregate(self) -> LMCacheKVReports:
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._workers += count

    def get_all_events(self) -> list[Any]:
        return list(self._reports)

    def get_number_of_workers(self) -> int:
        return self._workers

    def clear_events(self) -> None:
        self._reports = []
        self._workers = 1

    def __repr__(self) -> str:
        return f"<LMCacheKVReports {len(self._reports)} reports>"


class WorkerEventReports:
    """The worker's reports; see the module docstring. :meth:`tier_removed` is the manager's
    removal listener (any thread); the rest runs on the model-runner thread."""

    def __init__(self, manager: StorageManager, rank: int) -> None:
        self.manager = manager
        self.rank = rank
        self._lock = threading.Lock()
        self._reports: list[Report] = []
        self._watch: collections.OrderedDict[tuple[str, CacheEngineKey], float] = collections.OrderedDict()
        names = manager.tier_names
        self._cpu = "cpu" in names
        self._lower = [n for n in names if n != "cpu"]
        self.counters = dict.fromkeys(("stored", "removed", "unconfirmed", "dropped", "errors"), 0)

    def _add(self, report: Report) -> None:
        self._reports.append(report)
        self.counters[report[0]] += 1
        over = len(self._reports) - MAX_REPORTS
        if over > 0:
            del self._reports[:over]
            self.counters["dropped"] += over

    def saved(self, keys: Sequence[CacheEngineKey], results: Sequence[bool]) -> None:
        """The puts of ``keys`` returned ``results``: CPU-tier holders are reported at once,
        lower tiers watched until they hold the entry."""
        now = time.monotonic()
        with self._lock:
            for key, ok in zip(keys, results, strict=False):
                if not ok:
                    continue
                if self._cpu and self.manager.tier_holds("cpu", key) is True:
                    self._add(("stored", "cpu", key.chunk_hash, self.rank))
                for tier in self._lower:
                    self._watch[(tier, key)] = now

    def tier_removed(self, tier: str, keys: Sequence[CacheEngineKey], reason: object = None) -> None:
        """The manager's removal listener: ``keys`` left ``tier`` (KV records only: keys with
        tags, e.g. hidden-state records, are not chunks of the KV stream). Never raises."""
        try:
            with self._lock:
                for key in keys:
                    if getattr(key, "tags", None) is None:
                        self._watch.pop((tier, key), None)
                        self._add(("removed", tier, key.chunk_hash, self.rank))
        except Exception:
            self.counters["errors"] += 1

    def read_failed(self, tier: str, key: CacheEngineKey) -> None:
        """A load found ``key`` missing or unreadable on ``tier`` while the tier answers."""
        if tier and tier != StorageManager.MEMORY_TIER:
            self.tier_removed(tier, [key])

    def take(self) -> list[Report]:
        """The reports since the last call, after asking the lower tiers about watched chunks."""
        self._confirm(time.monotonic())
        with self._lock:
            out, self._reports = self._reports, []
        return out

    def _confirm(self, now: float) -> None:
        if not self._watch:
            return
        with self._lock:
            items = list(self._watch.items())[:CHECKS_PER_STEP]
        for (tier, key), since in items:
            try:
                held = self.manager.tier_holds(tier, key)
            except Exception:  # a manager closed meanwhile: the watch ends with the worker
                held = UNKNOWN
            with self._lock:
                if (tier, key) not in self._watch:
                    continue  # removed meanwhile
                if held is True:  # not UNKNOWN: a tier that cannot tell here is watched on
                    del self._watch[(tier, key)]
                    self._add(("stored", tier, key.chunk_hash, self.rank))
                elif now - since > WATCH_S:
                    del self._watch[(tier, key)]
                    self.counters["unconfirmed"] += 1
                else:
                    self._watch.move_to_end((tier, key))


class SchedulerEvents:
    """The scheduler's half; see the module docstring. Scheduler thread only."""

    def __init__(
        self,
        world_size: int,
        block_size: int,
        chunk_size: int,
        describe_server: Callable[[list[tuple[int, Chunk]]], None] | None = None,
    ) -> None:
        from vllm import envs
        from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, to_event_extra_keys

        self._extra_keys = generate_block_hash_extra_keys
        self._event_keys = to_event_extra_keys
        self._int_hashes = bool(envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)
        """vLLM's ``maybe_convert_block_hash``, its setting read once: the low 64 bits of each
        hash as an int (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``), else the hash bytes."""
        self.source = KVEventSource()
        self.world_size = max(int(world_size), 1)
        self.block_size = block_size
        self.chunk_size = chunk_size
        self._requests: dict[str, Any] = {}
        self._described: collections.OrderedDict[int, Chunk] = collections.OrderedDict()
        self._ranks: dict[tuple[str, int], set[int]] = {}
        self.counters = dict.fromkeys(("described", "undescribed", "reports", "vanished", "errors"), 0)
        self.describe_server = describe_server
        """Called with the chunks every rank holds on the node-server tier (``(chunk hash,
        chunk)``), so the server is told what they hold (:class:`ServerDescriber`)."""
        self._on_server: list[tuple[int, Chunk]] = []

    def track(self, req_id: str, request: Any) -> None:
        """Keep vLLM's ``Request`` while it runs (its hashes describe the chunks it saves)."""
        self._requests[req_id] = request

    def forget(self, req_id: str) -> None:
        self._requests.pop(req_id, None)

    def planned(self, req_id: str, hashes: Sequence[int], first: int, end: int) -> None:
        """Chunks ``first .. end - 1`` of request ``req_id`` (chunk hashes ``hashes``) are
        being saved: describe them for the reports to come."""
        request = self._requests.get(req_id)
        if request is None:
            return
        for c in range(first, end):
            try:
                chunk = self.describe(request, c)
            except Exception:
                chunk = None
                self.counters["errors"] += 1
            if chunk is None:
                self.counters["undescribed"] += 1
                continue
            self._described[hashes[c]] = chunk
            self._described.move_to_end(hashes[c])
            self.counters["described"] += 1
        while len(self._described) > MAX_DESCRIBED:
            self._described.popitem(last=False)

    def _convert(self, h: Any) -> Any:
        return int.from_bytes(h, "big") & _MASK64 if self._int_hashes else h

    def describe(self, request: Any, c: int) -> Chunk | None:
        """Chunk ``c`` of ``request`` in vLLM's terms; None when vLLM has not hashed its blocks."""
        bs, cs = self.block_size, self.chunk_size
        per = cs // bs
        hashes = request.block_hashes
        if len(hashes) < (c + 1) * per:
            return None
        start = c * cs
        block_hashes = tuple(self._convert(h) for h in hashes[c * per : (c + 1) * per])
        parent = self._convert(hashes[c * per - 1]) if c else None
        tokens = tuple(request.all_token_ids[start : start + cs])
        plain = not (
            getattr(request, "lora_request", None)
            or getattr(request, "mm_features", None)
            or getattr(request, "cache_salt", None)
            or getattr(request, "prompt_embeds", None) is not None
        )
        if plain:  # what vLLM's helpers give a block with no extra keys, without calling them
            event_keys: list[Any] | None = [None] * per
        else:
            extras = []
            mm = 0
            for b in range(per):
                keys, mm = self._extra_keys(request, start + b * bs, start + (b + 1) * bs, mm)
                extras.append(keys)
            event_keys = self._event_keys(extras)
        lora = getattr(request, "lora_request", None)
        return Chunk(
            block_hashes, parent, tokens, bs, getattr(lora, "lora_name", None) if lora else None,
            None if event_keys is None else tuple(event_keys),
        )  # fmt: skip

    def apply(self, reports: object) -> None:
        """The workers' reports of a step (``KVConnectorOutput.kv_cache_events``)."""
        if not isinstance(reports, LMCacheKVReports):
            return
        for report in reports.get_all_events():
            self.counters["reports"] += 1
            try:
                kind, tier, chunk_hash, rank = report
                if kind == "stored":
                    self._stored(tier, chunk_hash, rank)
                else:
                    self._ranks.pop((tier, chunk_hash), None)
                    self.source.tier_removed(tier, [chunk_hash])
            except Exception:
                self.counters["errors"] += 1
        if self._on_server:
            batch, self._on_server = self._on_server, []
            if self.describe_server is not None:
                self.describe_server(batch)

    def _stored(self, tier: str, chunk_hash: int, rank: int) -> None:
        chunk = self._described.get(chunk_hash)
        if chunk is None:
            return
        ranks = self._ranks.setdefault((tier, chunk_hash), set())
        ranks.add(rank)
        if len(ranks) >= self.world_size:
            del self._ranks[(tier, chunk_hash)]
            self.source.chunk_saved(chunk_hash, chunk, (tier,))
            if tier == "server":
                self._on_server.append((chunk_hash, chunk))

    def looked_up(self, hashes: Sequence[int], names: Sequence[str | None], available: dict[str, bool]) -> None:
        """A lookup found no tier holding the chunks where ``names`` is None: they are withdrawn
        from every tier that answers (``available``) and advertised them (a file deleted
        behind the tier's back, a record another process removed)."""
        for h, name in zip(hashes, names, strict=False):
            if name is None and self.source.holds(h):
                gone = [t for t in self.source.tiers_of(h) if available.get(t, False)]
                for tier in gone:
                    self.counters["vanished"] += 1
                    self.source.tier_removed(tier, [h])

    def take_events(self) -> list[Any]:
        return self.source.take_events()

    def stats(self) -> dict[str, int]:
        out = dict(self.counters)
        out.update(stored=self.source.stored, removed=self.source.removed, dropped=self.source.dropped)
        return out


class ServerDescriber:
    """Sends ``DESCRIBE`` for chunks the node-server tier holds, on a thread of its own (the
    scheduler never waits on the socket): every rank's entry of each chunk, through the server
    tier of ``manager()`` (:meth:`ServerBackend.describe
    <lmcache_async.server.tier.ServerBackend.describe>`). Failures are counted and
    logged once per kind; at most :data:`MAX_DESCRIBES_IN_FLIGHT` batches wait."""

    def __init__(
        self, manager: Callable[[], StorageManager], key_of: Callable[[int], CacheEngineKey], world_size: int
    ) -> None:
        self._manager = manager
        self._key_of = key_of
        self.world_size = max(int(world_size), 1)
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lmcache-async-kv-describe")
        self._lock = threading.Lock()
        self._in_flight = 0
        self.counters = dict.fromkeys(("sent", "recorded", "failed", "dropped"), 0)

    def __call__(self, items: list[tuple[int, Chunk]]) -> None:
        with self._lock:
            if self._in_flight >= MAX_DESCRIBES_IN_FLIGHT:
                self.counters["dropped"] += len(items)
                return
            self._in_flight += 1
        try:
            self._executor.submit(self._send, items)
        except RuntimeError:  # shut down
            with self._lock:
                self._in_flight -= 1

    def _send(self, items: list[tuple[int, Chunk]]) -> None:
        try:
            keys: list[CacheEngineKey] = []
            chunks: list[Chunk] = []
            for chunk_hash, chunk in items:
                k = self._key_of(chunk_hash)
                for rank in range(self.world_size):
                    keys.append(k if rank == k.worker_id else CacheEngineKey(
                        k.model_name, k.world_size, rank, k.chunk_hash, k.dtype))  # fmt: skip
                    chunks.append(chunk)
            describer = self._manager().describer()
            got = describer.describe(keys, chunks) if describer is not None else None
            self.counters["sent"] += len(keys)
            if got is None:
                self.counters["failed"] += len(keys)
            else:
                self.counters["recorded"] += sum(1 for ok in got if ok)
        except Exception as exc:
            self.counters["failed"] += len(items)
            logger.debug("KV connector: DESCRIBE to the node server failed: %s", exc)
        finally:
            with self._lock:
                self._in_flight -= 1

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

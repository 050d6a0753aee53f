"""Stage payloads over a StorageManager: the framework-free core of the Omni connector.

:class:`OmniStageStore` is what :class:`~lmcache_async.integration.omni.LMCacheOmniConnector`
delegates to; it needs no vLLM-Omni, so it also serves other multi-stage pipelines.

Keys. A payload sent over the stage edge ``from -> to`` under ``put_key`` lives under the
:class:`~lmcache_async.keys.CacheEngineKey` whose model name is ``<namespace>/<from>-><to>``
(percent-encoded in the key string), whose chunk hash is ``stable_u64_from_str(put_key)`` and
whose tag ``omni_key`` carries the put key itself (a SHA-256 of it for keys over 128
characters): two put keys never share an entry, on any tier, in any process.

Values. A tensor is stored as itself (its dtype and shape kept by the tier's records) and comes
back as a fresh CPU tensor; every other payload is one pickle-free record
(:mod:`~lmcache_async.integration.omni.codec`), stored as ``MemoryFormat.BINARY``.

Copies. With the node server as the only tier, a tensor put is one copy (the manager's put path
writes it straight into the server's block) and so is a get (out of the server's pool straight
into the buffer that becomes the returned tensor). Records are encoded into, and returned
tensors live in, pre-touched memory (:mod:`~lmcache_async.integration.omni.buffers`,
``payload_buffer_size``), so a large payload pays no page faults.

Visibility. ``put`` returns once the entry is readable by every process sharing a tier: with
lower tiers configured it waits for the write-through (``flush``). ``get`` reads through every
tier (a consumer in another process finds the entry in the shared tier).

Clean-up, across processes. A successful ``get`` removes the entry from every tier when
``consume_on_get`` is set (the default): the consumer deletes what it read. ``cleanup(rid)``
removes, on every tier, the entries this store wrote or read (and kept) whose put key is ``rid``
or starts with ``rid + "_"`` (Omni's ``<request>_<stage>_<chunk>`` keys), plus the entry
``rid`` itself on every edge this store has used.

Trouble (a tier down or slow, a corrupt record) is a miss or ``(False, 0, None)`` plus a
counter in :meth:`health` and a rate-limited log line; it never raises. Caller mistakes raise
``TypeError``/``ValueError`` naming the argument; any call after :meth:`close` raises
:class:`~lmcache_async.errors.ManagerClosedError`. Every method may be called from any thread
except the manager's loop thread.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import threading
import time
from collections import OrderedDict
from typing import Any

import torch

from lmcache_async.config import LMCacheEngineConfig
from lmcache_async.errors import ManagerClosedError
from lmcache_async.integration.omni.buffers import PayloadBuffers
from lmcache_async.integration.omni.codec import CorruptPayload, OmniCodec, decode_record, encode_record
from lmcache_async.integration.omni.options import StageOptions, omni_serializer
from lmcache_async.keys import TAG_PREFIX, CacheEngineKey, stable_u64_from_str
from lmcache_async.memory import MemoryFormat, MemoryObj, gib_to_bytes
from lmcache_async.ratelog import RateLimitedLog
from lmcache_async.storage_manager import StorageManager
from lmcache_async.tiers import BatchLookup

__all__ = ["OmniStageStore", "stage_key"]

ReadsInto = BatchLookup
"""The older name of :class:`lmcache_async.tiers.BatchLookup`."""

logger = logging.getLogger(__name__)

KEY_TAG = TAG_PREFIX + "omni_key"
MAX_TAG_CHARS = 128
FIRST_POLL_S = 0.0005
INLINE_MARGIN_S = 0.1
"""A poll runs on the caller's thread only when the tier's bound on one call plus this margin
(decoding included) ends before the deadline."""
REAP_BATCH = 16

Fetched = tuple[Any, int]


def _stage_name(value: object, name: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise TypeError(f"{name} must be a str (or an int stage id), got {type(value).__name__}")
    text = str(value)
    if not text:
        raise ValueError(f"{name} must be non-empty")
    return text


def _check_put_key(value: object, name: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type(value).__name__}")
    if not value:
        raise ValueError(f"{name} must be non-empty")
    return value


def _sole_reader(manager: StorageManager) -> BatchLookup | None:
    """The manager's tier when it is its only one and a :class:`~lmcache_async.tiers.BatchLookup` (no CPU tier, so
    the manager's own read would ask just that tier, on the caller's thread), else None."""
    return manager.sole_batch_reader()


def stage_key(namespace: str, from_stage: str, to_stage: str, put_key: str) -> CacheEngineKey:
    """The key of ``put_key`` on the edge ``from_stage -> to_stage`` (see the module docstring)."""
    tag = put_key if len(put_key) <= MAX_TAG_CHARS else "sha256-" + hashlib.sha256(put_key.encode()).hexdigest()
    return CacheEngineKey(
        f"{namespace}/{from_stage}->{to_stage}", 1, 0, stable_u64_from_str(put_key), torch.uint8, {KEY_TAG: tag}
    )


class OmniStageStore:
    """Stage payloads keyed per edge over one :class:`StorageManager`; see the module docstring.

    Built from an engine ``config`` (the manager is created here, named ``omni``, and closed by
    :meth:`close`) and :class:`StageOptions`. ``omni`` overrides Omni's serializer (default:
    looked up once; None where vllm_omni does not import, then records written with it are
    misses here).
    """

    def __init__(
        self,
        config: LMCacheEngineConfig,
        options: StageOptions | None = None,
        *,
        omni: OmniCodec | bool | None = True,
    ) -> None:
        if not isinstance(config, LMCacheEngineConfig):
            raise TypeError(f"config must be an LMCacheEngineConfig, got {type(config).__name__}")
        if options is None:
            options = StageOptions()
        if not isinstance(options, StageOptions):
            raise TypeError(f"options must be a StageOptions, got {type(options).__name__}")
        self.options = options
        self._omni: OmniCodec | None = omni_serializer() if omni is True else (omni or None)
        if options.serializer == "omni" and self._omni is None:
            raise ValueError("serializer 'omni' needs vllm_omni, which does not import here")
        self.manager = StorageManager(config, None, name="omni")
        try:
            self._buffers = PayloadBuffers(gib_to_bytes(options.payload_buffer_size), "omni payload buffers")
        except BaseException:
            self.manager.close_sync()
            raise
        self._reader = _sole_reader(self.manager)
        #: The manager's puts land in its only tier on the caller's thread (no write-through).
        self._direct_only = self._reader is not None and self.manager.direct_put is not None
        self._shared = self.manager.has_lower_tiers
        self._lock = threading.Lock()
        self._tracked: OrderedDict[str, set[CacheEngineKey]] = OrderedDict()
        self._edges: set[tuple[str, str]] = set()
        self._consuming: set[CacheEngineKey] = set()  # read and being removed: misses meanwhile
        self._workers = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="lmcache-async-omni")
        self._log = RateLimitedLog(logger)
        self._closed = False
        self._counts: dict[str, int] = dict.fromkeys(
            (
                "puts",
                "put_failures",
                "bytes_put",
                "gets",
                "misses",
                "bytes_got",
                "corrupt",
                "timeouts",
                "deadline_misses",
                "removed",
                "remove_failures",
            ),
            0,
        )

    # ---- helpers ------------------------------------------------------------------------------
    def _count(self, **deltas: int) -> None:
        with self._lock:
            for k, v in deltas.items():
                self._counts[k] += v

    def _check_open(self) -> None:
        if self._closed:
            raise ManagerClosedError("the Omni stage store is closed")

    def key(self, from_stage: str, to_stage: str, put_key: str) -> CacheEngineKey:
        """The storage key of ``put_key`` on this edge (arguments checked as for :meth:`put`)."""
        src = _stage_name(from_stage, "from_stage")
        dst = _stage_name(to_stage, "to_stage")
        return stage_key(self.options.namespace, src, dst, _check_put_key(put_key, "put_key"))

    def _track(self, put_key: str, key: CacheEngineKey, edge: tuple[str, str]) -> None:
        with self._lock:
            self._edges.add(edge)
            keys = self._tracked.get(put_key)
            if keys is None:
                self._tracked[put_key] = keys = set()
                while len(self._tracked) > self.options.max_tracked_keys:
                    self._tracked.popitem(last=False)
            keys.add(key)

    # ---- put ----------------------------------------------------------------------------------
    def put(self, from_stage: str, to_stage: str, put_key: str, data: Any) -> tuple[bool, int, dict[str, Any] | None]:
        """Store ``data`` for the edge; ``(ok, stored_bytes, metadata)``.

        ``ok`` is True once every process sharing a tier can read the entry; ``metadata`` (a
        small dict of ``key`` and ``size``) is informational: :meth:`get` finds entries by key.
        A tensor (any device) is stored as itself; ``bytes`` and trees of dicts, lists,
        tuples, tensors, numpy arrays and scalars as one record. Put keys are expected to be
        unique per payload: a put of a key still stored keeps the stored payload (returns
        True). ``TypeError`` naming ``data`` when it cannot be encoded without pickle.
        """
        self._check_open()
        key = self.key(from_stage, to_stage, put_key)
        edge = (str(from_stage), str(to_stage))
        sm = self.manager
        try:
            if isinstance(data, torch.Tensor):
                nbytes = data.numel() * data.element_size()
                ok = sm.put_sync(key, data)
            else:
                enc = encode_record(data, self._omni, prefer_omni=self.options.serializer == "omni")
                if self.options.serializer == "lmcache" and enc.codec == 2:
                    raise TypeError("data cannot be encoded by the tree codec (serializer 'lmcache')")
                nbytes = enc.nbytes
                ok = self._put_record(key, enc)
            # A put the direct tier took is readable everywhere already: nothing to wait for
            # unless the write is still queued (to the tiers after it).
            if ok and self._shared and not (self._direct_only and not sm.holds_locally(key)):
                sm.flush_sync()
        except TimeoutError:
            self._count(timeouts=1, put_failures=1)
            self._log.warning("Omni put of %r timed out (blocking_timeout_secs)", put_key, key="put-timeout")
            return False, 0, None
        if not ok:
            self._count(put_failures=1)
            self._log.warning("Omni put of %r (%d bytes) refused: no tier could take it", put_key, nbytes, key="put")
            return False, 0, None
        self._track(put_key, key, edge)
        self._count(puts=1, bytes_put=nbytes)
        return True, nbytes, {"key": key.to_string(), "size": nbytes}

    def _put_record(self, key: CacheEngineKey, enc: Any) -> bool:
        """Write the record straight into a CPU-pool block when there is one (the put borrows
        it: one copy), else into a payload buffer that the manager's put path copies from."""
        sm = self.manager
        obj = sm.allocate([enc.nbytes], torch.uint8, MemoryFormat.BINARY)
        if obj is None:
            obj = self._buffers.allocate([enc.nbytes], torch.uint8, MemoryFormat.BINARY)
        try:
            enc.write_into(obj.tensor)
            return sm.put_sync(key, obj)
        finally:
            obj.ref_count_down()

    # ---- get ----------------------------------------------------------------------------------
    def _read(self, key: CacheEngineKey) -> MemoryObj | None:
        """The entry with one reference the caller owns, or None. With the manager's only tier
        answering on this thread (the node server's), the entry is read from it straight into
        a payload buffer, unless this process's own write of it is still queued."""
        sm = self.manager
        reader = self._reader
        if reader is not None and not sm.holds_locally(key):
            return reader.lookup_many([key], self._buffers.allocate)[0]
        return sm.get_sync(key)

    def _fetch(self, key: CacheEngineKey, get_key: str) -> Fetched | None:
        """One read, decoded into objects the caller owns; None on a miss or trouble."""
        if key in self._consuming:
            return None
        try:
            obj = self._read(key)
        except TimeoutError:
            self._count(timeouts=1)
            self._log.warning("Omni get of %r timed out (blocking_timeout_secs)", get_key, key="get-timeout")
            return None
        if obj is None:
            return None
        nbytes = obj.nbytes
        if obj.fmt != MemoryFormat.BINARY:
            return self._buffers.take(obj), nbytes  # the tensor now holds the reference
        try:
            if obj.dtype != torch.uint8:
                raise CorruptPayload(f"a BINARY entry of dtype {obj.dtype}")
            return decode_record(obj.raw, self._omni, self._buffers.empty), nbytes
        except CorruptPayload as exc:
            self._count(corrupt=1)
            self._log.warning("Omni payload %r is corrupt and was dropped: %s", get_key, exc, key="corrupt")
        finally:
            obj.ref_count_down()
        self._remove_quietly(key)
        return None

    def _got(self, key: CacheEngineKey, get_key: str, edge: tuple[str, str], got: Fetched | None) -> Fetched | None:
        if got is None:
            self._count(misses=1)
            return None
        self._count(gets=1, bytes_got=got[1])
        if self.options.consume_on_get:
            with self._lock:
                self._edges.add(edge)
                keys = self._tracked.get(get_key)
                if keys is not None:
                    keys.discard(key)
                    if not keys:
                        del self._tracked[get_key]
                self._consuming.add(key)
            try:
                self._workers.submit(self._consume, key)
            except RuntimeError:  # close() began meanwhile: remove on this thread
                self._consume(key)
        else:
            self._track(get_key, key, edge)
        return got

    def get(
        self, from_stage: str, to_stage: str, get_key: str, metadata: dict[str, Any] | None = None
    ) -> Fetched | None:
        """``(payload, stored_bytes)`` or None when the entry is not (yet) there; one attempt,
        bounded by the manager's timeouts. The payload is a fresh object the caller owns
        (tensors on the CPU). ``metadata`` is accepted for Omni's interface and not needed."""
        self._check_open()
        key = self.key(from_stage, to_stage, get_key)
        return self._got(key, get_key, (str(from_stage), str(to_stage)), self._fetch(key, get_key))

    def get_with_deadline(
        self,
        from_stage: str,
        to_stage: str,
        get_key: str,
        metadata: dict[str, Any] | None = None,
        *,
        deadline: float,
    ) -> Fetched | None:
        """Like :meth:`get`, polling until the entry appears or ``deadline`` (a
        ``time.monotonic()`` instant) passes; then None. Returns by the deadline even when a
        tier hangs: each poll runs on a worker thread and is abandoned (its result dropped,
        the entry left in place) when the deadline comes first, except a poll of a
        :class:`~lmcache_async.tiers.BatchLookup` tier whose own bound on a call ends well before the deadline, which
        runs on this thread. Polls back off from 0.5 ms to ``poll_interval_s``."""
        self._check_open()
        if isinstance(deadline, bool) or not isinstance(deadline, (int, float)):
            raise TypeError(f"deadline must be a time.monotonic() value, got {type(deadline).__name__}")
        key = self.key(from_stage, to_stage, get_key)
        edge = (str(from_stage), str(to_stage))
        pause = FIRST_POLL_S
        reader = self._reader
        inline_s = None if reader is None else reader.call_timeout_s + INLINE_MARGIN_S
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if inline_s is not None and left > inline_s:
                got = self._fetch(key, get_key)  # bounded by the tier's own timeout
            else:
                fut = self._workers.submit(self._fetch, key, get_key)
                try:
                    got = fut.result(timeout=left)
                except concurrent.futures.TimeoutError:
                    break  # the late answer is dropped; the entry (if any) stays for the next reader
            if got is not None:
                return self._got(key, get_key, edge, got)
            left = deadline - time.monotonic()
            if left <= 0:
                break
            time.sleep(min(pause, left))
            pause = min(pause * 2, self.options.poll_interval_s)
        self._count(misses=1, deadline_misses=1)
        return None

    # ---- clean-up -----------------------------------------------------------------------------
    def _consume(self, key: CacheEngineKey) -> None:
        try:
            self._remove_quietly(key)
        finally:
            with self._lock:
                self._consuming.discard(key)

    def _remove_quietly(self, key: CacheEngineKey) -> bool:
        try:
            removed = self.manager.remove_sync(key)
        except ManagerClosedError:
            return False
        except TimeoutError:
            self._count(remove_failures=1)
            self._log.warning("Omni remove of %s timed out", key.to_string()[:200], key="remove")
            return False
        if removed:
            self._count(removed=1)
        return removed

    def cleanup(self, request_id: str) -> None:
        """Remove this request's entries from every tier (see the module docstring); entries
        another process wrote under other keys are left to it (or to its consumer)."""
        self._check_open()
        rid = _check_put_key(request_id, "request_id")
        prefix = rid + "_"
        keys: set[CacheEngineKey] = set()
        with self._lock:
            for pk in [pk for pk in self._tracked if pk == rid or pk.startswith(prefix)]:
                keys |= self._tracked.pop(pk)
            edges = list(self._edges)
        for src, dst in edges:
            keys.add(stage_key(self.options.namespace, src, dst, rid))
        for k in keys:
            self._remove_quietly(k)

    def reap_consumed(self) -> None:
        """Forget (not delete) up to 16 of the oldest remembered put keys whose entries another
        process has consumed already."""
        if self._closed:
            return
        with self._lock:
            batch = list(self._tracked.items())[:REAP_BATCH]
        for pk, keys in batch:
            try:
                gone = not any(self.manager.contains_sync(k) for k in list(keys))
            except (TimeoutError, ManagerClosedError):
                return
            if gone:
                with self._lock:
                    self._tracked.pop(pk, None)

    # ---- health and lifecycle -------------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        """``status`` (``"healthy"``, ``"degraded"`` while a lower tier's circuit is open, or
        ``"closed"``), the store's counters, the number of remembered put keys, the payload
        buffers' figures (``payload_buffers``: capacity, free bytes, tensors served from them
        and allocated afresh) and per tier the manager's figures. Any thread; never raises."""
        with self._lock:
            out: dict[str, Any] = dict(self._counts)
            out["tracked_keys"] = len(self._tracked)
        out["payload_buffers"] = self._buffers.stats()
        if self._closed:
            out["status"] = "closed"
            return out
        try:
            tiers = self.manager.stats()["tiers"]
        except Exception as exc:  # stats of a closing manager
            out.update(status="degraded", error=str(exc))
            return out
        down = [name for name, t in tiers.items() if t.get("circuit", "closed") != "closed"]
        out["status"] = "degraded" if down else "healthy"
        out["tiers_down"] = down
        out["tiers"] = tiers
        return out

    @property
    def closed(self) -> bool:
        """True once :meth:`close` started."""
        return self._closed

    def close(self) -> None:
        """Finish background removals, then close the manager. Idempotent; entries in shared
        tiers stay for their consumers."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._workers.shutdown(wait=True, cancel_futures=False)
        self.manager.close_sync()

    def __enter__(self) -> OmniStageStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"OmniStageStore(namespace={self.options.namespace!r}, tiers={self.manager.tier_names})"

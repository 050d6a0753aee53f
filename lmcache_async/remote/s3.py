"""S3 connector (``s3://BUCKET/PREFIX``) over obstore's native asyncio API.

* **Layout**: one object per entry, ``<PREFIX>/<prefix>/<model>/<digest[:2]>/<digest>.rec``
  (:mod:`.naming`), holding one record (:mod:`lmcache_async.records`): the header, then the
  payload as stored (plain, or sealed in segments of the part size when ``encryption_key_file``
  is set). S3 publishes an object whole, so a reader never sees part of an entry.
* **Put**: a conditional PUT (``If-None-Match: *``): the first writer of a key wins and a re-put
  is a no-op. An object above the multipart threshold (the part size, at least 5 MiB) goes up as
  a multipart upload of such parts, completed atomically by the store.
* **Get**: one plain GET for objects up to :data:`WHOLE_GET_MAX`; larger ones in ranged GETs:
  the head and a part first, then concurrent ranged GETs of one part (one sealed segment) each.
  Checked on every read: magic, version, header checksum, key, object size = header + payload,
  the payload's xxh3-64 and, when sealed, every segment's tag. A damaged record is deleted
  (counted ``corrupt``); a record of another key (``foreign``) or sealed under another key
  (``foreign_key``) is a miss that stays.
* **Concurrency**: at most ``s3_max_concurrency`` requests of this tier in flight.
* **Failures**: every request under ``remote_timeout_s`` (obstore's client timeout) with no
  retries inside obstore: the manager's timeout and circuit breaker decide, and obstore's
  connection pool reconnects by itself once the store answers again.
* **contains**: concurrent HEADs. ``remote_ttl_s`` is honoured by the object's last-modified time.
* **Credentials** come from the ``s3_*`` keys or the ``AWS_*`` variables and are never logged,
  printed or put in ``stats()``.

CPU work on large payloads (checksums, copies, AES) runs on the manager's executor, never on
the loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from lmcache_async.encryption import RecordCipher, new_buffer
from lmcache_async.memory import MemoryObj
from lmcache_async.ratelog import RateLimitedLog
from lmcache_async.records import (
    ForeignSeal,
    RecordError,
    RecordHeader,
    decode_header,
    encode_header,
    header_length,
    payload_checksum,
    payload_checksum_parts,
)
from lmcache_async.records.sections import SEAL_SECTION_LEN, TAG_LEN
from lmcache_async.tiers import Allocate

from .codec import ForeignRecord
from .connector import Connector, ConnectorSettings, S3Settings
from .naming import EntryName
from .url import RemoteURL, parse_remote_url, redact

try:
    import obstore
    from obstore.exceptions import AlreadyExistsError
    from obstore.store import S3Store
except ImportError as _exc:  # pragma: no cover - the registry reports it
    raise ImportError(f"obstore is not installed ({_exc})") from None

logger = logging.getLogger(__name__)

__all__ = ["S3Connector", "create"]

T = TypeVar("T")

MULTIPART_MIN = 5 << 20
"""S3's smallest multipart part (all but the last)."""
WHOLE_GET_MAX = 64 << 20
"""Objects up to this size are read with one plain GET (no range header: on SeaweedFS a ranged
GET of the same bytes measured 8 % slower, and concurrent ranged GETs of parts slower still).
The GET's response headers give the size before any byte of the body is read; a larger object
is read in ranged GETs instead: the head and a part first, then one part (one sealed segment)
per GET, concurrently."""
_OFFLOAD_BYTES = (4 << 20) + 1
"""Payloads from this size have their CPU work done on the executor; smaller ones (a copy and a
checksum of at most 4 MiB, as the Redis tier does for a part) are cheaper than the hop."""
_LOG_EVERY_S = 5.0
_DELETE_BATCH = 1000


def _resolve(settings: S3Settings) -> dict[str, Any]:
    """obstore's S3 config from the ``s3_*`` keys, else the ``AWS_*`` variables."""
    env = os.environ
    endpoint = settings.endpoint or env.get("AWS_ENDPOINT_URL") or None
    region = settings.region or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "us-east-1"
    key_id = settings.access_key_id or env.get("AWS_ACCESS_KEY_ID") or None
    secret = settings.secret_access_key or env.get("AWS_SECRET_ACCESS_KEY") or None
    if (key_id is None) != (secret is None):
        raise ValueError("s3_access_key_id and s3_secret_access_key must be given together (or neither)")
    if endpoint is not None:
        low = endpoint.lower()
        if not low.startswith(("http://", "https://")):
            raise ValueError(f"s3_endpoint {endpoint!r} must be an http:// or https:// URL")
        if low.startswith("http://") and not settings.allow_http:
            raise ValueError(f"s3_endpoint {endpoint!r} is plain http; set s3_allow_http to use it")
    cfg: dict[str, Any] = {"region": region}
    if endpoint is not None:
        cfg["endpoint"] = endpoint
    if key_id is not None:
        cfg["access_key_id"] = key_id
        cfg["secret_access_key"] = secret
        token = env.get("AWS_SESSION_TOKEN")
        if token and settings.access_key_id is None:
            cfg["session_token"] = token
    else:
        cfg["skip_signature"] = True
    return cfg


class S3Connector(Connector):
    """Records as objects in an S3 bucket; see the module docstring."""

    def __init__(self, url: RemoteURL, settings: ConnectorSettings) -> None:
        assert url.bucket is not None and url.path is not None
        s3 = settings.s3
        if s3.max_concurrency <= 0:
            raise ValueError(f"s3_max_concurrency must be > 0, got {s3.max_concurrency!r}")
        cfg = _resolve(s3)
        timeout = datetime.timedelta(seconds=settings.timeout_s)
        self._bucket = url.bucket
        self._root = url.path
        self._endpoint = cfg.get("endpoint", "aws")
        self._store = S3Store(
            url.bucket,
            prefix=url.path or None,
            client_options={"allow_http": bool(s3.allow_http), "timeout": timeout, "connect_timeout": timeout},
            retry_config={
                "max_retries": 0,
                "retry_timeout": timeout,
                "backoff": {
                    "init_backoff": datetime.timedelta(milliseconds=50),
                    "max_backoff": timeout,
                    "base": 2.0,
                },
            },
            **cfg,
        )
        self._cipher: RecordCipher | None = settings.cipher
        self._key_id = settings.cipher.key_id if settings.cipher is not None else None
        self._part = settings.part_size
        self._mp_chunk = max(settings.part_size, MULTIPART_MIN)
        self._first = self._part + (1 << 20)  # the first ranged GET: a part, and room for the header
        self._ttl = settings.ttl_s
        self._executor: concurrent.futures.Executor | None = settings.executor
        self._limit = s3.max_concurrency
        self._sem: asyncio.Semaphore | None = None
        self._rate_log = RateLimitedLog(logger, _LOG_EVERY_S)
        self.corrupt = 0
        self.foreign = 0
        self.foreign_key = 0
        self.expired = 0
        self.vanished = 0
        self.alloc_failed = 0
        self.requests = 0
        self.bytes_written = 0
        self.bytes_read = 0

    @property
    def seals(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"S3Connector(bucket={self._bucket!r}, prefix={self._root!r}, endpoint={self._endpoint!r})"

    # ---- plumbing ----------------------------------------------------------------------------------
    def _slot(self) -> asyncio.Semaphore:
        if self._sem is None:
            self._sem = asyncio.Semaphore(self._limit)
        self.requests += 1
        return self._sem

    async def _cpu(self, nbytes: int, fn: Callable[..., T], *args: Any, hold: MemoryObj | None = None) -> T:
        """``fn(*args)``: inline for small payloads, else one executor job. ``hold``: a block the
        job reads or writes, kept referenced until the job is over (also when the caller is
        cancelled meanwhile)."""
        if nbytes < _OFFLOAD_BYTES or self._executor is None:
            return fn(*args)
        if hold is not None:
            hold.ref_count_up()
        try:
            cf = self._executor.submit(fn, *args)
        except BaseException:
            if hold is not None:
                hold.ref_count_down()
            raise
        if hold is not None:
            cf.add_done_callback(lambda _f: hold.ref_count_down())
        return await asyncio.wrap_future(cf)

    def _expired(self, meta: Any) -> bool:
        if self._ttl is None:
            return False
        modified = meta.get("last_modified")
        if modified is None:
            return False
        age = datetime.datetime.now(datetime.UTC) - modified
        return bool(age.total_seconds() > self._ttl)

    def _segment_size(self) -> int:
        """Plaintext bytes per sealed segment: a stored segment with its tag is one part."""
        return max(1, self._part - TAG_LEN)

    # ---- put ---------------------------------------------------------------------------------------
    def _encode(self, key: str, obj: MemoryObj) -> memoryview:
        """The whole object: header and payload (sealed when a cipher is set), in a new buffer."""
        payload = obj.byte_view()
        shape = tuple(obj.shape)
        if self._cipher is not None:
            hlen = header_length(len(key.encode("utf-8")), len(shape), SEAL_SECTION_LEN)
            seal, buf = self._cipher.seal(key, shape, obj.dtype, obj.fmt, payload, self._segment_size(), reserve=hlen)
            head = encode_header(key, shape, obj.dtype, obj.fmt, payload_checksum(buf[hlen:]), seal=seal)
            assert len(head) == hlen
            buf[:hlen] = head
            return buf
        head = encode_header(key, shape, obj.dtype, obj.fmt, payload_checksum(payload))
        buf = new_buffer(len(head) + payload.nbytes)
        buf[: len(head)] = head
        buf[len(head) :] = payload
        return buf

    async def put(self, name: EntryName, obj: MemoryObj) -> bool:
        """Publish ``obj``'s record; True when stored or already present. The object is built in
        a buffer of its own, so a cancelled upload never reads a released block."""
        data = await self._cpu(obj.nbytes, self._encode, name.key, obj, hold=obj)
        n = data.nbytes
        try:
            async with self._slot():
                await obstore.put_async(
                    self._store,
                    name.relpath,
                    data,
                    mode="create",
                    use_multipart=n > self._mp_chunk,
                    chunk_size=self._mp_chunk,
                    max_concurrency=4,
                )
        except AlreadyExistsError:
            return True
        self.bytes_written += n
        return True

    # ---- get ---------------------------------------------------------------------------------------
    async def get(self, name: EntryName, alloc: Allocate) -> MemoryObj | None:
        """The verified entry (the caller owns one reference), or None. A damaged record is
        deleted; a record of another key or sealed under another key stays."""
        path = name.relpath
        try:
            async with self._slot():
                res = await obstore.get_async(self._store, path)
                size = int(res.meta["size"])
                if size <= WHOLE_GET_MAX:
                    first = memoryview(await res.bytes_async())
                else:  # the body is left unread (its connection is dropped): ranged GETs instead
                    res = await obstore.get_async(self._store, path, options={"range": (0, self._first)})
                    first = memoryview(await res.bytes_async())
        except FileNotFoundError:
            return None
        meta = res.meta
        if self._expired(meta):
            self.expired += 1
            await self._delete(path)
            return None
        try:
            hdr = decode_header(first, key_id=self._key_id)
            if hdr.key != name.key:
                raise ForeignRecord("record holds another key")
            if size != hdr.total_len or hdr.num_parts != 1:
                raise RecordError("object size does not match its header")
        except ForeignSeal as exc:
            self.foreign_key += 1
            self._rate_log.warning("s3 record %s is not for this tier's key (%s); kept", path, exc)
            return None
        except ForeignRecord:
            self.foreign += 1
            self._rate_log.warning("s3 record %s holds another key; kept", path)
            return None
        except RecordError as exc:
            await self._damaged(path, str(exc))
            return None
        obj = alloc(hdr.shape, hdr.dtype, hdr.fmt)
        if obj is None or obj.nbytes != hdr.plain_len:  # no memory for it now: a miss, counted
            if obj is not None:
                obj.ref_count_down()
            self.alloc_failed += 1
            return None
        try:
            pieces = await self._rest(path, hdr, first, size)
            if pieces is None:
                obj.ref_count_down()
                return None
            problem = await self._cpu(hdr.payload_len, self._assemble, hdr, pieces, obj.byte_view(), hold=obj)
        except BaseException:
            obj.ref_count_down()
            raise
        if problem is not None:
            obj.ref_count_down()
            await self._damaged(path, problem)
            return None
        self.bytes_read += size
        return obj

    async def _rest(self, path: str, hdr: RecordHeader, first: memoryview, size: int) -> list[memoryview] | None:
        """The stored payload as consecutive pieces: what the first GET brought, then concurrent
        ranged GETs, each ending on a part (sealed segment) boundary. None when the object
        vanished meanwhile."""
        pieces = [first[hdr.header_len :]]
        step = (hdr.seal.segment_size + TAG_LEN) if hdr.seal is not None and hdr.seal.segments > 1 else self._part
        start = len(first)
        ranges: list[tuple[int, int]] = []
        while start < size:
            k = (start - hdr.header_len) // step + 1
            end = min(size, hdr.header_len + k * step)
            ranges.append((start, end))
            start = end
        if not ranges:
            return pieces

        async def one(r: tuple[int, int]) -> memoryview:
            async with self._slot():
                return memoryview(await obstore.get_range_async(self._store, path, start=r[0], end=r[1]))

        results = await asyncio.gather(*(one(r) for r in ranges), return_exceptions=True)
        for r in results:
            if isinstance(r, FileNotFoundError):
                self.vanished += 1
                return None
            if isinstance(r, BaseException):
                raise r
        pieces.extend(r for r in results if isinstance(r, memoryview))
        if sum(p.nbytes for p in pieces) != hdr.payload_len:
            self.vanished += 1  # replaced by a shorter object between the GETs
            return None
        return pieces

    def _assemble(self, hdr: RecordHeader, pieces: list[memoryview], dst: memoryview) -> str | None:
        """Check the stored payload ``pieces`` and write the entry's bytes into ``dst``: what is
        wrong, or None (executor or loop thread)."""
        if payload_checksum_parts(pieces) != hdr.checksum:
            return "payload checksum mismatch"
        if hdr.seal is None:
            off = 0
            for p in pieces:
                dst[off : off + p.nbytes] = p
                off += p.nbytes
            return None
        assert self._cipher is not None  # decode_header let a sealed record through only with our key
        n = hdr.plain_len
        offsets = [0]
        for p in pieces:
            offsets.append(offsets[-1] + p.nbytes)
        try:
            for i in range(hdr.seal.segments):
                s, e = hdr.seal.plain_bounds(i, n)
                so, eo = hdr.seal.stored_bounds(i, n)
                self._cipher.open_segment(hdr, i, _span(pieces, offsets, so, eo), dst[s:e])
        except RecordError as exc:
            return str(exc)
        return None

    async def _damaged(self, path: str, why: str) -> None:
        self.corrupt += 1
        self._rate_log.warning("s3 record %s is damaged (%s); removing it", path, why)
        try:
            await self._delete(path)
        except Exception as exc:  # stays a miss; the next reader tries again
            self._rate_log.warning("s3 tier cannot remove %s: %s", path, exc)

    async def _delete(self, path: str) -> None:
        async with self._slot():
            await obstore.delete_async(self._store, path)

    # ---- exists / remove / clear -------------------------------------------------------------------
    async def exists(self, names: Sequence[EntryName]) -> list[bool]:
        """One HEAD per name, concurrently (bounded by ``s3_max_concurrency``)."""

        async def one(name: EntryName) -> bool:
            try:
                async with self._slot():
                    meta = await obstore.head_async(self._store, name.relpath)
            except FileNotFoundError:
                return False
            return not self._expired(meta)

        results = await asyncio.gather(*(one(n) for n in names), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return [bool(r) for r in results]

    async def remove(self, name: EntryName) -> bool:
        if not (await self.exists([name]))[0]:
            return False
        await self._delete(name.relpath)
        return True

    async def clear(self, prefix: str) -> None:
        """Delete every object below namespace ``prefix``."""
        stream = obstore.list(self._store, prefix=f"{prefix}/", chunk_size=_DELETE_BATCH)
        async for batch in stream:
            paths = [m["path"] for m in batch]
            if self._root:  # listed paths carry the store's prefix on some versions
                paths = [p[len(self._root) + 1 :] if p.startswith(self._root + "/") else p for p in paths]
            if paths:
                async with self._slot():
                    await obstore.delete_async(self._store, paths)

    async def start(self) -> None:
        """Check that the bucket answers (one HEAD of a name that is never written)."""
        try:
            async with self._slot():
                await obstore.head_async(self._store, ".lmcache-async-probe")
        except FileNotFoundError:
            pass

    def stats(self) -> dict[str, Any]:
        return {
            "url": redact(f"s3://{self._bucket}/{self._root}"),
            "endpoint": self._endpoint,
            "sealed": self._cipher is not None,
            "requests": self.requests,
            "corrupt": self.corrupt,
            "foreign": self.foreign,
            "foreign_key": self.foreign_key,
            "expired": self.expired,
            "vanished": self.vanished,
            "alloc_failed": self.alloc_failed,
            "bytes_written": self.bytes_written,
            "bytes_read": self.bytes_read,
        }


def _span(pieces: list[memoryview], offsets: list[int], start: int, end: int) -> memoryview:
    """Bytes ``[start, end)`` of the concatenation of ``pieces`` (``offsets``: where each piece
    starts, and the total at the end): a view when one piece holds them, else a joined copy."""
    lo = 0
    while offsets[lo + 1] <= start:
        lo += 1
    if end <= offsets[lo + 1]:
        return pieces[lo][start - offsets[lo] : end - offsets[lo]]
    out = bytearray()
    i = lo
    while offsets[i] < end:
        a = max(start, offsets[i]) - offsets[i]
        b = min(end, offsets[i + 1]) - offsets[i]
        out += pieces[i][a:b]
        i += 1
    return memoryview(out)


def create(url: str, settings: ConnectorSettings) -> S3Connector:
    """Registry factory for ``s3://`` URLs."""
    parsed = parse_remote_url(url)
    if parsed.kind != "s3":
        raise ValueError(f"remote_url {redact(url)!r} is not an s3:// URL")
    return S3Connector(parsed, settings)

"""The blocking side of the Mooncake tier: one ``MooncakeDistributedStore`` client and its
registered memory.

Everything here blocks (network round trips to the master and transfers from the segment
holders) and runs on the tier's own worker threads (:mod:`.mooncake`), never on the loop.
The ``mooncake`` package is imported lazily, on the first :meth:`MooncakeClient.open`.

Mooncake answers with integer status codes. :func:`check` turns the ones that mean "the store
cannot be reached or failed" into :class:`MooncakeUnavailable` (the tier then stops sending
work until a probe succeeds) and the others into :class:`MooncakeError`; "not found", "already
exists" and "no space" are answers, not errors, and are handled by the callers.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from lmcache_async.errors import BackendUnavailableError
from lmcache_async.memory import gib_to_bytes
from lmcache_async.tiers import BackendContext

from .url import parse_remote_url

__all__ = [
    "ALREADY_EXISTS",
    "HAS_LEASE",
    "INVALID_PARAMS",
    "NOT_FOUND",
    "NO_SPACE",
    "MooncakeClient",
    "MooncakeError",
    "MooncakeSettings",
    "MooncakeUnavailable",
    "check",
    "mooncake_settings",
]

DEFAULT_METADATA_PORT = 8080
"""Port of the master's embedded HTTP metadata server (``--enable_http_metadata_server``)."""

# Status codes of the Mooncake Store client (negative; 0 is success).
INTERNAL_ERROR = -1
NO_SPACE = -200
"""No segment has room for the object (NO_AVAILABLE_HANDLE)."""
INVALID_PARAMS = -600
"""Bad arguments, e.g. a buffer or range that does not match the object's size."""
NOT_FOUND = -704
ALREADY_EXISTS = -705
HAS_LEASE = -706
TRANSFER_FAIL = -800
RPC_FAIL = -900
RPC_TIMEOUT = -901
_UNREACHABLE = frozenset({INTERNAL_ERROR, TRANSFER_FAIL, RPC_FAIL, RPC_TIMEOUT})


class MooncakeError(RuntimeError):
    """A Mooncake call failed with status ``code``."""

    def __init__(self, what: str, code: int) -> None:
        super().__init__(f"mooncake {what} failed with status {code}")
        self.code = code


class MooncakeUnavailable(MooncakeError):
    """The store cannot be reached (master down or hung, transfer failed, client not set up)."""


def check(what: str, code: int) -> int:
    """``code`` when it is not negative; else raise the matching :class:`MooncakeError`."""
    if code >= 0:
        return code
    if code in _UNREACHABLE or code <= -1000:  # -1000 and below: metadata/etcd/HA failures
        raise MooncakeUnavailable(what, code)
    raise MooncakeError(what, code)


@dataclass(frozen=True)
class MooncakeSettings:
    """How one client joins the store (from ``remote_url`` and the ``mooncake_*`` keys)."""

    master: str
    """``host:port`` of the master's RPC service."""
    metadata_server: str
    """Metadata server connection string, e.g. ``http://127.0.0.1:8080/metadata``."""
    protocol: str = "tcp"
    device_name: str = ""
    local_hostname: str = "127.0.0.1"
    local_buffer_size: int = 64 << 20
    global_segment_size: int = 0
    replica_num: int = 1


def _store_module() -> Any:
    try:
        from mooncake import store
    except ImportError as exc:
        raise BackendUnavailableError(
            f"the mooncake:// tier needs the Mooncake Store client ({exc}); install lmcache-async[mooncake] "
            "(mooncake-transfer-engine-non-cuda on CPU hosts) and its system libraries "
            "(libcurl4 libibverbs1 rdma-core librdmacm1 libnuma1 liburing2)"
        ) from exc
    return store


class MooncakeClient:
    """One set-up ``MooncakeDistributedStore`` and the memory regions registered with it.

    Thread-safe: the store's calls may run concurrently from several worker threads. A buffer
    outside the registered regions is registered for the duration of one call
    (:meth:`registered`) and unregistered when the last call using it ends.
    """

    def __init__(self, store: Any, settings: MooncakeSettings, module: Any) -> None:
        self._store = store
        self._settings = settings
        self._config = module.ReplicateConfig()
        self._config.replica_num = settings.replica_num
        self._regions: list[tuple[int, int]] = []
        self._adhoc: dict[int, list[int]] = {}  # address -> [size, users]
        self._lock = threading.Lock()
        self._closed = False

    @classmethod
    def open(cls, settings: MooncakeSettings, regions: Sequence[tuple[int, int]] = ()) -> MooncakeClient:
        """Set up a client and register ``regions`` (``(address, size)``); blocking.

        Raises :class:`MooncakeUnavailable` when setup fails (master unreachable) and
        ``BackendUnavailableError`` when the ``mooncake`` package is missing."""
        module = _store_module()
        store = module.MooncakeDistributedStore()
        rc = store.setup(
            settings.local_hostname,
            settings.metadata_server,
            settings.global_segment_size,
            settings.local_buffer_size,
            settings.protocol,
            settings.device_name,
            settings.master,
        )
        if rc != 0:
            with contextlib.suppress(Exception):
                store.close()
            raise MooncakeUnavailable("setup", rc if rc < 0 else INTERNAL_ERROR)
        client = cls(store, settings, module)
        try:
            for addr, size in regions:
                client.register_region(addr, size)
        except BaseException:
            client.close()
            raise
        return client

    # ---- memory ------------------------------------------------------------------------------------
    def register_region(self, addr: int, size: int) -> None:
        """Register ``[addr, addr + size)`` for the client's lifetime (pools, staging)."""
        if size <= 0:
            return
        check("register_buffer", self._store.register_buffer(addr, size))
        with self._lock:
            self._regions.append((addr, size))

    def _covered(self, addr: int, size: int) -> bool:
        return any(a <= addr and addr + size <= a + n for a, n in self._regions)

    def registered(self, buffers: Sequence[tuple[int, int]]) -> contextlib.AbstractContextManager[None]:
        """Make every ``(address, size)`` in ``buffers`` usable for one call (``with``).

        Buffers inside the regions registered for the client's lifetime (the pools, the header
        arena) need nothing, and that case takes no lock (the region list only ever grows).
        Registering another buffer is local bookkeeping of the transfer engine (no round trip),
        done under the client's lock, so a second call on the same buffer never races it."""
        for addr, size in buffers:
            if size > 0 and not self._covered(addr, size):
                return self._adhoc_registered(buffers)
        return _NOTHING_TO_REGISTER

    @contextlib.contextmanager
    def _adhoc_registered(self, buffers: Sequence[tuple[int, int]]) -> Iterator[None]:
        taken: list[int] = []
        try:
            with self._lock:
                for addr, size in buffers:
                    if size <= 0 or self._covered(addr, size):
                        continue
                    entry = self._adhoc.get(addr)
                    if entry is not None:
                        if entry[0] >= size:
                            entry[1] += 1
                            taken.append(addr)
                        continue  # (a larger buffer at a registered address: used as it is)
                    check("register_buffer", int(self._store.register_buffer(addr, size)))
                    self._adhoc[addr] = [size, 1]
                    taken.append(addr)
            yield
        finally:
            with self._lock:
                for addr in taken:
                    entry = self._adhoc.get(addr)
                    if entry is None:
                        continue
                    entry[1] -= 1
                    if entry[1] <= 0:
                        del self._adhoc[addr]
                        self._store.unregister_buffer(addr)

    # ---- operations (blocking) -------------------------------------------------------------------
    def is_exist(self, key: str) -> int:
        """1 present, 0 absent; raises for an error (the probe of recovery)."""
        return check("is_exist", int(self._store.is_exist(key)))

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        """1 present, 0 absent per key; raises when any answer is an error (never "absent")."""
        out = [int(r) for r in self._store.batch_is_exist(keys)]
        for r in out:
            if r < 0:
                # -1 is the batch call's generic error: the answer is unknown, not "absent".
                check("batch_is_exist", r if r != INTERNAL_ERROR else RPC_FAIL)
        return out

    def put_parts(self, keys: list[str], ptrs: list[list[int]], sizes: list[list[int]]) -> list[int]:
        """Publish each key from its buffers (concatenated); status per key (0 also when the
        key was already present: nothing is copied then)."""
        return [int(r) for r in self._store.batch_put_from_multi_buffers(keys, ptrs, sizes, self._config)]

    def put_with_header(self, key: str, head_ptr: int, head_len: int, ptr: int, size: int) -> int:
        """Publish ``key`` as the ``head_len`` bytes at ``head_ptr`` followed by the ``size``
        bytes at ``ptr`` (``size`` > 0: the wheel stores nothing for an empty payload and
        answers 0); one status (0 also when the key was already present).

        ``put_from_with_metadata`` takes the single-object request path of ``put_from`` (one
        put-start and one put-end at the master), cheaper than a batch of one. Unlike every
        other call it answers a failure with the status negated (no space as 200); that is
        turned back into the usual negative status here."""
        if size <= 0:
            raise ValueError(f"size must be > 0, got {size}")
        rc = int(self._store.put_from_with_metadata(key, ptr, head_ptr, size, head_len, self._config))
        return -rc if rc > 0 else rc

    def session_start(self, keys: list[str]) -> list[int]:
        """Look up every key's replicas once (0, or a status such as :data:`NOT_FOUND`)."""
        return [int(r) for r in self._store.batch_get_session_start(keys)]

    def read_ranges(
        self, keys: list[str], ptrs: list[list[int]], sizes: list[list[int]], offsets: list[list[int]]
    ) -> list[int]:
        """Read byte ranges of objects of an open session; bytes read (or a status) per key."""
        return [int(r) for r in self._store.batch_get_into_multi_buffer_ranges(keys, ptrs, sizes, offsets)]

    def session_end(self, keys: list[str]) -> None:
        """Drop the replica metadata cached by :meth:`session_start`."""
        self._store.batch_get_session_end(keys)

    def size(self, key: str) -> int:
        """The object's size in bytes, or a status such as :data:`NOT_FOUND`."""
        return int(self._store.get_size(key))

    def remove(self, key: str) -> int:
        """Forced removal (leases of recent readers do not block it): 0, or a status."""
        return int(self._store.remove(key, True))

    def remove_matching(self, pattern: str) -> int:
        """Forced removal of every key matching the regular expression; how many."""
        return check("remove_by_regex", int(self._store.remove_by_regex(pattern, True)))

    def close(self) -> None:
        """Close the client; idempotent. Calls still running in other threads must be over."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        with contextlib.suppress(Exception):
            self._store.close()


_NOTHING_TO_REGISTER = contextlib.nullcontext()


def mooncake_settings(ctx: BackendContext, url: str) -> MooncakeSettings:
    """The client settings from ``url`` and the ``mooncake_*`` keys (``ValueError`` naming a bad one)."""
    parsed = parse_remote_url(url)
    if parsed.kind != "mooncake":
        raise ValueError(f"remote_url {url!r} is not a mooncake:// URL")
    host, port = parsed.hosts[0]
    cfg = ctx.config
    metadata = cfg.mooncake_metadata_server or f"http://{_host_text(host)}:{DEFAULT_METADATA_PORT}/metadata"
    protocol = cfg.mooncake_protocol.strip().lower()
    if protocol not in ("tcp", "rdma"):
        raise ValueError(f"mooncake_protocol must be tcp or rdma, got {cfg.mooncake_protocol!r}")
    if not cfg.mooncake_local_hostname.strip():
        raise ValueError("mooncake_local_hostname must not be empty")
    return MooncakeSettings(
        master=f"{_host_text(host)}:{port}",
        metadata_server=metadata,
        protocol=protocol,
        device_name=cfg.mooncake_device_name,
        local_hostname=cfg.mooncake_local_hostname.strip(),
        local_buffer_size=gib_to_bytes(cfg.mooncake_local_buffer_size),
        global_segment_size=gib_to_bytes(cfg.mooncake_global_segment_size),
        replica_num=cfg.mooncake_replica_num,
    )


def _host_text(host: str) -> str:
    return f"[{host}]" if ":" in host else host

"""NIXL plumbing for the ``nixl`` tier: the lazy import, the tier's settings and a small,
thread-safe wrapper around one NIXL agent.

NIXL is an optional dependency (``pip install 'lmcache-async[nixl]'``). It is imported only
when the tier is configured: :func:`load_nixl` tries ``nixl._api`` (the ``nixl`` meta package),
then ``nixl_cu12._api`` and ``nixl_cu13._api``, and raises
:class:`~lmcache_async.errors.BackendUnavailableError` naming the extra when none imports.

:class:`NixlAgent` owns one agent with one storage plugin. Its methods block and are meant for
worker threads: on this kind of host a POSIX ``transfer`` copies the bytes inside the post call
itself (the page cache completes the I/O synchronously), so even "posting" a 64 MiB write is
milliseconds of work that must stay off the event loop. The agent runs in NIXL's strict
thread-sync mode so several worker threads may use it at once.
"""

from __future__ import annotations

import importlib
import itertools
import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any

from lmcache_async.errors import BackendUnavailableError, ConfigError
from lmcache_async.memory import GiB, MiB, gib_to_bytes

if TYPE_CHECKING:
    from lmcache_async.config import LMCacheEngineConfig

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "FILE_PLUGINS",
    "HEADER_SCRATCH_BYTES",
    "INSTALL_HINT",
    "OBJECT_PLUGINS",
    "SUPPORTED_PLUGINS",
    "NixlAgent",
    "NixlSettings",
    "NixlStuckError",
    "NixlTransferError",
    "default_workers",
    "load_nixl",
    "nixl_available",
    "park",
    "parked_count",
]

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'lmcache-async[nixl]'"
"""What to install when NIXL is missing (the ``nixl`` extra pulls ``nixl-cu12``)."""

_API_MODULES = ("nixl._api", "nixl_cu12._api", "nixl_cu13._api")

FILE_PLUGINS = ("POSIX", "GDS", "GDS_MT")
"""Plugins that move bytes between memory and files (``FILE`` segments)."""
OBJECT_PLUGINS = ("OBJ",)
"""Plugins that move bytes between memory and objects of an S3-compatible store."""
SUPPORTED_PLUGINS = FILE_PLUGINS + OBJECT_PLUGINS

DEFAULT_CHUNK_BYTES = 2 * MiB
"""Payloads are moved in pieces of this size so each piece is checksummed while it is in the
CPU cache (measured best among 1-8 MiB on the reference host; see docs/nixl.md)."""


def default_workers() -> int:
    """Worker threads of the tier: 2 where at least 4 CPUs are usable (one can checksum while
    the other transfers), else 1. Measured on a 2-CPU host: a second worker only contends with
    the event loop and the caller there (1 MiB batched reads 0.42-0.63 x a bare transfer with
    two workers, 0.58-0.69 x with one; 64 MiB unchanged)."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        n = os.cpu_count() or 1
    return 2 if n >= 4 else 1


HEADER_SCRATCH_BYTES = 128 * 1024
"""Registered room for one record header (a header is at most ~66 KiB: 64 KiB key + shape)."""

_lock = threading.Lock()
_api: ModuleType | None = None


def load_nixl() -> ModuleType:
    """The NIXL Python API module (``nixl_agent``, ``nixl_agent_config``, ...).

    Raises :class:`BackendUnavailableError` naming the extra to install when NIXL is absent.
    The NIXL logger is quietened to warnings unless ``NIXL_LOG_LEVEL`` is set (NIXL prints
    INFO lines to stdout otherwise).
    """
    global _api
    if _api is not None:
        return _api
    with _lock:
        if _api is not None:
            return _api
        os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
        errors: list[str] = []
        for name in _API_MODULES:
            try:
                mod = importlib.import_module(name)
            except ImportError as exc:
                errors.append(f"{name}: {exc}")
                continue
            if hasattr(mod, "nixl_agent") and hasattr(mod, "nixl_agent_config"):
                _api = mod
                return mod
            errors.append(f"{name}: no nixl_agent")
        raise BackendUnavailableError(
            "the nixl tier is configured (nixl_path is set) but NIXL is not installed; "
            f"install it with: {INSTALL_HINT}  (tried {'; '.join(errors)})"
        )


def nixl_available() -> bool:
    """True when :func:`load_nixl` succeeds."""
    try:
        load_nixl()
    except BackendUnavailableError:
        return False
    return True


# ---- settings --------------------------------------------------------------------------------
@dataclass(frozen=True)
class NixlSettings:
    """The ``nixl_*`` configuration keys, resolved and checked.

    ``plugin`` is the NIXL plugin (``POSIX`` default; ``GDS``/``GDS_MT`` on GPU hosts; ``OBJ``
    for S3-compatible stores). ``path`` is the directory of file-backed storage, or for ``OBJ``
    the object-name prefix. ``pool_size`` > 0 pre-creates that many slot files (each holds one
    entry, registered once); 0 writes one file per entry. ``params`` go to the plugin as they are.
    """

    plugin: str
    path: str
    pool_size: int = 0
    max_bytes: int = 16 * GiB
    params: Mapping[str, str] = field(default_factory=dict)
    policy: str = "LRU"
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    workers: int = field(default_factory=default_workers)

    def __post_init__(self) -> None:
        if self.plugin not in SUPPORTED_PLUGINS:
            raise ConfigError(
                f"nixl_backend={self.plugin!r} is not supported; use one of {', '.join(SUPPORTED_PLUGINS)}"
            )
        if not isinstance(self.path, str) or not self.path:
            raise ConfigError(f"nixl_path must be a non-empty path, got {self.path!r}")
        if not isinstance(self.pool_size, int) or self.pool_size < 0:
            raise ConfigError(f"nixl_pool_size must be an int >= 0, got {self.pool_size!r}")
        if self.pool_size and self.is_object_store:
            raise ConfigError(
                f"nixl_pool_size={self.pool_size} applies to file-backed plugins "
                f"({', '.join(FILE_PLUGINS)}); set it to 0 with nixl_backend='OBJ'"
            )
        if self.max_bytes < 0:
            raise ConfigError(f"nixl_max_size must be >= 0, got {self.max_bytes / GiB!r} GiB")
        for k, v in self.params.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise ConfigError(f"nixl_backend_params must map str to str, got {k!r}: {v!r}")
        if self.is_object_store and not (self.params.get("bucket") or os.environ.get("AWS_DEFAULT_BUCKET")):
            raise ConfigError(
                "nixl_backend='OBJ' needs a bucket: set nixl_backend_params: {bucket: <name>} "
                "(or the AWS_DEFAULT_BUCKET environment variable)"
            )
        if self.policy not in ("LRU", "FIFO"):
            raise ConfigError(f"cache_policy must be 'LRU' or 'FIFO', got {self.policy!r}")
        if self.chunk_bytes <= 0 or self.chunk_bytes % 4096:
            raise ConfigError(f"chunk size must be a positive multiple of 4096, got {self.chunk_bytes}")
        if self.workers < 1:
            raise ConfigError(f"workers must be >= 1, got {self.workers}")

    @property
    def is_object_store(self) -> bool:
        """True for plugins whose storage is objects, not files."""
        return self.plugin in OBJECT_PLUGINS

    @classmethod
    def from_config(cls, config: LMCacheEngineConfig) -> NixlSettings:
        """Settings from an engine config. ``nixl_backends`` (LMCache's list spelling) sets
        the plugin when ``nixl_backend`` itself was left at its default."""
        plugin = config.nixl_backend
        if config.nixl_backends and not config.is_set("nixl_backend"):
            plugin = str(config.nixl_backends[0]).strip().upper()
        if not config.nixl_path:
            raise ConfigError("nixl_path must be set to enable the nixl tier")
        return cls(
            plugin=plugin,
            path=config.nixl_path,
            pool_size=config.nixl_pool_size,
            max_bytes=gib_to_bytes(config.nixl_max_size),
            params=dict(config.nixl_backend_params or {}),
            policy=config.cache_policy,
        )


# ---- the agent -------------------------------------------------------------------------------
class NixlTransferError(RuntimeError):
    """A NIXL call or transfer failed (the entry is treated as a miss/failed write)."""


class NixlStuckError(NixlTransferError):
    """A request NIXL could neither finish nor abort: it may still move bytes later.

    Whoever catches it must never reuse the memory or the storage target of that request
    (read destinations, scratch areas, open file descriptors): they are kept aside for the
    life of the process instead (:func:`park`).
    """


_parked: list[object] = []
_parked_lock = threading.Lock()


def park(*things: object) -> None:
    """Keep ``things`` alive for the life of the process (memory or handles a stuck request
    may still use; see :class:`NixlStuckError`). Thread-safe."""
    with _parked_lock:
        _parked.extend(things)


def parked_count() -> int:
    """How many objects :func:`park` holds (for diagnostics and tests)."""
    with _parked_lock:
        return len(_parked)


class NixlAgent:
    """One NIXL agent with one storage plugin; every method is thread-safe and blocking.

    Memory handed to :meth:`transfer` must lie in a region registered with
    :meth:`register_dram`; storage targets (file descriptors, object names) are registered with
    :meth:`register_target` and released with :meth:`deregister`.
    """

    _names = itertools.count()

    def __init__(self, name: str, plugin: str, params: Mapping[str, str] | None = None) -> None:
        api = load_nixl()
        self.plugin = plugin
        self.name = f"{name}-{os.getpid()}-{next(self._names)}"
        sync = api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
        conf = api.nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=[], sync_mode=sync)
        try:
            self._agent: Any = api.nixl_agent(self.name, conf)
        except Exception as exc:
            raise BackendUnavailableError(f"NIXL agent could not start: {exc}") from exc
        available = list(self._agent.get_plugin_list())
        if plugin not in available:
            raise BackendUnavailableError(
                f"NIXL plugin {plugin!r} (nixl_backend) is not available; available: {available}"
            )
        try:
            self._agent.create_backend(plugin, dict(params or {}))
        except Exception as exc:
            hint = " (GDS needs a GPU host with cuFile)" if plugin.startswith("GDS") else ""
            raise BackendUnavailableError(
                f"NIXL plugin {plugin!r} (nixl_backend) could not be created with parameters "
                f"{sorted((params or {}).keys())}: {type(exc).__name__}: {exc}{hint}"
            ) from exc
        self.mem_types = list(self._agent.get_backend_mem_types(plugin))
        self.target_seg = "OBJ" if plugin in OBJECT_PLUGINS else "FILE"
        self._dev_ids = itertools.count(1)
        self._closed = False
        self._stuck = 0
        self._stuck_lock = threading.Lock()

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._closed

    @property
    def stuck(self) -> int:
        """How many requests ended in :class:`NixlStuckError` (they may still be running)."""
        return self._stuck

    # ---- registration ------------------------------------------------------------------------
    def register_dram(self, ptr: int, nbytes: int) -> Any:
        """Register host memory ``[ptr, ptr + nbytes)`` once; returns a handle for deregister."""
        return self._agent.register_memory([(ptr, nbytes, 0, "")], "DRAM", backends=[self.plugin])

    def register_target(self, fd: int | None = None, object_name: str | None = None) -> tuple[int, Any]:
        """Register one storage target: a file descriptor (file plugins) or an object name
        (OBJ). Returns ``(dev_id, handle)``; descriptors address the target by ``dev_id``."""
        if self.target_seg == "FILE":
            if fd is None:
                raise ValueError("fd is required for file-backed plugins")
            dev = fd
            desc = (0, 0, fd, "")
        else:
            if not object_name:
                raise ValueError("object_name is required for the OBJ plugin")
            dev = next(self._dev_ids)
            desc = (0, 0, dev, object_name)
        try:
            handle = self._agent.register_memory([desc], self.target_seg, backends=[self.plugin])
        except Exception as exc:
            raise NixlTransferError(f"registering a {self.target_seg} target failed: {exc}") from exc
        return dev, handle

    def deregister(self, handle: Any) -> None:
        """Deregister memory or a target (errors are logged, never raised)."""
        try:
            self._agent.deregister_memory(handle, backends=[self.plugin])
        except Exception:
            logger.debug("NIXL deregistration failed", exc_info=True)

    # ---- transfers -----------------------------------------------------------------------------
    def transfer(
        self,
        op: str,
        local: Sequence[tuple[int, int]],
        remote: Sequence[tuple[int, int, int]],
        deadline_s: float = 300.0,
    ) -> None:
        """Move bytes: ``op`` is ``"WRITE"`` (memory -> storage) or ``"READ"``.

        ``local`` lists ``(address, length)`` in registered memory, ``remote`` the matching
        ``(offset, length, dev_id)`` on registered targets. Posts, then polls with back-off
        until the request is done; the handle is always released. Raises
        :class:`NixlTransferError` on any failure. A request still running at ``deadline_s`` is
        aborted. When releasing the handle fails (NIXL could not abort the request), the
        memory and the targets may still be used by it: that raises :class:`NixlStuckError`,
        and the caller must never reuse them.
        """
        if self._closed:
            raise NixlTransferError("the NIXL agent is closed")
        agent = self._agent
        try:
            ld = agent.get_xfer_descs([(a, n, 0) for a, n in local], "DRAM")
            rd = agent.get_xfer_descs(list(remote), self.target_seg)
            handle = agent.initialize_xfer(op, ld, rd, self.name, backends=[self.plugin])
        except Exception as exc:
            raise NixlTransferError(f"NIXL {op} could not be prepared: {exc}") from exc
        state = "ERR"
        try:
            state = agent.transfer(handle)
            if state == "PROC":
                state = self._wait(handle, deadline_s)
        except NixlTransferError:
            raise
        except Exception as exc:
            state = "ERR"
            raise NixlTransferError(f"NIXL {op} failed: {exc}") from exc
        finally:
            try:
                handle.release()
            except Exception as exc:
                # Only a request NIXL could not abort lands here: it may still move bytes.
                with self._stuck_lock:
                    self._stuck += 1
                raise NixlStuckError(f"NIXL {op} stuck: the request could not be released: {exc}") from exc
        if state != "DONE":
            raise NixlTransferError(f"NIXL {op} ended in state {state}")

    def _wait(self, handle: Any, deadline_s: float) -> str:
        agent = self._agent
        delay = 0.0
        end = time.monotonic() + deadline_s
        while True:
            state: str = agent.check_xfer_state(handle)
            if state != "PROC":
                return state
            if time.monotonic() > end:
                raise NixlTransferError(f"NIXL transfer still running after {deadline_s}s")
            # Back-off: yield first, then sleep 20 us doubling up to 1 ms.
            time.sleep(delay)
            delay = min(max(delay * 2, 20e-6), 1e-3)

    def close(self) -> None:
        """Drop the agent (registrations go with it). Idempotent.

        After a stuck request the agent is parked instead (:func:`park`): destroying it could
        free state that request still uses, and its registrations must stay valid.
        """
        if self._closed:
            return
        self._closed = True
        if self._stuck:
            logger.warning(
                "NIXL agent %s had %d stuck request(s); it is kept alive for the life of the process",
                self.name,
                self._stuck,
            )
            park(self._agent)
        self._agent = None

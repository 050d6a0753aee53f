"""The connector interface of the remote tier and the registry that picks one by URL scheme.

A connector moves whole records (see :mod:`lmcache_async.records`) between memory objects and
one kind of store. The :class:`~lmcache_async.remote.RemoteBackend` names entries
(:mod:`.naming`) and hands them to its connector; the connector owns its connections and is
responsible for leaving them usable after any error or cancellation.

Contract (every connector):

* coroutines run on the owning manager's loop and never block it;
* ``put`` publishes atomically: a reader never sees a partial entry as a hit; a key already
  present is left as it is (``True``);
* ``get`` reads into a buffer from ``alloc``, verifies the record (magic, version, header
  checksum, key equality, sizes, payload checksum) and releases the buffer on every failure
  path, including cancellation;
* a corrupt record is a miss (counted, removed); a record holding another key is a miss
  (counted; kept by Redis and S3, removed by ``fs://``); a record sealed under another key, or
  sealed while the connector has no cipher, or plain while it has one, is a miss that stays
  (``foreign_key``), and a sealed record whose tag fails is corrupt; a store that cannot be
  reached raises (the manager counts it and opens its circuit breaker), and the connector
  reconnects by itself once the store is back.

Registry: built-in schemes map to ``"module:attr"`` factories imported on first use;
:func:`register_connector` adds or replaces one.
"""

from __future__ import annotations

import concurrent.futures
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lmcache_async.errors import BackendUnavailableError
from lmcache_async.lazy_registry import LazyRegistry
from lmcache_async.memory import MemoryObj
from lmcache_async.tiers import Allocate

from .naming import EntryName
from .url import redact

if TYPE_CHECKING:
    from lmcache_async.encryption import RecordCipher

__all__ = [
    "Connector",
    "ConnectorFactory",
    "ConnectorSettings",
    "S3Settings",
    "known_schemes",
    "make_connector",
    "register_connector",
]


@dataclass(frozen=True)
class S3Settings:
    """The ``s3_*`` configuration keys (None: the ``AWS_*`` variables, then the defaults)."""

    endpoint: str | None = None
    region: str | None = None
    access_key_id: str | None = field(default=None, repr=False)
    secret_access_key: str | None = field(default=None, repr=False)
    allow_http: bool = False
    max_concurrency: int = 16


@dataclass(frozen=True)
class ConnectorSettings:
    """What a connector takes from the configuration besides its URL."""

    timeout_s: float
    """Bound on one network operation (``remote_timeout_s``)."""
    part_size: int
    """Payloads above this many bytes are stored in parts (``remote_part_size``)."""
    ttl_s: float | None
    """Expiry of entries, or None (``remote_ttl_s``)."""
    executor: concurrent.futures.Executor | None = None
    """Where blocking file operations run (the manager's executor)."""
    cipher: RecordCipher | None = field(default=None, repr=False)
    """Seals records written and opens records read (``encryption_key_file``); None: plain
    records only (sealed ones are foreign). Connectors that cannot seal refuse a cipher."""
    s3: S3Settings = field(default_factory=S3Settings)
    """The ``s3_*`` keys (``s3://`` URLs only)."""


class Connector(ABC):
    """Moves records between memory objects and one store. See the module docstring."""

    #: The URL scheme this instance was built for (set by the factory).
    scheme: str = ""

    @property
    def shared(self) -> bool:
        """Entries are visible to every process that uses the same URL and prefix."""
        return True

    @property
    def persistent(self) -> bool:
        """Entries outlive the process that wrote them."""
        return True

    @property
    def seals(self) -> bool:
        """Writes sealed records and opens them when built with a cipher
        (``ConnectorSettings.cipher``); a connector that cannot is never given one."""
        return False

    async def start(self) -> None:
        """Connect eagerly (optional); a failure is reported but the connector retries later."""

    @abstractmethod
    async def put(self, name: EntryName, obj: MemoryObj) -> bool:
        """Publish ``obj``'s record under ``name``; True when stored or already present."""

    @abstractmethod
    async def get(self, name: EntryName, alloc: Allocate) -> MemoryObj | None:
        """The verified entry (caller owns one reference) or None."""

    @abstractmethod
    async def exists(self, names: Sequence[EntryName]) -> list[bool]:
        """Presence of each entry, in one round trip where the store allows."""

    @abstractmethod
    async def remove(self, name: EntryName) -> bool:
        """Delete the entry; True when something was removed."""

    @abstractmethod
    async def clear(self, prefix: str) -> None:
        """Delete every entry below namespace ``prefix``."""

    async def close(self) -> None:
        """Release connections and files; idempotent."""

    def exists_nowait(self, name: EntryName) -> bool | None:
        """Presence without waiting on I/O, or None when it cannot be answered that way."""
        return None

    def stats(self) -> dict[str, Any]:
        """Counters (round trips, corrupt records, reconnects, ...)."""
        return {}


ConnectorFactory = Callable[[str, ConnectorSettings], Connector]
"""Builds a connector for a URL (``ValueError`` for a malformed one)."""

_BUILTIN = "lmcache_async.remote"
_TIER_SCHEMES = frozenset({"mooncake"})
"""Schemes served by a tier of their own rather than a connector: ``mooncake://`` is the Mooncake
Store tier (:mod:`.mooncake`), which the remote tier's factory builds instead of a connector."""


def _unknown_scheme(scheme: str, known: list[str]) -> Exception:
    if scheme in _TIER_SCHEMES:
        return ValueError(f"{scheme}:// URLs are served by their own tier, not by a connector")
    return ValueError(f"remote_url scheme {scheme!r} is not supported (known: {', '.join(known_schemes())})")


def _unimportable(scheme: str, exc: ImportError) -> Exception:
    extra = "s3" if scheme == "s3" else "redis"
    return BackendUnavailableError(
        f"the {scheme}:// connector cannot be imported ({exc}); install lmcache-async[{extra}] for {scheme}:// URLs"
    )


_registry: LazyRegistry[ConnectorFactory] = LazyRegistry(
    "connector",
    {
        "redis": f"{_BUILTIN}.redis_conn:create",
        "rediss": f"{_BUILTIN}.redis_conn:create",
        "valkey": f"{_BUILTIN}.redis_conn:create",
        "valkeys": f"{_BUILTIN}.redis_conn:create",
        "unix": f"{_BUILTIN}.redis_conn:create",
        "redis+cluster": f"{_BUILTIN}.cluster:create",
        "rediss+cluster": f"{_BUILTIN}.cluster:create",
        "valkey+cluster": f"{_BUILTIN}.cluster:create",
        "valkeys+cluster": f"{_BUILTIN}.cluster:create",
        "fs": f"{_BUILTIN}.fs:create",
        "s3": f"{_BUILTIN}.s3:create",
    },
    normalize=str.lower,
    unknown=_unknown_scheme,
    import_failed=_unimportable,
)


def register_connector(scheme: str, factory: ConnectorFactory | str, *, replace: bool = False) -> None:
    """Make ``scheme://`` URLs use ``factory`` (a callable or a ``"module:attr"`` path imported on
    first use); schemes are case-insensitive. ValueError for a scheme that is not bare or (unless
    ``replace``) already taken, TypeError for a factory that is neither callable nor a str."""
    if not isinstance(scheme, str) or not scheme or "://" in scheme:
        raise ValueError(f"scheme must be a bare URL scheme such as 'redis', got {scheme!r}")
    if not (callable(factory) or isinstance(factory, str)):
        raise TypeError("factory must be callable or a 'module:attr' string")
    _registry.register(scheme, factory, replace=replace)


def known_schemes() -> list[str]:
    """Schemes a ``remote_url`` may use: every registered connector's, and those served by a
    tier of their own (``mooncake``)."""
    return sorted(set(_registry.names()) | _TIER_SCHEMES)


def make_connector(url: str, settings: ConnectorSettings) -> Connector:
    """The connector for ``url`` (``ValueError`` for an unknown scheme or a malformed URL)."""
    if not isinstance(url, str):
        raise TypeError(f"remote_url must be a str, got {type(url).__name__}")
    scheme, sep, _ = url.strip().partition("://")
    if not sep:
        raise ValueError(f"remote_url {redact(url)!r} is not a URL (expected scheme://...)")
    conn = _registry.get(scheme.lower())(url.strip(), settings)
    conn.scheme = scheme.lower()
    return conn

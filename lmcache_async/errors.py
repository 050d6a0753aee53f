"""Named exceptions.

Caller mistakes raise :class:`ValueError`/:class:`TypeError` (or subclasses); misuse of a
manager's threading contract raises a :class:`RuntimeError` subclass at once. Storage trouble
never raises out of the public API: it is a miss/False plus a counter.
"""

from __future__ import annotations

__all__ = [
    "BackendUnavailableError",
    "ConfigError",
    "DoubleReleaseError",
    "ForkedProcessError",
    "LMCacheAsyncError",
    "LoopThreadCallError",
    "ManagerClosedError",
    "MisuseError",
    "PoolSizeError",
]


class LMCacheAsyncError(Exception):
    """Base class of every exception this package defines."""


class ConfigError(LMCacheAsyncError, ValueError):
    """An invalid configuration value; the message names key, value and source."""


class MisuseError(LMCacheAsyncError, RuntimeError):
    """Base class for calls that break the threading/lifecycle contract."""


class LoopThreadCallError(MisuseError):
    """A blocking (``*_sync``) call was made on the manager's own loop thread (it would deadlock)."""


class ManagerClosedError(MisuseError):
    """The manager (or engine) was closed; no new work is accepted."""


class ForkedProcessError(MisuseError):
    """The object was created in a parent process; it cannot be used after ``fork()``."""


class DoubleReleaseError(LMCacheAsyncError, RuntimeError):
    """A :class:`~lmcache_async.memory.MemoryObj` reference was released more times than taken."""


class PoolSizeError(ConfigError):
    """A requested pool does not fit into the memory available on this machine."""


class BackendUnavailableError(LMCacheAsyncError, RuntimeError):
    """A configured backend cannot be built (missing optional dependency, bad URL scheme)."""

"""Hooks and fixtures shared by the backend conformance classes.

A backend's test class implements :meth:`BackendHooks.make_backend`; a backend whose medium
can be read directly (a directory of record files, a dict) also implements
:meth:`BackendHooks.medium_keys` and :meth:`BackendHooks.medium_bytes`, so the suite checks
what is really stored, not only what the backend under test reports.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from lmcache_async.memory import PoolAllocator
from lmcache_async.tiers import BackendContext, StorageBackend

__all__ = ["BackendHooks", "MediumHooks", "flush_backend", "start_backend"]


async def start_backend(backend: StorageBackend) -> StorageBackend:
    """Run the backend's ``start()`` hook (a no-op unless the tier declares one; the manager
    does the same before use)."""
    await backend.start()
    return backend


async def flush_backend(backend: StorageBackend) -> None:
    """Run the backend's ``flush()`` hook: after it, every accepted put is on the medium."""
    await backend.flush()


class MediumHooks:
    """The optional hooks that read a tier's medium directly (shared by the backend and the
    manager conformance classes; :class:`~lmcache_async.testing.media.RecordDirectoryMedium`
    implements them for record-file tiers)."""

    def medium_keys(self, backend: StorageBackend, location: Path) -> set[str] | None:
        """The key strings (``CacheEngineKey.to_string()``) of every entry the medium holds,
        read from the medium itself (files, server, dict), not through ``backend``.

        None (the default, not overridden) means the medium cannot be read directly: the medium
        checks are not collected for that class.
        Called on the test's thread after ``flush()``, with no backend call in flight.
        """
        return None

    def medium_bytes(self, backend: StorageBackend, location: Path, key: str) -> bytes | None:
        """The payload stored for key string ``key``, read from the medium itself; None when the
        medium holds no entry for it. Only called when :meth:`medium_keys` is not None."""
        return None

    def medium_items(self, backend: StorageBackend, location: Path) -> dict[str, bytes] | None:
        """Every entry on the medium: key string to payload (None: not readable directly).
        Built from the two hooks above; override it when one pass over the medium is cheaper."""
        keys = self.medium_keys(backend, location)
        if keys is None:
            return None
        items = {k: self.medium_bytes(backend, location, k) for k in keys}
        missing = sorted(k for k, v in items.items() if v is None)
        assert not missing, f"medium_keys lists entries medium_bytes cannot read: {missing}"
        return {k: v for k, v in items.items() if v is not None}


class BackendHooks(MediumHooks, abc.ABC):
    """What a backend's test class provides, and the fixtures built from it."""

    #: Bytes of the test pool the suite allocates source objects from.
    pool_bytes: int = 64 << 20

    @abc.abstractmethod
    async def make_backend(self, ctx: BackendContext, location: Path) -> StorageBackend:
        """Build the backend under test. ``location`` is a fresh directory per test (per
        Hypothesis example in the state machine); the suite runs ``start()`` when present."""

    # ---- fixtures ----------------------------------------------------------------------------
    @pytest.fixture
    def location(self, tmp_path: Path) -> Path:
        d = tmp_path / "store"
        d.mkdir()
        return d

    @pytest.fixture
    async def src_pool(self) -> PoolAllocator:
        return PoolAllocator(self.pool_bytes, name="conformance-src", pretouch=False)

    @pytest.fixture
    async def backend(
        self, backend_context: Callable[[], BackendContext], location: Path
    ) -> AsyncIterator[StorageBackend]:
        be = await start_backend(await self.make_backend(backend_context(), location))
        yield be
        await be.close()

    async def reopen(self, backend: StorageBackend, ctx: BackendContext, location: Path) -> StorageBackend:
        """Close ``backend`` and build (and start) a new one on the same location."""
        await backend.close()
        return await start_backend(await self.make_backend(ctx, location))

"""Test support shipped with the package: the backend and manager conformance suites, the
in-memory reference backend, medium hooks for record-file tiers, and their fixtures.

The names below are imported on first use, so the server helpers of this package
(``lmcache_async.testing.servers``, ``.cache_server``) import without pytest: the benchmark
suite uses them from an install without the test extra. The conformance suites need pytest.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lmcache_async.testing.conformance import BackendConformanceTests, PersistentBackendConformanceTests
    from lmcache_async.testing.hooks import BackendHooks
    from lmcache_async.testing.media import RecordDirectoryMedium
    from lmcache_async.testing.memory_backend import InMemoryBackend
    from lmcache_async.testing.objects import make_key, make_obj, same_entry

_WHERE = {
    "BackendConformanceTests": "conformance",
    "PersistentBackendConformanceTests": "conformance",
    "BackendHooks": "hooks",
    "RecordDirectoryMedium": "media",
    "InMemoryBackend": "memory_backend",
    "make_key": "objects",
    "make_obj": "objects",
    "same_entry": "objects",
}

__all__ = [
    "BackendConformanceTests",
    "BackendHooks",
    "InMemoryBackend",
    "PersistentBackendConformanceTests",
    "RecordDirectoryMedium",
    "make_key",
    "make_obj",
    "same_entry",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value

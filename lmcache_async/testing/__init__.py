"""Test support shipped with the package: the backend and manager conformance suites, the
in-memory reference backend, medium hooks for record-file tiers, and their fixtures."""

from lmcache_async.testing.conformance import BackendConformanceTests, PersistentBackendConformanceTests
from lmcache_async.testing.hooks import BackendHooks
from lmcache_async.testing.media import RecordDirectoryMedium
from lmcache_async.testing.memory_backend import InMemoryBackend
from lmcache_async.testing.objects import make_key, make_obj, same_entry

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

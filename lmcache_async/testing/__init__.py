"""Test support shipped with the package: the backend conformance suite and its fixtures."""

from lmcache_async.testing.conformance import (
    BackendConformanceTests,
    PersistentBackendConformanceTests,
    make_key,
    make_obj,
)

__all__ = ["BackendConformanceTests", "PersistentBackendConformanceTests", "make_key", "make_obj"]

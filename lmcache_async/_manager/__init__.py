"""The StorageManager's internals (private): its put and read paths, tier guards, staging,
statistics and lifecycle.

Nothing here is public API; :mod:`lmcache_async.storage_manager` is the entry point.
"""

__all__: list[str] = []

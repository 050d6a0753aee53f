"""Built-in storage tiers, installed as ``lmcache_async.backends``.

Each module exposes ``create(ctx) -> StorageBackend | None``; the core builds them by name
through :mod:`lmcache_async.tiers`'s registry and never imports them directly.
"""

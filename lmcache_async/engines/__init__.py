"""The engines: the KV-cache engine (:mod:`.kv`), the hidden-state store (:mod:`.hidden_states`) and
the encoder cache (:mod:`.encoder_cache`), each over one :class:`~lmcache_async.StorageManager`.

The names are imported lazily from :mod:`lmcache_async` (``lmcache_async.LMCacheEngine`` ...).
"""

__all__: list[str] = []

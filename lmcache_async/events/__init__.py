"""KV events in vLLM's format, so cache-aware routers see what every tier holds.

* :mod:`~lmcache_async.events.wire`: vLLM's event types (``KVEventBatch`` of ``BlockStored`` /
  ``BlockRemoved`` / ``AllBlocksCleared``), msgpack codec, mediums and ownership;
* :mod:`~lmcache_async.events.chunks`: whole chunks only, parent first (:class:`ChunkAdvertiser`);
* :mod:`~lmcache_async.events.publisher`: ZMQ PUB with replay and snapshots, never blocking;
* :mod:`~lmcache_async.events.subscriber`: a reader that recovers through replay or snapshot;
* :mod:`~lmcache_async.events.describe`: telling the node server what its entries hold.

Needs ``pyzmq`` and ``msgspec`` (``pip install 'lmcache-async[events]'``), except
:mod:`~lmcache_async.events.chunks`, which is pure Python. See docs/routing.md.
"""

from lmcache_async.events.chunks import Changes, Chunk, ChunkAdvertiser

__all__ = ["Changes", "Chunk", "ChunkAdvertiser"]

"""The node cache server (``lmcache-async serve``) and its client.

One server process per node owns a shared-memory pool per namespace (model); every process
on the node (schedulers, workers, encoder producers and consumers) reaches it through the
client tier ``server`` (``cache_server_socket``). See ``docs/server.md``.
"""

from lmcache_async.server.client import ServerClient, query_status
from lmcache_async.server.server import CacheServer, run_server
from lmcache_async.server.views import EntryView

__all__ = ["CacheServer", "EntryView", "ServerClient", "query_status", "run_server"]

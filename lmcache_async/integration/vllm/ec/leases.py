"""Promise leases for the encoder-cache connector.

:class:`PromiseLeases` is what the connector needs of a lease kind
(:class:`lmcache_async.tiers.PromiseLeases`). The leases themselves are capabilities of the tiers
(:class:`~lmcache_async.tiers.Leasing`): the disk tier's hard-linked records
(:mod:`lmcache_async.disk.leases`) and the node server's holds
(:mod:`lmcache_async.server.leases`), reached through
:meth:`StorageManager.leases <lmcache_async.storage_manager.StorageManager.leases>`.
The older names of this module (``LeaseDir``, ``read_record``, ...) still resolve, with a
``DeprecationWarning``, for one release.
"""

from __future__ import annotations

from lmcache_async.deprecation import moved_names
from lmcache_async.tiers import PromiseLeases

__all__ = ["PromiseLeases"]

_MOVED = ("LeaseDir", "read_record", "LEASE_DIR_NAME", "LEASE_SUFFIX", "DEFAULT_MAX_AGE_S")

__getattr__ = moved_names(
    __name__,
    dict.fromkeys(_MOVED, "lmcache_async.disk.leases"),
    " (the disk tier's leases; reach them through StorageManager.leases)",
)

"""The disk tier: one record file per entry under a directory.

:mod:`.tier` is the tier (:mod:`.executor_jobs`: awaiting its executor jobs); :mod:`.store` its
file operations on the executor, with :mod:`.store_state` (index, counters, write stop) and
:mod:`.store_removal` (deletion, eviction, repair); :mod:`.budget` the size budget,
:mod:`.layout` the directory layout, :mod:`.leases` the promise leases, :mod:`.tools` the
offline inspection and repair commands.
"""

__all__: list[str] = []

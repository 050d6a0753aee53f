"""The disk tier: one record file per entry under a directory.

:mod:`.tier` is the tier; :mod:`.store` its file operations on the executor, :mod:`.budget` the
size budget and eviction, :mod:`.layout` the directory layout, :mod:`.leases` the promise leases,
:mod:`.tools` the offline inspection and repair commands.
"""

__all__: list[str] = []

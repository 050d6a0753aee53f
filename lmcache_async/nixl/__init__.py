"""The NIXL tier: records in registered files or memory, moved by a NIXL agent.

:mod:`.tier` is the tier; :mod:`.agent` wraps the NIXL agent, :mod:`.index` the record index,
:mod:`.io`, :mod:`.jobs`, :mod:`.transfer` and :mod:`.work` the transfers.
"""

__all__: list[str] = []

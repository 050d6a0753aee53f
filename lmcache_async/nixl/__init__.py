"""The NIXL tier: records in registered files or memory, moved by a NIXL agent.

:mod:`.tier` is the tier, with :mod:`.resources` (what it holds and its release) and
:mod:`.removals` (eviction, storage release); :mod:`.agent` wraps the NIXL agent, :mod:`.index`
the record index, :mod:`.io` the storage layouts (:mod:`.open_files`: kept record files),
:mod:`.jobs`, :mod:`.transfer` and :mod:`.work` the transfers.
"""

__all__: list[str] = []

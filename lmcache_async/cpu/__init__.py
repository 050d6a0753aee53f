"""The CPU tier: an LRU (or FIFO) index over the manager's memory pool (:mod:`.tier`)."""

__all__: list[str] = []

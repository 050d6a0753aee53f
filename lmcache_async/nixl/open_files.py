"""Record files the ``nixl`` tier's per-key layout keeps open and registered between operations.

:class:`OpenFiles` is a small LRU cache of :class:`OpenFile` (a descriptor plus its NIXL target
registration) used by :class:`~lmcache_async.nixl.io.KeyFileLayout`, so an operation soon after
another on the same record skips ``open``, registration, deregistration and ``close``. Any
thread (worker threads of the tier); a file taken for an operation is never closed under it.
"""

from __future__ import annotations

import collections
import os
import threading
from dataclasses import dataclass

from lmcache_async.nixl.agent import NixlAgent, park

__all__ = ["OPEN_FILES", "OpenFile", "OpenFiles"]


@dataclass(frozen=True)
class OpenFile:
    """A record file opened and registered with the agent as a NIXL target."""

    fd: int
    handle: object
    dev: int
    writable: bool


OPEN_FILES = 256
"""How many record files :class:`OpenFiles` keeps open and registered, at most."""


class OpenFiles:
    """Record files kept open and registered between operations, least recently used first
    out, so reading a record soon after it was written or read skips ``open``, registration,
    deregistration and ``close`` (≈ 15 µs here).

    A file is *taken* for an operation (out of the cache, so nothing else closes it under the
    operation) and *given back* afterwards under its (possibly new) name. Any thread; the
    lock covers the bookkeeping only, descriptors are closed outside it.
    """

    def __init__(self, agent: NixlAgent, cap: int = OPEN_FILES) -> None:
        self._agent = agent
        self._cap = cap
        self._lock = threading.Lock()
        self._files: collections.OrderedDict[str, OpenFile] = collections.OrderedDict()
        self._taken: set[str] = set()
        self._dropped: set[str] = set()

    def __len__(self) -> int:
        return len(self._files)

    def take(self, name: str) -> OpenFile | None:
        """The open file of record ``name``, now owned by the caller; None when not kept."""
        with self._lock:
            f = self._files.pop(name, None)
            if f is not None:
                self._taken.add(name)
            return f

    def give_back(self, name: str, f: OpenFile, taken_as: str | None = None) -> None:
        """Keep ``f`` as record ``name``'s open file (``taken_as``: the name it was taken
        under, when it was). Closes it instead when ``taken_as`` was dropped meanwhile, and
        closes the least recently used files beyond the cap."""
        out: list[OpenFile] = []
        with self._lock:
            if taken_as is not None:
                self._taken.discard(taken_as)
                if taken_as in self._dropped:
                    self._dropped.discard(taken_as)
                    out.append(f)
            if not out:
                self._files[name] = f
                while len(self._files) > self._cap:
                    out.append(self._files.popitem(last=False)[1])
        for old in out:
            self._close(old)

    def drop(self, name: str) -> None:
        """Record ``name`` is going away: close its kept file (or, when an operation has it
        taken, have :meth:`give_back` close it)."""
        with self._lock:
            f = self._files.pop(name, None)
            if f is None and name in self._taken:
                self._dropped.add(name)
        if f is not None:
            self._close(f)

    def release(self, f: OpenFile, taken_as: str | None = None) -> None:
        """Deregister and close ``f`` (owned by the caller; ``taken_as``: the name it was
        taken under, when it was)."""
        if taken_as is not None:
            with self._lock:
                self._taken.discard(taken_as)
                self._dropped.discard(taken_as)
        self._close(f)

    def settle(self, name: str, f: OpenFile, taken_as: str | None, ok: bool, stuck: bool) -> None:
        """After an operation on ``f``: keep it as ``name``'s file when it went well, park it
        after a stuck request (never closed: the request may still use it, and a closed
        descriptor's number would soon name another file), else close it."""
        if stuck:
            park(f.fd, f.handle)
        elif ok:
            self.give_back(name, f, taken_as)
        else:
            self.release(f, taken_as)

    def close(self) -> None:
        with self._lock:
            files = list(self._files.values())
            self._files.clear()
        for f in files:
            self._close(f)

    def _close(self, f: OpenFile) -> None:
        _release_target(self._agent, f.fd, f.handle, stuck=False)


def _release_target(agent: NixlAgent, fd: int, handle: object | None, stuck: bool) -> None:
    """Deregister and close a per-operation file target; after a stuck request, park both."""
    if stuck:
        park(fd, handle)
        return
    if handle is not None:
        agent.deregister(handle)
    os.close(fd)

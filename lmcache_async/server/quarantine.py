"""Quarantined grant blocks: pool blocks whose writer may still be copying into them.

One job: when the node cache server closes a connection whose process lives on, the blocks that
connection was granted cannot go back to the pool (a late copy would land in another entry); they
are parked here, with a pidfd watching the writer's process, until that process has exited.
A process that cannot be watched keeps its blocks reserved for the pool's lifetime. Loop thread
only; nothing blocks (the pidfd is polled with a zero timeout).
"""

from __future__ import annotations

import logging
import os
import select
from dataclasses import dataclass

from lmcache_async.memory import MemoryObj

__all__ = ["Quarantine", "discard", "quarantine", "sweep"]

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Quarantine:
    """Blocks of grants whose writer may still be copying into them: the server closed its
    connection while its process (``pidfd``; -1 when it cannot be watched) lives on."""

    pidfd: int
    blocks: list[MemoryObj]


def quarantine(pid: int, blocks: list[MemoryObj]) -> Quarantine | None:
    """Park ``blocks`` until process ``pid`` exits (``pid <= 0``, or a process that cannot be
    watched: for good, with a warning); None when the process is already gone, and the blocks
    were released here (nobody can write into them any more)."""
    pidfd = -1
    if pid > 0:
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:  # already gone: nobody can write there any more
            for obj in blocks:
                obj.ref_count_down()
            return None
        except OSError as exc:
            logger.warning("cache server: cannot watch process %d (%s); its grants stay reserved", pid, exc)
    return Quarantine(pidfd, blocks)


def sweep(parked: list[Quarantine]) -> list[Quarantine]:
    """Release the blocks of every entry of ``parked`` whose process has exited (closing its
    pidfd); the entries still waiting."""
    keep: list[Quarantine] = []
    for q in parked:
        if q.pidfd >= 0 and select.select([q.pidfd], [], [], 0)[0]:
            os.close(q.pidfd)
            for obj in q.blocks:
                obj.ref_count_down()
        else:
            keep.append(q)
    return keep


def discard(q: Quarantine) -> None:
    """Stop watching ``q``'s process and release its blocks (the pool itself is going away)."""
    if q.pidfd >= 0:
        os.close(q.pidfd)
    for obj in q.blocks:
        obj.ref_count_down()

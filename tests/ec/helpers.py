"""Constants and markers shared by the encoder-cache tests."""

from __future__ import annotations

import importlib.util

import pytest

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

HAS_DISK_TIER = importlib.util.find_spec("lmcache_async.disk.tier") is not None
needs_disk = pytest.mark.skipif(not HAS_DISK_TIER, reason="the disk tier (backends/disk.py) is not in this tree yet")


def gib(nbytes: int) -> float:
    """A size in bytes as the GiB float config keys take."""
    return nbytes / GiB

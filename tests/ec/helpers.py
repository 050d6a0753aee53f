"""Constants and markers shared by the encoder-cache tests."""

from __future__ import annotations

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30


def gib(nbytes: int) -> float:
    """A size in bytes as the GiB float config keys take."""
    return nbytes / GiB

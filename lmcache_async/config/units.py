"""Byte counts as people read them, in binary units: the one formatter the configuration's
findings and the ``lmcache-async`` command (``status``, ``keys``, ``serve``, the demo) share."""

from __future__ import annotations

__all__ = ["human_bytes"]

_UNITS = ("B", "KiB", "MiB", "GiB")


def human_bytes(n: object) -> str:
    """``n`` bytes in binary units: whole bytes below 1 KiB (``512 B``), else one decimal in the
    largest of KiB, MiB, GiB that keeps the figure at least 1 (``2.0 MiB``, ``1.5 GiB``; GiB is
    the largest: ``2048.0 GiB``). ``?`` for anything that is not a number (``bool`` included)."""
    if isinstance(n, bool) or not isinstance(n, int | float):
        return "?"
    v = float(n)
    for unit in _UNITS:
        if abs(v) < 1024 or unit == _UNITS[-1]:
            return f"{int(v)} B" if unit == "B" else f"{v:.1f} {unit}"
        v /= 1024
    raise AssertionError("unreachable")  # pragma: no cover

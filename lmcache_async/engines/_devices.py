"""The device an engine copies a result to, checked before anything is looked up.

A retrieve or get names the device of its result. A device that cannot hold a tensor on this
machine (a CUDA device without CUDA, an index past the last device, ``meta``, a misspelt type)
is a caller mistake: it raises one ``ValueError`` naming the argument, on a hit and on a miss
alike, instead of a torch error deep in the copy of a hit.
"""

from __future__ import annotations

import threading

import torch

CPU = torch.device("cpu")

_usable: set[torch.device] = {CPU}
_lock = threading.Lock()


def _first_line(exc: BaseException) -> str:
    """The first line of a torch error, bounded (some list every dispatch key)."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]


def check_device(device: object, name: str = "device") -> torch.device:
    """``device`` as a ``torch.device`` that can hold a tensor on this machine.

    Accepted: a ``torch.device``, a device string (``"cpu"``, ``"cuda:0"``) or a CUDA index.
    ``TypeError`` naming ``name`` for any other type; ``ValueError`` naming ``name`` for a string
    torch does not parse, the ``meta`` device (it holds no data) and a device this machine does
    not have. A device found usable is remembered, so a hot path pays one set lookup. Any thread.
    """
    if type(device) is str and device == "cpu":
        return CPU
    if isinstance(device, torch.device):
        dev = device
    elif isinstance(device, (str, int)) and not isinstance(device, bool):
        try:
            dev = torch.device(device)
        except (RuntimeError, ValueError) as exc:
            raise ValueError(f"{name} {device!r} is not a valid torch device: {_first_line(exc)}") from None
    else:
        raise TypeError(f"{name} must be a str or torch.device, got {type(device).__name__}")
    if dev in _usable:
        return dev
    if dev.type == "meta":
        raise ValueError(f"{name} must not be the meta device (a result there would hold no data)")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{name} {device!r} is not available: this machine has no usable CUDA device")
    try:
        torch.empty(0, device=dev)  # raises for a backend that is not built in or an index past the last
    except Exception as exc:  # torch reports this in many ways (RuntimeError, AssertionError, ImportError)
        raise ValueError(f"{name} {device!r} is not available on this machine: {_first_line(exc)}") from None
    with _lock:
        _usable.add(dev)
    return dev

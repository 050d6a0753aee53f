"""What a tensor must be for the cache to store it, checked once at every API boundary.

Every public entry point that takes a tensor to store (``StorageManager.put``, the KV engine's
``store``, the hidden-state store, the encoder-cache engine's ``put``) calls
:func:`check_storable_tensor` first, so a caller mistake is one ``TypeError``/``ValueError`` that
names the argument instead of a failure deep in a copy or a record writer — or, worse, an entry
the CPU tier accepts and no lower tier can ever write down (it would be lost on eviction).
"""

from __future__ import annotations

import torch

from lmcache_async.dtypes import DTYPE_TO_CODE
from lmcache_async.records import MAX_RANK

__all__ = ["check_storable_layout", "check_storable_tensor"]

_CODES = DTYPE_TO_CODE
_STRIDED = torch.strided


def check_storable_layout(dtype: torch.dtype, rank: int, name: str) -> None:
    """Refuse a dtype or a rank the record format (disk, fs://, remote, NIXL) cannot carry.

    ``TypeError`` naming ``name`` for a dtype without a record code (the sub-byte ``int1``..
    ``int7``/``uint1``..``uint7`` shells, quantized dtypes, anything newer than the code table);
    ``ValueError`` naming ``name`` for more than ``MAX_RANK`` dimensions. Any thread.
    """
    if dtype not in DTYPE_TO_CODE:
        raise TypeError(
            f"{name} has dtype {dtype}, which the cache cannot store (no record code; "
            "see docs/formats.md for the dtypes it can)"
        )
    if rank > MAX_RANK:
        raise ValueError(f"{name} has {rank} dimensions; the cache stores at most {MAX_RANK}")


def check_storable_tensor(tensor: object, name: str) -> torch.Tensor:
    """``tensor`` itself when the cache can store it; ``TypeError``/``ValueError`` naming ``name`` otherwise.

    ``TypeError`` for anything that is not a ``torch.Tensor``; for quantized, sparse (any sparse
    layout), nested and meta tensors (they have no dense bytes to copy); and for a dtype the
    record format has no code for (see :func:`check_storable_layout`). ``ValueError`` for more
    than ``MAX_RANK`` (32) dimensions. Any thread; no copy is made.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    # Every put pays for these checks: the dtype test comes first because it also rules out
    # quantized tensors (quantized dtypes have no record code), which saves a query.
    if tensor.dtype not in _CODES and tensor.is_quantized:
        raise TypeError(f"{name} must not be a quantized tensor ({tensor.dtype}); dequantize it first")
    layout = tensor.layout
    if layout is not _STRIDED:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {layout}")
    if tensor.is_nested:
        raise TypeError(f"{name} must not be a nested tensor")
    if tensor.is_meta:
        raise TypeError(f"{name} must not be a meta tensor (it holds no data)")
    check_storable_layout(tensor.dtype, tensor.dim(), name)
    return tensor

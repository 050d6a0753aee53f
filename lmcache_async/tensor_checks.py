"""What a tensor must be for the cache to store it, checked once at every API boundary.

Every public entry point that takes a tensor to store (``StorageManager.put``, the KV engine's
``store``, the hidden-state store, the encoder-cache engine's ``put``) calls
:func:`check_storable_tensor` first, so a caller mistake is one ``TypeError`` that names the
argument instead of a failure deep in a copy or a record writer.
"""

from __future__ import annotations

import torch


def check_storable_tensor(tensor: object, name: str) -> torch.Tensor:
    """``tensor`` itself when the cache can store it; ``TypeError`` naming ``name`` otherwise.

    Refused: anything that is not a ``torch.Tensor``; quantized, sparse (any sparse layout),
    nested and meta tensors (they have no dense bytes to copy). Any thread; no copy is made.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.is_quantized:
        raise TypeError(f"{name} must not be a quantized tensor ({tensor.dtype}); dequantize it first")
    if tensor.layout is not torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {tensor.layout}")
    if tensor.is_nested:
        raise TypeError(f"{name} must not be a nested tensor")
    if tensor.is_meta:
        raise TypeError(f"{name} must not be a meta tensor (it holds no data)")
    return tensor

"""Dtype tables: LMCache's string names (used in key strings) and stable numeric codes
(used in stored records). Both tables are append-only: a code is never reused."""

from __future__ import annotations

import torch

__all__ = [
    "CODE_TO_DTYPE",
    "DTYPE_TO_CODE",
    "DTYPE_TO_NAME",
    "NAME_TO_DTYPE",
    "dtype_code",
    "dtype_name",
    "is_storable_dtype",
    "parse_dtype",
]

# Name used in CacheEngineKey strings; identical to LMCache's names.
_NAMES: list[tuple[torch.dtype, str]] = [
    (torch.float16, "half"),
    (torch.bfloat16, "bfloat16"),
    (torch.float32, "float"),
    (torch.float64, "double"),
    (torch.int8, "int8"),
    (torch.uint8, "uint8"),
    (torch.int16, "int16"),
    (torch.int32, "int32"),
    (torch.int64, "int64"),
    (torch.bool, "bool"),
]
for _attr, _name in (
    ("float8_e4m3fn", "fp8_e4m3fn"),
    ("float8_e4m3fnuz", "fp8_e4m3fnuz"),
    ("float8_e5m2", "fp8_e5m2"),
    ("float8_e5m2fnuz", "fp8_e5m2fnuz"),
):
    if hasattr(torch, _attr):
        _NAMES.append((getattr(torch, _attr), _name))

DTYPE_TO_NAME: dict[torch.dtype, str] = dict(_NAMES)
NAME_TO_DTYPE: dict[str, torch.dtype] = {n: d for d, n in _NAMES}
# Accept the usual spellings too when parsing user input (config, CLI).
_ALIASES = {
    "float16": torch.float16,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float64": torch.float64,
    "auto": torch.bfloat16,
}

# Numeric codes for records on disk / remote / NIXL. Never renumber.
_CODES: list[tuple[int, str]] = [
    (1, "float16"),
    (2, "bfloat16"),
    (3, "float32"),
    (4, "float64"),
    (5, "int8"),
    (6, "uint8"),
    (7, "int16"),
    (8, "int32"),
    (9, "int64"),
    (10, "bool"),
    (11, "float8_e4m3fn"),
    (12, "float8_e4m3fnuz"),
    (13, "float8_e5m2"),
    (14, "float8_e5m2fnuz"),
    (15, "uint16"),
    (16, "uint32"),
    (17, "uint64"),
    (18, "complex64"),
    (19, "complex128"),
    # Dtypes whose bytes the pool copies and the records carry as they are (checked for each
    # in tests/core/test_storable_dtypes.py). Sub-byte shells (int1..int7, uint1..uint7) have
    # no copy kernel and quantized dtypes no plain bytes: they get no code and are refused.
    (20, "complex32"),
    (21, "float8_e8m0fnu"),
    (22, "float4_e2m1fn_x2"),
    (23, "bits1x8"),
    (24, "bits2x4"),
    (25, "bits4x2"),
    (26, "bits8"),
    (27, "bits16"),
]
DTYPE_TO_CODE: dict[torch.dtype, int] = {}
CODE_TO_DTYPE: dict[int, torch.dtype] = {}
for _code, _attr in _CODES:
    _dt = getattr(torch, _attr, None)
    if isinstance(_dt, torch.dtype):
        DTYPE_TO_CODE[_dt] = _code
        CODE_TO_DTYPE[_code] = _dt


def dtype_name(dtype: torch.dtype) -> str:
    """LMCache's key-string name of ``dtype``; ``ValueError`` for dtypes keys cannot carry."""
    try:
        return DTYPE_TO_NAME[dtype]
    except (KeyError, TypeError):
        raise ValueError(f"dtype {dtype!r} cannot be used in a cache key") from None


def parse_dtype(value: object) -> torch.dtype:
    """Turn a ``torch.dtype`` or a name (``"bfloat16"``, ``"half"``, ``"torch.float32"``) into a dtype.

    Raises ``ValueError`` naming the value when it is not a known dtype.
    """
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        name = value.strip().lower().removeprefix("torch.")
        if name in NAME_TO_DTYPE:
            return NAME_TO_DTYPE[name]
        if name in _ALIASES:
            return _ALIASES[name]
        attr = getattr(torch, name, None)
        if isinstance(attr, torch.dtype):
            return attr
    raise ValueError(f"unknown dtype {value!r}")


def is_storable_dtype(dtype: object) -> bool:
    """True when records (disk, fs://, remote, NIXL) can carry entries of ``dtype``."""
    return dtype in DTYPE_TO_CODE


def dtype_code(dtype: torch.dtype) -> int:
    """Stable record code of ``dtype``; ``ValueError`` if it cannot be stored."""
    try:
        return DTYPE_TO_CODE[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype!r} cannot be stored") from None

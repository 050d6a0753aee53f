"""Stage payloads as one self-describing uint8 record, without pickle.

A stage payload is whatever an Omni stage hands the next one: a tensor, bytes, or a tree of
dicts/lists/tuples holding tensors, numpy arrays, bytes and plain scalars. Tensors and
``bytes``-like objects put with :meth:`~lmcache_async.integration.omni.OmniStageStore.put` are
stored as themselves (no record); everything else becomes one record::

    0   4   magic b"LOSP"
    4   1   version (1)
    5   1   codec: 0 = bytes, 1 = tree (ours), 2 = Omni's msgpack serializer
    6   2   reserved (0)
    8   4   skeleton length S (u32, little-endian)
    12  4   segment count N (u32)
    16  16N segment table: (offset u64, length u64) from the record's start
    ..  S   skeleton: UTF-8 JSON
    ..      segments, each starting on a 64-byte boundary

The tree codec keeps tensor bytes raw: the skeleton is JSON in which a tensor is
``{"$t": [segment, dtype, shape]}``, a numpy array ``{"$nd": [segment, dtype.str, shape]}``,
``bytes`` ``{"$b": segment}``, a tuple ``{"$tuple": [...]}`` and a dict whose keys are not all
strings (or one starts with ``$``) ``{"$d": [[key, value], ...]}``. Encoding copies each tensor
once, straight from its device into the record; decoding copies each tensor once into a fresh
tensor the caller owns (from the ``empty`` allocator a reader passes, else ``torch.empty``).
Copies between contiguous CPU buffers are single-threaded ``memmove`` calls
(:func:`~lmcache_async.memory.copy_payload`). A reader trusts nothing it has not checked: a bad magic, version, codec,
table entry or skeleton is :class:`CorruptPayload`.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lmcache_async.dtypes import DTYPE_TO_NAME, NAME_TO_DTYPE
from lmcache_async.memory import copy_payload

__all__ = [
    "CODEC_BYTES",
    "CODEC_OMNI",
    "CODEC_TREE",
    "CorruptPayload",
    "EmptyTensor",
    "EncodedPayload",
    "decode_record",
    "encode_record",
]

MAGIC = b"LOSP"
VERSION = 1
CODEC_BYTES = 0
CODEC_TREE = 1
CODEC_OMNI = 2
ALIGN = 64
_HEAD = struct.Struct("<4sBBHII")
_SEG = struct.Struct("<QQ")
MAX_DEPTH = 64
"""Nesting deeper than this is refused (encode: ``TypeError``; decode: corrupt)."""

EmptyTensor = Callable[[list[int], torch.dtype], torch.Tensor]
"""Where a decoded tensor goes: ``(shape, dtype)`` -> an uninitialised contiguous CPU tensor the
caller will own."""

OmniCodec = tuple[Callable[[Any], bytes], Callable[[memoryview], Any]]
"""Omni's serializer as ``(serialize, deserialize)``
(see :func:`~lmcache_async.integration.omni.options.omni_serializer`)."""


class CorruptPayload(ValueError):
    """A stored record that does not decode (wrong magic/version, bad table or skeleton)."""


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass
class EncodedPayload:
    """A record planned but not yet written: :meth:`write_into` fills a buffer of ``nbytes``."""

    codec: int
    skeleton: bytes
    segments: list[torch.Tensor | bytes | memoryview]
    offsets: list[int]
    nbytes: int

    def write_into(self, buf: torch.Tensor) -> None:
        """Write the record into ``buf`` (contiguous CPU uint8 of at least ``nbytes``); each
        tensor is copied once, from whatever device it lives on."""
        head = bytearray(_HEAD.pack(MAGIC, VERSION, self.codec, 0, len(self.skeleton), len(self.segments)))
        for seg, off in zip(self.segments, self.offsets, strict=True):
            head += _SEG.pack(off, _seg_len(seg))
        head += self.skeleton
        mv = buf.numpy().data  # a CPU uint8 view: bytes go in without another copy
        mv[: len(head)] = head
        for seg, off in zip(self.segments, self.offsets, strict=True):
            n = _seg_len(seg)
            if not n:
                continue
            if isinstance(seg, torch.Tensor):
                copy_payload(buf[off : off + n].view(seg.dtype).view(seg.shape), seg)
            else:
                mv[off : off + n] = seg


def _seg_len(seg: torch.Tensor | bytes | memoryview) -> int:
    if isinstance(seg, torch.Tensor):
        return seg.numel() * seg.element_size()
    return len(seg)


class _Encoder:
    def __init__(self) -> None:
        self.segments: list[torch.Tensor | bytes | memoryview] = []

    def seg(self, s: torch.Tensor | bytes | memoryview) -> int:
        self.segments.append(s)
        return len(self.segments) - 1

    def walk(self, obj: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise TypeError(f"data nests deeper than {MAX_DEPTH} levels")
        if obj is None or isinstance(obj, (bool, int, float, str)):
            return obj
        if isinstance(obj, torch.Tensor):
            if obj.dtype not in DTYPE_TO_NAME or obj.layout is not torch.strided or obj.is_quantized:
                raise TypeError(f"data holds a tensor the tree codec cannot carry ({obj.dtype}, {obj.layout})")
            t = obj.detach()
            return {"$t": [self.seg(t), DTYPE_TO_NAME[t.dtype], list(t.shape)]}
        if isinstance(obj, (bytes, bytearray, memoryview)):
            mv = memoryview(obj).cast("B") if isinstance(obj, memoryview) else bytes(obj)
            return {"$b": self.seg(mv)}
        if isinstance(obj, tuple):
            return {"$tuple": [self.walk(v, depth + 1) for v in obj]}
        if isinstance(obj, list):
            return [self.walk(v, depth + 1) for v in obj]
        if isinstance(obj, dict):
            if all(isinstance(k, str) and not k.startswith("$") for k in obj):
                return {k: self.walk(v, depth + 1) for k, v in obj.items()}
            return {"$d": [[self.walk(k, depth + 1), self.walk(v, depth + 1)] for k, v in obj.items()]}
        nd = _numpy_array(obj)
        if nd is not None:
            if nd.dtype.kind in "OV":
                raise TypeError(f"data holds a numpy array of dtype {nd.dtype} (object/void)")
            arr = nd if nd.flags.c_contiguous else nd.copy(order="C")
            return {"$nd": [self.seg(memoryview(arr).cast("B")), arr.dtype.str, list(arr.shape)]}
        raise TypeError(f"data holds a {type(obj).__name__}, which the tree codec cannot carry")


def _numpy_array(obj: Any) -> Any:
    mod = type(obj).__module__
    if mod != "numpy":
        return None
    import numpy as np

    return obj if isinstance(obj, np.ndarray) else None


def _plan(codec: int, skeleton: bytes, segments: list[torch.Tensor | bytes | memoryview]) -> EncodedPayload:
    pos = _align(_HEAD.size + _SEG.size * len(segments) + len(skeleton))
    offsets = []
    for s in segments:
        offsets.append(pos)
        pos = _align(pos + _seg_len(s))
    return EncodedPayload(codec, skeleton, segments, offsets, max(pos, 1))


def encode_record(data: Any, omni: OmniCodec | None = None, prefer_omni: bool = False) -> EncodedPayload:
    """Plan the record of ``data``: ``bytes``-like data as codec 0, otherwise the tree codec,
    falling back to Omni's serializer (``omni``) for types the tree codec cannot carry (or
    using it first when ``prefer_omni``). ``TypeError`` naming ``data`` when nothing can encode
    it; nothing is written until :meth:`EncodedPayload.write_into`."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        mv = memoryview(data).cast("B") if isinstance(data, memoryview) else data
        return _plan(CODEC_BYTES, b"", [mv if isinstance(mv, memoryview) else bytes(mv)])
    if prefer_omni and omni is not None:
        return _plan(CODEC_OMNI, b"", [omni[0](data)])
    enc = _Encoder()
    try:
        skel = enc.walk(data, 0)
        text = json.dumps(skel, separators=(",", ":"), allow_nan=True).encode("utf-8")
    except (TypeError, ValueError, RecursionError) as exc:
        if omni is None:
            raise TypeError(f"data cannot be encoded without pickle: {exc}") from None
        try:
            blob = omni[0](data)
        except Exception as exc2:  # Omni's serializer raises what its encoder hook raises
            raise TypeError(f"data cannot be encoded without pickle: {exc}; Omni's serializer: {exc2}") from None
        return _plan(CODEC_OMNI, b"", [blob])
    return _plan(CODEC_TREE, text, enc.segments)


class _Decoder:
    def __init__(self, buf: torch.Tensor, table: list[tuple[int, int]], empty: EmptyTensor) -> None:
        self.buf = buf
        self.table = table
        self.empty = empty

    def span(self, idx: object) -> torch.Tensor:
        if not isinstance(idx, int) or isinstance(idx, bool) or not 0 <= idx < len(self.table):
            raise CorruptPayload(f"segment reference {idx!r} out of range")
        off, n = self.table[idx]
        return self.buf[off : off + n]

    def tensor(self, spec: object) -> torch.Tensor:
        if not (isinstance(spec, list) and len(spec) == 3 and isinstance(spec[2], list)):
            raise CorruptPayload("bad tensor entry")
        raw = self.span(spec[0])
        dtype = NAME_TO_DTYPE.get(spec[1]) if isinstance(spec[1], str) else None
        shape = spec[2]
        if dtype is None or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise CorruptPayload(f"bad tensor dtype/shape {spec[1]!r} {shape!r}")
        n = dtype.itemsize
        for d in shape:
            n *= d
        if n != raw.numel():
            raise CorruptPayload(f"tensor of {n} bytes in a segment of {raw.numel()}")
        if n == 0:
            return torch.empty(shape, dtype=dtype)
        out = self.empty(shape, dtype)
        copy_payload(out.view(-1).view(torch.uint8), raw)
        return out

    def ndarray(self, spec: object) -> Any:
        import numpy as np

        if not (isinstance(spec, list) and len(spec) == 3 and isinstance(spec[1], str) and isinstance(spec[2], list)):
            raise CorruptPayload("bad ndarray entry")
        raw = self.span(spec[0])
        try:
            dt = np.dtype(spec[1])
        except TypeError:
            raise CorruptPayload(f"bad ndarray dtype {spec[1]!r}") from None
        if dt.kind in "OV":
            raise CorruptPayload(f"ndarray dtype {dt} refused")
        shape = spec[2]
        if not all(isinstance(d, int) and d >= 0 for d in shape):
            raise CorruptPayload(f"bad ndarray shape {shape!r}")
        n = dt.itemsize
        for d in shape:
            n *= d
        if n != raw.numel():
            raise CorruptPayload(f"ndarray of {n} bytes in a segment of {raw.numel()}")
        return np.frombuffer(raw.numpy().tobytes(), dtype=dt).reshape(shape)

    def walk(self, node: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise CorruptPayload("skeleton nests too deeply")
        if isinstance(node, list):
            return [self.walk(v, depth + 1) for v in node]
        if not isinstance(node, dict):
            return node
        if len(node) == 1:
            ((tag, val),) = node.items()
            if tag == "$t":
                return self.tensor(val)
            if tag == "$b":
                return self.span(val).numpy().tobytes()
            if tag == "$tuple" and isinstance(val, list):
                return tuple(self.walk(v, depth + 1) for v in val)
            if tag == "$nd":
                return self.ndarray(val)
            if tag == "$d" and isinstance(val, list):
                out: dict[Any, Any] = {}
                for pair in val:
                    if not (isinstance(pair, list) and len(pair) == 2):
                        raise CorruptPayload("bad dict entry")
                    k = self.walk(pair[0], depth + 1)
                    try:
                        out[k] = self.walk(pair[1], depth + 1)
                    except TypeError:  # an unhashable key
                        raise CorruptPayload("unhashable dict key") from None
                return out
        if any(k.startswith("$") for k in node):
            raise CorruptPayload(f"unknown skeleton tag in {sorted(node)[:3]}")
        return {k: self.walk(v, depth + 1) for k, v in node.items()}


def _torch_empty(shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


def decode_record(buf: torch.Tensor, omni: OmniCodec | None = None, empty: EmptyTensor | None = None) -> Any:
    """Decode the record in ``buf`` (CPU uint8, 1-D): tensors and bytes come back as fresh
    objects the caller owns (``buf`` may be released right after); tensors are allocated by
    ``empty`` (default ``torch.empty``). :class:`CorruptPayload` for anything that does not
    check out, including an Omni-serialized record when ``omni`` is None."""
    total = buf.numel()
    if buf.dtype != torch.uint8 or buf.dim() != 1 or total < _HEAD.size:
        raise CorruptPayload("not a stage payload record")
    head = buf[: _HEAD.size].numpy().tobytes()
    magic, version, codec, _reserved, slen, nseg = _HEAD.unpack(head)
    if magic != MAGIC or version != VERSION:
        raise CorruptPayload(f"bad magic/version {magic!r}/{version}")
    table_end = _HEAD.size + _SEG.size * nseg
    if nseg > total or table_end + slen > total:
        raise CorruptPayload("header larger than the record")
    raw = buf[_HEAD.size : table_end + slen].numpy().tobytes()
    table = [_SEG.unpack_from(raw, i * _SEG.size) for i in range(nseg)]
    for off, n in table:
        if off < table_end + slen or off + n > total:
            raise CorruptPayload(f"segment ({off}, {n}) outside the record")
    dec = _Decoder(buf, table, empty or _torch_empty)
    if codec == CODEC_BYTES:
        if nseg != 1:
            raise CorruptPayload("bytes record without exactly one segment")
        return dec.span(0).numpy().tobytes()
    if codec == CODEC_OMNI:
        if nseg != 1:
            raise CorruptPayload("Omni record without exactly one segment")
        if omni is None:
            raise CorruptPayload("an Omni-serialized record, and Omni's serializer is not importable here")
        blob = dec.span(0).numpy().tobytes()
        try:
            return omni[1](memoryview(blob))
        except Exception as exc:  # msgpack errors of any kind
            raise CorruptPayload(f"Omni's serializer refused the record: {exc}") from None
    if codec != CODEC_TREE:
        raise CorruptPayload(f"unknown codec {codec}")
    try:
        skel = json.loads(raw[table_end - _HEAD.size :].decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CorruptPayload(f"bad skeleton: {exc}") from None
    return dec.walk(skel, 0)

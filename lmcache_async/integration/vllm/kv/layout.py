"""Paged KV-cache layouts and the whole-block gather/scatter between vLLM's caches and records.

vLLM keeps one paged cache tensor per attention layer. Two layouts are handled:

* ``cpu`` (vLLM's CPU attention backend): ``[num_blocks, kv_heads, block_size, 2 * head_size]``.
  The kernel reads a block as ``[kv_heads, 2 * block_size, head_size]`` (the block's K rows,
  then its V rows), so row ``t`` of a block is **not** token ``t``: only whole blocks can be
  copied without knowing the kernel's internal order. The block axis is 0.
* ``flash_attn`` (CUDA flash-attention): ``[2, num_blocks, block_size, kv_heads, head_size]``.
  The block axis is 1.

A record holds one chunk (``blocks_per_chunk`` consecutive blocks of one request) for every
layer: ``[num_layers, *layer_shape with the block axis sized blocks_per_chunk]``. Whatever the
layout, record layer ``l`` is ``cache_l.index_select(block_axis, block_ids)`` and a load is the
inverse ``cache_l.index_copy_(block_axis, block_ids, record[l])``: the bytes of a block move
unchanged, so the layout never has to be decoded.

On host caches (:attr:`PagedCaches.host_blocks`) every block of a layer is one run of memory:
the gather and scatter of one record are one ``memmove`` per run of consecutive blocks (no
torch call, no OpenMP team: safe on any thread), also when :func:`gather_records` fills all of a
step's records; :func:`gather_records_at` fills records given by address and, for records a pool
laid out one after another, uses one ``index_select`` per layer instead (torch's intra-op
threads: the model-runner thread only); and :meth:`PagedCaches.read_sink` describes a chunk's
blocks as the pieces of a :class:`~lmcache_async.read_sinks.ReadSink`, so a record is read from
a tier straight into them.

On CUDA the record lives in host memory (pinned when the pool is): :func:`gather_blocks` gathers
on the device into a staging tensor and copies it to the host on the given stream; the caller
synchronises that stream before it publishes the record. :func:`scatter_blocks` copies the
record to a device staging tensor and scatters it there, on the given stream.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lmcache_async.read_sinks import ReadSink, coalesce

__all__ = [
    "CPU_LAYOUT",
    "FLASH_ATTN_LAYOUT",
    "BlockLayout",
    "PagedCaches",
    "check_chunk_alignment",
    "gather_blocks",
    "gather_records",
    "gather_records_at",
    "scatter_blocks",
]

_memmove = ctypes.memmove


@dataclass(frozen=True)
class BlockLayout:
    """Where the block axis of a layer's paged cache is and how many dims the tensor has."""

    name: str
    block_axis: int
    ndim: int
    block_size_axis: int
    """Axis of ``block_size`` (checked against vLLM's block size)."""

    def num_blocks(self, cache: torch.Tensor) -> int:
        """Blocks in ``cache`` (its size along the block axis)."""
        return int(cache.shape[self.block_axis])

    def record_layer_shape(self, cache: torch.Tensor, blocks_per_chunk: int) -> tuple[int, ...]:
        """Shape of one layer's part of a chunk record for a cache shaped like ``cache``."""
        shape = list(cache.shape)
        shape[self.block_axis] = blocks_per_chunk
        return tuple(shape)


CPU_LAYOUT = BlockLayout("cpu", block_axis=0, ndim=4, block_size_axis=2)
"""vLLM's CPU attention cache ``[num_blocks, kv_heads, block_size, 2 * head_size]``."""

FLASH_ATTN_LAYOUT = BlockLayout("flash_attn", block_axis=1, ndim=5, block_size_axis=2)
"""CUDA flash-attention cache ``[2, num_blocks, block_size, kv_heads, head_size]``."""


def check_chunk_alignment(chunk_size: int, block_size: int) -> int:
    """Blocks per chunk; ``ValueError`` naming ``chunk_size`` unless it is a positive multiple
    of vLLM's ``block_size`` (only whole blocks can be copied, see the module docstring)."""
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if chunk_size % block_size:
        raise ValueError(
            f"chunk_size ({chunk_size}) must be a multiple of vLLM's KV block size ({block_size}): "
            "the connector copies whole blocks only (on CPU a block's rows are not tokens); "
            f"set chunk_size to {max(1, round(chunk_size / block_size)) * block_size} or another multiple"
        )
    return chunk_size // block_size


def _layout_of(name: str, cache: torch.Tensor, block_size: int, layout: BlockLayout | None = None) -> BlockLayout:
    if layout is not None:
        if cache.dim() != layout.ndim or (layout is FLASH_ATTN_LAYOUT and cache.shape[0] != 2):
            raise ValueError(f"kv_caches[{name!r}]: shape {tuple(cache.shape)} does not fit layout {layout.name}")
    elif cache.device.type == "cpu" and cache.dim() == CPU_LAYOUT.ndim:
        layout = CPU_LAYOUT
    elif cache.device.type != "cpu" and cache.dim() == FLASH_ATTN_LAYOUT.ndim and cache.shape[0] == 2:
        layout = FLASH_ATTN_LAYOUT
    else:
        raise ValueError(
            f"kv_caches[{name!r}]: unsupported paged KV layout {tuple(cache.shape)} on {cache.device}; "
            "expected [num_blocks, kv_heads, block_size, 2*head_size] on CPU or "
            "[2, num_blocks, block_size, kv_heads, head_size] on CUDA"
        )
    if cache.shape[layout.block_size_axis] != block_size:
        raise ValueError(
            f"kv_caches[{name!r}]: block size {cache.shape[layout.block_size_axis]} in layout "
            f"{layout.name} {tuple(cache.shape)} differs from vLLM's block_size {block_size}"
        )
    return layout


class PagedCaches:
    """vLLM's per-layer paged caches, in layer order, with their common layout.

    Built from the ``kv_caches`` dict of ``register_kv_caches`` (layer name → tensor; vLLM
    keeps the tensors, this object only references them). Every layer must have the same
    layout, shape, dtype and device (``ValueError`` naming the layer otherwise). ``layout`` is
    detected from the device and shape when None; passing one checks the tensors against it
    (the flash-attention layout can so be exercised on CPU tensors).
    """

    def __init__(
        self,
        kv_caches: Mapping[str, torch.Tensor],
        block_size: int,
        blocks_per_chunk: int,
        layout: BlockLayout | None = None,
        *,
        layer_parts: Sequence[int] | None = None,
        null_block: int | None = None,
    ) -> None:
        if not isinstance(kv_caches, Mapping) or not kv_caches:
            raise ValueError("kv_caches must be a non-empty mapping of layer name to tensor")
        names = list(kv_caches)
        first = kv_caches[names[0]]
        if not isinstance(first, torch.Tensor):
            raise TypeError(f"kv_caches[{names[0]!r}] must be a torch.Tensor, got {type(first).__name__}")
        self.layout = _layout_of(names[0], first, block_size, layout)
        for name in names[1:]:
            t = kv_caches[name]
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"kv_caches[{name!r}] must be a torch.Tensor, got {type(t).__name__}")
            if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
                raise ValueError(
                    f"kv_caches[{name!r}] is {tuple(t.shape)} {t.dtype} on {t.device}; every layer must "
                    f"match {names[0]!r}: {tuple(first.shape)} {first.dtype} on {first.device}"
                )
        self.layer_names = names
        self.tensors = [kv_caches[n] for n in names]
        parts = [0] * len(names) if layer_parts is None else [int(p) for p in layer_parts]
        if len(parts) != len(names) or min(parts) < 0:
            raise ValueError(f"layer_parts {list(parts)} for {len(names)} layers")
        self.layer_parts: tuple[int, ...] = tuple(parts)
        """Which record part (KV-cache group) each layer belongs to: its block ids are that
        part's (0: the primary ids, ``k``: ``others[k - 1]`` of the copy functions)."""
        self.num_parts = max(parts) + 1
        self.null_block = null_block
        """A block id that stands for "no block" (vLLM's null block, several KV-cache groups):
        never copied from or into; None: every id is a real block."""
        self.block_size = block_size
        self.blocks_per_chunk = blocks_per_chunk
        self.dtype = first.dtype
        self.device = first.device
        self.num_blocks = self.layout.num_blocks(first)
        self.record_shape: tuple[int, ...] = (
            len(names),
            *self.layout.record_layer_shape(first, blocks_per_chunk),
        )
        self.record_bytes = first.element_size() * int(torch.Size(self.record_shape).numel())
        block = first.select(self.layout.block_axis, 0)
        self.block_bytes = block.numel() * first.element_size()
        """Bytes of one block of one layer."""
        self.host_blocks = (
            self.layout is CPU_LAYOUT
            and self.device.type == "cpu"
            and all(t.is_contiguous() for t in self.tensors)
            and self.num_blocks > 0
        )
        """True when each block of each layer is one run of host memory (vLLM's CPU layout):
        blocks are then copied with one ``memmove`` per run of consecutive blocks, and records
        can be read straight into them (:meth:`read_sink`)."""
        self._bases = [t.data_ptr() for t in self.tensors] if self.host_blocks else []

    @property
    def num_layers(self) -> int:
        return len(self.tensors)

    def check_block_ids(self, block_ids: Sequence[int]) -> torch.Tensor:
        """``block_ids`` as an int64 index tensor on the caches' device; ``ValueError`` for an id
        outside ``[0, num_blocks)`` (a wiring mistake: never copy outside the cache)."""
        idx = torch.as_tensor(list(block_ids), dtype=torch.int64)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.num_blocks):
            raise ValueError(f"block_ids {list(block_ids)} outside [0, {self.num_blocks})")
        return idx.to(self.device) if self.device.type != "cpu" else idx

    def layer_ids(self, block_ids: Sequence[int], others: Sequence[Sequence[int]] = ()) -> list[list[int]]:
        """The block ids of each layer: ``block_ids`` for primary-part layers, ``others[k - 1]``
        for part ``k`` (each as long as ``block_ids``). ``ValueError`` for a missing or
        mismatched part, or an id outside the caches (the null block aside)."""
        per_part = [list(block_ids)] + [list(o) for o in others]
        if len(per_part) < self.num_parts:
            raise ValueError(f"block ids for {len(per_part)} parts; the caches have {self.num_parts}")
        n = len(per_part[0])
        real: list[int] = []
        for k, ids in enumerate(per_part):
            if len(ids) != n:
                raise ValueError(f"part {k} has {len(ids)} block ids for {n} blocks")
            real.extend(b for b in ids if b != self.null_block)
        if real and (min(real) < 0 or max(real) >= self.num_blocks):
            raise ValueError(f"block_ids {per_part} outside [0, {self.num_blocks})")
        return [per_part[p] for p in self.layer_parts]

    def block_copies(
        self, block_ids: Sequence[int], first: int = 0, others: Sequence[Sequence[int]] = ()
    ) -> list[tuple[int, int, int]]:
        """For blocks ``first .. first + len(block_ids) - 1`` of a chunk held in ``block_ids``
        (and, several parts, ``others``: see :meth:`layer_ids`): ``(cache address, offset in the
        record, nbytes)`` per run of consecutive blocks, in record order (:attr:`host_blocks`
        caches only); null blocks are left out. ``ValueError`` for a block id outside the
        caches or blocks outside the chunk."""
        n = len(block_ids)
        if not self.host_blocks:
            raise ValueError("block_copies needs host caches in vLLM's CPU layout")
        if first < 0 or first + n > self.blocks_per_chunk:
            raise ValueError(f"blocks {first}..{first + n} outside the chunk's {self.blocks_per_chunk} blocks")
        by_layer = self.layer_ids(block_ids, others)
        bb, bpc, null = self.block_bytes, self.blocks_per_chunk, self.null_block
        out: list[tuple[int, int, int]] = []
        for layer, base in enumerate(self._bases):
            ids = by_layer[layer]
            rec = (layer * bpc + first) * bb
            run_start = 0
            for j in range(1, n + 1):
                if j == n or ids[j] != ids[j - 1] + 1 or ids[j] == null or ids[j - 1] == null:
                    if ids[run_start] != null:
                        out.append((base + ids[run_start] * bb, rec + run_start * bb, (j - run_start) * bb))
                    run_start = j
        return out

    def read_sink(
        self,
        block_ids: Sequence[int],
        first: int = 0,
        scratch: torch.Tensor | None = None,
        others: Sequence[Sequence[int]] = (),
    ) -> ReadSink:
        """Where a record read lands for blocks ``first .. first + len(block_ids) - 1`` of its
        chunk: those blocks of every layer (each layer through its part's ids, ``others``),
        straight in vLLM's cache; the record's other bytes (blocks outside the run, null
        blocks) go to ``scratch`` (a contiguous host tensor of at least :meth:`gap_bytes`
        bytes the caller owns and keeps until the read returned). :attr:`host_blocks` caches
        only."""
        copies = self.block_copies(block_ids, first, others)
        need = self.record_bytes - sum(c[2] for c in copies)
        pieces: list[tuple[int, int]] = []
        if need:
            if scratch is None or scratch.device.type != "cpu" or not scratch.is_contiguous():
                raise ValueError("scratch: a contiguous host tensor is needed for a partial chunk")
            if scratch.numel() * scratch.element_size() < need:
                raise ValueError(f"scratch holds {scratch.numel() * scratch.element_size()} bytes; {need} needed")
        spare = scratch.data_ptr() if need and scratch is not None else 0
        at = 0  # record offset covered so far
        for addr, off, nbytes in copies:
            if off > at:  # a gap of blocks outside the run: distinct scratch bytes for each
                pieces.append((spare, off - at))
                spare += off - at
            pieces.append((addr, nbytes))
            at = off + nbytes
        if at < self.record_bytes:
            pieces.append((spare, self.record_bytes - at))
        return ReadSink(self.record_shape, self.dtype, tuple(coalesce(pieces)))

    def gap_bytes(self, block_ids: Sequence[int], first: int = 0, others: Sequence[Sequence[int]] = ()) -> int:
        """Bytes of a record that :meth:`read_sink` sends to scratch for these blocks."""
        return self.record_bytes - sum(c[2] for c in self.block_copies(block_ids, first, others))

    def scratch_bytes(self, num_blocks: int) -> int:
        """Scratch bytes :meth:`read_sink` needs for a run of ``num_blocks`` real blocks of a
        chunk (one part, no null blocks)."""
        return (self.blocks_per_chunk - num_blocks) * self.num_layers * self.block_bytes


@contextlib.contextmanager
def _on_stream(stream: Any) -> Iterator[None]:
    if stream is None:
        yield
        return
    with torch.cuda.stream(stream):
        yield


def _is_host_record(caches: PagedCaches, out: torch.Tensor) -> bool:
    """True when ``out`` is a whole contiguous host record of the caches' shape and dtype."""
    return (
        tuple(out.shape) == caches.record_shape
        and out.dtype == caches.dtype
        and out.device.type == "cpu"
        and out.is_contiguous()
    )


def _copy_runs(base: int, runs: Sequence[tuple[int, int, int]]) -> None:
    """Copy the :meth:`PagedCaches.block_copies` runs into the host record at address ``base``."""
    for addr, off, nbytes in runs:
        _memmove(base + off, addr, nbytes)


def _layer_indexes(
    caches: PagedCaches, block_ids: Sequence[int] | torch.Tensor, others: Sequence[Sequence[int]]
) -> list[torch.Tensor]:
    """One index tensor per layer (its part's block ids) on the caches' device."""
    if isinstance(block_ids, torch.Tensor) and caches.num_parts == 1:
        return [block_ids] * caches.num_layers
    ids = block_ids.tolist() if isinstance(block_ids, torch.Tensor) else list(block_ids)
    caches.layer_ids(ids, others)  # validates every part
    per_part = [caches.check_block_ids([b for b in p]) for p in [ids, *others]]
    return [per_part[p] for p in caches.layer_parts]


def gather_blocks(
    caches: PagedCaches,
    block_ids: Sequence[int] | torch.Tensor,
    out: torch.Tensor,
    stream: Any = None,
    others: Sequence[Sequence[int]] = (),
) -> None:
    """Copy the blocks ``block_ids`` of every layer into ``out`` (``[num_layers, ...]``, the
    record of one chunk or its leading part when fewer blocks are given).

    ``block_ids`` may be an index tensor from :meth:`PagedCaches.check_block_ids` (a caller
    gathering many chunks checks their ids once and passes slices). Several parts: the layers
    of part ``k`` read ``others[k - 1]`` (null blocks are copied as they are: a load never
    reads them back). ``out`` is host memory owned by the caller. On CUDA the copy is issued
    on ``stream`` (after the current stream's work, so this step's KV is complete) and may
    still be running when this returns: synchronise ``stream`` before reading ``out``.
    """
    if out.dim() != len(caches.record_shape) or out.shape[0] != caches.num_layers:
        raise ValueError(f"out has shape {tuple(out.shape)}; expected a record {caches.record_shape}")
    axis = caches.layout.block_axis
    if caches.host_blocks and _is_host_record(caches, out):
        ids = block_ids.tolist() if isinstance(block_ids, torch.Tensor) else list(block_ids)
        _copy_runs(out.data_ptr(), caches.block_copies(ids, 0, others))
        return
    if isinstance(block_ids, torch.Tensor) or caches.num_parts > 1:
        indexes = _layer_indexes(caches, block_ids, others)
    else:
        indexes = [caches.check_block_ids(block_ids)] * caches.num_layers
    n = indexes[0].numel()
    if caches.device.type == "cpu":
        whole = n == out.shape[axis + 1]
        for cache, dst, idx in zip(caches.tensors, out.unbind(0), indexes, strict=True):
            torch.index_select(cache, axis, idx, out=dst if whole else dst.narrow(axis, 0, n))
        return
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream(caches.device))
    with _on_stream(stream):
        for layer, (cache, idx) in enumerate(zip(caches.tensors, indexes, strict=True)):
            staged = cache.index_select(axis, idx)
            out[layer].narrow(axis, 0, n).copy_(staged, non_blocking=True)


PartIds = Sequence[Sequence[Sequence[int]]]
"""Per chunk, the block ids of the record parts after the primary one (several KV-cache groups)."""


def _others_of(caches: PagedCaches, chunk_others: PartIds | None, n: int) -> list[Sequence[Sequence[int]]]:
    if chunk_others is None:
        if caches.num_parts > 1:
            raise ValueError(f"the caches have {caches.num_parts} parts: chunk_others is needed")
        return [()] * n
    if len(chunk_others) != n:
        raise ValueError(f"chunk_others has {len(chunk_others)} entries for {n} chunks")
    return list(chunk_others)


def _check_chunks(
    caches: PagedCaches, chunk_blocks: Sequence[Sequence[int]], n_records: int, chunk_others: PartIds | None = None
) -> list[Sequence[Sequence[int]]]:
    """Check every argument of a gather of whole chunks before any byte moves (``ValueError``:
    not host caches, a count or chunk length that differs, a block id outside the caches);
    returns each chunk's other parts' ids."""
    if not caches.host_blocks:
        raise ValueError("gathering records needs host caches in vLLM's CPU layout")
    if len(chunk_blocks) != n_records:
        raise ValueError(f"{len(chunk_blocks)} chunks for {n_records} records")
    bpc = caches.blocks_per_chunk
    for i, bids in enumerate(chunk_blocks):
        if len(bids) != bpc:
            raise ValueError(f"chunk_blocks[{i}] has {len(bids)} blocks; a chunk has {bpc}")
    others = _others_of(caches, chunk_others, len(chunk_blocks))
    for bids, more in zip(chunk_blocks, others, strict=True):
        caches.layer_ids(bids, more)
    return others


def gather_records(
    caches: PagedCaches,
    chunk_blocks: Sequence[Sequence[int]],
    outs: Sequence[torch.Tensor],
    chunk_others: PartIds | None = None,
) -> None:
    """Gather whole chunks into their records: ``outs[i]`` (a host record of
    :attr:`PagedCaches.record_shape`, owned by the caller) gets the blocks ``chunk_blocks[i]``
    (``blocks_per_chunk`` ids each) of every layer; host caches (:attr:`PagedCaches.host_blocks`)
    only, on the calling thread.

    Every argument is checked before the first byte moves (``ValueError`` for a block id
    outside the caches or a chunk of another length). A contiguous record of the caches' dtype
    is then filled with one ``memmove`` per run of consecutive blocks per layer (no torch call,
    no OpenMP team); any other record like :func:`gather_blocks`. Records in a pool's blocks
    are better given by address (:func:`gather_records_at`). Several parts: ``chunk_others[i]``
    are chunk ``i``'s other parts' ids (:meth:`PagedCaches.layer_ids`; null blocks are skipped)."""
    others = _check_chunks(caches, chunk_blocks, len(outs), chunk_others)
    for bids, more, out in zip(chunk_blocks, others, outs, strict=True):
        if _is_host_record(caches, out):
            _copy_runs(out.data_ptr(), caches.block_copies(bids, 0, more))
        else:
            gather_blocks(caches, bids, out, None, more)


def gather_records_at(
    caches: PagedCaches,
    chunk_blocks: Sequence[Sequence[int]],
    addresses: Sequence[int],
    arena: torch.Tensor | None = None,
    chunk_others: PartIds | None = None,
) -> None:
    """:func:`gather_records` into records given by address: ``addresses[i]`` is the first
    byte of :attr:`PagedCaches.record_bytes` of contiguous, writable host memory the caller owns
    (a pool block of the record's shape and dtype), filled in the record's layout. Same checks,
    on the calling thread; no tensor view of a record is needed.

    ``arena``: a contiguous host tensor holding the records (the pool's buffer). Records that lie
    in it one after another at one distance (a pool's consecutive blocks) are then gathered with
    one ``index_select`` per layer and block position into a strided view of them: torch's copy
    on its intra-op threads, which in a vLLM worker right after the forward (its OpenMP team
    warm) beats one ``memmove`` per block (3.6 against 4.4 ms for 23 records of 2 MiB on this
    2-core machine). Every other record gets one ``memmove`` per run of consecutive blocks.
    ``chunk_others``: as for :func:`gather_records`."""
    others = _check_chunks(caches, chunk_blocks, len(addresses), chunk_others)
    done = [False] * len(addresses)
    if arena is not None:
        for first, count, step in _even_runs(caches, addresses, arena):
            run = range(first, first + count)
            parts = [[list(chunk_blocks[i]), *others[i]] for i in run]
            _select_run(caches, parts, arena, addresses[first], step)
            for i in run:
                done[i] = True
    for bids, more, base, gathered in zip(chunk_blocks, others, addresses, done, strict=True):
        if not gathered:
            _copy_runs(base, caches.block_copies(bids, 0, more))


def _even_runs(caches: PagedCaches, addresses: Sequence[int], arena: torch.Tensor) -> list[tuple[int, int, int]]:
    """``(first index, count, distance in bytes)`` of each run of two or more records that lie
    inside ``arena``, in address order at one distance of at least a record."""
    if arena.device.type != "cpu" or not arena.is_contiguous():
        return []
    lo = arena.data_ptr()
    hi = lo + arena.numel() * arena.element_size()
    size, item = caches.record_bytes, caches.dtype.itemsize

    def fits(a: int) -> bool:
        return lo <= a and a + size <= hi and (a - lo) % item == 0

    out: list[tuple[int, int, int]] = []
    i, n = 0, len(addresses)
    while i < n - 1:
        step = addresses[i + 1] - addresses[i]
        if step < size or step % item or not fits(addresses[i]):
            i += 1
            continue
        j = i + 1
        while j < n and addresses[j] - addresses[j - 1] == step and fits(addresses[j]):
            j += 1
        if j - i >= 2:
            out.append((i, j - i, step))
        i = j
    return out


def _select_run(
    caches: PagedCaches, chunk_parts: Sequence[Sequence[Sequence[int]]], arena: torch.Tensor, address: int, step: int
) -> None:
    """Gather the chunks of a run of records (the first at ``address``, each ``step`` bytes after
    the one before, all inside ``arena``) with one ``index_select`` per layer and block position;
    ``chunk_parts[i][k]``: chunk ``i``'s block ids of part ``k`` (a null block is copied as it is:
    a load never reads it back)."""
    item = caches.dtype.itemsize
    flat = arena.reshape(-1).view(torch.uint8)
    typed = flat[: flat.numel() - flat.numel() % item].view(caches.dtype)
    block_shape = tuple(caches.tensors[0].shape[1:])
    inner = torch.empty(block_shape, device="meta").stride()  # a record's block is contiguous
    block_elems = caches.block_bytes // item
    first = (address - arena.data_ptr()) // item
    idx = [
        torch.as_tensor([list(parts[k]) for parts in chunk_parts], dtype=torch.int64) for k in range(caches.num_parts)
    ]
    bpc = caches.blocks_per_chunk
    for layer, cache in enumerate(caches.tensors):
        part = idx[caches.layer_parts[layer]]
        for j in range(bpc):
            # Block j of this layer in every record of the run: records ``step`` bytes apart.
            dst = typed.as_strided(
                (len(chunk_parts), *block_shape), (step // item, *inner), first + (layer * bpc + j) * block_elems
            )
            torch.index_select(cache, 0, part[:, j], out=dst)


def scatter_blocks(
    caches: PagedCaches,
    block_ids: Sequence[int],
    record: torch.Tensor,
    first: int = 0,
    stream: Any = None,
    others: Sequence[Sequence[int]] = (),
) -> None:
    """Copy blocks ``first .. first + len(block_ids)`` of the chunk ``record`` into the blocks
    ``block_ids`` of every layer (several parts: part ``k``'s layers into ``others[k - 1]``;
    null blocks are never written). ``record`` is only read.

    On CUDA the copies run on ``stream`` (the current one when None); this returns once the
    host-to-device copies are done (``record`` may then be released) and the current stream
    is ordered after the scatter, so the forward that follows sees the loaded KV.
    """
    n = len(block_ids)
    axis = caches.layout.block_axis
    if tuple(record.shape) != caches.record_shape or record.dtype != caches.dtype:
        raise ValueError(
            f"record is {tuple(record.shape)} {record.dtype}; expected {caches.record_shape} {caches.dtype}"
        )
    if first < 0 or first + n > caches.blocks_per_chunk:
        raise ValueError(f"blocks {first}..{first + n} outside the chunk's {caches.blocks_per_chunk} blocks")
    by_layer = caches.layer_ids(block_ids, others)
    if caches.host_blocks and record.device.type == "cpu" and record.is_contiguous():
        src = record.data_ptr()
        for addr, off, nbytes in caches.block_copies(block_ids, first, others):
            _memmove(addr, src + off, nbytes)
        return
    copies = []  # per layer: (destination ids, positions in the record's run) without null blocks
    for ids in by_layer:
        keep = [j for j, b in enumerate(ids) if b != caches.null_block]
        copies.append((caches.check_block_ids([ids[j] for j in keep]), torch.as_tensor(keep, dtype=torch.int64)))
    if caches.device.type == "cpu":
        for layer, (cache, (idx, pos)) in enumerate(zip(caches.tensors, copies, strict=True)):
            cache.index_copy_(axis, idx, record[layer].narrow(axis, first, n).index_select(axis, pos))
        return
    used = stream if stream is not None else torch.cuda.current_stream(caches.device)
    with _on_stream(stream):
        for layer, (cache, (idx, pos)) in enumerate(zip(caches.tensors, copies, strict=True)):
            rows = record[layer].narrow(axis, first, n).index_select(axis, pos)
            cache.index_copy_(axis, idx, rows.to(caches.device, non_blocking=True))
    # The host record may be released (and its pool block reused) once this returns: wait for
    # the host-to-device copies, and make the compute stream wait for the scatter.
    used.synchronize()
    if stream is not None:
        torch.cuda.current_stream(caches.device).wait_stream(stream)

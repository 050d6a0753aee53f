"""Gathering a save's chunk records out of vLLM's paged caches (model-runner thread).

One call per save run: every record the run stores is filled before the batch put. Records are
pool blocks (:class:`~lmcache_async.memory.MemoryObj`) or, for a manager without a CPU tier,
host tensors the put copies from. With several KV-cache groups each record part's layers read
their own group's block ids (``chunk_others``, :mod:`.kv_groups`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lmcache_async.integration.vllm.kv.layout import PagedCaches, gather_blocks, gather_records, gather_records_at
from lmcache_async.memory import MemoryObj, PoolAllocator

__all__ = ["gather_chunks"]


def gather_chunks(
    caches: PagedCaches,
    chunk_ids: Sequence[Sequence[int]],
    records: Sequence[MemoryObj | torch.Tensor],
    chunk_others: Sequence[Sequence[Sequence[int]]],
    stream: Any = None,
) -> None:
    """Copy each chunk's blocks into its record; complete on return. Host caches: all records
    at once, pool blocks by address (:func:`~.kv_layout.gather_records_at`: no tensor view; the
    pool's consecutive blocks with one ``index_select`` per layer) and tensors with
    :func:`~.kv_layout.gather_records`; CUDA: the ids go to the device once (one part), each
    record is gathered on ``stream``, then that stream is synchronised."""
    if caches.host_blocks:
        blocks = [r for r in records if isinstance(r, MemoryObj) and r.nbytes == caches.record_bytes]
        if len(blocks) == len(records):  # pool blocks of the record's shape: contiguous host memory
            pool = blocks[0].allocator if blocks else None
            arena = pool.buffer if isinstance(pool, PoolAllocator) else None
            gather_records_at(caches, chunk_ids, [b.data_ptr for b in blocks], arena, chunk_others)
        else:
            outs = [r.tensor if isinstance(r, MemoryObj) else r for r in records]
            gather_records(caches, chunk_ids, outs, chunk_others)
        return
    outs = [r.tensor if isinstance(r, MemoryObj) else r for r in records]
    if caches.num_parts > 1:
        for ids, more, out in zip(chunk_ids, chunk_others, outs, strict=True):
            gather_blocks(caches, ids, out, stream, more)
    else:
        index = caches.check_block_ids([b for ids in chunk_ids for b in ids])
        bpc = caches.blocks_per_chunk
        for i, out in enumerate(outs):
            gather_blocks(caches, index[i * bpc : (i + 1) * bpc], out, stream)
    if stream is not None:
        stream.synchronize()

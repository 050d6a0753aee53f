"""SGLang host KV pools seen as whole pages: the gather/scatter between a pool and page records.

SGLang's HiCache keeps the host copy of the KV cache in one tensor per pool (``kv_buffer``),
laid out by the pool's ``layout``. Every supported layout is viewed here as a tensor with a
**page axis**, so page ``p`` of the pool is ``paged.select(page_axis, p)`` and a record holds
exactly those bytes (one record per page, every layer):

=========================  =====================================  ==========  =========================
pool / layout              ``kv_buffer``                          paged view  record (one page)
=========================  =====================================  ==========  =========================
MHA ``layer_first``        ``[2, L, S, H, D]``                    axis 2 of   ``[2, L, P, H, D]``
                                                                  ``[2, L, N, P, H, D]``
MHA ``page_first``         ``[2, S, L, H, D]``                    axis 1 of   ``[2, P, L, H, D]``
                                                                  ``[2, N, P, L, H, D]``
MHA ``page_first_direct``  ``[2, N, L, P, H, D]``                 axis 1      ``[2, L, P, H, D]``
MHA ``page_head``          ``[2, N, H, P, L, D]``                 axis 1      ``[2, H, P, L, D]``
MLA ``layer_first``        ``[L, S, 1, C]``                       axis 1 of   ``[L, P, 1, C]``
                                                                  ``[L, N, P, 1, C]``
MLA ``page_first``         ``[S, L, 1, C]``                       axis 0 of   ``[P, L, 1, C]``
                                                                  ``[N, P, L, 1, C]``
MLA ``page_first_direct``  ``[N, L, P, 1, C]``                    axis 0      ``[L, P, 1, C]``
=========================  =====================================  ==========  =========================

(``S`` slots, ``N = S / P`` pages of ``P`` tokens, ``L`` layers, ``H`` heads of ``D``, ``C`` the
MLA latent width.) A record is the page's bytes in the pool's own order, flattened exactly like
SGLang's ``get_data_page(index, flat=True)``; layouts that give the same order
(``layer_first`` and ``page_first_direct``) share records, the others have their own
(:attr:`HostPoolPages.record_order` names it; keys carry it).

Only whole pages move: ``host_indices`` must hold, for each page, ``P`` consecutive slots
starting on a page boundary (what SGLang's host allocator hands out; ``ValueError`` otherwise).
Pools with DCP sharding (``dcp_size > 1``) and the fused ``page_unified`` layout are refused at
construction with a ``ValueError`` naming the reason.

Loads go the other way through the manager's one read path: :meth:`HostPoolPages.sink` names
a page as a :class:`~lmcache_async.read_sinks.ReadSink` (its ``rows`` runs of the pool, in record
order, and the page's strided view), which :meth:`StorageManager.read_into_sync
<lmcache_async.storage_manager.StorageManager.read_into_sync>` fills straight from whichever tier
holds the record (a CPU-tier hit is one ``copy_`` into the page's view when the calling thread
runs torch with one intra-op thread, else one ``memmove`` per run; a disk record is read from
its file into the page and checked there).

Thread-safety: a :class:`HostPoolPages` holds no state beyond views of the pool; calls from
SGLang's prefetch and backup threads may run at once (they touch disjoint pages).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lmcache_async.read_sinks import ReadSink

__all__ = ["HostPoolPages", "PageRun"]

# Record byte orders (the part of a key that says how a record's bytes are laid out).
_MHA_ORDERS = {
    "layer_first": "mha-kv-layer-token",
    "page_first_direct": "mha-kv-layer-token",
    "page_first": "mha-kv-token-layer",
    "page_head": "mha-kv-head-token-layer",
}
_MLA_ORDERS = {
    "layer_first": "mla-layer-token",
    "page_first_direct": "mla-layer-token",
    "page_first": "mla-token-layer",
}


@dataclass(frozen=True)
class PageRun:
    """Pool pages named by one call's ``host_indices``: ``page_ids[i]`` is key ``i``'s page."""

    page_ids: list[int]


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides: list[int] = []
    acc = 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= d
    return tuple(reversed(strides))


def _int_attr(pool: Any, name: str) -> int:
    value = getattr(pool, name, None)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"mem_pool_host.{name} must be a positive int, got {value!r}")
    return value


class HostPoolPages:
    """Whole-page access to a SGLang host KV pool (``MHATokenToKVPoolHost`` or
    ``MLATokenToKVPoolHost``), checked against the geometry the pool declares.

    ``ValueError`` names what does not fit: an unsupported layout, a DCP-sharded pool, a
    ``kv_buffer`` whose shape differs from the pool's declared geometry. The pool keeps
    ownership of its buffer; this object only holds views of it.
    """

    def __init__(self, pool: Any) -> None:
        buf = getattr(pool, "kv_buffer", None)
        if not isinstance(buf, torch.Tensor):
            raise TypeError(
                f"mem_pool_host must be a SGLang host KV pool with a kv_buffer tensor, got {type(pool).__name__}"
            )
        if int(getattr(pool, "dcp_size", 1) or 1) != 1:
            raise ValueError("mem_pool_host: DCP-sharded host pools (dcp_size > 1) are not supported")
        layout = getattr(pool, "layout", None)
        self.layout: str = str(layout)
        self.page_size = _int_attr(pool, "page_size")
        self.layer_num = _int_attr(pool, "layer_num")
        size = _int_attr(pool, "size")
        if size % self.page_size:
            raise ValueError(f"mem_pool_host.size {size} is not a multiple of page_size {self.page_size}")
        self.size = size
        self.page_num = size // self.page_size
        self.dtype: torch.dtype = buf.dtype
        self.device = buf.device
        self.is_mla = hasattr(pool, "kv_cache_dim") and not hasattr(pool, "head_num")
        paged, axis, order = self._paged_view(pool, buf)
        self.paged = paged
        self.page_axis = axis
        self.record_order = order
        shape = list(paged.shape)
        del shape[axis]
        self.record_shape: tuple[int, ...] = tuple(shape)
        self.rows = int(torch.Size(paged.shape[:axis]).numel())
        """Contiguous runs per page (the product of the axes before the page axis)."""
        self.record_bytes = int(torch.Size(self.record_shape).numel()) * buf.element_size()

    def _paged_view(self, pool: Any, buf: torch.Tensor) -> tuple[torch.Tensor, int, str]:
        layout, P, L, N, S = self.layout, self.page_size, self.layer_num, self.page_num, self.size
        expected: dict[str, tuple[int, ...]]
        views: dict[str, tuple[tuple[int, ...], int]]
        if self.is_mla:
            C = _int_attr(pool, "kv_cache_dim")
            orders = _MLA_ORDERS
            expected = {
                "layer_first": (L, S, 1, C),
                "page_first": (S, L, 1, C),
                "page_first_direct": (N, L, P, 1, C),
            }
            views = {
                "layer_first": ((L, N, P, 1, C), 1),
                "page_first": ((N, P, L, 1, C), 0),
                "page_first_direct": ((N, L, P, 1, C), 0),
            }
        else:
            H = _int_attr(pool, "head_num")
            D = _int_attr(pool, "head_dim")
            v_dim = getattr(pool, "v_head_dim", D)
            if v_dim != D:
                raise ValueError(f"mem_pool_host: K and V head dims differ ({D} vs {v_dim}); not supported")
            orders = _MHA_ORDERS
            expected = {
                "layer_first": (2, L, S, H, D),
                "page_first": (2, S, L, H, D),
                "page_first_direct": (2, N, L, P, H, D),
                "page_head": (2, N, H, P, L, D),
            }
            views = {
                "layer_first": ((2, L, N, P, H, D), 2),
                "page_first": ((2, N, P, L, H, D), 1),
                "page_first_direct": ((2, N, L, P, H, D), 1),
                "page_head": ((2, N, H, P, L, D), 1),
            }
        if layout not in expected:
            kind = "MLA" if self.is_mla else "MHA"
            raise ValueError(
                f"mem_pool_host.layout {layout!r} is not supported for {kind} pools; supported: {', '.join(expected)}"
            )
        if tuple(buf.shape) != expected[layout]:
            raise ValueError(
                f"mem_pool_host.kv_buffer is {tuple(buf.shape)}; layout {layout!r} with the pool's "
                f"geometry gives {expected[layout]}"
            )
        if not buf.is_contiguous():
            raise ValueError("mem_pool_host.kv_buffer must be contiguous")
        shape, axis = views[layout]
        return buf.view(shape), axis, orders[layout]

    # ---- indices ----------------------------------------------------------------------------------
    def pages_of(self, host_indices: Any, n_pages: int) -> PageRun:
        """The pool pages of ``n_pages`` keys from SGLang's ``host_indices`` (token slots,
        ``n_pages * page_size`` of them, page after page).

        ``ValueError`` naming ``host_indices`` when there are too few slots, a page does not
        start on a page boundary, its slots are not consecutive, or a slot is outside the pool;
        ``TypeError`` when it is not an integer tensor or sequence.
        """
        P = self.page_size
        if isinstance(host_indices, torch.Tensor):
            idx = host_indices
        else:
            try:
                idx = torch.as_tensor(host_indices, dtype=torch.int64)
            except (TypeError, ValueError, RuntimeError):
                raise TypeError(
                    f"host_indices must be an integer tensor or sequence, got {type(host_indices).__name__}"
                ) from None
        if idx.dtype.is_floating_point or idx.dtype.is_complex or idx.dtype == torch.bool:
            raise TypeError(f"host_indices must hold integers, got {idx.dtype}")
        if idx.dim() != 1:
            raise ValueError(f"host_indices must be 1-D, got shape {tuple(idx.shape)}")
        need = n_pages * P
        if idx.numel() < need:
            raise ValueError(f"host_indices has {idx.numel()} slots; {n_pages} pages of {P} need {need}")
        if n_pages == 0:
            return PageRun([])
        if idx.device.type != "cpu":
            idx = idx.cpu()
        rows = idx[:need].to(torch.int64).view(n_pages, P)
        starts = rows[:, 0]
        if int(starts.min()) < 0 or int(rows.max()) >= self.size:
            raise ValueError(f"host_indices reach outside the host pool's {self.size} slots")
        if bool((starts % P).any()):
            raise ValueError(f"host_indices: every page must start on a multiple of page_size {P}")
        if P > 1 and not bool((rows - starts.unsqueeze(1) == torch.arange(P, dtype=torch.int64)).all()):
            raise ValueError("host_indices: the slots of each page must be consecutive")
        return PageRun((starts // P).tolist())

    # ---- page copies ------------------------------------------------------------------------------
    def page(self, page_id: int) -> torch.Tensor:
        """A view of one pool page in record shape (the pool's memory; not a copy)."""
        return self.paged.select(self.page_axis, page_id)

    # A page is ``rows`` contiguous runs of the pool (one per index of the axes before the page
    # axis: K/V, and layers in layer_first). A single page moves in one ``copy_`` of its strided
    # view (one kernel over its ``rows`` runs); copying run by run from Python costs a dispatch
    # and two views per run (16 per page for 8 layers). Many pages whose records lie at one
    # stride in one buffer (blocks a pool allocator handed out one after another) move in one
    # ``index_select`` along the page axis into a strided view over those records: the same
    # kernel, slice after slice, as a bare ``index_select`` of those pages.
    def gather(self, page_id: int, out: torch.Tensor) -> None:
        """Copy pool page ``page_id`` into ``out`` (a contiguous record-shaped tensor the caller
        owns); the calling thread, one ``copy_``."""
        out.view(self.record_shape).copy_(self.paged.select(self.page_axis, page_id))

    def gather_many(self, page_ids: Sequence[int], outs: Sequence[torch.Tensor]) -> int:
        """Copy pool page ``page_ids[i]`` into ``outs[i]`` for every ``i`` (contiguous
        record-shaped tensors the caller owns, not overlapping each other); the calling thread.

        Consecutive ``outs`` that lie at one stride (at least a record) in one storage are
        filled by one ``index_select`` each, any others one ``copy_`` each. Returns the number
        of copy calls made (for tests and stats).
        """
        if len(page_ids) != len(outs):
            raise ValueError(f"{len(page_ids)} page ids for {len(outs)} records")
        calls = 0
        i, n = 0, len(outs)
        while i < n:
            j, step = self._run_end(outs, i)
            if j - i == 1:
                self.gather(page_ids[i], outs[i])
            else:
                first = outs[i]
                stride = (step // first.element_size(), *_contiguous_strides(self.record_shape))
                view = first.as_strided((j - i, *self.record_shape), stride, first.storage_offset())
                ids = torch.tensor(page_ids[i:j], dtype=torch.int64)
                torch.index_select(self.paged, self.page_axis, ids, out=view.movedim(0, self.page_axis))
            calls += 1
            i = j
        return calls

    def _run_end(self, outs: Sequence[torch.Tensor], i: int) -> tuple[int, int]:
        """End (exclusive) of the run of ``outs`` from ``i`` at one stride in one storage, and
        that stride in bytes (0 for a run of one)."""
        first = outs[i]
        if i + 1 >= len(outs) or not self._whole_record(first):
            return i + 1, 0
        storage = first.untyped_storage().data_ptr()
        step = outs[i + 1].data_ptr() - first.data_ptr()
        if step < self.record_bytes or step % first.element_size():
            return i + 1, 0
        j = i + 1
        while (
            j < len(outs)
            and outs[j].data_ptr() - outs[j - 1].data_ptr() == step
            and self._whole_record(outs[j])
            and outs[j].untyped_storage().data_ptr() == storage
        ):
            j += 1
        return j, step if j - i > 1 else 0

    def _whole_record(self, t: torch.Tensor) -> bool:
        return (
            t.dtype == self.dtype
            and t.device == self.device
            and t.numel() * t.element_size() == self.record_bytes
            and t.is_contiguous()
        )

    def scatter(self, page_id: int, record: torch.Tensor) -> None:
        """Copy ``record`` (record-shaped or flat with the record's element count, contiguous,
        only read) into pool page ``page_id``; the calling thread, one ``copy_``."""
        self.paged.select(self.page_axis, page_id).copy_(record.reshape(self.record_shape))

    def sink(self, page_id: int) -> ReadSink:
        """Pool page ``page_id`` as a read destination: a :class:`ReadSink` of the record shape
        and dtype whose pieces are the page's runs of the pool, in record order (a record read
        into it lands in the page exactly as :meth:`scatter` would put it), carrying the page's
        strided view (:meth:`ReadSink.over`): a CPU-tier hit fills a ``layer_first`` page in one
        ``copy_`` over its ``rows`` runs, as :meth:`scatter` does, rather than one ``memmove``
        per run; the disk tier reads the record into the pieces. The pool must stay alive while
        the read runs. ``ValueError`` for a page outside the pool or a pool that is not in host
        memory."""
        if not 0 <= page_id < self.page_num:
            raise ValueError(f"page {page_id} is outside the host pool's {self.page_num} pages")
        if self.device.type != "cpu":
            raise ValueError(f"mem_pool_host.kv_buffer is on {self.device}; reads land in host memory only")
        return ReadSink.over(self.paged.select(self.page_axis, page_id))

    def fits(self, record: torch.Tensor) -> bool:
        """True when ``record`` has this pool's record shape and dtype."""
        return tuple(record.shape) == self.record_shape and record.dtype == self.dtype

    def describe(self) -> dict[str, Any]:
        """The geometry as plain data (for logs and stats)."""
        return {
            "layout": self.layout,
            "record_order": self.record_order,
            "page_size": self.page_size,
            "layer_num": self.layer_num,
            "page_num": self.page_num,
            "dtype": str(self.dtype),
            "record_shape": list(self.record_shape),
            "record_bytes": self.record_bytes,
            "mla": self.is_mla,
        }

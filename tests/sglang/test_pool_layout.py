"""Page copies between SGLang's real host pools and records (HostPoolPages.gather_many)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")


def _pages(make_pool: Any, sgl: Any, layout: str) -> Any:
    from lmcache_async.integration.sglang.pool_layout import HostPoolPages

    pool = make_pool(layout, page_num=12)
    sgl.fill_random(pool, seed=5)
    return HostPoolPages(pool)


def _expected(pages: Any, page_ids: list[int]) -> list[torch.Tensor]:
    out = []
    for q in page_ids:
        rec = torch.empty(pages.record_shape, dtype=pages.dtype)
        pages.gather(q, rec)
        out.append(rec)
    return out


def _records(buf: torch.Tensor, pages: Any, n: int, stride_elems: int) -> list[torch.Tensor]:
    numel = pages.record_bytes // buf.element_size()
    return [buf[i * stride_elems : i * stride_elems + numel].view(pages.record_shape) for i in range(n)]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_adjacent_records_are_gathered_in_one_call_bit_exact(make_pool: Any, sgl: Any, layout: str) -> None:
    pages = _pages(make_pool, sgl, layout)
    ids = [7, 2, 11, 0, 5]
    numel = pages.record_bytes // pages.paged.element_size()
    buf = torch.zeros(numel * len(ids), dtype=pages.dtype)
    outs = _records(buf, pages, len(ids), numel)
    assert pages.gather_many(ids, outs) == 1
    for got, want in zip(outs, _expected(pages, ids), strict=True):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    # The gather reads the pool and writes only the records.
    assert torch.equal(pages.page(7).contiguous().view(torch.uint8), outs[0].view(torch.uint8))


def test_records_at_a_wider_stride_leave_the_gaps_alone(make_pool: Any, sgl: Any) -> None:
    pages = _pages(make_pool, sgl, "layer_first")
    ids = [3, 4, 9]
    numel = pages.record_bytes // pages.paged.element_size()
    stride = numel + 96  # records padded as an aligned allocator would
    buf = torch.full((stride * len(ids),), 1.5, dtype=pages.dtype)
    outs = _records(buf, pages, len(ids), stride)
    assert pages.gather_many(ids, outs) == 1
    for got, want in zip(outs, _expected(pages, ids), strict=True):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    for i in range(len(ids)):
        gap = buf[i * stride + numel : (i + 1) * stride]
        assert bool((gap == 1.5).all())


def test_records_that_do_not_line_up_are_copied_one_by_one(make_pool: Any, sgl: Any) -> None:
    pages = _pages(make_pool, sgl, "page_first")
    numel = pages.record_bytes // pages.paged.element_size()
    buf = torch.zeros(numel * 4, dtype=pages.dtype)
    run = _records(buf, pages, 4, numel)
    alone = torch.zeros(pages.record_shape, dtype=pages.dtype)
    # A run of two, a tensor of its own, then two records in reverse order (a negative stride).
    outs = [run[0], run[1], alone, run[3], run[2]]
    ids = [1, 8, 10, 4, 6]
    assert pages.gather_many(ids, outs) == 4
    for got, want in zip(outs, _expected(pages, ids), strict=True):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert pages.gather_many([], []) == 0


def test_gather_many_wants_one_record_per_page(make_pool: Any, sgl: Any) -> None:
    pages = _pages(make_pool, sgl, "page_first")
    with pytest.raises(ValueError, match="page ids"):
        pages.gather_many([1, 2], [torch.empty(pages.record_shape, dtype=pages.dtype)])


def test_batch_set_v1_gathers_a_batch_of_fresh_blocks_in_one_call(
    make_backend: Any, make_pool: Any, cpu_config: dict[str, Any], sgl: Any
) -> None:
    pool = make_pool("layer_first", page_num=16)
    sgl.fill_random(pool, seed=6)
    backend = make_backend(cpu_config, pool)
    calls: list[int] = []
    gather_many = backend.pages.gather_many

    def counting(ids: list[int], outs: list[torch.Tensor]) -> int:
        n = gather_many(ids, outs)
        calls.append(n)
        return n

    backend.pages.gather_many = counting
    page_ids = [1, 3, 5, 7, 9, 11]
    keys = [f"{i:064x}" for i in range(len(page_ids))]
    p = pool.page_size
    host_indices = torch.cat([torch.arange(q * p, (q + 1) * p) for q in page_ids])
    want = [sgl.page_bytes(pool, q * p) for q in page_ids]
    assert backend.batch_set_v1(keys, host_indices) == [True] * len(page_ids)
    # An empty pool hands out blocks one after another: the whole batch is one index_select.
    assert calls == [1]
    pool.kv_buffer.zero_()
    assert backend.batch_get_v1(keys, host_indices) == [True] * len(page_ids)
    for q, w in zip(page_ids, want, strict=True):
        assert torch.equal(sgl.page_bytes(pool, q * p), w)


@pytest.mark.parametrize("layout", ["page_first", "layer_first", "page_first_direct"])
def test_mla_geometry_gathers_along_its_page_axis(layout: str) -> None:
    """MLA pools (page axis 0 in page_first): the attributes MLATokenToKVPoolHost declares,
    over a CPU buffer of its layout (its constructor needs a device pool)."""
    import types

    from lmcache_async.integration.sglang.pool_layout import HostPoolPages

    L, P, N, C = 3, 4, 6, 8
    shapes = {"page_first": (N * P, L, 1, C), "layer_first": (L, N * P, 1, C), "page_first_direct": (N, L, P, 1, C)}
    buf = torch.randn(shapes[layout]).to(torch.bfloat16)
    pool = types.SimpleNamespace(
        kv_buffer=buf, layout=layout, page_size=P, layer_num=L, size=N * P, kv_cache_dim=C, dcp_size=1
    )
    pages = HostPoolPages(pool)
    ids = [4, 0, 5]
    numel = pages.record_bytes // buf.element_size()
    flat = torch.zeros(numel * len(ids) + 16, dtype=buf.dtype)
    outs = _records(flat[16:], pages, len(ids), numel)
    assert pages.gather_many(ids, outs) == 1
    for got, want in zip(outs, _expected(pages, ids), strict=True):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert not flat[:16].any()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_page_sink_lands_a_record_where_scatter_puts_it(make_pool: Any, sgl: Any, layout: str) -> None:
    """HostPoolPages.sink names exactly the page's bytes, in record order, on SGLang's real
    pools: filling it from a stored record writes that page as scatter would, and nothing else."""
    from lmcache_async.config import LMCacheEngineConfig
    from lmcache_async.keys import CacheEngineKey
    from lmcache_async.memory import MemoryFormat
    from lmcache_async.metadata import LMCacheEngineMetadata
    from lmcache_async.storage_manager import StorageManager

    pages = _pages(make_pool, sgl, layout)
    src = _expected(pages, [2, 7])
    before = pages.paged.clone()
    sinks = [pages.sink(5), pages.sink(0)]
    assert all(s.fits(pages.record_shape, pages.dtype) for s in sinks)
    assert len(sinks[0].pieces) == pages.rows
    cfg = LMCacheEngineConfig.from_defaults(max_local_cpu_size=1 / 16)
    with StorageManager(cfg, LMCacheEngineMetadata("m")) as sm:
        keys = [CacheEngineKey("m", 1, 0, i, pages.dtype) for i in range(2)]
        assert all(sm.batched_put_sync(keys, src, MemoryFormat.UNDEFINED))
        assert sm.read_into_sync(keys, sinks) == [True, True]
    want = before.clone()
    want.select(pages.page_axis, 5).copy_(src[0])
    want.select(pages.page_axis, 0).copy_(src[1])
    assert torch.equal(pages.paged.view(torch.uint8), want.view(torch.uint8))
    with pytest.raises(ValueError, match="outside"):
        pages.sink(pages.page_num)

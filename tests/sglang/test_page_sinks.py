"""Page sinks that carry the page's strided view (ReadSink.over, HostPoolPages.sink): a CPU-tier
hit fills a layer_first page in one ``copy_`` when the calling thread runs torch with one
intra-op thread, else one ``memmove`` per run; either way exactly the page's runs are written."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch

import lmcache_async.read_sinks as read_sinks
from lmcache_async.read_sinks import ReadSink

GUARD = 0xA5


def _force(monkeypatch: pytest.MonkeyPatch, path: str) -> list[int]:
    """Make fill_from take ``path`` ("copy_" or "memmove"); returns the memmove call log."""
    calls: list[int] = []
    real = read_sinks._memmove

    def memmove(dst: int, src: int, n: int) -> Any:
        calls.append(n)
        return real(dst, src, n)

    monkeypatch.setattr(read_sinks, "_memmove", memmove)
    monkeypatch.setattr(read_sinks, "_num_threads", (lambda: 1) if path == "copy_" else (lambda: 2))
    return calls


@pytest.mark.parametrize("path", ["copy_", "memmove"])
def test_a_layer_first_page_filled_from_a_cpu_hit_gets_exactly_its_runs(
    make_pool: Any, make_backend: Any, cpu_config: dict[str, Any], sgl: Any, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    """batch_get_v1 of a CPU-tier hit into page 5 of a layer_first pool whose every byte is a
    guard: the page's 2 x L runs hold the record's bytes, every other byte of the pool (the
    pages beside it, the gaps between its runs) is still the guard."""
    pool = make_pool("layer_first", layer_num=3, page_num=8)
    sgl.fill_random(pool, seed=11)
    backend = make_backend(cpu_config, pool)
    pages = backend.pages
    P = pool.page_size
    want = pages.page(2).clone()
    assert backend.batch_set_v1(["k"], torch.arange(2 * P, 3 * P)) == [True]
    pool.kv_buffer.view(torch.uint8).fill_(GUARD)
    calls = _force(monkeypatch, path)

    assert backend.batch_get_v1(["k"], torch.arange(5 * P, 6 * P)) == [True]

    assert calls == ([] if path == "copy_" else [pages.record_bytes // pages.rows] * pages.rows)
    sink = pages.sink(5)
    assert sink.tensor is not None and len(sink.pieces) == pages.rows == 2 * 3
    got = pages.page(5)
    assert torch.equal(got.contiguous().view(torch.uint8), want.view(torch.uint8))
    guard = torch.full_like(pool.kv_buffer.view(torch.uint8), GUARD)
    written = torch.zeros_like(guard, dtype=torch.bool)
    base = pool.kv_buffer.data_ptr()
    flat = written.view(-1)
    for addr, n in sink.pieces:
        flat[addr - base : addr - base + n] = True
    rest = pool.kv_buffer.view(torch.uint8).view(-1)[~flat]
    assert rest.numel() == pool.kv_buffer.numel() * pool.kv_buffer.element_size() - pages.record_bytes
    assert bool((rest == GUARD).all())


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct", "page_head"])
def test_every_layout_page_sink_carries_its_view_and_its_runs(make_pool: Any, layout: str) -> None:
    from lmcache_async.integration.sglang.pool_layout import HostPoolPages

    pages = HostPoolPages(make_pool(layout, page_num=6))
    for pid in (0, 3, 5):
        sink = pages.sink(pid)
        view = pages.page(pid)
        assert sink.tensor is not None and sink.tensor.data_ptr() == view.data_ptr()
        assert sink.tensor.shape == view.shape and sink.tensor.stride() == view.stride()
        assert sink.shape == pages.record_shape and sink.dtype == pages.dtype
        assert len(sink.pieces) == pages.rows and sink.nbytes == pages.record_bytes
        # the same sink, checked the long way (the constructor compares the view's runs)
        assert ReadSink(sink.shape, sink.dtype, sink.pieces, sink.tensor) == sink


def _page_view() -> tuple[torch.Tensor, torch.Tensor]:
    buf = torch.zeros(2, 3, 4, 8, 16, dtype=torch.bfloat16)  # [2, L, N, P*H, D]: page 1 of 4
    return buf, buf[:, :, 1]


def test_over_derives_the_runs_of_a_strided_view() -> None:
    buf, view = _page_view()
    sink = ReadSink.over(view)
    run = 8 * 16 * 2
    base = buf.data_ptr()
    want = tuple((base + (k * 3 * 4 + layer * 4 + 1) * run, run) for k in range(2) for layer in range(3))
    assert sink.pieces == want and sink.shape == (2, 3, 8, 16) and sink.tensor is view
    # adjacent runs merge; a contiguous tensor is one piece
    assert ReadSink.over(buf[:, :, 1:3]).pieces == tuple((a, 2 * run) for a, _ in want)
    assert ReadSink.over(buf).pieces == ((base, buf.numel() * 2),)
    flat = ReadSink.over(view, shape=(view.numel(),))
    assert flat.shape == (view.numel(),) and flat.pieces == sink.pieces


def test_over_and_the_constructor_refuse_a_tensor_that_is_not_exactly_the_pieces() -> None:
    buf, view = _page_view()
    pieces = ReadSink.over(view).pieces
    with pytest.raises(ValueError, match="not exactly the pieces"):
        ReadSink(tuple(view.shape), view.dtype, pieces[::-1], view)
    with pytest.raises(ValueError, match="not exactly the pieces"):
        ReadSink(tuple(view.shape), view.dtype, pieces, buf[:, :, 2])
    with pytest.raises(ValueError, match="tensor is torch.float16"):
        ReadSink(tuple(view.shape), view.dtype, pieces, view.view(torch.float16))
    with pytest.raises(ValueError, match="stride 0"):
        ReadSink.over(torch.zeros(1, 16).expand(4, 16))
    with pytest.raises(ValueError, match="overlap"):
        ReadSink.over(torch.zeros(64).as_strided((4, 16), (8, 1)))
    with pytest.raises(ValueError, match="requires grad"):
        ReadSink.over(torch.zeros(4, 16, requires_grad=True)[:, :8])
    with pytest.raises(ValueError, match="elements"):
        ReadSink.over(view, shape=(3,))
    with pytest.raises(TypeError):
        ReadSink((16,), torch.float32, ((buf.data_ptr(), 64),), "not a tensor")  # type: ignore[arg-type]
    with torch.inference_mode():
        inf = torch.zeros(4, 2, 16)
    assert ReadSink.over(inf[:, 0]).tensor is None  # not written in place: pieces only


@pytest.mark.parametrize("path", ["copy_", "memmove"])
def test_fill_from_writes_the_payload_into_the_view_and_nothing_beside_it(
    monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    from lmcache_async.memory import HeapAllocator

    buf, view = _page_view()
    buf.view(torch.uint8).fill_(GUARD)
    sink = ReadSink.over(view)
    obj = HeapAllocator(pin=False).allocate(sink.shape, sink.dtype)
    src = torch.randint(-(1 << 15), 1 << 15, sink.shape, dtype=torch.int16).view(torch.bfloat16)
    obj.tensor.copy_(src)
    calls = _force(monkeypatch, path)
    assert sink.fill_from(obj)
    assert len(calls) == (0 if path == "copy_" else len(sink.pieces))
    assert torch.equal(view.contiguous().view(torch.int16), src.view(torch.int16))
    others = torch.ones(buf.shape, dtype=torch.bool)
    others[:, :, 1] = False
    assert bool((buf.view(torch.uint8).view(*buf.shape, 2)[others] == GUARD).all())
    wrong = HeapAllocator(pin=False).allocate((view.numel(),), sink.dtype)
    assert not sink.fill_from(wrong)  # another shape: nothing written


_THREADS_CHILD = textwrap.dedent(
    """
    import os, threading, torch
    import lmcache_async.read_sinks as rs
    from lmcache_async.memory import HeapAllocator

    def tasks():
        return len(os.listdir("/proc/self/task"))

    buf = torch.zeros(2, 4, 3, 64 * 8, 128, dtype=torch.bfloat16)  # runs of 64 Ki elements
    sink = rs.ReadSink.over(buf[:, :, 1])
    obj = HeapAllocator(pin=False).allocate(sink.shape, sink.dtype)
    calls = []
    real = rs._memmove
    rs._memmove = lambda d, s, n: calls.append(n) or real(d, s, n)
    out = {}

    def fill():
        n0 = tasks()
        assert sink.fill_from(obj)
        out["fill"] = tasks() - n0
        n0 = tasks()
        buf[:, :, 2].copy_(obj.tensor)  # control: a bare copy_ of the same size here
        out["bare"] = tasks() - n0

    t = threading.Thread(target=fill)
    t.start()
    t.join()
    print(out["fill"], out["bare"], len(calls), torch.get_num_threads())
    """
)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")
@pytest.mark.parametrize("omp", ["1", "2"])
def test_a_fill_on_a_fresh_thread_starts_no_openmp_team(omp: str) -> None:
    """With one intra-op thread the fill is a copy_ (which then runs inline); with two it is one
    memmove per run, where a bare copy_ of the same size would start an OpenMP team."""
    env = {**os.environ, "OMP_NUM_THREADS": omp}
    res = subprocess.run(
        [sys.executable, "-c", _THREADS_CHILD], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert res.returncode == 0, res.stderr
    fill, bare, memmoves, threads = map(int, res.stdout.split())
    assert fill == 0 and threads == int(omp)
    if omp == "1":
        assert memmoves == 0 and bare == 0
    else:
        assert memmoves == 2 * 4 and bare > 0

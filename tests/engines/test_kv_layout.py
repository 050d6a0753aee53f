"""Whole-block gather/scatter between vLLM's paged KV caches and chunk records (no vLLM needed)."""

from __future__ import annotations

import ctypes

import pytest
import torch

from lmcache_async.integration.vllm.kv.layout import (
    CPU_LAYOUT,
    FLASH_ATTN_LAYOUT,
    PagedCaches,
    check_chunk_alignment,
    gather_blocks,
    gather_records,
    gather_records_at,
    scatter_blocks,
)
from lmcache_async.read_sinks import ReadSink, coalesce

NB, HEADS, BS, HEAD = 8, 2, 4, 3
LAYERS = 3


def cpu_caches(fill: bool = True) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    make = (
        (lambda: torch.randn(NB, HEADS, BS, 2 * HEAD, generator=g))
        if fill
        else (lambda: torch.zeros(NB, HEADS, BS, 2 * HEAD))
    )
    return {f"model.layers.{i}.self_attn.attn": make() for i in range(LAYERS)}


def flash_caches(fill: bool = True) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    make = (
        (lambda: torch.randn(2, NB, BS, HEADS, HEAD, generator=g))
        if fill
        else (lambda: torch.zeros(2, NB, BS, HEADS, HEAD))
    )
    return {f"layers.{i}": make() for i in range(LAYERS)}


def test_chunk_size_must_be_a_multiple_of_the_block_size() -> None:
    assert check_chunk_alignment(256, 128) == 2
    assert check_chunk_alignment(128, 128) == 1
    with pytest.raises(ValueError, match="chunk_size"):
        check_chunk_alignment(200, 128)
    with pytest.raises(ValueError, match="chunk_size"):
        check_chunk_alignment(64, 128)
    with pytest.raises(ValueError, match="block_size"):
        check_chunk_alignment(256, 0)


def test_cpu_layout_is_detected_and_the_record_holds_every_layer() -> None:
    caches = PagedCaches(cpu_caches(), BS, 2)
    assert caches.layout is CPU_LAYOUT
    assert caches.record_shape == (LAYERS, 2, HEADS, BS, 2 * HEAD)
    assert caches.record_bytes == 4 * LAYERS * 2 * HEADS * BS * 2 * HEAD


def test_cpu_gather_copies_whole_blocks_in_the_given_order() -> None:
    src = cpu_caches()
    caches = PagedCaches(src, BS, 2)
    record = torch.empty(caches.record_shape)
    gather_blocks(caches, [5, 2], record)
    for layer, t in enumerate(src.values()):
        assert torch.equal(record[layer, 0], t[5])
        assert torch.equal(record[layer, 1], t[2])


def test_cpu_scatter_writes_only_the_target_blocks_byte_for_byte() -> None:
    src = cpu_caches()
    record = torch.empty(PagedCaches(src, BS, 2).record_shape)
    gather_blocks(PagedCaches(src, BS, 2), [5, 2], record)
    dst = cpu_caches(fill=False)
    scatter_blocks(PagedCaches(dst, BS, 2), [1, 7], record)
    for s, d in zip(src.values(), dst.values(), strict=True):
        assert torch.equal(d[1], s[5]) and torch.equal(d[7], s[2])
        # the kernel's view of a block ([heads, 2 * block_size, head]: K rows then V rows) is
        # the same bytes: nothing was reordered
        assert torch.equal(d.view(NB, HEADS, 2 * BS, HEAD)[1], s.view(NB, HEADS, 2 * BS, HEAD)[5])
        untouched = [b for b in range(NB) if b not in (1, 7)]
        assert not d[untouched].any()


def test_scatter_of_part_of_a_chunk_takes_the_blocks_from_the_given_offset() -> None:
    src = cpu_caches()
    caches = PagedCaches(src, BS, 2)
    record = torch.empty(caches.record_shape)
    gather_blocks(caches, [3, 4], record)
    dst = cpu_caches(fill=False)
    scatter_blocks(PagedCaches(dst, BS, 2), [6], record, first=1)
    for s, d in zip(src.values(), dst.values(), strict=True):
        assert torch.equal(d[6], s[4])
        assert not d[:6].any()


def test_gather_of_fewer_blocks_fills_the_leading_part_of_the_record() -> None:
    src = cpu_caches()
    caches = PagedCaches(src, BS, 2)
    record = torch.zeros(caches.record_shape)
    gather_blocks(caches, [7], record)
    assert torch.equal(record[0, 0], src["model.layers.0.self_attn.attn"][7])
    assert not record[:, 1].any()


def test_consecutive_blocks_are_copied_as_one_run_per_layer() -> None:
    pc = PagedCaches(cpu_caches(), BS, 3)
    assert pc.host_blocks
    copies = pc.block_copies([5, 6, 2])
    bb = pc.block_bytes
    assert len(copies) == 2 * LAYERS  # [5, 6] is one run, [2] another, in every layer
    base0 = pc.tensors[0].data_ptr()
    assert copies[0] == (base0 + 5 * bb, 0, 2 * bb) and copies[1] == (base0 + 2 * bb, 2 * bb, bb)
    assert copies[2][1] == 3 * bb  # layer 1 starts one layer of the record further on
    with pytest.raises(ValueError, match="outside"):
        pc.block_copies([NB])
    with pytest.raises(ValueError, match="outside the chunk"):
        pc.block_copies([0, 1], first=2)


def _records_at_one_distance(caches: PagedCaches, n: int, gap: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``n`` records in one buffer, ``gap`` elements of filler after each (as a pool lays out
    consecutive blocks); the filler is NaN so a stray write shows."""
    numel = int(torch.Size(caches.record_shape).numel())
    buf = torch.full((n * (numel + gap),), float("nan"))
    outs = [buf[i * (numel + gap) : i * (numel + gap) + numel].view(caches.record_shape) for i in range(n)]
    return buf, outs


@pytest.mark.parametrize("bpc", [1, 2])
@pytest.mark.parametrize("gap", [0, 5])
def test_gather_records_equals_a_gather_per_record_and_writes_nothing_else(bpc: int, gap: int) -> None:
    src = cpu_caches()
    caches = PagedCaches(src, BS, bpc)
    chunks = [[7, 1][:bpc], [2, 3][:bpc], [0, 6][:bpc]]
    buf, outs = _records_at_one_distance(caches, len(chunks), gap)
    gather_records(caches, chunks, outs)
    for bids, out in zip(chunks, outs, strict=True):
        want = torch.empty(caches.record_shape)
        gather_blocks(caches, bids, want)
        assert torch.equal(out, want)
    numel = int(torch.Size(caches.record_shape).numel())
    filler = torch.cat([buf[i * (numel + gap) + numel : (i + 1) * (numel + gap)] for i in range(len(chunks))])
    assert filler.numel() == gap * len(chunks) and bool(filler.isnan().all())  # the gaps were not written


def test_gather_records_fills_separate_and_descending_records() -> None:
    src = cpu_caches()
    caches = PagedCaches(src, BS, 2)
    chunks = [[4, 5], [1, 0]]
    outs = [torch.empty(caches.record_shape), torch.empty(caches.record_shape)]  # two allocations
    _, reversed_outs = _records_at_one_distance(caches, 2, 0)
    dims = len(caches.record_shape)
    strided = [torch.empty(caches.record_shape[::-1]).permute(*range(dims - 1, -1, -1)) for _ in range(2)]
    assert not strided[0].is_contiguous()
    # separate, in one buffer in descending order, or not contiguous (each gathered by torch)
    for records in (outs, reversed_outs[::-1], strided):
        gather_records(caches, chunks, records)
        for bids, out in zip(chunks, records, strict=True):
            for layer, t in enumerate(src.values()):
                assert torch.equal(out[layer, 0], t[bids[0]]) and torch.equal(out[layer, 1], t[bids[1]])


def test_gather_records_at_addresses_equals_gather_records() -> None:
    src = cpu_caches()
    caches = PagedCaches(src, BS, 2)
    chunks = [[4, 5], [1, 0], [7, 2]]
    want = [torch.full(caches.record_shape, float("nan")) for _ in chunks]
    gather_records(caches, chunks, want)
    got = [torch.full(caches.record_shape, float("nan")) for _ in chunks]
    gather_records_at(caches, chunks, [t.data_ptr() for t in got])
    for a, b in zip(want, got, strict=True):
        assert torch.equal(a, b)
    spare = torch.full(caches.record_shape, float("nan"))
    with pytest.raises(ValueError, match="outside"):
        gather_records_at(caches, [[0, 1], [2, NB]], [spare.data_ptr(), spare.data_ptr()])
    assert bool(spare.isnan().all())  # checked before any copy


@pytest.mark.parametrize("bpc", [1, 2])
@pytest.mark.parametrize("layout", ["consecutive", "gaps", "mixed", "outside"])
def test_gather_records_at_in_an_arena_equals_a_memmove_per_block(bpc: int, layout: str) -> None:
    """Runs of records at one distance in the arena go through ``index_select``; the rest
    through ``memmove``: the same bytes either way, and nothing between the records is written."""
    src = cpu_caches()
    caches = PagedCaches(src, BS, bpc)
    n = 5
    chunks = [[(3 * i + j) % NB for j in range(bpc)] for i in range(n)]
    size = caches.record_bytes
    arena = torch.full((n * 3 * size // 4,), float("nan"))  # float32: 4 bytes per element
    base = arena.data_ptr()
    elsewhere = torch.full((size // 4,), float("nan"))
    layouts: dict[str, list[int | None]] = {
        "consecutive": [i * size for i in range(n)],
        "gaps": [i * (size + 64) for i in range(n)],
        "mixed": [0, size, 2 * size, 5 * size, 7 * size + 128],
        "outside": [0, size, None, 4 * size, 5 * size],
    }
    offsets = layouts[layout]
    addresses = [elsewhere.data_ptr() if off is None else base + off for off in offsets]
    gather_records_at(caches, chunks, addresses, arena.view(torch.uint8))
    want = [torch.empty(caches.record_shape) for _ in chunks]
    gather_records(caches, chunks, want)
    flat = arena.view(torch.uint8)
    for off, w in zip(offsets, want, strict=True):
        got = elsewhere if off is None else flat[off : off + size].view(torch.float32)
        assert torch.equal(got, w.reshape(-1))
    written = sum(size for off in offsets if off is not None) // 4
    assert int(arena.isnan().logical_not().sum()) == written  # nothing outside the records


def test_gather_records_refuses_bad_arguments_before_any_copy() -> None:
    caches = PagedCaches(cpu_caches(), BS, 2)
    _, outs = _records_at_one_distance(caches, 2, 0)
    with pytest.raises(ValueError, match="2 chunks for 1 records"):
        gather_records(caches, [[0, 1], [2, 3]], outs[:1])
    with pytest.raises(ValueError, match=r"chunk_blocks\[1\]"):
        gather_records(caches, [[0, 1], [2]], outs)
    with pytest.raises(ValueError, match="block_ids"):
        gather_records(caches, [[0, 1], [2, NB]], outs)
    assert all(bool(o.isnan().all()) for o in outs)
    flash = PagedCaches(flash_caches(), BS, 2, layout=FLASH_ATTN_LAYOUT)
    with pytest.raises(ValueError, match="host caches"):
        gather_records(flash, [[0, 1]], [torch.empty(flash.record_shape)])


def _fill(sink: ReadSink, record: torch.Tensor) -> None:
    src = record.contiguous().view(torch.uint8).reshape(-1)
    at = 0
    for addr, n in sink.pieces:
        dst = torch.frombuffer(memoryview((ctypes.c_char * n).from_address(addr)), dtype=torch.uint8)
        dst.copy_(src[at : at + n])
        at += n


def test_a_read_sink_lands_a_record_in_the_blocks_and_the_rest_in_scratch() -> None:
    src = PagedCaches(cpu_caches(), BS, 3)
    record = torch.empty(src.record_shape)
    gather_blocks(src, [4, 1, 7], record)
    dst_caches = cpu_caches(fill=False)
    dst = PagedCaches(dst_caches, BS, 3)
    whole = dst.read_sink([2, 3, 0])
    assert whole.nbytes == dst.record_bytes and dst.scratch_bytes(3) == 0
    _fill(whole, record)
    for layer, t in enumerate(dst_caches.values()):
        assert torch.equal(t[[2, 3, 0]], record[layer])
    with pytest.raises(ValueError, match="scratch"):
        dst.read_sink([5], first=1)  # part of a chunk needs somewhere for the other blocks
    scratch = torch.full((dst.scratch_bytes(1),), 0xAB, dtype=torch.uint8)
    part = dst.read_sink([5], first=1, scratch=scratch)
    _fill(part, record)
    for layer, t in enumerate(dst_caches.values()):
        assert torch.equal(t[5], record[layer][1])
        assert not t[[1, 4, 6, 7]].any()  # nothing outside the named blocks
    assert not (scratch == 0xAB).all()  # the chunk's other blocks went there


def test_a_read_sink_refuses_pieces_that_do_not_add_up() -> None:
    buf = torch.zeros(16)
    with pytest.raises(ValueError, match="pieces"):
        ReadSink((16,), torch.float32, ((buf.data_ptr(), 32),))
    with pytest.raises(ValueError, match=r"pieces\[0\]"):
        ReadSink((16,), torch.float32, ((0, 64),))
    with pytest.raises(TypeError, match="dtype"):
        ReadSink((16,), "float32", ((buf.data_ptr(), 64),))  # type: ignore[arg-type]
    sink = ReadSink((16,), torch.float32, ((buf.data_ptr() + 32, 32), (buf.data_ptr(), 32)))
    assert sink.fits((16,), torch.float32) and not sink.fits((4, 4), torch.float32)
    assert coalesce([(100, 8), (108, 8), (200, 4)]) == [(100, 16), (200, 4)]


def test_flash_attention_layout_index_math_on_cpu_tensors() -> None:
    src = flash_caches()
    caches = PagedCaches(src, BS, 2, layout=FLASH_ATTN_LAYOUT)
    assert caches.record_shape == (LAYERS, 2, 2, BS, HEADS, HEAD)
    record = torch.empty(caches.record_shape)
    gather_blocks(caches, [6, 0], record)
    for layer, t in enumerate(src.values()):
        assert torch.equal(record[layer, 0, 0], t[0, 6])  # K of block 6
        assert torch.equal(record[layer, 1, 0], t[1, 6])  # V of block 6
        assert torch.equal(record[layer, :, 1], t[:, 0])
    dst = flash_caches(fill=False)
    scatter_blocks(PagedCaches(dst, BS, 2, layout=FLASH_ATTN_LAYOUT), [2, 3], record)
    for s, d in zip(src.values(), dst.values(), strict=True):
        assert torch.equal(d[:, 2], s[:, 6]) and torch.equal(d[:, 3], s[:, 0])
        assert not d[:, [0, 1, 4, 5, 6, 7]].any()


def test_a_cpu_shaped_cache_does_not_fit_the_flash_layout() -> None:
    with pytest.raises(ValueError, match="flash_attn"):
        PagedCaches(cpu_caches(), BS, 2, layout=FLASH_ATTN_LAYOUT)


def test_layers_that_differ_are_refused_naming_the_layer() -> None:
    caches = cpu_caches()
    caches["odd"] = torch.zeros(NB, HEADS, BS, 2 * HEAD, dtype=torch.float16)
    with pytest.raises(ValueError, match="odd"):
        PagedCaches(caches, BS, 2)


def test_a_cache_whose_block_size_differs_from_vllms_is_refused() -> None:
    with pytest.raises(ValueError, match="block size"):
        PagedCaches(cpu_caches(), BS * 2, 2)


def test_unsupported_layouts_and_non_tensors_are_refused() -> None:
    with pytest.raises(ValueError, match="unsupported"):
        PagedCaches({"x": torch.zeros(NB, BS, HEAD)}, BS, 2)
    with pytest.raises(TypeError, match="kv_caches"):
        PagedCaches({"x": [1, 2]}, BS, 2)  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="non-empty"):
        PagedCaches({}, BS, 2)


def test_block_ids_outside_the_cache_are_refused_before_any_copy() -> None:
    src = cpu_caches()
    caches = PagedCaches(src, BS, 2)
    record = torch.zeros(caches.record_shape)
    with pytest.raises(ValueError, match="block_ids"):
        gather_blocks(caches, [NB], record)
    with pytest.raises(ValueError, match="block_ids"):
        scatter_blocks(caches, [-1], record)


def test_a_record_of_another_shape_or_dtype_is_refused() -> None:
    caches = PagedCaches(cpu_caches(), BS, 2)
    with pytest.raises(ValueError, match="record"):
        scatter_blocks(caches, [0], torch.zeros(LAYERS, 1, HEADS, BS, 2 * HEAD))
    with pytest.raises(ValueError, match="record"):
        scatter_blocks(caches, [0], torch.zeros(caches.record_shape, dtype=torch.float64))
    with pytest.raises(ValueError, match="outside the chunk"):
        scatter_blocks(caches, [0, 1], torch.zeros(caches.record_shape), first=1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_flash_attention_round_trip_through_pinned_host_records_on_a_side_stream() -> None:
    dev = torch.device("cuda")
    src = {k: v.to(dev) for k, v in flash_caches().items()}
    caches = PagedCaches(src, BS, 2)
    assert caches.layout is FLASH_ATTN_LAYOUT
    stream = torch.cuda.Stream(dev)
    record = torch.empty(caches.record_shape, pin_memory=True)
    gather_blocks(caches, [6, 0], record, stream)
    stream.synchronize()
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    scatter_blocks(PagedCaches(dst, BS, 2), [2, 3], record, stream=stream)
    for s, d in zip(src.values(), dst.values(), strict=True):
        assert torch.equal(d[:, 2], s[:, 6]) and torch.equal(d[:, 3], s[:, 0])

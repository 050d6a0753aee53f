"""The backend inside SGLang's real factory and host pools, on the CPU tier."""

from __future__ import annotations

from typing import Any

import pytest
import torch

LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")


def hashes(n: int, salt: str = "") -> list[str]:
    """SGLang-style page hashes (SHA-256 hex) chained like SGLang's own."""
    from sglang.srt.mem_cache.utils import get_hash_str

    out: list[str] = []
    prior = None
    for i in range(n):
        prior = get_hash_str([i, 7, 11, *salt.encode()], prior)
        out.append(prior)
    return out


def slots(pool: Any, pages: list[int]) -> torch.Tensor:
    """host_indices for ``pages`` (page_size consecutive slots each), as SGLang passes them."""
    p = pool.page_size
    return torch.cat([torch.arange(q * p, (q + 1) * p, dtype=torch.int64) for q in pages])


def test_sglang_factory_builds_our_backend(cpu_config: dict[str, Any], sgl: Any) -> None:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    from lmcache_async.integration.sglang import LMCacheHiCacheStorage

    backend = StorageBackendFactory.create_backend("dynamic", sgl.storage_config(cpu_config), None)
    try:
        assert type(backend) is LMCacheHiCacheStorage
        assert isinstance(backend, HiCacheStorage)
        assert backend.manager.tier_names == ["cpu"]
        assert backend.config.max_local_cpu_size == pytest.approx(1 / 16)
    finally:
        backend.close()


def test_backends_of_one_config_share_one_manager(make_backend: Any, cpu_config: dict[str, Any]) -> None:
    a = make_backend(cpu_config)
    b = make_backend(cpu_config)
    c = make_backend({**cpu_config, "max_local_cpu_size": 1 / 32})
    assert a.manager is b.manager
    assert c.manager is not a.manager
    a.close()
    assert not b.manager.closed


def test_calls_before_the_pool_is_registered_are_misses(make_backend: Any, cpu_config: dict[str, Any]) -> None:
    backend = make_backend(cpu_config)
    assert backend.batch_exists(hashes(2)) == 0
    assert backend.batch_set_v1(hashes(2), torch.arange(32)) == [False, False]
    assert backend.stats()["unregistered_calls"] == 2


@pytest.mark.parametrize("layout", LAYOUTS)
def test_pages_round_trip_bit_exact(
    make_backend: Any, make_pool: Any, cpu_config: dict[str, Any], layout: str, sgl: Any
) -> None:
    pool = make_pool(layout, page_num=16)
    sgl.fill_random(pool, seed=1)
    backend = make_backend(cpu_config, pool)
    keys = hashes(5, layout)
    src_pages = [3, 9, 1, 12, 6]
    before = [sgl.page_bytes(pool, q * pool.page_size) for q in src_pages]
    assert backend.batch_set_v1(keys, slots(pool, src_pages)) == [True] * 5
    pool.kv_buffer.zero_()
    dst_pages = [0, 2, 4, 5, 7]
    assert backend.batch_get_v1(keys, slots(pool, dst_pages)) == [True] * 5
    for want, q in zip(before, dst_pages, strict=True):
        assert torch.equal(sgl.page_bytes(pool, q * pool.page_size), want)
    untouched = sgl.page_bytes(pool, 8 * pool.page_size)
    assert not untouched.any()  # pages not named are never written


def test_batch_exists_is_the_stored_prefix(
    make_backend: Any, make_pool: Any, cpu_config: dict[str, Any], sgl: Any
) -> None:
    pool = make_pool("page_first", page_num=8)
    sgl.fill_random(pool, seed=2)
    backend = make_backend(cpu_config, pool)
    keys = hashes(5, "prefix")
    assert backend.batch_exists(keys) == 0
    assert backend.batch_set_v1([keys[0], keys[1], keys[3], keys[4]], slots(pool, [0, 1, 3, 4])) == [True] * 4
    assert backend.batch_exists(keys) == 2  # keys[2] is a gap: it stops the prefix
    assert backend.exists(keys[3]) and not backend.exists(keys[2])
    assert backend.batch_exists([]) == 0


def test_a_miss_leaves_its_page_alone(make_backend: Any, make_pool: Any, cpu_config: dict[str, Any], sgl: Any) -> None:
    pool = make_pool("layer_first", page_num=8)
    sgl.fill_random(pool, seed=3)
    backend = make_backend(cpu_config, pool)
    keys = hashes(3, "miss")
    assert backend.batch_set_v1([keys[0], keys[2]], slots(pool, [0, 2])) == [True, True]
    page1 = sgl.page_bytes(pool, 1 * pool.page_size)
    assert backend.batch_get_v1(keys, slots(pool, [5, 1, 6])) == [True, False, True]
    assert torch.equal(sgl.page_bytes(pool, 1 * pool.page_size), page1)
    assert backend.stats()["get_misses"] == 1


def test_layouts_with_another_byte_order_never_read_each_others_pages(
    make_backend: Any, make_pool: Any, cpu_config: dict[str, Any], sgl: Any
) -> None:
    first = make_pool("layer_first", page_num=4)
    sgl.fill_random(first, seed=4)
    writer = make_backend(cpu_config, first)
    keys = hashes(2, "orders")
    assert writer.batch_set_v1(keys, slots(first, [0, 1])) == [True, True]
    direct = make_pool("page_first_direct", page_num=4)
    reader = make_backend(cpu_config, direct)  # same byte order per page: shares the records
    assert reader.batch_get_v1(keys, slots(direct, [2, 3])) == [True, True]
    assert torch.equal(sgl.page_bytes(direct, 2 * direct.page_size), sgl.page_bytes(first, 0))
    other = make_pool("page_first", page_num=4)
    stranger = make_backend(cpu_config, other)
    assert stranger.batch_exists(keys) == 0
    assert stranger.batch_get_v1(keys, slots(other, [0, 1])) == [False, False]


def test_tp_ranks_have_their_own_pages_and_mla_one_writer(
    make_backend: Any, make_pool: Any, cpu_config: dict[str, Any], sgl: Any
) -> None:
    pool = make_pool("page_first", page_num=4)
    sgl.fill_random(pool, seed=5)
    keys = hashes(1, "ranks")
    rank0 = make_backend(cpu_config, pool, tp_rank=0, tp_size=2)
    rank1 = make_backend(cpu_config, pool, tp_rank=1, tp_size=2)
    assert rank0.batch_set_v1(keys, slots(pool, [0])) == [True]
    assert rank1.batch_exists(keys) == 0
    # MLA: every rank reads one record per page; only the storage writer (rank 0) writes it.
    mla_reader = make_backend(cpu_config, pool, tp_rank=1, tp_size=2, is_mla_model=True)
    assert not mla_reader.is_writer
    assert mla_reader.batch_set_v1(keys, slots(pool, [0])) == [False]
    assert mla_reader.stats()["set_not_writer"] == 1


def test_a_page_already_stored_is_not_copied_again(
    make_backend: Any, make_pool: Any, cpu_config: dict[str, Any], sgl: Any
) -> None:
    pool = make_pool("page_head", page_num=4)
    sgl.fill_random(pool, seed=6)
    backend = make_backend(cpu_config, pool)
    keys = hashes(2, "again")
    assert backend.batch_set_v1(keys, slots(pool, [0, 1])) == [True, True]
    assert backend.batch_set_v1(keys, slots(pool, [2, 3])) == [True, True]
    stats = backend.stats()
    assert stats["set_stored"] == 2 and stats["set_already_present"] == 2


def test_tensor_interface_shares_records_with_v1(
    make_backend: Any, make_pool: Any, cpu_config: dict[str, Any], sgl: Any
) -> None:
    pool = make_pool("page_first", page_num=4)
    sgl.fill_random(pool, seed=7)
    backend = make_backend(cpu_config, pool)
    keys = hashes(2, "v0")
    # SGLang's generic path: set(key, get_data_page(index)), get(key, dummy flat page).
    assert backend.batch_set(keys, [pool.get_data_page(0), pool.get_data_page(pool.page_size)])
    want = sgl.page_bytes(pool, pool.page_size)
    pool.kv_buffer.zero_()
    assert backend.batch_get_v1(keys[1:], slots(pool, [3])) == [True]
    assert torch.equal(sgl.page_bytes(pool, 3 * pool.page_size), want)
    target = pool.get_dummy_flat_data_page()
    got = backend.get(keys[1], target)
    assert got is target and torch.equal(got.view(torch.uint8), want)
    fresh = backend.get(keys[1])
    assert fresh is not None and torch.equal(fresh.contiguous().view(torch.uint8), want)
    assert backend.get(hashes(1, "absent")[0]) is None
    assert backend.exists(keys[0])


def test_wiring_mistakes_raise_naming_the_argument(
    make_backend: Any, make_pool: Any, cpu_config: dict[str, Any]
) -> None:
    pool = make_pool("layer_first", page_num=4)
    backend = make_backend(cpu_config, pool)
    keys = hashes(2, "wiring")
    with pytest.raises(ValueError, match="host_indices"):
        backend.batch_set_v1(keys, torch.arange(pool.page_size))  # one page of slots for two keys
    with pytest.raises(ValueError, match="host_indices"):
        backend.batch_get_v1(keys[:1], torch.arange(1, pool.page_size + 1))  # not on a page boundary
    with pytest.raises(ValueError, match="host_indices"):
        backend.batch_get_v1(keys[:1], torch.arange(pool.page_size).flip(0))  # not consecutive
    with pytest.raises(ValueError, match="host_indices"):
        backend.batch_get_v1(keys[:1], torch.arange(100 * pool.page_size, 101 * pool.page_size))
    with pytest.raises(TypeError, match="page keys"):
        backend.batch_exists([b"bytes-key"])
    with pytest.raises(ValueError, match="values"):
        backend.set(keys[0], torch.zeros(3, dtype=pool.dtype))


def test_unsupported_pool_is_refused_at_registration(make_backend: Any, cpu_config: dict[str, Any]) -> None:
    class NotAPool:
        kv_buffer = None

    backend = make_backend(cpu_config)
    with pytest.raises(TypeError, match="mem_pool_host"):
        backend.register_mem_pool_host(NotAPool())


def test_after_close_calls_are_misses(make_backend: Any, make_pool: Any, cpu_config: dict[str, Any]) -> None:
    pool = make_pool("page_first", page_num=4)
    backend = make_backend(cpu_config, pool)
    keys = hashes(1, "closed")
    assert backend.batch_set_v1(keys, slots(pool, [0])) == [True]
    backend.close()
    assert backend.batch_exists(keys) == 0
    assert backend.batch_get_v1(keys, slots(pool, [1])) == [False]
    assert backend.stats()["closed_calls"] == 2


def test_unknown_extra_keys_are_dropped_and_factory_keys_ignored(cpu_config: dict[str, Any], sgl: Any) -> None:
    from lmcache_async.integration.sglang.settings import load_hicache_config

    cfg = load_hicache_config({**sgl.FACTORY_KEYS, **cpu_config, "file_storage_path": "/nowhere", "namespace": "m"})
    assert cfg.max_local_cpu_size == pytest.approx(1 / 16)
    with pytest.raises(ValueError, match="max_local_cpu_size"):
        load_hicache_config({"max_local_cpu_size": -1})

"""The disk tier driven by a real StorageManager: fall-through from the CPU tier, promotion
through the staging area, restart of the whole manager, and the registry factory."""

from __future__ import annotations

import logging

import pytest
import torch

from lmcache_async import LMCacheEngineConfig, StorageManager
from lmcache_async.disk.tier import DiskBackend, create

from .disk_testkit import dir_bytes, entry_files, key

MiB = 1 << 20


def _wait_ready(sm: StorageManager) -> DiskBackend:
    be = sm.backend("disk")
    assert isinstance(be, DiskBackend)
    sm.loop_thread.run_sync(be.wait_ready(), timeout=30)
    return be


def _key_1_only_on_disk(make_manager, tmp_path) -> tuple[StorageManager, torch.Tensor]:
    """A manager whose CPU tier holds one 1 MiB entry, after key 1 (returned bytes) went to
    disk and left the CPU tier for key 2."""
    sm = make_manager(
        max_local_cpu_size=1.5 / 1024,  # room for one 1 MiB entry
        local_disk=str(tmp_path / "disk"),
        max_local_disk_size=0.05,
    )
    a = torch.randn(MiB // 4)
    assert sm.put_sync(key(1), a)
    sm.flush_sync(timeout=30)
    assert sm.put_sync(key(2), torch.randn(MiB // 4))  # evicts key 1 from the CPU tier
    sm.flush_sync(timeout=30)
    assert key(1) not in sm.backend("cpu")._index
    return sm, a


def _assert_key_1_reads(sm: StorageManager, expected: torch.Tensor) -> None:
    got = sm.get_sync(key(1))
    assert got is not None
    try:
        assert torch.equal(got.tensor, expected)
    finally:
        got.ref_count_down()


def test_entry_that_left_the_cpu_tier_is_served_from_disk(make_manager, tmp_path):
    sm, a = _key_1_only_on_disk(make_manager, tmp_path)
    _assert_key_1_reads(sm, a)
    disk = sm.stats()["tiers"]["disk"]
    assert disk["hits"] == 1 and disk["corrupt"] == 0


def test_put_of_a_key_only_the_disk_holds_is_stored_in_the_cpu_tier_and_the_disk_keeps_its_record(
    make_manager, tmp_path
):
    """The disk's "present" is not trusted for a put (it may be a damaged record): the CPU tier
    takes the entry again, and the write-through leaves the disk's intact record as it was."""
    sm, a = _key_1_only_on_disk(make_manager, tmp_path)
    stored = sm.stats()["tiers"]["disk"]["stored"]
    assert sm.put_sync(key(1), a.clone())
    assert key(1) in sm.backend("cpu")._index  # type: ignore[union-attr]
    sm.flush_sync(timeout=30)
    assert sm.stats()["tiers"]["disk"]["stored"] == stored  # not written again
    assert sm.backend("cpu").remove_nowait(key(1))  # type: ignore[union-attr]
    _assert_key_1_reads(sm, a)
    assert sm.stats()["tiers"]["disk"]["hits"] == 1


def test_a_full_cpu_tier_does_not_block_reads_from_disk(make_manager, tmp_path):
    sm = make_manager(
        max_local_cpu_size=1.5 / 1024,
        local_disk=str(tmp_path / "disk"),
        max_local_disk_size=0.05,
    )
    a = torch.randn(MiB // 4)
    b = torch.randn(MiB // 4)
    sm.put_sync(key(1), a)
    sm.flush_sync(timeout=30)
    sm.put_sync(key(2), b)
    sm.flush_sync(timeout=30)
    held = sm.get_sync(key(2))  # a reader holds the only CPU block: nothing can be evicted
    assert held is not None
    got = sm.get_sync(key(1))  # lands in the staging area instead
    assert got is not None
    try:
        assert got.allocator is not sm.pool
        assert torch.equal(got.tensor, a)
    finally:
        got.ref_count_down()
        held.ref_count_down()


def test_restart_finds_all_1000_entries_with_their_bytes_and_budget(small_config, metadata, tmp_path):
    cfg = small_config(local_disk=str(tmp_path / "disk"), max_local_disk_size=0.05)
    data = [torch.full((1024,), float(i)) + torch.arange(1024) for i in range(1000)]
    keys = [key(i) for i in range(1000)]
    with StorageManager(cfg, metadata) as sm:
        assert all(sm.batched_put_sync(keys, data))
        sm.flush_sync(timeout=60)
        assert sm.stats()["tiers"]["disk"]["writes"] == 1000
    assert len(entry_files(tmp_path / "disk")) == 1000
    with StorageManager(cfg, metadata) as sm2:
        be = _wait_ready(sm2)
        assert be.stats()["entries"] == 1000
        found = 0
        for start in range(0, 1000, 100):
            got = sm2.batched_get_sync(keys[start : start + 100])
            for i, obj in enumerate(got, start):
                assert obj is not None, i
                assert torch.equal(obj.tensor, data[i])
                obj.ref_count_down()
                found += 1
        assert found == 1000
        st = sm2.stats()["tiers"]["disk"]
        assert st["bytes"] == dir_bytes(tmp_path / "disk") and st["files"] == 1000
        assert be.accounted() == (dir_bytes(tmp_path / "disk"), 1000)


def test_zero_size_with_a_directory_builds_no_tier_and_says_why(make_manager, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="lmcache_async.disk.tier"):
        sm = make_manager(local_disk=str(tmp_path / "disk"), max_local_disk_size=0)
    assert "disk" not in sm.tier_names
    assert any("max_local_disk_size" in r.getMessage() for r in caplog.records)


def test_factory_passes_the_configuration_through(backend_context_factory, tmp_path):
    cfg = LMCacheEngineConfig.from_defaults(
        local_disk=f"file://{tmp_path}/disk", max_local_disk_size=0.5, local_disk_fsync="data"
    )
    be = create(backend_context_factory(cfg))
    assert isinstance(be, DiskBackend)
    assert be.root == str(tmp_path / "disk") and be.fsync == "data"
    assert be.budget_bytes == 1 << 29
    assert create(backend_context_factory(LMCacheEngineConfig.from_defaults())) is None


@pytest.fixture
def backend_context_factory():
    import asyncio
    import concurrent.futures

    from lmcache_async.metadata import LMCacheEngineMetadata
    from lmcache_async.tiers import BackendContext

    loop = asyncio.new_event_loop()
    ex = concurrent.futures.ThreadPoolExecutor(1)

    def make(cfg: LMCacheEngineConfig) -> BackendContext:
        return BackendContext(
            config=cfg,
            metadata=LMCacheEngineMetadata("m"),
            cache_name="t",
            loop=loop,
            executor=ex,
            staging=lambda *a: None,
            staging_pool=None,
            pool=None,
        )

    yield make
    ex.shutdown()
    loop.close()

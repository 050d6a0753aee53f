"""Disk trouble: a full filesystem (a small tmpfs), a read-only filesystem and directory, record
files nobody may read. Writes stop and are counted, reads go on, nothing crashes, and writes
resume when the trouble is gone.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from lmcache_async import LMCacheEngineConfig, LMCacheEngineMetadata, StorageManager

from . import chaos_worker
from .chaos_support import chaos_key, files_below, identity, payload, same_payload
from .conftest import remount

ENTRY = 64 << 10


def _manager(tier: str, where: Path) -> StorageManager:
    extras: dict[str, dict[str, Any]] = {
        "disk": {"local_disk": str(where), "max_local_disk_size": 1.0},  # far beyond the filesystem
        "fs": {"remote_url": f"fs://{where}"},
        "nixl": {"nixl_path": str(where), "nixl_backend": "POSIX", "nixl_max_size": 1.0},
    }
    extra = extras[tier]
    cfg = LMCacheEngineConfig.from_defaults(
        max_local_cpu_size=2 / 1024, staging_size=2 / 1024, remote_timeout_s=10, blocking_timeout_secs=30, **extra
    )
    return StorageManager(cfg, LMCacheEngineMetadata("trouble"), name="trouble")


TIER_NAME = {"disk": "disk", "fs": "remote", "nixl": "nixl"}


def _evict(sm: StorageManager) -> None:
    assert sm.pool is not None
    block = sm.allocate((sm.pool.capacity,), torch.uint8)
    if block is not None:
        block.ref_count_down()


def _records(where: Path) -> int:
    return sum(1 for p in files_below(where) if p.name.endswith((".lmc", ".rec", ".lmcr")))


def _write_failures(sm: StorageManager, tier: str) -> int:
    st = sm.stats()["tiers"][TIER_NAME[tier]]
    return int(st["write_failures"]) + int(st.get("write_errors", 0))


def _read_back(sm: StorageManager, ids: list[int]) -> int:
    hits = 0
    for i in ids:
        _evict(sm)
        obj = sm.get_sync(chaos_key(i))
        if obj is not None:
            with obj:
                assert same_payload(obj, i, ENTRY), identity(obj)
            hits += 1
    return hits


def _fill_until_refused(sm: StorageManager, tier: str, start: int, limit: int) -> tuple[list[int], int]:
    """Put entries until the tier refuses writes; (ids stored on the tier, next id)."""
    ids: list[int] = []
    i = start
    before = _write_failures(sm, tier)
    while i < start + limit:
        for j in range(i, i + 8):
            assert sm.put_sync(chaos_key(j), payload(j, ENTRY)), "a put failed although the CPU tier takes it"
        sm.flush_sync(timeout=60)
        i += 8
        if _write_failures(sm, tier) > before:
            break
    return ids, i


def _wait_resumed(sm: StorageManager, tier: str, where: Path, start: int, deadline_s: float = 60) -> float:
    t0 = time.monotonic()
    i = start
    n0 = _records(where)
    while time.monotonic() - t0 < deadline_s:
        sm.put_sync(chaos_key(i), payload(i, ENTRY))
        sm.flush_sync(timeout=60)
        if _records(where) > n0:
            return time.monotonic() - t0
        i += 1
        time.sleep(0.25)
    pytest.fail(f"{tier}: writes did not resume within {deadline_s}s: {sm.stats()['tiers']}")


@pytest.mark.parametrize("tier", ["disk", "fs", "nixl"])
def test_full_filesystem(tier, small_fs, request, figures):
    if tier == "nixl":
        request.getfixturevalue("need_nixl")
    where = small_fs / "cache"
    filler = small_fs / "filler"
    filler.write_bytes(bytes(5 << 20))  # 5 of 8 MiB: the cache runs out after ~3 MiB
    sm = _manager(tier, where)
    try:
        _, nxt = _fill_until_refused(sm, tier, 0, 400)
        failures = _write_failures(sm, tier)
        assert failures > 0, f"{tier}: writes never failed on a full filesystem: {sm.stats()['tiers']}"
        on_tier = [i for i in range(nxt) if _stored(sm, tier, i)]
        assert on_tier, "nothing reached the tier before it filled up"
        # Reads go on, byte-exact.
        assert _read_back(sm, on_tier[:20]) == len(on_tier[:20])
        # More puts while full: accepted by the CPU tier, refused below, nothing raises.
        for j in range(nxt, nxt + 16):
            assert sm.put_sync(chaos_key(j), payload(j, ENTRY))
        sm.flush_sync(timeout=60)
        filler.unlink()  # space returns
        resumed = _wait_resumed(sm, tier, where, nxt + 100)
        figures("disk trouble: full filesystem", trials=1, write_failures_counted=failures,
                reads_while_full=min(20, len(on_tier)), crashes=0)  # fmt: skip
        figures(f"disk trouble: full filesystem: {tier}", write_failures=failures,
                max_resume_s=round(resumed, 1))  # fmt: skip
    finally:
        sm.close_sync()


def _stored(sm: StorageManager, tier: str, i: int) -> bool:
    backend = sm.backend(TIER_NAME[tier])
    assert backend is not None
    return bool(sm.loop_thread.run_sync(backend.contains(chaos_key(i)), timeout=30))


@pytest.mark.parametrize("tier", ["disk", "fs"])
def test_read_only_filesystem(tier, small_fs, figures):
    """The filesystem turns read-only under a running manager where the kernel allows it (the
    disk tier keeps its budget file mapped for writing, which makes a live remount fail with
    EBUSY: it gets a manager started on the read-only filesystem instead)."""
    where = small_fs / "cache"
    sm = _manager(tier, where)
    try:
        for i in range(20):
            sm.put_sync(chaos_key(i), payload(i, ENTRY))
        sm.flush_sync(timeout=60)
        if tier == "disk":
            sm.close_sync()
        before = 0 if tier == "disk" else _write_failures(sm, tier)
        remount(small_fs, "ro")
        try:
            if tier == "disk":
                sm = _manager(tier, where)  # a process starting on a read-only cache directory
            for i in range(100, 124):
                assert sm.put_sync(chaos_key(i), payload(i, ENTRY))
            sm.flush_sync(timeout=60)
            failures = _write_failures(sm, tier) - before
            assert failures > 0, f"{tier}: writes to a read-only filesystem were not counted: {sm.stats()['tiers']}"
            assert _read_back(sm, list(range(20))) == 20  # reads go on
            if tier == "disk":
                sm.close_sync()
        finally:
            remount(small_fs, "rw")
        if tier == "disk":
            sm = _manager(tier, where)
        resumed = _wait_resumed(sm, tier, where, 300)
        figures("disk trouble: read-only filesystem", trials=1, write_failures_counted=failures, crashes=0)
        figures(f"disk trouble: read-only filesystem: {tier}", max_resume_s=round(resumed, 1))
    finally:
        sm.close_sync()


def test_permission_denied_files_and_read_only_directory(tmp_path, figures):
    """Run in a process where permission bits apply (root drops CAP_DAC_OVERRIDE)."""
    pytest.importorskip("lmcache_async.disk.tier")
    work = tmp_path / "perm"
    work.mkdir()
    cmd = [sys.executable, chaos_worker.__file__, "permissions", str(work)]
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root without setpriv (util-linux): permission bits cannot be made to apply")
        drop = "-dac_override,-dac_read_search"
        cmd = [setpriv, f"--inh-caps={drop}", f"--bounding-set={drop}", *cmd]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    if "skip" in out:
        pytest.skip(out["skip"])
    assert not out["errors"], out
    assert out["unreadable_hits"] == 0 and out["unreadable_misses"] == 10, out
    assert out["readable_hits"] == 20 and out["read_errors"] >= 10, out
    assert out["restored_hits"] == 10, "unreadable entries must be kept, not deleted"
    assert out["ro_write_errors"] > 0 and out["ro_files_written"] == 0, out
    assert out["ro_readable_hits"] == 20, out
    assert out["resumed_after_s"] is not None, out
    figures("disk trouble: permission denied", unreadable_files=10, read_errors_counted=out["read_errors"],
            wrong_bytes=0, read_only_write_errors=out["ro_write_errors"],
            max_resume_s=round(out["resumed_after_s"], 1))  # fmt: skip


def test_one_burst_of_failed_writes_backs_off_once(small_fs):
    pytest.importorskip("lmcache_async.disk.tier")
    sm = _manager("disk", small_fs / "cache")
    try:
        assert sm.put_sync(chaos_key(0), payload(0, 4096))
        sm.flush_sync(timeout=60)
        with open(small_fs / "filler", "wb") as f:  # fill the filesystem to the last byte
            try:
                while True:
                    f.write(bytes(64 << 10))
                    f.flush()
            except OSError:
                pass
        from concurrent.futures import ThreadPoolExecutor

        from lmcache_async.disk.layout import key_digest
        from lmcache_async.disk.tier import DiskBackend
        from lmcache_async.memory import PoolAllocator

        disk = sm.backend("disk")
        assert isinstance(disk, DiskBackend)
        pool = PoolAllocator(1 << 20, name="burst", pretouch=False)
        block = pool.allocate((64 << 10,), torch.uint8)
        assert block is not None
        keys = [chaos_key(i).to_string() for i in range(1, 17)]
        with ThreadPoolExecutor(8) as ex:  # one burst: 16 writes in flight on a full disk
            list(ex.map(lambda k: disk.store.write(key_digest(k), k, block), keys))
        block.ref_count_down()
        failures = disk.stats()["write_errors"]
        assert failures >= 3, f"only {failures} writes failed on a full disk"
        backoff = disk.store._w_backoff  # the wait before writes are tried again
        assert backoff <= 2 * disk.store._retry_base, f"{failures} failures in one burst set a {backoff:.0f} s back-off"
    finally:
        sm.close_sync()

"""Every record-file store (disk tier, ``fs://``, NIXL POSIX) names, ignores and reaps its
temporary files the same way (:mod:`lmcache_async.records.files`), through a real manager."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from lmcache_async import LMCacheEngineConfig, LMCacheEngineMetadata, StorageManager
from lmcache_async.errors import BackendUnavailableError
from lmcache_async.nixl.agent import load_nixl
from lmcache_async.records import files as record_files
from lmcache_async.records.files import HOST_TAG, parse_temp_name, process_start_time, temp_name
from lmcache_async.testing import make_key


def _nixl_missing() -> str | None:
    try:
        load_nixl()
    except BackendUnavailableError as exc:
        return str(exc)
    return None


NIXL_MISSING = _nixl_missing()
STORES = [
    pytest.param("disk", ".lmc", id="disk"),
    pytest.param("fs", ".rec", id="fs"),
    pytest.param(
        "nixl",
        ".lmcr",
        id="nixl",
        marks=[pytest.mark.nixl, pytest.mark.skipif(NIXL_MISSING is not None, reason=f"NIXL: {NIXL_MISSING}")],
    ),
]


def _config(store: str, root: Path) -> LMCacheEngineConfig:
    tiers: dict[str, dict[str, Any]] = {
        "disk": {"local_disk": str(root), "max_local_disk_size": 0.25},
        "fs": {"remote_url": f"fs://{root}"},
        "nixl": {"nixl_path": str(root), "nixl_backend": "POSIX", "nixl_max_size": 0.25},
    }
    tier = tiers[store]
    return LMCacheEngineConfig.from_defaults(max_local_cpu_size=1 / 64, staging_size=1 / 64, **tier)


def _manager(store: str, root: Path) -> StorageManager:
    return StorageManager(_config(store, root), LMCacheEngineMetadata("record-files"), name="record-files")


def _files(root: Path, suffix: str) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name.endswith(suffix))


def _temps(root: Path) -> list[Path]:
    return _files(root, ".tmp")


def _dead_writer() -> tuple[int, int]:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    start = process_start_time(p.pid) or 0
    p.wait(10)
    return p.pid, start


def _store_one(store: str, root: Path, suffix: str) -> tuple[Path, bytes]:
    """Store key 1 through a manager; the record file it published and its bytes."""
    with _manager(store, root) as sm:
        assert sm.put_sync(make_key(1), torch.arange(256, dtype=torch.float32))
        sm.flush_sync(timeout=30)
    (record,) = _files(root, suffix)
    return record, record.read_bytes()


def _wait_gone(paths: list[Path], deadline_s: float = 60.0) -> bool:
    """The ``fs://`` tier reaps in the background after its start: wait (bounded) for it."""
    end = time.monotonic() + deadline_s
    while any(p.exists() for p in paths):
        if time.monotonic() > end:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.parametrize(("store", "suffix"), STORES)
def test_a_published_record_leaves_no_temporary_file(store: str, suffix: str, tmp_path: Path) -> None:
    _store_one(store, tmp_path, suffix)
    assert _temps(tmp_path) == []


@pytest.mark.parametrize(("store", "suffix"), STORES)
def test_an_orphaned_temp_of_a_dead_writer_is_reaped_on_start(store: str, suffix: str, tmp_path: Path) -> None:
    record, data = _store_one(store, tmp_path, suffix)
    pid, start = _dead_writer()
    # What a writer killed before publishing leaves, in the shared form and in the store's older one.
    orphan = record.parent / f".{record.name}.{HOST_TAG}.{pid}.{start}.0badcafe.tmp"
    older = (
        record.parent
        / {
            "disk": f".{record.stem}.{HOST_TAG}.{pid}.{start}.0badcafe.tmp",
            "fs": f".{record.name}.{record_files._LEGACY_FS_HOST}.{pid}.deadbeef.tmp",
            "nixl": f"{record.stem}.{pid}.tmp",
        }[store]
    )
    orphan.write_bytes(data[: len(data) // 2])
    older.write_bytes(data)
    assert parse_temp_name(orphan.name) is not None
    with _manager(store, tmp_path) as sm:
        assert sm.contains_sync(make_key(1))
        assert _wait_gone([orphan, older])
    assert _files(tmp_path, suffix) == [record]


@pytest.mark.parametrize(("store", "suffix"), STORES)
def test_a_half_written_temp_is_never_read_as_a_record(store: str, suffix: str, tmp_path: Path) -> None:
    record, data = _store_one(store, tmp_path, suffix)
    half = record.parent / temp_name(record.name)  # a live writer (this process) mid-write
    half.write_bytes(data[: len(data) // 2])
    whole = record.parent / temp_name(record.name)  # written but not yet published
    whole.write_bytes(data)
    record.unlink()
    with _manager(store, tmp_path) as sm:
        assert not sm.contains_sync(make_key(1))
        assert sm.get_sync(make_key(1)) is None
        assert sm.put_sync(make_key(1), torch.ones(256))  # the key can be stored anew
        sm.flush_sync(timeout=30)
        got = sm.get_sync(make_key(1))
        assert got is not None
        try:
            assert torch.equal(got.tensor.view(torch.float32)[:256], torch.ones(256))
        finally:
            got.ref_count_down()
    if store != "nixl":  # its directory is locked by the tier: every temp there is a leftover
        assert half.exists() and whole.exists(), "a live writer's temporary files were reaped"


@pytest.mark.parametrize(("store", "suffix"), [p for p in STORES if p.id != "nixl"])
def test_a_live_writers_temp_survives_a_restart(store: str, suffix: str, tmp_path: Path) -> None:
    record, data = _store_one(store, tmp_path, suffix)
    live = record.parent / temp_name(record.name)
    live.write_bytes(data)
    t = time.time() - 7200
    os.utime(live, (t, t))  # old, but its writer (this process) is alive
    with _manager(store, tmp_path) as sm:
        assert sm.contains_sync(make_key(1))
        sm.flush_sync(timeout=30)
    assert live.exists()

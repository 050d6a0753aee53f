"""Storage errors on real filesystems: a full tmpfs (ENOSPC), a read-only remount (EROFS) and an
immutable directory (EPERM). Writes stop (counted), reads go on, nothing crashes, writes resume
when the cause goes away. These tests need root (mount, chattr) and are skipped without it."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from .disk_testkit import dir_bytes, entry_files, key, put_entry, same_bytes, tmp_files

ENTRY = 256 << 10


def _run(*cmd: str) -> bool:
    try:
        return subprocess.run(cmd, capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs (skipped where it cannot be mounted)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if os.geteuid() != 0 or not _run("mount", "-t", "tmpfs", "-o", "size=2m,mode=0700", "tmpfs", str(mnt)):
        pytest.skip("needs root to mount a small tmpfs")
    try:
        yield mnt
    finally:
        if not _run("umount", str(mnt)):
            _run("umount", "-l", str(mnt))


async def _put(be, pool, i: int, nbytes: int = ENTRY) -> bool:
    return await put_entry(be, pool, i, nbytes)


async def _retry_until(pred, timeout: float = 10.0) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        if await pred():
            return True
        await asyncio.sleep(0.02)
    return False


async def test_disk_full_stops_writes_keeps_reads_and_resumes(make_disk, pool, small_fs):
    # A back-off long enough that the refused put below falls inside it even on a slow host.
    be = await make_disk(small_fs / "d", budget_bytes=1 << 30, write_retry_s=0.5, write_retry_max_s=1.0)
    stored = []
    for i in range(20):
        if not await _put(be, pool, i):
            break
        stored.append(i)
    st = be.stats()
    assert 2 <= len(stored) < 20
    assert st["writes_stopped"] and st["write_errors"] >= 1 and st["no_space"] >= 1  # the filesystem is full
    assert tmp_files(be.root) == []
    assert not await _put(be, pool, 100)  # within the back-off: refused without trying
    assert be.stats()["writes_refused"] >= 1
    for i in stored:  # reads go on
        got = await be.get(key(i))
        assert got is not None and same_bytes(got, i, ENTRY)
        got.ref_count_down()
    for i in stored[:3]:  # space comes back
        assert await be.remove(key(i))
    assert await _retry_until(lambda: _put(be, pool, 200))
    assert not be.stats()["writes_stopped"]
    assert be.accounted() == (dir_bytes(be.root), len(entry_files(be.root)))


async def test_read_only_filesystem_serves_reads_and_resumes_writes(make_disk, pool, tmp_path):
    mnt = tmp_path / "ro"
    mnt.mkdir()
    if os.geteuid() != 0 or not _run("mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)):
        pytest.skip("needs root to mount a tmpfs")
    try:
        first = await make_disk(mnt / "d")
        for i in range(3):
            assert await _put(first, pool, i)
        await first.close()
        assert _run("mount", "-o", "remount,ro", str(mnt)), "remount read-only failed"
        be = await make_disk(mnt / "d", write_retry_s=0.05, write_retry_max_s=0.2)
        assert be.stats()["entries"] == 3
        for i in range(3):
            got = await be.get(key(i))
            assert got is not None and same_bytes(got, i, ENTRY)
            got.ref_count_down()
        assert not await _put(be, pool, 10)
        assert be.stats()["writes_stopped"]
        assert _run("mount", "-o", "remount,rw", str(mnt))
        assert await _retry_until(lambda: _put(be, pool, 11))
        assert not be.stats()["writes_stopped"]
        assert be.accounted() == (dir_bytes(be.root), 4)
        await be.close()
    finally:
        if not _run("umount", str(mnt)):
            _run("umount", "-l", str(mnt))


async def test_permission_denied_stops_writes_and_resumes(make_disk, pool, tmp_path):
    if os.geteuid() != 0 or shutil.which("chattr") is None:
        pytest.skip("needs root and chattr")
    root = tmp_path / "d"
    be = await make_disk(root, write_retry_s=0.05, write_retry_max_s=0.2)
    assert await _put(be, pool, 1, 4096)
    dirs = [root, *sorted(p for p in root.iterdir() if p.is_dir())]
    if not _run("chattr", "+i", *map(str, dirs)):
        pytest.skip("filesystem does not support the immutable attribute")
    try:
        assert not await _put(be, pool, 2, 4096)
        st = be.stats()
        assert st["writes_stopped"] and st["write_errors"] >= 1
        got = await be.get(key(1))
        assert got is not None and same_bytes(got, 1, 4096)
        got.ref_count_down()
    finally:
        assert _run("chattr", "-i", *map(str, dirs))
    assert await _retry_until(lambda: _put(be, pool, 3, 4096))
    assert not be.stats()["writes_stopped"]
    assert tmp_files(root) == []

"""The disk tier and the ``fs://`` tier checked against their medium: the record files in the
directory must hold exactly what was put, byte for byte, also along the Hypothesis state
machine (their full backend suites run in ``tests/disk`` and ``tests/remote``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmcache_async.disk.tier import DiskBackend
from lmcache_async.memory import PoolAllocator
from lmcache_async.remote import RemoteBackend
from lmcache_async.testing import RecordDirectoryMedium, make_key, make_obj
from lmcache_async.testing.media import read_record_dir
from lmcache_async.testing.medium_conformance import MediumConformanceTests
from lmcache_async.tiers import BackendContext


class TestDiskMedium(RecordDirectoryMedium, MediumConformanceTests):
    record_suffix = ".lmc"
    state_machine_examples = 6  # each example builds a fresh 256-shard directory

    async def make_backend(self, ctx: BackendContext, location: Path) -> DiskBackend:
        return DiskBackend(location, 1 << 30, executor=ctx.executor, staging=ctx.staging)


class TestSharedFilesystemMedium(RecordDirectoryMedium, MediumConformanceTests):
    record_suffix = ".rec"

    async def make_backend(self, ctx: BackendContext, location: Path) -> RemoteBackend:
        return RemoteBackend(ctx, f"fs://{location}", prefix="medium", timeout_s=30.0)


async def test_reader_reports_a_damaged_record(backend_context, tmp_path: Path) -> None:
    """The medium reader is itself checked: a flipped payload byte is an assertion, not a pass."""
    root = tmp_path / "d"
    root.mkdir()
    be = DiskBackend(root, 1 << 30, executor=backend_context().executor, staging=backend_context().staging)
    pool = PoolAllocator(1 << 20, name="src", pretouch=False)
    obj = make_obj(pool, (16, 16), seed=3)
    assert await be.put(make_key(1), obj)
    obj.ref_count_down()
    await be.close()
    assert set(read_record_dir(root, ".lmc")) == {make_key(1).to_string()}
    (path,) = root.rglob("*.lmc")
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(AssertionError, match="not a valid record"):
        read_record_dir(root, ".lmc")

"""The NIXL POSIX key-file layout publishes through the shared record-file helpers
(:mod:`lmcache_async.records.files`): a new record never replaces a file at its name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lmcache_async.memory import MemoryFormat
from lmcache_async.nixl.io import RECORD_SUFFIX, TMP_SUFFIX, KeyFileLayout
from lmcache_async.nixl.tier import NixlBackend, NixlSettings
from lmcache_async.testing import make_key
from lmcache_async.tiers import BackendContext

pytestmark = pytest.mark.nixl

MiB = 1 << 20


async def _open(ctx: BackendContext, root: Path) -> NixlBackend:
    be = NixlBackend(ctx, NixlSettings(plugin="POSIX", path=str(root), pool_size=0, max_bytes=64 * MiB))
    await be.start()
    return be


async def test_a_new_record_never_replaces_a_file_at_its_name(big_context, tmp_path, fill, monkeypatch) -> None:
    ctx = big_context()
    be = await _open(ctx, tmp_path)
    monkeypatch.setattr(KeyFileLayout, "new_location", lambda self, key: "taken")
    other = tmp_path / f"taken{RECORD_SUFFIX}"
    other.write_bytes(b"another writer's record")
    assert ctx.pool is not None
    src = fill(ctx.pool.allocate((MiB // 4,), torch.float32, MemoryFormat.KV_2LTD), 1)
    try:
        assert await be.put(make_key(1), src) is False
        assert not await be.contains(make_key(1))
        assert other.read_bytes() == b"another writer's record"
        assert not [p for p in tmp_path.iterdir() if p.name.endswith(TMP_SUFFIX)]
        monkeypatch.undo()
        assert await be.put(make_key(1), src)  # a fresh name: stored
        assert await be.contains(make_key(1))
    finally:
        await be.close()
        src.ref_count_down()

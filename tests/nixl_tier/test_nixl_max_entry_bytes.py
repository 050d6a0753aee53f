"""The NIXL tier's ``max_entry_bytes`` is the largest record, header included, it ever holds:
a record of exactly that size is stored, one a little larger never is."""

from __future__ import annotations

import pytest
import torch

from lmcache_async.memory import MemoryFormat
from lmcache_async.nixl.tier import NixlBackend, NixlSettings
from lmcache_async.records import header_length
from lmcache_async.testing import make_key

pytestmark = pytest.mark.nixl

MiB = 1 << 20


@pytest.mark.parametrize("pool_size", [pytest.param(0, id="files"), pytest.param(8, id="slots")])
async def test_max_entry_bytes_is_the_largest_record_the_tier_holds(big_context, tmp_path, fill, pool_size) -> None:
    ctx = big_context()
    be = NixlBackend(ctx, NixlSettings(plugin="POSIX", path=str(tmp_path), pool_size=pool_size, max_bytes=MiB))
    await be.start()
    try:
        assert be.max_entry_bytes == MiB
        key = make_key(1)
        fits = MiB - header_length(len(key.to_string().encode("utf-8")), 1)
        assert ctx.pool is not None
        for nbytes, stored in ((fits + 4, False), (fits, True)):
            obj = fill(ctx.pool.allocate((nbytes // 4,), torch.float32, MemoryFormat.KV_2LTD), nbytes)
            try:
                assert await be.put(key, obj) is stored, nbytes
            finally:
                obj.ref_count_down()
    finally:
        await be.close()

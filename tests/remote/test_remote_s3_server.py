"""The s3:// tier below the node cache server: entries a server committed are read back from the
bucket by a fresh server (another node's, or this one after a restart), sealed when a key is set."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest
import torch

from lmcache_async.encryption import write_key_file
from lmcache_async.memory import MemoryFormat, PoolAllocator
from lmcache_async.server.client import ServerClient
from lmcache_async.testing.cache_server import CacheServerProcess
from lmcache_async.testing.conformance import make_key, make_obj
from lmcache_async.testing.servers import SeaweedServer

from .s3_support import objects

pytestmark = pytest.mark.s3


def _kb(i: int) -> bytes:
    return make_key(i).to_string().encode()


def test_a_second_server_reads_what_the_first_wrote_through_to_the_bucket(
    seaweed: SeaweedServer, tmp_path: Path
) -> None:
    prefix = f"srv{uuid.uuid4().hex[:10]}"
    key_file = str(tmp_path / "key")
    write_key_file(key_file)
    settings = {**seaweed.config("node"), "remote_key_prefix": prefix, "encryption_key_file": key_file}
    first = CacheServerProcess(tmp_path / "a", **settings).start()
    pool = PoolAllocator(16 << 20, name="t", pretouch=False)
    objs = [make_obj(pool, (64, 64), torch.float32, MemoryFormat.KV_2LTD, seed=i) for i in range(4)]
    try:
        client = ServerClient(first.socket, "s3-ns", timeout_s=10.0, max_backoff_s=0.5)
        assert client.put([(_kb(i), o) for i, o in enumerate(objs)]) == [True] * 4
        client.close()
        assert first.stop() == 0  # SIGTERM flushes the write-through
        assert len(objects(seaweed, f"node/{prefix}")) == 4
        second = CacheServerProcess(tmp_path / "b", **settings).start()
        try:
            reader = ServerClient(second.socket, "s3-ns", timeout_s=10.0, max_backoff_s=0.5)
            got = None
            deadline = time.monotonic() + 30
            while got is None and time.monotonic() < deadline:
                got = reader.get([_kb(i) for i in range(4)], pool.allocate)
                time.sleep(0.05)
            assert got is not None
            for g, o in zip(got, objs, strict=True):
                assert g is not None and torch.equal(g.tensor, o.tensor)
                g.ref_count_down()
            assert second.status()["namespaces"]["s3-ns"]["loaded_from_lower_tiers"] == 4
            reader.close()
        finally:
            second.kill()
    finally:
        first.kill()
        for o in objs:
            o.ref_count_down()

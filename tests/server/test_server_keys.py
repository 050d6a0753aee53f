"""``lmcache-async keys``: list, show and delete entries of a server namespace or a disk directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from lmcache_async import LMCacheEngineConfig, StorageManager
from lmcache_async.cli import main
from lmcache_async.keys import CacheEngineKey
from lmcache_async.memory import MemoryFormat, PoolAllocator
from lmcache_async.server.client import ServerClient
from lmcache_async.testing.cache_server import private_dir


def _key(model: str, h: int) -> CacheEngineKey:
    return CacheEngineKey(model, 1, 0, h, torch.float32)


def _fill_server(srv: Any, ns: str) -> None:
    pool = PoolAllocator(1 << 20, name="t-keys", pretouch=False)
    client = ServerClient(srv.socket, ns, timeout_s=10.0)
    try:
        for model, h in (("m-a", 0xAB01), ("m-a", 0xAB02), ("m-a", 0xCD03), ("m-b", 0xAB04)):
            obj = pool.allocate((16, 16), torch.float32, MemoryFormat.KV_2LTD)
            assert obj is not None
            assert client.put([(_key(model, h).to_string().encode(), obj)]) == [True]
            obj.ref_count_down()
    finally:
        client.close()


def test_list_pages_through_a_namespace_in_key_order_without_touching_recency(shared_server: Any) -> None:
    _fill_server(shared_server, "keys-page")
    client = ServerClient(shared_server.socket, "keys-page", timeout_s=10.0)
    try:
        first = client.list_page(limit=3)
        assert first is not None
        items, more = first
        assert len(items) == 3 and more
        rest = client.list_page(after=items[-1].key, limit=3)
        assert rest is not None and len(rest[0]) == 1 and not rest[1]
        keys = [e.key for e in [*items, *rest[0]]]
        assert keys == sorted(keys) and len(set(keys)) == 4
        assert all(e.meta.nbytes == 1024 and e.block_bytes >= 1024 and not e.pinned for e in items)
        assert [e.key for e in client.entries(prefix=b"m-b@")] == [_key("m-b", 0xAB04).to_string().encode()]
        with pytest.raises(ValueError, match="limit"):
            client.list_page(limit=0)
    finally:
        client.close()


def test_keys_list_show_and_delete_on_a_server_namespace_with_filters(
    shared_server: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    _fill_server(shared_server, "keys-cli")
    base = ["--socket", shared_server.socket, "--namespace", "keys-cli"]
    assert main(["keys", "list", *base, "--model", "m-a", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert sorted(e["hash"] for e in listed) == ["ab01", "ab02", "cd03"]
    assert all(e["tier"] == "server" and e["payload_bytes"] == 1024 and e["shape"] == [16, 16] for e in listed)
    assert main(["keys", "show", *base, "--hash", "cd"]) == 0
    out = capsys.readouterr().out
    assert "stored_bytes" in out and "1 entries, 1.0 KiB" in out
    assert main(["keys", "delete", *base]) == 2  # no filter: refused
    capsys.readouterr()
    assert main(["keys", "delete", *base, "--model", "m-a", "--hash", "ab"]) == 0
    assert "deleted 2 entries" in capsys.readouterr().out
    assert main(["keys", "list", *base]) == 0
    assert "2 entries" in capsys.readouterr().out


def test_keys_on_a_namespace_with_a_wrong_token_fail_with_one_line(
    make_server: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    srv = make_server(cache_server_token="right").start()
    rc = main(["keys", "list", "--socket", srv.socket, "--namespace", "x", "--token", "wrong", "--timeout", "3"])
    assert rc == 1
    assert "cannot list namespace 'x'" in capsys.readouterr().err


def test_keys_list_and_delete_on_a_disk_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    disk = private_dir(tmp_path / "disk")
    cfg = LMCacheEngineConfig.from_defaults(
        local_cpu=False, tier_order=["disk"], local_disk=str(disk), max_local_disk_size=0.05, staging_size=1 / 64
    )
    sm = StorageManager(cfg, name="keys-disk")
    try:
        for model, h in (("m-a", 0xAB01), ("m-a", 0xCD02), ("m-b", 0xAB03)):
            assert sm.put_sync(_key(model, h), torch.ones(8, 8))
        sm.flush_sync()
    finally:
        sm.close_sync()
    assert main(["keys", "list", "--dir", str(disk), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert sorted((e["model"], e["hash"]) for e in listed) == [("m-a", "ab01"), ("m-a", "cd02"), ("m-b", "ab03")]
    assert all(e["tier"] == "disk" and e["payload_bytes"] == 256 and e["stored_bytes"] > 256 for e in listed)
    assert main(["keys", "delete", "--dir", str(disk), "--hash", "ab"]) == 0
    assert "deleted 2 entries" in capsys.readouterr().out
    assert main(["keys", "list", "--dir", str(disk)]) == 0
    assert "1 entries" in capsys.readouterr().out

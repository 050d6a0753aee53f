"""Direct puts: without a CPU tier, a put lands in the node server's block on the caller's thread."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from support.server_config import server_tier_config

from lmcache_async import StorageManager
from lmcache_async.memory import MemoryFormat
from lmcache_async.server.tier import ServerTier
from lmcache_async.testing.conformance import make_key

_config = server_tier_config


def _server_stats(sm: StorageManager) -> dict[str, Any]:
    figures: dict[str, Any] = sm.stats()["tiers"]["server"]
    return figures


def test_the_server_tier_is_a_direct_put_tier(shared_server) -> None:
    sm = StorageManager(_config(shared_server.socket, "direct-proto"), name="direct")
    try:
        tier = sm.backend("server")
        assert tier is not None and tier.as_direct_put() is not None
    finally:
        sm.close_sync()


def test_a_put_is_readable_by_another_manager_without_a_flush(shared_server) -> None:
    writer = StorageManager(_config(shared_server.socket, "direct-read"), name="writer")
    reader = StorageManager(_config(shared_server.socket, "direct-read"), name="reader")
    try:
        value = torch.randn(64, 128)
        assert writer.put_sync(make_key(1), value)
        assert writer.stats()["pending_writes"] == 0  # nothing queued for the loop
        got = reader.get_sync(make_key(1))
        assert got is not None and torch.equal(got.tensor, value)
        got.ref_count_down()
        assert _server_stats(writer)["direct_puts"] == 1
    finally:
        writer.close_sync()
        reader.close_sync()


def test_direct_puts_keep_dtype_shape_and_bytes_of_any_layout(shared_server) -> None:
    writer = StorageManager(_config(shared_server.socket, "direct-layout"), name="writer")
    reader = StorageManager(_config(shared_server.socket, "direct-layout"), name="reader")
    try:
        values = [
            torch.randn(32, 48).to(torch.bfloat16),
            torch.randn(48, 32).t(),  # not contiguous
            torch.randint(0, 255, (1000,), dtype=torch.uint8),
            torch.zeros(0, 4),
        ]
        for i, v in enumerate(values):
            assert writer.put_sync(make_key(i), v)
        block = writer.allocate([256], torch.int32)  # no CPU tier: no pool block
        assert block is None
        for i, v in enumerate(values):
            got = reader.get_sync(make_key(i))
            assert got is not None
            assert got.tensor.dtype == v.dtype and tuple(got.tensor.shape) == tuple(v.shape)
            assert torch.equal(got.tensor, v)
            got.ref_count_down()
    finally:
        writer.close_sync()
        reader.close_sync()


def test_a_put_of_a_key_the_server_holds_is_true_and_keeps_the_entry(shared_server) -> None:
    sm = StorageManager(_config(shared_server.socket, "direct-again"), name="again")
    try:
        first = torch.ones(16)
        assert sm.put_sync(make_key(7), first)
        assert sm.put_sync(make_key(7), torch.zeros(16))
        got = sm.get_sync(make_key(7))
        assert got is not None and torch.equal(got.tensor, first)
        got.ref_count_down()
    finally:
        sm.close_sync()


def test_a_put_the_server_has_no_room_for_is_false_and_counted(shared_server) -> None:
    sm = StorageManager(_config(shared_server.socket, "direct-full"), name="full")
    try:
        too_big = torch.empty(48 << 20, dtype=torch.uint8)  # the namespace pool holds 32 MiB
        assert sm.put_sync(make_key(1), too_big) is False
        assert sm.stats()["put_rejected"] == 1
        assert _server_stats(sm)["direct_put_failures"] == 1
        assert sm.get_sync(make_key(1)) is None
    finally:
        sm.close_sync()


def test_a_put_while_the_server_is_down_is_false_not_an_exception(make_server) -> None:
    srv = make_server().start()
    sm = StorageManager(_config(srv.socket, "direct-down", remote_timeout_s=1.0), name="down")
    try:
        assert sm.put_sync(make_key(1), torch.ones(8))
        srv.kill()
        assert sm.put_sync(make_key(2), torch.ones(8)) is False
        assert sm.stats()["put_rejected"] == 1
    finally:
        sm.close_sync()


def test_tiers_after_the_server_get_the_put_through_the_write_through(shared_server, tmp_path: Path) -> None:
    cfg = _config(
        shared_server.socket,
        "direct-disk",
        tier_order=["server", "disk"],
        local_disk=str(tmp_path / "disk"),
        max_local_disk_size=0.0625,
    )
    writer = StorageManager(cfg, name="writer")
    reader = StorageManager(_config(shared_server.socket, "direct-disk"), name="reader")
    try:
        value = torch.randn(256)
        assert writer.put_sync(make_key(3), value)
        got = reader.get_sync(make_key(3))  # in the server before any flush
        assert got is not None and torch.equal(got.tensor, value)
        got.ref_count_down()
        writer.flush_sync()
        assert writer.stats()["tiers"]["disk"]["writes"] >= 1
        assert _server_stats(writer)["writes"] == 0  # the server was written directly, not queued
    finally:
        writer.close_sync()
        reader.close_sync()


def test_with_a_cpu_tier_puts_go_through_the_cpu_tier_not_direct(shared_server) -> None:
    cfg = _config(
        shared_server.socket, "direct-cpu", local_cpu=True, max_local_cpu_size=1 / 64, tier_order=["cpu", "server"]
    )
    writer = StorageManager(cfg, name="writer")
    reader = StorageManager(_config(shared_server.socket, "direct-cpu"), name="reader")
    try:
        value = torch.randn(256)
        assert writer.put_sync(make_key(4), value)
        writer.flush_sync()
        assert _server_stats(writer)["direct_puts"] == 0
        got = reader.get_sync(make_key(4))
        assert got is not None and torch.equal(got.tensor, value)
        got.ref_count_down()
    finally:
        writer.close_sync()
        reader.close_sync()


def test_a_batch_of_direct_puts_is_one_call_of_the_server_tier(shared_server, monkeypatch) -> None:
    writer = StorageManager(_config(shared_server.socket, "direct-batch"), name="writer")
    reader = StorageManager(_config(shared_server.socket, "direct-batch"), name="reader")
    try:
        tier = writer.backend("server")
        assert isinstance(tier, ServerTier)
        assert tier.as_direct_put() is tier
        calls: list[int] = []
        put_direct = tier.put_direct

        def counting(items, fmt):
            calls.append(len(items))
            return put_direct(items, fmt)

        monkeypatch.setattr(tier, "put_direct", counting)
        keys = [make_key(i) for i in range(5)]
        values = [torch.randn(32) for _ in keys]
        too_big = torch.empty(48 << 20, dtype=torch.uint8)
        # PutPath.put_batch is what StorageManager.batched_put runs for pairs it validated.
        got = writer._put.put_batch([*keys, make_key(99)], [*values, too_big], MemoryFormat.UNDEFINED)
        assert got == [True] * 5 + [False]
        assert calls == [6]
        for k, v in zip(keys, values, strict=True):
            obj = reader.get_sync(k)
            assert obj is not None and torch.equal(obj.tensor, v)
            obj.ref_count_down()
        assert writer.stats()["put_rejected"] == 1
    finally:
        writer.close_sync()
        reader.close_sync()

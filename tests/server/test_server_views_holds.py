"""Reconnecting on the first call after a restart, zero-copy views under a lease, and holds."""

from __future__ import annotations

import time

import pytest
import torch

from lmcache_async.memory import MemoryFormat, PoolAllocator
from lmcache_async.server.client import ServerClient
from lmcache_async.testing.conformance import make_key, make_obj

SHAPE = (64, 64)


def _kb(i: int) -> bytes:
    return make_key(i).to_string().encode()


def _expected(i: int, shape: tuple[int, ...] = SHAPE) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return torch.randn(shape, generator=g)


def _put(client: ServerClient, pool: PoolAllocator, i: int, shape: tuple[int, ...] = SHAPE) -> bool:
    obj = make_obj(pool, shape, torch.float32, MemoryFormat.KV_2LTD, seed=i)
    try:
        res = client.put([(_kb(i), obj)])
        return bool(res and res[0])
    finally:
        obj.ref_count_down()


def _wait(pred, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return bool(pred())


def _ns(srv, name: str) -> dict:
    return srv.status()["namespaces"][name]


@pytest.fixture
def pool() -> PoolAllocator:
    return PoolAllocator(16 << 20, name="t", pretouch=False)


# ---- the first call after a restart -------------------------------------------------------------
@pytest.mark.parametrize("how", ["kill", "stop"])
def test_the_first_call_after_a_server_restart_reconnects_and_succeeds(make_server, pool, how: str) -> None:
    srv = make_server().start()
    client = ServerClient(srv.socket, "first", timeout_s=5.0, max_backoff_s=0.5)
    assert _put(client, pool, 1)
    gen = client.generation
    if how == "kill":
        srv.kill()
    else:
        assert srv.stop() == 0
    srv.start()
    # No call happened while the server was away: the first one finds its connection closed,
    # reconnects, maps the new pool and is answered.
    assert client.contains([_kb(1)]) == [False]
    assert client.generation != gen
    st = client.stats()
    assert st["reconnects"] == 1 and st["new_generations"] == 1 and st["errors"] == 0
    assert st["circuit"] == "closed"
    client.close()


def test_the_first_put_and_get_after_a_restart_succeed(make_server, pool) -> None:
    srv = make_server().start()
    client = ServerClient(srv.socket, "first-put", timeout_s=5.0)
    assert _put(client, pool, 1)  # leaves pre-granted blocks of the old server cached
    srv.kill()
    srv.start()
    assert _put(client, pool, 2)
    client.close()
    other = ServerClient(srv.socket, "first-put", timeout_s=5.0)
    got = other.get([_kb(2)], pool.allocate)
    assert got is not None and got[0] is not None and torch.equal(got[0].tensor, _expected(2))
    got[0].ref_count_down()
    srv.kill()
    srv.start()
    got = other.get([_kb(2)], pool.allocate)
    assert got == [None]  # answered (a miss on the new, empty server), not "could not ask"
    other.close()


def test_a_call_while_the_server_is_gone_is_a_miss_within_the_timeout(make_server, pool) -> None:
    srv = make_server().start()
    client = ServerClient(srv.socket, "gone", timeout_s=1.0, max_backoff_s=0.5)
    assert _put(client, pool, 1)
    srv.kill()
    t0 = time.monotonic()
    assert client.contains([_kb(1)]) is None
    assert time.monotonic() - t0 < 11.0  # the timeout plus slack for a loaded machine
    assert client.stats()["circuit"] != "closed"
    srv.start()
    assert _wait(lambda: client.contains([_kb(1)]) == [False])
    client.close()


# ---- zero-copy views ----------------------------------------------------------------------------
def test_a_view_holds_the_entry_bytes_under_a_lease_released_on_exit(shared_server, pool) -> None:
    client = ServerClient(shared_server.socket, "view", timeout_s=5.0)
    assert _put(client, pool, 3)
    with client.get_view(_kb(3)) as view:
        assert view is not None and view.valid()
        assert view.meta.shape == SHAPE and view.meta.dtype == torch.float32
        t = view.tensor
        assert t is not None and torch.equal(t, _expected(3))
        buf = view.buffer
        assert buf is not None and buf.readonly and bytes(buf) == _expected(3).numpy().tobytes()
        with pytest.raises(TypeError):
            buf[0] = 1
        assert _ns(shared_server, "view")["leases"] == 1
    assert not view.valid() and view.tensor is None
    with pytest.raises(ValueError):
        bytes(buf)  # released with the view
    assert _wait(lambda: _ns(shared_server, "view")["leases"] == 0)
    client.close()


def test_a_view_lease_is_released_when_the_block_raises(shared_server, pool) -> None:
    client = ServerClient(shared_server.socket, "view-exc", timeout_s=5.0)
    assert _put(client, pool, 4)
    with pytest.raises(RuntimeError, match="caller"), client.get_view(_kb(4)) as view:
        assert view is not None
        assert _ns(shared_server, "view-exc")["leases"] == 1
        raise RuntimeError("caller failure")
    assert _wait(lambda: _ns(shared_server, "view-exc")["leases"] == 0)
    client.close()


def test_a_view_of_a_missing_key_is_none(shared_server) -> None:
    client = ServerClient(shared_server.socket, "view-miss", timeout_s=5.0)
    with client.get_view(_kb(5)) as view:
        assert view is None
    with pytest.raises(TypeError), client.get_view("not bytes"):  # type: ignore[arg-type]
        pass
    client.close()


def test_a_viewed_entry_removed_meanwhile_keeps_its_bytes_until_exit(shared_server, pool) -> None:
    client = ServerClient(shared_server.socket, "view-rm", timeout_s=5.0)
    other = ServerClient(shared_server.socket, "view-rm", timeout_s=5.0)
    assert _put(client, pool, 6)
    with client.get_view(_kb(6)) as view:
        assert view is not None
        assert other.remove([_kb(6)]) == [True]
        for i in range(100, 140):  # new entries must not land in the leased block
            assert _put(other, pool, i)
        t = view.tensor
        assert t is not None and torch.equal(t, _expected(6)) and view.valid()
    other.close()
    client.close()


def test_a_view_is_refused_after_the_server_restarts(make_server, pool) -> None:
    srv = make_server().start()
    client = ServerClient(srv.socket, "view-restart", timeout_s=5.0)
    assert _put(client, pool, 7)
    with client.get_view(_kb(7)) as view:
        assert view is not None and view.valid()
        srv.kill()
        srv.start()
        assert not view.valid()
        assert view.tensor is None and view.buffer is None and view.copy() is None
        assert _put(client, pool, 8)  # the client itself carries on with the new server
    assert client.stats()["stale_views"] == 1
    with client.get_view(_kb(8)) as fresh:
        assert fresh is not None and fresh.connection is not view.connection
        got = fresh.copy()
        assert got is not None and torch.equal(got, _expected(8))
    client.close()


def test_a_view_past_its_lease_ttl_is_refused(make_server, pool) -> None:
    srv = make_server(cache_server_lease_ttl_s=0.5).start()
    client = ServerClient(srv.socket, "view-ttl", timeout_s=5.0)
    assert _put(client, pool, 9)
    with client.get_view(_kb(9)) as view:
        assert view is not None
        assert _wait(lambda: not view.valid(), 10.0)
        assert view.tensor is None
        assert _wait(lambda: _ns(srv, "view-ttl")["expired_leases"] == 1)
    client.close()


# ---- holds --------------------------------------------------------------------------------------
def test_a_held_entry_stays_readable_by_another_client_after_its_key_is_removed(shared_server, pool) -> None:
    promiser = ServerClient(shared_server.socket, "hold", timeout_s=5.0)
    reader = ServerClient(shared_server.socket, "hold", timeout_s=5.0)
    assert _put(promiser, pool, 10)
    tokens = promiser.hold([_kb(10), _kb(11)], ttl_s=60.0)
    assert tokens is not None and tokens[0] != 0 and tokens[1] == 0  # 11 was never stored
    assert _ns(shared_server, "hold")["holds"] == 1
    promiser.close()  # a hold outlives the connection that took it
    assert reader.remove([_kb(10)]) == [True]
    got = reader.get_held(tokens, pool.allocate)
    assert got is not None and got[1] is None
    assert got[0] is not None and torch.equal(got[0].tensor, _expected(10))
    got[0].ref_count_down()
    assert reader.unhold([tokens[0]])
    assert _wait(lambda: _ns(shared_server, "hold")["holds"] == 0)
    assert reader.get_held([tokens[0]], pool.allocate) == [None]
    reader.close()


def test_a_hold_nobody_drops_expires_after_its_ttl(shared_server, pool) -> None:
    client = ServerClient(shared_server.socket, "hold-ttl", timeout_s=5.0)
    assert _put(client, pool, 12)
    tokens = client.hold([_kb(12)], ttl_s=0.3)
    assert tokens is not None and tokens[0]
    assert _wait(lambda: _ns(shared_server, "hold-ttl")["expired_holds"] == 1)
    assert _ns(shared_server, "hold-ttl")["holds"] == 0
    assert client.get_held(tokens, pool.allocate) == [None]
    with pytest.raises(ValueError):
        client.hold([_kb(12)], ttl_s=0)
    client.close()


def test_a_held_entry_is_not_evicted(make_server, pool) -> None:
    srv = make_server(max_local_cpu_size=1 / 128).start()  # an 8 MiB pool
    client = ServerClient(srv.socket, "hold-evict", timeout_s=10.0)
    shape = (512, 512)  # 1 MiB
    assert _put(client, pool, 0, shape)
    tokens = client.hold([_kb(0)], ttl_s=60.0)
    assert tokens is not None and tokens[0]
    for i in range(1, 30):
        _put(client, pool, i, shape)
    assert _ns(srv, "hold-evict")["evictions"] > 0
    got = client.get_held(tokens, pool.allocate)
    assert got is not None and got[0] is not None and torch.equal(got[0].tensor, _expected(0, shape))
    got[0].ref_count_down()
    client.close()


def test_holds_of_a_restarted_server_read_nothing(make_server, pool) -> None:
    srv = make_server().start()
    client = ServerClient(srv.socket, "hold-restart", timeout_s=5.0)
    assert _put(client, pool, 13)
    tokens = client.hold([_kb(13)], ttl_s=60.0)
    assert tokens is not None and tokens[0]
    srv.kill()
    srv.start()
    assert client.get_held(tokens, pool.allocate) == [None]
    client.close()

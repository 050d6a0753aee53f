"""The namespace index (least recently used first, leased entries kept) and keys the wire cannot
carry, which are misses rather than errors."""

from __future__ import annotations

import pytest
import torch

from lmcache_async.memory import MemoryFormat, PoolAllocator
from lmcache_async.server.client import ServerClient
from lmcache_async.server.namespace import Namespace
from lmcache_async.server.protocol import COMMIT_STORED, MAX_KEY_BYTES, EntryMeta
from lmcache_async.testing.conformance import make_key, make_obj

BLOCK = 64 << 10  # payload bytes of each entry


def _commit(ns: Namespace, st, key: bytes) -> None:
    grant = ns.grant(st, BLOCK)
    assert grant is not None
    gid, obj = grant
    obj.tensor.view(torch.uint8)[:BLOCK].fill_(len(key) % 251)
    assert ns.commit(st, gid, key, EntryMeta.of((BLOCK,), torch.uint8, MemoryFormat.BINARY)) == COMMIT_STORED


def _namespace(entries: int, **caps: float) -> Namespace:
    return Namespace("t", entries * BLOCK, lease_ttl_s=60.0, max_leases=8, max_grants=8, pretouch=False, **caps)  # type: ignore[arg-type]


def test_eviction_takes_the_least_recently_used_entry_and_keeps_leased_ones() -> None:
    ns = _namespace(4)
    try:
        st = ns.add_client(1)
        keys = [b"k%d" % i for i in range(4)]
        for k in keys:
            _commit(ns, st, k)
        assert len(ns) == 4 and ns.payload_bytes == 4 * BLOCK
        assert ns.contains([keys[0]], touch=True) == [True]  # k0 is now the youngest
        lease = ns.lease(st, keys[1])  # k1 is leased: not a victim
        assert lease is not None
        _commit(ns, st, b"k4")  # evicts k2, the oldest unheld entry
        assert ns.contains(keys, touch=False) == [True, True, False, True]
        assert ns.evictions == 1 and ns.payload_bytes == 4 * BLOCK
        assert ns.release(st, lease[0])
        _commit(ns, st, b"k5")  # k1 was touched by its lease after k3: k3 goes
        assert ns.contains([*keys, b"k4", b"k5"], touch=False) == [True, True, False, False, True, True]
        assert ns.remove(b"k5") and not ns.remove(b"k5")
        assert len(ns) == 3 and ns.payload_bytes == 3 * BLOCK == ns.stats()["bytes"]
        ns.clear()
        assert len(ns) == 0 and ns.payload_bytes == 0
    finally:
        ns.close()


def test_a_grant_fails_when_every_entry_is_leased() -> None:
    ns = _namespace(2, max_pinned_fraction=1.0)
    try:
        st = ns.add_client(1)
        for k in (b"a", b"b"):
            _commit(ns, st, k)
            assert ns.lease(st, k) is not None
        assert ns.grant(st, BLOCK) is None and ns.refused_grants == 1
        assert ns.contains([b"a", b"b"], touch=False) == [True, True]
    finally:
        ns.close()


@pytest.fixture
def pool() -> PoolAllocator:
    return PoolAllocator(4 << 20, name="t-index", pretouch=False)


def test_keys_longer_than_the_wire_limit_are_misses_beside_working_keys(shared_server, pool) -> None:
    client = ServerClient(shared_server.socket, "long-keys", timeout_s=5.0)
    good = make_key(1).to_string().encode()
    for size in (MAX_KEY_BYTES + 1, 70000):  # past the limit, and past what a u16 length can say
        long = b"x" * size
        obj = make_obj(pool, (16, 16), torch.float32, MemoryFormat.KV_2LTD, seed=1)
        try:
            assert client.put([(long, obj), (good, obj)]) == [False, True]
        finally:
            obj.ref_count_down()
        assert client.contains([good, long]) == [True, False]
        got = client.get([long, good], pool.allocate)
        assert got is not None and got[0] is None and got[1] is not None
        got[1].ref_count_down()
        tokens = client.hold([long, good], 5.0)
        assert tokens is not None and tokens[0] == 0 and tokens[1] != 0
        assert client.unhold(tokens)
        assert client.remove([long]) == [False]
    assert client.stats()["long_keys"] == 10 and client.stats()["errors"] == 0
    assert client.ping()
    client.close()


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_the_server_serves_on_either_event_loop(make_server, pool, loop: str) -> None:
    srv = make_server(loop=loop).start()
    client = ServerClient(srv.socket, f"loop-{loop}", timeout_s=5.0)
    keys = [make_key(i).to_string().encode() for i in range(3)]
    objs = [make_obj(pool, (32, 32), torch.float32, MemoryFormat.KV_2LTD, seed=i) for i in range(3)]
    try:
        assert client.put(list(zip(keys, objs, strict=True))) == [True] * 3
        got = client.get(keys, pool.allocate)
        assert got is not None
        for want, have in zip(objs, got, strict=True):
            assert have is not None and torch.equal(have.tensor, want.tensor)
            have.ref_count_down()
        assert srv.status()["namespaces"][f"loop-{loop}"]["entries"] == 3
    finally:
        for o in objs:
            o.ref_count_down()
        client.close()
    assert srv.stop() == 0


def test_an_unknown_event_loop_name_is_refused() -> None:
    from lmcache_async.server.server import event_loop_factory

    assert event_loop_factory("asyncio") is None
    with pytest.raises(ValueError, match="LMCACHE_ASYNC_SERVER_LOOP"):
        event_loop_factory("trio")

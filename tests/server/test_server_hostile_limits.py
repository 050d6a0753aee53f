"""The server's limits against hostile and careless clients: an allocation checks it
can fit before evicting, namespaces are released, holds and leases are capped per client and per
namespace, stalled frames and idle connections are closed, the connection cap answers full, and CLEAR
clears every tier. Stalled writers, pool files, namespace crossing and fake servers are tested in
test_server_hostile.py."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch
from support.server_entries import key_bytes, put_entry, wait_until

from lmcache_async.memory import MemoryFormat, PoolAllocator
from lmcache_async.server.client import ServerClient
from lmcache_async.server.connection import connect as _connect
from lmcache_async.server.connection import exchange as _exchange
from lmcache_async.server.namespace import Namespace
from lmcache_async.server.protocol import FRAME, WELCOME, EntryMeta, Mode, Op, Reader, Status
from lmcache_async.testing.cache_server import private_dir
from lmcache_async.testing.conformance import make_obj

from .hostile_support import _raw_handshake


# ---- 5. an allocation checks it can fit before evicting -----------------------------------------------
def test_an_oversized_grant_beside_a_leased_block_evicts_nothing() -> None:
    block = 1 << 20
    ns = Namespace("t", 16 * block, lease_ttl_s=60.0, max_leases=8, max_grants=8, pretouch=False)
    try:
        st = ns.add_client(1)
        meta = EntryMeta.of((block,), torch.uint8, MemoryFormat.KV_2LTD)
        for i in range(16):
            got = ns.grant(st, block)
            assert got is not None
            ns.commit(st, got[0], b"k%d" % i, meta)
        assert ns.lease(st, b"k8") is not None  # one leased entry in the middle of the pool
        assert ns.grant(st, 13 * block) is None  # no 13-block run can be freed
        assert len(ns) == 16 and ns.evictions == 0 and ns.refused_evictions == 1
        got = ns.grant(st, 7 * block)  # a run that eviction can free is still made
        assert got is not None and ns.evictions == 7
    finally:
        ns.close()


def test_an_oversized_put_beside_a_leased_entry_keeps_the_namespace(make_server) -> None:
    srv = make_server(max_local_cpu_size=1 / 64).start()  # a 16 MiB pool
    pool = PoolAllocator(64 << 20, name="t-oversized", pretouch=False)
    client = ServerClient(srv.socket, "oversized", timeout_s=10.0)
    for i in range(150):
        assert put_entry(client, pool, i, (256, 100))  # 100 KiB each
    with client.get_view(key_bytes(75)) as view:  # a lease in the middle of the pool
        assert view is not None
        big = make_obj(pool, (13 << 18,), torch.float32, MemoryFormat.KV_2LTD, seed=1)  # 13 MiB
        assert client.put([(key_bytes(999), big)]) == [False]
        big.ref_count_down()
    st = srv.status()["namespaces"]["oversized"]
    assert st["evictions"] == 0 and st["entries"] == 150, st
    client.close()


# ---- 6. namespaces are released --------------------------------------------------------------------------
def test_one_shot_clients_of_new_namespaces_never_fill_the_server(make_server) -> None:
    srv = make_server(cache_server_max_namespaces=8).start()
    for n in range(20):
        c = ServerClient(srv.socket, f"churn-{n}", timeout_s=5.0)
        assert c.ping(), n
        c.close()
    st = srv.status()
    assert len(st["namespaces"]) <= 8 and st["reclaimed_namespaces"] >= 12


def test_a_namespace_with_no_client_is_released_after_its_idle_time(make_server) -> None:
    srv = make_server(cache_server_namespace_idle_s=0.5).start()
    pool = PoolAllocator(4 << 20, name="t-idle-ns", pretouch=False)
    c = ServerClient(srv.socket, "idle", timeout_s=5.0)
    assert put_entry(c, pool, 1)
    assert "idle" in srv.status()["namespaces"]
    time.sleep(1.0)
    assert "idle" in srv.status()["namespaces"]  # a client is still connected
    c.close()
    assert wait_until(lambda: "idle" not in srv.status()["namespaces"], 10)
    again = ServerClient(srv.socket, "idle", timeout_s=5.0)
    assert again.contains([key_bytes(1)]) == [False]  # a fresh pool
    again.close()


# ---- 7. holds and leases are capped per client and per namespace ---------------------------------------
#: Another process of the namespace asks for one hold of test entry 1 and prints how many it got.
_HOLD_ONE = """
import sys
from lmcache_async.server.client import ServerClient
from lmcache_async.testing.conformance import make_key
client = ServerClient(sys.argv[1], "holds", timeout_s=10.0)
tokens = client.hold([make_key(1).to_string().encode()], ttl_s=60) or []
print("held", sum(1 for t in tokens if t))
client.close()
"""


def test_one_client_process_cannot_take_every_hold_even_over_many_connections(make_server) -> None:
    srv = make_server(cache_server_max_client_holds=100).start()
    pool = PoolAllocator(4 << 20, name="t-holds", pretouch=False)
    greedy = [ServerClient(srv.socket, "holds", timeout_s=10.0) for _ in range(8)]
    try:
        assert put_entry(greedy[0], pool, 1)
        taken = []
        for client in greedy:  # eight connections of one process share one allowance
            tokens = client.hold([key_bytes(1)] * 4096, ttl_s=3600)
            taken.append(sum(1 for t in tokens or [] if t))
        assert sum(taken) == 100 and taken[0] == 100, taken
        polite = subprocess.run(
            [sys.executable, "-c", _HOLD_ONE, srv.socket], capture_output=True, text=True, timeout=60, check=False
        )
        assert polite.stdout.strip() == "held 1", polite.stderr  # another process still holds
    finally:
        for client in greedy:
            client.close()


def test_a_processs_connections_share_its_lease_caps_and_its_record_goes_with_it() -> None:
    ns = Namespace("t", 1 << 20, lease_ttl_s=60.0, max_leases=2, max_grants=8, pretouch=False)
    try:
        meta = EntryMeta.of((256,), torch.uint8, MemoryFormat.KV_2LTD)
        a1, a2, b = ns.add_client(1, pid=100), ns.add_client(2, pid=100), ns.add_client(3, pid=200)
        got = ns.grant(b, 256)
        assert got is not None
        ns.commit(b, got[0], b"k", meta)
        assert ns.lease(a1, b"k") and ns.lease(a2, b"k")
        assert ns.lease(a2, b"k") is None and ns.refused_leases == 1  # pid 100 holds its two
        assert ns.lease(b, b"k")  # pid 200 has its own allowance
        assert ns.hold(b"k", 60.0, a1) is not None
        ns.drop_client(a1)
        ns.drop_client(a2)
        assert ns.lease(ns.add_client(4, pid=100), b"k")  # its leases ended with its connections
        assert len(ns._shares) == 2  # pid 100 (a hold and a connection) and pid 200
    finally:
        ns.close()


def test_a_killed_holder_pins_at_most_its_share_of_the_pool(make_server) -> None:
    srv = make_server(max_local_cpu_size=1 / 64).start()  # 16 MiB: 16 entries of 1 MiB
    pool = PoolAllocator(64 << 20, name="t-pin", pretouch=False)
    holder = ServerClient(srv.socket, "pin", timeout_s=10.0)
    shape = (512, 512)
    for i in range(16):
        assert put_entry(holder, pool, i, shape)
    tokens = holder.hold([key_bytes(i) for i in range(16)], ttl_s=3600)
    assert tokens is not None and 0 < sum(1 for t in tokens if t) <= 4  # a quarter of the pool
    holder.close()  # the holder goes away; its holds stay (they are promises to others)
    writer = ServerClient(srv.socket, "pin", timeout_s=10.0)
    stored = [put_entry(writer, pool, 100 + i, shape) for i in range(16)]
    kept = writer.contains([key_bytes(100 + i) for i in range(16)])
    assert kept is not None and sum(kept) >= 16 - 4 - 2, (stored, kept)  # 2 blocks pre-granted
    writer.close()


def test_leases_are_capped_per_namespace() -> None:
    ns = Namespace("t", 1 << 20, lease_ttl_s=60.0, max_leases=8, max_grants=8, max_namespace_leases=3, pretouch=False)
    try:
        meta = EntryMeta.of((256,), torch.uint8, MemoryFormat.KV_2LTD)
        a, b = ns.add_client(1), ns.add_client(2)
        got = ns.grant(a, 256)
        assert got is not None
        ns.commit(a, got[0], b"k", meta)
        assert ns.lease(a, b"k") and ns.lease(a, b"k") and ns.lease(b, b"k")
        assert ns.lease(b, b"k") is None and ns.refused_leases == 1
    finally:
        ns.close()


# ---- 8. stalled frames, idle connections, the connection cap ---------------------------------------------
def _admitted(path: str, ns: str) -> socket.socket:
    sock, fd, _fields = _raw_handshake(path, ns)
    os.close(fd)
    return sock


def _closed_by_server(sock: socket.socket, timeout: float = 10.0) -> bool:
    sock.settimeout(timeout)
    try:
        return sock.recv(1 << 16) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_a_connection_stalled_inside_a_frame_is_closed_and_its_buffer_freed(make_server) -> None:
    srv = make_server(cache_server_frame_timeout_s=0.5, cache_server_max_buffered_bytes=1 << 20).start()
    socks = [_admitted(srv.socket, "frames") for _ in range(6)]
    frame = memoryview(FRAME.pack(4 << 20, int(Op.CONTAINS), 1) + b"\0" * (900 << 10))
    sent = dict.fromkeys(socks, 0)
    for s in socks:
        s.setblocking(False)
    end = time.monotonic() + 0.3
    while time.monotonic() < end:  # a 4 MiB frame announced, up to 900 KiB sent, then nothing
        for s in socks:
            try:
                sent[s] += s.send(frame[sent[s] :])
            except (BlockingIOError, BrokenPipeError, ConnectionResetError):
                pass
        time.sleep(0.01)
    st = srv.status()
    assert st["buffered_bytes"] <= (1 << 20) + 6 * (256 << 10), st["buffered_bytes"]
    assert all(_closed_by_server(s) for s in socks)
    st = srv.status()
    assert st["timed_out_connections"] >= 1 and st["buffered_bytes"] == 0
    pool = PoolAllocator(4 << 20, name="t-frames", pretouch=False)
    good = ServerClient(srv.socket, "frames", timeout_s=5.0)
    assert put_entry(good, pool, 1)
    good.close()
    for s in socks:
        s.close()


def test_an_idle_connection_is_closed_after_the_idle_timeout(make_server) -> None:
    srv = make_server(cache_server_idle_timeout_s=0.5).start()
    sock = _admitted(srv.socket, "idle-conn")
    assert _closed_by_server(sock)
    sock.close()
    client = ServerClient(srv.socket, "idle-conn", timeout_s=5.0)
    assert client.ping()
    time.sleep(1.5)
    assert client.ping() and client.stats()["errors"] == 0  # reconnects on its own
    client.close()


def test_connections_past_the_cap_are_answered_full(make_server) -> None:
    srv = make_server(cache_server_max_connections=4).start()
    held = [_admitted(srv.socket, "cap") for _ in range(4)]
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(srv.socket)
    msg = sock.recv(WELCOME.size)
    assert WELCOME.unpack(msg)[2] == Status.FULL
    sock.close()
    held.pop().close()
    client = ServerClient(srv.socket, "cap", timeout_s=5.0)
    assert wait_until(lambda: client.ping(), 10)
    client.close()
    for s in held:
        s.close()


# ---- 9. CLEAR clears every tier -----------------------------------------------------------------------------
def test_clear_clears_the_servers_disk_tier_too(make_server, tmp_path: Path) -> None:
    disk = private_dir(tmp_path / "disk")
    srv = make_server(local_disk=str(disk), max_local_disk_size=0.05).start()
    # Until its start-up scan ends, the disk tier cannot vouch for being clear (it says so).
    assert wait_until(lambda: srv.status()["lower"]["tiers"]["disk"]["rebuild_done"] is True, 30)
    pool = PoolAllocator(4 << 20, name="t-clear", pretouch=False)
    client = ServerClient(srv.socket, "clr", timeout_s=10.0)
    other = ServerClient(srv.socket, "keep", timeout_s=10.0)
    for i in range(5):
        assert put_entry(client, pool, i)
    assert put_entry(other, pool, 50)
    assert client.clear() is True and client.uncleared == []
    assert client.contains([key_bytes(i) for i in range(5)]) == [False] * 5
    assert client.get([key_bytes(i) for i in range(5)], pool.allocate) == [None] * 5
    assert other.contains([key_bytes(50)]) == [True]
    client.close()
    other.close()
    srv.stop()
    again = make_server(local_disk=str(disk), max_local_disk_size=0.05).start()  # the disk holds records
    c2 = ServerClient(again.socket, "clr", timeout_s=10.0)
    assert c2.clear() is False and c2.uncleared == ["disk"]  # it says which tier it cannot vouch for
    c2.close()


def test_a_status_connection_of_our_user_sees_every_unbound_namespace(shared_server) -> None:
    c = ServerClient(shared_server.socket, "visible", timeout_s=5.0)
    assert c.ping()
    assert "visible" in shared_server.status()["namespaces"]
    conn = _connect(shared_server.socket, "", None, Mode.STATUS, time.monotonic() + 5)
    r = Reader(_exchange(conn, Op.STATS, b"", time.monotonic() + 5))
    assert "visible" in json.loads(r.rest())["namespaces"]
    conn.close()
    c.close()

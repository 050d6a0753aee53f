"""Faults around the cache server: restarts, clients killed mid-operation, stuck leases, eviction."""

from __future__ import annotations

import os
import signal
import threading
import time

import torch
from support.server_entries import expected, key_bytes, put_entry, wait_until

from lmcache_async.memory import MemoryFormat, PoolAllocator
from lmcache_async.server.client import ServerClient
from lmcache_async.server.connection import connect as _connect
from lmcache_async.server.connection import exchange as _exchange
from lmcache_async.server.protocol import EntryMeta, Mode, Op, Reader, Writer

TIMEOUT_S = 1.0
# Bound on one call while the server is gone: its timeout plus scheduling slack on a busy machine.
NO_HANG_S = TIMEOUT_S + 10.0


def test_server_restart_mid_run_gives_misses_within_the_timeout_then_recovers(make_server) -> None:
    srv = make_server().start()
    pool = PoolAllocator(16 << 20, name="t", pretouch=False)
    client = ServerClient(srv.socket, "restart", timeout_s=TIMEOUT_S, max_backoff_s=0.5)
    assert all(put_entry(client, pool, i) for i in range(10))
    gen_before = client.generation
    wrong: list[int] = []
    slow: list[float] = []
    stop = threading.Event()

    def run() -> None:  # a client run that spans the restart
        i = 0
        while not stop.is_set():
            k = i % 20
            t0 = time.monotonic()
            got = client.get([key_bytes(k)], pool.allocate)
            if got and got[0] is not None:
                if not torch.equal(got[0].tensor, expected(k)):
                    wrong.append(k)
                got[0].ref_count_down()
            put_entry(client, pool, k)
            slow.append(time.monotonic() - t0)
            i += 1

    t = threading.Thread(target=run)
    t.start()
    time.sleep(0.5)
    srv.kill()
    t0 = time.monotonic()
    assert client.contains([key_bytes(0)]) is None  # a miss ("could not ask"), not a hang
    assert time.monotonic() - t0 < NO_HANG_S
    time.sleep(1.0)
    srv.start()
    assert wait_until(lambda: client.ping(), 60.0)
    time.sleep(0.5)
    stop.set()
    t.join(60)
    assert not t.is_alive()
    assert wrong == []
    assert max(slow) < 2 * NO_HANG_S
    assert client.generation != gen_before
    assert client.stats()["errors"] >= 1
    # The new server holds only what was put after it came back, and serves it bit-exact.
    assert put_entry(client, pool, 99)
    got = client.get([key_bytes(99)], pool.allocate)
    assert got is not None and got[0] is not None and torch.equal(got[0].tensor, expected(99))
    got[0].ref_count_down()
    client.close()


def _child_holding_leases_and_half_writes(sock: str, ns: str, wfd: int) -> None:
    """In a forked child: lease committed entries, take grants and half-fill them, send half a
    COMMIT, then report and wait to be killed."""
    try:
        conn = _connect(sock, ns, None, Mode.CLIENT, time.monotonic() + 10)
        body = Writer().keys([key_bytes(i) for i in range(4)]).body()
        _exchange(conn, Op.GET, body, time.monotonic() + 10)  # leases, never released
        w = Writer().u16(3)
        for _ in range(3):
            w.u64(64 << 10)
        r = Reader(_exchange(conn, Op.GRANT, w.body(), time.monotonic() + 10))
        assert r.u16() == 3
        grants = [(r.u64(), r.u64(), r.u64()) for _ in range(3)]
        assert conn.mapping is not None
        for _gid, off, _size in grants:
            conn.mapping.data[off : off + 1000].fill_(0x5A)  # half-written payloads
        meta = EntryMeta.of((128, 128), torch.float32, MemoryFormat.KV_2LTD)
        commit = Writer().u16(1).u64(grants[0][0]).blob(key_bytes(500)).meta(meta).u16(0).frame(Op.COMMIT, 7)
        conn.sock.sendall(commit[: len(commit) // 2])  # half a commit message
        os.write(wfd, b"r")
        time.sleep(120)
    finally:
        os._exit(0)


def test_kill_9_of_clients_holding_leases_and_half_written_blocks_reclaims_everything(make_server) -> None:
    srv = make_server().start()
    pool = PoolAllocator(16 << 20, name="t", pretouch=False)
    client = ServerClient(srv.socket, "k9", timeout_s=10.0)
    assert all(put_entry(client, pool, i) for i in range(4))
    for _ in range(20):
        rfd, wfd = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(rfd)
            _child_holding_leases_and_half_writes(srv.socket, "k9", wfd)
        os.close(wfd)
        assert os.read(rfd, 1) == b"r"
        os.close(rfd)
        ns = srv.status()["namespaces"]["k9"]
        assert ns["leases"] == 4 and ns["grants"] == 3 + _cached_grants(client)[0]
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)

        def reclaimed() -> bool:
            ns = srv.status()["namespaces"]["k9"]
            return ns["clients"] == 1 and ns["leases"] == 0 and ns["grants"] == _cached_grants(client)[0]

        assert wait_until(reclaimed)
    ns = srv.status()["namespaces"]["k9"]
    assert ns["pool_used_bytes"] == ns["committed_block_bytes"] + _cached_grants(client)[1]
    assert ns["entries"] == 4 and ns["reclaimed_leases"] == 80 and ns["reclaimed_grants"] == 60
    assert client.contains([key_bytes(500)]) == [False]  # the half-sent commit never became visible
    got = client.get([key_bytes(i) for i in range(4)], pool.allocate)
    assert got is not None
    for i, g in enumerate(got):
        assert g is not None and torch.equal(g.tensor, expected(i))
        g.ref_count_down()
    client.close()


def _cached_grants(client: ServerClient) -> tuple[int, int]:
    """(count, bytes) of the blocks this test's own client holds pre-granted for its next puts."""
    conn = client._conn
    assert conn is not None
    return sum(len(v) for v in conn.grants.values()), sum(size * len(v) for size, v in conn.grants.items())


def test_a_lease_never_released_expires_after_its_ttl(make_server) -> None:
    srv = make_server(cache_server_lease_ttl_s=0.5).start()
    pool = PoolAllocator(16 << 20, name="t", pretouch=False)
    client = ServerClient(srv.socket, "ttl", timeout_s=10.0)
    assert put_entry(client, pool, 1)
    conn = _connect(srv.socket, "ttl", None, Mode.CLIENT, time.monotonic() + 10)
    _exchange(conn, Op.GET, Writer().keys([key_bytes(1)]).body(), time.monotonic() + 10)
    assert srv.status()["namespaces"]["ttl"]["leases"] == 1
    assert wait_until(lambda: srv.status()["namespaces"]["ttl"]["leases"] == 0)
    assert srv.status()["namespaces"]["ttl"]["expired_leases"] == 1
    conn.sock.close()
    client.close()


def test_a_leased_entry_is_not_evicted_and_its_bytes_stay_intact(make_server) -> None:
    srv = make_server(max_local_cpu_size=1 / 128).start()  # an 8 MiB pool
    pool = PoolAllocator(32 << 20, name="t", pretouch=False)
    client = ServerClient(srv.socket, "evict", timeout_s=10.0)
    shape = (512, 512)  # 1 MiB
    assert put_entry(client, pool, 0, shape)
    conn = _connect(srv.socket, "evict", None, Mode.CLIENT, time.monotonic() + 10)
    r = Reader(_exchange(conn, Op.GET, Writer().keys([key_bytes(0)]).body(), time.monotonic() + 10))
    assert r.u16() == 1 and r.u8() == 1
    lease_id, off = r.u64(), r.u64()
    meta = r.meta()
    for i in range(1, 30):  # far more than the pool holds: eviction runs many times
        put_entry(client, pool, i, shape)
    st = srv.status()["namespaces"]["evict"]
    assert st["evictions"] > 0
    assert client.contains([key_bytes(0)]) == [True]
    assert conn.mapping is not None
    view = conn.mapping.data[off : off + meta.nbytes].view(torch.float32).view(shape)
    assert torch.equal(view, expected(0, shape))
    conn.sock.sendall(Writer().u16(1).u64(lease_id).frame(Op.RELEASE, 0))
    conn.sock.close()
    assert wait_until(lambda: srv.status()["namespaces"]["evict"]["leases"] == 0)
    for i in range(30, 45):
        put_entry(client, pool, i, shape)
    assert client.contains([key_bytes(0)]) == [False]  # unpinned, it ages out like any entry
    client.close()

"""The server against stalled, hostile and careless clients: every case here broke a
promise of docs/server.md before.

Stalled writers (``SIGSTOP`` past the grant's TTL), a pool file a client tries to resize, namespace
crossing and a fake server of another user. The server's limits (an oversized put beside a pinned
block, namespace churn, hold exhaustion, stalled frames, the connection cap, CLEAR with a disk tier)
are tested in test_server_hostile_limits.py.
"""

from __future__ import annotations

import json
import mmap
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest
import torch
from support.server_entries import expected, key_bytes, put_entry, wait_until

from lmcache_async.memory import MemoryFormat, PoolAllocator
from lmcache_async.server.client import ServerClient, ServerUnavailable
from lmcache_async.server.connection import connect as _connect
from lmcache_async.server.protocol import Mode
from lmcache_async.server.shm import PoolMapping, pool_file_bytes
from lmcache_async.testing.cache_server import CacheServerProcess
from lmcache_async.testing.conformance import make_obj

from .hostile_support import _raw_handshake

HERE = Path(__file__).resolve().parent
WORKER = str(HERE / "client_worker.py")
sys.path.insert(0, str(HERE))
import client_worker as cw  # type: ignore[import-not-found]  # noqa: E402

#: Uids with no account here; root can run processes as them (setuid in a forked child).
OTHER_UID, THIRD_UID = 54321, 54322
needs_root = pytest.mark.skipif(os.getuid() != 0, reason="running a process as another uid needs root")


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def _worker(srv: CacheServerProcess, ns: str, *args: str, timeout_s: float = 5.0) -> subprocess.Popen[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", LMCACHE_TEST_WORKER_TIMEOUT_S=str(timeout_s))
    return subprocess.Popen(
        [sys.executable, WORKER, srv.socket, ns, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _wrong_big(client: ServerClient, pool: PoolAllocator, indices: Iterable[int]) -> tuple[int, int]:
    """(entries present, entries whose bytes are not their own) among ``indices``."""
    present = wrong = 0
    for i in indices:
        got = client.get([cw.key_of(i)], pool.allocate)
        assert got is not None
        if got[0] is not None:
            present += 1
            wrong += not cw.check(got[0], i)
            got[0].ref_count_down()
    return present, wrong


# ---- 1. a writer stalled past its grant's TTL ------------------------------------------------------
@pytest.mark.parametrize("server_closes", [False, True], ids=["connection-open", "closed-by-server"])
def test_a_writer_stopped_past_its_grant_ttl_never_lands_in_another_entry(make_server, server_closes: bool) -> None:
    settings: dict[str, object] = {"max_local_cpu_size": 1 / 128, "cache_server_lease_ttl_s": 0.4}  # 8 MiB pool
    if server_closes:  # the server gives up on the client stalled inside a frame; its process lives on
        settings["cache_server_frame_timeout_s"] = 0.5
    srv = make_server(**settings).start()
    pool = PoolAllocator(64 << 20, name="t-stall", pretouch=False)
    args = ["stall-put", str(cw.BIG)] + (["partial"] if server_closes else [])
    stalled = _worker(srv, "stall", *args)  # one put, stopped inside
    try:
        assert wait_until(lambda: _stopped(stalled.pid)), stalled.stderr.read() if stalled.stderr else ""
        time.sleep(1.5)  # past the grant's TTL (and the frame timeout)
        st = srv.status()["namespaces"]["stall"]
        other = ServerClient(srv.socket, "stall", timeout_s=10.0)
        others = range(cw.BIG + 1, cw.BIG + 17)  # twice the pool: every free block is granted again
        for i in others:
            obj = cw.fill(pool, i)
            other.put([(cw.key_of(i), obj)])
            obj.ref_count_down()
        other.close()  # its own side: its grants are free at once
        if server_closes:  # the stopped writer's grant waits for its process to exit
            assert srv.status()["namespaces"]["stall"].get("quarantined_blocks", 1) == 1
        os.kill(stalled.pid, signal.SIGCONT)  # the late copy runs now
        out, err = stalled.communicate(timeout=60)
        assert out.strip().splitlines()[-1] in ("stored 0", "stored 1"), err
        if server_closes:  # its process exited: the quarantined block is back in the pool
            assert wait_until(lambda: srv.status()["namespaces"]["stall"].get("quarantined_blocks", 0) == 0)
        reader = ServerClient(srv.socket, "stall", timeout_s=10.0)
        present, wrong = _wrong_big(reader, pool, range(cw.BIG, cw.BIG + 17))
        assert present > 0 and wrong == 0, (present, wrong)
        assert st.get("overdue_grants", 0) + st.get("quarantined_grants", 0) >= 1  # counted, kept
        reader.close()
    finally:
        if stalled.poll() is None:
            os.kill(stalled.pid, signal.SIGCONT)
            stalled.kill()
            stalled.wait(10)


def _stall_run(srv: CacheServerProcess, stalls: int, ttl_s: float, seed: int) -> dict[str, int]:
    """A writer process puts ``stalls`` 1 MiB entries, each time stopped inside its put (right
    before its copy into the granted block) past the grant TTL, while this process writes other
    entries (each removed and put again, so freed blocks are granted again); after each stall the
    writer goes on and every entry is read and checked. Returns the counts."""
    rng = random.Random(seed)
    pool = PoolAllocator(64 << 20, name="t-stalls", pretouch=False)
    other = ServerClient(srv.socket, "stalls", timeout_s=60.0)
    # Its calls outlast the stalls, so every put copies (a put whose deadline passed in a stall
    # drops its connection after the copy; the breaker would then skip the next puts).
    writer = _worker(srv, "stalls", "stall-loop", str(cw.BIG), str(stalls), timeout_s=3 * ttl_s + 30)
    mine = list(range(cw.BIG + 1000, cw.BIG + 1012))
    objs = {i: cw.fill(pool, i) for i in mine}
    everything = [*range(cw.BIG, cw.BIG + stalls), *mine]
    wrong = checked = 0
    try:
        for n in range(stalls):
            assert wait_until(lambda: _stopped(writer.pid) or writer.poll() is not None, 120), n
            time.sleep(ttl_s * 1.3 + 0.1)  # past the grant TTL and the server's next sweep
            for i in rng.sample(mine, 8):  # fresh commits: freed blocks are granted again
                other.remove([cw.key_of(i)])
                other.put([(cw.key_of(i), objs[i])])
            os.kill(writer.pid, signal.SIGCONT)  # the late copy lands now
            assert writer.stdout is not None and writer.stdout.readline().startswith("put ")
            present, bad = _wrong_big(other, pool, everything)
            checked += present
            wrong += bad
        assert writer.wait(60) == 0
        assert writer.stdout is not None
        out = writer.stdout.read()
        return {"stalls": stalls, "checked": checked, "wrong": wrong, "writer_stored": int(out.split()[-1])}
    finally:
        if writer.poll() is None:
            os.kill(writer.pid, signal.SIGCONT)
            writer.kill()
            writer.wait(10)
        for pipe in (writer.stdin, writer.stdout, writer.stderr):
            if pipe is not None:
                pipe.close()
        for o in objs.values():
            o.ref_count_down()
        other.close()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_fifty_stalls_past_a_short_grant_ttl_leave_no_wrong_entry(make_server) -> None:
    stalls = int(os.environ.get("LMCACHE_ASYNC_STALLS", "50"))
    srv = make_server(max_local_cpu_size=1 / 128, cache_server_lease_ttl_s=0.3).start()
    res = _stall_run(srv, stalls, 0.3, seed=1)
    print(json.dumps(res))
    assert res["checked"] > 0 and res["wrong"] == 0, res


@pytest.mark.slow
@pytest.mark.timeout(1200)  # six stalls of 39 s, and the checks after each
def test_six_stalls_past_the_default_grant_ttl_leave_no_wrong_entry(make_server) -> None:
    stalls = int(os.environ.get("LMCACHE_ASYNC_DEFAULT_TTL_STALLS", "6"))
    srv = make_server(max_local_cpu_size=1 / 128).start()  # cache_server_lease_ttl_s: 30 (default)
    res = _stall_run(srv, stalls, 30.0, seed=2)
    print(json.dumps(res))
    assert res["checked"] > 0 and res["wrong"] == 0, res


def test_a_lease_copy_outliving_its_lease_is_a_miss_not_another_entrys_bytes(make_server, monkeypatch) -> None:
    srv = make_server(max_local_cpu_size=1 / 128, cache_server_lease_ttl_s=0.3).start()
    pool = PoolAllocator(16 << 20, name="t-lease-stall", pretouch=False)
    client = ServerClient(srv.socket, "lease-stall", timeout_s=10.0)
    assert put_entry(client, pool, 1)
    tokens = client.hold([key_bytes(1)], ttl_s=60)
    assert tokens and tokens[0]
    from lmcache_async.server import client as client_module
    from lmcache_async.server import client_wire

    copy = client_wire.copy_hits  # defined in client_wire, called by client as _copy_hits

    def slow_copy(*args, **kw):
        time.sleep(1.0)  # a reader stalled inside its copy, past the lease's TTL
        return copy(*args, **kw)

    with monkeypatch.context() as m:
        m.setattr(client_module, "_copy_hits", slow_copy)
        assert client.get_held(tokens, pool.allocate) == [None]
        assert client.stats()["stale_leases"] == 1
    got = client.get_held(tokens, pool.allocate)
    assert got is not None and got[0] is not None and torch.equal(got[0].tensor, expected(1))
    got[0].ref_count_down()
    client.close()


# ---- 2. sealed pools ---------------------------------------------------------------------------------
def test_a_client_cannot_shrink_or_grow_the_pool_file(shared_server) -> None:
    pool = PoolAllocator(4 << 20, name="t-seal", pretouch=False)
    bystander = ServerClient(shared_server.socket, "sealed", timeout_s=10.0)
    assert put_entry(bystander, pool, 3)
    sock, fd, fields = _raw_handshake(shared_server.socket, "sealed")
    try:
        size = os.fstat(fd).st_size
        assert size == pool_file_bytes(fields[4], fields[6])
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 4096)
        with pytest.raises(PermissionError):
            os.ftruncate(fd, size + (512 << 20))
        assert os.fstat(fd).st_size == size
    finally:
        os.close(fd)
        sock.close()
    got = bystander.get([key_bytes(3)], pool.allocate)  # the server and the bystander live on
    assert got is not None and got[0] is not None and torch.equal(got[0].tensor, expected(3))
    got[0].ref_count_down()
    assert bystander.stats()["errors"] == 0
    bystander.close()


def test_a_client_refuses_an_unsealed_or_resized_pool_file() -> None:
    capacity, align = 1 << 20, 256
    size = pool_file_bytes(capacity, align)
    fd = os.memfd_create("t-unsealed", os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    with pytest.raises(ValueError, match="sealed"):
        PoolMapping(fd, 1, capacity, 4096, align)
    import fcntl

    fd = os.memfd_create("t-grown", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size + (512 << 20))  # grown before it was sealed: never mapped at its size
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    with pytest.raises(ValueError, match="announced"):
        PoolMapping(fd, 1, capacity, 4096, align)
    assert mmap.PAGESIZE > 0


# ---- 3. namespaces as a boundary ----------------------------------------------------------------------
def test_a_namespace_with_its_own_token_admits_only_that_token(make_server) -> None:
    srv = make_server(cache_server_namespaces={"a": {"token": "tok-a"}, "b": {"token": "tok-b"}}).start()
    pool = PoolAllocator(4 << 20, name="t-ns-tok", pretouch=False)
    a = ServerClient(srv.socket, "a", token="tok-a", timeout_s=5.0)
    b = ServerClient(srv.socket, "b", token="tok-b", timeout_s=5.0)
    assert put_entry(a, pool, 1) and put_entry(b, pool, 2)
    crossing = ServerClient(srv.socket, "b", token="tok-a", timeout_s=5.0)  # a's token, b's name
    assert crossing.get([key_bytes(2)], pool.allocate) is None and crossing.put([]) == []
    assert crossing.remove([key_bytes(2)]) is None and crossing.clear() is False
    no_token = ServerClient(srv.socket, "b", timeout_s=5.0)
    assert no_token.contains([key_bytes(2)]) is None
    stats = a.server_stats()
    assert stats is not None and set(stats["namespaces"]) == {"a"}  # a sees only its own namespace
    assert a.clear() is True and b.contains([key_bytes(2)]) == [True]  # CLEAR stays in a's namespace
    for c in (a, b, crossing, no_token):
        c.close()


def _as_uid(uid: int, fn: Callable[[], object], ready: Callable[[], None] | None = None) -> object:
    """``fn()`` run in a forked child that switched to ``uid`` (its JSON-able result, or
    ``{"error": ...}``); ``ready``, when given, runs here once the child wrote a first line."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: nothing of pytest's, no exec (the interpreter lies under /root)
        code = 1
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            out = fn()
            os.write(w, (json.dumps(out) + "\n").encode())
            code = 0
        except BaseException as exc:
            os.write(w, (json.dumps({"error": repr(exc)}) + "\n").encode())
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "r") as f:
        if ready is not None:
            assert f.readline().strip() == "ready"
            ready()
        line = f.readline()
    os.waitpid(pid, 0)
    return json.loads(line)


@needs_root
def test_namespaces_bound_to_uids_keep_tenants_apart() -> None:
    base = Path(tempfile.mkdtemp(prefix="lmc-uid-", dir="/tmp"))
    os.chmod(base, 0o711)
    srv = CacheServerProcess(
        base / "srv",
        cache_server_namespaces={"t1": {"uids": [OTHER_UID]}, "t2": {"uids": [THIRD_UID]}},
    )
    os.chmod(srv.workdir, 0o711)
    srv.start()
    try:
        assert os.stat(srv.socket).st_mode & 0o777 == 0o666  # other users reach it; SO_PEERCRED decides
        pool = PoolAllocator(4 << 20, name="t-uid", pretouch=False)
        root_in_t2 = ServerClient(srv.socket, "t2", timeout_s=5.0)  # root may join any namespace
        assert put_entry(root_in_t2, pool, 1)

        def tenant(own: str, other: str) -> dict[str, object]:
            mine = ServerClient(srv.socket, own, timeout_s=5.0, server_uid=0)
            obj = make_obj(pool, (64, 64), torch.float32, MemoryFormat.KV_2LTD, seed=7)
            out: dict[str, object] = {"put_own": mine.put([(key_bytes(7), obj)])}
            cross = ServerClient(srv.socket, other, timeout_s=5.0, server_uid=0)
            out["contains_other"] = cross.contains([key_bytes(1)])
            out["clear_other"] = cross.clear()
            st = mine.server_stats()
            out["sees"] = sorted(st["namespaces"]) if st else None
            return out

        out = _as_uid(OTHER_UID, lambda: tenant("t1", "t2"))
        assert out == {"put_own": [True], "contains_other": None, "clear_other": False, "sees": ["t1"]}, out
        assert root_in_t2.contains([key_bytes(1)]) == [True]
        stranger = _as_uid(THIRD_UID + 1, lambda: tenant("t1", "default"))  # bound nowhere
        assert stranger == {"put_own": None, "contains_other": None, "clear_other": False, "sees": None}
        root_in_t2.close()
    finally:
        srv.kill()


# ---- 4. clients check who serves the socket --------------------------------------------------------
@needs_root
def test_a_client_sends_nothing_to_a_server_of_another_uid() -> None:
    d = Path(tempfile.mkdtemp(prefix="lmc-fake-", dir="/tmp"))
    os.chmod(d, 0o777)  # a world-writable parent: another user creates the socket first
    path = str(d / "cache.sock")

    def fake_server(ready_fd: int) -> int:
        """Accept for a while as another user; the bytes clients sent."""
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(path)
        s.listen(4)
        os.write(ready_fd, b"ready\n")
        s.settimeout(4.0)
        got = 0
        try:
            while True:
                c, _ = s.accept()
                c.settimeout(0.5)
                try:
                    while b := c.recv(65536):
                        got += len(b)
                except OSError:
                    pass
                c.close()
        except OSError:
            pass
        return got

    results: list[object] = []

    def client_side() -> None:
        client = ServerClient(path, "victim", token="secret-token", timeout_s=2.0)
        pool = PoolAllocator(4 << 20, name="t-fake", pretouch=False)
        obj = make_obj(pool, (8, 8), torch.float32, MemoryFormat.KV_2LTD, seed=1)
        results.append(client.put([(key_bytes(1), obj)]))
        results.append(client.get([key_bytes(1)], pool.allocate))
        obj.ref_count_down()
        try:
            _connect(path, "victim", "secret-token", Mode.CLIENT, time.monotonic() + 2)
        except ServerUnavailable as exc:
            results.append(str(exc))
        client.close()

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(OTHER_UID)
            os.setuid(OTHER_UID)
            os.write(w, f"{fake_server(w)}\n".encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "r") as f:
        assert f.readline().strip() == "ready"
        client_side()
        received = int(f.readline())
    os.waitpid(pid, 0)
    assert results[0] is None and results[1] is None  # misses: the server was not ours
    assert "uid" in str(results[2])
    assert received == 0  # not one byte: no token, no payload

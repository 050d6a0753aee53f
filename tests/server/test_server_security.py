"""The server's trust boundary: socket permissions, admission, hostile and fuzzed messages."""

from __future__ import annotations

import os
import random
import socket
import stat
import struct
import time
from pathlib import Path

import pytest
import torch

from lmcache_async.dtypes import DTYPE_TO_CODE
from lmcache_async.memory import MemoryFormat, PoolAllocator
from lmcache_async.server.client import ServerClient, ServerUnavailable
from lmcache_async.server.connection import connect as _connect
from lmcache_async.server.connection import exchange as _exchange
from lmcache_async.server.protocol import FRAME, HELLO, MAGIC, MAX_BODY, VERSION, EntryMeta, Mode, Op, Reader, Writer
from lmcache_async.server.server import prepare_socket_dir
from lmcache_async.testing.conformance import make_key, make_obj


def _kb(i: int) -> bytes:
    return make_key(i).to_string().encode()


def _closed_by_server(sock: socket.socket) -> bool:
    sock.settimeout(10.0)
    try:
        return sock.recv(1 << 16) == b""
    except ConnectionResetError:
        return True


class _Bystander:
    """A well-behaved client whose entry must survive whatever the others send."""

    def __init__(self, path: str, ns: str) -> None:
        self.client = ServerClient(path, ns, timeout_s=10.0)
        self.pool = PoolAllocator(4 << 20, name="bystander", pretouch=False)
        self.obj = make_obj(self.pool, (32, 32), torch.float32, MemoryFormat.KV_2LTD, seed=5)
        assert self.client.put([(_kb(1), self.obj)]) == [True]

    def undisturbed(self) -> bool:
        got = self.client.get([_kb(1)], self.pool.allocate)
        if not got or got[0] is None:
            return False
        ok = torch.equal(got[0].tensor, self.obj.tensor)
        got[0].ref_count_down()
        return ok and self.client.stats()["errors"] == 0

    def close(self) -> None:
        self.obj.ref_count_down()
        self.client.close()


def test_socket_is_0600_in_a_0700_directory(shared_server) -> None:
    assert stat.S_IMODE(os.stat(shared_server.socket).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(Path(shared_server.socket).parent).st_mode) == 0o700


def test_socket_directory_open_to_others_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "open"
    d.mkdir()
    os.chmod(d, 0o755)
    with pytest.raises(ValueError, match="0700"):
        prepare_socket_dir(d / "s.sock")


def test_missing_socket_directory_is_created_private(tmp_path: Path) -> None:
    prepare_socket_dir(tmp_path / "new" / "s.sock")
    assert stat.S_IMODE(os.stat(tmp_path / "new").st_mode) == 0o700


def test_a_path_that_is_not_a_socket_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "d"
    d.mkdir(mode=0o700)
    (d / "s.sock").write_text("x")
    with pytest.raises(ValueError, match="not a socket"):
        prepare_socket_dir(d / "s.sock")


def test_a_running_server_is_not_replaced(shared_server) -> None:
    with pytest.raises(ValueError, match="already listening"):
        prepare_socket_dir(shared_server.socket)


def test_wrong_token_is_refused_and_right_token_admitted(make_server) -> None:
    srv = make_server(cache_server_token="s3cret").start()
    with pytest.raises(ServerUnavailable, match="BAD_TOKEN"):
        _connect(srv.socket, "ns", "wrong", Mode.CLIENT, time.monotonic() + 10)
    with pytest.raises(ServerUnavailable, match="BAD_TOKEN"):
        _connect(srv.socket, "ns", None, Mode.CLIENT, time.monotonic() + 10)
    conn = _connect(srv.socket, "ns", "s3cret", Mode.CLIENT, time.monotonic() + 10)
    conn.sock.close()


def test_namespace_with_control_characters_is_refused(shared_server) -> None:
    with pytest.raises(ServerUnavailable, match="BAD_NAMESPACE"):
        _connect(shared_server.socket, "bad\nname", None, Mode.CLIENT, time.monotonic() + 10)


def _hostile_cases() -> dict[str, bytes]:
    meta = EntryMeta.of((8, 8), torch.float32, MemoryFormat.KV_2LTD)
    # 12345 payload bytes claimed for a float32 tensor of shape (8,): 32 bytes.
    lying_meta = struct.pack("<QBBBQ", 12345, int(MemoryFormat.KV_2LTD), DTYPE_TO_CODE[torch.float32], 1, 8)
    lying_commit = Writer().u16(1).u64(1).blob(_kb(2)).body() + lying_meta + Writer().u16(0).body()
    return {
        "oversized frame": FRAME.pack(MAX_BODY + 1, int(Op.GET), 1),
        "unknown op": FRAME.pack(0, 200, 1),
        "truncated body": Writer().u16(5).frame(Op.GET, 1),
        "trailing bytes": Writer().u8(0).keys([_kb(1)]).u8(9).frame(Op.CONTAINS, 1),
        "batch over the limit": Writer().u16(60000).frame(Op.GET, 1),
        "invalid key grammar": Writer().u16(1).u64(1).blob(b"not a key").meta(meta).u16(0).frame(Op.COMMIT, 1),
        "metadata that lies about its size": FRAME.pack(len(lying_commit), int(Op.COMMIT), 1) + lying_commit,
        "truncated READ": Writer().u16(2).u16(3).frame(Op.READ, 1),
        "READ batch over the limit": Writer().u16(60000).frame(Op.READ, 1),
        "READ with trailing bytes": Writer().keys([_kb(1)]).u8(0).frame(Op.READ, 1),
        "truncated TOUCH": Writer().u16(1).u16(200).frame(Op.TOUCH, 0),
        "truncated RELEASE": Writer().u16(3).u64(1).frame(Op.RELEASE, 0),
    }


@pytest.mark.parametrize("case", sorted(_hostile_cases()))
def test_hostile_message_closes_only_its_connection(shared_server, case: str) -> None:
    ns = f"hostile-{abs(hash(case)) % 10**8}"
    bystander = _Bystander(shared_server.socket, ns)
    try:
        conn = _connect(shared_server.socket, ns, None, Mode.CLIENT, time.monotonic() + 10)
        conn.sock.sendall(_hostile_cases()[case])
        assert _closed_by_server(conn.sock), case
        conn.sock.close()
        assert bystander.undisturbed()
    finally:
        bystander.close()


def test_a_client_cannot_commit_or_release_what_another_client_holds(shared_server) -> None:
    ns = "hostile-ids"
    bystander = _Bystander(shared_server.socket, ns)
    owner = _connect(shared_server.socket, ns, None, Mode.CLIENT, time.monotonic() + 10)
    thief = _connect(shared_server.socket, ns, None, Mode.CLIENT, time.monotonic() + 10)
    try:
        r = Reader(_exchange(owner, Op.GRANT, Writer().u16(1).u64(4096).body(), time.monotonic() + 10))
        assert r.u16() == 1
        gid = r.u64()
        r = Reader(_exchange(owner, Op.GET, Writer().keys([_kb(1)]).body(), time.monotonic() + 10))
        assert r.u16() == 1 and r.u8() == 1
        lease = r.u64()
        meta = EntryMeta.of((32, 32), torch.float32, MemoryFormat.KV_2LTD)
        body = Writer().u16(1).u64(gid).blob(_kb(7)).meta(meta).u16(0).body()
        r = Reader(_exchange(thief, Op.COMMIT, body, time.monotonic() + 10))
        assert r.u16() == 1 and r.u8() == 0  # not the thief's grant: refused
        thief.sock.sendall(Writer().u16(1).u64(lease).frame(Op.RELEASE, 0))
        assert shared_server.status()["namespaces"][ns]["leases"] == 1  # still the owner's
        assert bystander.client.contains([_kb(7)]) == [False]
        assert bystander.undisturbed()
    finally:
        owner.sock.close()
        thief.sock.close()
        bystander.close()


def test_status_connection_cannot_reach_a_pool(shared_server) -> None:
    conn = _connect(shared_server.socket, "", None, Mode.STATUS, time.monotonic() + 10)
    assert conn.mapping is None
    conn.sock.sendall(Writer().keys([_kb(1)]).frame(Op.GET, 1))
    assert _closed_by_server(conn.sock)
    conn.sock.close()


def _valid_frames(rng: random.Random) -> list[bytes]:
    meta = EntryMeta.of((4, 4), torch.float32, MemoryFormat.KV_2LTD)
    return [
        Writer().u8(1).keys([_kb(rng.randrange(9))]).frame(Op.CONTAINS, 1),
        Writer().keys([_kb(rng.randrange(9)) for _ in range(3)]).frame(Op.GET, 2),
        Writer().u16(2).u64(rng.randrange(1 << 20)).u64(64).frame(Op.GRANT, 3),
        Writer()
        .u16(1)
        .u64(rng.randrange(50))
        .blob(_kb(rng.randrange(9)))
        .meta(meta)
        .u16(1)
        .u64(64)
        .frame(Op.COMMIT, 4),
        Writer().u16(1).u64(rng.randrange(50)).frame(Op.RELEASE, 0),
        Writer().u16(1).u64(rng.randrange(50)).frame(Op.UNGRANT, 0),
        Writer().keys([_kb(rng.randrange(2, 9))]).frame(Op.REMOVE, 5),  # never the bystander's key 1
        Writer().keys([_kb(rng.randrange(9)) for _ in range(2)]).frame(Op.READ, 8),
        Writer().keys([_kb(rng.randrange(9))]).frame(Op.TOUCH, 0),
        Writer().frame(Op.PING, 6),
        Writer().frame(Op.STATS, 7),
    ]


def _mutate(rng: random.Random, msg: bytes) -> bytes:
    b = bytearray(msg)
    for _ in range(rng.randint(1, 4)):
        choice = rng.random()
        if choice < 0.4 and b:
            b[rng.randrange(len(b))] = rng.randrange(256)
        elif choice < 0.6 and b:
            del b[rng.randrange(len(b)) :]
        elif choice < 0.8:
            b += rng.randbytes(rng.randint(1, 16))
        else:
            pos = rng.randrange(len(b) + 1)
            b[pos:pos] = struct.pack("<I", rng.choice([0, 1, 0xFFFF, 0xFFFFFFFF, MAX_BODY]))
    return bytes(b)


def test_bounded_wire_fuzzer_neither_crashes_the_server_nor_disturbs_another_client(shared_server) -> None:
    ns = "fuzz"
    bystander = _Bystander(shared_server.socket, ns)
    rng = random.Random(1234)
    try:
        for case in range(200):
            if rng.random() < 0.15:  # a garbled handshake
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.settimeout(10)
                s.connect(shared_server.socket)
                hello = HELLO.pack(MAGIC, VERSION, 0, 2, 0) + b"ns"
                s.sendall(_mutate(rng, hello))
                s.shutdown(socket.SHUT_WR)
                try:
                    while s.recv(4096):
                        pass
                except OSError:
                    pass
                s.close()
                continue
            conn = _connect(shared_server.socket, ns, None, Mode.CLIENT, time.monotonic() + 10)
            frames = _valid_frames(rng)
            stream = b"".join(_mutate(rng, f) if rng.random() < 0.6 else f for f in rng.sample(frames, 4))
            conn.sock.sendall(stream)
            conn.sock.shutdown(socket.SHUT_WR)
            conn.sock.settimeout(10)
            try:
                while conn.sock.recv(1 << 16):
                    pass
            except OSError:
                pass
            conn.sock.close()
            if case % 25 == 0:
                assert bystander.undisturbed(), case
        assert bystander.undisturbed()
        st = shared_server.status()
        assert st["protocol_errors"] > 0
        ns_st = st["namespaces"][ns]
        assert ns_st["clients"] == 1 and ns_st["leases"] == 0
        assert shared_server.proc.poll() is None
    finally:
        bystander.close()


def test_a_socket_path_longer_than_unix_allows_is_refused_naming_the_limit(tmp_path: Path) -> None:
    d = tmp_path / ("x" * 120)
    with pytest.raises(ValueError, match="at most 107"):
        prepare_socket_dir(d / "s.sock")
    assert not d.exists()

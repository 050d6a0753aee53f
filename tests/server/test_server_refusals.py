"""What a refused client is told, against a real server process: a peer refused for its uid
hears ``NOT_ALLOWED`` (``BAD_TOKEN`` only for a wrong token of an allowed uid); a client past the
connection cap always reads the ``FULL`` answer, however late it sends its hello; a status query
of the server's own user gets through a full server (a small reserve); and the ``since start``
count of ``status`` counts client connections only."""

from __future__ import annotations

import os
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lmcache_async.cli import main
from lmcache_async.server import connection as wire
from lmcache_async.server.client import ServerClient, ServerUnavailable, query_status
from lmcache_async.server.connection import connect as _connect
from lmcache_async.server.protocol import HELLO, MAGIC, VERSION, WELCOME, Mode, Status
from lmcache_async.server.server import STATUS_RESERVE
from lmcache_async.testing.cache_server import CacheServerProcess

from .hostile_support import _raw_handshake
from .test_server_hostile import OTHER_UID, THIRD_UID, _as_uid, needs_root


def _refusal(path: str, ns: str, token: str | None, mode: Mode = Mode.CLIENT) -> str:
    """The message of the refusal a connection of this process gets ("admitted" when none)."""
    try:
        conn = _connect(path, ns, token, mode, time.monotonic() + 10.0, server_uid=0)
    except (OSError, ServerUnavailable) as exc:
        return str(exc)
    conn.close()
    return "admitted"


@pytest.fixture
def shared_socket_server() -> Iterator[CacheServerProcess]:
    """A server whose socket other users reach: ``t1`` is bound to OTHER_UID, ``t2`` to OTHER_UID
    with its own token; the server has a token of its own."""
    base = Path(tempfile.mkdtemp(prefix="lmc-refuse-", dir="/tmp"))
    os.chmod(base, 0o711)
    srv = CacheServerProcess(
        base / "srv",
        cache_server_token="server-token",
        cache_server_namespaces={"t1": {"uids": [OTHER_UID]}, "t2": {"uids": [OTHER_UID], "token": "t2-token"}},
    )
    os.chmod(srv.workdir, 0o711)
    srv.start()
    yield srv
    srv.kill()


# ---- a uid refused is told so ------------------------------------------------------------------------
@needs_root
def test_a_peer_refused_for_its_uid_is_told_not_allowed_not_bad_token(shared_socket_server) -> None:
    path = shared_socket_server.socket

    def stranger() -> dict[str, str]:  # bound to no namespace: its token does not matter
        return {
            "t1": _refusal(path, "t1", "server-token"),
            "t2": _refusal(path, "t2", "t2-token"),
            "unbound": _refusal(path, "default", "server-token"),
            "status": _refusal(path, "", "server-token", Mode.STATUS),
        }

    out = _as_uid(THIRD_UID, stranger)
    assert isinstance(out, dict) and set(out) == {"t1", "t2", "unbound", "status"}, out
    for why in out.values():
        assert "NOT_ALLOWED" in why and "uid/gid" in why and "BAD_TOKEN" not in why, out


@needs_root
def test_a_wrong_token_of_an_allowed_uid_is_still_bad_token(shared_socket_server) -> None:
    path = shared_socket_server.socket

    def tenant() -> dict[str, str]:
        return {
            "t1_ok": _refusal(path, "t1", "server-token"),
            "t1_wrong": _refusal(path, "t1", "wrong"),
            "t2_server_token": _refusal(path, "t2", "server-token"),  # t2 wants its own
            "status_wrong": _refusal(path, "", "wrong", Mode.STATUS),
            "other_ns": _refusal(path, "default", "server-token"),  # an unbound one: our user's
        }

    out = _as_uid(OTHER_UID, tenant)
    assert isinstance(out, dict), out
    assert out["t1_ok"] == "admitted", out
    for k in ("t1_wrong", "t2_server_token", "status_wrong"):
        assert "BAD_TOKEN" in out[k] and "NOT_ALLOWED" not in out[k], out
    assert "NOT_ALLOWED" in out["other_ns"], out


def test_our_own_user_with_a_wrong_token_is_bad_token(make_server) -> None:
    srv = make_server(cache_server_token="right").start()
    assert "BAD_TOKEN" in _refusal(srv.socket, "ns", "wrong")
    assert "BAD_TOKEN" in _refusal(srv.socket, "", "wrong", Mode.STATUS)
    assert _refusal(srv.socket, "ns", "right") == "admitted"


# ---- the connection cap ------------------------------------------------------------------------------
def _hold(path: str, n: int) -> list[socket.socket]:
    """``n`` admitted client connections (their pool descriptors closed)."""
    held = []
    for _ in range(n):
        sock, fd, _fields = _raw_handshake(path, "cap")
        os.close(fd)
        held.append(sock)
    return held


def _late_hello(path: str, delay_s: float, mode: Mode = Mode.CLIENT) -> int:
    """The handshake status a client that waits ``delay_s`` before its hello reads."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    try:
        sock.connect(path)
        time.sleep(delay_s)
        sock.sendall(HELLO.pack(MAGIC, VERSION, int(mode), 3, 0) + b"cap")
        return int(WELCOME.unpack(sock.recv(WELCOME.size))[2])
    finally:
        sock.close()


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_client_past_the_cap_reads_full_even_when_its_hello_comes_late(make_server, loop: str) -> None:
    srv = make_server(loop=loop, cache_server_max_connections=4).start()
    held = _hold(srv.socket, 4)
    try:
        for _ in range(3):
            assert _late_hello(srv.socket, 0.2) == Status.FULL  # no broken pipe
        assert srv.status()["refused_connections"] == 3
    finally:
        for s in held:
            s.close()


def test_a_client_whose_hello_fails_to_send_still_reads_the_servers_answer(
    make_server, monkeypatch: pytest.MonkeyPatch
) -> None:
    srv = make_server(cache_server_max_connections=2).start()
    held = _hold(srv.socket, 2)
    real = wire.server_uid_of

    def slow_server_uid_of(sock: socket.socket) -> int:
        time.sleep(2.5)  # past the server's wait for the hello: it answers FULL and closes first
        return real(sock)

    monkeypatch.setattr(wire, "server_uid_of", slow_server_uid_of)
    try:
        why = _refusal(srv.socket, "cap", None)
        assert "FULL" in why and "cache_server_max_connections" in why, why
    finally:
        for s in held:
            s.close()


def test_status_of_our_user_gets_through_a_full_server_within_the_reserve(
    make_server, capsys: pytest.CaptureFixture[str]
) -> None:
    srv = make_server(cache_server_max_connections=4).start()
    held = _hold(srv.socket, 4)
    reserve: list[wire.Connection] = []
    try:
        assert main(["status", "--socket", srv.socket, "--timeout", "5"]) == 0
        assert "clients  4 connected" in capsys.readouterr().out
        assert "FULL" in _refusal(srv.socket, "cap", None)  # clients still are not
        for _ in range(STATUS_RESERVE):  # status connections held open fill the reserve
            reserve.append(_connect(srv.socket, "", None, Mode.STATUS, time.monotonic() + 10.0))
        assert main(["status", "--socket", srv.socket, "--timeout", "5"]) == 1
        err = capsys.readouterr().err
        assert "refused this query" in err and "FULL" in err and "Broken pipe" not in err, err
        reserve.pop().close()
        assert query_status(srv.socket, timeout_s=5.0)["clients"] == 4  # a reserve slot is free again
    finally:
        for c in reserve:
            c.close()
        for s in held:
            s.close()


@needs_root
def test_the_status_reserve_is_only_for_the_servers_own_user() -> None:
    base = Path(tempfile.mkdtemp(prefix="lmc-reserve-", dir="/tmp"))
    os.chmod(base, 0o711)
    srv = CacheServerProcess(
        base / "srv", cache_server_max_connections=2, cache_server_namespaces={"t1": {"uids": [OTHER_UID]}}
    )
    os.chmod(srv.workdir, 0o711)
    srv.start()
    held = _hold(srv.socket, 2)
    try:
        tenant = _as_uid(OTHER_UID, lambda: _refusal(srv.socket, "", None, Mode.STATUS))
        assert isinstance(tenant, str) and "FULL" in tenant, tenant  # admitted to t1, but not the reserve
        assert query_status(srv.socket, timeout_s=5.0)["clients"] == 2  # the server's own user's gets through
    finally:
        for s in held:
            s.close()
        srv.kill()


# ---- the figures ----------------------------------------------------------------------------------------
def test_since_start_counts_client_connections_only(make_server, capsys: pytest.CaptureFixture[str]) -> None:
    srv = make_server().start()  # start() asked for the status once already
    clients = [ServerClient(srv.socket, "count", timeout_s=5.0) for _ in range(2)]
    try:
        for c in clients:
            assert c.ping()
        assert srv.status()["connections_total"] == 2
        assert main(["status", "--socket", srv.socket]) == 0
        assert "(2 since start," in capsys.readouterr().out
        assert srv.status()["connections_total"] == 2
    finally:
        for c in clients:
            c.close()

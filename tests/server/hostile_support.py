"""A raw client handshake for the hostile-client tests of the server (test_server_hostile*.py):
what a client that skips :class:`~lmcache_async.server.client.ServerClient`'s checks sees."""

from __future__ import annotations

import socket

from lmcache_async.server.protocol import HELLO, MAGIC, VERSION, WELCOME, Mode, Status


def _raw_handshake(path: str, ns: str, token: str = "") -> tuple[socket.socket, int, tuple[int, ...]]:
    """A raw HELLO: (socket, the pool's descriptor, the WELCOME fields)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(path)
    nsb, tok = ns.encode(), token.encode()
    sock.sendall(HELLO.pack(MAGIC, VERSION, int(Mode.CLIENT), len(nsb), len(tok)) + nsb + tok)
    msg, fds, _flags, _addr = socket.recv_fds(sock, WELCOME.size, 1)
    fields = WELCOME.unpack(msg)
    assert fields[2] == Status.OK and len(fds) == 1
    return sock, fds[0], fields

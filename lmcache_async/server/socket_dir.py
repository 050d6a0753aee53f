"""Where the node cache server's socket lives: the default path, and the checks (or creation)
of its directory before the server binds, including the removal of a stale socket file."""

from __future__ import annotations

import contextlib
import os
import socket
import stat
from pathlib import Path

__all__ = ["MAX_SOCKET_PATH", "default_socket_path", "prepare_socket_dir"]

#: The longest Unix socket path Linux accepts (``sun_path`` is 108 bytes with its NUL).
MAX_SOCKET_PATH = 107


def default_socket_path() -> Path:
    """Where ``serve`` and ``status`` put the socket when no path is given:
    ``$XDG_RUNTIME_DIR/lmcache-async/cache.sock`` when that variable names a directory of ours,
    else ``<system temp dir>/lmcache-async-<uid>/cache.sock``. Clients never default: they name
    the socket (``cache_server_socket``)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        with contextlib.suppress(OSError):
            st = os.stat(runtime)
            if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid():
                return Path(runtime) / "lmcache-async" / "cache.sock"
    import tempfile

    return Path(tempfile.gettempdir()) / f"lmcache-async-{os.getuid()}" / "cache.sock"


def prepare_socket_dir(path: str | os.PathLike[str], *, shared: bool = False) -> Path:
    """Check (or create, 0700; 0711 when ``shared``) the socket's directory and remove a stale
    socket file.

    ``shared``: other users must reach the socket (namespaces bound to them), so the directory
    may be searchable by them, never writable. Raises ``ValueError`` (one line that says what to
    do) when the path is longer than a Unix socket path may be, when ``path`` exists and is not a
    socket, when the directory is not ours or is open to others beyond that, when it cannot be
    created or read (an I/O error, a read-only filesystem), or when a server already answers on it.
    """
    sock_path = Path(path)
    if len(os.fsencode(sock_path)) > MAX_SOCKET_PATH:
        raise ValueError(
            f"socket path {sock_path} is {len(os.fsencode(sock_path))} bytes; a Unix socket path "
            f"may have at most {MAX_SOCKET_PATH} (choose a shorter --socket)"
        )
    hint = f"or leave --socket out to use the default, {default_socket_path()}"
    try:
        mode_now = os.lstat(sock_path).st_mode
    except FileNotFoundError:
        mode_now = None
    except OSError as exc:
        raise ValueError(f"cannot look at {sock_path}: {exc.strerror or exc}") from None
    if mode_now is not None and not stat.S_ISSOCK(mode_now):
        what = "a directory" if stat.S_ISDIR(mode_now) else "a regular file" if stat.S_ISREG(mode_now) else "a file"
        raise ValueError(f"{sock_path} is {what}, not a socket: give a socket path ({hint})")
    parent = sock_path.absolute().parent  # a message names the directory, never "."
    mode = 0o711 if shared else 0o700
    try:
        if not parent.exists():
            parent.mkdir(mode=mode, parents=True)
            os.chmod(parent, mode)
        st = os.stat(parent)
    except OSError as exc:
        raise ValueError(f"cannot create the socket directory {parent}: {exc.strerror or exc} ({hint})") from None
    if st.st_uid != os.getuid():
        raise ValueError(f"socket directory {parent} is owned by uid {st.st_uid}, not by this user ({hint})")
    if shared and stat.S_IMODE(st.st_mode) & 0o022:
        raise ValueError(
            f"socket directory {parent} has mode {stat.S_IMODE(st.st_mode):o}; others must not write to it "
            f"(chmod 711 {parent})"
        )
    try:
        if shared and stat.S_IMODE(st.st_mode) & 0o011 != 0o011:
            os.chmod(parent, stat.S_IMODE(st.st_mode) | 0o111)  # ours, not writable by others: let them reach it
    except OSError as exc:
        raise ValueError(f"cannot open the socket directory {parent} to other users: {exc.strerror or exc}") from None
    if not shared and stat.S_IMODE(st.st_mode) & 0o077:
        raise ValueError(
            f"socket directory {parent} has mode {stat.S_IMODE(st.st_mode):o}; it must be 0700, only its user may "
            f"enter it (chmod 700 {parent}, {hint})"
        )
    if mode_now is not None:
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(1.0)
        try:
            probe.connect(str(sock_path))
        except OSError:
            try:
                sock_path.unlink()  # nobody listens: left over from a server that died
            except OSError as exc:
                raise ValueError(f"cannot remove the stale socket {sock_path}: {exc.strerror or exc}") from None
        else:
            raise ValueError(f"a server is already listening on {sock_path}")
        finally:
            probe.close()
    return sock_path

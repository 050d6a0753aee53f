"""``lmcache-async serve`` and ``status``: the node cache server in the foreground, and a running
server's figures; :func:`server_settings` resolves where a command finds the server for
``status`` and ``keys`` too.

Every one of them resolves the socket the same way: ``--socket``, else ``cache_server_socket``
of the configuration (``--config FILE`` or ``$LMCACHE_CONFIG_FILE``, then ``LMCACHE_<KEY>``
variables), else :func:`~lmcache_async.server.socket_dir.default_socket_path`. ``status`` and
``keys`` present ``--token``, else the configuration's ``cache_server_token``, and accept the
server uid ``cache_server_uid`` names, as the client tier does.

``serve`` always prints one start line on stderr once the socket listens (path, pid, pool size
and, above INFO, the ``status`` command that reaches it): below INFO its own line, at INFO and
DEBUG the server's start record, which names the same.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lmcache_async.cli import PROG

if TYPE_CHECKING:
    from lmcache_async.config import LMCacheEngineConfig

__all__ = ["ServerSettings", "add_serve_parser", "add_server_options", "add_status_parser", "server_settings"]


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """Where a command finds the server and what it presents: the socket path, the token (None:
    none) and the uid the server may run as besides ours (``cache_server_uid``)."""

    socket: str
    token: str | None
    server_uid: int | None


def server_settings(args: argparse.Namespace) -> ServerSettings:
    """The settings of a command with ``--socket``, ``--config`` and (optionally) ``--token``:
    an option wins over the configuration, the configuration over the default socket path.

    Loads the configuration (``ConfigError`` when it is invalid: the command's one error line).
    ``TypeError`` when ``args`` is not an ``argparse.Namespace``."""
    if not isinstance(args, argparse.Namespace):
        raise TypeError(f"args must be an argparse.Namespace, got {type(args).__name__}")
    from lmcache_async.config import load_engine_config

    return _settings(args, load_engine_config(getattr(args, "config", None)))


def _settings(args: argparse.Namespace, config: LMCacheEngineConfig) -> ServerSettings:
    """:func:`server_settings` of ``args`` over the loaded ``config``."""
    from lmcache_async.server.server import default_socket_path

    socket = getattr(args, "socket", None) or config.cache_server_socket or str(default_socket_path())
    token = getattr(args, "token", None)
    return ServerSettings(
        socket=str(socket),
        token=token if token is not None else config.cache_server_token,
        server_uid=config.cache_server_uid,
    )


def add_server_options(parser: argparse.ArgumentParser, *, token: bool) -> None:
    """Add ``--socket``, ``--config`` and (with ``token``) ``--token`` to ``parser``, worded alike
    for ``serve``, ``status`` and ``keys``."""
    parser.add_argument(
        "--socket",
        help="the server's Unix socket (default: cache_server_socket of the configuration, else "
        "$XDG_RUNTIME_DIR/lmcache-async/cache.sock, else <temp dir>/lmcache-async-<uid>/cache.sock)",
    )
    parser.add_argument("--config", metavar="FILE", help="YAML file (default: $LMCACHE_CONFIG_FILE)")
    if token:
        parser.add_argument("--token", help="token, when the server requires one (default: cache_server_token)")


# ---- serve -------------------------------------------------------------------------------------
def _start_line(level: int, hint: str) -> Callable[[str, int, int], None]:
    """What ``serve`` does once its server listens: print one line naming the socket, pid and pool
    size at every log level (the server logs its own start record at INFO, so below INFO that
    record is the line)."""

    def listening(path: str, pid: int, pool_bytes: int) -> None:
        if level > logging.INFO:
            from lmcache_async.config.units import human_bytes

            print(
                f"{PROG} serve: cache server listening on {path} (pid {pid}, pools of up to "
                f"{human_bytes(pool_bytes)} per namespace); {hint} shows it",
                file=sys.stderr,
                flush=True,
            )

    return listening


def _status_hint(args: argparse.Namespace, config: LMCacheEngineConfig, socket: str, default_socket: str) -> str:
    """The ``status`` command that reaches the server ``serve`` starts on ``socket`` with
    ``config``: ``--config`` when the token is in the file given with it, ``--socket`` when the
    socket is not the default one."""
    hint = f"{PROG} status"
    if args.config and config.source_of("cache_server_token").startswith("file "):
        hint += f" --config {args.config}"
    if socket != default_socket:
        hint += f" --socket {socket}"
    return hint


def _cmd_serve(args: argparse.Namespace) -> int:
    from lmcache_async.cli import UsageError
    from lmcache_async.config import load_engine_config
    from lmcache_async.server import run_server
    from lmcache_async.server.server import default_socket_path

    level = getattr(logging, args.log_level)
    logging.getLogger().setLevel(level)
    config = load_engine_config(args.config)
    settings = _settings(args, config)
    if args.events is not None:
        try:
            import msgspec  # noqa: F401
            import zmq  # noqa: F401
        except ImportError as exc:
            raise UsageError(f"--events needs pyzmq and msgspec ({exc}); pip install 'lmcache-async[events]'",
                             f"{PROG} serve") from None  # fmt: skip
    listening = _start_line(level, _status_hint(args, config, settings.socket, str(default_socket_path())))
    try:
        return run_server(config, settings.socket, args.events, on_listening=listening)
    except ValueError as exc:  # socket directory not private, a server already there, bad sizes, events endpoint
        raise UsageError(str(exc), f"{PROG} serve") from None


def add_serve_parser(sub: Any) -> None:
    """Add ``serve`` (the node cache server, in the foreground) to ``sub``."""
    sv = sub.add_parser(
        "serve",
        help="run the node cache server (foreground)",
        description="Serve one shared-memory cache pool per namespace (model) to every process on this "
        "machine over a Unix socket (clients use tier 'server' with cache_server_socket). Runs in the "
        "foreground, prints one line naming the socket once it listens and logs to stderr; SIGTERM stops "
        "accepting, closes clients and exits 0. Its socket's directory must be 0700 (created if absent); "
        "max_local_cpu_size sizes each pool.",
    )
    add_server_options(sv, token=False)
    sv.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sv.add_argument(
        "--events",
        metavar="tcp://HOST:PORT",
        help="publish the pools' KV events (vLLM's format, ZMQ PUB) there, with replay and snapshots on the "
        "next port (docs: Routing on the cache); needs the events extra",
    )
    sv.set_defaults(func=_cmd_serve)


# ---- status ------------------------------------------------------------------------------------
def _cmd_status(args: argparse.Namespace) -> int:
    from lmcache_async.cli import one_line
    from lmcache_async.server import query_status

    settings = server_settings(args)
    args.socket = settings.socket
    try:
        st = query_status(args.socket, token=settings.token, timeout_s=args.timeout, server_uid=settings.server_uid)
    except (OSError, ValueError) as exc:
        msg = one_line(exc)
        if msg.startswith("admission refused"):  # it answered, and said no
            print(f"{PROG} status: the cache server on {args.socket} refused this query: {msg}", file=sys.stderr)
        else:
            print(f"{PROG} status: no cache server answers on {args.socket}: {msg}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(st, indent=2, sort_keys=True))
        return 0
    _print_status(st)
    return 0


def _print_status(st: dict[str, Any]) -> None:
    """Print the figures of a status answer ``st``, one line per part and per namespace."""
    from lmcache_async.config.units import human_bytes

    print(f"server   pid {st.get('pid')} on {st.get('socket')}, up {st.get('uptime_s', 0):.0f} s")
    print(f"tiers    {', '.join(st.get('tiers', []))}")
    print(
        f"clients  {st.get('clients')} connected ({st.get('connections_total')} since start, "
        f"{st.get('rejected')} refused, {st.get('protocol_errors')} closed for bad messages)"
    )
    namespaces = st.get("namespaces", {})
    if not namespaces:
        print("namespaces  none yet")
    for name, ns in sorted(namespaces.items()):
        used, cap = ns.get("pool_used_bytes", 0), ns.get("pool_capacity_bytes", 0)
        committed = ns.get("pool_committed_bytes", cap)
        print(
            f"namespace {name!r}: {ns.get('entries')} entries, {human_bytes(ns.get('bytes'))}, pool "
            f"{human_bytes(used)} used of {human_bytes(committed)} committed (up to {human_bytes(cap)}), "
            f"{ns.get('clients')} clients, {ns.get('leases')} leases, {ns.get('grants')} grants, "
            f"hit rate {ns.get('hit_rate', 0.0):.1%} ({ns.get('hits')} hits, {ns.get('misses')} misses), "
            f"{ns.get('evictions')} evictions, generation {ns.get('generation', 0):x}"
        )


def add_status_parser(sub: Any) -> None:
    """Add ``status`` (a running cache server's figures) to ``sub``."""
    st = sub.add_parser(
        "status",
        help="print a running cache server's tiers, clients, namespaces and leases",
        description="Ask the cache server on the socket (--socket, else the configuration's "
        "cache_server_socket, else serve's default) for its figures: tiers, clients, namespaces with "
        "entries, bytes, hit rates, leases and grants. The token is --token, else the configuration's "
        "cache_server_token. Exit status 1 when no server answers or it refuses the query.",
    )
    add_server_options(st, token=True)
    st.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the answer (default 5)")
    st.add_argument("--json", action="store_true", help="print JSON")
    st.set_defaults(func=_cmd_status)

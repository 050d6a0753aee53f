"""Parsing of ``remote_url`` values into a :class:`RemoteURL`.

Accepted forms (credentials are percent-decoded; ``?name=value`` options follow the path):

* ``redis://[[user]:password@]host[:port][/db]`` and ``valkey://`` (same wire protocol)
* ``rediss://...`` and ``valkeys://...`` — TLS; options ``ssl_ca_certs``, ``ssl_certfile``,
  ``ssl_keyfile``, ``ssl_cert_reqs`` (``none``/``optional``/``required``), ``ssl_check_hostname``
* ``unix://[[user]:password@]/path/to/redis.sock[?db=N&password=...]``
* ``redis+cluster://[[user]:password@]host:port[,host:port...]`` (``rediss+cluster://`` for TLS;
  ``valkey+cluster://`` is an alias)
* ``fs:///absolute/dir`` or ``fs://relative/dir`` — a shared filesystem directory
* ``mooncake://host[:port]`` — a Mooncake Store master (RPC port, default 50051); the client
  settings come from the ``mooncake_*`` configuration keys
* ``s3://BUCKET[/PREFIX]`` — an S3 bucket (objects below ``PREFIX``); endpoint, region and
  credentials come from the ``s3_*`` configuration keys, never from the URL

Options valid for every Redis-family URL: ``db``, ``max_connections``, ``socket_read_size``,
``client_name``, ``password``, ``username``. Unknown options are refused with a ``ValueError``
naming them, so a typo never silently disables TLS verification.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import parse_qsl, unquote

__all__ = ["RemoteURL", "parse_remote_url", "redact"]

DEFAULT_PORT = 6379
MOONCAKE_PORT = 50051

_REDIS_SCHEMES = {"redis": False, "valkey": False, "rediss": True, "valkeys": True}
_CLUSTER_SCHEMES = {
    "redis+cluster": False,
    "valkey+cluster": False,
    "rediss+cluster": True,
    "valkeys+cluster": True,
}
_COMMON_OPTS = frozenset({"db", "max_connections", "socket_read_size", "client_name", "password", "username"})
_TLS_OPTS = frozenset({"ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs", "ssl_check_hostname"})
_FS_OPTS = frozenset({"fsync"})
_CERT_REQS = ("none", "optional", "required")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


@dataclass(frozen=True)
class RemoteURL:
    """A parsed ``remote_url``.

    ``kind`` is ``"redis"``, ``"unix"``, ``"cluster"``, ``"fs"``, ``"mooncake"`` or ``"s3"``; ``scheme``
    the scheme as written (lower case). ``hosts`` holds ``(host, port)`` pairs (one for ``redis``,
    one or more for ``cluster``, none otherwise); ``path`` the socket path (``unix``), directory
    (``fs``) or object-name prefix (``s3``, "" for none); ``bucket`` the S3 bucket.
    """

    scheme: str
    kind: str
    hosts: tuple[tuple[str, int], ...] = ()
    path: str | None = None
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    db: int = 0
    tls: bool = False
    options: dict[str, str] = field(default_factory=dict)
    bucket: str | None = None

    def option_int(self, name: str, default: int, minimum: int = 1) -> int:
        """Integer option ``name`` (``ValueError`` naming it when malformed or below ``minimum``)."""
        raw = self.options.get(name)
        if raw is None:
            return default
        try:
            value = int(raw)
        except ValueError:
            raise ValueError(f"remote_url option {name}={raw!r} is not an integer") from None
        if value < minimum:
            raise ValueError(f"remote_url option {name}={value} must be >= {minimum}")
        return value

    def option_bool(self, name: str, default: bool) -> bool:
        """Boolean option ``name`` (true/false, yes/no, on/off, 1/0)."""
        raw = self.options.get(name)
        if raw is None:
            return default
        low = raw.strip().lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise ValueError(f"remote_url option {name}={raw!r} is not a boolean")


def redact(url: str) -> str:
    """``url`` with any password replaced by ``***`` (for logs and errors)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    auth, at, tail = rest.rpartition("@")
    if at and ":" in auth:
        user = auth.split(":", 1)[0]
        rest = f"{user}:***@{tail}"
    if "password=" in rest:
        head, _, query = rest.partition("?")
        parts = [("password=***" if p.startswith("password=") else p) for p in query.split("&")]
        rest = head + "?" + "&".join(parts)
    return f"{scheme}://{rest}"


def _split_userinfo(netloc: str) -> tuple[str | None, str | None, str]:
    userinfo, at, hostpart = netloc.rpartition("@")
    if not at:
        return None, None, netloc
    user, colon, pw = userinfo.partition(":")
    username = unquote(user) or None
    password = unquote(pw) if colon else None
    if not colon and username is not None:
        # "redis://secret@host" is the common spelling of a password without a user name.
        username, password = None, username
    return username, password, hostpart


def _parse_host(text: str, url: str) -> tuple[str, int]:
    text = text.strip()
    if not text:
        raise ValueError(f"remote_url {redact(url)!r} names an empty host")
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise ValueError(f"remote_url {redact(url)!r}: unterminated IPv6 address")
        host, rest = text[1:end], text[end + 1 :]
        port_text = rest[1:] if rest.startswith(":") else ""
        if rest and not rest.startswith(":"):
            raise ValueError(f"remote_url {redact(url)!r}: bad host {text!r}")
    else:
        host, _, port_text = text.partition(":")
    if not host:
        raise ValueError(f"remote_url {redact(url)!r} names an empty host")
    if not port_text:
        return host, DEFAULT_PORT
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"remote_url {redact(url)!r}: port {port_text!r} is not a number") from None
    if not 0 < port < 65536:
        raise ValueError(f"remote_url {redact(url)!r}: port {port} is out of range")
    return host, port


def _query(query: str, allowed: frozenset[str], url: str) -> dict[str, str]:
    opts: dict[str, str] = {}
    for name, value in parse_qsl(query, keep_blank_values=True, strict_parsing=False):
        if name not in allowed:
            raise ValueError(
                f"remote_url {redact(url)!r}: unknown option {name!r} (known: {', '.join(sorted(allowed))})"
            )
        opts[name] = value
    return opts


def _db(text: str, url: str) -> int:
    text = text.strip("/")
    if not text:
        return 0
    try:
        db = int(text)
    except ValueError:
        raise ValueError(f"remote_url {redact(url)!r}: database {text!r} is not a number") from None
    if db < 0:
        raise ValueError(f"remote_url {redact(url)!r}: database must be >= 0")
    return db


def parse_remote_url(url: str) -> RemoteURL:
    """Parse ``url``; ``ValueError`` naming the problem (never echoing a password)."""
    if not isinstance(url, str):
        raise TypeError(f"remote_url must be a str, got {type(url).__name__}")
    url = url.strip()
    scheme, sep, rest = url.partition("://")
    if not sep or not scheme:
        raise ValueError(f"remote_url {redact(url)!r} is not a URL (expected scheme://...)")
    scheme = scheme.lower()
    rest, _, _frag = rest.partition("#")
    body, _, query = rest.partition("?")
    if scheme == "fs":
        return _parse_fs(body, query, url)
    if scheme == "unix":
        return _parse_unix(body, query, url)
    if scheme in _REDIS_SCHEMES or scheme in _CLUSTER_SCHEMES:
        return _parse_redis(scheme, body, query, url)
    if scheme == "mooncake":
        return _parse_mooncake(body, query, url)
    if scheme == "s3":
        return _parse_s3(body, query, url)
    known = sorted([*_REDIS_SCHEMES, *_CLUSTER_SCHEMES, "unix", "fs", "mooncake", "s3"])
    raise ValueError(f"remote_url scheme {scheme!r} is not supported (known: {', '.join(known)})")


def _parse_fs(body: str, query: str, url: str) -> RemoteURL:
    """``fs://DIR[?fsync=none|data|full]``: a shared filesystem directory (absolute or relative)."""
    opts = _query(query, _FS_OPTS, url)
    path = unquote(body)
    if not path:
        raise ValueError("remote_url fs:// needs a directory, e.g. fs:///shared/lmcache")
    fsync = opts.get("fsync", "none")
    if fsync not in ("none", "data", "full"):
        raise ValueError(f"remote_url option fsync={fsync!r} must be none, data or full")
    return RemoteURL(scheme="fs", kind="fs", path=path, options=opts)


def _parse_unix(body: str, query: str, url: str) -> RemoteURL:
    """``unix://[[user]:password@]/path.sock[?db=N&...]``: a Redis server's Unix socket (no host)."""
    opts = _query(query, _COMMON_OPTS, url)
    netloc, slash, path = body.partition("/")
    username, password, host = _split_userinfo(netloc)
    if host:
        raise ValueError(f"remote_url {redact(url)!r}: unix:// takes a path (unix:///run/redis.sock)")
    sock = unquote(slash + path)
    if sock in ("", "/"):
        raise ValueError(f"remote_url {redact(url)!r} names no socket path")
    return RemoteURL(
        scheme="unix",
        kind="unix",
        path=sock,
        username=opts.pop("username", None) or username,
        password=opts.pop("password", None) or password,
        db=_db(opts.pop("db", "0"), url),
        options=opts,
    )


def _parse_redis(scheme: str, body: str, query: str, url: str) -> RemoteURL:
    """A Redis-family URL (``scheme`` in :data:`_REDIS_SCHEMES` or :data:`_CLUSTER_SCHEMES`): one
    ``host[:port][/db]``, or for a cluster a comma-separated seed list and database 0 only; TLS
    options only on a TLS scheme."""
    tls = _REDIS_SCHEMES.get(scheme, _CLUSTER_SCHEMES.get(scheme, False))
    allowed = _COMMON_OPTS | _TLS_OPTS if tls else _COMMON_OPTS
    opts = _query(query, allowed, url)
    netloc, _, path = body.partition("/")
    username, password, hostpart = _split_userinfo(netloc)
    cluster = scheme in _CLUSTER_SCHEMES
    host_texts = hostpart.split(",") if cluster else [hostpart]
    if not cluster and "," in hostpart:
        raise ValueError(f"remote_url {redact(url)!r} lists several hosts; use redis+cluster:// for a cluster")
    hosts = tuple(_parse_host(h, url) for h in host_texts)
    db = _db(opts.pop("db", path), url) if not cluster else 0
    if cluster and path.strip("/") not in ("", "0"):
        raise ValueError(f"remote_url {redact(url)!r}: a Redis Cluster has only database 0")
    reqs = opts.get("ssl_cert_reqs")
    if reqs is not None and reqs not in _CERT_REQS:
        raise ValueError(f"remote_url option ssl_cert_reqs={reqs!r} must be one of {_CERT_REQS}")
    return RemoteURL(
        scheme=scheme,
        kind="cluster" if cluster else "redis",
        hosts=hosts,
        username=opts.pop("username", None) or username,
        password=opts.pop("password", None) or password,
        db=db,
        tls=tls,
        options=opts,
    )


def _parse_mooncake(body: str, query: str, url: str) -> RemoteURL:
    """``mooncake://HOST[:PORT]``: one master address (default port :data:`MOONCAKE_PORT`), no
    credentials, path or options."""
    _query(query, frozenset(), url)
    netloc, _, path = body.partition("/")
    if path.strip("/") or "@" in netloc or "," in netloc:
        raise ValueError(f"remote_url {redact(url)!r}: mooncake:// takes one host:port (the master)")
    tail = netloc.rsplit("]", 1)[-1]
    master = _parse_host(netloc if ":" in tail else f"{netloc}:{MOONCAKE_PORT}", url)
    return RemoteURL(scheme="mooncake", kind="mooncake", hosts=(master,))


_BUCKET_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789-.")
_S3_PREFIX_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_./")


def _parse_s3(body: str, query: str, url: str) -> RemoteURL:
    """``s3://BUCKET[/PREFIX]``: a bucket name by S3's rules and a plain object-name prefix."""
    _query(query, frozenset(), url)
    bucket, _, prefix = body.partition("/")
    if "@" in bucket or ":" in bucket:
        raise ValueError(f"remote_url {redact(url)!r}: s3:// takes no credentials or port (use the s3_* keys)")
    if not 3 <= len(bucket) <= 63 or not set(bucket) <= _BUCKET_CHARS or not bucket[0].isalnum():
        raise ValueError(f"remote_url {redact(url)!r}: {bucket!r} is not an S3 bucket name")
    prefix = prefix.strip("/")
    if not set(prefix) <= _S3_PREFIX_CHARS or any(seg in ("", ".", "..") for seg in prefix.split("/") if prefix):
        raise ValueError(f"remote_url {redact(url)!r}: prefix {prefix!r} must be letters, digits, '-_./' segments")
    return RemoteURL(scheme="s3", kind="s3", path=prefix, bucket=bucket)

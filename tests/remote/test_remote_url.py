"""remote_url parsing, the connector registry, key naming and the factory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lmcache_async.memory import PoolAllocator
from lmcache_async.remote import (
    RemoteBackend,
    create,
    known_schemes,
    make_connector,
    parse_remote_url,
    register_connector,
)
from lmcache_async.remote.connector import ConnectorSettings
from lmcache_async.remote.fs import FSConnector
from lmcache_async.remote.fs import create as fs_create
from lmcache_async.remote.naming import MAX_SEGMENT, check_prefix, encode_segment, entry_name
from lmcache_async.remote.url import redact
from lmcache_async.testing import make_key, make_obj


def test_plain_redis_url_defaults() -> None:
    u = parse_remote_url("redis://cache.example")
    assert (u.kind, u.hosts, u.db) == ("redis", (("cache.example", 6379),), 0)
    assert (u.password, u.username, u.tls) == (None, None, False)


def test_password_user_db_and_options_come_from_the_url() -> None:
    u = parse_remote_url("redis://alice:p%40ss%3Aw@10.0.0.1:7000/3?max_connections=4&client_name=x")
    assert u.username == "alice" and u.password == "p@ss:w"
    assert u.hosts == (("10.0.0.1", 7000),) and u.db == 3
    assert u.option_int("max_connections", 8) == 4 and u.options["client_name"] == "x"


def test_password_without_user_in_both_spellings() -> None:
    assert parse_remote_url("redis://:pw@h").password == "pw"
    u = parse_remote_url("redis://secret@h")
    assert u.password == "secret" and u.username is None


def test_tls_options() -> None:
    u = parse_remote_url("rediss://h:6380?ssl_ca_certs=/ca.pem&ssl_cert_reqs=none&ssl_check_hostname=yes")
    assert u.tls and u.options["ssl_ca_certs"] == "/ca.pem" and u.option_bool("ssl_check_hostname", False)
    assert parse_remote_url("valkeys://h").tls


@pytest.mark.parametrize(
    "url",
    [
        "rediss://h?ssl_cert_reqs=maybe",
        "redis://h?ssl_ca_certs=/x",  # a TLS option on a plain URL is a mistake, not ignored
        "redis://h?sslca=/x",
        "redis://h:99999",
        "redis://h:port",
        "redis://a:1,b:2",
        "redis://h/notadb",
        "redis+cluster://a:1/2",
        "unix://host/path.sock",
        "unix://",
        "fs://",
        "fs:///x?fsync=always",
        "ftp://h",
        "no-scheme",
    ],
)
def test_malformed_urls_are_refused(url: str) -> None:
    with pytest.raises(ValueError):
        parse_remote_url(url)


def test_unix_socket_url() -> None:
    u = parse_remote_url("unix:///run/redis/redis.sock?db=2&password=pw")
    assert (u.kind, u.path, u.db, u.password) == ("unix", "/run/redis/redis.sock", 2, "pw")
    u = parse_remote_url("unix://user:pw@/tmp/r.sock")
    assert (u.path, u.username, u.password) == ("/tmp/r.sock", "user", "pw")


def test_valkey_scheme_is_redis_protocol() -> None:
    assert parse_remote_url("valkey://h:1").kind == "redis"


def test_cluster_url_lists_every_seed_node() -> None:
    u = parse_remote_url("redis+cluster://:pw@a:7000,b:7001,[::1]:7002")
    assert u.kind == "cluster" and u.password == "pw"
    assert u.hosts == (("a", 7000), ("b", 7001), ("::1", 7002))
    assert parse_remote_url("rediss+cluster://a:1").tls


def test_fs_url_paths() -> None:
    assert parse_remote_url("fs:///shared/lmcache").path == "/shared/lmcache"
    assert parse_remote_url("fs://relative/dir?fsync=data").path == "relative/dir"
    assert parse_remote_url("fs:///d%20ir").path == "/d ir"


def test_passwords_never_appear_in_errors_or_redacted_urls() -> None:
    assert "hunter2" not in redact("redis://u:hunter2@h:1")
    assert "hunter2" not in redact("unix:///s.sock?password=hunter2&db=1")
    with pytest.raises(ValueError) as err:
        parse_remote_url("redis://u:hunter2@h:notaport")
    assert "hunter2" not in str(err.value)


def test_registry_knows_every_builtin_scheme() -> None:
    for scheme in ("redis", "rediss", "valkey", "valkeys", "unix", "redis+cluster", "rediss+cluster", "fs"):
        assert scheme in known_schemes()


def test_unknown_scheme_is_a_value_error() -> None:
    settings = ConnectorSettings(timeout_s=1.0, part_size=1 << 20, ttl_s=None)
    with pytest.raises(ValueError, match="gopher"):
        make_connector("gopher://h", settings)


async def test_registered_scheme_builds_its_connector(make_ctx: Any, tmp_path: Path) -> None:
    def shared_dir(url: str, settings: ConnectorSettings) -> FSConnector:
        return fs_create("fs://" + url.split("://", 1)[1], settings)

    register_connector("teamshare", shared_dir, replace=True)
    with pytest.raises(ValueError):
        register_connector("teamshare", shared_dir)
    be = RemoteBackend(make_ctx(), f"teamshare://{tmp_path}", prefix="reg")
    pool = PoolAllocator(1 << 20, name="reg", pretouch=False)
    src = make_obj(pool, (8, 8))
    try:
        assert isinstance(be.connector, FSConnector) and be.connector.scheme == "teamshare"
        assert await be.put(make_key(1), src)
        assert list(tmp_path.rglob("*.rec"))
    finally:
        src.ref_count_down()
        await be.close()


@pytest.mark.parametrize("bad", ["", ".hidden", "a b", "a{b}", "a*", "x/y", "a" * 129])
def test_bad_prefixes_are_refused_naming_the_key(bad: str) -> None:
    with pytest.raises(ValueError, match="remote_key_prefix"):
        check_prefix(bad)


def test_model_segments_are_safe_distinct_and_short() -> None:
    segs = {m: encode_segment(m) for m in ["a/b", "a%2Fb", "..", ".", "", "{tag}", "x:y", "模型", "x" * 500, "x" * 501]}
    assert len(set(segs.values())) == len(segs)
    for s in segs.values():
        assert s and not s.startswith(".") and "/" not in s and "{" not in s and ":" not in s
        assert len(s) <= MAX_SEGMENT
    a = entry_name("p", make_key(1, model="m"))
    assert a.record == f"p:m:{{{a.digest}}}" and a.relpath.startswith("p/m/")
    assert a.part("0123456789abcdef", 3) == a.record + ":0123456789abcdef:3"


def test_create_without_remote_url_builds_nothing(make_ctx: Any) -> None:
    assert create(make_ctx()) is None


def test_invalid_settings_are_refused(make_ctx: Any) -> None:
    with pytest.raises(ValueError, match="remote_part_size"):
        RemoteBackend(make_ctx(), "redis://h", part_size=0)
    with pytest.raises(ValueError, match="remote_key_prefix"):
        RemoteBackend(make_ctx(), "redis://h", prefix="bad prefix")
    with pytest.raises(ValueError):
        RemoteBackend(make_ctx(), "redis://h?nonsense=1")

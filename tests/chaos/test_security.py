"""Security: hostile key material never leaves the cache directory; no unpickling anywhere;
private file modes; Redis authentication (and TLS where the server has it) works and fails
cleanly; namespaces on one server stay apart.
"""

from __future__ import annotations

import ast
import contextlib
import logging
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import lmcache_async
from lmcache_async import ECCacheEngine, LMCacheEngineConfig, LMCacheEngineMetadata, StorageManager
from lmcache_async.keys import CacheEngineKey
from lmcache_async.testing.servers import RedisServer, make_tls_files, server_supports_tls

from .chaos_support import chaos_key, files_below, payload, same_payload, tree_snapshot

HOSTILE_MODELS = [
    "../../../../etc/passwd",
    "..",
    ".",
    "/absolute/path",
    "a/../../b",
    "..\\..\\windows",
    "a\x00b",
    "\x00",
    "%2e%2e%2f%2e%2e%2f",
    "~root",
    "name with spaces\n\t\r",
    "\u202eevil\u202d",  # right-to-left override
    "x" * 300,
    "../" * 200,
    "é" * 5000,
    "y" * 70_000,  # the key string is longer than a record header may hold
]


@contextlib.contextmanager
def umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def _tier_config(tier: str, cache_dir: Path, srv: Any = None) -> dict[str, Any]:
    if tier == "disk":
        return {"local_disk": str(cache_dir), "max_local_disk_size": 0.25}
    if tier == "fs":
        return {"remote_url": f"fs://{cache_dir}"}
    if tier == "nixl":
        return {"nixl_path": str(cache_dir), "nixl_backend": "POSIX"}
    raise AssertionError(tier)


def _manager(extra: dict[str, Any], model: str = "sec/model", name: str = "sec") -> StorageManager:
    base: dict[str, Any] = dict(max_local_cpu_size=1 / 1024, staging_size=2 / 1024, remote_timeout_s=10,
                                blocking_timeout_secs=30)  # fmt: skip
    cfg = LMCacheEngineConfig.from_defaults(**{**base, **extra})
    return StorageManager(cfg, LMCacheEngineMetadata(model), name=name)


def _need(tier: str, request: pytest.FixtureRequest) -> None:
    if tier == "nixl":
        request.getfixturevalue("need_nixl")
    if tier == "disk":
        pytest.importorskip("lmcache_async.disk.tier")


def _evict(sm: StorageManager) -> None:
    assert sm.pool is not None
    block = sm.allocate((sm.pool.capacity,), torch.uint8)
    if block is not None:
        block.ref_count_down()


# ---- hostile keys ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("tier", ["disk", "fs", "nixl"])
def test_hostile_model_names_never_leave_the_cache_directory(tier, tmp_path, request, figures, monkeypatch):
    _need(tier, request)
    sandbox = tmp_path / "sandbox"
    cache_dir = sandbox / "cache"
    sandbox.mkdir()
    (sandbox / "sentinel").write_text("must stay untouched")
    workdir = tmp_path / "cwd"
    workdir.mkdir()
    monkeypatch.chdir(workdir)  # a relative path would land here
    outside_before = tree_snapshot(tmp_path)
    stored = rejected = 0
    sm = _manager(_tier_config(tier, cache_dir))
    try:
        for n, model in enumerate(HOSTILE_MODELS):
            key = CacheEngineKey(model, 1, 0, 1000 + n, torch.bfloat16)
            assert sm.put_sync(key, payload(n, 4096))
            sm.flush_sync(timeout=30)
            _evict(sm)
            obj = sm.get_sync(key)
            if obj is None:  # the tier refused it (a key string too long for a record): counted
                rejected += 1
                continue
            with obj:
                assert same_payload(obj, n, 4096), model[:40]
            stored += 1
        # Another process's view: the same keys round-trip after a restart.
        sm.close_sync()
        sm = _manager(_tier_config(tier, cache_dir))
        for n, model in enumerate(HOSTILE_MODELS[:-1]):
            obj = sm.get_sync(CacheEngineKey(model, 1, 0, 1000 + n, torch.bfloat16))
            if obj is not None:
                with obj:
                    assert same_payload(obj, n, 4096)
    finally:
        sm.close_sync()
    resolved = cache_dir.resolve()
    for p in files_below(cache_dir):
        assert p.resolve().is_relative_to(resolved), f"{p} escapes the cache directory"
        assert not p.is_symlink()
    after = tree_snapshot(tmp_path)
    new_outside = {p for p in after - outside_before if not p.startswith("sandbox/cache")}
    assert new_outside == {"sandbox/cache"} or not new_outside, f"created outside the cache: {sorted(new_outside)[:10]}"
    assert (sandbox / "sentinel").read_text() == "must stay untouched"
    assert stored >= len(HOSTILE_MODELS) - 1, f"only {stored} hostile keys round-tripped"
    figures("security: hostile model names", keys=len(HOSTILE_MODELS), tiers=1, stored=stored,
            refused=rejected, escaped=0)  # fmt: skip


def test_non_utf8_model_names_are_refused_or_contained(tmp_path, request):
    """A model name that is not valid Unicode (a lone surrogate, as ``os.fsdecode`` makes of
    undecodable bytes) is refused by keys; where a caller's metadata still carries one, nothing
    is written outside the directory and nothing raises out of the engine."""
    bad = b"model-\xff\xfe".decode("utf-8", "surrogateescape")
    with pytest.raises(ValueError, match="model_name"):
        CacheEngineKey(bad, 1, 0, 1, torch.bfloat16)
    cache_dir = tmp_path / "cache"
    before = tree_snapshot(tmp_path)
    try:
        md = LMCacheEngineMetadata(bad)
    except ValueError:
        return  # refused at the API boundary: fine
    cfg = LMCacheEngineConfig.from_defaults(
        max_local_cpu_size=1 / 1024, staging_size=1 / 1024, remote_url=f"fs://{cache_dir}", remote_timeout_s=5
    )
    try:
        ec = ECCacheEngine(cfg, md, "bfloat16")
    except ValueError:
        return
    with ec:
        ec.put("image-1", torch.ones(4, 4))
        ec.flush(timeout=30)
        ec.get("image-1")
        ec.contains("image-1")
    for p in files_below(tmp_path):
        assert p.resolve().is_relative_to(cache_dir.resolve()) or str(p.relative_to(tmp_path)) in before, p


# ---- no unpickling -------------------------------------------------------------------------------------------
FORBIDDEN_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "marshal", "shelve", "joblib"}
FORBIDDEN_CALLS = {("torch", "load"), ("torch", "save"), ("np", "load"), ("numpy", "load"), ("pickle", "loads")}


def _package_sources() -> list[Path]:
    pkg = Path(lmcache_async.__file__).parent  # the built-in tiers are inside it
    return sorted(pkg.rglob("*.py"))


def test_no_pickle_or_torch_load_anywhere_in_the_package(figures):
    offenders: list[str] = []
    files = _package_sources()
    assert len(files) > 20, files
    for path in files:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] in FORBIDDEN_MODULES:
                        offenders.append(f"{path}:{node.lineno} import {alias.name}")
            elif isinstance(node, ast.ImportFrom):
                if (node.module or "").split(".")[0] in FORBIDDEN_MODULES:
                    offenders.append(f"{path}:{node.lineno} from {node.module} import ...")
                if node.module == "torch" and any(a.name in ("load", "save") for a in node.names):
                    offenders.append(f"{path}:{node.lineno} from torch import load/save")
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                if (node.value.id, node.attr) in FORBIDDEN_CALLS:
                    offenders.append(f"{path}:{node.lineno} {node.value.id}.{node.attr}")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("eval", "exec"):
                offenders.append(f"{path}:{node.lineno} {node.func.id}()")
            elif isinstance(node, ast.keyword) and node.arg == "allow_pickle":
                offenders.append(f"{path}:{node.lineno} allow_pickle=")
    assert not offenders, "\n".join(offenders)
    figures("security: no pickle/torch.load", files_scanned=len(files), offenders=0)


# ---- file modes -----------------------------------------------------------------------------------------------
def _modes(root: Path) -> tuple[dict[str, int], dict[str, int]]:
    files, dirs = {}, {}
    for dirpath, _dirs, fnames in os.walk(root):
        dirs[dirpath] = stat.S_IMODE(os.stat(dirpath).st_mode)
        for f in fnames:
            p = os.path.join(dirpath, f)
            files[p] = stat.S_IMODE(os.lstat(p).st_mode)
    return files, dirs


def _check_modes(tier: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    _need(tier, request)
    cache_dir = tmp_path / "cache"
    with umask(0o022), _manager(_tier_config(tier, cache_dir)) as sm:  # 022: the usual default
        for i in range(20):
            sm.put_sync(chaos_key(i), payload(i, 2048))
        sm.flush_sync(timeout=30)
        files, dirs = _modes(cache_dir)
    assert files, "nothing was written"
    loose_files = {p: oct(m) for p, m in files.items() if m != 0o600}
    loose_dirs = {p: oct(m) for p, m in dirs.items() if m != 0o700}
    assert not loose_files, f"cache files must be 0600: {dict(list(loose_files.items())[:5])}"
    assert not loose_dirs, f"cache directories must be 0700: {dict(list(loose_dirs.items())[:5])}"


def test_disk_files_are_private(tmp_path, request):
    _check_modes("disk", tmp_path, request)


def test_fs_files_are_private(tmp_path, request):
    _check_modes("fs", tmp_path, request)


def test_nixl_files_are_private(tmp_path, request):
    _check_modes("nixl", tmp_path, request)


# ---- Redis authentication and TLS ----------------------------------------------------------------------------
PASSWORD = "p@ss:w/rd%S3cret"
PASSWORD_IN_URL = PASSWORD.replace("%", "%25").replace("@", "%40").replace("/", "%2F").replace(":", "%3A")


@pytest.fixture(scope="module")
def password_redis(server_binary: str) -> Iterator[RedisServer]:
    with RedisServer(server_binary, password=PASSWORD) as srv:
        yield srv


def _round_trip(sm: StorageManager, i: int) -> bool:
    sm.put_sync(chaos_key(i), payload(i, 20_000))
    sm.flush_sync(timeout=30)
    _evict(sm)
    obj = sm.get_sync(chaos_key(i))
    if obj is None:
        return False
    with obj:
        assert same_payload(obj, i, 20_000)
    return True


def test_redis_with_password_works(password_redis):
    with _manager({"remote_url": password_redis.url, "remote_key_prefix": "auth-ok"}) as sm:
        assert _round_trip(sm, 1)
        assert sm.stats()["tiers"]["remote"]["errors"] == 0


@pytest.mark.parametrize("how", ["wrong-password", "no-password", "wrong-user"])
def test_redis_wrong_credentials_fail_cleanly(password_redis, how, caplog, figures):
    port = password_redis.port
    url = {
        "wrong-password": f"redis://:not-{PASSWORD_IN_URL}@127.0.0.1:{port}",
        "no-password": f"redis://127.0.0.1:{port}",
        "wrong-user": f"redis://mallory:x@127.0.0.1:{port}",
    }[how]
    with caplog.at_level(logging.DEBUG):
        t0 = time.monotonic()
        sm = _manager({"remote_url": url, "remote_key_prefix": "auth-bad", "remote_timeout_s": 2})
        try:
            assert not _round_trip(sm, 2)  # the CPU tier still works; the remote tier misses
            assert sm.contains_sync(chaos_key(3)) is False
            st = sm.stats()["tiers"]["remote"]
            assert st["errors"] + st["skipped"] > 0 and st["writes"] == 0, st
        finally:
            sm.close_sync()
        elapsed = time.monotonic() - t0
    assert elapsed < 30
    assert "not-" + PASSWORD not in caplog.text and "S3cret" not in caplog.text, "a password reached the logs"
    assert password_redis.command("DBSIZE") == 0 or password_redis.command("KEYS", "auth-bad:*") == []
    figures("security: redis auth", wrong_credentials_refused=1)


@pytest.fixture(scope="module")
def tls_redis(server_binary: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    files = make_tls_files(tmp_path_factory.mktemp("tls"))
    if files is None:
        pytest.skip("neither the cryptography package nor openssl can make test certificates")
    if not server_supports_tls(server_binary):
        pytest.skip(f"{server_binary} was built without TLS")
    with RedisServer(server_binary, tls=files, password=PASSWORD) as srv:
        yield srv


def test_redis_over_tls_with_password_works(tls_redis):
    with _manager({"remote_url": tls_redis.url, "remote_key_prefix": "tls-ok"}) as sm:
        assert _round_trip(sm, 4)


def test_redis_tls_with_an_untrusted_ca_fails_cleanly(tls_redis, tmp_path):
    other = make_tls_files(tmp_path / "other-ca")
    assert other is not None
    url = tls_redis.url.split("?")[0] + f"?ssl_ca_certs={other.ca_cert}"
    with _manager({"remote_url": url, "remote_key_prefix": "tls-bad", "remote_timeout_s": 2}) as sm:
        assert not _round_trip(sm, 5)
        assert sm.stats()["tiers"]["remote"]["writes"] == 0


def test_plain_client_cannot_talk_to_a_tls_server(tls_redis):
    url = f"redis://:{PASSWORD_IN_URL}@127.0.0.1:{tls_redis.port}"
    with _manager({"remote_url": url, "remote_key_prefix": "tls-plain", "remote_timeout_s": 2}) as sm:
        assert not _round_trip(sm, 6)


# ---- namespaces -------------------------------------------------------------------------------------------------
def test_two_namespaces_on_one_server_never_see_each_other(shared_redis, figures):
    a = _manager({"remote_url": shared_redis.url, "remote_key_prefix": "tenant-a"}, name="a")
    b = _manager({"remote_url": shared_redis.url, "remote_key_prefix": "tenant-b"}, name="b")
    try:
        a.clear_sync()
        b.clear_sync()
        n = 50
        for i in range(n):  # the same keys, different bytes per tenant
            assert a.put_sync(chaos_key(i), payload(i, 4096, version=1))
            assert b.put_sync(chaos_key(i), payload(i, 4096, version=2))
        b.put_sync(chaos_key(10_000), payload(10_000, 64))  # only tenant b has this one
        a.flush_sync(timeout=30)
        b.flush_sync(timeout=30)
        _evict(a)
        _evict(b)
        for i in range(n):
            for sm, version in ((a, 1), (b, 2)):
                got = sm.get_sync(chaos_key(i))
                assert got is not None, (sm.name, i)
                with got as obj:
                    assert same_payload(obj, i, 4096, version), (sm.name, i)
                _evict(sm)
        assert not a.contains_sync(chaos_key(10_000)) and a.get_sync(chaos_key(10_000)) is None
        keys = shared_redis.command("KEYS", "tenant-*")
        assert keys and all(k.startswith((b"tenant-a:", b"tenant-b:")) for k in keys)
        a.clear_sync()  # clears its own namespace only
        assert shared_redis.command("KEYS", "tenant-a:*") == []
        assert len(shared_redis.command("KEYS", "tenant-b:*")) >= n + 1
        _evict(b)
        got = b.get_sync(chaos_key(7))
        assert got is not None
        with got as obj:
            assert same_payload(obj, 7, 4096, 2)
        b.clear_sync()
    finally:
        a.close_sync()
        b.close_sync()
    figures("security: namespaces", namespaces=2, keys_per_namespace=n, crossings=0)


def test_models_sharing_a_prefix_are_separate_namespaces(shared_redis):
    a = _manager({"remote_url": shared_redis.url, "remote_key_prefix": "shared"}, model="org/model-a", name="ma")
    b = _manager({"remote_url": shared_redis.url, "remote_key_prefix": "shared"}, model="org/model-b", name="mb")
    try:
        ka = CacheEngineKey("org/model-a", 1, 0, 42, torch.bfloat16)
        kb = CacheEngineKey("org/model-b", 1, 0, 42, torch.bfloat16)
        a.put_sync(ka, payload(1, 256))
        b.put_sync(kb, payload(2, 256))
        a.flush_sync(timeout=30)
        b.flush_sync(timeout=30)
        _evict(a)
        got = a.get_sync(ka)
        assert got is not None
        with got as obj:
            assert same_payload(obj, 1, 256)
        keys = shared_redis.command("KEYS", "shared:*")
        assert any(k.startswith(b"shared:org%2Fmodel-a:") for k in keys)
        assert any(k.startswith(b"shared:org%2Fmodel-b:") for k in keys)
    finally:
        with contextlib.suppress(Exception):
            a.clear_sync()
        a.close_sync()
        b.close_sync()

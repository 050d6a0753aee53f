"""Configuration of the NIXL tier: plugin choice, parameters, storage paths, clear errors.

Most of these run without NIXL; the GDS/OBJ tests that need the wheel are marked ``nixl``.
GDS round-trips when the GDS plugin can be created (GPU hosts) and otherwise checks the error.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from lmcache_async.config import LMCacheEngineConfig
from lmcache_async.errors import BackendUnavailableError, ConfigError
from lmcache_async.memory import GiB, MemoryFormat
from lmcache_async.nixl.agent import INSTALL_HINT
from lmcache_async.nixl.tier import NixlBackend, NixlSettings, create, storage_root
from lmcache_async.testing import make_key
from lmcache_async.tiers import BackendContext


def _cfg(**kw: object) -> LMCacheEngineConfig:
    return LMCacheEngineConfig.from_defaults(**kw)


def test_defaults_are_posix_one_file_per_entry(tmp_path: Path) -> None:
    s = NixlSettings.from_config(_cfg(nixl_path=str(tmp_path)))
    assert (s.plugin, s.path, s.pool_size, s.max_bytes, dict(s.params)) == ("POSIX", str(tmp_path), 0, 16 * GiB, {})
    assert not s.is_object_store


@pytest.mark.parametrize("name", ["gds", "GDS", " gds_mt "])
def test_gds_plugins_are_accepted_and_normalised(tmp_path: Path, name: str) -> None:
    s = NixlSettings.from_config(_cfg(nixl_path=str(tmp_path), nixl_backend=name, nixl_pool_size=8))
    assert s.plugin == name.strip().upper()
    assert s.pool_size == 8 and not s.is_object_store


def test_backend_params_pass_through_unchanged(tmp_path: Path) -> None:
    params = {"use_uring": "true", "kernel_queue_size": "512"}
    s = NixlSettings.from_config(_cfg(nixl_path=str(tmp_path), nixl_backend_params=params))
    assert dict(s.params) == params


def test_lmcache_list_spelling_sets_the_plugin(tmp_path: Path) -> None:
    s = NixlSettings.from_config(_cfg(nixl_path=str(tmp_path), nixl_backends=["GDS_MT", "POSIX"]))
    assert s.plugin == "GDS_MT"
    explicit = NixlSettings.from_config(_cfg(nixl_path=str(tmp_path), nixl_backends=["GDS"], nixl_backend="POSIX"))
    assert explicit.plugin == "POSIX"


def test_unknown_plugin_is_rejected_naming_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="nixl_backend='UCX'"):
        NixlSettings.from_config(_cfg(nixl_path=str(tmp_path), nixl_backend="UCX"))


def test_obj_needs_a_bucket(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AWS_DEFAULT_BUCKET", raising=False)
    with pytest.raises(ConfigError, match="bucket"):
        NixlSettings.from_config(_cfg(nixl_path="prefix", nixl_backend="OBJ"))
    s = NixlSettings.from_config(
        _cfg(nixl_path="prefix", nixl_backend="OBJ", nixl_backend_params={"bucket": "kv", "region": "eu-west-1"})
    )
    assert s.is_object_store and s.params["bucket"] == "kv"
    monkeypatch.setenv("AWS_DEFAULT_BUCKET", "from-env")
    assert NixlSettings.from_config(_cfg(nixl_path="prefix", nixl_backend="OBJ")).is_object_store


def test_obj_rejects_a_slot_pool() -> None:
    with pytest.raises(ConfigError, match="nixl_pool_size"):
        NixlSettings.from_config(
            _cfg(nixl_path="p", nixl_backend="OBJ", nixl_pool_size=4, nixl_backend_params={"bucket": "b"})
        )


def test_max_size_is_taken_from_nixl_max_size(tmp_path: Path) -> None:
    s = NixlSettings.from_config(_cfg(nixl_path=str(tmp_path), nixl_max_size=0.5))
    assert s.max_bytes == GiB // 2


def test_storage_root_separates_caches_and_workers(tmp_path: Path, backend_context) -> None:
    ctx: BackendContext = backend_context()
    files = NixlSettings(plugin="POSIX", path=str(tmp_path))
    assert storage_root(ctx, files) == str(tmp_path / "test-0")
    objs = NixlSettings(plugin="OBJ", path="lmcache/", params={"bucket": "b"})
    assert storage_root(ctx, objs) == "lmcache/test-0"


def test_no_tier_without_nixl_path(backend_context) -> None:
    assert create(backend_context()) is None


def test_missing_nixl_raises_naming_the_extra(tmp_path: Path) -> None:
    """With every NIXL module hidden, configuring the tier fails with the install hint."""
    code = textwrap.dedent(
        f"""
        import importlib.abc, sys
        class Hide(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("nixl", "nixl_cu12", "nixl_cu13"):
                    raise ImportError("hidden for the test: " + name)
                return None
        sys.meta_path.insert(0, Hide())
        from lmcache_async import LMCacheEngineConfig, StorageManager
        from lmcache_async.errors import BackendUnavailableError
        cfg = LMCacheEngineConfig.from_defaults(nixl_path={str(tmp_path)!r}, max_local_cpu_size=0.01, staging_size=0.01)
        try:
            StorageManager(cfg)
        except BackendUnavailableError as exc:
            print("ERROR:", exc)
        else:
            print("NO ERROR")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "ERROR:" in out.stdout, out.stdout + out.stderr
    assert INSTALL_HINT in out.stdout


@pytest.mark.nixl
@pytest.mark.parametrize("plugin", ["GDS", "GDS_MT"])
async def test_gds_round_trips_where_available_else_fails_clearly(
    plugin: str, backend_context, tmp_path: Path, fill, same_bytes
) -> None:
    ctx: BackendContext = backend_context()
    settings = NixlSettings(plugin=plugin, path=str(tmp_path / "gds"), max_bytes=64 << 20)
    try:
        be = NixlBackend(ctx, settings)
    except BackendUnavailableError as exc:
        assert plugin in str(exc) and "nixl_backend" in str(exc)
        pytest.skip(f"{plugin} is not usable on this host (error checked): {exc}")
    await be.start()
    try:
        assert ctx.pool is not None
        src = fill(ctx.pool.allocate((256, 1024), torch.float16, MemoryFormat.KV_2LTD), 5)
        assert await be.put(make_key(1), src)
        got = await be.get(make_key(1))
        assert got is not None and same_bytes(got, src)
        got.ref_count_down()
        src.ref_count_down()
    finally:
        await be.close()


@pytest.mark.nixl
async def test_obj_plugin_takes_its_parameters(backend_context) -> None:
    """The OBJ plugin is created with the configured parameters (no store is contacted)."""
    settings = NixlSettings(
        plugin="OBJ",
        path="lmcache-test",
        params={"bucket": "kv", "endpoint_override": "http://127.0.0.1:1", "scheme": "http"},
    )
    try:
        be = NixlBackend(backend_context(), settings)
    except BackendUnavailableError as exc:
        assert "OBJ" in str(exc)
        pytest.skip(f"OBJ plugin not loadable here: {exc}")
    try:
        assert be.layout_name == "objects"
        assert not be.persistent and be.is_remote and be.supports_delete
    finally:
        await be.close()


@pytest.mark.nixl
async def test_posix_parameters_reach_the_plugin(backend_context, tmp_path: Path) -> None:
    """Parameters go to the plugin as they are (here: POSIX's io_uring switch off)."""
    be = NixlBackend(backend_context(), NixlSettings(plugin="POSIX", path=str(tmp_path), params={"use_uring": "false"}))
    try:
        assert be.stats()["plugin"] == "POSIX"
    finally:
        await be.close()


@pytest.mark.parametrize(("cpus", "workers"), [(1, 1), (2, 1), (3, 1), (4, 2), (64, 2)])
def test_worker_threads_follow_the_usable_cpus(monkeypatch: pytest.MonkeyPatch, cpus: int, workers: int) -> None:
    import os  # the nixl agent reads the affinity from os

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)))
    assert NixlSettings(plugin="POSIX", path="/x").workers == workers
    assert NixlSettings(plugin="POSIX", path="/x", workers=3).workers == 3  # explicit wins

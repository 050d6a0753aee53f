"""``lmcache-async status`` and the client tier as a StorageManager tier."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from lmcache_async import LMCacheEngineConfig, StorageManager
from lmcache_async.cli import main
from lmcache_async.server.server import default_socket_path
from lmcache_async.server.tier import ServerTier
from lmcache_async.testing.conformance import make_key


def _config(socket: str, namespace: str) -> LMCacheEngineConfig:
    return LMCacheEngineConfig.from_defaults(
        local_cpu=False,
        tier_order=["server"],
        cache_server_socket=socket,
        cache_server_namespace=namespace,
        staging_size=1 / 64,
        remote_timeout_s=10.0,
    )


def test_status_prints_tiers_clients_and_namespaces(shared_server, capsys: pytest.CaptureFixture[str]) -> None:
    sm = StorageManager(_config(shared_server.socket, "cli-status"), name="cli")
    try:
        assert sm.put_sync(make_key(1), torch.ones(8, 8))
        sm.flush_sync()
        assert main(["status", "--socket", shared_server.socket]) == 0
    finally:
        sm.close_sync()
    out = capsys.readouterr().out
    assert "tiers    shm" in out
    assert "namespace 'cli-status': 1 entries" in out


def test_status_without_a_server_fails_with_status_1(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "--socket", str(tmp_path / "none.sock"), "--timeout", "1"]) == 1
    assert "no cache server answers" in capsys.readouterr().err


def test_server_tier_is_a_local_tier(shared_server) -> None:
    sm = StorageManager(_config(shared_server.socket, "cli-local"), name="local")
    try:
        tier = sm.backend("server")
        assert isinstance(tier, ServerTier) and tier.as_local() is tier
    finally:
        sm.close_sync()


def test_two_managers_on_the_server_tier_alone_share_entries(shared_server) -> None:
    writer = StorageManager(_config(shared_server.socket, "cli-share"), name="writer")
    reader = StorageManager(_config(shared_server.socket, "cli-share"), name="reader")
    try:
        keys = [make_key(i) for i in range(4)]
        values = [torch.randn(16, 32) for _ in keys]
        assert all(writer.batched_put_sync(keys, values))
        writer.flush_sync()
        assert reader.prefix_len_sync(keys) == 4
        for k, v in zip(keys, values, strict=True):
            got = reader.get_sync(k)
            assert got is not None and torch.equal(got.tensor, v)
            got.ref_count_down()
    finally:
        writer.close_sync()
        reader.close_sync()


def test_status_prints_sizes_in_binary_units_and_does_not_count_its_own_connection(
    make_server: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    srv = make_server().start()
    sm = StorageManager(_config(srv.socket, "units"), name="units")
    try:
        assert sm.put_sync(make_key(1), torch.ones(256, 1024))  # 1 MiB
        sm.flush_sync()
        assert main(["status", "--socket", srv.socket]) == 0
    finally:
        sm.close_sync()
    out = capsys.readouterr().out
    assert "clients  1 connected" in out  # the manager's connection, not the status query's
    assert "1 entries, 1.0 MiB, pool " in out and " MiB used of " in out and "committed (up to 32.0 MiB)" in out, out


def test_status_with_a_wrong_token_says_the_server_refused_it(
    make_server: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    srv = make_server(cache_server_token="right").start()
    assert main(["status", "--socket", srv.socket, "--token", "wrong", "--timeout", "5"]) == 1
    err = capsys.readouterr().err
    assert "refused this query" in err and "BAD_TOKEN" in err and "no cache server answers" not in err, err


# ---- socket paths -------------------------------------------------------------------------------------
def test_the_default_socket_is_under_xdg_runtime_dir_else_a_per_uid_temp_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert default_socket_path() == tmp_path / "lmcache-async" / "cache.sock"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert default_socket_path() == Path(tempfile.gettempdir()) / f"lmcache-async-{os.getuid()}" / "cache.sock"


def test_serve_and_status_without_a_socket_use_the_default_path(tmp_path: Path) -> None:
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime)}
    conf = tmp_path / "s.yaml"
    conf.write_text("max_local_cpu_size: 0.03125\n")
    cmd = [sys.executable, "-m", "lmcache_async.cli"]
    proc = subprocess.Popen([*cmd, "serve", "--config", str(conf), "--log-level", "INFO"], env=env,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        out = None
        while time.monotonic() < deadline:
            out = subprocess.run([*cmd, "status"], env=env, capture_output=True, text=True, timeout=60)
            if out.returncode == 0:
                break
            time.sleep(0.2)
        assert out is not None and out.returncode == 0, out
        assert str(runtime / "lmcache-async" / "cache.sock") in out.stdout
        assert stat.S_IMODE(os.stat(runtime / "lmcache-async").st_mode) == 0o700
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert "INFO" in err and "cache server listening on" in err and "WARNING" not in err, err


def _serve_fails(capsys: pytest.CaptureFixture[str], socket: str) -> str:
    assert main(["serve", "--socket", socket]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_serve_on_a_directory_open_to_others_says_what_to_do(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = tmp_path / "open"
    d.mkdir()
    os.chmod(d, 0o755)
    err = _serve_fails(capsys, str(d / "cache.sock"))
    assert f"chmod 700 {d}" in err and "leave --socket out" in err, err


def test_serve_on_a_regular_file_says_it_is_not_a_socket(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "open"
    d.mkdir()
    os.chmod(d, 0o755)  # the file is named first, not the directory's mode
    (d / "afile").write_text("x")
    err = _serve_fails(capsys, str(d / "afile"))
    assert "is a regular file, not a socket" in err, err


def test_serve_where_the_directory_cannot_be_created_fails_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    err = _serve_fails(capsys, "/proc/lmcache-async-test/cache.sock")
    assert "cannot create the socket directory /proc/lmcache-async-test" in err, err


def test_cache_server_uid_reaches_the_client_and_a_server_of_our_own_uid_is_still_accepted(shared_server: Any) -> None:
    other = os.getuid() + 4242
    cfg = _config(shared_server.socket, "cli-uid")
    cfg = cfg.model_copy(update={"cache_server_uid": other})
    sm = StorageManager(cfg, name="uid")
    try:
        tier = sm.backend("server")
        assert tier is not None and tier.client.server_uid == other  # type: ignore[attr-defined]
        assert sm.put_sync(make_key(7), torch.ones(4, 4))  # our own uid serves it: accepted too
        sm.flush_sync()
        assert sm.contains_sync(make_key(7))
    finally:
        sm.close_sync()


def test_cache_server_uid_must_be_a_uid() -> None:
    with pytest.raises(ValueError, match="cache_server_uid"):
        LMCacheEngineConfig.from_defaults(cache_server_uid=-1)

"""What a user meets first with ``lmcache-async``: ``config --explain`` masks secrets as the table
does; ``status`` and ``keys`` find the token and socket in the configuration as clients do;
``serve`` names its socket on one start line at every log level; every configuration that does
not pass ``config`` exits 1 with one line; sizes in messages are in binary units; ``bench``
names the option a suite is given with."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from lmcache_async.cli import main
from lmcache_async.config.units import human_bytes
from lmcache_async.testing.cache_server import CacheServerProcess, private_dir


def _explain(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    rc = main(["config", "--explain", *argv])
    out = capsys.readouterr()
    return rc, out.out + out.err


# ---- config --explain masks secrets ------------------------------------------------------------
def test_explain_masks_the_token_and_the_password_of_a_url(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("cache_server_token: s3cr3t\nremote_url: redis://user:PASSWORD@host:6379\n")
    rc, out = _explain(capsys, "cache_server_token", "--file", str(f))
    assert rc == 0 and "s3cr3t" not in out
    assert "value     '********'" in out and f"source    file {f}" in out
    rc, out = _explain(capsys, "remote_url", "--file", str(f))
    assert rc == 0 and "PASSWORD" not in out
    assert "value     'redis://user:********@host:6379'" in out


def test_explain_of_a_token_from_the_environment_is_masked_in_json_too(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("LMCACHE_CACHE_SERVER_TOKEN", "Xtoken")
    rc, out = _explain(capsys, "LMCACHE_CACHE_SERVER_TOKEN")
    assert rc == 0 and "Xtoken" not in out and "value     '********'" in out
    rc, out = _explain(capsys, "LMCACHE_CACHE_SERVER_TOKEN", "--json")
    assert rc == 0 and "Xtoken" not in out
    got = json.loads(out)
    assert got["value"] == "********" and got["source"] == "env LMCACHE_CACHE_SERVER_TOKEN"


# ---- config: a configuration that fails the check exits 1 --------------------------------------
def test_an_lmcache_policy_without_an_equal_exits_1_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("cache_policy: LFU\n")
    for argv in (["config", "--file", str(f)], ["config", "--file", str(f), "--explain", "cache_policy"]):
        assert main(argv) == 1
        err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
        assert err == [
            f"lmcache-async config: error: invalid value for cache_policy: 'LFU' (from file {f}): "
            "Value error, LMCache's LFU policy has no equal here: every tier evicts LRU or FIFO"
        ]


def test_a_pool_that_never_fits_names_its_key_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("max_local_cpu_size: 100000\n")
    assert main(["config", "--file", str(f)]) == 1
    (line,) = [ln for ln in capsys.readouterr().err.splitlines() if "can never fit" in ln]
    assert line.count("max_local_cpu_size") == 1, line
    assert line.startswith("lmcache-async config: error: max_local_cpu_size: 100000 GiB pool can never fit in")


# ---- sizes in binary units ---------------------------------------------------------------------
def test_human_bytes_picks_the_unit_that_reads() -> None:
    assert [human_bytes(n) for n in (0, 512, 2 << 20, 3 << 29, 5 << 40)] == [
        "0 B", "512 B", "2.0 MiB", "1.5 GiB", "5120.0 GiB",
    ]  # fmt: skip
    assert human_bytes(None) == "?" and human_bytes("1") == "?" and human_bytes(True) == "?"


def test_the_disk_budget_warning_gives_both_sizes_in_binary_units(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = os.statvfs
    disk = tmp_path / "disk"

    def tiny(path: Any) -> Any:  # a 2 MiB filesystem under the disk tier's directory
        if str(path).startswith(str(tmp_path)):
            return SimpleNamespace(f_blocks=512, f_frsize=4096)
        return real(path)

    monkeypatch.setattr(os, "statvfs", tiny)
    f = tmp_path / "c.yaml"
    f.write_text(f"local_disk: {disk}\nmax_local_disk_size: 1\n")
    assert main(["config", "--file", str(f)]) == 0
    err = capsys.readouterr().err
    assert "max_local_disk_size: 1.0 GiB budget on a filesystem of 2.0 MiB (" in err, err


# ---- bench names the option a suite is given with ----------------------------------------------
def test_a_suite_given_as_a_word_gets_a_hint(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "ec"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("lmcache-async: error: unrecognized arguments: ec")
    assert err[1:] == ["lmcache-async bench: did you mean --suite ec?"]
    assert main(["bench", "nosuchsuite"]) == 2
    assert "did you mean" not in capsys.readouterr().err


# ---- status and keys take the token and socket from the configuration -------------------------
@pytest.fixture(scope="module")
def token_server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A real ``lmcache-async serve`` that requires the token ``right``."""
    srv = CacheServerProcess(tmp_path_factory.mktemp("token-server"), cache_server_token="right").start()
    yield srv
    srv.kill()


def _status(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    rc = main(["status", "--timeout", "10", *argv])
    out = capsys.readouterr()
    return rc, out.out + out.err


def test_status_presents_the_configured_token(
    token_server: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    sock = token_server.socket
    rc, out = _status(capsys, "--socket", sock)
    assert rc == 1 and "BAD_TOKEN" in out  # no token anywhere: refused
    monkeypatch.setenv("LMCACHE_CONFIG_FILE", str(token_server.config))
    rc, out = _status(capsys, "--socket", sock)
    assert rc == 0 and f"on {sock}" in out, out
    rc, out = _status(capsys, "--socket", sock, "--token", "wrong")
    assert rc == 1 and "BAD_TOKEN" in out  # --token wins over the configuration
    monkeypatch.delenv("LMCACHE_CONFIG_FILE")
    rc, out = _status(capsys, "--socket", sock, "--config", str(token_server.config))
    assert rc == 0, out
    monkeypatch.setenv("LMCACHE_CACHE_SERVER_TOKEN", "right")
    rc, out = _status(capsys, "--socket", sock)
    assert rc == 0, out


def test_status_and_keys_find_the_socket_in_the_configuration(
    token_server: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    client = tmp_path / "client.yaml"
    client.write_text(f"cache_server_socket: {token_server.socket}\ncache_server_token: right\n")
    rc, out = _status(capsys, "--config", str(client), "--json")
    assert rc == 0, out
    assert json.loads(out)["socket"] == token_server.socket
    assert main(["keys", "list", "--namespace", "first-contact", "--config", str(client)]) == 0
    assert capsys.readouterr().out.strip().endswith("0 entries, 0 B")
    assert main(["keys", "list", "--namespace", "first-contact", "--config", str(client), "--token", "no"]) == 1
    assert "cannot list namespace 'first-contact'" in capsys.readouterr().err  # --token wins: refused


# ---- serve names its socket --------------------------------------------------------------------
def _serve_start_lines(tmp_path: Path, *argv: str) -> tuple[list[str], int]:
    """The stderr lines of ``serve`` (default socket under a private runtime directory) until it
    answers ``status``, then SIGTERM; and the server's pid."""
    runtime = private_dir(tmp_path / "run")
    conf = tmp_path / "s.yaml"
    conf.write_text("max_local_cpu_size: 0.03125\ncache_server_pretouch: false\n")
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime)}
    log = tmp_path / "serve.err"
    cmd = [sys.executable, "-m", "lmcache_async.cli"]
    with open(log, "w") as err:
        proc = subprocess.Popen([*cmd, "serve", "--config", str(conf), *argv], env=env, stderr=err)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            if subprocess.run([*cmd, "status"], env=env, capture_output=True, timeout=60).returncode == 0:
                break
            time.sleep(0.2)
    finally:
        proc.terminate()
        assert proc.wait(30) == 0, log.read_text()
    return log.read_text().splitlines(), proc.pid


@pytest.mark.parametrize("level", ["WARNING", "INFO"])
def test_serve_prints_one_start_line_naming_socket_pid_and_pool_size(tmp_path: Path, level: str) -> None:
    lines, pid = _serve_start_lines(tmp_path, "--log-level", level)
    sock = tmp_path / "run" / "lmcache-async" / "cache.sock"
    starts = [ln for ln in lines if "listening on" in ln]
    assert len(starts) == 1, lines  # once, at every level
    if level == "WARNING":
        assert starts == [
            f"lmcache-async serve: cache server listening on {sock} (pid {pid}, pools of up to 32.0 MiB per "
            "namespace); lmcache-async status shows it"
        ]
        assert lines == starts  # nothing else at the default level
    else:  # the server's own start record, with the same facts
        assert f"cache server listening on {sock} (pid {pid}, pools of up to 0.03 GiB" in starts[0], starts

"""``lmcache-async keygen`` writes key files the cipher loads; ``config`` never prints S3 secrets."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from lmcache_async.cli import main
from lmcache_async.encryption import load_cipher


def test_keygen_writes_a_0600_key_file_and_prints_its_id(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "cache.key"
    assert main(["keygen", str(path)]) == 0
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert load_cipher(path).key_id.hex() in capsys.readouterr().out


def test_keygen_never_overwrites_a_key_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "cache.key"
    assert main(["keygen", str(path)]) == 0
    before = path.read_bytes()
    assert main(["keygen", str(path)]) == 2
    assert "never overwritten" in capsys.readouterr().err
    assert path.read_bytes() == before


def test_config_redacts_s3_credentials(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("LMCACHE_S3_ACCESS_KEY_ID", "AKIA-visible-id")
    monkeypatch.setenv("LMCACHE_S3_SECRET_ACCESS_KEY", "very-secret-value")
    assert main(["config"]) == 0
    assert main(["config", "--json"]) == 0
    assert main(["config", "--explain", "s3_secret_access_key"]) == 0
    out = capsys.readouterr().out
    assert "very-secret-value" not in out and "AKIA-visible-id" not in out
    assert "env LMCACHE_S3_SECRET_ACCESS_KEY" in out


def test_s3_credentials_reach_the_tier_but_not_its_stats_or_repr(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("obstore")
    from lmcache_async.remote.connector import ConnectorSettings, S3Settings, make_connector

    conn = make_connector(
        "s3://bucket/p",
        ConnectorSettings(
            timeout_s=1.0,
            part_size=1 << 20,
            ttl_s=None,
            s3=S3Settings(access_key_id="AKIA-id", secret_access_key="s3cret-key"),
        ),  # fmt: skip
    )
    shown = (
        json.dumps(conn.stats())
        + repr(conn)
        + repr(ConnectorSettings(1.0, 1, None, s3=S3Settings("e", "r", "AKIA-id", "s3cret-key")))
    )
    assert "s3cret-key" not in shown and "AKIA-id" not in shown


def test_a_plain_http_endpoint_needs_s3_allow_http() -> None:
    pytest.importorskip("obstore")
    from lmcache_async.remote.connector import ConnectorSettings, S3Settings, make_connector

    with pytest.raises(ValueError, match="s3_allow_http"):
        make_connector(
            "s3://bucket", ConnectorSettings(1.0, 1 << 20, None, s3=S3Settings(endpoint="http://127.0.0.1:1"))
        )
    with pytest.raises(ValueError, match="together"):
        make_connector("s3://bucket", ConnectorSettings(1.0, 1 << 20, None, s3=S3Settings(access_key_id="a")))

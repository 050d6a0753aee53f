"""A configuration is checked before anything is built from it, the same way by the manager and
by ``lmcache-async config``: tier names, remote URLs, tiers left out of ``tier_order``, sizes
that can never fit; LMCache values with no equal here; typos in keys and variables."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from lmcache_async import LMCacheEngineConfig, StorageManager
from lmcache_async.cli import main
from lmcache_async.config import DEFAULT_TIER_ORDER, load_engine_config
from lmcache_async.config.check import check_config, redacted
from lmcache_async.errors import ConfigError


def findings(**kw: object) -> list[str]:
    return [str(f) for f in check_config(LMCacheEngineConfig.from_defaults(**kw))]


def test_a_plain_configuration_has_nothing_to_say() -> None:
    assert findings() == []
    assert findings(local_disk="/tmp/x", max_local_disk_size=0.01, remote_url="redis://127.0.0.1:1") == []


def test_an_unknown_tier_is_an_error_with_a_suggestion_and_the_manager_says_it_in_one_line() -> None:
    (only,) = findings(tier_order=["cpu", "disc"])
    assert only.startswith("error: tier_order: unknown tier 'disc'; did you mean 'disk'?")
    with pytest.raises(ConfigError, match="unknown tier 'disc'; did you mean 'disk'"):
        StorageManager(LMCacheEngineConfig.from_defaults(tier_order=["cpu", "disc"], max_local_cpu_size=0.01))


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("lm://host:65432", "lm:// is LMCache's own server protocol"),
        ("redsi://h:1", "did you mean redis://"),
        ("redis://:pw@h:notaport", "port 'notaport' is not a number"),
    ],
)
def test_a_remote_url_the_tier_would_refuse_is_an_error(url: str, says: str) -> None:
    (only,) = findings(remote_url=url)
    assert only.startswith("error: remote_url:") and says in only
    assert "pw" not in only  # the URL's password never appears


def test_the_server_tier_is_in_the_default_order_and_leaving_a_tier_out_is_said() -> None:
    assert "server" in DEFAULT_TIER_ORDER
    assert findings(cache_server_socket="/tmp/none.sock") == []
    (only,) = findings(cache_server_socket="/tmp/none.sock", tier_order=["cpu", "disk"])
    assert only.startswith("warning: cache_server_socket:") and "lacks 'server'" in only


def test_sizes_that_can_never_fit_are_refused_before_any_pool(tmp_path: Path) -> None:
    (only,) = findings(max_local_cpu_size=100_000)
    assert only.startswith("error: max_local_cpu_size:") and "can never fit" in only
    with pytest.raises(ConfigError, match="can never fit"):
        StorageManager(LMCacheEngineConfig.from_defaults(max_local_cpu_size=100_000))
    (disk,) = findings(local_disk=str(tmp_path / "d"), max_local_disk_size=10_000_000)
    assert disk.startswith("warning: max_local_disk_size:") and "filesystem" in disk


def test_lmcache_values_without_an_equal_get_one_clear_line(caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(ConfigError, match="LMCache's LFU policy has no equal here: every tier evicts LRU or FIFO"):
        LMCacheEngineConfig.from_defaults(cache_policy="lfu")
    with caplog.at_level(logging.WARNING, logger="lmcache_async.config"):
        LMCacheEngineConfig.from_defaults(remote_serde="cachegen")
    assert [r.getMessage() for r in caplog.records if "remote_serde" in r.getMessage()] == [
        "remote_serde 'cachegen' (from init) has no effect here: records are stored as they are, self-describing "
        "(LMCache's serializers such as cachegen are not used)"
    ]


def test_typos_in_files_and_variables_are_named_with_a_suggestion(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("chunk_sise: 16\n")
    for var in [v for v in __import__("os").environ if v.startswith("LMCACHE_") and not v.startswith("LMCACHE_ASYNC")]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("LMCACHE_CHUNK_SIZ", "3")
    monkeypatch.setenv("LMCACHE_ASYNC_SOMETHING", "1")  # the project's own tool variables are not keys
    with caplog.at_level(logging.WARNING, logger="lmcache_async.config"):
        load_engine_config(str(f))
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "unknown configuration key 'chunk_sise' (from file" in text and "did you mean 'chunk_size'?" in text
    assert "unknown configuration variable LMCACHE_CHUNK_SIZ ignored; did you mean 'LMCACHE_CHUNK_SIZE'?" in text
    assert "LMCACHE_ASYNC_SOMETHING" not in text


def test_secrets_are_masked() -> None:
    assert redacted("remote_url", "redis://u:secret@h:1/0") == "redis://u:********@h:1/0"
    assert redacted("cache_server_token", "abc") == "********"
    assert redacted("chunk_size", 256) == 256


def test_the_config_command_prints_problems_and_fails_on_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    f = tmp_path / "c.yaml"
    f.write_text('tier_order: [cpu, disc]\nremote_url: "redis://:pw@127.0.0.1:1"\ncache_server_token: sekrit\n')
    rc = main(["config", "--file", str(f)])
    out = capsys.readouterr()
    assert rc == 1
    assert "config: error: tier_order: unknown tier 'disc'; did you mean 'disk'?" in out.err
    assert "sekrit" not in out.out + out.err and ":pw@" not in out.out + out.err
    f.write_text("chunk_size: 16\n")
    assert main(["config", "--file", str(f)]) == 0

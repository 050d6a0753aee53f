"""The shared temporary-name scheme and reaper of :mod:`lmcache_async.records.files`."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lmcache_async.records import files as record_files
from lmcache_async.records.files import (
    HOST_TAG,
    STALE_TEMP_S,
    TempWriter,
    parse_temp_name,
    process_start_time,
    publish_noreplace,
    reap_temp,
    reap_temps,
    temp_name,
    temp_reapable,
)

DIGEST = "ab" * 16
NOW = 1_000_000_000.0


def _dead_writer() -> tuple[int, int]:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    start = process_start_time(p.pid) or 0
    p.wait(10)
    return p.pid, start


def _aged(path: Path, age_s: float) -> Path:
    t = time.time() - age_s
    os.utime(path, (t, t))
    return path


def test_a_temp_name_carries_its_final_name_and_this_writer() -> None:
    name = temp_name(f"{DIGEST}.rec")
    assert name.startswith(f".{DIGEST}.rec.") and name.endswith(".tmp")
    me = parse_temp_name(name)
    assert me == TempWriter(f"{DIGEST}.rec", HOST_TAG, os.getpid(), process_start_time(os.getpid()) or 0)


def test_temp_names_are_unique_per_call() -> None:
    names = {temp_name("x.lmcr") for _ in range(1000)}
    assert len(names) == 1000


@pytest.mark.parametrize("bad", ["", "a/b", "/abs"])
def test_a_final_name_that_is_not_a_bare_name_is_a_value_error(bad: str) -> None:
    with pytest.raises(ValueError, match="final_name"):
        temp_name(bad)


def test_the_older_disk_form_is_parsed() -> None:
    assert parse_temp_name(f".{DIGEST}.{HOST_TAG}.42.777.0badcafe.tmp") == TempWriter(DIGEST, HOST_TAG, 42, 777)


def test_the_older_fs_form_is_parsed_with_its_host_name() -> None:
    legacy_host = record_files._LEGACY_FS_HOST
    mine = parse_temp_name(f".{DIGEST}.rec.{legacy_host}.42.deadbeef.tmp")
    assert mine == TempWriter(f"{DIGEST}.rec", HOST_TAG, 42, 0)
    other = parse_temp_name(f".{DIGEST}.rec.not-{legacy_host}.42.deadbeef.tmp")
    assert other is not None and other.host == "" and other.pid == 42


@pytest.mark.parametrize(
    "name",
    [f"{DIGEST}.lmc", f".{DIGEST}.lmc", ".editor-swap.tmp", f".{DIGEST}.x.y.z.tmp", f".{DIGEST}.{HOST_TAG}.1.2.3.tmp"],
)
def test_names_of_other_forms_are_not_parsed(name: str) -> None:
    assert parse_temp_name(name) is None


def test_a_dead_writers_temp_is_reapable_and_a_live_ones_is_not() -> None:
    pid, start = _dead_writer()
    assert temp_reapable(f".{DIGEST}.lmc.{HOST_TAG}.{pid}.{start}.0badcafe.tmp", NOW, NOW)
    mine = temp_name(f"{DIGEST}.lmc")
    assert not temp_reapable(mine, NOW - 10 * STALE_TEMP_S, NOW)  # a live writer, however old


def test_a_reused_pid_does_not_keep_a_dead_writers_temp() -> None:
    me = os.getpid()
    start = process_start_time(me) or 0
    assert temp_reapable(f".{DIGEST}.lmc.{HOST_TAG}.{me}.{start + 12345}.0badcafe.tmp", NOW, NOW)


def test_another_hosts_temp_is_reapable_only_when_old() -> None:
    name = f".{DIGEST}.rec.0f0f0f0f.1.1.0badcafe.tmp"
    assert not temp_reapable(name, NOW - STALE_TEMP_S + 60, NOW)
    assert temp_reapable(name, NOW - STALE_TEMP_S - 60, NOW)


def test_a_temp_ours_by_shape_only_is_reapable_when_old_and_foreign_names_never() -> None:
    odd = f".{DIGEST}deadbeef.tmp"
    assert not temp_reapable(odd, NOW - 60, NOW)
    assert temp_reapable(odd, NOW - STALE_TEMP_S - 60, NOW)
    assert not temp_reapable(".editor-swap.tmp", NOW - 10 * STALE_TEMP_S, NOW)


def test_an_exclusively_held_directory_loses_every_temp() -> None:
    assert temp_reapable(temp_name("live.lmcr"), NOW, NOW, exclusive=True)
    assert temp_reapable("abc.123.tmp", NOW, NOW, exclusive=True)
    assert not temp_reapable("abc.lmcr", NOW, NOW, exclusive=True)


def test_reap_temps_deletes_only_what_may_go(tmp_path: Path) -> None:
    pid, start = _dead_writer()
    dead = tmp_path / f".{DIGEST}.lmc.{HOST_TAG}.{pid}.{start}.0badcafe.tmp"
    live = tmp_path / temp_name(f"{DIGEST}.lmc")
    record = tmp_path / f"{DIGEST}.lmc"
    swap = tmp_path / ".editor-swap.tmp"
    for p in (dead, live, record):
        p.write_bytes(b"x")
    swap.write_bytes(b"x")
    _aged(swap, 10 * STALE_TEMP_S)
    assert reap_temps(tmp_path) == 1
    assert not dead.exists() and live.exists() and record.exists() and swap.exists()


def test_reap_temps_walks_a_tree_when_asked(tmp_path: Path) -> None:
    pid, start = _dead_writer()
    deep = tmp_path / "a" / "b"
    deep.mkdir(parents=True)
    top = tmp_path / f".{DIGEST}.rec.{HOST_TAG}.{pid}.{start}.00000001.tmp"
    below = deep / f".{DIGEST}.rec.{HOST_TAG}.{pid}.{start}.00000002.tmp"
    top.write_bytes(b"x")
    below.write_bytes(b"x")
    assert reap_temps(tmp_path) == 1 and below.exists()
    assert reap_temps(tmp_path, recursive=True) == 1 and not below.exists()


def test_reaping_what_is_gone_or_missing_is_not_an_error(tmp_path: Path) -> None:
    assert reap_temp(str(tmp_path / ".gone.tmp"), exclusive=True) is False
    assert reap_temps(tmp_path / "missing") == 0
    assert reap_temp(str(tmp_path / "record.lmc"), exclusive=True) is False  # not a temporary name


def test_a_temp_published_by_the_shared_helper_leaves_no_temp(tmp_path: Path) -> None:
    final = tmp_path / f"{DIGEST}.lmc"
    tmp = tmp_path / temp_name(final.name)
    tmp.write_bytes(b"whole")
    assert publish_noreplace(tmp, final) and final.read_bytes() == b"whole" and not tmp.exists()
    again = tmp_path / temp_name(final.name)
    again.write_bytes(b"other")
    assert not publish_noreplace(again, final) and final.read_bytes() == b"whole"

"""``lmcache-async inspect DIR`` (entries, bytes, models, ages), ``--verify`` and ``--purge``."""

from __future__ import annotations

import argparse
import json

from lmcache_async.disk.tools import add_inspect_parser, format_report, inspect_dir, purge_dir, run_inspect

from .disk_testkit import dir_bytes, entry_files, key, make_entry, path_of

N = 4096


async def _fill(be, pool, ids, model="disk/model") -> None:
    for i in ids:
        obj = make_entry(pool, i, N)
        assert await be.put(key(i, model), obj)
        obj.ref_count_down()


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="command", required=True)
    add_inspect_parser(sub)
    return p.parse_args(["inspect", *argv])


async def test_inspect_reports_entries_bytes_models_and_ages(make_disk, pool, tmp_path):
    be = await make_disk(tmp_path / "d")
    await _fill(be, pool, range(5), "llama/3")
    await _fill(be, pool, range(5, 8), "qwen@2")
    rep = inspect_dir(tmp_path / "d")
    assert rep.entries == 8 and rep.bytes == dir_bytes(tmp_path / "d")
    assert rep.payload_bytes == 8 * N
    assert rep.models == {"llama/3": 5, "qwen@2": 3}
    assert rep.dtypes == {"uint8": 8}
    assert rep.oldest is not None and rep.newest is not None and rep.oldest <= rep.newest
    assert (rep.accounted_bytes, rep.accounted_files) == (rep.bytes, 8)
    assert rep.corrupt == [] and rep.temp_files == 0
    text = format_report(rep)
    assert "entries     8" in text and "llama/3" in text and "matches" in text


async def test_verify_rechecks_every_checksum_with_progress(make_disk, pool, tmp_path):
    be = await make_disk(tmp_path / "d")
    await _fill(be, pool, range(6))
    bad = path_of(be.root, key(3))
    data = bytearray(bad.read_bytes())
    data[-1] ^= 0x01  # payload damage: invisible to a header check
    bad.write_bytes(bytes(data))
    assert inspect_dir(tmp_path / "d").corrupt == []
    calls: list[tuple[int, int]] = []
    rep = inspect_dir(tmp_path / "d", verify=True, progress=lambda d, t: calls.append((d, t)))
    assert rep.verified and rep.verified_bytes == 6 * N
    assert rep.corrupt == [(str(bad), "payload checksum mismatch")]
    assert rep.entries == 5
    assert calls[-1] == (6, 6) and len(calls) == 6
    assert bad.exists()  # inspect only reads


async def test_purge_empties_safely_next_to_a_running_tier(make_disk, pool, tmp_path):
    be = await make_disk(tmp_path / "d")
    await _fill(be, pool, range(10))
    (tmp_path / "d" / "keep-me.txt").write_text("not ours")
    assert purge_dir(tmp_path / "d") == 10
    assert entry_files(tmp_path / "d") == []
    assert (tmp_path / "d" / "keep-me.txt").exists()
    assert be.accounted() == (0, 0)
    await _fill(be, pool, range(20, 22))  # the running tier goes on with an exact budget
    assert be.accounted() == (dir_bytes(tmp_path / "d"), 2)


def test_purge_of_a_foreign_directory_touches_nothing(tmp_path):
    (tmp_path / "x.txt").write_text("hello")
    assert purge_dir(tmp_path) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.txt"]


async def test_cli_exit_codes_and_json(make_disk, pool, tmp_path, capsys):
    be = await make_disk(tmp_path / "d")
    await _fill(be, pool, range(3))
    assert run_inspect(_args(str(tmp_path / "d"))) == 0
    assert "entries     3" in capsys.readouterr().out
    assert run_inspect(_args(str(tmp_path / "d"), "--json")) == 0
    assert json.loads(capsys.readouterr().out)["entries"] == 3
    path_of(be.root, key(1)).write_bytes(b"garbage")
    assert run_inspect(_args(str(tmp_path / "d"), "--verify")) == 1
    assert "corrupt" in capsys.readouterr().out
    assert run_inspect(_args(str(tmp_path / "missing"))) == 2
    assert run_inspect(_args(str(tmp_path / "d"), "--purge")) == 0
    assert "3 files deleted" in capsys.readouterr().out


async def test_wired_into_the_lmcache_async_command(make_disk, pool, tmp_path, capsys):
    from lmcache_async.cli import main

    be = await make_disk(tmp_path / "d")
    await _fill(be, pool, range(2))
    assert main(["inspect", str(tmp_path / "d"), "--verify", "--no-progress"]) == 0
    assert "entries     2" in capsys.readouterr().out

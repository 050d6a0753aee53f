"""Several processes on one directory: a running process sees another's entries, and writers
killed with SIGKILL at random moments never leave wrong entries, temp files or a wrong budget."""

from __future__ import annotations

import os
import random
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lmcache_async import StorageManager
from lmcache_async.disk.tier import DiskBackend
from lmcache_async.keys import CacheEngineKey
from lmcache_async.records import decode_header

from .disk_testkit import dir_bytes, entry_files, key, payload, same_bytes, tmp_files

CHILD = str(Path(__file__).with_name("disk_child.py"))
TRIALS = 24


class Child:
    """A helper process speaking one line per command, with bounded waits."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, CHILD, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        self._sel = selectors.DefaultSelector()
        assert self.proc.stdout is not None
        self._sel.register(self.proc.stdout, selectors.EVENT_READ)

    def line(self, timeout: float = 60.0) -> str:
        assert self.proc.stdout is not None
        if not self._sel.select(timeout):
            raise TimeoutError(f"no answer from {CHILD} within {timeout}s")
        out = self.proc.stdout.readline()
        if not out:
            raise RuntimeError(f"{CHILD} exited with {self.proc.wait(10)}")
        return out.strip()

    def ask(self, cmd: str, timeout: float = 60.0) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self.line(timeout)

    def close(self) -> None:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            self.proc.wait(30)
        except Exception:
            self.proc.kill()
            self.proc.wait(10)
        finally:
            assert self.proc.stdout is not None
            self._sel.close()
            self.proc.stdout.close()


def test_a_running_process_gets_what_another_process_put(small_config, metadata, tmp_path):
    root = str(tmp_path / "shared")
    b = Child("serve", root)  # process B: running before A writes anything
    try:
        assert b.line(120) == "ready"
        assert b.ask("contains 42") == "no"
        cfg = small_config(local_disk=root, max_local_disk_size=0.1)
        with StorageManager(cfg, metadata) as a:  # process A (this one)
            assert a.put_sync(key(42), payload(42, 100_000))
            a.flush_sync(timeout=30)
        assert b.ask("contains 42") == "yes"
        assert b.ask("get 42 100000") == "hit"
    finally:
        b.close()


def _entry_size(i: int) -> int:
    return 1024 + (i * 7919) % (64 << 10)


def _read_log(path: Path) -> tuple[set[int], set[int]]:
    ok: set[int] = set()
    removed: set[int] = set()
    if not path.exists():
        return ok, removed
    for line in path.read_text().splitlines():
        parts = line.split()
        if parts and parts[0] == "ok":
            ok.update(int(x) for x in parts[1:])
        elif parts and parts[0] == "rm":
            removed.add(int(parts[1]))
    return ok, removed


async def _check_after_restart(make_disk, root: Path, must_have: set[int]) -> None:
    be: DiskBackend = await make_disk(root)
    try:
        assert tmp_files(root) == [], "a temp file survived the restart"
        assert be.accounted() == (dir_bytes(root), len(entry_files(root)))
        assert be.stats()["corrupt"] == 0
        for f in entry_files(root):  # every entry on disk reads back right
            k = CacheEngineKey.from_string(decode_header(f.read_bytes()).key)
            i = k.chunk_hash
            got = await be.get(k)
            assert got is not None, f
            assert same_bytes(got, i, _entry_size(i)), f"entry {i} reads back wrong"
            got.ref_count_down()
        for i in must_have:  # every entry whose flush() had returned is there
            got = await be.get(key(i))
            assert got is not None, f"entry {i} was flushed before the kill but is missing"
            got.ref_count_down()
    finally:
        await be.close()


def _wait_started(log: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.exists() and log.read_text().startswith("started"):
            return
        time.sleep(0.002)
    raise TimeoutError("the writer did not start")


@pytest.mark.chaos
async def test_sigkill_at_random_moments_never_leaves_wrong_entries(make_disk, tmp_path):
    root = tmp_path / "crash"
    root.mkdir()
    rng = random.Random(20261129)
    zygote = Child("zygote")
    kills_while_writing = 0
    try:
        assert zygote.line(120) == "ready"
        for trial in range(1, TRIALS + 1):
            log = tmp_path / f"trial{trial}.log"
            small = trial % 3 == 0  # every third writer evicts (tiny budget)
            budget = (256 << 10) if small else (1 << 30)
            pid = int(zygote.ask(f"crash {root} {trial} {log} {budget}").split()[1])
            _wait_started(log)
            time.sleep(rng.uniform(0.0, 0.2))
            os.kill(pid, signal.SIGKILL)
            status = zygote.line(30).split()
            assert status[:2] == ["exit", str(pid)]
            assert os.WIFSIGNALED(int(status[2])), f"writer ended on its own: {status}"
            ok, removed = _read_log(log)
            kills_while_writing += bool(ok)
            await _check_after_restart(make_disk, root, set() if small else ok - removed)
    finally:
        zygote.close()
    assert kills_while_writing >= 1, "no kill landed after an entry was written"


def test_entry_size_matches_the_child():
    sys.path.insert(0, str(Path(CHILD).parent))
    try:
        import disk_child  # type: ignore[import-not-found]  # found on sys.path at run time

        assert all(disk_child.entry_size(i) == _entry_size(i) for i in range(0, 10**6, 9973))
    finally:
        sys.path.pop(0)
    assert torch.equal(payload(3, 10), payload(3, 10))

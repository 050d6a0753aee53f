"""Process death: a writer process (a StorageManager over the disk, ``fs://`` or NIXL POSIX
tier) is killed with SIGKILL at random points, many times over the same directory. After each
kill a restarted manager finds every readable entry byte-exact, no temporary files, a space
budget equal to what is on disk, and every entry whose ``flush()`` returned before the kill.

``nixl-evicting`` runs the NIXL tier with room for a few dozen entries, so nearly every put
evicts and overwrites an evicted entry's file in place; a kill can then tear a record under
its name. There, flushed entries may have been evicted, so only byte-exactness, the budget and
the leftovers are checked, and records found torn at the restart are counted.
"""

from __future__ import annotations

import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from lmcache_async import LMCacheEngineConfig, LMCacheEngineMetadata, StorageManager
from lmcache_async.disk.tier import DiskBackend

from . import chaos_worker
from .chaos_support import chaos_key, files_below, identity, same_payload, scaled
from .conftest import nixl_problem

WORKER = Path(chaos_worker.__file__)
KEYS = 400


class Zygote:
    """The ``chaos_worker.py zygote`` process and its line protocol."""

    def __init__(self) -> None:
        env = dict(os.environ, CHAOS_WITH_NIXL="1" if nixl_problem() is None else "0")
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER), "zygote"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self._reader = threading.Thread(target=self._read, name="chaos-zygote-reader", daemon=True)
        self._reader.start()
        assert self.expect("zygote ready", 120)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.strip())

    def expect(self, prefix: str, timeout: float) -> str:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"the zygote did not say {prefix!r} within {timeout}s") from None
        assert line.startswith(prefix), line
        return line

    def trial(self, req: dict[str, Any]) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return int(self.expect("pid ", 30).split()[1])

    def close(self) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


@pytest.fixture(scope="module")
def zygote() -> Iterator[Zygote]:
    z = Zygote()
    yield z
    z.close()


@dataclass
class Tier:
    name: str
    config: dict[str, Any]
    tmp_files: list[Path] = field(default_factory=list)
    evicts: bool = False  # flushed entries may be evicted: absence is not a loss

    @property
    def backend_name(self) -> str:
        return {"disk": "disk", "fs": "remote"}.get(self.name, "nixl")


def _tier(name: str, root: Path) -> Tier:
    common = {
        "max_local_cpu_size": 2 / 1024,
        "staging_size": 2 / 1024,
        "remote_timeout_s": 30,
        "blocking_timeout_secs": 60,
    }
    if name == "disk":
        cfg = {"local_disk": str(root), "max_local_disk_size": 0.25}
    elif name == "fs":
        cfg = {"remote_url": f"fs://{root}"}
    elif name == "nixl":
        cfg = {"nixl_path": str(root), "nixl_backend": "POSIX", "nixl_max_size": 1.0}
    else:  # nixl-evicting: room for ~60 of the 400 entries (64 B .. 48 KiB each)
        cfg = {"nixl_path": str(root), "nixl_backend": "POSIX", "nixl_max_size": 1.5 / 1024}
    return Tier(name, {**common, **cfg}, evicts=name == "nixl-evicting")


def _tmp_files(root: Path) -> list[Path]:
    return [p for p in files_below(root) if p.name.endswith(".tmp")]


def _parse_log(path: Path, must: set[int], maybe_removed: set[int]) -> tuple[int, bool, str | None]:
    """Apply a writer's log to the set of entries that must be present; returns (batches
    flushed, whether the writer got ready, an error line if it stopped by itself)."""
    batches, ready, error = 0, False, None
    if not path.exists():
        return 0, False, None
    for line in path.read_text().splitlines():
        if line == "ready":
            ready = True
        elif line.startswith("ok "):
            ids = [int(x) for x in line.split()[1:]]
            must.update(ids)
            maybe_removed.difference_update(ids)
            batches += 1
        elif line.startswith("rm "):
            i = int(line.split()[1])
            must.discard(i)
            maybe_removed.add(i)
        elif line.startswith("error "):
            error = line
    return batches, ready, error


def _on_disk_bytes(tier: str, root: Path) -> tuple[int, int, int]:
    """(accounted bytes, bytes of record files, record files)."""
    if tier == "disk":
        from lmcache_async.disk.budget import read_accounting
        from lmcache_async.disk.layout import ENTRY_SUFFIX

        files = [p for p in files_below(root) if p.name.endswith(ENTRY_SUFFIX)]
        acct = read_accounting(str(root))
        assert acct is not None, "the disk tier's accounting file is unreadable"
        return acct[0], sum(p.stat().st_size for p in files), len(files)
    raise AssertionError(tier)


def _verify(tier: Tier, root: Path, must: set[int], attempted: int) -> dict[str, int]:
    """Restart on ``root`` and check everything; returns figures."""
    cfg = LMCacheEngineConfig.from_defaults(**tier.config)
    sm = StorageManager(cfg, LMCacheEngineMetadata("chaos"), name="chaos")
    figs = {"entries_checked": 0, "entries_present": 0, "flushed_present": 0, "torn_found": 0}
    try:
        backend = sm.backend(tier.backend_name)
        assert backend is not None, f"the {tier.name} tier did not come up after the kill: {sm.stats()}"
        if tier.name == "disk":
            assert isinstance(backend, DiskBackend)
            sm.loop_thread.run_sync(backend.wait_ready(), timeout=60)  # reaping and recount done
        for i in range(attempted):
            obj = sm.get_sync(chaos_key(i))
            figs["entries_checked"] += 1
            if obj is None:
                assert tier.evicts or i not in must, f"entry {i} was flushed before the kill but is gone ({tier.name})"
                continue
            with obj:
                assert same_payload(obj, i, chaos_worker.size(i)), f"entry {i} holds {identity(obj)}"
            figs["entries_present"] += 1
            figs["flushed_present"] += i in must
        tmp = _tmp_files(root)
        tier.tmp_files.extend(tmp)
        if tier.name != "fs":  # fs:// leftovers are checked by the test below (known issue)
            assert not tmp, f"temporary files remain after the restart: {[p.name for p in tmp[:5]]}"
        if tier.backend_name == "nixl":
            # A torn record a read found is deleted before that read returned its miss.
            records = [p for p in files_below(root) if p.name.endswith(".lmcr")]
            on_disk = sum(p.stat().st_size for p in records)
            st = backend.stats()
            assert st["bytes"] == on_disk and st["entries"] == len(records), (st, on_disk, len(records))
            figs["torn_found"] = st["corrupt"]
        elif tier.name == "disk":
            acct, on_disk, n = _on_disk_bytes("disk", root)
            assert acct == on_disk, f"budget says {acct} bytes, {n} record files hold {on_disk}"
    finally:
        sm.close_sync()
    return figs


@pytest.mark.parametrize("tier_name", ["disk", "fs", "nixl", "nixl-evicting"])
def test_sigkill_at_random_points(tier_name, zygote, tmp_path, figures):
    if tier_name.startswith("nixl") and (problem := nixl_problem()) is not None:
        from .conftest import REQUIRE_NIXL, missing

        missing(f"NIXL is not importable: {problem}", REQUIRE_NIXL, "LMCACHE_ASYNC_REQUIRE_NIXL")
    if tier_name == "disk":
        pytest.importorskip("lmcache_async.disk.tier")
    root = tmp_path / tier_name
    storage = root / "chaos-0" if tier_name.startswith("nixl") else root  # NIXL: <path>/<cache>-<worker>
    tier = _tier(tier_name, root)
    rng = random.Random(zlib.crc32(tier_name.encode()))
    must: set[int] = set()
    maybe_removed: set[int] = set()
    trials = scaled(20, minimum=2)
    totals = {
        "batches_flushed": 0,
        "entries_checked": 0,
        "entries_present": 0,
        "flushed_present": 0,
        "early_kills": 0,
        "torn_found": 0,
    }
    for trial in range(trials):
        log = tmp_path / f"log-{trial}"
        pid = zygote.trial({"config": tier.config, "log": str(log), "seed": rng.randrange(1 << 30), "keys": KEYS})
        if rng.random() < 0.15:  # anywhere, even while the writer is still starting up
            time.sleep(rng.uniform(0, 0.15))
            totals["early_kills"] += 1
        else:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not (log.exists() and b"ready" in log.read_bytes()):
                time.sleep(0.005)
            time.sleep(rng.uniform(0.0, 0.5))
        os.kill(pid, signal.SIGKILL)
        status = int(zygote.expect(f"exit {pid}", 30).split()[2])
        batches, _ready, error = _parse_log(log, must, maybe_removed)
        assert error is None, f"the writer stopped by itself: {error}"
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
        totals["batches_flushed"] += batches
        for k, v in _verify(tier, storage, must, KEYS).items():
            totals[k] += v
    assert totals["batches_flushed"] > 0, "no writer got as far as a flush"
    if not tier.evicts:
        figures(
            "process death (SIGKILL)",
            trials=trials,
            kills=trials,
            entries_checked=totals["entries_checked"],
            entries_flushed_before_kill=len(must),
            flushed_entries_lost=0,
            wrong_bytes=0,
        )
    figures(
        f"process death (SIGKILL): {tier_name}",
        trials=trials,
        early_kills=totals["early_kills"],
        batches_flushed=totals["batches_flushed"],
        entries_checked=totals["entries_checked"],
        entries_present=totals["entries_present"],
        temporary_files_left=len(tier.tmp_files),
        **({"wrong_bytes": 0, "torn_records_found_and_dropped": totals["torn_found"]} if tier.evicts else {}),
    )


def test_fs_restart_reaps_temporary_files_of_dead_writers(tmp_path):
    root = tmp_path / "fs"
    cfg = LMCacheEngineConfig.from_defaults(
        max_local_cpu_size=1 / 1024, staging_size=1 / 1024, remote_url=f"fs://{root}"
    )
    with StorageManager(cfg, LMCacheEngineMetadata("chaos"), name="chaos") as sm:
        sm.put_sync(chaos_key(1), __import__("torch").ones(16))
        sm.flush_sync(timeout=10)
    rec = next(p for p in files_below(root) if p.name.endswith(".rec"))
    # What a writer killed between open() and link() leaves: its pid is gone for good.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    leftover = rec.parent / f".{rec.name}.{os.uname().nodename}.{dead.pid}.deadbeef.tmp"
    leftover.write_bytes(rec.read_bytes()[:100])
    with StorageManager(cfg, LMCacheEngineMetadata("chaos"), name="chaos") as sm:
        assert sm.contains_sync(chaos_key(1))
        sm.clear_sync()
    assert not leftover.exists(), "the temporary file of a dead writer is still there after restart and clear"

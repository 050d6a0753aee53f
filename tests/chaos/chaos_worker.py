"""Writer processes of the process-death chaos test (run as a script, never collected).

``python chaos_worker.py zygote``
    Imports everything once, then for every JSON request on stdin forks a writer (so a trial
    starts in milliseconds instead of seconds), prints ``pid P``, waits for it and prints
    ``exit P STATUS``. No thread runs in the zygote before it forks.

The writer builds a StorageManager (a small CPU tier over the tier under test) from the
request's ``config``, appends ``ready`` to its log, then loops until killed: put a batch of
entries, sometimes remove one (``rm I`` is logged *before* the remove starts), ``flush()``,
and after ``flush()`` returned append ``ok I J ...`` (the batch) to the log. Log lines are
single ``write`` calls on an ``O_APPEND`` descriptor, so a SIGKILL never tears one.
"""

from __future__ import annotations

import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import chaos_support as cs  # type: ignore[import-not-found]  # noqa: E402

from lmcache_async import LMCacheEngineConfig, LMCacheEngineMetadata, StorageBackend, StorageManager  # noqa: E402


def writer(req: dict) -> None:
    fd = os.open(req["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    sm = StorageManager(
        LMCacheEngineConfig.from_defaults(**req["config"]), LMCacheEngineMetadata("chaos"), name="chaos"
    )
    os.write(fd, b"ready\n")
    rng = random.Random(req["seed"])
    keys = int(req["keys"])
    while True:
        batch = sorted({rng.randrange(keys) for _ in range(rng.randint(1, 10))})
        for i in batch:
            sm.put_sync(cs.chaos_key(i), cs.payload(i, size(i)))
        j = rng.randrange(keys)
        if rng.random() < 0.2 and j not in batch:  # the batch's "ok" must stay true
            os.write(fd, f"rm {j}\n".encode())
            sm.remove_sync(cs.chaos_key(j))
        sm.flush_sync()
        os.write(fd, ("ok " + " ".join(map(str, batch)) + "\n").encode())


def size(i: int) -> int:
    """Payload bytes of entry ``i`` (64 B .. 48 KiB)."""
    return cs.entry_size(i, lo=64, hi=48 << 10)


def zygote() -> None:
    if os.environ.get("CHAOS_WITH_NIXL") == "1":
        try:
            from lmcache_async.nixl.agent import load_nixl

            load_nixl()  # the library is mapped once, before any fork
        except Exception:
            pass
    import lmcache_async.remote  # noqa: F401

    try:
        import lmcache_async.disk.tier  # noqa: F401
    except ImportError:
        pass
    print("zygote ready", flush=True)
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        if line == "quit":
            break
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                writer(req)
            except BaseException as exc:  # the log tells the test why a writer stopped by itself
                try:
                    fd = os.open(req["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
                    os.write(fd, f"error {type(exc).__name__}: {exc}\n".encode()[:2000])
                finally:
                    code = 3
            finally:
                os._exit(code)
        print(f"pid {pid}", flush=True)
        _, status = os.waitpid(pid, 0)
        print(f"exit {pid} {status}", flush=True)


def _dac_override_applies(root: str) -> bool:
    """Whether this process reads a mode-0 file anyway (root with CAP_DAC_OVERRIDE), probed
    with a file under ``root``."""
    if os.access("/", os.W_OK) and os.geteuid() == 0:
        probe = os.path.join(root, "probe")
        with open(probe, "w") as f:
            f.write("x")
        os.chmod(probe, 0)
        try:
            open(probe).close()
            return True
        except PermissionError:
            pass
        finally:
            os.unlink(probe)
    return False


def _record_path(cache: str, i: int) -> str:
    """The record file of chaos entry ``i`` in the disk tier rooted at ``cache``."""
    from lmcache_async.disk.layout import entry_path, key_digest

    return entry_path(cache, key_digest(cs.chaos_key(i).to_string()))


def _evict(sm: StorageManager) -> None:
    """Push every entry out of the CPU tier by allocating the whole pool once."""
    import torch

    assert sm.pool is not None
    block = sm.allocate((sm.pool.capacity,), torch.uint8)
    if block is not None:
        block.ref_count_down()


def _read_all(sm: StorageManager, ids: range, out: dict) -> tuple[int, int]:
    """Read entries ``ids`` (each from below the CPU tier); wrong bytes go to ``out["errors"]``.
    Returns (hits, misses)."""
    hits = misses = 0
    for i in ids:
        _evict(sm)
        obj = sm.get_sync(cs.chaos_key(i))
        if obj is None:
            misses += 1
            continue
        with obj:
            if not cs.same_payload(obj, i, 4096):
                out["errors"].append(f"entry {i} returned wrong bytes")
        hits += 1
    return hits, misses


def _unreadable_files(sm: StorageManager, disk: StorageBackend, cache: str, out: dict) -> None:
    """1. Ten record files nobody may read, then readable again."""
    for i in range(10):
        os.chmod(_record_path(cache, i), 0)
    out["unreadable_hits"], out["unreadable_misses"] = _read_all(sm, range(10), out)
    out["readable_hits"], _ = _read_all(sm, range(10, 30), out)
    out["read_errors"] = disk.stats()["read_errors"]
    for i in range(10):
        os.chmod(_record_path(cache, i), 0o600)
    out["restored_hits"], _ = _read_all(sm, range(10), out)


def _read_only_directory(sm: StorageManager, disk: StorageBackend, cache: str, out: dict) -> None:
    """2. A read-only directory: writes stop and are counted, reads go on."""
    mode_of: dict[str, int] = {}
    for dirpath, dirs, _files in os.walk(cache):
        for d in [dirpath, *(os.path.join(dirpath, x) for x in dirs)]:
            mode_of.setdefault(d, os.stat(d).st_mode & 0o777)
    for d in mode_of:
        os.chmod(d, 0o500)
    for i in range(100, 130):
        if not sm.put_sync(cs.chaos_key(i), cs.payload(i, 4096)):
            out["errors"].append("put refused while the disk was read-only")
    sm.flush_sync(timeout=30)
    st = disk.stats()
    out["ro_write_errors"] = st["write_errors"]
    out["ro_writes_stopped"] = st["writes_stopped"]
    out["ro_files_written"] = sum(os.path.exists(_record_path(cache, i)) for i in range(100, 130))
    out["ro_readable_hits"], _ = _read_all(sm, range(10, 30), out)
    for d, m in mode_of.items():
        os.chmod(d, m)


def _writes_resume(sm: StorageManager, disk: StorageBackend, cache: str, out: dict) -> None:
    """3. Writes resume once the directory is writable again."""
    import time

    t0 = time.monotonic()
    resumed = None
    i = 200
    while time.monotonic() - t0 < 60:
        sm.put_sync(cs.chaos_key(i), cs.payload(i, 4096))
        sm.flush_sync(timeout=30)
        if os.path.exists(_record_path(cache, i)):
            resumed = time.monotonic() - t0
            break
        i += 1
        time.sleep(0.2)
    out["resumed_after_s"] = resumed
    out["writes_stopped_at_end"] = disk.stats()["writes_stopped"]


def permissions(root: str) -> None:
    """The permission scenario of the disk-trouble test, in a process whose permission checks
    apply (a normal user, or root without CAP_DAC_OVERRIDE): unreadable record files, a
    read-only directory, then everything restored. Prints one JSON object of figures."""
    if _dac_override_applies(root):
        print(json.dumps({"skip": "permission checks do not apply to this process (CAP_DAC_OVERRIDE)"}))
        return
    cache = os.path.join(root, "cache")
    cfg = LMCacheEngineConfig.from_defaults(
        max_local_cpu_size=1 / 1024, staging_size=1 / 1024, local_disk=cache, max_local_disk_size=0.1
    )
    out: dict = {"errors": []}
    with StorageManager(cfg, LMCacheEngineMetadata("chaos"), name="perm") as sm:
        disk = sm.backend("disk")
        assert disk is not None
        for i in range(30):
            sm.put_sync(cs.chaos_key(i), cs.payload(i, 4096))
        sm.flush_sync(timeout=30)
        _unreadable_files(sm, disk, cache, out)
        _read_only_directory(sm, disk, cache, out)
        _writes_resume(sm, disk, cache, out)
    print(json.dumps(out))


if __name__ == "__main__":
    if sys.argv[1:] == ["zygote"]:
        zygote()
    elif sys.argv[1:2] == ["permissions"] and len(sys.argv) == 3:
        permissions(sys.argv[2])
    else:
        sys.exit("usage: chaos_worker.py zygote | permissions DIR")

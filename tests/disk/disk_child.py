"""Other processes for the disk-tier tests (run as a script, never collected by pytest).

``python disk_child.py serve DIR``
    A StorageManager (CPU + disk on DIR) answering commands on stdin, one per line:
    ``contains I`` -> ``yes``/``no``; ``get I NBYTES`` -> ``hit``/``wrong``/``miss``; ``quit``.
``python disk_child.py zygote``
    Imports everything once, then for each ``crash DIR SEED LOG BUDGET`` line forks a writer
    (so every trial starts in milliseconds), prints ``pid P``, waits for it and prints
    ``exit P STATUS``. The writer puts batches of entries into a DiskBackend on DIR, and after
    each ``flush()`` returns appends ``ok I ...`` to LOG; before removing an entry it appends
    ``rm I``. It runs until killed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import random
import sys

import disk_testkit as kit  # type: ignore[import-not-found]  # found on sys.path at run time
import torch

from lmcache_async import LMCacheEngineConfig, LMCacheEngineMetadata, StorageManager
from lmcache_async.disk.tier import DiskBackend
from lmcache_async.memory import HeapAllocator, PoolAllocator


def entry_size(i: int) -> int:
    """Payload bytes of crash-test entry ``i`` (1 KiB .. 65 KiB, deterministic)."""
    return 1024 + (i * 7919) % (64 << 10)


def serve(root: str) -> None:
    cfg = LMCacheEngineConfig.from_defaults(
        max_local_cpu_size=1 / 64, staging_size=1 / 64, local_disk=root, max_local_disk_size=0.1
    )
    with StorageManager(cfg, LMCacheEngineMetadata("disk-test")) as sm:
        print("ready", flush=True)
        for line in sys.stdin:
            cmd = line.split()
            if not cmd or cmd[0] == "quit":
                break
            if cmd[0] == "contains":
                print("yes" if sm.contains_sync(kit.key(int(cmd[1]))) else "no", flush=True)
            elif cmd[0] == "get":
                i, n = int(cmd[1]), int(cmd[2])
                obj = sm.get_sync(kit.key(i))
                if obj is None:
                    print("miss", flush=True)
                else:
                    print("hit" if kit.same_bytes(obj, i, n) else "wrong", flush=True)
                    obj.ref_count_down()


async def write_until_killed(root: str, seed: int, log: str, budget: int) -> None:
    ex = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="lmcache-async-crash-io")
    pool = PoolAllocator(16 << 20, name="crash-src", pretouch=False)
    heap = HeapAllocator("crash-heap", pin=False)
    be = DiskBackend(root, budget, executor=ex, staging=lambda s, d, f: heap.allocate(s, d, f))
    await be.start()  # no wait: a kill may land during the start-up scan too
    rng = random.Random(seed)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.write(fd, b"started\n")
    nxt = seed * 100_000
    written: list[int] = []
    while True:
        ids = list(range(nxt, nxt + rng.randint(1, 12)))
        nxt = ids[-1] + 1
        objs = [kit.make_entry(pool, i, entry_size(i)) for i in ids]
        ok = await be.batched_put([(kit.key(i), o) for i, o in zip(ids, objs, strict=True)])
        for o in objs:
            o.ref_count_down()
        await be.flush()
        done = [i for i, flag in zip(ids, ok, strict=True) if flag]
        os.write(fd, ("ok " + " ".join(map(str, done)) + "\n").encode())
        written += done
        if written and rng.random() < 0.3:
            victim = written.pop(rng.randrange(len(written)))
            os.write(fd, f"rm {victim}\n".encode())
            await be.remove(kit.key(victim))
        if rng.random() < 0.2:
            got = await be.get(kit.key(rng.choice(written))) if written else None
            if got is not None:
                got.ref_count_down()


def zygote() -> None:
    torch.zeros(1)  # warm torch before forking
    print("ready", flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
            break
        root, seed, log, budget = cmd[1], int(cmd[2]), cmd[3], int(cmd[4])
        pid = os.fork()
        if pid == 0:  # the writer
            code = 0
            try:
                asyncio.run(write_until_killed(root, seed, log, budget))
            except BaseException:
                code = 3
            os._exit(code)
        print(f"pid {pid}", flush=True)
        _, status = os.waitpid(pid, 0)
        print(f"exit {pid} {status}", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2])
    elif sys.argv[1] == "zygote":
        zygote()
    else:  # pragma: no cover
        raise SystemExit(f"unknown mode {sys.argv[1]!r}")

"""The NIXL tier under faults NIXL itself reports: requests that cannot be released ("stuck"),
a close cut short by the manager's timeout, and a write job that fails before it consumed the
files of the entries it evicted.

Transfers are real (POSIX plugin, real files). The fault is injected where NIXL reports it:
``release_faults`` wraps the real handle release of NIXL's Python API, which runs first (so
NIXL really frees the request), and then reports the failure NIXL gives for a request it could
not abort, or holds the worker there until the test lets it go.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import xxhash

from lmcache_async.config import LMCacheEngineConfig
from lmcache_async.memory import MemoryFormat, MemoryObj, PoolAllocator
from lmcache_async.metadata import LMCacheEngineMetadata
from lmcache_async.nixl.agent import NixlTransferError, load_nixl, parked_count
from lmcache_async.nixl.io import RECORD_SUFFIX, TMP_SUFFIX
from lmcache_async.nixl.tier import NixlBackend, NixlSettings
from lmcache_async.records import encode_header
from lmcache_async.testing import make_key
from lmcache_async.tiers import BackendContext

pytestmark = pytest.mark.nixl

MiB = 1 << 20
SMALL_POOLS = {"pool_mib": 16, "staging_mib": 8}  # stuck tests withhold memory for good: keep it small


class ReleaseFaults:
    """Controls the wrapped release: ``fail_next`` releases report failure; ``hold`` makes the
    next release wait (after the real one) until :meth:`let_go`."""

    def __init__(self) -> None:
        self.fail_next = 0
        self.failed = 0
        self._lock = threading.Lock()
        self._hold: threading.Event | None = None
        self.holding = threading.Event()

    def hold(self) -> None:
        self._hold = threading.Event()

    def let_go(self) -> None:
        if self._hold is not None:
            self._hold.set()

    def after_release(self) -> None:
        hold = self._hold
        if hold is not None:
            self.holding.set()
            hold.wait(30.0)
        with self._lock:
            if self.fail_next <= 0:
                return
            self.fail_next -= 1
            self.failed += 1
        raise RuntimeError("injected: NIXL_ERR_BACKEND (the request could not be aborted)")


@pytest.fixture
def release_faults(monkeypatch: pytest.MonkeyPatch) -> Iterator[ReleaseFaults]:
    cls = load_nixl().nixl_xfer_handle
    real = cls.release
    faults = ReleaseFaults()

    def release(handle: object) -> None:
        real(handle)
        faults.after_release()

    monkeypatch.setattr(cls, "release", release)
    yield faults
    faults.let_go()


async def _open(ctx: BackendContext, root: Path, pool_size: int = 0, max_bytes: int = 64 * MiB) -> NixlBackend:
    be = NixlBackend(ctx, NixlSettings(plugin="POSIX", path=str(root), pool_size=pool_size, max_bytes=max_bytes))
    await be.start()
    return be


def _obj(ctx: BackendContext, fill, nbytes: int, seed: int) -> MemoryObj:
    assert ctx.pool is not None
    return fill(ctx.pool.allocate((nbytes // 4,), torch.float32, MemoryFormat.KV_2LTD), seed)


def _pool_alloc(ctx: BackendContext):
    pool = ctx.pool
    assert pool is not None
    return lambda s, d, f: pool.allocate(s, d, f)


async def _settle(be: NixlBackend) -> None:
    while be._tasks:
        await asyncio.gather(*list(be._tasks), return_exceptions=True)


async def _eventually(check, what: str, limit_s: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + limit_s
    while not check():
        assert loop.time() < end, f"{what} did not happen within {limit_s}s"
        await asyncio.sleep(0.01)


def _nixl_threads(cache: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(f"lmcache-async-{cache}-nixl") and t.is_alive()]


# ---- stuck requests ------------------------------------------------------------------------------
async def test_stuck_read_withholds_its_buffer_and_scratch_area_for_good(
    big_context, tmp_path, fill, same_bytes, release_faults
) -> None:
    ctx = big_context(**SMALL_POOLS)
    be = await _open(ctx, tmp_path)
    key = make_key(1)
    src = _obj(ctx, fill, 3 * MiB, 1)
    assert await be.put(key, src)
    assert ctx.pool is not None and be._scratch is not None
    used = ctx.pool.used_bytes
    parked = parked_count()

    release_faults.fail_next = 1
    assert await be.get(key, _pool_alloc(ctx)) is None
    assert release_faults.failed == 1
    await _settle(be)
    # The read buffer was never given back: the stuck request may still write into it.
    assert ctx.pool.used_bytes == used + 3 * MiB
    assert len(be._quarantine) == 1 and be._quarantine[0].get_ref_count() == 1
    st = be.stats()
    assert st["stuck"] == 1 and st["read_failures"] == 1 and st["quarantined_bytes"] == 3 * MiB
    # Its scratch area is retired and replaced; the retired one is never handed out again.
    scratch = be._scratch
    assert len(scratch.retired) == 1 and scratch.live == be.settings.workers
    with contextlib.ExitStack() as stack:
        held = [stack.enter_context(scratch.slot()) for _ in range(scratch.live)]
        assert all(not s.retired for s in held)
        assert scratch.retired[0].index not in {s.index for s in held}

    # A NIXL failure is not a bad record: the entry stays and reads again.
    got = await be.get(key, _pool_alloc(ctx))
    assert got is not None and same_bytes(got, src)
    got.ref_count_down()
    await be.close()
    assert be._quarantine[0].get_ref_count() == 1  # not even at close
    assert parked_count() > parked  # quarantine, scratch and the agent outlive the tier
    src.ref_count_down()


async def test_stuck_read_in_a_batch_leaves_the_other_reads_intact(
    big_context, tmp_path, fill, same_bytes, release_faults
) -> None:
    ctx = big_context(**SMALL_POOLS)
    be = await _open(ctx, tmp_path)
    keys = [make_key(10 + i) for i in range(3)]
    objs = [_obj(ctx, fill, MiB, 10 + i) for i in range(3)]
    assert await be.batched_put(list(zip(keys, objs, strict=True))) == [True] * 3
    release_faults.fail_next = 1  # the first request of the batch's job
    got = await be.batched_get(keys, _pool_alloc(ctx))
    assert got[0] is None
    for g, o in zip(got[1:], objs[1:], strict=True):
        assert g is not None and same_bytes(g, o)
        g.ref_count_down()
    assert be.stats()["stuck"] == 1 and be.stats()["reads"] == 2
    await be.close()
    for o in objs:
        o.ref_count_down()


async def test_stuck_write_retires_its_slot_and_gives_the_source_back(
    big_context, tmp_path, fill, same_bytes, release_faults
) -> None:
    ctx = big_context(**SMALL_POOLS)
    be = await _open(ctx, tmp_path, pool_size=4)
    key = make_key(20)
    src = _obj(ctx, fill, MiB, 20)
    release_faults.fail_next = 1
    assert await be.put(key, src) is False
    st = be.stats()
    assert st["stuck"] == 1 and st["write_failures"] == 1 and st["reserved_bytes"] == 0
    # A stuck write only reads its source; the slot it wrote to is out of use for good.
    assert src.get_ref_count() == 1
    assert st["free_slots"] == 3
    assert await be.put(key, src)
    got = await be.get(key)
    assert got is not None and same_bytes(got, src)
    got.ref_count_down()
    await be.clear()
    await _settle(be)
    assert be.stats()["free_slots"] == 3
    await be.close()
    src.ref_count_down()


async def test_stuck_write_to_a_file_leaves_no_record(big_context, tmp_path, fill, release_faults) -> None:
    ctx = big_context(**SMALL_POOLS)
    be = await _open(ctx, tmp_path)
    key = make_key(30)
    src = _obj(ctx, fill, MiB, 30)
    release_faults.fail_next = 1
    assert await be.put(key, src) is False
    assert be.stats()["stuck"] == 1 and not await be.contains(key)
    assert not [p for p in tmp_path.iterdir() if p.name.endswith((RECORD_SUFFIX, TMP_SUFFIX))]
    assert await be.put(key, src)  # a fresh scratch area and a fresh file
    await be.close()
    src.ref_count_down()


# ---- close -------------------------------------------------------------------------------------------
async def test_cancelled_close_still_releases_everything_after_the_last_job(
    big_context, tmp_path, fill, release_faults
) -> None:
    ctx = big_context(**SMALL_POOLS)
    be = await _open(ctx, tmp_path)
    src = _obj(ctx, fill, MiB, 40)
    release_faults.hold()
    put = asyncio.ensure_future(be.put(make_key(40), src))
    assert await asyncio.to_thread(release_faults.holding.wait, 10.0)  # a job is in flight
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(be.close(), 0.05)  # the manager's bound on close
    assert be._lock_fd is not None and be._agent is not None  # never under a running job
    release_faults.let_go()
    await put
    await _eventually(lambda: be._lock_fd is None, "the release of the closed tier")
    assert be._agent is None and be._executor is None and be._scratch is None
    await _eventually(lambda: not _nixl_threads("test"), "the end of the worker threads")
    again = await _open(ctx, tmp_path)  # the directory lock was released
    await again.close()
    assert src.get_ref_count() == 1
    src.ref_count_down()


def test_close_cut_short_by_the_end_of_the_loop_releases_on_the_worker(tmp_path, fill, release_faults) -> None:
    pool = PoolAllocator(8 * MiB, name="nixl-loop-end", pretouch=False)
    src = fill(pool.allocate((MiB // 4,), torch.float32, MemoryFormat.KV_2LTD), 50)
    root = tmp_path / "store"
    state: dict[str, NixlBackend] = {}

    async def session() -> None:
        ctx = BackendContext(
            config=LMCacheEngineConfig(),
            metadata=LMCacheEngineMetadata("nixl-test"),
            cache_name="loopend",
            loop=asyncio.get_running_loop(),
            executor=None,  # type: ignore[arg-type]  # the tier uses its own workers
            staging=lambda s, d, f: pool.allocate(s, d, f),
            staging_pool=None,
            pool=pool,
        )
        be = state["be"] = await _open(ctx, root)
        release_faults.hold()
        put = asyncio.ensure_future(be.put(make_key(50), src))
        assert await asyncio.to_thread(release_faults.holding.wait, 10.0)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(be.close(), 0.05)
        put.cancel()
        await asyncio.gather(put, return_exceptions=True)
        # The loop ends here, with the write job still running.

    asyncio.run(session())
    be = state["be"]
    assert be._lock_fd is not None
    release_faults.let_go()
    done = threading.Event()
    for _ in range(1000):
        if be._lock_fd is None:
            done.set()
            break
        done.wait(0.01)
    assert done.is_set(), "the last job did not release the tier"
    assert be._agent is None and src.get_ref_count() == 1
    src.ref_count_down()


# ---- recycled files --------------------------------------------------------------------------------
ROOM_FOR_TWO = 2 * (MiB + 4096)  # two 1 MiB records


async def _full_of_two(ctx: BackendContext, root: Path, fill, seed: int):
    """A files-layout tier with room for two 1 MiB records, holding ``a`` and ``b``; ``c`` and
    its source are ready to evict ``a``. Returns (tier, (a, b, c), sources, a's file)."""
    be = await _open(ctx, root, max_bytes=ROOM_FOR_TWO)
    keys = make_key(seed), make_key(seed + 1), make_key(seed + 2)
    objs = [_obj(ctx, fill, MiB, seed + i) for i in range(3)]
    assert await be.put(keys[0], objs[0]) and await be.put(keys[1], objs[1])
    a_file = root / f"{be._index[keys[0]].location}{RECORD_SUFFIX}"
    assert a_file.exists()
    return be, keys, objs, a_file


async def _after_restart(ctx: BackendContext, root: Path, keys, objs) -> list[bool]:
    """Which of ``keys`` a restarted tier finds; gives the sources back."""
    again = await _open(ctx, root, max_bytes=ROOM_FOR_TWO)
    try:
        assert again.stats()["bytes"] <= ROOM_FOR_TWO
        return [await again.contains(k) for k in keys]
    finally:
        await again.close()
        for o in objs:
            o.ref_count_down()


async def test_write_failing_before_it_reuses_evicted_files_deletes_them(
    big_context, tmp_path, fill, monkeypatch
) -> None:
    ctx = big_context(**SMALL_POOLS)
    be, (a, b, c), objs, a_file = await _full_of_two(ctx, tmp_path, fill, 60)
    assert be._scratch is not None

    @contextlib.contextmanager
    def no_scratch() -> Iterator[None]:
        raise NixlTransferError("injected: no scratch area")
        yield  # pragma: no cover

    monkeypatch.setattr(be._scratch, "slot", no_scratch)
    assert await be.put(c, objs[2]) is False  # evicted `a` to make room, then failed early
    monkeypatch.undo()
    await _settle(be)
    assert not a_file.exists()  # out of the index, so off the disk too
    records = [p for p in tmp_path.iterdir() if p.name.endswith(RECORD_SUFFIX)]
    assert len(records) == 1 and be.stats()["entries"] == 1
    await be.close()
    assert await _after_restart(ctx, tmp_path, (a, b, c), objs) == [False, True, False]  # no `a`


async def test_write_failing_inside_a_reused_evicted_file_deletes_it(big_context, tmp_path, fill, monkeypatch) -> None:
    ctx = big_context(**SMALL_POOLS)
    be, (a, b, c), objs, a_file = await _full_of_two(ctx, tmp_path, fill, 63)
    a_inode = a_file.stat().st_ino
    written_into: list[tuple[int, bool]] = []

    def half_write(agent, slot, loc, meta, src, registered, chunk, piecewise=True, cipher=None) -> None:
        # The payload lands (over `a`'s bytes, in place), then the request for the header fails.
        written_into.append((os.fstat(loc.payload_dev).st_ino, a_file.exists()))
        n = meta.payload_len
        agent.transfer("WRITE", [(src.data_ptr, n)], [(loc.payload_off, n, loc.payload_dev)])
        raise NixlTransferError("injected: the header request failed")

    monkeypatch.setattr("lmcache_async.nixl.work.write_record", half_write)
    assert await be.put(c, objs[2]) is False  # evicted `a`, wrote into its file, then failed
    monkeypatch.undo()
    await _settle(be)
    assert written_into == [(a_inode, True)]  # the evicted file was reused in place, under its name
    assert not a_file.exists()  # half-written: gone, not left under its old name
    names = [p.name for p in tmp_path.iterdir() if p.name.endswith((RECORD_SUFFIX, TMP_SUFFIX))]
    assert names == [f"{be._index[b].location}{RECORD_SUFFIX}"]
    await be.close()
    assert await _after_restart(ctx, tmp_path, (a, b, c), objs) == [False, True, False]


async def test_an_evicted_file_torn_by_a_crash_is_a_miss_after_restart(big_context, tmp_path, fill) -> None:
    # A process killed while it overwrote an evicted entry's file leaves that file under its
    # old name holding the new header and part of the old payload; the restart indexes it
    # under the new key, and the first read catches it by the payload checksum.
    ctx = big_context(**SMALL_POOLS)
    be = await _open(ctx, tmp_path)
    a, c = make_key(66), make_key(67)
    oa, oc = _obj(ctx, fill, MiB, 66), _obj(ctx, fill, MiB, 67)
    assert await be.put(a, oa)
    a_file = tmp_path / f"{be._index[a].location}{RECORD_SUFFIX}"
    hlen = be._index[a].meta.header_len
    await be.close()
    torn_header = encode_header(
        c.to_string(), tuple(oc.shape), oc.dtype, oc.fmt, xxhash.xxh3_64_intdigest(oc.tensor.numpy().tobytes())
    )
    assert len(torn_header) == hlen
    with open(a_file, "r+b") as f:
        f.write(torn_header)  # the new header landed, the new payload did not

    again = await _open(ctx, tmp_path)
    assert await again.contains(c) and not await again.contains(a)
    assert await again.get(c, _pool_alloc(ctx)) is None
    assert again.stats()["corrupt"] == 1 and not await again.contains(c)
    assert not a_file.exists()  # deleted before the miss was returned
    await again.close()
    oa.ref_count_down()
    oc.ref_count_down()

"""Load: 8 sync threads and 32 async tasks for 60 s of mixed KV / hidden-state / encoder-cache
traffic over CPU + disk. No error, every hit byte-exact, p99 latency reported, memory flat after
warm-up. ``LMCACHE_ASYNC_LOAD_SECONDS`` changes the duration; the soak variant runs 10 minutes.
"""

from __future__ import annotations

import asyncio
import os
import random
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

from lmcache_async import ECCacheEngine, LMCacheEngine, LMCacheEngineConfig, LMCacheEngineMetadata

from .chaos_support import Latencies

SYNC_THREADS = 8
ASYNC_TASKS = 32
CHUNK = 256
LAYERS, HIDDEN, HS_HIDDEN, EC_HIDDEN = 2, 64, 32, 64
PROMPTS = 48


def _duration(default: float) -> float:
    try:
        return float(os.environ.get("LMCACHE_ASYNC_LOAD_SECONDS", default))
    except ValueError:
        return default


def _prompts(seed: int) -> list[list[int]]:
    """Prompts with shared prefixes (a system prompt, then per-conversation turns)."""
    rng = random.Random(seed)
    systems = [[rng.randrange(50_000) for _ in range(CHUNK * rng.randint(1, 3))] for _ in range(4)]
    out = []
    for _ in range(PROMPTS):
        base = list(rng.choice(systems))
        out.append(base + [rng.randrange(50_000) for _ in range(rng.randint(1, 5) * CHUNK + rng.randrange(CHUNK))])
    return out


def _kv(tokens: list[int]) -> torch.Tensor:
    """KV of ``tokens``: a function of each token alone, so any prefix can be checked."""
    t = torch.tensor(tokens, dtype=torch.int64)
    col = ((t % 251) - 125).to(torch.bfloat16)  # small integers are exact in bfloat16
    return col.view(1, 1, -1, 1).expand(2, LAYERS, -1, HIDDEN).contiguous()


def _hs(tokens: list[int], layer: int) -> torch.Tensor:
    t = torch.tensor(tokens, dtype=torch.float32)
    return (t.view(-1, 1) * 0.5 + layer).expand(-1, HS_HIDDEN).contiguous()


def _ec(k: int) -> torch.Tensor:
    n = 16 + (k * 37) % 200
    return (torch.arange(n * EC_HIDDEN, dtype=torch.float32).view(n, EC_HIDDEN) % 97 + k).to(torch.float16)


class Traffic:
    def __init__(self, kv: LMCacheEngine, ec: ECCacheEngine, prompts: list[list[int]]) -> None:
        self.kv = kv
        hs = kv.hidden_state_store
        assert hs is not None
        self.hs = hs
        self.ec = ec
        self.prompts = prompts
        self.lat = Latencies()
        self.errors: list[str] = []
        self.wrong: list[str] = []
        self.hits = 0
        self.stop = threading.Event()

    # ---- checks ---------------------------------------------------------------------------------
    def _check_kv(self, p: list[int], n: int, t: torch.Tensor | None) -> None:
        if n == 0:
            return
        assert t is not None
        if not torch.equal(t, _kv(p[:n])):
            self.wrong.append(f"KV prefix of {n} tokens differs")
        self.hits += 1

    def _check_hs(self, p: list[int], layer: int, t: torch.Tensor | None) -> None:
        if t is None:
            return
        if not torch.equal(t, _hs(p[: t.shape[0]], layer)):
            self.wrong.append(f"HS prefix of {t.shape[0]} tokens (layer {layer}) differs")
        self.hits += 1

    def _check_ec(self, k: int, t: torch.Tensor | None) -> None:
        if t is None:
            return
        if not torch.equal(t, _ec(k)):
            self.wrong.append(f"EC entry img-{k} differs")
        self.hits += 1

    # ---- sync --------------------------------------------------------------------------------------
    def _timed(self, op: str, fn: Any, *args: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args)
        except BaseException as exc:
            self.errors.append(f"{op}: {type(exc).__name__}: {exc}")
            return None
        finally:
            self.lat.add(op, time.perf_counter() - t0)

    def sync_worker(self, seed: int) -> None:
        rng = random.Random(seed)
        kv, hs, ec = self.kv, self.hs, self.ec
        while not self.stop.is_set():
            p = rng.choice(self.prompts)
            r = rng.random()
            if r < 0.18:
                self._timed("kv.store", kv.store, p, _kv(p))
            elif r < 0.36:
                res = self._timed("kv.retrieve", kv.retrieve, p)
                if res is not None:
                    self._check_kv(p, *res)
            elif r < 0.46:
                self._timed("kv.lookup", kv.lookup, p)
            elif r < 0.56:
                layer = rng.randrange(2)
                self._timed("hs.store", hs.store_hidden_states, p, _hs(p, layer), layer)
            elif r < 0.66:
                layer = rng.randrange(2)
                self._check_hs(p, layer, self._timed("hs.retrieve", hs.retrieve_hidden_states, p, layer))
            elif r < 0.78:
                k = rng.randrange(400)
                self._timed("ec.put", ec.put, f"img-{k}", _ec(k))
            elif r < 0.94:
                k = rng.randrange(400)
                self._check_ec(k, self._timed("ec.get", ec.get, f"img-{k}"))
            else:
                k = rng.randrange(400)
                self._timed("ec.contains", ec.contains, f"img-{k}")

    # ---- async --------------------------------------------------------------------------------------
    async def _atimed(self, op: str, coro: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return await coro
        except BaseException as exc:
            self.errors.append(f"{op}: {type(exc).__name__}: {exc}")
            return None
        finally:
            self.lat.add(op, time.perf_counter() - t0)

    async def async_worker(self, seed: int) -> None:
        rng = random.Random(seed)
        kv, hs, ec = self.kv, self.hs, self.ec
        while not self.stop.is_set():
            p = rng.choice(self.prompts)
            r = rng.random()
            if r < 0.3:
                k = rng.randrange(400)
                self._check_ec(k, await self._atimed("ec.aget", ec.aget(f"img-{k}")))
            elif r < 0.45:
                k = rng.randrange(400)
                await self._atimed("ec.aput", ec.aput(f"img-{k}", _ec(k)))
            elif r < 0.55:
                await self._atimed("ec.acontains", ec.acontains(f"img-{rng.randrange(400)}"))
            elif r < 0.7:
                res = await self._atimed("kv.aretrieve", kv.aretrieve(p))
                if res is not None:
                    self._check_kv(p, *res)
            elif r < 0.8:
                await self._atimed("kv.astore", kv.astore(p, _kv(p)))
            elif r < 0.9:
                layer = rng.randrange(2)
                self._check_hs(p, layer, await self._atimed("hs.aretrieve", hs.aretrieve_hidden_states(p, layer)))
            else:
                await self._atimed("kv.alookup", kv.alookup(p))

    async def async_main(self) -> None:
        await asyncio.gather(*(self.async_worker(1000 + i) for i in range(ASYNC_TASKS)))


def _run_load(tmp_path: Path, seconds: float, figures: Any, section: str) -> None:
    pytest.importorskip("lmcache_async.disk.tier")
    md = LMCacheEngineMetadata("load/model", kv_dtype=torch.bfloat16)
    kv_cfg = LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK,
        max_local_cpu_size=24 / 1024,  # 24 MiB: the disk tier serves much of the traffic
        staging_size=16 / 1024,
        local_disk=str(tmp_path / "kv-disk"),
        max_local_disk_size=0.25,
        enable_hidden_state_cache=True,
        max_hidden_state_cpu_size=8 / 1024,
        blocking_timeout_secs=30,
    )
    ec_cfg = LMCacheEngineConfig.from_defaults(
        max_local_cpu_size=8 / 1024,
        staging_size=8 / 1024,
        local_disk=str(tmp_path / "ec-disk"),
        max_local_disk_size=0.125,
        blocking_timeout_secs=30,
    )
    proc = psutil.Process()
    kv = LMCacheEngine(kv_cfg, md)
    ec = ECCacheEngine(ec_cfg, md, "float16")
    traffic = Traffic(kv, ec, _prompts(5))
    rss: list[tuple[float, int]] = []
    try:
        threads = [
            threading.Thread(target=traffic.sync_worker, args=(s,), name=f"chaos-load-sync-{s}", daemon=True)
            for s in range(SYNC_THREADS)
        ]
        loop_thread = threading.Thread(
            target=lambda: asyncio.run(traffic.async_main()), name="chaos-load-async", daemon=True
        )
        t0 = time.monotonic()
        for t in threads:
            t.start()
        loop_thread.start()
        while time.monotonic() - t0 < seconds:
            time.sleep(min(1.0, seconds / 20))
            rss.append((time.monotonic() - t0, proc.memory_info().rss))
        traffic.stop.set()
        for t in [*threads, loop_thread]:
            t.join(120)
            assert not t.is_alive(), f"{t.name} hangs"
        elapsed = time.monotonic() - t0
    finally:
        traffic.stop.set()
        ec.close()
        kv.close()
    assert not traffic.errors, f"{len(traffic.errors)} errors, e.g. {traffic.errors[:5]}"
    assert not traffic.wrong, f"{len(traffic.wrong)} wrong results, e.g. {traffic.wrong[:5]}"
    warm = [m for t, m in rss if t >= seconds * 0.25]
    after_warmup, peak_later = warm[0], max(warm)
    growth = peak_later - after_warmup
    assert growth < max(96 << 20, after_warmup // 10), (
        f"RSS grew by {growth >> 20} MiB after warm-up ({after_warmup >> 20} -> {peak_later >> 20} MiB)"
    )
    summary = traffic.lat.summary()
    ops = traffic.lat.count()
    figures(
        section,
        seconds=round(elapsed, 1),
        sync_threads=SYNC_THREADS,
        async_tasks=ASYNC_TASKS,
        operations=ops,
        ops_per_s=round(ops / elapsed),
        hits_checked=traffic.hits,
        errors=0,
        wrong=0,
        p50_ms=summary["all"]["p50_ms"],
        p99_ms=summary["all"]["p99_ms"],
        max_ms=summary["all"]["max_ms"],
        rss_after_warmup_mib=after_warmup >> 20,
        rss_growth_after_warmup_mib=round(growth / (1 << 20), 1),
    )
    figures(section + " (p99 ms per operation)", **{op: v["p99_ms"] for op, v in summary.items() if op != "all"})


def test_mixed_load_over_cpu_and_disk(tmp_path, figures):
    _run_load(tmp_path, _duration(60.0), figures, "load: 8 threads + 32 tasks, KV/HS/EC over CPU+disk")


@pytest.mark.soak
def test_mixed_load_soak(tmp_path, figures):
    _run_load(tmp_path, _duration(600.0), figures, "load soak: KV/HS/EC over CPU+disk")

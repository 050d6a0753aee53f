"""``lmcache-async demo``: the embedded default (CPU tier + a temporary disk directory).

1. KV cache: a few prompts of a small model's KV chunks are stored through the KV engine into a
   CPU pool smaller than them, so older chunks live on only in the disk tier; every prompt is
   then restored bit-exact (from CPU or disk) and a prompt sharing a prefix is looked up.
2. Hidden states: the thinker -> talker walk-through (the HS prefix shrinks with the KV).
3. Encoder cache: two processes share encoder outputs through one disk directory.

It prints a table per tier (entries, bytes, hits, misses, evictions) and the throughputs.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lmcache_async.config import LMCacheEngineConfig
from lmcache_async.config.units import human_bytes
from lmcache_async.metadata import LMCacheEngineMetadata

__all__ = ["CHUNK", "KV_WIDTH", "LAYERS", "PROMPTS", "PROMPT_TOKENS", "MiB", "run_demo", "run_kv_demo", "tier_rows"]

# A small model's KV layout: 16 layers, 8 KV heads x 64 = 512 wide, bf16, 256-token chunks.
LAYERS = 16
KV_WIDTH = 512
CHUNK = 256
PROMPTS = 4
PROMPT_TOKENS = 2048
MiB = 1 << 20


def _table(rows: list[dict[str, Any]], cols: list[str]) -> str:
    widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in cols}
    head = "  ".join(c.ljust(widths[c]) for c in cols)
    sep = "  ".join("-" * widths[c] for c in cols)
    body = ["  ".join(str(r.get(c, "")).ljust(widths[c]) for c in cols) for r in rows]
    return "\n".join([head, sep, *body])


def tier_rows(stats: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per tier of a ``StorageManager.stats()`` result."""
    rows = []
    for name, t in stats["tiers"].items():
        rows.append(
            {
                "tier": name,
                "entries": t.get("entries", ""),
                "bytes": human_bytes(t.get("bytes", 0)),
                "hits": t.get("hits", 0),
                "misses": t.get("misses", 0),
                "evictions": t.get("evictions", 0),
                "errors": t.get("errors", 0),
            }
        )
    return rows


def run_kv_demo(workdir: Path, out: Callable[[str], None] = print) -> dict[str, Any]:
    """Store, evict to disk, restore and look up KV chunks; returns the figures printed."""
    from lmcache_async.engines.kv import LMCacheEngine

    chunk_bytes = 2 * LAYERS * CHUNK * KV_WIDTH * 2
    total_chunks = PROMPTS * PROMPT_TOKENS // CHUNK
    config = LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK,
        max_local_cpu_size=(total_chunks // 2) * chunk_bytes / (1 << 30),  # half the chunks fit
        local_disk=str(workdir / "kv"),
        max_local_disk_size=1.0,
        staging_size=1 / 16,
    )
    meta = LMCacheEngineMetadata("demo/llama-mini", kv_dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 128_000, (PROMPT_TOKENS,), generator=g) for _ in range(PROMPTS)]
    kvs = [torch.randn(2, LAYERS, PROMPT_TOKENS, KV_WIDTH, generator=g).to(torch.bfloat16) for _ in range(PROMPTS)]
    nbytes = sum(kv.numel() * kv.element_size() for kv in kvs)
    out(
        f"KV cache: {PROMPTS} prompts x {PROMPT_TOKENS} tokens, chunk {CHUNK} tokens = "
        f"{human_bytes(chunk_bytes)} per chunk; CPU pool holds half of the {total_chunks} chunks, "
        f"the disk tier ({workdir / 'kv'}) holds all of them."
    )
    figures: dict[str, Any] = {}
    with LMCacheEngine(config, meta) as engine:
        sm = engine.storage_manager
        t0 = time.perf_counter()
        stored = 0
        for p, kv in zip(prompts, kvs, strict=True):
            stored += engine.store(p, kv)
            sm.flush_sync()  # let the write-through land so the CPU tier can evict
        t_store = time.perf_counter() - t0
        t0 = time.perf_counter()
        restored = 0
        exact = True
        for p, kv in reversed(list(zip(prompts, kvs, strict=True))):  # newest first: CPU hits, then disk
            n, got = engine.retrieve(p)
            restored += n
            exact = exact and got is not None and bool(torch.equal(got, kv[:, :, :n]))
        t_get = time.perf_counter() - t0
        shared = torch.cat(
            [prompts[0][: PROMPT_TOKENS // 2], torch.randint(0, 128_000, (PROMPT_TOKENS // 2,), generator=g)]
        )
        hit = engine.lookup(shared)
        st = sm.stats()
        out(_table(tier_rows(st), ["tier", "entries", "bytes", "hits", "misses", "evictions", "errors"]))
        out(
            f"stored {stored} chunks ({human_bytes(nbytes)}) in {t_store * 1e3:.0f} ms "
            f"({nbytes / t_store / 1e9:.2f} GB/s incl. disk write-through); restored "
            f"{restored} tokens in {t_get * 1e3:.0f} ms ({nbytes / t_get / 1e9:.2f} GB/s), bit-exact: {exact}"
        )
        out(f"lookup of a prompt sharing its first {PROMPT_TOKENS // 2} tokens: {hit} tokens hit")
        figures = {"stored_chunks": stored, "restored_tokens": restored, "exact": exact, "lookup_hit": hit, "stats": st}
    return figures


def run_demo(workdir: str | None = None, keep: bool = False, out: Callable[[str], None] = print) -> int:
    """Run every part of the demo; returns the process exit status (0 when all checks held)."""
    tmp = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="lmcache-async-demo-"))
    tmp.mkdir(parents=True, exist_ok=True)
    ok = True
    try:
        out("== 1. KV cache through the StorageManager (CPU tier + disk tier) ==")
        kv = run_kv_demo(tmp, out)
        ok = ok and kv["exact"] and kv["restored_tokens"] == PROMPTS * PROMPT_TOKENS
        out("")
        out("== 2. Hidden states: thinker -> talker ==")
        from lmcache_async.cli.demo_hs import run_hs_demo

        hs = run_hs_demo(out=out)
        ok = ok and bool(hs.get("matches", True))
        out("")
        out("== 3. Encoder cache shared by two processes through one disk directory ==")
        try:
            from lmcache_async.cli.demo_ec import run_ec_demo
        except ImportError as exc:  # pragma: no cover - shipped with the package
            out(f"(encoder-cache demo unavailable: {exc})")
        else:
            ec = run_ec_demo(tmp / "ec", out=out)
            if isinstance(ec, dict):
                ok = ok and bool(ec.get("ok", True))
        out("")
        out("all checks passed" if ok else "SOME CHECKS FAILED")
        return 0 if ok else 1
    finally:
        if keep or workdir:
            out(f"(files kept in {tmp})")
        else:
            shutil.rmtree(tmp, ignore_errors=True)

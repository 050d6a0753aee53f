"""Encoder-cache demo: separate processes share encoder outputs through a disk directory.

:func:`run_ec_demo` starts real subprocesses (``python -m lmcache_async.cli.demo_ec ROLE ...``):

1. a *producer* (an encoder worker) puts a few encoder outputs into its engine, whose tiers are
   its own CPU pool and the shared disk directory, and exits;
2. a *consumer* (another worker or the scheduler, a fresh process) opens an engine on the same
   directory: ``contains`` says yes and ``get`` returns bit-exact tensors it never computed;
3. a *CPU-only* process asks for the same hashes and misses: an engine's CPU tier is private
   to its process, entries cross processes only through a shared tier (disk dir or remote).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lmcache_async._subprocess import module_command
from lmcache_async.config import LMCacheEngineConfig
from lmcache_async.engines.encoder_cache import ECCacheEngine
from lmcache_async.metadata import LMCacheEngineMetadata

__all__ = ["ITEMS", "MODEL", "demo_hashes", "demo_tensor", "main", "run_ec_demo"]

MODEL = "demo/vision-encoder"
ITEMS = 4
TOKENS, HIDDEN = 576, 1024  # one image through a ViT: 576 patch tokens x 1024 features
_TIMEOUT_S = 180.0


def demo_hashes(count: int = ITEMS) -> list[str]:
    """The ``mm_hash`` values of the demo images."""
    return [f"demo-image-{i:02d}" for i in range(count)]


def demo_tensor(index: int) -> torch.Tensor:
    """The (deterministic) encoder output of demo image ``index``: ``[576, 1024]`` float16."""
    g = torch.Generator().manual_seed(1000 + index)
    return torch.randn(TOKENS, HIDDEN, generator=g).to(torch.float16)


def _engine(disk: str | None) -> ECCacheEngine:
    keys: dict[str, Any] = {"max_local_cpu_size": 64 / 1024, "staging_size": 16 / 1024}
    if disk is not None:
        keys.update(local_disk=disk, max_local_disk_size=1.0)
    cfg = LMCacheEngineConfig.from_defaults(**keys)
    return ECCacheEngine(cfg, LMCacheEngineMetadata(model_name=MODEL), torch.float16)


def _produce(disk: str, count: int) -> dict[str, Any]:
    with _engine(disk) as engine:
        t0 = time.perf_counter()
        stored = [engine.put(h, demo_tensor(i)) for i, h in enumerate(demo_hashes(count))]
        engine.flush(timeout=60)
        dt = time.perf_counter() - t0
        tiers = engine.storage_manager.tier_names
    return {"role": "producer", "pid": os.getpid(), "tiers": tiers, "stored": sum(stored), "seconds": dt}


def _consume(disk: str | None, count: int) -> dict[str, Any]:
    with _engine(disk) as engine:
        hashes = demo_hashes(count)
        present = [engine.contains(h) for h in hashes]
        t0 = time.perf_counter()
        got = [engine.get(h) for h in hashes]
        dt = time.perf_counter() - t0
        exact = [g is not None and torch.equal(g, demo_tensor(i)) for i, g in enumerate(got)]
        tiers = engine.storage_manager.tier_names
    return {
        "role": "consumer" if disk is not None else "cpu-only",
        "pid": os.getpid(),
        "tiers": tiers,
        "present": sum(present),
        "hits": sum(g is not None for g in got),
        "exact": sum(exact),
        "seconds": dt,
    }


def _child(args: list[str]) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_")}
    proc = subprocess.run(
        module_command("lmcache_async.cli.demo_ec", *args),
        capture_output=True,
        text=True,
        timeout=_TIMEOUT_S,
        env=env,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"demo process {args[0]} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        raise RuntimeError(f"demo process {args[0]} printed no result: {proc.stdout[-2000:]}")
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def run_ec_demo(
    workdir: str | os.PathLike[str], out: Callable[[str], Any] = print, count: int = ITEMS
) -> dict[str, Any]:
    """Show encoder outputs shared across processes through ``<workdir>/ec-disk``.

    Starts three subprocesses (producer, consumer on the same directory, CPU-only consumer),
    reports each step through ``out`` and returns ``{"producer", "consumer", "cpu_only", "ok"}``
    (the children's reports; ``ok`` is True when the consumer got every tensor bit-exact and
    the CPU-only process got none). Needs the disk tier; raises ``RuntimeError`` when a child
    fails.
    """
    disk = Path(workdir) / "ec-disk"
    disk.mkdir(parents=True, exist_ok=True)
    mib = TOKENS * HIDDEN * 2 / (1 << 20)
    out(f"encoder cache demo: {count} images, encoder output [{TOKENS}, {HIDDEN}] float16 ({mib:.2f} MiB each)")
    out(f"shared tier: disk directory {disk}")
    prod = _child(["producer", "--disk", str(disk), "--count", str(count)])
    out(
        f"  process {prod['pid']} (producer, tiers {'+'.join(prod['tiers'])}): "
        f"put {prod['stored']}/{count} encoder outputs in {prod['seconds'] * 1e3:.1f} ms, then exited"
    )
    cons = _child(["consumer", "--disk", str(disk), "--count", str(count)])
    out(
        f"  process {cons['pid']} (consumer, tiers {'+'.join(cons['tiers'])}): contains {cons['present']}/{count}, "
        f"get {cons['hits']}/{count} hits, {cons['exact']}/{count} bit-exact, {cons['seconds'] * 1e3:.1f} ms"
    )
    cpu = _child(["consumer", "--count", str(count)])
    out(
        f"  process {cpu['pid']} (CPU tier only): get {cpu['hits']}/{count} hits "
        "- a CPU tier is private to its process; entries cross processes only through a shared tier"
    )
    ok = cons["exact"] == count and prod["stored"] == count and cpu["hits"] == 0
    out("result: " + ("the consumer reused every encoder output" if ok else "UNEXPECTED: see the numbers above"))
    return {"producer": prod, "consumer": cons, "cpu_only": cpu, "ok": ok}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="one process of the encoder-cache demo")
    parser.add_argument("role", choices=["producer", "consumer"])
    parser.add_argument("--disk", default=None, help="shared disk directory (none: CPU tier only)")
    parser.add_argument("--count", type=int, default=ITEMS)
    args = parser.parse_args(argv)
    if args.role == "producer":
        if args.disk is None:
            parser.error("the producer needs --disk")
        result = _produce(args.disk, args.count)
    else:
        result = _consume(args.disk, args.count)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

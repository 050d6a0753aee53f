"""The side-by-side workloads, written once and run against any system through an adapter.

The harness needs only the standard library and torch: the LMCache side of the comparison runs
it in a separate virtual environment where ``lmcache_async`` is not installed (it is loaded
there by path, next to ``lmcache_side.py``). Do not import ``lmcache_async`` here or in its
parts, each imported relatively in the package and by plain name in that environment:

* ``_harness_data.py`` — sizes, the :class:`Outcome` record, the stored tensors;
* ``_harness_baseline.py`` — :class:`PhysicalAdapter`;
* ``_harness_workloads.py`` — the workloads, :data:`WORKLOADS` and :func:`run_workload`;
* this file — the names above in one place and :func:`worker_main`, the command line of a side.

A *system* is an adapter object with the methods below (duck-typed); three exist:

* ``ours`` (``ours_side.py``) — this project's engines and StorageManager;
* ``lmcache`` (``lmcache_side.py``) — LMCache 0.5.6 on CPU with plain host memory;
* ``baseline`` (:class:`PhysicalAdapter`, ``_harness_baseline.py``) — the physical floor of each workload, per
  SPEC §6: ``copy_`` into pre-touched destinations rotating over >= 128 MiB, ``clone()``/fresh
  results kept as many as the measured call keeps, a locked dict lookup, plain file I/O (one
  executor job per whole file, temp name + rename, no fsync like both tiers under test,
  ``readinto`` a pre-touched buffer).

Every workload does its setup untimed, one warm-up repetition, then ``reps`` timed repetitions;
a repetition performs ``n`` operations over distinct entries that together span >= 128 MiB
(so copies are DRAM-bound, not cache-hot) and yields seconds per operation. Results kept by the
caller in real use (EC ``get``, HS ``retrieve``) are kept until the repetition's clock stops.
Background writes are drained between repetitions, outside the clock.

Adapter methods (``h`` is an ``mm_hash`` string, ``key`` whatever ``sm_key`` returns)::

    ec_open(workdir, cpu_bytes, disk_bytes)   ec_put(h, t) -> bool    ec_get(h) -> Tensor|None
    ec_contains(h) -> bool    ec_drain(hs)    ec_remove(hs) (CPU copies at least)  ec_close()
    hs_open(pool_bytes, chunk)  hs_store(tokens, hs) -> int  hs_retrieve(tokens, out) -> Tensor|None
    hs_clear()  hs_close()    supports_hs_out: bool
    sm_open(workdir|None, cpu_bytes, disk_bytes)  sm_key(i)  sm_batched_put(keys, ts)
    sm_batched_get_release(keys) -> hits   sm_get_release(key) -> bool   sm_drain(keys)
    sm_evict_cpu()   sm_disk_files() -> paths   sm_clear(keys) (CPU copies at least)   sm_close()
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

if __package__:
    from ._harness_baseline import PhysicalAdapter
    from ._harness_data import (
        CHUNK,
        EC_HIDDEN,
        HS_HIDDEN,
        SM_BATCH,
        SPAN,
        KiB,
        MiB,
        Outcome,
        ec_tensor,
        hs_tokens,
        kv_tensor,
    )
    from ._harness_workloads import (
        NO_BASELINE,
        WORKLOADS,
        evict_from_page_cache,
        run_workload,
    )
else:  # loaded by path beside lmcache_side.py
    from _harness_baseline import PhysicalAdapter  # type: ignore[no-redef]
    from _harness_data import (  # type: ignore[no-redef]
        CHUNK,
        EC_HIDDEN,
        HS_HIDDEN,
        SM_BATCH,
        SPAN,
        KiB,
        MiB,
        Outcome,
        ec_tensor,
        hs_tokens,
        kv_tensor,
    )
    from _harness_workloads import (  # type: ignore[no-redef]
        NO_BASELINE,
        WORKLOADS,
        evict_from_page_cache,
        run_workload,
    )

__all__ = [
    "CHUNK",
    "EC_HIDDEN",
    "HS_HIDDEN",
    "NO_BASELINE",
    "SM_BATCH",
    "SPAN",
    "WORKLOADS",
    "KiB",
    "MiB",
    "Outcome",
    "PhysicalAdapter",
    "ec_tensor",
    "evict_from_page_cache",
    "hs_tokens",
    "kv_tensor",
    "run_workload",
    "worker_main",
]


# ---- the worker protocol (shared by every side) ------------------------------------------------
def worker_main(make_adapter: Callable[[], Any], argv: list[str] | None, system: str) -> int:
    """Command line of a side: one workload (``--workload/--size/--reps``) or ``--serve``
    (one JSON request per stdin line: ``{"workload", "size", "reps", "warmup", "workdir",
    "quick"}``; ``{"cmd": "quit"}`` ends). Each outcome is one JSON line on stdout; anything
    else the system prints goes to stderr."""
    import argparse
    import json
    import sys
    import tempfile

    p = argparse.ArgumentParser(description=f"compare worker ({system})")
    p.add_argument("--workload", help=f"one of: {', '.join(WORKLOADS)}")
    p.add_argument("--size", type=int, default=0, help="entry size in bytes (default: the workload's first)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--workdir", default=None, help="directory for disk tiers (a temporary one by default)")
    p.add_argument("--quick", action="store_true", help="fewer entries per repetition (smoke runs)")
    p.add_argument("--serve", action="store_true", help="answer JSON requests from stdin")
    args = p.parse_args(argv)
    if not args.serve and not args.workload:
        p.error("--workload is required unless --serve is given")

    # stdout carries only the JSON lines: point fd 1 (C extensions, logging) at stderr.
    sys.stdout.flush()
    real = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    tmp = tempfile.mkdtemp(prefix=f"lmcache-compare-{system}-")
    adapter: Any = None

    def answer(req: dict[str, Any]) -> dict[str, Any]:
        nonlocal adapter
        name = str(req.get("workload", ""))
        size = int(req.get("size") or 0) or (WORKLOADS[name][1][0] if name in WORKLOADS else 0)
        if adapter is None:
            try:
                adapter = make_adapter()
            except Exception as exc:
                o = Outcome(system=system, workload=name, size=size, ok=False)
                o.error = f"{system} is not available: {type(exc).__name__}: {exc}"
                return o.to_dict()
        o = run_workload(
            adapter,
            name,
            size,
            int(req.get("reps", 5)),
            int(req.get("warmup", 1)),
            str(req.get("workdir") or tmp),
            bool(req.get("quick", False)),
        )
        o.system = system
        return o.to_dict()

    try:
        if not args.serve:
            real.write(json.dumps(answer(vars(args))) + "\n")
            return 0
        for line in sys.stdin:
            line = line.strip()
            if not line:
                continue
            req = json.loads(line)
            if req.get("cmd") == "quit":
                break
            real.write(json.dumps(answer(req)) + "\n")
            real.flush()
        return 0
    finally:
        real.flush()
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)

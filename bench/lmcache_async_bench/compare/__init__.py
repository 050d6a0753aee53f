"""Side-by-side benchmarks of this project against LMCache 0.5.6 (``nox -s compare``).

* ``_harness.py`` — the workloads, written once against an adapter (stdlib + torch only), and
  the physical-baseline adapter (SPEC §6), with the worker command line; its parts live in
  ``_harness_data.py`` (sizes, outcome, tensors), ``_harness_baseline.py`` (the baseline adapter)
  and ``_harness_workloads.py`` (the workloads and their table);
* ``ours_side.py`` — the adapter over this project's engines;
* ``lmcache_side.py`` — the adapter over LMCache, a standalone file run by path with the LMCache
  venv's python (``scripts/lmcache_env.sh`` builds that venv);
* ``worker.py`` — ``python -m lmcache_async_bench.compare.worker --system ours|lmcache|baseline
  --workload NAME --size BYTES --reps N`` prints one JSON line;
* ``driver.py`` / ``python -m lmcache_async_bench.compare`` — runs every workload on the three
  systems in separate long-lived processes, alternating the order each round, and prints both
  medians, our ratio and the same-run baseline.
"""

__all__: list[str] = []

"""The benchmark suites: each figure beside a physical baseline measured in the same run.

Installed beside the core as ``lmcache_async_bench`` (from ``bench/``); ``lmcache-async bench`` runs
them, and each suite module also runs alone with ``python -m lmcache_async_bench.<suite>``.
"""

__all__: list[str] = []

"""The benchmark suites: each figure beside a physical baseline measured in the same run.

Its own distribution, lmcache-async-bench (``bench/`` in the repository), installed beside the
core; ``lmcache-async bench`` runs them, and each suite module also runs alone with
``python -m lmcache_async_bench.<suite>``.
"""

__all__: list[str] = []

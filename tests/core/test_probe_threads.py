"""A tier probe starts no OpenMP team on the manager's loop thread.

A torch fill of a large block there starts a team of intra-op threads for that thread (two more
threads with two intra-op threads), which then compete with the engine's own intra-op threads for
the CPUs; the probe fills its block with ``memset`` instead.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

_CHILD = textwrap.dedent(
    """
    import os, sys, tempfile
    from lmcache_async import LMCacheEngineConfig, LMCacheEngineMetadata, StorageManager

    def tasks():
        return len(os.listdir("/proc/self/task"))

    cfg = LMCacheEngineConfig.from_defaults(
        max_local_cpu_size=0.05, local_disk=tempfile.mkdtemp(), max_local_disk_size=0.1, staging_size=0.05
    )
    with StorageManager(cfg, LMCacheEngineMetadata("probe/model")) as sm:
        assert sm.probe_read_sync("disk", 1024) is not None  # small: every thread the probe uses starts
        before = tasks()
        for _ in range(3):
            assert sm.probe_read_sync("disk", 4 << 20) is not None  # large enough for a parallel fill
        print(tasks() - before)
    """
)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")
def test_a_probe_of_a_large_entry_starts_no_thread() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    res = subprocess.run(
        [sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert res.returncode == 0, res.stderr
    assert int(res.stdout.split()[-1]) == 0, res.stdout

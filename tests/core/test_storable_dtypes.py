"""Every dtype torch has is either stored by every tier (a record code, bytes that round-trip
through the disk tier) or refused up front; the same for ranks above the record format's limit."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lmcache_async import LMCacheEngineConfig, LMCacheEngineMetadata, StorageManager
from lmcache_async.cpu.tier import CPUBackend
from lmcache_async.dtypes import CODE_TO_DTYPE, DTYPE_TO_CODE, is_storable_dtype
from lmcache_async.keys import CacheEngineKey
from lmcache_async.memory import MemoryFormat
from lmcache_async.records import MAX_RANK, decode_header, encode_header
from lmcache_async.tensor_checks import check_storable_tensor

ALL_DTYPES = sorted({d for d in (getattr(torch, a) for a in dir(torch)) if isinstance(d, torch.dtype)}, key=str)
STORABLE = [d for d in ALL_DTYPES if is_storable_dtype(d)]
REFUSED = [d for d in ALL_DTYPES if not is_storable_dtype(d)]

# The code table is append-only: records written by any release keep their meaning.
KNOWN_CODES = {
    1: "float16",
    2: "bfloat16",
    3: "float32",
    4: "float64",
    5: "int8",
    6: "uint8",
    7: "int16",
    8: "int32",
    9: "int64",
    10: "bool",
    11: "float8_e4m3fn",
    12: "float8_e4m3fnuz",
    13: "float8_e5m2",
    14: "float8_e5m2fnuz",
    15: "uint16",
    16: "uint32",
    17: "uint64",
    18: "complex64",
    19: "complex128",
    20: "complex32",
    21: "float8_e8m0fnu",
    22: "float4_e2m1fn_x2",
    23: "bits1x8",
    24: "bits2x4",
    25: "bits4x2",
    26: "bits8",
    27: "bits16",
}


def _key(i: int) -> CacheEngineKey:
    return CacheEngineKey("dtype/model", 1, 0, i, torch.bfloat16)


def _random(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """A tensor of ``dtype`` filled with arbitrary bytes (0/1 for bool), built without kernels
    the dtype may lack: random uint8 viewed as ``dtype``."""
    n = 1
    for d in shape:
        n *= d
    high = 2 if dtype == torch.bool else 256
    raw = torch.randint(
        0, high, (n * dtype.itemsize,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
    )
    return raw.view(dtype).view(shape)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


@pytest.fixture(scope="module")
def disk_manager(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StorageManager]:
    """One manager over a CPU tier and a disk tier for the whole module."""
    root: Path = tmp_path_factory.mktemp("dtypes-disk")
    config = LMCacheEngineConfig.from_defaults(
        max_local_cpu_size=1 / 64,
        staging_size=1 / 256,
        local_disk=str(root),
        max_local_disk_size=1 / 16,
        blocking_timeout_secs=10,
    )
    meta = LMCacheEngineMetadata(model_name="dtype/model", world_size=1, worker_id=0, kv_dtype=torch.bfloat16)
    sm = StorageManager(config, meta)
    yield sm
    sm.close_sync()


def test_the_dtype_code_table_keeps_every_code():
    for code, name in KNOWN_CODES.items():
        dtype = getattr(torch, name, None)
        if isinstance(dtype, torch.dtype):
            assert DTYPE_TO_CODE[dtype] == code and CODE_TO_DTYPE[code] == dtype
    assert len(set(DTYPE_TO_CODE.values())) == len(DTYPE_TO_CODE)


@pytest.mark.parametrize("dtype", STORABLE, ids=str)
def test_a_record_header_carries_every_storable_dtype(dtype):
    header = encode_header("k", (3, 5), dtype, MemoryFormat.UNDEFINED, 0)
    decoded = decode_header(header, expect_key="k")
    assert decoded.dtype == dtype and decoded.payload_len == 15 * dtype.itemsize


@pytest.mark.parametrize("dtype", STORABLE, ids=str)
def test_every_storable_dtype_round_trips_bit_exact_through_the_disk_tier(disk_manager, dtype):
    sm = disk_manager
    i = ALL_DTYPES.index(dtype)
    k = _key(1000 + i)
    t = _random(dtype, (3, 5, 7), seed=i)
    assert sm.put_sync(k, t)
    sm.flush_sync(timeout=30)
    cpu = sm.backend("cpu")
    assert isinstance(cpu, CPUBackend) and cpu.remove_nowait(k)  # the bytes must come from disk
    obj = sm.get_sync(k)
    assert obj is not None
    with obj:
        assert obj.dtype == dtype and obj.shape == (3, 5, 7)
        assert torch.equal(_bytes(obj.tensor), _bytes(t))


@pytest.mark.parametrize("dtype", REFUSED, ids=str)
def test_a_dtype_records_cannot_carry_is_refused_up_front_naming_the_argument(disk_manager, dtype):
    t = _random(dtype, (4,))
    with pytest.raises(TypeError, match="tensor"):
        check_storable_tensor(t, "tensor")
    used = disk_manager.pool.used_bytes
    with pytest.raises(TypeError, match="value"):
        disk_manager.put_sync(_key(1), t)
    assert disk_manager.pool.used_bytes == used


def test_the_largest_rank_records_carry_round_trips_through_the_disk_tier(disk_manager):
    sm = disk_manager
    k = _key(2)
    t = torch.randn([1] * (MAX_RANK - 2) + [2, 3])
    assert sm.put_sync(k, t)
    sm.flush_sync(timeout=30)
    cpu = sm.backend("cpu")
    assert isinstance(cpu, CPUBackend) and cpu.remove_nowait(k)
    obj = sm.get_sync(k)
    assert obj is not None
    with obj:
        assert obj.shape == tuple(t.shape) and torch.equal(obj.tensor, t)


def test_a_rank_above_the_record_limit_is_refused_up_front_naming_the_argument(disk_manager):
    t = torch.zeros([1] * (MAX_RANK + 1))
    with pytest.raises(ValueError, match="tensor"):
        check_storable_tensor(t, "tensor")
    with pytest.raises(ValueError, match="value"):
        disk_manager.put_sync(_key(3), t)
    assert not disk_manager.contains_sync(_key(3))

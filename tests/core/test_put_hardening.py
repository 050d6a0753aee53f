"""What a put may trust and what it may spend: lower-tier presence claims, entries no tier can
hold, one-off buffers, tensors the cache cannot store, and the lower tiers' breaker cap."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from support import membackend
from support.membackend import MemBackend

from lmcache_async import StorageManager
from lmcache_async._manager import staging as staging_module
from lmcache_async.cpu.tier import CPUBackend
from lmcache_async.dtypes import parse_dtype
from lmcache_async.keys import CacheEngineKey
from lmcache_async.memory import MemoryObj
from lmcache_async.testing import make_key
from lmcache_async.tiers import Allocate, StorageBackend, register_backend

MiB = 1 << 20
GiB = 1 << 30


class DamagedClaimBackend(MemBackend):
    """A local lower tier that answers presence from its index, like the disk tier: a key in
    ``damaged`` is claimed present but its record reads as a miss; a put replaces it."""

    name = "testdamaged"

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.damaged: set[CacheEngineKey] = set()

    def contains_nowait(self, key: CacheEngineKey) -> bool:
        return key in self.damaged or key in self.data

    async def contains(self, key: CacheEngineKey) -> bool:
        return key in self.damaged or key in self.data

    async def get(self, key: CacheEngineKey, alloc: Allocate | None = None) -> MemoryObj | None:
        if key in self.damaged:
            return None
        return await super().get(key, alloc)

    async def put(self, key: CacheEngineKey, obj: MemoryObj) -> bool:
        self.damaged.discard(key)
        return await super().put(key, obj)


class CappedBackend(MemBackend):
    """A lower tier that can never hold a record above ``cap`` bytes (header included)."""

    name = "testcapped"
    cap: int | None = 2 * MiB

    @property
    def max_entry_bytes(self) -> int | None:
        return CappedBackend.cap

    async def put(self, key: CacheEngineKey, obj: MemoryObj) -> bool:
        cap = CappedBackend.cap
        if cap is not None and obj.nbytes > cap:
            return False
        return await super().put(key, obj)


def _make_named(cls: type[MemBackend], name: str) -> Callable[[Any], MemBackend]:
    def make(ctx: Any) -> MemBackend:
        b = cls(ctx)
        b.name = name
        return b

    return make


@pytest.fixture(autouse=True)
def _register() -> None:
    membackend.register()
    register_backend("testdamaged", _make_named(DamagedClaimBackend, "testdamaged"), replace=True)
    register_backend("testcapped", _make_named(CappedBackend, "testcapped"), replace=True)
    MemBackend.instances.clear()
    CappedBackend.cap = 2 * MiB


def _t(nbytes: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(nbytes // 4, generator=torch.Generator().manual_seed(seed))


def _read(sm: StorageManager, k: CacheEngineKey) -> torch.Tensor | None:
    obj = sm.get_sync(k)
    if obj is None:
        return None
    with obj:
        return obj.tensor.clone()


# ---- a lower tier's presence claim ------------------------------------------------------------------
def test_put_of_a_key_a_lower_tier_claims_but_cannot_read_is_stored_and_readable(make_manager):
    sm = make_manager(tier_order=["cpu", "testdamaged"])
    lower = membackend.last()
    assert isinstance(lower, DamagedClaimBackend)
    k, t = make_key(1), _t(64 << 10)
    lower.damaged.add(k)
    assert sm.put_sync(k, t)
    got = _read(sm, k)
    assert got is not None and torch.equal(got, t)
    sm.flush_sync(timeout=30)
    cpu = sm.backend("cpu")
    assert isinstance(cpu, CPUBackend) and cpu.remove_nowait(k)
    got = _read(sm, k)  # now from the lower tier, which replaced its damaged record
    assert got is not None and torch.equal(got, t)


def test_put_without_a_cpu_tier_over_a_damaged_claim_is_written_through(make_manager):
    sm = make_manager(tier_order=["cpu", "testdamaged"], local_cpu=False)
    lower = membackend.last()
    assert isinstance(lower, DamagedClaimBackend)
    k, t = make_key(2), _t(64 << 10)
    lower.damaged.add(k)
    assert sm.put_sync(k, t)
    got = _read(sm, k)
    assert got is not None and torch.equal(got, t)
    sm.flush_sync(timeout=30)
    assert k in lower.data and k not in lower.damaged
    got = _read(sm, k)
    assert got is not None and torch.equal(got, t)


def test_put_of_a_cpu_resident_key_allocates_and_writes_nothing(make_manager):
    sm = make_manager(tier_order=["cpu", "testmem"])
    lower = membackend.last()
    k = make_key(3)
    assert sm.put_sync(k, _t(64 << 10))
    sm.flush_sync(timeout=30)
    used, puts = sm.pool.used_bytes, lower.puts
    assert sm.holds_locally(k)
    assert sm.put_sync(k, _t(64 << 10, seed=1))
    assert sm.pool.used_bytes == used
    assert sm.stats()["pending_writes"] == 0
    sm.flush_sync(timeout=30)
    assert lower.puts == puts


def test_holds_locally_ignores_lower_tier_claims(make_manager):
    sm = make_manager(tier_order=["cpu", "testdamaged"])
    lower = membackend.last()
    assert isinstance(lower, DamagedClaimBackend)
    k = make_key(4)
    lower.damaged.add(k)
    assert sm.contains_sync(k)  # presence answers still include the lower tiers
    assert not sm.holds_locally(k)


# ---- entries no tier can hold, one-off buffers -------------------------------------------------------
def test_max_entry_bytes_is_the_cpu_pool_capacity_and_unknown_by_default(make_manager):
    sm = make_manager(tier_order=["cpu", "testmem"])
    cpu = sm.backend("cpu")
    assert isinstance(cpu, CPUBackend)
    assert cpu.max_entry_bytes == sm.pool.capacity
    lower = sm.backend("testmem")
    assert isinstance(lower, StorageBackend) and lower.max_entry_bytes is None


def test_entry_larger_than_every_tier_can_hold_is_refused_at_once(make_manager):
    sm = make_manager(tier_order=["cpu", "testcapped"], max_local_cpu_size=1 / 1024, staging_size=1 / 1024)
    lower = membackend.last()
    huge = torch.ones(1).expand(4 * MiB // 4)  # 4 MiB logical, 4 bytes real
    k = make_key(5)
    assert sm.put_sync(k, huge) is False
    st = sm.stats()
    assert st["put_too_large"] == 1 and st["put_rejected"] == 1
    assert sm._staging.heap.used_bytes == 0 and st["pending_writes"] == 0
    sm.flush_sync(timeout=30)
    assert lower.puts == 0 and not sm.contains_sync(k)


def test_entry_larger_than_the_cpu_pool_and_the_disk_budget_is_refused_without_a_one_off_copy(make_manager, tmp_path):
    sm = make_manager(
        max_local_cpu_size=1 / 1024, staging_size=1 / 1024, local_disk=str(tmp_path / "d"), max_local_disk_size=4 / 1024
    )
    huge = torch.ones(1).expand(16 * MiB // 4)  # 16 MiB logical: above the 4 MiB disk budget
    assert sm.put_sync(make_key(13), huge) is False
    st = sm.stats()
    assert st["put_too_large"] == 1 and st["pending_writes"] == 0
    assert sm._staging.heap.used_bytes == 0
    sm.flush_sync(timeout=30)
    assert sm.stats()["tiers"]["disk"]["entries"] == 0


def test_batched_put_refuses_only_the_entry_no_tier_can_hold(make_manager):
    sm = make_manager(tier_order=["cpu", "testcapped"], max_local_cpu_size=1 / 1024, staging_size=1 / 1024)
    small, huge = _t(64 << 10), torch.ones(1).expand(4 * MiB // 4)
    assert sm.batched_put_sync([make_key(6), make_key(7)], [small, huge]) == [True, False]
    assert sm.stats()["put_too_large"] == 1


def test_entry_larger_than_the_cpu_pool_only_goes_to_a_lower_tier_that_can_hold_it(make_manager):
    CappedBackend.cap = 16 * MiB
    sm = make_manager(tier_order=["cpu", "testcapped"], max_local_cpu_size=1 / 1024, staging_size=1 / 1024)
    k, t = make_key(8), _t(4 * MiB)
    assert sm.put_sync(k, t)
    sm.flush_sync(timeout=30)
    assert sm.stats()["put_too_large"] == 0
    got = _read(sm, k)
    assert got is not None and torch.equal(got, t)


def test_cpu_only_manager_counts_an_entry_larger_than_its_pool_as_too_large(make_manager):
    sm = make_manager(max_local_cpu_size=1 / 1024)
    assert sm.put_sync(make_key(9), torch.ones(1).expand(4 * MiB // 4)) is False
    st = sm.stats()
    assert st["put_too_large"] == 1 and st["put_rejected"] == 1


def _short_of_memory(monkeypatch: pytest.MonkeyPatch, avail: int) -> None:
    # (raising=False: should the name go, the refusals asserted below fail loudly instead)
    monkeypatch.setattr(staging_module, "memory_available_bytes", lambda: avail, raising=False)


def test_one_off_write_buffer_never_eats_into_the_memory_reserve(make_manager, monkeypatch):
    sm = make_manager(
        tier_order=["cpu", "testmem"], max_local_cpu_size=1 / 1024, staging_size=1 / 1024, memory_reserve_size=1 / 1024
    )
    _short_of_memory(monkeypatch, 4 * MiB)  # 3 MiB above the 1 MiB reserve
    assert sm.put_sync(make_key(10), torch.ones(1).expand(8 * MiB // 4)) is False
    st = sm.stats()
    assert st["one_off_refused"] == 1 and st["put_rejected"] == 1 and st["put_too_large"] == 0
    assert sm._staging.heap.used_bytes == 0
    t = _t(2 * MiB)  # larger than the staging area, within what memory allows
    assert sm.put_sync(make_key(11), t)
    sm.flush_sync(timeout=30)
    got = _read(sm, make_key(11))
    assert got is not None and torch.equal(got, t)


def test_one_off_read_buffer_never_eats_into_the_memory_reserve(make_manager, monkeypatch):
    sm = make_manager(
        tier_order=["cpu", "testmem"], max_local_cpu_size=1 / 1024, staging_size=1 / 1024, memory_reserve_size=1 / 1024
    )
    k, t = make_key(12), _t(4 * MiB)  # lands neither in the CPU pool nor in the staging area
    assert sm.put_sync(k, t)
    sm.flush_sync(timeout=30)
    _short_of_memory(monkeypatch, 2 * MiB)
    assert sm.get_sync(k) is None
    assert sm.stats()["one_off_refused"] >= 1
    assert sm._staging.heap.used_bytes == 0
    monkeypatch.undo()
    got = _read(sm, k)
    assert got is not None and torch.equal(got, t)


# ---- tensor validation at the manager boundary ---------------------------------------------------------
def _quiet(make: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    def build() -> torch.Tensor:
        with warnings.catch_warnings():  # prototype/deprecation notices of these tensor kinds
            warnings.simplefilter("ignore")
            return make()

    return build


UNSTORABLE: dict[str, tuple[Callable[[], torch.Tensor], type[Exception]]] = {
    "quantized": (_quiet(lambda: torch.quantize_per_tensor(torch.randn(8), 0.1, 0, torch.qint8)), TypeError),
    "sparse_coo": (_quiet(lambda: torch.randn(4, 4).to_sparse()), TypeError),
    "sparse_csr": (_quiet(lambda: torch.randn(4, 4).to_sparse_csr()), TypeError),
    "nested": (_quiet(lambda: torch.nested.nested_tensor([torch.randn(2), torch.randn(3)])), TypeError),
    "nested_jagged": (
        _quiet(lambda: torch.nested.nested_tensor([torch.randn(2, 4), torch.randn(3, 4)], layout=torch.jagged)),
        TypeError,
    ),
    "meta": (lambda: torch.empty(8, device="meta"), TypeError),
    "sub_byte_dtype": (lambda: torch.zeros(8, dtype=torch.uint8).view(parse_dtype("uint4")), TypeError),
    "rank_33": (lambda: torch.zeros([1] * 33), ValueError),
}


@pytest.mark.parametrize("kind", sorted(UNSTORABLE))
def test_put_refuses_a_tensor_the_cache_cannot_store_naming_value(make_manager, kind):
    sm = make_manager(tier_order=["cpu", "testmem"])
    make, exc = UNSTORABLE[kind]
    with pytest.raises(exc, match="value"):
        sm.put_sync(make_key(20), make())
    assert sm.pool.used_bytes == 0 and not sm.contains_sync(make_key(20))


@pytest.mark.parametrize("kind", sorted(UNSTORABLE))
async def test_async_put_refuses_a_tensor_the_cache_cannot_store_naming_value(make_manager, kind):
    sm = make_manager()
    make, exc = UNSTORABLE[kind]
    with pytest.raises(exc, match="value"):
        await sm.put(make_key(21), make())
    assert sm.pool.used_bytes == 0


@pytest.mark.parametrize("kind", sorted(UNSTORABLE))
def test_batched_put_refuses_before_storing_any_pair(make_manager, kind):
    sm = make_manager()
    make, exc = UNSTORABLE[kind]
    keys = [make_key(22), make_key(23)]
    with pytest.raises(exc, match=r"values\[1\]"):
        sm.batched_put_sync(keys, [torch.ones(8), make()])
    assert sm.pool.used_bytes == 0 and not sm.contains_sync(keys[0])


async def test_async_batched_put_refuses_before_storing_any_pair(make_manager):
    sm = make_manager()
    keys = [make_key(24), make_key(25)]
    with pytest.raises(TypeError, match=r"values\[1\]"):
        await sm.batched_put(keys, [torch.ones(8), torch.empty(8, device="meta")])
    assert sm.pool.used_bytes == 0


def test_batched_put_names_a_bad_key_before_storing_any_pair(make_manager):
    sm = make_manager()
    with pytest.raises(TypeError, match=r"keys\[1\]"):
        sm.batched_put_sync([make_key(26), "not-a-key"], [torch.ones(8), torch.ones(8)])
    assert sm.pool.used_bytes == 0


def test_put_of_a_memory_obj_with_too_many_dimensions_is_refused(make_manager):
    sm = make_manager()
    obj = sm.allocate([1] * 33, torch.float32)
    assert obj is not None
    with obj, pytest.raises(ValueError, match="value"):
        sm.put_sync(make_key(27), obj)


# ---- breaker cap -------------------------------------------------------------------------------------
@pytest.mark.parametrize("cap", [None, 1.5])
def test_lower_tier_breakers_use_the_configured_back_off_cap(make_manager, cap):
    overrides = {} if cap is None else {"remote_breaker_max_backoff_s": cap}
    sm = make_manager(tier_order=["cpu", "testmem"], **overrides)
    expected = sm.config.remote_breaker_max_backoff_s
    assert expected == (4.0 if cap is None else cap)
    assert [t.breaker.max_backoff_s for t in sm._lower] == [expected]

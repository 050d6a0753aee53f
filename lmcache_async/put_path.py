"""The write front of a manager: where a put lands on the caller's thread.

:class:`PutPath` copies a put into the pool tier (or borrows a pool block it is given), takes
the write-through reference and queues it; when the pool tier is full of entries nobody may
evict, or there is none, a staging block carries the entry to the lower tiers instead. Nothing
here waits for the loop.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from lmcache_async.backend import PoolTier
from lmcache_async.errors import ManagerClosedError
from lmcache_async.keys import CacheEngineKey
from lmcache_async.lower_tiers import LowerTiers
from lmcache_async.memory import MemoryFormat, MemoryObj
from lmcache_async.ratelog import RateLimitedLog
from lmcache_async.staging import StagingArea
from lmcache_async.tensor_checks import check_storable_layout, check_storable_tensor
from lmcache_async.tier_guard import LOG_BURST_S
from lmcache_async.write_through import WriteThrough

__all__ = ["PutPath", "check_put_batch"]


def check_put_batch(keys: Sequence[CacheEngineKey], values: Sequence[torch.Tensor | MemoryObj]) -> None:
    """Validate every pair of a batched put before anything is stored (errors name ``keys[i]``
    or ``values[i]``): ``ValueError`` for lengths that differ, ``TypeError`` for a wrong type or
    a value records cannot carry."""
    if len(keys) != len(values):
        raise ValueError(f"keys and values differ in length ({len(keys)} != {len(values)})")
    for i, (k, v) in enumerate(zip(keys, values, strict=True)):
        if type(k) is not CacheEngineKey:
            raise TypeError(f"keys[{i}] must be a CacheEngineKey, got {type(k).__name__}")
        if isinstance(v, torch.Tensor):
            check_storable_tensor(v, f"values[{i}]")
        elif isinstance(v, MemoryObj):
            check_storable_layout(v.dtype, len(v.shape), f"values[{i}]")
        else:
            raise TypeError(f"values[{i}] must be a torch.Tensor or MemoryObj, got {type(v).__name__}")


class PutPath:
    """The put path of the manager named ``name`` over its pool tier ``cpu`` (None: no CPU
    tier), lower tiers ``tiers``, staging area ``staging`` and write-through queue ``wt``.

    Any thread but the loop's. Counters (``put_rejected``, ``put_too_large``) are written by
    caller threads; their figures may miss an increment under a race, never gain one.
    :meth:`detach` drops the tiers once the manager is closed.
    """

    def __init__(
        self,
        name: str,
        cpu: PoolTier | None,
        tiers: LowerTiers,
        staging: StagingArea,
        wt: WriteThrough,
        log: logging.Logger,
    ) -> None:
        self._name = name
        self.cpu = cpu
        self._tiers = tiers
        self._staging = staging
        self._wt = wt
        self._pending = wt.pending
        self.put_rejected = 0
        self.put_too_large = 0
        self._refuse_log = RateLimitedLog(log, LOG_BURST_S)

    def detach(self) -> None:
        """Let go of the pool tier (after close)."""
        self.cpu = None

    def put(
        self, key: CacheEngineKey, value: torch.Tensor | MemoryObj, fmt: MemoryFormat, checked: bool = False
    ) -> bool:
        """One put (see :meth:`StorageManager.put`); ``checked``: the value was validated already."""
        if type(key) is not CacheEngineKey:
            raise TypeError(f"key must be a CacheEngineKey, got {type(key).__name__}")
        src_obj: MemoryObj | None = None
        if isinstance(value, torch.Tensor):
            if not checked:
                check_storable_tensor(value, "value")
            tensor = value
            shape = tuple(value.shape)
            dtype = value.dtype
        elif isinstance(value, MemoryObj):
            src_obj = value
            tensor = value.tensor
            shape, dtype, fmt = value.shape, value.dtype, value.fmt
            if not checked:
                check_storable_layout(dtype, len(shape), "value")
        else:
            raise TypeError(f"value must be a torch.Tensor or MemoryObj, got {type(value).__name__}")
        if not isinstance(fmt, MemoryFormat):
            raise TypeError(f"fmt must be a MemoryFormat, got {type(fmt).__name__}")
        cpu = self.cpu
        if cpu is None:
            if key in self._pending:  # a lower tier's unverified "present" does not count (below)
                return True
            return self._stage_write(key, tensor, shape, dtype, fmt)
        # Only what this manager holds itself makes a put the content-addressed no-op. A lower
        # tier's "present" is unverified (an index entry, a file's size) and may stand for a
        # damaged record: the CPU tier takes the entry and the write-through lets each lower
        # tier keep its record or replace a damaged one.
        if key in cpu or key in self._pending:
            return True
        if src_obj is not None and src_obj.allocator is cpu.pool:
            src_obj.ref_count_up()
            obj = src_obj
        else:
            got = cpu.allocate(shape, dtype, fmt)
            if got is None:
                # CPU full of entries nobody may evict (readers, pending write-through):
                # carry this one to the lower tiers through the staging area instead.
                return self._stage_write(key, tensor, shape, dtype, fmt)
            obj = got
            try:
                obj.tensor.copy_(tensor)
            except BaseException:
                obj.ref_count_down()
                raise
        lower = bool(self._tiers.guards)
        try:
            existing = cpu.insert(key, obj, extra_refs=1 if lower else 0)
        except ManagerClosedError:  # the manager closed meanwhile
            obj.ref_count_down()
            raise
        if existing is not None:
            obj.ref_count_down()
            return True
        if lower and not self._wt.enqueue(key, obj, None):
            obj.ref_count_down()  # the queue closed meanwhile: its reference goes back
        return True

    def _refuse_too_large(self, key: CacheEngineKey, nbytes: int) -> bool:
        """Count (and log, once per burst) a put no tier could ever hold; returns False."""
        self.put_rejected += 1
        self.put_too_large += 1
        self._refuse_log.warning(
            "StorageManager %r: refused an entry of %d bytes (%s): larger than any tier can hold",
            self._name,
            nbytes,
            key.to_string()[:200],
        )
        return False

    def _stage_write(
        self, key: CacheEngineKey, tensor: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, fmt: MemoryFormat
    ) -> bool:
        """Write-through without a CPU-tier copy: a staging block (a one-off buffer for an entry
        larger than the whole staging area) carries the bytes until the lower tiers have them;
        the pending map serves reads meanwhile.

        False (counted in ``put_rejected``) when there is no lower tier, when no lower tier could
        ever hold the record (also counted in ``put_too_large`` when the CPU tier could not
        either), when the staging area is full right now, or when a one-off buffer is not
        allowed. One-off buffers are bounded: at most one at a time beyond the staging size
        (reads aside), never larger than the largest record a lower tier accepts
        (:attr:`~lmcache_async.backend.StorageBackend.max_entry_bytes`), and never eating into
        the memory reserve (``memory_reserve_size``; ``one_off_refused`` counts those refusals)."""
        n = dtype.itemsize
        for d in shape:
            n *= d
        cpu = self.cpu
        if not self._tiers.guards:
            if cpu is not None and not cpu.can_ever_hold(n):
                return self._refuse_too_large(key, n)
            self.put_rejected += 1
            return False
        if not self._tiers.could_hold(key, len(shape), n):
            if cpu is None or not cpu.can_ever_hold(n):
                return self._refuse_too_large(key, n)
            self.put_rejected += 1  # the CPU tier could, but is full of held entries right now
            return False
        staged = self._staging.allocate_write(shape, dtype, fmt, n)
        if staged is None:
            self.put_rejected += 1
            return False
        try:
            staged.tensor.copy_(tensor)
        except BaseException:
            staged.ref_count_down()
            raise
        if not self._wt.enqueue(key, staged, None, only_if_new=True):
            staged.ref_count_down()
        return True

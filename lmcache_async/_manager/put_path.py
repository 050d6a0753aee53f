"""The write front of a manager: where a put lands on the caller's thread.

:class:`PutPath` copies a put into the pool tier (or borrows a pool block it is given), takes
the write-through reference and queues it; when the pool tier is full of entries nobody may
evict, or there is none, a staging block carries the entry to the lower tiers instead.

Without a pool tier, when the first lower tier is a :class:`~lmcache_async.tiers.DirectPut` (the node server's
client tier), a put is written straight into that tier on the caller's thread: one copy, from
the caller's tensor into the tier's own storage, and readable by every process sharing it when
the put returns. Lower tiers after it still get the entry through a staging block. Nothing
here waits for the loop.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from lmcache_async._manager.lower_tiers import LowerTiers
from lmcache_async._manager.staging import StagingArea
from lmcache_async._manager.tier_guard import LOG_BURST_S
from lmcache_async._manager.write_through import WriteThrough
from lmcache_async.deprecation import moved_names
from lmcache_async.errors import ManagerClosedError
from lmcache_async.keys import CacheEngineKey
from lmcache_async.memory import MemoryFormat, MemoryObj, copy_payload, payload_nbytes
from lmcache_async.ratelog import RateLimitedLog
from lmcache_async.tensor_checks import check_storable_layout, check_storable_tensor
from lmcache_async.tiers import DirectPut, PoolTier

if TYPE_CHECKING:
    from lmcache_async._manager.front import Front

__all__ = ["PutPath", "check_put_batch"]


__getattr__ = moved_names(__name__, {"DirectPutTier": "lmcache_async.tiers:DirectPut"})  # kept for one release


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
    """The put path of the manager named ``name`` over its ``front`` (the pool tier, None: no CPU
    tier; the staging area; the write-through queue) and its lower tiers ``tiers``.

    Any thread but the loop's. Counters (``put_rejected``, ``put_too_large``) are written by
    caller threads; their figures may miss an increment under a race, never gain one.
    :meth:`detach` drops the tiers once the manager is closed. :attr:`direct` is the first
    lower tier when there is no CPU tier and that tier declares
    :class:`~lmcache_async.tiers.DirectPut` (see the module docstring), else None.
    """

    def __init__(self, name: str, front: Front, tiers: LowerTiers, log: logging.Logger) -> None:
        cpu, staging, wt = front.cpu, front.staging, front.wt
        self._name = name
        self.cpu: PoolTier | None = cpu
        self._tiers = tiers
        self._staging: StagingArea = staging
        self._wt: WriteThrough = wt
        self._pending = wt.pending
        self.put_rejected = 0
        self.put_too_large = 0
        self._refuse_log = RateLimitedLog(log, LOG_BURST_S)
        guards = tiers.guards
        first = guards[0].backend if guards else None
        self.direct: DirectPut | None = first.as_direct_put() if cpu is None and first is not None else None
        #: Write-through targets of a direct put: the lower tiers after the direct one.
        self._after_direct_targets = tuple(range(1, len(guards)))

    def detach(self) -> None:
        """Let go of the pool tier and the direct tier (after close)."""
        self.cpu = None
        self.direct = None

    def put(
        self, key: CacheEngineKey, value: torch.Tensor | MemoryObj, fmt: MemoryFormat, checked: bool = False
    ) -> bool:
        """One put (see :meth:`StorageManager.put`); ``checked``: the value was validated already."""
        if type(key) is not CacheEngineKey:
            raise TypeError(f"key must be a CacheEngineKey, got {type(key).__name__}")
        if isinstance(value, torch.Tensor):
            if not checked:
                check_storable_tensor(value, "value")
        elif isinstance(value, MemoryObj):
            if not checked:
                check_storable_layout(value.dtype, len(value.shape), "value")
        else:
            raise TypeError(f"value must be a torch.Tensor or MemoryObj, got {type(value).__name__}")
        src_obj = value if isinstance(value, MemoryObj) else None
        shape, dtype, fmt = _layout(value, fmt)
        if not isinstance(fmt, MemoryFormat):
            raise TypeError(f"fmt must be a MemoryFormat, got {type(fmt).__name__}")
        cpu = self.cpu
        if cpu is None:
            if key in self._pending:  # a lower tier's unverified "present" does not count (below)
                return True
            direct = self.direct
            if direct is not None:
                flags = direct.put_direct([(key, value)], fmt)
                stored = None if flags is None else flags[0]
                return self._after_direct(direct, stored, key, value, shape, dtype, fmt)
            return self._stage_write(key, _tensor_of(value), shape, dtype, fmt)
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
                return self._stage_write(key, _tensor_of(value), shape, dtype, fmt)
            obj = got
            try:
                obj.tensor.copy_(_tensor_of(value))
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

    def put_batch(
        self, keys: Sequence[CacheEngineKey], values: Sequence[torch.Tensor | MemoryObj], fmt: MemoryFormat
    ) -> list[bool]:
        """:meth:`put` of each pair, validated already (:func:`check_put_batch`); one result per
        key. With a direct tier the batch is one call of that tier (one round trip to the node
        server for all of it) instead of one per pair."""
        direct = self.direct
        if direct is None or self.cpu is not None or len(keys) < 2:
            return [self.put(k, v, fmt, checked=True) for k, v in zip(keys, values, strict=True)]
        if not isinstance(fmt, MemoryFormat):
            raise TypeError(f"fmt must be a MemoryFormat, got {type(fmt).__name__}")
        out = [True] * len(keys)
        todo = [i for i, k in enumerate(keys) if k not in self._pending]
        got = direct.put_direct([(keys[i], values[i]) for i in todo], fmt) if todo else []
        for j, i in enumerate(todo):
            shape, dtype, vfmt = _layout(values[i], fmt)
            stored = None if got is None else got[j]
            out[i] = self._after_direct(direct, stored, keys[i], values[i], shape, dtype, vfmt)
        return out

    def _after_direct(
        self,
        direct: DirectPut,
        stored: bool | None,
        key: CacheEngineKey,
        value: torch.Tensor | MemoryObj,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        fmt: MemoryFormat,
    ) -> bool:
        """The outcome of a put the direct tier answered with ``stored`` (None: not asked).
        Stored: the lower tiers after it get it through a staging block (when the staging area
        cannot carry it right now, only the direct tier holds it: logged once per burst). When
        the direct tier refused the put or could not be asked, the lower tiers after it still
        may take it (staged, as without a direct tier); with none, the put is refused: False,
        counted in ``put_rejected`` and logged once per burst."""
        rest = self._after_direct_targets
        nbytes = payload_nbytes(shape, dtype)
        if stored:
            if rest and not self._carry(key, _tensor_of(value), shape, dtype, fmt, nbytes, rest):
                self._refuse_log.warning(
                    "StorageManager %r: an entry of %d bytes (%s) is in tier %s only: no staging room "
                    "to carry it to the tiers after it",
                    self._name,
                    nbytes,
                    key.to_string()[:200],
                    direct.name,
                )
            return True
        if rest:
            return self._stage_write(key, _tensor_of(value), shape, dtype, fmt, rest)
        self.put_rejected += 1
        self._refuse_log.warning(
            "StorageManager %r: refused an entry of %d bytes (%s): tier %s %s",
            self._name,
            nbytes,
            key.to_string()[:200],
            direct.name,
            "had no room for it" if stored is False else "could not be reached",
        )
        return False

    def _stage_write(
        self,
        key: CacheEngineKey,
        tensor: torch.Tensor,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        fmt: MemoryFormat,
        targets: tuple[int, ...] | None = None,
    ) -> bool:
        """Write-through without a CPU-tier copy: a staging block (a one-off buffer for an entry
        larger than the whole staging area) carries the bytes until the lower tiers ``targets``
        (indexes into the lower tiers; None: all) have them; the pending map serves reads
        meanwhile.

        False (counted in ``put_rejected``) when there is no lower tier, when no lower tier could
        ever hold the record (also counted in ``put_too_large`` when the CPU tier could not
        either), when the staging area is full right now, or when a one-off buffer is not
        allowed. One-off buffers are bounded: at most one at a time beyond the staging size
        (reads aside), never larger than the largest record a lower tier accepts
        (:attr:`~lmcache_async.tiers.StorageBackend.max_entry_bytes`), and never eating into
        the memory reserve (``memory_reserve_size``; ``one_off_refused`` counts those refusals)."""
        n = payload_nbytes(shape, dtype)
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
        if not self._carry(key, tensor, shape, dtype, fmt, n, targets):
            self.put_rejected += 1
            return False
        return True

    def _carry(
        self,
        key: CacheEngineKey,
        tensor: torch.Tensor,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        fmt: MemoryFormat,
        nbytes: int,
        targets: tuple[int, ...] | None,
    ) -> bool:
        """Copy ``tensor`` into a staging block and queue it for the lower tiers ``targets``;
        False (nothing queued, nothing counted) when the staging area has no block right now."""
        staged = self._staging.allocate_write(shape, dtype, fmt, nbytes)
        if staged is None:
            return False
        try:
            copy_payload(staged.tensor, tensor)
        except BaseException:
            staged.ref_count_down()
            raise
        if not self._wt.enqueue(key, staged, targets, only_if_new=True):
            staged.ref_count_down()
        return True


def _layout(value: torch.Tensor | MemoryObj, fmt: MemoryFormat) -> tuple[tuple[int, ...], torch.dtype, MemoryFormat]:
    """Shape, dtype and format of what a put stores (a MemoryObj carries its own format)."""
    if isinstance(value, MemoryObj):
        return value.shape, value.dtype, value.fmt
    return tuple(value.shape), value.dtype, fmt


def _tensor_of(value: torch.Tensor | MemoryObj) -> torch.Tensor:
    """The bytes a put stores, as a tensor (a pool block's view is made only when a copy needs it)."""
    return value.tensor if isinstance(value, MemoryObj) else value

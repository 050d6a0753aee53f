"""What a KV load costs against what recomputing costs: measured, persisted, decided per chunk run.

Framework-free (no vLLM import). Three parts:

* :class:`ReadCost` — one tier's read time as a function of bytes, ``t = latency + bytes /
  bandwidth``, fitted by least squares over decayed samples (each new sample weighs the old
  ones by :data:`SAMPLE_DECAY`; samples also lose half their weight every ``half_life_s`` of
  wall time, so a tier that got faster is believed again).
* :class:`CostBook` — every tier's :class:`ReadCost` and the engine's prefill rate (tokens/s,
  from the engine's own steps), plus short "unavailable" marks for tiers whose load failed or
  was abandoned. Thread-safe: the scheduler's lookup thread, the worker's load thread and the
  model-runner thread all write it. Kept across processes in a small JSON state file (atomic
  temp + rename; merged entry by entry, newest wins), so a new process starts with the last
  one's estimates; :func:`cost_book` hands every connector of a process the same book for one
  file. Tiers are keyed by their name *and* location (a Redis URL, a disk directory), so a
  tier reached another way is measured anew.
* :func:`decide_load` — the longest chunk-aligned prefix worth loading: per run of chunks held
  by one tier, its expected read time (memory tiers are free) against the time the engine
  would need to prefill its tokens, with a margin; an unavailable tier ends the prefix, and so
  does ``max_load_s``. Pure: tests drive it with synthetic costs.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

__all__ = [
    "LOAD_POLICIES",
    "SAMPLE_DECAY",
    "CostBook",
    "LoadDecision",
    "ReadCost",
    "cost_book",
    "decide_load",
    "load_deadline",
]

logger = logging.getLogger(__name__)

LOAD_POLICIES: Final = ("auto", "always", "never")
LoadPolicy = Literal["auto", "always", "never"]

SAMPLE_DECAY: Final = 0.8
"""Weight every earlier sample keeps when a new one arrives (recent loads dominate)."""
UNAVAILABLE_S: Final = 30.0
"""How long a tier whose load failed or was abandoned is priced unavailable (then tried again)."""
SAVE_EVERY_S: Final = 2.0
"""Least time between two writes of the state file by one book."""
STATE_VERSION: Final = 1


class ReadCost:
    """Decayed least-squares fit of read seconds over bytes (not thread-safe: the book locks).

    ``half_life_s``: wall-clock half-life of the samples' weight."""

    __slots__ = ("half_life_s", "s", "stamp", "sx", "sxx", "sxy", "sy")

    def __init__(self, half_life_s: float) -> None:
        self.half_life_s = half_life_s
        self.s = self.sx = self.sy = self.sxx = self.sxy = 0.0
        self.stamp = 0.0

    def _age(self, now: float) -> None:
        if self.stamp and now > self.stamp:
            f = 0.5 ** ((now - self.stamp) / self.half_life_s)
            self.s, self.sx, self.sy, self.sxx, self.sxy = (
                v * f for v in (self.s, self.sx, self.sy, self.sxx, self.sxy)
            )
        self.stamp = now

    def observe(self, nbytes: float, seconds: float, now: float) -> None:
        """Add one read of ``nbytes`` that took ``seconds`` (wall time ``now``)."""
        self._age(now)
        d = SAMPLE_DECAY
        x, y = float(nbytes) / 1e6, float(seconds)  # MB keeps the sums well conditioned
        self.s = self.s * d + 1.0
        self.sx = self.sx * d + x
        self.sy = self.sy * d + y
        self.sxx = self.sxx * d + x * x
        self.sxy = self.sxy * d + x * y

    @property
    def known(self) -> bool:
        return self.s > 1e-6

    def params(self) -> tuple[float, float] | None:
        """``(latency_s, seconds_per_byte)``, or None without samples."""
        if not self.known:
            return None
        mx, my = self.sx / self.s, self.sy / self.s
        var = self.sxx / self.s - mx * mx
        if var > 1e-12 * max(mx * mx, 1e-12) and var > 1e-9:
            b = (self.sxy / self.s - mx * my) / var
            a = my - b * mx
            if b > 0 and a >= 0:
                return a, b / 1e6
            if b > 0:  # negative intercept: noise; keep the slope through the origin
                return 0.0, (my / mx) / 1e6 if mx > 0 else b / 1e6
        if mx <= 0:
            return my, 0.0
        return 0.0, (my / mx) / 1e6  # one size only: all of it priced as bandwidth

    def estimate(self, nbytes: float, reads: int = 1) -> float | None:
        """Expected seconds for ``reads`` reads of ``nbytes`` bytes in all; None when unknown."""
        p = self.params()
        if p is None:
            return None
        a, b = p
        return a * max(reads, 1) + b * float(nbytes)

    def to_dict(self) -> dict[str, float]:
        return {"s": self.s, "sx": self.sx, "sy": self.sy, "sxx": self.sxx, "sxy": self.sxy, "t": self.stamp}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], half_life_s: float) -> ReadCost:
        """Inverse of :meth:`to_dict`; ``ValueError``/``TypeError`` for a malformed entry."""
        c = cls(half_life_s)
        vals = [float(d[k]) for k in ("s", "sx", "sy", "sxx", "sxy", "t")]
        if not all(math.isfinite(v) and v >= -1e-9 for v in vals[:1] + vals[5:]):
            raise ValueError("a read-cost entry holds a negative or non-finite weight")
        c.s, c.sx, c.sy, c.sxx, c.sxy, c.stamp = vals
        return c


class _Rate:
    """Decayed mean of a rate (weighted by the work measured), with a wall-clock half-life."""

    __slots__ = ("half_life_s", "stamp", "w", "wr")

    def __init__(self, half_life_s: float) -> None:
        self.half_life_s = half_life_s
        self.w = self.wr = 0.0
        self.stamp = 0.0

    def observe(self, work: float, seconds: float, now: float) -> None:
        if self.stamp and now > self.stamp:
            f = 0.5 ** ((now - self.stamp) / self.half_life_s)
            self.w, self.wr = self.w * f, self.wr * f
        self.stamp = now
        weight = min(work / 1000.0, 4.0)  # a long prefill is a better sample than a short one
        self.w = self.w * SAMPLE_DECAY + weight
        self.wr = self.wr * SAMPLE_DECAY + weight * (work / seconds)

    @property
    def value(self) -> float | None:
        return self.wr / self.w if self.w > 1e-9 else None


@dataclass(frozen=True)
class LoadDecision:
    """How many chunks (from the first one asked about) to load, and why.

    ``reason``: ``"memory"`` (every chunk in memory), ``"cheaper"`` (the load beats recompute),
    ``"always"``, ``"unknown"`` (nothing measured yet: loaded, as before there were measures),
    ``"slower"`` (a tier's run costs more than its recompute), ``"unavailable"`` (a tier is
    priced unavailable), ``"max_load_s"``, ``"never"``, ``"miss"`` (nothing held)."""

    chunks: int
    load_s: float | None
    recompute_s: float | None
    reason: str
    tiers: tuple[str, ...] = ()
    declined: tuple[str, float, float] | None = None
    """The run that ended the prefix, when one did on its costs: ``(tier, expected read
    seconds, prefill seconds of its tokens)`` (for the debug log and tests)."""


def decide_load(
    tiers: Sequence[str | None],
    tokens: Sequence[int],
    chunk_bytes: int,
    price: Callable[[str, int, int], float | None],
    prefill_tokens_per_s: float | None,
    *,
    memory_tiers: frozenset[str] | set[str],
    policy: str = "auto",
    max_load_s: float | None = None,
    margin: float = 0.1,
    piece_bytes: int = 4 << 20,
) -> LoadDecision:
    """The prefix of chunks to load. ``tiers[i]`` is where chunk ``i`` lies (None: nowhere),
    ``tokens[i]`` the tokens it would save from recompute; ``price(tier, nbytes, reads)`` the
    expected read time (None: unknown, ``inf``: unavailable). A run of chunks on one non-memory
    tier is read in pieces of up to ``piece_bytes`` (one read each) and kept when its read time
    times ``1 + margin`` is at most the prefill time of its tokens; the first run that is not
    ends the prefix (a slow tail never rides on a fast head). ``max_load_s`` caps the total.
    ``policy="always"`` loads every held chunk whatever it costs (``max_load_s`` is then only
    the load's deadline); ``"never"`` loads nothing.

    ``ValueError`` naming ``policy``/``tokens`` for caller mistakes."""
    if policy not in LOAD_POLICIES:
        raise ValueError(f"policy must be one of {LOAD_POLICIES}, got {policy!r}")
    if len(tokens) != len(tiers):
        raise ValueError(f"tokens has {len(tokens)} entries for {len(tiers)} chunks")
    held = 0
    while held < len(tiers) and tiers[held] is not None:
        held += 1
    if held == 0:
        return LoadDecision(0, 0.0, 0.0, "miss")
    if policy == "never":
        return LoadDecision(0, 0.0, 0.0, "never")
    rate = prefill_tokens_per_s if prefill_tokens_per_s and prefill_tokens_per_s > 0 else None
    auto = policy == "auto"
    total = 0.0
    known = True
    lower = False  # some chunk comes from a tier that is not memory
    n = 0
    stop: str | None = None
    declined: tuple[str, float, float] | None = None
    per_piece = max(1, piece_bytes // max(chunk_bytes, 1))
    for tier, start, end in _tier_runs(tiers[:held]):
        count = end - start
        if tier in memory_tiers:
            n = end
            continue
        cost = price(tier, count * chunk_bytes, -(-count // per_piece))
        if cost is not None and math.isinf(cost):
            if auto:
                stop = "unavailable"
                break
            cost = None  # "always": loaded whatever it costs, at an unknown price
        if cost is None:
            known = False
        elif auto and rate is not None and cost * (1.0 + margin) > sum(tokens[start:end]) / rate:
            stop = "slower"
            declined = (tier, cost, sum(tokens[start:end]) / rate)
            break
        elif auto and max_load_s is not None and total + cost > max_load_s:
            fit = _chunks_within(max_load_s - total, cost, count)
            total += cost / count * fit
            n = start + fit
            stop = "max_load_s"
            break
        lower = True
        total += cost or 0.0
        n = end
    reason = stop or _load_reason(lower=lower, policy=policy, known=known and rate is not None)
    recompute = sum(tokens[:n]) / rate if rate is not None else None
    kept = tuple(t for t in tiers[:n] if t is not None)
    return LoadDecision(n, total if known else None, recompute, reason, kept, declined)


def _tier_runs(tiers: Sequence[str | None]) -> Iterator[tuple[str, int, int]]:
    """Each maximal run of consecutive chunks on one tier: ``(tier, first, end)`` with ``end``
    exclusive, in order. Every entry of ``tiers`` must be a tier (the caller cuts at the first
    chunk held nowhere)."""
    n = 0
    while n < len(tiers):
        tier = tiers[n]
        assert tier is not None
        end = n
        while end < len(tiers) and tiers[end] == tier:
            end += 1
        yield tier, n, end
        n = end


def _chunks_within(budget_s: float, cost: float, count: int) -> int:
    """How many of a run's ``count`` chunks, costing ``cost`` seconds together (spread evenly),
    fit in ``budget_s`` seconds (all of them when the run is free; never negative)."""
    per_chunk = cost / count
    return max(int(budget_s // per_chunk), 0) if per_chunk > 0 else count


def _load_reason(*, lower: bool, policy: str, known: bool) -> str:
    """The :class:`LoadDecision` reason of a prefix no run ended: ``"memory"`` when every chunk
    came from memory, else ``"always"`` for that policy, else ``"cheaper"`` when every run's cost
    and the prefill rate were ``known``, ``"unknown"`` otherwise."""
    if not lower:
        return "memory"
    if policy == "always":
        return "always"
    return "cheaper" if known else "unknown"


def load_deadline(
    decision: LoadDecision, *, factor: float, max_load_s: float | None, floor_s: float = 0.25
) -> float | None:
    """Seconds a load may take before it is abandoned: the larger of its expected time times
    ``factor`` and the recompute time of what it loads (loading longer than that can only
    lose), at least ``floor_s``, at most ``max_load_s``; None when nothing bounds it (no
    estimate and no ``max_load_s``: each read is still bounded by its tier's timeouts)."""
    cands = [v for v in (None if decision.load_s is None else decision.load_s * factor, decision.recompute_s) if v]
    deadline = max(max(cands), floor_s) if cands else None
    if max_load_s is not None:
        deadline = max_load_s if deadline is None else min(deadline, max_load_s)
    return deadline


class CostBook:
    """Read costs per tier and the engine's prefill rate; see the module docstring.

    ``locations`` maps a tier name to where it is (its identity in the state file); ``path``
    names the state file (None: this process only). Every method may be called from any
    thread; only :meth:`save` and :meth:`reload` touch the file (callers keep them off
    vLLM's scheduler thread)."""

    def __init__(
        self,
        locations: Mapping[str, str],
        path: str | None = None,
        *,
        half_life_s: float = 3600.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.locations = dict(locations)
        self.path = path
        self.half_life_s = half_life_s
        self._clock = clock
        self._lock = threading.Lock()
        self._reads: dict[str, ReadCost] = {}
        self._prefill = _Rate(half_life_s)
        self._down: dict[str, float] = {}
        self._dirty = False
        self._saved_at = 0.0
        self._file_mtime = 0.0
        if path is not None:
            self.reload()

    def _ident(self, tier: str) -> str:
        loc = self.locations.get(tier)
        return f"{tier} {loc}" if loc else tier

    # ---- observations (any thread) ----
    def observe_read(self, tier: str, nbytes: int, seconds: float) -> None:
        """A read of ``nbytes`` from ``tier`` took ``seconds`` (ignored unless both are > 0)."""
        if nbytes <= 0 or not seconds > 0:
            return
        with self._lock:
            ident = self._ident(tier)
            c = self._reads.get(ident)
            if c is None:
                c = self._reads[ident] = ReadCost(self.half_life_s)
            c.observe(nbytes, seconds, self._clock())
            self._dirty = True

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """The engine computed ``tokens`` prompt tokens in ``seconds`` (one step)."""
        if tokens <= 0 or not seconds > 0:
            return
        with self._lock:
            self._prefill.observe(float(tokens), seconds, self._clock())
            self._dirty = True

    def mark_unavailable(self, tier: str, seconds: float = UNAVAILABLE_S) -> None:
        """Price ``tier`` unavailable for ``seconds`` (a load from it failed or was abandoned)."""
        with self._lock:
            self._down[self._ident(tier)] = self._clock() + seconds

    # ---- estimates (any thread) ----
    def read_time(self, tier: str, nbytes: int, reads: int = 1) -> float | None:
        """Expected seconds to read ``nbytes`` from ``tier`` in ``reads`` reads; ``inf`` while
        it is marked unavailable; None when it was never measured."""
        with self._lock:
            ident = self._ident(tier)
            until = self._down.get(ident)
            if until is not None:
                if self._clock() < until:
                    return math.inf
                del self._down[ident]
            c = self._reads.get(ident)
            return None if c is None else c.estimate(nbytes, reads)

    def read_params(self, tier: str) -> tuple[float, float] | None:
        """``(latency_s, bytes_per_s)`` of ``tier``'s fit, or None (for stats and logs)."""
        with self._lock:
            c = self._reads.get(self._ident(tier))
            p = None if c is None else c.params()
        if p is None:
            return None
        return p[0], (1.0 / p[1] if p[1] > 0 else math.inf)

    @property
    def prefill_tokens_per_s(self) -> float | None:
        with self._lock:
            return self._prefill.value

    def snapshot(self) -> dict[str, Any]:
        """The estimates as plain data (stats): the prefill rate, each measured tier's fit by
        tier name (this book's locations), the tiers marked unavailable now."""
        out: dict[str, Any] = {"prefill_tokens_per_s": self.prefill_tokens_per_s, "tiers": {}}
        mine = {self._ident(t): t for t in self.locations}
        with self._lock:
            fits = {ident: c.params() for ident, c in self._reads.items()}
            now = self._clock()
            out["unavailable"] = sorted(mine.get(k, k) for k, until in self._down.items() if until > now)
        for ident, p in fits.items():
            tier = mine.get(ident, ident if " " not in ident else None)
            if tier is not None and p is not None:
                out["tiers"][tier] = {"latency_s": p[0], "bytes_per_s": 1.0 / p[1] if p[1] > 0 else math.inf}
        return out

    # ---- the state file (not on vLLM's scheduler thread) ----
    def _to_state(self) -> dict[str, Any]:
        p = self._prefill
        return {
            "version": STATE_VERSION,
            "reads": {k: c.to_dict() for k, c in self._reads.items()},
            "prefill": {"w": p.w, "wr": p.wr, "t": p.stamp},
        }

    def _merge(self, state: Mapping[str, Any]) -> None:
        """Adopt every entry of ``state`` newer than ours (caller holds the lock)."""
        if state.get("version") != STATE_VERSION:
            return
        for ident, d in (state.get("reads") or {}).items():
            try:
                c = ReadCost.from_dict(d, self.half_life_s)
            except (KeyError, TypeError, ValueError):
                continue
            mine = self._reads.get(str(ident))
            if mine is None or c.stamp > mine.stamp:
                self._reads[str(ident)] = c
        pf = state.get("prefill") or {}
        try:
            w, wr, t = float(pf["w"]), float(pf["wr"]), float(pf["t"])
        except (KeyError, TypeError, ValueError):
            return
        if t > self._prefill.stamp and w > 0 and math.isfinite(wr) and wr > 0:
            self._prefill.w, self._prefill.wr, self._prefill.stamp = w, wr, t

    def reload(self) -> None:
        """Merge the state file when it changed since the last look (a missing, unreadable or
        foreign file is ignored: the book keeps what it has)."""
        if self.path is None:
            return
        try:
            mtime = os.stat(self.path).st_mtime
            if mtime == self._file_mtime:
                return
            with open(self.path, encoding="utf-8") as f:
                state = json.load(f)
        except (OSError, ValueError):
            return
        if not isinstance(state, dict):
            return
        with self._lock:
            self._merge(state)
            self._file_mtime = mtime

    def save(self, force: bool = False) -> None:
        """Write the state file (merged with what other processes wrote; temp + rename) when
        something changed, at most every :data:`SAVE_EVERY_S` unless ``force``. Trouble is
        logged, never raised."""
        if self.path is None:
            return
        now = time.monotonic()
        with self._lock:
            if not self._dirty or (not force and now - self._saved_at < SAVE_EVERY_S):
                return
            self._dirty = False
            self._saved_at = now
        self._file_mtime = 0.0
        self.reload()
        with self._lock:
            state = self._to_state()
        directory = os.path.dirname(os.path.abspath(self.path))
        try:
            os.makedirs(directory, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".kv-costs-", dir=directory)
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    json.dump(state, f)
                os.replace(tmp, self.path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
            self._file_mtime = os.stat(self.path).st_mtime
        except OSError as exc:
            logger.warning("KV connector: the load-cost state file %s was not written: %s", self.path, exc)


_books: dict[tuple[Any, ...], CostBook] = {}
_books_lock = threading.Lock()


def cost_book(locations: Mapping[str, str], path: str | None) -> CostBook:
    """The process's book for ``(locations, path)`` (the scheduler and the worker of one
    process share it, so what the worker measures prices the scheduler's next decision)."""
    token = (os.getpid(), path, tuple(sorted(locations.items())))
    with _books_lock:
        book = _books.get(token)
        if book is None:
            book = _books[token] = CostBook(locations, path)
        return book

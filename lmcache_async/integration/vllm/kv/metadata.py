"""What the scheduler-side KV connector tells the workers each step.

A :class:`BlockRun` names consecutive blocks of one request (request block index ``first_block``
onwards) with the vLLM block ids that hold them and the chunk hashes of the chunks they fall in;
:class:`KVStepMetadata` lists this step's loads (records → blocks: synchronous ones, done before
the forward, and asynchronous ones, done beside it) and saves (blocks → records).
Everything is plain ints, strings and tuples: vLLM may send it to workers in other processes,
and :meth:`KVStepMetadata.to_dict`/:meth:`KVStepMetadata.from_dict` give a JSON-safe form that is
validated on the way back in.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["BlockRun", "HSRun", "KVStepMetadata"]

_U64 = 1 << 64


def _int_tuple(values: object, what: str, *, lo: int = 0, hi: int | None = None) -> tuple[int, ...]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(f"{what} must be a sequence of ints, got {type(values).__name__}")
    out = []
    for i, v in enumerate(values):
        if not isinstance(v, int) or isinstance(v, bool):
            raise TypeError(f"{what}[{i}] must be an int, got {type(v).__name__}")
        if v < lo or (hi is not None and v >= hi):
            raise ValueError(f"{what}[{i}] = {v} outside [{lo}, {hi if hi is not None else 'inf'})")
        out.append(v)
    return tuple(out)


@dataclass(frozen=True)
class BlockRun:
    """Blocks ``first_block .. first_block + len(block_ids) - 1`` of request ``req_id``.

    ``block_ids[i]`` is the vLLM block holding request block ``first_block + i``;
    ``chunk_hashes[j]`` is the prefix-chained hash of chunk ``first_block // blocks_per_chunk + j``
    (one per chunk the run touches). Loads only: ``tiers[j]`` names the tier the scheduler found
    chunk ``j`` in (empty: not known), and ``deadline_s`` is how long the load may take before
    the worker abandons it (None: no deadline beyond each read's own timeouts). Construction
    validates the fields (``TypeError`` / ``ValueError`` naming the field).
    """

    req_id: str
    first_block: int
    block_ids: tuple[int, ...]
    chunk_hashes: tuple[int, ...]
    tiers: tuple[str, ...] = ()
    deadline_s: float | None = None
    group_block_ids: tuple[tuple[int, ...], ...] = ()
    """Several KV-cache groups: the block ids of the record's other parts (one tuple per part
    after the primary, each aligned with ``block_ids``; ``0``, vLLM's null block: a block that
    part does not hold, neither saved from nor loaded into)."""

    def __post_init__(self) -> None:
        if not isinstance(self.req_id, str):
            raise TypeError(f"req_id must be a str, got {type(self.req_id).__name__}")
        if not isinstance(self.first_block, int) or isinstance(self.first_block, bool) or self.first_block < 0:
            raise ValueError(f"first_block must be an int >= 0, got {self.first_block!r}")
        object.__setattr__(self, "block_ids", _int_tuple(self.block_ids, "block_ids"))
        groups = self.group_block_ids
        if isinstance(groups, (str, bytes)) or not isinstance(groups, Sequence):
            raise TypeError(f"group_block_ids must be a sequence of sequences, got {type(groups).__name__}")
        checked = tuple(_int_tuple(g, f"group_block_ids[{i}]") for i, g in enumerate(groups))
        for i, g in enumerate(checked):
            if len(g) != len(self.block_ids):
                raise ValueError(f"group_block_ids[{i}] has {len(g)} ids for {len(self.block_ids)} blocks")
        object.__setattr__(self, "group_block_ids", checked)
        object.__setattr__(self, "chunk_hashes", _int_tuple(self.chunk_hashes, "chunk_hashes", hi=_U64))
        tiers = self.tiers
        if isinstance(tiers, (str, bytes)) or not isinstance(tiers, Sequence):
            raise TypeError(f"tiers must be a sequence of str, got {type(tiers).__name__}")
        if not all(isinstance(t, str) for t in tiers):
            raise TypeError("tiers must hold only str")
        if tiers and len(tiers) != len(self.chunk_hashes):
            raise ValueError(f"tiers has {len(tiers)} entries for {len(self.chunk_hashes)} chunk hashes")
        object.__setattr__(self, "tiers", tuple(tiers))
        d = self.deadline_s
        if d is not None and (isinstance(d, bool) or not isinstance(d, (int, float)) or not d > 0):
            raise ValueError(f"deadline_s must be a number > 0 or None, got {d!r}")

    def chunks(self, blocks_per_chunk: int) -> list[tuple[int, int, int, list[int]]]:
        """Per chunk the run touches: ``(chunk_hash, chunk_index, first block within the chunk,
        vLLM block ids)``, in order. ``ValueError`` when ``chunk_hashes`` does not have one hash
        per touched chunk."""
        out: list[tuple[int, int, int, list[int]]] = []
        first_chunk = self.first_block // blocks_per_chunk
        for i, bid in enumerate(self.block_ids):
            b = self.first_block + i
            c = b // blocks_per_chunk
            if not out or out[-1][1] != c:
                j = c - first_chunk
                if j >= len(self.chunk_hashes):
                    raise ValueError(
                        f"request {self.req_id!r}: {len(self.chunk_hashes)} chunk hashes for blocks "
                        f"{self.first_block}..{self.first_block + len(self.block_ids) - 1}"
                    )
                out.append((self.chunk_hashes[j], c, b % blocks_per_chunk, []))
            out[-1][3].append(bid)
        return out

    def part_ids(self, blocks_per_chunk: int) -> list[list[list[int]]]:
        """Per chunk (as :meth:`chunks`), the block ids of every record part: the primary
        group's, then each of ``group_block_ids``."""
        out: list[list[list[int]]] = []
        at = 0
        for _, _, _, bids in self.chunks(blocks_per_chunk):
            n = len(bids)
            out.append([list(bids)] + [list(g[at : at + n]) for g in self.group_block_ids])
            at += n
        return out

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form (hashes as ints; JSON integers are unbounded in Python)."""
        return {
            "req_id": self.req_id,
            "first_block": self.first_block,
            "block_ids": list(self.block_ids),
            "chunk_hashes": list(self.chunk_hashes),
            "tiers": list(self.tiers),
            "deadline_s": self.deadline_s,
            "group_block_ids": [list(g) for g in self.group_block_ids],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> BlockRun:
        """Inverse of :meth:`to_dict`; ``TypeError``/``ValueError`` for a malformed mapping."""
        if not isinstance(d, Mapping):
            raise TypeError(f"a block run must be a mapping, got {type(d).__name__}")
        missing = {"req_id", "first_block", "block_ids", "chunk_hashes"} - set(d)
        if missing:
            raise ValueError(f"block run lacks {sorted(missing)}")
        return cls(
            d["req_id"],
            d["first_block"],
            d["block_ids"],
            d["chunk_hashes"],
            d.get("tiers", ()),
            d.get("deadline_s"),
            d.get("group_block_ids", ()),
        )


@dataclass(frozen=True)
class HSRun:
    """Tokens ``start .. end - 1`` of request ``req_id`` in the hidden-state group.

    ``chunk_hashes`` are the request's chunk hashes from its first chunk through the chunk
    holding token ``end - 1`` (the scheduler derived them from the request with its key
    extras, so the hidden states are keyed exactly as the KV records are); ``block_ids`` are
    the group's block ids of the request from its first token on. Construction validates the
    fields (``TypeError`` / ``ValueError`` naming the field)."""

    req_id: str
    chunk_hashes: tuple[int, ...]
    start: int
    end: int
    block_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.req_id, str):
            raise TypeError(f"req_id must be a str, got {type(self.req_id).__name__}")
        for name in ("start", "end"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise TypeError(f"HSRun {name} must be an int, got {type(v).__name__}")
        if not 0 <= self.start <= self.end:
            raise ValueError(f"HSRun {self.req_id!r}: tokens {self.start}..{self.end}")
        object.__setattr__(self, "chunk_hashes", _int_tuple(self.chunk_hashes, "chunk_hashes", hi=_U64))
        object.__setattr__(self, "block_ids", _int_tuple(self.block_ids, "block_ids"))

    def to_dict(self) -> dict[str, Any]:
        return {
            "req_id": self.req_id,
            "chunk_hashes": list(self.chunk_hashes),
            "start": self.start,
            "end": self.end,
            "block_ids": list(self.block_ids),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> HSRun:
        """Inverse of :meth:`to_dict`; ``TypeError``/``ValueError`` for a malformed mapping."""
        if not isinstance(d, Mapping):
            raise TypeError(f"a hidden-state run must be a mapping, got {type(d).__name__}")
        missing = {"req_id", "chunk_hashes", "start", "end", "block_ids"} - set(d)
        if missing:
            raise ValueError(f"hidden-state run lacks {sorted(missing)}")
        return cls(d["req_id"], d["chunk_hashes"], d["start"], d["end"], d["block_ids"])


@dataclass
class KVStepMetadata:
    """Scheduler → workers for one step: the loads and the saves to do.

    ``loads`` run in ``start_load_kv`` before the forward that reads them; ``async_loads`` (hits
    only a lower tier holds) start there and finish beside later steps, reported through
    ``get_finished``; ``saves`` run in ``wait_for_save``, after the forward wrote the blocks.
    ``idle``: the step schedules no tokens (every request waits, e.g. for its load), so the
    worker may block briefly for a load in flight instead of returning to vLLM's busy loop.
    """

    loads: list[BlockRun] = field(default_factory=list)
    saves: list[BlockRun] = field(default_factory=list)
    async_loads: list[BlockRun] = field(default_factory=list)
    idle: bool = False
    hs_saves: list[HSRun] = field(default_factory=list)
    """Hidden-state group rows to store after this step's forward (``extract_hidden_states``)."""
    hs_loads: list[HSRun] = field(default_factory=list)
    """Hidden-state group rows to restore with the KV load of the same request."""
    num_tokens: int = 0
    """Tokens this step computes (the worker times the step: the engine's prefill rate)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "loads": [r.to_dict() for r in self.loads],
            "saves": [r.to_dict() for r in self.saves],
            "async_loads": [r.to_dict() for r in self.async_loads],
            "idle": self.idle,
            "hs_saves": [r.to_dict() for r in self.hs_saves],
            "hs_loads": [r.to_dict() for r in self.hs_loads],
            "num_tokens": self.num_tokens,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> KVStepMetadata:
        """Inverse of :meth:`to_dict`; ``TypeError``/``ValueError`` for a malformed mapping."""
        if not isinstance(d, Mapping):
            raise TypeError(f"step metadata must be a mapping, got {type(d).__name__}")
        idle = d.get("idle", False)
        if not isinstance(idle, bool):
            raise TypeError(f"idle must be a bool, got {type(idle).__name__}")
        return cls(
            [BlockRun.from_dict(r) for r in d.get("loads", ())],
            [BlockRun.from_dict(r) for r in d.get("saves", ())],
            [BlockRun.from_dict(r) for r in d.get("async_loads", ())],
            idle,
            [HSRun.from_dict(r) for r in d.get("hs_saves", ())],
            [HSRun.from_dict(r) for r in d.get("hs_loads", ())],
            _int_tuple([d.get("num_tokens", 0)], "num_tokens")[0],
        )

"""vLLM's KV-cache groups as the connector sees them: which parts a chunk record holds.

A model that mixes layer kinds gets several KV-cache groups from vLLM's hybrid KV-cache
manager, each with its own block ids: full-attention layers, sliding-window layers (which hold
only the blocks inside their window; the blocks before it are vLLM's null block, id
:data:`NULL_BLOCK_ID`), the hidden-state layer of ``extract_hidden_states``, Mamba or
linear-attention state. Framework-free: specs are recognised by class name, so nothing of vLLM
is imported.

A chunk's record is one entry holding one part per attention group: the layers of every
full-attention and sliding-window group, in group order, each layer copied through its own
group's block ids. One entry makes the parts one unit: a chunk is present only when every part
is (a lookup of one key), it is evicted and removed whole, and a load restores all parts or
none. A sliding-window part holds only the blocks a later load can need (:func:`window_first_block`);
the others are never written from (null or already released blocks) and never loaded into.

Groups the connector cannot restore (Mamba / linear-attention state, chunked-local attention,
MLA, sinks) make :attr:`GroupLayout.unsupported` non-empty: the connector then offers no
tokens (and saves nothing), with one warning at start-up naming them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["NULL_BLOCK_ID", "GroupLayout", "describe_groups", "mask_window", "window_first_block"]

NULL_BLOCK_ID = 0
"""vLLM's null block (``vllm.v1.attention.backends.utils.NULL_BLOCK_ID``): a placeholder in a
request's block table for blocks a sliding window has dropped; never read, never written."""

_FULL = {"FullAttentionSpec"}
_WINDOW = {"SlidingWindowSpec"}
_HIDDEN = {"HiddenStateCacheSpec"}


def _kind(spec: Any) -> str:
    """``"full"``, ``"window"``, ``"hidden"`` or ``"other"`` for one vLLM ``KVCacheSpec``."""
    name = type(spec).__name__
    if name == "UniformTypeKVCacheSpecs":
        kinds = {_kind(s) for s in (getattr(spec, "kv_cache_specs", None) or {}).values()}
        if kinds == {"full", "hidden"}:  # the hidden-state layer riding in the attention group
            return "full"
        return kinds.pop() if len(kinds) == 1 else "other"
    if name in _HIDDEN:
        return "hidden"
    if name in _FULL:
        return "full"
    if name in _WINDOW:
        return "window"
    return "other"


def _retained(spec: Any) -> int:
    """Tokens before a position that a sliding-window layer keeps (``sliding_window - 1`` plus
    ``extra_retained_tokens``)."""
    if type(spec).__name__ == "UniformTypeKVCacheSpecs":
        spec = next(iter(spec.kv_cache_specs.values()))
    return int(spec.sliding_window) - 1 + int(getattr(spec, "extra_retained_tokens", 0) or 0)


@dataclass(frozen=True)
class GroupLayout:
    """The connector's view of vLLM's KV-cache groups (indexes into ``kv_cache_groups``).

    ``attention``: the groups whose layers a record holds, in record order (the first is the
    *primary* group: its block ids are a run's ``block_ids``, the others go to
    ``group_block_ids``). ``retained``: per attention group, the tokens a sliding-window group
    keeps before a position (None: full attention). ``hidden``: the hidden-state group or None.
    ``unsupported``: ``"<index>:<spec class>"`` of each group nothing restores. ``layer_group``:
    layer name → group index.
    """

    attention: tuple[int, ...] = (0,)
    retained: tuple[int | None, ...] = (None,)
    hidden: int | None = None
    unsupported: tuple[str, ...] = ()
    layer_group: dict[str, int] = field(default_factory=dict)
    num_groups: int = 1
    block_size: int | None = None
    """Tokens per block of the attention groups (vLLM may give a hidden-state group smaller
    blocks, and then reports the smallest as the engine's block size); None: not known."""

    @property
    def several(self) -> bool:
        """More than one KV-cache group: vLLM takes no block-level load errors then."""
        return self.num_groups > 1

    @property
    def windowed(self) -> bool:
        """Some record part is a sliding-window group (hits then end on chunk boundaries)."""
        return any(r is not None for r in self.retained)

    def position(self, layer_name: str) -> int | None:
        """The record part (0 = primary) of ``layer_name``'s group; None when no part holds it."""
        g = self.layer_group.get(layer_name)
        if g is None or g not in self.attention:
            return None
        return self.attention.index(g)


def describe_groups(kv_cache_config: Any) -> GroupLayout:
    """The :class:`GroupLayout` of vLLM's ``KVCacheConfig`` (one full-attention group when it
    has no groups, e.g. a unit test without a config)."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())
    if not groups:
        return GroupLayout()
    attention: list[int] = []
    retained: list[int | None] = []
    hidden: int | None = None
    unsupported: list[str] = []
    layer_group: dict[str, int] = {}
    for i, g in enumerate(groups):
        spec = g.kv_cache_spec
        for name in getattr(g, "layer_names", None) or ():
            layer_group[str(name)] = i
        kind = _kind(spec)
        if kind == "hidden" and hidden is None:
            hidden = i
        elif kind in ("full", "window"):
            attention.append(i)
            retained.append(_retained(spec) if kind == "window" else None)
        else:
            unsupported.append(f"{i}:{type(spec).__name__}")
    if not attention:
        unsupported.append("no attention group")
    sizes = {
        int(groups[i].kv_cache_spec.block_size) for i in attention if hasattr(groups[i].kv_cache_spec, "block_size")
    }
    if len(sizes) > 1:
        unsupported.append(f"attention groups with block sizes {sorted(sizes)}")
    # Full attention first: the primary group is then one that never holds null blocks.
    order = sorted(range(len(attention)), key=lambda j: retained[j] is not None)
    return GroupLayout(
        tuple(attention[j] for j in order) or (0,),
        tuple(retained[j] for j in order) or (None,),
        hidden,
        tuple(unsupported),
        layer_group,
        len(groups),
        sizes.pop() if len(sizes) == 1 else None,
    )


def window_first_block(chunk_end: int, retained: int, block_size: int) -> int:
    """The first request block a sliding-window group keeps once ``chunk_end`` tokens are
    computed (vLLM's ``get_num_skipped_tokens``, in blocks). A chunk's window part holds the
    blocks from there on: every block a load ending at this chunk or a later one allocates
    is among them, and every one of them was still held when the chunk was saved."""
    return max(0, chunk_end - retained) // block_size


def mask_window(block_ids: Sequence[int], first_block: int, keep_from: int) -> tuple[int, ...]:
    """``block_ids`` (request blocks ``first_block ..``) with the blocks before request block
    ``keep_from`` replaced by :data:`NULL_BLOCK_ID` (not saved from, not loaded into)."""
    return tuple(NULL_BLOCK_ID if first_block + i < keep_from else b for i, b in enumerate(block_ids))

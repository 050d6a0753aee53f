"""Which chunks a publisher advertises, and in what order: whole chunks only, parent first.

A chunk (one cache entry: the vLLM blocks it holds, in order) is **present** while some entry of
the tier holds it, and **advertised** while it is present and so is every chunk before it in the
prompt (its parent: the chunk whose last block hash is this chunk's parent hash, and that one's
parent, up to a chunk with no parent). That is what a prefix lookup of the cache can serve, and it
is what routers can index: NVIDIA Dynamo's radix tree skips a store whose parent it does not know
and drops a subtree when its parent is removed.

:class:`ChunkAdvertiser` turns presence changes into the stores and removals to publish:

* a chunk that becomes present is advertised when its parent is; then every present chunk that
  waited for it, recursively, parents before children;
* a chunk that stops being present is withdrawn together with every advertised chunk below it,
  children before parents (leaves first), so each removal names blocks the router still knows;
  the present ones among them wait for their parent again.

Pure bookkeeping; not thread-safe (one owner thread).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

__all__ = ["Changes", "Chunk", "ChunkAdvertiser"]


@dataclass(frozen=True, slots=True)
class Chunk:
    """One chunk in vLLM's terms: ``block_hashes`` of its blocks (in order; hashable values,
    vLLM's ``BlockHash`` bytes or ints), ``parent_hash`` (of the block before the first; None at a
    prompt's start), ``token_ids`` (all of the chunk's tokens), ``block_size``, ``lora_name``
    and ``extra_keys`` (one entry per block, as vLLM publishes them; None when there are none)."""

    block_hashes: tuple[Any, ...]
    parent_hash: Any
    token_ids: tuple[int, ...]
    block_size: int
    lora_name: str | None = None
    extra_keys: tuple[Any, ...] | None = None

    def __post_init__(self) -> None:
        if not self.block_hashes:
            raise ValueError("a chunk holds at least one block")
        if self.block_size <= 0 or len(self.token_ids) != self.block_size * len(self.block_hashes):
            raise ValueError("token_ids must fill every block of the chunk")

    @property
    def ident(self) -> tuple[Any, ...]:
        """What identifies the chunk: its block hashes."""
        return self.block_hashes

    @property
    def last(self) -> Any:
        return self.block_hashes[-1]


@dataclass(slots=True)
class Changes:
    """What to publish, in this order: ``removed`` (leaves first), then ``stored`` (parents first)."""

    stored: list[Chunk]
    removed: list[Chunk]

    def __bool__(self) -> bool:
        return bool(self.stored or self.removed)


@dataclass(slots=True)
class _State:
    chunk: Chunk
    refs: int = 0
    advertised: bool = False


class ChunkAdvertiser:
    """Presence (counted per holder) in, stores and removals out; see the module docstring."""

    def __init__(self) -> None:
        self._chunks: dict[tuple[Any, ...], _State] = {}
        self._by_last: dict[Any, _State] = {}  # present chunks by their last block hash
        self._waiting: dict[Any, dict[tuple[Any, ...], _State]] = {}  # parent hash -> present, not advertised
        self._children: dict[Any, dict[tuple[Any, ...], _State]] = {}  # parent hash -> advertised
        #: Advertised chunks in the order they were advertised (every parent before its children).
        self._advertised: dict[tuple[Any, ...], Chunk] = {}

    def __len__(self) -> int:
        """Chunks advertised now."""
        return len(self._advertised)

    def advertised(self) -> Iterator[Chunk]:
        """The advertised chunks, every parent before its children (what a snapshot stores)."""
        return iter(list(self._advertised.values()))

    def is_advertised(self, chunk: Chunk) -> bool:
        return chunk.ident in self._advertised

    def add(self, chunk: Chunk) -> Changes:
        """One more holder of ``chunk`` (an entry was stored)."""
        out = Changes([], [])
        st = self._chunks.get(chunk.ident)
        if st is None:
            st = self._chunks[chunk.ident] = _State(chunk)
        st.refs += 1
        if st.refs > 1:
            return out
        self._by_last[chunk.last] = st
        parent = self._by_last.get(chunk.parent_hash) if chunk.parent_hash is not None else None
        if chunk.parent_hash is None or (parent is not None and parent.advertised):
            self._advertise(st, out.stored)
        else:
            self._waiting.setdefault(chunk.parent_hash, {})[chunk.ident] = st
        return out

    def discard(self, chunk: Chunk) -> Changes:
        """One holder of ``chunk`` fewer (an entry left the tier); unknown chunks are ignored."""
        out = Changes([], [])
        st = self._chunks.get(chunk.ident)
        if st is None:
            return out
        st.refs -= 1
        if st.refs > 0:
            return out
        del self._chunks[chunk.ident]
        if self._by_last.get(chunk.last) is st:
            del self._by_last[chunk.last]
        if st.advertised:
            self._withdraw(st, out.removed)
        else:
            waiting = self._waiting.get(chunk.parent_hash)
            if waiting is not None:
                waiting.pop(chunk.ident, None)
                if not waiting:
                    del self._waiting[chunk.parent_hash]
        return out

    def clear(self) -> None:
        """Forget everything (the holder restarted; its stream says so with AllBlocksCleared)."""
        self.__init__()  # type: ignore[misc]

    def _advertise(self, st: _State, stored: list[Chunk]) -> None:
        todo = [st]
        while todo:
            cur = todo.pop(0)
            cur.advertised = True
            self._advertised[cur.chunk.ident] = cur.chunk
            if cur.chunk.parent_hash is not None:
                self._children.setdefault(cur.chunk.parent_hash, {})[cur.chunk.ident] = cur
            stored.append(cur.chunk)
            todo.extend(self._waiting.pop(cur.chunk.last, {}).values())

    def _withdraw(self, st: _State, removed: list[Chunk]) -> None:
        order: list[_State] = []
        todo = [st]
        while todo:  # every advertised chunk below st, parents before children
            cur = todo.pop()
            order.append(cur)
            todo.extend(self._children.get(cur.chunk.last, {}).values())
        for cur in reversed(order):  # leaves first
            cur.advertised = False
            del self._advertised[cur.chunk.ident]
            parent = cur.chunk.parent_hash
            if parent is not None:
                kids = self._children.get(parent)
                if kids is not None:
                    kids.pop(cur.chunk.ident, None)
                    if not kids:
                        del self._children[parent]
            removed.append(cur.chunk)
            if cur is not st:  # still present: waits for its parent again
                self._waiting.setdefault(parent, {})[cur.chunk.ident] = cur

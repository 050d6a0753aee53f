"""Whole chunks only, parent first: what :class:`ChunkAdvertiser` publishes."""

from __future__ import annotations

import random

import pytest

from lmcache_async.events.chunks import Chunk, ChunkAdvertiser


def _chain(n: int, start: int = 0, parent: int | None = None) -> list[Chunk]:
    out = []
    for i in range(n):
        h = (start + 2 * i + 1, start + 2 * i + 2)
        out.append(Chunk(h, parent, tuple(range(4)), 2))
        parent = h[-1]
    return out


def test_a_root_chunk_is_advertised_at_once() -> None:
    adv = ChunkAdvertiser()
    c = _chain(1)[0]
    assert adv.add(c).stored == [c]


def test_a_child_waits_for_its_parent_then_follows_it() -> None:
    adv = ChunkAdvertiser()
    a, b, c = _chain(3)
    assert not adv.add(c) and not adv.add(b)
    assert adv.add(a).stored == [a, b, c]


def test_removing_a_parent_withdraws_its_subtree_leaves_first_and_readding_restores_it() -> None:
    adv = ChunkAdvertiser()
    a, b, c = _chain(3)
    for x in (a, b, c):
        adv.add(x)
    assert adv.discard(a).removed == [c, b, a]
    assert len(adv) == 0
    assert adv.add(a).stored == [a, b, c]


def test_a_chunk_held_twice_goes_when_the_last_holder_drops_it() -> None:
    adv = ChunkAdvertiser()
    a = _chain(1)[0]
    adv.add(a)
    assert not adv.add(a)
    assert not adv.discard(a)
    assert adv.discard(a).removed == [a]


def test_partial_chunks_are_refused() -> None:
    with pytest.raises(ValueError):
        Chunk((1, 2), None, (1, 2, 3), 2)


def test_random_presence_advertises_exactly_the_chains_present_from_their_root() -> None:
    rng = random.Random(7)
    chains = [_chain(4, start=100 * k) for k in range(5)]
    every = [c for ch in chains for c in ch]
    adv = ChunkAdvertiser()
    present: set[tuple[int, ...]] = set()
    view: set[tuple[int, ...]] = set()
    for _ in range(2000):
        c = rng.choice(every)
        ch = adv.discard(c) if c.ident in present else adv.add(c)
        present ^= {c.ident}
        for r in ch.removed:
            assert r.ident in view and not any(x.parent_hash == r.last for x in every if x.ident in view - {r.ident})
            view.discard(r.ident)
        for s in ch.stored:
            assert s.parent_hash is None or any(x.last == s.parent_hash for x in every if x.ident in view)
            view.add(s.ident)
        want = set()
        for ch_ in chains:
            for x in ch_:
                if x.ident not in present:
                    break
                want.add(x.ident)
        assert view == want == {x.ident for x in adv.advertised()}

"""A helper shared by the hidden-state store tests (test_hidden_states*.py)."""

from __future__ import annotations

from engines._data import kv_for


def _with_kv(eng, toks, seed=0):
    """Store KV for the whole prompt (the thinker's KV) so HS chunks count as covered."""
    eng.store(toks, kv_for(len(toks), seed=seed))

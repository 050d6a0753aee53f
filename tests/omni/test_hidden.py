"""The thinker's hidden states for a KV-cached prefix come from the hidden-state store."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from lmcache_async.config import LMCacheEngineConfig
from lmcache_async.engines.hidden_states import HiddenStateStore
from lmcache_async.integration.omni import OmniStageStore, load_stage_options
from lmcache_async.integration.omni.hidden import thinker_hidden_states

CHUNK = 16
HIDDEN = 8


@pytest.fixture
def hs_store() -> Iterator[HiddenStateStore]:
    cfg = LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK, max_local_cpu_size=1 / 64, max_hidden_state_cpu_size=1 / 64, staging_size=1 / 64
    )
    store = HiddenStateStore(cfg)
    yield store
    store.close()


def test_prefix_rows_come_from_the_store_and_suffix_rows_from_the_step(hs_store: HiddenStateStore) -> None:
    prompt = list(range(3 * CHUNK + 5))
    full = torch.randn(len(prompt), HIDDEN)
    assert hs_store.store_hidden_states(prompt[: 2 * CHUNK], full[: 2 * CHUNK]) == 2  # an earlier request
    suffix = full[2 * CHUNK :]  # this step computed only what the KV cache did not hold
    out = thinker_hidden_states(hs_store, prompt, suffix)
    assert out is not None and out.shape == (len(prompt), HIDDEN)
    torch.testing.assert_close(out, full)


def test_whole_prompt_cached_needs_no_computed_rows(hs_store: HiddenStateStore) -> None:
    prompt = list(range(2 * CHUNK))
    full = torch.randn(len(prompt), HIDDEN)
    hs_store.store_hidden_states(prompt, full)
    out = thinker_hidden_states(hs_store, prompt, None)
    assert out is not None
    torch.testing.assert_close(out, full)


def test_nothing_cached_returns_a_copy_of_the_computed_rows(hs_store: HiddenStateStore) -> None:
    prompt = list(range(10))
    computed = torch.randn(10, HIDDEN)
    out = thinker_hidden_states(hs_store, prompt, computed)
    assert out is not None and torch.equal(out, computed) and out.data_ptr() != computed.data_ptr()


def test_a_prefix_the_store_lost_is_none(hs_store: HiddenStateStore) -> None:
    prompt = list(range(3 * CHUNK))
    full = torch.randn(len(prompt), HIDDEN)
    hs_store.store_hidden_states(prompt[:CHUNK], full[:CHUNK])  # only one of the two cached chunks
    assert thinker_hidden_states(hs_store, prompt, full[2 * CHUNK :]) is None


def test_bad_computed_raises_naming_it(hs_store: HiddenStateStore) -> None:
    with pytest.raises(ValueError, match="computed"):
        thinker_hidden_states(hs_store, [1, 2], torch.ones(3, HIDDEN))
    with pytest.raises(ValueError, match="computed"):
        thinker_hidden_states(hs_store, [1, 2], torch.ones(2))
    with pytest.raises(TypeError, match="store"):
        thinker_hidden_states(object(), [1], None)  # type: ignore[arg-type]


def test_talker_receives_the_assembled_hidden_states_over_the_stage_store(hs_store: HiddenStateStore) -> None:
    prompt = list(range(2 * CHUNK + 3))
    full = torch.randn(len(prompt), HIDDEN)
    hs_store.store_hidden_states(prompt[:CHUNK], full[:CHUNK])
    hs = thinker_hidden_states(hs_store, prompt, full[CHUNK:])
    assert hs is not None
    cfg, opts = load_stage_options({"max_local_cpu_size": 1 / 64, "staging_size": 1 / 64})
    with OmniStageStore(cfg, opts) as stage:
        assert stage.put("thinker", "talker", "r_0_0", {"hidden_states": hs, "prompt_len": len(prompt)})[0]
        got = stage.get("thinker", "talker", "r_0_0")
    assert got is not None
    torch.testing.assert_close(got[0]["hidden_states"], full)

"""Our chunk keys against vLLM's own block hashes, for pairs of real vLLM ``Request`` objects.

vLLM computes ``request.block_hashes`` (its prefix-cache identity, extras included) whenever a
block hasher is set, as it is with a connector. For each pair below — same text with other
images, other offsets of one image, LoRA vs none, other adapters, salts, prompt embeddings —
two requests must share our key of a chunk exactly when they share vLLM's hashes of that
chunk's blocks. No engine starts: the requests are built with the engine's own classes.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

from lmcache_async.integration.vllm.kv.request_keys import UnreadableRequest, request_key_inputs
from lmcache_async.token_database import ChunkedTokenDatabase

if os.environ.get("LMCACHE_ASYNC_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="vLLM is not installed (nox -s e2e installs it)")

with warnings.catch_warnings():  # vLLM's import chain warns (torch.jit deprecations)
    warnings.simplefilter("ignore")
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

BLOCK = 16
BPC = 2  # blocks per chunk
CHUNK = BLOCK * BPC
N = 8 * CHUNK  # 256 tokens, 8 chunks
DB = ChunkedTokenDatabase(CHUNK)
TEXT = [(i * 7919) % 30000 + 5 for i in range(N)]
IMG = 32000  # placeholder id

init_none_hash(sha256)
_HASHER = get_request_block_hasher(BLOCK, sha256)
_ids = iter(range(1_000_000))


def image(identifier: str, offset: int, length: int = 40) -> MultiModalFeatureSpec:
    return MultiModalFeatureSpec(
        data=None, modality="image", identifier=identifier, mm_position=PlaceholderRange(offset, length)
    )


def with_placeholders(tokens: list[int], *items: MultiModalFeatureSpec) -> list[int]:
    out = list(tokens)
    for it in items:
        pos = it.mm_position
        out[pos.offset : pos.offset + pos.length] = [IMG] * pos.length
    return out


def request(tokens: list[int] | None = None, **kw: Any) -> Request:
    mm = kw.get("mm_features") or ()
    ids = with_placeholders(TEXT if tokens is None else tokens, *mm) if kw.get("prompt_embeds") is None else None
    if tokens is not None and kw.get("prompt_embeds") is not None:
        ids = tokens
    return Request(
        request_id=f"r{next(_ids)}",
        prompt_token_ids=ids,
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        block_hasher=_HASHER,
        **kw,
    )


def ours(req: Request) -> list[int]:
    tokens, extras = request_key_inputs(req)
    return DB.chunk_hashes(tokens, extras)


def theirs(req: Request) -> list[Any]:
    """vLLM's hash of each chunk's last block (chained: it stands for the whole prefix)."""
    return [req.block_hashes[(c + 1) * BPC - 1] for c in range(len(req.block_hashes) // BPC)]


def agree(a: Request, b: Request) -> list[bool]:
    """Per chunk: whether the two requests share it; asserts ours and vLLM's agree."""
    ours_a, ours_b, theirs_a, theirs_b = ours(a), ours(b), theirs(a), theirs(b)
    assert len(ours_a) == len(theirs_a) == N // CHUNK
    share_ours = [x == y for x, y in zip(ours_a, ours_b, strict=True)]
    share_theirs = [x == y for x, y in zip(theirs_a, theirs_b, strict=True)]
    assert share_ours == share_theirs, (share_ours, share_theirs)
    return share_ours


PAIRS: dict[str, tuple[Callable[[], Request], Callable[[], Request], list[bool]]] = {
    "same text, same image": (
        lambda: request(mm_features=[image("A", 70)]),
        lambda: request(mm_features=[image("A", 70)]),
        [True] * 8,
    ),
    "same text, other image": (
        lambda: request(mm_features=[image("A", 70)]),
        lambda: request(mm_features=[image("B", 70)]),
        [True, True] + [False] * 6,
    ),
    "one image at other offsets": (
        lambda: request(mm_features=[image("A", 70)]),
        lambda: request(mm_features=[image("A", 74)]),
        [True, True] + [False] * 6,
    ),
    "two images, the second other": (
        lambda: request(mm_features=[image("A", 10), image("B", 150)]),
        lambda: request(mm_features=[image("A", 10), image("C", 150)]),
        [True] * 4 + [False] * 4,
    ),
    "image vs no image": (
        lambda: request(mm_features=[image("A", 100)]),
        lambda: request(with_placeholders(TEXT, image("A", 100))),
        [True] * 3 + [False] * 5,
    ),
    "LoRA vs none": (
        lambda: request(lora_request=LoRARequest("a", 1, "/adapters/a")),
        lambda: request(),
        [False] * 8,
    ),
    "other adapters": (
        lambda: request(lora_request=LoRARequest("a", 1, "/adapters/a")),
        lambda: request(lora_request=LoRARequest("b", 2, "/adapters/b")),
        [False] * 8,
    ),
    "same adapter": (
        lambda: request(lora_request=LoRARequest("a", 1, "/adapters/a")),
        lambda: request(lora_request=LoRARequest("a", 1, "/adapters/a")),
        [True] * 8,
    ),
    "other salts": (lambda: request(cache_salt="alice"), lambda: request(cache_salt="bob"), [False] * 8),
    "same salt": (lambda: request(cache_salt="alice"), lambda: request(cache_salt="alice"), [True] * 8),
    "salt vs none": (lambda: request(cache_salt="alice"), lambda: request(), [False] * 8),
    "text only": (lambda: request(), lambda: request(), [True] * 8),
    "other text after chunk 3": (
        lambda: request(),
        lambda: request(TEXT[: 3 * CHUNK + 5] + [1] + TEXT[3 * CHUNK + 6 :]),
        [True] * 3 + [False] * 5,
    ),
}


@pytest.mark.parametrize("name", list(PAIRS))
def test_our_chunk_keys_are_shared_exactly_when_vllms_block_hashes_are(name: str) -> None:
    make_a, make_b, expected = PAIRS[name]
    assert agree(make_a(), make_b()) == expected


def test_prompt_embeddings_as_vllm_hashes_them() -> None:
    g = torch.Generator().manual_seed(0)
    e = torch.randn(N, 16, generator=g)
    other = e.clone()
    other[5 * CHUNK + 3] += 1.0
    assert agree(request(prompt_embeds=e), request(prompt_embeds=e.clone())) == [True] * 8
    assert agree(request(prompt_embeds=e), request(prompt_embeds=other)) == [True] * 5 + [False] * 3
    # Two embedding prompts look alike to a token-only key: their ids are all placeholders.
    assert request_key_inputs(request(prompt_embeds=e))[0] == [0] * N


def test_a_plain_request_keeps_the_token_only_key() -> None:
    req = request()
    tokens, extras = request_key_inputs(req)
    assert extras is None and tokens == TEXT
    assert ours(req) == DB.chunk_hashes(TEXT)


def test_a_feature_without_an_identifier_is_unreadable() -> None:
    req = request(mm_features=[image("A", 70)])
    req.mm_features[0].identifier = None
    with pytest.raises(UnreadableRequest) as info:
        request_key_inputs(req)
    assert info.value.kind == "mm"

"""KV that vLLM keeps apart stays apart: images, LoRA adapters and tenants, in real engines.

vLLM's own prefix cache never shares a block between two requests whose images, adapter or
``cache_salt`` differ. Neither may the connector: each case stores under one request in a first
engine and asks with another in a new process on the same disk directory (vLLM's own prefix
cache reset before each prompt, so a hit can only come from the connector).

* **Images** (tiny float32 LLaVA): the same text with image B after image A is restored only up
  to the chunk holding the image, and its tokens are those of an engine without a connector;
  image A again is restored whole (the control).
* **Tenants** (tiny float32 Llama): a prompt stored under ``cache_salt="alice"`` gives 0 external
  tokens under ``"bob"`` and under no salt; ``"alice"`` again is restored.
* **Adapters** (the same Llama with two random LoRA adapters made offline with peft): adapter B
  after adapter A gives 0 external tokens and B's own tokens; no adapter gives 0; adapter A again
  is restored.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("LMCACHE_ASYNC_REQUIRE_VLLM") == "1":
        raise RuntimeError("LMCACHE_ASYNC_REQUIRE_VLLM=1 but vLLM is not importable in this environment")
    pytest.skip("vLLM is not installed here; `nox -s e2e` builds its environment", allow_module_level=True)

from .engines import ROOT
from .kv_engines import BLOCK, CHUNK, make_prompts, run_kv_engine
from .kv_engines import ok_runs as _ok

CONNECTOR = {"max_local_cpu_size": 0.25, "staging_size": 0.05, "chunk_size": CHUNK}
TEXT_LEN = 1500
IMAGE_A, IMAGE_B = 3, 4  # image seeds


def full_hit(prompt_len: int) -> int:
    """What the connector restores of a fully stored prompt: whole chunks, cut to whole blocks
    below the last token."""
    return min(prompt_len // CHUNK * CHUNK, (prompt_len - 1) // BLOCK * BLOCK)


def by(runs: list[dict[str, Any]], **match: Any) -> dict[str, Any]:
    """The one run whose fields equal ``match``."""
    found = [r for r in runs if all(r.get(k) == v for k, v in match.items())]
    assert len(found) == 1, (match, [(r.get("prompt"), r.get("cache_salt"), r.get("lora")) for r in runs])
    return found[0]


WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "describe", "the", "image"]


def llava_text(before: int, after: int) -> str:
    """A prompt with ``before`` words, the image, then ``after`` words."""
    head = " ".join(WORDS[i % len(WORDS)] for i in range(before))
    tail = " ".join(WORDS[(i + 3) % len(WORDS)] for i in range(after))
    return f"user: {head} <image>\n{tail}\nassistant:"


# Image A and image B with the same text, twice: the image inside the first chunk (the greedy
# answers of the two images differ there), and the image after the first chunk.
EARLY, LATE = llava_text(120, 300), llava_text(280, 400)
LLAVA_PROMPTS = [
    {"text": EARLY, "image": IMAGE_A},
    {"text": EARLY, "image": IMAGE_B},
    {"text": LATE, "image": IMAGE_A},
    {"text": LATE, "image": IMAGE_B},
]
EARLY_A, EARLY_B, LATE_A, LATE_B = range(4)


@pytest.fixture(scope="module")
def image_runs(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("kv-identity-image")
    llm = {"max_model_len": 1024, "max_num_batched_tokens": 1024, "limit_mm_per_prompt": {"image": 1}}
    base = {"model": str(model_dir), "prompts": LLAVA_PROMPTS, "max_tokens": 16, "llm": llm, "logprobs": True}
    kv = {**CONNECTOR, "local_disk": str(work / "disk"), "max_local_disk_size": 0.5}
    load = [{"prompts": [EARLY_B, LATE_B]}, {"prompts": [EARLY_A, LATE_A]}]
    return {
        "baseline": run_kv_engine(work, "baseline", {**base, "kv": None, "phases": [{"prompts": [0, 1, 2, 3]}]}),
        "store": run_kv_engine(work, "store", {**base, "kv": kv, "phases": [{"prompts": [EARLY_A, LATE_A]}]}),
        "load": run_kv_engine(work, "load", {**base, "kv": kv, "phases": load}),
    }


def test_the_same_text_with_another_image_is_not_restored_past_the_image(image_runs: dict[str, Any]) -> None:
    base = _ok(image_runs["baseline"])
    ref = {r["prompt"]: r["tokens"] for r in base}
    lp = {r["prompt"]: r["logprobs"] for r in base}
    store = _ok(image_runs["store"])
    assert [r["tokens"] for r in store] == [ref[EARLY_A], ref[LATE_A]]
    load = _ok(image_runs["load"])
    for idx in (EARLY_B, LATE_B):
        other = by(load, prompt=idx)
        offset = other["image_offset"]
        assert offset is not None
        assert other["num_cached_tokens"] == offset // CHUNK * CHUNK, idx  # the text before the image only
        assert other["tokens"] == ref[idx], idx
        # The tiny model's greedy answer hardly depends on the image, but its probabilities do:
        # the restored engine's are image B's, not image A's (which B would get from A's KV).
        a_idx = idx - 1
        assert lp[a_idx] != lp[idx], idx  # the images matter to the model's numbers
        gap = max(abs(x - y) for x, y in zip(lp[a_idx], lp[idx], strict=True))
        off = max(abs(x - y) for x, y in zip(other["logprobs"], lp[idx], strict=True))
        assert off < gap / 10, (idx, off, gap)
        print(f"[e2e] image prompt {idx}: logprob gap A vs B {gap:.2e}, restored B vs uncached B {off:.2e}")
    assert by(load, prompt=EARLY_B)["num_cached_tokens"] == 0
    assert by(load, prompt=LATE_B)["num_cached_tokens"] == CHUNK


def test_the_same_image_is_restored(image_runs: dict[str, Any]) -> None:
    ref = {r["prompt"]: r["tokens"] for r in _ok(image_runs["baseline"])}
    for idx in (EARLY_A, LATE_A):
        same = by(_ok(image_runs["load"]), prompt=idx)
        assert same["num_cached_tokens"] == full_hit(same["prompt_len"]), idx
        assert same["tokens"] == ref[idx], idx


@pytest.fixture(scope="module")
def text_runs(kv_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT / "scripts"))
    import tiny_lora  # type: ignore[import-not-found]  # found on sys.path at run time

    work = tmp_path_factory.mktemp("kv-identity-text")
    cache = Path(os.environ.get("LMCACHE_E2E_LORA_DIR") or kv_model_dir.parent)
    adapters = {
        name: [i + 1, str(tiny_lora.build(kv_model_dir, cache / f"{kv_model_dir.name}-lora-{name}", seed=i + 1))]
        for i, name in enumerate(("a", "b"))
    }
    prompts = [p[:TEXT_LEN] for p in make_prompts(2, vocab=4096, seed=23)]
    llm = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8}
    base = {"model": str(kv_model_dir), "prompts": prompts, "max_tokens": 16, "llm": llm, "lora_modules": adapters}
    kv = {**CONNECTOR, "local_disk": str(work / "disk"), "max_local_disk_size": 0.5}
    P, T = 0, 1  # noqa: N806  (the adapter prompt, the tenant prompt)
    baseline = [{"prompts": [P], "lora": "a"}, {"prompts": [P], "lora": "b"}, {"prompts": [P, T]}]
    store = [{"prompts": [P], "lora": "a"}, {"prompts": [T], "cache_salt": "alice"}]
    load = [
        {"prompts": [P], "lora": "b"},
        {"prompts": [P]},
        {"prompts": [P], "lora": "a"},
        {"prompts": [T], "cache_salt": "bob"},
        {"prompts": [T]},
        {"prompts": [T], "cache_salt": "alice"},
    ]
    return {
        "baseline": run_kv_engine(work, "baseline", {**base, "kv": None, "phases": baseline}),
        "store": run_kv_engine(work, "store", {**base, "kv": kv, "phases": store}),
        "load": run_kv_engine(work, "load", {**base, "kv": kv, "phases": load}),
    }


def test_another_tenants_salt_or_none_is_never_restored_and_the_same_salt_is(text_runs: dict[str, Any]) -> None:
    base = _ok(text_runs["baseline"])
    ref = by(base, prompt=1)["tokens"]
    load = _ok(text_runs["load"])
    for salt in ("bob", None):
        r = by(load, prompt=1, cache_salt=salt)
        assert r["num_cached_tokens"] == 0, salt
        assert r["tokens"] == ref
    same = by(load, prompt=1, cache_salt="alice")
    assert same["num_cached_tokens"] == full_hit(TEXT_LEN)
    assert same["tokens"] == ref


def test_another_adapter_or_none_is_never_restored_and_the_same_adapter_is(text_runs: dict[str, Any]) -> None:
    base = _ok(text_runs["baseline"])
    ref = {lora: by(base, prompt=0, lora=lora)["tokens"] for lora in ("a", "b", None)}
    assert ref["a"] != ref["b"] and ref["a"] != ref[None]  # the adapters change the model
    assert by(_ok(text_runs["store"]), prompt=0, lora="a")["tokens"] == ref["a"]
    load = _ok(text_runs["load"])
    for lora in ("b", None):
        r = by(load, prompt=0, lora=lora)
        assert r["num_cached_tokens"] == 0, lora
        assert r["tokens"] == ref[lora]
    same = by(load, prompt=0, lora="a")
    assert same["num_cached_tokens"] == full_hit(TEXT_LEN)
    assert same["tokens"] == ref["a"]
    stats = text_runs["load"]["connector"]
    assert stats["errors"] == 0

"""What deriving a request's chunk keys costs, beside the lookup it runs in.

The KV connector's scheduler keys each request once, from the request (token ids and key extras:
images, LoRA adapter, ``cache_salt``, prompt embeddings), inside ``get_num_new_matched_tokens``.
For a 3,000-token prompt (chunk 256) this suite times, each a median over ``reps``:

* **keys, plain**: reading the request and hashing its whole chunks without extras;
* **keys, extras**: the same with two images, an adapter and a salt;
* **keys, embeddings**: the same for a prompt given as embeddings (``[3000, 1024]`` float32);
* beside each, **the lookup** the derivation runs in (the scheduler side's whole
  ``num_new_matched_tokens`` of a new request over a CPU tier that holds the prompt: keys,
  presence query, hit), so the share of the derivation in a lookup is read off directly.

Requests are plain objects with the attributes the connector reads from vLLM's ``Request``; vLLM
is not needed.
"""

from __future__ import annotations

import itertools
import sys
from types import SimpleNamespace
from typing import Any

import torch

from lmcache_async import KeyExtras, LMCacheEngineConfig
from lmcache_async.integration.vllm.kv.request_keys import request_key_inputs
from lmcache_async.integration.vllm.kv.scheduler import KVSchedulerSide
from lmcache_async.integration.vllm.kv.store import KVStore
from lmcache_async.metadata import LMCacheEngineMetadata
from lmcache_async_bench.common import BenchOptions, Result, median_time

__all__ = ["BLOCK", "CHUNK", "SUITE", "TOKENS", "main", "run"]

SUITE = "kv_keys"
TOKENS = 3000
CHUNK = 256
BLOCK = 128


def _request(req_id: str, tokens: list[int], **extras: Any) -> SimpleNamespace:
    fields: dict[str, Any] = dict(mm_features=[], lora_request=None, cache_salt=None, prompt_embeds=None)
    fields.update(extras)
    return SimpleNamespace(request_id=req_id, prompt_token_ids=tokens, num_prompt_tokens=len(tokens), **fields)


def _cases(tokens: list[int]) -> dict[str, dict[str, Any]]:
    def image(ident: str, off: int) -> SimpleNamespace:
        return SimpleNamespace(identifier=ident, mm_position=SimpleNamespace(offset=off, length=576))

    return {
        "plain": {},
        "extras": {
            "mm_features": [image("img-a", 300), image("img-b", 1500)],
            "lora_request": SimpleNamespace(lora_name="adapter", lora_path="/adapters/a"),
            "cache_salt": "tenant-1",
        },
        "embeddings": {"prompt_embeds": torch.randn(len(tokens), 1024)},
    }


def _store(tokens: list[int], extras: KeyExtras | None) -> tuple[KVStore, KVSchedulerSide]:
    config = LMCacheEngineConfig.from_defaults(chunk_size=CHUNK, max_local_cpu_size=0.2)
    store = KVStore(config, LMCacheEngineMetadata("bench/kv-keys", kv_dtype=torch.float32))
    sm = store.storage_manager
    keys = store.token_database.keys(tokens, extras=extras)
    for k in keys:
        sm.put_sync(k, torch.zeros(2, 2, CHUNK, 8))
    sched = KVSchedulerSide(lambda: sm, store.token_database, BLOCK, CHUNK // BLOCK)
    return store, sched


def run(opts: BenchOptions) -> list[Result]:
    reps = max(opts.reps, 5) * (1 if opts.quick else 20)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(4, 30000, (TOKENS,), generator=g).tolist()
    db_cs = CHUNK
    results: list[Result] = []
    ids = itertools.count()
    for name, extras in _cases(tokens).items():
        template = _request("t", tokens, **extras)
        _, key_extras = request_key_inputs(template)
        store, sched = _store(tokens, key_extras)
        try:
            db = store.token_database
            assert db.chunk_size == db_cs

            def derive(extras: dict[str, Any] = extras, db: Any = db) -> None:
                t, e = request_key_inputs(_request("k", tokens, **extras))
                db.chunk_hashes(t, e)

            def lookup(extras: dict[str, Any] = extras, sched: KVSchedulerSide = sched) -> None:
                req = _request(f"r{next(ids)}", tokens, **extras)
                n, _ = sched.num_new_matched_tokens(req, 0)
                assert n is not None and n > 0
                sched.finished(req.request_id)

            derive_s = median_time(derive, reps=reps, warmup=3)
            lookup_s = median_time(lookup, reps=reps, warmup=3)
        finally:
            store.close()
        results.append(
            Result(
                SUITE,
                f"keys, {name} ({TOKENS} tokens)",
                derive_s * 1e6,
                "us",
                baseline_name="the lookup it runs in",
                baseline=lookup_s * 1e6,
                params={"case": name, "tokens": TOKENS, "chunk": CHUNK},
            )
        )
        opts.say(f"{SUITE}: {name}: keys {derive_s * 1e6:.0f} us, lookup {lookup_s * 1e6:.0f} us")
    return results


def main(argv: list[str] | None = None) -> int:
    from lmcache_async_bench.common import format_table

    quick = "--quick" in (argv if argv is not None else sys.argv[1:])
    print(format_table(run(BenchOptions(reps=5, quick=quick))))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Decode recorded KV event payloads with vLLM's own ``KVEventBatch`` decoder.

Run by a python that has vLLM (``python vllm_decode.py PAYLOADS``), never imported beside the
project. ``PAYLOADS``: each payload as a u32 big-endian length then its bytes. Prints one JSON
object: how many batches and events of each type decoded; exits 1 on the first that does not.
"""

from __future__ import annotations

import collections
import json
import struct
import sys

import msgspec
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch


def main(path: str) -> dict:
    dec = msgspec.msgpack.Decoder(type=KVEventBatch)
    kinds: collections.Counter[str] = collections.Counter()
    batches = 0
    with open(path, "rb") as f:
        data = f.read()
    pos = 0
    while pos < len(data):
        (n,) = struct.unpack_from(">I", data, pos)
        batch = dec.decode(data[pos + 4 : pos + 4 + n])
        pos += 4 + n
        batches += 1
        for ev in batch.events:
            assert isinstance(ev, BlockStored | BlockRemoved | AllBlocksCleared), type(ev)
            kinds[type(ev).__name__] += 1
            if isinstance(ev, BlockStored):
                assert len(ev.token_ids) == ev.block_size * len(ev.block_hashes)
                assert ev.medium in ("CPU", "STORAGE") and (ev.ownership or "").startswith("lmcache_async:")
    return {"batches": batches, "events": dict(kinds)}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))

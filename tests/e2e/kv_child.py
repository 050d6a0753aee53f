"""One real vLLM engine run for the KV-connector tests: ``python kv_child.py SPEC.json RESULT.json``.

SPEC keys: ``model`` (directory), ``kv`` (``None`` or the ``kv_connector_extra_config`` dict),
``connector`` (class name, default ``LMCacheKVConnector``; ``module``: where vLLM finds it), ``speculative`` (vLLM's
``speculative_config`` dict or None; ``hs_group`` phases read its hidden-state group),
``executor`` (vLLM's ``distributed_executor_backend``; ``"mp"`` puts the worker in a process of
its own, so the scheduler's connector sees only the shared tiers),
``prompts`` (token-id lists, or ``{"text": ..., "image": seed}`` for a multimodal model: the
text holds the image token where the picture goes), ``phases`` (each ``{"prompts": [indices],
"barrier": name or None, "hs": None | "save" | "load", "cache_salt": salt or None, "lora": adapter
name or None}``), ``lora_modules`` (``{name: [int id, path]}``), ``llm`` (more ``LLM`` keyword
arguments, e.g. ``enable_lora``), ``logprobs`` (record each greedy token's log-probability),
``max_tokens``, ``hs_layers``, ``workdir``, ``kv_events`` (vLLM's ``KVEventsConfig`` keyword
arguments: the engine publishes KV events, its own and the connector's). A phase's ``params`` become the requests'
``kv_transfer_params``; ``keep_prefix`` keeps vLLM's own prefix cache (a repeated prompt
hits it: the baseline of a connector hit). RESULT's ``kv_config`` is vLLM's KV-cache layout.
Each prompt is generated alone (so its prefill is one forward the hooks see whole) after vLLM's
own prefix cache is reset (so a hit can only come from the connector). Before a phase with a
barrier the child writes ``<barrier>.ready`` and waits for ``<barrier>.go`` (the parent injects
a fault meanwhile).

RESULT per generated prompt: greedy token ids, ``num_cached_tokens``, the prompt's length and
(multimodal prompts) the position of its first image placeholder, the growth of
``vllm:prompt_tokens_by_source`` per source, the time to the first token, hidden-state
results; plus the worker's connector counters, disk record paths per prompt and any error.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def by_source(llm: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        if m.name == "vllm:prompt_tokens_by_source":
            src = m.labels.get("source", "?")
            out[src] = out.get(src, 0.0) + float(getattr(m, "value", 0) or 0)
    return out


def make_prompt(p: Any, cache_salt: str | None) -> dict[str, Any]:
    """vLLM's prompt dict: token ids, or text with one image (``{"text", "image": seed}``)."""
    from e2e_child import image  # type: ignore[import-not-found]  # found on sys.path at run time

    out: dict[str, Any]
    if isinstance(p, dict):
        out = {"prompt": p["text"], "multi_modal_data": {"image": image(int(p["image"]))}}
    else:
        out = {"prompt_token_ids": p}
    if cache_salt is not None:
        out["cache_salt"] = cache_salt
    return out


def sampled_logprobs(out: Any) -> list[float] | None:
    """The log-probability of each greedy token (None unless the spec asked for ``logprobs``)."""
    c = out.outputs[0] if out.outputs else None
    if c is None or not c.logprobs:
        return None
    return [float(c.logprobs[i][t].logprob) for i, t in enumerate(c.token_ids)]


def image_offset(llm: Any, token_ids: Any) -> int | None:
    """Where the first image placeholder sits in the prompt (None: no image, or no image model)."""
    hf = getattr(getattr(getattr(llm, "llm_engine", None), "model_config", None), "hf_config", None)
    image_id = getattr(hf, "image_token_index", None)
    if image_id is None or not token_ids:
        return None
    ids = list(token_ids)
    return ids.index(image_id) if image_id in ids else None


def scheduler_stats(llm: Any) -> dict[str, Any] | None:
    """The scheduler-side connector's stats (an engine core in this process), else None."""
    try:
        conn = llm.llm_engine.engine_core.engine_core.scheduler.connector
        stats: dict[str, Any] = conn.stats()
    except Exception:
        return None
    stats.pop("manager", None)
    return stats


def kv_cache_summary(llm: Any) -> dict[str, Any] | None:
    """vLLM's KV-cache layout (an engine core in this process): the groups (spec class, layer
    count, sliding window), the blocks, the token capacity and concurrency vLLM logs at start-up
    ("KV cache size: N tokens, Maximum concurrency ..."), and whether the hybrid manager is on."""
    try:
        core = llm.llm_engine.engine_core.engine_core
        cfg = core.scheduler.kv_cache_config
        vcfg = core.vllm_config
    except Exception:
        return None
    groups = [
        {
            "spec": type(g.kv_cache_spec).__name__,
            "layers": len(g.layer_names),
            "sliding_window": getattr(g.kv_cache_spec, "sliding_window", None),
            "page_bytes": int(g.kv_cache_spec.page_size_bytes),
        }
        for g in cfg.kv_cache_groups
    ]
    return {
        "groups": groups,
        "num_blocks": int(cfg.num_blocks),
        "tensor_bytes": max((int(t.size) for t in cfg.kv_cache_tensors), default=0),  # groups alias one buffer
        "capacity_tokens": getattr(vcfg.cache_config, "kv_cache_size_tokens", None),
        "max_concurrency": getattr(vcfg.cache_config, "kv_cache_max_concurrency", None),
        "hybrid_manager": not vcfg.scheduler_config.disable_hybrid_kv_cache_manager,
    }


def _debug_log() -> None:
    """The connector's decisions and warnings, timestamped, in the child's log."""
    import logging

    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s.%(msecs)03d %(threadName)s %(message)s", "%H:%M:%S"))
    kv_log = logging.getLogger("lmcache_async")
    kv_log.addHandler(handler)
    kv_log.setLevel(logging.DEBUG)


def _llm_kwargs(spec: dict[str, Any]) -> dict[str, Any]:
    """vLLM's ``LLM`` arguments for ``spec``: the tiny model in float32, the connector when
    ``spec["kv"]`` is given, KV events and speculative decoding when asked."""
    kwargs: dict[str, Any] = dict(
        model=spec["model"],
        dtype="float32",
        max_model_len=4096,
        max_num_batched_tokens=4096,
        max_num_seqs=4,
        enforce_eager=True,
        disable_log_stats=False,
        seed=0,
    )
    if spec.get("executor"):
        kwargs["distributed_executor_backend"] = spec["executor"]
    if spec.get("speculative"):
        kwargs["speculative_config"] = spec["speculative"]
    kwargs.update(spec.get("llm") or {})
    if spec.get("kv_events"):
        from vllm.config import KVEventsConfig

        kwargs["kv_events_config"] = KVEventsConfig(**spec["kv_events"])
    kv = spec.get("kv")
    if kv is not None:
        from vllm.config import KVTransferConfig

        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector=spec.get("connector") or "LMCacheKVConnector",
            kv_connector_module_path=spec.get("module") or "lmcache_async.integration.vllm",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=kv,
        )
    return kwargs


def _wait_barrier(workdir: Path, barrier: str) -> None:
    """Say ``barrier`` is reached and wait (at most 120 s) for the test's go-ahead."""
    (workdir / f"{barrier}.ready").write_text("ready")
    go = workdir / f"{barrier}.go"
    deadline = time.monotonic() + 120
    while not go.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def _ttft(out: Any) -> float | None:
    metrics = getattr(out, "metrics", None)
    latency = getattr(metrics, "first_token_latency", None) if metrics is not None else None
    return latency if isinstance(latency, float) and latency > 0 else None


def _hidden_states(
    llm: Any, kv_rpc: Any, spec: dict[str, Any], phase: dict[str, Any], idx: int, run: dict[str, Any]
) -> None:
    """The hidden-state rows the phase asks for (``hs_group``; ``hs``: save or load), into ``run``."""
    workdir, prompt = Path(spec["workdir"]), spec["prompts"][idx]
    if phase.get("hs_group"):
        path = str(workdir / f"hsg-{idx}-{spec['name']}.safetensors")
        run["hs_group"] = llm.collective_rpc(kv_rpc.hs_group_rows, args=(path,))[0]
        run["hs_group_path"] = path
    hs_mode = phase.get("hs")
    if hs_mode == "save":
        path = str(workdir / f"hs-{idx}.safetensors")
        run["hs"] = llm.collective_rpc(kv_rpc.save_hs, args=(prompt, path))[0]
        run["hs_path"] = path
    elif hs_mode == "load":
        path = str(workdir / f"hs-{idx}-{spec['name']}.safetensors")
        run["hs"] = llm.collective_rpc(kv_rpc.load_hs, args=(prompt, run["num_cached_tokens"], path))[0]
        run["hs_path"] = path


def _generate(
    llm: Any, kv_rpc: Any, spec: dict[str, Any], phase: dict[str, Any], idx: int, params: Any, loras: dict[str, Any]
) -> dict[str, Any]:
    """One prompt of a phase, after vLLM's own prefix cache is reset (unless ``keep_prefix``):
    its tokens, cached tokens, timings and the connector's counters by source."""
    if not phase.get("keep_prefix"):  # else a repeated prompt hits vLLM's own prefix cache
        llm.reset_prefix_cache()
    if spec.get("hs_layers"):
        llm.collective_rpc(kv_rpc.reset_hs)
    before = by_source(llm)
    g0 = time.monotonic()
    if spec.get("debug_log"):
        print(f"{time.strftime('%H:%M:%S')}.{int(time.time() * 1000) % 1000:03d} generate {idx}", flush=True)
    lora = loras[phase["lora"]] if phase.get("lora") else None
    phase_params = params
    if phase.get("params"):
        phase_params = params.clone()
        phase_params.extra_args = {"kv_transfer_params": dict(phase["params"])}
    prompt = make_prompt(spec["prompts"][idx], phase.get("cache_salt"))
    out = llm.generate([prompt], phase_params, use_tqdm=False, lora_request=lora)[0]
    gen_s = time.monotonic() - g0
    after = by_source(llm)
    run: dict[str, Any] = {
        "prompt": idx,
        "phase": phase.get("barrier"),
        "tokens": list(out.outputs[0].token_ids) if out.outputs else [],
        "finished": bool(out.finished),
        "num_cached_tokens": int(out.num_cached_tokens or 0),
        "prompt_len": len(out.prompt_token_ids or ()),
        "image_offset": image_offset(llm, out.prompt_token_ids),
        "cache_salt": phase.get("cache_salt"),
        "lora": phase.get("lora"),
        "logprobs": sampled_logprobs(out),
        "by_source": {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after},
        "generate_s": gen_s,
        "ttft_s": _ttft(out),
    }
    _hidden_states(llm, kv_rpc, spec, phase, idx, run)
    return run


def _run_engine(spec: dict[str, Any], result: dict[str, Any], t0: float) -> None:
    """Start the engine of ``spec`` and run its phases, filling ``result``."""
    import kv_rpc  # type: ignore[import-not-found]  # found on sys.path at run time
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    kv = spec.get("kv")
    llm = LLM(**_llm_kwargs(spec))
    result["start_s"] = time.monotonic() - t0
    result["kv_config"] = kv_cache_summary(llm)
    hs_layers = spec.get("hs_layers") or []
    if hs_layers:
        llm.collective_rpc(kv_rpc.install_hs_hooks, args=(hs_layers,))
    prompts = spec["prompts"]
    loras = {name: LoRARequest(name, int(i), path) for name, (i, path) in (spec.get("lora_modules") or {}).items()}
    logprobs = 1 if spec.get("logprobs") else None
    params = SamplingParams(max_tokens=spec.get("max_tokens", 16), temperature=0.0, logprobs=logprobs)
    disk = (kv or {}).get("local_disk")
    if kv is not None and disk and all(isinstance(p, list) for p in prompts):
        result["files"] = [llm.collective_rpc(kv_rpc.chunk_files, args=(p, disk))[0] for p in prompts]
    for phase in spec["phases"]:
        if phase.get("barrier"):
            _wait_barrier(Path(spec["workdir"]), phase["barrier"])
        for idx in phase["prompts"]:
            result["runs"].append(_generate(llm, kv_rpc, spec, phase, idx, params, loras))
        if kv is not None:
            llm.collective_rpc(kv_rpc.flush)
    result["connector"] = llm.collective_rpc(kv_rpc.connector_stats)[0] if kv is not None else None
    result["scheduler"] = scheduler_stats(llm) if kv is not None else None
    result["alive"] = True


def main(spec_path: str, result_path: str) -> int:
    """Run the engine the spec file describes; write what happened to ``result_path`` (JSON)."""
    spec = json.loads(Path(spec_path).read_text())
    if spec.get("debug_log"):
        _debug_log()
    result: dict[str, Any] = {"runs": [], "error": None, "alive": False}
    t0 = time.monotonic()
    try:
        _run_engine(spec, result, t0)
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()
    result["total_s"] = time.monotonic() - t0
    Path(result_path).write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)  # the engine's shutdown is not under test; skip it


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))

"""Functions run inside vLLM's worker through ``LLM.collective_rpc`` for the KV-connector tests.

The hidden-state path is the forward-hook one: hooks on the decoder layers keep the output
rows of the largest forward since the last reset (the prefill of a prompt generated alone),
and the test stores / restores them through the worker's connector.
"""

from __future__ import annotations

from typing import Any

import torch


def _worker(obj: Any) -> Any:
    return getattr(obj, "worker", None) or obj


def _layers(obj: Any) -> Any:
    model = _worker(obj).model_runner.get_model()
    return model.model.layers


def _connector() -> Any:
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    return get_kv_transfer_group() if has_kv_transfer_group() else None


def install_hs_hooks(obj: Any, layer_idxs: list[int]) -> bool:
    """Keep, per hooked layer, the output rows of the largest forward since the last reset."""
    layers = _layers(obj)
    store: dict[int, torch.Tensor] = getattr(layers, "_kv_e2e_hs", None) or {}
    store.clear()
    if getattr(layers, "_kv_e2e_hs", None) is None:
        for i in layer_idxs:

            def hook(module: Any, args: Any, output: Any, i: int = i) -> None:
                rows = output[0] if isinstance(output, tuple) else output
                prev = store.get(i)
                if prev is None or rows.shape[0] > prev.shape[0]:
                    store[i] = rows.detach().to("cpu", torch.float32).clone()

            layers[i].register_forward_hook(hook)
        layers._kv_e2e_hs = store
    return True


def reset_hs(obj: Any) -> bool:
    _layers(obj)._kv_e2e_hs.clear()
    return True


def save_hs(obj: Any, prompt: list[int], path: str) -> dict[str, int]:
    """Store the captured prefill rows of ``prompt`` through the connector; also write them to
    ``path`` (safetensors) for the comparison. Returns chunks published per layer."""
    from safetensors.torch import save_file

    captured = _layers(obj)._kv_e2e_hs
    conn = _connector()
    out = {}
    tensors = {}
    for i, rows in captured.items():
        if rows.shape[0] != len(prompt):
            out[str(i)] = -rows.shape[0]
            continue
        out[str(i)] = conn.save_hidden_states(prompt, rows, layer_idx=i)
        tensors[f"layer{i}"] = rows.contiguous()
    conn.flush()
    save_file(tensors, path)
    return out


def load_hs(obj: Any, prompt: list[int], max_tokens: int, path: str) -> dict[str, Any]:
    """Restore hidden states of ``prompt`` (capped at ``max_tokens``) per captured layer; write
    them to ``path`` and return their row counts and how many rows this run's forward computed."""
    from safetensors.torch import save_file

    captured = _layers(obj)._kv_e2e_hs
    conn = _connector()
    rows: dict[str, int] = {}
    tensors = {}
    for i in sorted(captured):
        got = conn.load_hidden_states(prompt, layer_idx=i, max_tokens=max_tokens)
        rows[str(i)] = 0 if got is None else int(got.shape[0])
        if got is not None:
            tensors[f"layer{i}"] = got.contiguous()
    save_file(tensors, path)
    return {"rows": rows, "computed": {str(i): int(t.shape[0]) for i, t in captured.items()}}


def connector_stats(obj: Any) -> dict[str, Any] | None:
    conn = _connector()
    if conn is None:
        return None
    stats: dict[str, Any] = conn.stats()
    manager = stats.pop("manager", None) or {}
    stats["staging"] = manager.get("staging")
    return stats


def flush(obj: Any) -> bool:
    conn = _connector()
    if conn is not None:
        conn.flush()
    return True


def chunk_files(obj: Any, prompt: list[int], root: str) -> list[str]:
    """Paths of the disk-tier records of ``prompt``'s KV chunks on this worker, in chunk order."""
    from lmcache_async.disk.layout import entry_path, key_digest

    conn = _connector()
    return [entry_path(root, key_digest(k.to_string())) for k in conn.store.token_database.keys(prompt)]


def hs_group_rows(obj: Any, path: str) -> dict[str, Any]:
    """The rows of vLLM's hidden-state KV-cache group (``extract_hidden_states``) for the
    latest hidden-state run of the worker's connector (the saved prompt in a store run, the
    restored prefix in a load run), read from the engine's own cache; written to ``path``."""
    from safetensors.torch import save_file

    side = _connector().worker_side
    if side.hs_group is None or not side.recent_hs_runs:
        return {"kind": None, "start": 0, "end": 0}
    kind, run = side.recent_hs_runs[-1]
    rows = side.hs_group.gather(run.block_ids, 0, run.end).to(torch.float32).contiguous()
    save_file({"rows": rows}, path)
    return {"kind": kind, "start": run.start, "end": run.end, "shape": list(rows.shape)}

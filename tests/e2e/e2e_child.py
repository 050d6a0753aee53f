"""One real vLLM engine run, in its own process: ``python e2e_child.py SPEC.json RESULT.json``.

SPEC keys: ``model`` (directory), ``ec`` (``None`` or ``{"role", "extra", "module"}``),
``prompts`` (``[[image_seed, text], ...]``), ``passes`` (how often the prompts are generated),
``max_tokens``, ``executor`` (``None`` or ``"mp"``), ``wait_for`` (a file that must exist
before generating: the parent injects a fault after start-up, then creates it),
``flush_each`` (generate prompt by prompt and record the disk files each one added).

RESULT: per pass the greedy token ids per prompt, the vision tower's calls and images, the
worker-side connector counters, whether every request finished, timings and errors.
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


def image(seed: int) -> Any:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, size=(56, 56, 3), dtype=np.uint8))


def data_url(seed: int) -> str:
    import base64
    import io

    buf = io.BytesIO()
    image(seed).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def chat_messages(seed: int, text: str) -> list[dict[str, Any]]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": data_url(seed)}},
                {"type": "text", "text": text},
            ],
        }
    ]


def disk_files(root: str | None) -> set[str]:
    if not root or not os.path.isdir(root):
        return set()
    out: set[str] = set()
    for shard in os.listdir(root):
        d = os.path.join(root, shard)
        if len(shard) == 2 and os.path.isdir(d):
            out.update(os.path.join(d, f) for f in os.listdir(d) if f.endswith(".lmc"))
    return out


def _llm_kwargs(spec: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """vLLM's ``LLM`` arguments for ``spec`` (the tiny LLaVA in bfloat16, the encoder-cache
    connector when ``spec["ec"]`` is given) and the connector's disk directory, if any."""
    kwargs: dict[str, Any] = dict(
        model=spec["model"],
        dtype="bfloat16",
        max_model_len=256,
        max_num_seqs=8,
        enforce_eager=True,
        disable_log_stats=False,
        limit_mm_per_prompt={"image": 1},
        seed=0,
    )
    if spec.get("executor"):
        kwargs["distributed_executor_backend"] = spec["executor"]
    ec = spec.get("ec")
    if not ec:
        return kwargs, None
    from vllm.config import ECTransferConfig

    kwargs["ec_transfer_config"] = ECTransferConfig(
        ec_connector=ec.get("name", "LMCacheECConnector"),
        ec_connector_module_path=ec.get("module", "lmcache_async.integration.vllm"),
        ec_role=ec["role"],
        ec_connector_extra_config=ec.get("extra", {}),
    )
    return kwargs, ec.get("extra", {}).get("local_disk")


def _one_pass(
    llm: Any, e2e_rpc: Any, spec: dict[str, Any], prompts: list[Any], params: Any, disk_root: str | None
) -> dict[str, Any]:
    """Every prompt once (flushing the connector after each with ``flush_each``), then the chat
    prompts: tokens, vision-encoder calls, the connector's counters and the files each wrote."""
    llm.collective_rpc(e2e_rpc.install_vision_counter)  # resets the counter
    g0 = time.monotonic()
    files: list[list[str]] = []
    if spec.get("flush_each"):
        outs = []
        for p in prompts:
            before = disk_files(disk_root)
            outs.extend(llm.generate([p], params, use_tqdm=False))
            llm.collective_rpc(e2e_rpc.flush_connector)
            files.append(sorted(disk_files(disk_root) - before))
    else:
        outs = llm.generate(prompts, params, use_tqdm=False)
    chat_tokens = []
    for seed, text in spec.get("chat", []):
        out = llm.chat(chat_messages(seed, text), params, use_tqdm=False)
        chat_tokens.append(list(out[0].outputs[0].token_ids) if out[0].outputs else [])
    if spec.get("chat"):
        llm.collective_rpc(e2e_rpc.flush_connector)
    return {
        "chat_tokens": chat_tokens,
        "tokens": [list(o.outputs[0].token_ids) if o.outputs else [] for o in outs],
        "finished": [bool(o.finished) for o in outs],
        "finish_reasons": [o.outputs[0].finish_reason if o.outputs else None for o in outs],
        "generate_s": time.monotonic() - g0,
        "vision": llm.collective_rpc(e2e_rpc.read_vision_counter)[0],
        "connector": llm.collective_rpc(e2e_rpc.connector_stats)[0],
        "files": files,
    }


def _run_engine(spec: dict[str, Any], result: dict[str, Any], t0: float) -> None:
    """Start the engine of ``spec``, wait for its go-ahead file if it has one, run its passes."""
    import e2e_rpc  # type: ignore[import-not-found]  # found on sys.path at run time
    from vllm import LLM, SamplingParams

    kwargs, disk_root = _llm_kwargs(spec)
    llm = LLM(**kwargs)
    result["start_s"] = time.monotonic() - t0
    llm.collective_rpc(e2e_rpc.install_vision_counter)
    wait_for = spec.get("wait_for")
    if wait_for:
        Path(spec["ready"]).write_text("ready")
        deadline = time.monotonic() + 120
        while not os.path.exists(wait_for) and time.monotonic() < deadline:
            time.sleep(0.05)
    params = SamplingParams(max_tokens=spec.get("max_tokens", 8), temperature=0.0)
    prompts = [
        {"prompt": f"user: <image>\n{text}\nassistant:", "multi_modal_data": {"image": image(seed)}}
        for seed, text in spec["prompts"]
    ]
    for _ in range(spec.get("passes", 1)):
        result["passes"].append(_one_pass(llm, e2e_rpc, spec, prompts, params, disk_root))
    result["alive"] = True


def main(spec_path: str, result_path: str) -> int:
    """Run the engine the spec file describes; write what happened to ``result_path`` (JSON)."""
    spec = json.loads(Path(spec_path).read_text())
    result: dict[str, Any] = {"passes": [], "error": None}
    t0 = time.monotonic()
    try:
        _run_engine(spec, result, t0)
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()
    result["total_s"] = time.monotonic() - t0
    Path(result_path).write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)  # the engine's shutdown is not under test; skip its ~5 s


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))

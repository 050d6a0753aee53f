"""KV-connector benchmark in real vLLM CPU engines: our connector beside vLLM's own paths.

Every engine runs in its own child process (:mod:`lmcache_async_bench.vllm_kv_child`); this
module starts them in order, one at a time, and prints the figures. Each figure is a median over
``--runs`` (>= 5) distinct prompts of ``--tokens`` pseudo-random ids, all greedy, one output token
(so the wall time of ``generate`` is the TTFT). Processes, in order:

1. **reference** (no connector): each prompt uncached, then at once again — a hit of vLLM's own
   prefix cache in the same process (the floor: no prefill for the hit tokens);
2. **ExampleConnector store** (run 1) and **load** (run 2, a new process) over a shared
   directory: vLLM's ``ExampleConnector``, one synchronous safetensors file per layer;
3. **LMCacheKVConnector store** and **load** (when
   ``lmcache_async.integration.vllm.kv.connector`` exists), loaded by its documented
   ``--kv-transfer-config`` (``kv_connector`` ``LMCacheKVConnector``, module path
   ``lmcache_async.integration.vllm``, role ``kv_both``, failure policy ``recompute``) with a
   disk tier in a shared directory, so run 2 reads what run 1 wrote.

Save time is what the worker spends inside the connector's ``save_kv_layer`` + ``wait_for_save``
for one prompt. Load time is what the request waits for its load: for an asynchronous load (ours,
from a lower tier) the wall time from the first load call (``start_load_kv``) to the end of the
``get_finished`` that reports the load finished, idle steps and vLLM's own work between them
included, plus the load calls after it; for a synchronous one (``ExampleConnector``) the seconds
inside ``start_load_kv`` + ``wait_for_layer_load`` + ``get_finished`` (the methods are wrapped on
the live worker connector; vLLM calls them by attribute). Our store process flushes after each
prompt, outside the save time (its disk writes are asynchronous; the flush is shown for
information). Right after each measured prompt the same process times the **bare gather/scatter**
baseline: the blocks that prompt saved (its whole chunks) or loaded (for ExampleConnector, whose
metadata the bench does not read, as many random blocks), in every layer's paged cache
(``[num_blocks, kv_heads, block_size, 2*head_size]`` on CPU), gathered into pre-touched staging
tensors and scattered back, both with torch (``index_select(out=)``, ``index_copy_``) and with one
``memmove`` per block; the faster median of the two is the baseline. Saves are compared with the
store process's gathers, loads with the load process's scatters. Another process
(**bare_at_save**) runs our store again and pairs each save, in its own ``wait_for_save``, with a
bare gather of the step's blocks into fresh pre-touched memory, alternating step by step which of
the two goes first: the copy a save must make, at the moment it must make it (right after the
forward), without anything else of a connector, beside our save of the same step. The load
process also times a **bare file read** of the blocks it loaded: one page-cache file per chunk
``preadv``'d straight into the blocks and hashed with xxh3 (the read a disk-tier load must make).
Another process (**ours_reload**, CPU tier only) stores each prompt, resets vLLM's own prefix
cache and runs the prompt again: a hit of our CPU tier in the same process, loaded
synchronously, beside the bare scatter of the same blocks. Last, an ``lmcache-async serve``
process (a pre-touched 1 GiB pool) serves **ours_server_store** and **ours_server_load**
(``tier_order: [cpu, server]``): run 1 writes its records through to the node's shared pool,
run 2, a new process, loads them from there synchronously (memory copies out of the pool).

Run it with the Python of the vLLM environment (``bash scripts/e2e_env.sh`` prints it)::

    $(bash scripts/e2e_env.sh | tail -1) -m lmcache_async_bench.vllm_kv [--runs 5]
        [--tokens 3000] [--model DIR] [--json PATH] [--skip-ours] [--workdir DIR]

Without ``--model`` the tiny float32 Llama of ``scripts/tiny_llama.py`` is built (once) under
``~/.cache/lmcache-async/``. The engine environment (``VLLM_CPU_KVCACHE_SPACE=1``,
``VLLM_CPU_NUM_OF_RESERVED_CPU=1``, offline, ``VLLM_TARGET_DEVICE=cpu``, in-process engine core)
is set for every child. On a shared, loaded host the TTFTs swing; compare ratios within a run.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .common import BenchOptions, Result
from .vllm_kv_figures import (
    BARE_FRACTION,
    HIT_BOUND,
    LOAD_SPEEDUP,
    SAVE_SPEEDUP,
    UNCACHED_BOUND,
    figures,
    must_show,
    report,
    tokens_equal,
)

__all__ = [
    "BARE_FRACTION",
    "DEFAULT_MODEL_DIR",
    "ENGINE_ENV",
    "HIT_BOUND",
    "LOAD_SPEEDUP",
    "OURS_KV_TRANSFER_CONFIG",
    "PYTHON_ENV",
    "SAVE_SPEEDUP",
    "SERVER_POOL_GIB",
    "SUITE",
    "UNCACHED_BOUND",
    "Plan",
    "ensure_model",
    "figures",
    "main",
    "measure",
    "must_show",
    "ours_available",
    "run",
    "run_child",
]

SUITE = "vllm_kv"
HERE = Path(__file__).resolve().parent
CHILD = HERE / "vllm_kv_child.py"
REPO = HERE.parents[1]  # a source checkout: bench/lmcache_async_bench/ -> the repository
TINY_LLAMA = REPO / "scripts" / "tiny_llama.py"
DEFAULT_MODEL_DIR = Path.home() / ".cache" / "lmcache-async" / "tiny-llama-8x1024-fp32"

ENGINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_TARGET_DEVICE": "cpu",
    "TOKENIZERS_PARALLELISM": "false",
}
"""Set in every engine child (see MACHINE_NOTES: the CPU worker's memory and thread count)."""

OURS_KV_TRANSFER_CONFIG: dict[str, Any] = {
    "kv_connector": "LMCacheKVConnector",
    "kv_connector_module_path": "lmcache_async.integration.vllm",
    "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute",
}
"""The documented ``--kv-transfer-config`` of our connector (the bench adds the extra config)."""


@dataclass
class Plan:
    """What one bench run does; built from the command line (or :class:`BenchOptions`)."""

    python: str
    model: Path
    tokens: int = 3000
    runs: int = 5
    seed: int = 0
    chunk_size: int = 128
    workdir: Path | None = None
    ours: bool = True
    child_timeout_s: float = 420.0
    progress: Callable[[str], None] | None = None
    """Where progress lines go (default: stderr)."""

    def __post_init__(self) -> None:
        if self.tokens < 256:
            raise ValueError(f"tokens must be at least 256, got {self.tokens}")
        if self.runs < 1:
            raise ValueError(f"runs must be positive, got {self.runs}")
        if self.chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, got {self.chunk_size}")

    def say(self, msg: str) -> None:
        if self.progress is not None:
            self.progress(f"vllm_kv: {msg}")
        else:
            print(f"[vllm_kv] {msg}", file=sys.stderr, flush=True)


def ours_available() -> bool:
    """Whether this checkout has the KV connector module (found without importing vLLM)."""
    try:
        return importlib.util.find_spec("lmcache_async.integration.vllm.kv.connector") is not None
    except (ImportError, ValueError):
        return False


def ensure_model(python: str, model: Path | None) -> Path:
    """``model`` when given (it must be a directory), else the tiny Llama built (or reused) by
    ``scripts/tiny_llama.py`` with ``python`` under :data:`DEFAULT_MODEL_DIR`."""
    if model is not None:
        if not (model / "config.json").is_file():
            raise ValueError(f"model: {model} has no config.json")
        return model
    if not TINY_LLAMA.is_file():
        raise ValueError(f"model: not given and {TINY_LLAMA} is missing (run from a source checkout)")
    subprocess.run([python, str(TINY_LLAMA), str(DEFAULT_MODEL_DIR)], check=True, stdout=subprocess.DEVNULL)
    return DEFAULT_MODEL_DIR


def _end_group(proc: subprocess.Popen[Any]) -> None:
    """End ``proc``'s process group (started with ``start_new_session``): TERM, then KILL."""
    for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def run_child(plan: Plan, workdir: Path, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    """Run one engine child; its result dict (``error`` set, with the log's tail, on failure)."""
    spec_path, out_path, log_path = (workdir / f"{name}.{s}" for s in ("spec.json", "out.json", "log"))
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ)
    env.update(ENGINE_ENV)
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [plan.python, str(CHILD), str(spec_path), str(out_path)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=str(workdir),
            start_new_session=True,
        )
        try:
            proc.wait(timeout=plan.child_timeout_s)
        except subprocess.TimeoutExpired:
            pass
        finally:
            _end_group(proc)
    result: dict[str, Any]
    if out_path.is_file():
        result = json.loads(out_path.read_text())
    else:
        result = {"error": f"no result (exit {proc.returncode})", "prompts": []}
    result["wall_s"] = time.monotonic() - t0
    if result.get("error"):
        result["log_tail"] = log_path.read_text(errors="replace")[-3000:]
        plan.say(f"{name}: FAILED after {result['wall_s']:.0f} s: {result['error']}")
    else:
        plan.say(f"{name}: {result['wall_s']:.0f} s (engine start {result.get('start_s', 0):.0f} s)")
    return result


SERVER_POOL_GIB = 1.0
"""The bench's node cache server pool (every prompt of a run fits)."""


@contextlib.contextmanager
def _cache_server(workdir: Path) -> Iterator[str]:
    """An ``lmcache-async serve`` process (this interpreter) with a pre-touched pool of
    :data:`SERVER_POOL_GIB`, for the duration of the block; yields its socket path."""
    from lmcache_async.testing.cache_server import CacheServerProcess

    shutil.rmtree(workdir, ignore_errors=True)
    srv = CacheServerProcess(workdir, max_local_cpu_size=SERVER_POOL_GIB, cache_server_pretouch=True).start(120.0)
    try:
        yield srv.socket
    finally:
        srv.kill()


def _spec(plan: Plan, vocab: int, mode: str, ktc: dict[str, Any] | None, flush: bool = False) -> dict[str, Any]:
    return {
        "model": str(plan.model),
        "tokens": plan.tokens,
        "runs": plan.runs,
        "seed": plan.seed,
        "vocab": vocab,
        "mode": mode,
        "kv_transfer_config": ktc,
        "flush": flush,
    }


def measure(plan: Plan) -> dict[str, Any]:
    """Run every engine child of ``plan``; the raw per-process results, keyed by process name."""
    vocab = int(json.loads((plan.model / "config.json").read_text())["vocab_size"])
    own_tmp = plan.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="vllm-kv-bench-")) if own_tmp else Path(plan.workdir or ".")
    workdir.mkdir(parents=True, exist_ok=True)
    raw: dict[str, Any] = {}
    try:
        raw["reference"] = run_child(plan, workdir, "reference", _spec(plan, vocab, "reference", None))
        example_dir = workdir / "example-store"
        shutil.rmtree(example_dir, ignore_errors=True)
        example_dir.mkdir()
        example = {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(example_dir)},
        }
        raw["example_store"] = run_child(plan, workdir, "example_store", _spec(plan, vocab, "store", example))
        raw["example_load"] = run_child(plan, workdir, "example_load", _spec(plan, vocab, "load", example))
        shutil.rmtree(example_dir, ignore_errors=True)
        if plan.ours:
            ours_dir = workdir / "ours-disk"
            shutil.rmtree(ours_dir, ignore_errors=True)
            ours = dict(OURS_KV_TRANSFER_CONFIG)
            ours["kv_connector_extra_config"] = {
                "local_disk": str(ours_dir),
                "max_local_disk_size": 4.0,
                "max_local_cpu_size": 1.0,
                "chunk_size": plan.chunk_size,
            }
            raw["ours_store"] = run_child(plan, workdir, "ours_store", _spec(plan, vocab, "store", ours, flush=True))
            load = _spec(plan, vocab, "load", ours)
            load["bare_files"] = {"dir": str(workdir / "bare-files"), "chunk_size": plan.chunk_size}
            raw["ours_load"] = run_child(plan, workdir, "ours_load", load)
            shutil.rmtree(ours_dir, ignore_errors=True)
            # The same engine and prompts with the save replaced by a bare gather of its blocks.
            bare = _spec(plan, vocab, "store", ours, flush=True)
            bare["bare_at_save"] = True
            raw["bare_at_save"] = run_child(plan, workdir, "bare_at_save", bare)
            shutil.rmtree(ours_dir, ignore_errors=True)
            # A CPU-tier hit in one process: vLLM's own prefix cache reset between store and load.
            cpu_only = dict(OURS_KV_TRANSFER_CONFIG)
            cpu_only["kv_connector_extra_config"] = {"max_local_cpu_size": 1.0, "chunk_size": plan.chunk_size}
            raw["ours_reload"] = run_child(plan, workdir, "ours_reload", _spec(plan, vocab, "reload", cpu_only))
            # Runs 1 and 2 through the node cache server (a private CPU tier in front of it): run 2,
            # a new process, finds the prefix in the node's shared pool.
            with _cache_server(workdir / "server") as socket:
                served = dict(OURS_KV_TRANSFER_CONFIG)
                served["kv_connector_extra_config"] = {
                    "tier_order": ["cpu", "server"],
                    "max_local_cpu_size": 1.0,
                    "cache_server_socket": socket,
                    "cache_server_namespace": "vllm-kv-bench",
                    "chunk_size": plan.chunk_size,
                }
                raw["ours_server_store"] = run_child(
                    plan, workdir, "ours_server_store", _spec(plan, vocab, "store", served, flush=True)
                )
                raw["ours_server_load"] = run_child(
                    plan, workdir, "ours_server_load", _spec(plan, vocab, "load", served)
                )
    finally:
        if own_tmp:
            shutil.rmtree(workdir, ignore_errors=True)
    return raw


PYTHON_ENV = "LMCACHE_VLLM_PYTHON"
"""Environment variable naming the interpreter with vLLM (used when ``--python`` is not given)."""


def _python_with_vllm(python: str | None) -> str:
    """The interpreter the engines run with: ``python``, else ``$LMCACHE_VLLM_PYTHON``, else this
    one when it can import vLLM; ValueError naming ``python`` otherwise."""
    python = python or os.environ.get(PYTHON_ENV)
    if python:
        if shutil.which(python) is None and not os.access(python, os.X_OK):
            raise ValueError(f"python: {python!r} is not an executable")
        return python
    if importlib.util.find_spec("vllm") is None:
        raise ValueError(
            f"python: this interpreter has no vLLM; pass --python or set {PYTHON_ENV} "
            "(bash scripts/e2e_env.sh prints the vLLM environment's python)"
        )
    return sys.executable


def run(opts: BenchOptions) -> list[Result]:
    """Suite entry point (``lmcache-async bench``). ``opts.reps`` is the number of prompts (at
    least 5); ``opts.extra`` may carry ``python``, ``model``, ``tokens`` and ``skip_ours``; the
    interpreter with vLLM also comes from ``$LMCACHE_VLLM_PYTHON``. Raises ValueError when no
    interpreter with vLLM is known (the CLI reports the suite as skipped)."""
    extra = dict(opts.extra or {})
    python = _python_with_vllm(extra.get("python"))
    plan = Plan(
        python=python,
        model=ensure_model(python, Path(extra["model"]) if extra.get("model") else None),
        tokens=int(extra.get("tokens", 3000)),
        runs=max(int(opts.reps), 5),
        ours=ours_available() and not extra.get("skip_ours"),
        workdir=Path(opts.workdir) if opts.workdir else None,
        progress=opts.say,
    )
    return figures(measure(plan), plan)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="KV-connector benchmark in real vLLM CPU engines.")
    p.add_argument("--python", help="interpreter with vLLM for the engines (default: this one)")
    p.add_argument("--model", type=Path, help="model directory (default: build the tiny Llama)")
    p.add_argument("--tokens", type=int, default=3000, help="prompt length")
    p.add_argument("--runs", type=int, default=5, help="prompts measured per process (medians)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chunk-size", type=int, default=128, help="our connector's chunk_size (tokens)")
    p.add_argument("--workdir", type=Path, help="keep spec/log/result files here (default: a temp dir)")
    p.add_argument("--skip-ours", action="store_true", help="only vLLM's own paths and ExampleConnector")
    p.add_argument("--timeout", type=float, default=420.0, help="seconds per engine process")
    p.add_argument("--json", type=Path, metavar="PATH", help="also write results, checks and raw data here")
    args = p.parse_args(argv)
    t0 = time.monotonic()
    try:
        python = _python_with_vllm(args.python)
        plan = Plan(
            python=python,
            model=ensure_model(python, args.model),
            tokens=args.tokens,
            runs=args.runs,
            seed=args.seed,
            chunk_size=args.chunk_size,
            workdir=args.workdir,
            ours=ours_available() and not args.skip_ours,
            child_timeout_s=args.timeout,
        )
    except ValueError as exc:
        p.error(str(exc))
    if not plan.ours and not args.skip_ours:
        plan.say("lmcache_async.integration.vllm.kv.connector not found: measuring vLLM's paths only")
    raw = measure(plan)
    results = figures(raw, plan)
    checks = must_show(results)
    wall = time.monotonic() - t0
    print(report(results, checks, raw, wall))
    if args.json is not None:
        doc = {
            "suite": SUITE,
            "argv": sys.argv,
            "results": [r.to_dict() for r in results],
            "must_show": checks,
            "tokens_equal": tokens_equal(raw),
            "raw": raw,
            "wall_s": wall,
        }
        args.json.write_text(json.dumps(doc, indent=1, default=str))
    failed = any(res.get("error") for res in raw.values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

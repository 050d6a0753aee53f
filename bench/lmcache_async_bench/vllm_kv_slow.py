"""Load or recompute in real vLLM CPU engines: a slow tier never makes a hit slower than recomputing.

Engine processes (each its own child, :mod:`lmcache_async_bench.vllm_kv_slow_child`), in order:

1. **store** — our connector writes every prompt to Redis (directly) and to a disk directory;
   it measures the engine's prefill rate into the load-cost state file;
2. **slow pairs** — a new process (empty CPU tier) reading the same Redis through a loopback
   proxy (:class:`~lmcache_async.testing.slow_link.SlowProxy`: reads at 8 MB/s shared by
   every connection, +5 ms per read, writes unpaced; ``remote_timeout_s`` above a chunk's read time). Round ``i``
   runs a stored prompt with ``load_policy: auto`` and a prompt nobody stored (the same-process
   uncached TTFT), alternating which goes first (round 0 starts with the stored one: the first
   request of a fresh process), then another stored prompt with ``load_policy: always``
   (every hit loaded whatever it costs: the behaviour before the decision). The scheduler hook's
   call times come from the same process;
3. **disk hit** — a new process reading the disk directory (``auto``): each prompt restored, then
   at once again as a hit of vLLM's own prefix cache (the floor);
4. **ours reload** / **native reload** — the CPU-offload hit in one process (store, reset vLLM's
   prefix cache, run again) with our connector's CPU tier and with vLLM's own offloading
   (``kv_offloading_backend="native"``); when the CPU build refuses the latter, its exact
   error is reported.

Run it with the vLLM environment's Python (``bash scripts/e2e_env.sh`` prints it)::

    $(bash scripts/e2e_env.sh | tail -1) -m lmcache_async_bench.vllm_kv_slow [--runs 5]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .common import BenchOptions, Result, format_table
from .vllm_kv import ENGINE_ENV, _end_group, _python_with_vllm, ensure_model

SUITE = "vllm_kv_slow"
CHILD = Path(__file__).resolve().parent / "vllm_kv_slow_child.py"
SLOW_BYTES_PER_S = 8e6
SLOW_DELAY_S = 0.005
CHUNK_SIZE = 256
TTFT_BOUND = 1.1  # slow tier: TTFT <= 1.1 x the paired uncached TTFT
HOOK_P99_S = 0.001  # the scheduler hook's p99 per call with a slow tier
NATIVE_OFFLOAD_GIB = 2.0


def _say(msg: str) -> None:
    print(f"[{SUITE}] {msg}", file=sys.stderr, flush=True)


def run_child(
    python: str, workdir: Path, name: str, spec: dict[str, Any], timeout_s: float, code: Path | None = None
) -> dict[str, Any]:
    """One engine child; its result (``error`` set, with the log's tail, on failure). ``code``:
    a checkout whose ``lmcache_async`` the child imports instead of the installed one."""
    spec_path, out_path, log_path = (workdir / f"{name}.{s}" for s in ("spec.json", "out.json", "log"))
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ)
    env.update(ENGINE_ENV)
    if code is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(code), env.get("PYTHONPATH", "")])
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [python, str(CHILD), str(spec_path), str(out_path)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=str(workdir),
            start_new_session=True,
        )
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
        finally:
            _end_group(proc)
    result: dict[str, Any] = (
        json.loads(out_path.read_text()) if out_path.is_file() else {"error": f"no result (exit {proc.returncode})"}
    )
    result["wall_s"] = time.monotonic() - t0
    if result.get("error"):
        result["log_tail"] = log_path.read_text(errors="replace")[-3000:]
        _say(f"{name}: FAILED after {result['wall_s']:.0f} s: {result['error']}")
    else:
        _say(f"{name}: {result['wall_s']:.0f} s (engine start {result.get('start_s', 0):.0f} s)")
    return result


def _chunk_read_bound(model: Path, bytes_per_s: float) -> float:
    """Three times one chunk record's read time over the slow link (at least 2 s), from the
    model's config (fp32 K and V of every layer)."""
    c = json.loads((model / "config.json").read_text())
    heads = int(c["num_attention_heads"])
    head_dim = int(c.get("head_dim") or int(c["hidden_size"]) // heads)
    kv_heads = int(c.get("num_key_value_heads") or heads)
    chunk_bytes = int(c["num_hidden_layers"]) * 2 * kv_heads * head_dim * 4 * CHUNK_SIZE
    return max(2.0, 3.0 * chunk_bytes / bytes_per_s)


def measure(
    python: str,
    model: Path,
    runs: int,
    tokens: int,
    workdir: Path,
    timeout_s: float,
    before: Path | None = None,
    *,
    bytes_per_s: float = SLOW_BYTES_PER_S,
    slow_only: bool = False,
    fast_only: bool = False,
    fast_rounds: int = 1,
    first_rounds: int = 0,
    pairs: bool = True,
    server: bool = False,
) -> dict[str, Any]:
    """Every engine process of the suite; the raw results by process name. ``before``: a
    checkout of earlier code, whose disk run 2 is measured too, alternating with ours
    ``fast_rounds`` times (the same files). ``bytes_per_s``: the slow link's read bandwidth;
    ``slow_only``: the store and the slow pairs only; ``fast_only``: a disk-only store and the
    disk runs 2 only; ``first_rounds``: that many pairs of fresh processes over the slow link,
    one whose first request is a stored prompt (``auto``), one whose first request was never
    stored (uncached), alternating which starts; ``pairs``: run the slow pairs process;
    ``server``: also run 2 through a node cache server (``tier_order: [cpu, server]``), ours and
    ``before``'s, after a store through it."""
    from lmcache_async.testing.servers import RedisServer, find_server_binary
    from lmcache_async.testing.slow_link import SlowProxy

    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    binary = find_server_binary()
    if binary is None:
        raise ValueError("no redis-server/valkey-server binary for the slow tier")
    auto = [100 + i for i in range(runs)]
    always = [200 + i for i in range(runs)]
    uncached = [300 + i for i in range(runs)]
    costs = str(workdir / "kv-costs.json")
    disk = str(workdir / "disk")
    base = {"model": str(model), "tokens": tokens, "vocab": vocab}
    common = {"chunk_size": CHUNK_SIZE, "max_local_cpu_size": 2.0, "load_cost_file": costs}
    raw: dict[str, Any] = {}
    if fast_only:
        store_kv = {**common, "local_disk": disk, "max_local_disk_size": 4.0}
        store = {**base, "mode": "store", "kv": store_kv, "seeds": {"all": auto}}
        raw["store"] = run_child(python, workdir, "store", store, timeout_s)
    else:
        with RedisServer(binary) as srv:
            port = int(srv.port)
            store_kv = {**common, "remote_url": srv.url, "local_disk": disk, "max_local_disk_size": 4.0}
            raw["store"] = run_child(
                python,
                workdir,
                "store",
                {**base, "mode": "store", "kv": store_kv, "seeds": {"all": auto + (always if pairs else [])}},
                timeout_s,
            )
            proxy = SlowProxy(port, bytes_per_s=bytes_per_s, delay_s=SLOW_DELAY_S).start()
            try:
                # a timeout well above one chunk's read over the link: slow, not failing
                slow_kv = {**common, "remote_url": proxy.url, "remote_timeout_s": _chunk_read_bound(model, bytes_per_s)}
                seeds = {"auto": auto, "always": always, "uncached": uncached}
                if pairs:
                    pairs_spec = {**base, "mode": "pairs", "kv": slow_kv, "seeds": seeds}
                    raw["slow_pairs"] = run_child(python, workdir, "slow_pairs", pairs_spec, timeout_s)
                for r in range(first_rounds):
                    order = [("auto", auto), ("uncached", uncached)]
                    for kind, pool in order if r % 2 == 0 else order[::-1]:
                        spec = {
                            **base,
                            "mode": "first",
                            "kind": kind,
                            "kv": slow_kv,
                            "seeds": {"all": [pool[r % runs]]},
                        }
                        raw[f"first_{kind}_{r}"] = run_child(python, workdir, f"first_{kind}_{r}", spec, timeout_s)
            finally:
                proxy.stop()
        if "slow_pairs" in raw:
            raw["slow_pairs"]["bytes_per_s"] = bytes_per_s
        if slow_only:
            return raw
    disk_kv = {**common, "local_disk": disk, "max_local_disk_size": 4.0}
    disk_spec = {**base, "mode": "hit", "kv": disk_kv, "seeds": {"all": auto}}
    for r in range(max(fast_rounds, 1)):
        tail = "" if r == 0 else f"_{r}"
        raw[f"disk_hit{tail}"] = run_child(python, workdir, f"disk_hit{tail}", disk_spec, timeout_s)
        if before is not None:
            name = f"disk_hit_before{tail}"
            raw[name] = run_child(python, workdir, name, disk_spec, timeout_s, before)
    if server:
        from .vllm_kv import _cache_server

        with _cache_server(workdir / "server") as socket:
            served = {
                **common,
                "tier_order": ["cpu", "server"],
                "cache_server_socket": socket,
                "cache_server_namespace": "vllm-kv-slow",
            }
            store = {**base, "mode": "store", "kv": served, "seeds": {"all": auto}}
            raw["server_store"] = run_child(python, workdir, "server_store", store, timeout_s)
            hit = {**base, "mode": "hit", "kv": served, "seeds": {"all": auto}}
            raw["server_hit"] = run_child(python, workdir, "server_hit", hit, timeout_s)
            if before is not None:
                raw["server_hit_before"] = run_child(python, workdir, "server_hit_before", hit, timeout_s, before)
    if fast_only:
        return raw
    reload = [400 + i for i in range(runs)]
    raw["ours_reload"] = run_child(
        python,
        workdir,
        "ours_reload",
        {
            **base,
            "mode": "reload",
            "kv": {"chunk_size": CHUNK_SIZE, "max_local_cpu_size": 2.0},
            "seeds": {"all": reload},
        },
        timeout_s,
    )
    native_llm = {"kv_offloading_backend": "native", "kv_offloading_size": NATIVE_OFFLOAD_GIB}
    raw["native_reload"] = run_child(
        python,
        workdir,
        "native_reload",
        {**base, "mode": "reload", "kv": None, "llm": native_llm, "seeds": {"all": reload}},
        timeout_s,
    )
    return raw


def _ttfts(res: dict[str, Any], kind: str) -> list[float]:
    return [r["ttft_s"] for r in res.get("runs") or [] if r["kind"] == kind]


def _pooled(raw: dict[str, Any], prefix: str, not_prefix: str | None = None) -> dict[str, Any]:
    """The runs of every process named ``prefix`` or ``prefix_<n>`` (but none starting with
    ``not_prefix``), pooled; the first such process's scheduler stats."""
    pattern = re.compile(re.escape(prefix) + r"(_\d+)?")
    names = [k for k in raw if pattern.fullmatch(k) and not (not_prefix and k.startswith(not_prefix))]
    runs = [r for k in names for r in raw[k].get("runs") or []]
    return {"runs": runs, "scheduler": raw[names[0]].get("scheduler") if names else None}


def _paired_ratio(res: dict[str, Any], kind: str, base: str) -> float | None:
    """Median over prompts of ``kind``'s TTFT / ``base``'s TTFT of the same prompt and process."""
    runs = res.get("runs") or []
    pairs = [
        a["ttft_s"] / b["ttft_s"]
        for a, b in itertools.pairwise(runs)
        if a["kind"] == kind and b["kind"] == base and a["seed"] == b["seed"] and b["ttft_s"] > 0
    ]
    return _med(pairs)


def _med(vals: Sequence[float]) -> float | None:
    return statistics.median(vals) if vals else None


def figures(raw: dict[str, Any]) -> tuple[list[Result], dict[str, Any]]:
    """The results table and the facts beside it (tokens equal, hook times, errors)."""
    out: list[Result] = []
    facts: dict[str, Any] = {}
    store_tokens = {r["seed"]: r["token"] for r in raw.get("store", {}).get("runs") or []}
    pairs = raw.get("slow_pairs", {})
    if pairs.get("runs"):
        auto, unc, alw = _ttfts(pairs, "auto"), _ttfts(pairs, "uncached"), _ttfts(pairs, "always")
        ratios = [a / u for a, u in zip(auto, unc, strict=False)]
        first = pairs["runs"][0]
        mbps = f"{float(pairs.get('bytes_per_s', SLOW_BYTES_PER_S)) / 1e6:g}"
        out.append(
            Result(
                SUITE,
                f"slow tier ({mbps} MB/s) TTFT, auto, first request of a fresh process",
                first["ttft_s"],
                "s",
                "uncached, same process (round 0)",
                unc[0] if unc else None,
                target=TTFT_BOUND,
                note=f"restored {first['cached']} tokens",
            )
        )
        out.append(
            Result(
                SUITE,
                f"slow tier ({mbps} MB/s) TTFT, auto (median of pairs)",
                _med(auto) or 0.0,
                "s",
                "uncached, paired",
                _med(unc),
                target=TTFT_BOUND,
                note=f"median of per-pair ratios {(_med(ratios) or 0):.3f}; "
                f"restored tokens {[r['cached'] for r in pairs['runs'] if r['kind'] == 'auto']}",
            )
        )
        out.append(
            Result(
                SUITE,
                f"slow tier ({mbps} MB/s) TTFT, always (every hit loaded)",
                _med(alw) or 0.0,
                "s",
                "uncached, paired",
                _med(unc),
                note="what a load of the whole slow hit costs (the behaviour before the decision)",
            )
        )
        sched = pairs.get("scheduler") or {}
        hook = sched.get("hook_s") or {}
        if hook:
            out.append(
                Result(
                    SUITE,
                    "scheduler hook per call, slow tier (p99)",
                    hook["p99"],
                    "s",
                    target=HOOK_P99_S,
                    note=f"{hook['calls']} calls, p50 {hook['p50'] * 1e6:.1f} us, max {hook['max'] * 1e3:.2f} ms",
                )
            )
        facts["slow_decisions"] = {k: v for k, v in sched.items() if k.startswith("decision_")}
        facts["slow_costs"] = sched.get("costs")
        facts["slow_lookups"] = {k: sched.get(k) for k in ("lookups_deferred", "lookups_given_up", "probes")}
        facts["slow_tokens_equal"] = all(
            r["token"] == store_tokens.get(r["seed"]) for r in pairs["runs"] if r["kind"] in ("auto", "always")
        )
    firsts = {kind: _pooled(raw, f"first_{kind}") for kind in ("auto", "uncached")}
    fa, fu = _ttfts(firsts["auto"], "auto"), _ttfts(firsts["uncached"], "uncached")
    if fa and fu:
        out.append(
            Result(
                SUITE,
                "slow tier TTFT, first request of a fresh process (auto; median over processes)",
                _med(fa) or 0.0,
                "s",
                "first request of a fresh process, never stored",
                _med(fu),
                target=TTFT_BOUND,
                note=f"{len(fa)} + {len(fu)} processes, alternating; auto {[round(x, 2) for x in fa]}, "
                f"uncached {[round(x, 2) for x in fu]}",
            )
        )
        facts["first_tokens_equal"] = all(r["token"] == store_tokens.get(r["seed"]) for r in firsts["auto"]["runs"])
    disk = _pooled(raw, "disk_hit", "disk_hit_before")
    if disk.get("runs"):
        restored, hit = _ttfts(disk, "restored"), _ttfts(disk, "prefix_hit")
        out.append(
            Result(
                SUITE,
                "disk run-2 TTFT (auto)",
                _med(restored) or 0.0,
                "s",
                "vLLM prefix-cache hit, same prompt",
                _med(hit),
                note=f"median of per-prompt ratios {_paired_ratio(disk, 'restored', 'prefix_hit') or 0:.3f}; "
                f"restored {[r['cached'] for r in disk['runs'] if r['kind'] == 'restored']} tokens",
            )
        )
        facts["disk_tokens_equal"] = all(
            r["token"] == store_tokens.get(r["seed"]) for r in disk["runs"] if r["kind"] == "restored"
        )
        facts["disk_decisions"] = {k: v for k, v in (disk.get("scheduler") or {}).items() if k.startswith("decision_")}
    old = _pooled(raw, "disk_hit_before")
    if old.get("runs"):
        out.append(
            Result(
                SUITE,
                "disk run-2 TTFT, the code before (--before)",
                _med(_ttfts(old, "restored")) or 0.0,
                "s",
                "vLLM prefix-cache hit, same prompt",
                _med(_ttfts(old, "prefix_hit")),
                note=f"median of per-prompt ratios {_paired_ratio(old, 'restored', 'prefix_hit') or 0:.3f}",
            )
        )
    for key, label in (
        ("server_hit", "node server run-2 TTFT (auto)"),
        ("server_hit_before", "node server run-2 TTFT, the code before"),
    ):
        res = raw.get(key, {})
        if res.get("runs"):
            out.append(
                Result(
                    SUITE,
                    label,
                    _med(_ttfts(res, "restored")) or 0.0,
                    "s",
                    "vLLM prefix-cache hit, same prompt",
                    _med(_ttfts(res, "prefix_hit")),
                    note=f"median of per-prompt ratios {_paired_ratio(res, 'restored', 'prefix_hit') or 0:.3f}; "
                    f"restored {[r['cached'] for r in res['runs'] if r['kind'] == 'restored']} tokens",
                )
            )
    ours, native = raw.get("ours_reload", {}), raw.get("native_reload", {})
    if ours.get("runs"):
        out.append(
            Result(
                SUITE,
                "CPU-offload hit TTFT, ours",
                _med(_ttfts(ours, "reload")) or 0.0,
                "s",
                "uncached, same prompts",
                _med(_ttfts(ours, "first")),
            )
        )
    if native.get("runs"):
        out.append(
            Result(
                SUITE,
                "CPU-offload hit TTFT, vLLM native offloading",
                _med(_ttfts(native, "reload")) or 0.0,
                "s",
                "uncached, same prompts",
                _med(_ttfts(native, "first")),
                note=f"cached {[r['cached'] for r in native['runs'] if r['kind'] == 'reload']} tokens",
            )
        )
    facts["errors"] = {k: v.get("error") for k, v in raw.items() if v.get("error")}
    return out, facts


def run(opts: BenchOptions) -> list[Result]:
    """Suite entry point: ``opts.reps`` pairs (at least 5); ``opts.extra`` may name ``python``,
    ``model`` and ``tokens`` (ValueError when no interpreter with vLLM is known)."""
    extra = dict(opts.extra or {})
    python = _python_with_vllm(extra.get("python"))
    model = ensure_model(python, Path(extra["model"]) if extra.get("model") else None)
    with tempfile.TemporaryDirectory(prefix="vllm-kv-slow-") as tmp:
        raw = measure(python, model, max(int(opts.reps), 5), int(extra.get("tokens", 3000)), Path(tmp), 900.0)
    results, facts = figures(raw)
    opts.say(json.dumps(facts, default=str))
    return results


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Load or recompute in real vLLM CPU engines.")
    p.add_argument("--python", help="interpreter with vLLM for the engines (default: this one)")
    p.add_argument("--model", type=Path, help="model directory (default: build the tiny Llama)")
    p.add_argument("--tokens", type=int, default=3000)
    p.add_argument("--runs", type=int, default=5, help="pairs (medians), at least 5")
    p.add_argument("--workdir", type=Path, help="keep spec/log/result files here")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per engine process")
    p.add_argument("--json", type=Path, metavar="PATH", help="also write results, facts and raw data here")
    p.add_argument("--before", type=Path, help="a checkout of earlier code: its disk run 2 is measured too")
    p.add_argument("--bytes-per-s", type=float, default=SLOW_BYTES_PER_S, help="the slow link's read bandwidth")
    p.add_argument("--slow-only", action="store_true", help="only the store and the slow-tier pairs")
    p.add_argument("--fast-only", action="store_true", help="only a disk store and the disk runs 2")
    p.add_argument("--fast-rounds", type=int, default=1, help="disk run-2 processes, ours and --before alternating")
    p.add_argument("--first-rounds", type=int, default=0, help="pairs of fresh processes measuring a first request")
    p.add_argument("--skip-pairs", action="store_true", help="no slow-pairs process (with --first-rounds)")
    p.add_argument("--server", action="store_true", help="also run 2 through a node cache server")
    args = p.parse_args(argv)
    python = _python_with_vllm(args.python)
    model = ensure_model(python, args.model)
    t0 = time.monotonic()
    own = args.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="vllm-kv-slow-")) if own else args.workdir
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        raw = measure(
            python,
            model,
            max(args.runs, 5),
            args.tokens,
            workdir,
            args.timeout,
            args.before,
            bytes_per_s=args.bytes_per_s,
            slow_only=args.slow_only,
            fast_only=args.fast_only,
            fast_rounds=args.fast_rounds,
            first_rounds=args.first_rounds,
            pairs=not args.skip_pairs,
            server=args.server,
        )
    finally:
        if own:
            shutil.rmtree(workdir, ignore_errors=True)
    results, facts = figures(raw)
    print(format_table(results))
    for k, v in facts.items():
        print(f"{k}: {v}")
    for name, res in raw.items():
        if res.get("error"):
            print(f"{name} failed: {res['error']}")
            tail = (res.get("log_tail") or "").strip().splitlines()[-6:]
            print("  " + "\n  ".join(tail))
    with contextlib.suppress(OSError):
        print(f"load average at the end: {' '.join(Path('/proc/loadavg').read_text().split()[:3])}")
    print(f"whole bench: {time.monotonic() - t0:.0f} s")
    if args.json:
        args.json.write_text(json.dumps({"results": [r.__dict__ for r in results], "facts": facts, "raw": raw}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

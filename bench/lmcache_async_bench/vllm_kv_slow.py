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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .common import BenchOptions, Result, format_table
from .vllm_kv import ENGINE_ENV, _end_group, _python_with_vllm, ensure_model

__all__ = [
    "CHILD",
    "CHUNK_SIZE",
    "HOOK_P99_S",
    "NATIVE_OFFLOAD_GIB",
    "SLOW_BYTES_PER_S",
    "SLOW_DELAY_S",
    "SUITE",
    "TTFT_BOUND",
    "figures",
    "main",
    "measure",
    "run",
    "run_child",
]

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


@dataclass
class _Children:
    """What every engine child of one :func:`measure` shares: the interpreter, the work
    directory, the time limit, the spec fields every child gets (``base``) and the connector
    settings every one of ours starts from (``common``)."""

    python: str
    workdir: Path
    timeout_s: float
    base: dict[str, Any]
    common: dict[str, Any]
    disk: str

    def run(self, name: str, spec: dict[str, Any], code: Path | None = None) -> dict[str, Any]:
        """One child named ``name`` with ``spec`` added to :attr:`base` (see :func:`run_child`)."""
        return run_child(self.python, self.workdir, name, {**self.base, **spec}, self.timeout_s, code)


def _measure_slow(
    ch: _Children,
    raw: dict[str, Any],
    binary: str,
    model: Path,
    seeds: dict[str, list[int]],
    bytes_per_s: float,
    first_rounds: int,
    pairs: bool,
) -> None:
    """The store to Redis (and the disk directory), then the slow pairs and the fresh-process
    rounds through a slow proxy in front of the same Redis; results into ``raw``."""
    from lmcache_async.testing.servers import RedisServer
    from lmcache_async.testing.slow_link import SlowProxy

    auto, always, uncached = seeds["auto"], seeds["always"], seeds["uncached"]
    runs = len(auto)
    with RedisServer(binary) as srv:
        port = int(srv.port)
        store_kv = {**ch.common, "remote_url": srv.url, "local_disk": ch.disk, "max_local_disk_size": 4.0}
        store_seeds = {"all": auto + (always if pairs else [])}
        raw["store"] = ch.run("store", {"mode": "store", "kv": store_kv, "seeds": store_seeds})
        proxy = SlowProxy(port, bytes_per_s=bytes_per_s, delay_s=SLOW_DELAY_S).start()
        try:
            # a timeout well above one chunk's read over the link: slow, not failing
            slow_kv = {**ch.common, "remote_url": proxy.url, "remote_timeout_s": _chunk_read_bound(model, bytes_per_s)}
            if pairs:
                raw["slow_pairs"] = ch.run("slow_pairs", {"mode": "pairs", "kv": slow_kv, "seeds": seeds})
            for r in range(first_rounds):
                order = [("auto", auto), ("uncached", uncached)]
                for kind, pool in order if r % 2 == 0 else order[::-1]:
                    spec = {"mode": "first", "kind": kind, "kv": slow_kv, "seeds": {"all": [pool[r % runs]]}}
                    raw[f"first_{kind}_{r}"] = ch.run(f"first_{kind}_{r}", spec)
        finally:
            proxy.stop()
    if "slow_pairs" in raw:
        raw["slow_pairs"]["bytes_per_s"] = bytes_per_s


def _measure_server(ch: _Children, raw: dict[str, Any], auto: list[int], before: Path | None) -> None:
    """A store through a node cache server (``tier_order: [cpu, server]``), then run 2 from it,
    ours and ``before``'s; results into ``raw``."""
    from .vllm_kv import _cache_server

    with _cache_server(ch.workdir / "server") as socket:
        served = {
            **ch.common,
            "tier_order": ["cpu", "server"],
            "cache_server_socket": socket,
            "cache_server_namespace": "vllm-kv-slow",
        }
        raw["server_store"] = ch.run("server_store", {"mode": "store", "kv": served, "seeds": {"all": auto}})
        hit = {"mode": "hit", "kv": served, "seeds": {"all": auto}}
        raw["server_hit"] = ch.run("server_hit", hit)
        if before is not None:
            raw["server_hit_before"] = ch.run("server_hit_before", hit, before)


def _measure_reloads(ch: _Children, raw: dict[str, Any], runs: int) -> None:
    """The CPU-offload hit in one process, with our CPU tier and with vLLM's native offloading."""
    reload = [400 + i for i in range(runs)]
    ours_kv = {"chunk_size": CHUNK_SIZE, "max_local_cpu_size": 2.0}
    raw["ours_reload"] = ch.run("ours_reload", {"mode": "reload", "kv": ours_kv, "seeds": {"all": reload}})
    native_llm = {"kv_offloading_backend": "native", "kv_offloading_size": NATIVE_OFFLOAD_GIB}
    native = {"mode": "reload", "kv": None, "llm": native_llm, "seeds": {"all": reload}}
    raw["native_reload"] = ch.run("native_reload", native)


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
    from lmcache_async.testing.servers import find_server_binary

    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    binary = find_server_binary()
    if binary is None:
        raise ValueError("no redis-server/valkey-server binary for the slow tier")
    auto = [100 + i for i in range(runs)]
    seeds = {"auto": auto, "always": [200 + i for i in range(runs)], "uncached": [300 + i for i in range(runs)]}
    common = {"chunk_size": CHUNK_SIZE, "max_local_cpu_size": 2.0, "load_cost_file": str(workdir / "kv-costs.json")}
    base = {"model": str(model), "tokens": tokens, "vocab": vocab}
    ch = _Children(python, workdir, timeout_s, base, common, str(workdir / "disk"))
    raw: dict[str, Any] = {}
    disk_kv = {**common, "local_disk": ch.disk, "max_local_disk_size": 4.0}
    if fast_only:
        raw["store"] = ch.run("store", {"mode": "store", "kv": disk_kv, "seeds": {"all": auto}})
    else:
        _measure_slow(ch, raw, binary, model, seeds, bytes_per_s, first_rounds, pairs)
        if slow_only:
            return raw
    disk_spec = {"mode": "hit", "kv": disk_kv, "seeds": {"all": auto}}
    for r in range(max(fast_rounds, 1)):
        tail = "" if r == 0 else f"_{r}"
        raw[f"disk_hit{tail}"] = ch.run(f"disk_hit{tail}", disk_spec)
        if before is not None:
            raw[f"disk_hit_before{tail}"] = ch.run(f"disk_hit_before{tail}", disk_spec, before)
    if server:
        _measure_server(ch, raw, auto, before)
    if fast_only:
        return raw
    _measure_reloads(ch, raw, runs)
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


def _slow_pair_rows(pairs: dict[str, Any], store_tokens: dict[Any, Any], facts: dict[str, Any]) -> list[Result]:
    """The slow-pairs process's rows: its first request (``auto``), the paired medians of
    ``auto`` and ``always`` vs uncached, and the scheduler hook's p99; its facts into ``facts``."""
    out: list[Result] = []
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
    return out


def _first_rows(raw: dict[str, Any], store_tokens: dict[Any, Any], facts: dict[str, Any]) -> list[Result]:
    """The fresh-process rounds' row: a first request of a stored prompt vs of a never-stored one."""
    firsts = {kind: _pooled(raw, f"first_{kind}") for kind in ("auto", "uncached")}
    fa, fu = _ttfts(firsts["auto"], "auto"), _ttfts(firsts["uncached"], "uncached")
    if not (fa and fu):
        return []
    facts["first_tokens_equal"] = all(r["token"] == store_tokens.get(r["seed"]) for r in firsts["auto"]["runs"])
    return [
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
    ]


def _run2_row(res: dict[str, Any], label: str, restored: bool = True) -> Result:
    """A run-2 row of ``res`` (a hit process): restored TTFT vs vLLM's prefix-cache hit of the
    same prompt; ``restored``: the note lists each prompt's restored tokens too."""
    note = f"median of per-prompt ratios {_paired_ratio(res, 'restored', 'prefix_hit') or 0:.3f}"
    if restored:
        note += f"; restored {[r['cached'] for r in res['runs'] if r['kind'] == 'restored']} tokens"
    return Result(
        SUITE,
        label,
        _med(_ttfts(res, "restored")) or 0.0,
        "s",
        "vLLM prefix-cache hit, same prompt",
        _med(_ttfts(res, "prefix_hit")),
        note=note,
    )


def _run2_rows(raw: dict[str, Any], store_tokens: dict[Any, Any], facts: dict[str, Any]) -> list[Result]:
    """Run 2 from the disk (ours, the code before) and through the node server (ours, before)."""
    out: list[Result] = []
    disk = _pooled(raw, "disk_hit", "disk_hit_before")
    if disk.get("runs"):
        out.append(_run2_row(disk, "disk run-2 TTFT (auto)"))
        facts["disk_tokens_equal"] = all(
            r["token"] == store_tokens.get(r["seed"]) for r in disk["runs"] if r["kind"] == "restored"
        )
        facts["disk_decisions"] = {k: v for k, v in (disk.get("scheduler") or {}).items() if k.startswith("decision_")}
    old = _pooled(raw, "disk_hit_before")
    if old.get("runs"):
        out.append(_run2_row(old, "disk run-2 TTFT, the code before (--before)", restored=False))
    for key, label in (
        ("server_hit", "node server run-2 TTFT (auto)"),
        ("server_hit_before", "node server run-2 TTFT, the code before"),
    ):
        res = raw.get(key, {})
        if res.get("runs"):
            out.append(_run2_row(res, label))
    return out


def _reload_rows(raw: dict[str, Any]) -> list[Result]:
    """The CPU-offload hit in one process: ours and vLLM's native offloading, each vs uncached."""
    out: list[Result] = []
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
    return out


def figures(raw: dict[str, Any]) -> tuple[list[Result], dict[str, Any]]:
    """The results table and the facts beside it (tokens equal, hook times, errors)."""
    out: list[Result] = []
    facts: dict[str, Any] = {}
    store_tokens = {r["seed"]: r["token"] for r in raw.get("store", {}).get("runs") or []}
    pairs = raw.get("slow_pairs", {})
    if pairs.get("runs"):
        out += _slow_pair_rows(pairs, store_tokens, facts)
    out += _first_rows(raw, store_tokens, facts)
    out += _run2_rows(raw, store_tokens, facts)
    out += _reload_rows(raw)
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

"""The figures of the vLLM KV-connector benchmark (:mod:`lmcache_async_bench.vllm_kv`): the table's
rows from the engine processes' raw results, the must-show checks and the printed report.

Each row group has its own function: vLLM's own paths (:func:`_reference_rows`), each connector's
runs 1 and 2 (:func:`_side_rows`), ours beside the bare copies and reads it must make
(:func:`_bare_rows`) and ours beside ``ExampleConnector`` (:func:`_example_rows`).
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .common import MiB, Result, format_table

if TYPE_CHECKING:
    from .vllm_kv import Plan

__all__ = [
    "BARE_FRACTION",
    "HIT_BOUND",
    "LOAD_SPEEDUP",
    "SAVE_SPEEDUP",
    "SUITE",
    "UNCACHED_BOUND",
    "figures",
    "must_show",
    "report",
    "tokens_equal",
]

SUITE = "vllm_kv"

# Must-show bounds of the KV-connector figures (ratio = value / baseline, times).
HIT_BOUND = 1.3  # run-2 TTFT <= 1.3 x vLLM's own prefix-cache hit
UNCACHED_BOUND = 0.3  # run-2 TTFT <= 0.3 x uncached
SAVE_SPEEDUP = 3.0  # save >= 3 x faster than ExampleConnector
LOAD_SPEEDUP = 1.0  # load >= 1 x ExampleConnector
BARE_FRACTION = 0.7  # each of ours >= 0.7 x the bare gather/scatter speed


def _median(rows: Sequence[dict[str, Any]], key: str) -> float | None:
    """The median of ``key`` over the ``rows`` that have it, None when none has."""
    vals = [float(r[key]) for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def _bare(prompts: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each prompt's bare-baseline timings (empty where it has none)."""
    return [p.get("bare") or {} for p in prompts]


def tokens_equal(raw: dict[str, Any]) -> bool | None:
    """Whether every process produced the reference's first greedy token for every prompt."""
    ref = raw.get("reference", {}).get("prompts") or []
    if not ref:
        return None
    want = [p["token"] for p in ref]
    got = [[p.get("hit_token") for p in ref]]
    for name, res in raw.items():
        if name != "reference" and not res.get("error"):
            got.append([p.get("token") for p in res.get("prompts", [])])
            if name == "ours_reload":  # its store pass too
                got.append([p.get("store_token") for p in res.get("prompts", [])])
    return all(g == want for g in got)


class _Rows:
    """The table being built: every row with the same ``params``; a row whose value (or, when
    one is named, baseline) is missing is left out."""

    def __init__(self, plan: Plan) -> None:
        self.out: list[Result] = []
        self.params = {"tokens": plan.tokens, "runs": plan.runs, "panel": "vLLM KV connector"}

    def add(self, name: str, value: float | None, unit: str = "s", **kw: Any) -> None:
        if value is None or ("baseline" in kw and kw["baseline"] is None):
            return
        self.out.append(Result(SUITE, name, value, unit, params=dict(self.params), **kw))

    def add_cold_scatter(self, name: str, prompts: list[dict[str, Any]]) -> None:
        """A load beside the bare scatter with neither side in the CPU's caches."""
        self.add(
            name,
            _median(prompts, "load"),
            baseline_name="bare scatter, cold caches",
            baseline=_median(_bare(prompts), "cold_scatter_s"),
            target=1 / BARE_FRACTION,
            note="the bare memmove scatter with neither side in the CPU's caches, as a record read later",
        )


def _reference_rows(rows: _Rows, raw: dict[str, Any]) -> tuple[float | None, float | None]:
    """vLLM's own paths: the uncached TTFT and its prefix-cache hit; returns both (the
    baselines of the run-2 rows)."""
    ref = raw.get("reference", {}).get("prompts") or []
    uncached, hit = _median(ref, "ttft_s"), _median(ref, "hit_ttft_s")
    rows.add("uncached TTFT", uncached, note="no connector, prefix cache empty for the prompt")
    rows.add(
        "prefix-cache hit TTFT",
        hit,
        baseline_name="uncached",
        baseline=uncached,
        note=f"hit {_median(ref, 'hit_cached')} tokens",
    )
    return uncached, hit


def _side_rows(rows: _Rows, raw: dict[str, Any], plan: Plan, uncached: float | None, hit: float | None) -> None:
    """Each connector's run-2 TTFT (vs the prefix-cache hit and vs uncached), its save vs the
    bare gather and its load vs the bare scatter."""
    sides = {"ExampleConnector": "example", "ours": "ours", "ours via the node server": "ours_server"}
    for label, key in sides.items():
        store = raw.get(f"{key}_store", {})
        load = raw.get(f"{key}_load", {})
        if store.get("error") or load.get("error") or not load.get("prompts"):
            continue
        sp, lp = store.get("prompts", []), load["prompts"]
        ttft2, cached = _median(lp, "ttft_s"), _median(lp, "cached")
        hit_note = f"run 2 restored {cached} of {plan.tokens} tokens"
        ours = key.startswith("ours")
        bound = HIT_BOUND if ours else None
        rows.add(
            f"{label} run-2 TTFT", ttft2, baseline_name="prefix-cache hit", baseline=hit, target=bound, note=hit_note
        )
        rows.add(
            f"{label} run-2 TTFT vs uncached",
            ttft2,
            baseline_name="uncached",
            baseline=uncached,
            target=UNCACHED_BOUND if ours else None,
        )
        moved: dict[str, Any] = next((p["bare"] for p in sp if p.get("bare")), {})
        rows.add(
            f"{label} save",
            _median(sp, "save"),
            baseline_name="bare gather",
            baseline=_median(_bare(sp), "gather_s"),
            target=1 / BARE_FRACTION if ours else None,
            note=f"{moved.get('blocks')} blocks x {moved.get('layers')} layers, {moved.get('bytes', 0) / MiB:.1f} MiB",
        )
        rows.add(
            f"{label} load",
            _median(lp, "load"),
            baseline_name="bare scatter",
            baseline=_median(_bare(lp), "scatter_s"),
            target=1 / BARE_FRACTION if ours else None,
        )
        if key == "ours":
            rows.add("ours store flush", _median(sp, "flush_s"), note="after each prompt, outside the save time")
            rows.add_cold_scatter("ours load vs bare scatter, cold caches", lp)


def _bare_rows(rows: _Rows, raw: dict[str, Any], hit: float | None) -> None:
    """Ours beside the bare work it must do: the save vs a gather in the same step, the disk load
    vs a bare file read, and the CPU-tier reload (TTFT vs the prefix-cache hit, load vs scatter)."""
    at_save = raw.get("bare_at_save", {})
    if at_save.get("prompts") and not at_save.get("error"):
        ap = at_save["prompts"]
        rows.add(
            "ours save vs bare gather at wait_for_save",
            _median(ap, "save"),
            baseline_name="bare gather, same step",
            baseline=_median(ap, "bare_at_save_s"),
            target=1 / BARE_FRACTION,
            note="each save paired in its step with a bare memmove gather of its blocks into fresh "
            "pre-touched memory, alternating which goes first",
        )
    ours_load = raw.get("ours_load", {})
    if ours_load.get("prompts") and not ours_load.get("error"):
        rows.add(
            "ours disk load vs bare file read",
            _median(ours_load["prompts"], "load"),
            baseline_name="bare preadv + xxh3, same blocks",
            baseline=_median(_bare(ours_load["prompts"]), "file_read_s"),
            note="one page-cache file per chunk read straight into the blocks and hashed, one thread",
        )
    reload = raw.get("ours_reload", {})
    if reload.get("prompts") and not reload.get("error"):
        rp = reload["prompts"]
        rows.add(
            "ours CPU-tier reload TTFT",
            _median(rp, "ttft_s"),
            baseline_name="prefix-cache hit",
            baseline=hit,
            note=f"same process, vLLM's prefix cache reset; restored {_median(rp, 'cached')} tokens",
        )
        rows.add(
            "ours CPU-tier load",
            _median(rp, "load"),
            baseline_name="bare scatter",
            baseline=_median(_bare(rp), "scatter_s"),
            target=1 / BARE_FRACTION,
            note="synchronous, in start_load_kv: a memmove per run of blocks from the CPU tier's pool",
        )
        rows.add_cold_scatter("ours CPU-tier load vs bare scatter, cold caches", rp)


def _example_rows(rows: _Rows, raw: dict[str, Any]) -> None:
    """Our save and load (directly and via the node server) vs ``ExampleConnector``'s."""
    ex_save = _median(raw.get("example_store", {}).get("prompts") or [], "save")
    ex_load = _median(raw.get("example_load", {}).get("prompts") or [], "load")
    for label, key in (("ours", "ours"), ("ours via the node server", "ours_server")):
        if f"{key}_load" not in raw or raw[f"{key}_load"].get("error"):
            continue
        rows.add(
            f"{label} save vs ExampleConnector",
            _median(raw[f"{key}_store"].get("prompts") or [], "save"),
            baseline_name="ExampleConnector save",
            baseline=ex_save,
            target=1 / SAVE_SPEEDUP,
        )
        rows.add(
            f"{label} load vs ExampleConnector",
            _median(raw[f"{key}_load"].get("prompts") or [], "load"),
            baseline_name="ExampleConnector load",
            baseline=ex_load,
            target=1 / LOAD_SPEEDUP,
        )


def figures(raw: dict[str, Any], plan: Plan) -> list[Result]:
    """The table's rows from :func:`~lmcache_async_bench.vllm_kv.measure`'s raw results (rows
    whose inputs are missing are left out)."""
    rows = _Rows(plan)
    uncached, hit = _reference_rows(rows, raw)
    _side_rows(rows, raw, plan, uncached, hit)
    _bare_rows(rows, raw, hit)
    _example_rows(rows, raw)
    return rows.out


def must_show(results: list[Result]) -> dict[str, Any]:
    """The issue's must-show checks, each as ``{"figure", "ratio", "bound", "met"}`` (speedups
    for the comparisons that are stated as "n x faster"); missing figures are absent."""
    by = {r.name: r for r in results}
    checks: dict[str, Any] = {}

    def put(key: str, name: str, bound: float, speedup: bool) -> None:
        r = by.get(name)
        if r is None or r.ratio is None or r.ratio == 0:
            return
        ratio = 1 / r.ratio if speedup else r.ratio
        met = ratio >= bound if speedup else ratio <= bound
        checks[key] = {"figure": name, "ratio": ratio, "bound": bound, "kind": ">=" if speedup else "<=", "met": met}

    put("run2_vs_prefix_hit", "ours run-2 TTFT", HIT_BOUND, False)
    put("run2_vs_uncached", "ours run-2 TTFT vs uncached", UNCACHED_BOUND, False)
    put("save_speedup_vs_example", "ours save vs ExampleConnector", SAVE_SPEEDUP, True)
    put("load_speedup_vs_example", "ours load vs ExampleConnector", LOAD_SPEEDUP, True)
    put("save_vs_bare_gather", "ours save", BARE_FRACTION, True)
    put("load_vs_bare_scatter", "ours load", BARE_FRACTION, True)
    put("save_vs_bare_gather_same_step", "ours save vs bare gather at wait_for_save", BARE_FRACTION, True)
    put("cpu_tier_load_vs_bare_scatter", "ours CPU-tier load", BARE_FRACTION, True)
    put("disk_load_vs_bare_file_read", "ours disk load vs bare file read", BARE_FRACTION, True)
    srv = "ours via the node server"
    put("server_run2_vs_prefix_hit", f"{srv} run-2 TTFT", HIT_BOUND, False)
    put("server_run2_vs_uncached", f"{srv} run-2 TTFT vs uncached", UNCACHED_BOUND, False)
    put("server_save_speedup_vs_example", f"{srv} save vs ExampleConnector", SAVE_SPEEDUP, True)
    put("server_load_speedup_vs_example", f"{srv} load vs ExampleConnector", LOAD_SPEEDUP, True)
    put("server_save_vs_bare_gather", f"{srv} save", BARE_FRACTION, True)
    put("server_load_vs_bare_scatter", f"{srv} load", BARE_FRACTION, True)
    return checks


def report(results: list[Result], checks: dict[str, Any], raw: dict[str, Any], wall: float) -> str:
    """The printed report: the table, the must-show checks, whether the tokens agree, the
    processes that failed, the load average and the whole bench's time."""
    head = "must show (speed ratios: ours / baseline speed; TTFT ratios: ours / baseline time):"
    lines = [format_table(results), "", head]
    for key, c in checks.items():
        verdict = "ok" if c["met"] else "NOT MET"
        lines.append(f"  {key:32s} {c['ratio']:.3f} (bound {c['kind']} {c['bound']:g}) {verdict}")
    lines.append(f"tokens equal in every run: {tokens_equal(raw)}")
    for name, res in raw.items():
        if res.get("error"):
            lines.append(f"{name} failed: {res['error']}")
    with contextlib.suppress(OSError):
        lines.append(f"load average at the end: {' '.join(Path('/proc/loadavg').read_text().split()[:3])}")
    lines.append(f"whole bench: {wall:.0f} s")
    return "\n".join(lines)

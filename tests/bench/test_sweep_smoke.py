"""Smoke tests of the ``sweep`` suite (throughput vs entry size per tier) and its figure.

Timings are never asserted: only that every available tier reports put and get at every quick
size, each beside a same-run baseline, that the suite leaves no files behind, and that the
figure is written.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from lmcache_async_bench.common import BenchOptions, Result, format_table

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _expected_tiers() -> set[str]:
    from lmcache_async.nixl.agent import nixl_available
    from lmcache_async.testing.servers import find_server_binary

    tiers = {"cpu", "disk"}
    if find_server_binary() is not None:
        tiers.add("remote")
    if nixl_available():
        tiers.add("nixl")
    return tiers


@pytest.mark.slow
def test_sweep_quick_reports_every_tier_and_size_and_plots(tmp_path: Path) -> None:
    from lmcache_async_bench import sweep

    work = tmp_path / "work"
    said: list[str] = []
    results = sweep.run(BenchOptions(quick=True, reps=1, workdir=str(work), progress=said.append))
    assert results
    assert not list(work.iterdir()), "the suite left files behind"

    tiers = _expected_tiers()
    points = {(r.params["tier"], r.params["series"], r.params["size"]) for r in results}
    assert points == {(t, op, s) for t in tiers for op in ("put", "get") for s in sweep.QUICK_SIZES}
    if "nixl" not in tiers:
        assert any("nixl tier skipped" in m for m in said)
    for r in results:
        assert isinstance(r, Result)
        assert r.suite == "sweep" and r.unit == "GB/s" and r.higher_is_better
        assert r.params["panel"] == f"sweep: {r.params['tier']} tier"
        assert r.baseline_name
        assert r.baseline is not None and math.isfinite(r.baseline) and r.baseline > 0
        assert math.isfinite(r.value) and r.value > 0
    assert format_table(results)

    pytest.importorskip("matplotlib")
    from lmcache_async_bench.plot import plot_results

    png = tmp_path / "sweep.png"
    plot_results(results, str(png))
    assert png.read_bytes()[:8] == PNG_MAGIC


def test_sweep_tiers_option_rejects_unknown_tiers() -> None:
    from lmcache_async_bench import sweep

    with pytest.raises(ValueError, match="unknown tiers"):
        sweep.run(BenchOptions(quick=True, reps=1, extra={"tiers": ["tape"]}))


def test_plot_draws_one_panel_per_sweep_tier(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.image

    from lmcache_async_bench.plot import plot_results

    sizes = (1 << 16, 1 << 20, 1 << 24)
    results = [
        Result(
            "sweep",
            f"{tier} {op} {s}",
            s / 1e9 * k,
            "GB/s",
            f"{tier} baseline",
            s / 1e9 * (k + 1),
            True,
            params={"size": s, "panel": f"sweep: {tier} tier", "series": op, "tier": tier},
        )
        for tier in ("cpu", "disk", "remote")
        for k, op in enumerate(("put", "get"), start=1)
        for s in sizes
    ]
    png = tmp_path / "sweep.png"
    plot_results(results, str(png))
    assert png.read_bytes()[:8] == PNG_MAGIC
    height, width = matplotlib.image.imread(str(png)).shape[:2]
    assert width > height  # two panels per row, two rows for three tiers


def test_sweep_sizes_and_labels() -> None:
    from lmcache_async_bench import sweep

    assert [sweep.size_label(s) for s in sweep.SIZES] == ["64 KiB", "256 KiB", "1 MiB", "4 MiB", "16 MiB"]
    assert set(sweep.QUICK_SIZES) <= set(sweep.SIZES)

"""The ``--plot`` figure: throughput vs entry size per tier (and vs concurrency), with baselines.

Reads the ``Result.params`` convention documented in :mod:`lmcache_async.bench.common`:

* results with ``params["size"]`` and no ``"concurrency"`` are points of throughput-vs-size
  curves, one panel per ``params["panel"]`` (default: the suite), one line per
  ``params["series"]`` (default: the figure name); times are converted to GB/s with the size;
  the same-run baseline of each series is drawn dashed in the same colour;
* results with ``params["concurrency"]`` are points of throughput-vs-concurrency curves
  (value and baseline already throughputs), one panel per ``params["panel"]``;
* when no result carries either, a bar chart of every ratio to its baseline is drawn instead,
  so ``--plot`` always writes a file.

matplotlib is the optional ``cli`` extra; it is imported only here, with the Agg backend.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from lmcache_async.bench.common import Result, throughput_gbs


def _matplotlib() -> Any:
    try:
        import matplotlib
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError(
            "--plot needs matplotlib: pip install 'lmcache-async[cli]' (or: pip install matplotlib)"
        ) from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _size_label(n: float) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            v = n / div
            return f"{v:g} {unit}"
    return f"{n:g} B"


def _panels(results: list[Result]) -> tuple[dict[str, list[Result]], dict[str, list[Result]]]:
    by_size: dict[str, list[Result]] = defaultdict(list)
    by_conc: dict[str, list[Result]] = defaultdict(list)
    for r in results:
        p = r.params or {}
        if "concurrency" in p:
            by_conc[str(p.get("panel", r.suite))].append(r)
        elif "size" in p and throughput_gbs(r)[0] is not None:
            by_size[str(p.get("panel", r.suite))].append(r)
    return by_size, by_conc


def _draw_size_panel(ax: Any, title: str, rs: list[Result]) -> None:
    series: dict[str, list[Result]] = defaultdict(list)
    for r in rs:
        series[str(r.params.get("series", r.name))].append(r)
    for i, (label, pts) in enumerate(sorted(series.items())):
        pts.sort(key=lambda r: float(r.params["size"]))
        xs = [float(r.params["size"]) for r in pts]
        ys = [throughput_gbs(r)[0] for r in pts]
        color = f"C{i % 10}"
        ax.plot(xs, ys, "o-", color=color, label=label)
        base = [(x, throughput_gbs(r)[1]) for x, r in zip(xs, pts, strict=True)]
        base = [(x, b) for x, b in base if b is not None]
        if base:
            names = {r.baseline_name for r in pts if r.baseline_name}
            ax.plot([x for x, _ in base], [b for _, b in base], "--", color=color, alpha=0.6,
                    label=f"baseline: {', '.join(sorted(names))}" if names else "baseline")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("entry size")
    ax.set_ylabel("GB/s")
    ax.set_title(title)
    ticks = sorted({float(r.params["size"]) for r in rs})
    ax.set_xticks(ticks)
    ax.set_xticklabels([_size_label(t) for t in ticks], rotation=30, fontsize=7)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=6)


def _draw_conc_panel(ax: Any, title: str, rs: list[Result]) -> None:
    series: dict[str, list[Result]] = defaultdict(list)
    for r in rs:
        series[str(r.params.get("series", r.name))].append(r)
    for i, (label, pts) in enumerate(sorted(series.items())):
        pts.sort(key=lambda r: int(r.params["concurrency"]))
        xs = [int(r.params["concurrency"]) for r in pts]
        color = f"C{i % 10}"
        ax.plot(xs, [r.value for r in pts], "o-", color=color, label=label)
        if all(r.baseline is not None for r in pts):
            ax.plot(xs, [r.baseline for r in pts], "--", color=color, alpha=0.6,
                    label=f"baseline: {pts[0].baseline_name}")
    ax.set_xscale("log", base=2)
    levels = sorted({int(r.params["concurrency"]) for r in rs})
    ax.set_xticks(levels)
    ax.set_xticklabels([str(n) for n in levels])
    ax.set_ylim(bottom=0)
    ax.set_xlabel(title.split(": ", 1)[-1])
    ax.set_ylabel(rs[0].unit)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=6)


def _draw_ratios(plt: Any, results: list[Result], path: str) -> None:
    rs = [r for r in results if r.ratio is not None]
    fig, ax = plt.subplots(figsize=(9, max(2.5, 0.3 * len(rs) + 1)))
    labels = [f"{r.suite}: {r.name}"[:70] for r in rs]
    ax.barh(range(len(rs)), [r.ratio for r in rs], color=["C2" if r.met is not False else "C3" for r in rs])
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_yticks(range(len(rs)))
    ax.set_yticklabels(labels, fontsize=7)
    ax.set_xlabel("value / same-run baseline")
    ax.set_title("ratios to the physical baseline (red: target missed)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_results(results: list[Result], path: str) -> None:
    """Write a PNG of ``results`` to ``path`` (see the module docstring for what is drawn).

    ``RuntimeError`` with an install hint when matplotlib is missing; ``ValueError`` when
    ``results`` is empty.
    """
    if not results:
        raise ValueError("plot_results: no results to plot")
    plt = _matplotlib()
    by_size, by_conc = _panels(results)
    panels = [("size", k, v) for k, v in sorted(by_size.items())] + [("conc", k, v) for k, v in sorted(by_conc.items())]
    if not panels:
        _draw_ratios(plt, results, path)
        return
    cols = 2 if len(panels) > 1 else 1
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 4.2 * rows), squeeze=False)
    for ax, (kind, title, rs) in zip(axes.flat, panels, strict=False):
        if kind == "size":
            _draw_size_panel(ax, title, rs)
        else:
            _draw_conc_panel(ax, title, rs)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.suptitle("lmcache_async benchmarks (dashed: same-run physical baseline)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

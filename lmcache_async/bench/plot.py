"""The ``--plot`` figure: throughput vs entry size per tier (and vs concurrency), with baselines.

Reads the ``Result.params`` convention documented in :mod:`lmcache_async.bench.common`:

* results with ``params["size"]`` and no ``"concurrency"`` are points of throughput-vs-size
  curves, one panel per ``params["panel"]`` (default: the suite), one line per
  ``params["series"]`` (default: the figure name); times are converted to GB/s with the size;
  the same-run baseline of each series is drawn dashed in the same colour; a series keeps its
  colour in every panel (``put`` is the same colour in each tier's panel); the x axis is
  logarithmic, labelled in KiB/MiB at the measured sizes; the y axis starts at 0, or is
  logarithmic when a panel's values span more than :data:`LOG_Y_SPAN`;
* results with ``params["concurrency"]`` are points of throughput-vs-concurrency curves
  (value and baseline already throughputs), one panel per ``params["panel"]``;
* when no result carries either, a bar chart of every ratio to its baseline is drawn instead,
  so ``--plot`` always writes a file.

Panels are laid out two per row. When every panel name starts with the same ``"<suite>: "``
(``sweep: cpu tier``, ``sweep: disk tier``, ...), that prefix moves to the figure's title.

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


def _series_colors(panels: dict[str, list[Result]]) -> dict[str, str]:
    """One colour per series name across all size panels, in order of first appearance."""
    colors: dict[str, str] = {}
    for rs in panels.values():
        for r in rs:
            label = str(r.params.get("series", r.name))
            if label not in colors:
                colors[label] = f"C{len(colors) % 10}"
    return colors


_MARKERS = "os^vDP*X"


def _draw_size_panel(ax: Any, title: str, rs: list[Result], colors: dict[str, str] | None = None) -> None:
    series: dict[str, list[Result]] = defaultdict(list)
    for r in rs:
        series[str(r.params.get("series", r.name))].append(r)
    colors = colors or _series_colors({title: rs})
    order = list(colors)
    seen: list[float] = []  # every value and baseline drawn, for the y scale
    for label, pts in series.items():
        pts.sort(key=lambda r: float(r.params["size"]))
        xs = [float(r.params["size"]) for r in pts]
        ys = [throughput_gbs(r)[0] for r in pts]
        i = order.index(label) if label in order else len(order)
        color = colors.get(label, f"C{i % 10}")
        ax.plot(xs, ys, "-", marker=_MARKERS[i % len(_MARKERS)], ms=5, lw=1.8, color=color, label=label)
        seen.extend(y for y in ys if y is not None)
        pairs = [(x, throughput_gbs(r)[1]) for x, r in zip(xs, pts, strict=True)]
        base = [(x, b) for x, b in pairs if b is not None]
        if base:
            names = sorted({r.baseline_name for r in pts if r.baseline_name})
            ax.plot(
                [x for x, _ in base],
                [b for _, b in base],
                "--",
                marker=_MARKERS[i % len(_MARKERS)],
                ms=3,
                lw=1.2,
                mfc="none",
                color=color,
                alpha=0.75,
                label=f"{label} baseline: {', '.join(names)}" if names else f"{label} baseline",
            )
            seen.extend(b for _, b in base)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("entry size")
    _set_gbs_scale(ax, seen)
    ax.set_title(title, fontsize=10)
    ticks = sorted({float(r.params["size"]) for r in rs})
    ax.set_xticks(ticks)
    ax.set_xticklabels([_size_label(t) for t in ticks], fontsize=8)
    ax.minorticks_off()
    if len(ticks) > 1:  # a little room left and right of the outermost sizes
        ax.set_xlim(ticks[0] / 1.4, ticks[-1] * 1.4)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=7, loc="best", framealpha=0.85)


LOG_Y_SPAN = 20.0
"""A size panel whose values span more than this factor gets a logarithmic y axis (so a tier
at a tenth of its baseline stays readable beside one at full speed); otherwise y starts at 0."""


def _set_gbs_scale(ax: Any, values: list[float]) -> None:
    positive = [v for v in values if v > 0]
    lo, hi = (min(positive), max(positive)) if positive else (0.0, 0.0)
    if lo > 0 and hi / lo > LOG_Y_SPAN:
        from matplotlib.ticker import FuncFormatter

        ax.set_yscale("log")
        ax.set_ylim(lo / 1.5, hi * 1.5)
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
        ax.set_ylabel("GB/s (log scale)")
    else:
        ax.set_ylim(0, hi * 1.12 if hi > 0 else 1.0)
        ax.set_ylabel("GB/s")


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
            ax.plot(
                xs, [r.baseline for r in pts], "--", color=color, alpha=0.6, label=f"baseline: {pts[0].baseline_name}"
            )
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


def _common_prefix(titles: list[str]) -> str:
    """``"sweep: "`` when every title is ``"sweep: <something>"`` (and there are several), else ``""``."""
    heads = {t.split(": ", 1)[0] + ": " for t in titles if ": " in t}
    if len(titles) < 2 or len(heads) != 1 or not all(": " in t for t in titles):
        return ""
    return heads.pop()


def plot_results(results: list[Result], path: str) -> None:
    """Write a PNG of ``results`` to ``path`` (see the module docstring for what is drawn).

    ``RuntimeError`` with an install hint when matplotlib is missing; ``ValueError`` when
    ``results`` is empty.
    """
    if not results:
        raise ValueError("plot_results: no results to plot")
    plt = _matplotlib()
    by_size, by_conc = _panels(results)
    # panels in the order the suites produced them (the sweep: cpu, disk, remote, nixl)
    panels = [("size", k, v) for k, v in by_size.items()] + [("conc", k, v) for k, v in by_conc.items()]
    if not panels:
        _draw_ratios(plt, results, path)
        return
    prefix = _common_prefix([title for _, title, _ in panels])
    colors = _series_colors(by_size)
    cols = 2 if len(panels) > 1 else 1
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 4.4 * rows), squeeze=False)
    for ax, (kind, title, rs) in zip(axes.flat, panels, strict=False):
        shown = title[len(prefix) :] if prefix else title
        if kind == "size":
            _draw_size_panel(ax, shown, rs, colors)
        else:
            _draw_conc_panel(ax, shown, rs)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    what = prefix[:-2] if prefix else "lmcache_async benchmarks"
    kinds = {kind for kind, _, _ in panels}
    if kinds == {"size"}:
        what += ": throughput vs entry size"
    elif kinds == {"conc"}:
        what += ": throughput vs concurrency"
    fig.suptitle(f"{what} (dashed: same-run physical baseline)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

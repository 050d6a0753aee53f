"""The ``--plot`` figure: throughput curves per tier, and every other figure as a bar beside its
baseline and target.

Reads the ``Result.params`` convention documented in :mod:`lmcache_async_bench.common`:

* results with ``params["size"]`` and no ``"concurrency"`` are points of throughput-vs-size
  curves, one panel per ``params["panel"]`` (default: the suite), one line per
  ``params["series"]`` (default: the figure name); times are converted to GB/s with the size;
  the same-run baseline of each series is drawn dashed in the same colour, a target dotted; a
  series keeps its colour in every panel (``put`` is the same colour in each tier's panel); the
  legend gives each series' smallest and largest ratio to its baseline; the x axis is logarithmic, labelled
  in KiB/MiB at the measured sizes; the y axis starts at 0, or is logarithmic when a panel's
  values span more than :data:`LOG_Y_SPAN`;
* results with ``params["concurrency"]`` are points of throughput-vs-concurrency curves
  (value and baseline already throughputs), one panel per ``params["panel"]``;
* every other result is a bar below the curves: the ratio to its same-run baseline, or (no
  baseline) its value relative to its target. Each bar's label gives the absolute values with
  units and whether lower or higher is better; its target is a black tick; green bars met
  their target, red ones missed it, grey ones have none. Results with neither baseline nor
  target are left to the table (the panel title says how many).

Every y axis (curves) and every bar label says whether lower or higher is better. Curve panels
are laid out two per row. When every curve panel name starts with the same ``"<suite>: "``
(``sweep: cpu tier``, ``sweep: disk tier``, ...), that prefix moves to the figure's title.

matplotlib is the optional ``cli`` extra; it is imported only here, with the Agg backend.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from typing import Any

from .common import Result, throughput_gbs

__all__ = [
    "DASH",
    "LOG_Y_SPAN",
    "MET_COLOR",
    "MISSED_COLOR",
    "MISSED_MARK",
    "NEUTRAL_COLOR",
    "TARGET_COLOR",
    "TIMES",
    "bar_label",
    "plot_formats",
    "plot_results",
]

MET_COLOR = "tab:green"
MISSED_COLOR = "tab:red"
NEUTRAL_COLOR = "0.62"
"""Bars of figures without a target: neither good nor bad."""
TARGET_COLOR = "black"
TIMES = "\u00d7"
DASH = "\u2013"
MISSED_MARK = "x"


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


def plot_formats() -> set[str]:
    """File name extensions :func:`plot_results` can write (``png``, ``svg``, ``pdf``, ...).

    ``RuntimeError`` with an install hint when matplotlib is missing.
    """
    _matplotlib()
    from matplotlib.backend_bases import FigureCanvasBase

    return set(FigureCanvasBase.get_supported_filetypes())


def _size_label(n: float) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            v = n / div
            return f"{v:g} {unit}"
    return f"{n:g} B"


def _better(higher: bool) -> str:
    return "higher is better" if higher else "lower is better"


def _panels(
    results: list[Result],
) -> tuple[dict[str, list[Result]], dict[str, list[Result]], list[Result]]:
    """``(size panels, concurrency panels, the rest)``."""
    by_size: dict[str, list[Result]] = defaultdict(list)
    by_conc: dict[str, list[Result]] = defaultdict(list)
    rest: list[Result] = []
    for r in results:
        p = r.params or {}
        if "concurrency" in p:
            by_conc[str(p.get("panel", r.suite))].append(r)
        elif "size" in p and throughput_gbs(r)[0] is not None:
            by_size[str(p.get("panel", r.suite))].append(r)
        else:
            rest.append(r)
    return by_size, by_conc, rest


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


def _ratio_range(pairs: list[tuple[float | None, float | None]]) -> str:
    """``" (0.40-0.92x baseline)"`` (smallest and largest ratio, typeset) of ``(value, baseline)``
    throughput pairs, or ``""``."""
    ratios = [v / b for v, b in pairs if v is not None and b is not None and b > 0]
    if not ratios:
        return ""
    lo, hi = min(ratios), max(ratios)
    span = f"{lo:.2f}{TIMES}" if math.isclose(lo, hi, rel_tol=5e-3) else f"{lo:.2f}{DASH}{hi:.2f}{TIMES}"
    return f" ({span} baseline)"


def _target_value(r: Result) -> float | None:
    """The value ``r`` must reach to meet its target, in ``r.unit`` (None without a target)."""
    if r.target is None:
        return None
    if r.baseline is None:
        return r.target
    return r.baseline * r.target


def _target_gbs(r: Result) -> float | None:
    tv = _target_value(r)
    if tv is None:
        return None
    return throughput_gbs(dataclasses.replace(r, value=tv))[0]


def _mark_missed(ax: Any, xs: list[float], ys: list[float | None], pts: list[Result]) -> bool:
    miss = [(x, y) for x, y, r in zip(xs, ys, pts, strict=True) if r.met is False and y is not None]
    if miss:
        ax.plot([x for x, _ in miss], [y for _, y in miss], "x", color=MISSED_COLOR, ms=9, mew=2, zorder=5)
    return bool(miss)


def _draw_size_panel(ax: Any, title: str, rs: list[Result], colors: dict[str, str] | None = None) -> bool:
    """Draw one throughput-vs-size panel; True when it drew a target."""
    series: dict[str, list[Result]] = defaultdict(list)
    for r in rs:
        series[str(r.params.get("series", r.name))].append(r)
    colors = colors or _series_colors({title: rs})
    order = list(colors)
    seen: list[float] = []  # every value, baseline and target drawn, for the y scale
    drew_target = False
    for label, pts in series.items():
        pts.sort(key=lambda r: float(r.params["size"]))
        xs = [float(r.params["size"]) for r in pts]
        pairs = [throughput_gbs(r) for r in pts]
        ys = [v for v, _ in pairs]
        i = order.index(label) if label in order else len(order)
        color = colors.get(label, f"C{i % 10}")
        marker = _MARKERS[i % len(_MARKERS)]
        ax.plot(xs, ys, "-", marker=marker, ms=5, lw=1.8, color=color, label=f"{label}{_ratio_range(pairs)}")
        seen.extend(y for y in ys if y is not None)
        base = [(x, b) for x, (_, b) in zip(xs, pairs, strict=True) if b is not None]
        if base:
            names = sorted({r.baseline_name for r in pts if r.baseline_name})
            ax.plot(
                [x for x, _ in base],
                [b for _, b in base],
                "--",
                marker=marker,
                ms=3,
                lw=1.2,
                mfc="none",
                color=color,
                alpha=0.75,
                label=f"{label} baseline: {', '.join(names)}" if names else f"{label} baseline",
            )
            seen.extend(b for _, b in base)
        targets = [(x, _target_gbs(r)) for x, r in zip(xs, pts, strict=True)]
        tpts = [(x, t) for x, t in targets if t is not None]
        if tpts:
            ax.plot([x for x, _ in tpts], [t for _, t in tpts], ":", lw=1.6, color=color, label=f"{label} target")
            seen.extend(t for _, t in tpts)
            drew_target = True
        _mark_missed(ax, xs, ys, pts)
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
    _, labels = ax.get_legend_handles_labels()
    ncol = 2 if max(map(len, labels), default=0) <= LEGEND_WIDE else 1  # long labels: one column, no clipping
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=ncol)  # below: never over the data
    return drew_target


LEGEND_WIDE = 48
"""Legend labels longer than this many characters get a one-column legend (two would be wider
than the panel)."""


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
        ax.set_ylabel(f"GB/s, log scale ({_better(True)})")
    else:
        ax.set_ylim(0, hi * 1.12 if hi > 0 else 1.0)
        ax.set_ylabel(f"GB/s ({_better(True)})")


def _draw_conc_panel(ax: Any, title: str, rs: list[Result]) -> bool:
    """Draw one throughput-vs-concurrency panel; True when it drew a target."""
    series: dict[str, list[Result]] = defaultdict(list)
    for r in rs:
        series[str(r.params.get("series", r.name))].append(r)
    drew_target = False
    for i, (label, pts) in enumerate(sorted(series.items())):
        pts.sort(key=lambda r: int(r.params["concurrency"]))
        xs = [float(r.params["concurrency"]) for r in pts]
        color = f"C{i % 10}"
        pairs: list[tuple[float | None, float | None]] = [(r.value, r.baseline) for r in pts]
        ax.plot(xs, [r.value for r in pts], "o-", color=color, label=f"{label}{_ratio_range(pairs)}")
        if all(r.baseline is not None for r in pts):
            ax.plot(
                xs, [r.baseline for r in pts], "--", color=color, alpha=0.6, label=f"baseline: {pts[0].baseline_name}"
            )
        tpts = [(x, t) for x, t in zip(xs, (_target_value(r) for r in pts), strict=True) if t is not None]
        if tpts:
            ax.plot([x for x, _ in tpts], [t for _, t in tpts], ":", lw=1.6, color=color, label=f"{label} target")
            drew_target = True
        _mark_missed(ax, xs, [r.value for r in pts], pts)
    ax.set_xscale("log", base=2)
    levels = sorted({int(r.params["concurrency"]) for r in rs})
    ax.set_xticks(levels)
    ax.set_xticklabels([str(n) for n in levels])
    ax.minorticks_off()
    ax.set_ylim(bottom=0)
    ax.set_xlabel(title.split(": ", 1)[-1])
    higher = sum(r.higher_is_better for r in rs) * 2 >= len(rs)
    ax.set_ylabel(f"{rs[0].unit} ({_better(higher)})")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)  # below: never over the data
    return drew_target


# ---- bars: every figure that is not a point of a curve -----------------------------------------
def _num(v: float) -> str:
    return f"{v:.4g}"


def _bound(r: Result) -> str:
    return ("<= " if r.target_kind == "max" else ">= ") + f"{r.target:g}"


def _bar_color(r: Result) -> str:
    return {True: MET_COLOR, False: MISSED_COLOR, None: NEUTRAL_COLOR}[r.met]


def _clip(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 1] + "\u2026"


def bar_label(r: Result) -> str:
    """Two lines: the figure's name, then its absolute values with units (beside the baseline's,
    or the target's when there is no baseline) and which way is better. Long names are cut;
    numbers never are."""
    head = _clip(f"{r.suite}: {r.name}", 64)
    if r.baseline is not None:
        values = f"{_num(r.value)} {r.unit} vs {_clip(r.baseline_name or 'baseline', 30)} {_num(r.baseline)} {r.unit}"
    else:
        values = f"{_num(r.value)} {r.unit} (target {_bound(r)} {r.unit})"
    return f"{head}\n{values} \u00b7 {_better(r.higher_is_better)}"


def _bar_groups(rs: list[Result]) -> tuple[list[Result], list[Result], int]:
    """``(with a baseline, without a baseline but with a target, with neither)``."""
    ratio = [r for r in rs if r.ratio is not None]
    target = [r for r in rs if r.ratio is None and r.baseline is None and r.target]
    return ratio, target, len(rs) - len(ratio) - len(target)


def _bar_height(n: int) -> float:
    return max(1.9, 0.44 * n + 1.1)


def _draw_bars(ax: Any, rs: list[Result], against_target: bool, title: str) -> None:
    """One bar per result: ``value / baseline`` (or ``value / target`` when ``against_target``),
    the target as a black tick, the reference (1) as a dashed line."""
    xs = [r.value / r.target if against_target and r.target else (r.ratio or 0.0) for r in rs]
    ticks = [1.0 if against_target else r.target for r in rs]
    ys = list(range(len(rs)))
    ax.barh(ys, xs, color=[_bar_color(r) for r in rs], height=0.62, zorder=2)
    ref = "target" if against_target else "baseline"
    ax.axvline(1.0, color="0.3", lw=0.9, ls="--", zorder=1)
    drew_tick = False
    for y, t in zip(ys, ticks, strict=True):
        if t is not None and not against_target:
            ax.plot([t, t], [y - 0.42, y + 0.42], color=TARGET_COLOR, lw=2.2, zorder=4)
            drew_tick = True
    positive = [v for v in xs + [t for t in ticks if t is not None] + [1.0] if v > 0]
    lo, hi = min(positive), max(positive)
    if hi / lo > LOG_Y_SPAN:
        ax.set_xscale("log")
        ax.set_xlim(lo / 2, hi * 4)
        from matplotlib.ticker import FuncFormatter

        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
    else:
        ax.set_xlim(0, hi * 1.3)
    for y, x, t in zip(ys, xs, ticks, strict=True):
        at = max(x, t if t is not None and not against_target else 0.0)  # right of the bar and its tick
        ax.annotate(
            f"{x:.2f}{TIMES} {ref}", (at, y), xytext=(5, 0), textcoords="offset points", va="center", fontsize=7
        )
    ax.set_yticks(ys)
    ax.set_yticklabels([bar_label(r) for r in rs], fontsize=7)
    ax.invert_yaxis()  # the first figure on top, as in the table
    ax.set_xlabel(f"value / {ref}" + (" (log scale)" if hi / lo > LOG_Y_SPAN else ""))
    ax.set_title(title, fontsize=10)
    ax.grid(True, axis="x", alpha=0.3, zorder=0)
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles = [
        Patch(color=MET_COLOR, label="target met"),
        Patch(color=MISSED_COLOR, label="target missed"),
        Patch(color=NEUTRAL_COLOR, label="no target"),
        Line2D([], [], color="0.3", ls="--", lw=0.9, label=f"= {ref}"),
    ]
    if drew_tick:
        handles.append(Line2D([], [], color=TARGET_COLOR, lw=2.2, label="target"))
    ax.legend(handles=handles, fontsize=7, loc="lower right", framealpha=0.85)


def _common_prefix(titles: list[str]) -> str:
    """``"sweep: "`` when every title is ``"sweep: <something>"`` (and there are several), else ``""``."""
    heads = {t.split(": ", 1)[0] + ": " for t in titles if ": " in t}
    if len(titles) < 2 or len(heads) != 1 or not all(": " in t for t in titles):
        return ""
    return heads.pop()


def plot_results(results: list[Result], path: str) -> None:
    """Write a plot of ``results`` to ``path`` (PNG, or the format its extension names; see the
    module docstring for what is drawn).

    ``RuntimeError`` with an install hint when matplotlib is missing; ``ValueError`` when
    ``results`` is empty.
    """
    if not results:
        raise ValueError("plot_results: no results to plot")
    plt = _matplotlib()
    by_size, by_conc, rest = _panels(results)
    # panels in the order the suites produced them (the sweep: cpu, disk, remote, nixl)
    panels = [("size", k, v) for k, v in by_size.items()] + [("conc", k, v) for k, v in by_conc.items()]
    with_base, with_target, neither = _bar_groups(rest)
    bars: list[tuple[list[Result], bool, str]] = []
    if with_base:
        bars.append((with_base, False, "figures beside a same-run baseline: value / baseline"))
    if with_target:
        bars.append((with_target, True, "figures without a baseline: value / target"))
    if neither and bars:
        rs, against, title = bars[-1]
        bars[-1] = (rs, against, f"{title} ({neither} figures with neither baseline nor target: see the table)")

    cols = 2 if len(panels) > 1 else 1
    curve_rows = (len(panels) + cols - 1) // cols
    heights = [4.4] * curve_rows + [_bar_height(len(rs)) for rs, _, _ in bars]
    if not heights:  # nothing to draw against anything: still write a file that says so
        fig, ax = plt.subplots(figsize=(8, 2))
        ax.axis("off")
        ax.text(
            0.5,
            0.5,
            f"{len(results)} figures, none with a baseline or a target: see the table",
            ha="center",
            va="center",
        )
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return
    width = max(6.5 * cols, 12.0) if bars else 6.5 * cols
    fig = plt.figure(figsize=(width, sum(heights) + 0.4), layout="constrained")
    # curves and bars in subfigures of their own, so the bars' long labels leave the curves' width alone
    parts = [curve_rows * 4.4] if panels else []
    parts += [_bar_height(len(rs)) for rs, _, _ in bars]
    subs = list(fig.subfigures(len(parts), 1, height_ratios=parts, squeeze=False).flat)
    prefix = _common_prefix([title for _, title, _ in panels])
    colors = _series_colors(by_size)
    drew_target = False
    if panels:
        axes = subs.pop(0).subplots(curve_rows, cols, squeeze=False)
        for ax, (kind, title, rs) in zip(axes.flat, panels, strict=False):
            shown = title[len(prefix) :] if prefix else title
            if kind == "size":
                drew_target |= _draw_size_panel(ax, shown, rs, colors)
            else:
                drew_target |= _draw_conc_panel(ax, shown, rs)
        for ax in list(axes.flat)[len(panels) :]:
            ax.set_visible(False)
    for sub, (rs, against, title) in zip(subs, bars, strict=True):
        _draw_bars(sub.subplots(), rs, against, title)
    what = prefix[:-2] if prefix else "lmcache_async benchmarks"
    kinds = {kind for kind, _, _ in panels}
    if kinds == {"size"} and not bars:
        what += ": throughput vs entry size"
    elif kinds == {"conc"} and not bars:
        what += ": throughput vs concurrency"
    if panels:
        keys = "dashed: same-run physical baseline"
        if drew_target:
            keys += f"; dotted: target; {MISSED_MARK}: target missed"
        what += f"\n({keys})"  # a line of its own: a one-panel figure is narrow
    fig.suptitle(what, fontsize=11)
    fig.savefig(path, dpi=120)
    plt.close(fig)

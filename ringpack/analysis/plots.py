"""PNG plots of a report document (``ringpack report`` / ``ringpack simulate`` JSON), with matplotlib.

Every function takes the JSON document, so plots can be redrawn from a saved ``report.json``.
Each plan keeps one colour across all figures; times are the cost model's predicted seconds.

See docs/analysis.md, "The figures".
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "draw_all",
    "plot_lengths",
    "plot_rank_costs",
    "plot_imbalance",
    "plot_idle_saved",
    "default_rank_step",
    "overlapping_lines",
]

DPI = 110


def median_idle(plan: dict[str, Any]) -> float:
    """The median over a report entry's steps of their idle share (0 for an entry without steps)."""
    idle = [r["idle_fraction"] for r in plan["steps"]]
    return float(np.median(idle)) if idle else 0.0


#: Style of every figure, in force only while one is drawn: the caller's matplotlib settings stay as they are.
_STYLE = {
    "font.size": 10,
    "axes.titlesize": 11,
    "axes.labelsize": 10,
    "figure.titlesize": 12,
    "axes.spines.top": False,
    "axes.spines.right": False,
}


def _styled(plot):
    """Run a plot function under :data:`_STYLE`; matplotlib is imported on the first plot, not with the module."""

    @functools.wraps(plot)
    def wrapper(*args, **kwargs):
        import matplotlib

        with matplotlib.rc_context(_STYLE):
            return plot(*args, **kwargs)

    return wrapper


def _figure(nrows: int = 1, ncols: int = 1, *, figsize: tuple[float, float], **subplots: Any):
    """A figure on the Agg canvas and its axes, without pyplot (no GUI backend, no global figure list).

    The figure has the saved file's dpi, so the text sizes measured for the layout are those drawn.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, dpi=DPI)
    FigureCanvasAgg(fig)
    return fig, fig.subplots(nrows, ncols, **subplots)


def _colors(doc: dict[str, Any]) -> dict[str, Any]:
    import matplotlib

    cmap = matplotlib.colormaps["tab10"]
    return {p["name"]: cmap(i % 10) for i, p in enumerate(doc["plans"])}


def _time_unit(seconds: float) -> tuple[str, float]:
    """A unit that keeps the largest value readable: (name, divisor)."""
    for name, scale in (("h", 3600.0), ("min", 60.0), ("s", 1.0), ("ms", 1e-3)):
        if seconds >= 2 * scale:
            return name, scale
    return "us", 1e-6


def _seconds_per_cost(doc: dict[str, Any]) -> float:
    return 1.0 / doc["cost_model"]["flops_per_second"] if doc["cost_unit"] == "flop" else 1.0


def _config(doc: dict[str, Any]) -> dict[str, Any]:
    for p in doc["plans"]:
        if p.get("config"):
            return p["config"]
    return {}


def _save(fig, path: Path) -> Path:
    """Lay ``fig`` out once and draw it once into ``path``.

    The layout moves the axes so that titles, tick labels and the legends below the axes fit inside
    the figure. The figure keeps no layout engine, so saving does not lay it out again, and the file
    is the figure as sized (``bbox_inches="tight"`` would draw the whole figure twice).
    """
    from matplotlib.layout_engine import TightLayoutEngine

    TightLayoutEngine().execute(fig)
    # zlib level 3 instead of PIL's 6: about half the encoding time for files about 3% larger
    fig.savefig(path, dpi=DPI, pil_kwargs={"compress_level": 3})
    return path


# ---------------------------------------------------------------------------------------- lengths
@_styled
def plot_lengths(doc: dict[str, Any], path: Path) -> Path:
    """Histogram of ``doc["lengths"]`` (log-log) with one rank's and one CP group's budget, as a PNG at ``path``."""
    hist = doc["lengths"]["histogram"]
    edges, counts = np.asarray(hist["edges"], dtype=float), np.asarray(hist["counts"])
    stats = doc["lengths"]
    fig, ax = _figure(figsize=(8, 4.2))
    ax.bar(edges[:-1], counts, width=np.diff(edges), align="edge", color="#4c72b0", edgecolor="white", linewidth=0.5)
    ax.set_xscale("log")
    ax.set_yscale("symlog", linthresh=1)
    ax.set_xlabel("sample length (tokens, log scale)")
    ax.set_ylabel("number of samples")
    cfg = _config(doc)
    budget = cfg.get("tokens_per_rank")
    if budget:
        ax.axvline(budget, color="#c44e52", ls="--", lw=1.2, label=f"one CP rank's budget ({budget:,} tokens)")
        cap = budget * doc["cp"]
        note = "; longer samples are cut into documents" if stats["max"] > cap else ""
        ax.axvline(cap, color="#8c564b", ls=":", lw=1.5, label=f"one CP group (cp={doc['cp']}: {cap:,} tokens{note})")
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=1, frameon=False)
    ax.set_title(
        f"Sample lengths: {stats['samples']:,} samples, {stats['tokens']:,} tokens; median {stats['median']:,.0f}, "
        f"p99 {stats['p99']:,.0f}, max {stats['max']:,}"
    )
    return _save(fig, path)


# ------------------------------------------------------------------------------------- rank costs
def default_rank_step(doc: dict[str, Any]) -> int:
    """A typical step of every plan: the one whose idle share is nearest each plan's median step.

    Each plan ranks its steps by idle share; the step chosen is the one whose worst distance from
    the middle rank, over the plans, is least (the first such step on ties). The step a table or
    plot shows then is neither plan's best nor its worst.

    Args:
        doc: a report document (``doc["plans"]``, each with ``steps`` rows holding ``idle_fraction``).

    Returns:
        A step index every plan has (0 for plans without steps).
    """
    plans = [p for p in doc["plans"] if p["steps"]]
    n = min((len(p["steps"]) for p in plans), default=0)
    if n <= 1:
        return 0
    distance = np.zeros(n)
    for p in plans:
        idle = np.array([r["idle_fraction"] for r in p["steps"][:n]])
        rank = np.argsort(np.argsort(idle, kind="stable"), kind="stable") / (n - 1)  # 0: least idle, 1: most
        distance = np.maximum(distance, np.abs(rank - 0.5))
    return int(np.argmin(distance))


@_styled
def plot_rank_costs(doc: dict[str, Any], path: Path, step: int | None = None) -> Path | None:
    """Per-GPU busy time in one step (default :func:`default_rank_step`), one panel per plan, as a PNG at ``path``.

    Returns None, writing nothing, when no plan has per-GPU costs (``rank_busy``).
    """
    plans = [p for p in doc["plans"] if p["steps"] and p["steps"][0].get("rank_busy") is not None]
    if not plans:
        return None
    step = default_rank_step(doc) if step is None else step
    colors = _colors(doc)
    to_s = _seconds_per_cost(doc)
    rows_of = {p["name"]: p["steps"][min(step, len(p["steps"]) - 1)] for p in plans}
    top = max(r["step_seconds"] for r in rows_of.values())
    unit, scale = _time_unit(top)
    n = len(plans)
    ncols = min(3, n)
    nrows = -(-n // ncols)
    dp, cp = doc["dp"], doc["cp"]
    from matplotlib.collections import PolyCollection

    fig, axes = _figure(nrows, ncols, figsize=(4.3 * ncols, 3.4 * nrows), sharey=True, squeeze=False)
    x = np.arange(dp * cp)
    gpu_gap = x + np.repeat(np.arange(dp), cp) * 0.6  # a small gap between DP ranks
    for ax, p in zip(axes.flat, plans):
        row = rows_of[p["name"]]
        busy = np.asarray(row["rank_busy"], dtype=float).reshape(-1) * to_s / scale
        step_time = row["step_seconds"] / scale
        shades = np.tile(np.linspace(1.0, 0.55, cp), dp) if cp > 1 else np.ones(dp)
        base = np.asarray(colors[p["name"]])[:3]
        # One collection of bars per plan: its cost does not grow with the GPU count as one patch per bar would.
        left, right = gpu_gap - 0.45, gpu_gap + 0.45
        bars = np.stack([np.c_[left, 0 * busy], np.c_[left, busy], np.c_[right, busy], np.c_[right, 0 * busy]], axis=1)
        ax.add_collection(
            PolyCollection(
                bars, facecolors=base * shades[:, None] + (1 - shades[:, None]), edgecolors=base, linewidths=0.4
            ),
            autolim=False,
        )
        margin = 0.05 * (right[-1] - left[0])  # the x margins ax.bar leaves
        ax.set_xlim(left[0] - margin, right[-1] + margin)
        ax.axhline(step_time, color="black", ls="--", lw=1)
        ax.text(gpu_gap[-1] + 0.5, step_time, " step", va="bottom", ha="right", fontsize=8)
        ax.set_title(
            f"{p['name']}: idle {100 * row['idle_fraction']:.1f}% (median step {100 * median_idle(p):.1f}%)",
            color=base,
        )
        if dp * cp <= 32:
            centers = [gpu_gap[d * cp : (d + 1) * cp].mean() for d in range(dp)]
            ax.set_xticks(centers, [f"DP {d}" for d in range(dp)], fontsize=8)
        else:
            ax.set_xticks([])
        ax.set_xlabel(f"GPU (grouped by DP rank; {cp} CP ranks each)")
    for ax in axes[:, 0]:
        ax.set_ylabel(f"busy time ({unit})")
    for ax in list(axes.flat)[n:]:
        ax.remove()  # an empty grid cell: not laid out or drawn
    ax0 = axes.flat[0]
    ax0.set_ylim(0, top / scale * 1.12)
    steps = min(len(p["steps"]) for p in plans)
    fig.suptitle(
        f"Per-GPU busy time in step {step} of 0-{steps - 1} (compute, predicted); "
        "dashed: step time, the gap above a bar is idle"
    )
    return _save(fig, path)


# -------------------------------------------------------------------------------------- imbalance
#: One marker per plan (cycled), so lines that coincide still show every plan's points.
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">")
#: Two plans' imbalance series closer than this (relative, every step) are drawn on top of each other.
_SAME_LINE_RTOL = 2e-3


def overlapping_lines(doc: dict[str, Any]) -> dict[str, str]:
    """``{plan: earlier plan}`` for each plan whose per-step imbalance equals an earlier plan's, to the width of a line.

    Such lines lie on top of each other in :func:`plot_imbalance`; its legend names the plan each
    one covers.
    """
    series = {p["name"]: np.array([r["imbalance"] for r in p["steps"]]) for p in doc["plans"]}
    same: dict[str, str] = {}
    names = list(series)
    for k, name in enumerate(names):
        for other in names[:k]:
            a, b = series[name], series[other]
            if a.shape == b.shape and a.size and np.allclose(a, b, rtol=_SAME_LINE_RTOL, atol=0.0):
                same[name] = same.get(other, other)
                break
    return same


@_styled
def plot_imbalance(doc: dict[str, Any], path: Path) -> Path:
    """Imbalance and idle share per step, one line per plan: each plan its colour and marker, the
    baseline dashed; a plan whose line covers another's says so in the legend."""
    colors = _colors(doc)
    fig, (ax1, ax2) = _figure(2, 1, figsize=(9, 6), sharex=True)
    max_steps = max(len(p["steps"]) for p in doc["plans"])
    every = max(1, -(-max_steps // 40))  # at most about 40 markers per line
    same = overlapping_lines(doc)
    for k, p in enumerate(doc["plans"]):
        steps = np.array([r["step"] for r in p["steps"]])
        imb = np.array([r["imbalance"] for r in p["steps"]])
        idle = np.array([r["idle_fraction"] for r in p["steps"]]) * 100
        baseline, covers = p["name"] == doc["baseline"], p["name"] in same
        style = dict(
            color=colors[p["name"]],
            lw=2.2 if baseline else 1.6,
            ls=(0, (2, 2)) if covers else "--" if baseline else "-",  # a covering line leaves gaps to see through
            marker=_MARKERS[k % len(_MARKERS)],
            markevery=every,
            ms=4 if covers else 7,  # a covering line's markers sit inside those of the line it covers
            mfc="none",
            mew=1.2,
            zorder=10 + k,
        )
        label = p["name"] + (f" (on top of {same[p['name']]})" if p["name"] in same else "")
        ax1.plot(steps, imb, label=label, **style)
        ax2.plot(steps, idle, **style)
    ax1.axhline(1.0, color="gray", lw=0.8)
    ax1.set_ylabel("imbalance\n(step time / mean GPU busy)")
    ax1.set_ylim(bottom=0.98)
    ax2.set_ylabel("idle GPU time (%)")
    ax2.set_ylim(bottom=0)
    ax2.set_xlabel("step")
    ax1.legend(
        fontsize=8,
        frameon=False,
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        title="plan (strategy/packing)",
        title_fontsize=8,
    )
    fig.suptitle(
        f"Imbalance over steps per plan (DP={doc['dp']} x CP={doc['cp']}; compute only; "
        f"dashed: baseline {doc['baseline']})"
    )
    return _save(fig, path)


# ------------------------------------------------------------------------------------- idle saved
@_styled
def plot_idle_saved(doc: dict[str, Any], path: Path) -> Path:
    """Busy and idle GPU time over all steps and predicted throughput, per plan, as a PNG at ``path``."""
    colors = _colors(doc)
    names = [p["name"] for p in doc["plans"]]
    summaries = [p["summary"] for p in doc["plans"]]
    idle = np.array([s["idle_gpu_seconds"] for s in summaries])
    total = np.array([s["predicted_seconds"] for s in summaries]) * doc["gpus"]
    busy = total - idle
    unit, scale = _time_unit(float(total.max()) if total.size else 1.0)
    base = next(s for p, s in zip(doc["plans"], summaries) if p["name"] == doc["baseline"])
    fig, (ax1, ax2) = _figure(1, 2, figsize=(12, 0.55 * len(names) + 2.2), gridspec_kw={"width_ratios": [1.4, 1]})
    y = np.arange(len(names))[::-1]
    from matplotlib.patches import Patch

    ax1.barh(y, busy / scale, color="#bbbbbb")
    ax1.barh(y, idle / scale, left=busy / scale, color=[colors[n] for n in names])
    for yi, s, b, i in zip(y, summaries, busy, idle):
        saved = base["idle_gpu_seconds"] - s["idle_gpu_seconds"]
        note = f"{100 * s['idle_fraction']:.1f}% idle"
        if saved > 0 and base["idle_gpu_seconds"] > 0:
            note += f", {100 * saved / base['idle_gpu_seconds']:.0f}% less idle than baseline"
        ax1.text((b + i) / scale, yi, "  " + note, va="center", fontsize=8)
    ax1.set_yticks(y, [n + (" (baseline)" if n == doc["baseline"] else "") for n in names])
    ax1.set_xlabel(f"GPU time over all steps (GPU-{unit}), compute only")
    ax1.set_xlim(0, total.max() / scale * 1.75)
    ax1.legend(
        handles=[
            Patch(color="#bbbbbb", label="busy"),
            Patch(facecolor="white", edgecolor="#444444", label="idle, waiting on the slowest rank (plan colour)"),
        ],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.14),
        ncol=2,
        fontsize=8,
        frameon=False,
    )
    ax1.set_title("Busy and idle GPU time")
    tps = np.array([s["tokens_per_second_comm"] for s in summaries])
    tps_compute = np.array([s["tokens_per_second"] for s in summaries])
    ax2.barh(y, tps_compute / 1e3, color="none", edgecolor="#888888", ls="--", label="compute only")
    ax2.barh(y, tps / 1e3, color=[colors[n] for n in names], height=0.6, label="with communication")
    for yi, v, s in zip(y, tps, summaries):
        sp = s.get("speedup_vs_baseline")
        ax2.text(v / 1e3, yi, f"  {sp:.2f}x" if sp else "", va="center", fontsize=8)
    ax2.set_yticks(y, [])
    ax2.set_xlabel("predicted throughput (thousand tokens/s, whole cluster)")
    ax2.set_xlim(0, max(tps_compute.max(), tps.max()) / 1e3 * 1.25)
    ax2.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, fontsize=8, frameon=False)
    ax2.set_title(f"Throughput ({doc['comm_model']['mode']} comm model)")
    fig.suptitle(f"Idle time saved vs the baseline ({doc['baseline']}), DP={doc['dp']} x CP={doc['cp']}")
    return _save(fig, path)


def draw_all(doc: dict[str, Any], out: Path, rank_step: int | None = None, progress: Any = None) -> dict[str, Path]:
    """Every plot the document supports, as ``{key: path}``."""
    out = Path(out)
    figures: dict[str, Path] = {}
    jobs = []
    if doc.get("lengths"):
        jobs.append(("lengths", lambda: plot_lengths(doc, out / "lengths.png")))
    jobs.append(("rank_costs", lambda: plot_rank_costs(doc, out / "rank_costs.png", step=rank_step)))
    jobs.append(("imbalance", lambda: plot_imbalance(doc, out / "imbalance.png")))
    jobs.append(("idle_saved", lambda: plot_idle_saved(doc, out / "idle_saved.png")))
    for key, job in jobs:
        path = job()
        if path is not None:
            figures[key] = path
        if progress is not None:
            progress.update(1)
    return figures

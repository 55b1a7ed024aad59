"""Figures of an evaluation's results dict and of a training run's metrics.jsonl, all PNG (Agg backend, written
atomically) and sized to read in a markdown report or a W&B media panel:

    plot_lengths            output-length CDF per family, one line per mode, the reference answers as a wide band
    plot_tradeoff           accuracy against decode speed-up, one point per mode (per-family accuracy small)
    plot_family_accuracy    grouped bars: one group per family and `all`, one bar per mode, the full model marked
    plot_training_curves    train loss (raw and smoothed) and the held-out loss at each evaluation
    plot_accuracy_vs_ratio  a pruning sweep: accuracy against pruning ratio, one line per mode (and criterion)

Every mode keeps one colour, line style and marker in every figure (`mode_styles`), so a reader learns them once.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Mapping, Sequence

from slimwise_train.distill.curves import (ema, log_scale, plot_training_curves, read_metrics,  # noqa: F401
                                           smoothing_span, start_to_end)
from slimwise_train.eval.modes import LM_EVAL_NAMES
from slimwise_train.eval.report import BOUND_BATCH, _decode_pruned, expert_bytes_bound, rows_for
from slimwise_train.utils.plotting import pyplot as _pyplot, save_png as _save

# One look per mode: full is black and drawn on top; a distill mode shares its undistilled twin's hue family.
MODE_STYLES = {
    "full": {"color": "#000000", "ls": "-", "marker": "o"},
    "conventional": {"color": "#d62728", "ls": "--", "marker": "s"},
    "slimwise": {"color": "#1f77b4", "ls": "-", "marker": "^"},
    "reverse": {"color": "#ff7f0e", "ls": "-.", "marker": "D"},
    "conventional_distill": {"color": "#9467bd", "ls": ":", "marker": "v"},
    "slimwise_distill": {"color": "#2ca02c", "ls": (0, (5, 1, 1, 1)), "marker": "P"},
}
# lm-eval's names of the student modes (slimwise_train.eval.generation.LM_EVAL_NAMES, reversed)
MODE_STYLE_ALIASES = {lm_eval: app for app, lm_eval in LM_EVAL_NAMES.items()}
_EXTRA_COLORS = ("#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f")
_EXTRA_LINESTYLES = ("-", "--", "-.", ":")
_EXTRA_MARKERS = ("X", "*", "h", "<", ">", "p", "d", "8")
REFERENCE_STYLE = {"color": "#f2b233", "lw": 6.0, "alpha": 0.55, "solid_capstyle": "butt"}
FULL_LABEL = "full model"


def mode_styles(modes: Sequence[str]) -> dict[str, dict]:
    """{mode: {color, ls, marker}}: the fixed look of a known mode; an unknown one gets a look no other mode in
    `modes` has (distinct line style + marker pair)."""
    styles = {m: dict(MODE_STYLES[MODE_STYLE_ALIASES.get(m, m)]) for m in modes
              if MODE_STYLE_ALIASES.get(m, m) in MODE_STYLES}
    used = {(str(s["ls"]), s["marker"]) for s in styles.values()}
    extra = 0
    for mode in modes:
        if mode in styles:
            continue
        while True:
            ls = _EXTRA_LINESTYLES[extra % len(_EXTRA_LINESTYLES)]
            marker = _EXTRA_MARKERS[(extra // len(_EXTRA_LINESTYLES)) % len(_EXTRA_MARKERS)]
            color = _EXTRA_COLORS[extra % len(_EXTRA_COLORS)]
            extra += 1
            if (ls, marker) not in used:
                break
        styles[mode] = {"color": color, "ls": ls, "marker": marker}
        used.add((ls, marker))
    return styles


def _by_mode(results: dict, keep_set: str | None) -> dict[str, dict[str, dict]]:
    """{mode: {family or 'all': row}} of one keep set's table (full first, then the keep set's modes in run order)."""
    by_mode: dict[str, dict] = {}
    for row in rows_for(results, keep_set):
        by_mode.setdefault(row["mode"], {})[row["family"]] = row
    return by_mode


def _keep_set_line(results: dict, keep_set: str | None) -> str:
    if keep_set is None:
        return "full model only (no keep set)"
    info = results["keep_sets"][keep_set]
    kept = info["num_kept"]
    kept_text = str(kept[0]) if len(set(kept)) == 1 else f"{min(kept)}-{max(kept)}"
    return f"keep set {keep_set}: {kept_text} of {info['num_experts'][0]} experts kept per layer"


# ----------------------------------------------------------------------------------------------- length CDFs
def _cdf(values) -> tuple[list, list]:
    """Step coordinates of an empirical CDF, starting at 0."""
    values = sorted(values)
    return [values[0], *values], [0.0, *((k + 1) / len(values) for k in range(len(values)))]


BUDGET_REACH = 1.25  # the budget line is drawn when it lies within this factor of the longest length


def length_xlim(lengths: Sequence[float], budget: float) -> tuple[float, float]:
    """x range of a length panel: the data, from 0.8x the shortest length (not 0: short answers left most of the
    axis empty) to a little past the longest length, or past the budget line when it lies within BUDGET_REACH x
    the longest length. A budget further out (it is 2x the longest reference answer by default) would leave half
    the axis empty: it is named in the panel's title instead, where no length reaches it."""
    lo, longest = 0.8 * min(lengths), max(lengths)
    hi = max(budget, longest) if budget <= BUDGET_REACH * longest else longest
    return lo, hi + 0.04 * max(hi - lo, 1.0)


def plot_lengths(results: dict, keep_set: str | None, path: str | Path) -> None:
    """CDF of output lengths per family (one panel each), one line per mode, the reference answers as a wide
    amber band underneath and the budget as a vertical line where it lies near the data (`length_xlim`).

    Modes often coincide (full and reverse, conventional and slimwise, a distill mode and its undistilled twin):
    every mode has its own colour, dashes and markers (placed at staggered points), lines are slightly
    transparent, a tiny vertical offset keeps equal lines apart, and the full model is drawn on top."""
    plt = _pyplot()
    families = results["families"]
    runs = [r for r in results["runs"] if r["keep_set"] is None or r["keep_set"] == keep_set]
    styles = mode_styles([r["mode"] for r in runs])
    problem_family = [p["family"] for p in results["problems"]]
    fig, axes = plt.subplots(1, len(families), figsize=(4.4 * len(families), 3.8), squeeze=False)
    for ax, family in zip(axes[0], families):
        idx = [i for i, f in enumerate(problem_family) if f == family]
        ref = [results["problems"][i]["reference_length"] for i in idx]
        shown = []
        if idx and None not in ref:  # lm-eval runs without logged samples know no references
            ax.step(*_cdf(ref), where="post", label="reference answers", zorder=1, **REFERENCE_STYLE)
            shown += ref
        for k, run in enumerate(runs):
            lengths = [run["length"][i] for i in idx]
            if not lengths:
                continue
            shown += lengths
            xs, ys = _cdf(lengths)
            offset = 0.006 * (k - (len(runs) - 1) / 2)
            style = styles[run["mode"]]
            every = max(1, len(xs) // 6)
            is_full = run["mode"] == "full"
            ax.step(xs, [y + offset for y in ys], where="post", label=run["mode"], color=style["color"],
                    ls=style["ls"], lw=1.8 if is_full else 1.5, alpha=0.9 if is_full else 0.8,
                    marker=style["marker"], markersize=4.5, markevery=(k % every, every),
                    zorder=4 if is_full else 3)
        budget = results["budget"][family]
        lo, hi = length_xlim(shown, budget) if shown else (0, budget * 1.04)
        title = f"{family}: {len(idx)} problems, budget {budget}"
        if budget <= hi:
            ax.axvline(budget, color="0.35", lw=1.0, ls=(0, (1, 2)), label=f"budget {budget}", zorder=2)
        else:
            title += "\n(budget right of the axis: no output reached it)"
        ax.set_xlim(lo, hi)
        ax.set_title(title, fontsize=9.5)
        ax.set_xlabel("output tokens (incl. EOS)")
        ax.set_ylim(0, 1.04)
        ax.grid(alpha=0.25, lw=0.5)
        ax.legend(fontsize=7, loc="best", framealpha=0.85)
    axes[0][0].set_ylabel("share of problems with length <= x")
    fig.suptitle(f"output length CDF, {_keep_set_line(results, keep_set)}" if keep_set else
                 "output length CDF, full model", fontsize=11)
    fig.tight_layout()
    _save(fig, path)


# ----------------------------------------------------------------------------------------------- trade-off
BOUND_AXIS = f"decode speed-up: expert-bytes bound at batch {BOUND_BATCH} (not measured)"
MEASURED_AXIS = "measured decode-step speed-up"


def tradeoff_points(results: dict, keep_set: str | None,
                    speedups: Mapping[str, float] | None = None) -> tuple[dict[str, float], str, list[str]]:
    """({mode: x}, axis label, notes) of `plot_tradeoff`: x is the measured speed-up where `speedups` (or the
    results' own `decode_speedups`) gives one, else 1.0 for a mode that decodes with the full model and the
    keep set's expert-bytes bound for one that decodes with the pruned pool or the student. Measured and bound
    numbers are never mixed on one axis: with `speedups`, a pruned-decode mode it lacks is left out (a note)."""
    speedups = speedups if speedups is not None else results.get("decode_speedups")
    info = results["keep_sets"].get(keep_set) if keep_set is not None else None
    bound = expert_bytes_bound(info) if info is not None else None
    xs, notes = {}, []
    for mode in _by_mode(results, keep_set):
        pruned = _decode_pruned(results, mode) and keep_set is not None
        if speedups:
            x = speedups.get(mode, None if pruned else 1.0)
            if x is None:
                notes.append(f"{mode}: no measured speed-up given")
                continue
        elif pruned:
            if bound is None:
                notes.append(f"{mode}: no expert-bytes bound (results without top_k)")
                continue
            x = bound
        else:
            x = 1.0
        xs[mode] = float(x)
    return xs, MEASURED_AXIS if speedups else BOUND_AXIS, notes


def _spread(ys: Sequence[float], gap: float, lo: float, hi: float) -> list[float]:
    """Label heights near `ys`, at least `gap` apart, within [lo, hi] (as far as they fit)."""
    order = sorted(range(len(ys)), key=lambda i: ys[i])
    pos = [ys[i] for i in order]
    for k in range(1, len(pos)):
        pos[k] = max(pos[k], pos[k - 1] + gap)
    if pos and pos[-1] > hi:
        pos[-1] = hi
        for k in range(len(pos) - 2, -1, -1):
            pos[k] = min(pos[k], pos[k + 1] - gap)
    if pos and pos[0] < lo:  # too many to fit: start at lo and let the top run over
        shift = lo - pos[0]
        pos = [p + shift for p in pos]
    out = [0.0] * len(ys)
    for k, i in enumerate(order):
        out[i] = pos[k]
    return out


def _family_abbreviations(families: Sequence[str]) -> dict[str, str]:
    """Short family names for point labels: initials when they differ (m, c, t), else the names."""
    initials = [f[0] for f in families]
    return dict(zip(families, initials if len(set(initials)) == len(initials) else families))


def plot_tradeoff(results: dict, keep_set: str | None, path: str | Path,
                  speedups: Mapping[str, float] | None = None, axis_note: str | None = None) -> None:
    """Accuracy against the decode speed-up of each mode's decoder: one large marker per mode at its pooled
    accuracy (all families), labelled with the mode, that accuracy and each family's; a thin bar with small
    ticks spans the family accuracies. The speed-up axis is the expert-bytes bound at batch 64 unless `speedups`
    ({mode: measured speed-up}, e.g. the demo's `bench decode` number) is given; the axis label says which, with
    `axis_note` after it (e.g. that the measured speed-up is above its bound). The full model's accuracy is a
    dotted line."""
    plt = _pyplot()
    by_mode = _by_mode(results, keep_set)
    xs, axis_label, notes = tradeoff_points(results, keep_set, speedups)
    if axis_note:
        axis_label = f"{axis_label} ({axis_note})"
    families = [f for f in results["families"] if any(f in cells for cells in by_mode.values())]
    short = _family_abbreviations(families)
    styles = mode_styles(list(by_mode))
    fig, ax = plt.subplots(figsize=(7.6, 5.2))
    points = {m: (x, by_mode[m]["all"]["accuracy"]) for m, x in xs.items()
              if by_mode[m].get("all", {}).get("accuracy") is not None}
    notes += [f"{m}: no accuracy" for m in xs if m not in points]
    values = sorted({round(x, 9) for x, _ in points.values()}) or [1.0]
    left, right = min(values), max(values)
    span = max(right - left, 0.5)
    lo_x, hi_x = left - 0.15 * span, right + 0.62 * span
    full = by_mode.get("full", {}).get("all", {}).get("accuracy")
    if full is not None:
        ax.axhline(full, color="0.3", lw=0.9, ls=":", zorder=1)
    groups: dict[float, list[str]] = {}
    for mode, (x, _) in points.items():
        groups.setdefault(round(x, 9), []).append(mode)
    # Several modes share an x (full and reverse at 1x; conventional, slimwise and the distill modes at the
    # bound): their labels go to the right, spread apart and joined to their point; their family ranges sit a
    # marker's width apart (never far enough to read as another speed-up).
    nudge = 0.011 * (hi_x - lo_x)
    for gx, modes in groups.items():
        for j, mode in enumerate(modes):
            fx = gx + (j - (len(modes) - 1) / 2) * nudge
            accs = [by_mode[mode][f]["accuracy"] for f in families
                    if by_mode[mode].get(f, {}).get("accuracy") is not None]
            if accs:
                ax.vlines(fx, min(accs), max(accs), color=styles[mode]["color"], lw=1.0, alpha=0.5, zorder=2)
                ax.plot([fx] * len(accs), accs, ls="none", marker="_", markersize=7, markeredgewidth=1.3,
                        color=styles[mode]["color"], alpha=0.8, zorder=2, clip_on=False)
        heights = _spread([points[m][1] for m in modes], 0.105, 0.05, 0.97)
        for mode, height in zip(modes, heights):
            x, acc = points[mode]
            style = styles[mode]
            ax.plot([x], [acc], ls="none", marker=style["marker"], markersize=10, color=style["color"],
                    markeredgecolor="white", markeredgewidth=1.0, zorder=5, clip_on=False, label=mode)
            per_family = "  ".join(f"{short[f]} {by_mode[mode][f]['accuracy']:.2f}" for f in families
                                   if by_mode[mode].get(f, {}).get("accuracy") is not None)
            ax.annotate(f"{mode}  {acc:.2f}" + (f"\n{per_family}" if per_family else ""), (x, acc),
                        xytext=(x + 0.09 * span, height), ha="left", va="center", fontsize=8.5,
                        color=style["color"], linespacing=1.25,
                        arrowprops={"arrowstyle": "-", "lw": 0.6, "color": style["color"], "alpha": 0.7},
                        zorder=6, annotation_clip=False)
    ax.set_xlim(lo_x, hi_x)
    ax.set_ylim(0, 1.05)  # accuracy is in [0, 1]; the margin keeps a point at 1 clear of the title
    ax.set_yticks([0, 0.2, 0.4, 0.6, 0.8, 1.0])
    ax.xaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.set_xlabel(axis_label)
    ax.set_ylabel("accuracy (all families pooled)")
    ax.grid(alpha=0.25, lw=0.5)
    handles = [plt.Line2D([], [], color="0.4", lw=1.0, marker="_", markersize=7,
                          label="range of the per-family accuracies")]
    if full is not None:
        handles.append(plt.Line2D([], [], color="0.3", lw=0.9, ls=":", label=f"{FULL_LABEL} {full:.2f}"))
    ax.legend(handles=handles, fontsize=8, loc="lower left", framealpha=0.85,
              title="labels: mode, pooled, then " + ", ".join(f"{v} = {f}" for f, v in short.items() if v != f)
              if any(v != f for f, v in short.items()) else None, title_fontsize=8)
    title = f"accuracy vs decode speed-up, {_keep_set_line(results, keep_set)}"
    if notes:
        title += "\nleft out: " + "; ".join(notes)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    _save(fig, path)


# ----------------------------------------------------------------------------------------------- family bars
def plot_family_accuracy(results: dict, keep_set: str | None, path: str | Path, values: bool = True) -> None:
    """Grouped bars: one group per family and `all`, one bar per mode (run order, full first), the full model's
    accuracy as a dotted reference across each group; `values` writes each bar's accuracy above it."""
    plt = _pyplot()
    by_mode = _by_mode(results, keep_set)
    groups = [*results["families"], "all"]
    modes = list(by_mode)
    styles = mode_styles(modes)
    width = 0.8 / max(len(modes), 1)
    fig, ax = plt.subplots(figsize=(max(6.5, 1.2 + 0.36 * len(modes) * len(groups)), 4.6))
    for j, mode in enumerate(modes):
        heights = [by_mode[mode].get(g, {}).get("accuracy") for g in groups]
        xs = [g + (j - (len(modes) - 1) / 2) * width for g in range(len(groups))]
        bars = ax.bar(xs, [math.nan if h is None else h for h in heights], width * 0.92, label=mode,
                      color=styles[mode]["color"], alpha=0.95 if mode == "full" else 0.8,
                      hatch="//" if mode == "full" else None, edgecolor="white", linewidth=0.5, zorder=2)
        if values:
            for bar, h in zip(bars, heights):
                if h is not None:
                    ax.text(bar.get_x() + bar.get_width() / 2, h + 0.012, f"{h:.2f}", ha="center", va="bottom",
                            fontsize=6.5, rotation=90 if len(modes) > 4 else 0, zorder=4,
                            bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.3, "alpha": 0.8})
    full = by_mode.get("full", {})
    for g, group in enumerate(groups):
        acc = full.get(group, {}).get("accuracy")
        if acc is not None:
            ax.hlines(acc, g - 0.45, g + 0.45, color="0.2", lw=1.0, ls=":", zorder=3,
                      label=f"{FULL_LABEL} (reference)" if g == 0 else None)
    ax.axvline(len(groups) - 1.5, color="0.6", lw=0.8)  # `all` apart from the families
    ax.set_xticks(range(len(groups)), [f"{g}\n(n={full.get(g, {}).get('n', '?')})" if full else g for g in groups])
    ax.set_xlim(-0.5, len(groups) - 0.5)
    ax.set_ylim(0, 1.14 if values else 1.04)
    ax.set_yticks([0, 0.2, 0.4, 0.6, 0.8, 1.0])
    ax.set_ylabel("accuracy")
    ax.grid(axis="y", alpha=0.25, lw=0.5, zorder=0)
    handles, labels = ax.get_legend_handles_labels()
    order = sorted(range(len(labels)), key=lambda i: labels[i] not in modes)  # the modes, then the reference line
    handles, labels = [handles[i] for i in order], [labels[i] for i in order]
    ax.legend(handles, labels, fontsize=8, ncol=len(labels) if len(labels) <= 5 else math.ceil(len(labels) / 2),
              loc="upper center",
              bbox_to_anchor=(0.5, -0.14), frameon=False)
    ax.set_title(f"accuracy per family, {_keep_set_line(results, keep_set)}", fontsize=10)
    fig.tight_layout()
    _save(fig, path)


# ----------------------------------------------------------------------------------------------- training
def sweep_points(results: dict) -> dict[str, list[tuple[float, float]]]:
    """{mode: [(pruning ratio, pooled accuracy)] sorted by ratio} over the keep sets of one eval results dict;
    the ratio is 1 - the keep set's keep fraction. The full model (no keep set) is {'full': [(0.0, acc)]}."""
    points: dict[str, list] = {}
    for row in results["rows"]:
        if row["family"] != "all" or row.get("accuracy") is None:
            continue
        ratio = 0.0 if row["keep_set"] is None else 1 - results["keep_sets"][row["keep_set"]]["keep_fraction"]
        points.setdefault(row["mode"], []).append((round(ratio, 6), row["accuracy"]))
    return {mode: sorted(set(p)) for mode, p in points.items()}


def plot_accuracy_vs_ratio(sweeps: Mapping[str, dict], path: str | Path, title: str | None = None) -> None:
    """Pooled accuracy against pruning ratio: one line per mode (colour and marker) per criterion (line style when
    there are several), from {criterion: eval results dict over that criterion's keep sets}. The full model is a
    dotted line; the top axis gives each ratio's expert-bytes bound at batch 64 (a bound, not a measurement)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.6, 4.8))
    criteria = list(sweeps)
    crit_ls = dict(zip(criteria, ("-", "--", "-.", ":", (0, (5, 1, 1, 1)))))
    modes = list(dict.fromkeys(m for r in sweeps.values() for m in r["modes"]))
    styles = mode_styles(modes)
    full_done, bounds = False, {}
    for criterion, results in sweeps.items():
        for info in results["keep_sets"].values():
            bound = expert_bytes_bound(info)
            if bound is not None:
                bounds[round(1 - info["keep_fraction"], 6)] = bound
        for mode, pts in sweep_points(results).items():
            if mode == "full":
                if not full_done:
                    ax.axhline(pts[0][1], color="0.3", lw=1.0, ls=":", zorder=1,
                               label=f"{FULL_LABEL} {pts[0][1]:.2f}")
                    ax.plot([0.0], [pts[0][1]], ls="none", marker="o", color="black", zorder=4, clip_on=False)
                    full_done = True
                continue
            style = styles[mode]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], color=style["color"], marker=style["marker"],
                    ls=crit_ls[criterion] if len(criteria) > 1 else style["ls"], lw=1.6, markersize=6, alpha=0.9,
                    label=mode if len(criteria) == 1 else f"{mode} ({criterion})", zorder=3, clip_on=False)
    ratios = sorted(bounds)
    right = max(ratios, default=0.5)
    ax.set_xlim(-0.02, right + 0.06)
    ax.set_ylim(0, 1)
    ax.set_xlabel("pruning ratio (share of experts removed per layer)")
    ax.set_ylabel("accuracy (all families pooled)")
    ax.grid(alpha=0.25, lw=0.5)
    if ratios:
        top = ax.secondary_xaxis("top")
        top.set_xticks(ratios, [f"{bounds[r]:.2f}x" for r in ratios], fontsize=8)
        top.set_xlabel(f"pruned decoder: expert-bytes bound at batch {BOUND_BATCH} (not measured)", fontsize=8)
    ax.legend(fontsize=8, framealpha=0.85, loc="lower left")
    ax.set_title(title or f"accuracy vs pruning ratio ({', '.join(criteria)})", fontsize=10)
    fig.tight_layout()
    _save(fig, path)

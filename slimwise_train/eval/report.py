"""Reports of an evaluation's results dict: the markdown tables (one per keep set), output-length CDF plots and
the W&B table rows."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Sequence

from slimwise_train.eval.metrics import METRICS

ROW_COLUMNS = ("keep_set", "mode", "family", *METRICS)


# ----------------------------------------------------------------------------------------------- rendering
def rows_for(results: dict, keep_set: str | None) -> list[dict]:
    """Rows of one keep set's table: the full model's rows, then that keep set's modes (in run order)."""
    return [r for r in results["rows"] if r["keep_set"] is None or r["keep_set"] == keep_set]


def _fmt(x, digits=2) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and x.is_integer() and digits == 0:
        return str(int(x))
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def _cell(row: dict) -> str:
    return (f"{_fmt(row['accuracy'])} / {_fmt(row['median_length'], 0 if row['median_length'].is_integer() else 1)}"
            f" / {_fmt(row['p90_length'], 0)} / {_fmt(row['hit_budget'])}")


def render_markdown(results: dict, title: str = "SlimWise evaluation", header_lines: Sequence[str] = ()) -> str:
    families = results["families"]
    columns = [*families, "all"]
    lines = [f"# {title}", ""]
    lines += [f"- {line}" for line in header_lines]
    budgets = ", ".join(f"{f} {results['budget'][f]}" for f in families)
    problems = ", ".join(f"{f} {results['num_problems'][f]}" for f in families)
    lines += [f"- problems per family: {problems}", f"- token budget: {budgets} ({results['budget_rule']})",
              "- cells: accuracy / median length / p90 length / share that hit the budget (lengths in tokens incl. "
              "EOS); first tok = first-token agreement with the full model; exact = full = whole output equals the "
              "full model's; collapse = share that ended shorter than half the reference"]
    descriptions = results.get("mode_descriptions") or {}
    lines += ["- modes: " + "; ".join(f"**{mode}** = {text}" for mode, text in descriptions.items()), ""]
    names = list(results["keep_sets"]) or [None]
    for name in names:
        if name is None:
            lines += ["## no keep set (full model only)", ""]
        else:
            info = results["keep_sets"][name]
            kept = info["num_kept"]
            lines += [f"## keep set `{name}`", "",
                      f"kept experts per layer: {kept[0] if len(set(kept)) == 1 else kept} of "
                      f"{info['num_experts'][0]} (keep fraction {info['keep_fraction']:.3f})"
                      + (f"; `{info['path']}`" if info.get("path") else ""), ""]
        lines.append("| mode | " + " | ".join(columns) + " | first tok | exact = full | collapse |")
        lines.append("|---|" + "---|" * (len(columns) + 3))
        by_mode: dict[str, dict] = {}
        for row in rows_for(results, name):
            by_mode.setdefault(row["mode"], {})[row["family"]] = row
        for mode, cells in by_mode.items():
            total = cells["all"]
            lines.append(f"| {mode} | " + " | ".join(_cell(cells[c]) for c in columns)
                         + f" | {_fmt(total['first_token_agreement_with_full'])}"
                         + f" | {_fmt(total['exact_match_with_full'])} | {_fmt(total['collapse'])} |")
        lines.append("")
    if results["notes"]:
        lines += ["## notes", ""] + [f"- {n}" for n in results["notes"]] + [""]
    return "\n".join(lines)


def safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_") or "keep_set"


def _cdf(values) -> tuple[list, list]:
    """Step coordinates of an empirical CDF, starting at 0."""
    values = sorted(values)
    return [values[0], *values], [0.0, *((k + 1) / len(values) for k in range(len(values)))]


_LINESTYLES = ("-", "--", "-.", ":", (0, (5, 1, 1, 1)), (0, (3, 1, 1, 1, 1, 1)))  # one per mode (six)
_MARKERS = ("o", "s", "^", "D", "v", "P")


def plot_lengths(results: dict, keep_set: str | None, path: str | Path) -> None:
    """CDF of output lengths per family (one panel each), one line per mode, the reference answers dashed and
    the budget as a vertical line. Written atomically with the Agg backend."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    from slimwise_train.utils.atomic import atomic_path

    families = results["families"]
    runs = [r for r in results["runs"] if r["keep_set"] is None or r["keep_set"] == keep_set]
    problem_family = [p["family"] for p in results["problems"]]
    fig, axes = plt.subplots(1, len(families), figsize=(4.2 * len(families), 3.4), squeeze=False)
    for ax, family in zip(axes[0], families):
        idx = [i for i, f in enumerate(problem_family) if f == family]
        ref = [results["problems"][i]["reference_length"] for i in idx]
        if None not in ref:  # lm-eval runs without logged samples know no references
            ax.step(*_cdf(ref), where="post", color="0.5", ls="--", label="reference")
        for k, run in enumerate(runs):
            # Modes often coincide (full and reverse, conventional and slimwise, a distill mode and its undistilled
            # twin): distinct dashes, markers and a small vertical offset keep every line visible where they overlap.
            xs, ys = _cdf(run["length"][i] for i in idx)
            offset = 0.006 * (k - (len(runs) - 1) / 2)
            ax.step(xs, [y + offset for y in ys], where="post", label=run["mode"], lw=1.3,
                    ls=_LINESTYLES[k % len(_LINESTYLES)], marker=_MARKERS[k % len(_MARKERS)],
                    markevery=max(1, len(xs) // 8), markersize=4)
        ax.axvline(results["budget"][family], color="k", lw=0.8, ls=":", label="budget")
        ax.set_title(family)
        ax.set_xlabel("output tokens (incl. EOS)")
        ax.set_ylim(0, 1.04)
        ax.legend(fontsize=7, loc="lower right")
    axes[0][0].set_ylabel("share of problems")
    fig.suptitle(f"output length CDF, keep set {keep_set}" if keep_set else "output length CDF, full model")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)


SUMMARY_METRICS = ("accuracy", "median_length", "p90_length", "hit_budget")


def wandb_summary(results: dict) -> dict:
    """Scalars for the W&B run summary: `<metric>/<mode>` over all families and `<metric>/<mode>/<family>`, for
    accuracy, median / p90 length and the share hitting the budget. With one keep set per eval run (the run named
    after it) the keys are the same in every run of a sweep, so one panel compares the sweep's ratios; with several
    keep sets in one run the pruned modes read `<metric>/<keep set>/<mode>[/<family>]`."""
    several = len(results["keep_sets"]) > 1
    scalars = {}
    for row in results["rows"]:
        name = f"{row['keep_set']}/{row['mode']}" if several and row["keep_set"] is not None else row["mode"]
        suffix = "" if row["family"] == "all" else f"/{row['family']}"
        for metric in SUMMARY_METRICS:
            if row.get(metric) is not None:
                scalars[f"{metric}/{name}{suffix}"] = row[metric]
    return scalars


def wandb_rows(results: dict) -> tuple[list[str], list[list]]:
    columns = list(ROW_COLUMNS)
    data = [[("-" if r["keep_set"] is None else r["keep_set"]) if c == "keep_set" else r[c] for c in columns]
            for r in results["rows"]]
    return columns, data

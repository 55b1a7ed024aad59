"""Reports of an evaluation's results dict: the markdown tables (one per keep set) and the W&B table rows; the
figures are in `slimwise_train.eval.plots`."""

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


BOUND_BATCH = 64  # the batch of the expert-bytes bound: the method's case is batched decode


def touched_experts(experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts of `experts` a decode step reads when `tokens` tokens each pick `top_k` uniformly."""
    return experts * (1 - (1 - top_k / experts) ** tokens)


def expert_bytes_bound(info: dict, batch: int = BOUND_BATCH) -> float | None:
    """Full / pruned expert bytes a decode step reads at `batch` under uniform routing, summed over layers: the most
    a pruned decoder can speed a decode step up if expert weights were all it read (attention, KV and the rest move
    the real number toward 1; `bench decode` measures it). None for an old results file without top_k."""
    if "top_k" not in info:
        return None
    full = sum(touched_experts(e, k, batch) for e, k in zip(info["num_experts"], info["top_k"]))
    pruned = sum(touched_experts(n, k, batch) for n, k in zip(info["num_kept"], info["top_k"]))
    return full / pruned


def _decode_pruned(results: dict, mode: str) -> bool:
    """Whether the mode decodes with the pruned pool (masked model or student): from the results' own description."""
    text = (results.get("mode_descriptions") or {}).get(mode, "")
    return "pruned decode" in text or "student decode" in text


def _worst_family(cells: dict, full: dict | None, families: Sequence[str]) -> str:
    """The family that loses most accuracy against the full model, and by how much: a pooled number hides a collapse."""
    if not full:
        return "-"
    drops = {f: cells[f]["accuracy"] - full[f]["accuracy"] for f in families if f in cells and f in full}
    family = min(drops, key=drops.get)
    return f"{family} {drops[family]:+.2f}"


def render_markdown(results: dict, title: str = "SlimWise evaluation", header_lines: Sequence[str] = (),
                    images: dict[str | None, Sequence[tuple[str, str]]] | None = None,
                    bytes_bound: bool = True) -> str:
    """The report; `images` ({keep set name or None: [(caption, relative path)]}) are linked under that keep set's
    table as markdown images. `bytes_bound=False` leaves out the expert-bytes bound column (a report that embeds
    this one beside a measured speed-up and the bound measured with it: one bound per report)."""
    families = results["families"]
    columns = [*families, "all"]
    lines = [f"# {title}", ""]
    lines += [f"- {line}" for line in header_lines]
    budgets = ", ".join(f"{f} {results['budget'][f]}" for f in families)
    problems = ", ".join(f"{f} {results['num_problems'][f]}" for f in families)
    lines += [f"- problems per family: {problems}", f"- token budget: {budgets} ({results['budget_rule']})",
              "- cells: accuracy / median length / p90 length / share that hit the budget (lengths in tokens incl. "
              "EOS); first tok = first-token agreement with the full model; exact = full = whole output equals the "
              "full model's; collapse = share that ended shorter than half the reference; worst family = the "
              "family losing most accuracy against the full model"
              + ("; bytes bound = expert bytes a decode step reads at "
                 f"batch {BOUND_BATCH}, full / this mode's decoder, under uniform routing (a bound on the decode "
                 "speed-up, NOT a measurement: `python -m slimwise_train.bench decode` measures it)" if bytes_bound
                 else "")]
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
        lines.append("| mode | " + " | ".join(columns)
                     + " | worst family | first tok | exact = full | collapse |" + (" bytes bound |" if bytes_bound else ""))
        lines.append("|---|" + "---|" * (len(columns) + 4 + bytes_bound))
        by_mode: dict[str, dict] = {}
        for row in rows_for(results, name):
            by_mode.setdefault(row["mode"], {})[row["family"]] = row
        bound = expert_bytes_bound(results["keep_sets"][name]) if name is not None else None
        for mode, cells in by_mode.items():
            total = cells["all"]
            speed = 1.0 if not _decode_pruned(results, mode) else bound
            lines.append(f"| {mode} | " + " | ".join(_cell(cells[c]) for c in columns)
                         + f" | {_worst_family(cells, by_mode.get('full'), families) if mode != 'full' else '-'}"
                         + f" | {_fmt(total['first_token_agreement_with_full'])}"
                         + f" | {_fmt(total['exact_match_with_full'])} | {_fmt(total['collapse'])} |"
                         + (f" {'-' if speed is None else f'{speed:.2f}x'} |" if bytes_bound else ""))
        lines.append("")
        for caption, link in (images or {}).get(name, ()):
            lines += [f"![{caption}]({link})", ""]
    if results["notes"]:
        lines += ["## notes", ""] + [f"- {n}" for n in results["notes"]] + [""]
    return "\n".join(lines)


def safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_") or "keep_set"


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

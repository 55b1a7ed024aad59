"""Output lengths of an lm-eval run of the `slimwise` model: per request records, per task summaries and the
report, with the eval app's metric definitions (`slimwise_train.eval.metrics`, one implementation).

Files written into the folder of lm-eval's results (each atomically):

    slimwise_lengths_<run>.jsonl   one line per request: task, doc_id, mode, num_tokens, end_reason (eos | stop |
                                   budget), budget, first_token_agrees, reference_tokens and correct when lm-eval
                                   logged samples (--log_samples)
    slimwise_summary_<run>.json    what ran (model, mode, keep set, student) and per task: accuracy (lm-eval's
                                   metric), median / p90 / max / mean length, hit_budget, collapse, first-token
                                   agreement with the full model
    slimwise_report.md             every run in the folder side by side: one table per keep set, rows = modes
    slimwise_lengths_<keep>.png    length CDF per task, one line per mode

`<run>` is the mode, plus for pruned modes the keep set's name and 8 hex digits of a digest of its content (and of the
student's weight files for the distilled modes), so the six modes of one keep set run into one `--output_path`
build up one comparison, and two keep sets whose paths end alike (`a/r0.5`, `b/r0.5`) never overwrite each other.
Length = generated tokens incl. EOS (or the token that completed a stop string); hit_budget = ended by max_gen_toks;
collapse = ended (EOS or stop) shorter than half the reference answer (lm-eval's target, tokens + 1 for EOS; null
without --log_samples).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Sequence

log = logging.getLogger("slimwise.lm_eval")

LENGTHS_PREFIX, SUMMARY_PREFIX = "slimwise_lengths_", "slimwise_summary_"
REPORT_NAME = "slimwise_report.md"


# ----------------------------------------------------------------------------------------------- lm-eval outputs
def declared_metrics(results: dict | None, task: str) -> list[str]:
    """The metrics `task` declares, in its order: its config's `metric_list` (what lm-eval aggregates and prints), else
    the keys of lm-eval's `higher_is_better` for it. Never a bookkeeping entry of the results (`sample_len`,
    `alias`, `name`): those are no accuracy."""
    config = ((results or {}).get("configs") or {}).get(task) or {}
    names = [entry.get("metric") for entry in config.get("metric_list") or () if isinstance(entry, dict)]
    names = [name for name in names if isinstance(name, str)]  # a metric given as a function has no result key
    if not names:
        names = list(((results or {}).get("higher_is_better") or {}).get(task) or {})
    return names


def primary_metric(results: dict | None, task: str) -> tuple[str, str, float] | None:
    """(metric, filter, value) of `task`'s first declared metric (`declared_metrics`) in lm-eval's results, under the
    first filter that reports it (`exact_match,strict-match` -> exact_match, strict-match); None when the results hold
    none of the declared metrics (no accuracy is better than a count taken for one)."""
    task_results = ((results or {}).get("results") or {}).get(task) or {}
    for metric in declared_metrics(results, task):
        for key, value in task_results.items():
            name, _, filter_key = key.partition(",")
            if name == metric and isinstance(value, (int, float)) and not isinstance(value, bool):
                return metric, filter_key or "none", float(value)
    return None


def per_sample(samples: Sequence[dict] | None, tokenizer, metric: str | None = None,
               filter_key: str | None = None) -> dict[int, dict]:
    """{doc_id: {"correct": bool|None, "reference_tokens": int|None}} from lm-eval's logged samples: correct is the
    sample's `metric` (the task's primary metric) under `filter_key` (a task with several filters logs each document
    once per filter); None where the sample does not report it."""
    out = {}
    for sample in samples or ():
        if filter_key is not None and sample.get("filter", filter_key) != filter_key:
            continue
        correct = bool(sample[metric]) if metric is not None and metric in sample else None
        target = sample.get("target")
        reference = (len(tokenizer(str(target), add_special_tokens=False)["input_ids"]) + 1
                     if isinstance(target, str) and target else None)
        out[int(sample["doc_id"])] = {"correct": correct, "reference_tokens": reference}
    return out


def read_lm_eval_outputs(folder: Path, since: float) -> tuple[Path | None, dict | None, dict[str, list]]:
    """(results file, results, {task: samples}) of the newest lm-eval run written into `folder` (recursively)
    after `since` (a time.time()), as `--output_path` writes them; (None, None, {}) when there is none."""
    candidates = [p for p in folder.rglob("results_*.json") if p.stat().st_mtime >= since - 1]
    if not candidates:
        return None, None, {}
    path = max(candidates, key=lambda p: p.stat().st_mtime)
    results = json.loads(path.read_text())
    date_id = path.stem[len("results_"):]
    samples = {}
    for task in results.get("results", {}):
        file = path.parent / f"samples_{task}_{date_id}.jsonl"
        if file.is_file():
            samples[task] = [json.loads(line) for line in file.read_text().splitlines() if line.strip()]
    return path, results, samples


# ----------------------------------------------------------------------------------------------- summaries
def run_name(info: dict) -> str:
    from slimwise_train.eval.app import keep_set_name

    if info["mode"] == "full" or not info.get("keep_set"):
        return info["mode"]
    name = f"{info['mode']}_{keep_set_name(info['keep_set'], set())}"
    if info.get("run_digest"):  # summaries written before 2026-12-07 have none
        name += f"-{info['run_digest'][:8]}"
    return name


def annotate(records: Sequence[dict], results: dict | None, samples: dict[str, list], tokenizer) -> list[dict]:
    """Records with correct / reference_tokens from lm-eval's samples (None where not logged), in task, doc order."""
    known = {}
    for task, rows in samples.items():
        metric = primary_metric(results, task)
        known[task] = per_sample(rows, tokenizer, *(metric[:2] if metric else (None, None)))
    out = []
    for record in sorted(records, key=lambda r: (str(r["task"]), r["doc_id"] or 0, r.get("idx", 0))):
        extra = known.get(record["task"], {}).get(record["doc_id"], {})
        out.append({**record, "correct": extra.get("correct"), "reference_tokens": extra.get("reference_tokens")})
    return out


def task_budgets(records: Sequence[dict]) -> dict[str, int]:
    """{task: the largest max_gen_toks any of its requests had}."""
    budgets: dict[str, int] = {}
    for r in records:
        budgets[r["task"]] = max(budgets.get(r["task"], 0), r["budget"])
    return budgets


def summarize_records(records: Sequence[dict], results: dict | None = None) -> dict[str, dict]:
    """{task: metrics, "all": metrics} with `slimwise_train.eval.metrics.summarize` (the eval app's definitions).
    Accuracy: the per-sample scores when lm-eval logged samples, else lm-eval's aggregate (per task only)."""
    from slimwise_train.eval.metrics import summarize

    problems = [SimpleNamespace(family=r["task"], reference_length=r.get("reference_tokens")) for r in records]
    record = {
        "length": [r["num_tokens"] for r in records],
        "ended": [r["end_reason"] != "budget" for r in records],
        "correct": [r.get("correct") for r in records],
        "first_token_agrees": [r["first_token_agrees"] for r in records],
        "same_as_full": None,
    }
    rows = summarize(problems, record, task_budgets(records))
    for task, row in rows.items():
        if row["accuracy"] is None and results and task in results.get("results", {}):
            metric = primary_metric(results, task)
            row["accuracy"] = metric[2] if metric else None
            row["accuracy_metric"] = metric[0] if metric else None
    return rows


# ----------------------------------------------------------------------------------------------- writing
def write_run(folder: str | Path, info: dict, records: Sequence[dict], results: dict | None,
              samples: dict[str, list] | None, tokenizer) -> dict:
    """Write one run's lengths and summary into `folder`, then rebuild the folder's report; returns the summary."""
    from slimwise_train.utils.atomic import atomic_path, write_json_atomic

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if not records:
        raise ValueError("the slimwise model answered no generate_until requests, so there are no lengths to "
                         "write (loglikelihood tasks have none)")
    records = annotate(records, results, samples or {}, tokenizer)
    seen = {(r["task"], r["doc_id"]) for r in records}
    unanswered = sum((task, int(sample["doc_id"])) not in seen for task, rows in (samples or {}).items()
                     for sample in rows if task in {r["task"] for r in records})
    if unanswered:  # e.g. answered from lm-eval's --use_cache: the model never saw them
        log.warning("%d logged samples have no length record (answered without the slimwise model, e.g. from "
                    "--use_cache); the length summary covers the %d requests it answered", unanswered, len(records))
        info = {**info, "samples_without_lengths": unanswered}
    name = run_name(info)
    with atomic_path(folder / f"{LENGTHS_PREFIX}{name}.jsonl") as tmp, open(tmp, "w") as handle:
        for record in records:
            handle.write(json.dumps(record) + "\n")
    summary = {"format": "slimwise-lm-eval-lengths/1", "run": name, "written_at": time.time(), **info,
               "tasks": summarize_records(records, results),
               "lm_eval_results": (results or {}).get("results")}
    write_json_atomic(folder / f"{SUMMARY_PREFIX}{name}.json", summary)
    write_report(folder)
    return summary


def load_runs(folder: Path) -> list[tuple[dict, list[dict]]]:
    runs = []
    for path in sorted(folder.glob(f"{SUMMARY_PREFIX}*.json")):
        summary = json.loads(path.read_text())
        lengths = folder / f"{LENGTHS_PREFIX}{summary['run']}.jsonl"
        if lengths.is_file():
            runs.append((summary, [json.loads(x) for x in lengths.read_text().splitlines() if x.strip()]))
    return runs


_MODE_ORDER = ("full", "conventional", "slimwise", "reverse", "conventional_distilled", "distilled")


def _task_order(task: str) -> tuple[int, str]:
    """The synthetic suite's tasks in the eval app's family order (math, code, tool), then the rest by name."""
    from slimwise_train.data.synthetic import FAMILIES

    family = task.removeprefix("slimwise_")
    return (FAMILIES.index(family), "") if family in FAMILIES else (len(FAMILIES), task)


def combined_results(runs: list[tuple[dict, list[dict]]]) -> dict:
    """The eval app's results shape (families = tasks) over the runs that evaluated the same requests as the
    newest run, so `slimwise_train.eval.report` renders and plots them."""
    from slimwise_train.eval.app import keep_set_name

    newest = max(runs, key=lambda run: run[0].get("written_at", 0))
    key = lambda r: (r["task"], r["doc_id"], r.get("idx", 0))  # noqa: E731
    reference = [key(r) for r in newest[1]]
    notes, chosen = [], []
    for summary, records in runs:
        if [key(r) for r in records] != reference:
            notes.append(f"run {summary['run']} evaluated other requests (tasks or --limit) than {newest[0]['run']}; "
                         "left out of this comparison")
            continue
        chosen.append((summary, records))
    chosen.sort(key=lambda run: _MODE_ORDER.index(run[0]["mode"]) if run[0]["mode"] in _MODE_ORDER else 99)
    base = newest[1]
    tasks = sorted(dict.fromkeys(r["task"] for r in base), key=_task_order)
    problems = [{"family": r["task"], "reference_length": r.get("reference_tokens"), "doc_id": r["doc_id"]}
                for r in base]
    keep_sets, rows, out_runs, taken = {}, [], [], {}
    for summary, records in chosen:
        keep = None
        if summary["mode"] != "full" and summary.get("keep_set"):
            path = summary["keep_set"]
            # one table per keep set by content: the same keep set named by two paths is one, two keep sets whose
            # paths end alike are two (summaries written before 2026-12-07 have no digest: by path)
            same = summary.get("keep_set_digest") or path
            if same not in taken:
                taken[same] = keep_set_name(path, set(taken.values()))
            keep = taken[same]
            keep_sets[keep] = {"path": path, "num_kept": summary.get("num_kept"),
                               "num_experts": summary.get("num_experts"), "keep_fraction": summary.get("keep_fraction")}
            if summary.get("top_k"):  # summaries written before 2026-12-02 lack it: no bound in their report
                keep_sets[keep]["top_k"] = summary["top_k"]
        for task, metrics in summary["tasks"].items():
            rows.append({"keep_set": keep, "mode": summary["mode"], "family": task, **metrics,
                         "exact_match_with_full": None})
        out_runs.append({"keep_set": keep, "mode": summary["mode"], "length": [r["num_tokens"] for r in records]})
    budgets = task_budgets(base)
    return {
        "families": tasks,
        "num_problems": {t: sum(r["task"] == t for r in base) for t in tasks},
        "budget": budgets,
        "budget_rule": "each task's max_gen_toks",
        "mode_descriptions": {s["mode"]: s["mode_description"] for s, _ in chosen},
        "keep_sets": keep_sets,
        "rows": rows,
        "notes": notes,
        "problems": problems,
        "runs": out_runs,
        "models": sorted({s["model"] for s, _ in chosen}),
    }


def write_report(folder: str | Path) -> Path:
    """slimwise_report.md and the length CDFs of every run in `folder`."""
    from slimwise_train.eval.plots import plot_lengths
    from slimwise_train.eval.report import render_markdown, safe_name
    from slimwise_train.utils.atomic import write_text_atomic

    folder = Path(folder)
    runs = load_runs(folder)
    results = combined_results(runs)
    header = [f"model: {', '.join(results['models'])}", "tool: lm-evaluation-harness (`python -m slimwise_train.lm_eval`)"]
    text = render_markdown(results, title="SlimWise lm-eval lengths", header_lines=header)
    write_text_atomic(folder / REPORT_NAME, text)
    for name in list(results["keep_sets"]) or [None]:
        plot_lengths(results, name, folder / f"slimwise_lengths_{safe_name(name or 'full')}.png")
    return folder / REPORT_NAME


def wandb_table(summary: dict):
    """The run's per-task rows as a wandb.Table (when lm-eval's --wandb_args started a run)."""
    import wandb

    columns = ["run", "mode", "task", "accuracy", "median_length", "p90_length", "max_length", "hit_budget",
               "collapse", "first_token_agreement_with_full", "n"]
    data = [[summary["run"], summary["mode"], task, *(row.get(c) for c in columns[3:])]
            for task, row in summary["tasks"].items()]
    return wandb.Table(columns=columns, data=data)

"""lm-evaluation-harness integration: importing this package registers the `slimwise` model with lm-eval.

    python -m slimwise_train.lm_eval --model slimwise --model_args pretrained=<ckpt>,keep_set=<keep_set.json>,mode=slimwise \\
        --tasks slimwise_math,slimwise_code,slimwise_tool --output_path outputs/lm_eval --log_samples

    from slimwise_train.lm_eval import SlimwiseLM, evaluate
    lm = SlimwiseLM(pretrained=..., keep_set=..., mode="slimwise")
    results = evaluate(lm, ["slimwise_math"], output_path="outputs/lm_eval")   # lm_eval.simple_evaluate + lengths

Model: `model.py`; packaged tasks: `tasks/` (TASKS_DIR; scoring in `scoring.py`); lengths and report: `lengths.py`.
"""

from __future__ import annotations

import logging
from pathlib import Path

from slimwise_train.lm_eval.model import MODES, GeneratedText, SlimwiseLM

TASKS_DIR = Path(__file__).resolve().parent / "tasks"
SELF_CONTAINED_TASKS = ("slimwise_math", "slimwise_code", "slimwise_tool")  # built in-process: no --metadata to pass


class _NoMetadataHintForSelfContainedTasks(logging.Filter):
    """lm-eval tells every task with a custom dataset that kwargs can be passed through `--metadata`; the synthetic
    suite's tasks take none, so the hint (three multi-line warnings per run) only misleads there. Kept for the
    `_local` tasks, which do read --metadata."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not ("can be passed to `--metadata`" in message and message.split(":", 1)[0] in SELF_CONTAINED_TASKS)


logging.getLogger("lm_eval.api.task").addFilter(_NoMetadataHintForSelfContainedTasks())

__all__ = ["MODES", "TASKS_DIR", "GeneratedText", "SlimwiseLM", "evaluate", "task_manager", "write_lengths"]


def packaged_task_config(path: str | Path) -> dict:
    """One packaged task YAML as a dict, its `!function` references left as plain strings (lm-eval resolves them;
    callers here read names, tags and generation kwargs)."""
    import yaml

    return yaml.safe_load(Path(path).read_text().replace("!function ", ""))


def task_manager(include_path: str | Path | list | None = None, metadata: dict | None = None,
                 include_defaults: bool = True):
    """lm-eval's TaskManager with the packaged tasks (and `include_path` folders) added. `include_defaults=False`
    skips indexing lm-eval's own thousands of tasks (about 15 s here) when only these are needed."""
    from lm_eval.tasks import TaskManager

    extra = [] if include_path is None else list(include_path) if isinstance(include_path, (list, tuple)) else [include_path]
    return TaskManager(include_path=[str(TASKS_DIR), *map(str, extra)], metadata=metadata or {},
                       include_defaults=include_defaults)


def write_lengths(lm: SlimwiseLM, output_path: str | Path, results: dict | None = None) -> dict | None:
    """Write `lm`'s length records, summary and the folder's report into `output_path` (rank 0; a collective
    under data parallelism). `results` from lm_eval.simple_evaluate adds accuracy (and, with log_samples,
    per-sample correctness and reference lengths). Returns the summary on rank 0, else None."""
    from slimwise_train.lm_eval.lengths import write_run

    records = lm.gathered_records()
    if records is None:
        return None
    samples = (results or {}).get("samples") or {}
    return write_run(output_path, lm.describe(), records, results, samples, lm.tokenizer)


def evaluate(lm: SlimwiseLM, tasks: list[str], output_path: str | Path | None = None, **simple_evaluate_kwargs) -> dict:
    """lm_eval.simple_evaluate over the packaged tasks with logged samples, then the lengths (into `output_path`
    when given). Returns lm-eval's results dict, with `slimwise_lengths` (the per-task length summary) on rank 0."""
    import lm_eval

    kwargs = {"log_samples": True, **simple_evaluate_kwargs}
    if kwargs.get("task_manager") is None:
        kwargs["task_manager"] = task_manager()
    results = lm_eval.simple_evaluate(model=lm, tasks=tasks, **kwargs)
    if output_path is not None:
        summary = write_lengths(lm, output_path, results)
        if results is not None and summary is not None:
            results["slimwise_lengths"] = summary["tasks"]
    elif results is not None:
        from slimwise_train.lm_eval.lengths import annotate, summarize_records

        records = lm.gathered_records()
        if records:
            results["slimwise_lengths"] = summarize_records(
                annotate(records, results, results.get("samples") or {}, lm.tokenizer), results)
    return results

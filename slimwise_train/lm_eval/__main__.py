"""`python -m slimwise_train.lm_eval <lm-eval flags>`: lm-eval's own CLI with the `slimwise` model registered and
the packaged tasks on the task path, then the output lengths written beside lm-eval's results.

Defaults added when the flag is absent: --include_path <the packaged tasks>, --device auto (lm-eval's own default
is cuda:0), --batch_size 32 (the eval app's). When every --tasks name is a packaged task, lm-eval's index of its
own tasks is skipped (11-15 s a run). Everything else is lm-eval's: see `lm-eval run --help`.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

log = logging.getLogger("slimwise.lm_eval")


def flag_value(argv: list[str], *names: str) -> str | None:
    for i, arg in enumerate(argv):
        for name in names:
            if arg == name and i + 1 < len(argv):
                return argv[i + 1]
            if arg.startswith(name + "="):
                return arg.split("=", 1)[1]
    return None


def with_defaults(argv: list[str]) -> list[str]:
    from slimwise_train.lm_eval import TASKS_DIR

    argv = list(argv)
    if argv and argv[0] == "run":
        argv = argv[1:]
    defaults = {"--include_path": str(TASKS_DIR), "--device": "auto", "--batch_size": "32"}
    for flag, value in defaults.items():
        if flag_value(argv, flag) is None:
            argv += [flag, value]
    if flag_value(argv, "--include_path") != str(TASKS_DIR):
        log.warning("--include_path replaces the packaged slimwise_* tasks folder (%s)", TASKS_DIR)
    return ["run", *argv]


def model_args_of(argv: list[str]) -> dict:
    """--model_args as lm-eval parses it ({} when absent or malformed: lm-eval reports a malformed one itself)."""
    from lm_eval.utils import simple_parse_args_string

    model_args = flag_value(argv, "--model_args") or ""
    try:
        return simple_parse_args_string(model_args) if "=" in model_args else {}
    except ValueError:
        return {}


def check_device_flag(argv: list[str]) -> None:
    """lm-eval passes its --device (its own default cuda:0, this CLI's auto) to the model beside --model_args, so a
    device= there is a second value of one argument (lm-eval's TypeError after its start-up): one line, before lm-eval
    loads anything."""
    device = model_args_of(argv).get("device")
    if device is not None:
        raise ValueError(f"--model_args device={device}: lm-eval passes the device from its own flag beside "
                         f"model_args; give it as --device {device}")


def check_one_chat_wrap(argv: list[str]) -> None:
    """--apply_chat_template with the slimwise model's chat_template=true would wrap every prompt twice: one line,
    before lm-eval loads anything."""
    from slimwise_train.lm_eval.model import DOUBLE_CHAT_TEMPLATE

    applied = any(arg == "--apply_chat_template" or arg.startswith("--apply_chat_template=") for arg in argv)
    if not applied or flag_value(argv, "--model") != "slimwise":
        return
    value = model_args_of(argv).get("chat_template", False)
    if str(value).strip().lower() in ("true", "1", "yes", "on"):  # as the model reads it (_as_bool)
        raise ValueError(DOUBLE_CHAT_TEMPLATE)


def packaged_task_names() -> set[str]:
    """Task names and tags of the packaged YAMLs (slimwise_train/lm_eval/tasks)."""
    from slimwise_train.lm_eval import TASKS_DIR, packaged_task_config

    names = set()
    for path in TASKS_DIR.glob("*.yaml"):
        config = packaged_task_config(path)
        names.add(config["task"])
        tags = config.get("tag") or []
        names.update([tags] if isinstance(tags, str) else tags)
    return names


def only_packaged_tasks(argv: list[str]) -> bool:
    """Every --tasks name is a packaged task or tag and the task path is ours: lm-eval's own index of its thousands
    of task YAMLs (11-15 s here, every run) is not needed."""
    from slimwise_train.lm_eval import TASKS_DIR

    tasks = flag_value(argv, "--tasks", "-t")
    if not tasks or flag_value(argv, "--include_path") != str(TASKS_DIR):
        return False
    return all(name.strip() in packaged_task_names() for name in tasks.split(","))


def skip_lm_evals_own_task_index() -> None:
    """The CLI builds its TaskManager itself (no flag for it): default it to include_defaults=False for this run."""
    import lm_eval.tasks

    class PackagedTasksOnly(lm_eval.tasks.TaskManager):
        def __init__(self, *args, include_defaults: bool = False, **kwargs):
            super().__init__(*args, include_defaults=include_defaults, **kwargs)

    lm_eval.tasks.TaskManager = PackagedTasksOnly


def finish(argv: list[str], start: float) -> None:
    """Write the lengths of the slimwise model this run made (rank 0), beside lm-eval's results."""
    from slimwise_train.lm_eval import SlimwiseLM
    from slimwise_train.lm_eval.lengths import read_lm_eval_outputs, write_run

    if not SlimwiseLM.instances:
        return
    lm = SlimwiseLM.instances[-1]
    records = lm.gathered_records()
    if records is None or not records:
        return
    output_path = flag_value(argv, "--output_path", "-o")
    if output_path is None:
        print("slimwise_train.lm_eval: output lengths not written: pass --output_path (and --log_samples for "
              "per-sample accuracy and collapse)", file=sys.stderr)
        return
    out = Path(output_path)
    folder = out.parent if out.suffix == ".json" else out
    results_file, results, samples = read_lm_eval_outputs(folder, start)
    target = results_file.parent if results_file is not None else folder
    summary = write_run(target, lm.describe(), records, results, samples, lm.tokenizer)
    print(f"slimwise_train.lm_eval: lengths of {summary['run']} written to {target} (report: "
          f"{target / 'slimwise_report.md'})")
    wandb_args = flag_value(argv, "--wandb_args")
    if wandb_args is not None:
        log_lengths_to_wandb(wandb_args, summary)


def log_lengths_to_wandb(wandb_args: str, summary: dict) -> None:
    """lm-eval logs its run and finishes it before the lengths exist: they go to a second run in the same project
    (and group, when --wandb_args names one), job_type slimwise-lengths, named after the lm-eval run + the mode."""
    import wandb
    from lm_eval.utils import simple_parse_args_string

    from slimwise_train.lm_eval.lengths import wandb_table

    init = simple_parse_args_string(wandb_args)
    init["name"] = f"{init['name']}-lengths" if init.get("name") else f"lengths-{summary['run']}"
    run = wandb.init(**init, job_type="slimwise-lengths", config={k: summary.get(k) for k in (
        "model", "mode", "keep_set", "student", "keep_fraction")})
    scalars = {f"{metric}/{summary['mode']}/{task}": row[metric] for task, row in summary["tasks"].items()
               for metric in ("accuracy", "median_length", "p90_length", "hit_budget") if row.get(metric) is not None}
    run.log({"slimwise/lengths": wandb_table(summary), **scalars})
    run.finish()


def main(argv: list[str] | None = None) -> None:
    from slimwise_train.utils.cli import user_errors

    argv = sys.argv[1:] if argv is None else argv
    # lm-eval writes its results, and this its lengths, once every request is answered
    with user_errors("slimwise_train.lm_eval", interrupted="no results or lengths were written (lm-eval writes them "
                                                           "at the end; a --use_cache database keeps the answers so "
                                                           "far)"):
        import slimwise_train.lm_eval  # noqa: F401  registers the slimwise model
        from lm_eval.__main__ import cli_evaluate

        check_device_flag(argv)
        argv = with_defaults(argv)
        check_one_chat_wrap(argv)

        start = time.time()
        if only_packaged_tasks(argv):
            skip_lm_evals_own_task_index()
        sys.argv = ["lm-eval", *argv]
        cli_evaluate()
        finish(argv, start)


if __name__ == "__main__":
    main()

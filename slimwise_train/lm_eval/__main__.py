"""`python -m slimwise_train.lm_eval <lm-eval flags>`: lm-eval's own CLI with the `slimwise` model registered and
the packaged tasks on the task path, then the output lengths written beside lm-eval's results.

Defaults added when the flag is absent: --include_path <the packaged tasks>, --device auto (lm-eval's own default
is cuda:0), --batch_size 32 (the eval app's). Everything else is lm-eval's: see `lm-eval run --help`.
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
    try:
        import wandb
    except ImportError:  # pragma: no cover - wandb is a dependency
        return
    if wandb.run is not None:  # lm-eval's --wandb_args started a run
        from slimwise_train.lm_eval.lengths import wandb_table

        wandb.run.log({f"slimwise/lengths_{summary['run']}": wandb_table(summary)})


def main(argv: list[str] | None = None) -> None:
    from slimwise_train.utils.cli import user_errors

    argv = with_defaults(sys.argv[1:] if argv is None else argv)
    with user_errors("slimwise_train.lm_eval"):
        import slimwise_train.lm_eval  # noqa: F401  registers the slimwise model
        from lm_eval.__main__ import cli_evaluate

        start = time.time()
        sys.argv = ["lm-eval", *argv]
        cli_evaluate()
        finish(argv, start)


if __name__ == "__main__":
    main()

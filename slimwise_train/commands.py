"""`slimwise <command> [args]`: the console entry point (pyproject.toml's [project.scripts]) for every app.

Each command is the app's own module run as `python -m` runs it, with the same arguments, so the two spellings are
one command: `slimwise prune ...` = `python -m slimwise_train.prune ...`, `slimwise train ...` = `python -m
slimwise_train ...`. torchrun starts a module or a script, so under it write `torchrun ... -m slimwise_train` (or
`-m slimwise_train.<app>`), or give it this script's path: `torchrun ... $(which slimwise) train ...`.
"""

from __future__ import annotations

import runpy
import sys

# command -> the module `python -m` runs (its __main__), in the order of a run: prune, train, eval, serve
COMMANDS = {
    "prune": ("slimwise_train.prune", "score experts on calibration data and write a keep set"),
    "train": ("slimwise_train", "distill the pruned decoder (one process; torchrun -m slimwise_train for several)"),
    "eval": ("slimwise_train.eval", "the six modes on held-out problems: accuracy, lengths, report"),
    "lm_eval": ("slimwise_train.lm_eval", "lm-evaluation-harness with the `slimwise` model"),
    "serve": ("slimwise_train.serve", "llama.cpp: convert to GGUF, generate, serve"),
    "bench": ("slimwise_train.bench", "side-by-side benchmarks, one JSON line each"),
    "plan": ("slimwise_train.plan", "memory per GPU of a training run before launching it"),
}

# The line under the title of every docs page with commands (the scripts that write docs pages put it there too).
DOCS_VENV_NOTE = ("Commands on this page run inside the venv, from the repository root: `source .venv/bin/activate` "
                  "once per\nshell ([README](../README.md#two-commands)).")


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: slimwise <command> [args]   (= python -m <module> [args]; `slimwise <command> --help` for its "
             "flags)", "", "commands:"]
    lines += [f"  {name.ljust(width)}  {help_text}  [python -m {module}]" for name, (module, help_text) in
              COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"slimwise: error: unknown command {name!r}: choose one of {', '.join(COMMANDS)} "
              "(slimwise --help lists them)", file=sys.stderr)
        return 2
    module = COMMANDS[name][0]
    # What `python -m <module> <rest>` would see: the app parses sys.argv[1:] (Hydra's overrides, argparse's flags).
    sys.argv = [f"slimwise {name}", *rest]
    runpy.run_module(module, run_name="__main__", alter_sys=False)  # its sys.exit(...) ends this process as its own
    return 0


if __name__ == "__main__":
    sys.exit(main())

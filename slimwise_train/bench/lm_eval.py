"""`bench lm_eval`: the eval app and lm-eval's `slimwise` model on the same problems, side by side in one run.

Both are run the way a user runs them (subprocesses): `python -m slimwise_train.eval` once with all five modes;
`python -m slimwise_train.lm_eval` once per mode (lm-eval's CLI evaluates one model per run) on the synthetic
suite's tasks with `--limit N`; and lm-eval's Python route (`slimwise_train.lm_eval.evaluate`) for the five modes in
one process, as the eval app does them. The eval app gets the tasks' budgets (their max_gen_toks). Reported: every
(mode, family) cell of the three and whether they are equal, and the wall-time ratios to the eval app.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

FAMILIES = ("math", "code", "tool")
MODES = ("full", "conventional", "slimwise", "reverse", "distilled")  # lm-eval's names (eval/modes.py LM_EVAL_NAMES)
COMPARED = ("accuracy", "median_length", "p90_length", "max_length", "hit_budget", "first_token_agreement_with_full")


def task_budgets() -> dict[str, int]:
    from slimwise_train.lm_eval import TASKS_DIR, packaged_task_config

    return {f: packaged_task_config(TASKS_DIR / f"slimwise_{f}.yaml")["generation_kwargs"]["max_gen_toks"]
            for f in FAMILIES}


def _run(cmd: list[str], log: Path, label: str | None = None) -> float:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "disabled",
           "TOKENIZERS_PARALLELISM": "false"}
    start = time.perf_counter()
    with open(log, "w") as handle:
        proc = subprocess.run(cmd, env=env, stdout=handle, stderr=subprocess.STDOUT)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"bench lm_eval: `{' '.join(cmd)}` failed (exit {proc.returncode}); see {log}")
    print(json.dumps({"partial": {"command": label or cmd[2], "seconds": round(elapsed, 1)}}), file=sys.stderr,
          flush=True)
    return elapsed


def run_lm_eval_bench(args) -> dict:
    for name, path in (("--keep-set", args.keep_set), ("--student", args.student)):
        if not Path(path).exists():
            raise SystemExit(f"bench lm_eval: {name} {path} does not exist; run `make demo` first (it writes "
                             "outputs/demo/reap-r0.5/keep_set.json and outputs/demo/distill/export) or pass your own")
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    budgets = task_budgets()
    budget_arg = "{" + ",".join(f"{f}:{b}" for f, b in budgets.items()) + "}"
    app_s = _run([sys.executable, "-m", "slimwise_train.eval", "model=teacher", f"model.path={args.teacher}",
                  f"eval.keep_sets=[{args.keep_set}]", f"eval.student={args.student}",
                  f"eval.num_per_family={args.num_per_family}", f"eval.budget={budget_arg}",
                  f"eval.batch_size={args.batch_size}", "progress=false", f"hydra.run.dir={out / 'eval_app'}"],
                 out / "eval_app.log")
    lm_s = {}
    for mode in MODES:
        model_args = f"pretrained={args.teacher},mode={mode},progress=false"
        model_args += f",keep_set={args.keep_set}" if mode != "full" else ""
        model_args += f",student={args.student}" if mode == "distilled" else ""
        lm_s[mode] = _run([sys.executable, "-m", "slimwise_train.lm_eval", "--model", "slimwise", "--model_args",
                           model_args, "--tasks", ",".join(f"slimwise_{f}" for f in FAMILIES), "--limit",
                           str(args.num_per_family), "--batch_size", str(args.batch_size), "--device", "cpu",
                           "--log_samples", "--output_path", str(out / "lm_eval")], out / f"lm_eval_{mode}.log")
    # The same five modes through lm-eval's Python route in ONE process, as the eval app runs them: no interpreter
    # start, imports and task index per mode.
    python_route = (
        "import sys, time; from slimwise_train.lm_eval import SlimwiseLM, evaluate, task_manager; "
        "teacher, keep, student, n, batch, out = sys.argv[1:7]; manager = task_manager(include_defaults=False); "
        f"tasks = {[f'slimwise_{f}' for f in FAMILIES]!r}\n"
        f"for mode in {list(MODES)!r}:\n"
        "    extra = {} if mode == 'full' else {'keep_set': keep}\n"
        "    extra.update({'student': student} if mode == 'distilled' else {})\n"
        "    lm = SlimwiseLM(pretrained=teacher, mode=mode, device='cpu', batch_size=int(batch), progress=False, **extra)\n"
        "    evaluate(lm, tasks, output_path=out, limit=int(n), task_manager=manager)\n"
        "    lm.masking and lm.masking.remove()\n")
    python_s = _run([sys.executable, "-c", python_route, args.teacher, args.keep_set, args.student,
                     str(args.num_per_family), str(args.batch_size), str(out / "lm_eval_python")],
                    out / "lm_eval_python.log", label="lm_eval python route, five modes")
    app = json.loads((out / "eval_app" / "results.json").read_text())
    (folder,) = {p.parent for p in (out / "lm_eval").rglob("results_*.json")}
    from slimwise_train.eval.modes import LM_EVAL_NAMES

    app_mode = {lm_eval: app for app, lm_eval in LM_EVAL_NAMES.items()}  # lm-eval's name -> the eval app's
    cells, mismatches = {}, []
    for route, route_folder in (("cli", folder), ("python", out / "lm_eval_python")):
        for mode in MODES:
            run = [p for p in route_folder.glob(f"slimwise_summary_{mode}*.json")]
            summary = json.loads(max(run, key=lambda p: p.stat().st_mtime).read_text())
            for family in FAMILIES:
                (row,) = [r for r in app["rows"] if r["mode"] == app_mode.get(mode, mode) and r["family"] == family]
                ours = summary["tasks"][f"slimwise_{family}"]
                cell = cells.setdefault(f"{mode}/{family}", {"eval_app": {m: row[m] for m in COMPARED}})
                cell[f"lm_eval_{route}"] = {m: ours[m] for m in COMPARED}
                mismatches += [f"{route} {mode}/{family}/{m}: {row[m]} vs {ours[m]}" for m in COMPARED
                               if abs((row[m] or 0) - (ours[m] or 0)) > 1e-12]
    lm_total = sum(lm_s.values())
    return {
        "bench": "lm_eval",
        "num_per_family": args.num_per_family,
        "budgets": budgets,
        "eval_app_s": round(app_s, 1),
        "lm_eval_cli_s": round(lm_total, 1),
        "lm_eval_cli_s_per_mode": {m: round(s, 1) for m, s in lm_s.items()},
        "lm_eval_python_s": round(python_s, 1),
        "wall_ratio_python": round(python_s / app_s, 3),  # the same work in one process, as the eval app
        "wall_ratio_cli": round(lm_total / app_s, 3),  # + one interpreter, import and report per mode
        "equal": not mismatches,
        "mismatches": mismatches,
        "cells": cells,
        "targets": {"wall_ratio_python_max": 1.3, "equal": True},
        "targets_met": not mismatches and python_s / app_s <= 1.3,
    }

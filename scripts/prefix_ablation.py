"""Does the distilled student need the full model's prefill? The ablation of issue 23, on the shipped teacher.

    python scripts/prefix_ablation.py                 # ~20 min on 2 CPU cores; writes docs/prefix-ablation-<date>.md
    ABLATION_STEPS=100 ABLATION_EVAL_N=50 python scripts/prefix_ablation.py --out /tmp/abl   # a quick look

For each REAP ratio (50%, 75%) and each training (`distill.split.prefix_from=teacher`: the student continues on the
teacher's prefill cache, the method; `student`: on its own pruned prefill, everything else equal: the demo's recipe,
seed, data and steps), the distilled student is evaluated in two serving modes on the same held-out problems:
`slimwise_distill` (full prefill, student decode) and `conventional_distill` (the student alone). Differences are
paired per problem: mean difference of exact-match accuracy +- its standard error (std of the per-problem
differences / sqrt(n)).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from slimwise_train.commands import DOCS_VENV_NOTE  # noqa: E402
from slimwise_train.eval.study import paired_difference, run_app  # noqa: E402

RATIOS = ("0.5", "0.75")
TRAININGS = ("teacher", "student")
MODES = ("slimwise_distill", "conventional_distill")


def run(cmd: list[str], log: Path) -> float:
    return run_app(cmd, log, REPO, "prefix_ablation")


def paired(a: list[bool], b: list[bool]) -> tuple[float, float]:
    """(mean of a - b, its standard error) over problems paired by index."""
    return paired_difference(a, b)[:2]


def correct_by_family(results: dict, mode: str) -> dict[str, list[bool]]:
    (record,) = [r for r in results["runs"] if r["mode"] == mode]
    out: dict[str, list[bool]] = {}
    for problem, ok in zip(results["problems"], record["correct"], strict=True):
        out.setdefault(problem["family"], []).append(bool(ok))
    out["all"] = [bool(ok) for ok in record["correct"]]
    return out


def fmt(mean: float, se: float) -> str:
    return f"{mean:+.3f} +- {se:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(REPO / "outputs" / "prefix_ablation"))
    parser.add_argument("--doc", default=str(REPO / "docs" / f"prefix-ablation-{time.strftime('%Y-%m-%d')}.md"))
    args = parser.parse_args()
    steps = int(os.environ.get("ABLATION_STEPS", 1000))
    eval_n = int(os.environ.get("ABLATION_EVAL_N", 200))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    timings, results = {}, {}
    for ratio in RATIOS:
        prune_dir = out / f"prune-r{ratio}"
        if not (prune_dir / "keep_set.json").is_file():
            timings[f"prune {ratio}"] = run([sys.executable, "-m", "slimwise_train.prune", "model=teacher",
                                             "prune.criterion=reap", f"prune.ratio={ratio}",
                                             f"hydra.run.dir={prune_dir}"], out / f"prune-r{ratio}.log")
        for training in TRAININGS:
            train_dir = out / f"train-r{ratio}-{training}"
            if not (train_dir / "export" / "config.json").is_file():
                timings[f"train {ratio} {training}"] = run(
                    [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "slimwise_train",
                     "experiment=demo", f"prune.keep_set={prune_dir / 'keep_set.json'}",
                     f"distill.schedule.max_steps={steps}", f"distill.split.prefix_from={training}",
                     f"output_dir={train_dir}", f"hydra.run.dir={train_dir}"],
                    out / f"train-r{ratio}-{training}.log")
            eval_dir = out / f"eval-r{ratio}-{training}"
            if not (eval_dir / "results.json").is_file():
                timings[f"eval {ratio} {training}"] = run(
                    [sys.executable, "-m", "slimwise_train.eval", "model=teacher",
                     f"eval.keep_sets=[{prune_dir / 'keep_set.json'}]", f"eval.student={train_dir}",
                     f"eval.modes=[{','.join(MODES)}]", f"eval.num_per_family={eval_n}", "progress=false",
                     f"hydra.run.dir={eval_dir}"], out / f"eval-r{ratio}-{training}.log")
            results[(ratio, training)] = json.loads((eval_dir / "results.json").read_text())

    families = ["math", "code", "tool", "all"]
    lines = [f"# Does the distilled student need the full prefill? ({time.strftime('%Y-%m-%d')})", "", DOCS_VENV_NOTE, "",
             f"`python scripts/prefix_ablation.py` on the shipped teacher: REAP, the demo's recipe (`experiment=demo`, "
             f"2 ranks ZeRO-2, {steps} steps, same seed and data), {eval_n} held-out problems per family, greedy. "
             "Cells: exact-match accuracy; differences are paired per problem (mean +- standard error).", "",
             "Trainings: `prefix_from=teacher` (the method: the student learns to continue the teacher's prefill "
             "cache) and `prefix_from=student` (the student continues its own pruned prefill, gradients through it). "
             "Serving modes: `slimwise_distill` (full prefill, student decode) and `conventional_distill` (the "
             "student alone: prune + distill).", ""]
    for ratio in RATIOS:
        lines += [f"## REAP {float(ratio):.0%} pruning", "",
                  "| training | serving mode | " + " | ".join(families) + " |",
                  "|---|---|" + "---|" * len(families)]
        for training in TRAININGS:
            for mode in MODES:
                correct = correct_by_family(results[(ratio, training)], mode)
                cells = [f"{sum(correct[f]) / len(correct[f]):.3f}" for f in families]
                lines.append(f"| prefix_from={training} | {mode} | " + " | ".join(cells) + " |")
        lines += ["", "| paired difference | " + " | ".join(families) + " |", "|---|" + "---|" * len(families)]
        for training in TRAININGS:
            a = correct_by_family(results[(ratio, training)], "slimwise_distill")
            b = correct_by_family(results[(ratio, training)], "conventional_distill")
            lines.append(f"| prefix_from={training}: slimwise_distill - conventional_distill | "
                         + " | ".join(fmt(*paired(a[f], b[f])) for f in families) + " |")
        for mode in MODES:
            a = correct_by_family(results[(ratio, "teacher")], mode)
            b = correct_by_family(results[(ratio, "student")], mode)
            lines.append(f"| {mode}: trained on the teacher's prefill - on its own | "
                         + " | ".join(fmt(*paired(a[f], b[f])) for f in families) + " |")
        # each student served the way it was trained: SlimWise + distill against prune + distill, both at their best
        a = correct_by_family(results[(ratio, "teacher")], "slimwise_distill")
        b = correct_by_family(results[(ratio, "student")], "conventional_distill")
        lines.append("| as trained: slimwise_distill (teacher's prefill) - conventional_distill (own prefill) | "
                     + " | ".join(fmt(*paired(a[f], b[f])) for f in families) + " |")
        lines.append("")
    if timings:
        lines += ["Wall time (2 CPU cores, this run): " + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items())
                  + (" (steps already done were reused)" if len(timings) < 2 + 4 * 2 else ""), ""]
    else:
        lines += [f"Wall time: every step was reused from {out} (this run only wrote the tables).", ""]
    text = "\n".join(lines)
    print(text)
    doc = Path(args.doc)
    tmp = doc.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, doc)
    print(f"wrote {doc}")


if __name__ == "__main__":
    main()

"""Stronger repair at high pruning: students side by side on the shipped teacher.

For each pruning ratio (REAP) and each student variant (VARIANTS below: the new-expert student and the LoRA presets
beside it, or the no-module default against the new-expert student) this
runs the user's commands of `make demo` (scripts/demo.py) with the same seed, data and step count:
  1. python -m slimwise_train.prune model=teacher prune.criterion=reap prune.ratio=<r>
  2. torchrun --nproc_per_node 2 -m slimwise_train experiment=demo prune.keep_set=<keep_set.json> \\
         <the variant's overrides> distill.schedule.max_steps=<steps>
  3. python -m slimwise_train.eval model=teacher eval.keep_sets=[<keep_set.json>] eval.student=<run> \\
         eval.modes=[slimwise_distill]          (plus one run of the full / untrained SlimWise baselines)
and writes outputs/lora_comparison/report.md (cells: accuracy / median / p90 output length / share hitting the
token budget, per family of the synthetic suite) with each preset's trainable share and its mean step time
against always_on, and a dated copy to docs/lora-<date>.md.

    python scripts/lora_comparison.py                       # 2 ratios x 3 presets x 1000 steps
    LORA_PRESETS=new_expert,no_module python scripts/lora_comparison.py   # stock export vs new expert (issue 22)
    LORA_STEPS=200 LORA_EVAL_N=50 python scripts/lora_comparison.py     # a quick look
Knobs: LORA_STEPS, LORA_EVAL_N, LORA_RATIOS (0.5,0.75), LORA_PRESETS (names in VARIANTS), LORA_OUT, LORA_DOCS
(folder of the dated copy, default docs/; 0: none), LORA_DOCS_NAME (its name before the date, default lora).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from slimwise_train.commands import DOCS_VENV_NOTE  # noqa: E402

OUT = Path(os.environ.get("LORA_OUT", REPO / "outputs" / "lora_comparison"))
STEPS = int(os.environ.get("LORA_STEPS", 1000))
EVAL_N = int(os.environ.get("LORA_EVAL_N", 200))
RATIOS = os.environ.get("LORA_RATIOS", "0.5,0.75").split(",")
# Student variants on the teacher (Qwen3-MoE: no shared slot of its own). The first is the step-time reference.
VARIANTS = {
    # a new shared expert (exported with remote code): what always_on meant before the no-module default
    "new_expert": ["distill/trainable=always_on", "distill.student.shared_expert_mode=new"],
    "always_on+lora_experts": ["distill/trainable=always_on+lora_experts", "distill.student.shared_expert_mode=new"],
    "always_on+lora_attention": ["distill/trainable=always_on+lora_attention",
                                 "distill.student.shared_expert_mode=new"],
    # the default on families without a slot: no added module, LoRA on the kept experts merged at export
    "no_module": ["distill/trainable=auto", "distill.student.shared_expert_mode=auto"],
}
PRESETS = os.environ.get("LORA_PRESETS", "new_expert,always_on+lora_experts,always_on+lora_attention").split(",")
_unknown = [p for p in PRESETS if p not in VARIANTS]
if _unknown:
    raise SystemExit(f"LORA_PRESETS: unknown {_unknown}; use some of {', '.join(VARIANTS)}")
FAMILIES = ("math", "code", "tool")


def run(name: str, cmd: list[str], timings: dict, log_dir: Path) -> None:
    """One stage as its own process (the user's command), output to <log_dir>/<name>.log."""
    print(f"=== {name}: {' '.join(cmd)}", flush=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
           "WANDB_MODE": os.environ.get("WANDB_MODE", "disabled")}
    log_dir.mkdir(parents=True, exist_ok=True)
    start = time.time()
    with open(log_dir / f"{name}.log", "w") as log:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    timings[name] = round(time.time() - start, 1)
    print(f"    {timings[name]} s", flush=True)
    if proc.returncode != 0:
        raise SystemExit(f"lora_comparison: '{name}' failed (exit {proc.returncode}); see {log_dir / name}.log")


def rows_of(eval_dir: Path) -> list[dict]:
    return json.loads((eval_dir / "results.json").read_text())["rows"]


def cells(rows: list[dict], keep_set: str | None, mode: str) -> tuple[list[str], float]:
    """(per-family cells 'acc / median / p90 / hit', accuracy over all problems) of one mode."""
    mine = {r["family"]: r for r in rows if r["mode"] == mode and r["keep_set"] == keep_set}
    out, correct, total = [], 0.0, 0
    for family in FAMILIES:
        r = mine[family]
        median = f"{r['median_length']:g}"
        out.append(f"{r['accuracy']:.2f} / {median} / {r['p90_length']:g} / {r['hit_budget']:.2f}")
        correct += r["accuracy"] * r["n"]
        total += r["n"]
    return out, correct / max(total, 1)


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    logs, timings = OUT / "logs", {}
    start = time.time()
    model = ["model=teacher"]
    keep_sets = {}
    for ratio in RATIOS:
        prune_dir = OUT / "prune" / f"reap-r{ratio}"
        run(f"prune-r{ratio}", [sys.executable, "-m", "slimwise_train.prune", *model, "prune.criterion=reap",
                                f"prune.ratio={ratio}", f"prune.cache_dir={OUT / 'cache'}",
                                f"hydra.run.dir={prune_dir}"], timings, logs)
        keep_sets[ratio] = prune_dir / "keep_set.json"
    train_dirs = {}
    for ratio in RATIOS:
        for preset in PRESETS:
            train_dir = OUT / "train" / f"reap-r{ratio}" / preset
            if train_dir.exists():
                shutil.rmtree(train_dir)
            run(f"train-r{ratio}-{preset}",
                [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                 "-m", "slimwise_train", "experiment=demo", f"prune.keep_set={keep_sets[ratio]}",
                 *VARIANTS[preset], f"distill.schedule.max_steps={STEPS}", "progress=false",
                 f"hydra.run.dir={train_dir}"], timings, logs)
            train_dirs[ratio, preset] = train_dir
    # Baselines once: the full model and the untrained pruned decoder (SlimWise without distillation).
    base_dir = OUT / "eval" / "baselines"
    run("eval-baselines", [sys.executable, "-m", "slimwise_train.eval", *model,
                           f"eval.keep_sets=[{','.join(str(keep_sets[r]) for r in RATIOS)}]",
                           "eval.modes=[full,slimwise]", f"eval.num_per_family={EVAL_N}", "progress=false",
                           f"hydra.run.dir={base_dir}"], timings, logs)
    eval_dirs = {}
    for (ratio, preset), train_dir in train_dirs.items():
        eval_dir = OUT / "eval" / f"reap-r{ratio}" / preset
        run(f"eval-r{ratio}-{preset}", [sys.executable, "-m", "slimwise_train.eval", *model,
                                        f"eval.keep_sets=[{keep_sets[ratio]}]", f"eval.student={train_dir}",
                                        "eval.modes=[slimwise_distill]", f"eval.num_per_family={EVAL_N}",
                                        "progress=false", f"hydra.run.dir={eval_dir}"], timings, logs)
        eval_dirs[ratio, preset] = eval_dir
    total = round(time.time() - start, 1)
    report = render(keep_sets, train_dirs, eval_dirs, base_dir, timings, total)
    (OUT / "report.md").write_text(report)
    docs_dir = os.environ.get("LORA_DOCS", str(REPO / "docs"))
    if docs_dir != "0":
        docs = Path(docs_dir) / f"{os.environ.get('LORA_DOCS_NAME', 'lora')}-{time.strftime('%Y-%m-%d')}.md"
        docs.write_text(report)
        print(f"dated copy: {docs}")
    print("\n" + report)
    print(f"lora_comparison finished in {total} s -> {OUT / 'report.md'}")
    return 0


def render(keep_sets, train_dirs, eval_dirs, base_dir, timings, total) -> str:
    base = rows_of(base_dir)
    lines = [
        ("# Stock-class student (no added module) vs the new-expert student" if "no_module" in PRESETS
         else "# Stronger repair at high pruning: LoRA presets vs always-on"), "", DOCS_VENV_NOTE, "",
        "Shipped teacher (`slimwise_train/assets/teacher`: stock Qwen3-MoE, 4 layers, 64 experts top-4), REAP "
        f"pruning, distillation `experiment=demo` (2 ranks, DeepSpeed ZeRO-2, lr 2e-3) for {STEPS} steps with the "
        "same seed and data for every preset, then the eval app's slimwise_distill mode (full prefill, distilled "
        f"decoder) on {EVAL_N} held-out problems per family. Cells: accuracy / median / p90 output length / share "
        "hitting the token budget. Trainable share: trainable parameters / all parameters of the one training module "
        "(expert LoRA is allocated for every expert; in brackets the share that can train, i.e. without the removed "
        "experts' pairs, which stay zero). Step "
        f"time: mean training step against {PRESETS[0]} at the same ratio (2 CPU ranks, shared machine: +-10% noise). "
        "Variants: " + "; ".join(f"`{p}`: {' '.join(VARIANTS[p])}" for p in PRESETS) + ".",
        "",
    ]
    for ratio in RATIOS:
        name = keep_sets[ratio].parent.name
        lines += [f"## {float(ratio):.0%} of the experts removed (`{name}`)", "",
                  f"| mode | math | code | tool | all | trainable share | step time vs {PRESETS[0]} | held-out KL |",
                  "|---|---|---|---|---|---|---|---|"]
        full, full_all = cells(base, None, "full")
        lines.append(f"| full | {' | '.join(full)} | {full_all:.2f} | - | - | - |")
        pruned, pruned_all = cells(base, name, "slimwise")
        lines.append(f"| SlimWise, no distillation | {' | '.join(pruned)} | {pruned_all:.2f} | - | - | - |")
        first = json.loads((train_dirs[ratio, PRESETS[0]] / "summary.json").read_text())
        reference, always_on = first["step_seconds_mean"], first["trainable_params"]
        for preset in PRESETS:
            summary = json.loads((train_dirs[ratio, preset] / "summary.json").read_text())
            row, row_all = cells(rows_of(eval_dirs[ratio, preset]), name, "slimwise_distill")
            ratio_time = summary["step_seconds_mean"] / reference if reference else float("nan")
            share = f"{summary['trainable_share']:.2%}"
            if preset.endswith("lora_experts") and PRESETS[0] == "new_expert":
                lora = summary["trainable_params"] - always_on  # the LoRA pairs, removed experts' included
                live = always_on + lora * (1 - float(ratio))
                share += f" ({live / (summary['total_params'] - lora * float(ratio)):.2%})"
            lines.append(f"| + distill `{preset}` | {' | '.join(row)} | {row_all:.2f} | "
                         f"{share} | {ratio_time:.2f}x | {summary['eval/kl']:.4f} |")
        lines.append("")
    knobs = f"LORA_STEPS={STEPS} LORA_EVAL_N={EVAL_N} LORA_PRESETS={','.join(PRESETS)}"
    if os.environ.get("LORA_DOCS_NAME"):
        knobs += f" LORA_DOCS_NAME={os.environ['LORA_DOCS_NAME']}"
    lines += ["## Reproduce", "", "```", f"{knobs} python scripts/lora_comparison.py",
              "```", "", f"Wall time {total} s: " + ", ".join(f"{k} {v} s" for k, v in timings.items()) + "."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())

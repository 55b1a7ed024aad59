"""Train the deep teacher of the fidelity study (slimwise_train/assets/teacher_deep) by its staged recipe.

    python scripts/train_deep_teacher.py                  # every stage; after a pause, the same command continues
    python scripts/train_deep_teacher.py --minutes 30     # pause (checkpoint) after 30 minutes of this run
    python scripts/train_deep_teacher.py --after stepscode=DIR   # go on from a stage kept from an earlier machine

Each stage is one `scripts/train_teacher.py --preset deep` run in `<out>/<stage>/`, started from the previous
stage's final model (`--grow-from`); a finished stage (`<out>/<stage>/final/`) is skipped, a paused one resumed
from its checkpoint, so rerunning the command is always safe. The last stage's model is copied to `<out>/final/`
(copy that folder into slimwise_train/assets/teacher_deep to ship it). The recipe takes longer than one session's
machine lives (models in outputs/ go with it): a finished stage's model is kept in recipes/teacher_deep/<stage>/ and
the next machine goes on from it with `--after`. Why these stages (docs/teacher.md):

1. ``recall`` (4 layers, from the shipped teacher): lookups alone, dense questions on small tables. Recall of the
   cell after a key forms as a phase change after ~6-8M tokens of such questions, and not within 27M tokens when
   the mixture's other families share the steps.
2. ``warmforms`` (4 layers): the whole long-context mixture (lookups weighted 2.5), where 4 layers train ~3x faster
   per token than 12, its first 20 chunks in easy forms of toolpick and steps; the other families come back from
   the shipped teacher's skills.
3. ``focus`` (4 layers): the mixture again from that model, the families still short of 0.9 weighted up.
4. ``toolpick`` (4 layers): toolpick weighted 5 of 10.2. Choosing the listed spelling of a tool forms late; its CE
   per token hides it (one decisive token per ~43-token call), the held-out checks show it.
5. ``stepscode`` (4 layers): longer, at lr 7e-4, steps and code weighted up. steps' errors are mostly copying the
   wrong operand of a long chain, code's are dedupe and sort; the only stage that took steps to 0.85 was a
   7000-step one at 7e-4, and code (0.91 in the shipped teacher) is forgotten under the long families.
6. ``depth`` (12 layers): each layer repeated three times, the repeats silent at the start (the grown model computes
   what the 4-layer one does), then trained on stepscode's mixture at a lower lr so the new layers take part.
7. ``depthcode`` (12 layers): a short stage at lr 1e-4 with code weighted up, the one family depth left short.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import sys
import time
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[1]
SHIPPED = str(REPO / "slimwise_train" / "assets" / "teacher")
ONLY_LOOKUP = "lookup=1,toolpick=0,steps=0,fewshot=0,math=0,code=0,tool=0"
# code weighted by answer tokens (its examples are ~87 tokens against lookup's ~417), steps the most
STEPSCODE_MIX = "toolpick=2.5,lookup=2,steps=2.5,code=5,fewshot=1.2,math=0.6,tool=0.5"


class Stage(NamedTuple):
    name: str
    flags: tuple[str, ...]  # train_teacher.py --preset deep flags; "{previous}" is the previous stage's final model


STAGES: tuple[Stage, ...] = (
    Stage("recall", (
        "--layers", "4", "--grow-from", SHIPPED, "--lr", "1e-3", "--warmup", "100",
        # the cosine planned over 4000 steps, ended at 2061: where recall had formed (0.80 on its tables)
        "--max-steps", "4000", "--end-at", "2061", "--mix", ONLY_LOOKUP,
        "--warm-params", "lookup.min_columns=0,lookup.max_columns=0,lookup.min_rows=8,lookup.max_rows=20,"
                         "lookup.min_steps=12,lookup.max_steps=24,lookup.name_key_share=1",
        "--warm-chunks", "1000", "--final-eval", "20")),
    Stage("warmforms", (
        # the whole mixture, its first 20 chunks (of ~52) in easy forms of toolpick and steps (fewer schemas, shorter
        # chains): in the eleventh session toolpick, steps and fewshot rose earlier than in the same run without them
        "--layers", "4", "--grow-from", "{previous}", "--lr", "1e-3", "--warmup", "100", "--max-steps", "8000",
        "--seed", "2026", "--mix", "toolpick=3,lookup=2.5,steps=1.5,code=1.5,fewshot=1.2,math=0.4,tool=0.3",
        "--warm-params", "toolpick.min_offered=4,toolpick.max_offered=10,toolpick.min_steps=3,toolpick.max_steps=8,"
                         "steps.min_steps=4,steps.max_steps=12",
        "--warm-chunks", "20", "--final-eval", "40")),
    Stage("focus", (
        # the skills still short after it (toolpick's listed spelling, steps' long chains, code) weighted up
        "--layers", "4", "--grow-from", "{previous}", "--lr", "5e-4", "--warmup", "100", "--max-steps", "3000",
        "--mix", "toolpick=5,steps=2,code=2,fewshot=1,lookup=1,math=0.6,tool=0.4", "--final-eval", "40")),
    Stage("toolpick", (
        "--layers", "4", "--grow-from", "{previous}", "--lr", "5e-4", "--warmup", "100", "--max-steps", "3000",
        "--mix", "toolpick=5,lookup=1.5,steps=1,code=1.2,fewshot=0.7,math=0.4,tool=0.4", "--final-eval", "40")),
    Stage("stepscode", (
        "--layers", "4", "--grow-from", "{previous}", "--lr", "7e-4", "--warmup", "100", "--max-steps", "6500",
        "--mix", STEPSCODE_MIX, "--final-eval", "40")),
    Stage("depth", (
        # stepscode's mix at half depth's former lr: at 3e-4 on the older mix steps lost 0.07 +- 0.029 and code
        # 0.06 +- 0.028 (paired, 100 per family), slips of the kind the low-lr tail of stepscode had removed
        "--layers", "12", "--grow-from", "{previous}", "--lr", "1.5e-4", "--warmup", "50", "--max-steps", "1000",
        "--mix", STEPSCODE_MIX)),
    Stage("depthcode", (
        # the grown model's code (0.87; the 4-layer one's 0.89) is the one family short of 0.9: code weighted up,
        # a short stage at a low lr so the others stay where depth left them
        "--layers", "12", "--grow-from", "{previous}", "--lr", "1e-4", "--warmup", "30", "--max-steps", "600",
        "--mix", "toolpick=2.5,lookup=2,steps=2.5,code=8,fewshot=1.2,math=0.6,tool=0.5")),
)


def load_train_teacher():
    spec = importlib.util.spec_from_file_location("train_teacher", REPO / "scripts" / "train_teacher.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(REPO / "outputs" / "teacher_deep"))
    parser.add_argument("--minutes", type=float, default=None,
                        help="pause (checkpoint) after this many minutes of this run; default: run every stage")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps-this-run", type=int, default=0,
                        help="pause the stage in progress after this many steps (0: no limit)")
    parser.add_argument("--after", default=None, metavar="STAGE=PATH",
                        help="take STAGE and the ones before it as done, with PATH as STAGE's final model (one kept "
                             "from an earlier machine, e.g. recipes/teacher_deep/<stage>); the later stages start "
                             "from it")
    args = parser.parse_args(argv)
    if args.after is not None:
        name, _, path = args.after.partition("=")
        names = [s.name for s in STAGES]
        if name not in names or not path:
            parser.error(f"--after must be STAGE=PATH with STAGE one of {names}, got {args.after!r}")
        if not (Path(path) / "model.safetensors").is_file():
            parser.error(f"--after {args.after}: {path} holds no model.safetensors (a stage's final model folder)")
        args.after = (name, Path(path))
    if args.minutes is not None and not args.minutes > 0:
        parser.error(f"--minutes must be > 0, got {args.minutes}")
    return args


def stage_argv(stage: Stage, folder: Path, previous: Path | None) -> list[str]:
    flags = [str(previous) if f == "{previous}" else f for f in stage.flags]
    if "{previous}" in stage.flags and previous is None:
        raise ValueError(f"stage {stage.name} starts from the previous stage's model, but it is the first")
    return ["--preset", "deep", "--out", str(folder), *flags]


def stage_row(name: str, final: Path) -> dict:
    log = json.loads((final / "training_log.json").read_text())
    return {"stage": name, "train_steps": log["steps"], "tokens": log["tokens"],  # "steps" is a family
            "train_minutes": round(log["train_seconds"] / 60, 1),
            **{f: r["accuracy"] for f, r in log["final_eval"].items()}}


def main(argv=None) -> int:
    args = parse_args(argv)
    train_teacher = load_train_teacher()
    out = Path(args.out)
    start = time.time()
    previous: Path | None = None
    summary = []
    skip = 0
    if args.after is not None:
        skip = 1 + [s.name for s in STAGES].index(args.after[0])
        previous = args.after[1]
        print(f"stages 1-{skip} ({', '.join(s.name for s in STAGES[:skip])}): taken as done, from {previous}",
              flush=True)
        if (previous / "training_log.json").is_file():  # the kept stage's own figures head the summary
            summary.append(stage_row(args.after[0], previous))
    for number, stage in enumerate(STAGES, 1):
        if number <= skip:
            continue
        folder = out / stage.name
        final = folder / "final"
        if (final / "model.safetensors").is_file():
            print(f"stage {number}/{len(STAGES)} {stage.name}: done ({final})", flush=True)
        else:
            controls = ["--threads", str(args.threads), "--steps-this-run", str(args.steps_this_run)]
            if args.minutes is not None:
                left = args.minutes - (time.time() - start) / 60
                if left <= 0:
                    print(f"paused before stage {stage.name}; rerun the same command to continue", flush=True)
                    return 0
                controls += ["--minutes", f"{left:.2f}"]
            else:
                controls += ["--minutes", "100000"]
            resume = (folder / "checkpoint" / "state.json").is_file()
            print(f"stage {number}/{len(STAGES)} {stage.name}: {'resuming' if resume else 'starting'} in {folder}",
                  flush=True)
            train_argv = (["--preset", "deep", "--out", str(folder), "--resume"] if resume
                          else stage_argv(stage, folder, previous))
            train_teacher.main(train_argv + controls)
            if not (final / "model.safetensors").is_file():
                print(f"paused in stage {stage.name}; rerun the same command to continue", flush=True)
                return 0
        summary.append(stage_row(stage.name, final))
        previous = final
    from slimwise_train.utils.atomic import atomic_dir

    with atomic_dir(out / "final", overwrite=True) as tmp:
        shutil.copytree(previous, tmp, dirs_exist_ok=True)
        (tmp / "recipe.json").write_text(json.dumps(
            {"stages": [{"name": s.name, "flags": list(s.flags)} for s in STAGES], "results": summary},
            indent=1) + "\n")
    for row in summary:
        print(json.dumps(row), flush=True)
    print(f"deep teacher: {out / 'final'} (copy it to slimwise_train/assets/teacher_deep to ship it)", flush=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    try:
        sys.exit(main())
    except SystemExit as exc:
        if type(exc).__name__ != "UsageError":  # train_teacher.py's bad flags: its one line, exit status 2
            raise
        print(f"train_deep_teacher.py: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None

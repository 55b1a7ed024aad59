"""The method's four findings, measured on the shipped teachers: writes docs/fidelity.md (issue 23).

    python scripts/fidelity.py                       # every teacher (all must be shipped); docs/fidelity.md, ~50 min
    python scripts/fidelity.py --teachers teacher teacher_lr_floor   # the two small teachers, ~14 min on 2 cores
    python scripts/fidelity.py --candidate DIR       # the deep suite on an unshipped checkpoint: its own report
    FIDELITY_EVAL_N=20 FIDELITY_STEPS=20 python scripts/fidelity.py --teachers teacher --out /tmp/fid --doc /tmp/f.md

The findings (the method's paper), each measured per teacher with the project's own apps (prune, distill, eval):
  (1) at 50% pruning the training-free handoff (full prefill, pruned decode: `slimwise`) narrows the gap to the full
      model under every criterion (routing mass, EAN, REAP): slimwise - conventional, paired per problem (also
      reported at 25%, where the pruned decoder is off the floor; the verdict is the 50% claim's);
  (2) pruning distorts output lengths while accuracy can look fine: median / p90 length and the share of outputs
      that hit the token budget (runaway) or end below half the reference length (collapse), full vs pruned;
  (3) distillation on the teacher's cache repairs accuracy and lengths: slimwise_distill vs slimwise (REAP 50%);
  (4) reverse (pruned prefill, full decode) helps math more, SlimWise coding more: reverse - slimwise by family.
Every step is one app call (its command printed, its log kept under --out); a step whose output exists is skipped,
so an interrupted run continues where it stopped. Differences are paired per problem: mean +- standard error (std
of the per-problem differences / sqrt(n)).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from slimwise_train.commands import DOCS_VENV_NOTE  # noqa: E402
from slimwise_train.eval.study import paired_difference as paired  # noqa: E402
from slimwise_train.eval.metrics import collapse_share, length_stats  # noqa: E402
from slimwise_train.eval.study import run_app  # noqa: E402
from slimwise_train.utils.atomic import write_text_atomic  # noqa: E402

CRITERIA = ("mass", "ean", "reap")  # the finding names routing mass, EAN and REAP
RATIO = "0.5"  # the paper's claims are at 50%, so every verdict is judged at this ratio
# finding (1) also at 25%: at 50% a pruned decoder can sit at the floor (no accuracy left for a full prefill to
# restore), which would hide a handoff gain that a lighter pruning shows
LIGHT_RATIO = "0.25"
DISTILL_CRITERION = "reap"
LONG_SUITE_SEED = 4321  # the distillation / calibration rows of the deep teacher: not its training stream's seed
TIMINGS_FILE: list[Path] = []  # <out>/timings.json, set by main
HELDOUT_EXCLUDED = 400  # the deep teacher's held-out problems per family (scripts/train_teacher.py --heldout-exclude)

# the small teachers' suite (math / code / tool) and the demo's distillation recipe
SMALL_SUITE = {"families": ["math", "code", "tool"], "math_like": ["math"], "code_like": ["code"], "steps": 1000,
               "recipe": "demo"}
TEACHERS = {
    # the small shipped teacher (the embedded default)
    "teacher": {"model": "teacher", **SMALL_SUITE},
    # the previous shipped teacher (cosine to 0.1x the peak lr): same suite and shape, more sensitive to a pruned
    # prefill, so the handoff has room to help; a second teacher, so no finding rests on one model
    "teacher_lr_floor": {"model": "teacher_lr_floor", **SMALL_SUITE},
    # the deep teacher (docs/teacher.md): long prompts, retrieval, many schemas, long working
    "teacher_deep": {
        "model": "teacher_deep",
        "families": ["lookup", "toolpick", "steps", "fewshot", "math", "code", "tool"],
        "math_like": ["math", "steps"], "code_like": ["code"],
        "steps": 300,
        "recipe": "fidelity",
    },
}


def run(cmd: list[str], log: Path, timings: dict, name: str) -> None:
    timings[name] = round(run_app(cmd, log, REPO, "fidelity"))
    # kept beside the outputs, so a continued run still reports every step's wall time
    write_text_atomic(TIMINGS_FILE[0], json.dumps(timings, indent=1) + "\n")


def write_long_suite(path: Path, n: int) -> None:
    """Rows for the deep teacher's calibration and distillation: the long-context suite's training stream, every
    held-out problem the teacher excluded kept out (so the evaluated problems stay unseen by the student too)."""
    from slimwise_train.data import synthetic
    excluded = frozenset(e.prompt for e in synthetic.long_heldout(TEACHERS["teacher_deep"]["families"],
                                                                   HELDOUT_EXCLUDED, seed=0))
    rows = []
    for example in synthetic.long_suite(n, LONG_SUITE_SEED, exclude=excluded):
        prompt, answer = synthetic.to_text(example)
        rows.append(json.dumps({"prompt": prompt, "answer": answer, "family": example.family}))
    write_text_atomic(path, "\n".join(rows) + "\n")


def fmt(diff: tuple[float, float, int]) -> str:
    return f"{diff[0]:+.3f} +- {diff[1]:.3f}"


class Results:
    """One eval app's results.json, indexed by (keep set, mode) and family ('all' pools the families)."""

    def __init__(self, path: Path):
        self.data = json.loads(path.read_text())
        self.families = [p["family"] for p in self.data["problems"]]
        self.reference = [p["reference_length"] for p in self.data["problems"]]
        self.budget = self.data["budget"]

    def run(self, keep_set: str | None, mode: str) -> dict:
        (record,) = [r for r in self.data["runs"]
                     if r["mode"] == mode and (mode == "full" or r["keep_set"] == keep_set)]
        return record

    def values(self, keep_set: str | None, mode: str, key: str, family: str = "all") -> list:
        record = self.run(keep_set, mode)
        return [v for v, f in zip(record[key], self.families, strict=True) if family in ("all", f)]

    def accuracy(self, keep_set, mode, family="all") -> float:
        correct = self.values(keep_set, mode, "correct", family)
        return sum(correct) / len(correct)

    def lengths(self, keep_set, mode, family) -> dict:
        """median, p90 (nearest rank), share hitting the budget, share collapsed: the eval app's own metrics."""
        length = self.values(keep_set, mode, "length", family)
        ended = self.values(keep_set, mode, "ended", family)
        ref = [r for r, f in zip(self.reference, self.families, strict=True) if f == family]
        stats = length_stats(length, self.budget[family], ended)
        return {"median": stats["median_length"], "p90": stats["p90_length"], "budget": stats["hit_budget"],
                "collapse": collapse_share(length, ref, ended)}


def keep_name(criterion: str, ratio: str = RATIO) -> str:
    return f"{criterion}-r{ratio}"


def model_args(spec: dict) -> list[str]:
    """The model overrides of every app call: the teacher's preset, and a candidate's checkpoint when one is given."""
    return [f"model={spec['model']}", *([f"model.path={spec['candidate']}"] if spec.get("candidate") else [])]


def measure_teacher(name: str, spec: dict, out: Path, eval_n: int, steps: int, timings: dict) -> dict:
    """Prune (3 criteria), distill (REAP), evaluate; returns the figures of the four findings for this teacher."""
    py = sys.executable
    out.mkdir(parents=True, exist_ok=True)
    data_args: list[str] = []
    if name == "teacher_deep":
        rows = out / "long_suite.jsonl"
        if not rows.is_file():
            write_long_suite(rows, 4096)
        data_args = [f"data.source={rows}", "data.seq_len=1024"]
    calibration = [*data_args, "data.num_samples=128"] if data_args else []
    keep_sets, light_keep_sets = {}, {}
    for ratio, sets in ((RATIO, keep_sets), (LIGHT_RATIO, light_keep_sets)):
        suffix = "" if ratio == RATIO else f"-r{ratio}"  # the 50% steps keep their names (a continued run finds them)
        for criterion in CRITERIA:
            prune_dir = out / keep_name(criterion, ratio)  # the eval app names a keep set by its folder
            if not (prune_dir / "keep_set.json").is_file():
                run([py, "-m", "slimwise_train.prune", *model_args(spec), f"prune.criterion={criterion}",
                     f"prune.ratio={ratio}", *calibration, "progress=false", f"hydra.run.dir={prune_dir}"],
                    out / f"prune-{criterion}{suffix}.log", timings,
                    f"{name} prune {criterion}{suffix.replace('-', ' ')}")
            sets[criterion] = prune_dir / "keep_set.json"

    train_dir = out / f"distill-{keep_name(DISTILL_CRITERION)}"
    if not (train_dir / "export" / "config.json").is_file():
        if spec["recipe"] == "demo":  # the demo's own recipe: 2 ranks, ZeRO-2
            cmd = [py, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "slimwise_train",
                   "experiment=demo"]
        else:
            cmd = [py, "-m", "slimwise_train", "experiment=fidelity", *data_args]
        run([*cmd, *model_args(spec), f"prune.keep_set={keep_sets[DISTILL_CRITERION]}",
             f"distill.schedule.max_steps={steps}", f"output_dir={train_dir}", f"hydra.run.dir={train_dir}"],
            out / "distill.log", timings, f"{name} distill")

    families = f"eval.families=[{','.join(spec['families'])}]"
    common = [*model_args(spec), families, f"eval.num_per_family={eval_n}", "progress=false"]

    def evaluate(folder: str, keep_paths: list[Path], modes: str, *extra: str) -> Results:
        """One eval app call into <out>/<folder> (skipped when its results exist), logged as <folder>.log."""
        if not (out / folder / "results.json").is_file():
            run([py, "-m", "slimwise_train.eval", *common, f"eval.keep_sets=[{','.join(map(str, keep_paths))}]",
                 *extra, f"eval.modes=[{modes}]", f"hydra.run.dir={out / folder}"],
                out / f"{folder}.log", timings, f"{name} {folder.replace('-', ' ')}")
        return Results(out / folder / "results.json")

    return {"main": evaluate("eval-reap", [keep_sets[DISTILL_CRITERION]],
                             "full,conventional,slimwise,reverse,slimwise_distill", f"eval.student={train_dir}"),
            "more": evaluate("eval-mass-ean", [keep_sets[c] for c in CRITERIA if c != DISTILL_CRITERION],
                             "full,conventional,slimwise"),
            "light": evaluate(f"eval-r{LIGHT_RATIO}", [light_keep_sets[c] for c in CRITERIA],
                              "full,conventional,slimwise"),
            "spec": spec, "steps": steps}


# ----------------------------------------------------------------------------------------------- verdicts
def significant(diff: tuple[float, float, int], sign: int = 1) -> bool:
    """The paired difference is in the expected direction by more than two standard errors."""
    mean, se, _ = diff
    return sign * mean > 2 * se and sign * mean > 0


def finding_1(m: dict) -> tuple[list[str], str]:
    fams = m["spec"]["families"]
    lines = ["| criterion, pruned | " + " | ".join(f"{f}: conv / SlimWise / diff" for f in fams) + " | pooled diff |",
             "|---|" + "---|" * (len(fams) + 1)]
    pooled_by_ratio, any_sig, any_neg = {RATIO: [], LIGHT_RATIO: []}, False, False
    rows = [(c, RATIO, m["main"] if c == DISTILL_CRITERION else m["more"]) for c in CRITERIA]
    rows += [(c, LIGHT_RATIO, m["light"]) for c in CRITERIA] if "light" in m else []
    for criterion, ratio, res in rows:
        ks = keep_name(criterion, ratio)
        cells = []
        for f in fams + ["all"]:
            diff = paired(res.values(ks, "slimwise", "correct", f), res.values(ks, "conventional", "correct", f))
            if ratio == RATIO:  # the verdict is the paper's claim at 50%
                any_sig |= significant(diff) and f != "all"
                any_neg |= significant(diff, -1)
            if f == "all":
                pooled_by_ratio[ratio].append(significant(diff))
                cells.append(fmt(diff))
            else:
                cells.append(f"{res.accuracy(ks, 'conventional', f):.2f} / {res.accuracy(ks, 'slimwise', f):.2f} / "
                             f"{fmt(diff)}")
        lines.append(f"| {criterion} {float(ratio):.0%} | " + " | ".join(cells) + " |")
    pooled_sig = pooled_by_ratio[RATIO]
    full = m["main"]
    lines += ["", "Full model: " + ", ".join(f"{f} {full.accuracy(None, 'full', f):.2f}" for f in fams) + "."]
    if all(pooled_sig):
        verdict = "reproduced: SlimWise beats conventional pruning by more than 2 SE pooled under every criterion"
    elif any(pooled_sig) or any_sig:
        verdict = ("partly: SlimWise beats conventional by more than 2 SE "
                   + ("pooled under " + ", ".join(c for c, s in zip(CRITERIA, pooled_sig) if s) if any(pooled_sig)
                      else "in some families only") + ", not under every criterion")
    else:
        verdict = "not reproduced: no pooled or per-family difference exceeds 2 SE"
    if any_neg:
        verdict += "; SlimWise is worse by more than 2 SE somewhere at 50% (see the table)"
    if "light" in m:
        gains = [c for c, s in zip(CRITERIA, pooled_by_ratio[LIGHT_RATIO]) if s]
        verdict += (f"; at {float(LIGHT_RATIO):.0%} SlimWise beats conventional by more than 2 SE pooled under "
                    f"{', '.join(gains)}" if gains else
                    f"; at {float(LIGHT_RATIO):.0%} no pooled difference exceeds 2 SE either")
    return lines, verdict


def finding_2(m: dict) -> tuple[list[str], str]:
    res, ks = m["main"], keep_name(DISTILL_CRITERION)
    lines = ["| family | mode | accuracy | median | p90 | hit budget | collapsed |", "|---|---|---|---|---|---|---|"]
    distorted, fine_accuracy = [], []
    for f in m["spec"]["families"]:
        full = res.lengths(None, "full", f)
        for mode in ("full", "conventional", "slimwise"):
            st = res.lengths(ks if mode != "full" else None, mode, f)
            acc = res.accuracy(ks if mode != "full" else None, mode, f)
            lines.append(f"| {f} | {mode} | {acc:.2f} | {st['median']:g} | {st['p90']:g} | {st['budget']:.2f} | "
                         f"{st['collapse']:.2f} |")
        conv = res.lengths(ks, "conventional", f)
        ratio = conv["median"] / max(full["median"], 1)
        if ratio >= 1.5 or ratio <= 2 / 3 or conv["budget"] - full["budget"] >= 0.10 \
                or conv["collapse"] - full["collapse"] >= 0.10:
            distorted.append(f"{f} (median x{ratio:.2f}, budget {conv['budget']:.2f}, collapse {conv['collapse']:.2f})")
            if res.accuracy(ks, "conventional", f) >= res.accuracy(None, "full", f) - 0.10:
                fine_accuracy.append(f)
    rule = ("Distorted: the pruned model's median length outside 2/3..1.5 x the full model's, or its budget-hit or "
            "collapse share 0.10 above the full model's.")
    lines += ["", rule, f"Budget per family (tokens): {res.budget}."]
    if distorted and fine_accuracy:
        verdict = (f"reproduced: lengths distorted under REAP 50% in {', '.join(distorted)}, with accuracy within 0.10 "
                   f"of full in {', '.join(fine_accuracy)}")
    elif distorted:
        verdict = (f"partly: lengths distorted in {', '.join(distorted)}, but accuracy falls with them (more than "
                   "0.10 below full), so the distortion is not hidden behind fine accuracy")
    else:
        verdict = "not reproduced: no family's lengths distorted by the rule below"
    return lines, verdict


def finding_3(m: dict) -> tuple[list[str], str]:
    res, ks = m["main"], keep_name(DISTILL_CRITERION)
    fams = m["spec"]["families"]
    lines = ["| family | full | SlimWise | SlimWise + distill | distill - SlimWise | median full / SW / SW+d | "
             "budget+collapse SW / SW+d |", "|---|---|---|---|---|---|---|"]
    for f in fams + ["all"]:
        diff = paired(res.values(ks, "slimwise_distill", "correct", f), res.values(ks, "slimwise", "correct", f))
        row = (f"| {f} | {res.accuracy(None, 'full', f):.2f} | {res.accuracy(ks, 'slimwise', f):.2f} | "
               f"{res.accuracy(ks, 'slimwise_distill', f):.2f} | {fmt(diff)} | ")
        if f == "all":
            lines.append(row + "| |")
            pooled = diff
        else:
            a, b, c = (res.lengths(None, "full", f), res.lengths(ks, "slimwise", f),
                       res.lengths(ks, "slimwise_distill", f))
            lines.append(row + f"{a['median']:g} / {b['median']:g} / {c['median']:g} | "
                         f"{b['budget'] + b['collapse']:.2f} / {c['budget'] + c['collapse']:.2f} |")
    off_before = sum(abs(res.lengths(ks, "slimwise", f)["median"] - res.lengths(None, "full", f)["median"])
                     for f in fams)
    off_after = sum(abs(res.lengths(ks, "slimwise_distill", f)["median"] - res.lengths(None, "full", f)["median"])
                    for f in fams)
    lines += ["", f"Distillation: {m['steps']} steps on the teacher's cache (REAP 50%). Sum over families of |median "
                  f"- full's median|: {off_before:g} before, {off_after:g} after."]
    acc_ok, len_ok = significant(pooled), off_after < off_before
    if acc_ok and len_ok:
        verdict = f"reproduced: accuracy {fmt(pooled)} pooled and medians closer to the full model's"
    elif acc_ok or len_ok:
        verdict = ("partly: " + (f"accuracy {fmt(pooled)} pooled, but medians no closer to full" if acc_ok
                                 else f"medians closer to full, but accuracy {fmt(pooled)} pooled (within 2 SE)"))
    else:
        verdict = f"not reproduced: accuracy {fmt(pooled)} pooled and medians no closer to full"
    return lines, verdict


def finding_4(m: dict) -> tuple[list[str], str]:
    res, ks = m["main"], keep_name(DISTILL_CRITERION)
    lines = ["| family | SlimWise | reverse | reverse - SlimWise |", "|---|---|---|---|"]
    gaps = {}
    for f in m["spec"]["families"]:
        gaps[f] = paired(res.values(ks, "reverse", "correct", f), res.values(ks, "slimwise", "correct", f))
        lines.append(f"| {f} | {res.accuracy(ks, 'slimwise', f):.2f} | {res.accuracy(ks, 'reverse', f):.2f} | "
                     f"{fmt(gaps[f])} |")
    math_like, code_like = m["spec"]["math_like"], m["spec"]["code_like"]
    # the paper's claim as two tests: reverse helps math (reverse - SlimWise > 0 there) and SlimWise helps code
    # (reverse - SlimWise < 0 there); "more" compares the two gaps, unpaired across families (SEs combined)
    math_gap = max((gaps[f] for f in math_like), key=lambda d: d[0])
    code_gap = gaps[code_like[0]]
    contrast = (math_gap[0] - code_gap[0], math.hypot(math_gap[1], code_gap[1]), 0)
    lines += ["", f"Math-like families: {', '.join(math_like)}; code: {', '.join(code_like)}. Math-like gap minus code "
                  f"gap: {fmt(contrast)} (unpaired, SEs combined)."]
    reverse_helps_math = significant(math_gap)
    slimwise_helps_code = significant(code_gap, -1)
    if reverse_helps_math and slimwise_helps_code:
        verdict = "reproduced: reverse beats SlimWise on math-like, SlimWise beats reverse on code (each > 2 SE)"
    elif significant(contrast):
        verdict = ("partly: the math-like gap exceeds the code gap by more than 2 SE, but "
                   + ("SlimWise does not beat reverse on code" if reverse_helps_math else
                      "reverse does not beat SlimWise on math-like families"))
    else:
        verdict = "not reproduced: the reverse - SlimWise gap is not larger on math-like than on code"
    return lines, verdict


FINDINGS = (
    ("(1) The handoff narrows the gap at 50% under every criterion",
     "Accuracy at 50% pruning, conventional (pruned prefill + decode) vs SlimWise (full prefill, pruned decode); "
     "diff = SlimWise - conventional, paired. Also at 25%, where the pruned decoder keeps more of the full model's "
     "accuracy, so a handoff gain has room to show; the verdict is the 50% claim's, the 25% result is added to it.",
     finding_1),
    ("(2) Pruning distorts output lengths while accuracy can look fine",
     "REAP 50%; lengths in generated tokens incl. EOS.", finding_2),
    ("(3) Distillation on the teacher's cache repairs accuracy and lengths",
     "REAP 50%; the student trained with the defaults (`distill.split.prefix_from=teacher`) serves as SlimWise + "
     "distill.",
     finding_3),
    ("(4) Reverse helps math more, SlimWise coding more",
     "REAP 50%; reverse = pruned prefill, full decode.", finding_4),
)


def render(measured: dict, eval_n: int, timings: dict) -> str:
    date = time.strftime("%Y-%m-%d")
    candidate = next((m["spec"]["candidate"] for m in measured.values() if m["spec"].get("candidate")), None)
    command = "python scripts/fidelity.py" + (f" --candidate {candidate}" if candidate else
                                              "" if len(measured) == len(TEACHERS) else
                                              " --teachers " + " ".join(measured))
    lines = [f"# Does the method's evidence reproduce? ({date})", "", DOCS_VENV_NOTE, "",
             f"Written by `{command}` in one run ({sum(timings.values()) / 60:.0f} min of app calls on this "
             f"machine's {os.cpu_count()} CPU cores). {eval_n} held-out problems per family (the heldout stream, "
             "seed 0, which neither teacher nor student trained on), greedy, the budget 2 x the longest reference "
             "answer per family. `a +- b`: mean paired difference +- its standard error; a difference counts when "
             "it exceeds 2 SE.", "",
             *([f"**A candidate, not a shipped teacher.** The deep teacher's suite and recipe measured on the "
                f"checkpoint `{candidate}` (a `model.path` override), which is not shipped: its full-model accuracy "
                "(Teachers, below) is under the 0.9-per-family bar of docs/teacher.md. The verdicts describe that "
                "checkpoint; docs/fidelity.md holds the shipped teachers'.", ""] if candidate else []),
             "## Verdicts", "",
             "| finding | " + " | ".join(f"`{t}`" for t in measured) + " |", "|---|" + "---|" * len(measured)]
    sections, verdicts = [], {}
    for title, what, fn in FINDINGS:
        sections += [f"## {title}", "", what, ""]
        for teacher, m in measured.items():
            body, verdict = fn(m)
            verdicts[(title, teacher)] = verdict
            sections += [f"### `{teacher}`: {verdict.split(':')[0]}", "", f"Verdict: {verdict}.", "", *body, ""]
    for title, _, _ in FINDINGS:
        lines.append(f"| {title} | " + " | ".join(verdicts[(title, t)].split(":")[0] for t in measured) + " |")
    missing = [t for t in TEACHERS if t not in measured]
    if missing:
        lines += ["", f"Not measured in this run: {', '.join(f'`{t}`' for t in missing)} (see Teachers)."]
    lines += ["", *sections, "## Teachers", ""]
    for teacher, m in measured.items():
        full = m["main"]
        lines.append(f"- `{teacher}` (`{' '.join(model_args(m['spec']))}`): families {', '.join(m['spec']['families'])}; "
                     f"full-model accuracy pooled {full.accuracy(None, 'full'):.3f}; distilled {m['steps']} steps.")
    for teacher in missing:
        shipped = (REPO / "slimwise_train" / "assets" / teacher / "config.json").is_file()
        lines.append(f"- `{teacher}`: not measured in this run" + ("." if shipped else
                     f": no shipped checkpoint at slimwise_train/assets/{teacher} yet (docs/teacher.md)."))
    lines += ["", "Wall time per step (s): " + ", ".join(f"{k} {v}" for k, v in timings.items()) + "."
              if timings else "", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="app outputs (default outputs/fidelity, outputs/fidelity-candidate)")
    parser.add_argument("--doc", help="the report (default docs/fidelity.md, docs/fidelity-deep-candidate.md)")
    parser.add_argument("--teachers", nargs="+", choices=list(TEACHERS))
    parser.add_argument("--candidate", metavar="DIR",
                        help="measure the deep teacher's suite on a checkpoint that is not shipped (e.g. a stage of "
                             "scripts/train_deep_teacher.py); writes its own report, never docs/fidelity.md")
    args = parser.parse_args()
    shipped_doc = REPO / "docs" / "fidelity.md"
    candidate = None
    if args.candidate:
        candidate = Path(args.candidate).expanduser().resolve()
        if not (candidate / "config.json").is_file():
            raise SystemExit(f"fidelity: --candidate {args.candidate}: no config.json there; give a checkpoint "
                             "folder such as <out>/final of scripts/train_teacher.py")
        if args.teachers not in (None, ["teacher_deep"]):
            raise SystemExit("fidelity: --candidate measures the deep teacher's suite only; drop --teachers or "
                             "give --teachers teacher_deep")
        if args.doc and Path(args.doc).resolve() == shipped_doc.resolve():
            raise SystemExit("fidelity: --doc docs/fidelity.md reports the shipped teachers only; leave --doc out "
                             "with --candidate (docs/fidelity-deep-candidate.md) or name another file")
        args.teachers = ["teacher_deep"]
    args.teachers = args.teachers or list(TEACHERS)
    args.out = args.out or str(REPO / "outputs" / ("fidelity-candidate" if candidate else "fidelity"))
    args.doc = args.doc or str(REPO / "docs" / "fidelity-deep-candidate.md" if candidate else shipped_doc)
    eval_n = int(os.environ.get("FIDELITY_EVAL_N", 100))
    steps_override = os.environ.get("FIDELITY_STEPS")
    for teacher in [] if candidate else args.teachers:
        path = REPO / "slimwise_train" / "assets" / teacher
        if not (path / "config.json").is_file():
            raise SystemExit(f"fidelity: --teachers {teacher}: no shipped checkpoint at {path}; train it with "
                             "`python scripts/train_deep_teacher.py` and copy its final/ there")
    TIMINGS_FILE.append(Path(args.out) / "timings.json")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    timings = json.loads(TIMINGS_FILE[0].read_text()) if TIMINGS_FILE[0].is_file() else {}
    measured = {}
    for teacher in args.teachers:
        spec = {**TEACHERS[teacher], "candidate": str(candidate)} if candidate else TEACHERS[teacher]
        steps = int(steps_override) if steps_override else spec["steps"]
        print(f"== {teacher}", flush=True)
        measured[teacher] = measure_teacher(teacher, spec, Path(args.out) / teacher, eval_n, steps, timings)
    write_text_atomic(Path(args.doc), render(measured, eval_n, timings))
    print(f"wrote {args.doc}", flush=True)


if __name__ == "__main__":
    main()

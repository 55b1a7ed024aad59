"""`make demo`: the whole SlimWise pipeline on the shipped teacher and synthetic suite.

Every step is the command a user would run; outputs land in outputs/demo/ and the final table in
outputs/demo/report.md:
  1. score experts with REAP and prune 50%      python -m slimwise_train.prune
  2. distill the pruned decoder (2 ranks, ZeRO-2) torchrun --nproc_per_node 2 -m slimwise_train engine=zero2
  3. evaluate full / conventional / SlimWise / reverse / SlimWise+distill   python -m slimwise_train.eval
  4. decode-step speedup of the keep set at batch 64        python -m slimwise_train.bench decode
Environment knobs (for quick looks; the defaults are the demo): DEMO_STEPS, DEMO_EVAL_N, DEMO_RATIO, DEMO_TEACHER,
DEMO_BENCH=0 (skip step 4: the speedup then comes from the expert-bytes model, labelled as such).
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
OUT = REPO / "outputs" / "demo"
STEPS = int(os.environ.get("DEMO_STEPS", 1000))
EVAL_N = int(os.environ.get("DEMO_EVAL_N", 200))
RATIO = os.environ.get("DEMO_RATIO", "0.5")
TEACHER = os.environ.get("DEMO_TEACHER")  # another teacher folder (default: the shipped one)
MODEL = ["model=teacher"] + ([f"model.path={TEACHER}"] if TEACHER else [])
BENCH = os.environ.get("DEMO_BENCH", "1") != "0"
BATCH = 64
# mode -> (prefill pool, decode pool): which pool's decode step the mode pays for
POOLS = {"full": ("full", "full"), "conventional": ("pruned", "pruned"), "slimwise": ("full", "pruned"),
         "reverse": ("pruned", "full"), "slimwise_distill": ("full", "student")}


def run(name: str, cmd: list[str], timings: dict) -> None:
    print(f"\n=== {name}: {' '.join(cmd)}", flush=True)
    start = time.time()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": os.environ.get("WANDB_MODE", "disabled")}
    proc = subprocess.run(cmd, cwd=REPO, env=env)
    timings[name] = round(time.time() - start, 1)
    if proc.returncode != 0:
        raise SystemExit(f"demo: step '{name}' failed (exit {proc.returncode}); see the output above")


def demoted(markdown: str) -> str:
    """Headings two levels down, so the eval report's own H1 becomes a section (one H1 per document)."""
    return "\n".join("##" + line if line.startswith("#") else line for line in markdown.splitlines())


def training_summary(train_dir: Path) -> list[str]:
    """The held-out trend at every evaluation, beside the mean training loss since the previous one (single
    logged steps are too noisy to read a trend from)."""
    metrics = train_dir / "metrics.jsonl"
    if not metrics.is_file():
        return ["(no metrics.jsonl found)"]
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    train = [r for r in rows if "loss" in r and "ce" in r]
    evals = [r for r in rows if "eval/loss" in r]
    lines = ["| step | held-out loss | held-out ce | held-out kl | mean train loss since the previous row | "
             "continuation tokens/s |", "|---|---|---|---|---|---|"]
    previous = -1
    for r in evals:
        window = [t for t in train if previous < t["step"] <= r["step"]]
        mean = sum(t["loss"] for t in window) / len(window) if window else None
        speed = sum(t.get("cont_tokens_per_s", 0) for t in window) / len(window) if window else None
        lines.append(f"| {r['step']} | {r['eval/loss']:.4f} | {r.get('eval/ce', float('nan')):.4f} | "
                     f"{r.get('eval/kl', float('nan')):.4f} | {'-' if mean is None else f'{mean:.4f}'} | "
                     f"{'-' if speed is None else f'{speed:.0f}'} |")
        previous = r["step"]
    return lines


def touched_experts(experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts a decode step reads when `tokens` tokens each pick `top_k` of `experts` uniformly."""
    return experts * (1 - (1 - top_k / experts) ** tokens)


def decode_speedup(teacher_dir: Path, keep_set: Path, timings: dict) -> tuple[float, str]:
    """(full / pruned decode-step time at batch 64, where the number comes from)."""
    config = json.loads((teacher_dir / "config.json").read_text())
    experts = int(config.get("num_experts") or config["num_local_experts"])
    top_k = int(config["num_experts_per_tok"])
    keep = json.loads(keep_set.read_text())
    kept = min(len(layer["kept"]) for layer in keep["layers"])
    ratio = round(1 - kept / experts, 6)
    if BENCH:
        cmd = [sys.executable, "-m", "slimwise_train.bench", "decode", "--batches", str(BATCH), "--ratios", str(ratio),
               "--experts", str(experts), "--top-k", str(top_k)]
        print(f"\n=== bench decode: {' '.join(cmd)}", flush=True)
        start = time.time()
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        timings["bench decode"] = round(time.time() - start, 1)
        if proc.returncode != 0:
            raise SystemExit(f"demo: bench decode failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
        result = json.loads([line for line in proc.stdout.splitlines() if line.startswith('{"bench"')][-1])
        row = next(r for r in result["results"] if r["batch"] == BATCH)
        return row["speedup"][str(ratio)], (
            f"measured in this run by `bench decode` (one decode step at batch {BATCH}, {experts} experts top-{top_k} "
            f"as the teacher routes, {kept} kept; serving-scale expert matrices H1024 x I768 fp32, static KV cache; "
            f"bytes bound {row['bytes_bound'][str(ratio)]}x)")
    bound = touched_experts(experts, top_k, BATCH) / touched_experts(kept, top_k, BATCH)
    return bound, (f"expert-bytes model, NOT measured (DEMO_BENCH=0): experts read per step at batch {BATCH} under "
                   f"uniform top-{top_k} routing, {experts} vs {kept} experts")


def mode_table(eval_dir: Path, speedup: float, source: str) -> list[str]:
    """What each mode buys (decode-step speed) next to what it costs (accuracy, lengths), pooled over families."""
    results = json.loads((eval_dir / "results.json").read_text())
    rows = {r["mode"]: r for r in results["rows"] if r["family"] == "all"}
    lines = [f"| mode | prefill pool | decode pool | decode step at batch {BATCH} | accuracy | median / p90 length | "
             "hit budget |", "|---|---|---|---|---|---|---|"]
    for mode, (prefill_pool, decode_pool) in POOLS.items():
        if mode not in rows:
            continue
        row = rows[mode]
        speed = 1.0 if decode_pool == "full" else speedup
        mark = " (+ its shared expert)" if decode_pool == "student" else ""
        lines.append(f"| {mode} | {prefill_pool} | {decode_pool} | {speed:.2f}x{mark} | {row['accuracy']:.3f} | "
                     f"{row['median_length']:g} / {row['p90_length']:g} | {row['hit_budget']:.3f} |")
    return lines + ["", f"Decode-step speedup: {source}. Prefill runs the full pool in full, slimwise and "
                        "slimwise_distill, so their time to first token is the full model's."]


def main() -> int:
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    timings: dict[str, float] = {}
    start = time.time()
    prune_dir, train_dir, eval_dir = OUT / f"reap-r{RATIO}", OUT / "distill", OUT / "eval"
    run("prune", [sys.executable, "-m", "slimwise_train.prune", *MODEL, "prune.criterion=reap",
                  f"prune.ratio={RATIO}", f"prune.cache_dir={OUT / 'cache'}", f"hydra.run.dir={prune_dir}"],
        timings)
    keep_set = prune_dir / "keep_set.json"
    run("distill", [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                    "-m", "slimwise_train", "experiment=demo", *MODEL[1:], f"prune.keep_set={keep_set}",
                    f"distill.max_steps={STEPS}", f"hydra.run.dir={train_dir}"], timings)
    run("eval", [sys.executable, "-m", "slimwise_train.eval", *MODEL, f"eval.keep_sets=[{keep_set}]",
                 f"eval.student={train_dir}", f"eval.num_per_family={EVAL_N}", f"hydra.run.dir={eval_dir}"],
        timings)
    teacher_dir = Path(TEACHER) if TEACHER else REPO / "slimwise_train" / "assets" / "teacher"
    speedup, speedup_source = decode_speedup(teacher_dir, keep_set, timings)
    total = round(time.time() - start, 1)
    prune_summary = json.loads((prune_dir / "prune_summary.json").read_text())
    eval_report = (eval_dir / "report.md").read_text()
    plots = sorted(p.name for p in eval_dir.glob("*.png"))
    for name in plots:
        shutil.copy(eval_dir / name, OUT / name)
    lines = [
        "# SlimWise demo report", "",
        "Shipped teacher (`slimwise_train/assets/teacher`, stock Qwen3-MoE, 64 experts top-4) on the synthetic suite.",
        f"Pruning: REAP, ratio {prune_summary['ratio']}, kept {prune_summary['num_kept']} experts per layer "
        f"(routing mass kept per layer: {[round(m, 3) for m in prune_summary['kept_routing_mass']]}).",
        f"Distillation: {STEPS} steps, 2 ranks, DeepSpeed ZeRO-2 (`conf/experiment/demo.yaml`).",
        f"Wall time: {total} s in all ({', '.join(f'{k} {v} s' for k, v in timings.items())}).", "",
        "## What each mode buys and costs", "", *mode_table(eval_dir, speedup, speedup_source), "",
        "## Evaluation", "", demoted(eval_report), "",
        "## Distillation log", "", *training_summary(train_dir), "",
        "## Length distributions", "", *[f"![{name}]({name})" for name in plots], "",
        "## Reproduce", "", "```", "make demo", "```",
    ]
    (OUT / "report.md").write_text("\n".join(lines) + "\n")
    print("\n" + (OUT / "report.md").read_text())
    print(f"demo finished in {total} s -> {OUT / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

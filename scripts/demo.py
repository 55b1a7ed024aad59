"""`make demo`: the whole SlimWise pipeline on the shipped teacher and synthetic suite.

Every step is the command a user would run; outputs land in outputs/demo/ and the final table in
outputs/demo/report.md:
  1. score experts with REAP and prune 50%      python -m slimwise_train.prune
  2. distill the pruned decoder (2 ranks, ZeRO-2) torchrun --nproc_per_node 2 -m slimwise_train engine=zero2
  3. evaluate full / conventional / SlimWise / reverse / conventional+distill / SlimWise+distill
                                                  python -m slimwise_train.eval
  4. decode-step speed-up of the keep set at batch 64, beside its bound   python -m slimwise_train.bench decode
  5. serve in llama.cpp: the teacher, pruned and distilled decoders converted (python -m slimwise_train.serve gguf),
     the full prefill handed to each decoder for 4 problems per family (compared with the eval app's outputs), and
     llama.cpp's decode speed-up at 64 sequences, beside its bound
Every speed-up in the report sits beside one bound measured in the same run (bench/roofline.py); one above its bound
is flagged as not a result, and a run on a machine other processes shared says so.
Environment knobs (for quick looks; the defaults are the demo): DEMO_STEPS, DEMO_EVAL_N, DEMO_RATIO, DEMO_TEACHER,
DEMO_BENCH=0 (skip step 4: the speed-up then comes from the expert-bytes model, labelled as such).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's package for the in-process steps, as the app commands (cwd) get it
OUT = REPO / "outputs" / "demo"
STEPS = int(os.environ.get("DEMO_STEPS", 1000))
EVAL_N = int(os.environ.get("DEMO_EVAL_N", 200))
RATIO = os.environ.get("DEMO_RATIO", "0.5")
TEACHER = os.environ.get("DEMO_TEACHER")  # another teacher folder (default: the shipped one)
MODEL = ["model=teacher"] + ([f"model.path={TEACHER}"] if TEACHER else [])
BENCH = os.environ.get("DEMO_BENCH", "1") != "0"
BATCH = 64
# mode -> (prefill pool, decode pool): which pool's decode step the mode pays for. The eval step runs these modes
# (conventional_distill = prune + distill, the student alone: the baseline that slimwise_distill must beat).
POOLS = {"full": ("full", "full"), "conventional": ("pruned", "pruned"), "slimwise": ("full", "pruned"),
         "reverse": ("pruned", "full"), "conventional_distill": ("student", "student"),
         "slimwise_distill": ("full", "student")}


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


def decode_speedup(teacher_dir: Path, keep_set: Path, timings: dict) -> tuple[dict, str]:
    """(the pruned decoder's decode-step speed-up at batch 64 with its bound: bench decode's against_bound cell, or
    {"speedup": expert-bytes bound} when not measured, where the number comes from)."""
    config = json.loads((teacher_dir / "config.json").read_text())
    experts = int(config.get("num_experts") or config["num_local_experts"])
    top_k = int(config["num_experts_per_tok"])
    keep = json.loads(keep_set.read_text())
    kept = min(len(layer["kept"]) for layer in keep["layers"])
    ratio = round(1 - kept / experts, 6)
    if BENCH:
        cmd = [sys.executable, "-m", "slimwise_train.bench", "decode", "--batches", str(BATCH), "--ratios", str(ratio),
               "--experts", str(experts), "--top-k", str(top_k)]
        print(f"\n=== bench decode: {' '.join(cmd)}\n(about 1-2 min on 2 cores: the full and pruned decode steps "
              "timed in interleaved rounds, this machine's copy and matmul rates probed between them)", flush=True)
        start = time.time()
        # stderr streams through (the bench's progress: a line per batch size); stdout carries the result line
        proc = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True)
        timings["bench decode"] = round(time.time() - start, 1)
        if proc.returncode != 0:
            raise SystemExit(f"demo: bench decode failed (exit {proc.returncode}); see its output above")
        result = json.loads([line for line in proc.stdout.splitlines() if line.startswith('{"bench"')][-1])
        row = next(r for r in result["results"] if r["batch"] == BATCH)
        cell = {**row["pruned"][str(ratio)], "repeats": row["repeats"], "machine": result["machine"]}
        return cell, (
            f"measured in this run by `bench decode` (one decode step at batch {BATCH}, {experts} experts top-{top_k} "
            f"as the teacher routes, {kept} kept; serving-scale expert matrices H1024 x I768 fp32, static KV cache): "
            f"{bound_sentence(cell)}")
    from slimwise_train.eval.report import touched_experts  # the eval report's bytes bound: one formula

    bound = touched_experts(experts, top_k, BATCH) / touched_experts(kept, top_k, BATCH)
    return {"speedup": bound, "bound": None}, (
        f"expert-bytes model, NOT measured (DEMO_BENCH=0): experts read per step at batch {BATCH} under uniform "
        f"top-{top_k} routing, {experts} vs {kept} experts")


def bound_sentence(cell: dict) -> str:
    """A measured speed-up with its spread, its bound (spread, where it comes from), the efficiency, and what to make
    of a speed-up above its bound or of a shared machine."""
    low, high = cell["speedup_quartiles"]
    b_low, b_high = cell["bound_quartiles"]
    text = (f"**{cell['speedup']:.2f}x** (quartiles {low:.2f}-{high:.2f}x over {cell.get('repeats', 'its')} paired rounds) "
            f"against this machine's bound {cell['bound']:.2f}x (quartiles {b_low:.2f}-{b_high:.2f}x over "
            f"{cell['probes']} probes between the rounds: copy bandwidth and matmul times at the rows each expert "
            f"gets, bench/roofline.py), efficiency {cell['efficiency']:.2f}")
    if cell["above_bound"]:
        text += (". **The speed-up is above its bound, so it is not a result**: "
                 + ("beyond the noise of both, the bound missed something" if cell["beyond_noise"] else
                    "within the noise (the quartiles overlap)"))
    machine = cell.get("machine") or {}
    if machine.get("shared"):
        text += (f". **Shared machine**: other processes used {machine['other_cpu_share']:.0%} of its "
                 f"{machine['cpus']} CPUs during the run; ratio and bound were measured side by side, but read both "
                 "as approximate and compare with a run on a quiet machine")
    return text


def speed_cell(cell: dict) -> str:
    """The mode table's decode-step cell: the speed-up, flagged when above its bound."""
    if cell.get("bound") is not None and cell["above_bound"]:
        return f"{cell['speedup']:.2f}x (ABOVE its bound {cell['bound']:.2f}x: not a result)"
    return f"{cell['speedup']:.2f}x"


def engine_step(teacher_dir: Path, prune_dir: Path, train_dir: Path, eval_dir: Path, timings: dict) -> list[str]:
    """Step 5: the demo's decoders in llama.cpp on the full model's prefill state, against the eval app's outputs."""
    from transformers import AutoTokenizer

    from slimwise_train.bench.engine import time_gguf_variants
    from slimwise_train.data import synthetic
    from slimwise_train.eval.generation import build_problems
    from slimwise_train.serve.gguf import convert
    from slimwise_train.serve.handoff import EngineHandoff, Request

    print("\n=== serve in llama.cpp (python -m slimwise_train.serve)", flush=True)
    start = time.time()
    gguf_dir = OUT / "gguf"
    gguf_dir.mkdir()
    files = {name: convert(folder, gguf_dir / f"{name}.gguf", "f32", log=print)
             for name, folder in (("teacher", teacher_dir), ("pruned", prune_dir / "pruned"),
                                  ("student", train_dir / "export"))}
    tokenizer = AutoTokenizer.from_pretrained(teacher_dir)
    problems = build_problems(tokenizer, list(synthetic.FAMILIES), EVAL_N)
    budgets = json.loads((eval_dir / "results.json").read_text())["budget"]  # the eval app's, per family
    chosen = [p for family in synthetic.FAMILIES for p in [q for q in problems if q.family == family][:4]]
    recorded = {}
    for line in (eval_dir / "generations.jsonl").read_text().splitlines():
        row = json.loads(line)
        recorded[(row["mode"], row["prompt"])] = (row["output"], row["length"])
    lines = ["| decoder (eval mode) | problems | equal to the eval app (text and length) | engine accuracy |",
             "|---|---|---|---|"]
    for decoder, mode in (("pruned", "slimwise"), ("student", "slimwise_distill")):
        with EngineHandoff(files["teacher"], files[decoder], n_seq=len(chosen), kv_type="f32") as engine:
            outs = engine.generate([Request(list(p.prompt_ids), budgets[p.family]) for p in chosen])
        # the eval app's text: its tokenizer's decoding up to and excluding EOS (eval/metrics.py decode_output)
        texts = [tokenizer.decode(c.tokens[:-1] if c.end == "eos" else c.tokens) for c in outs]
        equal = sum(recorded.get((mode, p.prompt)) == (t, c.length) for p, c, t in zip(chosen, outs, texts))
        correct = sum(synthetic.check(p.family, p.prompt, t, ended=c.end == "eos") for p, c, t in zip(chosen, outs, texts))
        lines.append(f"| {decoder} ({mode}) | {len(chosen)} | {equal}/{len(chosen)} | {correct}/{len(chosen)} |")
    from transformers import AutoModelForCausalLM

    from slimwise_train.bench.engine import add_bounds, engine_monitor

    threads = len(os.sched_getaffinity(0))
    ratio = float(RATIO)
    model = AutoModelForCausalLM.from_pretrained(teacher_dir)
    monitor = engine_monitor(model, [ratio], [BATCH], threads)
    rows = time_gguf_variants({"full": files["teacher"], f"pruned_{ratio}": files["pruned"]}, [BATCH], 64, 16, 3,
                              threads, "f16", tokenizer.vocab_size, print, between_rounds=lambda _: monitor.probe())
    add_bounds(rows, model, [ratio], monitor, {BATCH: (0, None)}, 4, 2, 64 + 16 / 2, print)
    cell = {**rows[0]["pruned"][str(ratio)], "repeats": 3, "machine": monitor.machine()}
    timings["serve"] = round(time.time() - start, 1)
    return lines + ["", f"llama.cpp decode, {BATCH} sequences, {threads} threads, f32 weights, f16 KV: full "
                        f"{rows[0]['decode_tok_s']['full']:g} tok/s, pruned {rows[0]['decode_tok_s'][f'pruned_{ratio}']:g} "
                        f"tok/s: {bound_sentence(cell)}. The teacher is tiny (hidden 128), so "
                        "a step is dominated by per-op overheads, not expert bytes: `python -m slimwise_train.bench "
                        "engine` measures a Qwen3-30B-A3B-sized layer."]


def shared_expert_cost(export_dir: Path) -> str:
    """What a student's shared expert adds to every decode step, as a number: its parameters against the routed
    experts' (a step reads the shared expert always, the routed ones only where routed)."""
    from safetensors import safe_open

    shared = routed = 0
    for file in sorted(export_dir.glob("*.safetensors")):
        with safe_open(str(file), "pt") as handle:
            for name in handle.keys():
                size = math.prod(handle.get_slice(name).get_shape())
                if "shared_expert" in name:
                    shared += size
                elif ".experts." in name or name.endswith(".experts"):
                    routed += size
    if not shared:
        return "no shared-expert tensors found in the export"
    return f"{shared:,} parameters, {shared / max(routed, 1):.1%} of the kept routed experts', read every step"


def mode_table(eval_dir: Path, measured: dict, source: str, student_dir: Path) -> list[str]:
    """What each mode buys (decode-step speed) next to what it costs (accuracy, lengths), pooled over families."""
    results = json.loads((eval_dir / "results.json").read_text())
    # what the distilled decoder adds to the pruned one: a shared expert (read per step) or nothing (LoRA merged)
    info_file = student_dir / "slimwise_export.json"
    info = json.loads(info_file.read_text()) if info_file.is_file() else {}
    student_note = (f"+ its shared expert: {shared_expert_cost(student_dir)}" if info.get("shared_expert")
                    else f"{info.get('trainable', '?')} merged: the pruned model's size")
    rows = {r["mode"]: r for r in results["rows"] if r["family"] == "all"}
    lines = [f"| mode | prefill pool | decode pool | decode step at batch {BATCH} | accuracy | median / p90 length | "
             "hit budget |", "|---|---|---|---|---|---|---|"]
    for mode, (prefill_pool, decode_pool) in POOLS.items():
        if mode not in rows:
            continue
        row = rows[mode]
        speed = "1.00x" if decode_pool == "full" else speed_cell(measured)
        mark = f" ({student_note})" if decode_pool == "student" else ""
        lines.append(f"| {mode} | {prefill_pool} | {decode_pool} | {speed}{mark} | {row['accuracy']:.3f} | "
                     f"{row['median_length']:g} / {row['p90_length']:g} | {row['hit_budget']:.3f} |")
    return lines + ["", f"Decode-step speed-up: {source}. Prefill runs the full pool in full, slimwise and "
                        "slimwise_distill, so their time to first token is the full model's; conventional_distill "
                        "(prune + distill) serves the student alone, for prefill too."]


def figures(eval_dir: Path, train_dir: Path, measured: dict | None) -> dict[str, list[str]]:
    """The report's PNGs in OUT: {kind: [file names]}. The eval app's length CDFs and per-family bars are copied;
    the trade-off is redrawn on the measured `bench decode` speed-up when there is one (the eval app's uses the
    expert-bytes bound); the training curve comes from the distill run's metrics.jsonl."""
    from slimwise_train.eval.plots import plot_tradeoff, plot_training_curves

    results = json.loads((eval_dir / "results.json").read_text())
    plots: dict[str, list[str]] = {}
    for kind in ("lengths", "family_accuracy", "tradeoff"):
        for src in sorted(eval_dir.glob(f"{kind}_*.png")):
            if kind == "tradeoff" and measured is not None:
                name = src.stem[len("tradeoff_"):]
                keep_set = name if name in results["keep_sets"] else None
                speedups = {mode: 1.0 if POOLS[mode][1] == "full" else measured["speedup"] for mode in POOLS}
                note = (f"ABOVE its bound {measured['bound']:.2f}x: not a result" if measured["above_bound"] else
                        f"bound {measured['bound']:.2f}x")
                plot_tradeoff(results, keep_set, OUT / src.name, speedups=speedups, axis_note=note)
            else:
                shutil.copy(src, OUT / src.name)
            plots.setdefault(kind, []).append(src.name)
    if (train_dir / "metrics.jsonl").is_file():
        plot_training_curves(train_dir / "metrics.jsonl", OUT / "training_curves.png",
                             title=f"demo distillation loss, {STEPS} steps")
        plots["training_curves"] = ["training_curves.png"]
    return plots


def embedded_eval_report(eval_dir: Path) -> str:
    """The eval app's report as the demo embeds it: re-rendered from its results.json without the expert-bytes
    bound column when `bench decode` measured the speed-up (the mode table carries that and its own bound: one
    bound per report)."""
    from slimwise_train.eval.app import FIGURES
    from slimwise_train.eval.report import render_markdown

    if not BENCH:
        return (eval_dir / "report.md").read_text()
    results = json.loads((eval_dir / "results.json").read_text())
    links = {name: [(caption, f"{figure}_{name or 'full'}.png") for figure, caption in FIGURES]
             for name in list(results["keep_sets"]) or [None]}
    header = [f"{key}: {results[key]}" for key in ("model", "student") if results.get(key)]  # as the eval app's
    return render_markdown(results, header_lines=header, images=links, bytes_bound=False)


def image(plots: dict[str, list[str]], kind: str) -> list[str]:
    return [f"![{name}]({name})\n" for name in plots.get(kind, [])] or ["(no figure)"]


def reproduce_command() -> str:
    """`make demo`, with the DEMO_* settings this run was given (a report of a shortened run must not claim the
    default one)."""
    knobs = [f"{name}={os.environ[name]}" for name in ("DEMO_STEPS", "DEMO_EVAL_N", "DEMO_RATIO", "DEMO_TEACHER",
                                                       "DEMO_BENCH") if name in os.environ]
    return " ".join([*knobs, "make demo"])


def main() -> int:
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    timings: dict[str, float] = {}
    start = time.time()
    prune_dir, train_dir, eval_dir = OUT / f"reap-r{RATIO}", OUT / "distill", OUT / "eval"
    run("prune", [sys.executable, "-m", "slimwise_train.prune", *MODEL, "prune.criterion=reap",
                  f"prune.ratio={RATIO}", "prune.export_checkpoint=true", f"prune.cache_dir={OUT / 'cache'}", f"hydra.run.dir={prune_dir}"],
        timings)
    keep_set = prune_dir / "keep_set.json"
    run("distill", [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                    "-m", "slimwise_train", "experiment=demo", *MODEL[1:], f"prune.keep_set={keep_set}",
                    f"distill.schedule.max_steps={STEPS}", f"hydra.run.dir={train_dir}"], timings)
    run("eval", [sys.executable, "-m", "slimwise_train.eval", *MODEL, f"eval.keep_sets=[{keep_set}]",
                 f"eval.student={train_dir}", f"eval.modes=[{','.join(POOLS)}]", f"eval.num_per_family={EVAL_N}",
                 "eval.save_generations=true",
                 f"hydra.run.dir={eval_dir}"],
        timings)
    return measure_and_report(timings, start)


def measure_and_report(timings: dict[str, float], start: float) -> int:
    """Steps 4 and 5 and the report, on the outputs of steps 1-3 in OUT."""
    prune_dir, train_dir, eval_dir = OUT / f"reap-r{RATIO}", OUT / "distill", OUT / "eval"
    keep_set = prune_dir / "keep_set.json"
    teacher_dir = Path(TEACHER) if TEACHER else REPO / "slimwise_train" / "assets" / "teacher"
    measured, speedup_source = decode_speedup(teacher_dir, keep_set, timings)
    serve_lines = engine_step(teacher_dir, prune_dir, train_dir, eval_dir, timings)
    total = round(time.time() - start, 1)
    prune_summary = json.loads((prune_dir / "prune_summary.json").read_text())
    eval_report = embedded_eval_report(eval_dir)
    plots = figures(eval_dir, train_dir, measured if BENCH else None)
    lines = [
        "# SlimWise demo report", "",
        "Shipped teacher (`slimwise_train/assets/teacher`, stock Qwen3-MoE, 64 experts top-4) on the synthetic suite.",
        f"Pruning: REAP, ratio {prune_summary['ratio']}, kept {prune_summary['num_kept']} experts per layer "
        f"(routing mass kept per layer: {[round(m, 3) for m in prune_summary['kept_routing_mass']]}).",
        f"Distillation: {STEPS} steps, 2 ranks, DeepSpeed ZeRO-2 (`conf/experiment/demo.yaml`).",
        f"Wall time: {total} s in all ({', '.join(f'{k} {v} s' for k, v in timings.items())}).", "",
        "## What each mode buys and costs", "", *mode_table(eval_dir, measured, speedup_source, train_dir / "export"), "",
        "## Evaluation", "", demoted(eval_report), "",
        "## Served by llama.cpp", "", *serve_lines, "",
        "## Accuracy against decode speed-up", "", *image(plots, "tradeoff"), "",
        "## Accuracy per family", "", *image(plots, "family_accuracy"), "",
        "## Distillation log", "", *image(plots, "training_curves"), *training_summary(train_dir), "",
        "## Length distributions", "", *image(plots, "lengths"), "",
        "## Reproduce", "", "```", reproduce_command(), "```",
    ]
    (OUT / "report.md").write_text("\n".join(lines) + "\n")
    print("\n" + (OUT / "report.md").read_text())
    print(f"demo finished in {total} s -> {OUT / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

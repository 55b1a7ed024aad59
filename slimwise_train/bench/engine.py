"""`bench engine`: llama.cpp decode and prefill throughput, full vs pruned 25/50/75%, side by side in one run.

Two models: the shipped teacher and `bench decode`'s shape (Qwen3-MoE, 2 layers, H1024, 128 experts top-8, I768:
Qwen3-30B-A3B's expert bytes per layer). Each is pruned by a fixed stride (which experts survive does not matter
for speed, only how many), every variant converted to GGUF with `slimwise_train.serve.gguf`, and timed in its own
llama.cpp context: per round, each variant prefills the same random prompts and decodes `--steps` tokens for every
sequence, variants in turn (a slow spell of the machine hits all of them), ratios paired per round.

Beside each decode ratio: its bound on this machine (bench/roofline.py: copy bandwidth and matmul times at the row
counts uniform routing gives each expert, probed between the rounds; the bytes and FLOPs the step must move and do)
with its spread, the efficiency measured / bound, and a flag on any speed-up above its bound. Threads are stated; on
a GPU build of llama.cpp (SLIMWISE_LLAMA_CPP_GPU=1 offloads every layer) the figures are absolute (the bound is the
CPU's, so it is left out there).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from slimwise_train.bench.common import bench_model, paired_ratio_quartiles
from slimwise_train.bench.roofline import (RooflineMonitor, above_bound_note, against_bound, decode_shape,
                                           faster_than_bound, rows_to_measure, shared_note, step_bound_s)

TEACHER = Path(__file__).resolve().parents[1] / "assets" / "teacher"
GGUF_BYTES = {"f32": 4, "f16": 2, "bf16": 2}


def _variants(name: str, model, tokenizer, ratios, outtype: str, root: Path, log) -> dict[str, Path]:
    """GGUF per variant ("full", "pruned_0.5", ...), converted once into `root`."""
    from slimwise_train.moe.adapters import get_adapter
    from slimwise_train.moe.keepset import KeepSet
    from slimwise_train.moe.pruning import export_pruned
    from slimwise_train.prune.criteria import num_to_keep
    from slimwise_train.serve.gguf import convert

    layers = get_adapter(model).moe_layers(model)
    out = {}
    full_dir = root / f"{name}_full"
    model.save_pretrained(full_dir)
    tokenizer.save_pretrained(full_dir)
    folders = {"full": full_dir}
    for r in ratios:
        keep = KeepSet.from_kept(layers, [list(range(num_to_keep(m.num_experts, r))) for m in layers],
                                 model_type=model.config.model_type)
        folders[f"pruned_{r}"] = export_pruned(model, keep, root / f"{name}_pruned_{r}", tokenizer=tokenizer)
    for variant, folder in folders.items():
        start = time.perf_counter()
        out[variant] = convert(folder, root / f"{name}_{variant}.gguf", outtype, check_texts=[], log=lambda *_: None)
        log(f"bench engine: {name} {variant} -> GGUF {out[variant].stat().st_size / 1e6:.0f} MB "
            f"({time.perf_counter() - start:.0f} s)")
    return out


def time_gguf_variants(files: dict[str, Path], batches, prompt_len: int, steps: int, repeats: int, threads: int,
                       kv_type: str, vocab: int, log, between_rounds=None) -> list[dict]:
    """Decode and prefill throughput of each GGUF ({variant: file}, "full" among them) per batch size, variants in
    turn within a round, speed-ups against "full" paired per round: one row per batch size. `between_rounds(batch)`
    runs after every round (a machine probe beside the rounds: bench/roofline.py)."""
    from slimwise_train.serve.llamacpp import Context, ContextSettings, GGUFModel

    models = {v: GGUFModel(f) for v, f in files.items()}
    rows = []
    try:
        for batch in batches:
            settings = ContextSettings(n_seq=batch, n_ctx_per_seq=prompt_len + steps + 1, n_batch=max(512, batch),
                                       kv_type=kv_type, threads=threads)
            contexts = {v: Context(m, settings) for v, m in models.items()}
            rng = np.random.default_rng(batch)
            prompts = rng.integers(4, vocab, size=(batch, prompt_len)).tolist()
            step_tokens = rng.integers(4, vocab, size=(steps, batch)).tolist()
            decode_s = {v: [] for v in models}
            prefill_s = {v: [] for v in models}
            for rnd in range(repeats + 1):  # round 0 warms caches and page-ins, untimed
                for v, ctx in contexts.items():
                    ctx.clear()
                    start = time.perf_counter()
                    ctx.decode([(s, prompts[s], 0) for s in range(batch)])
                    mid = time.perf_counter()
                    for i in range(steps):
                        ctx.decode([(s, [step_tokens[i][s]], prompt_len + i) for s in range(batch)])
                    end = time.perf_counter()
                    if rnd:
                        prefill_s[v].append(mid - start)
                        decode_s[v].append(end - mid)
                if between_rounds is not None:
                    between_rounds(batch)
            for ctx in contexts.values():
                ctx.close()

            def paired(times, a, b):
                return statistics.median(x / y for x, y in zip(times[a], times[b]))

            pruned = [v for v in models if v != "full"]
            row = {"sequences": batch,
                   "decode_tok_s": {v: round(batch * steps / statistics.median(t), 1) for v, t in decode_s.items()},
                   "prefill_tok_s": {v: round(batch * prompt_len / statistics.median(t), 1) for v, t in prefill_s.items()},
                   "pruned": {v.removeprefix("pruned_"): {
                       "speedup": round(paired(decode_s, "full", v), 3),
                       "speedup_quartiles": [round(q, 3) for q in paired_ratio_quartiles(decode_s, "full", v)]}
                       for v in pruned},
                   "prefill_speedup": {v.removeprefix("pruned_"): round(paired(prefill_s, "full", v), 3) for v in pruned}}
            rows.append(row)
            log(json.dumps({"partial": row}))
    finally:
        for m in models.values():
            m.close()
    return rows


def engine_monitor(model, ratios, batches, threads: int, own_pids=()) -> RooflineMonitor:
    """The machine probe for a model's llama.cpp rounds: expert matmuls timed at its shape and at the row counts
    uniform routing gives each kept expert at these batch sizes; `own_pids`: the llama.cpp processes the bench runs
    (their CPU time is not another job's)."""
    from slimwise_train.prune.criteria import num_to_keep

    shape = decode_shape(model, 4, 4)
    kept = [shape.experts, *(num_to_keep(shape.experts, r) for r in ratios)]
    intermediate = shape.expert_params // (3 * model.config.hidden_size)
    return RooflineMonitor(threads, expert=(model.config.hidden_size, intermediate),
                           rows=rows_to_measure(batches, shape.top_k, kept), own_pids=own_pids)


def add_bounds(rows: list[dict], model, ratios, monitor: RooflineMonitor, probes_per_batch: dict[int, tuple[int, int]],
               weight_bytes: float, kv_bytes: float, context: float, log) -> list[tuple[int, float]]:
    """Each row's decode speed-ups beside their bound (against_bound), from the probes taken beside that batch
    size's rounds (`probes_per_batch`: {sequences: (first probe, end)}), and each variant's step against its own
    roofline (`roofline_fraction`). Returns the (sequences, ratio) whose speed-up is above its bound (logged)."""
    from slimwise_train.prune.criteria import num_to_keep

    shape = decode_shape(model, weight_bytes, kv_bytes)
    flagged = []
    for row in rows:
        n = row["sequences"]
        span = probes_per_batch[n]

        def full_s(rates, n=n):
            return step_bound_s(shape, n, context, rates)

        step_s = {v: n / tok_s for v, tok_s in row["decode_tok_s"].items()}
        rates = monitor.median_rates(*span)
        row["roofline_fraction"] = {"full": round(full_s(rates) / step_s["full"], 3)}
        for r in ratios:
            pruned_shape = shape.with_experts(num_to_keep(shape.experts, r))

            def pruned_s(rates, n=n, pruned_shape=pruned_shape):
                return step_bound_s(pruned_shape, n, context, rates)

            cell = row["pruned"][str(r)]
            cell.update(against_bound(cell["speedup"], cell["speedup_quartiles"], monitor.bound(full_s, pruned_s, *span)))
            row["roofline_fraction"][f"pruned_{r}"] = round(pruned_s(rates) / step_s[f"pruned_{r}"], 3)
            if cell["above_bound"]:
                flagged.append((n, r))
                log(above_bound_note(f"bench engine: {n} sequences, pruned {r}, decode", cell))
        row["faster_than_bound"] = faster_than_bound(row["roofline_fraction"])
        if row["faster_than_bound"]:
            log(f"bench engine: {n} sequences: {', '.join(row['faster_than_bound'])} ran faster than its least time "
                "from the probes: they understated this machine, so these bounds are suspect")
    return flagged


def run_engine(args) -> dict:
    import contextlib

    # transformers' save_pretrained imports DeepSpeed, whose logger prints to stdout: keep stdout for the JSON line
    with contextlib.redirect_stdout(sys.stderr):
        return _run_engine(args)


def _run_engine(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def log(message):
        print(message, file=sys.stderr, flush=True)

    threads = args.threads or len(os.sched_getaffinity(0))
    ratios = [float(r) for r in args.ratios.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    if any(b < 1 for b in batches) or args.steps < 1 or args.repeats < 1 or not all(0 < r < 1 for r in ratios):
        raise ValueError("--batches, --steps and --repeats must be >= 1 and --ratios in (0, 1)")
    gpu = os.environ.get("SLIMWISE_LLAMA_CPP_GPU") == "1"
    tokenizer = AutoTokenizer.from_pretrained(TEACHER)
    kv_bytes = {"f16": 2, "f32": 4}[args.kv_type]
    models = {}
    if "teacher" in args.models:
        models["teacher"] = AutoModelForCausalLM.from_pretrained(TEACHER).eval()
    if "bench" in args.models:
        models["bench"] = bench_model("qwen3_moe", 1024, 2, 128, 8, 768, 2048, torch.device("cpu"), kv_heads=2).eval()
    results, flagged, machines = {}, [], {}
    with tempfile.TemporaryDirectory(prefix="slimwise-bench-engine-", dir=args.work_dir) as tmp:
        for name, model in models.items():
            files = _variants(name, model, tokenizer, ratios, args.outtype, Path(tmp), log)
            monitor = None if gpu else engine_monitor(model, ratios, batches, threads)
            spans: dict[int, list[int]] = {}

            def probe(batch, monitor=monitor, spans=spans):
                spans.setdefault(batch, [len(monitor.samples), 0])
                monitor.probe()
                spans[batch][1] = len(monitor.samples)

            rows = time_gguf_variants(files, batches, args.prompt, args.steps, args.repeats, threads, args.kv_type,
                                      model.config.vocab_size, log, between_rounds=None if gpu else probe)
            if monitor is not None:
                flagged += [{"model": name, "sequences": n, "ratio": r} for n, r in add_bounds(
                    rows, model, ratios, monitor, {b: tuple(v) for b, v in spans.items()}, GGUF_BYTES[args.outtype],
                    kv_bytes, args.prompt + args.steps / 2, log)]
                machines[name] = monitor.machine()
                log(f"bench engine: {name}: this machine at {threads} threads, median of {len(monitor.samples)} "
                    f"probes beside the rounds: copy {machines[name]['bandwidth_gbs'][1]:.1f} GB/s, fp32 matmul "
                    f"{machines[name]['matmul_gflops'][1]:.1f} GFLOP/s")
            shape = decode_shape(model, GGUF_BYTES[args.outtype], kv_bytes)
            results[name] = {"model": f"qwen3_moe L{model.config.num_hidden_layers} H{model.config.hidden_size} "
                                      f"E{shape.experts} top{shape.top_k} ({args.outtype})",
                             "machine": machines.get(name), "rows": rows}
    for machine in machines.values():
        note = shared_note(machine, "bench engine")
        if note:
            log(note)
            break
    at_64 = results.get("bench", {}).get("rows", [])
    at_64 = next((row["pruned"]["0.5"] for row in at_64 if row["sequences"] == 64 and "0.5" in row["pruned"]), None)
    targets = {"decode_speedup_0.5_at_64_min": 1.15, "efficiency_0.5_at_64_min": 0.7}
    targets_met = {
        "decode_speedup_at_64": None if at_64 is None else at_64["speedup"] >= targets["decode_speedup_0.5_at_64_min"],
        "efficiency_at_64": None if at_64 is None or "efficiency" not in at_64
        else targets["efficiency_0.5_at_64_min"] <= at_64["efficiency"] <= 1,
        # a speed-up above its bound, or a step faster than its own least time, anywhere: the bound is wrong there
        "within_bound": None if gpu else not flagged and not any(
            row.get("faster_than_bound") for res in results.values() for row in res["rows"]),
    }
    from slimwise_train.serve.llamacpp import llama_cpp_home

    # the headline: the 0.5 decode speed-up at the most sequences of the last model measured
    last = list(results.values())[-1]["rows"][-1]["pruned"]
    return {"bench": "engine", "ratio": last.get("0.5", next(iter(last.values())))["speedup"],
            "engine": f"llama.cpp ({llama_cpp_home().name})", "threads": threads, "gpu": gpu,
            "shared": any(m["shared"] for m in machines.values()),
            "kv_type": args.kv_type, "prompt_len": args.prompt, "steps": args.steps, "repeats": args.repeats,
            "results": results, "above_bound": flagged, "targets": targets, "targets_met": targets_met}

"""`bench engine`: llama.cpp decode and prefill throughput, full vs pruned 25/50/75%, side by side in one run.

Two models: the shipped teacher and `bench decode`'s shape (Qwen3-MoE, 2 layers, H1024, 128 experts top-8, I768:
Qwen3-30B-A3B's expert bytes per layer). Each is pruned by a fixed stride (which experts survive does not matter
for speed, only how many), every variant converted to GGUF with `slimwise_train.serve.gguf`, and timed in its own
llama.cpp context: per round, each variant prefills the same random prompts and decodes `--steps` tokens for every
sequence, variants in turn (a slow spell of the machine hits all of them), ratios paired per round.

Beside each decode ratio: the roofline bound for this machine (bench/roofline.py: measured copy bandwidth and
matmul rate, the bytes and FLOPs the step must move and do) and the efficiency measured / bound. Threads are
stated; on a GPU build of llama.cpp (SLIMWISE_LLAMA_CPP_GPU=1 offloads every layer) the figures are absolute.
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

from slimwise_train.bench.common import bench_model
from slimwise_train.bench.roofline import decode_shape, measure_machine, step_bound_s

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
                       kv_type: str, vocab: int, log) -> list[dict]:
    """Decode and prefill throughput of each GGUF ({variant: file}, "full" among them) per batch size, variants in
    turn within a round, speed-ups against "full" paired per round: one row per batch size."""
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
            for ctx in contexts.values():
                ctx.close()

            def paired(times, a, b):
                return statistics.median(x / y for x, y in zip(times[a], times[b]))

            row = {"sequences": batch,
                   "decode_tok_s": {v: round(batch * steps / statistics.median(t), 1) for v, t in decode_s.items()},
                   "prefill_tok_s": {v: round(batch * prompt_len / statistics.median(t), 1) for v, t in prefill_s.items()},
                   "decode_speedup": {v.removeprefix("pruned_"): round(paired(decode_s, "full", v), 3)
                                      for v in models if v != "full"},
                   "prefill_speedup": {v.removeprefix("pruned_"): round(paired(prefill_s, "full", v), 3)
                                       for v in models if v != "full"}}
            rows.append(row)
            log(json.dumps({"partial": row}))
    finally:
        for m in models.values():
            m.close()
    return rows


def run_engine(args) -> dict:
    import contextlib

    # transformers' save_pretrained imports DeepSpeed, whose logger prints to stdout: keep stdout for the JSON line
    with contextlib.redirect_stdout(sys.stderr):
        return _run_engine(args)


def _run_engine(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from slimwise_train.prune.criteria import num_to_keep

    def log(message):
        print(message, file=sys.stderr, flush=True)

    threads = args.threads or len(os.sched_getaffinity(0))
    ratios = [float(r) for r in args.ratios.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    if any(b < 1 for b in batches) or args.steps < 1 or args.repeats < 1 or not all(0 < r < 1 for r in ratios):
        raise ValueError("--batches, --steps and --repeats must be >= 1 and --ratios in (0, 1)")
    rates = measure_machine(threads)
    log(f"bench engine: this machine at {threads} threads: copy {rates.bandwidth_gbs:.1f} GB/s, fp32 matmul "
        f"{rates.matmul_gflops:.1f} GFLOP/s")
    tokenizer = AutoTokenizer.from_pretrained(TEACHER)
    kv_bytes = {"f16": 2, "f32": 4}[args.kv_type]
    models = {}
    if "teacher" in args.models:
        models["teacher"] = AutoModelForCausalLM.from_pretrained(TEACHER).eval()
    if "bench" in args.models:
        models["bench"] = bench_model("qwen3_moe", 1024, 2, 128, 8, 768, 2048, torch.device("cpu"), kv_heads=2).eval()
    results = {}
    with tempfile.TemporaryDirectory(prefix="slimwise-bench-engine-", dir=args.work_dir) as tmp:
        for name, model in models.items():
            files = _variants(name, model, tokenizer, ratios, args.outtype, Path(tmp), log)
            rows = time_gguf_variants(files, batches, args.prompt, args.steps, args.repeats, threads, args.kv_type,
                                      model.config.vocab_size, log)
            shape_full = decode_shape(model, GGUF_BYTES[args.outtype], kv_bytes)
            context = args.prompt + args.steps / 2
            for row in rows:
                n = row["sequences"]
                full_bound = step_bound_s(shape_full, n, context, rates)
                row["bound"], row["efficiency"] = {}, {}
                # each variant's step against its own roofline time (how far llama.cpp is from the hardware)
                step_s = {v: n / tok_s for v, tok_s in row["decode_tok_s"].items()}
                row["roofline_fraction"] = {"full": round(full_bound / step_s["full"], 3)}
                for r in ratios:
                    pruned_bound = step_bound_s(shape_full.with_experts(num_to_keep(shape_full.experts, r)), n, context,
                                                rates)
                    bound = full_bound / pruned_bound
                    row["roofline_fraction"][f"pruned_{r}"] = round(pruned_bound / step_s[f"pruned_{r}"], 3)
                    row["bound"][str(r)] = round(bound, 3)
                    row["efficiency"][str(r)] = round(row["decode_speedup"][str(r)] / bound, 3)
            results[name] = {"model": f"qwen3_moe L{model.config.num_hidden_layers} H{model.config.hidden_size} "
                                      f"E{shape_full.experts} top{shape_full.top_k} ({args.outtype})",
                             "rows": rows}
    at_64 = results.get("bench", {}).get("rows", [])
    at_64 = next((row for row in at_64 if row["sequences"] == 64), None)
    targets = {"decode_speedup_0.5_at_64_min": 1.15, "efficiency_0.5_at_64_min": 0.7}
    targets_met = {
        "decode_speedup_at_64": None if at_64 is None or "0.5" not in at_64["decode_speedup"]
        else at_64["decode_speedup"]["0.5"] >= targets["decode_speedup_0.5_at_64_min"],
        "efficiency_at_64": None if at_64 is None or "0.5" not in at_64["efficiency"]
        else at_64["efficiency"]["0.5"] >= targets["efficiency_0.5_at_64_min"],
    }
    from slimwise_train.serve.llamacpp import llama_cpp_home

    # the headline: the 0.5 decode speed-up at the most sequences of the last model measured
    last = list(results.values())[-1]["rows"][-1]["decode_speedup"]
    return {"bench": "engine", "ratio": last.get("0.5", next(iter(last.values()))), "engine": f"llama.cpp ({llama_cpp_home().name})", "threads": threads,
            "gpu": os.environ.get("SLIMWISE_LLAMA_CPP_GPU") == "1", "machine": rates.as_dict(),
            "kv_type": args.kv_type, "prompt_len": args.prompt, "steps": args.steps, "repeats": args.repeats,
            "results": results, "targets": targets, "targets_met": targets_met}

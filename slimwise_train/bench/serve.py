"""`bench serve`: the paper's serving figure on this machine. `python -m slimwise_train.serve up` endpoints are
driven by an established load generator, GuideLLM (its concurrent profile, synthetic prompts of fixed length,
`ignore_eos` for a fixed output length), over a sweep of concurrency, for five variants of each model:

    full                the full model prefills and the full model decodes (the disaggregated baseline)
    pruned_<r>          the pruned model in both phases (conventional pruning)
    slimwise_<r>        the full model prefills, the pruned model decodes, r = 0.5 and 0.75

Every variant runs as two llama-servers (a prefill one and a decode one, the handoff between them), so all get the
same processes and threads and differ only in which model does which phase, as under prefill/decode disaggregation
where the paper measures.
Models: the shipped teacher and `bench engine`'s larger shape (Qwen3-MoE L2 H1024 E128 top-8 I768, f16). All five
endpoints of a model run at once (idle ones cost nothing); each round measures every concurrency level, and each
level every variant in turn, in an order that rotates from level to level, with the machine's bandwidth and matmul
rate measured just before the level's runs (beside them, not once at the start): a slow spell of a shared machine
hits all variants. A level's numbers are medians over the rounds; its ratios are medians of the ratios paired
within a round; its bound (bench/roofline.py's RooflineMonitor: copy bandwidth and expert matmuls at the row counts
that occur) is the median over the probes taken beside that level's runs, with its quartiles.

Per run (GuideLLM's own numbers): aggregate output tokens/s (every output token but a request's first comes from
the decode phase), per-user decode speed (1000 / inter-token latency in ms: p50, and p90 = the speed 90% of
requests reach or beat), time to first token (p50 / p90). The per-user target is scaled to this machine: a
fraction (`--target-fraction`, default 0.5) of the full model's own single-request speed measured in the run, or
`--target-tok-s` (the paper's 50 tokens/s on a GPU). The headline per variant: the best aggregate throughput among
the levels whose p90 per-user speed meets the target, and its ratio to the full model's, beside its bound at that
level's concurrency: the least time of a round of requests (prompts prefilled, then the decode steps; `bench/roofline.py`,
the rates measured beside the level's runs) of the full model over the variant's; a ratio whose efficiency
(ratio / bound) exceeds 1 is flagged: a bound a run beats is not a bound.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from slimwise_train.bench.engine import GGUF_BYTES, TEACHER, _variants, engine_monitor
from slimwise_train.bench.roofline import (above_bound_note, against_bound, decode_shape, quartiles, shared_note,
                                           step_bound_s)
from slimwise_train.prune.criteria import num_to_keep

class _Endpoint:
    """One `serve up` child process for a variant."""

    def __init__(self, name: str, prefill: Path, decode: Path, parallel: int, threads: int, root: Path):
        from slimwise_train.serve.server import free_port

        self.name = name
        self.port = free_port()
        self.key_file = root / f"{name}.key"
        self.log = root / f"{name}.log"
        command = [sys.executable, "-m", "slimwise_train.serve", "up", "--prefill", str(prefill), "--parallel",
                   str(parallel), "--port", str(self.port), "--api-key-file", str(self.key_file), "--threads",
                   str(threads), "--queue", str(4 * parallel), "--decode", str(decode)]
        self.model = decode.stem
        self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=open(self.log, "w"),
                                     start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 300
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"bench serve: `serve up` for {name} exited: {self.log.read_text()[-500:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"bench serve: `serve up` for {name} not healthy after 300 s (log {self.log})")
            time.sleep(0.5)
        self.key = self.key_file.read_text().strip()

    def handoff(self) -> dict:
        """Handoff bytes and milliseconds per request so far, from the endpoint's /metrics."""
        text = httpx.get(self.url + "/metrics", headers={"Authorization": f"Bearer {self.key}"}).text
        values = {}
        for line in text.splitlines():
            if line.startswith(("slimwise_handoff_bytes_total ", "slimwise_handoff_seconds_sum ",
                                "slimwise_handoff_seconds_count ")):
                name, value = line.split()
                values[name] = float(value)
        count = values.get("slimwise_handoff_seconds_count", 0)
        if not count:
            return {}
        return {"bytes_per_request": round(values["slimwise_handoff_bytes_total"] / count),
                "ms_per_request": round(1000 * values["slimwise_handoff_seconds_sum"] / count, 3)}

    def pids(self) -> list[int]:
        """The `serve up` process and its descendants (the llama-servers), from /proc (Linux; [] elsewhere)."""
        found, todo = [], [self.proc.pid]
        while todo:
            pid = todo.pop()
            found.append(pid)
            try:
                for task in os.listdir(f"/proc/{pid}/task"):
                    with open(f"/proc/{pid}/task/{task}/children") as f:
                        todo.extend(int(child) for child in f.read().split())
            except OSError:
                continue
        return found

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def run_guidellm(endpoint: _Endpoint, concurrency: int, requests: int, prompt: int, output: int, root: Path,
                 log) -> dict:
    """One GuideLLM benchmark (concurrent profile at `concurrency` streams, `requests` requests) against the
    endpoint; GuideLLM's per-run metrics."""
    out = root / f"guidellm-{endpoint.name}-c{concurrency}.json"
    scenario = {
        "spec": {
            "backend": {"kind": "openai_http", "target": endpoint.url, "model": endpoint.model,
                        "request_format": "/v1/completions", "api_key": endpoint.key, "http2": False},
            "profile": {"kind": "concurrent"},
            "tokenizer": {"kind": "huggingface_auto", "model": str(TEACHER)},
            "data": [{"kind": "synthetic_text", "prompt_tokens": prompt, "output_tokens": output}],
            "constraints": [{"kind": "max_requests", "count": requests}],
            "outputs": [{"kind": "json", "path": str(out)}],
        },
        "benchmarks": [{"profile.streams": concurrency}],
    }
    config = root / f"scenario-{endpoint.name}-c{concurrency}.json"
    config.write_text(json.dumps(scenario))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, "-m", "guidellm", "run", "-c", str(config), "--disable-console"],
                          env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0 or not out.is_file():
        raise RuntimeError(f"bench serve: GuideLLM failed for {endpoint.name} at concurrency {concurrency}: "
                           f"{(proc.stderr or proc.stdout).strip()[-400:]}")
    benchmark = json.loads(out.read_text())["benchmarks"][0]
    metrics = benchmark["metrics"]

    def ok(name):
        return metrics[name]["successful"]

    itl, ttft = ok("inter_token_latency_ms")["percentiles"], ok("time_to_first_token_ms")["percentiles"]
    duration = benchmark["duration"]
    row = {"requests": ok("output_token_count")["count"],
           "errored": metrics["output_token_count"]["errored"]["count"],
           "output_tok_s": round(ok("output_token_count")["total_sum"] / duration, 1),
           "per_user_tok_s": {"p50": round(1000 / itl["p50"], 1), "p90": round(1000 / itl["p90"], 1)},
           "ttft_ms": {"p50": round(ttft["p50"], 1), "p90": round(ttft["p90"], 1)},
           "output_tokens_per_request": ok("output_token_count")["median"]}
    log(f"bench serve: {endpoint.name} at {concurrency}: {json.dumps(row)}")
    return row


def _variant_files(files: dict[str, Path], ratios) -> dict[str, tuple[Path, Path | None]]:
    out = {"full": (files["full"], files["full"])}
    for r in ratios:
        out[f"pruned_{r}"] = (files[f"pruned_{r}"], files[f"pruned_{r}"])
    for r in ratios:
        out[f"slimwise_{r}"] = (files["full"], files[f"pruned_{r}"])
    return out


def _median_row(rows: list[dict]) -> dict:
    """One row from the rounds' rows of a variant at a level: medians of the rates, sums of the counts."""
    med = statistics.median
    return {"requests": sum(r["requests"] for r in rows), "errored": sum(r["errored"] for r in rows),
            "output_tok_s": round(med(r["output_tok_s"] for r in rows), 1),
            "per_user_tok_s": {q: round(med(r["per_user_tok_s"][q] for r in rows), 1) for q in ("p50", "p90")},
            "ttft_ms": {q: round(med(r["ttft_ms"][q] for r in rows), 1) for q in ("p50", "p90")},
            "output_tokens_per_request": med(r["output_tokens_per_request"] for r in rows),
            "output_tok_s_rounds": [r["output_tok_s"] for r in rows]}


def _measure_model(name, model, tokenizer, args, threads, concurrencies, ratios, root, log) -> dict:
    files = _variants(name, model, tokenizer, ratios, args.outtype, root, log)
    endpoints: dict[str, _Endpoint] = {}
    rounds: dict[str, dict[int, list[dict]]] = {}
    probes_at: dict[int, list[int]] = {c: [] for c in concurrencies}  # the probes taken beside each level's runs
    try:
        for variant, (prefill, decode) in _variant_files(files, ratios).items():
            endpoints[variant] = _Endpoint(f"{name}_{variant}", prefill, decode, max(concurrencies), threads, root)
            rounds[variant] = {c: [] for c in concurrencies}
        # expert matmuls timed at the decode steps' rows and at the prefills' (c prompts of --prompt tokens at once);
        # the endpoints' and their llama-servers' CPU time is this bench's own, not another job's
        monitor = engine_monitor(model, ratios, sorted({*concurrencies, *(c * args.prompt for c in concurrencies)}),
                                 threads, own_pids=[pid for e in endpoints.values() for pid in e.pids()])
        order = list(endpoints)
        step = 0
        for round_index in range(args.rounds):
            for c in concurrencies:
                rates = monitor.probe()
                probes_at[c].append(len(monitor.samples) - 1)
                log(f"bench serve: {name}, round {round_index + 1}, concurrency {c}: copy {rates.bandwidth_gbs:.1f} "
                    f"GB/s, matmul {rates.matmul_gflops:.1f} GFLOP/s")
                shift = step % len(order)
                step += 1
                for variant in order[shift:] + order[:shift]:
                    rounds[variant][c].append(run_guidellm(endpoints[variant], c, max(args.min_requests, 4 * c),
                                                           args.prompt, args.output, root, log))
        machine = monitor.machine()
        handoff = {v: endpoints[v].handoff() for v in endpoints}
    finally:
        for endpoint in endpoints.values():
            endpoint.stop()
        for file in files.values():
            file.unlink(missing_ok=True)
    rows = {v: {c: _median_row(rs) for c, rs in by_c.items()} for v, by_c in rounds.items()}

    target = args.target_tok_s or round(args.target_fraction * rows["full"][concurrencies[0]]["per_user_tok_s"]["p50"],
                                        1)
    kv_bytes = {"f16": 2, "f32": 4}["f16"]
    context = args.prompt + args.output / 2
    shape = decode_shape(model, GGUF_BYTES[args.outtype], kv_bytes)

    def bound_at(variant: str, c: int) -> dict:
        """The variant's output-throughput ratio to full at `c` concurrent requests, at most: the least time of a
        round of c requests (their prompts prefilled at once, then --output - 1 decode steps of c sequences) of the
        full model over the variant's (its prefill model, then its decode model), over the probes beside that
        level's runs. The prefill counts: GuideLLM's output tokens/s spans whole requests, and a pruned prefill is
        faster too (at one sequence the decode steps read the same top-k experts, so only the prefill differs)."""
        kind, r = variant.split("_")
        pruned = shape.with_experts(num_to_keep(shape.experts, float(r)))
        prefill_of_variant = pruned if kind == "pruned" else shape

        def round_s(prefill_shape, decode_shape, rates):
            prefill = step_bound_s(prefill_shape, c * args.prompt, args.prompt / 2, rates)
            return prefill + (args.output - 1) * step_bound_s(decode_shape, c, context, rates)

        return monitor.bound(lambda rates: round_s(shape, shape, rates),
                             lambda rates: round_s(prefill_of_variant, pruned, rates), probes=probes_at[c])

    best = {}
    for variant, by_c in rows.items():
        meeting = [c for c, row in by_c.items() if row["per_user_tok_s"]["p90"] >= target and not row["errored"]]
        c_best = max(meeting, key=lambda c: by_c[c]["output_tok_s"]) if meeting else None
        best[variant] = {"concurrency": c_best, "output_tok_s": by_c[c_best]["output_tok_s"] if c_best else None}
    ratios_out, flags = {}, []
    for variant in rows:
        if variant == "full":
            continue
        per_c = {}
        for c in concurrencies:
            # paired within a round: both ran back to back, a slow spell of the machine scales both
            paired = [a["output_tok_s"] / b["output_tok_s"] for a, b in zip(rounds[variant][c], rounds["full"][c])]
            per_user = statistics.median(a["per_user_tok_s"]["p50"] / b["per_user_tok_s"]["p50"]
                                         for a, b in zip(rounds[variant][c], rounds["full"][c]))
            cell = against_bound(statistics.median(paired), quartiles(paired), bound_at(variant, c))
            per_c[c] = {"ratio": cell.pop("speedup"), "ratio_quartiles": cell.pop("speedup_quartiles"),
                        "per_user_ratio": round(per_user, 3), **cell}
            if cell["above_bound"]:
                flags.append(above_bound_note(f"{name} {variant} at concurrency {c}, output tokens/s",
                                              {"speedup": per_c[c]["ratio"], **cell}))
        entry = {"at_concurrency": per_c}
        if best[variant]["output_tok_s"] and best["full"]["output_tok_s"]:
            c_best = best[variant]["concurrency"]
            ratio = best[variant]["output_tok_s"] / best["full"]["output_tok_s"]
            # the medians of two levels: no paired spread, so the ratio reads against the bound's own quartiles
            cell = against_bound(ratio, [ratio, ratio], bound_at(variant, c_best))
            cell.pop("speedup_quartiles")
            entry["best_under_target"] = {"ratio": cell.pop("speedup"), "concurrency": c_best, **cell}
            if cell["above_bound"]:
                flags.append(above_bound_note(f"{name} {variant} best under target (concurrency {c_best})",
                                              {"speedup": round(ratio, 3), **cell}))
        ratios_out[variant] = entry
    return {"model": f"qwen3_moe L{model.config.num_hidden_layers} H{model.config.hidden_size} "
                     f"E{model.config.num_experts} top{model.config.num_experts_per_tok} ({args.outtype})",
            "target_per_user_tok_s": target,
            "target_rule": (f"--target-tok-s {args.target_tok_s}" if args.target_tok_s else
                            f"{args.target_fraction} x the full model's p50 per-user speed at concurrency "
                            f"{concurrencies[0]}"),
            "machine": machine,
            "runs": {v: {str(c): row for c, row in by_c.items()} for v, by_c in rows.items()},
            "best_under_target": best, "ratios_vs_full": ratios_out, "handoff": handoff, "flags": flags}


def run_serve_bench(args) -> dict:
    # transformers' save_pretrained imports DeepSpeed, whose logger prints to stdout: keep stdout for the JSON line
    with contextlib.redirect_stdout(sys.stderr):
        return _run(args)


def _run(args) -> dict:
    def log(message):
        print(message, file=sys.stderr, flush=True)

    concurrencies = sorted({int(c) for c in args.concurrency.split(",")})
    ratios = sorted({float(r) for r in args.ratios.split(",")})
    if not ratios or not all(0 < r < 1 for r in ratios):
        raise ValueError(f"--ratios {args.ratios!r}: shares of experts removed, each in (0, 1)")
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if (not concurrencies or concurrencies[0] < 1 or args.prompt < 1 or args.output < 2 or args.min_requests < 1
            or args.rounds < 1):
        raise ValueError("--concurrency, --prompt, --min-requests and --rounds must be >= 1 and --output >= 2")
    if not set(models) <= {"teacher", "bench"} or not models:
        raise ValueError(f"--models {args.models!r}: use teacher and/or bench")
    if not 0 < args.target_fraction <= 1:
        raise ValueError(f"--target-fraction must be in (0, 1], got {args.target_fraction}")
    if args.target_tok_s is not None and not 0 < args.target_tok_s < float("inf"):
        raise ValueError(f"--target-tok-s must be a number of tokens/s > 0, got {args.target_tok_s}")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads} (leave it out: half the CPUs this process may "
                         "use)")
    if args.work_dir is not None and not Path(args.work_dir).is_dir():
        raise ValueError(f"--work-dir {args.work_dir}: no such folder (the run's files go in a temporary folder "
                         "inside it)")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from slimwise_train.bench.common import bench_model
    from slimwise_train.serve.llamacpp import llama_cpp_home

    threads = args.threads or max(1, len(os.sched_getaffinity(0)) // 2)
    tokenizer = AutoTokenizer.from_pretrained(TEACHER)
    results = {}
    with tempfile.TemporaryDirectory(prefix="slimwise-bench-serve-", dir=args.work_dir) as tmp:
        for name in models:
            if name == "teacher":
                model = AutoModelForCausalLM.from_pretrained(TEACHER).eval()
            else:
                model = bench_model("qwen3_moe", 1024, 2, 128, 8, 768, 2048, torch.device("cpu"), kv_heads=2).eval()
            results[name] = _measure_model(name, model, tokenizer, args, threads, concurrencies, ratios, Path(tmp),
                                           log)
    flags = [f for r in results.values() for f in r["flags"]]
    for flag in flags:
        log(flag)
    for r in results.values():
        note = shared_note(r["machine"], "bench serve")
        if note:
            log(note)
            break
    errored = sum(row["errored"] for r in results.values() for runs in r["runs"].values() for row in runs.values())
    headline = {}
    for name, r in results.items():
        for variant, entry in r["ratios_vs_full"].items():
            if "best_under_target" in entry:
                headline[f"{name}/{variant}"] = entry["best_under_target"]["ratio"]
    targets = {"errored_requests_max": 0, "efficiency_max": 1.0, "slimwise_0.5_best_ratio_min": 1.0}
    slimwise = [r["ratios_vs_full"].get("slimwise_0.5", {}).get("best_under_target", {}).get("ratio")
                for r in results.values()]
    targets_met = {"errored_requests": errored == 0, "bound_holds": not flags,
                   "slimwise_0.5_not_slower": None if None in slimwise else all(x >= 1.0 for x in slimwise)}
    return {"bench": "serve", "load_generator": "guidellm 0.8.1 (concurrent profile, synthetic text, ignore_eos)",
            "engine": f"llama.cpp ({llama_cpp_home().name})", "threads_per_llama_server": threads,
            "gpu": os.environ.get("SLIMWISE_LLAMA_CPP_GPU") == "1", "prompt_tokens": args.prompt,
            "output_tokens": args.output, "concurrency": concurrencies, "rounds": args.rounds,
            "shared": any(r["machine"]["shared"] for r in results.values()),
            "headline_best_under_target": headline,
            "results": results, "flags": flags, "targets": targets, "targets_met": targets_met}

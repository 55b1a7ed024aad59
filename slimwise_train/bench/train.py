"""`python -m slimwise_train.bench <name>`: side-by-side benchmarks that print one JSON line each.

Every figure that matters is a ratio of two things timed in the same process, interleaved, so it holds on a
noisy shared machine; absolute times are printed too and become meaningful on a GPU.

    python -m slimwise_train.bench calib      # statistics collection vs a plain no-grad forward
    python -m slimwise_train.bench phase      # phase-aware masking hooks in the prefill phase vs no hooks
    python -m slimwise_train.bench loss       # top-k + residual KL vs naive full-vocabulary KL
    python -m slimwise_train.bench decode     # decode step: full vs masked vs pruned pools, batch 1..64
    python -m slimwise_train.bench train      # distillation step vs a naive two-copy step and the lower bound
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from typing import Callable

import torch


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def interleaved_times(fns: dict[str, Callable[[], None]], repeats: int, warmup: int, device) -> dict[str, list[float]]:
    """Run each callable `repeats` times in round-robin order (after `warmup` rounds); seconds per run."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            _sync(device)
            start = time.perf_counter()
            fn()
            _sync(device)
            times[name].append(time.perf_counter() - start)
    return times


def bench_model(model_type: str, hidden: int, layers: int, experts: int, top_k: int, moe_intermediate: int,
                vocab: int, device, kv_heads: int | None = None, dtype: torch.dtype = torch.float32):
    """A random stock model of `model_type` with 64-wide heads; `kv_heads` defaults to one per two query heads."""
    from slimwise_train.testing.tiny import tiny_model

    heads = max(hidden // 64, 1)
    kv_heads = kv_heads or max(heads // 2, 1)
    if heads % kv_heads:
        raise ValueError(f"--kv-heads {kv_heads} must divide the {heads} query heads (hidden {hidden} / 64)")
    overrides = dict(hidden_size=hidden, num_hidden_layers=layers, moe_intermediate_size=moe_intermediate,
                     intermediate_size=moe_intermediate, num_attention_heads=heads,
                     num_key_value_heads=kv_heads, head_dim=64, vocab_size=vocab)
    key = {"mixtral": "num_local_experts", "gpt_oss": "num_local_experts", "deepseek_v3": "n_routed_experts"}.get(
        model_type, "num_experts")
    overrides[key] = experts
    overrides["top_k_experts" if model_type == "gemma4_text" else "num_experts_per_tok"] = top_k
    return tiny_model(model_type, init_std=0.02, **overrides).to(device=device, dtype=dtype)


def run_calib(args) -> dict:
    from slimwise_train.prune.statistics import ExpertStatistics
    from slimwise_train.moe.stats import ExpertStatsRecorder

    device = torch.device(args.device)
    torch.manual_seed(0)
    model = bench_model(args.model_type, args.hidden, args.layers, args.experts, args.top_k, args.moe_intermediate,
                        args.vocab, device)
    batches = [torch.randint(0, args.vocab, (args.batch, args.seq), device=device) for _ in range(args.batches)]
    masks = [torch.ones_like(b) for b in batches]
    from slimwise_train.moe.adapters import get_adapter

    layers = get_adapter(model).moe_layers(model)
    stats = ExpertStatistics.empty([m.layer_index for m in layers], layers[0].num_experts, layers[0].top_k)

    @torch.no_grad()
    def plain():
        for ids, mask in zip(batches, masks):
            model(input_ids=ids, attention_mask=mask, use_cache=False)

    @torch.no_grad()
    def with_stats():
        with ExpertStatsRecorder(model, stats.update) as recorder:
            for ids, mask in zip(batches, masks):
                recorder.token_mask = mask.bool().reshape(-1)
                model(input_ids=ids, attention_mask=mask, use_cache=False)

    times = interleaved_times({"forward": plain, "statistics": with_stats}, args.repeats, 1, device)
    fwd, st = statistics.median(times["forward"]), statistics.median(times["statistics"])
    return {
        "bench": "calib",
        "device": str(device),
        "model": f"{args.model_type} L{args.layers} H{args.hidden} E{args.experts} top{args.top_k}",
        "tokens_per_run": args.batches * args.batch * args.seq,
        "forward_s": round(fwd, 4),
        "statistics_s": round(st, 4),
        "ratio": round(st / fwd, 3),
        "target_ratio_max": 1.3,
        "repeats": args.repeats,
    }


def run_phase(args) -> dict:
    """Cost of phase-aware masking: prefill with hooks installed vs the plain model, and decode (masked)."""
    from slimwise_train.moe.adapters import get_adapter
    from slimwise_train.moe.keepset import KeepSet
    from slimwise_train.moe.masking import PhaseMasking

    device = torch.device(args.device)
    model = bench_model(args.model_type, args.hidden, args.layers, args.experts, args.top_k, args.moe_intermediate,
                        args.vocab, device)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)
    layers = get_adapter(model).moe_layers(model)
    keep = KeepSet.from_kept(layers, [list(range(0, m.num_experts, 2)) for m in layers])

    import copy

    hooked_model = copy.deepcopy(model)
    masking = PhaseMasking(hooked_model, keep)

    def forward(m):
        @torch.no_grad()
        def run():
            m(input_ids=ids, use_cache=False)
        return run

    times = interleaved_times({"plain": forward(model), "prefill_phase": forward(hooked_model)}, args.repeats, 1, device)
    t_plain, t_hooked = statistics.median(times["plain"]), statistics.median(times["prefill_phase"])
    switches = 100000
    start = time.perf_counter()
    for i in range(switches):
        masking.set_phase("decode" if i % 2 else "prefill")
    switch_us = (time.perf_counter() - start) / switches * 1e6
    return {
        "bench": "phase",
        "device": str(device),
        "plain_forward_s": round(t_plain, 4),
        "prefill_phase_with_hooks_s": round(t_hooked, 4),
        "ratio": round(t_hooked / t_plain, 3),
        "phase_switch_us": round(switch_us, 3),
    }


def _model_args(parser, **defaults):
    parser.add_argument("--model-type", default=defaults.get("model_type", "qwen3_moe"))
    parser.add_argument("--hidden", type=int, default=defaults.get("hidden", 256))
    parser.add_argument("--layers", type=int, default=defaults.get("layers", 4))
    parser.add_argument("--experts", type=int, default=defaults.get("experts", 32))
    parser.add_argument("--top-k", type=int, default=defaults.get("top_k", 4))
    parser.add_argument("--moe-intermediate", type=int, default=defaults.get("moe_intermediate", 256))
    parser.add_argument("--vocab", type=int, default=defaults.get("vocab", 4096))
    parser.add_argument("--batch", type=int, default=defaults.get("batch", 8))
    parser.add_argument("--seq", type=int, default=defaults.get("seq", 256))
    parser.add_argument("--repeats", type=int, default=defaults.get("repeats", 5))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")


def _peak_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _loss_memory_child(variant: str, tokens: int, vocab: int, top_k: int, chunk: int) -> dict:
    """Runs in a fresh process: peak RSS growth of one loss forward+backward beyond its inputs."""
    import torch.nn.functional as F

    from slimwise_train.distill.losses import distill_loss

    g = torch.Generator().manual_seed(0)
    student = torch.randn(tokens, vocab, generator=g).requires_grad_(True)
    teacher = torch.randn(tokens, vocab, generator=g) * 2
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    # The peak so far includes randn's temporaries; reset it so only the loss's own allocations count
    # (the student gradient, [N, V], is part of them).
    reset = _reset_peak_rss()
    before = _rss_now_bytes() if reset else _peak_rss_bytes()
    if variant == "topk_residual":
        out = distill_loss(student, teacher, labels, top_k=top_k, chunk_size=chunk)
        out["loss"].backward()
    else:
        kl = F.kl_div(F.log_softmax(student, -1), F.log_softmax(teacher, -1), log_target=True, reduction="batchmean")
        loss = 0.1 * F.cross_entropy(student, labels) + 0.9 * kl
        loss.backward()
    return {"peak_extra_bytes": _peak_rss_bytes() - before}


def run_loss(args) -> dict:
    """top-k + residual KL (chunked) vs the naive full-vocabulary KL: time and peak extra memory."""
    import subprocess
    import torch.nn.functional as F

    from slimwise_train.distill.losses import distill_loss

    # The naive KL needs ~5 logits tensors on top of its inputs (~30 GB at 8192 x 151,936 on CPU), so its memory is
    # measured on fewer tokens; both figures are per one fp32 logits tensor of the tokens each ran.
    memory_tokens = {"topk_residual": args.tokens, "naive_full": min(args.naive_tokens, args.tokens)}
    logits_bytes = {variant: n * args.vocab * 4 for variant, n in memory_tokens.items()}
    memory = {}
    for variant, n in memory_tokens.items():
        code = (f"import json; from slimwise_train.bench import _loss_memory_child as f; "
                f"print(json.dumps(f({variant!r}, {n}, {args.vocab}, {args.top_k}, {args.chunk})))")
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"bench loss ({variant}) failed: {proc.stderr.strip().splitlines()[-1:]}")
        memory[variant] = json.loads(proc.stdout.strip().splitlines()[-1])["peak_extra_bytes"]
    g = torch.Generator().manual_seed(0)
    tokens = min(args.tokens, args.time_tokens)
    student = torch.randn(tokens, args.vocab, generator=g).requires_grad_(True)
    teacher = torch.randn(tokens, args.vocab, generator=g) * 2
    labels = torch.randint(0, args.vocab, (tokens,), generator=g)

    def ours():
        student.grad = None
        distill_loss(student, teacher, labels, top_k=args.top_k, chunk_size=args.chunk)["loss"].backward()

    def naive():
        student.grad = None
        kl = F.kl_div(F.log_softmax(student, -1), F.log_softmax(teacher, -1), log_target=True, reduction="batchmean")
        (0.1 * F.cross_entropy(student, labels) + 0.9 * kl).backward()

    times = interleaved_times({"topk_residual": ours, "naive_full": naive}, args.repeats, 1, torch.device("cpu"))
    t_ours, t_naive = statistics.median(times["topk_residual"]), statistics.median(times["naive_full"])
    over_logits = {k: round(v / logits_bytes[k], 3) for k, v in memory.items()}
    target = 1.5
    return {
        "bench": "loss",
        "tokens": memory_tokens,
        "vocab": args.vocab,
        "top_k": args.top_k,
        "chunk_size": args.chunk,
        "logits_fp32_bytes": logits_bytes,
        "peak_extra_bytes": memory,
        "peak_extra_over_logits": over_logits,
        "target_peak_extra_over_logits_max": target,
        "targets_met": {"memory": over_logits["topk_residual"] <= target},
        "timed_tokens": tokens,
        "time_s": {"topk_residual": round(t_ours, 4), "naive_full": round(t_naive, 4)},
        "ratio": round(t_ours / t_naive, 3),
    }


def _paired_ratio(times: dict[str, list[float]], numerator: str, denominator: str) -> float:
    """Median over rounds of the two variants' time ratio within one round. The variants of a round run back to
    back, so a slow spell of the machine (seconds long here) scales both and cancels, where a ratio of the two
    medians would take it in whenever it hits one variant's rounds more than the other's."""
    return statistics.median(a / b for a, b in zip(times[numerator], times[denominator]))


def _decode_cache(model, kind: str, max_len: int):
    """`static`: preallocated K/V written in place, as serving engines keep them (a dynamic cache re-copies the whole
    cache with torch.cat on every step, a cost that has nothing to do with the experts); `dynamic`: HF's default."""
    if kind == "dynamic":
        return None  # the prefill creates a DynamicCache
    from transformers import StaticCache

    return StaticCache(config=model.config, max_cache_len=max_len)


def _rewind_one_token(cache) -> None:
    """Drop the token a decode step appended, so the next timed step sees the same cache."""
    from transformers import StaticCache

    if not isinstance(cache, StaticCache):
        cache.crop(-1)
        return
    for layer in cache.layers:
        # The slot is overwritten by the next step; only the write position has to move back.
        if not hasattr(layer, "cumulative_length"):
            raise RuntimeError("this transformers StaticCache layer has no cumulative_length to rewind; "
                               "run `bench decode --cache dynamic`")
        layer.cumulative_length.sub_(1)
        if hasattr(layer, "cumulative_length_int"):  # sliding-window layers track it twice
            layer.cumulative_length_int -= 1


def run_decode(args) -> dict:
    """One batched decode step: full pool, phase-aware masking and physically pruned pools, per batch size."""
    import copy

    from slimwise_train.moe.adapters import get_adapter
    from slimwise_train.moe.keepset import KeepSet
    from slimwise_train.moe.masking import PhaseMasking
    from slimwise_train.moe.pruning import prune_experts_
    from slimwise_train.prune.criteria import num_to_keep

    device = torch.device(args.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    full = bench_model(args.model_type, args.hidden, args.layers, args.experts, args.top_k, args.moe_intermediate,
                       args.vocab, device, kv_heads=args.kv_heads, dtype=dtype).eval()
    adapter = get_adapter(full)
    layers = adapter.moe_layers(full)
    bytes_per_expert = sum(getattr(m, n)[0].numel() * getattr(m, n).element_size()
                           for m, n, _ in adapter.expert_tensors(layers[0]) if m is layers[0].experts)
    ratios = [float(r) for r in args.ratios.split(",")]
    # Keep sets by a fixed stride (which experts survive does not matter for speed, only how many).
    keeps = {r: KeepSet.from_kept(layers, [list(range(num_to_keep(m.num_experts, r))) for m in layers]) for r in ratios}
    pruned = {r: prune_experts_(copy.deepcopy(full), keeps[r]) for r in ratios}
    masked = copy.deepcopy(full)
    mask_ratio = 0.5 if 0.5 in ratios else ratios[0]
    masking = PhaseMasking(masked, keeps[mask_ratio], phase="decode")
    results = []
    for batch in [int(b) for b in args.batches.split(",")]:
        g = torch.Generator().manual_seed(batch)
        prompt = torch.randint(0, args.vocab, (batch, args.prompt), generator=g).to(device)
        with torch.no_grad():
            cache = _decode_cache(full, args.cache, args.prompt + 1)
            cache = full(input_ids=prompt, past_key_values=cache, use_cache=True).past_key_values
        step_ids = torch.randint(0, args.vocab, (batch, 1), generator=g).to(device)
        touched: dict[str, list[float]] = {}
        # The first MoE layer's expert-module call (module, inputs) per model, replayed alone below to split the
        # step into the routed-expert matmuls and everything else.
        experts_call: dict[str, tuple] = {}

        def step(model, name):
            @torch.no_grad()
            def run():
                hooks = []
                fractions = []
                for i, moe in enumerate(adapter.moe_layers(model)):
                    def pre_hook(mod, a, n=moe.num_experts, first=i == 0):
                        fractions.append(a[1].unique().numel() / n)
                        if first and name not in experts_call:
                            experts_call[name] = (mod, tuple(t.clone() for t in a))
                    hooks.append(moe.experts.register_forward_pre_hook(pre_hook))
                model(input_ids=step_ids, past_key_values=cache, use_cache=True)
                for h in hooks:
                    h.remove()
                _rewind_one_token(cache)  # every run sees the same prompt-length cache
                touched.setdefault(name, []).append(sum(fractions) / len(fractions))
            return run

        def experts_only(name):
            module, inputs = experts_call[name]

            @torch.no_grad()
            def run():
                module(*inputs)
            return run

        fns = {"full": step(full, "full"), f"masked_{mask_ratio}": step(masked, f"masked_{mask_ratio}")}
        fns.update({f"pruned_{r}": step(pruned[r], f"pruned_{r}") for r in ratios})
        # Small batches take milliseconds a step: give every variant at least --min-seconds of timed runs, so
        # their ratios are not left to a handful of samples.
        probe = interleaved_times(fns, 1, args.warmup, device)
        repeats = max(args.repeats, math.ceil(args.min_seconds / max(min(v[0] for v in probe.values()), 1e-6)))
        times = interleaved_times(fns, repeats, 0, device)
        med = {k: statistics.median(v) for k, v in times.items()}
        expert_times = interleaved_times({k: experts_only(k) for k in fns}, repeats, 1, device)
        expert_med = {k: statistics.median(v) for k, v in expert_times.items()}
        experts_full = statistics.mean(touched["full"]) * args.experts
        row = {"batch": batch, "repeats": repeats, "step_s": {k: round(v, 5) for k, v in med.items()},
               "experts_touched_share": {k: round(statistics.mean(v), 3) for k, v in touched.items()}}
        row["masked_over_pruned"] = round(_paired_ratio(times, f"masked_{mask_ratio}", f"pruned_{mask_ratio}"), 3)
        # Routed-expert matmuls of one layer replayed on the step's own routing, times the MoE layer count: the
        # part of the step that pruning shrinks; the rest (attention over the cache, router, LM head) it does not.
        row["experts_share_of_step"] = round(expert_med["full"] * len(layers) / med["full"], 3)
        row["speedup"] = {}
        row["experts_only_speedup"] = {}
        row["bytes_bound"] = {}
        row["bound_efficiency"] = {}
        for r in ratios:
            kept = num_to_keep(args.experts, r)
            experts_pruned = statistics.mean(touched[f"pruned_{r}"]) * kept
            bound = experts_full / experts_pruned
            speed = _paired_ratio(times, "full", f"pruned_{r}")
            row["speedup"][str(r)] = round(speed, 3)
            row["experts_only_speedup"][str(r)] = round(_paired_ratio(expert_times, "full", f"pruned_{r}"), 3)
            row["bytes_bound"][str(r)] = round(bound, 3)
            row["bound_efficiency"][str(r)] = round(speed / bound, 3)
        results.append(row)
        print(json.dumps({"partial": row}), file=sys.stderr, flush=True)
    masking.remove()
    targets = {"masked_over_pruned_max": 1.05, "pruned_0.5_speedup_at_64_min": 1.5, "bound_efficiency_min": 0.85}
    at_64 = next((row for row in results if row["batch"] == 64 and "0.5" in row["speedup"]), None)
    targets_met = {
        "masked_over_pruned": all(row["masked_over_pruned"] <= targets["masked_over_pruned_max"] for row in results),
        # The two batch-64 targets are undefined when batch 64 or ratio 0.5 was not measured.
        "speedup_at_64": None if at_64 is None else at_64["speedup"]["0.5"] >= targets["pruned_0.5_speedup_at_64_min"],
        "bound_efficiency_at_64": None if at_64 is None
        else at_64["bound_efficiency"]["0.5"] >= targets["bound_efficiency_min"],
    }
    return {
        "bench": "decode",
        "device": str(device),
        "model": f"{args.model_type} L{args.layers} H{args.hidden} E{args.experts} top{args.top_k} "
                 f"I{args.moe_intermediate} kv{full.config.num_key_value_heads}x64 {args.dtype}",
        "cache": args.cache,
        "expert_bytes_per_layer": bytes_per_expert * args.experts,
        "prompt_len": args.prompt,
        "results": results,
        "ratio": results[-1]["speedup"].get("0.5", next(iter(results[-1]["speedup"].values()))),
        "targets": targets,
        "targets_met": targets_met,
    }


# --------------------------------------------------------------------------- bench train


def _rss_now_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return _peak_rss_bytes()


def _reset_peak_rss() -> bool:
    """Reset the peak RSS (VmHWM, which getrusage's ru_maxrss reads) to the current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _train_cfg(args: dict):
    """The trainer's config (distill defaults of the real schema, the loss knobs from the command line)."""
    from omegaconf import OmegaConf

    from slimwise_train.config import DistillConfig

    distill = DistillConfig(top_k=args["loss_top_k"], chunk_size=args["chunk"], grad_accum=1)
    return OmegaConf.create({"distill": OmegaConf.structured(distill), "extra": {}, "output_dir": ".",
                             "seed": args["seed"]})


def _train_build(args: dict, device, variants, after_teacher: Callable[[], None] | None = None):
    """The step callables of `variants` (ours / naive / lower_bound) on one shared teacher and one batch.

    Everything built after `after_teacher()` is what the variant adds on top of the teacher's weights.
    Returns (steps {name: fn}, batch stats).
    """
    import copy
    from types import SimpleNamespace

    import torch.nn.functional as F
    from transformers import DynamicCache

    from slimwise_train.moe.adapters import get_adapter
    from slimwise_train.distill import batches as B
    from slimwise_train.distill.engine import TorchEngine
    from slimwise_train.distill.losses import IGNORE_INDEX
    from slimwise_train.distill.student import (DistillModel, SharedExpert, StudentSpec, activation_name, find_norms,
                                                routed_expert_size, text_config)
    from slimwise_train.distill.trainer import Trainer
    from slimwise_train.moe.handoff import positions_from_mask
    from slimwise_train.moe.keepset import KeepSet
    from slimwise_train.moe.pruning import prune_experts_
    from slimwise_train.prune.criteria import num_to_keep

    torch.manual_seed(args["seed"])
    teacher = bench_model(args["model_type"], args["hidden"], args["layers"], args["experts"], args["top_k"],
                          args["moe_intermediate"], args["vocab"], device).eval()
    teacher.requires_grad_(False)
    if after_teacher is not None:
        after_teacher()
    adapter = get_adapter(teacher)
    layers = adapter.moe_layers(teacher)
    keep = KeepSet.from_kept(layers, [list(range(num_to_keep(m.num_experts, args["prune_ratio"]))) for m in layers])
    cfg = _train_cfg(args)
    d = cfg.distill

    # One batch from the trainer's own data plan: `batch` sequences of `seq` random tokens; a one-batch plan without
    # shuffling repeats it at every step. split="random": the trainer's default rule, s ~ U{1..seq-2} per row (a
    # batch of few rows can land far from the mean). A fraction f: every row split at s = f * seq, by the rule with
    # min_split = s and min_continuation = seq - s (so lo = hi = s); 0.5 is the mean of the default rule, and equal
    # splits are what length bucketing (bucket_windows) approximates in training.
    g = torch.Generator().manual_seed(args["seed"])
    pad = int(teacher.config.pad_token_id or 0)
    seqs = [(torch.randint(3, args["vocab"], (args["seq"],), generator=g).tolist(), 0) for _ in range(args["batch"])]
    if args["split"] == "random":
        rule = B.SplitRule(int(d.min_split), int(d.min_continuation), bool(d.split_after_prompt))
    else:
        at = min(max(round(float(args["split"]) * args["seq"]), 1), args["seq"] - 2)
        rule = B.SplitRule(min_split=at, min_continuation=args["seq"] - at)
    plan = B.DataPlan(seqs, rule, args["batch"], data_seed=0, split_seed=args["seed"], bucket_windows=1, shuffle=False)
    indices, splits = plan.step_batch(0)
    batch = B.continuation_batch([seqs[i] for i in indices], splits, pad).to(device)
    P, L = batch.prefix_ids.shape[1], batch.cont_ids.shape[1]
    full_ids = torch.cat([batch.prefix_ids, batch.cont_ids], dim=1)
    cont_mask = batch.full_mask[:, P:]
    cont_positions = positions_from_mask(batch.full_mask, P, L)
    steps: dict[str, Callable[[], None]] = {}

    def optimizer_step(params, optimizer):
        # What TorchEngine.step does: explicit clip, AdamW, zero grads.
        torch.nn.utils.clip_grad_norm_(params, float(d.grad_clip) if float(d.grad_clip) > 0 else float("inf"))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def adamw(params):
        return torch.optim.AdamW(params, lr=float(d.lr), betas=(float(d.adam_beta1), float(d.adam_beta2)),
                                 eps=float(d.adam_eps), weight_decay=float(d.weight_decay))

    if "naive" in variants:
        # A separate student: deep copy of the teacher, experts physically pruned, its own routers and norms
        # trainable in place, plus a new shared expert (same module and init as ours) added to the experts' output.
        student = prune_experts_(copy.deepcopy(teacher), keep)
        student.requires_grad_(False)
        params = []
        for moe in adapter.moe_layers(student):
            router = adapter.mask_hook_target(moe)
            for p in router.parameters(recurse=False):
                params.append(p.requires_grad_(True))
            shared = SharedExpert(teacher.config.hidden_size, routed_expert_size(student), activation_name(student),
                                  torch.float32, device)
            with torch.no_grad():
                shared.down_proj.weight.zero_()
            moe.block.add_module("naive_shared_expert", shared)
            moe.experts.register_forward_hook(
                lambda mod, a, out, shared=shared: out + shared(a[0]).view_as(out))
            params += list(shared.parameters())
        params += [norm.weight.requires_grad_(True) for _, norm in find_norms(student, "all")]
        naive_opt = adamw(params)

        def naive():
            with torch.no_grad():
                # Teacher pass 1: the prefix, for the cache (only the cache is used, as in generate's prefill).
                cache = DynamicCache(config=text_config(teacher))
                teacher(input_ids=batch.prefix_ids, attention_mask=batch.prefix_mask,
                        position_ids=positions_from_mask(batch.prefix_mask), past_key_values=cache, use_cache=True,
                        logits_to_keep=1)
                # Teacher pass 2: the whole sequence again for the targets (a plain forward: logits everywhere).
                target = teacher(input_ids=full_ids, attention_mask=batch.full_mask,
                                 position_ids=positions_from_mask(batch.full_mask), use_cache=False).logits[:, P:]
            logits = student(input_ids=batch.cont_ids, attention_mask=batch.full_mask, position_ids=cont_positions,
                             past_key_values=cache, use_cache=True).logits
            valid = batch.labels != IGNORE_INDEX
            s, t = logits[valid].float(), target[valid].float()
            kl = F.kl_div(F.log_softmax(s, -1), F.log_softmax(t, -1), log_target=True, reduction="batchmean")
            loss = float(d.ce_weight) * F.cross_entropy(s, batch.labels[valid]) + float(d.kl_weight) * kl
            loss.backward()
            optimizer_step(params, naive_opt)

        steps["naive"] = naive

    if "ours" in variants or "lower_bound" in variants:
        model = DistillModel(teacher, keep, StudentSpec(seed=args["seed"]))
        trainable = [p for _, p in model.trainable_named_parameters()]
    if "ours" in variants:
        # The real step: Trainer.train_step on a trainer whose setup() is replaced by the attributes it would set
        # (model, data plan, engine=torch); no files, no logger.
        trainer = Trainer(cfg)
        trainer.rank, trainer.world_size, trainer.device = 0, 1, device
        trainer.student, trainer.rule, trainer.train_seqs, trainer.plan = model, rule, seqs, plan
        trainer.micro_batch, trainer.grad_accum, trainer.global_batch = args["batch"], 1, args["batch"]
        trainer.tokenizer = SimpleNamespace(pad_token_id=pad)
        trainer.engine = TorchEngine(model, d, device)
        steps["ours"] = lambda: trainer.train_step(0)
    if "lower_bound" in variants:
        lower_opt = adamw(trainable)

        def lower_bound():
            with torch.no_grad():  # one teacher pass over the whole sequence, logits only where targets are needed
                model(full_ids, batch.full_mask, positions_from_mask(batch.full_mask), None, phase="teacher",
                      use_cache=False, logits_to_keep=L)
            logits = model(batch.cont_ids, cont_mask, cont_positions, None, phase="student", use_cache=False)
            F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch.labels.reshape(-1),
                            ignore_index=IGNORE_INDEX).backward()
            optimizer_step(trainable, lower_opt)

        steps["lower_bound"] = lower_bound
    return steps, batch.stats()


TRAIN_VARIANTS = ("ours", "naive", "lower_bound")


def _train_memory_child(variant: str, args: dict) -> dict:
    """Runs in a fresh process: memory of `warm steps` + 1 steps of one variant beyond the teacher's weights."""
    device = torch.device(args["device"])
    marks: dict[str, int] = {}

    def after_teacher():
        if device.type == "cuda":
            torch.cuda.synchronize()
            marks["teacher"] = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        else:
            marks["teacher"] = _rss_now_bytes()
            marks["reset"] = int(_reset_peak_rss())  # drop the peak of building the teacher

    steps, _ = _train_build(args, device, [variant], after_teacher)
    if device.type == "cuda":
        torch.cuda.synchronize()
        marks["models"] = torch.cuda.memory_allocated(device)
    else:
        marks["models"] = _rss_now_bytes()
    for _ in range(2):  # the first step creates the optimizer state; the second runs with it
        steps[variant]()
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(device)
    else:
        peak = _peak_rss_bytes()
    return {
        "metric": "cuda_max_memory_allocated" if device.type == "cuda" else
        ("rss_vmhwm_reset_after_teacher" if marks.get("reset") else "rss_ru_maxrss"),
        "peak_total": peak,
        "after_teacher": marks["teacher"],
        "models_extra": marks["models"] - marks["teacher"],
        "peak_extra_over_teacher_weights": peak - marks["teacher"],
    }


def run_train(args) -> dict:
    """One distillation step: ours (Trainer.train_step) vs a naive two-copy step vs the lower bound.

    ours         the real SlimWise step, `Trainer.train_step` itself on a trainer whose `setup()` is replaced by the
                 attributes it sets (DistillModel over the one teacher, the trainer's DataPlan, engine=torch):
                 teacher prefill of the prefix (cache only) -> teacher continuation on a copy of the cache (targets)
                 -> student continuation on the cache -> chunked top-k + residual KL and CE -> backward -> clip, AdamW.
    naive        how existing distillation tools do it: a separate deep copy of the teacher, experts physically
                 pruned, its own router/norm weights trainable and a new shared expert (two weight copies in memory);
                 a teacher pass over the prefix for the cache and ANOTHER plain teacher forward over the whole sequence
                 for the targets; the student continues on the prefix cache; full-vocabulary fp32 KL (log_softmax of
                 both over every token, unchunked) + CE with the same weights; clip, AdamW.
    lower_bound  the least compute the method needs: one no-grad teacher forward over the whole sequence (logits
                 only at the continuation) + one student forward and backward over the continuation tokens alone
                 (no prefix cache) with a plain CE; clip, AdamW.

    All three run the same batch from the trainer's DataPlan (`--split`: every row split at that fraction of
    `--seq`, default the mean split 0.5, or the trainer's random split points) and the same AdamW settings; the
    loss knobs are distill.top_k / chunk_size (`--loss-top-k`, `--chunk`, defaults of the real config).

    Time: interleaved repeats in one process after a warm-up round, medians; throughput counts real continuation
    tokens (no padding). Memory: each variant in a fresh process, two steps (the second one with optimizer state).
    `peak_total` is the peak RSS (GPU: max_memory_allocated) of the whole process after the teacher was built: the
    interpreter, torch and the teacher's weights, which every variant holds alike, plus the rest.
    `peak_extra_over_teacher_weights` = peak - memory right after the teacher was built: everything the variant
    adds on top of the one copy of the teacher it cannot do without, i.e. the naive student's second (pruned) weight
    copy, trainable tensors, optimizer state, caches, logits, activations and loss intermediates. This is the fair
    basis of the memory target (the fixed part would make any two variants look alike); `models_extra` is the part of
    it that exists before the first step (the naive student's copy; ours: the small trainable children).
    """
    import subprocess

    device = torch.device(args.device)
    a = {k: getattr(args, k) for k in ("model_type", "hidden", "layers", "experts", "top_k", "moe_intermediate",
                                       "vocab", "batch", "seq", "prune_ratio", "loss_top_k", "chunk", "split", "seed")}
    a["device"] = str(device)
    memory = {}
    for variant in TRAIN_VARIANTS:
        code = (f"import json; from slimwise_train.bench import _train_memory_child as f; "
                f"print(json.dumps(f({variant!r}, {a!r})))")
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"bench train memory ({variant}) failed: {proc.stderr.strip().splitlines()[-3:]}")
        memory[variant] = json.loads(proc.stdout.strip().splitlines()[-1])
    steps, stats = _train_build(a, device, TRAIN_VARIANTS)
    times = interleaved_times(steps, args.repeats, 1, device)
    med = {k: statistics.median(v) for k, v in times.items()}
    tokens = stats["cont_tokens"]
    throughput = {k: tokens / v for k, v in med.items()}
    speedup = throughput["ours"] / throughput["naive"]
    over_lower = med["ours"] / med["lower_bound"]
    extra = {k: v["peak_extra_over_teacher_weights"] for k, v in memory.items()}
    mem_ratio = extra["ours"] / extra["naive"]
    mib = 1 / 2**20
    return {
        "bench": "train",
        "device": str(device),
        "threads": torch.get_num_threads(),
        "model": f"{args.model_type} L{args.layers} H{args.hidden} E{args.experts} top{args.top_k} "
                 f"I{args.moe_intermediate} V{args.vocab}",
        "prune_ratio": args.prune_ratio,
        "batch": args.batch,
        "seq": args.seq,
        "split": args.split,
        "tokens": stats,
        "step_s": {k: round(v, 4) for k, v in med.items()},
        "cont_tokens_per_s": {k: round(v, 2) for k, v in throughput.items()},
        "ours_over_naive_throughput": round(speedup, 3),
        "ours_over_lower_bound_time": round(over_lower, 3),
        "memory_metric": memory["ours"]["metric"],
        "peak_total_mib": {k: round(v["peak_total"] * mib, 1) for k, v in memory.items()},
        "peak_extra_over_teacher_weights_mib": {k: round(v * mib, 1) for k, v in extra.items()},
        "models_extra_mib": {k: round(v["models_extra"] * mib, 1) for k, v in memory.items()},
        "ours_over_naive_peak_extra": round(mem_ratio, 3),
        "ours_over_naive_peak_total": round(memory["ours"]["peak_total"] / memory["naive"]["peak_total"], 3),
        "targets": {"ours_over_naive_throughput_min": 1.3, "ours_over_naive_peak_extra_max": 0.6,
                    "ours_over_lower_bound_time_max": 1.15},
        "targets_met": {"throughput": speedup >= 1.3, "memory": mem_ratio <= 0.6, "lower_bound": over_lower <= 1.15},
        "repeats": args.repeats,
        "ratio": round(speedup, 3),
    }


BENCHES = {"calib": run_calib, "phase": run_phase, "loss": run_loss, "decode": run_decode, "train": run_train}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m slimwise_train.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="name", required=True)
    calib = sub.add_parser("calib", help="statistics collection vs plain no-grad forward")
    _model_args(calib)
    calib.add_argument("--batches", type=int, default=4)
    phase = sub.add_parser("phase", help="phase-aware masking overhead")
    _model_args(phase)
    loss = sub.add_parser("loss", help="top-k + residual KL vs naive full-vocabulary KL: time, peak memory")
    loss.add_argument("--tokens", type=int, default=8192, help="tokens for the memory of the top-k + residual KL")
    loss.add_argument("--naive-tokens", type=int, default=2048,
                      help="tokens for the memory of the naive KL (at 8192 it needs ~30 GB on CPU)")
    loss.add_argument("--vocab", type=int, default=151936)
    loss.add_argument("--top-k", type=int, default=64)
    loss.add_argument("--chunk", type=int, default=256)
    loss.add_argument("--time-tokens", type=int, default=1024, help="tokens for the timing part")
    loss.add_argument("--repeats", type=int, default=3)
    decode = sub.add_parser("decode", help="one batched decode step: full, masked, pruned 25/50/75%")
    # 8 of 128 experts as Qwen3-30B-A3B routes (the paper's models route 8 of 128 or 256). I768 puts 1.2 GB of fp32
    # experts in a layer, the bytes of Qwen3-30B-A3B's bf16 experts: the per-op costs of attention, router and cache
    # do not grow with the experts, so at I256 (400 MB) they took 28% of the batch-64 step, at I512 6-12%.
    _model_args(decode, hidden=1024, layers=2, experts=128, top_k=8, moe_intermediate=768, vocab=2048, repeats=15)
    decode.add_argument("--batches", default="1,8,32,64")
    decode.add_argument("--ratios", default="0.25,0.5,0.75")
    decode.add_argument("--prompt", type=int, default=256)
    decode.add_argument("--kv-heads", type=int, default=2,
                        help="key/value heads of 64 (default 2: 8 query heads per KV head, as Qwen3-30B-A3B's 32/4)")
    decode.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    decode.add_argument("--min-seconds", type=float, default=2.0,
                        help="timed seconds per variant and batch size at least (more repeats for small batches)")
    decode.add_argument("--warmup", type=int, default=4,
                        help="untimed rounds of every variant first (the first few rounds after the models are "
                             "built run slow and uneven here)")
    decode.add_argument("--cache", choices=["static", "dynamic"], default="static",
                        help="KV cache: preallocated and written in place (static, as serving engines do) or HF's "
                             "DynamicCache, which re-copies it on every step")
    train = sub.add_parser("train", help="distillation step: ours vs naive two-copy step vs lower bound; memory")
    _model_args(train, hidden=512, layers=4, experts=32, top_k=4, moe_intermediate=256, vocab=32768, batch=4, seq=256,
                repeats=3)
    train.add_argument("--prune-ratio", type=float, default=0.5, help="share of routed experts removed per layer")
    train.add_argument("--loss-top-k", type=int, default=64, help="distill.top_k of the KL")
    train.add_argument("--chunk", type=int, default=1024, help="distill.chunk_size of the loss")
    train.add_argument("--split", default="0.5",
                       help="split point as a fraction of --seq for every row, or 'random' (s ~ U{1..seq-2} per row)")
    train.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    result = BENCHES[args.name](args)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

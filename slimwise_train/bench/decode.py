"""`bench decode`: one batched decode step, full vs masked vs pruned pools, per batch size."""

from __future__ import annotations

import json
import math
import statistics
import sys

import torch

from slimwise_train.bench.common import _paired_ratio, bench_model, interleaved_times, paired_ratio_quartiles
from slimwise_train.bench.roofline import decode_shape, measure_machine, step_bound_s


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
    # The roofline of this machine (bench/roofline.py): bytes and FLOPs, where bytes_bound counts expert bytes only.
    rates = measure_machine(torch.get_num_threads()) if device.type == "cpu" else None
    element = torch.finfo(dtype).bits // 8
    shape = decode_shape(full, element, element)
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
        row["speedup_quartiles"] = {}  # over rounds: the noise of the ratio on this machine, in this run
        row["experts_only_speedup"] = {}
        row["bytes_bound"] = {}
        row["bound_efficiency"] = {}
        row["roofline_bound"] = {}
        row["roofline_efficiency"] = {}
        # each variant's step against its own roofline time: how far the implementation is from the hardware (a
        # ratio of two bounds is exceeded when the full step is further from its bound than the pruned one)
        row["roofline_fraction"] = {}
        if rates is not None:
            full_bound = step_bound_s(shape, batch, args.prompt, rates, touched=experts_full)
            row["roofline_fraction"]["full"] = round(full_bound / med["full"], 3)
        for r in ratios:
            kept = num_to_keep(args.experts, r)
            experts_pruned = statistics.mean(touched[f"pruned_{r}"]) * kept
            bound = experts_full / experts_pruned
            speed = _paired_ratio(times, "full", f"pruned_{r}")
            row["speedup"][str(r)] = round(speed, 3)
            row["speedup_quartiles"][str(r)] = [round(q, 3) for q in paired_ratio_quartiles(times, "full", f"pruned_{r}")]
            row["experts_only_speedup"][str(r)] = round(_paired_ratio(expert_times, "full", f"pruned_{r}"), 3)
            row["bytes_bound"][str(r)] = round(bound, 3)
            row["bound_efficiency"][str(r)] = round(speed / bound, 3)
            if rates is not None:
                pruned_bound = step_bound_s(shape.with_experts(kept), batch, args.prompt, rates, touched=experts_pruned)
                roof = full_bound / pruned_bound
                row["roofline_bound"][str(r)] = round(roof, 3)
                row["roofline_fraction"][f"pruned_{r}"] = round(pruned_bound / med[f"pruned_{r}"], 3)
                row["roofline_efficiency"][str(r)] = round(speed / roof, 3)
        results.append(row)
        print(json.dumps({"partial": row}), file=sys.stderr, flush=True)
    masking.remove()
    targets = {"masked_over_pruned_max": 1.05, "pruned_0.5_speedup_at_64_min": 1.5, "bound_efficiency_min": 0.85,
               "roofline_efficiency_min": 0.85}
    at_64 = next((row for row in results if row["batch"] == 64 and "0.5" in row["speedup"]), None)
    targets_met = {
        "masked_over_pruned": all(row["masked_over_pruned"] <= targets["masked_over_pruned_max"] for row in results),
        # The two batch-64 targets are undefined when batch 64 or ratio 0.5 was not measured.
        "speedup_at_64": None if at_64 is None else at_64["speedup"]["0.5"] >= targets["pruned_0.5_speedup_at_64_min"],
        "bound_efficiency_at_64": None if at_64 is None
        else at_64["bound_efficiency"]["0.5"] >= targets["bound_efficiency_min"],
        # the bound computed on this machine (bytes and FLOPs); CPU only (a GPU's rates are not measured here)
        "roofline_efficiency_at_64": None if at_64 is None or "0.5" not in at_64["roofline_efficiency"]
        else at_64["roofline_efficiency"]["0.5"] >= targets["roofline_efficiency_min"],
    }
    return {
        "bench": "decode",
        "device": str(device),
        "model": f"{args.model_type} L{args.layers} H{args.hidden} E{args.experts} top{args.top_k} "
                 f"I{args.moe_intermediate} kv{full.config.num_key_value_heads}x64 {args.dtype}",
        "cache": args.cache,
        "machine": rates.as_dict() if rates is not None else None,
        "expert_bytes_per_layer": bytes_per_expert * args.experts,
        "prompt_len": args.prompt,
        "results": results,
        "ratio": results[-1]["speedup"].get("0.5", next(iter(results[-1]["speedup"].values()))),
        "targets": targets,
        "targets_met": targets_met,
    }


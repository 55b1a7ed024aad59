"""`bench decode`: one batched decode step, full vs masked vs pruned pools, per batch size."""

from __future__ import annotations

import json
import math
import statistics
import sys

import torch

from slimwise_train.bench.common import _paired_ratio, bench_model, interleaved_times, paired_ratio_quartiles
from slimwise_train.bench.roofline import (RooflineMonitor, above_bound_note, against_bound, decode_shape,
                                           faster_than_bound, rows_to_measure, shared_note, step_bound_s)


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


PROBES = 10  # machine probes per batch size, spread over its timed rounds


def run_decode(args) -> dict:
    """One batched decode step: full pool, phase-aware masking and physically pruned pools, per batch size; each
    speed-up beside its bound from this machine's rates, probed between the timed rounds (bench/roofline.py)."""
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
    batches = [int(b) for b in args.batches.split(",")]
    kept = {r: num_to_keep(args.experts, r) for r in ratios}
    # Keep sets by a fixed stride (which experts survive does not matter for speed, only how many).
    keeps = {r: KeepSet.from_kept(layers, [list(range(kept[r])) for _ in layers]) for r in ratios}
    pruned = {r: prune_experts_(copy.deepcopy(full), keeps[r]) for r in ratios}
    masked = copy.deepcopy(full)
    mask_ratio = 0.5 if 0.5 in ratios else ratios[0]
    masking = PhaseMasking(masked, keeps[mask_ratio], phase="decode")
    element = torch.finfo(dtype).bits // 8
    shape = decode_shape(full, element, element)
    # The bound needs this machine's rates, probed on the CPU the step runs on (a GPU's are not measured here).
    monitor = (RooflineMonitor(torch.get_num_threads(), expert=(args.hidden, args.moe_intermediate),
                               rows=rows_to_measure(batches, args.top_k, [args.experts, *kept.values()]))
               if device.type == "cpu" else None)
    results, flagged = [], []
    for batch in batches:
        g = torch.Generator().manual_seed(batch)
        prompt = torch.randint(0, args.vocab, (batch, args.prompt), generator=g).to(device)
        with torch.no_grad():
            cache = _decode_cache(full, args.cache, args.prompt + 1)
            cache = full(input_ids=prompt, past_key_values=cache, use_cache=True).past_key_values
        step_ids = torch.randint(0, args.vocab, (batch, 1), generator=g).to(device)
        # Rows routed to each expert of each MoE layer in this step, per variant: recorded on the untimed first
        # call (the same step on the same cache routes the same way every time).
        rows: dict[str, list[list[int]]] = {}

        def step(model, name):
            @torch.no_grad()
            def run():
                hooks = []
                if name not in rows:
                    rows[name] = []
                    for moe in adapter.moe_layers(model):
                        def pre_hook(mod, a, n=moe.num_experts, into=rows[name]):
                            into.append(torch.bincount(a[1].flatten().cpu(), minlength=n).tolist())
                        hooks.append(moe.experts.register_forward_pre_hook(pre_hook))
                model(input_ids=step_ids, past_key_values=cache, use_cache=True)
                for h in hooks:
                    h.remove()
                _rewind_one_token(cache)  # every run sees the same prompt-length cache
            return run

        fns = {"full": step(full, "full"), f"masked_{mask_ratio}": step(masked, f"masked_{mask_ratio}")}
        fns.update({f"pruned_{r}": step(pruned[r], f"pruned_{r}") for r in ratios})
        # Small batches take milliseconds a step: give every variant at least --min-seconds of timed runs, so
        # their ratios are not left to a handful of samples.
        probe = interleaved_times(fns, 1, args.warmup, device)
        repeats = max(args.repeats, math.ceil(args.min_seconds / max(min(v[0] for v in probe.values()), 1e-6)))
        first_probe = len(monitor.samples) if monitor else 0
        every = max(1, repeats // PROBES)
        between = (lambda i: monitor.probe() if (i + 1) % every == 0 else None) if monitor else None
        times = interleaved_times(fns, repeats, 0, device, between_rounds=between)
        med = {k: statistics.median(v) for k, v in times.items()}
        touched = {k: sum(r > 0 for layer in v for r in layer) / (len(v) * len(v[0])) for k, v in rows.items()}
        row = {"batch": batch, "repeats": repeats, "step_s": {k: round(v, 5) for k, v in med.items()},
               "experts_touched_share": {k: round(v, 3) for k, v in touched.items()},
               "rows_per_touched_expert": {k: round(batch * args.top_k / max(sum(r > 0 for r in v[0]), 1), 2)
                                           for k, v in rows.items()},
               "masked_over_pruned": round(_paired_ratio(times, f"masked_{mask_ratio}", f"pruned_{mask_ratio}"), 3),
               "masked_over_pruned_quartiles": [round(q, 3) for q in paired_ratio_quartiles(
                   times, f"masked_{mask_ratio}", f"pruned_{mask_ratio}")],
               "pruned": {}}

        def bound_s(r, variant):
            model_shape = shape if variant == "full" else shape.with_experts(kept[float(variant.split("_")[1])])
            return step_bound_s(model_shape, batch, args.prompt, r, rows=rows[variant])

        for r in ratios:
            speed = _paired_ratio(times, "full", f"pruned_{r}")
            spread = paired_ratio_quartiles(times, "full", f"pruned_{r}")
            if monitor is None:
                row["pruned"][str(r)] = {"speedup": round(speed, 3), "speedup_quartiles": [round(q, 3) for q in spread],
                                         "bound": None}
                continue
            bound = monitor.bound(lambda m: bound_s(m, "full"), lambda m, v=f"pruned_{r}": bound_s(m, v),
                                  since=first_probe)
            row["pruned"][str(r)] = against_bound(speed, spread, bound)
            if row["pruned"][str(r)]["above_bound"]:
                flagged.append({"batch": batch, "ratio": r})
                print(above_bound_note(f"bench decode: batch {batch}, pruned {r}", row["pruned"][str(r)]),
                      file=sys.stderr, flush=True)
        if monitor is not None:
            # each variant's step against its own roofline time (median rates of this batch's probes): how far the
            # implementation is from the hardware; a ratio of two bounds is exceeded when the full step is further
            # from its bound than the pruned one
            rates = monitor.median_rates(first_probe)
            row["roofline_fraction"] = {v: round(bound_s(rates, v) / med[v], 3) for v in rows if v in med
                                        and not v.startswith("masked")}
            row["faster_than_bound"] = faster_than_bound(row["roofline_fraction"])
            if row["faster_than_bound"]:
                print(f"bench decode: batch {batch}: {', '.join(row['faster_than_bound'])} ran faster than its least "
                      "time from the probes: they understated this machine, so this batch's bounds are suspect",
                      file=sys.stderr, flush=True)
        results.append(row)
        print(json.dumps({"partial": row}), file=sys.stderr, flush=True)
    masking.remove()
    machine = monitor.machine() if monitor else None
    note = shared_note(machine, "bench decode") if machine else None
    if note:
        print(note, file=sys.stderr, flush=True)
    targets = {"masked_over_pruned_max": 1.05, "pruned_0.5_speedup_at_64_min": 1.5, "efficiency_min": 0.85}
    at_64 = next((row["pruned"]["0.5"] for row in results if row["batch"] == 64 and "0.5" in row["pruned"]), None)
    targets_met = {
        "masked_over_pruned": all(row["masked_over_pruned"] <= targets["masked_over_pruned_max"] for row in results),
        # The two batch-64 targets are undefined when batch 64 or ratio 0.5 was not measured (or, for the
        # efficiency, no bound: off the CPU).
        "speedup_at_64": None if at_64 is None else at_64["speedup"] >= targets["pruned_0.5_speedup_at_64_min"],
        "efficiency_at_64": None if at_64 is None or at_64["bound"] is None
        else targets["efficiency_min"] <= at_64["efficiency"] <= 1,
        # a speed-up above its bound, or a step faster than its own least time, anywhere: the bound is wrong there
        "within_bound": None if monitor is None else not flagged and not any(r["faster_than_bound"] for r in results),
    }
    last = results[-1]["pruned"]
    return {
        "bench": "decode",
        "device": str(device),
        "model": f"{args.model_type} L{args.layers} H{args.hidden} E{args.experts} top{args.top_k} "
                 f"I{args.moe_intermediate} kv{full.config.num_key_value_heads}x64 {args.dtype}",
        "cache": args.cache,
        "machine": machine,
        "expert_bytes_per_layer": bytes_per_expert * args.experts,
        "prompt_len": args.prompt,
        "results": results,
        "above_bound": flagged,
        "ratio": last.get("0.5", next(iter(last.values())))["speedup"],
        "targets": targets,
        "targets_met": targets_met,
    }

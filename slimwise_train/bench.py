"""`python -m slimwise_train.bench <name>`: side-by-side benchmarks that print one JSON line each.

Every figure that matters is a ratio of two things timed in the same process, interleaved, so it holds on a
noisy shared machine; absolute times are printed too and become meaningful on a GPU.

    python -m slimwise_train.bench calib      # statistics collection vs a plain no-grad forward
    python -m slimwise_train.bench phase      # phase-aware masking hooks in the prefill phase vs no hooks
"""

from __future__ import annotations

import argparse
import json
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
                vocab: int, device):
    from slimwise_train.testing.tiny import tiny_model

    overrides = dict(hidden_size=hidden, num_hidden_layers=layers, moe_intermediate_size=moe_intermediate,
                     intermediate_size=moe_intermediate, num_attention_heads=max(hidden // 64, 1),
                     num_key_value_heads=max(hidden // 128, 1), head_dim=64, vocab_size=vocab)
    key = {"mixtral": "num_local_experts", "gpt_oss": "num_local_experts", "deepseek_v3": "n_routed_experts"}.get(
        model_type, "num_experts")
    overrides[key] = experts
    overrides["top_k_experts" if model_type == "gemma4_text" else "num_experts_per_tok"] = top_k
    return tiny_model(model_type, init_std=0.02, **overrides).to(device)


def run_calib(args) -> dict:
    from slimwise_train.scoring import ExpertStatistics
    from slimwise_train.stats import ExpertStatsRecorder

    device = torch.device(args.device)
    torch.manual_seed(0)
    model = bench_model(args.model_type, args.hidden, args.layers, args.experts, args.top_k, args.moe_intermediate,
                        args.vocab, device)
    batches = [torch.randint(0, args.vocab, (args.batch, args.seq), device=device) for _ in range(args.batches)]
    masks = [torch.ones_like(b) for b in batches]
    from slimwise_train.adapters import get_adapter

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
    from slimwise_train.adapters import get_adapter
    from slimwise_train.keepset import KeepSet
    from slimwise_train.masking import PhaseMasking

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


BENCHES = {"calib": run_calib, "phase": run_phase}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m slimwise_train.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="name", required=True)
    calib = sub.add_parser("calib", help="statistics collection vs plain no-grad forward")
    _model_args(calib)
    calib.add_argument("--batches", type=int, default=4)
    phase = sub.add_parser("phase", help="phase-aware masking overhead")
    _model_args(phase)
    args = parser.parse_args(argv)
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    result = BENCHES[args.name](args)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

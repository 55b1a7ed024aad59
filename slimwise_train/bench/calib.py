"""`bench calib`: statistics collection vs a plain no-grad forward."""

from __future__ import annotations

import statistics

import torch

from slimwise_train.bench.common import bench_model, interleaved_times


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


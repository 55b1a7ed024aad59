"""`bench phase`: phase-aware masking hooks in the prefill phase vs no hooks, and the cost of a phase switch."""

from __future__ import annotations

import statistics
import time

import torch

from slimwise_train.bench.common import bench_model, interleaved_times


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


"""`python -m slimwise_train.bench <name>`: side-by-side benchmarks that print one JSON line each.

Every figure that matters is a ratio of two things timed in the same process, interleaved, so it holds on a
noisy shared machine; absolute times are printed too and become meaningful on a GPU.

    python -m slimwise_train.bench calib      # statistics collection vs a plain no-grad forward
    python -m slimwise_train.bench phase      # phase-aware masking hooks in the prefill phase vs no hooks
    python -m slimwise_train.bench loss       # top-k + residual KL vs naive full-vocabulary KL
    python -m slimwise_train.bench decode     # decode step: full vs masked vs pruned pools, batch 1..64
    python -m slimwise_train.bench train      # distillation step vs a naive two-copy step and the lower bound
    python -m slimwise_train.bench memory     # per-rank memory of the trainer on a saved checkpoint, per engine
    python -m slimwise_train.bench lm_eval    # lm-eval's slimwise model vs the eval app: same cells, wall-time ratio
    python -m slimwise_train.bench engine     # llama.cpp decode/prefill: full vs pruned, beside this machine's roofline

`memory` launches torchrun itself (2 ranks) and prints one JSON line per engine, then its targets.
"""

# One module per bench (calib, phase, loss, decode, train, memory: run_<name> and its private helpers), the shared timing,
# model and memory helpers in common, the BENCHES registry and the argument parsing in cli.

from slimwise_train.bench.cli import BENCHES, main

__all__ = ["BENCHES", "main"]

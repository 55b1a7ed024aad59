"""Side-by-side benchmarks: `python -m slimwise_train.bench <name>`; the usage is `cli.USAGE` (--help prints it)."""

# One module per bench (calib, phase, loss, decode, train, memory: run_<name> and its private helpers), the shared timing,
# model and memory helpers in common, the BENCHES registry and the argument parsing in cli.

from slimwise_train.bench.cli import BENCHES, USAGE, main

__all__ = ["BENCHES", "USAGE", "main"]

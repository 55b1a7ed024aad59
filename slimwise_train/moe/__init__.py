"""MoE mechanics, below every stage: per-family adapters, keep sets, phase-aware masking, physical pruning,
routing statistics and the prefill -> decode KV handoff. Nothing here knows about training or parallelism."""

"""slimwise_train: prune MoE experts for decode only.

Prefill runs with the full expert pool, decode with a pruned pool over the same KV cache,
either as one model with phase-aware router masking or as a physically pruned checkpoint.
"""

__version__ = "0.1.0"

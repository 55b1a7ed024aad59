"""Stage 1, scoring and pruning: statistics over a calibration set (statistics), saliency criteria and
keep-set selection (criteria), and the `python -m slimwise_train.prune` app (app)."""

"""`python -m slimwise_train.plan`: per-GPU memory of a distillation run, planned from the model's architecture.

The model is built on the meta device from its shipped config.json (offline); the project's adapter and student give
the frozen, trainable and expert parameters; docs/planning.md has the formulas and their calibration against
`python -m slimwise_train.bench memory`.
"""

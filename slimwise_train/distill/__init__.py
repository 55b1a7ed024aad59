"""Stage 3, distillation: the student (trainable always-on parts over the frozen model), batches with split
points, the top-k + residual KL loss, engines (torch / DeepSpeed: the only DeepSpeed import), checkpoints, export,
metrics, the Trainer, and the `python -m slimwise_train` app (app)."""

"""Stage 4, evaluation: batched generation in the five serving modes (generation), accuracy and
output-length metrics (metrics), reports and plots (report), and the `python -m slimwise_train.eval` app (app)."""

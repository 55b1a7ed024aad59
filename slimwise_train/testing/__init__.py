"""Helpers that build tiny random models of the stock transformers MoE classes (tests, benchmarks, demos)."""

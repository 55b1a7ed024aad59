"""`python -m slimwise_train.plan`: per-GPU memory of one distillation step, by component, before launching it.

    python -m slimwise_train.plan model=qwen3_moe_30b_a3b engine=zero3 world_size=8 data.seq_len=4096
    python -m slimwise_train.plan model=gpt_oss_20b engine=zero3 world_size=4 gpu_memory_gib=192 distill.recompute=moe
    python -m slimwise_train.plan model=bench_memory device=cpu world_size=2 engine=zero3 data.batch_size=2

Prints a table (per rank: frozen weights, trainable + grads + AdamW, DeepSpeed buckets, logits and loss scratch, KV
cache, activations, ZeRO-3 gathers, framework baseline; total; whether it fits gpu_memory_gib) and then one JSON line
(`json_only=true`: only the line). Nothing is downloaded and no weight is allocated: the model is built on the meta
device from model.architecture (the real presets ship their config.json), a tiny preset, or a local model.path.
"""

from __future__ import annotations

import json

from omegaconf import DictConfig

from slimwise_train.config import (
    CONF_DIR,
    PlanAppConfig,
    check_known_keys,
    register_configs,
)
from slimwise_train.utils.cli import hydra_app, user_errors


def run_plan(cfg) -> dict:
    """The plan as its JSON object, after printing the table (unless json_only) and the JSON line."""
    from slimwise_train.plan.memory import plan_from_config

    check_known_keys(cfg, PlanAppConfig)
    plan = plan_from_config(cfg)
    if not cfg.json_only:
        print(plan.table(), flush=True)
    line = plan.to_json()
    print(json.dumps(line), flush=True)
    return line


register_configs()


@hydra_app(CONF_DIR, "plan", "slimwise_train.plan", set_threads=False)
def main(cfg: DictConfig) -> None:
    with user_errors("slimwise_train.plan"):
        run_plan(cfg)

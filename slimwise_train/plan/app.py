"""`python -m slimwise_train.plan`: per-GPU memory of one distillation step, by component, before launching it.

    python -m slimwise_train.plan model=qwen3_moe_30b_a3b engine=zero3 world_size=8 data.seq_len=4096
    python -m slimwise_train.plan model=gpt_oss_20b engine=zero3 world_size=4 gpu_memory_gib=192 distill.memory.recompute=moe
    python -m slimwise_train.plan model=bench_memory device=cpu world_size=2 engine=zero3 data.batch_size=2

Prints a table (per rank: frozen weights, trainable + grads + AdamW, DeepSpeed buckets, logits and loss scratch, KV
cache, activations, ZeRO-3 gathers, framework baseline; total; whether it fits gpu_memory_gib), what a heavier
distill.memory.recompute would plan when it does not fit, then pruning's peaks (calibration whole vs layer by layer,
the streamed export: GPU and host, against gpu_memory_gib and host_memory_gib; plan/prune.py) and the mode that fits,
and writes the plan as JSON to <hydra run dir>/plan.json
(`json_only=true`: only the JSON, as one line on stdout). Nothing is downloaded and no weight is allocated: the model is built on the meta
device from model.architecture (the real presets ship their config.json), a tiny preset, or a local model.path.
"""

from __future__ import annotations

import json
from pathlib import Path

from omegaconf import DictConfig

from slimwise_train.config import (
    CONF_DIR,
    PlanAppConfig,
    check_known_keys,
    moved_key_message,
    register_configs,
)
from slimwise_train.utils.cli import hydra_app, user_errors


def run_plan(cfg, json_path: Path | None = None) -> dict:
    """The plan as its JSON object. Prints the table and, when it does not fit, what would (unless json_only: then
    only the JSON line); the JSON goes to `json_path` when given (the app: `<hydra run dir>/plan.json`)."""
    from slimwise_train.plan.memory import plan_from_config
    from slimwise_train.utils.atomic import write_json_atomic

    check_known_keys(cfg, PlanAppConfig)
    plan = plan_from_config(cfg)
    line = plan.to_json()
    if cfg.json_only:
        print(json.dumps(line), flush=True)
        return line
    print(plan.table(), flush=True)
    if not plan.fits:
        for suggestion in fitting_alternatives(cfg):
            print(suggestion, flush=True)
    from slimwise_train.plan.prune import prune_table

    print("\n" + prune_table(plan.prune, plan.device), flush=True)
    if json_path is not None:
        write_json_atomic(json_path, line)
        print(f"plan as JSON: {json_path} (json_only=true prints it as one line instead)", flush=True)
    return line


def fitting_alternatives(cfg) -> list[str]:
    """The same run under each heavier activation recompute (cheapest first), planned the same way, as lines to print:
    what a user whose plan does not fit tries first."""
    from omegaconf import OmegaConf

    from slimwise_train.plan.memory import plan_from_config

    order = ["none", "moe", "layer"]
    current = str(cfg.distill.memory.recompute)
    lines = []
    for mode in order[order.index(current) + 1:] if current in order else []:
        other = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
        other.distill.memory.recompute = mode
        alt = plan_from_config(other)
        verdict = "fits" if alt.fits else "does not fit either"
        lines.append(f"with distill.memory.recompute={mode}: {alt.total_bytes / 2**30:.1f} GiB per rank ({verdict})")
    if lines:
        lines.insert(0, "what would fit (recompute trades step time for activation memory; docs/planning.md):")
    return lines


register_configs()


@hydra_app(CONF_DIR, "plan", "slimwise_train.plan", set_threads=False, schema=PlanAppConfig,
           check=check_known_keys, moved=moved_key_message)
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    with user_errors("slimwise_train.plan"):
        run_plan(cfg, Path(HydraConfig.get().runtime.output_dir) / "plan.json")

"""The planner's README table: per-GPU GiB of the real presets on two clusters, ZeRO-3, recompute none vs moe.

    python scripts/plan_table.py                         # seq 4096, micro batch 1 (docs/planning.md)
    python scripts/plan_table.py --seq-len 2048 --models qwen3_moe_30b_a3b,gpt_oss_20b

Each cell is `python -m slimwise_train.plan model=<m> engine=zero3 world_size=<n> gpu_memory_gib=<g>
data.seq_len=<s> data.batch_size=<b> distill.memory.recompute=<r>`, run in-process (offline, seconds per model).
"""

from __future__ import annotations

import argparse

from hydra import compose, initialize_config_dir

from slimwise_train.config import CONF_DIR, register_configs
from slimwise_train.plan.memory import GIB, plan_from_config

MODELS = "qwen3_moe_30b_a3b,qwen3_5_moe_35b_a3b,gemma4_26b_a4b,gpt_oss_20b,deepseek_v3"
CLUSTERS = ((8, 80), (4, 192))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=MODELS)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--engine", default="zero3")
    args = parser.parse_args(argv)
    register_configs()
    header = ["model"] + [f"{n} x {g} GB, recompute={r}" for n, g in CLUSTERS for r in ("none", "moe")]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for model in args.models.split(","):
        cells = []
        for world, gib in CLUSTERS:
            for recompute in ("none", "moe"):
                with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
                    cfg = compose("plan", overrides=[f"model={model}", f"engine={args.engine}", f"world_size={world}",
                                                     f"gpu_memory_gib={gib}", f"data.seq_len={args.seq_len}",
                                                     f"data.batch_size={args.batch}",
                                                     f"distill.memory.recompute={recompute}"])
                plan = plan_from_config(cfg)
                cells.append(f"{plan.total_bytes / GIB:.1f} ({'yes' if plan.fits else 'no'})")
        print(f"| {model} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()

"""The planner's README table: per-GPU GiB of the real presets on two clusters, ZeRO-3, recompute none vs moe.

    python scripts/plan_table.py                         # seq 4096, micro batch 1 (docs/planning.md)
    python scripts/plan_table.py --seq-len 2048 --models qwen3_moe_30b_a3b,gpt_oss_20b
    python scripts/plan_table.py --prune --gpu-gib 80 --host-gib 256   # pruning: whole vs layerwise (docs/scale.md)

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
    parser.add_argument("--prune", action="store_true", help="the prune plan instead: calibration whole vs layer by "
                        "layer and the streamed export, with the presets' calibration data (1024 x 2048 tokens)")
    parser.add_argument("--gpu-gib", type=float, default=80.0)
    parser.add_argument("--host-gib", type=float, default=256.0)
    parser.add_argument("--gpus", type=int, default=8, help="GPUs model.device_map=auto spreads the model over")
    args = parser.parse_args(argv)
    register_configs()
    if args.prune:
        prune_table(args)
        return
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


def prune_table(args) -> None:
    print(f"| model | weights | whole, 1 GPU | whole, {args.gpus} GPUs (device_map) | layerwise GPU / host "
          f"(hidden states on host) | layerwise GPU / host (on device) | export (host) | mode that fits "
          f"{args.gpu_gib:g} GiB GPU + {args.host_gib:g} GiB host |")
    print("|---|---|---|---|---|---|---|---|")
    for model in args.models.split(","):
        with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
            cfg = compose("plan", overrides=[f"model={model}", f"world_size={args.gpus}", f"gpu_memory_gib={args.gpu_gib}",
                                             f"host_memory_gib={args.host_gib}"])
        prune = plan_from_config(cfg).prune
        cal, gib = prune["calibration"], lambda b: f"{b / GIB:.1f}"
        pair = lambda m: f"{gib(cal[m]['gpu_bytes'])} / {gib(cal[m]['host_bytes'])}"  # noqa: E731
        print(f"| {model} | {gib(prune['terms']['model_bytes'])} | {gib(cal['whole']['gpu_bytes'])} | "
              f"{gib(cal['whole_device_map']['gpu_bytes'])} | {pair('layerwise_hidden_on_host')} | "
              f"{pair('layerwise_hidden_on_device')} | {gib(prune['export_streamed']['host_bytes'])} | "
              f"{prune['use'] or 'none'} |", flush=True)


if __name__ == "__main__":
    main()

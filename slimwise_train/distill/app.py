"""`python -m slimwise_train` / `torchrun --nproc_per_node N -m slimwise_train`: distil the pruned decoder.

    python -m slimwise_train                                   # tiny Qwen3-MoE, engine=torch, < 1 min on CPU
    torchrun --nproc_per_node 2 -m slimwise_train engine=zero2
    torchrun --nproc_per_node 2 -m slimwise_train --multirun prune.ratio=0.25,0.5
    python -m slimwise_train --multirun hydra/launcher=slurm prune.ratio=0.25,0.5,0.75   # SLURM, docs/cluster.md
    python -m slimwise_train experiment=tiny_zero3_wandb

The config is conf/train.yaml (schema: slimwise_train.config.TrainAppConfig); the trainer is
slimwise_train.distill.trainer. The process group is created once per process (multirun jobs share it) and
destroyed by __main__ after the last job (in a submitit task, which runs one job, at the end of that job);
output folders are fixed per job so every rank agrees on them.
"""

from __future__ import annotations

import logging
import sys

from omegaconf import DictConfig

from slimwise_train.config import CONF_DIR, TrainAppConfig, check_known_keys, moved_key_message, register_configs
from slimwise_train.utils import distributed as du
from slimwise_train.utils.cli import hydra_app, user_errors
from slimwise_train.utils.rundir import die_with_launcher

log = logging.getLogger("slimwise.train")

register_configs()


def _quiet_other_ranks() -> None:
    # Hydra configures logging per job on every rank: keep one log file and one console stream (rank 0's).
    if du.is_rank0():
        return
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, logging.FileHandler):
            root.removeHandler(handler)
    root.setLevel(logging.WARNING)


@hydra_app(CONF_DIR, "train", "slimwise_train", schema=TrainAppConfig, check=check_known_keys,
           moved=moved_key_message, interrupted="the checkpoints written so far stay; rerun the same command "
                                                "(resume=auto) to continue from the newest")
def main(cfg: DictConfig) -> None:
    from slimwise_train.distill.trainer import NonFiniteLossError, run_train

    die_with_launcher()
    with du.job_process_group(cfg.engine.backend):  # torchrun, or a submitit / srun task (docs/cluster.md)
        _quiet_other_ranks()
        try:
            with user_errors("slimwise_train"):
                run_train(cfg)
        except NonFiniteLossError as exc:
            print(f"slimwise_train: error: {exc}", file=sys.stderr)
            raise SystemExit(3) from None

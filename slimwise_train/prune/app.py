"""`python -m slimwise_train.prune`: score experts on a calibration set and write keep sets.

    python -m slimwise_train.prune model=tiny_qwen3_moe prune.criterion=reap prune.ratio=0.5
    python -m slimwise_train.prune --multirun prune.ratio=0.25,0.5,0.75 prune.criterion=mass,ean,reap
    torchrun --nproc_per_node 2 -m slimwise_train.prune ...     # each rank scores a shard, sums all-reduced

Writes into output_dir (each file atomically, only after everything is computed):
  scores.safetensors    raw float64 statistics + every criterion's [layers, experts] scores + metadata
  keep_set.json         kept experts per layer
  router_mask.safetensors   per layer a [E] 0/-inf logit bias for co-located (phase-aware) serving
  pruned/               physically pruned HF checkpoint for a decode instance (prune.export_checkpoint=true)
  prune_summary.json    what was done, where the statistics came from, kept mass per layer
Statistics are cached under prune.cache_dir keyed by model + calibration data, so a sweep over ratios and
criteria calibrates once.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from slimwise_train.config import CONF_DIR, PruneAppConfig, check_known_keys, register_configs
from slimwise_train.utils import distributed as du
from slimwise_train.utils.cli import hydra_app, user_errors
from slimwise_train.utils.rundir import (check_outputs_spare_inputs, check_writable, claim_output_dir,
                                         die_with_launcher)

log = logging.getLogger("slimwise.prune")
# what _write_outputs writes into output_dir (pruned/ is replaced whole)
OUTPUTS = ("pruned", "scores.safetensors", "keep_set.json", "router_mask.safetensors", "prune_config.yaml",
           "prune_summary.json")


def router_mask_tensors(keep_set) -> dict[str, torch.Tensor]:
    tensors = {}
    for lk in keep_set:
        bias = torch.zeros(lk.num_experts, dtype=torch.float32)
        bias[list(lk.removed)] = float("-inf")
        tensors[f"layers.{lk.layer}.router_logit_bias"] = bias
        tensors[f"layers.{lk.layer}.kept"] = torch.tensor(lk.kept, dtype=torch.int64)
    return tensors


def run_prune(cfg) -> dict:
    """The whole prune job; returns the summary. Importable for tests and notebooks."""
    from slimwise_train.models import load_model, resolve_path
    from slimwise_train.moe.adapters import get_adapter
    from slimwise_train.moe.keepset_rules import check_exportable, check_fits
    from slimwise_train.prune.criteria import validate_prune_config
    from slimwise_train.prune.scoring import score_keep_set

    check_known_keys(cfg, PruneAppConfig)
    validate_prune_config(cfg.prune)
    if cfg.prune.keep_set:
        raise ValueError(f"prune.keep_set={cfg.prune.keep_set} is what the trainer and eval read; the prune app "
                         "scores a new keep set: drop prune.keep_set (or pass it to python -m slimwise_train / eval)")
    check_writable(Path(cfg.output_dir), create=False)
    out = Path(cfg.output_dir)
    check_outputs_spare_inputs({name: out / name for name in OUTPUTS},
                               {"model.path": resolve_path(cfg.model.path),
                                "model.tokenizer": resolve_path(cfg.model.tokenizer), "data.source": cfg.data.source})
    checkpoint = None
    if cfg.prune.calibration.mode == "layerwise":  # the model stays in its files: a meta-device skeleton
        from slimwise_train.models import resolve_device
        from slimwise_train.prune.layerwise import open_checkpoint

        checkpoint, tokenizer = open_checkpoint(cfg.model, resolve_device(cfg.device))
        model = checkpoint.model
    else:
        model, tokenizer = load_model(cfg.model, cfg.device)
    adapter = get_adapter(model)
    keep_set, stats, stats_meta, fingerprint = score_keep_set(model, tokenizer, cfg, checkpoint=checkpoint)
    meta = keep_set.meta
    where = f"the keep set scored with prune.scope={cfg.prune.scope}"
    check_fits(keep_set, model, where)
    if cfg.prune.export_checkpoint:
        check_exportable(keep_set, model.config, where, "prune.export_checkpoint")
    mass = stats.mass_all
    kept_mass = [float(mass[i, list(lk.kept)].sum() / mass[i].sum()) if mass[i].sum() > 0 else 0.0
                 for i, lk in enumerate(keep_set)]
    summary = {
        **meta,
        "family": adapter.family,
        "num_kept": list(keep_set.num_kept),
        "kept_routing_mass": kept_mass,
        "calibration_tokens": int(stats.num_tokens[0].item()),
        "world_size": du.world_size(),
        "calibration_mode": str(cfg.prune.calibration.mode),
    }
    if du.is_rank0():
        with claim_output_dir(cfg.output_dir) as out:
            _write_outputs(cfg, out, model, tokenizer, keep_set, stats, stats_meta, fingerprint, summary, checkpoint)
    du.barrier()
    return summary


def _write_outputs(cfg, out: Path, model, tokenizer, keep_set, stats, stats_meta, fingerprint, summary,
                   checkpoint=None) -> None:
    from safetensors.torch import save_file

    from slimwise_train.moe.pruning import export_pruned, export_pruned_from_checkpoint
    from slimwise_train.prune.statistics import save_scores
    from slimwise_train.utils.atomic import atomic_path, write_json_atomic, write_text_atomic

    if cfg.prune.export_checkpoint and checkpoint is not None:  # layerwise: streamed from the files, a layer at a time
        export_pruned_from_checkpoint(checkpoint, keep_set, out / "pruned", tokenizer=tokenizer, overwrite=True,
                                      progress=cfg.progress)
    elif cfg.prune.export_checkpoint:
        export_pruned(model, keep_set, out / "pruned", tokenizer=tokenizer, overwrite=True)
    save_scores(out / "scores.safetensors", stats, {**stats_meta, "model": fingerprint})
    keep_set.save(out / "keep_set.json")
    if cfg.prune.export_mask:
        with atomic_path(out / "router_mask.safetensors") as tmp:
            save_file(router_mask_tensors(keep_set), str(tmp),
                      metadata={"format": "slimwise-router-mask/1", "model": json.dumps(fingerprint, sort_keys=True)})
    write_text_atomic(out / "prune_config.yaml", OmegaConf.to_yaml(cfg))
    write_json_atomic(out / "prune_summary.json", summary)
    log.info("kept %s experts per layer (%s, ratio %s) -> %s", list(keep_set.num_kept), cfg.prune.criterion,
             cfg.prune.ratio, out)


register_configs()


@hydra_app(CONF_DIR, "prune", "slimwise_train.prune", schema=PruneAppConfig, check=check_known_keys,
           interrupted="nothing was written (prune writes its outputs at the end; statistics already cached stay)")
def main(cfg: DictConfig) -> None:
    die_with_launcher()
    with du.job_process_group(), user_errors("slimwise_train.prune"):
        run_prune(cfg)


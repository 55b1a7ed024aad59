"""The prune stage's scoring: the one sequence that turns a model and a calibration set into a keep set, run by the
prune app and by the trainer when it scores its own keep set (prune.keep_set=null)."""

from __future__ import annotations

import contextlib
from typing import Any, NamedTuple

from slimwise_train.utils import distributed as du


class Scored(NamedTuple):
    """What `score_keep_set` computed: the keep set (its meta included), the statistics, their metadata and the
    model's fingerprint (what the prune app writes beside the keep set)."""

    keep_set: Any
    stats: Any
    stats_meta: dict
    fingerprint: dict


def score_keep_set(model, tokenizer, cfg, *, data_key: str = "data", loading=None, checkpoint=None) -> Scored:
    """The prune stage's scoring, the one sequence the prune app and the trainer (prune.keep_set=null) both run: the
    ratio checked against the model before any calibration, the weight fingerprint, the statistics (a scores file, the
    cache or a calibration on `cfg.data`), the criterion's [L, E] scores, `keep_set_from_scores`.

    cfg: `prune`, `data` (the calibration set; `data_key` names it in errors: the trainer's is `calibration`),
    `model` and `progress`. loading: engine=zero3's partitioned loading (`.gathered`, `.gathered_inference`), whose
    parameters are gathered for the fingerprint and around each module's forward; None: the model is whole.
    checkpoint: prune.calibration.mode=layerwise, the `LazyCheckpoint` behind `model` (its meta-device skeleton),
    read one decoder layer at a time for the fingerprint and the calibration (prune/layerwise.py)."""
    from slimwise_train.models import model_weights
    from slimwise_train.moe.adapters import get_adapter
    from slimwise_train.moe.keepset_rules import provenance
    from slimwise_train.prune.criteria import get_criterion, keep_set_from_scores, validate_prune_config
    from slimwise_train.prune.statistics import compute_or_load_statistics, model_fingerprint

    validate_prune_config(cfg.prune)
    calibration = cfg.prune.get("calibration")  # absent from configs saved before it existed
    layerwise = calibration is not None and calibration.mode == "layerwise"
    if layerwise and checkpoint is None:
        raise ValueError("prune.calibration.mode=layerwise is the prune app's (python -m slimwise_train.prune): the "
                         "trainer scores the model it holds; drop it, or prune first and pass prune.keep_set")
    adapter = get_adapter(model)
    keep_set_from_scores(model, None, cfg.prune.ratio, cfg.prune.scope, adapter=adapter)  # a bad ratio fails here
    collector = None
    if layerwise:
        from slimwise_train.prune.layerwise import layerwise_collector, streamed_weights_digest

        digest = streamed_weights_digest(checkpoint, cfg.prune.cache_dir, cfg.progress) if du.is_rank0() else None
        fingerprint = model_fingerprint(model, adapter, digest=du.broadcast_object(digest))
        collector = layerwise_collector(checkpoint, cfg)
    else:
        fingerprint = model_fingerprint(model, adapter, gather=loading.gathered if loading else None)
    with loading.gathered_inference(model) if loading else contextlib.nullcontext():
        stats, stats_meta, source = compute_or_load_statistics(model, tokenizer, cfg, fingerprint, data_key=data_key,
                                                               collector=collector)
    du.barrier()  # rank 0 has written the statistics cache: a next job (a sweep) sees it on every rank
    # meta.model and meta.weights: what the keep-set rules compare a later run's model with (moe/keepset_rules.py);
    # rank 0 reads the weight files, once, for every rank
    weights = du.broadcast_object(provenance(model_weights(cfg.model)) if du.is_rank0() else None)
    meta = {"criterion": cfg.prune.criterion, "ratio": cfg.prune.ratio, "scope": cfg.prune.scope, **weights,
            "statistics": source}
    keep_set = keep_set_from_scores(model, get_criterion(cfg.prune.criterion)(stats), cfg.prune.ratio,
                                    cfg.prune.scope, adapter=adapter, meta=meta)
    return Scored(keep_set, stats, stats_meta, fingerprint)

"""Expert statistics over a calibration set: accumulation, scores files, the cache key and the cache.

Shape legend: L MoE layers, E experts per layer, T tokens, K experts per token.

`ExpertStatistics` accumulates, in float64 and over valid (non-padding) calibration tokens only:

    num_tokens            scalar   tokens seen per layer
    frequency    [L, E]   n_j      = #{x : j in topk(x)}
    mass_all     [L, E]   sum_x p_j(x)                  over all tokens
    mass_routed  [L, E]   sum_{x : j in topk(x)} p_j(x) over tokens routed to j
    gate_sum     [L, E]   sum_{x : j in topk(x)} g_j(x)
    ean_sum      [L, E]   sum_{x : j in topk(x)} ||f_j(x)||_2
    reap_sum     [L, E]   sum_{x : j in topk(x)} g_j(x) * ||f_j(x)||_2

where p_j is the router probability over all experts (softmax of the logits; sigmoid affinity for
DeepSeek-V3; Gemma 4's router output), g_j the model's own routing weight after its normalisation and
scaling (what multiplies f_j in the forward), and f_j the expert's unweighted output.

Criteria (slimwise_train.prune.criteria) are pure functions of those sums, registered by name; `ExpertStatistics`
itself is defined there (below this module, which writes every criterion's scores) and importable from here.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
from pathlib import Path
from typing import Iterable

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from slimwise_train.config import to_container
# ExpertStatistics and SUM_FIELDS live in criteria (the lower module: the criteria are functions of it); importable
# from here as before.
from slimwise_train.prune.criteria import CRITERIA, SUM_FIELDS, ExpertStatistics  # noqa: F401
from slimwise_train.utils import distributed as du
from slimwise_train.utils.atomic import atomic_path
from slimwise_train.utils.hf import text_config

log = logging.getLogger("slimwise.prune")

STATS_FORMAT = "slimwise-expert-stats/1"


# --------------------------------------------------------------------------- scores files


def save_scores(path, stats: ExpertStatistics, meta: dict) -> None:
    """Write statistics + every criterion's [L, E] scores to one safetensors file, atomically."""
    tensors = stats.tensors()
    for name, fn in CRITERIA.items():
        tensors[f"score.{name}"] = fn(stats).contiguous()
    full_meta = {
        "format": STATS_FORMAT,
        "layer_indices": list(stats.layer_indices),
        "num_experts": stats.num_experts,
        "top_k": stats.top_k,
        **meta,
    }
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={"slimwise": json.dumps(full_meta, sort_keys=True)})


def load_scores(path) -> tuple[ExpertStatistics, dict]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as handle:
        raw = (handle.metadata() or {}).get("slimwise")
    if raw is None:
        raise ValueError(f"{path} is not a slimwise scores file (no 'slimwise' metadata)")
    meta = json.loads(raw)
    if meta.get("format") != STATS_FORMAT:
        raise ValueError(f"{path}: unsupported scores format {meta.get('format')!r}, expected {STATS_FORMAT!r}")
    try:
        return ExpertStatistics.from_tensors(load_file(str(path)), meta), meta
    except KeyError as exc:  # a file of the right format with an entry missing: bad input, not a bug
        raise ValueError(f"{path}: incomplete scores file (no {exc}); score again (python -m slimwise_train.prune)") \
            from None


def weights_digest(model, gather=None, named_tensors=None) -> str:
    """sha256 over every parameter and buffer (names, dtypes, shapes, raw bytes) in state-dict order.

    Every weight can change the statistics: attention and embeddings shape the hidden states the routers see,
    experts their output norms (EAN, REAP). Hashing routers only gave a fine-tune with frozen routers, or a merged
    LoRA, another model's cached scores. named_tensors: the (name, tensor) pairs of that order from elsewhere (the
    layer-by-layer path reads them from the checkpoint one layer at a time: prune/layerwise.py).
    """
    digest = hashlib.sha256()
    for name, tensor in named_tensors if named_tensors is not None else model.state_dict(keep_vars=True).items():
        # `gather` (partitioned ZeRO-3 weights): the full tensor, one at a time, in the same order on every rank.
        with gather([tensor]) if gather is not None else contextlib.nullcontext():
            data = tensor.detach()
            digest.update(f"{name}|{data.dtype}|{tuple(data.shape)}\n".encode())
            digest.update(data.contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes())
    return digest.hexdigest()


def model_fingerprint(model, adapter, gather=None, digest: str | None = None) -> dict:
    """Identity of a model for scores files: family, MoE layout and a hash of all its weights (`digest`: that hash,
    computed elsewhere)."""
    layers = adapter.moe_layers(model)
    config = text_config(model)
    return {
        "family": adapter.family,
        "model_type": model.config.model_type,
        "moe_layers": [m.layer_index for m in layers],
        "num_experts": [m.num_experts for m in layers],
        "top_k": layers[0].top_k,
        "hidden_size": getattr(config, "hidden_size", None),
        "weights_sha256": digest if digest is not None else weights_digest(model, gather),
    }


def collect_statistics(model, batches: Iterable[dict], progress: bool = True, total: int | None = None,
                       num_forwards: int | None = None) -> ExpertStatistics:
    """Run `model` over `batches` (dicts with input_ids, attention_mask) and accumulate statistics.

    Under torch.distributed each rank should pass its own shard; the result is all-reduced. `num_forwards`: run at
    least this many forwards, repeating the last batch with every token masked out of the statistics, so that ranks
    with one batch fewer still join every collective of a partitioned (ZeRO-3) forward.
    """
    from tqdm.auto import tqdm

    from slimwise_train.moe.adapters import get_adapter
    from slimwise_train.moe.stats import ExpertStatsRecorder

    adapter = get_adapter(model)
    layers = adapter.moe_layers(model)
    stats = ExpertStatistics.empty([m.layer_index for m in layers], layers[0].num_experts, layers[0].top_k)
    device = next(model.parameters()).device
    rank0 = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    with torch.no_grad(), ExpertStatsRecorder(model, stats.update) as recorder:

        def forward(batch: dict, counted: bool) -> None:
            mask = batch["attention_mask"].to(device)
            recorder.token_mask = mask.bool().reshape(-1) & counted
            # Scoring needs the routers, not the vocabulary: one position of logits instead of [B, S, V].
            model(input_ids=batch["input_ids"].to(device), attention_mask=mask, use_cache=False, logits_to_keep=1)

        done, batch = 0, None
        for batch in tqdm(batches, total=total, desc="scoring experts", disable=not (progress and rank0), unit="batch"):
            forward(batch, counted=True)
            done += 1
        for _ in range(max(0, (num_forwards or 0) - done) if batch is not None else 0):
            forward(batch, counted=False)
    stats.all_reduce()
    return stats


def statistics_key(fingerprint: dict, data_cfg, tokenizer) -> str:
    data = {k: data_cfg[k] for k in ("source", "split", "subset", "text_field", "num_samples", "seq_len",
                                     "chat_template", "seed", "shuffle", "bad_rows")}
    from slimwise_train.data.loading import RENDERING_VERSION, source_digest, template_of, uses_template

    data["source_digest"] = source_digest(str(data_cfg["source"]))  # an edited recipe or local file: recompute
    # how rows become tokens: the code's version and the chat template's text (an edited template: recompute)
    template = template_of(tokenizer) if uses_template(tokenizer, data_cfg["chat_template"]) else None
    data["rendering"] = [RENDERING_VERSION, hashlib.sha256(template.encode()).hexdigest()[:16] if template else None]
    payload = {"model": fingerprint, "data": data, "tokenizer": [type(tokenizer).__name__, len(tokenizer)]}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:24]


def check_enough_tokens(num_tokens: int, minimum: int, where: str) -> None:
    if num_tokens < minimum:
        raise ValueError(
            f"{where}: {num_tokens} real calibration tokens, fewer than prune.min_calibration_tokens={minimum}; "
            "raise data.num_samples or data.seq_len (or lower prune.min_calibration_tokens)"
        )


def compute_or_load_statistics(model, tokenizer, cfg, fingerprint: dict, data_key: str = "data", collector=None):
    """(ExpertStatistics, metadata, source) where source is 'file', 'cache' or 'computed'. collector(batches, key,
    **collect_statistics' keywords): what runs the calibration (default: `collect_statistics` on `model`; the
    layer-by-layer path passes its own, which keys its resume points by the statistics key)."""
    stats, meta, source = _compute_or_load_statistics(model, tokenizer, cfg, fingerprint, data_key, collector)
    num_tokens = int(stats.num_tokens[0].item())
    check_enough_tokens(num_tokens, int(cfg.prune.min_calibration_tokens),
                        f"statistics ({source}{': ' + str(cfg.prune.scores) if source == 'file' else ''})")
    if du.is_rank0():  # all-reduced: the same count on every rank
        log.info("statistics (%s): %d real calibration tokens", source, num_tokens)
    return stats, meta, source


def _compute_or_load_statistics(model, tokenizer, cfg, fingerprint: dict, data_key: str, collector=None):
    from slimwise_train.data.loading import calibration_batches, check_seq_len, encode_all, load_pairs, num_batches

    if cfg.prune.scores:
        stats, meta = load_scores(cfg.prune.scores)
        check_same_model(meta.get("model", {}), fingerprint, cfg.prune.scores)
        return stats, meta, "file"
    check_seq_len(cfg.data, model)
    key = statistics_key(fingerprint, cfg.data, tokenizer)
    cache_file = Path(cfg.prune.cache_dir) / f"{key}.safetensors"
    # Rank 0 decides for all: a concurrent job (a submitit sweep runs its jobs at once) may write the cache between
    # two ranks' checks, and a rank that loads it while another calibrates deadlocks the calibration's collectives.
    if du.broadcast_object(bool(cfg.prune.use_cache and cache_file.is_file())):
        stats, meta = load_scores(cache_file)
        check_same_model(meta.get("model", {}), fingerprint, cache_file)
        log.info("statistics: cache hit %s", cache_file)
        return stats, meta, "cache"
    pairs = load_pairs(cfg.data, key=data_key)  # errors name the user's key (the trainer's is `calibration`)
    encoded = encode_all(tokenizer, pairs, cfg.data, find_turns=False, key=data_key)  # every token is scored
    # Refuse before the forward passes, not after: the count is known from the token ids.
    check_enough_tokens(sum(len(sequence[0]) for sequence in encoded), int(cfg.prune.min_calibration_tokens),
                        f"calibration data {cfg.data.source!r}")
    rank, world = du.rank(), du.world_size()
    if len(encoded) < world:
        raise ValueError(f"calibration set has {len(encoded)} sequences for {world} ranks; raise data.num_samples")
    log.info("statistics: calibrating on %d sequences (%d real tokens) across %d rank(s)", len(encoded),
             sum(len(e[0]) for e in encoded), world)
    batches = calibration_batches(encoded, cfg.data.batch_size, tokenizer.pad_token_id, rank, world)
    collect = collector or (lambda batches, key, **kw: collect_statistics(model, batches, **kw))
    stats = collect(batches, key, progress=cfg.progress,
                    total=num_batches(len(encoded), cfg.data.batch_size, rank, world),
                    num_forwards=num_batches(len(encoded), cfg.data.batch_size, 0, world))
    meta = {
        "model": fingerprint,
        "calibration": {**to_container(cfg.data), "num_sequences": len(encoded),
                        "num_tokens": int(stats.num_tokens[0].item())},
    }
    if cfg.prune.use_cache and du.is_rank0():
        save_scores(cache_file, stats, meta)
    return stats, {**meta, "layer_indices": list(stats.layer_indices)}, "computed"


def check_same_model(recorded: dict, fingerprint: dict, where) -> None:
    if recorded != fingerprint:
        differing = sorted(k for k in set(recorded) | set(fingerprint) if recorded.get(k) != fingerprint.get(k))
        raise ValueError(
            f"scores file {where} was computed on another model (differs in {', '.join(differing)}); "
            "re-run scoring on this model or drop prune.scores"
        )

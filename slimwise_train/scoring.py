"""Expert statistics, saliency criteria and keep-set selection.

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

Criteria are pure functions of those sums, registered by name; higher score = more worth keeping.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from slimwise_train.stats import RoutingRecord
from slimwise_train.utils.atomic import atomic_path

SUM_FIELDS = ("frequency", "mass_all", "mass_routed", "gate_sum", "ean_sum", "reap_sum")
STATS_FORMAT = "slimwise-expert-stats/1"


@dataclass
class ExpertStatistics:
    layer_indices: tuple[int, ...]
    num_experts: int
    top_k: int
    num_tokens: torch.Tensor  # [L] float64
    frequency: torch.Tensor
    mass_all: torch.Tensor
    mass_routed: torch.Tensor
    gate_sum: torch.Tensor
    ean_sum: torch.Tensor
    reap_sum: torch.Tensor

    @classmethod
    def empty(cls, layer_indices, num_experts: int, top_k: int) -> "ExpertStatistics":
        n = len(layer_indices)
        zeros = lambda: torch.zeros(n, num_experts, dtype=torch.float64)  # noqa: E731
        return cls(tuple(layer_indices), num_experts, top_k, torch.zeros(n, dtype=torch.float64),
                   *(zeros() for _ in SUM_FIELDS))

    def update(self, record: RoutingRecord) -> None:
        """Add one layer's routing for one batch (padding excluded via `record.token_mask`)."""
        row = self.layer_indices.index(record.layer_index)
        index, weight, norm, probs = record.top_k_index, record.top_k_weight, record.output_norm, record.probs
        if record.token_mask is not None:
            keep = record.token_mask.to(index.device).bool()
            index, weight, norm, probs = index[keep], weight[keep], norm[keep], probs[keep]
        index = index.reshape(-1).cpu()
        weight = weight.reshape(-1).double().cpu()
        norm = norm.reshape(-1).double().cpu()
        probs = probs.double().cpu()
        routed_probs = probs.gather(1, index.view(probs.shape[0], self.top_k))
        self.num_tokens[row] += probs.shape[0]
        self.frequency[row].index_add_(0, index, torch.ones_like(weight))
        self.mass_all[row] += probs.sum(0)
        self.mass_routed[row].index_add_(0, index, routed_probs.reshape(-1))
        self.gate_sum[row].index_add_(0, index, weight)
        self.ean_sum[row].index_add_(0, index, norm)
        self.reap_sum[row].index_add_(0, index, weight * norm)

    def all_reduce(self) -> None:
        """Sum the statistics of every rank (each scored its own shard of the calibration set)."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return
        packed = torch.cat([self.num_tokens.view(-1, 1)] + [getattr(self, f) for f in SUM_FIELDS], dim=1)
        # gloo and NCCL both reduce float64; a fixed packing keeps one collective per call.
        dist.all_reduce(packed, op=dist.ReduceOp.SUM)
        self.num_tokens = packed[:, 0].clone()
        for i, name in enumerate(SUM_FIELDS):
            setattr(self, name, packed[:, 1 + i * self.num_experts : 1 + (i + 1) * self.num_experts].clone())

    # ------------------------------------------------------------------ IO
    def tensors(self) -> dict[str, torch.Tensor]:
        out = {f"stats.{name}": getattr(self, name).contiguous() for name in SUM_FIELDS}
        out["stats.num_tokens"] = self.num_tokens.contiguous()
        return out

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], meta: dict) -> "ExpertStatistics":
        return cls(
            tuple(meta["layer_indices"]), int(meta["num_experts"]), int(meta["top_k"]), tensors["stats.num_tokens"],
            *(tensors[f"stats.{name}"] for name in SUM_FIELDS),
        )


# --------------------------------------------------------------------------- criteria


def frequency(stats: ExpertStatistics) -> torch.Tensor:
    """[L, E]: n_j, the number of calibration tokens routed to expert j."""
    return stats.frequency.clone()


def routing_mass(stats: ExpertStatistics) -> torch.Tensor:
    """[L, E]: sum over ALL calibration tokens of p_j(x), the router probability of j (routed or not)."""
    return stats.mass_all.clone()


def routing_mass_routed(stats: ExpertStatistics) -> torch.Tensor:
    """[L, E]: sum over the tokens ROUTED to j of p_j(x) (the REAP codebase's weighted frequency)."""
    return stats.mass_routed.clone()


def ean(stats: ExpertStatistics) -> torch.Tensor:
    """[L, E]: EAN_j = sum over tokens routed to j of ||f_j(x)||_2 (unweighted expert output norm)."""
    return stats.ean_sum.clone()


def reap(stats: ExpertStatistics) -> torch.Tensor:
    """[L, E]: REAP_j = (1/n_j) sum over tokens routed to j of g_j(x) ||f_j(x)||_2; 0 for never-routed experts."""
    return torch.where(stats.frequency > 0, stats.reap_sum / stats.frequency.clamp(min=1), torch.zeros_like(stats.reap_sum))


CRITERIA: dict[str, Callable[[ExpertStatistics], torch.Tensor]] = {
    "frequency": frequency,
    "mass": routing_mass,
    "mass_routed": routing_mass_routed,
    "ean": ean,
    "reap": reap,
}


def get_criterion(name: str) -> Callable[[ExpertStatistics], torch.Tensor]:
    if name not in CRITERIA:
        raise ValueError(f"unknown criterion {name!r}; choose one of: {', '.join(CRITERIA)}")
    return CRITERIA[name]


# --------------------------------------------------------------------------- selection


def rank_experts(scores: torch.Tensor) -> torch.Tensor:
    """[E] scores -> [E] expert indices, best first; ties go to the lower index (deterministic)."""
    # A stable sort of -score keeps index order among equal scores on every platform.
    return torch.sort(-scores.double(), stable=True).indices


def num_to_keep(num_experts: int, ratio: float) -> int:
    return num_experts - int(math.floor(num_experts * ratio + 1e-9))


def select_keep(
    scores: torch.Tensor,
    ratio: float,
    top_k: int,
    scope: str = "layer",
    num_groups: int = 1,
) -> list[list[int]]:
    """[L, E] scores -> kept expert indices per layer (sorted).

    scope="layer": every layer drops floor(E * ratio) experts (uniform counts).
    scope="global": one ranking over all layers keeps the same total, but a layer never keeps fewer than
    top_k experts (its best top_k are reserved first). Raw scores are compared across layers, so use it
    with criteria on a common scale (frequency, mass).
    num_groups > 1 (DeepSeek-V3 group-limited routing): each group keeps the same number of experts.
    """
    if not 0.0 < ratio < 1.0:
        raise ValueError(f"prune.ratio must be in (0, 1), got {ratio}")
    num_layers, num_experts = scores.shape
    keep = num_to_keep(num_experts, ratio)
    if keep < top_k:
        raise ValueError(
            f"pruning ratio {ratio} keeps {keep} of {num_experts} experts per layer, fewer than the router's "
            f"top-{top_k}; use prune.ratio <= {1 - top_k / num_experts:.4g}"
        )
    if scope == "layer":
        if num_groups > 1:
            if num_experts % num_groups or keep % num_groups or keep // num_groups < 2:
                raise ValueError(
                    f"{num_groups} expert groups: the {keep} kept experts per layer must split evenly with >= 2 "
                    "per group; pick another ratio"
                )
            per_group, size = keep // num_groups, num_experts // num_groups
            return [
                sorted(int(g * size + j) for g in range(num_groups) for j in rank_experts(scores[l, g * size:(g + 1) * size])[:per_group])
                for l in range(num_layers)
            ]
        return [sorted(int(j) for j in rank_experts(scores[l])[:keep]) for l in range(num_layers)]
    if scope == "global":
        if num_groups > 1:
            raise ValueError("prune.scope=global cannot keep expert groups balanced; use prune.scope=layer")
        total = keep * num_layers
        kept = [set(int(j) for j in rank_experts(scores[l])[:top_k]) for l in range(num_layers)]
        flat = scores.double().reshape(-1)
        order = torch.sort(-flat, stable=True).indices
        remaining = total - sum(len(k) for k in kept)
        for pos in order.tolist():
            if remaining == 0:
                break
            l, j = divmod(pos, num_experts)
            if j not in kept[l]:
                kept[l].add(j)
                remaining -= 1
        return [sorted(k) for k in kept]
    raise ValueError(f"unknown prune.scope {scope!r}; use 'layer' or 'global'")


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
    return ExpertStatistics.from_tensors(load_file(str(path)), meta), meta


def model_fingerprint(model, adapter) -> dict:
    """Identity of a model for scores files: family, MoE layout and a hash of every router's weights."""
    digest = hashlib.sha256()
    layers = adapter.moe_layers(model)
    for moe in layers:
        for tensor in moe.router.parameters():
            digest.update(tensor.detach().float().cpu().numpy().tobytes())
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return {
        "family": adapter.family,
        "model_type": model.config.model_type,
        "moe_layers": [m.layer_index for m in layers],
        "num_experts": [m.num_experts for m in layers],
        "top_k": layers[0].top_k,
        "hidden_size": getattr(config, "hidden_size", None),
        "router_sha256": digest.hexdigest(),
    }


def collect_statistics(model, batches: Iterable[dict], progress: bool = True, total: int | None = None) -> ExpertStatistics:
    """Run `model` over `batches` (dicts with input_ids, attention_mask) and accumulate statistics.

    Under torch.distributed each rank should pass its own shard; the result is all-reduced.
    """
    from tqdm.auto import tqdm

    from slimwise_train.adapters import get_adapter
    from slimwise_train.stats import ExpertStatsRecorder

    adapter = get_adapter(model)
    layers = adapter.moe_layers(model)
    stats = ExpertStatistics.empty([m.layer_index for m in layers], layers[0].num_experts, layers[0].top_k)
    device = next(model.parameters()).device
    rank0 = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    with torch.no_grad(), ExpertStatsRecorder(model, stats.update) as recorder:
        for batch in tqdm(batches, total=total, desc="scoring experts", disable=not (progress and rank0), unit="batch"):
            input_ids = batch["input_ids"].to(device)
            mask = batch["attention_mask"].to(device)
            recorder.token_mask = mask.bool().reshape(-1)
            model(input_ids=input_ids, attention_mask=mask, use_cache=False)
    stats.all_reduce()
    return stats

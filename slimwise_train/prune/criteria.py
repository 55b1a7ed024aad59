"""Saliency criteria and keep-set selection: pure functions of `ExpertStatistics`, picked by name.

Shape legend: L MoE layers, E experts per layer. Every criterion maps the float64 sums of `ExpertStatistics`
(defined here, collected by `slimwise_train.prune.statistics`) to [L, E] scores; higher = more worth keeping.
`select_keep` turns scores into kept indices; `keep_set_from_scores` into a model's `KeepSet` (the one function the
prune app, the trainer and the planner use).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist


if TYPE_CHECKING:
    from slimwise_train.moe.stats import RoutingRecord


# --------------------------------------------------------------------------- the statistics the criteria read

# The float64 sums (legend: slimwise_train.prune.statistics, which collects them, saves and loads them; defined here,
# below it, so that the criteria and the scores files need no import cycle).
SUM_FIELDS = ("frequency", "mass_all", "mass_routed", "gate_sum", "ean_sum", "reap_sum")


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


def validate_prune_config(prune_cfg) -> None:
    """prune.ratio's range, prune.criterion (a name in CRITERIA) and prune.calibration's layerwise-only keys;
    prune.scope and the calibration mode are the schema's Literal fields (check_known_keys)."""
    if not 0.0 < float(prune_cfg.ratio) < 1.0:
        raise ValueError(f"prune.ratio must be in (0, 1), got {prune_cfg.ratio}; e.g. prune.ratio=0.5 removes half")
    get_criterion(prune_cfg.criterion)
    calibration = prune_cfg.get("calibration") if hasattr(prune_cfg, "get") else getattr(prune_cfg, "calibration", None)
    if calibration is not None:
        if int(calibration.resume_every) < 0:
            raise ValueError(f"prune.calibration.resume_every={calibration.resume_every}: use a number of layers, or "
                             "0 for no resume points")
        if calibration.mode != "layerwise" and calibration.hidden_states != "cpu":
            raise ValueError("prune.calibration.hidden_states applies to prune.calibration.mode=layerwise; set that "
                             "mode or drop the key")



# --------------------------------------------------------------------------- criteria


def frequency(stats: ExpertStatistics) -> torch.Tensor:
    """[L, E]: n_j, the number of calibration tokens routed to expert j."""
    return stats.frequency.clone()


def routing_mass(stats: ExpertStatistics) -> torch.Tensor:
    """[L, E]: sum over ALL calibration tokens of p_j(x), the router probability of j (routed or not)."""
    return stats.mass_all.clone()


def routing_mass_routed(stats: ExpertStatistics) -> torch.Tensor:
    """[L, E]: sum over the tokens ROUTED to j of p_j(x), the router's probability over all experts (not renormalised
    over the top k: `ExpertStatistics.mass_routed`).

    The REAP codebase's weighted frequency (`weighted_expert_frequency_sum`) is this number only without top-k
    renormalisation: its observer divides by the top-k sum only when the model's `config.norm_topk_prob` is set (and
    its `renormalize_router_weights` flag, on by default), and then its number is the project's
    `ExpertStatistics.gate_sum` (the weights the forward applies; no criterion of its own) wherever the forward's
    weight is exactly the renormalised softmax (Qwen3-MoE with norm_topk_prob: true)."""
    return stats.mass_routed.clone()


def ean(stats: ExpertStatistics) -> torch.Tensor:
    """[L, E]: EAN_j = sum over tokens routed to j of ||f_j(x)||_2 (unweighted expert output norm)."""
    return stats.ean_sum.clone()


def reap(stats: ExpertStatistics) -> torch.Tensor:
    """[L, E]: REAP_j = (1/n_j) sum over tokens routed to j of g_j(x) ||f_j(x)||_2; 0 for never-routed experts.

    g_j is the weight the model's forward applies (renormalised over the top k where the family renormalises). The
    REAP codebase renormalises only when `config.norm_topk_prob` is set, so on a family that renormalises without
    that key (Mixtral) its g_j is the softmax over all experts and its scores differ from these."""
    return torch.where(stats.frequency > 0, stats.reap_sum / stats.frequency.clamp(min=1), torch.zeros_like(stats.reap_sum))


# prune.criterion's choices: the one list of criterion names (a new criterion is a function above and an entry here).
CRITERIA: dict[str, Callable[[ExpertStatistics], torch.Tensor]] = {
    "frequency": frequency, "mass": routing_mass, "mass_routed": routing_mass_routed, "ean": ean, "reap": reap}


def get_criterion(name: str, key: str = "prune.criterion") -> Callable[[ExpertStatistics], torch.Tensor]:
    if name not in CRITERIA:
        raise ValueError(f"{key}={name!r} is not one of: {', '.join(CRITERIA)}")
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


def keep_set_from_scores(model, scores: torch.Tensor | None, ratio: float, scope: str = "layer", *, adapter=None,
                         meta: dict | None = None):
    """The `KeepSet` of `model` at `ratio` from [L, E] `scores` (higher = keep), for the model's model_type.

    The one place that turns scores into a keep set (the prune app, the trainer's own scoring, the planner): the
    family's expert groups come from its adapter (`expert_groups`), the top-k from its MoE layers. `scores=None`
    ranks every expert equal (the first ones by index are kept): a check of the ratio before calibrating, or the
    planner's keep set, which only needs the counts. A bad ratio or scope is a ValueError before anything is scored.
    """
    from slimwise_train.moe.adapters import get_adapter
    from slimwise_train.moe.keepset import KeepSet

    adapter = adapter or get_adapter(model)
    layers = adapter.moe_layers(model)
    if scores is None:
        scores = torch.zeros(len(layers), layers[0].num_experts)
    kept = select_keep(scores, float(ratio), layers[0].top_k, str(scope), adapter.expert_groups(model))
    return KeepSet.from_kept(layers, kept, model_type=model.config.model_type, meta=meta)

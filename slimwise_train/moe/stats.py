"""Per-expert routing statistics in the same forward pass, without running unselected experts.

Shape legend: T tokens (batch*seq flattened), E experts, K experts per token, H hidden size.

Two pieces cooperate per MoE layer:
  * a forward hook on the router keeps the router's output, turned into per-expert probabilities [T, E]
    by the adapter;
  * an experts backend registered in transformers' `ExpertsInterface` runs the model's own backend once on
    the (token, choice) pairs with unit weights, which yields the *unweighted* output f_j(x) of each selected
    expert [T*K, H] at the cost of the normal expert matmuls; it then applies the routing weights itself, so
    the layer output is what the stock backend computes.

Each layer call produces a `RoutingRecord` handed to `on_record`; accumulation (float64 sums, criteria)
belongs to the caller (see slimwise_train.prune.statistics).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import nn
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

from slimwise_train.moe.adapters import get_adapter

STATS_BACKEND = "slimwise_stats"


@dataclass
class RoutingRecord:
    """What one MoE layer did for one forward call.

    probs        [T, E] fp32  router probabilities over all experts (sigmoid affinities for DeepSeek-V3)
    top_k_index  [T, K] long  selected experts
    top_k_weight [T, K]       the model's routing weights after its own normalisation and scaling
    output_norm  [T, K] fp32  ||f_j(x)||_2 of each selected expert's unweighted output
    token_mask   [T] bool or None  valid (non-padding) tokens, as set by `ExpertStatsRecorder.token_mask`
    """

    layer_index: int
    probs: torch.Tensor
    top_k_index: torch.Tensor
    top_k_weight: torch.Tensor
    output_norm: torch.Tensor
    token_mask: torch.Tensor | None


def _stats_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """[T,H], [T,K], [T,K] -> [T,H]; reports unweighted per-choice outputs to the recorder on `self`."""
    recorder = self._slimwise_recorder
    base = recorder.base_forward(self)
    num_tokens, k = top_k_index.shape
    unit = torch.ones(num_tokens * k, 1, dtype=top_k_weights.dtype, device=top_k_weights.device)
    unweighted = base(self, hidden_states.repeat_interleave(k, dim=0), top_k_index.reshape(-1, 1), unit)  # [T*K, H]
    recorder._on_experts(self, top_k_index, top_k_weights, unweighted.view(num_tokens, k, -1))
    out = (unweighted.view(num_tokens, k, -1) * top_k_weights.unsqueeze(-1)).sum(dim=1)
    return out.to(hidden_states.dtype)


ALL_EXPERTS_FUNCTIONS.register(STATS_BACKEND, _stats_experts_forward)


class ExpertStatsRecorder:
    """Context manager that reports a `RoutingRecord` per MoE layer per forward to `on_record`.

        recorder = ExpertStatsRecorder(model, on_record)
        with recorder:
            recorder.token_mask = attention_mask.bool().flatten()
            model(input_ids, attention_mask=attention_mask)
    """

    def __init__(self, model: nn.Module, on_record: Callable[[RoutingRecord], None]):
        self.model = model
        self.adapter = get_adapter(model)
        self.on_record = on_record
        self.token_mask: torch.Tensor | None = None
        self._layers = self.adapter.moe_layers(model)
        self._pending: dict[int, torch.Tensor] = {}
        self._handles: list = []
        self._saved_impl = None

    def base_forward(self, experts: nn.Module):
        impl = self._saved_impl
        if impl in (None, "eager"):
            return type(experts).forward.__wrapped__  # the class's own loop, kept by functools.wraps
        return ALL_EXPERTS_FUNCTIONS[impl]

    def _on_experts(self, experts, top_k_index, top_k_weights, unweighted):
        moe = experts._slimwise_moe
        probs = self._pending.pop(moe.layer_index)
        mask = self.token_mask
        if mask is not None and mask.numel() != top_k_index.shape[0]:
            raise ValueError(f"token_mask has {mask.numel()} entries but the layer saw {top_k_index.shape[0]} tokens")
        self.on_record(
            RoutingRecord(
                layer_index=moe.layer_index,
                probs=probs,
                top_k_index=top_k_index.detach(),
                top_k_weight=top_k_weights.detach(),
                output_norm=unweighted.detach().float().norm(dim=-1),
                token_mask=mask,
            )
        )

    def __enter__(self):
        config = self._layers[0].experts.config
        self._saved_impl = getattr(config, "_experts_implementation", None)
        for moe in self._layers:
            moe.experts._slimwise_recorder = self
            moe.experts._slimwise_moe = moe
            moe.experts.config._experts_implementation = STATS_BACKEND
            self._handles.append(moe.router.register_forward_hook(self._router_hook(moe)))
        return self

    def _router_hook(self, moe):
        def hook(module, args, output):
            self._pending[moe.layer_index] = self.adapter.router_probs(moe, output).detach()

        return hook

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for moe in self._layers:
            moe.experts.config._experts_implementation = self._saved_impl
            del moe.experts._slimwise_recorder, moe.experts._slimwise_moe
        self._pending.clear()
        return False


@contextlib.contextmanager
def record_expert_stats(model: nn.Module, on_record: Callable[[RoutingRecord], None]) -> Iterator[ExpertStatsRecorder]:
    with ExpertStatsRecorder(model, on_record) as recorder:
        yield recorder

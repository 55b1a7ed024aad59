"""The one interface behind which all per-architecture MoE knowledge lives.

Shape legend: T tokens (batch*seq flattened), E experts in a layer, K experts chosen per token (top-k),
H hidden size, I a native slot's intermediate size, X extra intermediate columns.

An adapter answers these questions about a model family (nothing outside `moe/adapters/` compares a family name or
a model_type; tests/test_layout.py checks that):
  * where the MoE layers, routers, fused expert tensors and shared experts are (`moe_layers`);
  * how the router turns logits into (weights, indices), so it can be redone with removed experts
    excluded *before* the top-k (`reroute`), which is what makes masking equal to physical pruning;
  * what the router's per-expert probabilities are, for calibration statistics (`router_probs`);
  * which tensors carry an expert dimension and which config key counts experts (`expert_tensors`,
    `num_experts_key`), so physical pruning is generic;
  * whether the family has its own always-on MLP beside the experts (a "native slot" for shared capacity), and
    how that slot and its config field grow by extra intermediate columns (`native_slot`, `widen_native_slot_`,
    `widened_slot_config`).
Nothing here knows about phases, training or parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from slimwise_train.utils.hf import text_config

RouterOutput = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (logits or probs [T,E], weights [T,K], index [T,K])


@dataclass
class MoELayer:
    """One MoE block of a decoder, seen through its adapter.

    `layer_index` is the decoder layer index (MoE layers need not be contiguous: DeepSeek-V3 keeps the first
    layers dense, Qwen MoE models can list `mlp_only_layers`).
    """

    layer_index: int
    block: nn.Module  # module whose forward runs router then experts (mlp, or the decoder layer for Gemma 4)
    router: nn.Module
    experts: nn.Module
    num_experts: int
    top_k: int
    shared_expert: nn.Module | None = None
    shared_expert_gate: nn.Module | None = None
    extra: dict = field(default_factory=dict)


class MoEAdapter:
    """Per-family knowledge about a transformers MoE model. Subclasses override the marked methods."""

    family: str = ""
    model_types: tuple[str, ...] = ()
    num_experts_key: str = "num_experts"  # config attribute that counts routed experts
    top_k_key: str = "num_experts_per_tok"  # config attribute of the router's top-k
    # lm-eval's convention for the family's tokenizer: score text with a leading BOS token (Gemma) or without
    add_bos_token: bool = False
    # Whether a stock checkpoint can hold different expert counts per layer (by padding with experts that a
    # -inf router bias makes unselectable). Families without a per-expert router bias cannot.
    supports_non_uniform_export: bool = False

    # ------------------------------------------------------------------ discovery
    def has_experts(self, config) -> bool:
        """Whether a config of this family builds MoE layers (a family can have dense members); default: yes."""
        return True

    def expert_groups(self, model_or_config) -> int:
        """Groups of the group-limited routing (the router picks groups, then experts inside them); 1: none. A keep
        set must keep the same number of experts in every group, and a padded (non-uniform) export is refused."""
        return 1

    def decoder_layers(self, model: nn.Module) -> nn.ModuleList:
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
        layers = getattr(decoder, "layers", None)
        if layers is None and hasattr(decoder, "language_model"):
            layers = getattr(decoder.language_model, "layers", None)
        if layers is None:
            raise ValueError(f"{type(model).__name__}: cannot find the decoder layers (expected `.layers`)")
        return layers

    def moe_layers(self, model: nn.Module) -> list[MoELayer]:
        found = []
        for index, layer in enumerate(self.decoder_layers(model)):
            moe = self.layer_view(index, layer, model)
            if moe is not None:
                found.append(moe)
        if not found:
            raise ValueError(f"{type(model).__name__} ({self.family}) has no MoE layers in this config")
        return found

    def layer_view(self, index: int, layer: nn.Module, model: nn.Module) -> MoELayer | None:  # override
        raise NotImplementedError

    # ------------------------------------------------------------------ routing
    def mask_hook_target(self, moe: MoELayer) -> nn.Module:
        """Module whose forward output the masking hook rewrites (the router, unless overridden)."""
        return moe.router

    def reroute(self, moe: MoELayer, output, removed: torch.Tensor):  # override
        """Redo the router's choice from `output` with the `removed` experts ([E] bool) excluded.

        Returns a replacement for `output` of `mask_hook_target(moe)`. Must equal what a router over only the
        kept experts computes (up to the expert index renumbering).
        """
        raise NotImplementedError

    def router_probs(self, moe: MoELayer, output: RouterOutput) -> torch.Tensor:
        """Per-expert router probabilities [T, E] in fp32 from the router's output (softmax over all E)."""
        return torch.softmax(output[0].float(), dim=-1)

    # ------------------------------------------------------------------ pruning
    def expert_tensors(self, moe: MoELayer) -> list[tuple[nn.Module, str, int]]:
        """(module, attribute, dim) for every parameter or buffer with an expert dimension."""
        tensors = [(moe.experts, name, 0) for name, _ in moe.experts.named_parameters(recurse=False)]
        tensors += [(moe.router, name, 0) for name, _ in moe.router.named_parameters(recurse=False)]
        tensors += [(moe.router, name, 0) for name, _ in moe.router.named_buffers(recurse=False)]
        return tensors

    def set_layer_num_experts(self, moe: MoELayer, n: int) -> None:
        for module in (moe.experts, moe.router):
            if hasattr(module, "num_experts"):
                module.num_experts = n
        moe.num_experts = n

    def pad_value(self, module: nn.Module, name: str) -> float:
        """Value of padded experts in a non-uniform export (only for `supports_non_uniform_export`)."""
        return 0.0

    def check_keep(self, moe: MoELayer, kept: list[int]) -> None:
        """Family-specific constraints on a layer's kept experts (raise ValueError); default: none."""

    def describe(self, moe: MoELayer) -> str:
        return f"layer {moe.layer_index}: {moe.num_experts} experts, top-{moe.top_k}"

    # ------------------------------------------------------------------ multi-token prediction (MTP)
    # Checkpoints of some families (Qwen3.5/3.6, Qwen3-Next, DeepSeek-V3) carry MTP layers beside the trunk, which
    # transformers does not load. `mtp_layers_key` is the (text) config key that counts them; None: the family has
    # none. A pruned or distilled export drops them and sets that key to 0 (moe/pruning.py, `drop_mtp_config`).
    mtp_layers_key: str | None = None

    def mtp_layers(self, config) -> int:
        """How many MTP layers a checkpoint of this (text) config carries."""
        return int(getattr(text_config(config), self.mtp_layers_key, 0) or 0) if self.mtp_layers_key else 0

    def is_mtp_tensor(self, name: str, config) -> bool:
        """Whether the checkpoint tensor `name` belongs to an MTP layer or its head."""
        return False

    def mtp_trunk_overrides(self, config, count: int) -> dict:
        """Text-config values under which the stock class builds `count` more decoder layers of the kind the MTP
        layers are (what builds an MTP layer's tensors with the trunk's names, e.g. the twins)."""
        raise NotImplementedError(f"{self.family} has no MTP layers")

    def mtp_layer_prefix(self, config, index: int) -> str:
        """Where MTP layer `index` (a decoder layer) lives in a checkpoint, e.g. `mtp.layers.0.`."""
        raise NotImplementedError(f"{self.family} has no MTP layers")

    def mtp_head_tensors(self, config, index: int) -> dict[str, tuple[int, ...]]:
        """{checkpoint name: shape} of what MTP layer `index` has besides its decoder layer: the projection of
        [embedding; hidden] back to the hidden size, its norms, its own embedding and output head where it has them."""
        raise NotImplementedError(f"{self.family} has no MTP layers")

    # ------------------------------------------------------------------ native shared slot
    # The family's own always-on MLP beside the routed experts (Qwen's gated shared expert, DeepSeek-V3's shared
    # experts, Gemma 4's dense MLP) is where new shared capacity can go so that the result is still the stock class:
    # extra intermediate columns there export as a wider slot and a larger config value. `native_slot_key` is the
    # config field that sets the slot's width; None: the family has no slot.
    native_slot_key: str | None = None

    @property
    def has_native_slot(self) -> bool:
        return self.native_slot_key is not None

    def native_slot(self, moe: MoELayer) -> nn.Module:
        """The slot of one MoE layer: a bias-free gated MLP down(act(gate(x)) * up(x)) with `gate_proj`, `up_proj`
        (weights [I, H]) and `down_proj` ([H, I]), whose output joins the routed experts' (for Qwen, after the
        sigmoid `shared_expert_gate`: columns added to this module's output sit inside the gate)."""
        assert self.has_native_slot and moe.shared_expert is not None, f"{self.family} has no native slot"
        return moe.shared_expert

    def widened_slot_config(self, config, extra: int) -> dict[str, int]:
        """{config field: new value} of the (text) config under which the stock class builds every MoE layer's slot
        `extra` intermediate columns wider. ValueError when the family's config cannot express that width."""
        return {self.native_slot_key: int(getattr(config, self.native_slot_key)) + int(extra)}

    def widen_native_slot_(self, moe: MoELayer, gate_XH: torch.Tensor, up_XH: torch.Tensor,
                           down_HX: torch.Tensor) -> None:
        """Append X intermediate columns to the slot in place: gate/up weights [I, H] -> [I+X, H] (new rows last),
        down weight [H, I] -> [H, I+X]. The result computes slot(x) + down_HX act(gate_XH x) * up_XH x."""
        slot = self.native_slot(moe)
        for proj, extra, dim in ((slot.gate_proj, gate_XH, 0), (slot.up_proj, up_XH, 0), (slot.down_proj, down_HX, 1)):
            weight = proj.weight
            widened = torch.cat([weight, extra.to(weight)], dim=dim)
            proj.weight = nn.Parameter(widened, requires_grad=weight.requires_grad)
        width = slot.gate_proj.weight.shape[0]
        slot.gate_proj.out_features = slot.up_proj.out_features = slot.down_proj.in_features = width
        if hasattr(slot, "intermediate_size"):
            slot.intermediate_size = width


def softmax_topk_route(
    logits: torch.Tensor, removed: torch.Tensor, top_k: int, renormalize: bool, out_dtype: torch.dtype | None
) -> RouterOutput:
    """softmax(fp32) -> top-k -> optional renormalisation, with removed experts at -inf before the softmax.

    -inf before the softmax makes the denominator cover only kept experts, so the result equals a router
    that never had the removed rows, whether or not the family renormalises the top-k.
    """
    masked = logits.masked_fill(removed, float("-inf"))
    probs = torch.softmax(masked, dim=-1, dtype=torch.float)
    weights, index = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if out_dtype is not None:
        weights = weights.to(out_dtype)
    return masked, weights, index

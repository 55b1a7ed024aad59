"""Adapters for the MoE families of transformers 5.23 (see ../shared/notes/moe-internals.md for the layouts).

Every `reroute` below is a line-for-line re-statement of the stock router's forward with removed experts
excluded before selection; tests check that with nothing removed it reproduces the stock router bit for bit.
"""

from __future__ import annotations

import re

import torch

from slimwise_train.moe.adapters.base import MoEAdapter, MoELayer, softmax_topk_route
from slimwise_train.utils.hf import text_config


class SoftmaxTopKAdapter(MoEAdapter):
    """`layer.mlp` = block with `.gate` (softmax top-k router, bias-free) and `.experts` (fused SwiGLU)."""

    shared_expert_attr: str | None = None
    shared_expert_gate_attr: str | None = None
    weights_in_logits_dtype = True  # Qwen/OLMoE cast top-k weights back to the logits dtype; Mixtral keeps fp32

    def layer_view(self, index, layer, model):
        block = getattr(layer, "mlp", None)
        if block is None or not hasattr(block, "gate") or not hasattr(block, "experts"):
            return None  # dense layer (mlp_only_layers, decoder_sparse_step, first_k_dense_replace)
        return MoELayer(
            layer_index=index,
            block=block,
            router=block.gate,
            experts=block.experts,
            num_experts=block.experts.num_experts,
            top_k=block.gate.top_k,
            shared_expert=getattr(block, self.shared_expert_attr, None) if self.shared_expert_attr else None,
            shared_expert_gate=(
                getattr(block, self.shared_expert_gate_attr, None) if self.shared_expert_gate_attr else None
            ),
        )

    def reroute(self, moe, output, removed):
        logits = output[0]
        # Qwen3.5-MoE and Mixtral always renormalise and have no flag; the others read norm_topk_prob.
        renormalize = getattr(moe.router, "norm_topk_prob", True)
        out_dtype = logits.dtype if self.weights_in_logits_dtype else None
        return softmax_topk_route(logits, removed, moe.router.top_k, renormalize, out_dtype)


class Qwen3MoeAdapter(SoftmaxTopKAdapter):
    family = "qwen3_moe"
    model_types = ("qwen3_moe",)


class Qwen2MoeAdapter(SoftmaxTopKAdapter):
    family = "qwen2_moe"
    model_types = ("qwen2_moe",)
    shared_expert_attr = "shared_expert"
    shared_expert_gate_attr = "shared_expert_gate"
    # block output = experts + sigmoid(shared_expert_gate(x)) * shared_expert(x); the slot is `shared_expert`
    native_slot_key = "shared_expert_intermediate_size"


class QwenMtpAdapter(Qwen2MoeAdapter):
    """Qwen3-Next and Qwen3.5/3.6 checkpoints hold their MTP layers under `mtp.*` (a full-attention MoE decoder
    layer `mtp.layers.<i>.*`, `mtp.fc` projecting [embedding; hidden] to the hidden size, `mtp.pre_fc_norm_embedding`,
    `mtp.pre_fc_norm_hidden` and the final `mtp.norm`; the embedding and output head are the trunk's), counted by
    `mtp_num_hidden_layers` (names as llama.cpp's converter and vLLM read them)."""

    mtp_layers_key = "mtp_num_hidden_layers"

    def is_mtp_tensor(self, name, config):
        return name.startswith(("mtp.", "model.mtp."))

    def mtp_trunk_overrides(self, config, count):
        config = text_config(config)
        types = list(getattr(config, "layer_types", None) or [])
        return {"num_hidden_layers": config.num_hidden_layers + count,
                **({"layer_types": types + ["full_attention"] * count} if types else {})}

    def mtp_layer_prefix(self, config, index):
        return f"mtp.layers.{index}."

    def mtp_head_tensors(self, config, index):
        if index:
            return {}  # one projection and one set of norms, whatever the layer count
        hidden = text_config(config).hidden_size
        return {"mtp.fc.weight": (hidden, 2 * hidden), "mtp.pre_fc_norm_embedding.weight": (hidden,),
                "mtp.pre_fc_norm_hidden.weight": (hidden,), "mtp.norm.weight": (hidden,)}


class Qwen3NextAdapter(QwenMtpAdapter):
    family = "qwen3_next"
    model_types = ("qwen3_next",)


class Qwen35MoeAdapter(QwenMtpAdapter):
    family = "qwen3_5_moe"
    model_types = ("qwen3_5_moe", "qwen3_5_moe_text")


class MixtralAdapter(SoftmaxTopKAdapter):
    family = "mixtral"
    model_types = ("mixtral",)
    num_experts_key = "num_local_experts"
    weights_in_logits_dtype = False


class OlmoeAdapter(SoftmaxTopKAdapter):
    family = "olmoe"
    model_types = ("olmoe",)


class DeepseekV3Adapter(SoftmaxTopKAdapter):
    """Sigmoid scores, selection on score + e_score_correction_bias with group limiting, unbiased weights."""

    family = "deepseek_v3"
    model_types = ("deepseek_v3",)
    num_experts_key = "n_routed_experts"
    shared_expert_attr = "shared_experts"
    supports_non_uniform_export = True  # padded experts get e_score_correction_bias = -inf (n_group == 1 only)
    # `shared_experts` is ONE ungated MLP of width moe_intermediate_size x n_shared_experts
    native_slot_key = "n_shared_experts"

    def widened_slot_config(self, config, extra):
        # The slot grows in whole experts: X extra columns are X / moe_intermediate_size more shared experts.
        expert = int(config.moe_intermediate_size)
        if extra % expert:
            raise ValueError(
                f"deepseek_v3 adds shared experts whole: distill.student.shared_expert_intermediate_size={extra} is "
                f"not a multiple of moe_intermediate_size={expert}; use a multiple, null for one more expert, or "
                "distill.student.shared_expert_mode=none (no shared expert, stock class) or new (remote code)"
            )
        return {"n_shared_experts": int(config.n_shared_experts) + extra // expert}

    # The MTP layers follow the trunk as `model.layers.<num_hidden_layers + i>.*` (a MoE decoder layer) with `enorm`,
    # `hnorm`, `eh_proj`, `shared_head.norm`, `shared_head.head` and their own `embed_tokens`, counted by
    # `num_nextn_predict_layers` (DeepSeek-V3's checkpoint layout, as llama.cpp's converter and vLLM read it).
    mtp_layers_key = "num_nextn_predict_layers"

    def is_mtp_tensor(self, name, config):
        found = re.match(r"(?:model\.)?layers\.(\d+)\.", name)
        return found is not None and int(found.group(1)) >= text_config(config).num_hidden_layers

    def mtp_trunk_overrides(self, config, count):
        return {"num_hidden_layers": text_config(config).num_hidden_layers + count}

    def mtp_layer_prefix(self, config, index):
        return f"model.layers.{text_config(config).num_hidden_layers + index}."

    def mtp_head_tensors(self, config, index):
        config = text_config(config)
        prefix, hidden, vocab = self.mtp_layer_prefix(config, index), config.hidden_size, config.vocab_size
        return {f"{prefix}enorm.weight": (hidden,), f"{prefix}hnorm.weight": (hidden,),
                f"{prefix}eh_proj.weight": (hidden, 2 * hidden), f"{prefix}shared_head.norm.weight": (hidden,),
                f"{prefix}shared_head.head.weight": (vocab, hidden), f"{prefix}embed_tokens.weight": (vocab, hidden)}

    def expert_groups(self, model_or_config):
        return int(getattr(text_config(model_or_config), "n_group", None) or 1)

    def reroute(self, moe, output, removed):
        router = moe.router
        logits = output[0]
        scores = logits.sigmoid()
        # Removed experts leave the *selection* scores (-inf), never the unbiased weights: the kept weights are
        # then exactly those of a router whose bias and rows were sliced.
        choice = (scores + router.e_score_correction_bias).masked_fill(removed, float("-inf"))
        num_experts = choice.shape[-1]
        group_scores = choice.view(-1, router.num_group, num_experts // router.num_group).topk(2, dim=-1)[0].sum(-1)
        group_idx = torch.topk(group_scores, k=router.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        score_mask = (
            group_mask.unsqueeze(-1).expand(-1, router.num_group, num_experts // router.num_group).reshape(-1, num_experts)
        )
        choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
        index = torch.topk(choice, k=router.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, index)
        if router.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        weights = weights * router.routed_scaling_factor
        return logits.masked_fill(removed, float("-inf")), weights, index

    def router_probs(self, moe, output):
        # DeepSeek's affinities are independent sigmoids, not a distribution over experts.
        return output[0].float().sigmoid()

    def check_keep(self, moe, kept):
        groups = moe.router.num_group
        if groups == 1:
            return
        per_group = moe.num_experts // groups
        counts = [sum(1 for j in kept if j // per_group == g) for g in range(groups)]
        if len(set(counts)) != 1 or counts[0] < 2:
            raise ValueError(
                f"deepseek_v3 layer {moe.layer_index}: with n_group={groups} every expert group must keep the same "
                f"number (>= 2) of experts so group-limited routing is unchanged; got per-group counts {counts}. "
                "Rank experts within groups (prune.group_balanced=true) or use a model with n_group=1."
            )

    def pad_value(self, module, name):
        return float("-inf") if name == "e_score_correction_bias" else 0.0


class GptOssAdapter(MoEAdapter):
    """`layer.mlp.router` (top-k on logits incl. bias, softmax over the k values); transposed, biased experts."""

    family = "gpt_oss"
    model_types = ("gpt_oss",)
    num_experts_key = "num_local_experts"
    supports_non_uniform_export = True  # padded experts get router bias = -inf

    def layer_view(self, index, layer, model):
        block = getattr(layer, "mlp", None)
        if block is None or not hasattr(block, "router"):
            return None
        return MoELayer(index, block, block.router, block.experts, block.experts.num_experts, block.router.top_k)

    def reroute(self, moe, output, removed):
        logits = output[0].masked_fill(removed, float("-inf"))
        top_values, index = torch.topk(logits, moe.router.top_k, dim=-1)
        weights = torch.softmax(top_values, dim=1, dtype=top_values.dtype)
        return logits, weights, index

    def pad_value(self, module, name):
        return float("-inf") if (module.__class__.__name__.endswith("Router") and name == "bias") else 0.0


class Gemma4Adapter(MoEAdapter):
    """MoE block lives on the decoder layer: `layer.router` (RMSNorm -> proj -> softmax -> top-k -> renorm ->
    per_expert_scale), `layer.experts`; the dense `layer.mlp` always runs beside it (the family's shared expert)."""

    family = "gemma4"
    model_types = ("gemma4_text", "gemma4")
    top_k_key = "top_k_experts"
    add_bos_token = True
    # layer output = post_ffn_norm_1(mlp(x)) + post_ffn_norm_2(experts(...)); the slot is the dense `mlp`
    native_slot_key = "intermediate_size"

    def widened_slot_config(self, config, extra):
        # KV-shared layers of a double-wide config build their MLP 2 x intermediate_size wide, so no one value of
        # intermediate_size widens every layer by the same X columns.
        if getattr(config, "use_double_wide_mlp", False) and getattr(config, "num_kv_shared_layers", 0):
            raise ValueError("gemma4 with use_double_wide_mlp and KV-shared layers cannot widen its dense MLP "
                             "uniformly; use distill.student.shared_expert_mode=none (no shared expert: the default "
                             "trainable preset trains LoRA on the kept experts, stock-class export) or new (remote "
                             "code)")
        return super().widened_slot_config(config, extra)

    def has_experts(self, config):
        return bool(getattr(text_config(config), "enable_moe_block", False))  # else a dense Gemma 4

    def layer_view(self, index, layer, model):
        if not getattr(layer, "enable_moe_block", False):
            return None
        return MoELayer(
            layer_index=index,
            block=layer,
            router=layer.router,
            experts=layer.experts,
            num_experts=layer.experts.num_experts,
            top_k=layer.router.config.top_k_experts,
            shared_expert=layer.mlp,
        )

    def mask_hook_target(self, moe):
        # The projection's output is the logits; -inf there and the stock softmax/top-k/renorm/scale do the rest.
        return moe.router.proj

    def reroute(self, moe, output, removed):
        return output.masked_fill(removed, float("-inf"))

    def router_probs(self, moe, output):
        return output[0].float()  # Gemma 4's router already returns probabilities

    def expert_tensors(self, moe):
        return [
            (moe.experts, "gate_up_proj", 0),
            (moe.experts, "down_proj", 0),
            (moe.router.proj, "weight", 0),
            (moe.router, "per_expert_scale", 0),
        ]

    def set_layer_num_experts(self, moe, n):
        super().set_layer_num_experts(moe, n)
        moe.router.proj.out_features = n


ADAPTERS: tuple[type[MoEAdapter], ...] = (
    Qwen3MoeAdapter,
    Qwen35MoeAdapter,
    Qwen3NextAdapter,
    Gemma4Adapter,
    MixtralAdapter,
    OlmoeAdapter,
    DeepseekV3Adapter,
    GptOssAdapter,
    Qwen2MoeAdapter,
)

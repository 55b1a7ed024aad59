"""Tiny random configs of the stock transformers MoE classes, one per supported family.

Nothing here is downloaded: each config builds a ~100k-parameter model of the real class, so tests
exercise the same routers, fused expert tensors and caches that the 35B checkpoints use.
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

TINY_VOCAB = 96

_COMMON = dict(
    vocab_size=TINY_VOCAB,
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_hidden_layers=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

# model_type -> config overrides. Every family routes top-2 of 8 experts so keep sets are comparable.
TINY_CONFIGS: dict[str, dict] = {
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, intermediate_size=48,
                      norm_topk_prob=True),
    "qwen2_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, intermediate_size=48,
                      shared_expert_intermediate_size=24, norm_topk_prob=False),
    "qwen3_next": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, intermediate_size=48,
                       shared_expert_intermediate_size=24, layer_types=["linear_attention", "full_attention"],
                       linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
                       linear_value_head_dim=8, linear_conv_kernel_dim=4),
    "qwen3_5_moe_text": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                             shared_expert_intermediate_size=24, layer_types=["linear_attention", "full_attention"],
                             linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
                             linear_value_head_dim=8, linear_conv_kernel_dim=4),
    "gemma4_text": dict(enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=16,
                        intermediate_size=48, layer_types=["sliding_attention", "full_attention"],
                        sliding_window=8, hidden_size_per_layer_input=0, global_head_dim=8,
                        num_global_key_value_heads=2),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=16),
    "olmoe": dict(num_experts=8, num_experts_per_tok=2, intermediate_size=16, norm_topk_prob=False),
    "deepseek_v3": dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, intermediate_size=48,
                        num_key_value_heads=4, n_shared_experts=1, first_k_dense_replace=0, n_group=1, topk_group=1,
                        kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8,
                        v_head_dim=8, routed_scaling_factor=2.5, norm_topk_prob=True),
    "gpt_oss": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=16, sliding_window=8,
                    layer_types=["sliding_attention", "full_attention"],
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
}

SUPPORTED_TINY = tuple(TINY_CONFIGS)


def tiny_config(model_type: str, **overrides) -> PretrainedConfig:
    """A tiny config of the stock class for `model_type`; `overrides` win over the defaults."""
    if model_type not in TINY_CONFIGS:
        raise ValueError(f"no tiny config for model_type {model_type!r}; known: {', '.join(SUPPORTED_TINY)}")
    kwargs = {**_COMMON, **TINY_CONFIGS[model_type], **overrides}
    return AutoConfig.for_model(model_type, **kwargs)


def tiny_model(model_type: str, seed: int = 0, init_std: float = 0.2, **overrides) -> PreTrainedModel:
    """A tiny random causal LM in fp32 and eval mode.

    Weights are drawn with a large `init_std` so routers make confident, distinct choices and a masked
    expert visibly changes the logits (with the stock 0.02 init all experts look alike).
    """
    config = tiny_config(model_type, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.copy_(torch.randn(param.shape, generator=generator) * init_std)
            elif name.endswith("bias") or "correction_bias" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * init_std)
    return model.eval()

"""What the planner needs to know about a model, read off the real transformers class built on the meta device.

    arch = describe(model_cfg, prune_cfg, distill_cfg, dtype)   # no weights, no network: milliseconds to seconds

The model is built with `AutoModelForCausalLM.from_config` under `torch.device("meta")` from the preset's shipped
architecture (`model.architecture`: a config.json under slimwise_train/assets/configs/), a tiny preset's
`tiny_config`, or the config.json of a local `model.path`. The project's own adapter finds the MoE layers and the
project's own `DistillModel` is attached (also on meta, its random init skipped), so frozen, trainable and expert
parameter counts are the trainer's, not a re-derivation. Per decoder layer the planner records the attention kind and
head geometry (from the attention module itself: Gemma 4's full layers have their own head size and KV heads), the
width of every tensor a student RMSNorm normalises, and the expert and MLP sizes.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

ASSET_CONFIGS = Path(__file__).resolve().parents[1] / "assets" / "configs"
REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class LayerShape:
    index: int
    attention: str  # full | sliding | linear | mla
    window: int | None = None  # sliding: the window (the cache keeps window - 1 tokens of the prefix)
    heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0  # query/key head size (MLA: nope + rope)
    v_head_dim: int = 0
    gated_output: bool = False  # Qwen3.5 / Qwen3-Next: sigmoid(gate) * attention output
    # linear attention (gated delta rule)
    lin_k_heads: int = 0
    lin_v_heads: int = 0
    lin_k_dim: int = 0
    lin_v_dim: int = 0
    conv_kernel: int = 0
    # MLA (DeepSeek-V3): the cache holds the compressed latent and the shared rope key
    kv_lora_rank: int = 0
    rope_dim: int = 0
    norm_width: int = 0  # per token: summed widths of the tensors the student's norm deltas see in this layer
    moe: bool = False
    experts: int = 0
    top_k: int = 0
    expert_size: int = 0  # routed expert intermediate size
    expert_params: int = 0  # routed experts' parameters in this layer (one fused module)
    dense_mlp_size: int = 0  # a dense MLP beside or instead of the experts (Gemma 4, DeepSeek's dense layers)
    stock_shared_size: int = 0  # the checkpoint's own shared expert (Qwen2/3.5/Next gated, DeepSeek ungated)
    stock_shared_gated: bool = False
    student_shared_size: int = 0  # the student's trained shared expert (new, or extra columns of the stock one)
    # Elements of the fused expert tensors the student's LoRA parametrises (distill.trainable, the default on the
    # families without a slot): peft materialises W + s B A for all E experts at every forward. Their input widths,
    # summed (H for gate_up_proj, I for down_proj): a weight that needs a gradient makes its matmul save the input.
    lora_expert_params: int = 0
    lora_expert_inputs: int = 0
    params: int = 0  # every parameter of the decoder layer (frozen + the student's)


@dataclass
class Architecture:
    name: str
    model_type: str
    family: str
    model_class: str
    attn_implementation: str
    hidden: int
    vocab: int
    layers: list[LayerShape]
    frozen_params: int
    trainable_params: int
    trainable_by_kind: dict
    expert_params: int  # all routed experts
    kept_expert_params: int  # routed experts the keep set keeps (the decode model's experts)
    largest_other_module_params: int  # the largest non-expert module (embedding, lm_head, a dense MLP)
    final_norm_width: int
    final_logit_softcapping: float | None
    tied_embeddings: bool
    kept_experts: list[int] = field(default_factory=list)
    # The largest single expert tensor of a layer (gate_up_proj), and whether checkpoints store it one tensor per
    # expert (transformers fuses those on load: its conversion mapping merges a module list) or already fused
    largest_expert_tensor_params: int = 0
    experts_stored_per_expert: bool = False

    def to_json(self) -> dict:
        out = asdict(self)
        out["layers"] = len(self.layers)
        out["layer_kinds"] = {kind: sum(layer.attention == kind for layer in self.layers)
                              for kind in ("full", "sliding", "linear", "mla")}
        out["moe_layers"] = sum(layer.moe for layer in self.layers)
        return out


# --------------------------------------------------------------------------- config


def tiny_overrides(model_cfg) -> dict:
    """model.tiny_overrides as plain Python (lists from the YAML become lists, not ListConfig)."""
    from omegaconf import DictConfig, OmegaConf

    overrides = model_cfg.tiny_overrides or {}
    return OmegaConf.to_container(overrides, resolve=True) if isinstance(overrides, DictConfig) else dict(overrides)


def architecture_config(model_cfg):
    """The transformers config of the model to plan, offline: the preset's shipped architecture, a tiny config, or
    the config.json of a local `model.path` folder. A hub id alone is refused (the planner never downloads)."""
    from transformers import AutoConfig

    arch = getattr(model_cfg, "architecture", None)
    if arch:
        path = Path(arch)
        if not path.is_absolute() and not path.exists():
            path = REPO_ROOT / arch
        if not path.is_file():
            raise ValueError(f"model.architecture={arch}: no such file (shipped configs: {ASSET_CONFIGS})")
        data = json.loads(path.read_text())
        return AutoConfig.for_model(data.pop("model_type"), **data)
    if model_cfg.tiny:
        from slimwise_train.testing.tiny import tiny_config

        return tiny_config(model_cfg.tiny, **tiny_overrides(model_cfg))
    from slimwise_train.models import resolve_path

    folder = resolve_path(model_cfg.path) if model_cfg.path else None
    if folder and (Path(folder) / "config.json").is_file():
        return AutoConfig.from_pretrained(folder)
    raise ValueError(f"model {model_cfg.name}: the planner needs model.architecture (a shipped config.json), a tiny "
                     f"preset or a local model.path folder with a config.json; {model_cfg.path!r} is none of these "
                     "(it never downloads)")


# --------------------------------------------------------------------------- the meta model


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _attention_shape(index: int, layer: nn.Module, text_config) -> LayerShape:
    linear = getattr(layer, "linear_attn", None)
    if linear is not None:
        conv = getattr(linear, "conv1d", None)
        return LayerShape(index, "linear", lin_k_heads=int(linear.num_k_heads), lin_v_heads=int(linear.num_v_heads),
                          lin_k_dim=int(linear.head_k_dim), lin_v_dim=int(linear.head_v_dim),
                          conv_kernel=int(getattr(linear, "conv_kernel_size", conv.kernel_size[0] if conv else 4)))
    attn = layer.self_attn
    if hasattr(attn, "kv_lora_rank"):  # MLA
        return LayerShape(index, "mla", heads=int(attn.num_heads), kv_heads=int(attn.num_heads),
                          head_dim=int(attn.qk_head_dim), v_head_dim=int(attn.v_head_dim),
                          kv_lora_rank=int(attn.kv_lora_rank), rope_dim=int(attn.qk_rope_head_dim))
    head_dim = int(attn.head_dim)
    heads = int(text_config.num_attention_heads)
    kv_heads = heads // int(getattr(attn, "num_key_value_groups", 1))
    window = getattr(attn, "sliding_window", None)
    kind = "sliding" if window else "full"
    gated = (bool(getattr(text_config, "attn_output_gate", False))
             and attn.q_proj.weight.shape[0] == 2 * heads * head_dim)
    return LayerShape(index, kind, window=int(window) if window else None, heads=heads, kv_heads=kv_heads,
                      head_dim=head_dim, v_head_dim=head_dim, gated_output=gated)


def _norm_width(name: str, norm: nn.Module, layer_shape: LayerShape) -> int:
    """Per-token elements the norm sees: per-head q/k norms run over every head."""
    width = int(norm.weight.shape[0])
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "q_norm" and width == layer_shape.head_dim:
        return layer_shape.heads * width
    if leaf == "k_norm" and width == layer_shape.head_dim:
        return layer_shape.kv_heads * width
    return width


def _mlp_size(module: nn.Module | None) -> int:
    if module is None:
        return 0
    gate = getattr(module, "gate_proj", None) or getattr(module, "up_proj", None)
    return int(gate.weight.shape[0]) if gate is not None and hasattr(gate, "weight") else 0


def _experts_stored_per_expert(model) -> bool:
    """Whether transformers loads this model's experts from one checkpoint tensor per expert (a conversion that merges
    a module list), as hub checkpoints of the Qwen, Mixtral, OLMoE and DeepSeek families store them."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import MergeModulelist, WeightConverter

    return any(isinstance(op, MergeModulelist) for conversion in get_model_conversion_mapping(model)
               if isinstance(conversion, WeightConverter) for op in conversion.operations)


def describe(model_cfg, prune_cfg, distill_cfg, dtype: torch.dtype = torch.bfloat16,
             config=None) -> tuple[Architecture, object]:
    """(Architecture, the meta DistillModel) for the configured model, keep ratio and student; `config`: the model's
    transformers config when the caller has read it already (default: `architecture_config(model_cfg)`)."""
    from transformers import AutoModelForCausalLM

    from slimwise_train.distill.lora import expert_wrappers
    from slimwise_train.distill.student import (
        DistillModel,
        StudentSpec,
        find_norms,
        routed_expert_size,
    )
    from slimwise_train.moe.adapters import get_adapter
    from slimwise_train.prune.criteria import keep_set_from_scores, validate_prune_config
    from slimwise_train.utils.hf import text_config

    config = architecture_config(model_cfg) if config is None else config
    validate_prune_config(prune_cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    adapter = get_adapter(model)
    moe_layers = adapter.moe_layers(model)
    tcfg = text_config(model)
    if prune_cfg.get("keep_set"):  # the trainer's keep set (was ignored: a uniform plan at prune.ratio instead)
        from slimwise_train.moe.keepset import KeepSet
        from slimwise_train.moe.keepset_rules import check_fits

        keep_set = KeepSet.load(prune_cfg.keep_set, key="prune.keep_set")
        check_fits(keep_set, model, f"prune.keep_set={prune_cfg.keep_set}")
    else:
        keep_set = keep_set_from_scores(model, None, prune_cfg.ratio, prune_cfg.scope, adapter=adapter)
    expert_params = {m.layer_index: _numel(m.experts) for m in moe_layers}
    with torch.device("meta"):  # the student's random init of its shared experts costs nothing on meta
        student = DistillModel(model, keep_set, StudentSpec.from_config(distill_cfg), adapter=adapter,
                               recompute="none")
    counts = student.parameter_counts()
    lora_params: dict[int, tuple[int, int]] = {}  # MoE layer index -> (parametrised elements, summed input widths)
    for index, wrapper in expert_wrappers(student):
        elements, inputs = lora_params.get(index, (0, 0))
        lora_params[index] = (elements + wrapper.get_param().numel(), inputs + int(wrapper.in_features))

    decoder_layers = adapter.decoder_layers(model)
    by_index = {m.layer_index: m for m in moe_layers}
    shapes = []
    for index, layer in enumerate(decoder_layers):
        shape = _attention_shape(index, layer, tcfg)
        moe = by_index.get(index)
        if moe is not None:
            shape.moe, shape.experts, shape.top_k = True, int(moe.num_experts), int(moe.top_k)
            shape.expert_size = int(routed_expert_size(model))
            shape.expert_params = expert_params[index]
            # The trained shared capacity: a new expert, or extra columns of the family's own slot (native mode)
            shape.student_shared_size = _mlp_size(student.trainable_shared_expert(moe))
            shape.lora_expert_params, shape.lora_expert_inputs = lora_params.get(index, (0, 0))
            if moe.shared_expert is not None:
                shape.stock_shared_size = _mlp_size(moe.shared_expert)
                shape.stock_shared_gated = moe.shared_expert_gate is not None
            dense = getattr(layer, "mlp", None)
            if dense is not None and dense is not moe.block:  # Gemma 4: a dense MLP runs beside the experts
                shape.dense_mlp_size = _mlp_size(dense)
        else:
            shape.dense_mlp_size = _mlp_size(getattr(layer, "mlp", None))
        shape.params = _numel(layer)
        shapes.append(shape)

    owner = {}
    for i, layer in enumerate(decoder_layers):
        for module in layer.modules():
            owner[id(module)] = i
    final_width = 0
    student_cfg = distill_cfg.student
    for name, norm in find_norms(model, str(student_cfg.norm_scope)) if student_cfg.train_norms else []:
        index = owner.get(id(norm))
        if index is None:
            if norm is getattr(model.get_decoder(), "norm", None):
                final_width += int(norm.weight.shape[0])
            continue  # a vision tower's norms: trained, never run on text
        shapes[index].norm_width += _norm_width(name, norm, shapes[index])

    expert_ids = {id(p) for m in moe_layers for p in m.experts.parameters()}
    largest_other = 0
    for module in model.modules():
        own = [p for p in module.parameters(recurse=False) if id(p) not in expert_ids]
        largest_other = max(largest_other, sum(p.numel() for p in own))
    kept_fraction = sum(keep_set.num_kept) / sum(m.num_experts for m in moe_layers)
    total_experts = sum(expert_params.values())
    arch = Architecture(
        name=str(model_cfg.name), model_type=str(model.config.model_type), family=adapter.family,
        model_class=type(model).__name__, attn_implementation=str(model.config._attn_implementation),
        hidden=int(tcfg.hidden_size), vocab=int(model.get_output_embeddings().weight.shape[0]), layers=shapes,
        frozen_params=int(counts["frozen"]), trainable_params=int(counts["trainable"]),
        trainable_by_kind={k: int(counts[k]) for k in ("router", "norm", "shared_expert", "lora")},
        expert_params=int(total_experts), kept_expert_params=round(total_experts * kept_fraction),
        largest_other_module_params=int(largest_other), final_norm_width=final_width,
        largest_expert_tensor_params=max(p.numel() for m in moe_layers for p in m.experts.parameters()),
        experts_stored_per_expert=_experts_stored_per_expert(model),
        final_logit_softcapping=getattr(tcfg, "final_logit_softcapping", None),
        tied_embeddings=bool(getattr(model.config, "tie_word_embeddings", False)),
        kept_experts=list(keep_set.num_kept),
    )
    return arch, student

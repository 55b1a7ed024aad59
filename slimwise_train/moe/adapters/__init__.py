"""Per-architecture MoE adapters, chosen from `config.model_type`.

Everything a family does differently lives here (docs/adding-a-family.md); the rest of the package asks the adapter.
"""

from __future__ import annotations

from torch import nn

from slimwise_train.moe.adapters.base import MoEAdapter, MoELayer, RouterOutput
from slimwise_train.moe.adapters.families import ADAPTERS
from slimwise_train.utils.hf import text_config

ADAPTER_BY_MODEL_TYPE: dict[str, type[MoEAdapter]] = {mt: cls for cls in ADAPTERS for mt in cls.model_types}
SUPPORTED_FAMILIES: tuple[str, ...] = tuple(cls.family for cls in ADAPTERS)
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(ADAPTER_BY_MODEL_TYPE)
# Families with an always-on MLP of their own beside the experts, where new shared capacity stays the stock class.
NATIVE_SLOT_FAMILIES: tuple[str, ...] = tuple(cls.family for cls in ADAPTERS if cls.native_slot_key is not None)


def model_type_of(model_or_config) -> str:
    config = getattr(model_or_config, "config", model_or_config)
    return getattr(config, "model_type", None) or type(config).__name__


def adapter_class(model_type: str) -> type[MoEAdapter]:
    """The adapter class registered for `model_type` (no config needed: class-level facts such as config keys)."""
    if model_type not in ADAPTER_BY_MODEL_TYPE:
        raise ValueError(f"model_type {model_type!r} is not a supported MoE model; supported: "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    return ADAPTER_BY_MODEL_TYPE[model_type]


def family_of(model_type: str) -> str:
    """The family of `model_type` (gemma4 for gemma4 and gemma4_text); an unknown model_type is its own family."""
    cls = ADAPTER_BY_MODEL_TYPE.get(model_type)
    return cls.family if cls else model_type


def get_adapter(model_or_config) -> MoEAdapter:
    """The adapter for a model or config; a clear ValueError for dense or unsupported models."""
    config = getattr(model_or_config, "config", model_or_config)
    candidates = [getattr(config, "model_type", None), getattr(text_config(config), "model_type", None)]
    for model_type in candidates:
        if model_type in ADAPTER_BY_MODEL_TYPE:
            adapter = ADAPTER_BY_MODEL_TYPE[model_type]()
            if not adapter.has_experts(config):
                break  # a dense member of a MoE family (a dense Gemma 4)
            return adapter
    raise ValueError(
        f"model_type {candidates[0]!r} is not a supported MoE model (dense models have no experts to prune); "
        f"supported families: {', '.join(SUPPORTED_FAMILIES)}"
    )


def moe_layers(model: nn.Module) -> list[MoELayer]:
    return get_adapter(model).moe_layers(model)


__all__ = ["MoEAdapter", "MoELayer", "RouterOutput", "SUPPORTED_FAMILIES", "SUPPORTED_MODEL_TYPES",
           "NATIVE_SLOT_FAMILIES", "ADAPTER_BY_MODEL_TYPE", "adapter_class", "family_of", "get_adapter", "moe_layers",
           "model_type_of"]

"""Per-architecture MoE adapters, chosen from `config.model_type`."""

from __future__ import annotations

from torch import nn

from slimwise_train.moe.adapters.base import MoEAdapter, MoELayer, RouterOutput
from slimwise_train.moe.adapters.families import ADAPTERS

_BY_MODEL_TYPE: dict[str, type[MoEAdapter]] = {mt: cls for cls in ADAPTERS for mt in cls.model_types}
SUPPORTED_FAMILIES: tuple[str, ...] = tuple(cls.family for cls in ADAPTERS)
# Families with an always-on MLP of their own beside the experts, where new shared capacity stays the stock class.
NATIVE_SLOT_FAMILIES: tuple[str, ...] = tuple(cls.family for cls in ADAPTERS if cls.native_slot_key is not None)


def model_type_of(model_or_config) -> str:
    config = getattr(model_or_config, "config", model_or_config)
    return getattr(config, "model_type", None) or type(config).__name__


def get_adapter(model_or_config) -> MoEAdapter:
    """The adapter for a model or config; a clear ValueError for dense or unsupported models."""
    config = getattr(model_or_config, "config", model_or_config)
    candidates = [getattr(config, "model_type", None)]
    if hasattr(config, "get_text_config"):
        candidates.append(getattr(config.get_text_config(), "model_type", None))
    for model_type in candidates:
        if model_type in _BY_MODEL_TYPE:
            adapter = _BY_MODEL_TYPE[model_type]()
            if adapter.family == "gemma4" and not getattr(config.get_text_config(), "enable_moe_block", False):
                break  # a dense Gemma 4
            return adapter
    raise ValueError(
        f"model_type {candidates[0]!r} is not a supported MoE model (dense models have no experts to prune); "
        f"supported families: {', '.join(SUPPORTED_FAMILIES)}"
    )


def moe_layers(model: nn.Module) -> list[MoELayer]:
    return get_adapter(model).moe_layers(model)


__all__ = ["MoEAdapter", "MoELayer", "RouterOutput", "SUPPORTED_FAMILIES", "NATIVE_SLOT_FAMILIES", "get_adapter",
           "moe_layers", "model_type_of"]

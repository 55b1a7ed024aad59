"""Physical pruning: slice the removed experts out of the fused expert tensors, router rows and every
per-expert buffer, update the config, and export a stock Hugging Face checkpoint for a decode instance.

The exported folder loads with plain `AutoModelForCausalLM.from_pretrained` and no project code. Stock
configs hold one expert count for all layers, so a non-uniform keep set is exported by padding each layer to
the largest count with experts that the router can never select; only families with a per-expert router bias
can express that (GPT-OSS router bias, DeepSeek-V3 score-correction bias with n_group=1). Others get a clear
error and should use router masking or a uniform keep set.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import torch
from torch import nn

from slimwise_train.moe.adapters import MoEAdapter, get_adapter
from slimwise_train.moe.keepset import KeepSet
from slimwise_train.utils.atomic import atomic_dir
from slimwise_train.utils.hf import text_config


def _replace_tensor(module: nn.Module, name: str, new: torch.Tensor) -> None:
    old = getattr(module, name)
    if isinstance(old, nn.Parameter):
        setattr(module, name, nn.Parameter(new, requires_grad=old.requires_grad))
    else:
        module._buffers[name] = new


def prune_experts_(model: nn.Module, keep_set: KeepSet, pad_to: int | None = None) -> nn.Module:
    """Slice every MoE layer of `model` in place to its kept experts (renumbered 0..n-1 in sorted order).

    With `pad_to`, each layer is then padded to `pad_to` experts that the router cannot select (see module
    docstring); used for exporting non-uniform keep sets.
    """
    adapter = get_adapter(model)
    keep_set.check_model(model, adapter)
    for moe in adapter.moe_layers(model):
        kept = list(keep_set.layer(moe.layer_index).kept)
        index = torch.tensor(kept, dtype=torch.long)
        for module, name, dim in adapter.expert_tensors(moe):
            tensor = getattr(module, name)
            with torch.no_grad():
                new = tensor.detach().index_select(dim, index.to(tensor.device)).clone()
                if pad_to is not None and pad_to > len(kept):
                    shape = list(new.shape)
                    shape[dim] = pad_to - len(kept)
                    pad = torch.full(shape, adapter.pad_value(module, name), dtype=new.dtype, device=new.device)
                    new = torch.cat([new, pad], dim=dim)
            _replace_tensor(module, name, new)
        adapter.set_layer_num_experts(moe, pad_to if pad_to is not None else len(kept))
    counts = keep_set.num_kept
    config = text_config(model)
    setattr(config, adapter.num_experts_key, pad_to if pad_to is not None else max(counts))
    if hasattr(model, "num_experts"):  # ForCausalLM keeps a copy for the load-balancing loss
        model.num_experts = getattr(config, adapter.num_experts_key)
    return model


def drop_mtp(model: nn.Module) -> dict | None:
    """Make `model`'s config say it has no multi-token-prediction layers: the adapter's `mtp_layers_key` set to 0.

    A pruned or distilled decoder is exported without the checkpoint's MTP layers: transformers never loads them, so
    they are not in the model that is saved, and a config still counting them would make an engine that speculates
    with MTP (vLLM, SGLang) build a full-width MTP head over a pruned trunk, or look for tensors that are not there.
    Returns {"key", "was"} (None for a family without MTP layers). A model that holds MTP tensors (a loader that kept
    them) is an error: pruning them consistently is not implemented."""
    adapter = get_adapter(model)
    if adapter.mtp_layers_key is None:
        return None
    kept = [name for name in model.state_dict() if adapter.is_mtp_tensor(name, model)]
    if kept:
        raise ValueError(f"{type(model).__name__} holds multi-token-prediction tensors ({kept[0]}, ...): the export "
                         "drops MTP layers but cannot prune them; load the model without them (transformers does)")
    config = text_config(model)
    was = adapter.mtp_layers(config)
    setattr(config, adapter.mtp_layers_key, 0)
    return {"key": adapter.mtp_layers_key, "was": was}


def check_exportable(adapter: MoEAdapter, model: nn.Module, keep_set: KeepSet) -> None:
    if keep_set.is_uniform:
        return
    if not adapter.supports_non_uniform_export:
        raise ValueError(
            f"{adapter.family} checkpoints hold one expert count for all layers and its router has no per-expert "
            f"bias to disable padded experts, so the non-uniform keep set (kept per layer: {list(keep_set.num_kept)}) "
            "cannot be exported; use a uniform keep set (prune.scope=layer) or router masking (the mask file)"
        )
    groups = adapter.expert_groups(model)
    if groups != 1:
        raise ValueError(
            f"{adapter.family} with {groups} expert groups (n_group={groups}): padded experts would change "
            "group-limited routing, so a non-uniform keep set cannot be exported; use a uniform keep set"
        )


def export_pruned(
    model: nn.Module,
    keep_set: KeepSet,
    output_dir: str | os.PathLike,
    tokenizer=None,
    overwrite: bool = False,
    extra_files: dict[str, dict] | None = None,
) -> Path:
    """Write the physically pruned decode checkpoint of `model` (left untouched) to `output_dir`, atomically.
    Without MTP layers, its config saying so (`drop_mtp`)."""
    adapter = get_adapter(model)
    keep_set.check_model(model, adapter)
    check_exportable(adapter, model, keep_set)
    pruned = copy.deepcopy(model)
    pad_to = None if keep_set.is_uniform else max(keep_set.num_kept)
    prune_experts_(pruned, keep_set, pad_to=pad_to)
    drop_mtp(pruned)
    output_dir = Path(output_dir)
    with atomic_dir(output_dir, overwrite=overwrite) as tmp:
        pruned.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        keep_set.save(tmp / "slimwise_keep_set.json")
        for name, obj in (extra_files or {}).items():
            (tmp / name).write_text(json.dumps(obj, indent=2) + "\n")
    return output_dir

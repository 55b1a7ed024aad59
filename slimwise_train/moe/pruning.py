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


def slice_experts(tensor: torch.Tensor, dim: int, kept: torch.Tensor, pad_to: int | None = None,
                  pad_value: float = 0.0) -> torch.Tensor:
    """A new tensor of `tensor`'s kept experts along `dim` (in `kept`'s order), padded to `pad_to` with `pad_value`
    (experts a router bias of -inf makes unselectable; see module docstring). The one slicing rule of in-place pruning,
    the export from a model in memory and the export streamed from a checkpoint's files (meta tensors too)."""
    with torch.no_grad():
        new = tensor.detach().index_select(dim, kept.to(tensor.device)).clone()
        if pad_to is not None and pad_to > len(kept):
            shape = list(new.shape)
            shape[dim] = pad_to - len(kept)
            pad = torch.full(shape, pad_value, dtype=new.dtype, device=new.device)
            new = torch.cat([new, pad], dim=dim)
    return new


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
            new = slice_experts(getattr(module, name), dim, index, pad_to, adapter.pad_value(module, name))
            _replace_tensor(module, name, new)
        adapter.set_layer_num_experts(moe, pad_to if pad_to is not None else len(kept))
    counts = keep_set.num_kept
    config = text_config(model)
    setattr(config, adapter.num_experts_key, pad_to if pad_to is not None else max(counts))
    if hasattr(model, "num_experts"):  # ForCausalLM keeps a copy for the load-balancing loss
        model.num_experts = getattr(config, adapter.num_experts_key)
    return model


def mtp_config_updates(model: nn.Module) -> dict:
    """What an export sets in its (text) config so that it says it has no multi-token-prediction layers: the adapter's
    `mtp_layers_key` at 0 ({} for a family without MTP layers). `model` is not changed.

    A pruned or distilled decoder is exported without the checkpoint's MTP layers: transformers never loads them, so
    they are not in the model that is saved, and a config still counting them would make an engine that speculates
    with MTP (vLLM, SGLang) build a full-width MTP head over a pruned trunk, or look for tensors that are not there.
    A model that holds MTP tensors (a loader that kept them) is an error: pruning them consistently is not
    implemented."""
    adapter = get_adapter(model)
    if adapter.mtp_layers_key is None:
        return {}
    kept = [name for name in model.state_dict() if adapter.is_mtp_tensor(name, model)]
    if kept:
        raise ValueError(f"{type(model).__name__} holds multi-token-prediction tensors ({kept[0]}, ...): the export "
                         "drops MTP layers but cannot prune them; load the model without them (transformers does)")
    return {adapter.mtp_layers_key: 0}


def drop_mtp(model: nn.Module) -> dict | None:
    """Make `model`'s own config say it has no MTP layers (`mtp_config_updates` applied to it): for an export that
    saves a model it built (the distilled decoder). Returns {"key", "was"} (None for a family without MTP layers)."""
    updates = mtp_config_updates(model)
    if not updates:
        return None
    (key, value), = updates.items()
    config = text_config(model)
    was = get_adapter(model).mtp_layers(config)
    setattr(config, key, value)
    return {"key": key, "was": was}


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


def export_units(model: nn.Module) -> list[list[str]]:
    """The state-dict names `save_pretrained` writes (without `_keys_to_ignore_on_save` and the aliases of tied
    weights), in state-dict order, grouped into what an export holds at once: a decoder layer, or one tensor
    outside every layer (embeddings, final norm, lm_head)."""
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    from slimwise_train.moe.checkpoint import OUTSIDE, decoder_layer_owner

    state = model.state_dict()
    for key in getattr(model, "_keys_to_ignore_on_save", None) or ():
        state.pop(key, None)
    owner = decoder_layer_owner(model)
    units: list[list[str]] = []
    previous = OUTSIDE
    for name in remove_tied_weights_from_state_dict(state, model):
        layer = owner(name)
        if layer is OUTSIDE or layer != previous:
            units.append([])
        units[-1].append(name)
        previous = layer
    return units


def _expert_slices(model: nn.Module, adapter: MoEAdapter, keep_set: KeepSet) -> dict[str, tuple]:
    """state-dict name -> (expert dim, kept experts, pad value) of every tensor with an expert dimension."""
    names = {id(module): name for name, module in model.named_modules()}
    slices = {}
    for moe in adapter.moe_layers(model):
        kept = torch.tensor(list(keep_set.layer(moe.layer_index).kept), dtype=torch.long)
        for module, attr, dim in adapter.expert_tensors(moe):
            prefix = names[id(module)]
            slices[f"{prefix}.{attr}" if prefix else attr] = (dim, kept, adapter.pad_value(module, attr))
    return slices


def save_pruned(model: nn.Module, keep_set: KeepSet, folder: str | os.PathLike, *, max_shard_size: int | str = "5GB",
                checkpoint=None, drop=None, config_updates: dict | None = None, progress: bool = False) -> None:
    """What `prune_experts_(copy.deepcopy(model)).save_pretrained(folder)` writes (the same tensor names, dtypes and
    values, config.json and generation_config.json), without the copy: one unit of `export_units` at a time is
    sliced, turned into the checkpoint layout by transformers' `revert_weight_conversion` (save_pretrained's own
    step) and written (`PlannedSafetensorsWriter`: shards planned from meta tensors first, so no shard is buffered).

    checkpoint: the `LazyCheckpoint` whose meta-device skeleton `model` is; the export then reads the files. Each
    unit is split into the groups transformers converts together; a group whose checkpoint keys are exactly the
    names save_pretrained gives the unpruned group (the layout a save_pretrained checkpoint has) is written by copying
    the kept experts' tensors one by one (read, cast to the model's dtype, renamed: loading fuses per-expert tensors
    and saving splits them again, so that is the same bytes), any other group is loaded (`materialize`), sliced,
    reverted and released. drop (a name in the saved layout -> bool) leaves tensors out; config_updates are set on
    the (text) config written: the hooks a family rule (e.g. multi-token-prediction layers an export drops) plugs
    into. `model` is left as it was."""
    from huggingface_hub.serialization._base import parse_size_to_int
    from tqdm.auto import tqdm
    from transformers.core_model_loading import revert_weight_conversion

    from slimwise_train.moe.checkpoint import PlannedSafetensorsWriter, PlannedTensor, return_freed_memory

    folder = Path(folder)
    adapter = get_adapter(model)
    pad_to = None if keep_set.is_uniform else max(keep_set.num_kept)
    slices = _expert_slices(model, adapter, keep_set)
    buffers = {name for name, _ in model.named_buffers()}
    units = export_units(model)
    if checkpoint is not None:
        units = [group for unit in units for group in checkpoint.load_groups(unit)]

    def chunk_of(names: list[str], meta: bool, sliced: bool = True) -> dict:
        state = model.state_dict()
        chunk = {}
        for name in names:
            tensor = state[name]
            if meta and tensor.device.type != "meta":
                tensor = torch.empty_like(tensor, device="meta")
            if sliced and name in slices:
                dim, kept, pad_value = slices[name]
                tensor = slice_experts(tensor, dim, kept, pad_to, pad_value)
            chunk[name] = tensor
        return chunk

    planned, parameters, copies = [], 0, []
    for names in units:  # the layout, from meta tensors: nothing is read or allocated
        chunk = chunk_of(names, meta=True)
        parameters += sum(t.numel() for name, t in chunk.items() if name not in buffers)
        saved = revert_weight_conversion(model, chunk)
        planned += [PlannedTensor(name, t.dtype, tuple(t.shape)) for name, t in saved.items() if not (drop and drop(name))]
        copies.append(_copy_plan(checkpoint, model, names, chunk_of(names, meta=True, sliced=False), saved, slices,
                                 pad_to) if checkpoint is not None else None)
    _save_pruned_config(model, adapter, keep_set, folder, pad_to, config_updates)
    writer = PlannedSafetensorsWriter(folder, planned, parse_size_to_int(max_shard_size)
                                      if isinstance(max_shard_size, str) else int(max_shard_size))
    dtypes, shapes = {t.name: t.dtype for t in planned}, {t.name: t.shape for t in planned}
    try:
        for names, copy_plan in tqdm(list(zip(units, copies)), desc="writing the pruned checkpoint", unit="part",
                                     disable=not progress):
            if copy_plan is not None:  # one checkpoint tensor in memory at a time
                entries = [(name, source, pad) for name, source, pad in copy_plan if not (drop and drop(name))]
                tensors = checkpoint.read_tensors([source for _, source, _ in entries if source is not None])
                for name, source, pad_value in entries:
                    tensor = next(tensors) if source is not None else torch.full(shapes[name], pad_value)
                    writer.write(name, tensor.to(dtypes[name]))
                    del tensor
                continue
            if checkpoint is not None:
                checkpoint.materialize(names)
            saved = revert_weight_conversion(model, chunk_of(names, meta=False))
            for name in list(saved):
                tensor = saved.pop(name)  # each tensor freed once written
                if not (drop and drop(name)):
                    writer.write(name, tensor)
                tensor = None
            if checkpoint is not None:
                checkpoint.release(names)
            return_freed_memory()  # the slices went: their heap pages too, before the next unit's
        writer.close(parameters)
    finally:
        writer.abort()


def _copy_plan(checkpoint, model, names: list[str], full: dict, saved: dict, slices: dict, pad_to: int | None):
    """[(saved name, checkpoint key or None for a padded expert, pad value)] when the group `names` can be written by
    copying checkpoint tensors (see `save_pruned`), else None. full: the group's meta tensors unsliced; saved: the
    sliced group reverted to the saved layout (meta)."""
    from transformers.core_model_loading import revert_weight_conversion

    keys = {key for name in names for _, key in checkpoint.plan.sources.get(name, ())}
    unpruned = list(revert_weight_conversion(model, full))
    if set(unpruned) != keys or len(unpruned) != len(keys):
        return None  # the checkpoint stores this group in another layout than save_pretrained writes
    pruned = list(saved)
    sliced = [name for name in names if name in slices]
    if not sliced:
        return [(name, name, 0.0) for name in pruned] if pruned == unpruned else None
    if len(sliced) != 1 or slices[sliced[0]][0] != 0:
        return None
    experts = full[sliced[0]].shape[0]
    _, kept, pad_value = slices[sliced[0]]
    kept = kept.tolist()
    out = pad_to if pad_to is not None else len(kept)
    if len(unpruned) % experts or len(pruned) != len(unpruned) // experts * out:
        return None  # not one saved tensor per expert
    plan = []
    for block in range(len(unpruned) // experts):
        for i in range(out):
            # The same expert number keeps its name (experts.3 -> experts.3): the blocks line up, or this is
            # not a per-expert layout.
            if i < experts and unpruned[block * experts + i] != pruned[block * out + i]:
                return None
            source = unpruned[block * experts + kept[i]] if i < len(kept) else None
            plan.append((pruned[block * out + i], source, pad_value))
    return plan


def _save_pruned_config(model, adapter: MoEAdapter, keep_set: KeepSet, folder: Path, pad_to: int | None,
                        config_updates: dict | None) -> None:
    """config.json (expert count patched as `prune_experts_` patches it) and generation_config.json, as
    save_pretrained writes them for the pruned model, from a copy of the config (the model's stays as it was)."""
    config = copy.deepcopy(model.config)
    text = text_config(config)
    setattr(text, adapter.num_experts_key, pad_to if pad_to is not None else max(keep_set.num_kept))
    for key, value in (config_updates or {}).items():
        setattr(text, key, value)
    config.dtype = str(model.dtype).split(".")[1]  # what save_pretrained records
    config.architectures = [type(model).__name__]
    if model.is_remote_code():
        from transformers.dynamic_module_utils import custom_object_save

        custom_object_save(model, folder, config=config)
    config.save_pretrained(folder)
    if model.can_generate():
        model.generation_config.save_pretrained(folder)


def _save_beside(folder: Path, keep_set: KeepSet, tokenizer, extra_files: dict | None) -> None:
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    keep_set.save(folder / "slimwise_keep_set.json")
    for name, obj in (extra_files or {}).items():
        (folder / name).write_text(json.dumps(obj, indent=2) + "\n")


def export_pruned(
    model: nn.Module,
    keep_set: KeepSet,
    output_dir: str | os.PathLike,
    tokenizer=None,
    overwrite: bool = False,
    extra_files: dict[str, dict] | None = None,
    max_shard_size: int | str = "5GB",
) -> Path:
    """Write the physically pruned decode checkpoint of `model` (left untouched) to `output_dir`, atomically.
    Without MTP layers, its config saying so (`drop_mtp`)."""
    adapter = get_adapter(model)
    keep_set.check_model(model, adapter)
    check_exportable(adapter, model, keep_set)
    output_dir = Path(output_dir)
    with atomic_dir(output_dir, overwrite=overwrite) as tmp:
        save_pruned(model, keep_set, tmp, max_shard_size=max_shard_size,  # no copy of the model (see save_pruned)
                    config_updates=mtp_config_updates(model))
        _save_beside(tmp, keep_set, tokenizer, extra_files)
    return output_dir


def export_pruned_from_checkpoint(checkpoint, keep_set: KeepSet, output_dir: str | os.PathLike, tokenizer=None,
                                  overwrite: bool = False, extra_files: dict[str, dict] | None = None,
                                  max_shard_size: int | str | None = None, progress: bool = False, drop=None,
                                  config_updates: dict | None = None) -> Path:
    """`export_pruned` of the model in a `LazyCheckpoint`'s files, read and written a tensor (or a conversion group)
    at a time: the same files, bitwise. Output shards at most the source's largest shard unless `max_shard_size`;
    drop / config_updates: `save_pruned`'s hooks for a family rule."""
    model = checkpoint.model
    adapter = get_adapter(model)
    keep_set.check_model(model, adapter)
    check_exportable(adapter, model, keep_set)
    config_updates = {**mtp_config_updates(model), **(config_updates or {})}
    output_dir = Path(output_dir)
    with atomic_dir(output_dir, overwrite=overwrite) as tmp:
        save_pruned(model, keep_set, tmp, max_shard_size=max_shard_size or checkpoint.largest_shard_bytes(),
                    checkpoint=checkpoint, progress=progress, drop=drop, config_updates=config_updates)
        _save_beside(tmp, keep_set, tokenizer, extra_files)
    return output_dir

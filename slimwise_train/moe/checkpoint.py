"""A local safetensors checkpoint read a few tensors at a time into a model built on the meta device, and a
safetensors writer whose layout is planned before any tensor exists.

    ckpt = LazyCheckpoint("path/to/folder", dtype=torch.bfloat16)     # no weight read yet
    ckpt.materialize(ckpt.layer_targets(3), device="cuda")           # decoder layer 3, exactly as from_pretrained
    ...                                                              # loads it (renames, fused experts, dtypes)
    ckpt.release(ckpt.layer_targets(3))                              # back on the meta device

The skeleton is the class `AutoModelForCausalLM.from_pretrained` builds, constructed the way it constructs it (its init
contexts, the meta device, its dtype plan, the non-persistent buffers initialised as its loader does), and a
tensor is loaded by transformers' own `convert_and_load_state_dict_in_model` over lazy `safe_open` slices of only the
checkpoint keys that feed it: the per-expert tensors a hub checkpoint stores are fused into the model's
`gate_up_proj` by the same conversion, so a layer loaded here is bitwise the layer `from_pretrained` loads. Nothing
here knows a family: decoder layers come from the adapter, keys from transformers' conversion mapping.

`PlannedSafetensorsWriter` writes shards whose every tensor name, dtype and shape is known in advance (from meta
tensors), header first, each tensor's bytes as it arrives: the writer itself holds no tensor, so an export holds what
it is writing (a tensor, a conversion group or a decoder layer: moe/pruning.save_pruned), never a shard's worth.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import torch
from torch import nn

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
OUTSIDE = None  # owner of a tensor outside every decoder layer (embeddings, final norm, lm_head, a vision tower)


# --------------------------------------------------------------------------- the shards of a folder


def checkpoint_shards(folder: str | os.PathLike, what: str = "model.path") -> list[Path]:
    """The safetensors files of a checkpoint folder, checked against its index: a missing shard, or a shard whose
    tensors are not the ones the index puts in it, is a one-line error naming the file."""
    from safetensors import safe_open

    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"{what}={folder}: no such folder; layer-by-layer reading needs a local checkpoint folder "
                         "(download a hub model first: huggingface-cli download <id> --local-dir <folder>)")
    index = folder / INDEX_NAME
    if not index.is_file():
        single = folder / SINGLE_NAME
        if single.is_file():
            return [single]
        raise ValueError(f"{what}={folder}: no {SINGLE_NAME} or {INDEX_NAME}; layer-by-layer reading needs a "
                         "safetensors checkpoint (save it with save_pretrained, which writes safetensors)")
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{what}={folder}: {INDEX_NAME} is not a safetensors index ({exc}); copy the checkpoint "
                         "again") from None
    by_file: dict[str, set[str]] = {}
    for key, name in weight_map.items():
        by_file.setdefault(name, set()).add(key)
    shards = []
    for name in sorted(by_file):
        path = folder / name
        if not path.is_file():
            raise FileNotFoundError(f"{what}={folder}: shard {name} named by {INDEX_NAME} is missing; copy the "
                                    "checkpoint again")
        try:
            with safe_open(str(path), "pt") as handle:
                keys = set(handle.keys())
        except Exception as exc:  # safetensors' own error type for a truncated or corrupt file
            raise ValueError(f"{what}={folder}: shard {name} is truncated or corrupt ({exc}); copy the checkpoint "
                             "again") from None
        if keys != by_file[name]:
            extra, lacking = sorted(keys - by_file[name]), sorted(by_file[name] - keys)
            detail = (f"holds {len(extra)} tensor(s) the index does not put there (e.g. {extra[0]})" if extra else
                      f"lacks {len(lacking)} tensor(s) the index puts there (e.g. {lacking[0]})")
            raise ValueError(f"{what}={folder}: shard {name} disagrees with {INDEX_NAME}: it {detail}; the folder "
                             "mixes two checkpoints, copy it again")
        shards.append(path)
    return shards


# --------------------------------------------------------------------------- the lazily loaded model


def return_freed_memory() -> None:
    """Hand the heap's free pages back to the OS (glibc's malloc_trim; a no-op elsewhere). Tensors under glibc's
    mmap threshold (which grows to 32 MiB once a large block is freed) live in the heap, and a freed layer's worth
    of them stayed resident (measured: ~115 MiB on the 240M bench model) until reused."""
    global _MALLOC_TRIM
    if _MALLOC_TRIM is None:
        import ctypes
        import ctypes.util

        try:
            _MALLOC_TRIM = ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim
        except (OSError, AttributeError, TypeError):
            _MALLOC_TRIM = False
    if _MALLOC_TRIM:
        _MALLOC_TRIM(0)


_MALLOC_TRIM = None


def decoder_layer_owner(model: nn.Module):
    """name -> the index of the decoder layer whose tensor `name` (a state-dict name) is, or OUTSIDE."""
    from slimwise_train.moe.adapters import get_adapter

    names = {id(module): name for name, module in model.named_modules()}
    prefixes = [names[id(layer)] + "." for layer in get_adapter(model).decoder_layers(model)]

    def owner(name: str) -> int | None:
        return next((i for i, prefix in enumerate(prefixes) if name.startswith(prefix)), OUTSIDE)

    return owner


def _quiet_transformers_bars():
    """transformers draws a 'Loading weights' bar per load call: one per layer here, so the caller's bar is the one."""
    from transformers.utils import logging as hf_logging

    @contextlib.contextmanager
    def quiet():
        enabled = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        try:
            yield
        finally:
            if enabled:
                hf_logging.enable_progress_bar()

    return quiet()


@dataclass
class CheckpointPlan:
    """Which checkpoint keys feed which model tensor, and which decoder layer owns it."""

    sources: dict[str, list[tuple[Path, str]]] = field(default_factory=dict)  # state-dict name -> (shard, key)
    owner: dict[str, int | None] = field(default_factory=dict)  # state-dict name -> decoder layer index or OUTSIDE
    unexpected: list[str] = field(default_factory=list)  # checkpoint keys the model does not load (MTP, vision, ...)
    shard_of: dict[str, Path] = field(default_factory=dict)  # checkpoint key -> its shard


class LazyCheckpoint:
    """A local safetensors checkpoint behind the meta-device model `from_pretrained` would build for it."""

    def __init__(self, folder: str | os.PathLike, dtype: torch.dtype, *, what: str = "model.path",
                 experts_implementation: str | None = None):
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.modeling_utils import LoadStateDictConfig
        from transformers.models.auto.auto_factory import _get_model_class
        from transformers.monkey_patching import patch_output_recorders
        from transformers.utils.generic import ContextManagers

        self.folder = Path(folder)
        self.what = what
        self.shards = checkpoint_shards(self.folder, what)
        try:
            config = AutoConfig.from_pretrained(self.folder)
        except (OSError, ValueError, KeyError) as exc:
            first = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
            raise ValueError(f"{what}={self.folder}: cannot read its config.json ({first[:200]}); copy the checkpoint "
                             "again") from None
        if type(config) not in AutoModelForCausalLM._model_mapping:
            raise ValueError(f"{what}={self.folder}: model_type {config.model_type!r} has no stock causal-LM class in "
                             "transformers (remote code); layer-by-layer reading needs a stock class")
        cls = _get_model_class(config, AutoModelForCausalLM._model_mapping)
        # What from_pretrained does to the config and the model before reading a weight (transformers 5.23,
        # PreTrainedModel.from_pretrained and _finalize_model_loading): the dtype on the config and its sub-configs,
        # the model built under its init contexts (meta device, no tying), output recorders patched.
        config.dtype = dtype
        for sub in config.sub_configs:
            if getattr(config, sub, None) is not None:
                getattr(config, sub).dtype = dtype
        config.name_or_path = str(self.folder)
        with ContextManagers(cls.get_init_context(dtype, False, False, None)):
            model = cls(config)
            patch_output_recorders(model)
        self.dtype = dtype
        self.load_config = LoadStateDictConfig(pretrained_model_name_or_path=str(self.folder), dtype=dtype,
                                               dtype_plan=model._get_dtype_plan(dtype),
                                               weight_mapping=get_model_conversion_mapping(model, None, None))
        self.model = model
        self.plan = self._plan()
        # Every model tensor needs a source: from_pretrained would initialise a missing one at random (and warn),
        # which calibration would then score; a tied output embedding is not a missing one.
        state = model.state_dict()
        tied = set(model.all_tied_weights_keys)
        missing = sorted(k for k in state if k not in self.plan.sources and k not in tied)
        if missing:
            raise ValueError(f"{what}={self.folder}: the checkpoint has no tensor for {len(missing)} of the model's "
                             f"(e.g. {missing[0]}); it is incomplete or of another architecture than its config.json")
        # Non-persistent buffers (rotary tables, embedding scales) are not in any checkpoint: transformers moves them
        # off the meta device and initialises them after loading; the same two calls here, before any weight.
        model._move_missing_keys_from_meta_to_device(set(), None, None, None)
        model._initialize_missing_keys(False)
        model.tie_weights(missing_keys=tied - set(self.plan.sources), recompute_mapping=False)
        # What save_pretrained reverts on export: the conversions from_pretrained would record (those matching a key).
        model._weight_conversions = [c for c in self.load_config.weight_mapping if c.was_used()]
        if model.can_generate():  # from_pretrained's generation config: the folder's file, else the model config's
            model.adjust_generation_fn(None, True, None, str(self.folder), cache_dir=None, force_download=False,
                                       proxies=None, local_files_only=True, token=None, revision=None, subfolder="",
                                       trust_remote_code=False)
        if experts_implementation:
            model.set_experts_implementation(experts_implementation)
        self.model = model.eval()

    # ------------------------------------------------------------------ planning
    def _plan(self) -> CheckpointPlan:
        from safetensors import safe_open
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

        model = self.model
        mapping = self.load_config.weight_mapping
        renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
        converters = [m for m in mapping if isinstance(m, WeightConverter)]
        state = model.state_dict()
        plan = CheckpointPlan()
        for shard in self.shards:
            with safe_open(str(shard), "pt") as handle:
                keys = list(handle.keys())
            for key in keys:
                plan.shard_of[key] = shard
                # transformers' loader, step 1 (convert_and_load_state_dict_in_model): renamings, at most one
                # converter, the base-model prefix added or stripped
                target, _ = rename_source_key(key, renamings, converters, model.base_model_prefix, state)
                if target not in state and key in state:
                    target = key
                if target not in state:
                    plan.unexpected.append(key)
                    continue
                plan.sources.setdefault(target, []).append((shard, key))
        owner = decoder_layer_owner(model)
        plan.owner = {target: owner(target) for target in state}
        return plan

    @property
    def num_layers(self) -> int:
        from slimwise_train.moe.adapters import get_adapter

        return len(get_adapter(self.model).decoder_layers(self.model))

    def layer_targets(self, index: int) -> list[str]:
        return [name for name, owner in self.plan.owner.items() if owner == index]

    def outside_targets(self) -> list[str]:
        return [name for name, owner in self.plan.owner.items() if owner is OUTSIDE]

    def largest_shard_bytes(self) -> int:
        return max(p.stat().st_size for p in self.shards)

    # ------------------------------------------------------------------ loading and releasing
    def load_groups(self, targets: Iterable[str]) -> list[list[str]]:
        """`targets` split into the smallest groups transformers converts together (tensors fed by a shared checkpoint
        key, such as a fused qkv), in their order: loading group by group, the loader's transient copies (the
        per-expert tensors it stacks into one fused tensor) are one group's, not a layer's."""
        by_key: dict[str, int] = {}
        groups: list[list[str]] = []
        for target in targets:
            keys = [key for _, key in self.plan.sources.get(target, ())]
            joined = next((by_key[k] for k in keys if k in by_key), None)
            if joined is None:
                joined = len(groups)
                groups.append([])
            groups[joined].append(target)
            by_key.update(dict.fromkeys(keys, joined))
        return [group for group in groups if group]

    def materialize(self, targets: Iterable[str], device: str | torch.device = "cpu") -> None:
        """Load `targets` (state-dict names; a tied output embedding follows its source) onto `device`, one load
        group at a time (`load_groups`).

        The shards are opened for one group and closed after it: an open (memory-mapped) safetensors file keeps every
        page ever read from it resident while the handle or any tensor read from it lives (measured: with the
        handles kept open, the pages of every layer read stayed, up to the whole checkpoint). A loaded tensor maps
        its own pages; they go with it. (pread reads cost twice the tensor while it is copied; measured.)"""
        from safetensors import safe_open
        from transformers.core_model_loading import convert_and_load_state_dict_in_model

        load_config = dataclasses.replace(self.load_config, device_map={"": str(device)})
        for group in self.load_groups(targets):
            wanted = [(shard, key) for target in group for shard, key in self.plan.sources.get(target, ())]
            if not wanted:
                continue
            handles = {shard: safe_open(str(shard), "pt") for shard in {s for s, _ in wanted}}
            lazy = {key: handles[shard].get_slice(key) for shard, key in wanted}
            try:
                with _quiet_transformers_bars():
                    info, _ = convert_and_load_state_dict_in_model(self.model, lazy, load_config)
            finally:
                del lazy
                handles.clear()
                return_freed_memory()
            self._check(info)
        self.model.tie_weights(recompute_mapping=False)

    def read_tensors(self, keys: list[str]):
        """The checkpoint tensors `keys`, as stored (no conversion, no cast), one at a time when asked for: each from
        a handle opened for it alone, so only its own pages are mapped, and they go once the caller drops it."""
        from safetensors import safe_open

        for key in keys:
            with safe_open(str(self.plan.shard_of[key]), "pt") as handle:
                tensor = handle.get_slice(key)[...]
            yield tensor
            del tensor

    def _check(self, info) -> None:
        if info.mismatched_keys:
            name, got, expected = sorted(info.mismatched_keys)[0]
            raise ValueError(f"{self.what}={self.folder}: tensor {name} has shape {tuple(got)} in the checkpoint but "
                             f"{tuple(expected)} in the model its config.json builds; the folder mixes two checkpoints")
        if info.conversion_errors:
            name, error = next(iter(info.conversion_errors.items()))
            raise ValueError(f"{self.what}={self.folder}: cannot convert {name} ({error})")

    def release(self, targets: Iterable[str]) -> None:
        """Put `targets` back on the meta device (their memory freed once nothing else holds them)."""
        for target in targets:
            module_path, _, attr = target.rpartition(".")
            module = self.model.get_submodule(module_path)
            tensor = getattr(module, attr)
            if tensor is None or tensor.device.type == "meta":
                continue
            meta = torch.empty_like(tensor, device="meta")
            if attr in module._parameters:
                module._parameters[attr] = nn.Parameter(meta, requires_grad=False)
            else:
                module._buffers[attr] = meta
        self.model.tie_weights(recompute_mapping=False)
        return_freed_memory()


# --------------------------------------------------------------------------- a writer with a planned layout

_DTYPE_NAMES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
                torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * torch.empty((), dtype=self.dtype).element_size()


class PlannedSafetensorsWriter:
    """Safetensors shards of a layout fixed up front (`planned`: every tensor in the order it will arrive), named as
    `save_pretrained` names them (model.safetensors, or model-0000i-of-0000N.safetensors with the index).

    Each shard's header is written when its first tensor arrives, then each tensor's bytes as it arrives; a tensor
    out of plan (another name, dtype or shape) is an error. `close()` writes the index; the caller writes into a
    temporary folder published atomically (utils/atomic.atomic_dir)."""

    def __init__(self, folder: Path, planned: list[PlannedTensor], max_shard_bytes: int,
                 metadata: dict[str, str] | None = None):
        self.folder = Path(folder)
        self.metadata = {"format": "pt", **(metadata or {})}
        shards: list[list[PlannedTensor]] = [[]]
        size = 0
        for tensor in planned:
            if shards[-1] and size + tensor.nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(tensor)
            size += tensor.nbytes
        self.shards = shards
        count = len(shards)
        self.names = ([SINGLE_NAME] if count == 1 else
                      [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)])
        self._queue = [(shard_index, tensor) for shard_index, shard in enumerate(shards) for tensor in shard]
        self._next = 0
        self._file = None
        self._file_index = -1
        self.total_size = sum(t.nbytes for t in planned)

    def _open(self, shard_index: int) -> None:
        if self._file is not None:
            self._file.close()
        header, offset = {"__metadata__": self.metadata}, 0
        for tensor in self.shards[shard_index]:
            header[tensor.name] = {"dtype": _DTYPE_NAMES[tensor.dtype], "shape": list(tensor.shape),
                                   "data_offsets": [offset, offset + tensor.nbytes]}
            offset += tensor.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors' own writer pads it
        self._file = open(self.folder / self.names[shard_index], "wb")
        self._file.write(len(raw).to_bytes(8, "little"))
        self._file.write(raw)
        self._file_index = shard_index

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._next >= len(self._queue):
            raise RuntimeError(f"tensor {name} arrived after every planned tensor was written")
        shard_index, planned = self._queue[self._next]
        got = (name, tensor.dtype, tuple(tensor.shape))
        if got != (planned.name, planned.dtype, planned.shape):
            raise RuntimeError(f"export out of plan: got {got}, planned {(planned.name, planned.dtype, planned.shape)}")
        if shard_index != self._file_index:
            self._open(shard_index)
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        self._file.write(memoryview(data.numpy()))
        self._next += 1

    def close(self, total_parameters: int) -> list[str]:
        """Finish the last shard and write the index (several shards); returns the shard file names."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._next != len(self._queue):
            raise RuntimeError(f"export stopped after {self._next} of {len(self._queue)} planned tensors")
        if len(self.names) > 1:
            index = {"metadata": {"total_parameters": int(total_parameters), "total_size": int(self.total_size)},
                     "weight_map": {t.name: self.names[i] for i, shard in enumerate(self.shards) for t in shard}}
            (self.folder / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        return self.names

    def abort(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

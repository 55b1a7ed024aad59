"""Layer-by-layer calibration (`prune.calibration.mode=layerwise`): the expert statistics of a model that does not fit,
holding one decoder layer at a time.

    checkpoint, tokenizer = open_checkpoint(cfg.model, device)        # meta-device model, no weight read
    stats = collect_statistics_layerwise(checkpoint, batches, device=device)

1. The embeddings (every tensor of the decoder outside its layers) are read, and each calibration batch runs through
   the model's own forward with every decoder layer's `forward` replaced by a recorder: each layer's arguments are
   exactly what the whole model would pass it (padding and per-layer-type masks, positions, rotary tables, a
   linear-attention mask), and the first layer's input is the embeddings' output. The forward stops there (no final
   norm, no lm_head); the embeddings are freed.
2. For each decoder layer in turn: its tensors are read from the checkpoint's shards (`LazyCheckpoint`: lazy slices
   of only its keys, converted as from_pretrained converts them), every batch runs through it with its recorded
   arguments (whole sequences: a linear-attention layer's recurrence runs over all positions of a sequence as in
   the whole model), the same `ExpertStatsRecorder` as the whole-model path records its routing, and the layer is
   freed. Hidden states wait between layers on the CPU or the device, in the model's dtype.
3. After every `resume_every` layers each rank writes a resume point (its statistics so far and its hidden states)
   under the statistics cache, keyed by the statistics key (+ world size and batch size) and the layer: a rerun
   after a crash (kill -9 included) continues after the last layer every rank finished, with the same result.

The statistics equal the whole-model path's (same forward arithmetic, same accumulation order: measured bitwise on
the 9 families' tiny models; tests/test_layerwise.py). Nothing here knows a family: decoder layers come from the
adapter, the tensors' names and conversions from transformers.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from slimwise_train.utils import distributed as du

log = logging.getLogger("slimwise.prune")

RESUME_FORMAT = "slimwise-layerwise-resume/1"


class _StopBeforeHead(Exception):
    """Raised by the last layer's recorder: the capture needs nothing after the decoder layers."""


# --------------------------------------------------------------------------- opening the checkpoint


def open_checkpoint(model_cfg, device: torch.device, what: str = "prune.calibration.mode=layerwise"):
    """(LazyCheckpoint of model.path with the model's dtype on `device`, tokenizer), with load_model's checks: a
    dense or unknown model, a tokenizer larger than the embedding. One-line errors for what layerwise cannot read."""
    from slimwise_train.models import load_tokenizer, resolve_dtype, resolve_path
    from slimwise_train.moe.adapters import get_adapter
    from slimwise_train.moe.checkpoint import LazyCheckpoint

    if model_cfg.tiny or not model_cfg.path:
        raise ValueError(f"{what} reads a checkpoint's safetensors files: set model.path to a local checkpoint folder "
                         f"(model={model_cfg.name} is a tiny random model; save it with save_pretrained first)")
    if getattr(model_cfg, "device_map", None):
        raise ValueError(f"{what} places one layer at a time itself: drop model.device_map")
    path = Path(str(resolve_path(model_cfg.path))).expanduser()
    if not path.is_dir():
        raise ValueError(f"{what} needs a local checkpoint folder; model.path={model_cfg.path} is not one (a hub id: "
                         f"huggingface-cli download {model_cfg.path} --local-dir <folder>, then model.path=<folder>)")
    checkpoint = LazyCheckpoint(path, resolve_dtype(model_cfg.dtype, device),
                                experts_implementation=model_cfg.experts_implementation)
    get_adapter(checkpoint.model)  # a dense or unknown model: the supported list, now
    tokenizer = load_tokenizer(model_cfg)
    vocab = checkpoint.model.get_input_embeddings().num_embeddings
    if len(tokenizer) > vocab:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens but the model's embedding has {vocab}; "
                         "model.tokenizer points at the wrong tokenizer")
    return checkpoint, tokenizer


# --------------------------------------------------------------------------- the weights' digest, streamed


def _tensor_source(checkpoint, name: str) -> str:
    """The state-dict name whose checkpoint tensors give `name` (a tied output embedding: its input embedding's)."""
    return checkpoint.model.all_tied_weights_keys.get(name, name) if name not in checkpoint.plan.sources else name


def streamed_weights_digest(checkpoint, cache_dir: str | Path | None = None, progress: bool = True) -> str:
    """`prune.statistics.weights_digest` of the model `from_pretrained` would load (the statistics key's hash of every
    weight, so scores files and the cache are shared with the whole-model path), computed one decoder layer at a
    time. Remembered under `cache_dir/weights/` by the shard files' names, sizes and modification times, the dtype
    and config.json: a second run on the same files reads them once, for the calibration."""
    from tqdm.auto import tqdm

    from slimwise_train.moe.checkpoint import OUTSIDE
    from slimwise_train.prune.statistics import weights_digest

    memo = None
    if cache_dir is not None:
        identity = {"files": [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in checkpoint.shards],
                    "dtype": str(checkpoint.dtype), "folder": str(checkpoint.folder.resolve()),
                    "config": (checkpoint.folder / "config.json").read_text()}
        key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:24]
        memo = Path(cache_dir) / "weights" / f"{key}.json"
        if memo.is_file():
            return json.loads(memo.read_text())["weights_sha256"]
    model, plan = checkpoint.model, checkpoint.plan
    names = list(model.state_dict(keep_vars=True))
    bar = tqdm(total=checkpoint.num_layers, desc="hashing weights", unit="layer",
               disable=not (progress and du.is_rank0()))

    def tensors():
        loaded_layer = OUTSIDE
        for name in names:
            owner = plan.owner.get(name, OUTSIDE)
            if owner != loaded_layer and loaded_layer is not OUTSIDE:
                checkpoint.release(checkpoint.layer_targets(loaded_layer))
                bar.update(1)
                loaded_layer = OUTSIDE
            if owner is OUTSIDE:
                source = _tensor_source(checkpoint, name)
                checkpoint.materialize([source])
                yield name, model.state_dict(keep_vars=True)[name]
                checkpoint.release([source])
            else:
                if loaded_layer is OUTSIDE:
                    checkpoint.materialize(checkpoint.layer_targets(owner))
                    loaded_layer = owner
                yield name, model.state_dict(keep_vars=True)[name]
        if loaded_layer is not OUTSIDE:
            checkpoint.release(checkpoint.layer_targets(loaded_layer))
            bar.update(1)

    digest = weights_digest(model, named_tensors=tensors())
    bar.close()
    if memo is not None and du.is_rank0():
        from slimwise_train.utils.atomic import write_json_atomic

        write_json_atomic(memo, {"weights_sha256": digest, "folder": str(checkpoint.folder)})
    return digest


# --------------------------------------------------------------------------- moving a layer's arguments


def _to(obj, device, moved: dict | None = None):
    """`obj` with every tensor inside plain tuples, lists and dicts moved to `device` (other objects as they are: a
    cache or a KV-sharing dict must stay the one object every layer of a batch sees). `moved` (id -> moved tensor)
    keeps a tensor that many layers share (a batch's mask) one tensor after the move."""
    if isinstance(obj, torch.Tensor):
        if moved is None:
            return obj.to(device)
        if id(obj) not in moved:
            moved[id(obj)] = (obj, obj.to(device))  # the source is kept alive so that its id stays its own
        return moved[id(obj)][1]
    if type(obj) in (tuple, list):
        return type(obj)(_to(item, device, moved) for item in obj)
    if type(obj) is dict:
        return {key: _to(value, device, moved) for key, value in obj.items()}
    return obj


def _buffers_to(modules, device) -> None:
    """Move the non-persistent buffers (rotary tables, scales: never in a checkpoint, so never materialized) of
    `modules` to the device their layer runs on."""
    for module in modules:
        for name, buffer in list(module._buffers.items()):
            if buffer is not None and buffer.device.type != "meta" and buffer.device != device:
                module._buffers[name] = buffer.to(device)


def _decoder_prologue_targets(checkpoint) -> list[str]:
    """State-dict names the model's forward reads before its first decoder layer: every tensor of the decoder
    outside its layers (embeddings, per-layer-input tables; the final norm, cheap) and the input embeddings."""
    from slimwise_train.moe.checkpoint import OUTSIDE

    model = checkpoint.model
    names = {id(module): name for name, module in model.named_modules()}
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    prefix = names[id(decoder)]
    embeddings = names[id(model.get_input_embeddings())]
    wanted = [f"{prefix}." if prefix else "", f"{embeddings}."]
    return [name for name, owner in checkpoint.plan.owner.items()
            if owner is OUTSIDE and any(name.startswith(p) for p in wanted) and name in checkpoint.plan.sources]


def capture_layer_inputs(checkpoint, batches: list[dict], device, keep_on) -> tuple[list, list[list]]:
    """(first layer's input per batch, [batch][layer] (args, kwargs)) from the model's own forward with every decoder
    layer replaced by a recorder; everything on `keep_on`."""
    from slimwise_train.moe.adapters import get_adapter

    model = checkpoint.model
    layers = list(get_adapter(model).decoder_layers(model))
    prologue = _decoder_prologue_targets(checkpoint)
    checkpoint.materialize(prologue, device)
    in_layers = {id(m) for layer in layers for m in layer.modules()}
    _buffers_to([m for m in model.modules() if id(m) not in in_layers], torch.device(device))
    first_inputs, arguments = [], []
    try:
        for batch in batches:
            calls: list = [None] * len(layers)
            expected = {"hidden": None}
            moved: dict = {}

            def recorder(index):
                def forward(hidden_states, *args, **kwargs):
                    if index and hidden_states is not expected["hidden"]:
                        # The decoder loop changed the hidden states between two layers: a replay would miss that.
                        raise RuntimeError(f"{type(model).__name__}: the decoder transforms the hidden states between "
                                           "its layers, which layer-by-layer calibration cannot replay; use "
                                           "prune.calibration.mode=whole")
                    calls[index] = (_to(args, keep_on, moved), _to(kwargs, keep_on, moved))
                    if index == 0:
                        first_inputs.append(hidden_states.to(keep_on))
                    if index == len(layers) - 1:
                        raise _StopBeforeHead
                    expected["hidden"] = hidden_states
                    return hidden_states

                return forward

            for index, layer in enumerate(layers):
                layer.forward = recorder(index)
            try:
                with torch.no_grad():
                    model(input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device),
                          use_cache=False, logits_to_keep=1)
            except _StopBeforeHead:
                pass
            finally:
                for layer in layers:
                    del layer.forward  # the class's forward again
            if any(call is None for call in calls):
                raise RuntimeError(f"{type(model).__name__}: its forward skipped decoder layers "
                                   f"{[i for i, c in enumerate(calls) if c is None]}; use prune.calibration.mode=whole")
            arguments.append(calls)
    finally:
        checkpoint.release(prologue)
    return first_inputs, arguments


# --------------------------------------------------------------------------- resume points


def _resume_files(resume_dir: Path, rank: int) -> dict[int, Path]:
    files = {}
    for path in resume_dir.glob(f"rank{rank}-layer*.safetensors"):
        try:
            files[int(path.stem.split("layer")[1])] = path
        except ValueError:
            continue
    return files


def _min_over_ranks(value: int) -> int:
    if not du.is_initialized():
        return value
    box = torch.tensor([value], dtype=torch.long)
    dist.all_reduce(box, op=dist.ReduceOp.MIN)
    return int(box.item())


def _save_resume(resume_dir: Path, rank: int, layer: int, stats, hidden: list, meta: dict) -> None:
    from safetensors.torch import save_file

    from slimwise_train.utils.atomic import atomic_path

    tensors = {**stats.tensors(), **{f"hidden.{b}": h.detach().to("cpu").contiguous() for b, h in enumerate(hidden)}}
    with atomic_path(resume_dir / f"rank{rank}-layer{layer:05d}.safetensors") as tmp:
        save_file(tensors, str(tmp), metadata={"slimwise": json.dumps({**meta, "layer": layer})})


def _load_resume(path: Path, meta: dict, num_batches: int):
    from safetensors import safe_open
    from safetensors.torch import load_file

    from slimwise_train.prune.criteria import ExpertStatistics

    with safe_open(str(path), "pt") as handle:
        recorded = json.loads((handle.metadata() or {}).get("slimwise", "{}"))
    recorded.pop("layer", None)
    if recorded != meta:
        return None  # written by another run (a changed key would live in another folder; a format change here)
    tensors = load_file(str(path))
    hidden = [tensors[f"hidden.{b}"] for b in range(num_batches)]
    stats = ExpertStatistics.from_tensors(tensors, meta)
    return stats, hidden


# --------------------------------------------------------------------------- the calibration


def collect_statistics_layerwise(checkpoint, batches, *, device, hidden_states: str = "cpu", progress: bool = True,
                                 resume_dir: str | Path | None = None, resume_every: int = 1,
                                 after_layer: Callable[[int], None] | None = None):
    """`prune.statistics.collect_statistics` over a `LazyCheckpoint`, one decoder layer at a time (module docstring).

    batches: this rank's calibration batches (dicts with input_ids, attention_mask), all held (their hidden states
    wait between layers). hidden_states: "cpu" or "device". resume_dir: where this run's resume points go (None: no
    resume points). after_layer(i): called once layer i is done and its resume point written (tests inject faults
    there). Under torch.distributed each rank passes its own shard; the result is all-reduced."""
    from tqdm.auto import tqdm

    from slimwise_train.moe.adapters import get_adapter
    from slimwise_train.moe.stats import ExpertStatsRecorder
    from slimwise_train.prune.criteria import ExpertStatistics

    batches = list(batches)
    model = checkpoint.model
    adapter = get_adapter(model)
    layers = list(adapter.decoder_layers(model))
    moe_layers = adapter.moe_layers(model)
    device = torch.device(device)
    keep_on = device if hidden_states == "device" else torch.device("cpu")
    rank = du.rank()
    meta = {"format": RESUME_FORMAT, "layer_indices": [m.layer_index for m in moe_layers],
            "num_experts": moe_layers[0].num_experts, "top_k": moe_layers[0].top_k, "num_batches": len(batches),
            "batch_shapes": [list(b["input_ids"].shape) for b in batches]}
    stats = ExpertStatistics.empty(meta["layer_indices"], meta["num_experts"], meta["top_k"])

    if du.is_rank0():
        log.info("layerwise calibration: %d decoder layers, one at a time on %s, %d batches' hidden states on %s",
                 len(layers), device, len(batches), keep_on)
    first_inputs, arguments = capture_layer_inputs(checkpoint, batches, device, keep_on)
    hidden, start = first_inputs, 0
    resume_dir = Path(resume_dir) if resume_dir is not None and resume_every > 0 else None
    if resume_dir is not None:
        files = _resume_files(resume_dir, rank)
        done = _min_over_ranks(max(files, default=-1))
        resumed = _load_resume(files[done], meta, len(batches)) if done >= 0 and done in files else None
        if _min_over_ranks(1 if resumed is not None else 0) == 1:
            stats, saved = resumed
            hidden = [h.to(device=keep_on, dtype=first.dtype) for h, first in zip(saved, first_inputs)]
            start = done + 1
            if du.is_rank0():
                log.info("layerwise calibration: resuming after layer %d of %d (%s)", done, len(layers), resume_dir)
    masks = [b["attention_mask"].bool().reshape(-1) for b in batches]
    bar = tqdm(total=len(layers), initial=start, desc="scoring experts, layer by layer", unit="layer",
               disable=not (progress and du.is_rank0()))
    with torch.no_grad(), ExpertStatsRecorder(model, stats.update) as recorder:
        for index in range(start, len(layers)):
            targets = checkpoint.layer_targets(index)
            checkpoint.materialize(targets, device)
            layer = layers[index]
            _buffers_to(layer.modules(), device)
            for b, calls in enumerate(arguments):
                args, kwargs = calls[index]
                recorder.token_mask = masks[b].to(device)
                out = layer(hidden[b].to(device), *_to(args, device), **_to(kwargs, device))
                if not isinstance(out, torch.Tensor):
                    raise RuntimeError(f"{type(layer).__name__} returns {type(out).__name__}, not the hidden states; "
                                       "use prune.calibration.mode=whole")
                hidden[b] = out.to(keep_on)
            checkpoint.release(targets)
            if resume_dir is not None and ((index + 1) % resume_every == 0 or index == len(layers) - 1):
                _save_resume(resume_dir, rank, index, stats, hidden, meta)
                du.barrier()  # every rank has this layer's point: the older ones can go
                for older, path in _resume_files(resume_dir, rank).items():
                    if older < index:
                        path.unlink(missing_ok=True)
            bar.update(1)
            if after_layer is not None:
                after_layer(index)
    bar.close()
    stats.all_reduce()
    if resume_dir is not None:
        du.barrier()
        for path in _resume_files(resume_dir, rank).values():
            path.unlink(missing_ok=True)
        du.barrier()
        if du.is_rank0():
            _remove_if_empty(resume_dir)
    return stats


def _remove_if_empty(folder: Path) -> None:
    try:
        folder.rmdir()
    except OSError:
        pass


def layerwise_collector(checkpoint, cfg):
    """The statistics collector of the prune app in layerwise mode (`compute_or_load_statistics`'s `collector`): the
    calibration on `cfg.device`, resume points under prune.cache_dir beside the statistics cache, keyed by the
    statistics key, the world size and the batch size; `extra.kill_after_layer` (tests) kills the process there."""
    from slimwise_train.models import resolve_device
    from slimwise_train.testing.faults import FaultHooks

    calibration = cfg.prune.calibration
    hooks = FaultHooks.from_config(cfg.extra) if cfg.get("extra") else None

    def collect(batches, key, progress=True, total=None, num_forwards=None):
        resume_dir = (Path(cfg.prune.cache_dir) / f"{key}.layerwise-w{du.world_size()}-b{int(cfg.data.batch_size)}"
                      if int(calibration.resume_every) > 0 else None)
        return collect_statistics_layerwise(checkpoint, batches, device=resolve_device(cfg.device),
                                            hidden_states=str(calibration.hidden_states), progress=progress,
                                            resume_dir=resume_dir, resume_every=int(calibration.resume_every),
                                            after_layer=hooks.after_layer if hooks else None)

    return collect

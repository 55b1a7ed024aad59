"""The fingerprint of the weights that write a model's KV cache and that pruning and distillation leave alone.

Token embeddings and attention projections (norms excluded: distillation trains them), by sorted name, as float32
values, so storage dtype and GGUF type do not change it. Equal for a teacher, its pruned checkpoints and its
distilled exports (an export whose attention LoRA was merged records its teacher's at export); different for
another model even when every shape matches. `python -m slimwise_train.serve gguf` writes it into the GGUF header
and the llama.cpp handoff compares it (serve/handoff.py).
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Iterable

import torch

_CACHE_TENSOR = re.compile(r"(^|\.)(embed_tokens|self_attn|linear_attn|attn)\.")
_NORM = re.compile(r"norm", re.IGNORECASE)


def is_cache_tensor(name: str) -> bool:
    return bool(_CACHE_TENSOR.search(name)) and not _NORM.search(name)


def canonical_name(name: str) -> str | None:
    """A module parameter's name as a checkpoint stores it (peft's `.base_layer` dropped); None for tensors a
    checkpoint of the stock model does not have (LoRA pairs, the student's deltas)."""
    if "lora_" in name or "slimwise_" in name:
        return None
    return name.replace(".base_layer", "")


_TEXT_MODEL = re.compile(r"(^|\.)language_model\.")


def text_model_name(name: str, multimodal: bool) -> str | None:
    """A checkpoint tensor's name as the causal-LM class that serves the text model loads it: in a multimodal
    checkpoint (Qwen3.5/3.6's and Gemma 4's ConditionalGeneration layout) the text model's tensors sit under a
    `language_model.` component, which that class does not have (`model.language_model.layers.0.` is its
    `model.layers.0.`), and the other towers' tensors (vision, audio) are none of its (None)."""
    if not multimodal:
        return name
    return _TEXT_MODEL.sub(r"\1", name, count=1) if _TEXT_MODEL.search(name) else None


def is_multimodal_layout(names: Iterable[str]) -> bool:
    return any(_TEXT_MODEL.search(name) for name in names)


def cache_fingerprint_of(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """SHA-256 (hex) over the cache tensors among `named` (name, tensor) pairs, in sorted name order."""
    chosen = {name: t for name, t in named if is_cache_tensor(name)}
    if not chosen:
        raise ValueError("no embedding or attention tensors found to fingerprint")
    digest = hashlib.sha256()
    for name in sorted(chosen):
        tensor = chosen[name].detach().to("cpu", torch.float32).contiguous()
        digest.update(name.encode() + b"\0" + str(tuple(tensor.shape)).encode() + b"\0")
        digest.update(tensor.numpy().tobytes())
    return digest.hexdigest()


def model_cache_fingerprint(model: torch.nn.Module) -> str:
    """The fingerprint of an in-memory model (a student before its LoRA is merged: the teacher's attention), over its
    text model's tensors under the causal-LM names (`text_model_name`), as serve/gguf.py's of a checkpoint folder."""
    named = [(canonical_name(n), p) for n, p in model.named_parameters()]
    named = [(n, p) for n, p in named if n is not None]
    multimodal = is_multimodal_layout(n for n, _ in named)
    served = ((text_model_name(n, multimodal), p) for n, p in named)
    return cache_fingerprint_of((n, p) for n, p in served if n is not None)


# --------------------------------------------------------------------------- the weight files of a checkpoint folder
# What a keep set records of the model it was scored on (moe/keepset_rules.py): a byte-identical copy of a checkpoint
# at another path is the same model, a fine-tune at the same path is not. Hashing the files, not the loaded tensors,
# makes the record independent of the dtype a run loads in (prune on a CPU in float32, train on a GPU in bfloat16)
# and lets the check run before the weights load.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def weight_files(folder) -> list:
    """The weight files of a checkpoint folder (its top level: shards sit there), by name; hidden files (a writer's
    temporaries) left out."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir()
                  if p.suffix in WEIGHT_SUFFIXES and not p.name.startswith(".") and p.is_file())


def weight_files_state(folder) -> dict[str, list[int]]:
    """{file name: [size, mtime_ns]} of the weight files: unchanged means not rewritten since (as git's index
    assumes), so a digest recorded with this state holds without reading the files again."""
    return {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in weight_files(folder)}


_DIGESTS: dict[tuple, str] = {}  # (folder, state) -> digest: a process hashes each folder once


def weight_files_digest(folder) -> str | None:
    """SHA-256 (hex) over the weight files' names and bytes, in name order; None for a folder without any. Shows a
    progress bar above 1 GiB (hashing runs at disk speed: about a minute for 60 GB)."""
    from tqdm.auto import tqdm

    files = weight_files(folder)
    if not files:
        return None
    state = tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    key = (os.path.realpath(folder), state)
    if key in _DIGESTS:
        return _DIGESTS[key]
    total = sum(size for _, size, _ in state)
    digest = hashlib.sha256()
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"hashing the weights of {folder}",
              disable=total < 1 << 30) as bar:
        for path in files:
            digest.update(path.name.encode() + b"\0")
            with open(path, "rb") as handle:
                for block in iter(lambda: handle.read(1 << 22), b""):
                    digest.update(block)
                    bar.update(len(block))
    _DIGESTS[key] = digest.hexdigest()
    return _DIGESTS[key]

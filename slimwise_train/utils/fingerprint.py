"""The fingerprint of the weights that write a model's KV cache and that pruning and distillation leave alone.

Token embeddings and attention projections (norms excluded: distillation trains them), by sorted name, as float32
values, so storage dtype and GGUF type do not change it. Equal for a teacher, its pruned checkpoints and its
distilled exports (an export whose attention LoRA was merged records its teacher's at export); different for
another model even when every shape matches. `python -m slimwise_train.serve gguf` writes it into the GGUF header
and the llama.cpp handoff compares it (serve/handoff.py).
"""

from __future__ import annotations

import hashlib
import re
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
    """The fingerprint of an in-memory model (a student before its LoRA is merged: the teacher's attention)."""
    named = ((canonical_name(n), p) for n, p in model.named_parameters())
    return cache_fingerprint_of((n, p) for n, p in named if n is not None)

"""Phase-aware router masking: one model, all experts in prefill, only the kept experts in decode.

    masking = PhaseMasking(model, keep_set)      # installs one forward hook per MoE router
    with masking.phase("prefill"): out = model(prompt, use_cache=True)
    with masking.phase("decode"):  model(next_tokens, past_key_values=out.past_key_values)
    masking.set_phase("auto")      # decide per forward by what it is: one new token per sequence on a
    model.generate(...)             # non-empty cache = decode, anything else = prompt (prefill)

In SlimWise every prompt token is prefill, so "auto" masks only single-token steps on an existing cache: a
second chat turn appended to the cache, or a prompt prefilled in chunks, runs through the full pool. A caller
that prefills a one-token chunk marks it with `with masking.phase("prefill"):` (explicit phases always win).

In the decode phase a removed expert's router logit is -inf *before* the top-k, so it is never selected and
the kept experts' weights are renormalised exactly as in a physically pruned model. In the prefill phase the
hooks return immediately, so switching phase costs one Python attribute read per layer.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from slimwise_train.moe.adapters import MoEAdapter, get_adapter
from slimwise_train.moe.keepset import KeepSet

PHASES = ("prefill", "decode", "auto")


class PhaseMasking:
    def __init__(self, model: nn.Module, keep_set: KeepSet, adapter: MoEAdapter | None = None, phase: str = "prefill"):
        self.adapter = adapter or get_adapter(model)
        keep_set.check_model(model, self.adapter)
        self.model = model
        self.keep_set = keep_set
        self._phase = "prefill"
        self._masking_now = False
        self._handles: list = []
        self._removed: dict[int, torch.Tensor] = {}
        for moe in self.adapter.moe_layers(model):
            device = next(moe.experts.parameters()).device
            self._removed[moe.layer_index] = keep_set.layer(moe.layer_index).removed_mask(device)
            target = self.adapter.mask_hook_target(moe)
            # prepend=True: transformers' own output_router_logits capture hooks must see the masked logits.
            self._handles.append(target.register_forward_hook(self._make_hook(moe), prepend=True))
        self._handles.append(model.register_forward_pre_hook(self._resolve_auto, with_kwargs=True))
        self.set_phase(phase)
        model._slimwise_masking = self

    def _make_hook(self, moe):
        adapter, removed = self.adapter, self._removed[moe.layer_index]

        def hook(module, args, output):
            if not self._masking_now:
                return None
            return adapter.reroute(moe, output, removed)

        return hook

    def _resolve_auto(self, module, args, kwargs):
        if self._phase != "auto":
            return None
        cache = kwargs.get("past_key_values")
        self._masking_now = cache is not None and cache.get_seq_length() > 0 and new_tokens(args, kwargs) == 1
        return None

    # ------------------------------------------------------------------ phase control
    @property
    def current_phase(self) -> str:
        return self._phase

    @property
    def masking_active(self) -> bool:
        return self._masking_now

    def set_phase(self, phase: str) -> None:
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; use one of {PHASES}")
        self._phase = phase
        self._masking_now = phase == "decode"

    @contextlib.contextmanager
    def phase(self, phase: str) -> Iterator["PhaseMasking"]:
        previous = self._phase, self._masking_now
        self.set_phase(phase)
        try:
            yield self
        finally:
            self._phase, self._masking_now = previous

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if getattr(self.model, "_slimwise_masking", None) is self:
            del self.model._slimwise_masking


def new_tokens(args, kwargs) -> int | None:
    """Tokens per sequence this forward adds ([B, T] input_ids or [B, T, H] inputs_embeds -> T)."""
    for value in (kwargs.get("input_ids"), args[0] if args else None, kwargs.get("inputs_embeds")):
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            return int(value.shape[1])
    return None


def get_masking(model: nn.Module) -> PhaseMasking | None:
    return getattr(model, "_slimwise_masking", None)


@contextlib.contextmanager
def model_phase(model: nn.Module, phase: str) -> Iterator[None]:
    """Run `model` in `phase` if it carries phase masking; a no-op for plain (full or pruned) models."""
    masking = get_masking(model)
    if masking is None:
        yield
        return
    with masking.phase(phase):
        yield

"""KV handoff: the full expert pool prefills, a pruned pool decodes over the same cache.

Pruning never touches attention, embeddings or norms, so the cache a full model writes is exactly the cache a
pruned model would expect: there is no conversion. Two forms share these helpers:

* one model with `PhaseMasking` (co-located serving): `prefill_model is decode_model`, phases switch;
* two models (prefill/decode disaggregation): the full model and a physically pruned checkpoint.

Shapes: B batch, S prompt length (left-padded), L continuation length, V vocabulary.
"""

from __future__ import annotations

import copy
import types
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from slimwise_train.moe.masking import model_phase
from slimwise_train.utils.hf import text_config


def make_cache_autograd_safe(cache) -> None:
    """Let gradients flow through a cache that a no-grad prefill wrote (hybrid linear-attention models).

    transformers' `LinearAttentionLayer` updates its conv and recurrent states with in-place `copy_` into the
    tensors that the next chunk read as its initial state, which autograd rejects ("modified by an inplace
    operation") once a trainable continuation runs on the cache. Assigning the new tensor instead keeps the
    values identical and the graph valid. Only affects the given cache object.
    """
    for layer in getattr(cache, "layers", []):
        if not hasattr(layer, "update_recurrent_state") or getattr(layer, "_slimwise_autograd_safe", False):
            continue

        def update_recurrent_state(self, recurrent_states, state_idx=0, **kwargs):
            if not self.is_recurrent_states_initialized[state_idx]:
                self.lazy_initialization(recurrent_states=recurrent_states, state_idx=state_idx)
            self.recurrent_states[state_idx] = recurrent_states
            return recurrent_states

        def update_conv_state(self, conv_states, state_idx=0, conv_kernel_size=None, **kwargs):
            if not self.is_conv_states_initialized[state_idx]:
                self.lazy_initialization(conv_states=conv_states, state_idx=state_idx, conv_kernel_size=conv_kernel_size)
            if not self.has_previous_state[state_idx]:
                full = conv_states
                self.has_previous_state[state_idx] = True
                if not self.record_past and full.shape[-1] < self.conv_kernel_size[state_idx]:
                    full = nn.functional.pad(full, (self.conv_kernel_size[state_idx] - full.shape[-1], 0), value=0)
            else:
                full = torch.cat([self.conv_states[state_idx], conv_states], dim=-1)
            self.conv_states[state_idx] = full if self.record_past else full[..., -self.conv_kernel_size[state_idx]:]
            return full

        layer.update_recurrent_state = types.MethodType(update_recurrent_state, layer)
        layer.update_conv_state = types.MethodType(update_conv_state, layer)
        layer._slimwise_autograd_safe = True


def copy_cache(cache):
    """An independent copy: every forward mutates its cache in place, so reuse of a prefix needs one each time."""
    return copy.deepcopy(cache)


def cache_layer_kinds(model: nn.Module) -> list[str]:
    """Class name of each layer of the DynamicCache `model` fills (DynamicLayer: full attention;
    DynamicSlidingWindowLayer; LinearAttentionLayer: recurrent state updated in place), in layer order."""
    from transformers import DynamicCache

    return [type(layer).__name__ for layer in DynamicCache(config=text_config(model)).layers]


def positions_from_mask(attention_mask: torch.Tensor, past_length: int = 0, new_length: int | None = None) -> torch.Tensor:
    """[B, past+new] 0/1 mask -> [B, new] position ids counting only real tokens (left padding gets 0)."""
    positions = attention_mask.long().cumsum(-1) - 1
    positions = positions.clamp(min=0)
    return positions[:, past_length:] if new_length is None else positions[:, past_length : past_length + new_length]


def prefill(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, phase: str = "prefill"
):
    """Forward over the prompt [B, S] in `phase` (default the full pool). Returns (logits [B, S, V], cache)."""
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    with model_phase(model, phase):
        out = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=positions_from_mask(attention_mask),
            use_cache=True,
        )
    return out.logits, out.past_key_values


def continue_on_cache(
    model: nn.Module,
    cache,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    phase: str = "decode",
):
    """Teacher-forced continuation of L tokens [B, L] in one call on `cache` (mutated in place).

    `attention_mask` covers past + new tokens [B, P+L]; by default every position is real. Returns
    (logits [B, L, V], cache).
    """
    past = cache.get_seq_length()
    batch, length = input_ids.shape
    if attention_mask is None:
        attention_mask = torch.ones(batch, past + length, dtype=torch.long, device=input_ids.device)
    if attention_mask.shape[-1] != past + length:
        raise ValueError(f"attention_mask covers {attention_mask.shape[-1]} positions, expected cache {past} + new {length}")
    with model_phase(model, phase):
        out = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=positions_from_mask(attention_mask, past, length),
            past_key_values=cache,
            use_cache=True,
        )
    return out.logits, out.past_key_values


@dataclass
class GenerationResult:
    """tokens [B, N] (pad after EOS), lengths [B] (tokens incl. EOS), ended [B] bool (EOS before budget),
    first_token [B] (the token the prefill pool chose)."""

    tokens: torch.Tensor
    lengths: torch.Tensor
    ended: torch.Tensor
    first_token: torch.Tensor
    stopped: torch.Tensor | None = None  # [B] bool: ended by `stop_fn` (a stop string), not by EOS or the budget

    @property
    def hit_budget(self) -> torch.Tensor:
        return ~self.ended if self.stopped is None else ~self.ended & ~self.stopped


@torch.no_grad()
def handoff_generate(
    prefill_model: nn.Module,
    decode_model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    max_new_tokens: int,
    eos_token_id: int | list[int],
    pad_token_id: int = 0,
    *,
    prefill_phase: str = "prefill",
    decode_phase: str = "decode",
    stop_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> GenerationResult:
    """Batched greedy generation: `prefill_model` reads the left-padded prompt [B, S] and picks the first
    token; `decode_model` produces the rest over the same cache.

    Pass the same masked model twice for phase-aware masking (it prefills in the prefill phase and decodes in
    the decode phase), the full model and a pruned checkpoint for disaggregation, or the full model twice.
    `prefill_phase`/`decode_phase` pick the masking phase of each part for a masked model (ignored by plain
    models): ("decode", "decode") runs pruned throughout, ("decode", "prefill") prefills pruned and decodes full.
    `stop_fn(tokens [B, n], active [B]) -> [B] bool` is asked after every step for the rows still running: True
    ends a row there (stop strings); such a row is not `ended` (no EOS) and its length counts the tokens made.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    eos = torch.tensor([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id), device=input_ids.device)
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    logits, cache = prefill(prefill_model, input_ids, attention_mask, phase=prefill_phase)
    next_token = logits[:, -1].argmax(-1)
    first_token = next_token.clone()
    batch = input_ids.shape[0]
    tokens = torch.full((batch, max_new_tokens), pad_token_id, dtype=torch.long, device=input_ids.device)
    done = torch.zeros(batch, dtype=torch.bool, device=input_ids.device)
    lengths = torch.full((batch,), max_new_tokens, dtype=torch.long, device=input_ids.device)
    stopped_early = torch.zeros(batch, dtype=torch.bool, device=input_ids.device)
    mask = attention_mask
    for step in range(max_new_tokens):
        tokens[:, step] = torch.where(done, torch.full_like(next_token, pad_token_id), next_token)
        just_ended = ~done & torch.isin(next_token, eos)
        lengths = torch.where(just_ended, torch.full_like(lengths, step + 1), lengths)
        done = done | just_ended
        if stop_fn is not None:
            stopped = ~done & stop_fn(tokens[:, : step + 1], ~done)
            lengths = torch.where(stopped, torch.full_like(lengths, step + 1), lengths)
            stopped_early = stopped_early | stopped
            done = done | stopped
        if bool(done.all()) or step + 1 == max_new_tokens:
            break
        mask = torch.cat([mask, torch.ones(batch, 1, dtype=mask.dtype, device=mask.device)], dim=-1)
        logits, cache = continue_on_cache(decode_model, cache, next_token[:, None], mask, phase=decode_phase)
        next_token = logits[:, -1].argmax(-1)
    return GenerationResult(tokens=tokens, lengths=lengths, ended=done & ~stopped_early, first_token=first_token,
                            stopped=stopped_early)

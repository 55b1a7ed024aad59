"""The training objective: the named terms of `distill.loss.terms`, weighted and summed in ONE place.

    objective = Objective.from_config(cfg.distill.loss)        # terms {name: weight}, top_k, chunk_size
    out = objective(student_logits, teacher_logits, labels, num_tokens_global=n)
    out.loss                    # [] fp32, differentiable: sum_name weight x sum_name / n
    out.sums                    # {name: [] detached local sum}: every term, then what the terms report beside them
    objective.total(means)      # the same weighted sum over logged (all-reduced) means: the logged loss

The terms themselves (pure tensor functions returning sums) and their registry are in `distill/losses.py`; the
trainer all-reduces `out.sums` and logs each one by name. A term at weight 0 is off (not computed, not logged), so
`distill.loss.terms.kl=0 +distill.loss.terms.full_kl=0.9` swaps the KL for the dense one.
"""

from __future__ import annotations

import math
from typing import Mapping, NamedTuple

import torch
from torch import Tensor

from slimwise_train.distill.losses import IGNORE_INDEX, TERMS, compute_terms, get_term, prepare_inputs

__all__ = ["DEFAULT_TERMS", "LossOutput", "Objective", "check_loss_config", "distill_loss", "loss_memory_bytes"]

DEFAULT_TERMS = {"ce": 0.1, "kl": 0.9}  # the schema's default (config.LossConfig)


def check_loss_config(loss_cfg, key: str = "distill.loss") -> None:
    """Refuse a `distill.loss` no run can use, in one line naming the key: an unknown term (with the known ones), a
    weight that is not a finite number >= 0, every weight 0, top_k or chunk_size < 1. Needs neither model nor data."""
    _check_terms(loss_cfg.get("terms"), f"{key}.terms")
    for name in ("top_k", "chunk_size"):
        value = loss_cfg.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{key}.{name}={value} is invalid: it must be an integer >= 1; e.g. {key}.{name}="
                             f"{64 if name == 'top_k' else 1024}")


def _check_terms(terms, key: str) -> None:
    if not terms:
        raise ValueError(f"{key} is empty: name at least one term and its weight; e.g. {key}.kl=0.9")
    for name, weight in terms.items():
        if name not in TERMS:
            raise ValueError(f"unknown {key} key {name!r}; known terms: {', '.join(sorted(TERMS))}")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight < 0:
            raise ValueError(f"{key}.{name}={weight} is invalid: it must be a finite number >= 0; "
                             f"e.g. {key}.{name}={DEFAULT_TERMS.get(name, 0.1)}")
    if not any(weight > 0 for weight in terms.values()):
        raise ValueError(f"every {key} weight is 0, so the loss is 0; e.g. {key}.kl=0.9")


class LossOutput(NamedTuple):
    """One micro-batch's loss. loss: [] fp32 differentiable; sums: {name: [] detached LOCAL sum}; num_tokens: []
    int64 local valid count; denom: [] fp32, the count the loss was divided by."""

    loss: Tensor
    sums: dict[str, Tensor]
    num_tokens: Tensor
    denom: Tensor

    def means(self) -> dict[str, Tensor]:
        return {name: value / self.denom for name, value in self.sums.items()}


class Objective:
    """sum over the terms of weight x (the term's sum over valid tokens) / the global token count."""

    def __init__(self, terms: Mapping[str, float] = DEFAULT_TERMS, *, top_k: int = 64, chunk_size: int = 1024):
        _check_terms(terms, "terms")
        # weight 0 = off; the order of `terms` is the order of the sum (and of the logged metrics)
        self.weights = {name: float(w) for name, w in terms.items() if float(w) > 0}
        self.top_k, self.chunk_size = top_k, chunk_size

    @classmethod
    def from_config(cls, loss_cfg, key: str = "distill.loss") -> "Objective":
        check_loss_config(loss_cfg, key)
        return cls(dict(loss_cfg.terms), top_k=int(loss_cfg.top_k), chunk_size=int(loss_cfg.chunk_size))

    @property
    def terms(self) -> list[str]:
        return list(self.weights)

    def total(self, values: Mapping):
        """The weighted sum of the terms in `values` (tensors or floats: sums or means alike). The one place the
        objective's terms are combined: the differentiable loss and every logged loss come from here."""
        parts = [weight * values[name] for name, weight in self.weights.items()]
        total = parts[0]
        for part in parts[1:]:
            total = total + part
        return total

    def __call__(self, student_logits: Tensor, teacher_logits: Tensor, labels: Tensor, *,
                 num_tokens_global: int | Tensor | None = None, mask: Tensor | None = None,
                 ignore_index: int = IGNORE_INDEX) -> LossOutput:
        """student_logits, teacher_logits [N, V] (or [..., V]), labels [N] (ignore_index = skip), mask [N] bool.

        num_tokens_global: the valid tokens of the whole optimizer step (all ranks, all micro-batches); None: the
        local count (one process). Clamped to >= 1, so an all-padding batch gives loss 0 (still in the graph)."""
        inputs = prepare_inputs(student_logits, teacher_logits, labels, mask=mask, top_k=self.top_k,
                                chunk_size=self.chunk_size, ignore_index=ignore_index)
        sums = compute_terms(inputs, self.terms)
        count = inputs.valid.sum()
        denom = _denominator(num_tokens_global, count, inputs.student.device)
        loss = self.total(sums) / denom
        return LossOutput(loss, {name: value.detach() for name, value in sums.items()}, count, denom)


def _denominator(num_tokens_global, count: Tensor, device) -> Tensor:
    if num_tokens_global is None:
        denom = count
    elif isinstance(num_tokens_global, Tensor):
        if num_tokens_global.numel() != 1:
            raise ValueError(f"num_tokens_global must be a scalar, got shape {tuple(num_tokens_global.shape)}")
        denom = num_tokens_global.reshape(()).to(device)
    else:
        if isinstance(num_tokens_global, bool) or not isinstance(num_tokens_global, int) or num_tokens_global < 0:
            raise ValueError(f"num_tokens_global must be a non-negative int, got {num_tokens_global!r}")
        denom = torch.tensor(num_tokens_global, device=device)
    return denom.to(torch.float32).clamp(min=1.0)


def distill_loss(student_logits: Tensor, teacher_logits: Tensor, labels: Tensor, *,
                 terms: Mapping[str, float] = DEFAULT_TERMS, top_k: int = 64, chunk_size: int = 1024,
                 mask: Tensor | None = None, num_tokens_global: int | Tensor | None = None,
                 ignore_index: int = IGNORE_INDEX) -> dict[str, Tensor]:
    """`Objective(terms, top_k, chunk_size)` in one call, as a flat dict of 0-dim tensors:

        loss            fp32, differentiable: sum_name terms[name] x sum_name / num_tokens_global
        <name>          detached, sum / num_tokens_global, for every term and what it reports (residual masses)
        <name>_sum      detached local sums, for callers that re-normalise
        num_tokens      int64, the LOCAL valid-token count (all-reduce SUM it for the global)
    Every normalised value uses the same denominator, so an all-reduce SUM across ranks of any logged value gives its
    global per-token mean."""
    out = Objective(terms, top_k=top_k, chunk_size=chunk_size)(
        student_logits, teacher_logits, labels, num_tokens_global=num_tokens_global, mask=mask,
        ignore_index=ignore_index)
    return {"loss": out.loss, **out.means(), **{f"{k}_sum": v for k, v in out.sums.items()},
            "num_tokens": out.num_tokens}


def loss_memory_bytes(loss_cfg, rows: int, vocab: int, device_type: str) -> dict[str, int]:
    """What the objective of `loss_cfg` (distill.loss) holds on `rows` rows beyond the logits and their gradient, by
    part ({'loss_scratch', 'loss_row_statistics'}): each active term group's own estimate (`TermGroup.memory`); a
    group registered without one counts 0."""
    objective = Objective.from_config(loss_cfg)
    total = {"loss_scratch": 0, "loss_row_statistics": 0}
    for group in dict.fromkeys(get_term(name) for name in objective.terms):
        if group.memory is not None:
            names = frozenset(n for n in objective.terms if n in group.names)
            for part, value in group.memory(names, rows, vocab, device_type, objective.top_k,
                                            objective.chunk_size).items():
                total[part] = total.get(part, 0) + int(value)
    return total

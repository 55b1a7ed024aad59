"""Distillation losses: CE on data tokens plus KL(teacher || student).

All functions are pure tensor functions. They return SUMS over valid tokens plus the local
token count (``LossSums``), never means, so the trainer can normalise by the GLOBAL number
of continuation tokens across data-parallel ranks (and gradient-accumulation micro-batches).
``distill_loss`` does the weighting and normalisation given that global count.

Shapes (leading dims are flattened, so ``[B, T, V]`` logits with ``[B, T]`` labels also work):

    student_logits  [N, V]  any float dtype; gradients flow here only
    teacher_logits  [N, V]  any float dtype; treated as a fixed target (detached)
    labels          [N]     int; ``ignore_index`` (-100) marks padding / no next token
    mask            [N]     bool, optional; further restricts the valid positions

Valid positions are ``labels != ignore_index`` (all positions if labels is None for the KL
losses), AND-ed with ``mask`` when given. Invalid positions contribute to no term, not to
the count and get exactly zero gradient, even when their logits are NaN/inf (some attention
kernels produce NaN on fully masked padding rows; we overwrite those rows before softmax).

Memory: tokens are processed in chunks of ``chunk_size`` rows, so only about one chunk of
``[chunk_size, V]`` fp32 temporaries is alive at a time (a few of them, roughly 4-6 x
chunk_size x V x 4 bytes; 1024 x 151936 fp32 is ~0.6 GB each). When the student needs
gradients each chunk runs under non-reentrant ``torch.utils.checkpoint``: the forward keeps
only the chunk's inputs (views into the caller's logits, no copies) and the scalar outputs;
the backward recomputes one chunk's fp32 intermediates at a time and frees them before the
next chunk. The price is running the loss forward twice, which is cheap next to the model.
The gradient w.r.t. the student logits itself is a full ``[N, V]`` tensor in the student's
dtype; that is inherent unless the loss is fused with the lm_head.

Pass logits as produced (contiguous) and shift the LABELS, not the logits: slicing the
logits (``logits[:, :-1]``) makes them non-contiguous and the flattening below then copies
the whole ``[N, V]`` tensor.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

__all__ = [
    "IGNORE_INDEX",
    "LossSums",
    "LOSSES",
    "KL_LOSSES",
    "cross_entropy",
    "full_kl",
    "topk_residual_kl",
    "distill_loss",
    "get_loss",
]

IGNORE_INDEX = -100


class LossSums(NamedTuple):
    """Un-normalised result of one loss over the local tokens.

    sum                    [] fp32, differentiable w.r.t. student_logits: sum over valid tokens
    count                  [] int64: number of valid tokens on this rank
    residual_mass_teacher  [] fp32, detached: sum over valid tokens of T_res (0 if no bucket)
    residual_mass_student  [] fp32, detached: sum over valid tokens of S_res (0 if no bucket)
    """

    sum: Tensor
    count: Tensor
    residual_mass_teacher: Tensor
    residual_mass_student: Tensor


# --------------------------------------------------------------------------------------
# Input checking
# --------------------------------------------------------------------------------------


def _check_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


def _prepare(
    student_logits: Tensor,
    teacher_logits: Tensor | None,
    labels: Tensor | None,
    mask: Tensor | None,
    ignore_index: int,
    need_labels: bool,
    need_teacher: bool,
) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
    """Validate and flatten inputs.

    Returns (student [N, V], teacher [N, V] detached or None, safe_labels [N] int64 with
    invalid positions set to 0, valid [N] bool).
    """
    if not isinstance(student_logits, Tensor) or student_logits.dim() < 2:
        raise ValueError(
            "student_logits must be a tensor of shape [N, V] (or [..., V]), got "
            f"{getattr(student_logits, 'shape', type(student_logits).__name__)}"
        )
    if not student_logits.is_floating_point():
        raise ValueError(f"student_logits must be floating point, got {student_logits.dtype}")
    lead = tuple(student_logits.shape[:-1])
    vocab = student_logits.shape[-1]
    if vocab < 1:
        raise ValueError("student_logits has an empty vocabulary dimension (V == 0)")

    teacher = None
    if need_teacher:
        if teacher_logits is None:
            raise ValueError("teacher_logits is required for a KL loss; pass the teacher's [N, V] logits")
        if tuple(teacher_logits.shape) != tuple(student_logits.shape):
            raise ValueError(
                f"teacher_logits shape {tuple(teacher_logits.shape)} != student_logits shape "
                f"{tuple(student_logits.shape)}; both must be [N, V] over the same vocabulary "
                "(slice padded vocab columns to a common V first)"
            )
        if not teacher_logits.is_floating_point():
            raise ValueError(f"teacher_logits must be floating point, got {teacher_logits.dtype}")
        if teacher_logits.device != student_logits.device:
            raise ValueError(
                f"teacher_logits on {teacher_logits.device} but student_logits on "
                f"{student_logits.device}; move them to the same device"
            )
        # Targets only: no gradient may reach the teacher.
        teacher = teacher_logits.detach().reshape(-1, vocab)

    device = student_logits.device
    if labels is None:
        if need_labels:
            raise ValueError("labels are required for cross entropy; pass [N] int labels with -100 = ignore")
        valid = torch.ones(lead, dtype=torch.bool, device=device)
        safe_labels = torch.zeros(lead, dtype=torch.long, device=device)
    else:
        if tuple(labels.shape) != lead:
            raise ValueError(
                f"labels shape {tuple(labels.shape)} must equal the logits' leading shape {lead}"
            )
        if labels.dtype.is_floating_point or labels.dtype == torch.bool:
            raise ValueError(f"labels must be an integer tensor, got {labels.dtype}")
        labels = labels.to(device=device, dtype=torch.long)
        valid = labels != ignore_index
        safe_labels = torch.where(valid, labels, torch.zeros_like(labels))

    if mask is not None:
        if tuple(mask.shape) != lead:
            raise ValueError(f"mask shape {tuple(mask.shape)} must equal the logits' leading shape {lead}")
        if mask.dtype != torch.bool:
            raise ValueError(f"mask must be a bool tensor, got {mask.dtype}")
        valid = valid & mask.to(device)

    return (
        student_logits.reshape(-1, vocab),
        teacher,
        safe_labels.reshape(-1),
        valid.reshape(-1),
    )


# --------------------------------------------------------------------------------------
# Per-chunk kernel
# --------------------------------------------------------------------------------------

_NEG_INF = float("-inf")


def _xlogx_ratio(p: Tensor, log_p: Tensor, log_q: Tensor) -> Tensor:
    """p * (log_p - log_q) with the convention 0 * log 0 = 0 (also when log_q = -inf).

    The double ``where`` keeps the unselected branch finite so no NaN leaks into backward.
    """
    pos = p > 0
    diff = torch.where(pos, log_p - log_q, torch.zeros_like(log_p))
    return torch.where(pos, p * diff, torch.zeros_like(p))


def _chunk_sums(
    s_chunk: Tensor,
    t_chunk: Tensor | None,
    labels_chunk: Tensor,
    valid_chunk: Tensor,
    kl_mode: str,
    top_k: int,
    want_ce: bool,
) -> Tensor:
    """Loss sums over one chunk of rows.

    s_chunk [C, V], t_chunk [C, V] or None, labels_chunk [C] int64 (already safe),
    valid_chunk [C] bool. kl_mode is "none", "full" or "topk".
    Returns [4] fp32: (ce_sum, kl_sum, teacher_residual_sum, student_residual_sum).
    """
    invalid = ~valid_chunk[:, None]
    # fp32 softmax. masked_fill makes invalid rows a harmless uniform distribution (their
    # logits may be NaN/inf on padding) and gives them exactly zero gradient.
    s = s_chunk.float().masked_fill(invalid, 0.0)
    s_lse = torch.logsumexp(s, dim=-1)  # [C]
    zero_rows = torch.zeros_like(s_lse)

    if want_ce:
        target = s.gather(-1, labels_chunk[:, None]).squeeze(-1)
        ce_rows = torch.where(valid_chunk, s_lse - target, zero_rows)
    else:
        ce_rows = zero_rows

    kl_rows = zero_rows
    t_res_rows = zero_rows
    s_res_rows = zero_rows
    if kl_mode != "none":
        assert t_chunk is not None
        t = t_chunk.float().masked_fill(invalid, 0.0)
        t_lse = torch.logsumexp(t, dim=-1)  # [C]
        vocab = s.shape[-1]
        if kl_mode == "full" or top_k >= vocab:
            # k >= V: the residual bucket is empty and the loss is exactly the full KL.
            log_t = t - t_lse[:, None]
            log_s = s - s_lse[:, None]
            kl_rows = _xlogx_ratio(log_t.exp(), log_t, log_s).sum(-1)
        else:
            t_top, idx = t.topk(top_k, dim=-1, sorted=False)  # [C, k]
            log_t_k = t_top - t_lse[:, None]
            log_s_k = s.gather(-1, idx) - s_lse[:, None]
            kl_rows = _xlogx_ratio(log_t_k.exp(), log_t_k, log_s_k).sum(-1)
            # Residual bucket via the logsumexp of the complement logits (top-k set to -inf)
            # minus the full logsumexp: log R = lse(x[~K]) - lse(x). Unlike log1p(-sum_K p)
            # this has no cancellation when the residual mass is tiny (peaked teacher, or a
            # student that already puts nearly all mass on K), and it is exact in fp32.
            # T_res = 0 (teacher complement all -inf) is handled by 0 log 0 = 0 in
            # _xlogx_ratio. The student's complement is never all -inf for finite student
            # logits, so its backward is finite.
            log_t_res = torch.logsumexp(t.scatter(-1, idx, _NEG_INF), dim=-1) - t_lse
            log_s_res = torch.logsumexp(s.scatter(-1, idx, _NEG_INF), dim=-1) - s_lse
            t_res = log_t_res.exp()
            kl_rows = kl_rows + _xlogx_ratio(t_res, log_t_res, log_s_res)
            t_res_rows = torch.where(valid_chunk, t_res, zero_rows).detach()
            s_res_rows = torch.where(valid_chunk, log_s_res.exp(), zero_rows).detach()
        kl_rows = torch.where(valid_chunk, kl_rows, zero_rows)

    return torch.stack([ce_rows.sum(), kl_rows.sum(), t_res_rows.sum(), s_res_rows.sum()])


def _chunked_sums(
    student: Tensor,
    teacher: Tensor | None,
    safe_labels: Tensor,
    valid: Tensor,
    *,
    kl_mode: str,
    top_k: int,
    want_ce: bool,
    chunk_size: int,
) -> Tensor:
    """Sum ``_chunk_sums`` over row chunks. Inputs are flattened [N, V] / [N]. Returns [4]."""
    use_ckpt = torch.is_grad_enabled() and student.requires_grad
    n = student.shape[0]
    # torch.split (not per-chunk slicing) so the backward concatenates the chunk gradients
    # once instead of materialising a zero-filled [N, V] gradient per chunk.
    s_chunks = torch.split(student, chunk_size, dim=0)
    t_chunks = torch.split(teacher, chunk_size, dim=0) if teacher is not None else [None] * len(s_chunks)
    l_chunks = torch.split(safe_labels, chunk_size, dim=0)
    v_chunks = torch.split(valid, chunk_size, dim=0)

    total = torch.zeros(4, dtype=torch.float32, device=student.device)
    if n == 0:
        # Keep the result attached to the graph so backward() on an empty batch still works.
        return total + student.float().sum() * 0.0
    for s_c, t_c, l_c, v_c in zip(s_chunks, t_chunks, l_chunks, v_chunks):
        if use_ckpt:
            # Non-reentrant checkpoint saves only the inputs (views, no copies); the chunk's
            # [C, V] fp32 intermediates are recomputed during backward, one chunk at a time.
            part = checkpoint(
                _chunk_sums, s_c, t_c, l_c, v_c, kl_mode, top_k, want_ce,
                use_reentrant=False, preserve_rng_state=False,
            )
        else:
            part = _chunk_sums(s_c, t_c, l_c, v_c, kl_mode, top_k, want_ce)
        total = total + part
    return total


def _as_loss_sums(total: Tensor, valid: Tensor, index: int) -> LossSums:
    return LossSums(
        sum=total[index],
        count=valid.sum(),
        residual_mass_teacher=total[2].detach(),
        residual_mass_student=total[3].detach(),
    )


# --------------------------------------------------------------------------------------
# Public losses (registry entries share one signature; unused arguments are ignored)
# --------------------------------------------------------------------------------------


def cross_entropy(
    student_logits: Tensor,
    teacher_logits: Tensor | None = None,
    labels: Tensor | None = None,
    *,
    mask: Tensor | None = None,
    top_k: int = 64,
    chunk_size: int = 1024,
    ignore_index: int = IGNORE_INDEX,
) -> LossSums:
    """Summed fp32 cross entropy of the student on the data tokens.

    student_logits [N, V], labels [N] (required; ignore_index = skip), mask [N] bool optional.
    teacher_logits and top_k are accepted for the registry's common signature and ignored.
    Returns LossSums(sum=sum of -log S[label] over valid tokens, count=#valid, residuals 0).
    """
    _check_positive_int("chunk_size", chunk_size)
    student, _, safe_labels, valid = _prepare(
        student_logits, None, labels, mask, ignore_index, need_labels=True, need_teacher=False
    )
    total = _chunked_sums(
        student, None, safe_labels, valid, kl_mode="none", top_k=1, want_ce=True, chunk_size=chunk_size
    )
    return _as_loss_sums(total, valid, 0)


def full_kl(
    student_logits: Tensor,
    teacher_logits: Tensor,
    labels: Tensor | None = None,
    *,
    mask: Tensor | None = None,
    top_k: int = 64,
    chunk_size: int = 1024,
    ignore_index: int = IGNORE_INDEX,
) -> LossSums:
    """Summed dense KL(T || S) = sum_v T_v (log T_v - log S_v) over the full vocabulary.

    student_logits [N, V], teacher_logits [N, V], labels [N] optional (only used for the
    ignore mask), mask [N] bool optional. top_k is ignored (registry signature). fp32,
    chunked like the other losses. Baseline for benchmarks against topk_residual_kl.
    """
    _check_positive_int("chunk_size", chunk_size)
    student, teacher, safe_labels, valid = _prepare(
        student_logits, teacher_logits, labels, mask, ignore_index, need_labels=False, need_teacher=True
    )
    total = _chunked_sums(
        student, teacher, safe_labels, valid, kl_mode="full", top_k=1, want_ce=False, chunk_size=chunk_size
    )
    return _as_loss_sums(total, valid, 1)


def topk_residual_kl(
    student_logits: Tensor,
    teacher_logits: Tensor,
    labels: Tensor | None = None,
    *,
    mask: Tensor | None = None,
    top_k: int = 64,
    chunk_size: int = 1024,
    ignore_index: int = IGNORE_INDEX,
) -> LossSums:
    """Summed KL(T || S) over the teacher's top-k tokens plus one residual bucket.

    student_logits [N, V], teacher_logits [N, V], labels [N] optional (only used for the
    ignore mask), mask [N] bool optional.

    Per token, with K = indices of the teacher's top-k logits (k clipped to V):
        KL = sum_{i in K} T_i (log T_i - log S_i) + T_res (log T_res - log S_res)
        T_res = 1 - sum_K T_i,  S_res = 1 - sum_K S_i  (computed as complement logsumexp)
    With k >= V the bucket is empty and this is exactly full_kl. 0 log 0 = 0. Ties in the
    teacher's logits at the k-th position are broken by torch.topk. By the data-processing
    inequality this is <= full_kl for every token.
    """
    _check_positive_int("top_k", top_k)
    _check_positive_int("chunk_size", chunk_size)
    student, teacher, safe_labels, valid = _prepare(
        student_logits, teacher_logits, labels, mask, ignore_index, need_labels=False, need_teacher=True
    )
    total = _chunked_sums(
        student, teacher, safe_labels, valid, kl_mode="topk", top_k=top_k, want_ce=False, chunk_size=chunk_size
    )
    return _as_loss_sums(total, valid, 1)


LossFn = Callable[..., LossSums]

# name -> fn(student_logits, teacher_logits, labels, *, mask, top_k, chunk_size, ignore_index)
LOSSES: dict[str, LossFn] = {
    "topk_residual_kl": topk_residual_kl,
    "full_kl": full_kl,
    "ce": cross_entropy,
}
# The KL variants distill_loss can use for its KL term, mapped to the fused kernel's mode.
KL_LOSSES: dict[str, str] = {"topk_residual_kl": "topk", "full_kl": "full"}


def get_loss(name: str) -> LossFn:
    """Look up a loss by name; raises ValueError listing the known names."""
    try:
        return LOSSES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown loss {name!r}; known losses: {', '.join(sorted(LOSSES))}") from None


# --------------------------------------------------------------------------------------
# Weighted, normalised training loss
# --------------------------------------------------------------------------------------


def distill_loss(
    student_logits: Tensor,
    teacher_logits: Tensor,
    labels: Tensor,
    *,
    mask: Tensor | None = None,
    top_k: int = 64,
    ce_weight: float = 0.1,
    kl_weight: float = 0.9,
    chunk_size: int = 1024,
    num_tokens_global: int | Tensor | None = None,
    kl_loss: str = "topk_residual_kl",
    ignore_index: int = IGNORE_INDEX,
) -> dict[str, Tensor]:
    """loss = (ce_weight * CE_sum + kl_weight * KL_sum) / num_tokens_global.

    student_logits [N, V], teacher_logits [N, V], labels [N] (ignore_index = skip),
    mask [N] bool optional. CE and KL are computed in ONE fused chunked pass (the student's
    logsumexp is shared), with kl_loss in {"topk_residual_kl", "full_kl"}.

    num_tokens_global: the number of valid tokens summed over all data-parallel ranks (and
    all micro-batches of the optimizer step); None means the local count (single process).
    It is clamped to >= 1 so an all-padding batch gives loss 0 (still attached to the graph).

    Returns a dict of 0-dim tensors:
        loss                   fp32, differentiable: the weighted, normalised scalar
        ce, kl                 detached, each sum / num_tokens_global (unweighted)
        residual_mass_teacher  detached, sum of T_res / num_tokens_global
        residual_mass_student  detached, sum of S_res / num_tokens_global
        num_tokens             int64, LOCAL valid-token count (all-reduce SUM it for the global)
        ce_sum, kl_sum         detached local sums, for callers that re-normalise
    Every normalised value uses the same denominator, so an all-reduce SUM across ranks of any
    logged value gives its global per-token mean.
    """
    if kl_loss not in KL_LOSSES:
        raise ValueError(f"kl_loss must be one of {', '.join(sorted(KL_LOSSES))}, got {kl_loss!r}")
    _check_positive_int("top_k", top_k)
    _check_positive_int("chunk_size", chunk_size)
    for name, w in (("ce_weight", ce_weight), ("kl_weight", kl_weight)):
        if not isinstance(w, (int, float)) or isinstance(w, bool) or not w >= 0:
            raise ValueError(f"{name} must be a non-negative number, got {w!r}")

    student, teacher, safe_labels, valid = _prepare(
        student_logits, teacher_logits, labels, mask, ignore_index, need_labels=True, need_teacher=True
    )
    total = _chunked_sums(
        student, teacher, safe_labels, valid,
        kl_mode=KL_LOSSES[kl_loss], top_k=top_k, want_ce=True, chunk_size=chunk_size,
    )
    count = valid.sum()

    if num_tokens_global is None:
        denom = count
    elif isinstance(num_tokens_global, Tensor):
        if num_tokens_global.numel() != 1:
            raise ValueError(f"num_tokens_global must be a scalar, got shape {tuple(num_tokens_global.shape)}")
        denom = num_tokens_global.reshape(()).to(student.device)
    else:
        if isinstance(num_tokens_global, bool) or not isinstance(num_tokens_global, int) or num_tokens_global < 0:
            raise ValueError(f"num_tokens_global must be a non-negative int, got {num_tokens_global!r}")
        denom = torch.tensor(num_tokens_global, device=student.device)
    denom = denom.to(torch.float32).clamp(min=1.0)

    ce_sum, kl_sum = total[0], total[1]
    loss = (ce_weight * ce_sum + kl_weight * kl_sum) / denom
    return {
        "loss": loss,
        "ce": (ce_sum / denom).detach(),
        "kl": (kl_sum / denom).detach(),
        "residual_mass_teacher": (total[2] / denom).detach(),
        "residual_mass_student": (total[3] / denom).detach(),
        "num_tokens": count,
        "ce_sum": ce_sum.detach(),
        "kl_sum": kl_sum.detach(),
    }

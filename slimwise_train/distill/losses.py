"""Distillation losses: CE on data tokens plus KL(teacher || student), and the registry of named terms.

All functions are pure tensor functions. They return SUMS over valid tokens (the standalone
losses also the local token count, ``LossSums``), never means, so the trainer can normalise by
the GLOBAL number of continuation tokens across data-parallel ranks (and gradient-accumulation
micro-batches). ``distill/objective.py`` weights the terms named in ``distill.loss.terms`` and
does that normalisation.

Terms (``TERMS``, picked by name): ``ce``, ``kl`` (top-k + residual) and ``full_kl`` come from
one fused pass (``ce_and_kl``). A new term is one function here::

    @register_term("l2")
    def l2(x: LossInputs) -> Tensor:
        # sum over the valid rows of ||S - T||^2 / V on the logits x.student, x.teacher [N, V]
        d = (x.student.float() - x.teacher.float()).pow(2).mean(-1)
        return torch.where(x.valid, d, torch.zeros_like(d)).sum()

and one config entry (``distill.loss.terms.l2=0.01``, or a line in conf/distill/default.yaml).

Shapes (leading dims are flattened, so ``[B, T, V]`` logits with ``[B, T]`` labels also work):

    student_logits  [N, V]  any float dtype; gradients flow here only
    teacher_logits  [N, V]  any float dtype; treated as a fixed target (detached)
    labels          [N]     int; ``ignore_index`` (-100) marks padding / no next token
    mask            [N]     bool, optional; further restricts the valid positions

Valid positions are ``labels != ignore_index`` (all positions if labels is None for the KL
losses), AND-ed with ``mask`` when given. Invalid positions contribute to no term, not to
the count and get exactly zero gradient, even when their logits are NaN/inf (some attention
kernels produce NaN on fully masked padding rows; their per-row results are selected away,
never multiplied, and their gradient rows are overwritten with zeros).

Speed and memory: CE and KL are one fused ``torch.autograd.Function`` with an analytic
gradient (no autograd graph over the vocabulary, no recompute). The forward walks the rows in
blocks (``chunk_size`` rows on accelerators; on CPU fewer, ~4 MiB of fp32, so the block stays
in cache) through ONE reused fp32 scratch block of ``[rows, V]`` (two for the full KL): the
teacher's top-k and complement logsumexp, then the student's. It keeps for backward only the
caller's student logits (a view, no copy; plus the teacher's for the full KL) and per-row
statistics (logsumexps, the teacher's top-k indices and probabilities, T_res, S_res). The
backward makes one pass over the student logits per block and writes the gradient straight
into the ``[N, V]`` result in the student's dtype; that gradient is the only ``[N, V]``-sized
allocation (inherent unless the loss is fused with the lm_head). ``ce_sum`` and ``kl_sum`` each
carry their own gradient, so any combination of them backpropagates exactly.

Pass logits as produced (contiguous) and shift the LABELS, not the logits: slicing the
logits (``logits[:, :-1]``) makes them non-contiguous and the flattening below then copies
the whole ``[N, V]`` tensor.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

__all__ = [
    "IGNORE_INDEX",
    "LossInputs",
    "LossSums",
    "TERMS",
    "ce_and_kl",
    "compute_terms",
    "cross_entropy",
    "full_kl",
    "get_term",
    "prepare_inputs",
    "register_term",
    "register_terms",
    "topk_residual_kl",
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
# Fused kernel: forward sums + analytic gradient
# --------------------------------------------------------------------------------------

_NEG_INF = float("-inf")

# On CPU the rows are processed in blocks of about this many elements (4 MiB of fp32), so a
# block's scratch stays in cache, is reused across blocks (no page faults from fresh large
# allocations) and each elementwise pass costs ~nothing in memory traffic. On accelerators a
# block is the caller's chunk_size (fewer, larger kernels).
_CPU_BLOCK_ELEMENTS = 1 << 20


def _block_rows(device: torch.device, vocab: int, chunk_size: int) -> int:
    if device.type == "cpu":
        return max(1, min(chunk_size, _CPU_BLOCK_ELEMENTS // max(vocab, 1)))
    return chunk_size


def _xlogx_ratio(p: Tensor, log_p: Tensor, log_q: Tensor) -> Tensor:
    """p * (log_p - log_q) with the convention 0 * log 0 = 0 (also when log_q = -inf)."""
    pos = p > 0
    diff = torch.where(pos, log_p - log_q, torch.zeros_like(log_p))
    return torch.where(pos, p * diff, torch.zeros_like(p))


def _lse_(x: Tensor) -> Tensor:
    """Row logsumexp of an fp32 scratch tensor [C, V], overwriting it. All -inf rows give -inf."""
    m = x.amax(-1, keepdim=True)
    m = m.masked_fill(~torch.isfinite(m), 0.0)  # all -inf rows (and inf/NaN padding rows)
    x.sub_(m).exp_()
    return x.sum(-1).log_().add_(m.squeeze(-1))


class _FusedDistill(torch.autograd.Function):
    """CE and/or KL(T || S) sums over the valid rows, with an analytic gradient.

    forward(student [N, V], teacher [N, V] | None, safe_labels [N], valid [N], kl_mode, top_k,
    want_ce, chunk_size) -> (ce_sum, kl_sum, teacher_residual_sum, student_residual_sum), fp32.
    ce_sum and kl_sum are differentiable w.r.t. student (each with its own gradient, so any
    combination of them backpropagates correctly); the residual sums are not.

    The forward keeps, besides the caller's student logits themselves (and the teacher's for the
    full KL), only per-row statistics: the student's logsumexp and, for the top-k KL, the
    teacher's top-k indices and probabilities, T_res, S_res and the logsumexp of the student's
    complement. No [N, V] intermediate lives between forward and backward and nothing is
    recomputed: the backward makes ONE pass over the student logits per block and writes
        d/dz_j = w S_j - g_kl T_j                        (j in K, or every j for the full KL)
        d/dz_j = (w S_res - g_kl T_res) * q_j            (j not in K; q_j = S_j / S_res)
        d/dz_label -= g_ce,           w = g_ce + g_kl,   invalid rows: 0
    where g_ce, g_kl are the incoming gradients of ce_sum and kl_sum. q_j = exp(z_j - lse of the
    complement) is exact even when S_res underflows, so the residual term's gradient is too.
    """

    @staticmethod
    def forward(ctx, student, teacher, safe_labels, valid, kl_mode, top_k, want_ce, chunk_size):
        n, vocab = student.shape
        device = student.device
        f32 = torch.float32
        topk = kl_mode == "topk" and top_k < vocab
        full = kl_mode != "none" and not topk  # k >= V: no residual bucket, exactly the full KL
        rows = _block_rows(device, vocab, chunk_size)

        zeros = torch.zeros(n, dtype=f32, device=device)
        lse_s = torch.empty(n, dtype=f32, device=device)
        ce_rows = torch.empty(n, dtype=f32, device=device) if want_ce else zeros
        kl_rows = torch.empty(n, dtype=f32, device=device) if kl_mode != "none" else zeros
        t_res_rows, s_res_rows = zeros, zeros
        if topk:
            idx = torch.empty(n, top_k, dtype=torch.long, device=device)
            t_k = torch.empty(n, top_k, dtype=f32, device=device)
            lse_sc = torch.empty(n, dtype=f32, device=device)
            t_res_rows = torch.empty(n, dtype=f32, device=device)
            s_res_rows = torch.empty(n, dtype=f32, device=device)
        if full:
            lse_t = torch.empty(n, dtype=f32, device=device)

        ws = torch.empty(min(rows, n), vocab, dtype=f32, device=device)  # fp32 scratch block
        ws2 = torch.empty_like(ws) if full else None
        for r0 in range(0, n, rows):
            r1 = min(r0 + rows, n)
            w = ws[: r1 - r0]
            z = student[r0:r1]
            lab = safe_labels[r0:r1, None]
            if topk:
                # Teacher: top-k, then the logsumexp of its complement (top-k set to -inf). Unlike
                # log1p(-sum_K p), log R = lse(x[~K]) - lse(x) has no cancellation when the
                # residual is tiny (peaked teacher, or a student with nearly all mass on K).
                w.copy_(teacher[r0:r1])
                tk, ik = w.topk(top_k, dim=-1, sorted=False)
                w.scatter_(-1, ik, _NEG_INF)
                t_lse_c = _lse_(w)
                t_lse = torch.logaddexp(torch.logsumexp(tk, -1), t_lse_c)
                log_t_k = tk - t_lse[:, None]
                log_t_res = t_lse_c - t_lse
                p_k = log_t_k.exp()
                t_res = log_t_res.exp()
                # Student: same split over the teacher's K.
                w.copy_(z)
                zk = w.gather(-1, ik)
                if want_ce:
                    z_label = w.gather(-1, lab).squeeze(-1)
                w.scatter_(-1, ik, _NEG_INF)
                s_lse_c = _lse_(w)
                s_lse = torch.logaddexp(torch.logsumexp(zk, -1), s_lse_c)
                log_s_res = s_lse_c - s_lse
                kl = _xlogx_ratio(p_k, log_t_k, zk - s_lse[:, None]).sum(-1)
                kl_rows[r0:r1] = kl + _xlogx_ratio(t_res, log_t_res, log_s_res)
                idx[r0:r1] = ik
                t_k[r0:r1] = p_k
                # A complement that is all -inf has no gradient; keep the backward's shift finite.
                lse_sc[r0:r1] = s_lse_c.masked_fill(s_lse_c == _NEG_INF, 0.0)
                t_res_rows[r0:r1] = t_res
                s_res_rows[r0:r1] = log_s_res.exp()
            else:
                w.copy_(z)
                if want_ce:
                    z_label = w.gather(-1, lab).squeeze(-1)
                s_lse = _lse_(w)
                if full:
                    w2 = ws2[: r1 - r0]
                    w2.copy_(teacher[r0:r1])
                    t_lse = _lse_(w2)
                    torch.sub(teacher[r0:r1], t_lse[:, None], out=w2)  # log T
                    torch.sub(z, s_lse[:, None], out=w)  # log S
                    torch.sub(w2, w, out=w)  # log T - log S
                    w2.exp_()  # T
                    w.mul_(w2).masked_fill_(w2 == 0, 0.0)  # 0 log 0 = 0
                    kl_rows[r0:r1] = w.sum(-1)
                    lse_t[r0:r1] = t_lse
            lse_s[r0:r1] = s_lse
            if want_ce:
                ce_rows[r0:r1] = s_lse - z_label
        del ws, ws2

        def total(x: Tensor) -> Tensor:  # invalid rows may hold NaN/inf: select, never multiply
            return torch.where(valid, x, zeros).sum()

        out = (total(ce_rows), total(kl_rows), total(t_res_rows), total(s_res_rows))
        ctx.mark_non_differentiable(out[2], out[3])
        ctx.meta = (kl_mode, topk, full, want_ce, rows)
        if topk:
            ctx.save_for_backward(student, safe_labels, valid, lse_s, idx, t_k, lse_sc, t_res_rows, s_res_rows)
        elif full:
            ctx.save_for_backward(student, safe_labels, valid, lse_s, teacher, lse_t)
        else:
            ctx.save_for_backward(student, safe_labels, valid, lse_s)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, g_ce, g_kl, _g_t_res, _g_s_res):
        kl_mode, topk, full, want_ce, rows = ctx.meta
        student, safe_labels, valid, lse_s, *rest = ctx.saved_tensors
        n, vocab = student.shape
        g_ce = g_ce.float() if want_ce else torch.zeros((), dtype=torch.float32, device=student.device)
        g_kl = g_kl.float() if kl_mode != "none" else torch.zeros_like(g_ce)
        wt = g_ce + g_kl  # weight of S_j in the gradient of the combination
        grad = torch.empty(student.shape, dtype=student.dtype, device=student.device)
        in_place = student.dtype == torch.float32
        on_cpu = student.device.type == "cpu"
        ws = None if in_place or n == 0 else torch.empty(min(rows, n), vocab, dtype=torch.float32,
                                                         device=student.device)
        ws2 = torch.empty(min(rows, n), vocab, dtype=torch.float32, device=student.device) if full and n else None
        if topk:
            idx, t_k, lse_sc, t_res, s_res = rest
            factor = wt * s_res - g_kl * t_res  # [N]: gradient of the complement is factor * q_j
        elif full:
            teacher, lse_t = rest
        for r0 in range(0, n, rows):
            r1 = min(r0 + rows, n)
            z = student[r0:r1]
            out = grad[r0:r1] if in_place else ws[: r1 - r0]
            if topk:
                ik = idx[r0:r1]
                s_k = (z.gather(-1, ik).float() - lse_s[r0:r1, None]).exp_()
                torch.sub(z, lse_sc[r0:r1, None], out=out)
                out.exp_().mul_(factor[r0:r1, None])
                out.scatter_(-1, ik, s_k.mul_(wt).sub_(t_k[r0:r1] * g_kl))
            else:
                torch.sub(z, lse_s[r0:r1, None], out=out)
                out.exp_().mul_(wt)
                if full:
                    w2 = ws2[: r1 - r0]
                    torch.sub(teacher[r0:r1], lse_t[r0:r1, None], out=w2)
                    out.sub_(w2.exp_().mul_(g_kl))
            if want_ce:
                out.scatter_add_(-1, safe_labels[r0:r1, None], (-g_ce).expand(r1 - r0, 1))
            if not on_cpu:
                out.masked_fill_(~valid[r0:r1, None], 0.0)  # padding rows (even NaN logits): exactly 0
            if not in_place:
                grad[r0:r1].copy_(out)
        if on_cpu:  # same, but touching only the padding rows (a masked_fill pass costs ~10% on CPU)
            grad.index_fill_(0, (~valid).nonzero().squeeze(-1), 0.0)
        return grad, None, None, None, None, None, None, None


def _fused_sums(
    student: Tensor,
    teacher: Tensor | None,
    safe_labels: Tensor,
    valid: Tensor,
    *,
    kl_mode: str,
    top_k: int,
    want_ce: bool,
    chunk_size: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(ce_sum, kl_sum, teacher_residual_sum, student_residual_sum) over flattened inputs."""
    return _FusedDistill.apply(student, teacher, safe_labels, valid, kl_mode, top_k, want_ce, chunk_size)


def _as_loss_sums(total: tuple[Tensor, ...], valid: Tensor, index: int) -> LossSums:
    return LossSums(
        sum=total[index],
        count=valid.sum(),
        residual_mass_teacher=total[2].detach(),
        residual_mass_student=total[3].detach(),
    )


# --------------------------------------------------------------------------------------
# Standalone losses (one shared signature; unused arguments are ignored)
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
    total = _fused_sums(
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
    total = _fused_sums(
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
    total = _fused_sums(
        student, teacher, safe_labels, valid, kl_mode="topk", top_k=top_k, want_ce=False, chunk_size=chunk_size
    )
    return _as_loss_sums(total, valid, 1)


# --------------------------------------------------------------------------------------
# Named terms: the registry the training objective picks from (distill.loss.terms)
# --------------------------------------------------------------------------------------


class LossInputs(NamedTuple):
    """One micro-batch as every term sees it (`prepare_inputs`: checked and flattened).

    student     [N, V]  any float dtype; gradients flow here only
    teacher     [N, V]  any float dtype, detached: targets only
    labels      [N]     int64 next data token; 0 where not valid (never read there)
    valid       [N]     bool: the positions that count (labels != ignore_index, AND the mask)
    top_k       int     teacher tokens kept per row by the top-k KL (distill.loss.top_k)
    chunk_size  int     rows per block of the chunked terms (distill.loss.chunk_size)
    """

    student: Tensor
    teacher: Tensor
    labels: Tensor
    valid: Tensor
    top_k: int
    chunk_size: int


def prepare_inputs(
    student_logits: Tensor,
    teacher_logits: Tensor,
    labels: Tensor,
    *,
    mask: Tensor | None = None,
    top_k: int = 64,
    chunk_size: int = 1024,
    ignore_index: int = IGNORE_INDEX,
) -> LossInputs:
    """`LossInputs` from logits [..., V] (student, teacher) and labels [...]; ValueError naming what is wrong."""
    _check_positive_int("top_k", top_k)
    _check_positive_int("chunk_size", chunk_size)
    student, teacher, safe_labels, valid = _prepare(
        student_logits, teacher_logits, labels, mask, ignore_index, need_labels=True, need_teacher=True
    )
    return LossInputs(student, teacher, safe_labels, valid, top_k, chunk_size)


class TermGroup(NamedTuple):
    """Terms computed together in one call: fn(inputs, wanted) -> {name: [] fp32 sum over the valid rows} for the
    requested `wanted` (a subset of `names`), plus detached sums it reports beside them (e.g. residual masses).
    `memory(wanted, rows, vocab, device_type, top_k, chunk_size)` estimates the bytes it keeps (the planner); None: 0."""

    names: tuple[str, ...]
    fn: Callable[[LossInputs, frozenset], dict]
    memory: Callable[..., dict] | None = None


# term name -> the group that computes it. One-term groups come from `register_term`.
TERMS: dict[str, TermGroup] = {}


def register_terms(*names: str, memory: Callable[..., dict] | None = None):
    """Decorator: register fn(inputs: LossInputs, names: frozenset[str]) -> {name: sum} under every one of `names`
    (terms that share one pass over the logits: asked for together, it is called once)."""

    def add(fn):
        for name in names:
            if not name.isidentifier() or name in TERMS:
                raise ValueError(f"loss term name {name!r} is {'taken' if name in TERMS else 'not an identifier'}")
        group = TermGroup(tuple(names), fn, memory)
        TERMS.update(dict.fromkeys(names, group))
        return fn

    return add


def register_term(name: str):
    """Decorator: register a loss term fn(inputs: LossInputs) -> [] fp32 SUM over the rows of inputs.valid (never a
    mean: the objective divides by the global token count). Then `distill.loss.terms.<name>=<weight>` trains on it and
    the trainer logs it as `<name>` (train) and `eval/<name>` (held out)."""

    def add(fn):
        register_terms(name)(lambda inputs, names: {name: fn(inputs)})
        return fn

    return add


def compute_terms(inputs: LossInputs, names) -> dict[str, Tensor]:
    """{name: sum} for every term of `names`, each group called once, plus what the groups report beside them."""
    out: dict[str, Tensor] = {}
    for group in dict.fromkeys(get_term(name) for name in names):
        wanted = frozenset(name for name in names if name in group.names)
        out.update(group.fn(inputs, wanted))
    return out


def get_term(name: str) -> TermGroup:
    """The group computing term `name`; ValueError listing the known names."""
    try:
        return TERMS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown loss term {name!r}; known terms: {', '.join(sorted(TERMS))}") from None


_KL_TERMS = (("kl", "topk"), ("full_kl", "full"))  # term name -> the fused kernel's KL mode


def _fused_memory_bytes(names, rows: int, vocab: int, device_type: str, top_k: int, chunk_size: int) -> dict:
    """What `ce_and_kl` holds besides the logits and their gradient: the fp32 scratch block(s) [block rows, V] (two
    for the full KL) and the per-row statistics kept for backward (the top-k indices and probabilities, logsumexps,
    residuals)."""
    block = min(_block_rows(torch.device(device_type), vocab, chunk_size), rows)
    topk = "kl" in names and top_k < vocab  # else the kernel runs the full KL (k >= V: no residual bucket)
    blocks = 2 if "full_kl" in names or ("kl" in names and not topk) else 1
    stats = rows * (6 * 4 + (top_k * 12 if topk else 0))
    return {"loss_scratch": blocks * block * vocab * 4, "loss_row_statistics": stats}


@register_terms("ce", "kl", "full_kl", memory=_fused_memory_bytes)
def ce_and_kl(inputs: LossInputs, names: frozenset) -> dict[str, Tensor]:
    """CE on the data tokens and KL(teacher || student) in ONE fused pass over the logits (the student's logsumexp is
    shared; see the module docstring for its memory).

        ce       sum of -log S[label]
        kl       top-k + residual KL: the teacher's inputs.top_k tokens plus one residual bucket (`topk_residual_kl`);
                 also reports the residual masses, sums of T_res and S_res (detached)
        full_kl  the dense KL over the whole vocabulary (`full_kl`; a baseline: a second pass when asked with kl)
    """
    x, out = inputs, {}
    modes = [mode for name, mode in _KL_TERMS if name in names] or ["none"]
    for i, mode in enumerate(modes):
        want_ce = "ce" in names and i == 0
        ce, kl, t_res, s_res = _fused_sums(x.student, x.teacher, x.labels, x.valid, kl_mode=mode, top_k=x.top_k,
                                           want_ce=want_ce, chunk_size=x.chunk_size)
        if want_ce:
            out["ce"] = ce
        if mode == "topk":
            out.update(kl=kl, residual_mass_teacher=t_res.detach(), residual_mass_student=s_res.detach())
        elif mode == "full":
            out["full_kl"] = kl
    return out

"""`bench loss`: top-k + residual KL vs naive full-vocabulary KL; time, and peak memory in fresh processes."""

from __future__ import annotations

import json
import statistics
import sys

import torch

from slimwise_train.bench.common import _peak_rss_bytes, _reset_peak_rss, _rss_now_bytes, interleaved_times


def _loss_memory_child(variant: str, tokens: int, vocab: int, top_k: int, chunk: int) -> dict:
    """Runs in a fresh process: peak RSS growth of one loss forward+backward beyond its inputs."""
    import torch.nn.functional as F

    from slimwise_train.distill.objective import distill_loss

    g = torch.Generator().manual_seed(0)
    student = torch.randn(tokens, vocab, generator=g).requires_grad_(True)
    teacher = torch.randn(tokens, vocab, generator=g) * 2
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    # The peak so far includes randn's temporaries; reset it so only the loss's own allocations count
    # (the student gradient, [N, V], is part of them).
    reset = _reset_peak_rss()
    before = _rss_now_bytes() if reset else _peak_rss_bytes()
    if variant == "topk_residual":
        out = distill_loss(student, teacher, labels, top_k=top_k, chunk_size=chunk)
        out["loss"].backward()
    else:
        kl = F.kl_div(F.log_softmax(student, -1), F.log_softmax(teacher, -1), log_target=True, reduction="batchmean")
        loss = 0.1 * F.cross_entropy(student, labels) + 0.9 * kl
        loss.backward()
    return {"peak_extra_bytes": _peak_rss_bytes() - before}


def run_loss(args) -> dict:
    """top-k + residual KL (chunked) vs the naive full-vocabulary KL: time and peak extra memory."""
    import subprocess
    import torch.nn.functional as F

    from slimwise_train.distill.objective import distill_loss

    # The naive KL needs ~5 logits tensors on top of its inputs (~30 GB at 8192 x 151,936 on CPU), so its memory is
    # measured on fewer tokens; both figures are per one fp32 logits tensor of the tokens each ran.
    memory_tokens = {"topk_residual": args.tokens, "naive_full": min(args.naive_tokens, args.tokens)}
    logits_bytes = {variant: n * args.vocab * 4 for variant, n in memory_tokens.items()}
    memory = {}
    for variant, n in memory_tokens.items():
        code = (f"import json; from slimwise_train.bench.loss import _loss_memory_child as f; "
                f"print(json.dumps(f({variant!r}, {n}, {args.vocab}, {args.top_k}, {args.chunk})))")
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"bench loss ({variant}) failed: {proc.stderr.strip().splitlines()[-1:]}")
        memory[variant] = json.loads(proc.stdout.strip().splitlines()[-1])["peak_extra_bytes"]
    g = torch.Generator().manual_seed(0)
    tokens = min(args.tokens, args.time_tokens)
    student = torch.randn(tokens, args.vocab, generator=g).requires_grad_(True)
    teacher = torch.randn(tokens, args.vocab, generator=g) * 2
    labels = torch.randint(0, args.vocab, (tokens,), generator=g)

    def ours():
        student.grad = None
        distill_loss(student, teacher, labels, top_k=args.top_k, chunk_size=args.chunk)["loss"].backward()

    def naive():
        student.grad = None
        kl = F.kl_div(F.log_softmax(student, -1), F.log_softmax(teacher, -1), log_target=True, reduction="batchmean")
        (0.1 * F.cross_entropy(student, labels) + 0.9 * kl).backward()

    times = interleaved_times({"topk_residual": ours, "naive_full": naive}, args.repeats, 1, torch.device("cpu"))
    t_ours, t_naive = statistics.median(times["topk_residual"]), statistics.median(times["naive_full"])
    over_logits = {k: round(v / logits_bytes[k], 3) for k, v in memory.items()}
    target = 1.5
    return {
        "bench": "loss",
        "tokens": memory_tokens,
        "vocab": args.vocab,
        "top_k": args.top_k,
        "chunk_size": args.chunk,
        "logits_fp32_bytes": logits_bytes,
        "peak_extra_bytes": memory,
        "peak_extra_over_logits": over_logits,
        "target_peak_extra_over_logits_max": target,
        "targets_met": {"memory": over_logits["topk_residual"] <= target},
        "timed_tokens": tokens,
        "time_s": {"topk_residual": round(t_ours, 4), "naive_full": round(t_naive, 4)},
        "ratio": round(t_ours / t_naive, 3),
    }


"""The training run's loss curve from its metrics.jsonl: train loss (raw and smoothed) and the held-out loss at each
evaluation, each with its change from its own start (the two are on different sequences). The trainer draws it into
`<run>/loss_curve.png` at the end; the demo embeds it."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Sequence

from slimwise_train.utils.plotting import pyplot as _pyplot, save_png as _save


def read_metrics(metrics_jsonl_path: str | Path) -> tuple[dict[int, float], dict[int, float], int]:
    """({step: train loss}, {step: held-out loss}, unreadable lines) of a trainer's metrics.jsonl. A step logged
    twice (a resumed run logs again from its checkpoint) keeps its last value; non-finite losses are dropped."""
    (train, held_out), bad = _read(metrics_jsonl_path, ("loss", "eval/loss"))
    return train, held_out, bad


def _read(metrics_jsonl_path: str | Path, keys: Sequence[str]) -> tuple[list[dict[int, float]], int]:
    """([{step: value of key} per key, in step order], unreadable lines): finite numbers only, a step's last value."""
    found: list[dict[int, float]] = [{} for _ in keys]
    bad = 0
    for line in Path(metrics_jsonl_path).read_text().splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line cut by a kill mid-write
            bad += 1
            continue
        if not isinstance(row, dict) or "step" not in row:
            continue
        for key, into in zip(keys, found):
            value = row.get(key)
            if isinstance(value, (int, float)) and math.isfinite(value):
                into[int(row["step"])] = float(value)
    return [dict(sorted(d.items())) for d in found], bad


def ema(values: Sequence[float], span: int, weights: Sequence[float] | None = None) -> list[float]:
    """Bias-corrected exponential moving average (alpha = 2 / (span + 1)), as TensorBoard's smoothing: the first
    values are not pulled toward 0. With `weights` each value counts by its weight (a step's loss by its loss
    tokens: a step of 20 tokens, whose mean swings by orders of magnitude, then moves the average little)."""
    alpha, avg, weight, out = 2 / (span + 1), 0.0, 0.0, []
    for i, v in enumerate(values):
        w = 1.0 if weights is None else float(weights[i])
        avg = (1 - alpha) * avg + alpha * w * v
        weight = (1 - alpha) * weight + alpha * w
        out.append(avg / weight if weight > 0 else v)
    return out


def smoothing_span(n: int) -> int:
    """EMA span for n logged steps: a tenth of the run, at least 3."""
    return max(3, round(n / 10))


def log_scale(train: Sequence[float], held_out: Sequence[float]) -> bool:
    """Whether the losses span more than a decade: the held-out losses and the train losses between their 5th and
    95th percentiles (from 20 logged steps on; a few steps with a handful of loss tokens log losses near 0 and
    would otherwise turn a readable linear axis into six decades)."""
    train = sorted(v for v in train if v > 0)
    if len(train) >= 20:
        train = train[int(0.05 * (len(train) - 1)):math.ceil(0.95 * (len(train) - 1)) + 1]
    values = [*train, *(v for v in held_out if v > 0)]
    return bool(values) and max(values) / min(values) > 10


def _smoothed(train: dict[int, float], tokens: dict[int, float] | None) -> list[float]:
    """The train curve's trend: `ema` over the logged steps, weighted by each step's loss tokens where all have them."""
    weights = [tokens[s] for s in train] if tokens and all(s in tokens for s in train) else None
    return ema(list(train.values()), smoothing_span(len(train)), weights)


def start_to_end(train: dict[int, float], held_out: dict[int, float],
                 tokens: dict[int, float] | None = None) -> str | None:
    """The note under the curve: the two losses are on different sequences (each step's own training batch, the
    fixed held-out set), so their levels differ before any training; each is read against its own start (train at
    step 1, logged before the first update; held-out at step 0). None when the run lacks either start (resumed)."""
    parts = []
    if 1 in train and len(train) >= 2:
        end = _smoothed(train, tokens)[-1]
        parts.append(f"train {train[1]:.3g} at step 1 -> {end:.3g} smoothed ({end / train[1] - 1:+.0%})")
    if 0 in held_out and len(held_out) >= 2:
        last = list(held_out)[-1]
        parts.append(f"held-out {held_out[0]:.3g} at step 0 -> {held_out[last]:.3g} at step {last} "
                     f"({held_out[last] / held_out[0] - 1:+.0%})")
    if not parts:
        return None
    return ("The train loss is on each step's own batch, the held-out loss on fixed held-out sequences: different "
            "sequences, so their levels differ before any training. Each against its own start (before training):\n"
            + "; ".join(parts))


def plot_training_curves(metrics_jsonl_path: str | Path, path: str | Path, title: str | None = None) -> None:
    """Train loss per logged step (thin, light), its smoothed trend (EMA, `smoothing_span`, weighted by each step's
    loss tokens when metrics.jsonl has them), and the held-out loss
    at each evaluation (markers, first and last value written), from a training run's metrics.jsonl; the losses
    before training (train at step 1, held-out at step 0) ringed and each curve's change from its own start written
    under the axes (`start_to_end`: the two are on different sequences, so one sitting below the other says nothing
    about training); log y when the smoothed train and held-out losses span more than one decade (`log_scale`). A pure function of the file:
    ValueError when it has no loss rows."""
    plt = _pyplot()
    (train, held_out, tokens), bad = _read(metrics_jsonl_path, ("loss", "eval/loss", "loss_tokens"))
    if not train and not held_out:
        raise ValueError(f"{metrics_jsonl_path}: no 'loss' or 'eval/loss' rows to plot")
    note = start_to_end(train, held_out, tokens)
    weighted = bool(tokens) and all(s in tokens for s in train)
    fig, ax = plt.subplots(figsize=(7.6, 4.4 + (0.45 if note else 0)))
    if train:
        steps, losses = list(train), list(train.values())
        ax.plot(steps, losses, color="#1f77b4", lw=0.8, alpha=0.35,
                label="train loss (each logged step, on its own training batch)", zorder=2)
        if len(losses) >= 2:
            span = smoothing_span(len(losses))
            ax.plot(steps, _smoothed(train, tokens), color="#1f77b4", lw=2.0, zorder=3,
                    label=f"train loss, smoothed (EMA over {span} logged steps"
                          + (", weighted by their loss tokens)" if weighted else ")"))
    if held_out:
        steps, losses = list(held_out), list(held_out.values())
        ax.plot(steps, losses, color="#d62728", lw=1.5, marker="o", markersize=5,
                label="held-out loss (eval/loss: the same held-out sequences each time)", zorder=4)
        ends = [(steps[0], losses[0], 4, "left")] + ([(steps[-1], losses[-1], -4, "right")] if len(steps) > 1 else [])
        for step, loss, dx, ha in ends:
            ax.annotate(f"{loss:.4g}", (step, loss), xytext=(dx, 7), textcoords="offset points", ha=ha,
                        fontsize=8, color="#d62728")
    starts = [(s, v, c) for s, v, c in ((1, train.get(1), "#1f77b4"), (0, held_out.get(0), "#d62728")) if v is not None]
    if starts:
        ax.plot([s for s, _, _ in starts], [v for _, v, _ in starts], ls="none", marker="o", markersize=11,
                markerfacecolor="none", markeredgecolor="0.2", markeredgewidth=1.2, zorder=5,
                label="before training (train: step 1, before its update; held-out: step 0)")
    # the axis follows the trend (smoothed train, held-out), not the single logged steps: a step of a few loss tokens
    # can log 1e-4 and would otherwise make a readable linear axis logarithmic
    if log_scale(_smoothed(train, tokens) if train else [], list(held_out.values())):
        ax.set_yscale("log")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("distillation loss" + (" (log scale)" if ax.get_yscale() == "log" else ""))
    ax.grid(alpha=0.25, lw=0.5)
    ax.legend(fontsize=8, framealpha=0.85)
    name = title or f"training loss, {Path(metrics_jsonl_path).resolve().parent.name}"
    ax.set_title(name + (f" ({bad} unreadable lines skipped)" if bad else ""), fontsize=10)
    if note:
        fig.text(0.01, 0.01, note, fontsize=7.5, ha="left", va="bottom", color="0.2", wrap=True)
        fig.tight_layout(rect=(0, 0.1, 1, 1))
    else:
        fig.tight_layout()
    _save(fig, path)


# ----------------------------------------------------------------------------------------------- sweeps

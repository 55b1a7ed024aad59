"""Accuracy and output-length metrics of the synthetic suite: pure functions of per-problem records, the one
implementation that every evaluation path shares (the eval app's `evaluate`, every mode, and the lm-eval
`slimwise` model).

Per problem (`score_run`, lists aligned with the problems):

    length              output length in tokens incl. EOS, or the budget when no EOS was produced
    ended               EOS produced within the budget
    correct             `synthetic.check(family, prompt, output, ended=...)` on the text up to EOS (`decode_output`);
                        EOS required
    first_token_agrees  the first generated token equals the full model's
    same_as_full        the whole output equals the full model's (None when `full` did not run)

Per (keep set, mode, family) and pooled over families (`all`) (`summarize`; accuracy / collapse are None when a
record has no correctness / reference length, as for lm-eval runs without logged samples):

    accuracy                         share correct
    median_length                    median length: the mean of the two middle values for even n
    p90_length                       nearest rank: the ceil(0.9 n)-th smallest length
    max_length / mean_length         max / mean length
    hit_budget                       share that produced no EOS within the budget (an EOS exactly at the budget is
                                     not a hit)
    collapse                         share that ended (EOS) shorter than COLLAPSE_FRACTION (0.5) x the reference
                                     answer (tokens incl. EOS); outputs cut off by the budget count in hit_budget
                                     instead
    first_token_agreement_with_full  share whose first generated token equals the full model's
    exact_match_with_full            share whose whole output equals the full model's (None when `full` did not run)
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Mapping, Sequence

# ----------------------------------------------------------------------------------------------- records
# The per-problem records the metrics read, defined here (generation builds them and imports this module; importable
# from slimwise_train.eval.generation too).


@dataclass(frozen=True)
class Problem:
    family: str
    prompt: str  # suite prompt without the separator
    answer: str  # reference answer (for lengths only; correctness uses `synthetic.check`)
    prompt_ids: tuple[int, ...]  # tokens of prompt + SEP
    reference_length: int  # reference answer tokens + EOS


@dataclass(frozen=True)
class Generation:
    tokens: tuple[int, ...]  # generated tokens incl. EOS (nothing after it)
    ended: bool  # EOS produced within the budget
    first_token: int

    @property
    def length(self) -> int:
        return len(self.tokens)


COLLAPSE_FRACTION = 0.5
METRICS = ("n", "accuracy", "median_length", "p90_length", "max_length", "mean_length", "hit_budget", "collapse",
           "first_token_agreement_with_full", "exact_match_with_full")
METRIC_DEFINITIONS = {
    "length": "generated tokens including EOS; the budget when no EOS was produced",
    "median_length": "statistics.median (mean of the two middle values for an even count)",
    "p90_length": "nearest rank: the ceil(0.9 n)-th smallest length",
    "hit_budget": "share of outputs without EOS within the budget",
    "collapse": f"share of outputs that ended (EOS) shorter than {COLLAPSE_FRACTION} x the reference answer "
                "(tokens incl. EOS)",
    "first_token_agreement_with_full": "share whose first generated token equals the full model's first token",
    "exact_match_with_full": "share whose whole output equals the full model's (null when full mode did not run)",
    "accuracy": "synthetic.check on the output text up to EOS, with ended = EOS produced (EOS required)",
}


# ----------------------------------------------------------------------------------------------- metrics
def median(values: Sequence[float]) -> float:
    """The middle value; the mean of the two middle values for an even count (`statistics.median`)."""
    return float(statistics.median(values))


def p90(values: Sequence[float]) -> float:
    """Nearest rank: the ceil(0.9 n)-th smallest value."""
    ordered = sorted(values)
    return float(ordered[max(1, math.ceil(0.9 * len(ordered))) - 1])


def length_stats(lengths: Sequence[int], budget: int | Sequence[int], ended: Sequence[bool] | None = None) -> dict:
    """median / p90 / max / mean of output lengths and the share that hit the budget.

    `budget` is one int or one per output. Without `ended`, an output hit the budget when its length reached it;
    with `ended` (EOS produced), when it did not end (an EOS exactly at the budget is not a hit).
    """
    lengths = [int(x) for x in lengths]
    if not lengths:
        raise ValueError("length_stats needs at least one length")
    budgets = [int(budget)] * len(lengths) if isinstance(budget, (int, float)) else [int(b) for b in budget]
    if len(budgets) != len(lengths):
        raise ValueError(f"{len(budgets)} budgets for {len(lengths)} lengths")
    hits = [length >= b for length, b in zip(lengths, budgets)] if ended is None else [not e for e in ended]
    return {
        "median_length": median(lengths),
        "p90_length": p90(lengths),
        "max_length": max(lengths),
        "mean_length": sum(lengths) / len(lengths),
        "hit_budget": sum(hits) / len(hits),
    }


def share(flags: Sequence[bool]) -> float:
    """The fraction of true flags; nan when there are none."""
    return sum(bool(f) for f in flags) / len(flags) if flags else float("nan")


def collapse_share(lengths: Sequence[int], reference_lengths: Sequence[int], ended: Sequence[bool] | None = None,
                   fraction: float = COLLAPSE_FRACTION) -> float:
    """Share of outputs that stopped (EOS; all when `ended` is None) shorter than `fraction` x their reference."""
    ended = [True] * len(lengths) if ended is None else ended
    return share([e and length < fraction * ref for length, ref, e in zip(lengths, reference_lengths, ended)])


def decode_output(tokenizer, generation: Generation) -> str:
    """Answer text up to and excluding EOS."""
    tokens = generation.tokens[:-1] if generation.ended else generation.tokens
    return tokenizer.decode(list(tokens), skip_special_tokens=False)


def score_run(problems: Sequence[Problem], generations: Sequence[Generation], tokenizer, full_first: Sequence[int],
              full_generations: Sequence[Generation] | None = None) -> dict:
    """Per-problem records of one (keep set, mode) run: lists aligned with `problems`."""
    from slimwise_train.data.synthetic import check

    texts = [decode_output(tokenizer, g) for g in generations]
    return {
        "length": [g.length for g in generations],
        "ended": [g.ended for g in generations],
        "correct": [check(p.family, p.prompt, t, ended=g.ended) for p, t, g in zip(problems, texts, generations)],
        "first_token": [g.first_token for g in generations],
        "first_token_agrees": [g.first_token == f for g, f in zip(generations, full_first)],
        "same_as_full": None if full_generations is None else
        [g.tokens == f.tokens for g, f in zip(generations, full_generations)],
        "text": texts,
    }


def summarize(problems: Sequence[Problem], record: dict, budgets: Mapping[str, int]) -> dict[str, dict]:
    """{family: metrics, ..., "all": metrics} for one run's per-problem record."""
    families = dict.fromkeys(p.family for p in problems)
    groups = {f: [i for i, p in enumerate(problems) if p.family == f] for f in families}
    groups["all"] = list(range(len(problems)))
    out = {}
    for name, idx in groups.items():
        pick = lambda key: [record[key][i] for i in idx]  # noqa: E731
        lengths = pick("length")
        correct = pick("correct")
        metrics = {"n": len(idx), "accuracy": None if None in correct else share(correct)}
        metrics.update(length_stats(lengths, [budgets[problems[i].family] for i in idx], pick("ended")))
        references = [problems[i].reference_length for i in idx]
        metrics["collapse"] = None if None in references else collapse_share(lengths, references, pick("ended"))
        metrics["first_token_agreement_with_full"] = share(pick("first_token_agrees"))
        metrics["exact_match_with_full"] = None if record["same_as_full"] is None else share(pick("same_as_full"))
        out[name] = metrics
    return out

"""Helpers shared by the synthetic suite's task families (``math`` and ``tool`` draw operands here)."""

from __future__ import annotations

import random


def _operand(rng: random.Random, hi: int, lo: int = 1) -> int:
    """Uniform number of digits (up to len(str(hi))), then a uniform value with that many."""
    if hi < lo:
        raise ValueError("empty operand range")
    d = rng.randint(len(str(lo)), len(str(hi)))
    a = max(lo, 10 ** (d - 1) if d > 1 else lo)
    b = min(hi, 10**d - 1)
    return rng.randint(a, b)

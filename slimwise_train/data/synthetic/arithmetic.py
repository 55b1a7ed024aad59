"""``math`` family of the synthetic suite: left-to-right arithmetic with the running total shown
step by step (generator ``_gen_math``, solver ``_solve_math``; format in ``suite``'s docstring)."""

from __future__ import annotations

import random
import re
from typing import Sequence

from .common import _operand

_MATH_OPS = ("+", "-", "*")


def _render_math(first: int, ops: Sequence[tuple[str, int]]) -> str:
    """Canonical expression: parentheses only where precedence differs from left-to-right."""
    expr = str(first)
    addsub_top = False  # does the current expression have +/- at its top level?
    for op, v in ops:
        if op == "*" and addsub_top:
            expr = f"({expr})*{v}"
            addsub_top = False
        else:
            expr = f"{expr}{op}{v}"
            if op in "+-":
                addsub_top = True
    return expr


def _apply_math(a: int, op: str, v: int) -> int:
    return a + v if op == "+" else a - v if op == "-" else a * v


def _math_answer(first: int, ops: Sequence[tuple[str, int]]) -> tuple[str, int]:
    total = first
    parts = []
    for op, v in ops:
        new = _apply_math(total, op, v)
        parts.append(f"{total}{op}{v}={new}")
        total = new
    parts.append(f"A={total}")
    return ";".join(parts), total


def _draw_operation(rng: random.Random, total: int, max_value: int, cand: list[str], weights: dict[str, float],
                    max_multiplier: int) -> tuple[str, int]:
    """The next (op, operand) of a chain at `total`, among the operations `cand` that keep it in [0, max_value]:
    the math and steps families' one rule (the order of the rng calls is part of the suite's streams)."""
    # lean towards + when the total is low and - when it is high (keeps operands varied)
    frac = total / max_value
    lean = {"+": 2.0 * (1.0 - frac) + 0.1, "-": 2.0 * frac + 0.1, "*": 1.0}
    op = rng.choices(cand, weights=[weights.get(c, 1.0) * lean[c] for c in cand])[0]
    if op == "+":
        return op, _operand(rng, max_value - total)
    if op == "-":
        return op, _operand(rng, total)
    return op, rng.randint(2, max(2, min(max_multiplier, max_value // total)))


def _gen_math(rng: random.Random, p: dict) -> tuple[str, str, dict]:
    max_value = int(p["max_value"])
    ops_allowed = tuple(p["ops"])
    weights = dict(zip(_MATH_OPS, p["op_weights"]))
    k = rng.randint(int(p["min_steps"]), int(p["max_steps"]))
    total = first = _operand(rng, max_value)
    ops: list[tuple[str, int]] = []
    for _ in range(k):
        cand = []
        if "+" in ops_allowed and total < max_value:
            cand.append("+")
        if "-" in ops_allowed and total > 0:
            cand.append("-")
        if "*" in ops_allowed and 1 <= total and total * 2 <= max_value:
            cand.append("*")
        if not cand:  # only reachable with exotic ``ops``; keep the chain valid
            cand = ["-"] if total > 0 else ["+"]
        op, v = _draw_operation(rng, total, max_value, cand, weights, int(p["max_multiplier"]))
        ops.append((op, v))
        total = _apply_math(total, op, v)
    prompt = f"Q: {_render_math(first, ops)}="
    answer, result = _math_answer(first, ops)
    return prompt, answer, {"first": first, "ops": [list(o) for o in ops], "result": result}


_MATH_PROMPT = re.compile(r"Q: ([0-9+\-*()]+)=")


def _solve_math(prompt: str) -> str:
    m = _MATH_PROMPT.fullmatch(prompt)
    if not m:
        raise ValueError(f"not a math prompt: {prompt!r}")
    expr = m.group(1)
    flat = expr.replace("(", "").replace(")", "")
    if not re.fullmatch(r"\d+(?:[+\-*]\d+)*", flat):
        raise ValueError(f"malformed math expression: {expr!r}")
    toks = re.findall(r"\d+|[+\-*]", flat)
    first = int(toks[0])
    ops = [(toks[i], int(toks[i + 1])) for i in range(1, len(toks), 2)]
    if _render_math(first, ops) != expr:
        # e.g. missing/extra parentheses or leading zeros: left-to-right != precedence
        raise ValueError(f"non-canonical math expression: {expr!r}")
    return _math_answer(first, ops)[0]

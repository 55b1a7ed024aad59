"""Offline synthetic reasoning suite: deterministic generators and exact checkers.

Nothing can be downloaded here, so the teacher is trained and evaluated on three small
families that mirror the paper's domains. Every output is formulaic (learnable by a
3-5M parameter MoE on CPU) and its length varies from tens to a couple hundred tokens.

Families (``FAMILIES``)
-----------------------
``math``  left-to-right arithmetic with the running total shown step by step::

    Q: (57+53-25)*3+52=
    57+53=110;110-25=85;85*3=255;255+52=307;A=307

  Operands have 1-3 digits, the running total stays in ``0..max_value`` (999), ``*`` uses a
  single-digit multiplier. Parentheses are inserted exactly where standard precedence
  would otherwise differ from left-to-right order, so the prompt is ordinary notation and
  the working is always "combine the running total with the next operand".

``code``  list programs (``x=[...]``) or word-string programs (``s="..."``) with a trace::

    x=[4,3,9];x=reverse(x);x=sort(x);print(x)
    reverse->[9,3,4];sort->[3,4,9];out=[3,4,9]

    s="red fox red";s=dedupe(s);s=replace(s,"fox","cat");print(s)
    dedupe->"red fox";replace->"red cat";out="red cat"

  List ops: ``sort reverse dedupe evens odds add(x,k) take(x,k) drop(x,k) rotate(x,k)
  append(x,v)``; final ``print(x)``, ``print(len(x))``, ``print(max(x))``, ``print(min(x))``.
  Strings are space-separated lowercase words and the ops act on the words: ``sort reverse
  dedupe take drop rotate replace(s,"a","b") append(s,"w")``; final ``print(s)``.
  ``take(x,k)`` keeps the first k, ``drop(x,k)`` removes the first k, ``rotate(x,k)`` moves
  the first k to the end, ``dedupe`` keeps first occurrences, ``add(x,k)`` adds k to each.

``tool``  a JSON function call (or a JSON array of calls, in request order) from a
  compact schema list and a natural-language request::

    T: get_weather(city:str,unit?:celsius|fahrenheit);set_alarm(time:str,label?:str) U: wake me up at 7:30 pm for gym
    {"name":"set_alarm","arguments":{"time":"19:30","label":"gym"}}

  Five tools: ``set_alarm`` (12h/phrase -> ``HH:MM`` 24h), ``set_timer`` (duration ->
  minutes), ``get_weather`` (optional unit enum), ``send_message`` (free-text copy),
  ``convert_currency`` (currency names/codes -> upper-case ISO codes). Optional arguments
  not mentioned in the request are omitted. Several requests are joined by " and then ".

API
---
``generate(family, n, seed, ...)``  deterministic for ``(family, seed, stream, params,
exclude)``; uses its own ``random.Random`` seeded from a stable SHA-256 of
``(seed, family, stream)`` (never the global RNG nor Python's salted ``hash``), so
families and streams are independent. Prompts are unique within one call by default and
the first ``k`` examples of ``generate(..., n)`` equal ``generate(..., k)`` when nothing is
excluded.

Held-out split: ``heldout(family, n, seed)`` draws from a separate stream ("heldout").
Train data must be generated with ``exclude=heldout_prompts(...)`` (dedup by exact prompt
string): ``generate_splits`` does both in one call and ``generate_from_recipe`` does it for
the YAML recipe. Short tool prompts can collide across streams, so the exclusion matters.

``check(family, prompt, output, *, ended=True)`` recomputes the reference FROM THE PROMPT
(``solve``), never from ``Example.meta``, so it grades model outputs too.
``output`` is the decoded text after the separator up to and excluding EOS; ``ended``
says whether EOS was generated. Contract:

* ``ended=False`` (generation stopped without EOS) -> always ``False``: EOS is required.
* If ``output`` still contains the literal ``"<eos>"`` (decoded with special tokens), the
  text from it on (EOS, padding) is ignored.
* Surrounding whitespace is ignored (``output.strip()``).
* math/code: the whole answer string must be exactly the reference (every step, ``A=``/
  ``out=``). tool: the output must parse as JSON (duplicate keys rejected) and equal the
  expected call(s): key order is free, types are strict (``25.0`` or ``true`` are not the
  int ``25``/``1``), a single call is an object, several calls an array in request order.
* A prompt that is not in the suite's canonical format raises ``ValueError`` (caller bug).

Text format (``to_text``): ``prompt + SEP`` then ``answer``; ``SEP = "\\n"`` (prompts and
answers never contain a newline). The training loss covers the answer tokens plus EOS.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Collection, Iterable, Sequence

__all__ = [
    "FAMILIES",
    "SEP",
    "EOS_TEXT",
    "DEFAULT_PARAMS",
    "TOOLS",
    "Example",
    "derive_seed",
    "generate",
    "heldout",
    "heldout_prompts",
    "generate_mixture",
    "generate_splits",
    "solve",
    "check",
    "family_of",
    "to_text",
    "to_hf_dataset",
    "write_jsonl",
    "read_jsonl",
    "load_recipe",
    "generate_from_recipe",
    "recipe_counts",
    "recipe_params",
    "DEFAULT_RECIPE",
]

FAMILIES: tuple[str, ...] = ("math", "code", "tool")
SEP = "\n"  # between prompt and answer
EOS_TEXT = "<eos>"  # literal EOS token string (see tokenizer.py)
_SUITE_VERSION = "slimwise-synthetic/v1"  # part of the seed derivation; bump to change streams

DEFAULT_RECIPE = Path(__file__).resolve().parents[2] / "data_recipes" / "synthetic.yaml"


@dataclass(frozen=True)
class Example:
    """One synthetic example. ``meta`` holds the generator's ground truth (informative only;
    ``check`` never reads it)."""

    family: str
    prompt: str
    answer: str
    meta: dict = field(default_factory=dict, compare=True)


# --------------------------------------------------------------------------------------
# seeding
# --------------------------------------------------------------------------------------


def derive_seed(seed: int, family: str, stream: str = "train") -> int:
    """Stable 64-bit seed for ``(seed, family, stream)`` (SHA-256, not Python's ``hash``)."""
    key = f"{_SUITE_VERSION}|{stream}|{family}|{int(seed)}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "big")


def _operand(rng: random.Random, hi: int, lo: int = 1) -> int:
    """Uniform number of digits (up to len(str(hi))), then a uniform value with that many."""
    if hi < lo:
        raise ValueError("empty operand range")
    d = rng.randint(len(str(lo)), len(str(hi)))
    a = max(lo, 10 ** (d - 1) if d > 1 else lo)
    b = min(hi, 10**d - 1)
    return rng.randint(a, b)


# --------------------------------------------------------------------------------------
# math
# --------------------------------------------------------------------------------------

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
        # lean towards + when the total is low and - when it is high (keeps operands varied)
        frac = total / max_value
        lean = {"+": 2.0 * (1.0 - frac) + 0.1, "-": 2.0 * frac + 0.1, "*": 1.0}
        op = rng.choices(cand, weights=[weights.get(c, 1.0) * lean[c] for c in cand])[0]
        if op == "+":
            v = _operand(rng, max_value - total)
        elif op == "-":
            v = _operand(rng, total)
        else:
            v = rng.randint(2, max(2, min(int(p["max_multiplier"]), max_value // total)))
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


# --------------------------------------------------------------------------------------
# code
# --------------------------------------------------------------------------------------

WORDS = (
    "red", "blue", "green", "cat", "dog", "fox", "sun", "sky",
    "tree", "fish", "bird", "rain", "moon", "star", "king", "cup",
)  # fmt: skip


def _dedupe(x: list) -> list:
    seen: set = set()
    out = []
    for v in x:
        if v not in seen:
            seen.add(v)
            out.append(v)
    return out


# name -> (argument kinds, function). Kinds: "int" or "word". Shared by list/str programs
# where it makes sense; the checker executes exactly these semantics.
_LIST_OPS: dict[str, tuple[tuple[str, ...], Callable[..., list]]] = {
    "sort": ((), lambda x: sorted(x)),
    "reverse": ((), lambda x: x[::-1]),
    "dedupe": ((), _dedupe),
    "evens": ((), lambda x: [v for v in x if v % 2 == 0]),
    "odds": ((), lambda x: [v for v in x if v % 2 == 1]),
    "add": (("int",), lambda x, k: [v + k for v in x]),
    "take": (("int",), lambda x, k: x[:k]),
    "drop": (("int",), lambda x, k: x[k:]),
    "rotate": (("int",), lambda x, k: x[k:] + x[:k]),
    "append": (("int",), lambda x, v: x + [v]),
}
_STR_OPS: dict[str, tuple[tuple[str, ...], Callable[..., list]]] = {
    "sort": ((), lambda x: sorted(x)),
    "reverse": ((), lambda x: x[::-1]),
    "dedupe": ((), _dedupe),
    "take": (("int",), lambda x, k: x[:k]),
    "drop": (("int",), lambda x, k: x[k:]),
    "rotate": (("int",), lambda x, k: x[k:] + x[:k]),
    "replace": (("word", "word"), lambda x, a, b: [b if w == a else w for w in x]),
    "append": (("word",), lambda x, w: x + [w]),
}
_LIST_FINALS = ("x", "len", "max", "min")
_NEVER_EMPTY = ("reverse", "sort", "dedupe")  # always applicable, never empty a program's state


def _allowed_ops(p: dict, table: dict) -> list[str]:
    """The code family's allowed op names (``p["ops"]``) that exist in ``table`` (list or string ops)."""
    return [n for n in p["ops"] if n in table]


def _fmt_list(x: Sequence[int]) -> str:
    return "[" + ",".join(str(v) for v in x) + "]"


def _fmt_str(x: Sequence[str]) -> str:
    return '"' + " ".join(x) + '"'


def _sample_code_arg(rng: random.Random, kind: str, name: str, x: list, p: dict):
    """Arguments for op ``name`` on state ``x`` or None if the op is not applicable."""
    n = len(x)
    max_items, max_item = int(p["max_items"]), int(p["max_item"])
    if name in ("take", "drop", "rotate"):
        return None if n < 2 else (rng.randint(1, n - 1),)
    if name == "add":
        room = min(9, max_item - max(x))
        return None if room < 1 else (rng.randint(1, room),)
    if name == "append":
        if n >= max_items:
            return None
        return (rng.randint(0, max_item),) if kind == "list" else (rng.choice(WORDS),)
    if name == "replace":
        a = rng.choice(x)
        b = rng.choice([w for w in WORDS if w != a])
        return (a, b)
    return ()


def _gen_code(rng: random.Random, p: dict) -> tuple[str, str, dict]:
    kind = "str" if rng.random() < float(p["str_fraction"]) else "list"
    min_items, max_items = int(p["min_items"]), int(p["max_items"])
    n = rng.randint(min_items, max_items)
    if kind == "list":
        # a small pool sometimes, so dedupe/evens/odds have something to do
        pool_hi = int(p["max_item"]) if rng.random() < 0.5 else rng.randint(min(5, int(p["max_item"])), int(p["max_item"]))
        x: list = [rng.randint(0, pool_hi) for _ in range(n)]
        var, table, init = "x", _LIST_OPS, _fmt_list(x)
        names = _allowed_ops(p, _LIST_OPS)
    else:
        pool = rng.sample(WORDS, rng.randint(3, len(WORDS)))
        x = [rng.choice(pool) for _ in range(n)]
        var, table, init = "s", _STR_OPS, _fmt_str(x)
        names = _allowed_ops(p, _STR_OPS)
    stmts = [f"{var}={init}"]
    trace = []
    k = rng.randint(int(p["min_steps"]), int(p["max_steps"]))
    for _ in range(k):
        for _attempt in range(50):
            name = rng.choice(names)
            args = _sample_code_arg(rng, kind, name, x, p)
            if args is None:
                continue
            y = table[name][1](x, *args)
            # never empty, rarely below two items, and mostly a visible change
            if y and len(y) >= min(2, len(x)) and (y != x or rng.random() < 0.15):
                break
        else:  # nothing applicable changed the state: fall back to a no-argument op (always applicable)
            name = next(n for n in names if n in _NEVER_EMPTY)
            args, y = (), table[name][1](x)
        arg_s = "".join("," + (str(a) if isinstance(a, int) else f'"{a}"') for a in args)
        stmts.append(f"{var}={name}({var}{arg_s})")
        x = y
        trace.append(f"{name}->{_fmt_list(x) if kind == 'list' else _fmt_str(x)}")
    if kind == "list":
        final = rng.choices(_LIST_FINALS, weights=p["final_weights"])[0]
    else:
        final = "x"
    if final == "x":
        stmts.append(f"print({var})")
        out: Any = x
        out_s = _fmt_list(x) if kind == "list" else _fmt_str(x)
    else:
        stmts.append(f"print({final}({var}))")
        out = {"len": len, "max": max, "min": min}[final](x)
        out_s = str(out)
    trace.append(f"out={out_s}")
    return ";".join(stmts), ";".join(trace), {"kind": kind, "result": out}


_CODE_INIT_LIST = re.compile(r"x=\[(\d+(?:,\d+)*)?\]")
_CODE_INIT_STR = re.compile(r's="([a-z]+(?: [a-z]+)*)"')
_CODE_OP = re.compile(r'([xs])=([a-z]+)\(([xs])((?:,(?:\d+|"[a-z]+"))*)\)')
_CODE_PRINT = re.compile(r"print\(([xs])\)|print\((len|max|min)\(([xs])\)\)")


def _solve_code(prompt: str) -> str:
    stmts = prompt.split(";")
    if len(stmts) < 2:
        raise ValueError(f"not a code prompt: {prompt!r}")
    if m := _CODE_INIT_LIST.fullmatch(stmts[0]):
        kind, var, table = "list", "x", _LIST_OPS
        x: list = [int(v) for v in m.group(1).split(",")] if m.group(1) else []
        fmt: Callable[[list], str] = _fmt_list
    elif m := _CODE_INIT_STR.fullmatch(stmts[0]):
        kind, var, table = "str", "s", _STR_OPS
        x = m.group(1).split(" ")
        fmt = _fmt_str
    else:
        raise ValueError(f"bad code init: {stmts[0]!r}")
    trace = []
    for st in stmts[1:-1]:
        m = _CODE_OP.fullmatch(st)
        if not m or m.group(1) != var or m.group(3) != var or m.group(2) not in table:
            raise ValueError(f"bad code statement: {st!r}")
        kinds, fn = table[m.group(2)]
        raw = re.findall(r'\d+|"[a-z]+"', m.group(4))
        if len(raw) != len(kinds):
            raise ValueError(f"wrong arity: {st!r}")
        args = []
        for r, kd in zip(raw, kinds):
            if (kd == "int") != r[0].isdigit():
                raise ValueError(f"wrong argument type: {st!r}")
            args.append(int(r) if kd == "int" else r.strip('"'))
        x = fn(x, *args)
        trace.append(f"{m.group(2)}->{fmt(x)}")
    m = _CODE_PRINT.fullmatch(stmts[-1])
    if not m or (m.group(1) or m.group(3)) != var:
        raise ValueError(f"bad print: {stmts[-1]!r}")
    if m.group(2):
        if kind != "list" or not x:
            raise ValueError(f"{m.group(2)} needs a non-empty list")
        out_s = str({"len": len, "max": max, "min": min}[m.group(2)](x))
    else:
        out_s = fmt(x)
    trace.append(f"out={out_s}")
    return ";".join(trace)


# --------------------------------------------------------------------------------------
# tool
# --------------------------------------------------------------------------------------

# name -> [(argument, type shown in the schema, required)]
TOOLS: dict[str, tuple[tuple[str, str, bool], ...]] = {
    "set_alarm": (("time", "str", True), ("label", "str", False)),
    "set_timer": (("minutes", "int", True),),
    "get_weather": (("city", "str", True), ("unit", "celsius|fahrenheit", False)),
    "send_message": (("to", "str", True), ("text", "str", True)),
    "convert_currency": (("amount", "int", True), ("from", "str", True), ("to", "str", True)),
}

# Surface templates. Slots: time label dur city unit to text amount cur_from cur_to.
_TEMPLATES: dict[str, tuple[str, ...]] = {
    "set_alarm": (
        "wake me up at {time}",
        "wake me up at {time} for {label}",
        "set an alarm for {time}",
        "set an alarm for {time} called {label}",
        "alarm at {time} labeled {label}",
    ),
    "set_timer": (
        "set a timer for {dur}",
        "timer for {dur}",
        "start a countdown of {dur}",
        "count down {dur}",
    ),
    "get_weather": (
        "what is the weather in {city}",
        "what is the weather in {city} in {unit}",
        "weather for {city} in {unit}",
        "forecast for {city}",
        "how warm is it in {city} in {unit}",
    ),
    "send_message": (
        "tell {to} that {text}",
        "text {to}: {text}",
        "send {to} a message saying {text}",
        "message {to}: {text}",
    ),
    "convert_currency": (
        "convert {amount} {cur_from} to {cur_to}",
        "how much is {amount} {cur_from} in {cur_to}",
        "exchange {amount} {cur_from} into {cur_to}",
        "{amount} {cur_from} in {cur_to} please",
    ),
}
_JOIN = " and then "
_LABELS = ("gym", "work", "meds", "school", "yoga", "laundry", "dinner", "team call", "bus", "piano")
_CITIES = (
    "Paris", "Tokyo", "Berlin", "Lima", "Cairo", "Oslo", "Rome", "Delhi",
    "Austin", "Seoul", "Madrid", "Nairobi", "New York", "Cape Town",
)  # fmt: skip
_NAMES = ("Bob", "Alice", "Carol", "Dave", "Eve", "Mia", "Omar", "Lena", "Raj", "Zoe")
_MESSAGES = (
    "I am running late", "see you at {h} pm", "call me back", "lunch is ready",
    "the meeting moved to {h} pm", "happy birthday", "thanks for the help", "on my way",
    "bring {n} chairs", "the code is {c}", "dinner at {h}", "do not forget the keys",
)  # fmt: skip
_CURRENCIES = {
    "USD": ("usd", "USD", "dollars"),
    "EUR": ("eur", "EUR", "euros"),
    "GBP": ("gbp", "GBP", "pounds"),
    "JPY": ("jpy", "JPY", "yen"),
    "CHF": ("chf", "CHF", "francs"),
    "INR": ("inr", "INR", "rupees"),
}
_CUR_LOOKUP = {s: code for code, forms in _CURRENCIES.items() for s in forms}
_UNITS = {"celsius": "celsius", "fahrenheit": "fahrenheit", "degrees C": "celsius", "degrees F": "fahrenheit"}
_UNIT_FORMS = {"celsius": ("celsius", "degrees C"), "fahrenheit": ("fahrenheit", "degrees F")}


def _schema(name: str) -> str:
    args = ",".join(f"{a}{'' if req else '?'}:{t}" for a, t, req in TOOLS[name])
    return f"{name}({args})"


# ---- slot parsing (checker side): surface string -> argument value, ValueError if invalid


def _parse_time(s: str) -> str:
    if s == "noon":
        return "12:00"
    if s == "midnight":
        return "00:00"
    if m := re.fullmatch(r"(half|quarter) past (\d{1,2}) (am|pm)", s):
        h, mi, ap = int(m.group(2)), 30 if m.group(1) == "half" else 15, m.group(3)
    elif m := re.fullmatch(r"(\d{1,2})(?::(\d{2}))? (am|pm)", s):
        h, mi, ap = int(m.group(1)), int(m.group(2) or 0), m.group(3)
    elif m := re.fullmatch(r"(\d{2}):(\d{2})", s):
        h, mi = int(m.group(1)), int(m.group(2))
        if h > 23 or mi > 59:
            raise ValueError(s)
        return f"{h:02d}:{mi:02d}"
    else:
        raise ValueError(s)
    if not 1 <= h <= 12 or mi > 59:
        raise ValueError(s)
    return f"{h % 12 + (12 if ap == 'pm' else 0):02d}:{mi:02d}"


def _parse_dur(s: str) -> int:
    fixed = {"half an hour": 30, "an hour": 60, "an hour and a half": 90}
    if s in fixed:
        return fixed[s]
    if m := re.fullmatch(r"([1-9]\d*) hours?(?: (?:and )?([1-9]\d*) minutes?)?", s):
        return int(m.group(1)) * 60 + int(m.group(2) or 0)
    if m := re.fullmatch(r"([1-9]\d*) minutes?", s):
        return int(m.group(1))
    raise ValueError(s)


def _parse_re(pattern: str) -> Callable[[str], str]:
    def f(s: str) -> str:
        if not re.fullmatch(pattern, s):
            raise ValueError(s)
        return s

    return f


def _parse_map(table: dict) -> Callable[[str], Any]:
    def f(s: str) -> Any:
        if s not in table:
            raise ValueError(s)
        return table[s]

    return f


# slot -> (argument name, parser)
_SLOTS: dict[str, tuple[str, Callable[[str], Any]]] = {
    "time": ("time", _parse_time),
    "label": ("label", _parse_re(r"[a-z]+(?: [a-z]+)*")),
    "dur": ("minutes", _parse_dur),
    "city": ("city", _parse_re(r"[A-Z][a-z]+(?: [A-Z][a-z]+)*")),
    "unit": ("unit", _parse_map(_UNITS)),
    "to": ("to", _parse_re(r"[A-Z][a-z]+")),
    "text": ("text", _parse_re(r"\S(?:.*\S)?")),
    "amount": ("amount", lambda s: int(_parse_re(r"[1-9]\d*")(s))),
    "cur_from": ("from", _parse_map(_CUR_LOOKUP)),
    "cur_to": ("to", _parse_map(_CUR_LOOKUP)),
}


def _compile_template(t: str) -> re.Pattern:
    parts = re.split(r"\{(\w+)\}", t)
    rx = "".join(re.escape(s) if i % 2 == 0 else f"(?P<{s}>.+?)" for i, s in enumerate(parts))
    return re.compile(rx)


_TEMPLATE_RX = {tool: [_compile_template(t) for t in ts] for tool, ts in _TEMPLATES.items()}


def _ordered_args(tool: str, args: dict) -> dict:
    return {a: args[a] for a, _, _ in TOOLS[tool] if a in args}


def _parse_request(segment: str, offered: Sequence[str]) -> dict:
    """All template parses of one request segment; exactly one distinct call must result."""
    found = []
    for tool in offered:
        for rx in _TEMPLATE_RX[tool]:
            m = rx.fullmatch(segment)
            if not m:
                continue
            try:
                args = {_SLOTS[k][0]: _SLOTS[k][1](v) for k, v in m.groupdict().items()}
            except ValueError:
                continue
            call = {"name": tool, "arguments": _ordered_args(tool, args)}
            if call not in found:
                found.append(call)
    if len(found) != 1:
        raise ValueError(f"request {segment!r} has {len(found)} parses")
    return found[0]


_TOOL_PROMPT = re.compile(r"T: (\S+) U: (.+)")


def _tool_calls(prompt: str) -> list[dict]:
    m = _TOOL_PROMPT.fullmatch(prompt)
    if not m:
        raise ValueError(f"not a tool prompt: {prompt!r}")
    offered = []
    for sch in m.group(1).split(";"):
        name = sch.split("(", 1)[0]
        if name not in TOOLS or _schema(name) != sch:
            raise ValueError(f"unknown tool schema: {sch!r}")
        offered.append(name)
    return [_parse_request(seg, offered) for seg in m.group(2).split(_JOIN)]


def _dump_calls(calls: list[dict]) -> str:
    obj = calls[0] if len(calls) == 1 else calls
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=True)


def _solve_tool(prompt: str) -> str:
    return _dump_calls(_tool_calls(prompt))


def _render_time(rng: random.Random, h: int, mi: int) -> str:
    h12, ap = h % 12 or 12, "am" if h < 12 else "pm"
    forms = [f"{h12}:{mi:02d} {ap}", f"{h:02d}:{mi:02d}"]
    if mi == 0:
        forms.append(f"{h12} {ap}")
    if mi == 30:
        forms.append(f"half past {h12} {ap}")
    if mi == 15:
        forms.append(f"quarter past {h12} {ap}")
    if (h, mi) == (12, 0):
        forms.append("noon")
    if (h, mi) == (0, 0):
        forms.append("midnight")
    return rng.choice(forms)


def _render_dur(rng: random.Random, total: int) -> str:
    h, mi = divmod(total, 60)
    mins = f"{mi} minute{'s' if mi != 1 else ''}"
    hours = f"{h} hour{'s' if h != 1 else ''}"
    forms = {30: ["half an hour"], 60: ["an hour"], 90: ["an hour and a half"]}.get(total, [])
    if h == 0:
        forms.append(mins)
    elif mi == 0:
        forms.append(hours)
    else:
        forms += [f"{hours} {mins}", f"{hours} and {mins}"]
    return rng.choice(forms)


def _gen_one_call(rng: random.Random, tool: str) -> tuple[str, dict]:
    template = rng.choice(_TEMPLATES[tool])
    slots = set(re.findall(r"\{(\w+)\}", template))
    surf: dict[str, str] = {}
    args: dict[str, Any] = {}
    if tool == "set_alarm":
        h = rng.randint(0, 23)
        mi = rng.choice((0, 15, 30, 45)) if rng.random() < 0.5 else rng.randint(0, 59)
        if rng.random() < 0.05:
            h, mi = rng.choice(((12, 0), (0, 0)))
        surf["time"], args["time"] = _render_time(rng, h, mi), f"{h:02d}:{mi:02d}"
        if "label" in slots:
            surf["label"] = args["label"] = rng.choice(_LABELS)
    elif tool == "set_timer":
        if rng.random() < 0.5:
            total = rng.randint(1, 59)
        else:
            total = rng.randint(1, 3) * 60 + (0 if rng.random() < 0.3 else rng.randint(1, 59))
        if rng.random() < 0.1:
            total = rng.choice((30, 60, 90))
        surf["dur"], args["minutes"] = _render_dur(rng, total), total
    elif tool == "get_weather":
        surf["city"] = args["city"] = rng.choice(_CITIES)
        if "unit" in slots:
            args["unit"] = rng.choice(("celsius", "fahrenheit"))
            surf["unit"] = rng.choice(_UNIT_FORMS[args["unit"]])
    elif tool == "send_message":
        surf["to"] = args["to"] = rng.choice(_NAMES)
        text = rng.choice(_MESSAGES).format(
            h=rng.randint(1, 12), n=rng.randint(2, 20), c=rng.randint(100, 9999)
        )
        surf["text"] = args["text"] = text
    elif tool == "convert_currency":
        amount = _operand(rng, 2000, lo=2)
        a, b = rng.sample(sorted(_CURRENCIES), 2)
        surf["amount"], args["amount"] = str(amount), amount
        surf["cur_from"], args["from"] = rng.choice(_CURRENCIES[a]), a
        surf["cur_to"], args["to"] = rng.choice(_CURRENCIES[b]), b
    else:  # pragma: no cover
        raise ValueError(tool)
    return template.format(**surf), {"name": tool, "arguments": _ordered_args(tool, args)}


def _gen_tool(rng: random.Random, p: dict) -> tuple[str, str, dict]:
    tools = list(p["tools"])
    k = rng.randint(int(p["min_steps"]), int(p["max_steps"]))
    used = [rng.choice(tools) for _ in range(k)]
    n_off = max(len(set(used)), rng.randint(int(p["min_offered"]), int(p["max_offered"])))
    n_off = min(n_off, len(tools))
    distractors = [t for t in tools if t not in used]
    offered = list(dict.fromkeys(used)) + rng.sample(distractors, n_off - len(set(used)))
    rng.shuffle(offered)
    segs, calls = zip(*(_gen_one_call(rng, t) for t in used))
    prompt = f"T: {';'.join(_schema(t) for t in offered)} U: {_JOIN.join(segs)}"
    return prompt, _dump_calls(list(calls)), {"calls": list(calls), "offered": offered}


# --------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------

DEFAULT_PARAMS: dict[str, dict[str, Any]] = {
    "math": {
        "min_steps": 2,  # operations per chain
        "max_steps": 5,
        "ops": ("+", "-", "*"),
        "op_weights": (0.45, 0.35, 0.2),  # for + - *
        "max_value": 999,  # running total stays in 0..max_value
        "max_multiplier": 9,
    },
    "code": {
        "min_steps": 1,  # ops per program
        "max_steps": 3,
        "min_items": 3,
        "max_items": 8,
        "max_item": 99,
        "str_fraction": 0.25,  # share of word-string programs
        # allowed op names (string programs use those that also exist for strings); the others in _LIST_OPS /
        # _STR_OPS (evens odds add take drop rotate append replace) made a one-hour CPU teacher fail at copying
        "ops": ("sort", "reverse", "dedupe"),
        "final_weights": (1.0, 0.0, 0.0, 0.0),  # print(x), print(len(x)), print(max(x)), print(min(x))
    },
    "tool": {
        "min_steps": 1,  # calls per request
        "max_steps": 1,
        "min_offered": 2,  # tools listed in the schema
        "max_offered": 3,
        "tools": tuple(TOOLS),
    },
}

_GENERATORS: dict[str, Callable[[random.Random, dict], tuple[str, str, dict]]] = {
    "math": _gen_math,
    "code": _gen_code,
    "tool": _gen_tool,
}
_SOLVERS: dict[str, Callable[[str], str]] = {"math": _solve_math, "code": _solve_code, "tool": _solve_tool}


def _params(family: str, overrides: dict) -> dict:
    if family not in DEFAULT_PARAMS:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    p = dict(DEFAULT_PARAMS[family])
    unknown = set(overrides) - set(p)
    if unknown:
        raise TypeError(f"unknown {family} parameters: {sorted(unknown)}")
    p.update({k: v for k, v in overrides.items() if v is not None})
    if family == "tool" and (not p["tools"] or set(p["tools"]) - set(TOOLS)):
        raise ValueError(f"tools must be a non-empty subset of {tuple(TOOLS)}")
    if family == "math" and (not p["ops"] or set(p["ops"]) - set(_MATH_OPS)):
        raise ValueError(f"ops must be a non-empty subset of {_MATH_OPS}")
    if family == "code":
        if not p["ops"] or set(p["ops"]) - set(_LIST_OPS) - set(_STR_OPS):
            raise ValueError(f"code ops must be a non-empty subset of {sorted(set(_LIST_OPS) | set(_STR_OPS))}")
        for kind, table, share in (("list", _LIST_OPS, 1 - float(p["str_fraction"])),
                                   ("string", _STR_OPS, float(p["str_fraction"]))):
            if share > 0 and not set(_allowed_ops(p, table)) & set(_NEVER_EMPTY):
                raise ValueError(f"code ops {list(p['ops'])} leave {kind} programs without a no-argument op "
                                 "(sort/reverse/dedupe); add one or set str_fraction to 0 or 1")
        if len(p["final_weights"]) != len(_LIST_FINALS) or min(p["final_weights"]) < 0 or not sum(p["final_weights"]):
            raise ValueError(f"code final_weights needs {len(_LIST_FINALS)} non-negative weights for {_LIST_FINALS}")
    if not 1 <= int(p["min_steps"]) <= int(p["max_steps"]):
        raise ValueError(f"need 1 <= min_steps <= max_steps, got {p['min_steps']}..{p['max_steps']}")
    return p


def generate(
    family: str,
    n: int,
    seed: int,
    *,
    stream: str = "train",
    exclude: Collection[str] | None = None,
    unique: bool = True,
    min_steps: int | None = None,
    max_steps: int | None = None,
    **params: Any,
) -> list[Example]:
    """``n`` examples of ``family``, deterministic for the arguments.

    ``min_steps``/``max_steps``: math operations, code ops, tool calls per example.
    Other family parameters (see ``DEFAULT_PARAMS``) go in ``params``; unknown names raise.
    ``exclude``: prompts that must not be produced (e.g. ``heldout_prompts(...)``).
    ``unique``: no repeated prompt within the returned list.
    ``stream``: independent sub-stream name ("train", "heldout", ...).
    """
    p = _params(family, {"min_steps": min_steps, "max_steps": max_steps, **params})
    rng = random.Random(derive_seed(seed, family, stream))
    gen = _GENERATORS[family]
    excl = exclude if exclude is not None else ()
    seen: set[str] = set()
    out: list[Example] = []
    budget = 50 * n + 1000
    while len(out) < n:
        budget -= 1
        if budget < 0:
            raise RuntimeError(f"could not draw {n} distinct {family} prompts; widen the parameters")
        prompt, answer, meta = gen(rng, p)
        if prompt in excl or (unique and prompt in seen):
            continue
        seen.add(prompt)
        out.append(Example(family, prompt, answer, meta))
    return out


def heldout(family: str, n: int, seed: int = 0, **kwargs: Any) -> list[Example]:
    """Held-out examples: the separate "heldout" stream. Exclude their prompts from train data
    with ``generate(..., exclude=heldout_prompts(...))`` (or use ``generate_splits``)."""
    return generate(family, n, seed, stream="heldout", **kwargs)


def heldout_prompts(family: str, n: int, seed: int = 0, **kwargs: Any) -> frozenset[str]:
    """Prompt set of ``heldout(family, n, seed)`` for ``exclude=`` / membership tests."""
    return frozenset(e.prompt for e in heldout(family, n, seed, **kwargs))


def generate_mixture(
    n_per_family: int | dict[str, int],
    seed: int,
    *,
    families: Sequence[str] = FAMILIES,
    exclude: Collection[str] | None = None,
    shuffle: bool = True,
    stream: str = "train",
    params: dict[str, dict] | None = None,
) -> list[Example]:
    """``n_per_family`` examples of each family (or a ``{family: n}`` dict), shuffled
    deterministically. ``params`` maps family -> overrides for ``generate``."""
    params = params or {}
    out: list[Example] = []
    for fam in families:
        n = n_per_family[fam] if isinstance(n_per_family, dict) else n_per_family
        out += generate(fam, n, seed, stream=stream, exclude=exclude, **params.get(fam, {}))
    if shuffle:
        random.Random(derive_seed(seed, "+".join(families), stream + "/mix")).shuffle(out)
    return out


def generate_splits(
    n_train_per_family: int | dict[str, int],
    n_eval_per_family: int | dict[str, int],
    seed: int,
    *,
    eval_seed: int = 0,
    families: Sequence[str] = FAMILIES,
    params: dict[str, dict] | None = None,
) -> tuple[list[Example], list[Example]]:
    """(train, eval): eval from the held-out stream, train excluding every eval prompt."""
    params = params or {}
    ev: list[Example] = []
    for fam in families:
        n = n_eval_per_family[fam] if isinstance(n_eval_per_family, dict) else n_eval_per_family
        ev += heldout(fam, n, eval_seed, **params.get(fam, {}))
    excl = frozenset(e.prompt for e in ev)
    train = generate_mixture(
        n_train_per_family, seed, families=families, exclude=excl, params=params
    )
    return train, ev


def family_of(prompt: str) -> str:
    """Family of a suite prompt, from its prefix."""
    if prompt.startswith("Q: "):
        return "math"
    if prompt.startswith(("x=", "s=")):
        return "code"
    if prompt.startswith("T: "):
        return "tool"
    raise ValueError(f"unrecognised prompt: {prompt[:40]!r}")


def _clean_prompt(prompt: str) -> str:
    return prompt[: -len(SEP)] if prompt.endswith(SEP) else prompt


def solve(family: str, prompt: str) -> str:
    """Canonical reference answer computed from ``prompt`` alone (``prompt`` may carry the
    trailing ``SEP`` from ``to_text``). Raises ``ValueError`` for a non-suite prompt."""
    if family not in _SOLVERS:
        raise ValueError(f"unknown family {family!r}")
    return _SOLVERS[family](_clean_prompt(prompt).strip())


def _no_dup_keys(pairs: list[tuple[str, Any]]) -> dict:
    d = {}
    for k, v in pairs:
        if k in d:
            raise ValueError(f"duplicate key {k!r}")
        d[k] = v
    return d


def _strict_eq(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_strict_eq(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_strict_eq(x, y) for x, y in zip(a, b))
    return a == b


def check(family: str, prompt: str, output: str, *, ended: bool = True) -> bool:
    """Exact check of a model ``output`` for ``prompt`` (see the module docstring).

    ``output``: decoded answer text up to and excluding EOS; ``ended``: EOS was produced
    (required). Returns ``False`` for any wrong, partial or unterminated answer.
    """
    if not ended:
        return False
    text = output.split(EOS_TEXT, 1)[0].strip()
    ref = solve(family, prompt)
    if family != "tool":
        return text == ref
    try:
        got = json.loads(text, object_pairs_hook=_no_dup_keys)
    except ValueError:
        return False
    return _strict_eq(got, json.loads(ref))


def to_text(example: Example) -> tuple[str, str]:
    """``(prompt_text, answer_text)`` = ``(prompt + SEP, answer)``. Train on answer + EOS.

    ``prompt_text`` ends with a non-letter, so tokenizing the two parts separately gives
    the same tokens as tokenizing their concatenation (see ``tokenizer.encode_example``).
    """
    return example.prompt + SEP, example.answer


def to_hf_dataset(examples: Iterable[Example]):
    """``datasets.Dataset`` with string columns family, prompt, answer."""
    import datasets

    exs = list(examples)
    return datasets.Dataset.from_dict(
        {
            "family": [e.family for e in exs],
            "prompt": [e.prompt for e in exs],
            "answer": [e.answer for e in exs],
        },
        features=datasets.Features(
            {k: datasets.Value("string") for k in ("family", "prompt", "answer")}
        ),
    )


def write_jsonl(path: str | os.PathLike, examples: Iterable[Example]) -> Path:
    """Write one JSON object per line (family, prompt, answer, meta) atomically:
    a temp file in the same directory, fsync, then ``os.replace``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for e in examples:
                rec = {"family": e.family, "prompt": e.prompt, "answer": e.answer, "meta": e.meta}
                f.write(json.dumps(rec, ensure_ascii=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path


def read_jsonl(path: str | os.PathLike) -> list[Example]:
    """Inverse of ``write_jsonl``."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                out.append(Example(r["family"], r["prompt"], r["answer"], r.get("meta", {})))
    return out


# --------------------------------------------------------------------------------------
# recipe
# --------------------------------------------------------------------------------------


def load_recipe(path: str | os.PathLike | None = None) -> dict:
    """Parse ``data_recipes/synthetic.yaml`` (or ``path``)."""
    import yaml

    with open(path or DEFAULT_RECIPE, encoding="utf-8") as f:
        recipe = yaml.safe_load(f)
    for fam in recipe["families"]:
        if fam not in FAMILIES:
            raise ValueError(f"recipe names unknown family {fam!r}")
    return recipe


def recipe_params(recipe: dict) -> dict[str, dict]:
    """Family -> generator parameters of a recipe (``generate``'s keyword arguments)."""
    return {name: dict(spec.get("params") or {}) for name, spec in recipe["families"].items()}


def recipe_counts(recipe: dict, n_total: int) -> dict[str, int]:
    """`n_total` split by the family weights, summing exactly to `n_total` (largest remainder, ties in order)."""
    fams = recipe["families"]
    weights = {name: float(f.get("weight", 1.0)) for name, f in fams.items()}
    total = sum(weights.values())
    if any(w < 0 for w in weights.values()) or not total > 0:
        raise ValueError(f"recipe family weights must be >= 0 with a positive sum, got {weights}")
    shares = {name: n_total * w / total for name, w in weights.items()}
    counts = {name: int(share) for name, share in shares.items()}
    by_remainder = sorted(shares, key=lambda name: -(shares[name] - counts[name]))
    for name in by_remainder[: n_total - sum(counts.values())]:
        counts[name] += 1
    return counts


def _interleave_families(examples: list[Example], n: int) -> list[Example]:
    """The first ``n`` examples taking families in turn, so a small eval sample covers every family."""
    by_family: dict[str, list[Example]] = {}
    for e in examples:
        by_family.setdefault(e.family, []).append(e)
    out, i = [], 0
    while len(out) < n:
        for fam in by_family:
            if i < len(by_family[fam]) and len(out) < n:
                out.append(by_family[fam][i])
        i += 1
    return out


def generate_from_recipe(
    recipe: dict | str | os.PathLike | None = None, split: str = "train", n: int | None = None
) -> list[Example]:
    """Examples of ``split`` ("train" or "eval") from a recipe. The eval split uses the
    held-out stream; the train split excludes every eval prompt. ``n`` overrides the split's
    total count (the eval set that training excludes stays the recipe's)."""
    if not isinstance(recipe, dict):
        recipe = load_recipe(recipe)
    params = recipe_params(recipe)
    ev_cfg = recipe["splits"]["eval"]
    ev_counts = recipe_counts(recipe, int(ev_cfg["n"]))
    ev = []
    for fam, count in ev_counts.items():
        ev += heldout(fam, count, int(ev_cfg["seed"]), **params[fam])
    if split == "eval":
        if n is not None and n > len(ev):
            ev = []
            for fam, count in recipe_counts(recipe, n).items():
                ev += heldout(fam, count, int(ev_cfg["seed"]), **params[fam])
        return ev if n is None or n >= len(ev) else _interleave_families(ev, n)
    if split != "train":
        raise ValueError(f"unknown split {split!r}")
    tr_cfg = recipe["splits"]["train"]
    return generate_mixture(
        recipe_counts(recipe, int(tr_cfg["n"]) if n is None else n),
        int(tr_cfg["seed"]),
        families=tuple(recipe["families"]),
        exclude=frozenset(e.prompt for e in ev),
        params=params,
    )

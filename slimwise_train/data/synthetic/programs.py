"""``code`` family of the synthetic suite: list and word-string programs with a step trace
(generator ``_gen_code``, solver ``_solve_code``, op tables; format in ``suite``'s docstring)."""

from __future__ import annotations

import random
import re
from typing import Any, Callable, Sequence

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

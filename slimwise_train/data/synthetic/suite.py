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

Long-context families (opt-in, not in ``FAMILIES``)
---------------------------------------------------
``lookup``, ``toolpick``, ``steps`` and ``fewshot`` (``long_context.LONG_FAMILIES``, formats in
``long_context``'s docstring) go through the same ``generate`` / ``heldout`` / ``solve`` / ``check`` /
``family_of``; their prompts may span several lines. The default suite, its streams and the recipe are unchanged.

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Collection, Iterable, Sequence

from .arithmetic import _MATH_OPS, _gen_math, _solve_math
from .long_context import (LONG_DEFAULT_PARAMS, LONG_FAMILIES, LONG_GENERATORS, LONG_SOLVERS, LONG_SUITE_WEIGHTS,
                           answer_is_json, check_long_params, gen_fewshot, long_family_of, solve_fewshot)
from .programs import _LIST_FINALS, _LIST_OPS, _NEVER_EMPTY, _STR_OPS, _allowed_ops, _gen_code, _solve_code
from .tools import TOOLS, _gen_tool, _solve_tool

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
    "check_recipe",
    "DEFAULT_RECIPE",
]

FAMILIES: tuple[str, ...] = ("math", "code", "tool")
SEP = "\n"  # between prompt and answer
EOS_TEXT = "<eos>"  # literal EOS token string (see tokenizer.py)
_SUITE_VERSION = "slimwise-synthetic/v1"  # part of the seed derivation; bump to change streams

DEFAULT_RECIPE = Path(__file__).resolve().parents[3] / "data_recipes" / "synthetic.yaml"


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
    **LONG_GENERATORS,  # opt-in long-context families (long_context.py); not in FAMILIES
    "fewshot": lambda rng, p: gen_fewshot(rng, p, _fewshot_bases()),
}
_SOLVERS: dict[str, Callable[[str], str]] = {"math": _solve_math, "code": _solve_code, "tool": _solve_tool,
                                             **LONG_SOLVERS,
                                             "fewshot": lambda prompt: solve_fewshot(prompt, family_of, solve)}


def _fewshot_bases() -> dict[str, tuple[Callable, dict]]:
    """fewshot's base families: generator and default parameters (math / code / tool: the shipped recipe's)."""
    return {base: (_GENERATORS[base], _params(base, {})) for base in ("math", "code", "tool", "steps")}


def _params(family: str, overrides: dict) -> dict:
    if family not in DEFAULT_PARAMS and family not in LONG_DEFAULT_PARAMS:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES} or the long-context {LONG_FAMILIES}")
    p = dict(DEFAULT_PARAMS[family] if family in DEFAULT_PARAMS else LONG_DEFAULT_PARAMS[family])
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
    if family in LONG_DEFAULT_PARAMS:
        check_long_params(family, p)
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


def long_suite(
    n: int,
    seed: int,
    *,
    weights: dict[str, float] | None = None,
    exclude: Collection[str] = (),
    params: dict[str, dict] | None = None,
    stream: str = "train",
) -> list[Example]:
    """Opt-in long-context training mixture: ``n`` examples split by ``weights`` (default
    ``long_context.LONG_SUITE_WEIGHTS``: lookup, toolpick, steps, fewshot and math / code / tool), shuffled,
    deterministic for the arguments. ``exclude`` holds held-out prompts: an example is dropped when its prompt or
    ANY line of it is excluded, so no held-out problem leaks into training as a solved example or a question."""
    weights = dict(LONG_SUITE_WEIGHTS if weights is None else weights)
    recipe = {"families": {name: {"weight": w} for name, w in weights.items()}}
    excluded = frozenset(exclude)
    out: list[Example] = []
    for name, count in recipe_counts(recipe, n).items():
        if count:
            batch = generate(name, count, seed, stream=stream, exclude=excluded, **(params or {}).get(name, {}))
            out += [e for e in batch if not any(line in excluded for line in e.prompt.split(SEP))]
    random.Random(derive_seed(seed, "+".join(weights), stream + "/long-mix")).shuffle(out)
    return out


def long_heldout(
    families: Sequence[str], n: int, seed: int = 0, params: dict[str, dict] | None = None
) -> list[Example]:
    """The first ``n`` held-out examples of each of ``families`` (any registered family; math / code / tool with
    the default parameters, which are the shipped recipe's, so these are the eval split's first problems)."""
    return [e for name in families for e in heldout(name, n, seed, **(params or {}).get(name, {}))]


def family_of(prompt: str) -> str:
    """Family of a suite prompt, from its prefix (a prompt of several lines is one of the long families)."""
    long_family = long_family_of(prompt)
    if long_family is not None:
        return long_family
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
    if family != "tool" and not (family in LONG_FAMILIES and answer_is_json(family, _clean_prompt(prompt))):
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
    from slimwise_train.utils.atomic import atomic_path

    path = Path(path)
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for e in examples:
            rec = {"family": e.family, "prompt": e.prompt, "answer": e.answer, "meta": e.meta}
            f.write(json.dumps(rec, ensure_ascii=True) + "\n")
        f.flush()
        os.fsync(f.fileno())
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
        recipe = check_recipe(yaml.safe_load(f), f"recipe {path or DEFAULT_RECIPE}")
    for fam in recipe["families"]:
        if fam not in FAMILIES:
            raise ValueError(f"recipe names unknown family {fam!r}")
    return recipe


def check_recipe(recipe, where: str = "recipe") -> dict:
    """`recipe` if it has the keys a synthetic recipe needs; else a ValueError naming the missing one."""
    if not isinstance(recipe, dict) or not isinstance(recipe.get("families"), dict):
        raise ValueError(f"{where}: needs a `families` mapping (family: {{weight, params}})")
    splits = recipe.get("splits") if isinstance(recipe.get("splits"), dict) else {}
    for split in ("train", "eval"):
        if not isinstance(splits.get(split), dict) or not {"n", "seed"} <= set(splits[split]):
            raise ValueError(f"{where}: needs splits.{split} with n and seed")
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
    recipe = check_recipe(recipe) if isinstance(recipe, dict) else load_recipe(recipe)
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

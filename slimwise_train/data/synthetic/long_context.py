"""Long-context families of the synthetic suite, and packed multi-example training sequences (opt-in).

The shipped 4-layer teacher only ever saw one short example starting at position 0, so a full prefill has little
room to help a pruned decoder and few-shot prompts break it (../shared/notes/fidelity-probe.md). These families are
for a deeper teacher whose answers depend on information spread across a long prompt. ``suite`` registers them next
to math / code / tool (``generate``, ``heldout``, ``solve``, ``check`` and ``family_of`` accept them; the opt-in
mixture is ``suite.long_suite``, held-out problems ``suite.long_heldout``) but they are NOT in ``FAMILIES``: the
default suite, its streams, the shipped teacher and ``make demo`` are unchanged. This module sits below ``suite``
and never imports it (``suite`` passes fewshot its base families).

Families (``LONG_FAMILIES``; prompts may span several lines, answers never contain a newline)
------------------------------------------------------------------------------------------------
``lookup``  multi-query associative recall over a table of 10-48 records in the prompt: each question finds a
row by its key (the first column) and the answer copies the value after it::

    table: name|id
    kalo|482
    mirute|915
    find name=mirute: id                 -> id=915

  ``min_steps..max_steps`` (1-12) is the number of questions on the table: all but the last are solved in the
  prompt (query line, then its answer line: a few-shot prompt sharing the document); the last is asked. Harder
  forms stay available as parameters: ``min_columns..max_columns`` attribute columns after id (``city``, ``item``,
  ... asked 1..``max_fields`` at a time: ``find name=mirute: city,item -> city=Lima;item=cup``) and
  ``name_key_share`` < 1 (the share of questions keyed by name; the others find the row by id and may ask for the
  name *before* it). The defaults ask only for the cell after the key: on 4-layer models grown from the shipped
  teacher that recall formed in ~7M tokens (0.80), while the reverse direction (id -> name) and attribute columns
  did not form in 3-27M tokens (docs/teacher.md, 2026-12-04), out of reach of a deep teacher trained on 2 cores.

``toolpick``  8-20 tool schemas (one per intent, each intent has two spellings with different names and argument
names, so the call depends on the list, not on the request alone), then requests; argument values are copied::

    tools:
    forecast(location:str)
    book_hotel(city:str,nights:int)
    user: reserve 3 nights in Cairo
    -> {"name":"book_hotel","arguments":{"city":"Cairo","nights":3}}

  ``min_steps..max_steps`` is the number of requests (solved ones before the asked one, as for lookup).

``steps``  a long left-to-right chain with every running total written out (the math family's answer format,
8-20 operations, 80-230 answer tokens), so runaway or collapsed lengths under pruning are visible::

    steps: 57 +53 -25 *3 +52
    -> 57+53=110;110-25=85;85*3=255;255+52=307;A=307

  Operations apply to the running total in order (no precedence); the total stays in 0..999; no operation (sign
  and operand) repeats within a chain, so the next operand is found by matching the last one used.

``fewshot``  ``min_steps..max_steps`` examples of one base family (math / code / tool / steps), one per line
pair ``prompt`` / ``answer``, the last one asked: independent solved examples in front of the question.

The checkers (``solve``) recompute every answer from the prompt alone, verify that the solved examples inside a
prompt are right, and raise ``ValueError`` for a prompt out of format (as ``suite.solve`` does). ``max_chars``
caps prompt + answer in characters (the shipped tokenizer never makes more tokens than characters), so every
example fits a 1024-token training sequence with its EOS: solved examples, then rows, are dropped to fit.

Packing (``encode_packed``, ``pack_sequences``, ``packed_batches``, fed e.g. by ``suite.long_suite``): examples are
concatenated, each answer followed by EOS, into sequences of up to ``seq_len`` tokens with positions continuing
across examples, so the model learns to answer at any position after other examples; loss on answers + EOS only
(by default also on the solved answers inside few-shot prompts: they are answers too, and a table's prompt is long
for one short answer).
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from typing import Any, Callable, Iterator, Mapping, Sequence

from .arithmetic import _apply_math, _draw_operation, _math_answer
from .common import _operand
from .programs import WORDS
from .tools import _CITIES, _TOOL_PROMPT

__all__ = [
    "LONG_FAMILIES",
    "LONG_DEFAULT_PARAMS",
    "LONG_SUITE_WEIGHTS",
    "shot_answer_lines",
    "answer_is_json",
    "encode_packed",
    "pack_sequences",
    "packed_batches",
]

LONG_FAMILIES: tuple[str, ...] = ("lookup", "toolpick", "steps", "fewshot")
_NL = "\n"  # the suite's SEP; kept local so this module does not import suite (suite imports it)

LONG_DEFAULT_PARAMS: dict[str, dict[str, Any]] = {
    "lookup": {
        "min_steps": 1,  # questions on the table (the last one is asked, the others are solved in the prompt)
        "max_steps": 12,
        "min_rows": 10,
        "max_rows": 48,
        "min_columns": 0,  # attribute columns besides name and id (a harder form; docs/teacher.md)
        "max_columns": 0,
        "max_fields": 2,  # fields asked per question
        "name_key_share": 1.0,  # share of questions that find the row by name (the others by id)
        "max_chars": 1000,
    },
    "toolpick": {
        "min_steps": 1,  # requests (the last one is asked, the others are solved in the prompt)
        "max_steps": 4,
        "min_offered": 8,  # schemas listed
        "max_offered": 20,
        "max_chars": 1000,
    },
    "steps": {
        "min_steps": 8,  # operations per chain
        "max_steps": 20,
        "op_weights": (0.45, 0.35, 0.2),  # + - *
        "max_value": 999,
        "max_multiplier": 9,
        "max_chars": 1000,
    },
    "fewshot": {
        "min_steps": 2,  # examples in the prompt, the last one asked
        "max_steps": 4,
        "bases": ("math", "code", "tool", "steps"),
        "max_chars": 1000,
    },
}

# Mixture for the deep teacher, in examples. The long families are 4-8x longer than math / code / tool, so about
# 85% of the tokens are long-context; lookup has the fewest answer tokens per prompt token, so it gets the most
# examples; the short families keep the shipped suite (and its eval split) learnt.
LONG_SUITE_WEIGHTS: dict[str, float] = {
    "lookup": 1.2, "toolpick": 1.0, "steps": 0.8, "fewshot": 0.8, "math": 1.0, "code": 1.0, "tool": 0.5,
}


# ----------------------------------------------------------------------------------------------- lookup
_SYLLABLES = ("ka", "lo", "mi", "ru", "te", "sa", "no", "vi", "da", "be", "zo", "pe", "ul", "ti", "gor", "an")
_LOOKUP_COLUMNS: dict[str, Any] = {  # column -> sampler(rng) of its value text
    "city": lambda rng: rng.choice(_CITIES),
    "age": lambda rng: str(rng.randint(18, 89)),
    "item": lambda rng: rng.choice(WORDS),
    "floor": lambda rng: str(rng.randint(1, 40)),
    "score": lambda rng: str(rng.randint(0, 999)),
}
_LOOKUP_QUERY = re.compile(r"find (name|id)=([a-z0-9]+): ([a-z]+(?:,[a-z]+)*)")
_LOOKUP_ROW = re.compile(r"[a-z]+\|[1-9][0-9]{2}(?:\|[A-Za-z0-9 ]+)*")


def _lookup_name(rng: random.Random) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 3)))


def _lookup_question(rng: random.Random, columns: Sequence[str], rows: Sequence[dict], target: int, p: dict) -> str:
    """A query line about row ``target``: by name or by id, for 1..max_fields other columns (in table order)."""
    share = float(p["name_key_share"])
    # 0.5 draws the key as before the parameter existed, so the default streams are unchanged
    key = rng.choice(("name", "id")) if share == 0.5 else ("name" if rng.random() < share else "id")
    others = [c for c in columns if c != key]
    fields = sorted(rng.sample(others, rng.randint(1, min(int(p["max_fields"]), len(others)))), key=columns.index)
    return f"find {key}={rows[target][key]}: {','.join(fields)}"


def _lookup_render(columns: Sequence[str], rows: Sequence[dict], lines: Sequence[str]) -> str:
    table = [f"table: {'|'.join(columns)}"] + ["|".join(r[c] for c in columns) for r in rows]
    return _NL.join(table + list(lines))


def _gen_lookup(rng: random.Random, p: dict) -> tuple[str, str, dict]:
    extra = rng.sample(sorted(_LOOKUP_COLUMNS), rng.randint(int(p["min_columns"]), int(p["max_columns"])))
    columns = ["name", "id"] + sorted(extra, key=list(_LOOKUP_COLUMNS).index)
    n_rows = rng.randint(int(p["min_rows"]), int(p["max_rows"]))
    names: list[str] = []
    while len(names) < n_rows:  # keys must be unique (and no name is a prefix-free issue: the query ends with ':')
        name = _lookup_name(rng)
        if name not in names:
            names.append(name)
    ids = rng.sample(range(100, 1000), n_rows)
    rows = [{"name": n, "id": str(i), **{c: _LOOKUP_COLUMNS[c](rng) for c in extra}} for n, i in zip(names, ids)]
    n_questions = rng.randint(int(p["min_steps"]), int(p["max_steps"]))
    targets = [rng.randrange(n_rows) for _ in range(n_questions)]
    questions = [_lookup_question(rng, columns, rows, t, p) for t in targets]
    answers = [_lookup_answer(columns, rows, q) for q in questions]

    def size(rows_, k):  # prompt + answer characters with the last k questions kept
        lines = [x for q, a in zip(questions[-k:-1], answers[-k:-1]) for x in (q, a)] + [questions[-1]]
        return len(_lookup_render(columns, rows_, lines)) + 1 + len(answers[-1]), lines

    k = n_questions
    while k > 1 and size(rows, k)[0] > int(p["max_chars"]):
        k -= 1
    keep = set(targets[-k:])
    while size(rows, k)[0] > int(p["max_chars"]) and len(rows) > len(keep):  # then drop rows nobody asks about
        drop = rng.choice([i for i in range(len(rows)) if i not in keep])
        rows = rows[:drop] + rows[drop + 1:]
        keep = {i - (i > drop) for i in keep}
    prompt = _lookup_render(columns, rows, size(rows, k)[1])
    return prompt, answers[-1], {"rows": len(rows), "questions": k, "columns": columns}


def _lookup_answer(columns: Sequence[str], rows: Sequence[dict], query: str) -> str:
    m = _LOOKUP_QUERY.fullmatch(query)
    if not m:
        raise ValueError(f"not a lookup question: {query!r}")
    key, value, fields = m.group(1), m.group(2), m.group(3).split(",")
    if any(f not in columns or f == key for f in fields) or len(set(fields)) != len(fields):
        raise ValueError(f"lookup question asks for unknown or repeated fields: {query!r}")
    hits = [r for r in rows if r[key] == value]
    if len(hits) != 1:
        raise ValueError(f"lookup question matches {len(hits)} rows: {query!r}")
    return ";".join(f"{f}={hits[0][f]}" for f in fields)


def _parse_lookup(prompt: str) -> tuple[list[str], list[dict], list[str]]:
    """(columns, rows, the lines after the table) of a lookup prompt; ValueError if out of format."""
    lines = prompt.split(_NL)
    if not lines[0].startswith("table: "):
        raise ValueError(f"not a lookup prompt: {prompt[:40]!r}")
    columns = lines[0][len("table: "):].split("|")
    if columns[:2] != ["name", "id"] or len(set(columns)) != len(columns) or set(columns[2:]) - set(_LOOKUP_COLUMNS):
        raise ValueError(f"bad lookup header: {lines[0]!r}")
    rows, i = [], 1
    while i < len(lines) and not lines[i].startswith("find "):
        cells = lines[i].split("|")
        if len(cells) != len(columns) or not _LOOKUP_ROW.fullmatch(lines[i]):
            raise ValueError(f"bad lookup row: {lines[i]!r}")
        rows.append(dict(zip(columns, cells)))
        i += 1
    if not rows or len({r["name"] for r in rows}) != len(rows) or len({r["id"] for r in rows}) != len(rows):
        raise ValueError("a lookup table needs rows with unique names and ids")
    return columns, rows, lines[i:]


def _solve_lookup(prompt: str) -> str:
    columns, rows, rest = _parse_lookup(prompt)
    return _solve_dialogue(rest, lambda q: _lookup_answer(columns, rows, q), "find ")


def _solve_dialogue(lines: Sequence[str], answer_of, question_prefix: str) -> str:
    """Answer to the last question of ``q1, a1, ..., qk`` after checking every solved ``a_i`` (a prompt with a
    wrong solved example is not canonical)."""
    if len(lines) % 2 != 1:
        raise ValueError("expected question / answer line pairs ending with a question")
    for q, a in zip(lines[0:-1:2], lines[1::2]):
        if not q.startswith(question_prefix) or answer_of(q) != a:
            raise ValueError(f"solved example {q!r} -> {a!r} is not the reference")
    if not lines[-1].startswith(question_prefix):
        raise ValueError(f"the last line must be a question starting with {question_prefix!r}")
    return answer_of(lines[-1])


# ----------------------------------------------------------------------------------------------- toolpick
_PEOPLE = ("Bob", "Alice", "Carol", "Dave", "Eve", "Mia", "Omar", "Lena", "Raj", "Zoe", "Ivan", "Nora", "Sam", "Tina")
_ROOMS = ("kitchen", "bedroom", "office", "garage", "hall", "attic")
_GENRES = ("jazz", "rock", "pop", "folk", "blues", "soul")
_LANGS = ("French", "German", "Spanish", "Hindi", "Korean", "Swahili")
_PLACES = ("station", "airport", "museum", "harbor", "campus", "stadium")
_DISHES = ("pizza", "sushi", "tacos", "noodles", "salad", "curry")


def _words(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 4)))


def _alternation(values: Sequence[str]) -> str:
    return "(?:" + "|".join(re.escape(v) for v in sorted(values, key=len, reverse=True)) + ")"


# slot -> (JSON type, sampler(rng) -> surface text, regex of the surface text); the value is the surface text
# (converted to int for int slots): arguments are copied, never computed
_TP_SLOTS: dict[str, tuple[str, Any, str]] = {
    "city": ("str", lambda rng: rng.choice(_CITIES), _alternation(_CITIES)),
    "city2": ("str", lambda rng: rng.choice(_CITIES), _alternation(_CITIES)),
    "person": ("str", lambda rng: rng.choice(_PEOPLE), _alternation(_PEOPLE)),
    "text": ("str", _words, r"[a-z]+(?: [a-z]+)*"),
    "time": ("str", lambda rng: f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}", r"\d\d:\d\d"),
    "date": ("str", lambda rng: f"2027-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}", r"\d{4}-\d\d-\d\d"),
    "count": ("int", lambda rng: str(rng.randint(2, 99)), r"[1-9]\d?"),
    "amount": ("int", lambda rng: str(_operand(rng, 999, lo=2)), r"[1-9]\d{0,2}"),
    "room": ("str", lambda rng: rng.choice(_ROOMS), _alternation(_ROOMS)),
    "genre": ("str", lambda rng: rng.choice(_GENRES), _alternation(_GENRES)),
    "lang": ("str", lambda rng: rng.choice(_LANGS), _alternation(_LANGS)),
    "place": ("str", lambda rng: rng.choice(_PLACES), _alternation(_PLACES)),
    "place2": ("str", lambda rng: rng.choice(_PLACES), _alternation(_PLACES)),
    "dish": ("str", lambda rng: rng.choice(_DISHES), _alternation(_DISHES)),
    "symbol": ("str", lambda rng: "".join(rng.choice("ABCDEFGHKLMNPRSTXZ") for _ in range(rng.randint(3, 4))),
               r"[A-Z]{3,4}"),
}

# intent -> (two spellings: (tool name, ((slot, argument name), ...)), request templates); every template uses
# every slot of its intent, so a request fills all arguments
_TP_INTENTS: dict[str, tuple[tuple[tuple[str, tuple[tuple[str, str], ...]], ...], tuple[str, ...]]] = {
    "weather": ((("get_weather", (("city", "city"),)), ("forecast", (("city", "location"),))),
                ("what is the weather in {city}", "forecast for {city}", "will it rain in {city}")),
    "alarm": ((("set_alarm", (("time", "time"),)), ("wake_up", (("time", "at"),))),
              ("wake me up at {time}", "set an alarm for {time}")),
    "timer": ((("set_timer", (("count", "minutes"),)), ("countdown", (("count", "mins"),))),
              ("set a timer for {count} minutes", "count down {count} minutes")),
    "message": ((("send_message", (("person", "to"), ("text", "text"))),
                 ("text_contact", (("person", "name"), ("text", "body")))),
                ("tell {person} that {text}", "message {person}: {text}")),
    "call": ((("call_contact", (("person", "name"),)), ("phone", (("person", "to"),))),
             ("call {person}", "ring {person} please")),
    "email": ((("send_email", (("person", "to"), ("text", "subject"))),
               ("email", (("person", "recipient"), ("text", "title")))),
              ("email {person} about {text}", "write {person} an email about {text}")),
    "flight": ((("book_flight", (("city", "from"), ("city2", "to"), ("date", "date"))),
                ("find_flights", (("city", "origin"), ("city2", "dest"), ("date", "day")))),
               ("book a flight from {city} to {city2} on {date}", "fly me from {city} to {city2} on {date}")),
    "hotel": ((("book_hotel", (("city", "city"), ("count", "nights"))),
               ("reserve_room", (("city", "place"), ("count", "count")))),
              ("book a hotel in {city} for {count} nights", "reserve {count} nights in {city}")),
    "music": ((("play_music", (("genre", "genre"), ("room", "room"))),
               ("play", (("genre", "style"), ("room", "zone")))),
              ("play {genre} in the {room}", "put on some {genre} music in the {room}")),
    "lights": ((("set_lights", (("room", "room"), ("count", "level"))),
                ("dim", (("room", "area"), ("count", "percent")))),
               ("set the {room} lights to {count} percent", "dim the {room} to {count}")),
    "reminder": ((("remind", (("text", "text"), ("time", "time"))),
                  ("add_reminder", (("text", "note"), ("time", "at")))),
                 ("remind me to {text} at {time}", "at {time} remind me to {text}")),
    "note": ((("add_note", (("text", "text"),)), ("save_note", (("text", "body"),))),
             ("note that {text}", "save a note: {text}")),
    "taxi": ((("order_taxi", (("place", "from"), ("place2", "to"))),
              ("ride", (("place", "pickup"), ("place2", "dropoff")))),
             ("get me a taxi from the {place} to the {place2}", "ride from the {place} to the {place2}")),
    "translate": ((("translate", (("text", "text"), ("lang", "lang"))),
                   ("to_language", (("text", "phrase"), ("lang", "target")))),
                  ("translate {text} into {lang}", "say {text} in {lang}")),
    "stock": ((("get_price", (("symbol", "symbol"),)), ("quote", (("symbol", "ticker"),))),
              ("price of {symbol}", "how is {symbol} trading")),
    "search": ((("web_search", (("text", "query"),)), ("search", (("text", "q"),))),
               ("search the web for {text}", "look up {text}")),
    "food": ((("order_food", (("dish", "dish"), ("count", "count"))), ("food", (("dish", "item"), ("count", "qty")))),
             ("order {count} {dish}", "get me {count} portions of {dish}")),
    "event": ((("add_event", (("text", "title"), ("date", "date"), ("time", "time"))),
               ("schedule", (("text", "name"), ("date", "day"), ("time", "at")))),
              ("add {text} on {date} at {time} to my calendar", "schedule {text} for {date} at {time}")),
    "payment": ((("pay", (("person", "to"), ("amount", "amount"))),
                 ("send_money", (("person", "recipient"), ("amount", "sum")))),
                ("pay {person} {amount} dollars", "send {amount} dollars to {person}")),
    "stock_alert": ((("price_alert", (("symbol", "symbol"), ("amount", "price"))),
                     ("watch", (("symbol", "ticker"), ("amount", "limit")))),
                    ("alert me when {symbol} hits {amount}", "watch {symbol} for {amount}")),
}
_TP_TOOL = {name: (intent, args) for intent, (spellings, _) in _TP_INTENTS.items() for name, args in spellings}
_TP_SCHEMA = {name: f"{name}({','.join(f'{arg}:{_TP_SLOTS[slot][0]}' for slot, arg in args)})"
              for name, (_, args) in _TP_TOOL.items()}


def _tp_template_rx(template: str) -> re.Pattern:
    parts = re.split(r"\{(\w+)\}", template)
    return re.compile("".join(re.escape(s) if i % 2 == 0 else f"(?P<{s}>{_TP_SLOTS[s][2]})"
                              for i, s in enumerate(parts)))


_TP_RX = {intent: [_tp_template_rx(t) for t in templates] for intent, (_, templates) in _TP_INTENTS.items()}


def _tp_call(tool: str, slots: dict[str, str]) -> str:
    args = {arg: int(slots[slot]) if _TP_SLOTS[slot][0] == "int" else slots[slot] for slot, arg in _TP_TOOL[tool][1]}
    return json.dumps({"name": tool, "arguments": args}, separators=(",", ":"), ensure_ascii=True)


def _tp_answer(offered: Sequence[str], request: str) -> str:
    """The call for one ``user: ...`` line: the offered tool whose intent's template parses the request."""
    if not request.startswith("user: "):
        raise ValueError(f"not a toolpick request: {request!r}")
    text = request[len("user: "):]
    found = []
    for tool in offered:
        intent = _TP_TOOL[tool][0]
        for rx in _TP_RX[intent]:
            m = rx.fullmatch(text)
            if m:
                call = _tp_call(tool, m.groupdict())
                if call not in found:
                    found.append(call)
    if len(found) != 1:
        raise ValueError(f"toolpick request {text!r} has {len(found)} parses among the offered tools")
    return found[0]


def _parse_toolpick(prompt: str) -> tuple[list[str], list[str]]:
    lines = prompt.split(_NL)
    if lines[0] != "tools:":
        raise ValueError(f"not a toolpick prompt: {prompt[:40]!r}")
    offered, i = [], 1
    while i < len(lines) and not lines[i].startswith("user: "):
        name = lines[i].split("(", 1)[0]
        if name not in _TP_SCHEMA or _TP_SCHEMA[name] != lines[i]:
            raise ValueError(f"unknown toolpick schema: {lines[i]!r}")
        offered.append(name)
        i += 1
    if len({_TP_TOOL[t][0] for t in offered}) != len(offered):
        raise ValueError("a toolpick prompt offers one spelling per intent")
    return offered, lines[i:]


def _solve_toolpick(prompt: str) -> str:
    offered, rest = _parse_toolpick(prompt)
    return _solve_dialogue(rest, lambda q: _tp_answer(offered, q), "user: ")


def _gen_toolpick(rng: random.Random, p: dict) -> tuple[str, str, dict]:
    n_offered = rng.randint(int(p["min_offered"]), min(int(p["max_offered"]), len(_TP_INTENTS)))
    intents = rng.sample(sorted(_TP_INTENTS), n_offered)
    offered = [rng.choice(_TP_INTENTS[i][0])[0] for i in intents]
    n_requests = rng.randint(int(p["min_steps"]), int(p["max_steps"]))
    lines: list[str] = []
    for _ in range(n_requests):
        intent = rng.choice(intents)
        slots = {s: _TP_SLOTS[s][1](rng) for s, _ in _TP_INTENTS[intent][0][0][1]}  # slot order fixed: reproducible
        while "city2" in slots and slots["city2"] == slots["city"]:
            slots["city2"] = _TP_SLOTS["city2"][1](rng)
        while "place2" in slots and slots["place2"] == slots["place"]:
            slots["place2"] = _TP_SLOTS["place2"][1](rng)
        request = "user: " + rng.choice(_TP_INTENTS[intent][1]).format(**slots)
        lines += [request, _tp_answer(offered, request)]
    head = ["tools:"] + [_TP_SCHEMA[t] for t in offered]
    while len(lines) > 2 and len(_NL.join(head + lines)) > int(p["max_chars"]):
        lines = lines[2:]  # drop solved requests first
    while len(_NL.join(head + lines)) > int(p["max_chars"]) and len(head) > 2:  # then schemas the last one skips
        asked = json.loads(lines[-1])["name"]
        spare = [i for i in range(1, len(head)) if head[i].split("(", 1)[0] != asked
                 and all(json.loads(a)["name"] != head[i].split("(", 1)[0] for a in lines[1:-1:2])]
        if not spare:
            break
        del head[rng.choice(spare)]
    prompt = _NL.join(head + lines[:-1])
    return prompt, lines[-1], {"offered": [h.split("(", 1)[0] for h in head[1:]], "requests": len(lines) // 2}


# ----------------------------------------------------------------------------------------------- steps
_STEPS_PROMPT = re.compile(r"steps: ([1-9]\d*|0)((?: [+\-*][1-9]\d*)+)")


def _gen_steps(rng: random.Random, p: dict) -> tuple[str, str, dict]:
    max_value = int(p["max_value"])
    weights = dict(zip("+-*", p["op_weights"]))
    n_ops = rng.randint(int(p["min_steps"]), int(p["max_steps"]))
    total = first = _operand(rng, max_value)
    ops: list[tuple[str, int]] = []
    while len(ops) < n_ops:
        cand = [c for c, ok in (("+", total < max_value), ("-", total > 0),
                                ("*", 1 <= total and total * 2 <= max_value)) if ok]
        op, v = _draw_operation(rng, total, max_value, cand, weights, int(p["max_multiplier"]))
        if (op, v) in ops:  # unique operations: the next operand is the one after the last used (no ambiguity)
            continue
        ops.append((op, v))
        total = _apply_math(total, op, v)
    answer, result = _math_answer(first, ops)
    while len(ops) > 1 and len(_steps_prompt(first, ops)) + 1 + len(_math_answer(first, ops)[0]) > int(p["max_chars"]):
        ops.pop()
        answer, result = _math_answer(first, ops)
    return _steps_prompt(first, ops), answer, {"ops": len(ops), "result": result}


def _steps_prompt(first: int, ops: Sequence[tuple[str, int]]) -> str:
    return "steps: " + " ".join([str(first)] + [f"{op}{v}" for op, v in ops])


def _solve_steps(prompt: str) -> str:
    m = _STEPS_PROMPT.fullmatch(prompt)
    if not m:
        raise ValueError(f"not a steps prompt: {prompt!r}")
    first = int(m.group(1))
    ops = [(t[0], int(t[1:])) for t in m.group(2).split()]
    total = first
    for op, v in ops:
        total = _apply_math(total, op, v)
        if not 0 <= total <= 999:
            raise ValueError(f"steps running total leaves 0..999: {prompt!r}")
    if len(set(ops)) != len(ops):
        raise ValueError(f"steps operations repeat: {prompt!r}")
    return _math_answer(first, ops)[0]


# ----------------------------------------------------------------------------------------------- fewshot
# The base families' generators, parameters and solvers live in (or are wired by) ``suite``, which imports this
# module; ``suite`` passes them in, so this module never imports it (the package has no import cycles).
FEWSHOT_BASES = ("math", "code", "tool", "steps")


def gen_fewshot(rng: random.Random, p: dict, bases: Mapping[str, tuple[Callable, dict]]) -> tuple[str, str, dict]:
    """Solved examples of one base family, one line each for prompt and answer, the last one asked;
    ``bases`` maps a base family to (its generator, its parameters)."""
    base = rng.choice(list(p["bases"]))
    gen, params = bases[base]
    n = rng.randint(int(p["min_steps"]), int(p["max_steps"]))
    pairs: list[tuple[str, str]] = []
    while len(pairs) < n:
        prompt, answer, _ = gen(rng, params)
        if all(prompt != q for q, _ in pairs):
            pairs.append((prompt, answer))
    while len(pairs) > 2 and len(_NL.join(x for pa in pairs for x in pa)) > int(p["max_chars"]):
        pairs.pop(0)  # drop solved examples to fit, keep at least one
    lines = [x for pa in pairs for x in pa]
    return _NL.join(lines[:-1]), lines[-1], {"base": base, "examples": len(pairs)}


def solve_fewshot(prompt: str, family_of: Callable[[str], str], solve: Callable[[str, str], str]) -> str:
    """The answer to the last question after checking every solved example (``family_of`` / ``solve``: the
    suite's)."""
    lines = prompt.split(_NL)
    if len(lines) < 3:
        raise ValueError("a fewshot prompt needs at least one solved example before the question")
    base = family_of(lines[0])
    if base not in FEWSHOT_BASES:
        raise ValueError(f"fewshot base family must be one of {FEWSHOT_BASES}, got {base}")
    if any(family_of(q) != base for q in lines[0::2]):
        raise ValueError("every example of a fewshot prompt must be of the same family")
    return _solve_dialogue(lines, lambda q: solve(base, q), "")


# ----------------------------------------------------------------------------------------------- registry
# fewshot is wired in ``suite`` (``gen_fewshot`` / ``solve_fewshot`` need the base families)
LONG_GENERATORS = {"lookup": _gen_lookup, "toolpick": _gen_toolpick, "steps": _gen_steps}
LONG_SOLVERS = {"lookup": _solve_lookup, "toolpick": _solve_toolpick, "steps": _solve_steps}


def check_long_params(task: str, p: dict) -> None:
    """ValueError naming the parameter and the fix when a long family's parameters cannot generate."""
    if task == "lookup" and not (2 <= int(p["min_rows"]) <= int(p["max_rows"]) <= 800):
        raise ValueError(f"lookup needs 2 <= min_rows <= max_rows <= 800 (distinct 3-digit ids), got "
                         f"{p['min_rows']}..{p['max_rows']}")
    if task == "lookup" and not 0 <= int(p["min_columns"]) <= int(p["max_columns"]) <= len(_LOOKUP_COLUMNS):
        raise ValueError(f"lookup needs 0 <= min_columns <= max_columns <= {len(_LOOKUP_COLUMNS)}")
    if task == "lookup" and not 0 <= float(p["name_key_share"]) <= 1:
        raise ValueError(f"lookup name_key_share must be in [0, 1] (the share of questions keyed by name), got "
                         f"{p['name_key_share']}")
    if task == "toolpick" and not 1 <= int(p["min_offered"]) <= int(p["max_offered"]):
        raise ValueError(f"toolpick needs 1 <= min_offered <= max_offered (at most {len(_TP_INTENTS)} intents)")
    if task == "fewshot" and (not p["bases"] or set(p["bases"]) - set(FEWSHOT_BASES)):
        raise ValueError(f"fewshot bases must be a non-empty subset of {FEWSHOT_BASES}")
    if task == "fewshot" and int(p["min_steps"]) < 2:
        raise ValueError("fewshot min_steps must be >= 2 (one solved example and the question)")


def long_family_of(prompt: str) -> str | None:
    """The long family of ``prompt`` from its first line, or None (then it is one of math / code / tool)."""
    if prompt.startswith("table: "):
        return "lookup"
    if prompt.startswith("tools:" + _NL):
        return "toolpick"
    if _NL in prompt.strip():  # the short families and steps never span lines: solved examples in front
        return "fewshot"
    if prompt.startswith("steps: "):
        return "steps"
    return None


def answer_is_json(task: str, prompt: str) -> bool:
    """Whether ``check`` compares parsed JSON (tool calls) rather than the exact string: toolpick, and fewshot
    whose question is a tool prompt."""
    return task == "toolpick" or (task == "fewshot" and bool(_TOOL_PROMPT.fullmatch(prompt.strip().split(_NL)[-1])))


def shot_answer_lines(task: str, prompt: str) -> list[int]:
    """Indices of the prompt lines that are answers of solved examples (lookup/toolpick/fewshot), for optional
    supervision when packing; empty for single-question prompts."""
    lines = prompt.split(_NL)
    if task == "lookup":
        first = next((i for i, line in enumerate(lines) if line.startswith("find ")), len(lines))
        return list(range(first + 1, len(lines) - 1, 2))
    if task == "toolpick":
        first = next((i for i, line in enumerate(lines) if line.startswith("user: ")), len(lines))
        return list(range(first + 1, len(lines) - 1, 2))
    if task == "fewshot":
        return list(range(1, len(lines) - 1, 2))
    return []


# ----------------------------------------------------------------------------------------------- packing
def encode_packed(tokenizer, example, *, supervise_shots: bool = True) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of ``prompt + SEP + answer + EOS``; labels are -100 except the answer and EOS and, with
    ``supervise_shots``, the answers of the solved examples inside the prompt (not their line breaks: after a
    solved answer comes a newline, after the asked one EOS, and the model cannot tell which is the last).

    Pieces are tokenized separately and split only next to a newline, which the pre-tokenizer always isolates,
    so the ids equal tokenizing the whole text (tests check it)."""
    shots = set(shot_answer_lines(example.family, example.prompt)) if supervise_shots else set()
    pieces: list[tuple[str, bool]] = []
    pending = ""
    for i, line in enumerate(example.prompt.split(_NL)):
        if i in shots:
            pieces += [(pending, False), (line, True)]
            pending = _NL
        else:
            pending += line + _NL
    pieces += [(pending, False), (example.answer, True)]
    pieces = [(text, sup) for text, sup in pieces if text]
    encoded = tokenizer([text for text, _ in pieces], add_special_tokens=False)["input_ids"]
    ids: list[int] = []
    labels: list[int] = []
    for (_, supervised), piece in zip(pieces, encoded):
        ids += piece
        labels += piece if supervised else [-100] * len(piece)
    ids.append(tokenizer.eos_token_id)
    labels.append(tokenizer.eos_token_id)
    return ids, labels


def pack_sequences(encoded: Sequence[tuple[list[int], ...]], seq_len: int, seed: int = 0
                   ) -> tuple[list[tuple[list[int], ...]], int]:
    """First-fit-decreasing packing of whole examples into sequences of at most ``seq_len`` tokens.

    ``encoded``: per example a tuple of equally long per-token lists, ``(ids, labels)`` or ``(ids, labels, more)``.
    Returns (sequences, dropped): each sequence concatenates, list by list, some examples in a shuffled order (so
    short examples also sit late in a sequence), unpadded; examples longer than ``seq_len`` are dropped and
    counted, never cut (a cut answer would teach a wrong end). Deterministic for ``seed``."""
    if seq_len < 2:
        raise ValueError(f"--seq-len must be >= 2, got {seq_len}")
    order = sorted(range(len(encoded)), key=lambda i: -len(encoded[i][0]))
    bins: list[list[int]] = []
    room: list[int] = []
    dropped = 0
    for i in order:
        size = len(encoded[i][0])
        if size > seq_len:
            dropped += 1
            continue
        for b, free in enumerate(room):
            if size <= free:
                bins[b].append(i)
                room[b] -= size
                break
        else:
            bins.append([i])
            room.append(seq_len - size)
    rng = random.Random(seed)
    sequences = []
    for members in bins:
        rng.shuffle(members)
        fields = range(len(encoded[members[0]]))
        sequences.append(tuple([t for i in members for t in encoded[i][k]] for k in fields))
    return sequences, dropped


def _stable_seed(*parts: object) -> int:
    return int.from_bytes(hashlib.sha256("|".join(map(str, parts)).encode()).digest()[:8], "big")


def packed_batches(tokenizer, make_examples: Callable[[int], Sequence], *, seq_len: int = 1024, batch_size: int = 8,
                   seed: int = 2025, start: tuple[int, int] = (0, 0), supervise_shots: bool = True,
                   token_families: Sequence[str] | None = None) -> Iterator[tuple]:
    """Endless ``(position, input_ids, labels)`` training batches of packed sequences, right-padded to the batch's
    longest sequence (padding after the content needs no attention mask under causal attention).

    With ``token_families`` (family names) each batch also carries ``families`` [batch, width]: per token the index
    in ``token_families`` of the example it belongs to, -1 on padding, so a trainer can report its loss per family
    (``(position, input_ids, labels, families)``; the other three are the same as without it).

    Chunk ``c`` is ``make_examples(c)`` (e.g. ``suite.long_suite(n, seed + 1000 * c, exclude=...)``), packed and
    shuffled; ``position`` is ``(chunk, next batch index)`` AFTER this batch, so passing it back as ``start``
    resumes exactly (a checkpoint stores it). The last partial batch of a chunk is dropped."""
    import torch

    chunk, skip = start
    while True:
        examples = make_examples(chunk)
        encoded = [encode_packed(tokenizer, e, supervise_shots=supervise_shots) for e in examples]
        if token_families is not None:
            family_index = {family: i for i, family in enumerate(token_families)}
            unknown = sorted({e.family for e in examples} - family_index.keys())
            if unknown:
                raise ValueError(f"token_families {list(token_families)} lacks the families {unknown}")
            encoded = [(ids, labels, [family_index[e.family]] * len(ids))
                       for e, (ids, labels) in zip(examples, encoded)]
        sequences, _ = pack_sequences(encoded, seq_len, seed=_stable_seed(seed, "pack", chunk))
        random.Random(_stable_seed(seed, "batches", chunk)).shuffle(sequences)
        batches = [sequences[i : i + batch_size] for i in range(0, len(sequences) - batch_size + 1, batch_size)]
        for index in range(skip, len(batches)):
            group = batches[index]
            width = max(len(sequence[0]) for sequence in group)
            ids = torch.full((len(group), width), tokenizer.pad_token_id, dtype=torch.long)
            labels = torch.full((len(group), width), -100, dtype=torch.long)
            for row, sequence in enumerate(group):
                ids[row, : len(sequence[0])] = torch.tensor(sequence[0])
                labels[row, : len(sequence[1])] = torch.tensor(sequence[1])
            if token_families is None:
                yield (chunk, index + 1), ids, labels
                continue
            families = torch.full((len(group), width), -1, dtype=torch.long)
            for row, sequence in enumerate(group):
                families[row, : len(sequence[2])] = torch.tensor(sequence[2])
            yield (chunk, index + 1), ids, labels, families
        chunk, skip = chunk + 1, 0

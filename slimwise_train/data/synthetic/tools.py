"""``tool`` family of the synthetic suite: JSON function calls from a schema list and a request
(generator ``_gen_tool``, solver ``_solve_tool``, tool/template tables; format in ``suite``'s docstring)."""

from __future__ import annotations

import json
import random
import re
from typing import Any, Callable, Sequence

from .common import _operand

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

"""The shipped chat and tool-call conversations (slimwise_train/assets/data/), written by the project.

The synthetic suite's tool family turned into multi-turn tool conversations, plus a few plain chat rows (its math and
code problems), in the two row forms data/chat.py reads:
  * `tool_chats_openai.jsonl`: OpenAI form, `messages` (system, user, assistant `tool_calls`, `tool` results,
    assistant answer) and `tools` (a list of {"type": "function", "function": <schema>});
  * `tool_chats_sharegpt.jsonl`: ShareGPT form as APIGen-MT stores it, `conversations` (human, function_call,
    observation, gpt), `system` (text) and `tools` (the list of schemas as JSON text).
Both hold the same conversations: 24 with one call (system, user, call, result, answer: 5 turns), 12 with two calls
in a row (7 turns), 12 with two rounds (9 turns), and 16 chat rows (user, assistant; half with a system prompt).
Deterministic: `python scripts/make_tool_chats.py` regenerates the files byte for byte (tests/test_tool_chats.py).
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from slimwise_train.data import synthetic
from slimwise_train.data.synthetic.tools import TOOLS
from slimwise_train.utils.atomic import write_text_atomic

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "data"
FILES = {"openai": "tool_chats_openai.jsonl", "sharegpt": "tool_chats_sharegpt.jsonl"}

TOOL_SYSTEM = ("You are a phone assistant. When the user asks for an action, call one of the tools, then tell the user "
               "what it did.")
CHAT_SYSTEM = "Work the problem out step by step, then give the result."
_DESCRIPTIONS = {
    "set_alarm": "Set an alarm at a time of day (HH:MM, 24-hour clock), optionally with a label.",
    "set_timer": "Start a countdown timer of a number of minutes.",
    "get_weather": "Current weather in a city, in celsius unless asked otherwise.",
    "send_message": "Send a text message to a contact.",
    "convert_currency": "Convert an amount of money from one currency to another (ISO codes).",
}
_RATES_TO_USD = {"USD": 1.0, "EUR": 1.08, "GBP": 1.27, "JPY": 0.0067, "CHF": 1.13, "INR": 0.012}
_SKIES = ("sunny", "cloudy", "rainy", "snowy", "windy")


def tool_schema(name: str) -> dict:
    """The JSON schema of one suite tool (what a chat template lists)."""
    properties, required = {}, []
    for argument, kind, needed in TOOLS[name]:
        if kind == "int":
            properties[argument] = {"type": "integer"}
        elif "|" in kind:
            properties[argument] = {"type": "string", "enum": kind.split("|")}
        else:
            properties[argument] = {"type": "string"}
        if needed:
            required.append(argument)
    return {"name": name, "description": _DESCRIPTIONS[name],
            "parameters": {"type": "object", "properties": properties, "required": required}}


def _result(rng: random.Random, call: dict) -> dict:
    name, args = call["name"], call["arguments"]
    if name == "set_alarm":
        return {"status": "set", **args}
    if name == "set_timer":
        return {"status": "running", "minutes": args["minutes"]}
    if name == "get_weather":
        return {"city": args["city"], "temperature": rng.randint(-5, 35), "unit": args.get("unit", "celsius"),
                "sky": rng.choice(_SKIES)}
    if name == "send_message":
        return {"status": "sent", "to": args["to"]}
    amount = round(args["amount"] * _RATES_TO_USD[args["from"]] / _RATES_TO_USD[args["to"]], 2)
    return {"amount": args["amount"], "from": args["from"], "to": args["to"], "result": amount}


def _answer(call: dict, result: dict) -> str:
    name = call["name"]
    if name == "set_alarm":
        return f"Your alarm is set for {result['time']}" + (f" ({result['label']})." if "label" in result else ".")
    if name == "set_timer":
        return f"Your timer for {result['minutes']} minutes is running."
    if name == "get_weather":
        return f"It is {result['temperature']} degrees {result['unit']} and {result['sky']} in {result['city']}."
    if name == "send_message":
        return f"I sent your message to {result['to']}."
    return f"{result['amount']} {result['from']} is {result['result']} {result['to']}."


_REQUEST = re.compile(r"T: \S+ U: (.+)")


def _round(rng: random.Random, example) -> list[tuple[str, object]]:
    """One user request of the suite and what follows it: each call, its result, then the answer."""
    turns: list[tuple[str, object]] = [("user", _REQUEST.fullmatch(example.prompt).group(1))]
    answers = []
    for call in example.meta["calls"]:
        result = _result(rng, call)
        turns += [("call", call), ("tool", result)]
        answers.append(_answer(call, result))
    return turns + [("assistant", " ".join(answers))]


def conversations(seed: int = 0) -> list[dict]:
    """The shipped conversations in a neutral form: {"system", "tools" (schemas or None), "turns": [(kind, value)]}
    with kind user | call (a {"name", "arguments"} call) | tool (its result) | assistant."""
    rng = random.Random(seed)
    single = synthetic.generate("tool", 48, seed, stream="chats-one", min_steps=1, max_steps=1)
    double = synthetic.generate("tool", 12, seed, stream="chats-two", min_steps=2, max_steps=2)
    out = []
    for example in single[:24] + double:
        out.append({"system": TOOL_SYSTEM, "offered": example.meta["offered"], "turns": _round(rng, example)})
    for first, second in zip(single[24:36], single[36:48]):
        offered = list(dict.fromkeys(first.meta["offered"] + second.meta["offered"]))
        out.append({"system": TOOL_SYSTEM, "offered": offered, "turns": _round(rng, first) + _round(rng, second)})
    problems = synthetic.generate("math", 8, seed, stream="chats") + synthetic.generate("code", 8, seed, stream="chats")
    for i, example in enumerate(problems):
        out.append({"system": CHAT_SYSTEM if i % 2 else None, "offered": None,
                    "turns": [("user", example.prompt), ("assistant", example.answer)]})
    for conversation in out:
        offered = conversation.pop("offered")
        conversation["tools"] = None if offered is None else [tool_schema(name) for name in offered]
    return out


def to_openai(conversation: dict) -> dict:
    """A conversation as an OpenAI-form row: messages (+ tools)."""
    messages = [{"role": "system", "content": conversation["system"]}] if conversation["system"] else []
    for kind, value in conversation["turns"]:
        if kind == "call":
            messages.append({"role": "assistant", "tool_calls": [{"type": "function", "function": value}]})
        elif kind == "tool":
            messages.append({"role": "tool", "content": json.dumps(value)})
        else:
            messages.append({"role": kind, "content": value})
    row = {"messages": messages}
    if conversation["tools"] is not None:
        row["tools"] = [{"type": "function", "function": schema} for schema in conversation["tools"]]
    return row


def to_sharegpt(conversation: dict) -> dict:
    """A conversation as a ShareGPT row the way APIGen-MT stores it: conversations, system, tools as JSON text."""
    names = {"user": "human", "call": "function_call", "tool": "observation", "assistant": "gpt"}
    turns = [{"from": names[kind], "value": value if isinstance(value, str) else json.dumps(value)}
             for kind, value in conversation["turns"]]
    row: dict = {"conversations": turns}
    if conversation["system"]:
        row["system"] = conversation["system"]
    if conversation["tools"] is not None:
        row["tools"] = json.dumps(conversation["tools"])
    return row


def render_files(seed: int = 0) -> dict[str, str]:
    """{file name: its text}: one JSON row per line, ASCII."""
    rows = conversations(seed)
    return {FILES[form]: "".join(json.dumps(convert(c), ensure_ascii=True) + "\n" for c in rows)
            for form, convert in (("openai", to_openai), ("sharegpt", to_sharegpt))}


def write_tool_chats(folder: str | Path = ASSETS, seed: int = 0) -> list[Path]:
    """Write both files into `folder` (atomically); returns their paths."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, text in render_files(seed).items():
        write_text_atomic(folder / name, text)
        paths.append(folder / name)
    return paths

"""Conversations as the model serves them: rows in OpenAI or ShareGPT form, rendered WHOLE by the tokenizer's own chat
template (system prompt, tools, every turn), with every assistant turn found from the template itself.

Row forms (one conversation per row; either column name may hold either form):
  * OpenAI: `messages` = [{"role": system|user|assistant|tool, "content": text, ...}]. An assistant turn may carry
    `tool_calls` = [{"type": "function", "function": {"name": ..., "arguments": {...} or JSON text}}] (its content
    then may be null); a `tool` turn holds a tool's result. A message's other keys (name, tool_call_id,
    reasoning_content, ...) reach the template unchanged.
  * ShareGPT: `conversations` = [{"from": human|gpt|system|function_call|observation, "value": text}]. A
    `function_call` turn is an assistant tool call whose value is the call as JSON ({"name", "arguments"}, or a list
    of them); an `observation` is a tool result.
  * Optional columns: `tools` (a list of tool schemas, or that list as JSON text, as APIGen-MT stores it), handed to
    the template as its `tools` in the OpenAI form (a bare schema wrapped as {"type": "function", "function": ...});
    `system` (text), rendered as the first, system, turn.

Assistant turns (`Rendered.supervised`, 1 per token of an assistant turn) come from the template, never from
searching the text:
  * its `{% generation %}` ... `{% endgeneration %}` markers when it has them (transformers'
    `return_assistant_tokens_mask`);
  * else by rendering prefixes: assistant turn i is the tokens between the conversation before it rendered with the
    generation prompt and the conversation up to and with it, each checked to be a token prefix of the whole
    rendering. A template for which that does not hold (one that drops earlier turns' reasoning once a later turn
    follows) is an error naming the fix: add the markers.

Bad rows raise `BadRow` (a ValueError: one line naming the row, what is wrong and the fix; `reason` is its kind, what
`data.bad_rows=skip` counts); rows with nothing to learn from raise `SkipRow` (always skipped and counted).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

# Every role name a row may use (OpenAI's and ShareGPT's) -> the OpenAI role the templates read.
ROLES = {"system": "system", "user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant",
         "function_call": "assistant", "tool": "tool", "observation": "tool", "function": "tool"}
_ROLE_NAMES = "system, user, assistant, tool (OpenAI) or system, human, gpt, function_call, observation (ShareGPT)"
# transformers' own test for a template's assistant markers (render_jinja_template)
_GENERATION_TAG = re.compile(r"\{\%-?\s*generation\s*-?\%\}")

MARKERS = "generation markers"
PREFIXES = "prefix rendering"


class BadRow(ValueError):
    """A row that cannot be trained on as it is: one line naming the row, what is wrong and the fix. `reason` names
    its kind (what data.bad_rows=skip counts)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


class SkipRow(Exception):
    """A row with nothing to learn from (no assistant turn, blank): skipped and counted by `reason`, never an error."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def _where(origin: str) -> str:
    return origin or "a data row"


@dataclass(frozen=True)
class Conversation:
    """One conversation in OpenAI form (what chat templates read), held as JSON text so that it hashes and compares
    by value (held-out rows are checked against training rows). `origin` names the row in messages
    ("row 17 of rows.jsonl"); it is not part of the value."""

    messages_json: str
    tools_json: str | None = None
    family: str = ""
    origin: str = field(default="", compare=False)

    @classmethod
    def of(cls, messages: list[dict], tools: list | None = None, family: str = "", origin: str = "") -> "Conversation":
        # Key order is kept, not sorted: a template that writes a tool schema or call arguments as JSON shows it.
        return cls(json.dumps(messages, ensure_ascii=False),
                   None if tools is None else json.dumps(tools, ensure_ascii=False), family, origin)

    @property
    def messages(self) -> list[dict]:
        return json.loads(self.messages_json)

    @property
    def tools(self) -> list | None:
        return None if self.tools_json is None else json.loads(self.tools_json)

    def up_to(self, last: int) -> "Conversation":
        """The conversation cut after message `last` (a whole turn)."""
        return Conversation.of(self.messages[: last + 1], self.tools, self.family, self.origin)


# --------------------------------------------------------------------------- rows -> conversations


def _text(value: Any, what: str, origin: str) -> str:
    if not isinstance(value, str):
        raise BadRow("content not text", f"{_where(origin)}: {what} is {type(value).__name__} {str(value)[:40]!r}, not "
                                          "text: fix or drop such rows")
    return value


def _tool_call(call: Any, what: str, origin: str) -> dict:
    """One tool call in OpenAI form ({"type": "function", "function": {"name", "arguments"}}); a bare
    {"name", "arguments"} (ShareGPT's function_call JSON) is put under "function" as it is."""
    inner = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(inner, dict) or not isinstance(inner.get("name"), str) or not inner["name"]:
        raise BadRow("malformed tool call", f"{_where(origin)}: {what} is {str(call)[:60]!r}, not a tool call "
                                            '{"name": ..., "arguments": {...}}: fix or drop such rows')
    return call if "function" in call else {"type": "function", "function": call}


def _sharegpt_calls(value: Any, index: int, origin: str) -> list[dict]:
    text = _text(value, f"turn {index}'s function_call value", origin)
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError:
        raise BadRow("malformed tool call", f"{_where(origin)}: turn {index} is a function_call whose value is not "
                                            f"JSON ({text[:40]!r}): fix or drop such rows") from None
    calls = parsed if isinstance(parsed, list) else [parsed]
    return [_tool_call(call, f"turn {index}'s function_call", origin) for call in calls]


def _message(turn: dict, index: int, origin: str) -> dict:
    """One turn in OpenAI form; a turn the templates cannot read is a BadRow."""
    openai = "role" in turn
    name = turn.get("role", turn.get("from"))
    role = ROLES.get(name) if isinstance(name, str) else None
    if role is None:
        raise BadRow("unknown role", f"{_where(origin)}: turn {index} has role {name!r}, which the chat templates do "
                                     f"not know; use {_ROLE_NAMES}, or drop such rows")
    if not openai:  # ShareGPT: from/value
        if name == "function_call":
            return {"role": "assistant", "tool_calls": _sharegpt_calls(turn.get("value"), index, origin)}
        return {"role": role, "content": _text(turn.get("value"), f"turn {index}'s value", origin)}
    message = {k: v for k, v in turn.items() if v is not None}
    message["role"] = role
    calls = turn.get("tool_calls")
    if calls is not None:
        if role != "assistant" or not isinstance(calls, list):
            raise BadRow("malformed tool call", f"{_where(origin)}: turn {index} ({name}) has tool_calls "
                                                f"{str(calls)[:40]!r}; only an assistant turn may carry a list of "
                                                "them: fix or drop such rows")
        message["tool_calls"] = [_tool_call(c, f"turn {index}'s tool call", origin) for c in calls]
    if calls is None or turn.get("content") is not None:  # a tool call may come without content, nothing else may
        _text(turn.get("content"), f"turn {index}'s content", origin)
    return message


def _tools(value: Any, origin: str) -> list | None:
    if value is None or value == "":
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise BadRow("malformed tools", f"{_where(origin)}: its tools column is text but not JSON "
                                            f"({value[:40]!r}): give a list of tool schemas or its JSON") from None
    if not isinstance(value, list) or not all(isinstance(t, dict) and isinstance(t.get("function", t).get("name"), str)
                                              for t in value):
        raise BadRow("malformed tools", f"{_where(origin)}: its tools are {str(value)[:60]!r}, not a list of tool "
                                        'schemas ({"name": ..., "parameters": ...}, optionally under "function")')
    # A bare schema (APIGen-MT's, the ShareGPT file's) in the OpenAI form that transformers' get_json_schema gives and
    # templates read (`tool.function.name`: GPT-OSS's, DeepSeek's, Gemma's): the same tools whichever form a row uses.
    return [t if "function" in t else {"type": "function", "function": t} for t in value]


def tool_names(tools: list | None) -> list[str]:
    return [t.get("function", t)["name"] for t in tools or []]


def conversation_from_row(turns: Any, *, system: Any = None, tools: Any = None, family: str = "",
                          origin: str = "") -> Conversation:
    """A row's turns (OpenAI or ShareGPT form), its `system` and `tools` columns, as one Conversation.

    Raises BadRow for what cannot be rendered as given (an unknown role, content that is not text, a malformed tool
    call, a call of a tool the row's `tools` do not list, a `system` column that contradicts the first turn) and
    SkipRow for a row with no assistant turn or no text at all."""
    if not isinstance(turns, list) or not all(isinstance(m, dict) for m in turns):
        raise BadRow("malformed turns", f"{_where(origin)}: its messages are {type(turns).__name__} "
                                        f"{str(turns)[:40]!r}: expected a list of {{\"role\": ..., \"content\": ...}} "
                                        "turns")
    messages = [_message(turn, i, origin) for i, turn in enumerate(turns)]
    tool_list = _tools(tools, origin)
    if system is not None and system != "":
        system = _text(system, "its system column", origin)
        if messages and messages[0]["role"] == "system":
            if messages[0].get("content") != system:
                raise BadRow("two system prompts", f"{_where(origin)}: it has a system column and a different first "
                                                   "system turn; keep one of them")
        else:
            messages.insert(0, {"role": "system", "content": system})
    if tool_list is not None:
        offered = tool_names(tool_list)
        for i, message in enumerate(messages):
            for call in message.get("tool_calls", []):
                if call["function"]["name"] not in offered:
                    raise BadRow("unknown tool", f"{_where(origin)}: turn {i} calls {call['function']['name']!r}, "
                                                 f"which the row's tools do not list ({', '.join(offered) or 'none'}); "
                                                 "add its schema to the tools or drop the row")
    if not any(m.get("content", "").strip() or m.get("tool_calls") for m in messages):
        raise SkipRow("blank")
    if not any(m["role"] == "assistant" for m in messages):
        raise SkipRow("no assistant turn")
    return Conversation.of(messages, tool_list, family, origin)


# --------------------------------------------------------------------------- rendering with the chat template


@dataclass(frozen=True)
class Rendered:
    """A conversation rendered by the chat template: token ids and, per token, 1 where it belongs to an assistant turn
    (None when the turns were not looked for), and how they were found (MARKERS or PREFIXES)."""

    ids: list[int]
    supervised: list[int] | None
    method: str | None

    @property
    def first_supervised(self) -> int | None:
        """Index of the first assistant token (the prompt's length); None: there is none, or it was not looked for."""
        return None if self.supervised is None else next((i for i, s in enumerate(self.supervised) if s), None)


def template_of(tokenizer, tools: list | None = None) -> str | None:
    """The chat template the tokenizer applies to a conversation with these tools (a tokenizer may keep several by
    name), None when it has none."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    return tokenizer.get_chat_template(None, tools)


def has_generation_markers(tokenizer, tools: list | None = None) -> bool:
    template = template_of(tokenizer, tools)
    return bool(template and _GENERATION_TAG.search(template))


def _template_name(tokenizer) -> str:
    return f"the chat template of {getattr(tokenizer, 'name_or_path', '') or 'the tokenizer'} (model.tokenizer)"


def _apply(tokenizer, messages: list[dict], tools: list | None, origin: str, *, generation_prompt: bool = False,
           assistant_mask: bool = False) -> tuple[list[int], list[int] | None]:
    """(ids, assistant mask or None) of `messages` through the chat template. transformers 5 returns a BatchEncoding
    (a mapping that is not a dict) for tokenize=True: read by key, never iterated."""
    import jinja2

    try:
        out = tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=generation_prompt,
                                            tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=assistant_mask)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"{_template_name(tokenizer)} does not compile ({exc}); fix the template") from None
    except (jinja2.TemplateError, TypeError, ValueError) as exc:
        first = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        raise BadRow("template refused it", f"{_where(origin)}: {_template_name(tokenizer)} cannot render it "
                                            f"({first[:160]}): fix the row (roles, tool calls, tools) or drop it") \
            from None
    ids = [int(i) for i in out["input_ids"]]
    return ids, ([int(m) for m in out["assistant_masks"]] if assistant_mask else None)


def _no_turns(tokenizer, origin: str, why: str) -> ValueError:
    return ValueError(f"{_where(origin)}: cannot find the assistant turns from {_template_name(tokenizer)}: {why}; add "
                      "{% generation %} ... {% endgeneration %} around each assistant turn's output in the template "
                      "(tokenizer_config.json's chat_template), or set data.chat_template=false (plain rendering)")


def _turns_by_prefixes(tokenizer, messages: list[dict], tools: list | None, whole: list[int],
                       origin: str) -> list[int]:
    supervised = [0] * len(whole)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if i == 0:
            raise _no_turns(tokenizer, origin, "it has no generation markers and the conversation starts with an "
                                               "assistant turn, so no rendering shows where that turn begins")
        start, _ = _apply(tokenizer, messages[:i], tools, origin, generation_prompt=True)
        end = whole if i == len(messages) - 1 else _apply(tokenizer, messages[: i + 1], tools, origin)[0]
        if whole[: len(start)] != start or whole[: len(end)] != end or len(end) <= len(start):
            raise _no_turns(tokenizer, origin, f"it has no generation markers, and rendering the conversation up to "
                                               f"turn {i} is not a token prefix of the whole rendering (a template "
                                               "that drops earlier turns' reasoning once a later turn follows does "
                                               "this)")
        supervised[len(start): len(end)] = [1] * (len(end) - len(start))
    return supervised


def render(tokenizer, conversation: Conversation, *, find_turns: bool = True) -> Rendered:
    """The whole conversation through the tokenizer's chat template: ids, and with `find_turns` every assistant
    turn's tokens (by the template's generation markers, else by prefix rendering; an error naming the fix when
    neither works). Raises BadRow when the template refuses the row."""
    messages, tools, origin = conversation.messages, conversation.tools, conversation.origin
    if not find_turns:
        return Rendered(_apply(tokenizer, messages, tools, origin)[0], None, None)
    if has_generation_markers(tokenizer, tools):
        ids, mask = _apply(tokenizer, messages, tools, origin, assistant_mask=True)
        if not any(mask):
            raise _no_turns(tokenizer, origin, "its generation markers mark no token of this row's assistant turns")
        return Rendered(ids, mask, MARKERS)
    ids, _ = _apply(tokenizer, messages, tools, origin)
    return Rendered(ids, _turns_by_prefixes(tokenizer, messages, tools, ids, origin), PREFIXES)


# How a conversation longer than data.seq_len was shortened (None: it fits).
CUT_AT_TURN = "cut after a whole assistant turn"
CUT_IN_ANSWER = "cut inside its first assistant turn"
CUT_AT_LIMIT = "cut at data.seq_len"


def render_within(tokenizer, conversation: Conversation, max_len: int, *,
                  find_turns: bool = True) -> tuple[Rendered, str | None]:
    """`render`, kept within `max_len` tokens: a longer conversation is cut after its last assistant turn that fits
    (rendered again as that shorter conversation, CUT_AT_TURN); when not even its first assistant turn fits, the
    tokens are cut at max_len inside that turn (CUT_IN_ANSWER; CUT_AT_LIMIT when the turns are not looked for).
    SkipRow when no assistant token lies within max_len."""
    whole = render(tokenizer, conversation, find_turns=find_turns)
    if len(whole.ids) <= max_len:
        return whole, None
    messages = conversation.messages
    ends = [i for i, m in enumerate(messages) if m["role"] == "assistant" and i < len(messages) - 1]
    for last in reversed(ends):
        shorter = conversation.up_to(last)
        if len(_apply(tokenizer, shorter.messages, shorter.tools, shorter.origin)[0]) <= max_len:
            return render(tokenizer, shorter, find_turns=find_turns), CUT_AT_TURN
    if not find_turns:
        return Rendered(whole.ids[:max_len], None, None), CUT_AT_LIMIT
    first = whole.first_supervised
    if first is None or first >= max_len:
        raise SkipRow("no assistant token within data.seq_len")
    return Rendered(whole.ids[:max_len], whole.supervised[:max_len], whole.method), CUT_IN_ANSWER

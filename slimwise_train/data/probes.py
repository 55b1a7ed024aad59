"""Probe texts and conversations for checking tokenizers and chat templates: varied on purpose (code, CJK, emoji,
numbers, whitespace runs, other scripts, combining marks, a tokenizer's own special tokens), generated
deterministically from a seed so a check is the same on every machine (the twins' tokenizer tests, `serve gguf`'s
tokenization check).

The probe conversations (OpenAI form): `TOOL_CONVERSATION` (system, user, assistant tool call, tool result, assistant)
with `TOOLS`, and `MULTI_CALL_CONVERSATION` (two calls in one turn, two results, a second user turn);
`chat_probe_texts` renders them with a tokenizer's own chat template.
"""

from __future__ import annotations

import random
import unicodedata
from typing import Sequence

ENGLISH = (
    "The quick brown fox jumps over the lazy dog.",
    "It's a well-known fact that you'll need more than two words, isn't it?",
    "Prefill runs the full expert pool; decode runs the pruned one on the same cache.",
    "Mr. O'Neill said: \"we'd better check the logs\" -- twice!",
    "PRUNING 50% OF THE EXPERTS halves the expert bytes read per decode step.",
    "can't won't shouldn't I'm you're they've we'll she'd",
)
CODE = (
    "def f(x, y=2):\n    return {'k': [x, y], \"s\": x ** y}\n",
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }",
    "if __name__ == \"__main__\":\n\tmain(sys.argv[1:])\n",
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name DESC;",
    "const add = (a, b) => a + b; // arrow function\n",
    "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"celsius\"}}",
    "x = [i**2 for i in range(10) if i % 3 == 0]  # squares",
    "<div class=\"row\"><span id='a1'>&nbsp;</span></div>",
)
CJK = (
    "\u4f60\u597d\uff0c\u4e16\u754c\uff01\u4eca\u5929\u5929\u6c14\u5f88\u597d\u3002",
    "\u673a\u5668\u5b66\u4e60\u6a21\u578b\u7684\u4e13\u5bb6\u526a\u679d"
    "\u53ef\u4ee5\u51cf\u5c11\u89e3\u7801\u65f6\u7684\u5185\u5b58\u8bfb\u53d6\u3002",
    "\u6771\u4eac\u306f\u65e5\u672c\u306e\u9996\u90fd\u3067\u3059\u3002"
    "\u3072\u3089\u304c\u306a\u3068\u30ab\u30bf\u30ab\u30ca\u3001\u6f22\u5b57\u3002",
    "\ud55c\uad6d\uc5b4 \ubb38\uc7a5\ub3c4 \ud1a0\ud070\ud654\ud574\uc57c \ud569\ub2c8\ub2e4.",
    "\u6df7\u5408 mixed \u6587\u672c text 123 \u6d4b\u8bd5\u3002",
    "\u300c\u5f15\u7528\u300d\u3068\u300e\u4e8c\u91cd\u5f15"
    "\u7528\u300f\u3001\u305d\u3057\u3066\u2026\u2026\u7701\u7565\u3002",
)
EMOJI = (
    "Emoji: \U0001f600\U0001f603\U0001f604 \U0001f44d\U0001f3fd \u2764\ufe0f \U0001f1eb"
    "\U0001f1f7 \U0001f468\u200d\U0001f469\u200d\U0001f467\u200d\U0001f466 \U0001f9d1\u200d\U0001f4bb",
    "\U0001f680 launch at T-10s \u2705 done \u26a0\ufe0f warning",
    "\U0001f642\U0001f643\U0001f914\U0001f916\U0001f389\U0001f525\U0001f4af",
)
NUMBERS = (
    "3.14159 2.71828 1,234,567.89 -42 +7 1e-5 0x1F 0b1010",
    "2026-12-07T16:57:21Z, 12:30:05.123, v1.2.3-rc.4",
    "1234567890 00000 99999999999999999999",
    "1/2 + 3/4 = 5/4; 10% of 250 = 25; 6*7=42",
)
WHITESPACE = (
    "two  spaces   three    four     five",
    "\n\n\nthree newlines then\r\nCRLF and\ttabs\t\tdouble",
    "   leading and trailing spaces   ",
    "line one\n    indented four\n\tindented tab\n\n",
    " ",
    "\n",
    "trailing newline\n",
)
SCRIPTS = (
    "\u041f\u0440\u0438\u0432\u0435\u0442, \u043c\u0438\u0440! "
    "\u0401\u0436\u0438\u043a \u0432 \u0442\u0443\u043c\u0430\u043d\u0435.",
    "\u0393\u03b5\u03b9\u03ac \u03c3\u03bf\u03c5 \u039a\u03cc\u03c3\u03bc\u03b5, \u03b1\u03b2\u03b3\u03b4\u03b5.",
    "\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645",
    "\u05e9\u05dc\u05d5\u05dd \u05e2\u05d5\u05dc\u05dd",
    "\u0928\u092e\u0938\u094d\u0924\u0947 \u0926\u0941\u0928\u093f\u092f\u093e",
    "\u0e2a\u0e27\u0e31\u0e2a\u0e14\u0e35\u0e0a\u0e32\u0e27\u0e42\u0e25\u0e01",
    "\u00c7a va? Na\u00efve caf\u00e9, fa\u00e7ade, jalape\u00f1o, Stra\u00dfe, \u00d8resund.",
    "\u2211\u1d62 x\u1d62\u00b2 \u2264 \u221e \u2192 \u2200"
    "\u03b5>0 \u2203\u03b4; \u221a2 \u2248 1.414; \u00bd \u00be \u2153",
)
# Decomposed forms (a letter then a combining mark): an NFC normaliser composes them.
COMBINING = (
    "e\u0301cole, man\u0303ana, A\u030angstro\u0308m",
    "cafe\u0301 na\u0131\u0308ve",
)
POOLS = (ENGLISH, CODE, CJK, EMOJI, NUMBERS, WHITESPACE, SCRIPTS, COMBINING)
SEPARATORS = ("", " ", "\n", "  ", "\n\n", "\t", " \n ")


def varied_texts(count: int, seed: int, special_tokens: Sequence[str] = (), nfc: bool = False) -> list[str]:
    """`count` texts, each 1-4 fragments from the pools above joined by varied separators; with `special_tokens`,
    about a third of the texts carry one or two of them between fragments. The first texts are every pool fragment
    alone (each is checked at least once). `nfc`: NFC-normalise every text (an engine that does not normalise
    must still agree)."""
    rng = random.Random(seed)
    texts = [text for pool in POOLS for text in pool]
    while len(texts) < count:
        parts = []
        for _ in range(rng.randint(1, 4)):
            parts.append(rng.choice(rng.choice(POOLS)))
            if special_tokens and rng.random() < 0.15:
                parts.append(rng.choice(list(special_tokens)))
        text = parts[0]
        for part in parts[1:]:
            text += rng.choice(SEPARATORS) + part
        texts.append(text)
    texts = texts[:count]
    return [unicodedata.normalize("NFC", t) for t in texts] if nfc else texts


TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "City name"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "add", "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                       "required": ["a", "b"]}}},
]

# The 5-message tool conversation (system, user, assistant tool call, tool result, assistant), OpenAI form.
TOOL_CONVERSATION = [
    {"role": "system", "content": "You are a concise assistant. Use tools when they help."},
    {"role": "user", "content": "What is the weather in Paris, in celsius? \u5929\u6c14\u5982\u4f55\uff1f"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"unit\": \"celsius\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather",
     "content": "{\"temperature\": 21, \"sky\": \"clear\"}"},
    {"role": "assistant", "content": "It is 21 \u00b0C and clear in Paris. \U0001f31e"},
]

# A longer one: two tool calls in one turn (arguments as a mapping), two results, a follow-up question.
MULTI_CALL_CONVERSATION = [
    {"role": "user", "content": "Add 2 and 40, and tell me the weather in Kyoto."},
    {"role": "assistant", "content": "Let me check both.", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 40}}},
        {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Kyoto"}}}]},
    {"role": "tool", "tool_call_id": "c1", "name": "add", "content": "42"},
    {"role": "tool", "tool_call_id": "c2", "name": "get_weather", "content": "{\"temperature\": 9, \"sky\": \"rain\"}"},
    {"role": "assistant", "content": "2 + 40 = 42, and Kyoto has 9 degrees with rain."},
    {"role": "user", "content": "Thanks!\n\nAnd   in    code?"},
    {"role": "assistant", "content": "```python\nprint(2 + 40)\n```"},
]


def chat_probe_texts(tokenizer) -> tuple[list[str], list[str]]:
    """(texts, problems): the probe conversations rendered by `tokenizer`'s chat template, with and without the
    generation prompt, and with their last assistant turn cut for a prompt; `problems` says which render failed and
    why (a template may refuse a role or a form). No template: ([], ["no chat template"])."""
    if not getattr(tokenizer, "chat_template", None):
        return [], ["no chat template"]
    texts, problems = [], []
    for name, messages in (("TOOL_CONVERSATION", TOOL_CONVERSATION),
                           ("MULTI_CALL_CONVERSATION", MULTI_CALL_CONVERSATION)):
        for cut, generation_prompt in ((len(messages), False), (len(messages) - 1, True)):
            try:
                texts.append(tokenizer.apply_chat_template(messages[:cut], tools=TOOLS, tokenize=False,
                                                           add_generation_prompt=generation_prompt))
            except Exception as exc:  # a template's raise_exception, or Jinja's own error: reported, not hidden
                problems.append(f"{name}[:{cut}]: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
    return texts, problems

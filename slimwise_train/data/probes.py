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
    "你好，世界！今天天气很好。",
    "机器学习模型的专家剪枝可以减少解码时的内存读取。",
    "東京は日本の首都です。ひらがなとカタカナ、漢字。",
    "한국어 문장도 토큰화해야 합니다.",
    "混合 mixed 文本 text 123 测试。",
    "「引用」と『二重引用』、そして……省略。",
)
EMOJI = (
    "Emoji: 😀😃😄 👍🏽 ❤️ 🇫🇷 👨‍👩‍👧‍👦 🧑‍💻",
    "🚀 launch at T-10s ✅ done ⚠️ warning",
    "🙂🙃🤔🤖🎉🔥💯",
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
    "Привет, мир! Ёжик в тумане.",
    "Γειά σου Κόσμε, αβγδε.",
    "مرحبا بالعالم",
    "שלום עולם",
    "नमस्ते दुनिया",
    "สวัสดีชาวโลก",
    "Ça va? Naïve café, façade, jalapeño, Straße, Øresund.",
    "∑ᵢ xᵢ² ≤ ∞ → ∀ε>0 ∃δ; √2 ≈ 1.414; ½ ¾ ⅓",
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
    {"role": "user", "content": "What is the weather in Paris, in celsius? 天气如何？"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"unit\": \"celsius\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather",
     "content": "{\"temperature\": 21, \"sky\": \"clear\"}"},
    {"role": "assistant", "content": "It is 21 °C and clear in Paris. 🌞"},
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
    for name, messages in (("TOOL_CONVERSATION", TOOL_CONVERSATION), ("MULTI_CALL_CONVERSATION", MULTI_CALL_CONVERSATION)):
        for cut, generation_prompt in ((len(messages), False), (len(messages) - 1, True)):
            try:
                texts.append(tokenizer.apply_chat_template(messages[:cut], tools=TOOLS, tokenize=False,
                                                           add_generation_prompt=generation_prompt))
            except Exception as exc:  # a template's raise_exception, or Jinja's own error: reported, not hidden
                problems.append(f"{name}[:{cut}]: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
    return texts, problems

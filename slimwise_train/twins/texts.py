"""Texts the twins' tokenizers are trained on and checked against: varied on purpose (code, CJK, emoji, numbers,
whitespace runs, other scripts, combining marks, a tokenizer's own special tokens), generated deterministically
from a seed so a check or a training corpus is the same on every machine.

Also the probe conversation every template renders: system prompt, a `tools` list, an assistant tool call (OpenAI
form), a tool result and a final answer (`TOOL_CONVERSATION`, `TOOLS`).
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


def training_corpus(seed: int = 12345, count: int = 3000) -> list[str]:
    """What the byte-level twins' vocabularies are trained on: the offline suite's problems (the project's own
    text) and varied texts from another seed than the checks use."""
    from slimwise_train.data import synthetic

    texts = varied_texts(count, seed)
    for family in synthetic.FAMILIES:
        for example in synthetic.generate(family, 300, seed=seed):
            prompt, answer = synthetic.to_text(example)
            texts.append(prompt + answer)
    return texts


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

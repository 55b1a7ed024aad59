"""Chat templates the project writes for the twins, one per family format (Jinja, as transformers renders them).

Each renders system prompts, a `tools` list, assistant tool calls in OpenAI form (`message.tool_calls[].function.
{name, arguments}`, arguments a JSON string or a mapping), tool results (role "tool") and `add_generation_prompt`.
What the model itself generates in an assistant turn (its content, its tool calls and the token that ends the turn)
is wrapped in `{% generation %}...{% endgeneration %}`, so `apply_chat_template(..., return_assistant_tokens_mask=True,
return_dict=True)` marks exactly those tokens; what follows `add_generation_prompt` is where that block starts.
llama.cpp accepts the markers: its Jinja engine parses `generation` / `endgeneration` as no-ops
(common/jinja/parser.cpp), and llama-cpp-python's Jinja2ChatFormatter registers an extension that ignores them.

They follow each family's real format where it is simple and simplify where it is not (docs/real-models.md):
  * CHATML_QWEN: Qwen3's ChatML (tools in the system turn, `<tool_call>` JSON, `<tool_response>` in a user turn,
    `<think>` for `reasoning_content`); also used for Qwen3.5/3.6, whose real template writes tool arguments as
    `<parameter=...>` blocks instead of JSON.
  * DEEPSEEK_V3: DeepSeek-V3's markers (`[[User]]`, `[[Assistant]]`, `[[tool calls begin]]` ... function
    `[[tool sep]]` name + a json block, `[[tool outputs begin]]`: `deepseek_markers` spells them); the tools are
    listed in the system prompt
    (V3's own template ignores `tools`).
  * HARMONY: GPT-OSS's Harmony messages (system, developer with a `functions` namespace, `<|channel|>`, tool calls
    `to=functions.NAME` ... `<|call|>`, the last answer ending in `<|return|>`), without the date line.
  * GEMMA4: Gemma 4's turns (`<|turn>role` ... `<turn|>`), `<|tool>` declarations in the system turn, tool calls
    `<|tool_call>call:NAME{...}<tool_call|>` ending the model's output with `<|tool_response>`, the result and the
    answer continuing the same model turn; declarations and arguments are written as JSON, not in Gemma's own
    `key:<|"|>value<|"|>` notation (a template cannot turn OpenAI's JSON-string arguments into that, so training
    renders and llama-server's, which parses them, would differ).
  * MISTRAL_INST: Mixtral's `[INST] ... [/INST]` with Mistral's v3 tool tokens; the tool list goes before the
    first user turn (Mistral's own puts it before the last), so a prefix of a conversation renders as a prefix.
  * TULU: OLMoE-Instruct's Tulu turns (`<|user|>`, `<|assistant|>`), with tools in the system turn as
    `<functions>` and calls as `<function_calls>` (Tulu has no tool format of its own).
"""

from __future__ import annotations

import re

def deepseek_markers(template: str) -> str:
    """DeepSeek's special tokens, written `[[tool calls begin]]` here (ASCII), as DeepSeek spells them: full-width
    bars around the words, U+2581 between them (`<\uff5ctool\u2581calls\u2581begin\uff5c>`)."""
    return re.sub(r"\[\[([^\]]+)\]\]", lambda m: "<\uff5c" + m.group(1).replace(" ", "\u2581") + "\uff5c>", template)


# The arguments of a tool call: a JSON string as OpenAI sends it, or a mapping.
_ARGS = "{%- if fn.arguments is string %}{{- fn.arguments }}{%- else %}{{- fn.arguments | tojson }}{%- endif %}"
_CONTENT = "(message.content if message.content is string else message.content | tojson)"

CHATML_QWEN = (
    "{%- set loop_messages = messages %}"
    "{%- if messages and messages[0].role == 'system' %}{%- set system = messages[0].content %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set system = none %}{%- endif %}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}{%- if system %}{{- system + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": <args-json-object>}"
    "\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif system is not none %}{{- '<|im_start|>system\\n' + system + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in loop_messages %}"
    "{%- if message.role == 'user' or message.role == 'system' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- generation %}"
    "{%- if message.reasoning_content %}"
    "{{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}{%- endif %}"
    "{%- if message.content %}{{- message.content }}{%- endif %}"
    "{%- for call in message.tool_calls or [] %}"
    "{%- set fn = call.function if call.function is defined else call %}"
    "{%- if not loop.first or message.content %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + fn.name + '\", \"arguments\": ' }}" + _ARGS + "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>' }}"
    "{%- endgeneration %}"
    "{{- '\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or loop_messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + " + _CONTENT + " + '\\n</tool_response>' }}"
    "{%- if loop.last or loop_messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- raise_exception('unknown role ' + message.role + ': use system, user, assistant or tool') }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)

DEEPSEEK_V3 = deepseek_markers(
    "{{- bos_token }}"
    "{%- set ns = namespace(system='', first=true) %}"
    "{%- for message in messages %}{%- if message.role == 'system' %}"
    "{%- set ns.system = ns.system + ('' if ns.first else '\\n\\n') + message.content %}{%- set ns.first = false %}"
    "{%- endif %}{%- endfor %}"
    "{%- if tools %}"
    "{%- set ns.system = ns.system + ('\\n\\n' if ns.system else '') + '## Tools\\nYou have access to the following "
    "tools:' %}"
    "{%- for tool in tools %}{%- set ns.system = ns.system + '\\n\\n### ' + tool.function.name + '\\nDescription: ' + "
    "(tool.function.description or '') + '\\nParameters: ' + (tool.function.parameters | tojson) %}{%- endfor %}"
    "{%- set ns.system = ns.system + '\\n\\nTo call tools, write [[tool calls begin]][[tool call begin]]function"
    "[[tool sep]]name\\n```json\\narguments\\n```[[tool call end]][[tool calls end]]' %}"
    "{%- endif %}"
    "{{- ns.system }}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}{{- '[[User]]' + message.content }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '[[Assistant]]' }}{%- endif %}"
    "{%- generation %}"
    "{%- if message.content %}{{- message.content }}{%- endif %}"
    "{%- if message.tool_calls %}{{- '[[tool calls begin]]' }}"
    "{%- for call in message.tool_calls %}{%- set fn = call.function if call.function is defined else call %}"
    "{%- if not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '[[tool call begin]]function[[tool sep]]' + fn.name + '\\n```json\\n' }}" + _ARGS +
    "{{- '\\n```[[tool call end]]' }}"
    "{%- endfor %}{{- '[[tool calls end]]' }}{%- endif %}"
    "{{- '[[end of sentence]]' }}"
    "{%- endgeneration %}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '[[tool outputs begin]]' }}"
    "{%- else %}{{- '\\n' }}{%- endif %}"
    "{{- '[[tool output begin]]' + " + _CONTENT + " + '[[tool output end]]' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '[[tool outputs end]]' }}{%- endif %}"
    "{%- elif message.role != 'system' %}"
    "{{- raise_exception('unknown role ' + message.role + ': use system, user, assistant or tool') }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt and (not messages or messages[-1].role != 'tool') %}{{- '[[Assistant]]' }}"
    "{%- endif %}"
)

HARMONY = (
    "{{- '<|start|>system<|message|>You are a helpful assistant.\\nReasoning: medium\\n\\n# Valid channels: analysis, "
    "commentary, final. Channel must be included for every message.' }}"
    "{%- if tools %}{{- '\\nCalls to these tools must go to the commentary channel: \\'functions\\'.' }}{%- endif %}"
    "{{- '<|end|>' }}"
    "{%- set loop_messages = messages %}"
    "{%- if messages and (messages[0].role == 'system' or messages[0].role == 'developer') %}"
    "{%- set developer = messages[0].content %}{%- set loop_messages = messages[1:] %}"
    "{%- else %}{%- set developer = '' %}{%- endif %}"
    "{%- if developer or tools %}{{- '<|start|>developer<|message|>' }}"
    "{%- if developer %}{{- '# Instructions\\n\\n' + developer + '\\n\\n' }}{%- endif %}"
    "{%- if tools %}{{- '# Tools\\n\\n## functions\\n\\nnamespace functions {\\n\\n' }}"
    "{%- for tool in tools %}{{- '// ' + (tool.function.description or '') + '\\ntype ' + tool.function.name + "
    "' = (_: ' + (tool.function.parameters | tojson) + ') => any;\\n\\n' }}{%- endfor %}"
    "{{- '} // namespace functions' }}{%- endif %}"
    "{{- '<|end|>' }}{%- endif %}"
    "{%- set ns = namespace(call=none) %}"
    "{%- for message in loop_messages %}"
    "{%- if message.role == 'user' %}{{- '<|start|>user<|message|>' + message.content + '<|end|>' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|start|>assistant' }}"
    "{%- generation %}"
    "{%- if message.tool_calls %}"
    "{%- if message.content %}{{- '<|channel|>analysis<|message|>' + message.content + '<|end|><|start|>assistant' }}"
    "{%- endif %}"
    "{%- for call in message.tool_calls %}{%- set fn = call.function if call.function is defined else call %}"
    "{%- if not loop.first %}{{- '<|start|>assistant' }}{%- endif %}"
    "{{- ' to=functions.' + fn.name + '<|channel|>commentary json<|message|>' }}" + _ARGS + "{{- '<|call|>' }}"
    "{%- set ns.call = fn.name %}"
    "{%- endfor %}"
    "{%- else %}"
    "{{- '<|channel|>final<|message|>' + message.content }}"
    "{%- if loop.last and not add_generation_prompt %}{{- '<|return|>' }}{%- else %}{{- '<|end|>' }}{%- endif %}"
    "{%- endif %}"
    "{%- endgeneration %}"
    "{%- elif message.role == 'tool' %}"
    "{%- set name = message.name if message.name is defined and message.name else ns.call %}"
    "{%- if name is none %}{{- raise_exception('a tool message needs an assistant tool call before it') }}{%- endif %}"
    "{{- '<|start|>functions.' + name + ' to=assistant<|channel|>commentary<|message|>' + " + _CONTENT +
    " + '<|end|>' }}"
    "{%- else %}{{- raise_exception('unknown role ' + message.role + ': use system, user, assistant or tool') }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}"
)

GEMMA4 = (
    # llama.cpp reads this line (common/chat.cpp): without it, it takes a template with Gemma 4's tool-call text for
    # an outdated one and folds the tool messages into the assistant's (tool_responses), which this one does not read
    "{#- OpenAI Chat Completions: role tool messages follow the assistant's tool calls, as they come -#}"
    "{{- bos_token }}"
    "{%- set loop_messages = messages %}"
    "{%- if tools or (messages and messages[0].role == 'system') %}{{- '<|turn>system\\n' }}"
    "{%- if messages and messages[0].role == 'system' %}{{- messages[0].content | trim }}"
    "{%- set loop_messages = messages[1:] %}{%- endif %}"
    "{%- for tool in tools or [] %}{{- '<|tool>declaration:' + tool.function.name + (tool.function | tojson) + "
    "'<tool|>' }}{%- endfor %}"
    "{{- '<turn|>\\n' }}{%- endif %}"
    "{%- set ns = namespace(calls=[], next=0) %}"
    "{%- for message in loop_messages %}"
    "{%- set after_tool = not loop.first and loop_messages[loop.index0 - 1].role == 'tool' %}"
    "{%- if message.role == 'user' %}"
    "{%- if after_tool %}{{- '<turn|>\\n' }}{%- endif %}"
    "{{- '<|turn>user\\n' + (message.content | trim) + '<turn|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- if not after_tool %}{{- '<|turn>model\\n' }}{%- endif %}"
    "{%- generation %}"
    "{%- if message.content %}{{- message.content }}{%- endif %}"
    "{%- if message.tool_calls %}"
    "{%- set ns.calls = [] %}{%- set ns.next = 0 %}"
    "{%- for call in message.tool_calls %}{%- set fn = call.function if call.function is defined else call %}"
    "{{- '<|tool_call>call:' + fn.name }}" + _ARGS + "{{- '<tool_call|>' }}"
    "{%- set ns.calls = ns.calls + [fn.name] %}"
    "{%- endfor %}"
    "{{- '<|tool_response>' }}"
    "{%- else %}{{- '<turn|>' }}{%- endif %}"
    "{%- endgeneration %}"
    "{%- if not message.tool_calls %}{{- '\\n' }}{%- endif %}"
    "{%- elif message.role == 'tool' %}"
    "{%- if after_tool %}{{- '<|tool_response>' }}{%- endif %}"
    "{%- set name = message.name if message.name is defined and message.name else "
    "(ns.calls[ns.next] if ns.next < ns.calls | length else 'unknown') %}"
    "{%- set ns.next = ns.next + 1 %}"
    "{{- 'response:' + name + '{value:' + " + _CONTENT + " + '}<tool_response|>' }}"
    "{%- else %}{{- raise_exception('unknown role ' + message.role + ': use system, user, assistant or tool') }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt and (not loop_messages or loop_messages[-1].role != 'tool') %}"
    "{{- '<|turn>model\\n' }}{%- endif %}"
)

MISTRAL_INST = (
    "{{- bos_token }}"
    "{%- set loop_messages = messages %}{%- set system = none %}"
    "{%- if messages and messages[0].role == 'system' %}{%- set system = messages[0].content %}"
    "{%- set loop_messages = messages[1:] %}{%- endif %}"
    "{%- set ns = namespace(first_user=true) %}"
    "{%- for message in loop_messages %}"
    "{%- if message.role == 'user' %}"
    "{%- if ns.first_user and tools %}{{- '[AVAILABLE_TOOLS] ' + (tools | tojson) + '[/AVAILABLE_TOOLS]' }}{%- endif %}"
    "{%- if ns.first_user and system %}{{- '[INST] ' + system + '\\n\\n' + message.content + ' [/INST]' }}"
    "{%- else %}{{- '[INST] ' + message.content + ' [/INST]' }}{%- endif %}"
    "{%- set ns.first_user = false %}"
    "{%- elif message.role == 'assistant' %}"
    "{%- generation %}"
    "{%- if message.content %}{{- message.content }}{%- endif %}"
    "{%- if message.tool_calls %}{{- '[TOOL_CALLS] [' }}"
    "{%- for call in message.tool_calls %}{%- set fn = call.function if call.function is defined else call %}"
    "{%- if not loop.first %}{{- ', ' }}{%- endif %}"
    "{{- '{\"name\": \"' + fn.name + '\", \"arguments\": ' }}" + _ARGS + "{{- '}' }}"
    "{%- endfor %}{{- ']' }}{%- endif %}"
    "{{- eos_token }}"
    "{%- endgeneration %}"
    "{%- elif message.role == 'tool' %}"
    "{{- '[TOOL_RESULTS] {\"content\": ' + (message.content | tojson) + '}[/TOOL_RESULTS]' }}"
    "{%- else %}{{- raise_exception('unknown role ' + message.role + ': use system, user, assistant or tool') }}"
    "{%- endif %}"
    "{%- endfor %}"
)

TULU = (
    "{%- for message in messages %}"
    "{%- if message.role == 'system' %}{{- '<|system|>\\n' + message.content }}"
    "{%- if loop.first and tools %}{{- '\\n<functions>' }}{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}"
    "{%- endfor %}{{- '\\n</functions>' }}{%- endif %}{{- '\\n' }}"
    "{%- elif message.role == 'user' %}"
    "{%- if loop.first and tools %}{{- '<|system|>\\n<functions>' }}{%- for tool in tools %}"
    "{{- '\\n' + (tool | tojson) }}{%- endfor %}{{- '\\n</functions>\\n' }}{%- endif %}"
    "{{- '<|user|>\\n' + message.content + '\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|assistant|>\\n' }}"
    "{%- generation %}"
    "{%- if message.content %}{{- message.content }}{%- endif %}"
    "{%- if message.tool_calls %}{%- if message.content %}{{- '\\n' }}{%- endif %}{{- '<function_calls>' }}"
    "{%- for call in message.tool_calls %}{%- set fn = call.function if call.function is defined else call %}"
    "{{- '\\n{\"name\": \"' + fn.name + '\", \"arguments\": ' }}" + _ARGS + "{{- '}' }}"
    "{%- endfor %}{{- '\\n</function_calls>' }}{%- endif %}"
    "{{- eos_token }}"
    "{%- endgeneration %}"
    "{{- '\\n' }}"
    "{%- elif message.role == 'tool' %}{{- '<|tool|>\\n' + " + _CONTENT + " + '\\n' }}"
    "{%- else %}{{- raise_exception('unknown role ' + message.role + ': use system, user, assistant or tool') }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- endif %}"
)

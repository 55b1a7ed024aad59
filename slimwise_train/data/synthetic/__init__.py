"""Offline synthetic reasoning suite: deterministic generators and exact checkers.

``suite`` holds the API and documents the formats and the ``check`` contract; the three task
families live in ``arithmetic`` (math), ``programs`` (code) and ``tools`` (tool), with shared
helpers in ``common``. Everything the former single module ``synthetic.py`` defined is
re-exported here, so ``synthetic.X`` and ``from slimwise_train.data.synthetic import X`` keep working.
"""

# ruff: noqa: F401  (this module only re-exports)

from __future__ import annotations

from .arithmetic import _MATH_OPS, _MATH_PROMPT, _apply_math, _gen_math, _math_answer, _render_math, _solve_math
from .common import _operand
from .programs import (
    _CODE_INIT_LIST,
    _CODE_INIT_STR,
    _CODE_OP,
    _CODE_PRINT,
    _LIST_FINALS,
    _LIST_OPS,
    _NEVER_EMPTY,
    _STR_OPS,
    WORDS,
    _allowed_ops,
    _dedupe,
    _fmt_list,
    _fmt_str,
    _gen_code,
    _sample_code_arg,
    _solve_code,
)
from .suite import (
    _GENERATORS,
    _SOLVERS,
    _SUITE_VERSION,
    DEFAULT_PARAMS,
    DEFAULT_RECIPE,
    EOS_TEXT,
    FAMILIES,
    LONG_FAMILIES,
    SEP,
    Example,
    __all__,
    _clean_prompt,
    _interleave_families,
    _no_dup_keys,
    _params,
    _strict_eq,
    check,
    check_recipe,
    derive_seed,
    family_of,
    generate,
    generate_from_recipe,
    generate_mixture,
    generate_splits,
    heldout,
    heldout_prompts,
    load_recipe,
    long_heldout,
    long_suite,
    read_jsonl,
    recipe_counts,
    recipe_params,
    solve,
    to_hf_dataset,
    to_text,
    write_jsonl,
)
from .tools import (
    _CITIES,
    _CUR_LOOKUP,
    _CURRENCIES,
    _JOIN,
    _LABELS,
    _MESSAGES,
    _NAMES,
    _SLOTS,
    _TEMPLATE_RX,
    _TEMPLATES,
    _TOOL_PROMPT,
    _UNIT_FORMS,
    _UNITS,
    TOOLS,
    _compile_template,
    _dump_calls,
    _gen_one_call,
    _gen_tool,
    _ordered_args,
    _parse_dur,
    _parse_map,
    _parse_re,
    _parse_request,
    _parse_time,
    _render_dur,
    _render_time,
    _schema,
    _solve_tool,
    _tool_calls,
)

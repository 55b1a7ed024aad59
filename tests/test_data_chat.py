"""Conversations as the model serves them (data/chat.py, data/loading.py; issue 47 items 2 and 5): rows in OpenAI and
ShareGPT form rendered whole by the tokenizer's chat template, assistant turns found from the template (generation
markers, or prefix rendering), the transformers 5 BatchEncoding bug, and every kind of bad conversation."""

from __future__ import annotations

import json
import logging

import pytest
from omegaconf import OmegaConf
from transformers import AutoTokenizer

from slimwise_train.config import DataConfig
from slimwise_train.data import chat
from slimwise_train.data.chat import BadRow, Conversation, SkipRow, conversation_from_row, render
from slimwise_train.data.loading import (DataCounts, TextPair, encode_all, encode_example, encode_pair, load_pairs,
                                         row_to_pair)
from slimwise_train.models import SHIPPED_TOKENIZER

from helpers import CHATML_TOOLS_TEMPLATE, TOOL_CHATS, write_chat_tokenizer

WEATHER = {"name": "get_weather", "description": "Weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
# The 5-message tool conversation: system, user, assistant tool call, tool result, assistant answer.
FIVE = [{"role": "system", "content": "You are a phone assistant."},
        {"role": "user", "content": "Is it warm in Paris?"},
        {"role": "assistant", "tool_calls": [{"type": "function",
                                              "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": '{"temperature": 21}'},
        {"role": "assistant", "content": "It is 21 degrees in Paris."}]
TOOLS = [{"type": "function", "function": WEATHER}]
# What the template writes for each assistant turn (CHATML_TOOLS_TEMPLATE, by hand): the output and its end of turn.
FIVE_ASSISTANT = ['<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call><|im_end|>\n',
                  "It is 21 degrees in Paris.<|im_end|>\n"]


@pytest.fixture(scope="module")
def markers(chat_tokenizer_dir):
    return AutoTokenizer.from_pretrained(str(chat_tokenizer_dir))


@pytest.fixture(scope="module")
def prefixes(chat_tokenizer_dir_no_markers):
    return AutoTokenizer.from_pretrained(str(chat_tokenizer_dir_no_markers))


@pytest.fixture(scope="module")
def plain():
    return AutoTokenizer.from_pretrained(str(SHIPPED_TOKENIZER))


def _data(**kw):
    return OmegaConf.structured(DataConfig(**kw))


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


# --------------------------------------------------------------------------- the BatchEncoding bug (item 1)


def test_a_prompt_answer_row_through_a_chat_template_is_token_ids_not_batchencoding_keys(markers):
    """transformers 5.23's apply_chat_template(tokenize=True) returns a BatchEncoding (not a dict): iterating it gave
    the prompt ids 'input_ids', 'attention_mask' (issue 47). Now the ids are the template's rendering, tokenised."""
    pair = TextPair("What is 2+2?", "4")
    ids, prompt_len = encode_pair(markers, pair, chat_template=True, max_len=512)
    assert all(isinstance(i, int) for i in ids)
    messages = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]
    text = markers.apply_chat_template(messages, tokenize=False)
    assert ids == markers(text, add_special_tokens=False)["input_ids"]
    prompt = markers.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert prompt_len == len(markers(prompt, add_special_tokens=False)["input_ids"])  # the first assistant token
    assert markers.decode(ids[prompt_len:]) == "4<|im_end|>\n"


# --------------------------------------------------------------------------- the 5-turn tool conversation


def _expected_five(tokenizer):
    """(ids, supervised) built independently: the template's text split around the hand-written assistant outputs,
    each piece tokenised on its own (ChatML pieces meet at special tokens and newlines)."""
    text = tokenizer.apply_chat_template(FIVE, tools=TOOLS, tokenize=False)
    pieces, rest = [], text
    for output in FIVE_ASSISTANT:
        assert rest.count(output) == 1
        before, rest = rest.split(output)
        pieces += [(before, 0), (output, 1)]
    pieces.append((rest, 0))
    ids, supervised = [], []
    for piece, flag in pieces:
        piece_ids = tokenizer(piece, add_special_tokens=False)["input_ids"] if piece else []
        ids += piece_ids
        supervised += [flag] * len(piece_ids)
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]  # the pieces tokenise as the whole does
    return ids, supervised


@pytest.mark.parametrize("which, method", [("markers", chat.MARKERS), ("prefixes", chat.PREFIXES)])
def test_five_turn_tool_conversation_supervises_exactly_the_assistant_turns(which, method, request):
    tokenizer = request.getfixturevalue(which)
    conversation = conversation_from_row(FIVE, tools=TOOLS, origin="row 0 of five")
    rendered = render(tokenizer, conversation)
    assert rendered.method == method
    assert (rendered.ids, rendered.supervised) == _expected_five(tokenizer)
    assert tokenizer.decode([i for i, s in zip(rendered.ids, rendered.supervised) if s]) == "".join(FIVE_ASSISTANT)
    # The same conversation in ShareGPT form with APIGen-MT's columns: the same tokens, the same supervision.
    sharegpt = {"system": FIVE[0]["content"], "tools": json.dumps(TOOLS), "conversations": [
        {"from": "human", "value": FIVE[1]["content"]},
        {"from": "function_call", "value": json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})},
        {"from": "observation", "value": FIVE[3]["content"]}, {"from": "gpt", "value": FIVE[4]["content"]}]}
    again = render(tokenizer, row_to_pair(sharegpt, origin="row 0"))
    assert (again.ids, again.supervised) == (rendered.ids, rendered.supervised)


def test_both_ways_of_finding_turns_agree_on_every_shipped_conversation(markers, prefixes):
    """Markers and prefix rendering are independent routes to the assistant tokens: equal on all 128 shipped rows,
    and the OpenAI and ShareGPT files render the same tokens row by row (the ShareGPT file's bare tool schemas are
    read in the OpenAI form)."""
    supervised_text = {}
    for form, path in TOOL_CHATS.items():
        examples = load_pairs(_data(source=str(path), num_samples=1000, shuffle=False))
        assert len(examples) == 64 and all(isinstance(e, Conversation) for e in examples)
        texts = []
        for example in examples:
            by_markers, by_prefixes = render(markers, example), render(prefixes, example)
            assert by_markers.ids == by_prefixes.ids and by_markers.supervised == by_prefixes.supervised, example.origin
            turns = sum(m["role"] == "assistant" for m in example.messages)
            texts.append(markers.decode([i for i, s in zip(by_markers.ids, by_markers.supervised) if s]))
            assert texts[-1].count("<|im_end|>") == turns  # every assistant turn, each once
        supervised_text[form] = (texts, [render(markers, example).ids for example in examples])
    assert supervised_text["openai"] == supervised_text["sharegpt"]


def test_a_template_that_changes_earlier_turns_is_an_error_naming_the_fix(tmp_path, markers):
    """No markers, and an earlier assistant turn rendered differently once a later turn follows (as templates that
    drop earlier reasoning do): no prefix rendering is a token prefix of the whole; never guessed from the text."""
    tokenizer = AutoTokenizer.from_pretrained(str(write_chat_tokenizer(tmp_path / "tok", generation_markers=False)))
    tokenizer.chat_template = tokenizer.chat_template.replace(
        "{%- if message.content %}{{ message.content }}{% endif %}",
        "{%- if message.content %}{{ message.content if loop.last else '(earlier answer)' }}{% endif %}")
    conversation = conversation_from_row(FIVE[1:2] + [{"role": "assistant", "content": "Yes."}] + FIVE[1:2]
                                         + [{"role": "assistant", "content": "Still yes."}], origin="row 7 of chats")
    with pytest.raises(ValueError) as error:
        render(tokenizer, conversation)
    message = str(error.value)
    assert "\n" not in message and message.startswith("row 7 of chats: cannot find the assistant turns")
    assert "{% generation %}" in message and "data.chat_template=false" in message and "turn 1" in message
    assert render(markers, conversation).method == chat.MARKERS  # the same rows with markers: fine
    # Markers that enclose none of the assistant tokens are no way to find them either.
    tokenizer.chat_template = "{% for m in messages %}{{ m.content }}\n{% endfor %}{% generation %}{% endgeneration %}"
    with pytest.raises(ValueError, match="row 7 of chats: cannot find the assistant turns .*: its generation markers "
                                         "mark no token of this row's assistant turns; add"):
        render(tokenizer, conversation)


# --------------------------------------------------------------------------- supervise, plain rendering


def test_supervise_all_assistant_and_auto(markers, plain):
    pair = TextPair("Q: 1+2=\n", "1+2=3;A=3")
    by = {s: encode_example(markers, pair, supervise=s) for s in ("auto", "assistant", "all")}
    assert by["auto"] == by["assistant"] and by["auto"].supervised is not None
    assert by["all"].supervised is None and by["all"].ids == by["auto"].ids
    assert by["auto"].prompt_len == by["auto"].supervised.index(1)
    # Plain (no template): auto supervises every token, as before conversations were rendered whole.
    plain_by = {s: encode_example(plain, pair, supervise=s) for s in ("auto", "assistant", "all")}
    assert plain_by["auto"].supervised is None and plain_by["all"].supervised is None
    prompt_len = len(plain(pair.prompt, add_special_tokens=False)["input_ids"])
    assert plain_by["assistant"].supervised == [0] * prompt_len + [1] * (len(plain_by["auto"].ids) - prompt_len)
    assert plain_by["auto"].ids[-1] == plain.eos_token_id and plain_by["auto"].rendering == "plain"


def test_without_a_template_conversations_keep_the_plain_rendering_said_once(plain, caplog, monkeypatch):
    from slimwise_train.data import loading

    monkeypatch.setattr(loading, "_RENDERING_SAID", set())
    conversation = conversation_from_row(FIVE, tools=TOOLS)
    sequence = encode_example(plain, conversation)
    expected = ('system: You are a phone assistant.\nuser: Is it warm in Paris?\n'
                'assistant: {"name": "get_weather", "arguments": {"city": "Paris"}}\ntool: {"temperature": 21}\n'
                'It is 21 degrees in Paris.')
    assert plain.decode(sequence.ids) == expected + "<eos>" and sequence.rendering == "plain"
    with caplog.at_level(logging.INFO, logger="slimwise.data"):
        for _ in range(2):
            encode_all(plain, [conversation], _data(seq_len=512))
    said = [r.getMessage() for r in caplog.records if "plain rendering" in r.getMessage()]
    assert len(said) == 1 and "has no chat template" in said[0]


def test_continuation_labels_are_the_supervised_tokens_after_the_split():
    from slimwise_train.distill import batches as B
    from slimwise_train.distill.losses import IGNORE_INDEX

    sequences = [([10, 11, 12, 13, 14, 15], 1, [0, 0, 1, 1, 0, 1]), ([20, 21, 22, 23], 1)]
    batch = B.continuation_batch(sequences, [2, 1], pad_id=0)
    # row 0: continuation 12 13 14 15, targets 13 14 15 of which 14 is not supervised; row 1 as before (every token)
    assert batch.labels.tolist() == [[13, IGNORE_INDEX, 15, IGNORE_INDEX], [22, 23, IGNORE_INDEX, IGNORE_INDEX]]
    rule = B.SplitRule(min_split=1, min_continuation=2)
    no_target_after = ([1, 2, 3, 4, 5], 0, [0, 1, 0, 0, 0])  # lowest split 1: targets 2.. hold no supervised token
    kept, dropped = B.filter_splittable([sequences[0], no_target_after], rule)
    assert kept == [sequences[0]] and dropped == 1
    assert B.data_fingerprint([sequences[1]]) != B.data_fingerprint([(*sequences[1], [1, 1, 0, 1])])


# --------------------------------------------------------------------------- bad conversations (item 5)


BAD_ROWS = [
    ({"messages": [{"role": "narrator", "content": "x"}, {"role": "assistant", "content": "y"}]}, "unknown role",
     "turn 0 has role 'narrator'", "use system, user, assistant, tool"),
    ({"messages": FIVE, "tools": [{"type": "function", "function": dict(WEATHER, name="get_time")}]}, "unknown tool",
     "turn 2 calls 'get_weather', which the row's tools do not list (get_time)", "add its schema to the tools"),
    ({"messages": [{"role": "user", "content": [{"type": "image"}]}, {"role": "assistant", "content": "y"}]},
     "content not text", "turn 0's content is list", "fix or drop such rows"),
    ({"conversations": [{"from": "human", "value": "x"}, {"from": "function_call", "value": "get_weather(Paris)"}]},
     "malformed tool call", "turn 1 is a function_call whose value is not JSON", "fix or drop such rows"),
]


@pytest.mark.parametrize("row, reason, what, fix", BAD_ROWS, ids=[r[1] for r in BAD_ROWS])
def test_a_row_that_cannot_be_rendered_is_one_line_naming_it_or_a_counted_skip(tmp_path, row, reason, what, fix):
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    path = _jsonl(tmp_path / "rows.jsonl", [good, good, row, good])
    with pytest.raises(ValueError) as error:
        load_pairs(_data(source=str(path), shuffle=False))
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"row 2 of {path}: ")
    assert what in message and fix in message and message.endswith("or set data.bad_rows=skip to skip and count "
                                                                    "such rows")
    counts = DataCounts()
    kept = load_pairs(_data(source=str(path), shuffle=False, bad_rows="skip"), counts=counts)
    assert len(kept) == 3 and counts.skipped == {reason: 1} and counts.first[reason] == f"row 2 of {path}"


def test_a_row_the_template_refuses_is_named_too(tmp_path, markers):
    """The template's own raise_exception (here: a system turn after the first) is the row's error, one line."""
    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "system", "content": "late"},
                          {"role": "assistant", "content": "hello"}]}]
    pairs = load_pairs(_data(source=str(_jsonl(tmp_path / "late.jsonl", rows))))
    with pytest.raises(ValueError) as error:
        encode_all(markers, pairs, _data(source="late.jsonl"))
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"row 0 of {tmp_path / 'late.jsonl'}: the chat template of ")
    assert "cannot render it (a system turn must come first)" in message and "data.bad_rows=skip" in message
    counts = DataCounts()
    good = load_pairs(_data(source=str(TOOL_CHATS["openai"]), num_samples=1))
    encoded = encode_all(markers, pairs * 2 + good, _data(source="x", bad_rows="skip", seq_len=2048), counts=counts)
    assert len(encoded) == 1 and counts.skipped == {"template refused it": 2}


def test_rows_without_an_assistant_turn_or_text_are_skipped_and_counted(tmp_path, caplog):
    rows = [{"messages": [{"role": "user", "content": "only a question"}]},
            {"conversations": [{"from": "human", "value": " "}, {"from": "gpt", "value": ""}]},
            {"text": "   "},
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}]
    path = _jsonl(tmp_path / "rows.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="slimwise.data"):
        kept = load_pairs(_data(source=str(path), shuffle=False))
    assert len(kept) == 1 and kept[0].origin == f"row 3 of {path}"
    assert f"skipped 3 of 4 rows read: blank: 2 rows (first: row 1 of {path}), no assistant turn: 1 row (first: row 0 of {path})" \
        in caplog.text
    with pytest.raises(SkipRow, match="no assistant turn"):
        conversation_from_row(rows[0]["messages"])


def test_a_conversation_longer_than_seq_len_is_cut_after_whole_turns(markers, caplog):
    two_rounds = FIVE + [{"role": "user", "content": "And in Rome?"},
                         {"role": "assistant", "content": "I would need to look that up."}]
    conversation = conversation_from_row(two_rounds, tools=TOOLS, origin="row 4 of long")
    whole = render(markers, conversation)
    first_round = render(markers, conversation.up_to(4))
    # Room for the first round only: it is rendered again as the shorter conversation, never cut inside an answer.
    sequence = encode_example(markers, conversation, max_len=len(first_round.ids) + 3)
    assert sequence.cut == chat.CUT_AT_TURN and sequence.ids == first_round.ids
    assert sequence.supervised == first_round.supervised and len(whole.ids) > len(first_round.ids) + 3
    # Not even the first assistant turn fits: cut inside it, and said so.
    start = whole.supervised.index(1)
    inside = encode_example(markers, conversation, max_len=start + 5)
    assert inside.cut == chat.CUT_IN_ANSWER and inside.ids == whole.ids[: start + 5] and sum(inside.supervised) == 5
    # No assistant token within the limit: skipped, counted.
    with pytest.raises(SkipRow, match="no assistant token within data.seq_len"):
        encode_example(markers, conversation, max_len=start)
    counts = DataCounts()
    encoded = encode_all(markers, [conversation, conversation.up_to(4)], _data(seq_len=start + 5), counts=counts)
    assert len(encoded) == 2 and counts.cut == {chat.CUT_IN_ANSWER: 2}
    with caplog.at_level(logging.WARNING, logger="slimwise.data"):
        encode_all(markers, [conversation], _data(source="long", seq_len=len(first_round.ids)))
    assert "1 of 1 conversations longer than data.seq_len" in caplog.text and "row 4 of long" in caplog.text


def test_system_and_tools_columns_become_the_system_turn_and_the_templates_tools():
    row = {"system": "Be brief.", "tools": json.dumps([WEATHER]),
           "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
    conversation = row_to_pair(row)
    assert conversation.messages[0] == {"role": "system", "content": "Be brief."}
    # a bare schema becomes the OpenAI form that templates read (tool.function.name); one in that form stays as it is
    assert conversation.tools == [{"type": "function", "function": WEATHER}]
    assert row_to_pair({**row, "tools": conversation.tools}).tools == conversation.tools
    with pytest.raises(BadRow, match="a system column and a different first system turn"):
        row_to_pair({**row, "conversations": [{"from": "system", "value": "Be long."}, *row["conversations"]]})
    with pytest.raises(BadRow, match="its tools column is text but not JSON"):
        row_to_pair({**row, "tools": "get_weather(city)"})
    assert CHATML_TOOLS_TEMPLATE.count("{% generation %}") == 1  # the fixture's markers (the prefix path strips them)


def test_the_supervise_choices_are_the_schemas():
    from typing import get_args

    from slimwise_train.config import Supervise
    from slimwise_train.data.loading import SUPERVISE

    assert SUPERVISE == get_args(Supervise)
    with pytest.raises(ValueError, match="data.supervise='some' is not one of auto, assistant, all"):
        encode_example(AutoTokenizer.from_pretrained(str(SHIPPED_TOKENIZER)), TextPair("a", "b"), supervise="some")

"""The data layer: recipes with hub ids (exercised on local rows of the same schema), local files, chat rows."""

from __future__ import annotations

import json

import pytest
import yaml
from omegaconf import OmegaConf

from slimwise_train.config import DataConfig
from slimwise_train.data.chat import Conversation
from slimwise_train.data.loading import (RECIPES_DIR, TextPair, encode_example, encode_pair, load_pairs, load_recipe,
                                         row_to_pair)
from slimwise_train.models import SHIPPED_TOKENIZER


def _cfg(**kw):
    return OmegaConf.structured(DataConfig(**kw))


def test_slimwise_mix_recipe_names_the_papers_sources():
    recipe = load_recipe("slimwise_mix")
    ids = {s["id"]: s for s in recipe["sources"]}
    assert set(ids) == {"mlabonne/open-perfectblend", "Salesforce/APIGen-MT-5k"}
    assert "context_fields" not in ids["Salesforce/APIGen-MT-5k"]  # its system and tools columns are read as such


def test_recipe_loading_on_local_rows_in_the_hub_schema(tmp_path, chat_tokenizer_dir):
    """slimwise_mix on local files of its sources' schema: ShareGPT conversations; APIGen-MT's `system` column is the
    system turn and its `tools` column (JSON text) the template's tools, rendered whole by the chat template."""
    from transformers import AutoTokenizer

    blend = tmp_path / "blend.jsonl"
    blend.write_text("\n".join(json.dumps({"conversations": [
        {"from": "human", "value": f"What is {i} squared?"}, {"from": "gpt", "value": f"{i * i}"}]}) for i in range(8)))
    apigen = tmp_path / "apigen.jsonl"
    tools = [{"name": "book", "description": "Book a flight.", "parameters": {"type": "object", "properties": {}}}]
    apigen.write_text("\n".join(json.dumps({
        "system": "You are an airline agent.", "tools": json.dumps(tools),
        "conversations": [{"from": "human", "value": "book me"},
                          {"from": "function_call", "value": '{"name": "book", "arguments": {}}'},
                          {"from": "observation", "value": "ok"}, {"from": "gpt", "value": f"Booked #{i}."}]})
        for i in range(8)))
    recipe = yaml.safe_load((RECIPES_DIR / "slimwise_mix.yaml").read_text())
    recipe["sources"][0]["path"] = str(blend)
    recipe["sources"][1]["path"] = str(apigen)
    path = tmp_path / "local_mix.yaml"
    path.write_text(yaml.safe_dump(recipe))
    pairs = load_pairs(_cfg(source=str(path), num_samples=10, shuffle=False))
    assert len(pairs) == 10 and all(isinstance(p, Conversation) for p in pairs)
    chat = [p for p in pairs if p.family == "chat"]
    tool = [p for p in pairs if p.family == "tool"]
    assert len(chat) == 8 and len(tool) == 2  # weights 0.8 / 0.2
    assert chat[0].messages == [{"role": "user", "content": "What is 0 squared?"},
                                {"role": "assistant", "content": "0"}]
    assert tool[0].messages == [
        {"role": "system", "content": "You are an airline agent."}, {"role": "user", "content": "book me"},
        {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "book", "arguments": {}}}]},
        {"role": "tool", "content": "ok"}, {"role": "assistant", "content": "Booked #0."}]
    # APIGen-MT's bare schemas, read in the OpenAI form the templates read
    assert tool[0].tools == [{"type": "function", "function": t} for t in tools]
    assert tool[0].origin == f"row 0 of {apigen}"
    tokenizer = AutoTokenizer.from_pretrained(str(chat_tokenizer_dir))
    text = tokenizer.decode(encode_example(tokenizer, tool[0]).ids)
    assert text.startswith("<|im_start|>system\nYou are an airline agent.\n\n# Tools\n<tools>\n"
                           '{"type": "function", "function": {"name": "book", "description": "Book a flight."')
    assert '<tool_call>{"name": "book", "arguments": {}}</tool_call>' in text and text.count("<|im_start|>") == 5
    # A recipe of before, with the text prefix of context_fields, is refused in one line naming the replacement.
    recipe["sources"][1]["context_fields"] = ["system", "tools"]
    path.write_text(yaml.safe_dump(recipe))
    with pytest.raises(ValueError, match=r"sources\[1\].context_fields is no longer read: a `system` column"):
        load_pairs(_cfg(source=str(path), num_samples=10))


def test_row_formats_and_bad_rows():
    assert row_to_pair({"prompt": "a", "answer": "b"}) == TextPair("a", "b")
    assert row_to_pair({"text": "hello"}) == TextPair("", "hello")
    assert row_to_pair({"messages": [{"role": "user", "content": "hi"}]}) is None  # no assistant turn
    with pytest.raises(ValueError, match="cannot read a row with columns"):
        row_to_pair({"foo": 1})


def test_synthetic_recipe_and_chat_free_encoding():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(SHIPPED_TOKENIZER)
    pairs = load_pairs(_cfg(source="synthetic", num_samples=6))
    assert len(pairs) == 6 and {p.family for p in pairs} == {"math", "code", "tool"}
    ids, prompt_len = encode_pair(tok, pairs[0], chat_template=True, max_len=512)
    assert ids[-1] == tok.eos_token_id and 0 < prompt_len < len(ids)
    assert tok.decode(ids[:prompt_len]) == pairs[0].prompt


def test_missing_and_malformed_sources(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a recipe"):
        load_pairs(_cfg(source="no_such_recipe"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    with pytest.raises(ValueError, match="cannot read it as json"):
        load_pairs(_cfg(source=str(bad)))


def test_rows_that_are_not_text_are_one_line_errors_not_trained_on():
    """Issue 24 items 2 and 9: str() trained on "None" and on digits; a string of messages raised AttributeError."""
    import pytest

    from slimwise_train.data.loading import row_to_pair

    for row, message in (({"text": None}, "'text' is NoneType"), ({"text": 12345}, "'text' is int"),
                         ({"prompt": None, "answer": None}, "'prompt' is NoneType"),
                         ({"prompt": "q", "answer": ["a"]}, "'answer' is list"),
                         ({"messages": "x"}, "messages are str"),
                         ({"messages": [{"role": "user", "content": None}]}, "content is NoneType")):
        with pytest.raises(ValueError, match=message) as error:
            row_to_pair(row)
        assert "\n" not in str(error.value)
    assert row_to_pair({"text": "fine"}).answer == "fine"

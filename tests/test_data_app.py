"""`python -m slimwise_train.data show` (data/app.py): the first sequences as a run trains on them, supervised tokens
marked, and the counts; its --help; bad input in one line; nothing written."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from slimwise_train.data.app import CLOSE, OPEN, marked_text, show
from slimwise_train.data.chat import render
from slimwise_train.data.loading import load_pairs

from helpers import CHILD_ENV, REPO, TOOL_CHATS, compose_config
from test_help import key_entry

ENV = {**CHILD_ENV, "PYTHONPATH": os.pathsep.join([str(REPO), CHILD_ENV.get("PYTHONPATH", "")])}
# The shipped tool conversations run to ~1400 tokens with their schemas: the tiny model's context is raised to match.
LONG = ("data.seq_len=1536", "+model.tiny_overrides.max_position_embeddings=2048")


def _show(*overrides: str) -> tuple[str, object]:
    out = io.StringIO()
    counts = show(compose_config("data_show", *overrides), out=out)
    return out.getvalue(), counts


def test_show_marks_the_assistant_turns_and_counts(chat_tokenizer_dir):
    text, counts = _show(f"data.source={TOOL_CHATS['openai']}", f"model.tokenizer={chat_tokenizer_dir}", "n=2",
                         "data.shuffle=false", *LONG)
    tokenizer = AutoTokenizer.from_pretrained(str(chat_tokenizer_dir))
    first = load_pairs(compose_config("data_show", f"data.source={TOOL_CHATS['openai']}", "data.shuffle=false").data)[0]
    rendered = render(tokenizer, first)
    assert marked_text(tokenizer, rendered.ids, rendered.supervised) in text
    assert text.count("\n--- sequence ") == 2 and f"--- sequence 1: {first.origin}: {len(rendered.ids)} tokens, " \
        f"{sum(rendered.supervised)} supervised, first assistant token at {rendered.supervised.index(1)}" in text
    # the block between the marks is exactly the assistant output
    assert f"{OPEN}<tool_call>" in text and "<|im_end|>\n]]<|im_start|>user\n<tool_response>" in text
    assert "assistant turns found by its generation markers; loss targets: the assistant turns" in text
    assert counts.rows == counts.sequences == 64 and 0 < counts.supervised < counts.tokens
    assert f"supervised tokens     {counts.supervised} ({100 * counts.supervised / counts.tokens:.1f}%)" in text
    assert "\nskipped               0\n" in text


def test_show_counts_cuts_and_skips_with_their_first_row(chat_tokenizer_dir, tmp_path):
    rows = tmp_path / "rows.jsonl"
    good = json.loads(TOOL_CHATS["openai"].read_text().splitlines()[0])
    rows.write_text("".join(json.dumps(r) + "\n" for r in (
        good, {"messages": [{"role": "user", "content": "no answer"}]},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]})))
    text, counts = _show(f"data.source={rows}", f"model.tokenizer={chat_tokenizer_dir}", "n=0", "data.seq_len=256",
                         "data.shuffle=false")
    assert "--- sequence" not in text and counts.sequences == 1
    assert f"skipped               2: no assistant turn: 1 row (first: row 1 of {rows}), no assistant token within " \
           f"data.seq_len: 1 row (first: row 0 of {rows})" in text


def test_show_on_the_shipped_teacher_is_the_plain_rendering():
    text, counts = _show("model=teacher", "data.num_samples=4", "n=1")
    assert "has no chat template: plain rendering" in text and "loss targets: every token (data.supervise=auto)" in text
    assert counts.supervised == counts.tokens and "<eos>]]" in text


@pytest.mark.subprocess
def test_the_cli_shows_writes_nothing_and_refuses_bad_input_in_one_line(chat_tokenizer_dir, tmp_path):
    def run(*args):
        return subprocess.run([sys.executable, "-m", "slimwise_train.data", *args], cwd=tmp_path, env=ENV,
                              capture_output=True, text=True, timeout=300)

    ok = run("show", f"data.source={TOOL_CHATS['sharegpt']}", f"model.tokenizer={chat_tokenizer_dir}", "n=1", *LONG)
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert "assistant turns found by its generation markers" in ok.stdout and "\nsequences             64\n" in ok.stdout
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "narrator", "content": "x"}]}) + "\n")
    for args, error in ((["show", f"data.source={bad}"], f"slimwise_train.data show: error: row 0 of {bad}: turn 0 "
                                                         "has role 'narrator'"),
                        (["list"], "slimwise_train.data: error: unknown command 'list'; use one of: show")):
        proc = run(*args)
        errors = [line for line in proc.stderr.splitlines() if ": error: " in line]  # beside datasets' progress bar
        assert proc.returncode == 2 and len(errors) == 1 and errors[0].startswith(error), proc.stderr
        assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]  # no run folder, no log


@pytest.mark.subprocess
def test_help_explains_every_key(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "slimwise_train.data", "show", "--help"], cwd=tmp_path, env=ENV,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert out.startswith("usage: python -m slimwise_train.data show ") and list(tmp_path.iterdir()) == []
    keys = [line.split("=", 1)[0].strip() for line in out.split("\nkeys:", 1)[1].splitlines()
            if line.startswith("  ") and not line.startswith("   ") and "=" in line]
    assert {"n", "data.source", "data.supervise", "data.bad_rows", "data.chat_template", "model.tokenizer"} <= set(keys)
    for key in keys:
        assert key_entry(out, key)[1], f"{key} has no description:\n{out}"
    assert "[one of: auto, assistant, all]" in key_entry(out, "data.supervise")[1]
    assert "[one of: error, skip]" in key_entry(out, "data.bad_rows")[1]

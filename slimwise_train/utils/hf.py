"""Small facts about transformers objects that every layer needs (no project imports: utils is the bottom layer)."""

from __future__ import annotations


def text_config(model_or_config):
    """The text (decoder) config of a model or a config: `get_text_config()` where the config has one (multimodal
    wrappers such as Gemma 4 and Qwen3.5-MoE nest it), else the config itself."""
    config = getattr(model_or_config, "config", model_or_config)
    return config.get_text_config() if hasattr(config, "get_text_config") else config

"""Small facts about transformers objects that every layer needs (no project imports: utils is the bottom layer)."""

from __future__ import annotations

from pathlib import Path

# The repository (the package's parent): relative model paths are also tried against it, so shipped assets resolve
# from any working directory.
REPO_ROOT = Path(__file__).resolve().parents[2]


def text_config(model_or_config):
    """The text (decoder) config of a model or a config: `get_text_config()` where the config has one (multimodal
    wrappers such as Gemma 4 and Qwen3.5-MoE nest it), else the config itself."""
    config = getattr(model_or_config, "config", model_or_config)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def resolve_path(path: str | None) -> str | None:
    """Relative local paths are tried against the working directory, then the repository root (so shipped
    assets resolve from anywhere); anything else (a hub id) is returned unchanged."""
    if path is None or Path(path).is_absolute() or Path(path).exists():
        return path
    candidate = REPO_ROOT / path
    return str(candidate) if candidate.exists() else path

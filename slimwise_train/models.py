"""Loading models and tokenizers from a `ModelConfig`: real checkpoints through `from_pretrained`, tiny
random models of the stock classes for tests and smoke runs."""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import get_args

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from slimwise_train.config import ModelDtype
from slimwise_train.moe.adapters import get_adapter
from slimwise_train.utils.distributed import is_partitioned
from slimwise_train.utils.hf import resolve_path, text_config

ASSETS = Path(__file__).resolve().parent / "assets"
SHIPPED_TOKENIZER = ASSETS / "tokenizer"

log = logging.getLogger("slimwise.models")
_TINY_NOTICE_SHOWN: set = set()  # (preset, model_type) whose notice this process logged (the trainer loads twice)

# model.dtype's names (config.ModelDtype, the one list; `auto` aside) -> their torch dtypes, in its order.
_DTYPES = dict(zip(get_args(ModelDtype)[1:], (torch.float32, torch.float32, torch.bfloat16, torch.bfloat16,
                                              torch.float16, torch.float16), strict=True))


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"unknown model.dtype {dtype!r}; use auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def _looks_local(path: str) -> bool:
    return path.startswith(("/", ".", "~")) or path.count("/") != 1 or Path(path).exists()


_HUB_PROBES: dict[str, str | None] = {}


def hub_unreachable(timeout: float = 5.0) -> str | None:
    """Why the hub cannot be reached (one TCP connection to HF_ENDPOINT's host, at most `timeout` s, once per process),
    or None: it answers, HF_HUB_OFFLINE is set (nothing will be fetched), or a proxy is configured (the direct probe
    would say nothing about the route the downloads take)."""
    import socket
    from urllib.parse import urlparse

    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return None
    if any(os.environ.get(name) for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None
    endpoint = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host = endpoint.hostname or "huggingface.co"
    port = endpoint.port or (80 if endpoint.scheme == "http" else 443)
    key = f"{host}:{port}"
    if key not in _HUB_PROBES:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            _HUB_PROBES[key] = None
        except OSError as exc:
            _HUB_PROBES[key] = f"{key}: {exc.strerror or exc}"
    return _HUB_PROBES[key]


def from_pretrained_or_explain(load, path: str, what: str = "model.path", **kwargs):
    """`load(path, **kwargs)` (a from_pretrained), with every way it commonly fails as one ValueError line: a missing
    local folder, a truncated or corrupt weights file, a hub id that cannot be reached offline."""
    path = str(path)
    if _looks_local(path) and not Path(path).expanduser().exists():
        raise ValueError(f"{what}={path}: no such folder; point it at a checkpoint folder or a hub id (owner/name)")
    unreachable = None if _looks_local(path) else hub_unreachable()
    if unreachable:  # the local cache only: huggingface_hub would retry each file 5 times (50 s, 22 log lines)
        kwargs["local_files_only"] = True
    try:
        return load(path, **kwargs)
    except (OSError, ValueError, RuntimeError) as exc:
        if isinstance(exc, ValueError) and "supported MoE" in str(exc):
            raise
        first = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        if unreachable:
            hint = (f"it is not in the local cache and the hub cannot be reached ({unreachable}); check the network "
                    "(or HTTPS_PROXY), or fill the cache where there is one")
        elif not _looks_local(path):
            hint = ("a hub id needs the network or a filled cache (HF_HUB_OFFLINE is set)" if os.environ.get(
                "HF_HUB_OFFLINE") in ("1", "true") else "check the id and the network")
        else:
            hint = "the folder's files are incomplete or corrupt (a truncated copy?); copy or export it again"
        raise ValueError(f"{what}={path}: cannot load it ({first[:200]}); {hint}") from None
    except Exception as exc:  # safetensors' own error type for a truncated file, among others
        if type(exc).__name__ not in ("SafetensorError", "HeaderTooLarge", "HeaderTooSmall"):
            raise
        raise ValueError(f"{what}={path}: a weights file is truncated or corrupt ({exc}); "
                         "copy or export it again") from None


def load_config(model_cfg):
    """The model's (text) config without its weights: for sizes needed before the model loads."""
    if model_cfg.tiny:
        from slimwise_train.testing.tiny import tiny_config

        config = tiny_config(model_cfg.tiny, **dict(model_cfg.tiny_overrides or {}))
    else:
        from transformers import AutoConfig

        config = from_pretrained_or_explain(AutoConfig.from_pretrained, resolve_path(model_cfg.path),
                                            revision=model_cfg.revision, trust_remote_code=model_cfg.trust_remote_code)
    return text_config(config)


def load_tokenizer(model_cfg):
    source = resolve_path(model_cfg.tokenizer or model_cfg.path)
    if source is None and model_cfg.tiny:
        source = str(SHIPPED_TOKENIZER)
    if source is None:
        raise ValueError("model config needs model.path (hub id or folder) or model.tiny (a model_type)")
    tokenizer = from_pretrained_or_explain(
        AutoTokenizer.from_pretrained, source, "model.tokenizer" if model_cfg.tokenizer else "model.path",
        revision=model_cfg.revision if source == model_cfg.path else None,
        trust_remote_code=model_cfg.trust_remote_code)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _tiny_notice(model_cfg) -> None:
    """Say once that the model is a random tiny one: a bare `python -m slimwise_train.prune` runs on one."""
    try:
        preset = getattr(model_cfg, "name", None) or f"tiny_{model_cfg.tiny}"
    except Exception:  # a config without a usable name (MISSING)
        preset = f"tiny_{model_cfg.tiny}"
    if (preset, model_cfg.tiny) in _TINY_NOTICE_SHOWN:
        return
    _TINY_NOTICE_SHOWN.add((preset, model_cfg.tiny))
    log.info("model=%s is a random tiny %s for smoke tests (no trained weights); use model=teacher for the shipped "
             "teacher or model.path=<folder or hub id> for your checkpoint", preset, model_cfg.tiny)


def load_model(model_cfg, device: str | torch.device = "auto", tokenizer=None, partition=None,
               dtype: torch.dtype | None = None):
    """(model in eval mode on `device`, tokenizer). Raises a clear error for a dense or unsupported model.

    `partition` (the trainer's ZeRO-3 partitioned loading): from_pretrained runs in its `from_pretrained()` context
    (transformers' DeepSpeed-aware path builds the model partitioned); a tiny random model is built whole and handed
    to its `partition(model)`. Without it a checkpoint loads straight onto `device` (on a GPU no host copy first)."""
    device = resolve_device(device) if isinstance(device, str) else device
    dtype = dtype or resolve_dtype(model_cfg.dtype, device)
    device_map = getattr(model_cfg, "device_map", None)  # absent from configs saved before it existed
    if device_map and model_cfg.tiny:
        raise ValueError("model.device_map needs a checkpoint (model.path); tiny random models are built on one device")
    if model_cfg.tiny and model_cfg.path:
        raise ValueError(f"the model preset sets both model.path ({model_cfg.path}) and model.tiny ({model_cfg.tiny}); "
                         "keep one (a tiny preset writes tiny as ${tiny_unless_path:<type>,${.path}})")
    tokenizer = tokenizer or load_tokenizer(model_cfg)
    if model_cfg.tiny:
        from slimwise_train.testing.tiny import tiny_model

        _tiny_notice(model_cfg)
        overrides = dict(model_cfg.tiny_overrides or {})
        overrides.setdefault("vocab_size", len(tokenizer))
        overrides.setdefault("pad_token_id", tokenizer.pad_token_id)
        overrides.setdefault("eos_token_id", tokenizer.eos_token_id)
        model = tiny_model(model_cfg.tiny, seed=model_cfg.seed, **overrides).to(dtype)
        if partition is not None:
            model = partition.partition(model.to(device))
    else:
        if not model_cfg.path:
            raise ValueError("model config needs model.path (hub id or folder) or model.tiny (a model_type)")
        if device_map and partition is not None:
            raise ValueError("model.device_map spreads one model over GPUs for prune/eval; training partitions it with "
                             "engine=zero3 instead: drop model.device_map")
        placement = ({"device_map": device_map} if device_map
                     else {} if partition is not None or device.type == "cpu" else {"device_map": {"": device}})
        with partition.from_pretrained() if partition is not None else contextlib.nullcontext():
            model = from_pretrained_or_explain(
                AutoModelForCausalLM.from_pretrained, resolve_path(model_cfg.path), dtype=dtype,
                revision=model_cfg.revision, trust_remote_code=model_cfg.trust_remote_code, **placement)
    get_adapter(model)  # fail now, with the supported list, for a dense or unknown model
    if model_cfg.experts_implementation:
        model.set_experts_implementation(model_cfg.experts_implementation)
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        raise ValueError(
            f"tokenizer has {len(tokenizer)} tokens but the model's embedding has "
            f"{model.get_input_embeddings().num_embeddings}; model.tokenizer points at the wrong tokenizer"
        )
    if device_map or any(is_partitioned(p) for p in model.parameters()):
        return model.eval(), tokenizer  # placed already: DeepSpeed's partitions, or accelerate's device map
    return model.to(device).eval(), tokenizer


def model_identity(model_cfg) -> str:
    """Human-readable identity recorded in output metadata."""
    if model_cfg.tiny:
        return f"tiny:{model_cfg.tiny}:seed={model_cfg.seed}"
    return f"{model_cfg.path}@{model_cfg.revision or 'main'}"


def model_weights(model_cfg):
    """The model of `model_cfg` as the keep-set rules compare it (`moe.keepset_rules.ModelWeights`), without loading
    it: a tiny random model by its recipe (type, seed, overrides, tokenizer: what builds its weights), a checkpoint by
    its local folder, a hub id by its snapshot in the local cache (none when it is not cached)."""
    import json

    from slimwise_train.moe.keepset_rules import ModelWeights

    identity = model_identity(model_cfg)
    if model_cfg.tiny:
        recipe = {"tiny": model_cfg.tiny, "seed": int(model_cfg.seed), "tokenizer": model_cfg.tokenizer,
                  "overrides": dict(model_cfg.tiny_overrides or {})}
        return ModelWeights(identity, recipe=json.dumps(recipe, sort_keys=True, default=str))
    path = resolve_path(str(model_cfg.path))
    folder = Path(path).expanduser()
    if not folder.is_dir():
        folder = _cached_snapshot(path, model_cfg.revision)
    return ModelWeights(identity, folder=os.path.realpath(folder) if folder else None)


def _cached_snapshot(repo_id: str, revision: str | None) -> Path | None:
    """The local snapshot folder of a hub id in the Hugging Face cache, without the network; None when not cached."""
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, revision=revision, local_files_only=True))
    except Exception:  # not cached, or not a valid id: the model load names the problem
        return None

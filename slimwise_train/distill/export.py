"""Export of the distilled decoder.

Two artefacts, written atomically by rank 0 at the end of training:

* `student_trainable.safetensors`: only the trained tensors (router and norm deltas, shared experts, LoRA) plus the
  keep set and the student spec in its metadata. `load_trainable(path, teacher)` rebuilds the student on any copy
  of the teacher; this is the small file to ship when the teacher is already deployed (co-located serving).
* `export/`: a Hugging Face checkpoint of the decode model alone: the kept experts (physically pruned), the routers
  and norms with the trained deltas folded in (W + dW, w + dw), and the shared experts. It expects the teacher's
  KV cache for the prompt (`handoff.handoff_generate(teacher, exported, ...)`), exactly as trained. LoRA
  (distill.trainable, lora.py) is merged into the kept experts / attention weights (W + s B A); its co-located
  form, a peft adapter folder (`adapter/`), is `lora.export_adapter`.

Architecture of the exported checkpoint:
  * without a shared expert (shared_expert_mode=none, the default on the families without a slot of their own:
    Qwen3-MoE, Mixtral, OLMoE, GPT-OSS; or distill.student.train_shared_expert=false) it is the stock class
    (`AutoModelForCausalLM`, no project code), like `pruning.export_pruned`: routers and norms with their deltas
    folded, the default preset's LoRA merged into the kept experts;
  * with the shared expert in the family's own slot (distill.student.shared_expert_mode=native; the default where there
    is one) it is the stock class too: the slot's trained extra columns are concatenated into its weights (gate/up
    rows, down columns) and the adapter's config field grows to match (`shared_expert_intermediate_size`,
    DeepSeek-V3's `n_shared_experts`, Gemma 4's `intermediate_size`), so any engine that loads the family loads it;
  * multi-token-prediction layers of the teacher's checkpoint (Qwen3.5/3.6, Qwen3-Next, DeepSeek-V3) are not
    exported; the config says so (`mtp_num_hidden_layers` / `num_nextn_predict_layers`: 0, `moe.pruning.drop_mtp`);
  * with a new shared expert (shared_expert_mode=new, explicit only), no stock class has an ungated shared expert
    in the right place for every family, so it is a registered architecture: model_type
    `slimwise_<base model_type>`, class `Slimwise<StockClass>`, which is the stock class plus one `SharedExpert`
    per MoE block (`<block>.slimwise_shared_expert`, added to the routed experts' output). The folder is
    self-describing: `modeling_slimwise.py` (transformers and torch only, no project import) and an `auto_map` in
    config.json, so `AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)` loads it anywhere;
    without trust_remote_code transformers says so in one message.
    `import slimwise_train.distill.export` registers the same classes, so in-project code needs neither.
    Expert tensors are stored in the stock on-disk layout (the stock conversion mapping is registered too).
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from slimwise_train.moe.adapters import ADAPTER_BY_MODEL_TYPE, get_adapter
from slimwise_train.distill.student import (
    NORM_DELTA,
    ROUTER_DELTA,
    SHARED_EXPERT,
    SLOT_COLUMNS,
    DistillModel,
    SharedExpert,
    StudentSpec,
)
from slimwise_train.distill.lora import merge_lora_, preset_name
from slimwise_train.moe.keepset import KeepSet
from slimwise_train.moe.pruning import check_exportable, drop_mtp, prune_experts_
from slimwise_train.utils.atomic import atomic_dir, atomic_path
from slimwise_train.utils.fingerprint import model_cache_fingerprint
from slimwise_train.utils.hf import text_config

TRAINABLE_FORMAT = "slimwise-student-trainable/1"
PREFIX = "slimwise_"


# --------------------------------------------------------------------------- registered architecture


def _make_classes(base_model_type: str):
    base_config_cls = CONFIG_MAPPING[base_model_type]
    base_model_cls = MODEL_FOR_CAUSAL_LM_MAPPING[base_config_cls]
    model_type = PREFIX + base_model_type
    config_cls = type(f"Slimwise{base_config_cls.__name__}", (base_config_cls,), {"model_type": model_type,
                                                                                   "__module__": __name__})

    def __init__(self, config):
        base_model_cls.__init__(self, config)
        adapter = ADAPTER_BY_MODEL_TYPE[base_model_type]()
        size = getattr(config, "slimwise_shared_expert_intermediate_size", None)
        if size:
            act = config.slimwise_shared_expert_act
            for moe in adapter.moe_layers(self):
                shared = SharedExpert(config.hidden_size, int(size), act, dtype=None)
                moe.block.add_module(SHARED_EXPERT, shared)
                moe.experts.register_forward_hook(_add_shared_expert(shared))

    model_cls = type(f"Slimwise{base_model_cls.__name__}", (base_model_cls,), {
        "__init__": __init__, "config_class": config_cls, "__module__": __name__,
    })
    return config_cls, model_cls


def _add_shared_expert(shared):
    def hook(module, args, output):
        return output + shared(args[0]).view_as(output)

    return hook


def _register_all() -> dict[str, tuple[type, type]]:
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping, register_checkpoint_conversion_mapping

    classes = {}
    for base_model_type in ADAPTER_BY_MODEL_TYPE:
        if base_model_type not in CONFIG_MAPPING or CONFIG_MAPPING[base_model_type] not in MODEL_FOR_CAUSAL_LM_MAPPING:
            continue  # e.g. multimodal wrappers without a causal-LM class
        config_cls, model_cls = _make_classes(base_model_type)
        globals()[config_cls.__name__] = config_cls
        globals()[model_cls.__name__] = model_cls
        AutoConfig.register(config_cls.model_type, config_cls, exist_ok=True)
        AutoModelForCausalLM.register(config_cls, model_cls, exist_ok=True)
        mapping = get_checkpoint_conversion_mapping(base_model_type)
        if mapping is not None:
            register_checkpoint_conversion_mapping(config_cls.model_type, mapping, overwrite=True)
        classes[base_model_type] = (config_cls, model_cls)
    return classes


REGISTERED = _register_all()


REMOTE_CODE_FILE = "modeling_slimwise.py"
_REMOTE_CODE = '''"""A distilled SlimWise decode model: the stock {base_model} plus one shared expert per MoE block.

Written by slimwise_train's export (no slimwise_train import needed): load with
    AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
It decodes on the KV cache that the unpruned model wrote for the prompt (attention is unchanged).
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN
from {base_config_module} import {base_config}
from {base_model_module} import {base_model}

try:  # the stock on-disk expert layout -> fused tensors, as for the base model
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping, register_checkpoint_conversion_mapping

    _mapping = get_checkpoint_conversion_mapping("{base_model_type}")
    if _mapping is not None:
        register_checkpoint_conversion_mapping("{model_type}", _mapping, overwrite=True)
except ImportError:  # pragma: no cover
    pass


class SharedExpert(nn.Module):
    """down(act(gate(x)) * up(x)), bias-free; added to the routed experts' output."""

    def __init__(self, hidden, intermediate, act):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.act_fn = ACT2FN[act]

    def forward(self, x):
        dtype = x.dtype
        gate = F.linear(x, self.gate_proj.weight.to(dtype))
        up = F.linear(x, self.up_proj.weight.to(dtype))
        return F.linear(self.act_fn(gate) * up, self.down_proj.weight.to(dtype))


def _add_shared_expert(shared):
    def hook(module, args, output):
        return output + shared(args[0]).view_as(output)

    return hook


class {config_cls}({base_config}):
    model_type = "{model_type}"


class {model_cls}({base_model}):
    config_class = {config_cls}

    def __init__(self, config):
        super().__init__(config)
        size = getattr(config, "slimwise_shared_expert_intermediate_size", None)
        if size:
            for block_name, experts_name in config.slimwise_shared_expert_sites:
                shared = SharedExpert(config.hidden_size, int(size), config.slimwise_shared_expert_act)
                self.get_submodule(block_name).add_module("{shared_name}", shared)
                self.get_submodule(experts_name).register_forward_hook(_add_shared_expert(shared))
'''


def remote_code(base_model_type: str) -> tuple[str, dict]:
    """(the standalone modeling file, the auto_map) for the registered architecture of `base_model_type`."""
    config_cls, model_cls = REGISTERED[base_model_type]
    base_config, base_model = config_cls.__mro__[1], model_cls.__mro__[1]
    source = _REMOTE_CODE.format(
        base_config_module=base_config.__module__, base_config=base_config.__name__,
        base_model_module=base_model.__module__, base_model=base_model.__name__, base_model_type=base_model_type,
        model_type=config_cls.model_type, config_cls=config_cls.__name__, model_cls=model_cls.__name__,
        shared_name=SHARED_EXPERT)
    module = REMOTE_CODE_FILE.removesuffix(".py")
    return source, {"AutoConfig": f"{module}.{config_cls.__name__}",
                    "AutoModelForCausalLM": f"{module}.{model_cls.__name__}"}


# --------------------------------------------------------------------------- trainable-only file


def save_trainable(path: str | os.PathLike, state: dict[str, torch.Tensor], keep_set: KeepSet, spec: StudentSpec,
                   model_type: str, extra: dict | None = None) -> Path:
    meta = {
        "format": TRAINABLE_FORMAT,
        "model_type": model_type,
        "keep_set": json.dumps(keep_set.to_dict()),
        "spec": json.dumps(spec.__dict__),
        "extra": json.dumps(extra or {}),
    }
    with atomic_path(path) as tmp:
        save_file({k: v.detach().to("cpu").contiguous() for k, v in state.items()}, str(tmp), metadata=meta)
    return Path(path)


def load_trainable(path: str | os.PathLike, teacher: torch.nn.Module) -> DistillModel:
    """The distilled student rebuilt on `teacher` (a fresh copy of the model it was trained from) from the file
    `save_trainable` wrote. (An exported student folder is read by `slimwise_train.eval.generation.load_student`,
    which takes its arguments in the same order: the file first, the model second.)"""
    with safe_open(str(path), "pt") as handle:
        meta = handle.metadata() or {}
        if meta.get("format") != TRAINABLE_FORMAT:
            raise ValueError(f"{path} is not a slimwise student file (format {meta.get('format')!r})")
        state = {k: handle.get_tensor(k) for k in handle.keys()}
    keep_set = KeepSet.from_dict(json.loads(meta["keep_set"]))
    # Files written before shared_expert_mode existed trained a new shared expert, and before distill.trainable no
    # LoRA; the StudentSpec defaults (auto) would rebuild another student for them.
    spec = StudentSpec(**{"shared_expert_mode": "new", "lora": None, **json.loads(meta["spec"])})
    student = DistillModel(teacher, keep_set, spec)
    names = {n for n, _ in student.trainable_named_parameters()}
    if names != set(state):
        missing, unexpected = sorted(names - set(state)), sorted(set(state) - names)
        raise ValueError(f"{path} does not fit this model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    with torch.no_grad():
        for name, param in student.trainable_named_parameters():
            param.copy_(state[name])
    return student


# --------------------------------------------------------------------------- HF checkpoint of the decoder


def _strip_hooks(model: torch.nn.Module, handle_ids: set[int]) -> None:
    for module in model.modules():
        for hooks in (module._forward_hooks, module._forward_hooks_with_kwargs, module._forward_hooks_always_called):
            for key in [k for k in hooks if k in handle_ids]:
                del hooks[key]


def _fold_slot_columns(model: torch.nn.Module) -> None:
    """Native mode: concatenate every slot's trained extra columns into its weights and grow the config field the
    stock class builds the slot from, so `model` is the stock class with a wider slot."""
    adapter = get_adapter(model)
    widths = set()
    for moe in adapter.moe_layers(model):
        columns = adapter.native_slot(moe)._modules.pop(SLOT_COLUMNS)
        adapter.widen_native_slot_(moe, columns.gate_proj.weight, columns.up_proj.weight, columns.down_proj.weight)
        widths.add(columns.down_proj.in_features)
    assert len(widths) == 1, widths  # one spec size for every layer
    config = text_config(model)
    for key, value in adapter.widened_slot_config(config, widths.pop()).items():
        setattr(config, key, value)
    # The stock class built from the grown config must have exactly these shapes, or from_pretrained would refuse
    # (or worse, silently re-initialise) the checkpoint; building it on the meta device costs no memory.
    with torch.device("meta"):
        stock = type(model)(copy.deepcopy(model.config))
    expected = {k: tuple(v.shape) for k, v in stock.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert got == expected, sorted(set(got.items()) ^ set(expected.items()))[:4]


def folded_decoder(student: DistillModel, in_place: bool = False) -> torch.nn.Module:
    """A copy of the student as one plain model: deltas folded into the routers and norms (W + dW, w + dw),
    removed experts sliced out, the shared expert folded into the family's slot (native mode, the stock class) or
    kept as a child (new mode). The student is left untouched, unless `in_place`."""
    # in_place: nothing uses the student after (a ZeRO-3 run's student rebuilt only to be exported, or the app's run
    # once training is over): fold into its own model instead of a second copy of every weight. The same operations
    # on the same values, so the same checkpoint bitwise.
    model = student.model if in_place else copy.deepcopy(student.model)
    _strip_hooks(model, {h.id for h in student._handles})
    for module in model.modules():  # a copy of a recomputed module is a plain module again
        base = getattr(type(module), "_slimwise_recompute_base", None)
        if base is not None:
            module.__class__ = base
    merge_lora_(model)  # distill.trainable LoRA: W + s B A into the expert / attention weights, stock modules back
    with torch.no_grad():
        for module in list(model.modules()):
            delta = module._modules.pop(ROUTER_DELTA, None)
            if delta is not None:
                module.weight.add_(delta.weight.to(module.weight.dtype))
                if delta.bias is not None:
                    module.bias.add_(delta.bias.to(module.bias.dtype))
            delta = module._modules.pop(NORM_DELTA, None)
            if delta is not None:
                module.weight.add_(delta.weight.to(module.weight.dtype))
    adapter = get_adapter(model)
    check_exportable(adapter, model, student.keep_set)
    pad_to = None if student.keep_set.is_uniform else max(student.keep_set.num_kept)
    prune_experts_(model, student.keep_set, pad_to=pad_to)
    if student.spec.train_shared_expert and student.spec.shared_expert_mode == "native":
        _fold_slot_columns(model)
    for moe in adapter.moe_layers(model):  # the copy's new shared experts run always (as in the registered class)
        shared = getattr(moe.block, SHARED_EXPERT, None)
        if shared is not None:
            moe.experts.register_forward_hook(_add_shared_expert(shared))
    return model


def export_student(student: DistillModel, output_dir: str | os.PathLike, tokenizer=None, overwrite: bool = True,
                   in_place: bool = False, prefix_from: str = "teacher") -> Path:
    """Write the distilled decoder as an HF checkpoint (see module docstring); returns the folder. `prefix_from`
    (distill.split.prefix_from of the training run) is recorded in slimwise_export.json: which prefill it was trained
    after, the teacher's (SlimWise) or its own (conventional + distill)."""
    # the teacher's cache fingerprint, read before LoRA is merged (attention LoRA changes the export's own attention
    # weights, not the cache the teacher writes for it): what the llama.cpp handoff checks (serve/gguf.py)
    teacher_fingerprint = model_cache_fingerprint(student.model)
    model = folded_decoder(student, in_place=in_place)
    mtp = drop_mtp(model)  # the checkpoint's MTP layers are not exported: the config says 0 (moe/pruning.py)
    config = text_config(model)
    base_model_type = config.model_type
    # A new shared expert needs the registered architecture; a native one was folded into the stock slot, and
    # without one (mode none) there is nothing beyond the stock class.
    shared = student.spec.train_shared_expert and student.spec.shared_expert_mode == "new"
    if shared:
        config_cls, model_cls = REGISTERED[base_model_type]
        shared_expert = getattr(student.moe_layers[0].block, SHARED_EXPERT)
        act, size = shared_expert.act_name, shared_expert.down_proj.in_features
        names = {id(module): name for name, module in model.named_modules()}
        sites = [[names[id(moe.block)], names[id(moe.experts)]] for moe in get_adapter(model).moe_layers(model)]
        source, auto_map = remote_code(base_model_type)
        new_config = config_cls.from_dict({
            **config.to_dict(),
            "model_type": config_cls.model_type,
            "architectures": [model_cls.__name__],
            "auto_map": auto_map,
            "slimwise_base_model_type": base_model_type,
            "slimwise_shared_expert_intermediate_size": int(size),
            "slimwise_shared_expert_act": act,
            "slimwise_shared_expert_sites": sites,
        })
        # The registered class built on the meta device, then given the folded model's own tensors (assign): no
        # second copy of the weights. Non-persistent buffers (rotary tables) are not in a state dict: taken over too.
        with torch.device("meta"):
            out_model = model_cls(new_config)
        missing, unexpected = out_model.load_state_dict(model.state_dict(), strict=False, assign=True)
        assert not unexpected and not [k for k in missing if not k.endswith("inv_freq")], (missing, unexpected)
        buffers = dict(model.named_buffers())
        for name, buffer in list(out_model.named_buffers()):
            if buffer.is_meta:
                owner, _, attr = name.rpartition(".")
                out_model.get_submodule(owner)._buffers[attr] = buffers[name]
        left = [n for n, t in [*out_model.named_parameters(), *out_model.named_buffers()] if t.is_meta]
        assert not left, left[:4]
        out_model.eval()
    else:
        out_model = model
    info = {
        "format": "slimwise-distilled-decoder/1",
        "architecture": "registered" if shared else "stock",
        "base_model_type": base_model_type,
        "load": ("AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)" if shared
                 else "AutoModelForCausalLM.from_pretrained(path)"),
        "prefill": ("the unpruned teacher prefills the prompt; this model decodes on its KV cache"
                    if prefix_from == "teacher" else
                    "trained to prefill the prompt itself and decode on its own KV cache "
                    "(distill.split.prefix_from=student)"),
        "prefix_from": prefix_from,
        "num_kept": list(student.keep_set.num_kept),
        "shared_expert": student.spec.shared_expert_mode if student.spec.train_shared_expert else None,
        "trainable": preset_name(student.spec.lora),  # the resolved preset (LoRA merged into the weights above)
        "cache_fingerprint": teacher_fingerprint,
        "mtp": None if mtp is None else f"dropped: {mtp['key']} {mtp['was']} -> 0 (no MTP tensors exported)",
    }
    output_dir = Path(output_dir)
    with atomic_dir(output_dir, overwrite=overwrite) as tmp:
        out_model.save_pretrained(tmp)
        if shared:
            (tmp / REMOTE_CODE_FILE).write_text(source)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        student.keep_set.save(tmp / "slimwise_keep_set.json")
        (tmp / "slimwise_export.json").write_text(json.dumps(info, indent=2) + "\n")
    return output_dir

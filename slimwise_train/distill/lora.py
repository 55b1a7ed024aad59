"""LoRA in the student phase (peft), the `distill.trainable` presets, and the two serving forms of an adapter.

    distill/trainable=auto                       the default: always_on where the student has a shared expert (its
                                                 family's own slot), always_on+lora_experts where it has none (the
                                                 families without a slot: shared_expert_mode auto -> none)
    distill/trainable=always_on                  routers, norms and the shared expert if any (student.py)
    distill/trainable=always_on+lora_experts     + LoRA of rank r on every MoE layer's fused expert tensors
    distill/trainable=always_on+lora_attention   + LoRA on the attention projections (q/k/v/o by default)

`auto` exists so that the default export of every family is its stock class: a family without a slot of its own
would otherwise need a new module (a new shared expert, remote code); LoRA on the kept experts is the capacity it
trains instead, merged into the kept experts at export.

How peft 0.21 adapts a fused expert tensor (peft/tuners/lora/layer.py, `ParamWrapper`; `LoraConfig(
target_parameters=[...])`): the experts module is wrapped (two nested wrappers for gate_up_proj and down_proj)
and, for one forward, the tensor is parametrised as W + s * B_e A_e for every expert e at once (one `baddbmm` over
[E, out, in]); A is `Linear(in, r*E)`, B `Linear(r*E, out)`, i.e. an independent rank-r pair per expert. There is
no per-expert mask. A removed expert still has its pair, but the student never routes a token to it (its router
logit is -inf before the top-k), so the gradient of its slice of W + dW is exactly zero, hence so are the gradients
of its A_e and B_e; B_e starts at zero and stays zero (AdamW with a zero gradient and zero moments moves nothing;
weight decay scales zero), so its delta is exactly zero for the whole run (tests/test_lora.py checks the slices
after training). The exports drop or zero those slices explicitly anyway.

Phases: peft's own switch (`enable_adapters`) also flips requires_grad, which DDP and DeepSpeed must not see
between forwards. Instead a pre-hook on every LoRA layer sets its `_disable_adapters` flag from the student's
phase at each call, so the teacher phase runs the stock modules (bit for bit) and a recompute in backward, which
re-enters the student phase, re-enables them. B is zero at init, so the untrained student equals the masked model
bit for bit (W + 0 == W).

Serving:
* disaggregated: `export.export_student` merges the deltas into the kept experts / attention weights of the pruned
  decode checkpoint (`merge_lora_`);
* co-located: `export_adapter` writes a peft adapter folder (`PeftModel.from_pretrained(stock, folder)` loads the
  LoRA part) plus the always-on tensors and the keep set; `load_colocated(stock, folder)` (in student.py, which
  builds the DistillModel and imports this module) turns one stock model into prefill = stock (adapters off, all
  experts) and decode = the distilled student (adapters on, removed experts masked), driven by `PhaseMasking`'s phase
  rule (`set_phase("auto")` for `model.generate`).

Shapes: E routed experts of a layer, r the LoRA rank.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import get_args

import torch
from torch import nn

from slimwise_train.config import TrainablePreset
from slimwise_train.moe.adapters import MoEAdapter
from slimwise_train.utils.atomic import atomic_dir
from slimwise_train.utils.distributed import full_shape

# preset name (config.TrainablePreset, the one list) -> where LoRA goes (config.LoraKind: None = nothing beyond the
# always-on tensors; auto: resolve_lora decides per family)
_KIND = {"auto": "auto", "always_on": None, "always_on+lora_experts": "experts",
         "always_on+lora_attention": "attention"}
TRAINABLE_PRESETS = {name: _KIND[name] for name in get_args(TrainablePreset)}
LORA_KINDS = ("experts", "attention")  # what peft is applied to (auto resolves to one of them or to none)
DEFAULT_TARGETS = {"experts": ["gate_up_proj", "down_proj"], "attention": ["q_proj", "k_proj", "v_proj", "o_proj"]}
ADAPTER_NAME = "default"  # peft's adapter name, part of every LoRA parameter name (lora_A.default.weight)
PEFT_PREFIX = "base_model.model."  # how PeftModel names the wrapped model's parameters in adapter_model.safetensors
ALWAYS_ON_FILE = "slimwise_student.safetensors"
KEEP_SET_FILE = "slimwise_keep_set.json"
INFO_FILE = "slimwise_adapter.json"
ADAPTER_FORMAT = "slimwise-lora-adapter/1"


# --------------------------------------------------------------------------- config


def lora_from_config(trainable_cfg) -> dict | None:
    """The `lora` entry of a StudentSpec from `distill.trainable` (None for always_on; kind "auto" for the auto
    preset, which DistillModel resolves with `resolve_lora`); ValueError on a bad preset."""
    if trainable_cfg is None:
        return None
    name, kind = str(trainable_cfg.name), trainable_cfg.lora
    if name not in TRAINABLE_PRESETS:
        raise ValueError(f"unknown distill.trainable preset {name!r}; use one of {', '.join(TRAINABLE_PRESETS)} "
                         "(distill/trainable=<name>)")
    if kind != TRAINABLE_PRESETS[name]:
        raise ValueError(f"distill.trainable.name={name} but distill.trainable.lora={kind}; pick the preset with "
                         f"distill/trainable=<name> instead of overriding lora")
    if kind is None:
        return None
    rank, alpha, targets = int(trainable_cfg.rank), float(trainable_cfg.alpha), list(trainable_cfg.targets)
    if rank < 1 or alpha <= 0:
        raise ValueError(f"distill.trainable.rank must be >= 1 and alpha > 0, got rank={rank} alpha={alpha}")
    if not targets:
        example = DEFAULT_TARGETS["experts" if kind == "auto" else kind]
        raise ValueError(f"distill.trainable.targets is empty; {kind} LoRA needs names, e.g. {example}")
    return {"kind": kind, "rank": rank, "alpha": alpha, "targets": targets}


def resolve_lora(lora: dict | None, has_shared_expert: bool) -> dict | None:
    """A StudentSpec's `lora` with kind auto resolved: LoRA on the kept experts when the student has no shared
    expert (its capacity, without adding a module), else none. Other entries are returned as they are."""
    if not lora or lora["kind"] != "auto":
        return lora
    return None if has_shared_expert else {**lora, "kind": "experts"}


def preset_name(lora: dict | None) -> str:
    return "always_on" if not lora else f"always_on+lora_{lora['kind']}"


def peft_config(model: nn.Module, adapter: MoEAdapter, lora: dict):
    """peft `LoraConfig` naming every adapted tensor or module of `model` by its full name (so the same config
    applies to the stock model in `PeftModel.from_pretrained`). ValueError in one line when nothing fits."""
    from peft import LoraConfig

    kind, targets = lora["kind"], list(lora["targets"])
    if kind not in LORA_KINDS:
        raise ValueError(f"unknown LoRA kind {kind!r}; use one of {', '.join(LORA_KINDS)}")
    names = {id(module): name for name, module in model.named_modules()}
    common = dict(r=int(lora["rank"]), lora_alpha=float(lora["alpha"]), lora_dropout=0.0, bias="none")
    if kind == "experts":
        params = []
        for moe in adapter.moe_layers(model):
            own = dict(moe.experts.named_parameters(recurse=False))
            for target in targets:
                if target not in own or len(full_shape(own[target])) != 3:
                    fused = [n for n, p in own.items() if len(full_shape(p)) == 3]
                    raise ValueError(
                        f"always_on+lora_experts: {adapter.family} layer {moe.layer_index}: the experts "
                        f"({type(moe.experts).__name__}) have no fused 3D tensor {target!r} (fused [E, ., .] tensors: "
                        f"{fused or 'none'}); set distill.trainable.targets to some of them")
                params.append(f"{names[id(moe.experts)]}.{target}")
        return LoraConfig(target_modules=[], target_parameters=params, **common)
    modules = []
    for layer in adapter.decoder_layers(model):
        attention = getattr(layer, "self_attn", None)
        if attention is None:  # e.g. a linear-attention layer of a hybrid model (`linear_attn`)
            continue
        for name, module in attention.named_modules():
            if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in targets:
                modules.append(f"{names[id(attention)]}.{name}")
    if not modules:
        found = sorted({n.rsplit(".", 1)[-1] for layer in adapter.decoder_layers(model)
                        for n, m in getattr(layer, "self_attn", nn.Module()).named_modules() if isinstance(m, nn.Linear)})
        raise ValueError(f"always_on+lora_attention: {adapter.family} has no attention projection named {targets} "
                         f"under its decoder layers' self_attn (its projections: {found or 'none'}); set "
                         "distill.trainable.targets")
    return LoraConfig(target_modules=modules, **common)


# --------------------------------------------------------------------------- the student's LoRA


def tuner_layers(model: nn.Module) -> list[nn.Module]:
    """Every peft LoRA layer of `model` (nested ParamWrappers included)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


def _outermost(model: nn.Module) -> list[tuple[str, nn.Module]]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    found = []
    for name, module in model.named_modules():
        if isinstance(module, BaseTunerLayer) and not any(name.startswith(f"{outer}.") for outer, _ in found):
            found.append((name, module))
    return found


class StudentLora:
    """peft LoRA layers injected into `model` in place, enabled only while `is_student()` is true."""

    def __init__(self, model: nn.Module, adapter: MoEAdapter, lora: dict, is_student):
        from peft import inject_adapter_in_model

        self.config = peft_config(model, adapter, lora)
        inject_adapter_in_model(self.config, model, adapter_name=ADAPTER_NAME)  # freezes every non-LoRA tensor
        self.layers = tuner_layers(model)
        # Trainable tensors are fp32 (master weights under engine=torch, as student.py's); peft made them in the
        # weight's dtype. ParamWrapper casts its factors to the weight's dtype; lora.Linear casts its input.
        with torch.no_grad():
            for layer in self.layers:
                for name, param in layer.named_parameters():
                    if "lora_" in name and param.dtype != torch.float32:
                        param.data = param.data.float()

        def switch(module, args):
            module._disable_adapters = not is_student()

        self.handles = [layer.register_forward_pre_hook(switch) for layer in self.layers]
        # engine=zero3: a wrapper reads its factors and the expert tensor outside their modules' own forwards, so
        # DeepSpeed must gather the whole wrapper at once (a "leaf"); attention LoRA calls lora_A / lora_B as modules.
        self.zero3_leaves = [m for _, m in _outermost(model)] if lora["kind"] == "experts" else []

def expert_lora_slices(layer: nn.Module, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(A rows [r, in], B columns [out, r]) of one expert in a peft ParamWrapper (views into the parameters).

    peft's layout: A is [r*E, in] read as [E, r, in]; B is [out, r*E] read as [out, r, E]."""
    weight_a = layer.lora_A[ADAPTER_NAME].weight
    weight_b = layer.lora_B[ADAPTER_NAME].weight
    num_experts = layer.num_experts
    a = weight_a.view(num_experts, -1, weight_a.shape[-1])[expert]
    b = weight_b.view(weight_b.shape[0], -1, num_experts)[:, :, expert]
    return a, b


def expert_wrappers(student) -> list[tuple[int, nn.Module]]:
    """(decoder layer index, ParamWrapper) for every adapted expert tensor of a DistillModel."""
    from peft.tuners.lora import ParamWrapper

    found = []
    for moe in student.moe_layers:
        module = moe.experts
        while isinstance(module, ParamWrapper):
            found.append((moe.layer_index, module))
            module = module.base_layer
    return found


def merge_lora_(model: nn.Module) -> nn.Module:
    """Fold every LoRA delta into its weight (W + s B A, per expert for fused tensors) and put the stock module
    back in place of each peft wrapper. In place; returns `model`."""
    with torch.no_grad():
        for name, module in _outermost(model):
            if hasattr(module, "unload_and_optionally_merge_module"):  # ParamWrapper: merges nested ones too
                base = module.unload_and_optionally_merge_module(merge=True, safe_merge=False, adapter_names=None)
            else:
                module.merge(safe_merge=False)
                base = module.get_base_layer()
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, base)
    if hasattr(model, "peft_config"):
        del model.peft_config
    return model


# --------------------------------------------------------------------------- co-located serving: adapter folder


def peft_state_dict(student) -> dict[str, torch.Tensor]:
    """The LoRA tensors under PeftModel's names (`base_model.model.<module>.lora_A.weight`), removed experts' pairs
    zeroed, fp32 on CPU."""
    state = {PEFT_PREFIX + name.replace(f".{ADAPTER_NAME}.", "."): param.detach().to("cpu", torch.float32, copy=True)
             for name, param in student.model.named_parameters() if "lora_" in name}
    names = {id(param): PEFT_PREFIX + name.replace(f".{ADAPTER_NAME}.", ".")
             for name, param in student.model.named_parameters()}
    for layer_index, wrapper in expert_wrappers(student):
        a = state[names[id(wrapper.lora_A[ADAPTER_NAME].weight)]]
        b = state[names[id(wrapper.lora_B[ADAPTER_NAME].weight)]]
        for expert in student.keep_set.layer(layer_index).removed:  # zero already (see module docstring): made explicit
            a.view(wrapper.num_experts, -1, a.shape[-1])[expert] = 0
            b.view(b.shape[0], -1, wrapper.num_experts)[:, :, expert] = 0
    return state


def export_adapter(student, output_dir: str | os.PathLike, tokenizer=None, overwrite: bool = True) -> Path:
    """Write the co-located serving folder of a student with LoRA (see module docstring); returns the folder.

    adapter_config.json + adapter_model.safetensors   peft's format: `PeftModel.from_pretrained(stock, folder)`
    slimwise_student.safetensors                      the always-on tensors (router/norm deltas, shared experts)
    slimwise_keep_set.json, slimwise_adapter.json     the keep set; the student spec and how to load
    """
    from safetensors.torch import save_file

    lora = student.spec.lora
    if not lora:
        raise ValueError("export_adapter: this student has no LoRA (distill.trainable=always_on); serve it with "
                         "student_trainable.safetensors and load_trainable instead")
    config = copy.deepcopy(student.lora.config)  # names the stock model's tensors and modules
    config.base_model_name_or_path = getattr(student.model.config, "_name_or_path", None) or None
    config.inference_mode = True
    always_on = {n: p.detach().to("cpu", torch.float32, copy=True).contiguous()
                 for n, p in student.trainable_named_parameters() if "lora_" not in n}
    info = {
        "format": ADAPTER_FORMAT,
        "trainable": preset_name(lora),
        "spec": student.spec.__dict__,
        "model_type": student.model.config.model_type,
        "load": "slimwise_train.distill.student.load_colocated(stock_model, folder)  # prefill stock, decode student",
        "peft": "PeftModel.from_pretrained(stock_model, folder) loads the LoRA part only (no router/norm deltas, "
                "no shared expert, no masking)",
        "num_kept": list(student.keep_set.num_kept),
    }
    output_dir = Path(output_dir)
    with atomic_dir(output_dir, overwrite=overwrite) as tmp:
        config.save_pretrained(str(tmp))
        save_file(peft_state_dict(student), str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        if always_on:
            save_file(always_on, str(tmp / ALWAYS_ON_FILE))
        student.keep_set.save(tmp / KEEP_SET_FILE)
        (tmp / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    return output_dir

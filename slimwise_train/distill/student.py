"""Teacher and student in ONE module over one copy of the frozen weights.

    student = DistillModel(model, keep_set, StudentSpec(...))   # adds small trainable children, freezes the rest
    logits = student(ids, mask, positions, cache, phase="teacher")   # stock model: all experts, original routers/norms
    logits = student(ids, mask, positions, cache, phase="student")   # kept experts + trained routers/norms/shared expert

The stock model stays intact. Three kinds of zero-initialised trainable child modules are attached, and forward
hooks call them (as modules, so ZeRO-3 gathers their parameters; see engine.py) only in the student phase:

* router delta   `DeltaLinear(H, E)` under the router (Gemma 4: under `router.proj`, whose input is the normalised,
                 scaled hidden state). Student logits = stock logits + dW h (+ db for GPT-OSS, whose router has a
                 bias), i.e. a trainable copy W + dW of the router that starts at W. The removed experts are then
                 excluded with `adapter.reroute`, exactly as `PhaseMasking` does in its decode phase.
* norm delta     `NormDelta(H)` under every RMSNorm that has a weight. RMSNorm output is linear in its weight, for
                 the plain (x_hat * w) and the zero-centred (x_hat * (1 + w): Qwen3-Next, Qwen3.5) forms alike, so
                 student out = stock out + x_hat * dw is the norm with weight w + dw. Norms before attention change
                 the K/V of the continuation tokens only; the prefix cache stays the teacher's (the SlimWise design;
                 with distill.split.prefix_from=student the student prefills too, so they change its prefix K/V as
                 well).
* shared expert  `SharedExpert` (gated MLP in the family's activation, down projection zero), placed by
                 `StudentSpec.shared_expert_mode` (auto, the default: native where the family has a slot of its
                 own, else none):
                 - native (Qwen2-MoE / Qwen3-Next / Qwen3.5-MoE `shared_expert`, DeepSeek-V3 `shared_experts`,
                   Gemma 4's dense `mlp`): extra intermediate columns of that slot, under it as
                   `slimwise_slot_columns`; a hook adds their output to the slot's, which is exactly the slot widened
                   by those columns (for Qwen before the sigmoid shared_expert_gate multiplies it, so the columns
                   sit inside the gate). The export concatenates them into the slot: the stock class with a larger
                   config width (export.py).
                 - none (Qwen3-MoE, Mixtral, OLMoE, GPT-OSS by default): no shared expert. The default trainable
                   preset (`auto`, lora.py) trains LoRA on the kept experts instead, merged into them at export, so
                   the export is the stock class there too (no module is added anywhere).
                 - new (explicit only, for those who accept remote code): a new expert under the MoE block whose
                   output is added to the routed experts' output (hook on `experts`, input [T, H] -> [T, H]), so it
                   sits inside Gemma 4's post_feedforward_layernorm_2 like the routed experts. GPT-OSS experts are a
                   clamped SwiGLU with biases; its shared expert is a plain SwiGLU (documented deviation). Exports
                   with remote code (modeling_slimwise.py + auto_map).

Optionally (`StudentSpec.lora`, distill.trainable) peft LoRA wraps the fused expert tensors or the attention
projections in place; its layers are on in the student phase only (lora.py).

At init every delta is exactly zero and x + 0 == x in floating point, so the untrained student's logits equal the
masked model's bit for bit (tests/test_student.py checks all families). In the teacher phase every hook returns
immediately.

Shapes: T tokens (batch*seq flattened), H hidden, E routed experts, I shared-expert intermediate size.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import get_args

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from slimwise_train.config import NormScope, Recompute, SharedExpertMode, StudentConfig, TrainableConfig
from slimwise_train.distill.lora import (ADAPTER_FORMAT, ADAPTER_NAME, ALWAYS_ON_FILE, INFO_FILE, KEEP_SET_FILE,
                                         PEFT_PREFIX, StudentLora, lora_from_config, resolve_lora)
from slimwise_train.moe.adapters import NATIVE_SLOT_FAMILIES, MoEAdapter, MoELayer, get_adapter
from slimwise_train.moe.keepset import KeepSet
from slimwise_train.utils.distributed import full_shape
from slimwise_train.utils.hf import text_config

PHASES = ("teacher", "student")
# Attribute names of the added children; export.py and the trainable-tensor file rely on them.
ROUTER_DELTA = "slimwise_router_delta"
NORM_DELTA = "slimwise_norm_delta"
SHARED_EXPERT = "slimwise_shared_expert"
SLOT_COLUMNS = "slimwise_slot_columns"  # native mode: the extra columns of the family's own shared slot
# The choices live in config.py (one list each); auto: native where the family has a slot of its own, else none.
SHARED_EXPERT_MODES = get_args(SharedExpertMode)
NORM_SCOPES = get_args(NormScope)
RECOMPUTE = get_args(Recompute)
# Cache layers that a recomputed decoder layer can rewind (their update reassigns tensors; linear-attention state is
# updated in place and cannot be rewound, so those layers recompute their routed experts only).
_REWINDABLE_CACHE_LAYERS = ("DynamicLayer", "DynamicSlidingWindowLayer")


@dataclass
class StudentSpec:
    """Which parameter kinds train. `norm_scope`: all = every RMSNorm with a weight (incl. attention q/k norms),
    layer = only norms that are direct children of a decoder layer, plus the final norm.

    The defaults are the config schema's (config.StudentConfig / TrainableConfig), so `StudentSpec()` is the student
    a default training run builds. DistillModel resolves the two autos per family (`resolved`) and records that."""

    train_routers: bool = StudentConfig.train_routers
    train_norms: bool = StudentConfig.train_norms
    norm_scope: str = StudentConfig.norm_scope
    train_shared_expert: bool = StudentConfig.train_shared_expert
    shared_expert_intermediate_size: int | None = None  # None: the routed expert size
    # auto | native | new | none (see the module docstring); DistillModel resolves auto
    shared_expert_mode: str = StudentConfig.shared_expert_mode
    init_std: float = 0.02  # gate/up projections of the new shared expert
    seed: int = 0  # the shared expert init is drawn from its own generator, identical on every rank
    # distill.trainable's LoRA (lora.py): kind (experts | attention | auto), rank, alpha, targets; None: no LoRA
    lora: dict | None = field(default_factory=lambda: lora_from_config(TrainableConfig()))

    @classmethod
    def from_config(cls, distill_cfg, seed: int = 0) -> "StudentSpec":
        """The spec of `distill` (its student group and trainable preset)."""
        student = distill_cfg.student
        return cls(
            train_routers=bool(student.train_routers),
            train_norms=bool(student.train_norms),
            norm_scope=str(student.norm_scope),
            train_shared_expert=bool(student.train_shared_expert),
            shared_expert_intermediate_size=student.shared_expert_intermediate_size,
            shared_expert_mode=str(student.shared_expert_mode),
            seed=seed,
            lora=lora_from_config(distill_cfg.get("trainable")),
        )

    def resolved(self, adapter: MoEAdapter) -> "StudentSpec":
        """This spec for `adapter`'s family with no auto left: the shared-expert mode (a student without a shared
        expert always reads mode none, train_shared_expert false, however it was asked for) and the LoRA kind."""
        mode = resolve_shared_expert_mode(adapter, self.shared_expert_mode)
        shared = self.train_shared_expert and mode != "none"
        return replace(self, shared_expert_mode=mode if shared else "none", train_shared_expert=shared,
                       lora=resolve_lora(self.lora, shared))


# --------------------------------------------------------------------------- trainable children


class DeltaLinear(nn.Module):
    """dW h (+ db): the trainable offset of a router's logits, zero at init. Computes in fp32 when the router
    does (DeepSeek-V3), else in the activations' dtype; the parameters keep their own dtype (fp32 master)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(out_features, in_features, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None

    def forward(self, h_TH: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        h = h_TH.to(out_dtype)
        bias = None if self.bias is None else self.bias.to(out_dtype)
        return F.linear(h, self.weight.to(out_dtype), bias)


class NormDelta(nn.Module):
    """x_hat * dw with x_hat = x / rms(x) in fp32: the change of an RMSNorm's output when its weight moves by dw."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        x = x.float()
        x_hat = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x_hat * self.weight.float()).to(out_dtype)


class SharedExpert(nn.Module):
    """down(act(gate(x)) * up(x)), bias-free, down projection zero at init. Parameters keep their dtype; the
    matmuls run in the input's dtype (bf16 activations with fp32 master weights under engine=torch)."""

    def __init__(self, hidden: int, intermediate: int, act: str, dtype: torch.dtype, device=None):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False, dtype=dtype, device=device)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False, dtype=dtype, device=device)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False, dtype=dtype, device=device)
        self.act_name = act
        self.act_fn = ACT2FN[act]

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        dtype = x_TH.dtype
        gate = F.linear(x_TH, self.gate_proj.weight.to(dtype))
        up = F.linear(x_TH, self.up_proj.weight.to(dtype))
        return F.linear(self.act_fn(gate) * up, self.down_proj.weight.to(dtype))


# --------------------------------------------------------------------------- model facts


def routed_expert_size(model) -> int:
    config = text_config(model)
    return int(getattr(config, "moe_intermediate_size", None) or config.intermediate_size)


def activation_name(model) -> str:
    config = text_config(model)
    return getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None) or "silu"


def resolve_shared_expert_mode(adapter: MoEAdapter, mode: str) -> str:
    """`native`, `new` or `none` for this family: auto picks native where the family has a slot of its own, else
    none (no added module, so the export stays the stock class)."""
    if mode not in SHARED_EXPERT_MODES:
        raise ValueError(f"unknown distill.student.shared_expert_mode {mode!r}; use one of "
                         f"{', '.join(SHARED_EXPERT_MODES)}")
    if mode == "auto":
        return "native" if adapter.has_native_slot else "none"
    if mode == "native" and not adapter.has_native_slot:
        raise ValueError(f"distill.student.shared_expert_mode=native: {adapter.family} has no shared-expert slot of "
                         f"its own (only {', '.join(NATIVE_SLOT_FAMILIES)} do); use "
                         "distill.student.shared_expert_mode=auto or none (stock-class export) or new (a new expert, "
                         "exported with remote code)")
    return mode


def norm_eps(module: nn.Module) -> float:
    for name in ("variance_epsilon", "eps"):
        if hasattr(module, name):
            return float(getattr(module, name))
    raise ValueError(f"{type(module).__name__}: no eps attribute (variance_epsilon or eps)")


def find_norms(model: nn.Module, scope: str = "all") -> list[tuple[str, nn.Module]]:
    """RMSNorm modules with a weight (name order). Gated norms (linear attention: they take a gate input) and
    weightless norms (Gemma 4's router/v norms) are skipped."""
    if scope not in NORM_SCOPES:
        raise ValueError(f"unknown distill.student.norm_scope {scope!r}; use one of {', '.join(NORM_SCOPES)}")
    adapter = get_adapter(model)
    layers = adapter.decoder_layers(model)
    layer_ids = {id(layer) for layer in layers}
    final = getattr(model.get_decoder(), "norm", None) if hasattr(model, "get_decoder") else None
    found = []
    for name, module in model.named_modules():
        if not type(module).__name__.endswith("RMSNorm"):
            continue
        weight = getattr(module, "weight", None)
        if not isinstance(weight, nn.Parameter) or len(full_shape(weight)) != 1:
            continue
        if scope == "layer":
            parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
            if id(parent) not in layer_ids and module is not final:
                continue
        found.append((name, module))
    return found


# --------------------------------------------------------------------------- recompute


class _Recompute:
    """Activation recompute of one module in the student phase (`torch.utils.checkpoint`, use_reentrant=False).

    The module's class is swapped for a subclass whose `__call__` runs the stock `__call__` under checkpoint, so
    parameter names do not change and every forward hook (ZeRO-3's parameter gathering among them) fires again in
    the recompute. For a decoder layer, `cache_index` names its KV-cache layer: the recompute rewinds that layer
    to its state before the forward and restores it after, so the cache is not extended twice.
    """

    def __init__(self, module: nn.Module, is_active, recompute_context, cache_index: int | None = None):
        self.module, self.original_class = module, type(module)
        recompute, original = self, type(module)

        def __call__(self_, *args, **kwargs):
            if not is_active():
                return original.__call__(self_, *args, **kwargs)
            return recompute.checkpointed(original.__call__, self_, args, kwargs, cache_index, recompute_context)

        namespace = {"__call__": __call__, "__module__": original.__module__, "_slimwise_recompute_base": original}
        module.__class__ = type(original.__name__, (original,), namespace)

    @staticmethod
    def checkpointed(call, module, args, kwargs, cache_index, recompute_context):
        from torch.utils.checkpoint import checkpoint as torch_checkpoint
        from torch.utils.checkpoint import set_checkpoint_early_stop

        def checkpoint(*a, **k):
            # No early stop: the recompute runs the whole call, post-forward hooks included (ZeRO-3 releases the
            # parameters it gathered for the recompute in one of them).
            with set_checkpoint_early_stop(False):
                return torch_checkpoint(*a, **k)

        # The recompute runs in backward, after the forward has left the student phase: put it back for it.
        contexts = lambda: (contextlib.nullcontext(), recompute_context())  # noqa: E731
        cache = kwargs.get("past_key_values") if cache_index is not None else None
        if cache is None:
            return checkpoint(call, module, *args, use_reentrant=False, context_fn=contexts, **kwargs)
        layer = cache.layers[cache_index]
        before, after = dict(layer.__dict__), {}

        def run(*a, **k):
            if not after:  # the forward itself
                try:
                    return call(*a, **k)
                finally:
                    after.update(layer.__dict__)
            current = dict(layer.__dict__)  # the recompute, during backward: rewind, run, restore
            layer.__dict__.clear()
            layer.__dict__.update(before)
            try:
                return call(*a, **k)
            finally:
                layer.__dict__.clear()
                layer.__dict__.update(current)

        return checkpoint(run, module, *args, use_reentrant=False, context_fn=contexts, **kwargs)

    def remove(self) -> None:
        self.module.__class__ = self.original_class


# --------------------------------------------------------------------------- the one module


class DistillModel(nn.Module):
    """The stock model (frozen) plus the student's trainable children; `phase` selects teacher or student."""

    def __init__(self, model: nn.Module, keep_set: KeepSet, spec: StudentSpec | None = None,
                 adapter: MoEAdapter | None = None, recompute: str = "none"):
        super().__init__()
        spec = spec or StudentSpec()
        self.adapter = adapter or get_adapter(model)
        # The resolved spec (no auto) is what save_trainable records, so load_trainable rebuilds the same layout.
        spec = spec.resolved(self.adapter)
        keep_set.check_model(model, self.adapter)
        if not (spec.train_routers or spec.train_norms or spec.train_shared_expert or spec.lora):
            raise ValueError("nothing to train: distill.student.train_routers and train_norms are false and there is "
                             "neither a shared expert (train_shared_expert=false or shared_expert_mode=none) nor LoRA "
                             "(distill/trainable=always_on)")
        self.model = model
        self.keep_set = keep_set
        self.spec = spec
        self.phase = "teacher"
        self._handles: list = []
        for param in model.parameters():
            param.requires_grad_(False)
        # Trainable tensors are created in fp32 (master weights under engine=torch; a DeepSpeed bf16 engine casts the
        # module and keeps its own fp32 copies). The hooks cast them to the activations' dtype.
        dtype, device = torch.float32, next(model.parameters()).device
        # LoRA (distill.trainable) wraps expert or attention modules in place, before the MoE views are taken: hooks
        # and recompute then see `moe.experts` as the outermost wrapper. Its layers are on in the student phase only.
        self.lora = StudentLora(model, self.adapter, spec.lora, lambda: self.phase == "student") if spec.lora else None
        self._handles += self.lora.handles if self.lora else []
        self.moe_layers = self.adapter.moe_layers(model)
        self.removed = {m.layer_index: keep_set.layer(m.layer_index).removed_mask(device) for m in self.moe_layers}
        generator = torch.Generator(device="cpu").manual_seed(spec.seed)
        hidden = text_config(model).hidden_size
        shared_size = int(spec.shared_expert_intermediate_size or routed_expert_size(model))
        native = spec.train_shared_expert and spec.shared_expert_mode == "native"
        if native:  # fail here, not at export, when the family's config cannot express the wider slot
            self.adapter.widened_slot_config(text_config(model), shared_size)
        for moe in self.moe_layers:
            target = self.adapter.mask_hook_target(moe)
            if spec.train_routers:
                has_bias = getattr(target, "bias", None) is not None  # GPT-OSS: logits include the router bias
                target.add_module(ROUTER_DELTA, DeltaLinear(hidden, moe.num_experts, has_bias, dtype, device))
            # prepend=True: transformers' output_router_logits capture hooks must see the student's logits.
            self._handles.append(target.register_forward_hook(self._router_hook(moe), prepend=True))
            if spec.train_shared_expert:
                shared = SharedExpert(hidden, shared_size, activation_name(model), dtype, device)
                with torch.no_grad():
                    for proj in (shared.gate_proj, shared.up_proj):
                        proj.weight.copy_(torch.randn(proj.weight.shape, generator=generator) * spec.init_std)
                    shared.down_proj.weight.zero_()
                if native:
                    slot = self.adapter.native_slot(moe)
                    slot.add_module(SLOT_COLUMNS, shared)
                    self._handles.append(slot.register_forward_hook(self._slot_hook))
                else:
                    moe.block.add_module(SHARED_EXPERT, shared)
                    self._handles.append(moe.experts.register_forward_hook(self._experts_hook(moe.block)))
        self._recomputed: list[_Recompute] = []
        self._install_recompute(recompute)
        self.norm_names: list[str] = []
        if spec.train_norms:
            for name, norm in find_norms(model, spec.norm_scope):
                # full_shape: under partitioned loading (ZeRO-3) the weight holds one rank's slice.
                norm.add_module(NORM_DELTA, NormDelta(full_shape(norm.weight)[0], norm_eps(norm), dtype, device))
                self._handles.append(norm.register_forward_hook(self._norm_hook))
                self.norm_names.append(name)

    def _install_recompute(self, mode: str) -> None:
        """distill.memory.recompute: none | moe (the routed experts of every MoE layer: their saved views of the fused
        expert tensors are what keeps gathered ZeRO-3 weights alive until backward) | layer (every decoder layer
        whose KV cache can be rewound; the others recompute their experts)."""
        if mode not in RECOMPUTE:
            raise ValueError(f"unknown distill.memory.recompute {mode!r}; use one of {', '.join(RECOMPUTE)}")
        if mode == "none":
            return

        def active() -> bool:
            return self.phase == "student" and torch.is_grad_enabled()

        @contextlib.contextmanager
        def student_phase():
            previous, self.phase = self.phase, "student"
            try:
                yield
            finally:
                self.phase = previous

        layers = list(self.adapter.decoder_layers(self.model))
        whole = set()
        if mode == "layer":
            from slimwise_train.moe.handoff import cache_layer_kinds

            kinds = cache_layer_kinds(self.model)
            for index, layer in enumerate(layers):
                if index < len(kinds) and kinds[index] in _REWINDABLE_CACHE_LAYERS:
                    self._recomputed.append(_Recompute(layer, active, student_phase, cache_index=index))
                    whole.add(index)
        for moe in self.moe_layers:
            if moe.layer_index not in whole:
                self._recomputed.append(_Recompute(moe.experts, active, student_phase))

    # ------------------------------------------------------------------ hooks (student phase only)
    def _router_hook(self, moe: MoELayer):
        adapter, removed = self.adapter, self.removed[moe.layer_index]

        def hook(module, args, output):
            if self.phase != "student":
                return None
            delta = getattr(module, ROUTER_DELTA, None)
            if delta is not None:
                logits = output[0] if isinstance(output, tuple) else output
                h = args[0].reshape(-1, args[0].shape[-1])
                logits = logits + delta(h, logits.dtype)
                output = (logits, *output[1:]) if isinstance(output, tuple) else logits
            return adapter.reroute(moe, output, removed)

        return hook

    def _experts_hook(self, block: nn.Module):
        def hook(module, args, output):
            if self.phase != "student":
                return None
            return output + getattr(block, SHARED_EXPERT)(args[0]).view_as(output)

        return hook

    def _slot_hook(self, module, args, output):
        if self.phase != "student":
            return None
        # slot(x) + columns(x) is the slot widened by the columns: its down projection sums over both sets.
        return output + getattr(module, SLOT_COLUMNS)(args[0])

    def _norm_hook(self, module, args, output):
        if self.phase != "student":
            return None
        return output + getattr(module, NORM_DELTA)(args[0], output.dtype)

    # ------------------------------------------------------------------ forward
    def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None, phase: str = "student",
                use_cache: bool = True, logits_to_keep: int = 0):
        """logits [B, L, V] of one phase (the last `logits_to_keep` positions if > 0); `past_key_values` is extended
        in place (HF semantics)."""
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; use one of {PHASES}")
        previous, self.phase = self.phase, phase
        try:
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             past_key_values=past_key_values, use_cache=use_cache, logits_to_keep=logits_to_keep)
        finally:
            self.phase = previous
        return out.logits

    # ------------------------------------------------------------------ parameters
    def trainable_named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.named_parameters() if p.requires_grad]

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in self.trainable_named_parameters()}

    def parameter_counts(self) -> dict[str, int]:
        """Counts by kind, plus the frozen total; share = trainable / all parameters of the one module."""
        counts = {"router": 0, "norm": 0, "shared_expert": 0, "lora": 0}
        frozen = 0
        for name, param in self.named_parameters():
            n = param.ds_numel if hasattr(param, "ds_numel") else param.numel()  # ZeRO-3 partitions in place
            if not param.requires_grad:
                frozen += n
            elif ROUTER_DELTA in name:
                counts["router"] += n
            elif NORM_DELTA in name:
                counts["norm"] += n
            elif SHARED_EXPERT in name or SLOT_COLUMNS in name:
                counts["shared_expert"] += n
            elif "lora_" in name:  # peft's lora_A / lora_B (lora.py)
                counts["lora"] += n
            else:
                raise AssertionError(f"unexpected trainable parameter {name}")
        trainable = sum(counts.values())
        return {**counts, "trainable": trainable, "frozen": frozen, "total": trainable + frozen}

    def trainable_shared_expert(self, moe: MoELayer) -> SharedExpert | None:
        """The shared capacity this student trains in one MoE layer (any view of it, e.g. a fresh
        `adapter.moe_layers`): the new expert or the slot's extra columns; None without one."""
        if not self.spec.train_shared_expert:
            return None
        if self.spec.shared_expert_mode == "native":
            return getattr(self.adapter.native_slot(moe), SLOT_COLUMNS)
        return getattr(moe.block, SHARED_EXPERT)

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        # Without their phase hook the LoRA layers would keep whatever the last forward set (on after a student
        # forward): switch them off, so the model is the stock one again like every other inert child.
        for layer in self.lora.layers if self.lora else ():
            layer._disable_adapters = True
        for wrapped in self._recomputed:
            wrapped.remove()
        self._recomputed.clear()


# --------------------------------------------------------------------------- co-located serving of an adapter folder
# The folder lora.export_adapter writes, loaded back as a DistillModel; here rather than in lora.py because it builds
# the student (lora.py is below this module: the student wraps its LoRA layers).


def load_adapter_student(model: nn.Module, folder: str | os.PathLike):
    """The DistillModel of an adapter folder rebuilt on `model` (a stock copy of the teacher), weights loaded."""
    from safetensors.torch import load_file

    folder = Path(folder)
    info_path = folder / INFO_FILE
    if not info_path.is_file():
        raise ValueError(f"{folder} is not a slimwise adapter folder (no {INFO_FILE}; export_adapter writes one)")
    info = json.loads(info_path.read_text())
    if info.get("format") != ADAPTER_FORMAT:
        raise ValueError(f"{info_path}: format {info.get('format')!r}, expected {ADAPTER_FORMAT!r}")
    student = DistillModel(model, KeepSet.load(folder / KEEP_SET_FILE), StudentSpec(**info["spec"]))
    state = {}
    for key, tensor in load_file(str(folder / "adapter_model.safetensors")).items():
        module, _, leaf = key.removeprefix(PEFT_PREFIX).rpartition(".")  # ...lora_A.weight -> ...lora_A.default.weight
        state[f"model.{module}.{ADAPTER_NAME}.{leaf}"] = tensor
    if (folder / ALWAYS_ON_FILE).is_file():
        state.update(load_file(str(folder / ALWAYS_ON_FILE)))
    params = dict(student.trainable_named_parameters())
    if set(params) != set(state):
        missing, unexpected = sorted(set(params) - set(state)), sorted(set(state) - set(params))
        raise ValueError(f"{folder} does not fit this model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(state[name])
            param.requires_grad_(False)  # serving
    return student


class ColocatedStudent:
    """One model, both phases: prefill = the stock model (LoRA off, all experts, stock routers and norms); decode =
    the distilled student (LoRA on, removed experts masked, trained deltas and shared experts on).

    `PhaseMasking` decides the phase of each forward (explicit `phase("prefill"|"decode")`, or `set_phase("auto")`:
    one new token per sequence on a non-empty cache is decode), and the student follows it, so `model.generate`,
    `handoff.continue_on_cache(..., phase="decode")` and `masking.model_phase` work unchanged."""

    def __init__(self, student, phase: str = "prefill"):
        from slimwise_train.moe.masking import PhaseMasking

        self.student = student
        self.model = student.model
        self.masking = PhaseMasking(self.model, student.keep_set, adapter=student.adapter, phase=phase)
        # Registered after PhaseMasking's own pre-hook, so it reads the phase that one resolved for this forward.
        self._handle = self.model.register_forward_pre_hook(self._follow)

    def _follow(self, module, args):
        self.student.phase = "student" if self.masking.masking_active else "teacher"

    def set_phase(self, phase: str) -> None:
        self.masking.set_phase(phase)

    def phase(self, phase: str):
        return self.masking.phase(phase)

    def remove(self) -> None:
        self._handle.remove()
        self.masking.remove()
        self.student.phase = "teacher"


def load_colocated(model: nn.Module, folder: str | os.PathLike, phase: str = "prefill") -> ColocatedStudent:
    """Co-located serving of an `export_adapter` folder on `model` (the stock teacher, modified in place)."""
    return ColocatedStudent(load_adapter_student(model, folder), phase=phase)

"""Engines: how the one DistillModel is wrapped, stepped and checkpointed. The ONLY module that imports deepspeed.

    engine=torch   single process, or DistributedDataParallel when launched with several ranks (gloo on CPU)
    engine=zero1|zero2|zero3   DeepSpeed ZeRO stage 1/2/3, optional optimizer offload to CPU

Both engines implement `Engine` (the Protocol below), the whole surface the trainer and checkpoint.py use:

    logits = engine.forward("teacher"|"student", input_ids=..., attention_mask=..., position_ids=..., past_key_values=...)
    engine.backward(loss, last_micro_batch)    # loss already normalised by the GLOBAL token count
    grad_norm = engine.step()                   # clip (distill.optim.grad_clip), optimizer, scheduler, zero grads
    engine.skip_step()                          # drop this step's gradients (non-finite loss)
    engine.lr()                                 # the scheduler's current learning rate
    engine.trainable_state_dict()               # full (gathered) trainable tensors on CPU, every rank
    with engine.gathered_parameters(params):    # full values of (ZeRO-3 partitioned) parameters, every rank
    engine.save(dir) / engine.load(dir, trainable)   # optimizer + scheduler (+ DeepSpeed's own files)
    engine.close()

Gradient scale: DDP and DeepSpeed average gradients over the W data-parallel ranks, while the loss is a sum over
every rank's tokens divided by the global count; `backward` multiplies by W so the applied gradient is the gradient
of that global loss (tests compare grad norms across engines and against one process).

Precision: fp32 on CPU; on GPU the frozen model is bf16. engine=torch keeps fp32 master copies of the trainable
tensors (student.py casts them to the activations' dtype); DeepSpeed runs bf16 with its own fp32 master weights.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import math
import os
import socket
import warnings
from pathlib import Path
from typing import ContextManager, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from slimwise_train.config import zero_stage
from slimwise_train.utils import distributed as du
from slimwise_train.utils.distributed import is_partitioned

log = logging.getLogger("slimwise.train")
REPO_ROOT = Path(__file__).resolve().parents[2]


def lr_lambda(warmup_steps: int, max_steps: int, min_lr_ratio: float):
    """Linear warmup over `warmup_steps`, then cosine decay to `min_lr_ratio` x peak at `max_steps`."""

    def factor(step: int) -> float:
        if warmup_steps > 0 and step < warmup_steps:
            return (step + 1) / warmup_steps
        span = max(1, max_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / span)
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def validate_engine_config(engine_cfg, distill_cfg) -> None:
    """What the schema cannot say (engine.name, precision and backend are Literal fields: check_known_keys refuses
    any other value): the keys that apply to some engines only."""
    if engine_cfg.offload_optimizer and engine_cfg.name not in ("zero2", "zero3"):
        raise ValueError(f"engine.offload_optimizer needs engine=zero2 or zero3, not {engine_cfg.name}")
    if engine_cfg.name != "zero3":
        from slimwise_train.config import EngineConfig

        for key in ("partitioned_load", "max_live_parameters", "prefetch_bucket_size", "param_persistence_threshold",
                    "offload_params"):
            if engine_cfg.get(key, getattr(EngineConfig, key)) != getattr(EngineConfig, key):
                raise ValueError(f"engine.{key} applies to engine=zero3 only (this run: engine={engine_cfg.name})")
    if float(distill_cfg.optim.grad_clip) < 0:
        raise ValueError(f"distill.optim.grad_clip must be >= 0 (0 disables clipping), "
                         f"got {distill_cfg.optim.grad_clip}")


def resolve_precision(engine_cfg, device: torch.device) -> str:
    if engine_cfg.precision == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    if engine_cfg.precision == "bf16" and device.type != "cuda":
        raise ValueError("engine.precision=bf16 needs a GPU; on CPU the engines run fp32")
    return engine_cfg.precision


def build_engine(engine_cfg, distill_cfg, module, micro_batch_size: int, device: torch.device,
                 loading: "PartitionedLoading | None" = None) -> Engine:
    validate_engine_config(engine_cfg, distill_cfg)
    if engine_cfg.name == "torch":
        return TorchEngine(module, distill_cfg, device)
    config = loading.config if loading is not None else deepspeed_config(
        engine_cfg, distill_cfg, micro_batch_size, device, _hidden_size(module))
    return DeepSpeedZeroEngine(module, engine_cfg, distill_cfg, micro_batch_size, device, config=config)


def _hidden_size(module) -> int:
    from slimwise_train.utils.hf import text_config

    return text_config(module.model).hidden_size


def partitioned_loading(engine_cfg, distill_cfg, micro_batch_size: int, device: torch.device,
                        hidden_size: int | None = None):
    """A `PartitionedLoading` for engine=zero3 with engine.partitioned_load (the default), else None."""
    validate_engine_config(engine_cfg, distill_cfg)
    if engine_cfg.name != "zero3" or not engine_cfg.partitioned_load:
        return None
    return PartitionedLoading(engine_cfg, distill_cfg, micro_batch_size, device, hidden_size)


def _optimizer_kwargs(distill_cfg) -> dict:
    """AdamW's arguments from distill.optim."""
    optim = distill_cfg.optim
    return {
        "lr": float(optim.lr),
        "betas": (float(optim.adam_beta1), float(optim.adam_beta2)),
        "eps": float(optim.adam_eps),
        "weight_decay": float(optim.weight_decay),
    }


def _schedule(distill_cfg):
    """The learning-rate multiplier per step of distill.schedule (`lr_lambda`)."""
    schedule = distill_cfg.schedule
    return lr_lambda(int(schedule.warmup_steps), int(schedule.max_steps), float(schedule.min_lr_ratio))


class Engine(Protocol):
    """What the trainer and checkpoint.py call on an engine; `TorchEngine` and `DeepSpeedZeroEngine` implement it."""

    name: str
    # Whether gradients accumulated by some micro-batches of a step can be dropped (a non-finite loss mid-step):
    # DeepSpeed with grad_accum > 1 cannot, so the trainer stops instead (Trainer._skip_nan_step).
    supports_partial_skip: bool

    def forward(self, phase: str, **kwargs) -> torch.Tensor:
        """The module's logits in `phase` ("teacher": no student deltas, "student": the pruned student)."""

    def backward(self, loss: torch.Tensor, last_micro_batch: bool) -> None:
        """Accumulate the gradient of `loss` (normalised by the global token count: no averaging here)."""

    def step(self) -> float:
        """Clip, optimizer and scheduler step, zero the gradients; returns the gradient norm before clipping."""

    def skip_step(self) -> None:
        """Drop this step's accumulated gradients."""

    def lr(self) -> float:
        """The current learning rate."""

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Every trainable tensor in full, on CPU, on every rank (collective under ZeRO-3)."""

    def gathered_parameters(self, params=None) -> ContextManager:
        """Full values of `params` (default: all) inside the context, on every rank (collective under ZeRO-3)."""

    def save(self, directory: Path) -> None:
        """Optimizer and scheduler state into `directory` (the trainable tensors are checkpoint.py's)."""

    def load(self, directory: Path, trainable: dict[str, torch.Tensor]) -> None:
        """Restore what `save` wrote and the trainable tensors (`trainable`; DeepSpeed reads its own copy)."""

    def close(self) -> None:
        """Release the wrapped module, optimizer and scheduler."""


# --------------------------------------------------------------------------- engine=torch


class TorchEngine:
    name = "torch"
    supports_partial_skip = True  # gradients can be dropped after any micro-batch

    def __init__(self, module, distill_cfg, device: torch.device):
        self.module = module
        self.world_size = du.world_size()
        self.named_params = module.trainable_named_parameters()
        self.params = [p for _, p in self.named_params]
        self.grad_clip = float(distill_cfg.optim.grad_clip)
        if self.world_size > 1:
            # Buffers are frozen and identical on every rank: no sync per forward. DDP broadcasts rank 0's parameters
            # here, so all ranks start from the same trainable tensors.
            self.wrapped = DistributedDataParallel(
                module, device_ids=[device.index] if device.type == "cuda" else None, forward_sync_buffers=False
            )
        else:
            self.wrapped = module
        self.optimizer = torch.optim.AdamW(self.params, **_optimizer_kwargs(distill_cfg))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _schedule(distill_cfg))

    def forward(self, phase: str, **kwargs):
        # The teacher needs no gradient bookkeeping, so it bypasses the DDP wrapper.
        target = self.module if phase == "teacher" else self.wrapped
        return target(phase=phase, **kwargs)

    def backward(self, loss: torch.Tensor, last_micro_batch: bool) -> None:
        sync = last_micro_batch or self.world_size == 1
        with contextlib.nullcontext() if sync else self.wrapped.no_sync():
            (loss * self.world_size).backward()

    def step(self) -> float:
        # max_norm=inf scales by exactly 1.0 (bitwise no-op) and still returns the norm for logging.
        max_norm = self.grad_clip if self.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def skip_step(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def lr(self) -> float:
        return float(self.scheduler.get_last_lr()[0])

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().to("cpu", copy=True) for name, p in self.named_params}

    def load_trainable_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, p in self.named_params:
                p.copy_(state[name].to(p.device, p.dtype))

    @contextlib.contextmanager
    def gathered_parameters(self, params=None):
        yield list(self.module.parameters()) if params is None else params

    def save(self, directory: Path) -> None:
        if du.is_rank0():  # optimizer state is replicated on every rank under DDP
            torch.save(self.optimizer.state_dict(), directory / "optimizer.pt")
            torch.save(self.scheduler.state_dict(), directory / "scheduler.pt")

    def load(self, directory: Path, trainable: dict[str, torch.Tensor]) -> None:
        self.load_trainable_state_dict(trainable)
        self.optimizer.load_state_dict(torch.load(directory / "optimizer.pt", map_location="cpu", weights_only=True))
        self.scheduler.load_state_dict(torch.load(directory / "scheduler.pt", map_location="cpu", weights_only=True))

    def close(self) -> None:
        self.wrapped = self.optimizer = self.scheduler = None
        gc.collect()


# --------------------------------------------------------------------------- engine=zero1|zero2|zero3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_single_process_group(backend: str) -> None:
    """DeepSpeed needs a process group even for one process; create it once (destroyed by du.shutdown)."""
    if du.is_initialized():
        return
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    dist.init_process_group(backend=backend, rank=0, world_size=1)


SHM_OP = "deepspeed_shm_comm"  # DeepSpeed's CPU shared-memory collectives, JIT-built by torch's cpp_extension
SHM_STAMP = "slimwise-build.json"  # beside the built op: what it was built from (shm_op_stamp)


def _extensions_dir() -> Path:
    """Where JIT-built ops go: TORCH_EXTENSIONS_DIR, defaulting to <repo>/.cache/torch_extensions (the Makefile's)."""
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO_ROOT / ".cache" / "torch_extensions"))
    return Path(os.environ["TORCH_EXTENSIONS_DIR"])


def shm_op_stamp(builder) -> dict:
    """Everything the built shm op depends on: versions, the sources' bytes and the compiler flags. The op is loaded
    from its folder only while this matches what the folder's stamp recorded at its build."""
    import hashlib
    import platform

    import deepspeed

    digest = hashlib.sha256()
    for source in builder.sources():
        digest.update(Path(builder.deepspeed_src_path(source)).read_bytes())
    return {"deepspeed": deepspeed.__version__, "torch": torch.__version__, "python": platform.python_version(),
            "machine": platform.machine(), "sources_sha256": digest.hexdigest(),
            "cxx_args": builder.strip_empty_entries(builder.cxx_args())}


@contextlib.contextmanager
def _pinned_ninja():
    """PATH with one ninja first for the build: the venv's own (pip's ninja) when it has one, else the first on PATH.
    torch runs `ninja` from PATH, and two ninja versions (a system 1.11 and the venv's 1.13) discard each other's
    .ninja_log, so which one a launch found decided whether it rebuilt the op from scratch."""
    import shutil
    import sys

    own = Path(sys.executable).parent / "ninja"
    ninja = own if own.is_file() and os.access(own, os.X_OK) else shutil.which("ninja")
    if ninja is None:
        raise RuntimeError("DeepSpeed's CPU shared-memory op needs ninja to build once: `pip install ninja` into the "
                           "venv (make venv does), then launch again")
    previous = os.environ.get("PATH", "")
    os.environ["PATH"] = f"{Path(ninja).parent}{os.pathsep}{previous}"
    try:
        yield Path(ninja)
    finally:
        os.environ["PATH"] = previous


def prepare_shm_op() -> str:
    """Make DeepSpeed's CPU shm op available without a JIT check: load it from its build folder when the folder's
    stamp matches `shm_op_stamp`, else build it once (one line says so) with a pinned ninja and record the stamp.
    DeepSpeed's own `build_shm_op` then finds it in its op cache and builds nothing. Returns what happened:
    "loaded", "built" or "unavailable" (DeepSpeed then uses gloo's collectives)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from torch.utils.cpp_extension import _get_build_directory, _import_module_from_library

    from slimwise_train.utils.atomic import write_json_atomic

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return "unavailable"
    # the class whose `load` keeps the op cache (`__class__._loaded_ops` in DeepSpeed's OpBuilder.load)
    cache = next(c for c in type(builder).__mro__ if "load" in c.__dict__)._loaded_ops
    if builder.NAME in cache:
        return "loaded"
    folder = Path(_get_build_directory(builder.NAME, verbose=False))
    stamp = shm_op_stamp(builder)
    stamp_file = folder / SHM_STAMP
    try:
        recorded = json.loads(stamp_file.read_text())
    except (OSError, ValueError):
        recorded = None
    if recorded == stamp and (folder / f"{builder.NAME}.so").is_file():
        cache[builder.NAME] = _import_module_from_library(builder.NAME, str(folder), True)
        return "loaded"
    with _pinned_ninja() as ninja:
        if du.is_rank0():
            log.warning("DeepSpeed: building its CPU shared-memory op once with %s (30-90 s; cached in %s, loaded "
                        "from there by every later launch)", ninja, folder)
        builder.load(verbose=False)  # the other ranks wait on torch's lock in the folder, then import the result
    write_json_atomic(stamp_file, stamp)
    return "built"


def _setup_deepspeed(engine_cfg, device: torch.device):
    """Import deepspeed with its process group; the JIT-built shm op is built once and loaded (prepare_shm_op)."""
    _extensions_dir()
    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        prepare_shm_op()
    import deepspeed

    # DeepSpeed 0.19 calls the collectives torch 2.13 deprecated, warning on every call (82 lines in a 20-step zero3
    # run) and burying the progress bar and our log: they are DeepSpeed's to change, not the user's.
    warnings.filterwarnings("ignore", category=FutureWarning,
                            message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated")
    backend = engine_cfg.backend if engine_cfg.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
    _init_single_process_group(backend)
    deepspeed.init_distributed(dist_backend=backend)
    return deepspeed


def import_backend() -> None:
    """Import DeepSpeed (for callers that measure the framework's footprint before any engine exists)."""
    import deepspeed  # noqa: F401


def deepspeed_config(engine_cfg, distill_cfg, micro_batch_size: int, device: torch.device,
                     hidden_size: int | None = None) -> dict:
    """The one DeepSpeed config of a run: used to load the model partitioned and to build the engine. Unset ZeRO-3
    bucket sizes follow the model's hidden size (transformers' "auto" rule)."""
    stage = zero_stage(engine_cfg)
    precision = resolve_precision(engine_cfg, device)
    zero: dict = {"stage": stage}
    if engine_cfg.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": device.type == "cuda"}
    if stage == 3:
        hidden = int(hidden_size or 4096)
        prefetch, persistence = engine_cfg.prefetch_bucket_size, engine_cfg.param_persistence_threshold
        zero.update({
            "stage3_max_live_parameters": int(engine_cfg.max_live_parameters),
            "stage3_prefetch_bucket_size": int(prefetch if prefetch is not None else 0.9 * hidden * hidden),
            "stage3_param_persistence_threshold": int(persistence if persistence is not None else 10 * hidden),
        })
        if engine_cfg.offload_params:
            zero["offload_param"] = {"device": "cpu", "pin_memory": device.type == "cuda"}
    opt = _optimizer_kwargs(distill_cfg)
    return {
        "train_micro_batch_size_per_gpu": int(micro_batch_size),
        "gradient_accumulation_steps": int(distill_cfg.schedule.grad_accum),
        "optimizer": {"type": "AdamW", "params": {"lr": opt["lr"], "betas": list(opt["betas"]), "eps": opt["eps"],
                                                  "weight_decay": opt["weight_decay"], "torch_adam": True}},
        # DeepSpeed 0.19 defaults gradient_clipping to 1.0; always set it from our config (0 = off).
        "gradient_clipping": float(distill_cfg.optim.grad_clip),
        "zero_optimization": zero,
        "bf16": {"enabled": precision == "bf16"},
        "fp16": {"enabled": False},
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,  # keep torch AdamW with offload (no JIT cpu_adam build)
        "steps_per_print": 2**31,
        "wall_clock_breakdown": False,
    }


@contextlib.contextmanager
def _gathered(deepspeed, params):
    """Full values of the ZeRO-3 parameters among `params` on every rank (collective: same list on every rank)."""
    params = [p for p in params if is_partitioned(p)]
    if not params:
        yield
        return
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        yield


class PartitionedLoading:
    """engine=zero3: the frozen model is partitioned while it loads, so no rank ever holds it whole.

    `from_pretrained()` is the context for `from_pretrained`: it keeps transformers' `HfDeepSpeedConfig` alive, so the
    model is built under `deepspeed.zero.Init` and each tensor is loaded into its partitions; the engine is later
    built from the same config. Tiny random models are built whole outside it (their random init writes full
    tensors) and partitioned by `partition`. `gathered` / `gathered_inference` give the full parameters to code
    that reads values before the engine exists (the weight fingerprint, expert scoring).
    """

    def __init__(self, engine_cfg, distill_cfg, micro_batch_size: int, device: torch.device,
                 hidden_size: int | None = None):
        self.deepspeed = _setup_deepspeed(engine_cfg, device)
        self.config = deepspeed_config(engine_cfg, distill_cfg, micro_batch_size, device, hidden_size)

    @contextlib.contextmanager
    def from_pretrained(self):
        from transformers.integrations import HfDeepSpeedConfig

        keep_alive = HfDeepSpeedConfig(self.config)  # transformers holds only a weak reference
        try:
            yield
        finally:
            del keep_alive

    def partition(self, model: nn.Module) -> nn.Module:
        if not any(is_partitioned(p) for p in model.parameters()):
            self.deepspeed.zero.Init(module=model, config_dict_or_path=self.config)
        return model

    def gathered(self, params):
        """Full values of `params` on every rank (collective: every rank calls it with the same list)."""
        return _gathered(self.deepspeed, params)

    @contextlib.contextmanager
    def gathered_inference(self, model: nn.Module):
        """Run no-grad forwards of the partitioned `model` before the engine exists: each module gathers its own
        parameters just before its forward and releases them after (one module's weights at a time). Collective:
        every rank must run the same number of forwards."""
        contexts: dict[int, list] = {}
        handles = []

        def pre(module, args):
            own = [p for p in module.parameters(recurse=False) if is_partitioned(p)]
            if own:
                ctx = self.deepspeed.zero.GatheredParameters(own, modifier_rank=None)
                ctx.__enter__()
                contexts.setdefault(id(module), []).append(ctx)

        def post(module, args, output):
            stack = contexts.get(id(module))
            if stack:
                stack.pop().__exit__(None, None, None)

        for module in model.modules():
            if any(True for _ in module.parameters(recurse=False)):
                handles.append(module.register_forward_pre_hook(pre))
                handles.append(module.register_forward_hook(post))
        try:
            with torch.no_grad():
                yield
        finally:
            for handle in handles:
                handle.remove()
            for stack in contexts.values():
                while stack:
                    stack.pop().__exit__(None, None, None)


class DeepSpeedZeroEngine:
    supports_partial_skip = False  # DeepSpeed counts micro-steps itself; see Trainer._skip_nan_step

    def __init__(self, module, engine_cfg, distill_cfg, micro_batch_size: int, device: torch.device,
                 config: dict | None = None):
        deepspeed = _setup_deepspeed(engine_cfg, device)
        self._deepspeed = deepspeed
        self.name = engine_cfg.name
        self.stage = zero_stage(engine_cfg)
        self.world_size = du.world_size()
        self.grad_accum = int(distill_cfg.schedule.grad_accum)
        self.supports_partial_skip = self.grad_accum == 1
        self.module = module
        names = module.trainable_named_parameters()
        self.trainable_names = [n for n, _ in names]
        config = config or deepspeed_config(engine_cfg, distill_cfg, micro_batch_size, device, _hidden_size(module))
        schedule = _schedule(distill_cfg)
        if self.stage == 3 and getattr(module, "lora", None) is not None:
            # Expert LoRA (distill/lora.py) reads its factors and the fused expert tensor outside those modules' own
            # forwards: ZeRO-3 gathers each wrapper whole, as one leaf, around its forward.
            for leaf in module.lora.zero3_leaves:
                deepspeed.utils.set_z3_leaf_module(leaf, True)
        self.ds, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=module,
            model_parameters=[p for _, p in names],
            config=config,
            lr_scheduler=lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, schedule),
        )
        self._named = dict(names)

    def forward(self, phase: str, **kwargs):
        return self.ds(phase=phase, **kwargs)

    def backward(self, loss: torch.Tensor, last_micro_batch: bool) -> None:
        # Our loss is already divided by the global token count of the whole step: no division by the
        # accumulation steps; x W undoes DeepSpeed's average over ranks.
        self.ds.backward(loss * self.world_size, scale_wrt_gas=False)
        self.ds.step()  # DeepSpeed applies the update itself on its accumulation boundary (the last micro-batch)

    def step(self) -> float:
        norm = self.ds.get_global_grad_norm()
        norm = float(norm) if norm is not None else float("nan")
        return norm

    def skip_step(self) -> None:
        # Only reached with grad_accum == 1 before any backward of this step: nothing was accumulated.
        self.ds.zero_grad()

    def lr(self) -> float:
        return float(self.scheduler.get_last_lr()[0])

    @contextlib.contextmanager
    def gathered_parameters(self, params=None):
        """Full parameters on every rank (ZeRO-3 partitions them; stages 1/2 hold them whole)."""
        params = list(self.module.parameters()) if params is None else params
        with _gathered(self._deepspeed, params) if self.stage == 3 else contextlib.nullcontext():
            yield params

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        params = [self._named[n] for n in self.trainable_names]
        with self.gathered_parameters(params):
            return {n: self._named[n].detach().to("cpu", torch.float32, copy=True) for n in self.trainable_names}

    def save(self, directory: Path) -> None:
        # Collective: every rank writes its own optimizer partition under directory/deepspeed/.
        self.ds.save_checkpoint(str(directory), tag="deepspeed", save_latest=True, exclude_frozen_parameters=True)

    def load(self, directory: Path, trainable: dict[str, torch.Tensor]) -> None:
        path, _ = self.ds.load_checkpoint(str(directory), tag="deepspeed", load_module_strict=False,
                                          load_optimizer_states=True, load_lr_scheduler_states=True)
        if path is None:
            raise ValueError(f"{directory}: DeepSpeed found no checkpoint under tag 'deepspeed'")

    def close(self) -> None:
        if hasattr(self.ds, "destroy"):
            self.ds.destroy()
        self.ds = self.optimizer = self.scheduler = None
        gc.collect()

"""Typed schemas for every Hydra config group (model, prune, distill, data, engine, logger) and app.

The YAML files under conf/ are validated against these dataclasses: a misspelt key or a wrong type fails at
start-up with Hydra's error naming the key, never halfway through a run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


@dataclass
class ModelConfig:
    name: str = MISSING  # short name used in output paths
    path: Optional[str] = None  # hub id or local folder for from_pretrained
    tiny: Optional[str] = None  # instead of `path`: a tiny random model of this model_type (tests, smoke runs)
    tiny_overrides: dict = field(default_factory=dict)
    tokenizer: Optional[str] = None  # defaults to `path`; tiny models default to the shipped synthetic tokenizer
    dtype: str = "auto"  # auto: bf16 on GPU, fp32 on CPU
    revision: Optional[str] = None
    trust_remote_code: bool = False
    experts_implementation: Optional[str] = None  # transformers backend: grouped_mm, eager, batched_mm, ...
    seed: int = 0


@dataclass
class DataConfig:
    source: str = "synthetic"  # recipe name (data_recipes/<name>.yaml), hub id, or local .jsonl/.json/.parquet/.txt
    split: str = "train"
    subset: Optional[str] = None
    text_field: Optional[str] = None  # plain-text column; default: messages / prompt+answer / text
    num_samples: int = 256
    seq_len: int = 256
    batch_size: int = 8
    chat_template: bool = True  # apply the tokenizer's chat template when it has one
    seed: int = 1234
    shuffle: bool = True


@dataclass
class PruneConfig:
    criterion: str = "reap"  # frequency | mass | mass_routed | ean | reap
    ratio: float = 0.5  # share of routed experts removed per layer (0, 1)
    scope: str = "layer"  # layer: same count per layer | global: one ranking, >= top_k per layer
    keep_set: Optional[str] = None  # trainer/eval: an existing keep_set.json instead of scoring
    scores: Optional[str] = None  # reuse an existing scores.safetensors instead of calibrating
    cache_dir: str = ".cache/slimwise/scores"  # statistics cache keyed by model + calibration data
    use_cache: bool = True
    export_checkpoint: bool = False  # write the physically pruned HF checkpoint (decode instance)
    export_mask: bool = True  # write router_mask.safetensors (co-located serving)


@dataclass
class DistillConfig:
    ce_weight: float = 0.1
    kl_weight: float = 0.9
    top_k: int = 64
    kl_loss: str = "topk_residual_kl"
    chunk_size: int = 1024
    shared_expert_intermediate_size: Optional[int] = None  # default: the routed expert size
    train_routers: bool = True
    train_norms: bool = True
    train_shared_expert: bool = True
    min_split: int = 1  # split point s ~ U[min_split, len - min_continuation]
    min_continuation: int = 1
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 10
    max_steps: int = 100
    grad_clip: float = 1.0
    grad_accum: int = 1
    max_nan_steps: int = 3
    eval_every: int = 50
    eval_batches: int = 4
    log_every: int = 10
    save_every: int = 50
    keep_checkpoints: int = 2


@dataclass
class EngineConfig:
    name: str = "torch"  # torch (single process / DDP) | zero1 | zero2 | zero3 (DeepSpeed)
    zero_stage: int = 0
    offload_optimizer: bool = False
    precision: str = "auto"  # auto: bf16 on GPU, fp32 on CPU
    backend: str = "auto"  # process-group backend: auto -> nccl on GPU, gloo on CPU


@dataclass
class LoggerConfig:
    name: str = "none"  # none | wandb
    project: str = "slimwise"
    entity: Optional[str] = None
    mode: str = "auto"  # auto: online with WANDB_API_KEY, else offline
    tags: list = field(default_factory=list)


@dataclass
class PruneAppConfig:
    model: ModelConfig = MISSING
    data: DataConfig = field(default_factory=DataConfig)
    prune: PruneConfig = field(default_factory=PruneConfig)
    output_dir: str = MISSING
    device: str = "auto"
    progress: bool = True


@dataclass
class TrainAppConfig:
    model: ModelConfig = MISSING
    data: DataConfig = field(default_factory=DataConfig)
    prune: PruneConfig = field(default_factory=PruneConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    output_dir: str = MISSING
    resume: str = "auto"  # auto: newest complete checkpoint in output_dir | never | <path>
    seed: int = 0
    device: str = "auto"
    extra: dict = field(default_factory=dict)


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="prune_app_schema", node=PruneAppConfig)
    cs.store(name="train_app_schema", node=TrainAppConfig)
    cs.store(group="model", name="model_schema", node=ModelConfig)
    cs.store(group="data", name="data_schema", node=DataConfig)
    cs.store(group="prune", name="prune_schema", node=PruneConfig)
    cs.store(group="distill", name="distill_schema", node=DistillConfig)
    cs.store(group="engine", name="engine_schema", node=EngineConfig)
    cs.store(group="logger", name="logger_schema", node=LoggerConfig)


def to_container(cfg: Any) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(cfg, resolve=True)

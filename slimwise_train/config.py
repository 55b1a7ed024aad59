"""Typed schemas for every Hydra config group (model, prune, distill, data, engine, logger, eval) and app.

The YAML files under conf/ are validated against these dataclasses: a misspelt key or a wrong type fails at
start-up with Hydra's error naming the key, never halfway through a run.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Dict, List, Literal, Optional, get_args, get_origin, get_type_hints

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

# The Hydra config tree (conf/ at the repository root) shared by every app.
CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")

# Closed sets of choices, the one list of each (the modules that act on them read them from here). A field is
# annotated `Annotated[str, <Literal>]`: OmegaConf 2.3 rejects Literal annotations, so it sees `str`, and
# check_known_keys refuses a value outside the Literal in one line.
# Where the student's shared capacity goes (distill/student.py): native = extra columns of the family's own shared
# slot | new = a new expert beside the routed ones (exports with remote code) | none = no shared expert (with the
# auto preset: LoRA on the kept experts instead) | auto = native where the family has a slot, else none.
SharedExpertMode = Literal["auto", "native", "new", "none"]
# distill.trainable presets (conf/distill/trainable/<name>.yaml; distill/lora.py maps each to its LoRA kind).
TrainablePreset = Literal["auto", "always_on", "always_on+lora_experts", "always_on+lora_attention"]
# A preset's LoRA: null | experts (fused expert tensors) | attention (q/k/v/o) | auto (experts where the student has
# no shared expert, else null; resolved per family by DistillModel).
LoraKind = Literal[None, "auto", "experts", "attention"]
NormScope = Literal["all", "layer"]
Recompute = Literal["none", "moe", "layer"]
# Who prefills the prefix whose KV cache the student continues on in training (distill/trainer.py, issue 23):
# teacher = the full model (the SlimWise setting: full prefill, pruned decode) | student = the student itself, with
# gradients through its prefill (the conventional + distill setting: the pruned student serves both phases).
PrefixFrom = Literal["teacher", "student"]
# prune.scope: layer = the same count per layer | global = one ranking over all layers, >= top_k kept per layer.
PruneScope = Literal["layer", "global"]
# prune.calibration.mode: whole = the model loaded whole, one forward per batch | layerwise = one decoder layer at a time
# read from model.path's safetensors files, every batch through it, then the next (prune/layerwise.py).
CalibrationMode = Literal["whole", "layerwise"]
# prune.calibration.hidden_states (layerwise): where the batches' hidden states wait between layers.
HiddenStatesPlace = Literal["cpu", "device"]
# engine.name: torch (single process / DDP) | zero1 | zero2 | zero3 (DeepSpeed); the ZeRO stage is its position.
EngineName = Literal["torch", "zero1", "zero2", "zero3"]
# The one mapping engine name -> ZeRO stage (distill/engine.py and plan/memory.py read it; `zero_stage` below).
ZERO_STAGE: Dict[str, int] = {name: stage for stage, name in enumerate(get_args(EngineName))}
Precision = Literal["auto", "fp32", "bf16"]  # engine.precision: auto = bf16 on GPU, fp32 on CPU
Backend = Literal["auto", "nccl", "gloo"]  # engine.backend (process group): auto = nccl on GPU, gloo on CPU
LoggerName = Literal["none", "wandb"]  # logger.name: none = metrics.jsonl only | wandb = metrics.jsonl + W&B
WandbMode = Literal["auto", "online", "offline", "disabled"]  # logger.mode (auto: `wandb_mode` below)
# model.dtype: auto (bf16 on GPU, fp32 on CPU) or a torch dtype by name (models.py maps each name to its dtype).
ModelDtype = Literal["auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16"]
PlanDevice = Literal["cuda", "cpu"]  # plan.device: cuda = bf16 on GPUs | cpu = fp32 (the bench's setting)
# eval.modes items, in their report order (eval/modes.py MODES is this list): full | conventional (pruned prefill and
# decode) | slimwise (full prefill, pruned decode) | reverse (pruned prefill, full decode) | conventional_distill (the
# distilled student prefills and decodes) | slimwise_distill (full prefill, distilled student decode).
# data.supervise: which tokens are loss targets (data/loading.py SUPERVISE). auto = the assistant turns when the chat
# template renders the rows, every token with the plain rendering | assistant = the assistant turns (plain: the answer
# and EOS) | all = every token.
Supervise = Literal["auto", "assistant", "all"]
# data.bad_rows: a row that cannot be rendered as given (unknown role, content not text, a tool call of an unlisted
# tool, a row the template refuses): error = a one-line error naming it | skip = skipped and counted in the log.
BadRows = Literal["error", "skip"]
EvalMode = Literal["full", "conventional", "slimwise", "reverse", "conventional_distill", "slimwise_distill"]


def zero_stage(engine_cfg) -> int:
    """The ZeRO stage of `engine.name` (0 for torch): derived from the name, never configured."""
    return ZERO_STAGE[str(engine_cfg.name if not isinstance(engine_cfg, str) else engine_cfg)]


@dataclass
class ModelConfig:
    # Short name used in output paths. Tiny presets derive it (`${model_name:...}`): from model.path when one is
    # given, so `model.path=<folder>` alone names the run after the checkpoint.
    name: str = MISSING
    path: Optional[str] = None  # hub id or local folder for from_pretrained
    # Instead of `path`: a tiny random model of this model_type (tests, smoke runs). Tiny presets write it as
    # `${tiny_unless_path:<type>,${.path}}`, so a model.path override replaces the random model; a preset that
    # sets both literally is an error.
    tiny: Optional[str] = None
    tiny_overrides: dict = field(default_factory=dict)  # config.json fields a tiny preset overrides
    tokenizer: Optional[str] = None  # defaults to `path`; tiny models default to the shipped synthetic tokenizer
    dtype: Annotated[str, ModelDtype] = "auto"  # auto: bf16 on GPU, fp32 on CPU
    revision: Optional[str] = None  # hub revision (branch, tag or commit) of model.path
    trust_remote_code: bool = False  # allow the checkpoint's own modelling code (hub models that need it)
    experts_implementation: Optional[str] = None  # transformers backend: grouped_mm, eager, batched_mm, ...
    # prune / eval only: `auto` spreads one model over the node's GPUs (accelerate), for a model bigger than a GPU.
    device_map: Optional[str] = None
    seed: int = 0  # seed of a tiny preset's random weights
    # The model's config.json shipped in the package (slimwise_train/assets/configs/<preset>.json): what
    # `python -m slimwise_train.plan` builds on the meta device, offline. Real presets set it; null elsewhere.
    architecture: Optional[str] = None


@dataclass
class DataConfig:
    source: str = "synthetic"  # recipe name (data_recipes/<name>.yaml), hub id, or local .jsonl/.json/.parquet/.txt
    split: str = "train"  # the dataset split read for training (hub or named splits)
    subset: Optional[str] = None  # the dataset's configuration name (hub datasets with several)
    text_field: Optional[str] = None  # plain-text column; default: messages / prompt+answer / text
    num_samples: int = 256  # rows read (before the held-out cut)
    seq_len: int = 256  # tokens per sequence; longer rows are truncated (counted in the log)
    batch_size: int = 8  # sequences per micro-batch (per rank)
    # render rows with the tokenizer's chat template when it has one: conversations whole (system, tools, every turn),
    # prompt+answer rows as a user turn and an assistant turn; false (or no template): plain text (docs/data.md)
    chat_template: bool = True
    # which tokens are loss targets after the split point: auto = the assistant turns with a chat template, every token
    # with the plain rendering | assistant = the assistant turns (plain: the answer and EOS) | all = every token
    supervise: Annotated[str, Supervise] = "auto"
    # a row that cannot be rendered as given (unknown role, content not text, a call of a tool its tools do not list,
    # a row the template refuses): error = a one-line error naming the row | skip = skipped, counted in the log
    bad_rows: Annotated[str, BadRows] = "error"
    seed: int = 1234  # seed of the row shuffle and of the synthetic suite's stream
    shuffle: bool = True  # shuffle the rows before the held-out cut


@dataclass
class CalibrationConfig:
    """prune.calibration: how the prune app runs the calibration batches (docs/scale.md, 'Pruning models that do not
    fit'). The statistics, their cache and the scores are the same in both modes."""

    # whole: the model loaded whole (model.device_map too) | layerwise: one decoder layer at a time from model.path's
    # safetensors files (a local folder), every batch through it, then the next; the export streams from the files
    mode: Annotated[str, CalibrationMode] = "whole"
    # layerwise: where the batches' hidden states wait between layers, in the model's dtype (cpu: host memory, the
    # layer alone on the GPU | device: beside the layer, no transfers)
    hidden_states: Annotated[str, HiddenStatesPlace] = "cpu"
    # layerwise: write a resume point (the statistics so far and the hidden states) after every this many layers; a
    # rerun after a crash continues from the last one; 0: never
    resume_every: int = 1


@dataclass
class PruneConfig:
    # a name in prune/criteria.py's CRITERIA (frequency | mass | mass_routed | ean | reap), checked before anything
    # loads; the registry is the one list, so a new criterion is one function there
    criterion: str = "reap"
    ratio: float = 0.5  # share of routed experts removed per layer (0, 1)
    scope: Annotated[str, PruneScope] = "layer"  # layer: same count per layer | global: one ranking, >= top_k per layer
    keep_set: Optional[str] = None  # trainer/eval: an existing keep_set.json instead of scoring
    scores: Optional[str] = None  # reuse an existing scores.safetensors instead of calibrating
    cache_dir: str = ".cache/slimwise/scores"  # statistics cache keyed by model + calibration data
    use_cache: bool = True  # reuse cached statistics for the same weights and calibration data
    # Scoring refuses a calibration set with fewer real (non-padding) tokens: a keep set from a handful of tokens
    # is noise. 1024 is a floor for smoke runs; real checkpoints calibrate on ~1M (presets: 1024 x 2048).
    min_calibration_tokens: int = 1024
    export_checkpoint: bool = False  # write the physically pruned HF checkpoint (decode instance)
    export_mask: bool = True  # write router_mask.safetensors (co-located serving)
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)


@dataclass
class TrainableConfig:
    """distill.trainable: a preset of conf/distill/trainable/ (distill/trainable=<name>) naming what trains beside
    the always-on tensors (routers, norms, shared expert: the flags of distill.student). See distill/lora.py."""

    # The defaults are the `auto` preset (conf/distill/trainable/auto.yaml sets nothing else): LoRA on the kept
    # experts where the student has no shared expert (the families without a slot), else the always-on tensors only.
    name: Annotated[str, TrainablePreset] = "auto"
    lora: Annotated[Optional[str], LoraKind] = "auto"  # set by the preset
    rank: int = 8  # LoRA rank
    alpha: float = 16.0  # LoRA scale alpha / rank
    # experts / auto: fused expert tensor names (gate_up_proj, down_proj); attention: Linear names under self_attn
    targets: List[str] = field(default_factory=lambda: ["gate_up_proj", "down_proj"])


@dataclass
class LossConfig:
    """distill.loss: sum over `terms` of weight x term, per continuation token (distill/objective.py). The terms are
    named in distill/losses.py (TERMS): ce (CE on the data tokens), kl (KL(teacher || student) over the teacher's
    top_k tokens + one residual bucket), full_kl (the dense KL); weight 0 = off. Add one: +distill.loss.terms.<name>=w"""

    # {name: weight}: terms of distill/losses.py TERMS (ce | kl | full_kl | a registered one); 0 = off; add one with
    # +distill.loss.terms.<name>=<weight>
    terms: Dict[str, float] = field(default_factory=lambda: {"ce": 0.1, "kl": 0.9})
    top_k: int = 64  # teacher tokens kept per position for the kl term (the rest in one residual bucket)
    chunk_size: int = 1024  # loss rows per chunk (bounded memory at a 152k vocabulary)


@dataclass
class StudentConfig:
    """distill.student: what trains beside the trainable preset's LoRA (all three kinds by default): router deltas,
    RMSNorm deltas and the shared capacity per MoE layer (distill/student.py)."""

    shared_expert_intermediate_size: Optional[int] = None  # default: the routed expert size
    # where the shared expert goes (SharedExpertMode above): auto = native where the family has a slot (Qwen2-MoE,
    # Qwen3-Next, Qwen3.5-MoE, DeepSeek-V3, Gemma 4), else none. Every mode but `new` exports the stock class.
    shared_expert_mode: Annotated[str, SharedExpertMode] = "auto"
    train_routers: bool = True  # train a delta on every router (W + dW)
    train_norms: bool = True  # train a delta on every RMSNorm weight (w + dw)
    # all: every RMSNorm with a weight (incl. q/k norms) | layer: decoder-layer norms + final
    norm_scope: Annotated[str, NormScope] = "all"
    train_shared_expert: bool = True  # false: no shared expert, whatever shared_expert_mode says (= mode none)


@dataclass
class SplitConfig:
    """distill.split: where each sequence is cut into the prefix (prefilled, its KV cache handed off) and the
    continuation the student predicts (distill/batches.py), and who prefills the prefix."""

    # prefix_from=student runs one student forward over prefix + continuation, so it costs the student's activations
    # on the prefix too (distill.memory.recompute cuts them; the memory planner counts the continuation only).
    # Everything else is equal: the same split points, loss positions (the continuation only) and teacher targets (the
    # full model over the whole sequence, computed exactly as with teacher).

    # who prefills the prefix the student continues on (PrefixFrom above). teacher: the full model's KV cache (the
    # SlimWise design). student (an ablation): the student prefills seq[:s] itself, WITH gradients through its own
    # K/V, so it is trained end to end as a pruned model that prefills and decodes (eval mode conventional_distill);
    # it costs the student's activations on the prefix too. A run cannot resume with the other value.
    prefix_from: Annotated[str, PrefixFrom] = "teacher"
    # split point s ~ U[max(min_split, prompt_len if split_after_prompt else 0), len - min_continuation], over the whole
    # sequence (a conversation: all its turns); the loss covers the supervised tokens after it (data.supervise)
    min_split: int = 1
    min_continuation: int = 2  # fewest continuation tokens after the split point
    # the split point at or after the prompt: the first assistant (supervised) token of the row (docs/data.md)
    split_after_prompt: bool = False
    bucket_windows: int = 8  # length bucketing: sort windows of this many global batches by length


@dataclass
class MemoryConfig:
    """distill.memory: trading compute for memory in a training step."""

    # activation recompute in the student phase: none | moe (routed experts) | layer (decoder layers)
    recompute: Annotated[str, Recompute] = "none"
    # teacher prefix + continuation in ONE forward, the cache cropped back to the prefix for the student (one
    # weight gather fewer per micro-batch under ZeRO-3). null: on when every KV-cache layer is full attention.
    teacher_single_pass: Optional[bool] = None


@dataclass
class OptimConfig:
    """distill.optim: the AdamW optimizer and gradient clipping (distill/engine.py; the same for every engine)."""

    lr: float = 1e-3  # peak AdamW learning rate (after distill.schedule.warmup_steps)
    weight_decay: float = 0.0  # AdamW weight decay
    adam_beta1: float = 0.9  # AdamW beta1
    adam_beta2: float = 0.999  # AdamW beta2
    adam_eps: float = 1e-8  # AdamW epsilon
    grad_clip: float = 1.0  # explicit for every engine; 0 disables clipping


@dataclass
class ScheduleConfig:
    """distill.schedule: the run's length, the learning-rate schedule (linear warm-up, then cosine) and the step's
    accumulation."""

    max_steps: int = 100  # optimizer steps of the run
    warmup_steps: int = 10  # linear warm-up steps to distill.optim.lr
    min_lr_ratio: float = 0.1  # cosine decays to min_lr_ratio x lr at max_steps
    grad_accum: int = 1  # micro-batches per optimizer step (per rank)
    max_nan_steps: int = 3  # a non-finite loss skips the step; this many in a row aborts the run


@dataclass
class DistillEvalConfig:
    """distill.eval: the held-out loss during training (the generation evals are `python -m slimwise_train.eval`)."""

    every: int = 50  # optimizer steps between held-out evaluations
    batches: int = 4  # per rank
    split: str = "eval"  # split of data.source for the held-out loss; = data.split: held out of the training read
    samples: int = 64  # held-out sequences for the eval loss


@dataclass
class CheckpointConfig:
    """distill.checkpoint: the resumable checkpoints under <output_dir>/checkpoints/ (resume=auto picks the newest)."""

    every: int = 50  # optimizer steps between checkpoints
    keep: int = 2  # newest complete checkpoints kept


@dataclass
class DistillConfig:
    """Distillation of the pruned decoder on the teacher's prefix KV cache, in groups: loss (the objective), student
    and trainable (what trains), split (prefix / continuation), memory, optim, schedule, eval, checkpoint."""

    loss: LossConfig = field(default_factory=LossConfig)  # the objective: named, weighted terms (LossConfig)
    student: StudentConfig = field(default_factory=StudentConfig)  # what trains: routers, norms, shared expert
    trainable: TrainableConfig = field(default_factory=TrainableConfig)  # LoRA presets (conf/distill/trainable/)
    split: SplitConfig = field(default_factory=SplitConfig)  # split points and who prefills the prefix
    memory: MemoryConfig = field(default_factory=MemoryConfig)  # activation recompute, the teacher's single pass
    optim: OptimConfig = field(default_factory=OptimConfig)  # AdamW and gradient clipping
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)  # steps, warm-up, cosine, accumulation
    eval: DistillEvalConfig = field(default_factory=DistillEvalConfig)  # the held-out loss during training
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)  # resumable checkpoints
    log_every: int = 10  # optimizer steps between metrics rows and console lines
    export: bool = True  # write export/ (HF checkpoint) and student_trainable.safetensors at the end
    check_frozen: bool = True  # hash every frozen tensor at start and end (and on resume); costs one pass over them
    # prune.keep_set scored on other weights than this run's model (its meta.model names another checkpoint, seed or
    # revision) is an error; true trains with it anyway (a warning says so), e.g. a keep set of the base checkpoint
    # reused on its fine-tune.
    allow_foreign_keep_set: bool = False


# The flat distill keys before the groups (issue 25): an old key on the command line or in a YAML is refused in one
# line naming its new place (utils/cli.py, check_known_keys).
MOVED_KEYS: Dict[str, str] = {
    **{f"distill.{name}": f"distill.student.{name}" for name in (
        "shared_expert_intermediate_size", "shared_expert_mode", "train_routers", "train_norms", "norm_scope",
        "train_shared_expert")},
    **{f"distill.{name}": f"distill.split.{name}" for name in (
        "prefix_from", "min_split", "min_continuation", "split_after_prompt", "bucket_windows")},
    **{f"distill.{name}": f"distill.memory.{name}" for name in ("recompute", "teacher_single_pass")},
    **{f"distill.{name}": f"distill.optim.{name}" for name in (
        "lr", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "grad_clip")},
    **{f"distill.{name}": f"distill.schedule.{name}" for name in (
        "max_steps", "warmup_steps", "min_lr_ratio", "grad_accum", "max_nan_steps")},
    **{f"distill.eval_{name}": f"distill.eval.{name}" for name in ("every", "batches", "split", "samples")},
    "distill.save_every": "distill.checkpoint.every",
    "distill.keep_checkpoints": "distill.checkpoint.keep",
}


def moved_key_message(key: str) -> Optional[str]:
    """`<old> moved to <new>` for a flat distill key of before the groups (a leading +/++/~ ignored), else None."""
    key = key.lstrip("+~")
    return f"{key} moved to {MOVED_KEYS[key]}" if key in MOVED_KEYS else None


@dataclass
class EngineConfig:
    # torch (single process / DDP) | zero1 | zero2 | zero3 (DeepSpeed); the ZeRO stage follows: zero_stage(engine)
    name: Annotated[str, EngineName] = "torch"
    offload_optimizer: bool = False  # zero2 / zero3: optimizer state and step on CPU
    precision: Annotated[str, Precision] = "auto"  # auto: bf16 on GPU, fp32 on CPU
    backend: Annotated[str, Backend] = "auto"  # process-group backend: auto -> nccl on GPU, gloo on CPU
    # zero3 only. partitioned_load: the frozen model is partitioned while it loads (no rank holds it whole).
    partitioned_load: bool = True
    max_live_parameters: int = 1_000_000_000  # DeepSpeed stage3_max_live_parameters
    # stage3_prefetch_bucket_size (elements); null: 0.9 x hidden^2, as transformers' "auto". DeepSpeed's own 5e7
    # gathered the whole 240M bench model at once in the student forward (+1.3 GB per rank, measured).
    prefetch_bucket_size: Optional[int] = None
    # stage3_param_persistence_threshold: tensors below it stay whole on every rank; null: 10 x hidden
    param_persistence_threshold: Optional[int] = None
    offload_params: bool = False  # offload_param to CPU (frozen weights live in host memory between uses)


@dataclass
class LoggerConfig:
    name: Annotated[str, LoggerName] = "none"  # none (metrics.jsonl only) | wandb (metrics.jsonl + W&B)
    project: str = "slimwise"  # W&B project
    entity: Optional[str] = None  # W&B entity (team or user); null: the API key's default
    run_name: Optional[str] = None  # W&B run name; null: <criterion>-r<ratio>
    group: Optional[str] = None  # W&B group; logger=wandb: ${sweep_group:} (the multirun's sweep, none in a single run)
    mode: Annotated[str, WandbMode] = "auto"  # auto: online with WANDB_API_KEY, else offline | online | offline | disabled
    tags: list = field(default_factory=list)  # W&B tags


def wandb_mode(logger_cfg) -> str:
    """The W&B mode of `logger.mode` (the trainer's and the eval app's runs): auto is WANDB_MODE when set, else online
    with a WANDB_API_KEY and offline without one (so a run works without network)."""
    if logger_cfg.mode != "auto":
        return logger_cfg.mode
    return os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")


@dataclass
class PruneAppConfig:
    model: ModelConfig = MISSING
    data: DataConfig = field(default_factory=DataConfig)
    prune: PruneConfig = field(default_factory=PruneConfig)
    output_dir: str = MISSING
    device: str = "auto"
    progress: bool = True
    extra: dict = field(default_factory=dict)  # test faults of the layerwise calibration (testing/faults.py): kill_after_layer


@dataclass
class TrainAppConfig:
    model: ModelConfig = MISSING
    data: DataConfig = field(default_factory=DataConfig)  # training sequences
    calibration: DataConfig = field(default_factory=DataConfig)  # expert scoring when prune.keep_set is null
    prune: PruneConfig = field(default_factory=PruneConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    output_dir: str = MISSING
    resume: str = "auto"  # auto: newest complete checkpoint in output_dir | never | <checkpoint folder>
    seed: int = 0  # seed of data order, split points and initialisation
    device: str = "auto"
    cpu_threads: Optional[int] = None  # torch intra-op threads when running on CPU; None: torch's default
    progress: bool = True  # a step progress bar on rank 0 (stderr)
    extra: dict = field(default_factory=dict)  # test faults (testing/faults.py): kill_after_step, nan_at_steps, ...


@dataclass
class EvalConfig:
    keep_sets: List[str] = field(default_factory=list)  # keep_set.json paths; empty: only the full model runs
    # full | conventional (pruned prefill+decode) | slimwise (full prefill, pruned decode) | reverse (pruned prefill,
    # full decode) | conventional_distill (the distilled student prefills and decodes: prune + distill) |
    # slimwise_distill (full prefill, distilled student decode); the two *_distill modes need `student`
    modes: Annotated[List[str], EvalMode] = field(default_factory=lambda: list(get_args(EvalMode)))
    student: Optional[str] = None  # exported student checkpoint folder (from_pretrained) for the *_distill modes
    families: List[str] = field(default_factory=lambda: ["math", "code", "tool"])  # suite families evaluated
    num_per_family: int = 200  # held-out problems per family
    seed: Optional[int] = None  # held-out stream seed; null: the recipe's eval seed (the split training excludes)
    recipe: Optional[str] = None  # synthetic recipe YAML (family params); null: data_recipes/synthetic.yaml
    # max new tokens: an int, {family: int} (e.g. the lm-eval tasks' max_gen_toks), or null: budget_factor x the
    # longest reference answer, per family
    budget: Optional[Any] = None
    budget_factor: float = 2.0  # budget = budget_factor x the longest reference answer, per family (eval.budget=null)
    batch_size: int = 32  # problems generated together (left-padded batch)
    save_generations: bool = False  # also write generations.jsonl (every output text, per mode and keep set)
    # a keep set scored on other weights than model (its meta records another model) is refused unless this is true:
    # then it is evaluated with a warning that the model changed (the trainer's distill.allow_foreign_keep_set)
    allow_foreign_keep_set: bool = False


@dataclass
class EvalAppConfig:
    model: ModelConfig = MISSING
    eval: EvalConfig = field(default_factory=EvalConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    output_dir: str = MISSING
    device: str = "auto"
    progress: bool = True


@dataclass
class PlanAppConfig:
    """`python -m slimwise_train.plan`: per-GPU memory of a distillation run, planned from the architecture alone."""

    model: ModelConfig = MISSING
    data: DataConfig = field(default_factory=DataConfig)  # seq_len and batch_size (the micro batch per rank)
    prune: PruneConfig = field(default_factory=PruneConfig)  # ratio: the keep set (uniform) of the student
    distill: DistillConfig = field(default_factory=DistillConfig)  # memory.recompute, loss, split.min_split, student
    engine: EngineConfig = field(default_factory=EngineConfig)
    world_size: int = 8  # ranks (GPUs) the run is spread over
    gpu_memory_gib: float = 80.0  # memory per GPU the plan must fit in
    # The prune plan (plan/prune.py): the host's memory, and the prune app's sequences per calibration batch (the
    # presets' data.batch_size; data.num_samples and data.seq_len give the rest of the calibration set)
    host_memory_gib: float = 256.0
    calibration_batch_size: int = 4
    device: Annotated[str, PlanDevice] = "cuda"  # cuda: bf16 on GPUs | cpu: fp32, to compare with `python -m slimwise_train.bench memory`
    # The micro-batch's prefix and continuation widths; null: the split rule's worst case (a min_split-token prefix,
    # data.seq_len - min_split continuation tokens).
    prefix_tokens: Optional[int] = None
    continuation_tokens: Optional[int] = None  # null: the split rule's worst case
    # The framework's baseline per rank in MiB; null: the calibrated default (CPU: the bench's B; GPU: an estimate).
    baseline_mib: Optional[float] = None
    json_only: bool = False  # print only the JSON line


@dataclass
class DataShowAppConfig:
    """`python -m slimwise_train.data show`: the data as a run sees it, before any model weights load."""

    model: ModelConfig = MISSING  # only its tokenizer is read (model.tokenizer, else model.path) and its context length
    data: DataConfig = field(default_factory=DataConfig)  # the rows shown: source, seq_len, chat_template, supervise, ...
    n: int = 3  # sequences printed in full, supervised tokens marked (all of them are counted)


def model_name_from(path: Optional[str], fallback: str) -> str:
    """`${model_name:${.path},<fallback>}`: the checkpoint's folder or hub name when a path is given."""
    if path in (None, "", "None", "null"):
        return fallback
    name = Path(str(path).rstrip("/")).name
    return name or fallback


def tiny_unless_path(model_type: str, path: Optional[str]) -> Optional[str]:
    """`${tiny_unless_path:<model_type>,${.path}}`: a tiny preset's random model, unless model.path is set."""
    return None if path not in (None, "", "None", "null") else model_type


def sweep_group() -> Optional[str]:
    """`${sweep_group:}`: in a Hydra multirun (local or submitit/SLURM jobs alike), the sweep folder's last two parts
    (`train/tiny_qwen3_moe` for outputs/train/tiny_qwen3_moe), the same for every job; None in a single run or a
    config composed outside an app."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return None
    path = Path(str(HydraConfig.get().sweep.dir))
    return "/".join(part for part in path.parts[-2:] if part != path.anchor) or None


def register_resolvers() -> None:
    from omegaconf import OmegaConf

    for name, fn in (("model_name", model_name_from), ("tiny_unless_path", tiny_unless_path),
                     ("sweep_group", sweep_group)):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)


def register_configs() -> None:
    register_resolvers()
    cs = ConfigStore.instance()
    cs.store(name="prune_app_schema", node=PruneAppConfig)
    cs.store(name="train_app_schema", node=TrainAppConfig)
    cs.store(name="eval_app_schema", node=EvalAppConfig)
    cs.store(name="plan_app_schema", node=PlanAppConfig)
    cs.store(name="data_show_app_schema", node=DataShowAppConfig)
    cs.store(group="model", name="model_schema", node=ModelConfig)
    cs.store(group="data", name="data_schema", node=DataConfig)
    cs.store(group="prune", name="prune_schema", node=PruneConfig)
    cs.store(group="distill", name="distill_schema", node=DistillConfig)
    cs.store(group="engine", name="engine_schema", node=EngineConfig)
    cs.store(group="logger", name="logger_schema", node=LoggerConfig)


def to_container(cfg: Any) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(cfg, resolve=True)


def field_choices(schema: type) -> dict[str, tuple]:
    """{field name: allowed values} for the fields of `schema` annotated `Annotated[..., Literal[...]]`."""
    found = {}
    for name, hint in get_type_hints(schema, include_extras=True).items():
        if get_origin(hint) is Annotated:
            for meta in hint.__metadata__:
                if get_origin(meta) is Literal:
                    found[name] = get_args(meta)
    return found


def check_known_keys(cfg: Any, schema: type, where: str = "") -> None:
    """Raise ValueError for a key the typed schema does not know, or a value outside a field's Literal choices,
    anywhere in `cfg`.

    Hydra lets `+group.key=value` add keys to a structured config (the fix it suggests for a typo), which would
    otherwise be ignored silently; free-form `dict` fields (tiny_overrides, extra) are not checked.
    """
    from omegaconf import DictConfig, ListConfig

    fields = {f.name: f for f in dataclasses.fields(schema)}
    allowed = field_choices(schema)
    for key in cfg.keys() if isinstance(cfg, DictConfig) else ():
        path = f"{where}.{key}" if where else str(key)
        if key not in fields:
            moved = moved_key_message(path)  # a flat distill key of before the groups
            if moved:
                raise ValueError(moved)
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f"did you mean {where + '.' if where else ''}{close[0]}? " if close else ""
            raise ValueError(f"unknown config key {path!r}: {hint}known keys here: {', '.join(fields)}")
        if key in allowed:
            # a list field (eval.modes) is annotated with the Literal of its items
            is_list = isinstance(cfg[key], ListConfig)
            bad = [value for value in (list(cfg[key]) if is_list else [cfg[key]]) if value not in allowed[key]]
            if bad:
                names = ", ".join("null" if c is None else str(c) for c in allowed[key])
                shown = f"{path}={list(cfg[key])!r}: {bad[0]!r}" if is_list else f"{path}={bad[0]!r}"
                raise ValueError(f"{shown} is not one of: {names}")
        sub_type = fields[key].type
        sub_schema = globals().get(sub_type) if isinstance(sub_type, str) else sub_type
        value = cfg._get_node(key)
        if dataclasses.is_dataclass(sub_schema) and isinstance(value, DictConfig):
            check_known_keys(value, sub_schema, path)


# --------------------------------------------------------------------------- value checks (no model, no data needed)


def _number(value) -> float | None:
    """`value` as a float, or None when it is not a finite number (nan, inf, a string)."""
    import math

    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _integer(value) -> int | None:
    """`value` when it is an int (not a bool), else None."""
    return None if isinstance(value, bool) or not isinstance(value, int) else value


# DistillConfig's numbers that no run can use otherwise (paths under distill): integers >= 1, and
# (path, lowest, lowest allowed too, rule, a valid example).
_DISTILL_AT_LEAST_ONE = ("schedule.max_steps", "schedule.grad_accum", "log_every", "checkpoint.every", "eval.every",
                         "eval.batches", "eval.samples", "schedule.max_nan_steps", "checkpoint.keep",
                         "split.bucket_windows")
_DISTILL_RANGES = (
    ("optim.lr", 0.0, False, "a finite number > 0", "1e-4"),
    ("optim.adam_eps", 0.0, False, "a finite number > 0", "1e-8"),
    ("optim.weight_decay", 0.0, True, "a finite number >= 0", "0.0"),
    ("optim.grad_clip", 0.0, True, "a finite number >= 0 (0 disables clipping)", "1.0"),
)


def _at(node, path: str):
    """`node.<path>` (dotted) of a DictConfig, dict or dataclass, None where a part is missing."""
    for part in path.split("."):
        if node is None:
            return None
        node = node.get(part) if hasattr(node, "get") else getattr(node, part, None)
    return node


def check_distill_config(d, key: str = "distill") -> None:
    """Refuse a distill.* value no run can use (a learning rate <= 0, zero steps, ...) in one line naming the key and a
    valid value. Needs neither the model nor the data: the trainer calls it first. distill.loss is checked against the
    term registry by distill/objective.check_loss_config."""
    defaults = DistillConfig()
    for name in _DISTILL_AT_LEAST_ONE:
        value = _integer(_at(d, name))
        if value is None or value < 1:
            raise ValueError(f"{key}.{name}={_at(d, name)} is invalid: it must be an integer >= 1; "
                             f"e.g. {key}.{name}={_at(defaults, name)}")
    warmup = _integer(_at(d, "schedule.warmup_steps"))
    if warmup is None or warmup < 0:
        raise ValueError(f"{key}.schedule.warmup_steps={_at(d, 'schedule.warmup_steps')} is invalid: it must be an "
                         f"integer >= 0; {key}.schedule.warmup_steps=0 for no warm-up")
    for name, low, inclusive, rule, example in _DISTILL_RANGES:
        number = _number(_at(d, name))
        if number is None or number < low or (number == low and not inclusive):
            raise ValueError(f"{key}.{name}={_at(d, name)} is invalid: it must be {rule}; e.g. {key}.{name}={example}")
    ratio = _number(_at(d, "schedule.min_lr_ratio"))
    if ratio is None or not 0 <= ratio <= 1:
        raise ValueError(f"{key}.schedule.min_lr_ratio={_at(d, 'schedule.min_lr_ratio')} is invalid: the cosine ends "
                         f"at min_lr_ratio x lr, a share in [0, 1]; e.g. {key}.schedule.min_lr_ratio=0.1")
    for name, example in (("optim.adam_beta1", 0.9), ("optim.adam_beta2", 0.999)):
        beta = _number(_at(d, name))
        if beta is None or not 0 <= beta < 1:
            raise ValueError(f"{key}.{name}={_at(d, name)} is invalid: an Adam beta is in [0, 1); "
                             f"e.g. {key}.{name}={example}")
    prefix_from = _at(d, "split.prefix_from")
    prefix_from = SplitConfig.prefix_from if prefix_from is None else prefix_from
    if prefix_from not in get_args(PrefixFrom):
        raise ValueError(f"{key}.split.prefix_from={prefix_from!r} is invalid: it must be one of "
                         f"{', '.join(get_args(PrefixFrom))}; e.g. {key}.split.prefix_from=student")
    size = _at(d, "student.shared_expert_intermediate_size")
    if size is not None and (_integer(size) is None or size < 1):
        raise ValueError(f"{key}.student.shared_expert_intermediate_size={size} is invalid: it must be an integer "
                         f">= 1, or null for the routed expert size")


def check_data_config(data, key: str = "data") -> None:
    """Refuse data.* sizes no run can use, in one line naming the key (`key`: data, calibration); the source itself
    is checked by `slimwise_train.data.loading.check_source`."""
    for name, low in (("num_samples", 1), ("batch_size", 1), ("seq_len", 2)):
        value = _integer(data.get(name))
        if value is None or value < low:
            raise ValueError(f"{key}.{name}={data.get(name)} is invalid: it must be an integer >= {low}; "
                             f"e.g. {key}.{name}={getattr(DataConfig, name)}")

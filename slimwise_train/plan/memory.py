"""Per-GPU (per-rank) memory of one distillation step, by component, from the architecture and the run's config.

    plan = plan_from_config(cfg)      # cfg: conf/plan.yaml (PlanAppConfig)
    plan.components                   # bytes per component, this rank
    plan.total_bytes, plan.fits

The step's peak is taken where the trainer's memory is highest: at the start of the student's backward, when the
teacher's target logits, the student's logits and their gradient, every activation the student saved for backward,
the KV cache (prefix + continuation) and, under ZeRO-3, the gathered weights are all alive. Components:

  frozen_weights        the stock model's parameters (compute dtype); zero3: / world_size
  trainable_and_optimizer   the student's tensors, their gradients and AdamW state, sharded as DeepSpeed does
  deepspeed_buckets     DeepSpeed's gradient reduction buffer (reduce_bucket_size 5e8 elements; on CPU only the
                        pages it touches count)
  logits_and_loss       teacher + student logits [B, L, V] and the gradient of the student's, in the compute dtype,
                        + the loss's fp32 scratch block [rows, V] and per-row statistics (distill/losses.py)
  kv_cache              prefix + continuation keys/values per layer kind (full, sliding window, MLA latent,
                        linear-attention state)
  activations           what the student's forward saves for backward (distill.memory.recompute none | moe |
                        layer), plus one layer's worth of backward working memory
  zero3_gathered        zero3: the largest module gathered whole + the prefetch bucket; with recompute=none also
                        every MoE layer's gathered expert tensors, which transformers' expert code keeps alive
                        through views until backward (docs/scale.md)
  framework_baseline    CPU: the measured process baseline B (torch, transformers, deepspeed, the process group)
                        plus the trainer's own runtime (data, modeling code, the engine; calibrated on
                        `python -m slimwise_train.bench memory`); GPU: CUDA context, NCCL and cuBLAS workspaces
                        (an estimate: no GPU run is recorded yet)
  host_allocator_retention  CPU only: buffers glibc keeps after they are freed: the per-expert tensors a replicated
                        from_pretrained fuses, ZeRO-3's gather transients (calibrated)
  tokenizer             CPU only: what the run's tokenizer keeps beyond the shipped one's (inside the calibrated
                        runtime), measured by loading both in fresh processes (plan/host.py); a real vocabulary's
                        fast tokenizer holds hundreds of MiB
  fragmentation         GPU only: caching-allocator slack, a share of the dynamic components

The formulas, their calibration against the bench and their limits are in docs/planning.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from slimwise_train.config import ZERO_STAGE
from slimwise_train.distill.objective import loss_memory_bytes
from slimwise_train.plan.architecture import Architecture, LayerShape, describe
from slimwise_train.utils.hf import text_config

GIB = 1 << 30
MIB = 1 << 20
DTYPE_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}
REDUCE_BUCKET = 500_000_000  # DeepSpeed's reduce_bucket_size default (elements); the engine does not set it
LINEAR_CHUNK = 64  # the gated delta rule's chunk (transformers' torch implementation)

# Calibration on CPU (fp32, gloo, 2 ranks) against the bench's per-rank RSS; see docs/planning.md.
CPU_BASELINE_MIB = 396.0  # B: docs/scale.md, the 240M bench (395 MiB in the small runs)
# Beyond B through the first steps, model-independent: data, modeling code, autograd, the engine. Refitted 2026-12-03
# (116 / 166 MiB for torch / zero2 on the bench shape of tests/test_plan.py): transformers' modeling import loads
# scipy where it is installed (lm-eval's dependencies install it, as most environments do), 59 MiB measured, so the
# 48-56 / 92-98 MiB fitted on four bench shapes before it joined the venv plan ~66 MiB short (docs/planning.md).
CPU_RUNTIME_MIB = {"torch": 116.0, "deepspeed": 166.0}
CPU_PARTITIONED_RETENTION = 0.08  # zero3's partitioned load: x the model's bytes
CPU_ZERO3_GATHER_COPIES = 3  # zero3 over gloo: transient copies of the largest gathered module the heap keeps
# GPU estimates (not measured here): CUDA context + NCCL + cuBLAS workspaces, and caching-allocator slack.
GPU_BASELINE_GIB = 1.5
GPU_FRAGMENTATION = 0.05
HOST_CUDA_RUNTIME_GIB = 1.0  # host memory of a CUDA process's runtime beyond B (an estimate; the prune plan's host)

COMPONENTS = ("frozen_weights", "trainable_and_optimizer", "deepspeed_buckets", "logits_and_loss", "kv_cache",
              "activations", "zero3_gathered", "framework_baseline", "host_allocator_retention", "tokenizer",
              "fragmentation")


@dataclass
class Shape:
    """One micro-batch on one rank: B rows, P prefix and L continuation tokens (S = P + L attended)."""

    batch: int
    prefix: int
    continuation: int

    @property
    def total(self) -> int:
        return self.prefix + self.continuation


@dataclass
class Plan:
    model: str
    engine: str
    world_size: int
    device: str
    dtype: str
    recompute: str
    shape: Shape
    components: dict
    details: dict
    gpu_memory_gib: float
    architecture: dict = field(default_factory=dict)
    prune: dict = field(default_factory=dict)  # pruning's calibration and export peaks (plan/prune.py)

    @property
    def total_bytes(self) -> int:
        return int(sum(self.components.values()))

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.gpu_memory_gib * GIB

    def to_json(self) -> dict:
        return {
            "plan": "memory", "model": self.model, "engine": self.engine, "world_size": self.world_size,
            "device": self.device, "dtype": self.dtype, "recompute": self.recompute,
            "micro_batch": self.shape.batch, "prefix_tokens": self.shape.prefix,
            "continuation_tokens": self.shape.continuation,
            "components": {k: int(v) for k, v in self.components.items()},
            "components_gib": {k: round(v / GIB, 3) for k, v in self.components.items()},
            "total_bytes": self.total_bytes, "total_gib": round(self.total_bytes / GIB, 2),
            "gpu_memory_gib": self.gpu_memory_gib, "fits": self.fits, "details": self.details,
            "architecture": self.architecture, "prune": self.prune,
        }

    def table(self) -> str:
        unit, div = ("GiB", GIB) if self.device != "cpu" else ("MiB", MIB)
        title = (f"memory plan: {self.model}, engine={self.engine}, {self.world_size} rank(s), {self.device} "
                 f"{self.dtype}, micro batch {self.shape.batch} x ({self.shape.prefix} prefix + "
                 f"{self.shape.continuation} continuation tokens), distill.memory.recompute={self.recompute}")
        rows = [title, f"{'component':<28}{'per rank (' + unit + ')':>18}   what"]
        for name in COMPONENTS:
            if name in self.components:
                rows.append(f"{name:<28}{self.components[name] / div:>18.2f}   {self.details['what'].get(name, '')}")
        rows.append(f"{'total':<28}{self.total_bytes / div:>18.2f}")
        rows.append(f"(model {self.details['model_bytes'] / div:.2f} {unit}, of which routed experts "
                    f"{self.details['expert_bytes'] / div:.2f}; the decode model keeps "
                    f"{self.details['kept_expert_bytes'] / div:.2f} {unit} of experts at this prune.ratio)")
        if self.device != "cpu":
            verdict = "fits" if self.fits else "does NOT fit"
            rows.append(f"{verdict} in {self.gpu_memory_gib:g} GiB per GPU "
                        f"({self.total_bytes / GIB:.1f} GiB planned, "
                        f"{self.gpu_memory_gib - self.total_bytes / GIB:+.1f}"
                        " GiB headroom)")
        return "\n".join(rows)


# --------------------------------------------------------------------------- activations (saved for backward)


def attended_tokens(layer: LayerShape, shape: Shape) -> int:
    """Key/value positions one continuation token's attention reads in this layer: the prefix (a sliding layer's cache
    keeps its last window - 1 tokens) plus the continuation."""
    if layer.attention == "sliding" and layer.window:
        return min(shape.prefix, layer.window - 1) + shape.continuation
    return shape.total


def attention_saved_bytes(layer: LayerShape, shape: Shape, s: int, eager: bool, device: str) -> int:
    """Tensors one attention layer saves for backward in the student phase (not the KV cache itself).

    SDPA kernels (flash on CPU, memory-efficient on GPU, both take the padding mask): q, output, logsumexp, the
    [B, L, S] mask, and keys/values expanded to every query head when there are fewer KV heads (transformers'
    repeat_kv: SDPA's native GQA needs mask=None). Eager attention (GPT-OSS, and SDPA's math fallback on CPU when
    q/k and v head sizes differ: DeepSeek-V3) also saves the [B, heads, L, S] probabilities."""
    B, L = shape.batch, shape.continuation
    if layer.attention == "linear":
        return linear_attention_saved_bytes(layer, shape, s)
    S = attended_tokens(layer, shape)
    nh, hd, hv = layer.heads, layer.head_dim, layer.v_head_dim
    T = B * L
    math_path = eager or (device == "cpu" and hd != hv)
    q = T * nh * hd * s
    if layer.attention == "mla":
        # K and V decompressed per head from the latent for all S positions (kv_b_proj output: nope + v per head).
        kv = B * S * nh * (hd + (hd - layer.rope_dim) + hv) * s
    elif layer.kv_heads < layer.heads or math_path:
        kv = B * S * nh * (hd + hv) * s  # repeat_kv copies (or the math path's transposed keys)
    else:
        kv = 0  # SDPA saves the cache's own tensors: counted in kv_cache
    if math_path:
        sinks = 1 if eager and layer.attention in ("full", "sliding") else 0
        return q + kv + B * nh * L * (S + sinks) * s + T * nh * 8
    out = T * nh * hv * s
    lse = T * nh * 4
    mask = B * L * S * s
    gate = 2 * T * nh * hv * s if layer.gated_output else 0
    return q + out + lse + mask + kv + gate


def linear_attention_saved_bytes(layer: LayerShape, shape: Shape, s: int) -> int:
    """transformers' torch gated delta rule (used when flash-linear-attention is not installed) works in fp32 on
    64-token chunks and keeps, per value head and padded token, [C]-wide rows of four chunk matrices and a dozen
    head-sized fp32 tensors (q, k, v, their beta-scaled and decayed forms, the conv's input and output, the gated
    norm). Fitted to the saved tensors measured on CPU at three head geometries (tests/test_plan.py):
    bytes = B x padded(L) x Hv x (22 C + 33 (dk + dv)), within 5% there."""
    B, L = shape.batch, shape.continuation
    padded = math.ceil(L / LINEAR_CHUNK) * LINEAR_CHUNK
    return B * padded * layer.lin_v_heads * (22 * LINEAR_CHUNK + 33 * (layer.lin_k_dim + layer.lin_v_dim))


def norm_saved_bytes(width: int, tokens: int, s: int) -> int:
    """A stock RMSNorm saves its fp32 input and the student's norm delta its normalised input x_hat (fp32): two fp32
    copies per normalised element on fp32, three on bf16 (each upcast is a new tensor)."""
    copies = 2 if s == 4 else 3
    return copies * width * tokens * 4


def mlp_saved_bytes(size: int, tokens: int, s: int, trainable: bool) -> int:
    """A gated MLP saves gate, up and act(gate) ([T, I] each); a trainable down projection also saves its input."""
    return (4 if trainable else 3) * size * tokens * s


def moe_saved_bytes(layer: LayerShape, tokens: int, hidden: int, s: int, recompute_moe: bool) -> int:
    """Routed experts (transformers' grouped path): per routed slot the expert's [2I] gate/up output, [I] activation
    and [H] output; the router's fp32 probabilities and indices; the student's shared expert; with LoRA on the experts,
    the parametrised tensors W + s B A (peft's baddbmm makes a new [E, out, in] tensor per forward, and the expert
    code saves it for backward) and each adapted matmul's per-slot input ([H] for gate_up_proj, [I] for down_proj:
    saved once the weight needs a gradient). Under distill.memory.recompute=moe only the block's input and the router's
    outputs stay."""
    T, E, k = tokens, layer.experts, layer.top_k
    router = T * (2 * E * 4 + 3 * k * 8 + 2 * k * 4 + E * 1)
    kept = T * hidden * s + router
    if layer.stock_shared_size:
        kept += mlp_saved_bytes(layer.stock_shared_size, T, s, False) + (T * hidden * s if layer.stock_shared_gated
                                                                          else 0)
    if recompute_moe:
        return kept
    routed = T * k * (hidden + 3 * layer.expert_size) * s + T * k * (3 * 8 + 4)
    student_shared = mlp_saved_bytes(layer.student_shared_size, T, s, True) if layer.student_shared_size else 0
    lora = (layer.lora_expert_params + T * k * layer.lora_expert_inputs) * s
    return kept + routed + student_shared + lora


def layer_saved_bytes(arch: Architecture, layer: LayerShape, shape: Shape, s: int, recompute: str, eager: bool,
                      device: str) -> dict[str, int]:
    """{attention, moe, mlp, norms, layer_input} saved by one decoder layer in the student phase."""
    T = shape.batch * shape.continuation
    if recompute == "layer" and layer.attention != "linear":
        return {"layer_input": T * arch.hidden * s}  # the checkpointed layer keeps only its input
    out = {"attention": attention_saved_bytes(layer, shape, s, eager, device),
           "norms": norm_saved_bytes(layer.norm_width, T, s)}
    if layer.moe:
        out["moe"] = moe_saved_bytes(layer, T, arch.hidden, s, recompute in ("moe", "layer"))
    if layer.dense_mlp_size:
        out["mlp"] = mlp_saved_bytes(layer.dense_mlp_size, T, s, False)
    return out


def activation_bytes(arch: Architecture, shape: Shape, s: int, recompute: str, device: str) -> dict[str, int]:
    """Saved activations of the whole student forward, by kind, plus the backward's working set (one layer's
    un-recomputed activations: a recomputed layer rebuilds them, any layer's backward holds gradients of that size)."""
    eager = arch.attn_implementation == "eager"
    total: dict[str, int] = {}
    largest_layer = 0
    for layer in arch.layers:
        for kind, value in layer_saved_bytes(arch, layer, shape, s, recompute, eager, device).items():
            total[kind] = total.get(kind, 0) + value
        full = sum(layer_saved_bytes(arch, layer, shape, s, "none", eager, device).values())
        largest_layer = max(largest_layer, full)
    T = shape.batch * shape.continuation
    total["final_norm"] = norm_saved_bytes(arch.final_norm_width, T, s)
    total["backward_working_set"] = largest_layer
    return total


# --------------------------------------------------------------------------- other components


def kv_cache_bytes(arch: Architecture, shape: Shape, s: int) -> int:
    """The cache after the student's forward: prefix + continuation per full layer, the last window - 1 prefix tokens
    + the continuation per sliding layer, MLA's latent + rope key, a linear-attention layer's conv and recurrent
    state (measured: tests/test_plan.py)."""
    B, S = shape.batch, shape.total
    total = 0
    for layer in arch.layers:
        if layer.attention == "linear":
            conv_dim = 2 * layer.lin_k_heads * layer.lin_k_dim + layer.lin_v_heads * layer.lin_v_dim
            state = layer.lin_v_heads * layer.lin_k_dim * layer.lin_v_dim * 4  # the recurrent state, fp32
            total += B * conv_dim * layer.conv_kernel * s + B * state
        elif layer.attention == "mla":
            total += B * S * (layer.kv_lora_rank + layer.rope_dim) * s
        else:  # a sliding layer holds its window - 1 prefix tokens plus the whole continuation after the forward
            tokens = attended_tokens(layer, shape)
            total += B * tokens * layer.kv_heads * (layer.head_dim + layer.v_head_dim) * s
    return total


def logits_bytes(arch: Architecture, shape: Shape, s: int, device: str, loss_cfg) -> dict:
    """Teacher targets + student logits + the gradient of the student's (allocated in the loss's backward while both
    are alive), [B, L, V] each in the compute dtype; Gemma 4's final soft-capping keeps one more (its tanh output).
    The rest is the objective's own estimate for the terms of `loss_cfg` (distill.loss; distill/objective.py): the
    fused CE + KL walks rows through one fp32 [rows, V] block (chunk_size rows on GPU, ~1M elements on CPU; two for
    the full KL) and keeps per-row statistics (the teacher's top-k indices and probabilities, logsumexps)."""
    N, V = shape.batch * shape.continuation, arch.vocab
    per = N * V * s
    tensors = 3 + (1 if arch.final_logit_softcapping else 0)
    return {"logits": tensors * per, **loss_memory_bytes(loss_cfg, N, V, device)}


def optimizer_bytes(trainable: int, engine: str, world: int, s: int, device: str) -> dict:
    """The student's tensors, their gradients and AdamW's two moments, per rank.

    engine=torch keeps fp32 trainable tensors (the master copy) + fp32 gradients + DDP's gradient buckets (a second
    copy, with several ranks). DeepSpeed casts them to the compute dtype and keeps an fp32 master partition and
    fp32 moments: stage 1 shards the optimizer state, stage 2 also the gradients, stage 3 also the parameters."""
    stage = ZERO_STAGE[engine]
    if stage == 0:
        ddp = trainable * 4 if world > 1 else 0
        return {"params": trainable * 4, "grads": trainable * 4 + ddp, "adam_master_and_moments": trainable * 8}
    shard = trainable / world
    params = trainable * s if stage < 3 else shard * s
    # Stage 1 keeps autograd's whole gradients until the step; stages 2 and 3 move each into the reduction bucket as
    # it is produced (deepspeed_buckets) and keep a partition. Plus the fp32 partition the optimizer steps on.
    grads = (trainable * s if stage == 1 else shard * s) + shard * 4
    return {"params": int(params), "grads": int(grads), "adam_master_and_moments": int(shard * 4 + shard * 8)}


def deepspeed_bucket_bytes(trainable: int, engine: str, s: int, device: str) -> int:
    """DeepSpeed's contiguous gradient buffer: reduce_bucket_size (5e8) elements, fp32 staging for stage 1, the compute
    dtype for stages 2 and 3. On a GPU the whole buffer is allocated; on CPU only the touched pages (the trainable
    gradients) are resident."""
    stage = ZERO_STAGE[engine]
    if stage == 0:
        return 0
    bytes_per = 4 if stage == 1 else s
    elements = REDUCE_BUCKET if device != "cpu" else min(REDUCE_BUCKET, trainable)
    return int(elements * bytes_per)


def zero3_gathered_bytes(arch: Architecture, s: int, recompute: str, prefetch: int, max_live: int) -> dict:
    """Weights gathered whole under ZeRO-3 at the student's backward: the largest module (a layer's fused experts, the
    embedding or lm_head; a whole layer with recompute=layer) and the prefetch bucket, which DeepSpeed keeps under
    stage3_max_live_parameters; with recompute=none every MoE layer's experts also stay alive, through the views
    transformers' expert code saves for backward (DeepSpeed counts them as released: no limit applies)."""
    experts = [layer.expert_params for layer in arch.layers if layer.moe]
    largest = max([arch.largest_other_module_params, *experts])
    if recompute == "layer":
        largest = max(largest, max(layer.params for layer in arch.layers))
    if recompute == "none":
        largest = arch.largest_other_module_params  # the experts are counted whole below
    live = min(largest + prefetch, max(largest, max_live))
    out = {"largest_module": largest * s, "prefetch_bucket": (live - largest) * s}
    if recompute == "none":
        out["retained_expert_views"] = sum(experts) * s
    return out


# --------------------------------------------------------------------------- the plan


def _integer(value):
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _positive_number(value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(float(value))
            and float(value) > 0)


def validate_plan_config(cfg) -> None:
    """Every value of conf/plan.yaml the config alone shows wrong, in one line naming the key and the valid range:
    run first by `plan_from_config`, before the architecture is read or the meta model is built. The model's own
    limit (data.seq_len <= max_position_embeddings) is checked next, from its config alone (`check_seq_len`). The
    closed choices (engine.name, distill.memory.recompute, device, ...) are the schema's Literal fields:
    check_known_keys."""
    from slimwise_train.config import PlanAppConfig, check_distill_config, check_known_keys
    from slimwise_train.distill.batches import SplitRule
    from slimwise_train.distill.engine import validate_engine_config
    from slimwise_train.distill.objective import check_loss_config
    from slimwise_train.prune.criteria import validate_prune_config

    check_known_keys(cfg, PlanAppConfig)
    resolve_dtype(cfg)
    validate_engine_config(cfg.engine, cfg.distill)
    world = _integer(cfg.world_size)
    if world is None or world < 1:
        raise ValueError(f"world_size={cfg.world_size} is invalid: the run needs at least one rank; use an integer "
                         "world_size>=1 (the ranks the run is spread over, e.g. world_size=8)")
    if not _positive_number(cfg.gpu_memory_gib):
        raise ValueError(f"gpu_memory_gib={cfg.gpu_memory_gib} is invalid: the memory per GPU must be a finite "
                         "number > 0 (GiB); e.g. gpu_memory_gib=80")
    if not _positive_number(cfg.host_memory_gib):
        raise ValueError(f"host_memory_gib={cfg.host_memory_gib} is invalid: the host's memory must be a finite "
                         "number > 0 (GiB); e.g. host_memory_gib=256")
    calibration_batch = _integer(cfg.calibration_batch_size)
    if calibration_batch is None or calibration_batch < 1:
        raise ValueError(f"calibration_batch_size={cfg.calibration_batch_size} is invalid: the prune app's sequences "
                         "per calibration batch must be an integer >= 1; e.g. calibration_batch_size=4")
    baseline = cfg.get("baseline_mib")
    if baseline is not None and not (_positive_number(baseline) or baseline == 0):
        raise ValueError(f"baseline_mib={baseline} is invalid: the framework's baseline per rank is a finite number "
                         ">= 0 (MiB), or null for the calibrated default")
    check_distill_config(cfg.distill)
    check_loss_config(cfg.distill.loss)
    rule = SplitRule.from_config(cfg.distill.split)  # names distill.split.min_*
    batch = _integer(cfg.data.batch_size)
    if batch is None or batch < 1:
        raise ValueError(f"data.batch_size={cfg.data.batch_size} is invalid: the micro batch per rank must be an "
                         "integer >= 1; e.g. data.batch_size=1")
    seq, shortest = _integer(cfg.data.seq_len), rule.min_split + rule.min_continuation
    if seq is None or seq < shortest:
        raise ValueError(f"data.seq_len={cfg.data.seq_len} is too short to split: a sequence needs "
                         f"distill.split.min_split + distill.split.min_continuation = {shortest} tokens; use "
                         f"data.seq_len>={shortest}")
    validate_prune_config(cfg.prune)
    resolve_shape(cfg)


def check_seq_len(cfg, config) -> None:
    """data.seq_len within the model's max_position_embeddings (`config`: its transformers config), as the trainer
    requires (slimwise_train.data.loading.check_seq_len)."""
    text = text_config(config)
    limit = getattr(text, "max_position_embeddings", None)
    if limit is not None and int(cfg.data.seq_len) > int(limit):
        shortest = int(cfg.distill.split.min_split) + int(cfg.distill.split.min_continuation)
        raise ValueError(f"data.seq_len={cfg.data.seq_len} exceeds the max_position_embeddings={limit} of model "
                         f"{cfg.model.name}; use data.seq_len in [{shortest}, {limit}]")


def resolve_shape(cfg) -> Shape:
    """The planned micro-batch: data.batch_size rows, the longest prefix P and the longest continuation L.

    The split rule (slimwise_train/distill/batches.py) puts a sequence of n <= data.seq_len tokens at s in
    [distill.split.min_split, n - distill.split.min_continuation]: so P is in [min_split, seq_len - min_continuation]
    and L in [min_continuation, seq_len - min_split]. With one row (data.batch_size=1) both come from one sequence, so
    P + L <= seq_len; with more rows P and L may come from different rows (left- and right-padded).

    Unless given, the worst case of that rule: the longest continuation seq_len - min_split on a min_split-token
    prefix (activations and logits grow with the continuation); with prefix_tokens given and one row, the rest of the
    sequence, seq_len - prefix_tokens; with continuation_tokens given, prefix seq_len - continuation_tokens."""
    seq, batch = int(cfg.data.seq_len), int(cfg.data.batch_size)
    min_split, min_cont = int(cfg.distill.split.min_split), int(cfg.distill.split.min_continuation)
    prefix, cont = cfg.get("prefix_tokens"), cfg.get("continuation_tokens")
    where = (f"at data.seq_len={seq} (split rule: distill.split.min_split={min_split}, "
             f"distill.split.min_continuation={min_cont}), or null for the worst case")
    if prefix is not None and not min_split <= int(prefix) <= seq - min_cont:
        raise ValueError(f"prefix_tokens={prefix} is invalid: use prefix_tokens in [{min_split}, {seq - min_cont}] "
                         + where)
    if cont is not None and not min_cont <= int(cont) <= seq - min_split:
        raise ValueError(f"continuation_tokens={cont} is invalid: use continuation_tokens in [{min_cont}, "
                         f"{seq - min_split}] " + where)
    if cont is None:
        cont = seq - int(prefix) if prefix is not None and batch == 1 else seq - min_split
    if prefix is None:
        prefix = seq - int(cont)
    if batch == 1 and int(prefix) + int(cont) > seq:
        raise ValueError(f"prefix_tokens={prefix} + continuation_tokens={cont} = {int(prefix) + int(cont)} exceeds "
                         f"data.seq_len={seq}: with data.batch_size=1 both come from one sequence; use "
                         "prefix_tokens + continuation_tokens <= data.seq_len")
    return Shape(batch, int(prefix), int(cont))


def resolve_dtype(cfg) -> tuple[str, torch.dtype]:
    device = str(cfg.device)  # cuda | cpu: a Literal field (PlanAppConfig.device)
    precision = str(cfg.engine.precision)
    if precision == "auto":
        precision = "bf16" if device == "cuda" else "fp32"
    if precision == "bf16" and device == "cpu":
        raise ValueError("engine.precision=bf16 needs a GPU (the engines run fp32 on CPU)")
    return device, torch.bfloat16 if precision == "bf16" else torch.float32


def plan_memory(arch: Architecture, cfg, shape: Shape, device: str, dtype: torch.dtype) -> Plan:
    s = DTYPE_BYTES[dtype]
    engine = str(cfg.engine.name)  # validated by validate_plan_config (the schema's Literal fields)
    world = int(cfg.world_size)
    if world < 1:
        raise ValueError(f"world_size must be >= 1, got {world}")
    recompute = str(cfg.distill.memory.recompute)
    stage = ZERO_STAGE[engine]
    frozen = arch.frozen_params * s
    opt = optimizer_bytes(arch.trainable_params, engine, world, s, device)
    if cfg.engine.get("offload_optimizer"):  # fp32 master, moments and gradient partition in host memory
        opt = {"params": opt["params"], "grads": int(opt["grads"] - arch.trainable_params / world * 4),
               "adam_master_and_moments": 0}
    logits = logits_bytes(arch, shape, s, device, cfg.distill.loss)
    acts = activation_bytes(arch, shape, s, recompute, device)
    components = {
        "frozen_weights": frozen / world if stage == 3 else frozen,
        "trainable_and_optimizer": sum(opt.values()),
        "deepspeed_buckets": deepspeed_bucket_bytes(arch.trainable_params, engine, s, device),
        "logits_and_loss": sum(logits.values()),
        "kv_cache": kv_cache_bytes(arch, shape, s),
        "activations": sum(acts.values()),
    }
    what = {
        "frozen_weights": f"{arch.frozen_params / 1e9:.3f}B params x {s} B" + (f" / {world}" if stage == 3 else ""),
        "trainable_and_optimizer": f"{arch.trainable_params / 1e6:.1f}M trainable: params, grads, AdamW ({engine})",
        "deepspeed_buckets": "reduce_bucket_size 5e8" if stage else "",
        "logits_and_loss": f"teacher + student logits + grad [B, L, V={arch.vocab}], loss scratch",
        "kv_cache": f"{shape.total} tokens x {len(arch.layers)} layers",
        "activations": f"saved for backward, recompute={recompute}",
    }
    if stage == 3:
        what["zero3_gathered"] = "gathered weights" + (" incl. every layer's experts" if recompute == "none" else "")
    gathered = {}
    if stage == 3:
        prefetch = cfg.engine.get("prefetch_bucket_size")
        prefetch = int(prefetch) if prefetch is not None else int(0.9 * arch.hidden * arch.hidden)
        max_live = int(cfg.engine.get("max_live_parameters", 1_000_000_000))
        gathered = zero3_gathered_bytes(arch, s, recompute, prefetch, max_live)
        components["zero3_gathered"] = sum(gathered.values())
        if cfg.engine.get("offload_params"):  # the partitions live in host memory between uses
            components["frozen_weights"] = 0
            what["frozen_weights"] = "offloaded to host memory (engine.offload_params)"
    baseline_bytes = (float(cfg.baseline_mib) if cfg.get("baseline_mib") is not None else None)
    if device == "cpu":
        runtime = CPU_RUNTIME_MIB["torch" if stage == 0 else "deepspeed"] * MIB
        base = (baseline_bytes if baseline_bytes is not None else CPU_BASELINE_MIB) * MIB
        components["framework_baseline"] = base + runtime
        partitioned = stage == 3 and bool(cfg.engine.get("partitioned_load", True))
        model_bytes = (arch.frozen_params + arch.trainable_params) * s
        # A replicated load reads the checkpoint's per-expert tensors and fuses them ([E, 2I, H]): the per-expert
        # copies stay in glibc's heap (measured: ~1x the expert bytes at every bench shape).
        retention = CPU_PARTITIONED_RETENTION * model_bytes if partitioned else arch.expert_params * s
        if stage == 3:
            largest = max([arch.largest_other_module_params, *[l.expert_params for l in arch.layers if l.moe]])
            retention += CPU_ZERO3_GATHER_COPIES * largest * s
        components["host_allocator_retention"] = retention
        what["framework_baseline"] = f"B {base / MIB:.0f} MiB + trainer runtime {runtime / MIB:.0f} MiB (calibrated)"
        what["host_allocator_retention"] = ("per-expert load buffers glibc keeps" if not partitioned else
                                            "partitioned load + gather transients glibc keeps") + " (calibrated)"
    else:
        dynamic = sum(components.values())
        components["framework_baseline"] = (baseline_bytes * MIB if baseline_bytes is not None
                                             else GPU_BASELINE_GIB * GIB)
        components["fragmentation"] = GPU_FRAGMENTATION * dynamic
        what["framework_baseline"] = "CUDA context, NCCL, cuBLAS workspaces (estimate)"
        what["fragmentation"] = f"{GPU_FRAGMENTATION:.0%} of the dynamic components (estimate)"
    details = {
        "what": what,
        "bytes_per_element": s,
        "optimizer": opt,
        "logits": logits,
        "activations": acts,
        "zero3_gathered": gathered,
        "expert_bytes": arch.expert_params * s,
        "kept_expert_bytes": arch.kept_expert_params * s,
        "model_bytes": (arch.frozen_params + arch.trainable_params) * s,
    }
    return Plan(model=arch.name, engine=engine, world_size=world, device=device,
                dtype="bf16" if s == 2 else "fp32", recompute=recompute, shape=shape,
                components={k: int(v) for k, v in components.items()}, details=details,
                gpu_memory_gib=float(cfg.gpu_memory_gib), architecture=arch.to_json())


def plan_from_config(cfg) -> Plan:
    """The plan for a composed conf/plan.yaml: the config checked first (`validate_plan_config`), then data.seq_len
    against the model's config, then the meta model."""
    from slimwise_train.plan.architecture import architecture_config

    validate_plan_config(cfg)
    device, dtype = resolve_dtype(cfg)
    shape = resolve_shape(cfg)
    config = architecture_config(cfg.model)
    check_seq_len(cfg, config)
    arch, _ = describe(cfg.model, cfg.prune, cfg.distill, dtype, config=config)
    plan = plan_memory(arch, cfg, shape, device, dtype)
    if device == "cpu":
        from slimwise_train.plan.host import tokenizer_beyond_shipped

        plan.components["tokenizer"], plan.details["what"]["tokenizer"] = tokenizer_beyond_shipped(cfg.model)
    plan.prune = _prune_plan(arch, cfg, device, dtype)
    return plan


def _prune_plan(arch: Architecture, cfg, device: str, dtype: torch.dtype) -> dict:
    """plan/prune.py's calibration and export peaks for this model on this GPU and host, with the planner's
    baselines (GPU: the estimate; host: the measured CPU baseline B, plus a CUDA process's runtime on a GPU)."""
    from slimwise_train.plan.prune import plan_prune

    baseline = cfg.get("baseline_mib")
    host = (float(baseline) if baseline is not None else CPU_BASELINE_MIB) * MIB
    if device != "cpu":
        host += HOST_CUDA_RUNTIME_GIB * GIB
    gpu = float(baseline) * MIB if baseline is not None else GPU_BASELINE_GIB * GIB
    return plan_prune(arch, s=DTYPE_BYTES[dtype], device=device, num_samples=int(cfg.data.num_samples),
                      seq_len=int(cfg.data.seq_len), batch=int(cfg.calibration_batch_size), world=int(cfg.world_size),
                      gpu_memory_gib=float(cfg.gpu_memory_gib), host_memory_gib=float(cfg.host_memory_gib),
                      gpu_baseline=int(gpu), host_baseline=int(host))

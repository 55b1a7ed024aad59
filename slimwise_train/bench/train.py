"""`bench train`: distillation step, ours vs a naive two-copy step vs the lower bound; memory in fresh processes."""

from __future__ import annotations

import json
import statistics
import sys
from typing import Callable

import torch
import torch.nn.functional as F

from slimwise_train.bench.common import (_peak_rss_bytes, _reset_peak_rss, _rss_now_bytes, bench_model,
                                         interleaved_times)


def _train_cfg(args: dict):
    """The trainer's config (distill defaults of the real schema, the loss knobs from the command line)."""
    from omegaconf import OmegaConf

    from slimwise_train.config import DistillConfig, LossConfig, ScheduleConfig

    distill = DistillConfig(loss=LossConfig(top_k=args["loss_top_k"], chunk_size=args["chunk"]),
                            schedule=ScheduleConfig(grad_accum=1))
    return OmegaConf.create({"distill": OmegaConf.structured(distill), "output_dir": ".", "seed": args["seed"]})


def _train_build(args: dict, device, variants, after_teacher: Callable[[], None] | None = None):
    """The step callables of `variants` (ours / naive / lower_bound) on one shared teacher and one batch.

    Everything built after `after_teacher()` is what the variant adds on top of the teacher's weights.
    Returns (steps {name: fn}, batch stats).
    """
    import copy
    from types import SimpleNamespace

    from transformers import DynamicCache

    from slimwise_train.moe.adapters import get_adapter
    from slimwise_train.distill import batches as B
    from slimwise_train.distill.engine import TorchEngine
    from slimwise_train.distill.losses import IGNORE_INDEX
    from slimwise_train.distill.objective import Objective
    from slimwise_train.distill.student import (DistillModel, SharedExpert, StudentSpec, activation_name, find_norms,
                                                routed_expert_size)
    from slimwise_train.distill.trainer import Trainer
    from slimwise_train.moe.handoff import positions_from_mask
    from slimwise_train.utils.hf import text_config
    from slimwise_train.moe.keepset import KeepSet
    from slimwise_train.moe.pruning import prune_experts_
    from slimwise_train.prune.criteria import num_to_keep

    torch.manual_seed(args["seed"])
    teacher = bench_model(args["model_type"], args["hidden"], args["layers"], args["experts"], args["top_k"],
                          args["moe_intermediate"], args["vocab"], device).eval()
    teacher.requires_grad_(False)
    if after_teacher is not None:
        after_teacher()
    adapter = get_adapter(teacher)
    layers = adapter.moe_layers(teacher)
    keep = KeepSet.from_kept(layers, [list(range(num_to_keep(m.num_experts, args["prune_ratio"]))) for m in layers])
    cfg = _train_cfg(args)
    d = cfg.distill
    objective = Objective.from_config(d.loss)  # the terms and weights all three variants train on

    # One batch from the trainer's own data plan: `batch` sequences of `seq` random tokens; a one-batch plan without
    # shuffling repeats it at every step. split="random": the trainer's default rule, s ~ U{1..seq-2} per row (a
    # batch of few rows can land far from the mean). A fraction f: every row split at s = f * seq, by the rule with
    # min_split = s and min_continuation = seq - s (so lo = hi = s); 0.5 is the mean of the default rule, and equal
    # splits are what length bucketing (distill.split.bucket_windows) approximates in training.
    g = torch.Generator().manual_seed(args["seed"])
    pad = int(teacher.config.pad_token_id or 0)
    seqs = [(torch.randint(3, args["vocab"], (args["seq"],), generator=g).tolist(), 0) for _ in range(args["batch"])]
    if args["split"] == "random":
        rule = B.SplitRule.from_config(d.split)
    else:
        at = min(max(round(float(args["split"]) * args["seq"]), 1), args["seq"] - 2)
        rule = B.SplitRule(min_split=at, min_continuation=args["seq"] - at)
    plan = B.DataPlan(seqs, rule, args["batch"], data_seed=0, split_seed=args["seed"], bucket_windows=1, shuffle=False)
    indices, splits = plan.step_batch(0)
    batch = B.continuation_batch([seqs[i] for i in indices], splits, pad).to(device)
    P, L = batch.prefix_ids.shape[1], batch.cont_ids.shape[1]
    full_ids = torch.cat([batch.prefix_ids, batch.cont_ids], dim=1)
    cont_mask = batch.full_mask[:, P:]
    cont_positions = positions_from_mask(batch.full_mask, P, L)
    steps: dict[str, Callable[[], None]] = {}

    def optimizer_step(params, optimizer):
        # What TorchEngine.step does: explicit clip, AdamW, zero grads.
        clip = float(d.optim.grad_clip)
        torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def adamw(params):
        optim = d.optim
        return torch.optim.AdamW(params, lr=float(optim.lr), betas=(float(optim.adam_beta1), float(optim.adam_beta2)),
                                 eps=float(optim.adam_eps), weight_decay=float(optim.weight_decay))

    if "naive" in variants:
        missing = [name for name in objective.terms if name not in NAIVE_TERMS]
        if missing:
            raise ValueError(f"bench train: the naive step has no counterpart of the loss terms {missing}; it has "
                             f"{', '.join(NAIVE_TERMS)}")
        # A separate student: deep copy of the teacher, experts physically pruned, its own routers and norms
        # trainable in place, plus a new shared expert (same module and init as ours) added to the experts' output.
        student = prune_experts_(copy.deepcopy(teacher), keep)
        student.requires_grad_(False)
        params = []
        for moe in adapter.moe_layers(student):
            router = adapter.mask_hook_target(moe)
            for p in router.parameters(recurse=False):
                params.append(p.requires_grad_(True))
            shared = SharedExpert(teacher.config.hidden_size, routed_expert_size(student), activation_name(student),
                                  torch.float32, device)
            with torch.no_grad():
                shared.down_proj.weight.zero_()
            moe.block.add_module("naive_shared_expert", shared)
            moe.experts.register_forward_hook(
                lambda mod, a, out, shared=shared: out + shared(a[0]).view_as(out))
            params += list(shared.parameters())
        params += [norm.weight.requires_grad_(True) for _, norm in find_norms(student, "all")]
        naive_opt = adamw(params)

        def naive():
            with torch.no_grad():
                # Teacher pass 1: the prefix, for the cache (only the cache is used, as in generate's prefill).
                cache = DynamicCache(config=text_config(teacher))
                teacher(input_ids=batch.prefix_ids, attention_mask=batch.prefix_mask,
                        position_ids=positions_from_mask(batch.prefix_mask), past_key_values=cache, use_cache=True,
                        logits_to_keep=1)
                # Teacher pass 2: the whole sequence again for the targets (a plain forward: logits everywhere).
                target = teacher(input_ids=full_ids, attention_mask=batch.full_mask,
                                 position_ids=positions_from_mask(batch.full_mask), use_cache=False).logits[:, P:]
            logits = student(input_ids=batch.cont_ids, attention_mask=batch.full_mask, position_ids=cont_positions,
                             past_key_values=cache, use_cache=True).logits
            valid = batch.labels != IGNORE_INDEX
            s, t = logits[valid].float(), target[valid].float()
            naive_terms = {name: NAIVE_TERMS[name](s, t, batch.labels[valid]) for name in objective.terms}
            objective.total(naive_terms).backward()
            optimizer_step(params, naive_opt)

        steps["naive"] = naive

    if "ours" in variants or "lower_bound" in variants:
        # The student the naive step mirrors (routers, norms, a shared expert; no LoRA): the slot's extra columns where
        # the family has a slot, else a new expert. The default on a family without a slot trains LoRA on the kept
        # experts instead, which the naive step has no counterpart of.
        mode = "auto" if adapter.has_native_slot else "new"
        spec = StudentSpec(seed=args["seed"], shared_expert_mode=mode, lora=None)
        model = DistillModel(teacher, keep, spec)
        trainable = [p for _, p in model.trainable_named_parameters()]
    if "ours" in variants:
        # The real step: Trainer.train_step on a trainer built from these parts (the student, the data plan,
        # engine=torch) instead of setup(); no files, no logger.
        trainer = Trainer.from_components(cfg, student=model, engine=TorchEngine(model, d, device), plan=plan,
                                          tokenizer=SimpleNamespace(pad_token_id=pad), device=device,
                                          micro_batch=args["batch"])
        steps["ours"] = lambda: trainer.train_step(0)
    if "lower_bound" in variants:
        lower_opt = adamw(trainable)

        def lower_bound():
            with torch.no_grad():  # one teacher pass over the whole sequence, logits only where targets are needed
                model(full_ids, batch.full_mask, positions_from_mask(batch.full_mask), None, phase="teacher",
                      use_cache=False, logits_to_keep=L)
            logits = model(batch.cont_ids, cont_mask, cont_positions, None, phase="student", use_cache=False)
            F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch.labels.reshape(-1),
                            ignore_index=IGNORE_INDEX).backward()
            optimizer_step(trainable, lower_opt)

        steps["lower_bound"] = lower_bound
    return steps, batch.stats()


TRAIN_VARIANTS = ("ours", "naive", "lower_bound")


def _naive_kl(s: torch.Tensor, t: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.kl_div(F.log_softmax(s, -1), F.log_softmax(t, -1), log_target=True, reduction="batchmean")


def _naive_ce(s: torch.Tensor, t: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(s, labels)


# The naive step's counterpart of each loss term, as existing tools compute it: means over the valid tokens of the
# full-vocabulary fp32 softmaxes, unchunked (s, t: [N, V] fp32 valid rows, labels [N]). Both KLs are the dense one.
NAIVE_TERMS = {"ce": _naive_ce, "kl": _naive_kl, "full_kl": _naive_kl}


def _train_memory_child(variant: str, args: dict) -> dict:
    """Runs in a fresh process: memory of `warm steps` + 1 steps of one variant beyond the teacher's weights."""
    device = torch.device(args["device"])
    marks: dict[str, int] = {}

    def after_teacher():
        if device.type == "cuda":
            torch.cuda.synchronize()
            marks["teacher"] = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        else:
            marks["teacher"] = _rss_now_bytes()
            marks["reset"] = int(_reset_peak_rss())  # drop the peak of building the teacher

    steps, _ = _train_build(args, device, [variant], after_teacher)
    if device.type == "cuda":
        torch.cuda.synchronize()
        marks["models"] = torch.cuda.memory_allocated(device)
    else:
        marks["models"] = _rss_now_bytes()
    for _ in range(2):  # the first step creates the optimizer state; the second runs with it
        steps[variant]()
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(device)
    else:
        peak = _peak_rss_bytes()
    return {
        "metric": "cuda_max_memory_allocated" if device.type == "cuda" else
        ("rss_vmhwm_reset_after_teacher" if marks.get("reset") else "rss_ru_maxrss"),
        "peak_total": peak,
        "after_teacher": marks["teacher"],
        "models_extra": marks["models"] - marks["teacher"],
        "peak_extra_over_teacher_weights": peak - marks["teacher"],
    }


def run_train(args) -> dict:
    """One distillation step: ours (Trainer.train_step) vs a naive two-copy step vs the lower bound.

    ours         the real SlimWise step, `Trainer.train_step` itself on a trainer whose `setup()` is replaced by the
                 attributes it sets (DistillModel over the one teacher, the trainer's DataPlan, engine=torch):
                 teacher prefill of the prefix (cache only) -> teacher continuation on a copy of the cache (targets)
                 -> student continuation on the cache -> chunked top-k + residual KL and CE -> backward -> clip, AdamW.
    naive        how existing distillation tools do it: a separate deep copy of the teacher, experts physically
                 pruned, its own router/norm weights trainable and a new shared expert (two weight copies in memory);
                 a teacher pass over the prefix for the cache and ANOTHER plain teacher forward over the whole sequence
                 for the targets; the student continues on the prefix cache; full-vocabulary fp32 KL (log_softmax of
                 both over every token, unchunked) + CE with the same weights; clip, AdamW.
    lower_bound  the least compute the method needs: one no-grad teacher forward over the whole sequence (logits
                 only at the continuation) + one student forward and backward over the continuation tokens alone
                 (no prefix cache) with a plain CE; clip, AdamW.

    All three run the same batch from the trainer's DataPlan (`--split`: every row split at that fraction of
    `--seq`, default the mean split 0.5, or the trainer's random split points) and the same AdamW settings; the
    loss is the real config's distill.loss (its terms and weights; top_k and chunk_size from `--loss-top-k`,
    `--chunk`), the naive step's terms their full-vocabulary counterparts (NAIVE_TERMS).

    Time: interleaved repeats in one process after a warm-up round, medians; throughput counts real continuation
    tokens (no padding). Memory: each variant in a fresh process, two steps (the second one with optimizer state).
    `peak_total` is the peak RSS (GPU: max_memory_allocated) of the whole process after the teacher was built: the
    interpreter, torch and the teacher's weights, which every variant holds alike, plus the rest.
    `peak_extra_over_teacher_weights` = peak - memory right after the teacher was built: everything the variant
    adds on top of the one copy of the teacher it cannot do without, i.e. the naive student's second (pruned) weight
    copy, trainable tensors, optimizer state, caches, logits, activations and loss intermediates. This is the fair
    basis of the memory target (the fixed part would make any two variants look alike); `models_extra` is the part of
    it that exists before the first step (the naive student's copy; ours: the small trainable children).
    """
    import subprocess

    device = torch.device(args.device)
    a = {k: getattr(args, k) for k in ("model_type", "hidden", "layers", "experts", "top_k", "moe_intermediate",
                                       "vocab", "batch", "seq", "prune_ratio", "loss_top_k", "chunk", "split", "seed")}
    a["device"] = str(device)
    memory = {}
    for variant in TRAIN_VARIANTS:
        code = (f"import json; from slimwise_train.bench.train import _train_memory_child as f; "
                f"print(json.dumps(f({variant!r}, {a!r})))")
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"bench train memory ({variant}) failed: {proc.stderr.strip().splitlines()[-3:]}")
        memory[variant] = json.loads(proc.stdout.strip().splitlines()[-1])
    steps, stats = _train_build(a, device, TRAIN_VARIANTS)
    times = interleaved_times(steps, args.repeats, 1, device)
    med = {k: statistics.median(v) for k, v in times.items()}
    tokens = stats["cont_tokens"]
    throughput = {k: tokens / v for k, v in med.items()}
    speedup = throughput["ours"] / throughput["naive"]
    over_lower = med["ours"] / med["lower_bound"]
    extra = {k: v["peak_extra_over_teacher_weights"] for k, v in memory.items()}
    mem_ratio = extra["ours"] / extra["naive"]
    mib = 1 / 2**20
    return {
        "bench": "train",
        "device": str(device),
        "threads": torch.get_num_threads(),
        "model": f"{args.model_type} L{args.layers} H{args.hidden} E{args.experts} top{args.top_k} "
                 f"I{args.moe_intermediate} V{args.vocab}",
        "prune_ratio": args.prune_ratio,
        "batch": args.batch,
        "seq": args.seq,
        "split": args.split,
        "tokens": stats,
        "step_s": {k: round(v, 4) for k, v in med.items()},
        "cont_tokens_per_s": {k: round(v, 2) for k, v in throughput.items()},
        "ours_over_naive_throughput": round(speedup, 3),
        "ours_over_lower_bound_time": round(over_lower, 3),
        "memory_metric": memory["ours"]["metric"],
        "peak_total_mib": {k: round(v["peak_total"] * mib, 1) for k, v in memory.items()},
        "peak_extra_over_teacher_weights_mib": {k: round(v * mib, 1) for k, v in extra.items()},
        "models_extra_mib": {k: round(v["models_extra"] * mib, 1) for k, v in memory.items()},
        "ours_over_naive_peak_extra": round(mem_ratio, 3),
        "ours_over_naive_peak_total": round(memory["ours"]["peak_total"] / memory["naive"]["peak_total"], 3),
        "targets": {"ours_over_naive_throughput_min": 1.3, "ours_over_naive_peak_extra_max": 0.6,
                    "ours_over_lower_bound_time_max": 1.15},
        "targets_met": {"throughput": speedup >= 1.3, "memory": mem_ratio <= 0.6, "lower_bound": over_lower <= 1.15},
        "repeats": args.repeats,
        "ratio": round(speedup, 3),
    }


"""The distillation trainer: one readable class, `setup` / `train_step` / `train` / `close`.

One optimizer step, top to bottom (`train_step`):
  1. the step's global batch (same on every rank) with one split point per sequence (a function of the seeds and
     the epoch only, see batches.DataPlan);
  2. sequences sorted by continuation length, dealt to ranks, cut into distill.schedule.grad_accum micro-batches;
  3. the global number of loss tokens (all ranks, all micro-batches) by one all-reduce: the loss denominator;
  4. per micro-batch: teacher prefill of the left-padded prefixes (no grad) -> cache; teacher continuation on a
     copy of the cache -> target logits; student continuation on the cache -> logits; loss; backward
     (distill.split.prefix_from=student: the same teacher targets; the student runs its OWN prefill of the prefixes,
     with gradients, and the continuation after it: one student forward over prefix + continuation, see
     `_student_on_own_prefix`);
  5. a non-finite loss on any rank skips the step on every rank (counted; distill.schedule.max_nan_steps in a row
     abort);
  6. clip (explicit), optimizer and scheduler step; metrics; checkpoint every distill.checkpoint.every steps.

Only rank 0 writes files (DeepSpeed's per-rank optimizer partitions are the one exception, see checkpoint.py).
Shapes: B rows, P prefix width, L continuation width, V vocabulary.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf
from safetensors import safe_open
from tqdm.auto import tqdm
from transformers import DynamicCache

from slimwise_train.config import (TrainAppConfig, check_data_config, check_distill_config, check_known_keys,
                                   to_container)
from slimwise_train.distill import batches as B
from slimwise_train.distill.checkpoint import (check_run_folder, gather_objects, load_checkpoint, resolve_resume,
                                               save_checkpoint, set_aside_previous_run)
from slimwise_train.distill.engine import Engine, build_engine, partitioned_loading, validate_engine_config
from slimwise_train.distill.lora import lora_from_config, preset_name
from slimwise_train.distill.metrics import build_sink
from slimwise_train.distill.objective import Objective, check_loss_config
from slimwise_train.distill.student import DistillModel, StudentSpec
from slimwise_train.moe.handoff import cache_layer_kinds, copy_cache, make_cache_autograd_safe, positions_from_mask
from slimwise_train.moe.keepset import KeepSet
from slimwise_train.moe.keepset_rules import check_exportable, check_fits, keep_set_for_run
from slimwise_train.utils import distributed as du
from slimwise_train.utils.distributed import full_shape
from slimwise_train.utils.atomic import write_json_atomic, write_text_atomic
from slimwise_train.utils.hf import text_config
from slimwise_train.utils.rundir import check_outputs_spare_inputs, claim_output_dir

log = logging.getLogger("slimwise.train")

# Everything a run writes into its output_dir (resume=never moves an earlier run's into replaced/<time>/, checkpoints
# first): keep this list in step with the writers below (tests/test_checkpoint.py trains and compares).
RUN_OUTPUTS = ("checkpoints", "metrics.jsonl", "summary.json", "train_config.yaml", "keep_set.json", "loss_curve.png",
               "student_trainable.safetensors", "adapter", "export", "wandb", "wandb_run_id")


class NonFiniteLossError(RuntimeError):
    """Too many consecutive non-finite losses; the last complete checkpoint is untouched."""


def validate_train_config(cfg) -> None:
    """Everything the config alone can show wrong, before anything is created or loaded (the first thing `setup`
    does): unknown keys, values no run can use (distill.optim.lr <= 0, zero steps, an unknown loss term or a negative
    weight, ...), a data source that is neither a recipe, a local file or folder nor a hub id."""
    from slimwise_train.data.loading import check_source
    from slimwise_train.models import resolve_path
    from slimwise_train.prune.criteria import validate_prune_config

    check_known_keys(cfg, TrainAppConfig)
    if cfg.model.get("device_map"):
        raise ValueError("model.device_map is for prune/eval (one model over a node's GPUs); training partitions the "
                         "model with engine=zero3: drop model.device_map")
    d = cfg.distill
    check_loss_config(d.loss)  # an unknown term names the known ones
    check_distill_config(d)
    check_data_config(cfg.data, "data")
    check_source(cfg.data.source, "data")
    if not cfg.prune.keep_set:  # the keep set is scored now, on the calibration data
        validate_prune_config(cfg.prune)
        check_data_config(cfg.calibration, "calibration")
        check_source(cfg.calibration.source, "calibration")
    validate_engine_config(cfg.engine, d)
    B.SplitRule.from_config(d.split)
    lora_from_config(d.trainable)  # a bad distill.trainable preset or override fails before the model loads
    # e.g. model.path=<this output_dir>/export (distilling on from a run's export into its own folder): the end of the
    # run would write its export over the model it trains on
    out = Path(cfg.output_dir)
    check_outputs_spare_inputs(
        {name: out / name for name in RUN_OUTPUTS if name != "checkpoints"},
        {"model.path": resolve_path(cfg.model.path), "model.tokenizer": resolve_path(cfg.model.tokenizer),
         "data.source": cfg.data.source, "calibration.source": cfg.calibration.source,
         "prune.scores": cfg.prune.scores})


def _shown(value) -> str:
    """A value as the command line writes it (a dict of loss terms as {ce: 0.1, kl: 0.9})."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {v:g}" if isinstance(v, float) else f"{k}: {v}" for k, v in value.items()) + "}"
    return str(value)


def _digest(tensors) -> str:
    h = hashlib.sha256()
    for name, t in tensors:
        h.update(name.encode())
        h.update(t.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class StepHooks:
    """The points where a test injects a fault into a run (slimwise_train/testing/faults.py); here they do nothing."""

    def loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        """A micro-batch's loss in step `step` (0-based), before the finiteness check and backward."""
        return loss

    def before_checkpoint_publish(self, step: int):
        """Called (rank 0) once checkpoint `step`'s files are written, before its folder is published; None: nothing."""
        return None

    def after_step(self, step: int) -> None:
        """After `step` steps are done (metrics, eval and checkpoint of that step included)."""


class Trainer:
    def __init__(self, cfg, hooks: StepHooks | None = None, keep_student: bool = True):
        """keep_student=False: nothing uses `self.student` after `train()` (the app's run, `run_train`), so the
        export folds the trained student into its own weights instead of a copy of them (no second model in
        memory); the student is then the exported decoder, no longer the student."""
        self.cfg = cfg
        self.keep_student = keep_student
        if hooks is None and cfg.get("extra"):  # faults named on the command line (+extra.kill_after_step=5, ...)
            from slimwise_train.testing.faults import FaultHooks

            hooks = FaultHooks.from_config(cfg.extra)
        self.hooks = hooks or StepHooks()
        self.objective: Objective | None = None  # distill.loss, built once the config is validated
        self.output_dir = Path(cfg.output_dir)
        self.step = 0
        self.nan_streak = 0
        self.nan_skipped = 0
        self.tokens_seen = 0
        self.last_eval: dict | None = None  # the latest held-out loss (eval/loss, eval/ce, eval/kl, eval/tokens)
        self.engine: Engine | None = None
        self.sink = None
        self.claim = contextlib.ExitStack()
        self.loading = None
        self.frozen_names: list[str] | None = None  # the digest's order, fixed by its first call
        self.requested_keep_set: KeepSet | None = None  # prune.keep_set, read before the model loads

    # ================================================================== setup
    def setup(self) -> "Trainer":
        from slimwise_train.data.loading import check_seq_len
        from slimwise_train.models import load_model, resolve_device

        cfg = self.cfg
        validate_train_config(cfg)
        self.objective = Objective.from_config(cfg.distill.loss)
        # prune.keep_set: the file, its family, exportability, the weights it was scored on and the run folder's own
        # keep set are checked now, before the folder is claimed and the model loads.
        self.requested_keep_set = self._precheck_keep_set()
        du.init_if_launched(cfg.engine.backend)
        self.rank, self.world_size = du.rank(), du.world_size()
        if du.is_rank0():
            # Before loading anything: an unwritable folder, or one a live job holds, fails now, not at the first save.
            # The folder stays claimed (locked) until close().
            self.claim.enter_context(claim_output_dir(self.output_dir))
        self.device = resolve_device(cfg.device)
        if self.device.type == "cuda":
            self.device = torch.device("cuda", du.cuda_index())
        elif cfg.cpu_threads:
            torch.set_num_threads(int(cfg.cpu_threads))
        torch.manual_seed(cfg.seed)
        self.t_setup = time.perf_counter()

        # ---- model, keep set, the one student/teacher module
        # engine=zero3: the DeepSpeed config exists before the model, which loads partitioned (no rank holds it whole)
        if cfg.engine.name == "zero3":
            from slimwise_train.models import load_config

            self.loading = partitioned_loading(cfg.engine, cfg.distill, int(cfg.data.batch_size), self.device,
                                               load_config(cfg.model).hidden_size)
        model, self.tokenizer = load_model(cfg.model, self.device, partition=self.loading)
        check_seq_len(cfg.data, model)
        self.vocab_size = full_shape(model.get_output_embeddings().weight)[0]
        self.keep_set = self._resolve_keep_set(model)
        if self.requested_keep_set is None:  # scored now: checked as soon as it exists, before data or any write
            if cfg.distill.export:
                check_exportable(self.keep_set, model.config, f"the keep set scored with prune.scope={cfg.prune.scope}",
                                 "distill.export")
            check_run_folder(self.output_dir, self.keep_set, str(cfg.resume))
        self.student = DistillModel(model, self.keep_set, StudentSpec.from_config(cfg.distill, seed=cfg.seed),
                                    recompute=str(cfg.distill.memory.recompute))
        self.counts = self.student.parameter_counts()
        self.single_pass = self._teacher_single_pass()
        log.info("prefix cache: %s (distill.split.prefix_from)", "the student's own prefill, with gradients"
                 if self._student_prefix() else "the teacher's prefill")
        # The same digest at the end proves the teacher unchanged. Unpartitioned it is taken now; partitioned, once
        # the engine can gather the parameters.
        self.frozen_digest = (self._frozen_digest() if cfg.distill.check_frozen and self.loading is None else None)
        log.info(
            "trainable parameters: %d of %d (%.3f%%): routers %d, norms %d (%d modules), shared experts %d, LoRA %d "
            "(shared_expert_mode %s, trainable %s)",
            self.counts["trainable"], self.counts["total"], 100 * self.counts["trainable"] / self.counts["total"],
            self.counts["router"], self.counts["norm"], len(self.student.norm_names), self.counts["shared_expert"],
            self.counts["lora"], self.student.spec.shared_expert_mode, preset_name(self.student.spec.lora),
        )

        # ---- data
        self.rule = B.SplitRule.from_config(cfg.distill.split)
        train_pairs, eval_pairs = self._load_pairs()
        self.train_seqs, self.num_too_short = self._encode(train_pairs, cfg.data.split)
        self.eval_seqs, self.num_eval_too_short = self._encode(eval_pairs, cfg.distill.eval.split)
        if len(self.eval_seqs) < self.world_size:
            raise ValueError(f"{len(self.eval_seqs)} held-out sequences for {self.world_size} ranks; raise "
                             "distill.eval.samples")
        micro_batch = int(cfg.data.batch_size)
        global_batch = self.world_size * int(cfg.distill.schedule.grad_accum) * micro_batch
        plan = B.DataPlan(self.train_seqs, self.rule, global_batch,
                          data_seed=int(cfg.data.seed), split_seed=int(cfg.seed),
                          bucket_windows=int(cfg.distill.split.bucket_windows), shuffle=bool(cfg.data.shuffle))
        self._use_plan(plan, micro_batch)
        self.data_fingerprint = B.data_fingerprint(self.train_seqs)
        log.info("data: %d training sequences (%d too short to split, skipped), %d eval; global batch %d = %d rank(s) "
                 "x %d accumulation x %d", len(self.train_seqs), self.num_too_short, len(self.eval_seqs),
                 self.global_batch, self.world_size, self.grad_accum, self.micro_batch)

        # ---- engine (wraps the module; DeepSpeed partitions it here under ZeRO-3)
        self.engine = build_engine(cfg.engine, cfg.distill, self.student, self.micro_batch, self.device, self.loading)
        if self.loading is not None and cfg.distill.check_frozen:
            self.frozen_digest = self._frozen_digest()

        # ---- resume, run folder, logging (rank 0 writes)
        self.checkpoint_root = self.output_dir / "checkpoints"
        resume_from = resolve_resume(str(cfg.resume), self.checkpoint_root)
        if resume_from is not None:
            self._resume(resume_from)
        resolved = to_container(cfg)
        if du.is_rank0():
            if str(cfg.resume) == "never":  # start over: no later resume=auto may find the earlier run's checkpoints
                set_aside_previous_run(self.output_dir, RUN_OUTPUTS)
            self.output_dir.mkdir(parents=True, exist_ok=True)
            write_text_atomic(self.output_dir / "train_config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
            self.keep_set.save(self.output_dir / "keep_set.json")
        self.sink = build_sink(cfg.logger, self.output_dir, resolved, self.step if resume_from is not None else None)
        self.sink.summary({
            "trainable_params": self.counts["trainable"], "total_params": self.counts["total"],
            "trainable_share": self.counts["trainable"] / self.counts["total"],
            "num_too_short": self.num_too_short, "prefix_from": str(cfg.distill.split.prefix_from),
        })
        du.barrier()
        self.setup_seconds = time.perf_counter() - self.t_setup
        return self

    @classmethod
    def from_components(cls, cfg, *, student: DistillModel, engine: Engine, plan: B.DataPlan, tokenizer,
                        device: torch.device | str, micro_batch: int, rank: int = 0, world_size: int = 1,
                        hooks: StepHooks | None = None) -> "Trainer":
        """A trainer over parts built elsewhere, ready for `train_step` (no files, no logger, no resume): the student
        over its teacher, its engine, the data plan (its sequences, split rule and global batch), a tokenizer (only its
        pad_token_id is read). `cfg` needs `distill` and `output_dir`. bench/train.py times the real step this way;
        `setup()` builds the same parts from the config."""
        trainer = cls(cfg, hooks)
        trainer.objective = Objective.from_config(cfg.distill.loss)
        trainer.rank, trainer.world_size, trainer.device = rank, world_size, torch.device(device)
        trainer.student, trainer.engine, trainer.tokenizer = student, engine, tokenizer
        trainer._use_plan(plan, micro_batch)
        trainer.single_pass = trainer._teacher_single_pass()
        return trainer

    def _use_plan(self, plan: B.DataPlan, micro_batch: int) -> None:
        """The data plan and the batch sizes it implies (global = world_size x distill.schedule.grad_accum x
        micro_batch)."""
        self.plan, self.rule, self.train_seqs = plan, plan.rule, plan.sequences
        self.micro_batch, self.grad_accum = micro_batch, int(self.cfg.distill.schedule.grad_accum)
        self.global_batch = plan.global_batch
        if self.global_batch != self.world_size * self.grad_accum * self.micro_batch:
            raise ValueError(f"the data plan's global batch {self.global_batch} is not world_size {self.world_size} x "
                             f"distill.schedule.grad_accum {self.grad_accum} x micro batch {self.micro_batch}")

    def _load_pairs(self):
        """(train pairs, held-out pairs), disjoint. When distill.eval.split is the training split, or the source is a
        local file or folder (which has no named splits), the held-out rows are cut off the end of one shuffled read,
        so they never appear in training. A separate split that shares rows with the training read is refused."""
        from slimwise_train.data.loading import has_named_splits, load_pairs

        data_cfg, n_train, n_eval = self.cfg.data, int(self.cfg.data.num_samples), int(self.cfg.distill.eval.samples)
        eval_split = self.cfg.distill.eval.split
        if eval_split != data_cfg.split and not has_named_splits(data_cfg.source):
            log.info("data %s has no named splits: holding out %d rows of it for distill.eval.split=%s",
                     data_cfg.source, n_eval, eval_split)
        elif eval_split != data_cfg.split:
            train = load_pairs(data_cfg, key="data")
            held_out = load_pairs(data_cfg, split=eval_split, num_samples=n_eval, key="data")
            seen = set(train)
            shared = sum(p in seen for p in held_out)
            if shared:
                raise ValueError(
                    f"{shared} of {len(held_out)} held-out rows (distill.eval.split={eval_split}) are also training "
                    f"rows of split {data_cfg.split}; set distill.eval.split={data_cfg.split} to hold out rows of the "
                    "training read instead")
            return train, held_out
        pairs = load_pairs(data_cfg, num_samples=n_train + n_eval, key="data")
        if len(pairs) <= n_eval:
            raise ValueError(f"data source {data_cfg.source!r} has {len(pairs)} rows, not enough to hold out "
                             f"distill.eval.samples={n_eval} for evaluation")
        return pairs[:-n_eval], pairs[-n_eval:]

    def _encode(self, pairs, split: str):
        """Token sequences ((ids, prompt_len) or (ids, prompt_len, supervised), data/loading.py) that can be split,
        and the count of the ones too short to split (or with no loss target after the lowest split point)."""
        from slimwise_train.data.loading import encode_all

        # The assistant turns are looked for unless nothing reads them (every token a target, no split after the prompt)
        find_turns = str(self.cfg.data.supervise) != "all" or self.rule.after_prompt
        encoded = encode_all(self.tokenizer, pairs, self.cfg.data, find_turns=find_turns, key="data")
        top = max(max(sequence[0]) for sequence in encoded)
        if top >= self.vocab_size:
            raise ValueError(
                f"data split {split!r} has token id {top} but the model's vocabulary has {self.vocab_size} entries; "
                "the tokenizer does not belong to this model (model.tokenizer)"
            )
        kept, too_short = B.filter_splittable(encoded, self.rule)
        if not kept:
            raise ValueError(
                f"all {len(encoded)} sequences of split {split!r} are too short to split (need at least "
                f"min_split + min_continuation = {self.rule.min_split + self.rule.min_continuation} tokens"
                f"{' after the prompt' if self.rule.after_prompt else ''}); raise data.seq_len or lower the minimums"
            )
        return kept, too_short

    def _resolve_keep_set(self, model) -> KeepSet:
        """prune.keep_set (a keep_set.json), or scored now by the prune stage's own scoring (what makes a ratio sweep
        work) on the calibration data."""
        from slimwise_train.prune.scoring import score_keep_set

        cfg = self.cfg
        if self.requested_keep_set is not None:  # prune.keep_set, loaded and checked by _precheck_keep_set
            check_fits(self.requested_keep_set, model, f"prune.keep_set={cfg.prune.keep_set}")
            return self.requested_keep_set
        prune_cfg = OmegaConf.create({"model": to_container(cfg.model), "data": to_container(cfg.calibration),
                                      "prune": to_container(cfg.prune), "progress": bool(cfg.progress)})
        keep_set = score_keep_set(model, self.tokenizer, prune_cfg, data_key="calibration",
                                  loading=self.loading).keep_set
        log.info("keep set: %s by %s at ratio %s (statistics: %s)", list(keep_set.num_kept), cfg.prune.criterion,
                 cfg.prune.ratio, keep_set.meta["statistics"])
        return keep_set

    # ------------------------------------------------------------------ keep set checks (before anything is written)
    def _precheck_keep_set(self) -> KeepSet | None:
        """prune.keep_set if this run may use it (moe/keepset_rules.py: the file, its family, exportability, the weights
        it was scored on) and the run folder may continue with it (distill/checkpoint.py), checked with the model's
        config and weight files only. None when the keep set is scored in this run."""
        from slimwise_train.models import load_config, model_weights

        cfg = self.cfg
        if not cfg.prune.keep_set:
            return None
        keep_set = keep_set_for_run(cfg.prune.keep_set, "prune.keep_set", config=load_config(cfg.model),
                                    model=model_weights(cfg.model),
                                    allow_foreign=bool(cfg.distill.allow_foreign_keep_set),
                                    allow_key="distill.allow_foreign_keep_set",
                                    export_key="distill.export" if cfg.distill.export else None)
        check_run_folder(self.output_dir, keep_set, str(cfg.resume))
        return keep_set

    def _frozen_digest(self) -> str:
        """sha256 over every frozen tensor's bytes, one parameter at a time (ZeRO-3 gathers each in turn)."""
        params = dict(self.student.named_parameters())
        # In the order of the first call, not named_parameters' current one: a student forward re-registers every
        # LoRA-adapted expert tensor at the end of its module (peft's parametrization is removed after each call),
        # which reorders GPT-OSS's tensors and biases and would change the digest of unchanged weights.
        if self.frozen_names is None:
            self.frozen_names = [name for name, param in params.items() if not param.requires_grad]
        h = hashlib.sha256()
        for name in self.frozen_names:
            param = params[name]
            with self.engine.gathered_parameters([param]) if self.engine is not None else contextlib.nullcontext():
                h.update(name.encode())
                h.update(param.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    def _trainer_state(self) -> dict:
        return {
            "step": self.step,
            "data_position": self.plan.position(self.step),
            "global_batch": self.global_batch,
            "data_fingerprint": self.data_fingerprint,
            "num_too_short": self.num_too_short,
            "nan_streak": self.nan_streak,
            "nan_skipped": self.nan_skipped,
            "tokens_seen": self.tokens_seen,
            "world_size": self.world_size,
            "engine": self.cfg.engine.name,
            "frozen_digest": self.frozen_digest,
            "keep_set": self.keep_set.to_dict(),  # a rerun of this folder with another keep set is refused
            "prefix_from": str(self.cfg.distill.split.prefix_from),  # another training objective: resume is refused
            "loss_terms": self._loss_terms(),  # another objective too (distill.loss.terms)
            "schedule": self._schedule(),  # a resume with another one re-plans the learning rate: said in one line
            "lr": self.engine.lr(),  # the learning rate of the next step under that schedule
        }

    def _schedule(self) -> dict:
        """distill.schedule's keys that shape the learning rate over the steps (engine.lr_lambda)."""
        schedule = self.cfg.distill.schedule
        return {"max_steps": int(schedule.max_steps), "warmup_steps": int(schedule.warmup_steps),
                "min_lr_ratio": float(schedule.min_lr_ratio)}

    def _loss_terms(self) -> dict[str, float]:
        """distill.loss.terms as trained: {name: weight} of the terms on (a weight of 0 is off, the same as absent)."""
        terms = OmegaConf.select(self.cfg, "distill.loss.terms", default=None) or {}
        return {str(name): float(weight) for name, weight in sorted(dict(terms).items()) if float(weight) != 0}

    def _resume(self, path: Path) -> None:
        state = json.loads((path / "trainer_state.json").read_text())
        # Another student first (e.g. a run from before the no-module default, which trained a new shared expert on
        # the families without a slot): it would fail with a KeyError under engine=torch and load partly under
        # DeepSpeed, and LoRA's wrappers rename the frozen tensors, so the frozen digest below would blame the weights.
        with safe_open(str(path / "trainable.safetensors"), "pt") as handle:
            saved = set(handle.keys())
        mine = {name for name, _ in self.student.trainable_named_parameters()}
        if saved != mine:
            raise ValueError(
                f"cannot resume from {path}: it trained another student ({len(saved - mine)} tensors not in this one, "
                f"e.g. {sorted(saved - mine)[:1]}; {len(mine - saved)} missing, e.g. {sorted(mine - saved)[:1]}); "
                "set distill.student.shared_expert_mode and distill/trainable to what that run trained (before the "
                "no-module default, auto on a family without a slot meant distill.student.shared_expert_mode=new with "
                "distill/trainable=always_on), or use resume=never"
            )
        # (name in the error, key in trainer_state.json, this run's value): the state's keys stay those of the
        # checkpoints already written (prefix_from, not the config path distill.split.prefix_from).
        expected = [("global_batch", "global_batch", self.global_batch),
                    ("data_fingerprint", "data_fingerprint", self.data_fingerprint),
                    ("engine.name", "engine", self.cfg.engine.name),
                    ("distill.split.prefix_from", "prefix_from", str(self.cfg.distill.split.prefix_from))]
        if "loss_terms" in state:  # checkpoints from before it was recorded: unknown, not checked
            expected.append(("distill.loss.terms", "loss_terms", self._loss_terms()))
        if self.frozen_digest is not None and state.get("frozen_digest") is not None:
            expected.append(("frozen_digest", "frozen_digest", self.frozen_digest))  # another teacher (or weights)
        # Checkpoints from before distill.split.prefix_from existed were all trained on the teacher's prefix cache.
        state = {"prefix_from": "teacher", **state}
        mismatch = [(name, _shown(state.get(k)), _shown(v)) for name, k, v in expected if state.get(k) != v]
        if mismatch:
            raise ValueError(
                f"cannot resume from {path}: it was written with "
                + ", ".join(f"{name}={a} (now {b})" for name, a, b in mismatch)
                + "; use resume=never or another output folder"
            )
        planned = state.get("schedule")  # checkpoints from before it was recorded: unknown, nothing to say
        state = load_checkpoint(path, self.engine)
        self.step = int(state["step"])
        if planned is not None and planned != self._schedule():
            self._say_schedule_replanned(planned, state.get("lr"))
        self.nan_streak, self.nan_skipped = int(state["nan_streak"]), int(state["nan_skipped"])
        self.tokens_seen = int(state["tokens_seen"])
        log.info("resumed from %s at step %d", path, self.step)

    def _say_schedule_replanned(self, planned: dict, planned_lr: float | None) -> None:
        """A resume under another distill.schedule (a larger max_steps, to train on) re-plans the learning rate from
        the resumed step: one line with what changed and the learning rate it jumps between."""
        from slimwise_train.distill.engine import lr_lambda

        now = self._schedule()
        changed = ", ".join(f"{key} {planned.get(key)} -> {value}" for key, value in now.items()
                            if planned.get(key) != value)
        new_lr = float(self.cfg.distill.optim.lr) * lr_lambda(now["warmup_steps"], now["max_steps"],
                                                              now["min_lr_ratio"])(self.step)
        jump = f" (lr {planned_lr:.3g} -> {new_lr:.3g})" if planned_lr is not None else f" (lr now {new_lr:.3g})"
        log.warning("resuming at step %d under another distill.schedule (%s): the learning-rate schedule is re-planned "
                    "from this step%s", self.step, changed, jump)

    # ================================================================== one step
    def _micro_batches(self, step: int) -> tuple[list[B.ContinuationBatch], list[float]]:
        indices, splits = self.plan.step_batch(step)
        seqs = [self.train_seqs[i] for i in indices]
        plan = B.plan_micro_batches(seqs, splits, self.world_size, self.grad_accum)[self.rank]
        pad = self.tokenizer.pad_token_id
        micro = [B.continuation_batch([seqs[i] for i in mb], [splits[i] for i in mb], pad) for mb in plan]
        fractions = [s / len(sequence[0]) for sequence, s in zip(seqs, splits)]  # whole global step: known on every rank
        return micro, fractions

    def _teacher_single_pass(self) -> bool:
        """One teacher forward over prefix + continuation, then the cache cropped to the prefix: exact for full
        attention (a causal forward over prefix + continuation computes the prefix's K/V as the prefix pass does);
        sliding-window and linear-attention cache layers cannot be cropped back, so they keep the two passes."""
        wanted = self.cfg.distill.memory.teacher_single_pass
        kinds = set(cache_layer_kinds(self.student.model))
        possible = kinds == {"DynamicLayer"}
        if wanted and not possible:
            raise ValueError(f"distill.memory.teacher_single_pass=true needs full-attention KV caches, this model has "
                             f"{', '.join(sorted(kinds))}; use distill.memory.teacher_single_pass=null")
        return possible if wanted is None else bool(wanted)

    def _student_prefix(self) -> bool:
        """distill.split.prefix_from=student: the student prefills the prefix itself (read from the config, so a trainer
        assembled without setup(), as bench/train.py does, follows it too)."""
        return str(OmegaConf.select(self.cfg, "distill.split.prefix_from", default="teacher")) == "student"

    def _forward_pair(self, batch: B.ContinuationBatch):
        """Teacher target logits and student logits [B, L, V] for one micro-batch (student keeps its graph).

        The teacher's targets are the full model over the whole sequence, computed the same way whatever
        distill.split.prefix_from says (one pass over prefix + continuation, or prefill then continuation), so both
        settings train on bit-identical targets. The prefix the student continues on:
          teacher: the teacher's prefill (no grad) -> KV cache, the SlimWise handoff;
          student: the student's own: see `_student_on_own_prefix`.
        """
        P, L = batch.prefix_ids.shape[1], batch.cont_ids.shape[1]
        own_prefix = self._student_prefix()
        cache = DynamicCache(config=text_config(self.student.model))
        cont_positions = positions_from_mask(batch.full_mask, P, L)
        if self.single_pass:
            with torch.no_grad():
                teacher_logits = self.engine.forward(
                    "teacher", input_ids=torch.cat([batch.prefix_ids, batch.cont_ids], dim=1),
                    attention_mask=batch.full_mask, position_ids=positions_from_mask(batch.full_mask),
                    past_key_values=cache, logits_to_keep=L)
            if own_prefix:
                del cache  # the teacher's K/V are not the student's
                return teacher_logits, self._student_on_own_prefix(batch)
            cache.crop(-L)  # back to the prefix: remove the L continuation tokens
            student_logits = self.engine.forward("student", input_ids=batch.cont_ids, attention_mask=batch.full_mask,
                                                 position_ids=cont_positions, past_key_values=cache)
            return teacher_logits, student_logits
        with torch.no_grad():
            # Only the cache is needed from the prefill: skip the [B, P, V] logits (600 MB a row at 2k x 152k bf16).
            self.engine.forward("teacher", input_ids=batch.prefix_ids, attention_mask=batch.prefix_mask,
                                position_ids=positions_from_mask(batch.prefix_mask), past_key_values=cache,
                                logits_to_keep=1)
            # The forward extends the cache in place: the teacher continues on a copy, the student on the original
            # (with the student's own prefix the teacher's cache has no other use: no copy).
            teacher_logits = self.engine.forward("teacher", input_ids=batch.cont_ids, attention_mask=batch.full_mask,
                                                 position_ids=cont_positions,
                                                 past_key_values=cache if own_prefix else copy_cache(cache))
        if own_prefix:
            del cache
            return teacher_logits, self._student_on_own_prefix(batch)
        make_cache_autograd_safe(cache)  # hybrid linear-attention caches update state in place otherwise
        student_logits = self.engine.forward("student", input_ids=batch.cont_ids, attention_mask=batch.full_mask,
                                             position_ids=cont_positions, past_key_values=cache)
        return teacher_logits, student_logits

    def _student_on_own_prefix(self, batch: B.ContinuationBatch) -> torch.Tensor:
        """distill.split.prefix_from=student: the student's logits [B, L, V] on the continuation after its OWN prefill
        of the prefix, with gradients through that prefill.

        Computed as ONE causal student forward over the left-padded prefix + right-padded continuation (no cache, the
        last L logits kept): the K/V it computes for the prefix positions are exactly the ones the student's prefill
        of the prefix writes to its cache, and the continuation attends to them as it would on that cache, for every
        cache kind (full, sliding-window, linear attention: nothing is cropped). tests/test_prefix_from.py checks it
        against the literal prefill -> cache -> continuation. One call per module instead of two also matters under
        ZeRO-3: a z3 leaf module (expert LoRA) reduces its gradients once per call in backward, so a second call
        with gradients would reduce them twice. Gradients flow through the prefix positions (the student is trained
        end to end as the pruned model on the whole sequence, as it runs when it serves both phases); the loss
        positions stay the continuation's (the prefix logits are not computed)."""
        L = batch.cont_ids.shape[1]
        return self.engine.forward("student", input_ids=torch.cat([batch.prefix_ids, batch.cont_ids], dim=1),
                                   attention_mask=batch.full_mask, position_ids=positions_from_mask(batch.full_mask),
                                   use_cache=False, logits_to_keep=L)

    def _all_reduce(self, values: list[float], op=None) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device if self.device.type == "cuda" else "cpu")
        if du.is_initialized() and self.world_size > 1:
            torch.distributed.all_reduce(t, op=op or torch.distributed.ReduceOp.SUM)
        return t.tolist()

    def train_step(self, step: int) -> dict:
        t0 = time.perf_counter()
        micro, fractions = self._micro_batches(step)
        local_tokens = sum(b.num_loss_tokens for b in micro)
        num_tokens_global = int(self._all_reduce([local_tokens])[0])
        sums: dict[str, float] = {}  # every term's sum (and what the terms report beside them), over micro-batches
        stats = dict.fromkeys(("cont_tokens", "cont_slots", "prefix_tokens", "prefix_slots", "loss_tokens"), 0)
        finite = True
        for index, batch in enumerate(micro):
            batch.to(self.device)
            teacher_logits, student_logits = self._forward_pair(batch)
            out = self.objective(student_logits, teacher_logits, batch.labels, num_tokens_global=num_tokens_global)
            loss = self.hooks.loss(step, out.loss)
            # Every rank must agree before anyone calls backward (DDP / DeepSpeed collectives inside it).
            finite = self._all_reduce([float(torch.isfinite(loss.detach()))], torch.distributed.ReduceOp.MIN)[0] == 1.0
            if not finite:
                break
            self.engine.backward(loss, last_micro_batch=index == len(micro) - 1)
            for name, value in out.sums.items():
                sums[name] = sums.get(name, 0.0) + float(value)
            for key, value in batch.stats().items():
                stats[key] += value
            del teacher_logits, student_logits, out, loss

        if not finite:
            return self._skip_nan_step(step, index)
        grad_norm = self.engine.step()
        self.nan_streak = 0
        # ---- metrics: global sums over ranks, one all-reduce (every rank computed the same terms, in one order)
        keys = list(sums) + list(stats)
        totals = dict(zip(keys, self._all_reduce([sums[k] for k in sums] + [stats[k] for k in stats])))
        seconds = time.perf_counter() - t0
        n = max(num_tokens_global, 1)
        means = {name: totals[name] / n for name in sums}  # each term by its name (ce, kl, ...), per loss token
        self.tokens_seen += int(totals["cont_tokens"])
        return {
            "loss": self.objective.total(means),
            **means,
            "grad_norm": grad_norm,
            "lr": self.engine.lr(),
            "loss_tokens": num_tokens_global,
            # Student compute is spent on continuation slots only; the padding share is the waste.
            "student_pad_share": 1.0 - totals["cont_tokens"] / max(totals["cont_slots"], 1),
            "teacher_prefix_pad_share": 1.0 - totals["prefix_tokens"] / max(totals["prefix_slots"], 1),
            "cont_tokens_per_s": totals["cont_tokens"] / seconds,
            "tokens_per_s": (totals["cont_tokens"] + totals["prefix_tokens"]) / seconds,
            "step_seconds": seconds,
            "nan_skipped": self.nan_skipped,
            "_split_fractions": fractions,
        }

    def _skip_nan_step(self, step: int, micro_index: int) -> dict:
        if not self.engine.supports_partial_skip:
            raise NonFiniteLossError(
                f"non-finite loss at step {step + 1} (micro-batch {micro_index}) with engine={self.cfg.engine.name} "
                f"and distill.schedule.grad_accum={self.grad_accum}: DeepSpeed cannot drop a partly accumulated step, "
                "so the run stops here; the last complete checkpoint is untouched (lower distill.optim.lr or use "
                "distill.schedule.grad_accum=1)"
            )
        self.engine.skip_step()
        self.nan_streak += 1
        self.nan_skipped += 1
        log.warning("step %d: non-finite loss, step skipped (%d in a row, limit %d)", step + 1, self.nan_streak,
                    self.cfg.distill.schedule.max_nan_steps)
        if self.nan_streak >= int(self.cfg.distill.schedule.max_nan_steps):
            raise NonFiniteLossError(
                f"{self.nan_streak} consecutive steps with a non-finite loss (distill.schedule.max_nan_steps="
                f"{self.cfg.distill.schedule.max_nan_steps}); stopping. The last complete checkpoint is untouched; "
                "lower distill.optim.lr or distill.optim.grad_clip, or check the data"
            )
        return {"nan_skipped": self.nan_skipped, "skipped": 1}

    # ================================================================== evaluation
    @torch.no_grad()
    def evaluate(self) -> dict:
        """Held-out loss with fixed split points (stream 1 of the split seed), up to distill.eval.batches per rank.

        Every rank gets the same number of sequences (ZeRO-3 forwards are collective), dealt round-robin."""
        splits = B.sample_splits(self.eval_seqs, self.rule, B.split_generator(int(self.cfg.seed), 0, stream=1))
        per_rank = min(int(self.cfg.distill.eval.batches) * self.micro_batch, len(self.eval_seqs) // self.world_size)
        mine = list(range(self.rank, len(self.eval_seqs), self.world_size))[:per_rank]
        sums: dict[str, float] = {}
        tokens = 0.0
        for start in range(0, len(mine), self.micro_batch):
            chunk = mine[start : start + self.micro_batch]
            batch = B.continuation_batch([self.eval_seqs[i] for i in chunk], [splits[i] for i in chunk],
                                         self.tokenizer.pad_token_id).to(self.device)
            teacher_logits, student_logits = self._forward_pair(batch)
            out = self.objective(student_logits, teacher_logits, batch.labels)
            for name, value in out.sums.items():
                sums[name] = sums.get(name, 0.0) + float(value)
            tokens += float(out.num_tokens)
        *totals, tokens = self._all_reduce([*sums.values(), tokens])
        n = max(tokens, 1.0)
        means = {name: total / n for name, total in zip(sums, totals)}
        return {"eval/loss": self.objective.total(means), **{f"eval/{k}": v for k, v in means.items()},
                "eval/tokens": tokens}

    # ================================================================== loop
    def train(self) -> dict:
        cfg, d = self.cfg, self.cfg.distill
        max_steps = int(d.schedule.max_steps)
        self.sink.log(self.step, {"trainable_params": self.counts["trainable"],
                                  "trainable_share": self.counts["trainable"] / self.counts["total"],
                                  "num_too_short": self.num_too_short})
        if self.step == 0:
            self._log_eval()  # the untrained student = the masked model
        t_train = time.perf_counter()
        first_step = self.step
        history: list[dict] = []
        step_seconds: list[float] = []  # completed (not skipped) steps of this run
        window_fractions: list[float] = []
        window_losses: list[dict] = []  # the steps since the last console line
        losses = ["loss", *self.objective.terms]  # what the history and the console show: the loss and each term
        # a context: an error mid-training ends the bar's line first, so the one error line stands on its own
        with tqdm(total=max_steps, initial=self.step, desc="distill", unit="step", dynamic_ncols=True,
                  disable=not (cfg.progress and du.is_rank0())) as bar:
            while self.step < max_steps:
                metrics = self.train_step(self.step)
                self.step += 1
                if "loss" in metrics:  # before update(), which draws it: after it the bar shows the previous step's loss
                    bar.set_postfix(loss=f"{metrics['loss']:.4f}", refresh=False)
                bar.update(1)
                window_fractions += metrics.pop("_split_fractions", [])
                if "step_seconds" in metrics:
                    step_seconds.append(metrics["step_seconds"])
                history.append({"step": self.step, **{k: metrics[k] for k in losses if k in metrics}})
                if "loss" in metrics:
                    window_losses.append(metrics)
                if self.step % int(d.log_every) == 0 or self.step == max_steps or self.step == first_step + 1:
                    self.sink.log(self.step, metrics, {"split_fraction": window_fractions})
                    window_fractions = []
                    if window_losses:
                        # One step's loss swings by orders of magnitude with its continuation lengths (a step of 21
                        # loss tokens read 2.6e-6): the console shows the mean since the last line; metrics.jsonl
                        # keeps every step.
                        mean = {k: sum(m[k] for m in window_losses) / len(window_losses) for k in losses}
                        log.info("step %d/%d train loss %.5f (%s; mean of %d steps) grad %.3g lr %.3g pad %.2f %.0f "
                                 "tok/s", self.step, max_steps, mean["loss"], _terms_text(mean, losses[1:]),
                                 len(window_losses), metrics.get("grad_norm", float("nan")), metrics["lr"],
                                 metrics["student_pad_share"], metrics["cont_tokens_per_s"])
                        window_losses = []
                if self.step % int(d.eval.every) == 0 or self.step == max_steps:
                    self._log_eval()
                if self.step % int(d.checkpoint.every) == 0 or self.step == max_steps:
                    hook = self.hooks.before_checkpoint_publish(self.step) if du.is_rank0() else None
                    save_checkpoint(self.checkpoint_root, self.step, self.engine, self._trainer_state(),
                                    int(d.checkpoint.keep), before_rename=hook)
                self.hooks.after_step(self.step)
        train_seconds = time.perf_counter() - t_train
        return self._finish(history, train_seconds, first_step, step_seconds)

    def _log_eval(self) -> None:
        self.last_eval = self.evaluate()
        self.sink.log(self.step, self.last_eval)
        if "eval/loss" in self.last_eval:
            means = {name: self.last_eval[f"eval/{name}"] for name in self.objective.terms}
            log.info("step %d held-out loss %.5f (%s)", self.step, self.last_eval["eval/loss"],
                     _terms_text(means, self.objective.terms))

    def _finish(self, history, train_seconds: float, first_step: int, step_seconds: list[float]) -> dict:
        if self.last_eval is None:  # resumed from the final checkpoint: no step ran, so measure the end state once
            self.last_eval = self.evaluate()
        trainable = self.engine.trainable_state_dict()
        frozen_now = self._frozen_digest() if self.frozen_digest is not None else None
        summary = {
            "steps": self.step,
            "steps_this_run": self.step - first_step,
            "train_seconds": train_seconds,
            "setup_seconds": self.setup_seconds,
            "engine": self.cfg.engine.name,
            "world_size": self.world_size,
            "trainable_params": self.counts["trainable"],
            "total_params": self.counts["total"],
            "trainable_share": self.counts["trainable"] / self.counts["total"],
            "num_too_short": self.num_too_short,
            "nan_skipped": self.nan_skipped,
            "tokens_seen": self.tokens_seen,
            "step_seconds_mean": sum(step_seconds) / len(step_seconds) if step_seconds else None,
            # The held-out loss at the end (the last evaluation: at max_steps), for sweep dashboards and summary.json
            **self.last_eval,
            "frozen_unchanged": None if frozen_now is None else frozen_now == self.frozen_digest,
            "trainable_digest": _digest(sorted(trainable.items())),
            # Every rank's own copy of the trainable tensors (gathered under ZeRO-3): they must all agree.
            "rank_trainable_digests": gather_objects(_digest(sorted(trainable.items()))),
            "keep_set": list(self.keep_set.num_kept),
            # who prefilled the prefix in training (distill.split.prefix_from): tells the two trainings apart for evals
            "prefix_from": str(self.cfg.distill.split.prefix_from),
            "history": history,  # returned to callers; summary.json leaves it out (metrics.jsonl has every step)
        }
        if du.is_rank0() and self.cfg.distill.export:
            self._export(trainable)
        if du.is_rank0():
            written = {k: v for k, v in summary.items() if k != "history"}
            write_json_atomic(self.output_dir / "summary.json", written)
            self.sink.summary(written)
            self._plot_loss_curve()
        du.barrier()
        return summary

    def _plot_loss_curve(self) -> None:
        """loss_curve.png beside metrics.jsonl: train loss (raw and smoothed) and the held-out loss at each eval."""
        from slimwise_train.distill.curves import plot_training_curves  # written atomically

        metrics = self.output_dir / "metrics.jsonl"
        if not metrics.is_file():
            return
        try:
            plot_training_curves(metrics, self.output_dir / "loss_curve.png")
        except ValueError as exc:  # no loss rows (a resumed run with no step left): nothing to draw
            log.info("no loss curve: %s", exc)
        else:
            log.info("loss curve: %s", self.output_dir / "loss_curve.png")

    def _export(self, trainable: dict) -> None:
        from slimwise_train.distill.export import export_student, load_trainable, save_trainable

        spec = self.student.spec
        prefix_from = str(self.cfg.distill.split.prefix_from)
        path = save_trainable(self.output_dir / "student_trainable.safetensors", trainable, self.keep_set, spec,
                              self.student.model.config.model_type,
                              extra={"steps": self.step, "prefix_from": prefix_from})
        if self.cfg.engine.name == "zero3":
            # The live module is partitioned: rebuild the student on a fresh teacher from the small file, on the host
            # in the run's dtype (bf16 on GPU), not fp32 (a layer-at-a-time gathered export is not done yet).
            from slimwise_train.models import load_model, resolve_dtype

            teacher, _ = load_model(self.cfg.model, "cpu", tokenizer=self.tokenizer,
                                    dtype=resolve_dtype(self.cfg.model.dtype, self.device))
            student = load_trainable(path, teacher)
        else:
            student = self.student
        if spec.lora:  # co-located serving: a peft adapter folder (first: an in-place export merges the LoRA away)
            from slimwise_train.distill.lora import export_adapter

            export_adapter(student, self.output_dir / "adapter", tokenizer=self.tokenizer)
        # in place for a rebuilt student, or for the trained one when nothing uses it after (keep_student=False): no
        # second copy of the weights; the same checkpoint, bitwise (tests/test_student.py, tests/test_trainer.py)
        export_student(student, self.output_dir / "export", tokenizer=self.tokenizer, overwrite=True,
                       in_place=student is not self.student or not self.keep_student, prefix_from=prefix_from)
        log.info("exported the distilled decoder to %s", self.output_dir / "export")

    def close(self) -> None:
        self.claim.close()
        if self.sink is not None:
            self.sink.close()
        if self.engine is not None:
            self.engine.close()
        self.loading = None
        if hasattr(self, "student"):
            self.student.remove_hooks()
        self.engine = self.sink = None


def _terms_text(values: dict, names) -> str:
    """`ce 0.1234 kl 0.004567`: each term's value by name, for the console."""
    return " ".join(f"{name} {values[name]:.4g}" for name in names)


def run_train(cfg, hooks: StepHooks | None = None) -> dict:
    """The whole training job; returns the summary. Importable for tests and notebooks (`hooks`: a test's faults).
    Nothing uses the student after the run: the export folds it in place."""
    trainer = Trainer(cfg, hooks, keep_student=False)
    try:
        trainer.setup()
        return trainer.train()
    finally:
        trainer.close()

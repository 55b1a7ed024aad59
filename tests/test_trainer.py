"""The trainer in one process (engine=torch): a short real run, split points, batches, bad input, NaN handling.

Runs use the tiny Qwen3-MoE (hidden 32, 8 experts, top-2) on the offline synthetic data. "Loss falls" is judged on
the held-out loss (fixed eval batches and split points), which is not subject to batch-to-batch noise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from safetensors.torch import load_file

from slimwise_train.config import register_configs
from slimwise_train.distill import batches as B
from slimwise_train.distill.losses import IGNORE_INDEX
from slimwise_train.distill.trainer import NonFiniteLossError, Trainer, run_train
from slimwise_train.config import CONF_DIR
from slimwise_train.testing.faults import FaultHooks
from slimwise_train.testing.tiny import SUPPORTED_TINY

REPO = Path(__file__).resolve().parents[1]
register_configs()

SMALL = [
    "experiment=tiny_smoke", "logger=none", "resume=never", "distill.optim.lr=2e-2", "distill.schedule.warmup_steps=2",
    "distill.eval.batches=2", "distill.log_every=1",
]



def make_cfg(output_dir, *overrides):
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return compose(config_name="train", overrides=[*SMALL, f"output_dir={output_dir}", *overrides])


def read_metrics(output_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------------------------------------- a real run


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    cfg = make_cfg(out, "distill.schedule.max_steps=16", "distill.eval.every=16", "distill.checkpoint.every=8",
                   "logger=wandb", "logger.mode=offline")
    trainer = Trainer(cfg).setup()
    summary = trainer.train()
    yield trainer, summary, out
    trainer.close()


def test_loss_falls_and_every_term_is_logged(trained):
    trainer, summary, out = trained
    records = read_metrics(out)
    evals = [r for r in records if "eval/loss" in r]
    assert evals[0]["step"] == 0 and evals[-1]["step"] == 16
    # Held-out loss of the untrained (= masked) student vs after 16 steps; measured 0.792 -> 0.745 with the default
    # student here (LoRA on the kept experts; the new-expert student: -> 0.747).
    assert evals[-1]["eval/loss"] < 0.97 * evals[0]["eval/loss"]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 17))
    for key in ("loss", "ce", "kl", "residual_mass_teacher", "residual_mass_student", "lr", "grad_norm",
                "cont_tokens_per_s", "tokens_per_s", "student_pad_share", "teacher_prefix_pad_share"):
        assert all(key in r and r[key] == r[key] for r in steps), key  # present and not NaN
    for r in steps:  # loss = 0.1 CE + 0.9 KL, each term logged separately
        assert abs(r["loss"] - (0.1 * r["ce"] + 0.9 * r["kl"])) < 1e-9
        assert 0.0 <= r["student_pad_share"] < 1.0 and 0.0 <= r["residual_mass_teacher"] <= 1.0
        assert r["split_fraction"]["count"] == 4 and 0.0 < r["split_fraction"]["min"] <= r["split_fraction"]["max"] < 1.0
    first = records[0]
    assert first["trainable_params"] == summary["trainable_params"] > 0
    counts = trainer.student.parameter_counts()
    assert first["trainable_share"] == counts["trainable"] / counts["total"]
    # Rank-8 LoRA on 16-wide experts is a fifth of this tiny model (measured 0.21); real presets: ~1% (test_plan).
    assert 0.0 < first["trainable_share"] < 0.25 and counts["lora"] > 0
    # The resolved config is saved with the run; W&B ran offline (no API key) into the run folder.
    saved = OmegaConf.load(out / "train_config.yaml")
    assert saved.output_dir == str(out) and saved.distill.schedule.max_steps == 16
    assert list((out / "wandb").glob("offline-run-*"))


def test_frozen_tensors_are_bitwise_unchanged(trained):
    from slimwise_train.models import load_model

    trainer, summary, _ = trained
    fresh, _ = load_model(trainer.cfg.model, "cpu")
    fresh_params = dict(fresh.named_parameters())
    frozen = [(n, p) for n, p in trainer.student.model.named_parameters() if not p.requires_grad]
    assert len(frozen) == len(fresh_params)
    for name, param in frozen:  # peft's LoRA wrappers put the expert module under `base_layer` (one per tensor)
        assert torch.equal(param, fresh_params[name.replace(".base_layer", "")]), name
    assert summary["frozen_unchanged"] is True
    # The default student of the tiny Qwen3-MoE: router and norm deltas, LoRA on the kept experts (B starts at 0).
    moved = [n for n, p in trainer.student.trainable_named_parameters() if "lora_B" in n or "router_delta" in n]
    assert any("lora_B" in n for n in moved) and any("router_delta" in n for n in moved)
    assert all(trainer.student.get_parameter(n).abs().sum() > 0 for n in moved)  # training did move them


def test_checkpoints_are_complete_and_pruned(trained):
    trainer, _, out = trained
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert names == ["step_000008", "step_000016"]
    last = out / "checkpoints" / "step_000016"
    assert {p.name for p in last.iterdir()} >= {"trainable.safetensors", "optimizer.pt", "scheduler.pt", "rng.pt",
                                                 "trainer_state.json", "complete"}
    state = json.loads((last / "trainer_state.json").read_text())
    assert state["step"] == 16 and state["data_position"] == trainer.plan.position(16)
    saved = load_file(str(last / "trainable.safetensors"))
    for name, param in trainer.student.trainable_named_parameters():
        assert torch.equal(saved[name], param.detach()), name


FRESH = r"""
import sys, torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM
from slimwise_train.moe.handoff import continue_on_cache, prefill
from slimwise_train.models import load_model
out = sys.argv[1]
teacher, _ = load_model(OmegaConf.load(f"{out}/train_config.yaml").model, "cpu")
decoder = AutoModelForCausalLM.from_pretrained(f"{out}/export").eval()
ids = torch.load(f"{out}/probe_ids.pt")
with torch.no_grad():
    _, cache = prefill(teacher, ids[:, :9])
    logits, _ = continue_on_cache(decoder, cache, ids[:, 9:])
torch.save(logits, f"{out}/probe_fresh.pt")
assert "slimwise_train.distill.export" not in sys.modules  # the Slimwise* classes were never registered
"""


@pytest.mark.subprocess
def test_exported_student_reloads_in_a_fresh_process(trained):
    from slimwise_train.moe.handoff import prefill

    trainer, _, out = trained
    ids = torch.stack([torch.tensor(seq[:20]) for seq, _ in trainer.eval_seqs[:2]])
    torch.save(ids, out / "probe_ids.pt")
    with torch.no_grad():
        _, cache = prefill(trainer.student.model, ids[:, :9])  # no phase given: the teacher phase
        expected = trainer.student(ids[:, 9:], past_key_values=cache, phase="student",
                                   position_ids=torch.arange(9, 20).expand(2, -1))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", FRESH, str(out)], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    fresh = torch.load(out / "probe_fresh.pt")
    # Folded weights (W + dW) vs stock + delta: rounding only; measured ~2e-6.
    assert (fresh - expected).abs().max() <= 1e-4
    info = json.loads((out / "export" / "slimwise_export.json").read_text())
    # The default on a family without a slot: no added module, the stock class (FRESH never registers Slimwise*)
    assert info["architecture"] == "stock" and info["trainable"] == "always_on+lora_experts"
    assert info["num_kept"] == [4, 4]
    assert (out / "student_trainable.safetensors").stat().st_size < (out / "export" / "model.safetensors").stat().st_size


# ---------------------------------------------------------------------------------------------- batches


def test_continuation_batch_layout():
    seqs = [([10, 11, 12, 13, 14, 15], 2), ([20, 21, 22, 23], 1)]
    batch = B.continuation_batch(seqs, [2, 1], pad_id=0)
    assert batch.prefix_ids.tolist() == [[10, 11], [0, 20]]  # left-padded prefixes end at the same position
    assert batch.prefix_mask.tolist() == [[1, 1], [0, 1]]
    assert batch.cont_ids.tolist() == [[12, 13, 14, 15], [21, 22, 23, 0]]  # right-padded continuations
    assert batch.full_mask.tolist() == [[1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 0]]
    # Next token inside the continuation; the last continuation token and padding have no target.
    assert batch.labels.tolist() == [[13, 14, 15, IGNORE_INDEX], [22, 23, IGNORE_INDEX, IGNORE_INDEX]]
    assert batch.stats() == {"cont_tokens": 7, "cont_slots": 8, "prefix_tokens": 3, "prefix_slots": 4, "loss_tokens": 5}


def test_split_points_respect_bounds_and_replay_from_the_seeds():
    rule = B.SplitRule(min_split=2, min_continuation=3, after_prompt=True)
    seqs = [(list(range(12)), 4), (list(range(9)), 1)] * 50
    splits = B.sample_splits(seqs, rule, B.split_generator(7, 0, 3))
    assert splits == B.sample_splits(seqs, rule, B.split_generator(7, 0, 3))  # resumable: a function of the seeds
    assert splits != B.sample_splits(seqs, rule, B.split_generator(7, 1, 3))
    first, second = splits[0::2], splits[1::2]
    assert set(first) == set(range(4, 10))  # [max(2, prompt 4), 12 - 3], both ends reached in 50 draws
    assert set(second) == set(range(2, 7))  # [max(2, prompt 1), 9 - 3]
    assert not rule.splittable(6, 4) and rule.splittable(7, 4)
    with pytest.raises(ValueError, match="min_continuation must be >= 2"):
        B.SplitRule(min_continuation=1)


def test_data_plan_is_deterministic_and_independent_of_the_rank_split():
    seqs = [(list(range(5 + (i * 7) % 23)), 2) for i in range(40)]
    rule = B.SplitRule()
    a, b = (B.DataPlan(seqs, rule, 8, data_seed=3, split_seed=5, bucket_windows=4) for _ in range(2))
    steps = [a.step_batch(k) for k in range(12)]  # 5 steps per epoch: crosses two epoch boundaries
    assert steps == [b.step_batch(k) for k in range(12)]
    first_epoch = [i for indices, _ in steps[:5] for i in indices]
    assert len(first_epoch) == len(set(first_epoch)) == 40  # an epoch sees every sequence once
    for indices, splits in steps:
        for i, s in zip(indices, splits):
            assert rule.bounds(len(seqs[i][0]), 2)[0] <= s <= rule.bounds(len(seqs[i][0]), 2)[1]
    # Split-aware bucketing: continuation lengths inside a batch are tighter than with no bucketing (window = 1 batch).
    def mean_spread(plan):
        conts = [[len(seqs[i][0]) - s for i, s in zip(*plan.step_batch(k))] for k in range(5)]
        return sum(max(c) - min(c) for c in conts) / 5

    assert mean_spread(a) < 0.5 * mean_spread(B.DataPlan(seqs, rule, 8, data_seed=3, split_seed=5, bucket_windows=1))
    indices, splits = steps[0]
    step = [seqs[i] for i in indices]
    one_rank = B.plan_micro_batches(step, splits, world_size=1, grad_accum=2)
    two_ranks = B.plan_micro_batches(step, splits, world_size=2, grad_accum=1)
    flat = lambda plan: sorted(i for rank in plan for mb in rank for i in mb)  # noqa: E731
    assert flat(one_rank) == flat(two_ranks) == list(range(8))
    # Sorting by continuation length keeps micro-batches tight: the short half and the long half.
    cont = [len(ids) - s for (ids, _), s in zip(step, splits)]
    assert max(cont[i] for i in one_rank[0][0]) <= min(cont[i] for i in one_rank[0][1])


def test_too_short_sequences_are_skipped_and_counted(tmp_path):
    from slimwise_train.data.loading import encode_all, load_pairs
    from slimwise_train.models import load_tokenizer

    cfg = make_cfg(tmp_path, "distill.split.split_after_prompt=true", "distill.split.min_continuation=20",
                   "data.seq_len=64")
    trainer = Trainer(cfg).setup()
    try:
        encoded = encode_all(load_tokenizer(cfg.model), load_pairs(cfg.data), cfg.data)
        expected = sum(1 for ids, prompt in encoded if len(ids) - 20 < max(1, prompt))
        assert 0 < expected < len(encoded)  # the setting really cuts some, not all
        assert trainer.num_too_short == expected
        assert len(trainer.train_seqs) == len(encoded) - expected
    finally:
        trainer.close()
    with pytest.raises(ValueError, match="too short to split"):
        run_train(make_cfg(tmp_path / "all", "distill.split.min_continuation=1000"))
    assert not (tmp_path / "all" / "checkpoints").exists()


# ---------------------------------------------------------------------------------------------- bad input


def test_keep_set_from_another_model_is_a_clear_error(tmp_path):
    from slimwise_train.moe.adapters import get_adapter
    from slimwise_train.moe.keepset import KeepSet
    from slimwise_train.testing.tiny import tiny_model

    other = tiny_model("mixtral")
    path = tmp_path / "keep_set.json"
    KeepSet.from_kept(get_adapter(other).moe_layers(other), [[0, 1, 2, 3]] * 2, model_type="mixtral").save(path)
    with pytest.raises(ValueError, match="keep set was made for model_type 'mixtral' but the model is 'qwen3_moe'"):
        run_train(make_cfg(tmp_path / "out", f"prune.keep_set={path}"))
    assert not (tmp_path / "out" / "checkpoints").exists()


def test_tokenizer_model_vocabulary_mismatch_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="tokenizer has 384 tokens but the model's embedding has 100"):
        run_train(make_cfg(tmp_path, "+model.tiny_overrides.vocab_size=100"))
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.subprocess
def test_unknown_config_key_is_a_clean_error(tmp_path):
    with pytest.raises(ConfigCompositionException, match="lr_typo"):
        make_cfg(tmp_path, "distill.lr_typo=1")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "slimwise_train", "distill.lr_typo=1", f"hydra.run.dir={tmp_path}"],
                          cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode != 0
    assert "Key 'lr_typo' not in 'DistillConfig'" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "checkpoints").exists()


def test_nan_loss_skips_the_step_then_aborts_without_a_corrupt_checkpoint(tmp_path):
    # One non-finite step: skipped and counted, parameters untouched by it, the run finishes.
    out = tmp_path / "one"
    summary = run_train(make_cfg(out, "distill.schedule.max_steps=3", "distill.checkpoint.every=1",
                                 "distill.checkpoint.keep=3"), hooks=FaultHooks(nan_at_steps=frozenset({2})))
    assert summary["nan_skipped"] == 1 and summary["steps"] == 3
    ckpt = lambda s: load_file(str(out / "checkpoints" / f"step_{s:06d}" / "trainable.safetensors"))  # noqa: E731
    one, two, three = ckpt(1), ckpt(2), ckpt(3)
    assert all(torch.equal(one[k], two[k]) for k in one)  # the skipped step changed nothing
    assert any(not torch.equal(two[k], three[k]) for k in two)  # the next step trained again
    assert [r.get("skipped") for r in read_metrics(out) if r["step"] == 2 and "nan_skipped" in r] == [1]

    # max_nan_steps in a row: a clear error; only finite, complete checkpoints from before remain. (The faults named
    # in the config, as a command line names them: FaultHooks.from_config.)
    out = tmp_path / "abort"
    with pytest.raises(NonFiniteLossError, match="2 consecutive steps with a non-finite loss"):
        run_train(make_cfg(out, "distill.schedule.max_steps=5", "distill.checkpoint.every=1",
                           "distill.schedule.max_nan_steps=2", "+extra.nan_at_steps=[2,3]"))
    # Step 2 was skipped (its checkpoint equals step 1), step 3 aborted before any write.
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000001", "step_000002"]
    one, two = ckpt_at(out, 1), ckpt_at(out, 2)
    assert all(torch.isfinite(t).all() and torch.equal(t, two[k]) for k, t in one.items())


def test_adding_a_loss_term_is_one_function_and_one_config_entry(tmp_path):
    """Issue 25 item 2, the walk-through: register a term by name (here a toy L2 on the logits), name it in
    distill.loss.terms, train: it is in the loss and logged by name in training and on the held-out set."""
    from slimwise_train.distill.losses import TERMS, register_term

    @register_term("logit_l2")
    def logit_l2(x):
        # sum over the valid rows of the mean squared logit difference: x.student, x.teacher [N, V] -> []
        d = (x.student.float() - x.teacher.float()).pow(2).mean(-1)
        return torch.where(x.valid, d, torch.zeros_like(d)).sum()

    try:
        summary = run_train(make_cfg(tmp_path, "+distill.loss.terms.logit_l2=0.01", "distill.schedule.max_steps=2",
                                     "distill.eval.every=2", "distill.export=false"))
    finally:
        TERMS.pop("logit_l2")
    steps = [r for r in read_metrics(tmp_path) if "loss" in r]
    assert len(steps) == 2
    for r in steps:
        assert r["logit_l2"] > 0 and abs(r["loss"] - (0.1 * r["ce"] + 0.9 * r["kl"] + 0.01 * r["logit_l2"])) < 1e-9
    assert summary["eval/logit_l2"] > 0
    assert abs(summary["eval/loss"] - (0.1 * summary["eval/ce"] + 0.9 * summary["eval/kl"]
                                       + 0.01 * summary["eval/logit_l2"])) < 1e-9
    assert all("logit_l2" in h for h in summary["history"])


def test_an_unknown_loss_term_is_refused_before_anything_is_created(tmp_path):
    with pytest.raises(ValueError, match=r"^unknown distill.loss.terms key 'nope'; known terms: ce, full_kl, kl$"):
        run_train(make_cfg(tmp_path / "out", "+distill.loss.terms.nope=1"))
    assert not (tmp_path / "out").exists()


def test_a_trainer_from_components_plans_the_same_steps(trained):
    """bench/train.py's trainer: built from parts (Trainer.from_components), the same data plan and objective."""
    trainer, _, _ = trained
    other = Trainer.from_components(trainer.cfg, student=trainer.student, engine=trainer.engine, plan=trainer.plan,
                                    tokenizer=trainer.tokenizer, device="cpu", micro_batch=trainer.micro_batch)
    assert other.objective.weights == trainer.objective.weights == {"ce": 0.1, "kl": 0.9}
    assert (other.global_batch, other.grad_accum, other.single_pass) == (trainer.global_batch, 1, trainer.single_pass)
    for step in (0, 5):
        mine, theirs = other._micro_batches(step), trainer._micro_batches(step)
        assert mine[1] == theirs[1]
        assert all(torch.equal(a.cont_ids, b.cont_ids) for a, b in zip(mine[0], theirs[0]))
    with pytest.raises(ValueError, match="global batch 4 is not world_size 1 x distill.schedule.grad_accum 1 x micro "
                                         "batch 2"):
        Trainer.from_components(trainer.cfg, student=trainer.student, engine=trainer.engine, plan=trainer.plan,
                                tokenizer=trainer.tokenizer, device="cpu", micro_batch=2)


def test_both_engines_implement_the_engine_protocol():
    from slimwise_train.distill.engine import DeepSpeedZeroEngine, Engine, TorchEngine

    methods = {m for m, value in vars(Engine).items() if not m.startswith("_") and callable(value)}
    assert {"forward", "backward", "step", "skip_step", "lr", "trainable_state_dict", "gathered_parameters", "save",
            "load", "close"} <= methods
    for cls in (TorchEngine, DeepSpeedZeroEngine):
        assert all(callable(getattr(cls, m, None)) for m in methods), cls


def ckpt_at(out, step):
    return load_file(str(out / "checkpoints" / f"step_{step:06d}" / "trainable.safetensors"))


def test_eval_rows_are_held_out_of_the_training_split(tmp_path):
    trainer = Trainer(make_cfg(tmp_path, "distill.eval.split=train", "distill.eval.samples=8")).setup()
    try:
        train = {tuple(ids) for ids, _ in trainer.train_seqs}
        held_out = [tuple(ids) for ids, _ in trainer.eval_seqs]
        assert len(held_out) == 8 and not train.intersection(held_out)
        assert len(trainer.train_seqs) + trainer.num_too_short == trainer.cfg.data.num_samples
    finally:
        trainer.close()


@pytest.mark.parametrize("name", sorted(p.stem for p in (REPO / "conf" / "experiment").glob("*.yaml")))
def test_every_experiment_composes_and_starts_with_its_launch_command(name, tmp_path):
    from slimwise_train.distill.trainer import validate_train_config

    lines = (REPO / "conf" / "experiment" / f"{name}.yaml").read_text().splitlines()
    # Hydra needs the package header first; the launch command is the next line.
    assert lines[0] == "# @package _global_" and lines[1].startswith("# ") and "slimwise_train" in lines[1]
    assert f"experiment={name}" in lines[1]
    validate_train_config(make_cfg(tmp_path, f"experiment={name}"))


@pytest.mark.parametrize("family", [t for t in SUPPORTED_TINY if t != "qwen3_moe"])  # qwen3_moe: the tests above
def test_every_family_trains_through_the_trainer(family, tmp_path):
    """Two steps per family: shared-expert models, hybrid linear-attention caches (autograd-safe), sliding windows,
    MLA caches, biased routers all run through teacher prefill -> copied cache -> student continuation."""
    from slimwise_train.moe.adapters import get_adapter
    from slimwise_train.moe.keepset import KeepSet
    from slimwise_train.testing.tiny import tiny_model

    model = tiny_model(family)  # only for the layer layout of the keep set (scoring is tested with qwen3_moe)
    path = tmp_path / "keep_set.json"
    KeepSet.from_kept(get_adapter(model).moe_layers(model), [[0, 2, 5, 7], [1, 3, 4, 6]],
                      model_type=model.config.model_type).save(path)
    summary = run_train(make_cfg(tmp_path / "out", f"model=tiny_{family}", f"prune.keep_set={path}",
                                 "distill.schedule.max_steps=2", "distill.eval.every=100", "distill.export=false"))
    assert summary["steps"] == 2 and summary["frozen_unchanged"] is True
    assert all(h["loss"] == h["loss"] and h["loss"] > 0 for h in summary["history"])
    steps = [r for r in read_metrics(tmp_path / "out") if "loss" in r]
    assert len(steps) == 2 and all(r["grad_norm"] > 0 and r["kl"] > 0 for r in steps)  # gradients reached the student


def test_training_data_from_a_local_jsonl_through_datasets(tmp_path):
    rows = [{"messages": [{"role": "user", "content": f"Q: {i}+{i}="}, {"role": "assistant", "content": f"A={2 * i}"}]}
            for i in range(40)]
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = make_cfg(tmp_path / "out", f"data.source={path}", "data.num_samples=32", "distill.eval.split=train",
                   "distill.eval.samples=8", "distill.schedule.max_steps=2", "distill.export=false")
    summary = run_train(cfg)
    assert summary["steps"] == 2 and summary["num_too_short"] == 0
    assert summary["tokens_seen"] > 0


def test_console_shows_mean_train_loss_and_held_out_loss_and_the_run_draws_its_loss_curve(tmp_path, caplog):
    """Issue 26 item 6: one step's loss is noise (0.00004 to 0.75); the console shows the mean since its last line and
    the held-out loss at each eval; summary.json stays small (metrics.jsonl has every step); loss_curve.png."""
    with caplog.at_level("INFO", logger="slimwise"):
        summary = run_train(make_cfg(tmp_path, "distill.schedule.max_steps=4", "distill.log_every=2",
                                     "distill.eval.every=2", "distill.export=false"))
    means = [r.getMessage() for r in caplog.records if "train loss" in r.getMessage()]
    assert means and all("mean of" in m for m in means)
    assert "(ce" in means[-1] and "mean of 2 steps" in means[-1]
    held_out = [r.getMessage() for r in caplog.records if "held-out loss" in r.getMessage()]
    assert [m.split()[1] for m in held_out] == ["0", "2", "4"]  # the untrained student, then every eval
    written = json.loads((tmp_path / "summary.json").read_text())
    assert "history" not in written and len(summary["history"]) == 4
    assert (tmp_path / "loss_curve.png").stat().st_size > 5000


def test_wandb_mode_is_one_rule_for_the_trainer_and_the_eval_app(monkeypatch):
    """logger.mode=auto: WANDB_MODE when set, else online with WANDB_API_KEY, offline without (config.wandb_mode, used
    by distill/metrics.py and eval/app.py alike)."""
    from types import SimpleNamespace

    from slimwise_train.config import wandb_mode
    from slimwise_train.distill import metrics
    from slimwise_train.eval import app

    assert metrics.wandb_mode is wandb_mode and app.wandb_mode is wandb_mode
    auto = SimpleNamespace(mode="auto")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    assert wandb_mode(auto) == "offline" and wandb_mode(SimpleNamespace(mode="disabled")) == "disabled"
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert wandb_mode(auto) == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_mode(auto) == "disabled" and wandb_mode(SimpleNamespace(mode="offline")) == "offline"


# ---------------------------------------------------------------------------------------------- conversations

# The shipped tool conversations whole (up to ~1400 tokens with their tool schemas): the tiny model's context raised.
CHAT_RUN = ("distill.schedule.max_steps=2", "distill.eval.every=2", "distill.checkpoint.every=2", "data.seq_len=1536",
            "+model.tiny_overrides.max_position_embeddings=2048")


@pytest.mark.subprocess
def test_distills_on_multi_turn_tool_conversations_with_the_loss_on_assistant_tokens(tmp_path, chat_tokenizer_dir):
    """Issue 47: the train app on the shipped multi-turn tool conversations through a chat template: it trains, and
    every loss target of a batch is an assistant token as transformers' own assistant mask of that row marks it (the
    split point anywhere in the sequence, the targets after it)."""
    from transformers import AutoTokenizer

    from helpers import CHILD_ENV, TOOL_CHATS

    overrides = [f"model.tokenizer={chat_tokenizer_dir}", f"data.source={TOOL_CHATS['openai']}", *CHAT_RUN]
    proc = subprocess.run([sys.executable, "-m", "slimwise_train", *SMALL, *overrides,
                           f"hydra.run.dir={tmp_path / 'cli'}"], cwd=REPO, env=CHILD_ENV, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [m for m in read_metrics(tmp_path / "cli") if "loss" in m and "eval/loss" not in m]
    assert len(steps) == 2 and all(0 < m["loss_tokens"] and m["loss"] == m["loss"] for m in steps)
    assert "loss targets: the assistant turns" in proc.stdout + proc.stderr

    tokenizer = AutoTokenizer.from_pretrained(str(chat_tokenizer_dir))
    masks = {}
    for line in TOOL_CHATS["openai"].read_text().splitlines():
        row = json.loads(line)
        out = tokenizer.apply_chat_template(row["messages"], tools=row.get("tools"), return_assistant_tokens_mask=True)
        masks[tuple(out["input_ids"])] = out["assistant_masks"]
    trainer = Trainer(make_cfg(tmp_path / "in", *overrides)).setup()
    try:
        checked = 0
        for step in range(2):
            for batch in trainer._micro_batches(step)[0]:
                for row, (s, n) in enumerate(zip(batch.splits, batch.lengths)):
                    prefix = batch.prefix_ids[row, batch.prefix_ids.shape[1] - s:]
                    ids = prefix.tolist() + batch.cont_ids[row, :n - s].tolist()
                    mask = masks[tuple(ids)]  # the whole conversation, uncut
                    expected = [ids[j] if mask[j] else IGNORE_INDEX for j in range(s + 1, n)]
                    assert batch.labels[row, :n - s - 1].tolist() == expected
                    assert (batch.labels[row, n - s - 1:] == IGNORE_INDEX).all()
                    checked += 1
        assert checked == 2 * trainer.global_batch
    finally:
        trainer.close()


def test_resuming_under_a_longer_schedule_says_the_learning_rate_is_re_planned(tmp_path, caplog):
    # Rerunning a folder with a larger max_steps re-plans the cosine mid-run: the lr jumps, and the log says so.
    no_warmup = "distill.schedule.warmup_steps=0"
    run_train(make_cfg(tmp_path, no_warmup, "distill.schedule.max_steps=2", "distill.checkpoint.every=2",
                       "distill.eval.every=2"))
    longer = (no_warmup, "resume=auto", "distill.schedule.max_steps=3", "distill.checkpoint.every=3",
              "distill.eval.every=3")
    with caplog.at_level("WARNING", logger="slimwise.train"):
        run_train(make_cfg(tmp_path, *longer))
    (line,) = [r.getMessage() for r in caplog.records if "re-planned" in r.getMessage()]
    # peak 2e-2, no warmup: step 2 of 2 is the cosine's floor (min_lr_ratio 0.1 x 2e-2); step 2 of 3 is
    # 2e-2 x (0.1 + 0.9 x 0.5 x (1 + cos(2 pi / 3))) = 6.5e-3
    assert line == ("resuming at step 2 under another distill.schedule (max_steps 2 -> 3): the learning-rate schedule "
                    "is re-planned from this step (lr 0.002 -> 0.0065)")
    caplog.clear()
    with caplog.at_level("WARNING", logger="slimwise.train"):  # the same schedule: nothing to say
        run_train(make_cfg(tmp_path, *longer))
    assert "re-planned" not in caplog.text


def test_the_apps_run_folds_the_student_in_place_into_the_checkpoint_a_copying_export_writes(tmp_path, monkeypatch):
    """run_train (the app: nothing uses the student after the run) folds the trained student into its own weights:
    no copy of the model is made (issue 51: the distilled export needed a second copy outside ZeRO-3), and the export
    is bitwise the checkpoint that a copying export of the same student (rebuilt from student_trainable) writes."""
    import copy as copy_module

    from slimwise_train.distill.export import export_student, load_trainable
    from slimwise_train.models import load_model

    copied = []
    deepcopy = copy_module.deepcopy

    def spy(obj, *args, **kwargs):
        if isinstance(obj, torch.nn.Module):
            copied.append(type(obj).__name__)
        return deepcopy(obj, *args, **kwargs)

    cfg = make_cfg(tmp_path / "run", "distill.schedule.max_steps=2", "distill.eval.every=2",
                   "distill.checkpoint.every=2")
    monkeypatch.setattr(copy_module, "deepcopy", spy)
    run_train(cfg)
    monkeypatch.undo()
    assert copied == []
    teacher, tokenizer = load_model(cfg.model, "cpu")
    student = load_trainable(tmp_path / "run" / "student_trainable.safetensors", teacher)
    export_student(student, tmp_path / "copied", tokenizer=tokenizer, in_place=False)
    exported, reference = (load_file(str(tmp_path / folder / "model.safetensors")) for folder in ("run/export", "copied"))
    assert exported.keys() == reference.keys()
    assert all(torch.equal(exported[k], reference[k]) and exported[k].dtype == reference[k].dtype for k in exported)
    for name in ("config.json", "slimwise_export.json"):
        assert (tmp_path / "run" / "export" / name).read_text() == (tmp_path / "copied" / name).read_text(), name

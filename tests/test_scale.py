"""Memory levers that must not change the numbers: activation recompute in the student phase, the teacher's single
pass over prefix + continuation, partitioned (ZeRO-3) loading of every family."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from slimwise_train.distill.student import DistillModel
from slimwise_train.moe.adapters import get_adapter
from slimwise_train.moe.handoff import prefill
from slimwise_train.moe.keepset import KeepSet
from slimwise_train.testing.tiny import SUPPORTED_TINY, tiny_model

from helpers import TINY_TRAIN, compose_config

REPO = Path(__file__).resolve().parents[1]


def _student(family: str, recompute: str) -> DistillModel:
    model = tiny_model(family, seed=1)
    layers = get_adapter(model).moe_layers(model)
    keep = KeepSet.from_kept(layers, [[0, 2, 5, 7] for _ in layers])
    student = DistillModel(model, keep, recompute=recompute)
    with torch.no_grad():  # trained-looking deltas, so every gradient path is exercised
        gen = torch.Generator().manual_seed(0)
        for _, p in student.trainable_named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return student


def _grads(family: str, recompute: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    from slimwise_train.moe.handoff import make_cache_autograd_safe

    student = _student(family, recompute)
    ids = torch.randint(3, 96, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        _, cache = prefill(student.model, ids[:, :7])
    make_cache_autograd_safe(cache)
    logits = student(ids[:, 7:], past_key_values=cache, position_ids=torch.arange(7, 12).expand(2, -1),
                     phase="student")
    (logits.float().square().mean()).backward()
    return logits.detach(), {n: p.grad.clone() for n, p in student.trainable_named_parameters()}


@pytest.mark.parametrize("family", SUPPORTED_TINY)
@pytest.mark.parametrize("mode", ["moe", "layer"])
def test_recompute_gives_the_gradients_of_no_recompute(family, mode):
    """Tolerance 1e-6 relative (per tensor, on the norm of the difference): recompute re-runs the same kernels on
    the same inputs, so in practice the gradients are bitwise equal."""
    reference_logits, reference = _grads(family, "none")
    logits, grads = _grads(family, mode)
    assert torch.equal(logits, reference_logits)
    assert grads.keys() == reference.keys()
    for name, grad in grads.items():
        scale = reference[name].norm().clamp(min=1e-12)
        assert (grad - reference[name]).norm() / scale <= 1e-6, name


def test_recompute_actually_recomputes_and_leaves_no_trace():
    student = _student("qwen3_moe", "moe")
    calls = []
    experts = student.moe_layers[0].experts
    hook = experts.register_forward_hook(lambda m, a, o: calls.append(torch.is_grad_enabled()))
    ids = torch.randint(3, 96, (1, 6))
    student(ids, phase="student", use_cache=False).float().sum().backward()
    assert len(calls) == 2  # the forward, then its recompute in backward
    hook.remove()
    student.remove_hooks()
    assert type(experts).__name__ == type(experts).__mro__[0].__name__ and not hasattr(type(experts),
                                                                                          "_slimwise_recompute_base")


def test_unknown_recompute_mode_is_an_error():
    with pytest.raises(ValueError, match="unknown distill.memory.recompute 'all'; use one of none, moe, layer"):
        _student("qwen3_moe", "all")


def _trainer(tmp_path, *overrides):
    from slimwise_train.distill.trainer import Trainer

    cfg = compose_config("train", *TINY_TRAIN, "resume=never", "progress=false", f"output_dir={tmp_path}", *overrides)
    return Trainer(cfg).setup()


def test_teacher_single_pass_equals_two_passes(tmp_path):
    from slimwise_train.distill import batches as B

    trainer = _trainer(tmp_path)
    try:
        assert trainer.single_pass  # qwen3_moe: full attention only
        splits = B.sample_splits(trainer.eval_seqs, trainer.rule, B.split_generator(0, 0, stream=1))
        batch = B.continuation_batch(trainer.eval_seqs[:4], splits[:4], trainer.tokenizer.pad_token_id)
        with torch.no_grad():
            one = trainer._forward_pair(batch)
            trainer.single_pass = False
            two = trainer._forward_pair(batch)
        # Same math, other summation order for the prefix K/V: measured max |diff| ~1e-6 on logits of scale ~5.
        for a, b in zip(one, two):
            torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)
    finally:
        trainer.close()


def test_teacher_single_pass_is_refused_for_sliding_window_caches(tmp_path):
    with pytest.raises(ValueError, match="teacher_single_pass=true needs full-attention KV caches"):
        _trainer(tmp_path, "model=tiny_gpt_oss", "distill.memory.teacher_single_pass=true")


def test_zero3_only_knobs_are_refused_elsewhere(tmp_path):
    with pytest.raises(ValueError, match="engine.offload_params applies to engine=zero3 only"):
        _trainer(tmp_path, "engine=zero2", "engine.offload_params=true")


# --------------------------------------------------------------------------- partitioned loading, 2 ranks


PARTITIONED_CHILD = r"""
import json, os, sys, torch
from omegaconf import OmegaConf
from slimwise_train.config import DistillConfig, EngineConfig
from slimwise_train.distill.engine import PartitionedLoading, build_engine, is_partitioned
from slimwise_train.distill.student import DistillModel
from slimwise_train.moe.adapters import get_adapter
from slimwise_train.moe.keepset import KeepSet
from slimwise_train.testing.tiny import tiny_model
from slimwise_train.utils import distributed as du

du.init_if_launched("gloo")
engine_cfg = OmegaConf.structured(EngineConfig(name="zero3"))
distill_cfg = OmegaConf.structured(DistillConfig())
out = {}
for family in sys.argv[2:]:
    replicated = tiny_model(family, seed=4)
    layers = get_adapter(replicated).moe_layers(replicated)
    keep = KeepSet.from_kept(layers, [[1, 2, 4, 6] for _ in layers])
    ids = torch.randint(3, 96, (2, 10), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = DistillModel(replicated, keep)(ids, phase="student", use_cache=False)
    loading = PartitionedLoading(engine_cfg, distill_cfg, 2, torch.device("cpu"))
    model = loading.partition(tiny_model(family, seed=4))
    partitioned = all(is_partitioned(p) for p in model.parameters())
    held = sum(p.ds_tensor.numel() for p in model.parameters())  # this rank's partition only
    full = sum(p.ds_numel for p in model.parameters())
    student = DistillModel(model, keep)
    engine = build_engine(engine_cfg, distill_cfg, student, 2, torch.device("cpu"), loading)
    with torch.no_grad():
        got = engine.forward("student", input_ids=ids, use_cache=False)
    out[family] = {"partitioned": partitioned, "held": held, "full": full,
                   "max_diff": float((got - expected).abs().max())}
    engine.close()
if du.rank() == 0:
    json.dump(out, open(sys.argv[1], "w"))
du.shutdown()
"""


@pytest.mark.dist
@pytest.mark.subprocess
def test_every_family_loads_partitioned_and_its_step0_student_equals_the_replicated_one(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled",
           "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))}
    script = tmp_path / "child.py"
    script.write_text(PARTITIONED_CHILD)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(script), str(tmp_path / "out.json"), *SUPPORTED_TINY], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads((tmp_path / "out.json").read_text())
    assert sorted(out) == sorted(SUPPORTED_TINY)
    for family, r in out.items():
        assert r["partitioned"], family
        assert r["held"] <= r["full"] / 2 + 1024, family  # half of every tensor (+ alignment padding)
        assert r["max_diff"] <= 1e-6, (family, r["max_diff"])


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["moe", "layer"])
def test_recompute_on_cuda_bf16_gives_the_gradients_of_no_recompute(mode):
    """The GPU tier: the same check in bf16 on CUDA (recompute re-runs the same kernels; 1e-3 relative allows for
    a different cuBLAS algorithm choice between the forward and the recompute)."""
    def grads(recompute):
        student = _student("qwen3_moe", recompute).to("cuda", torch.bfloat16)
        ids = torch.randint(3, 96, (2, 12), generator=torch.Generator().manual_seed(2)).cuda()
        with torch.no_grad():
            _, cache = prefill(student.model, ids[:, :7])
        logits = student(ids[:, 7:], past_key_values=cache,
                         position_ids=torch.arange(7, 12, device="cuda").expand(2, -1), phase="student")
        logits.float().square().mean().backward()
        return {n: p.grad.float() for n, p in student.trainable_named_parameters()}

    reference, got = grads("none"), grads(mode)
    for name, grad in got.items():
        assert (grad - reference[name]).norm() / reference[name].norm().clamp(min=1e-12) <= 1e-3, name


def test_device_map_auto_loads_one_model_for_prune_and_is_refused_for_training(tmp_path, monkeypatch):
    """model.device_map=auto spreads a checkpoint over the node's GPUs through accelerate (here: all on the CPU)."""
    from transformers import AutoTokenizer

    from slimwise_train.config import ModelConfig
    from slimwise_train.models import SHIPPED_TOKENIZER, load_model

    tokenizer = AutoTokenizer.from_pretrained(str(SHIPPED_TOKENIZER))
    tiny_model("qwen3_moe", vocab_size=len(tokenizer)).save_pretrained(tmp_path / "ckpt")
    tokenizer.save_pretrained(tmp_path / "ckpt")
    import slimwise_train.models as models

    seen = {}
    real = models.AutoModelForCausalLM.from_pretrained

    def spy(path, **kwargs):
        seen.update(kwargs)
        return real(path, **kwargs)

    monkeypatch.setattr(models.AutoModelForCausalLM, "from_pretrained", spy)
    model, _ = load_model(ModelConfig(name="x", path=str(tmp_path / "ckpt"), dtype="float32", device_map="auto"),
                          "cpu")
    assert seen["device_map"] == "auto" and next(model.parameters()).device.type == "cpu"
    with pytest.raises(ValueError, match="model.device_map is for prune/eval"):
        _trainer(tmp_path / "run", f"model.path={tmp_path / 'ckpt'}", "+model.device_map=auto")


def test_calibration_computes_one_position_of_logits():
    from slimwise_train.prune.statistics import collect_statistics

    model = tiny_model("qwen3_moe")
    shapes = []
    hook = model.lm_head.register_forward_hook(lambda m, a, o: shapes.append(tuple(o.shape)))
    batch = {"input_ids": torch.randint(3, 96, (2, 9)), "attention_mask": torch.ones(2, 9, dtype=torch.long)}
    collect_statistics(model, [batch], progress=False)
    hook.remove()
    assert shapes == [(2, 1, 96)]  # not [2, 9, 96]: scoring needs the routers only

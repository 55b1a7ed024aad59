"""LoRA in the student phase (slimwise_train.distill.lora): the distill.trainable presets on every family.

Exactness claims use torch.equal (bit for bit): the teacher phase with adapters present is the stock model, and the
untrained student (LoRA B zero) is the masked model. The merged decode checkpoint (W + s B A folded into the kept
experts / attention weights) against the unmerged student on the teacher's cache allows MERGE_TOL: same math,
other rounding (measured 1.2e-6 .. 4.6e-6 on these tiny fp32 models, both kinds, all 9 families).
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from slimwise_train.distill.export import folded_decoder
from slimwise_train.distill.lora import (
    ADAPTER_NAME,
    expert_lora_slices,
    expert_wrappers,
    export_adapter,
    lora_from_config,
)
from slimwise_train.distill.student import DistillModel, StudentSpec, load_colocated
from slimwise_train.moe.adapters import get_adapter
from slimwise_train.moe.handoff import copy_cache, make_cache_autograd_safe, prefill
from slimwise_train.moe.keepset import KeepSet
from slimwise_train.moe.masking import PhaseMasking
from slimwise_train.testing.tiny import SUPPORTED_TINY, TINY_VOCAB, tiny_model

from helpers import FAST_LR, TINY_TRAIN, compose_config, train_steps

REPO = Path(__file__).resolve().parents[1]
MERGE_TOL = 1e-5
KEPT = [[0, 2, 5, 7], [1, 3, 4, 6]]
EXPERTS = {"kind": "experts", "rank": 4, "alpha": 8.0, "targets": ["gate_up_proj", "down_proj"]}
ATTENTION = {"kind": "attention", "rank": 4, "alpha": 8.0,
             "targets": ["q_proj", "k_proj", "v_proj", "o_proj", "kv_a_proj_with_mqa", "kv_b_proj"]}
families = pytest.mark.parametrize("model_type", SUPPORTED_TINY)
kinds = pytest.mark.parametrize("lora", [EXPERTS, ATTENTION], ids=["experts", "attention"])


def _ids(batch=2, length=12, seed=0):
    return torch.randint(3, TINY_VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _keep(model):
    return KeepSet.from_kept(get_adapter(model).moe_layers(model), KEPT, model_type=model.config.model_type)


def _student(model_type, lora):
    model = tiny_model(model_type)
    stock = copy.deepcopy(model)
    return DistillModel(model, _keep(model), StudentSpec(lora=lora)), stock


def _perturb(student, scale=0.1, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in student.trainable_named_parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)


def _cont(student_or_model, cache, cont, phase=None):
    pos = torch.arange(7, 7 + cont.shape[1]).expand(cont.shape[0], -1)
    if phase is None:
        return student_or_model(input_ids=cont, past_key_values=cache, position_ids=pos).logits
    return student_or_model(cont, past_key_values=cache, position_ids=pos, phase=phase)


# ------------------------------------------------------------------------------------------ phases, exactness


@families
@kinds
def test_teacher_phase_is_stock_and_untrained_student_is_masked_model(model_type, lora):
    student, stock = _student(model_type, lora)
    masked_model = copy.deepcopy(stock)
    masking = PhaseMasking(masked_model, _keep(masked_model))
    ids = _ids()
    prefix, cont = ids[:, :7], ids[:, 7:]
    with torch.no_grad():
        full = stock(ids).logits
        with masking.phase("decode"):
            masked = masked_model(ids).logits
        _, cache = prefill(stock, prefix)
        masked_cont = None
        with masking.phase("decode"):
            masked_cont = _cont(masked_model, copy_cache(cache), cont)
        assert student.parameter_counts()["lora"] > 0
        assert torch.equal(student(ids, phase="teacher", use_cache=False), full)
        assert torch.equal(student(ids, phase="student", use_cache=False), masked)  # B == 0: W + 0 == W
        assert torch.equal(_cont(student, copy_cache(cache), cont, "student"), masked_cont)
        # Adapters present and trained: the teacher phase still is the stock model, bit for bit.
        _perturb(student)
        assert torch.equal(student(ids, phase="teacher", use_cache=False), full)
        assert (student(ids, phase="student", use_cache=False) - masked).abs().max() > 1e-2


@families
def test_removed_experts_get_no_lora_update(model_type):
    """peft has no per-expert mask: a removed expert keeps its LoRA pair, but the student never routes to it, so
    its gradient is exactly zero and AdamW leaves B_e at zero (and A_e at its init) for the whole run."""
    student, _ = _student(model_type, EXPERTS)
    keep = student.keep_set
    before = {n: p.detach().clone() for n, p in student.trainable_named_parameters()}
    params = [p for _, p in student.trainable_named_parameters()]
    optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0)  # the trainer default
    ids = _ids(batch=4, length=16)
    for step in range(3):
        with torch.no_grad():
            _, cache = prefill(student.model, ids[:, :7])  # the teacher phase is the default
        make_cache_autograd_safe(cache)
        _cont(student, cache, ids[:, 7:], "student").float().pow(2).mean().backward()
        for layer_index, wrapper in expert_wrappers(student):
            grad_a, grad_b = wrapper.lora_A[ADAPTER_NAME].weight.grad, wrapper.lora_B[ADAPTER_NAME].weight.grad
            num = wrapper.num_experts
            assert grad_b.any()  # the kept experts' pairs get gradients
            for expert in keep.layer(layer_index).removed:  # exactly zero, not small
                assert not grad_a.view(num, -1, grad_a.shape[-1])[expert].any(), (step, layer_index, expert)
                assert not grad_b.view(grad_b.shape[0], -1, num)[:, :, expert].any(), (step, layer_index, expert)
        optimizer.step()
        optimizer.zero_grad()
    names = {id(p): n for n, p in student.named_parameters()}
    assert len(expert_wrappers(student)) == 2 * len(student.moe_layers)  # gate_up_proj and down_proj per layer
    for layer_index, wrapper in expert_wrappers(student):
        layer = keep.layer(layer_index)
        a_name, b_name = (names[id(wrapper.lora_A[ADAPTER_NAME].weight)], names[id(wrapper.lora_B[ADAPTER_NAME].weight)])
        for expert in range(wrapper.num_experts):
            a, b = expert_lora_slices(wrapper, expert)
            a0 = before[a_name].view(wrapper.num_experts, -1, a.shape[-1])[expert]
            if expert in layer.removed:
                assert not b.any() and torch.equal(a, a0)
            else:
                assert b.abs().max() > 0  # the kept experts' pairs did train


# ------------------------------------------------------------------------------------------ the two exports


@families
@kinds
def test_merged_decode_checkpoint_equals_student_on_the_teacher_cache(model_type, lora):
    student, stock = _student(model_type, lora)
    _perturb(student)
    ids = _ids()
    prefix, cont = ids[:, :7], ids[:, 7:]
    with torch.no_grad():
        _, cache = prefill(stock, prefix)  # the full teacher's cache (the prefill instance)
        unmerged = _cont(student, copy_cache(cache), cont, "student")
        decoder = folded_decoder(student)  # LoRA merged, experts sliced, deltas folded
        merged = _cont(decoder, copy_cache(cache), cont)
    assert not any("lora_" in n for n, _ in decoder.named_parameters())
    assert (unmerged - merged).abs().max() <= MERGE_TOL
    # the student is untouched by the export
    assert any("lora_" in n for n, _ in student.named_parameters())


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss", "deepseek_v3", "qwen3_next"])
@kinds
def test_colocated_adapter_prefill_is_stock_and_decode_is_student(model_type, lora, tmp_path):
    from peft import PeftModel

    student, stock = _student(model_type, lora)
    _perturb(student)
    folder = export_adapter(student, tmp_path / "adapter")
    # peft's own loader reads the LoRA part onto a stock copy (removed experts' pairs as zeros)
    peft_model = PeftModel.from_pretrained(copy.deepcopy(stock), str(folder))
    loaded = {n.replace(f".{ADAPTER_NAME}.", "."): p for n, p in peft_model.named_parameters() if "lora_" in n}
    written = load_file(str(folder / "adapter_model.safetensors"))
    assert set(loaded) == set(written) and all(torch.equal(loaded[k], written[k]) for k in written)
    for key, tensor in written.items():  # perturbed above, removed experts' pairs included: written as zeros
        if "experts" in key:
            layer = student.keep_set.layer(int(key.split("layers.")[1].split(".")[0]))
            view = tensor.view(tensor.shape[0], -1, 8) if "lora_B" in key else tensor.view(8, -1, tensor.shape[-1])
            gone = view[:, :, list(layer.removed)] if "lora_B" in key else view[list(layer.removed)]
            assert not gone.any() and view.any(), key

    colocated = load_colocated(copy.deepcopy(stock), folder)
    ids = _ids()
    prefix, cont = ids[:, :7], ids[:, 7:]
    with torch.no_grad():
        out = colocated.model(prefix, use_cache=True)  # the default phase: prefill = stock
        assert torch.equal(out.logits, stock(prefix).logits)
        _, teacher_cache = prefill(stock, prefix)
        reference = _cont(student, copy_cache(teacher_cache), cont[:, :1], "student")
        colocated.set_phase("auto")  # one new token on a non-empty cache: decode = the student
        step = _cont(colocated.model, out.past_key_values, cont[:, :1])
        assert torch.equal(step, reference)
        with colocated.phase("prefill"):  # a prompt in auto mode (or an explicit prefill) is stock again
            assert torch.equal(colocated.model(ids).logits, stock(ids).logits)
        assert torch.equal(colocated.model(ids).logits, stock(ids).logits)


def test_a_tensor_that_is_not_fused_and_a_missing_projection_are_one_line_errors():
    model = tiny_model("mixtral")
    with pytest.raises(ValueError, match=r"no fused 3D tensor 'w1'.*gate_up_proj"):
        DistillModel(model, _keep(model), StudentSpec(lora={**EXPERTS, "targets": ["w1"]}))
    model = tiny_model("mixtral")
    with pytest.raises(ValueError, match=r"no attention projection named \['qkv'\].*q_proj"):
        DistillModel(model, _keep(model), StudentSpec(lora={**ATTENTION, "targets": ["qkv"]}))


def test_presets_compose_and_bad_ones_fail(tmp_path):
    def cfg(*overrides):
        return compose_config("train", f"output_dir={tmp_path}", *overrides)

    # default: the auto preset, resolved per family by DistillModel (tests/test_stock_export.py)
    auto = {"kind": "auto", "rank": 8, "alpha": 16.0, "targets": ["gate_up_proj", "down_proj"]}
    assert lora_from_config(cfg().distill.trainable) == auto == StudentSpec.from_config(cfg().distill).lora
    assert lora_from_config(cfg("distill/trainable=always_on").distill.trainable) is None
    experts = lora_from_config(cfg("distill/trainable=always_on+lora_experts").distill.trainable)
    assert experts == {"kind": "experts", "rank": 8, "alpha": 16.0, "targets": ["gate_up_proj", "down_proj"]}
    attention = cfg("distill/trainable=always_on+lora_attention", "distill.trainable.rank=4").distill.trainable
    assert lora_from_config(attention)["rank"] == 4
    with pytest.raises(ValueError, match="distill.trainable.name=always_on but distill.trainable.lora=experts"):
        lora_from_config(cfg("distill/trainable=always_on", "distill.trainable.lora=experts").distill.trainable)
    with pytest.raises(ValueError, match="distill.trainable.name=auto but distill.trainable.lora=attention"):
        lora_from_config(cfg("distill.trainable.lora=attention").distill.trainable)
    with pytest.raises(Exception, match="rnak"):
        cfg("distill.trainable.rnak=4")
    with pytest.raises(Exception, match="always_on\\+lora_mlp"):
        cfg("distill/trainable=always_on+lora_mlp")


# ------------------------------------------------------------------------------------------ the trainer


def test_trainer_lora_run_counts_exports_and_resumes_bitwise(tmp_path):
    """engine=torch, 4 steps with checkpoints at 2 and 4; the step-4 checkpoint deleted and the run resumed from
    step 2 reproduces the same adapters bit for bit. Both export forms are written."""
    from slimwise_train.distill.trainer import run_train

    out = tmp_path / "run"
    cfg = compose_config("train", *TINY_TRAIN, *FAST_LR, *train_steps(4, save_every=2, eval_every=100, log_every=None),
                         "distill/trainable=always_on+lora_experts", "distill.trainable.rank=2", f"output_dir={out}",
                         "progress=false", "resume=auto")
    first = run_train(cfg)
    trained = load_file(str(out / "student_trainable.safetensors"))
    lora = {k: v for k, v in trained.items() if "lora_" in k}
    assert lora and any(v.abs().max() > 0 for k, v in lora.items() if "lora_B" in k)
    assert first["trainable_params"] == sum(v.numel() for v in trained.values())
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    share = [m["trainable_share"] for m in metrics if "trainable_share" in m][0]
    assert share == first["trainable_share"] and first["frozen_unchanged"] is True
    assert (out / "export" / "config.json").is_file() and (out / "adapter" / "adapter_config.json").is_file()
    assert json.loads((out / "adapter" / "slimwise_adapter.json").read_text())["trainable"] == "always_on+lora_experts"

    shutil.rmtree(out / "checkpoints" / "step_000004")
    second = run_train(cfg)  # resume=auto: from step 2
    assert second["steps_this_run"] == 2
    again = load_file(str(out / "student_trainable.safetensors"))
    assert set(again) == set(trained) and all(torch.equal(again[k], trained[k]) for k in trained)


@pytest.mark.dist
@pytest.mark.subprocess
def test_zero3_on_two_ranks_trains_lora_like_ddp(tmp_path):
    """torchrun, 2 gloo ranks: engine=zero3 (partitioned loading, each expert wrapper a ZeRO-3 leaf) against DDP
    (engine=torch) on the same micro-batches: the same trained tensors (1e-4, as tests/test_train_dist.py;
    measured 4.8e-6), every rank's copy identical, removed experts' pairs still zero. (Against one process
    with 2 accumulation micro-batches the losses agree to 1e-5 but the tensors only to 2e-3: other padding, and
    Adam's first steps on gradients that are exactly zero at step 1, B = 0, magnify the rounding.)"""
    common = [*TINY_TRAIN, *FAST_LR, *train_steps(4, log_every=None), "progress=false",
              "distill/trainable=always_on+lora_experts", "distill.trainable.rank=2", "data.batch_size=2",
              "prune.ratio=0.5"]
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1"}
    head = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    for cmd, out in (([*head, "-m", "slimwise_train", *common, "engine=zero3"], tmp_path / "zero3"),
                     ([*head, "-m", "slimwise_train", *common, "engine=torch"], tmp_path / "ddp")):
        proc = subprocess.run([*cmd, f"hydra.run.dir={out}"], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "zero3" / "summary.json").read_text())
    assert summary["engine"] == "zero3" and len(set(summary["rank_trainable_digests"])) == 1
    zero3 = load_file(str(tmp_path / "zero3" / "student_trainable.safetensors"))
    ddp = load_file(str(tmp_path / "ddp" / "student_trainable.safetensors"))
    assert set(zero3) == set(ddp) and any("lora_B" in k for k in zero3)
    assert max((zero3[k] - ddp[k]).abs().max().item() for k in ddp) <= 1e-4
    keep = KeepSet.load(tmp_path / "zero3" / "keep_set.json")
    num = keep.layers[0].num_experts
    for key, tensor in zero3.items():
        if "lora_B" in key and "experts" in key:
            layer = int(key.split("layers.")[1].split(".")[0])
            b = tensor.view(tensor.shape[0], -1, num)
            assert b.any() and not b[:, :, list(keep.layer(layer).removed)].any(), key

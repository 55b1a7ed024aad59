"""The one-module student/teacher (slimwise_train.distill.student) on every family, and its export.

Exactness claims use torch.equal (bit for bit). Comparisons between the student (stock output + delta) and a
model with the deltas folded into its weights (W + dW) allow 1e-4: same math, different rounding (measured
1.6e-6 .. 4.4e-6 on these tiny fp32 models).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from slimwise_train.moe.adapters import get_adapter
from slimwise_train.distill.export import export_student, folded_decoder, load_trainable, save_trainable
from slimwise_train.distill.student import (
    NORM_DELTA,
    ROUTER_DELTA,
    SHARED_EXPERT,
    SLOT_COLUMNS,
    DistillModel,
    StudentSpec,
    find_norms,
    routed_expert_size,
)
from slimwise_train.moe.handoff import continue_on_cache, prefill
from slimwise_train.moe.keepset import KeepSet
from slimwise_train.moe.masking import PhaseMasking
from slimwise_train.testing.tiny import SUPPORTED_TINY, TINY_VOCAB, tiny_model

REPO = Path(__file__).resolve().parents[1]
FOLD_TOL = 1e-4
KEPT = [[0, 2, 5, 7], [1, 3, 4, 6]]
families = pytest.mark.parametrize("model_type", SUPPORTED_TINY)



def _ids(batch=2, length=12, seed=0):
    return torch.randint(3, TINY_VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _keep(model, kept=KEPT):
    return KeepSet.from_kept(get_adapter(model).moe_layers(model), kept, model_type=model.config.model_type)


def _perturb(student, scale=0.1, seed=1):
    """Move every trainable tensor away from its init, as training would."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in student.trainable_named_parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)


@families
def test_untrained_student_equals_masked_model_exactly(model_type):
    model = tiny_model(model_type)
    keep = _keep(model)
    reference = copy.deepcopy(model)
    masking = PhaseMasking(reference, keep)
    ids = _ids()
    prefix, cont = ids[:, :7], ids[:, 7:]
    with torch.no_grad():
        full = reference(ids).logits
        with masking.phase("decode"):
            masked = reference(ids).logits
        # Handoff form: full-pool prefix cache, masked continuation on it.
        _, cache = prefill(reference, prefix)
        masked_cont, _ = continue_on_cache(reference, cache, cont, phase="decode")

    student = DistillModel(model, keep)
    with torch.no_grad():
        assert torch.equal(student(ids, phase="student", use_cache=False), masked)
        assert torch.equal(student(ids, phase="teacher", use_cache=False), full)
        _, cache = prefill(model, prefix)  # no phase masking on `model`: the teacher phase is the default
        student_cont = student(cont, past_key_values=cache, phase="student",
                               position_ids=torch.arange(7, 12).expand(2, -1))
    assert torch.equal(student_cont, masked_cont)
    assert not torch.equal(masked, full)  # the keep set matters, so the equalities above are not vacuous


@families
def test_teacher_phase_ignores_trained_tensors_and_student_equals_folded_model(model_type):
    model = tiny_model(model_type)
    original = copy.deepcopy(model)
    student = DistillModel(model, _keep(model))
    _perturb(student)
    ids = _ids()
    with torch.no_grad():
        assert torch.equal(student(ids, phase="teacher", use_cache=False), original(ids).logits)
        trained = student(ids, phase="student", use_cache=False)
        folded = folded_decoder(student)(ids).logits  # W + dW, w + dw, LoRA merged, experts sliced, slot widened
        masking = PhaseMasking(original, _keep(original))
        with masking.phase("decode"):
            untrained = original(ids).logits
    assert (trained - folded).abs().max() <= FOLD_TOL
    assert (trained - untrained).abs().max() > 1e-2  # the perturbation is visible: the check has teeth


@families
@pytest.mark.parametrize("mode", ["auto", "new"])
def test_only_routers_norms_and_shared_capacity_train(model_type, mode):
    """The default student (auto: the family's own slot, else no shared expert and LoRA on the kept experts) and the
    new-expert one: routers, norms and that capacity train, nothing else."""
    model = tiny_model(model_type)
    frozen_before = {n: p.detach().clone() for n, p in model.named_parameters()}
    student = DistillModel(model, _keep(model), StudentSpec(shared_expert_mode=mode))
    names = [n for n, _ in student.trainable_named_parameters()]
    # native mode: SLOT_COLUMNS; LoRA: peft's lora_A / lora_B of each adapted expert tensor
    kinds = {ROUTER_DELTA: 0, NORM_DELTA: 0, SHARED_EXPERT: 0, SLOT_COLUMNS: 0, "lora_": 0}
    for name in names:
        hits = [k for k in kinds if k in name]
        assert len(hits) == 1, name
        kinds[hits[0]] += 1
    moes = get_adapter(model).moe_layers(model)
    assert kinds[ROUTER_DELTA] == len(moes) * (2 if model_type == "gpt_oss" else 1)  # GPT-OSS: weight + bias
    assert kinds[NORM_DELTA] == len(find_norms(model, "all")) > 0
    shared_expected = mode == "new" or get_adapter(model).has_native_slot
    assert kinds[SHARED_EXPERT] + kinds[SLOT_COLUMNS] == (3 * len(moes) if shared_expected else 0)
    assert kinds["lora_"] == (0 if shared_expected else 4 * len(moes))  # A and B of gate_up_proj and down_proj
    for moe in moes:  # default shared-expert size = routed expert size; down projection starts at zero
        shared = student.trainable_shared_expert(moe)
        if not shared_expected:
            assert shared is None
            continue
        assert shared.down_proj.weight.shape[1] == routed_expert_size(model)
        assert not shared.down_proj.weight.any()
    counts = student.parameter_counts()
    assert counts["trainable"] == sum(p.numel() for _, p in student.trainable_named_parameters())
    assert counts["frozen"] == sum(t.numel() for t in frozen_before.values())

    # Gradients reach every trainable tensor kind and nothing else.
    ids = _ids()
    student(ids, phase="student", use_cache=False).float().pow(2).mean().backward()
    for name, p in student.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and torch.isfinite(p.grad).all(), name
        else:
            assert p.grad is None, name
    capacity = [p for n, p in student.trainable_named_parameters()
                if SHARED_EXPERT in n or SLOT_COLUMNS in n or "lora_B" in n]  # lora_A: zero gradient while B == 0
    assert capacity and any(p.grad.abs().sum() > 0 for p in capacity)


def test_student_spec_switches_and_shared_expert_size():
    model = tiny_model("qwen3_moe")
    student = DistillModel(model, _keep(model), StudentSpec(train_norms=False, shared_expert_intermediate_size=8,
                                                           norm_scope="layer", shared_expert_mode="new"))
    names = [n for n, _ in student.trainable_named_parameters()]
    assert not any(NORM_DELTA in n for n in names)
    assert all(getattr(m.block, SHARED_EXPERT).gate_proj.weight.shape[0] == 8 for m in student.moe_layers)
    layer_norms = [n for n, _ in find_norms(tiny_model("qwen3_moe"), "layer")]
    assert layer_norms and not any("q_norm" in n or "k_norm" in n for n in layer_norms)
    with pytest.raises(ValueError, match="nothing to train"):
        DistillModel(tiny_model("qwen3_moe"), _keep(model),
                     StudentSpec(train_routers=False, train_norms=False, train_shared_expert=False, lora=None))
    # Without a shared expert the default preset's LoRA is what trains.
    lora_only = DistillModel(tiny_model("qwen3_moe"), _keep(model),
                             StudentSpec(train_routers=False, train_norms=False, train_shared_expert=False))
    assert lora_only.parameter_counts()["trainable"] == lora_only.parameter_counts()["lora"] > 0


def test_keep_set_of_another_model_is_rejected():
    other = tiny_model("mixtral")
    with pytest.raises(ValueError, match="keep set was made for model_type 'mixtral'"):
        DistillModel(tiny_model("qwen3_moe"), _keep(other))


FRESH = r"""
import sys, torch
import slimwise_train.distill.export  # registers the Slimwise* architectures
from transformers import AutoModelForCausalLM
from slimwise_train.moe.handoff import continue_on_cache, prefill
root = sys.argv[1]
for name in sys.argv[2:]:
    teacher = AutoModelForCausalLM.from_pretrained(f"{root}/{name}/teacher").eval()
    decoder = AutoModelForCausalLM.from_pretrained(f"{root}/{name}/export").eval()
    ids = torch.load(f"{root}/{name}/ids.pt")
    with torch.no_grad():
        _, cache = prefill(teacher, ids[:, :7])
        logits, _ = continue_on_cache(decoder, cache, ids[:, 7:])
    torch.save({"logits": logits, "class": type(decoder).__name__}, f"{root}/{name}/fresh.pt")
"""


@pytest.mark.subprocess
def test_exported_decoder_reloads_in_a_fresh_process(tmp_path):
    """Export (folded routers/norms, pruned experts, a new shared expert), reload with no state from this process,
    and reproduce the student's continuation on the teacher's cache. Three families cover the layouts: plain
    attention, sliding window + MoE on the decoder layer (Gemma 4), hybrid linear attention (Qwen3-Next). (The
    shared expert in the family's own slot: tests/test_native_slot.py.)"""
    expected = {}
    names = ["qwen3_moe", "gemma4_text", "qwen3_next"]
    for name in names:
        model = tiny_model(name)
        model.save_pretrained(tmp_path / name / "teacher")
        student = DistillModel(model, _keep(model), StudentSpec(shared_expert_mode="new"))
        _perturb(student)
        ids = _ids(seed=3)
        torch.save(ids, tmp_path / name / "ids.pt")
        with torch.no_grad():
            _, cache = prefill(model, ids[:, :7])
            expected[name] = student(ids[:, 7:], past_key_values=cache, position_ids=torch.arange(7, 12).expand(2, -1),
                                     phase="student")
        export_student(student, tmp_path / name / "export")
        # The small file rebuilds the same student on a fresh teacher copy.
        path = save_trainable(tmp_path / name / "student.safetensors", student.trainable_state_dict(), student.keep_set,
                              student.spec, name)
        rebuilt = load_trainable(path, tiny_model(name))
        with torch.no_grad():
            assert torch.equal(rebuilt(ids, phase="student", use_cache=False), student(ids, phase="student", use_cache=False))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", FRESH, str(tmp_path), *names], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in names:
        fresh = torch.load(tmp_path / name / "fresh.pt")
        assert fresh["class"].startswith("Slimwise")
        assert (fresh["logits"] - expected[name]).abs().max() <= FOLD_TOL, name


def test_without_a_shared_expert_the_export_is_the_stock_class(tmp_path):
    """train_shared_expert=false on a family with a slot (the default LoRA on the kept experts then trains in its
    place) and plain routers + norms on one without (the no-module default: tests/test_stock_export.py)."""
    from transformers import AutoModelForCausalLM

    model = tiny_model("qwen2_moe")
    student = DistillModel(model, _keep(model), StudentSpec(train_shared_expert=False))
    assert student.spec.shared_expert_mode == "none" and student.spec.lora["kind"] == "experts"
    _perturb(student)
    export_student(student, tmp_path / "slot")
    config = (tmp_path / "slot" / "config.json").read_text()
    assert '"model_type": "qwen2_moe"' in config and "Slimwise" not in config
    assert '"shared_expert_intermediate_size": 24' in config  # the stock slot, not widened
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "slot")
    ids = _ids()
    with torch.no_grad():
        assert (reloaded(ids).logits - student(ids, phase="student", use_cache=False)).abs().max() <= FOLD_TOL

    model = tiny_model("qwen3_moe")
    student = DistillModel(model, _keep(model), StudentSpec(lora=None))
    _perturb(student)
    export_student(student, tmp_path / "export")
    config = (tmp_path / "export" / "config.json").read_text()
    assert '"model_type": "qwen3_moe"' in config and "Slimwise" not in config
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    assert type(reloaded).__name__ == "Qwen3MoeForCausalLM" and reloaded.config.num_experts == 4
    ids = _ids()
    with torch.no_grad():
        assert (reloaded(ids).logits - student(ids, phase="student", use_cache=False)).abs().max() <= FOLD_TOL


NO_PROJECT = r"""
import json, sys, torch
from transformers import AutoModelForCausalLM
root = sys.argv[1]
for name in sys.argv[2:]:
    try:
        AutoModelForCausalLM.from_pretrained(f"{root}/{name}/export")
        refused = ""
    except Exception as exc:  # transformers asks for trust_remote_code
        refused = str(exc)
    decoder = AutoModelForCausalLM.from_pretrained(f"{root}/{name}/export", trust_remote_code=True).eval()
    ids = torch.load(f"{root}/{name}/ids.pt")
    with torch.no_grad():
        logits = decoder(ids, use_cache=False).logits
    torch.save({"logits": logits, "class": type(decoder).__name__, "refused": refused}, f"{root}/{name}/remote.pt")
assert not any(m.startswith("slimwise_train") for m in sys.modules), "the export needed the project"
"""


REMOTE_CODE_TOL = 1e-5


@pytest.mark.subprocess
def test_every_family_export_loads_with_trust_remote_code_and_no_project_import(tmp_path):
    """The export with a new shared expert carries its own modeling file and auto_map: a process that never
    imports slimwise_train loads it with `trust_remote_code=True` and reproduces the registered class's logits;
    without it, transformers refuses with a message that names trust_remote_code."""
    from transformers import AutoModelForCausalLM

    expected = {}
    for name in SUPPORTED_TINY:
        model = tiny_model(name)
        student = DistillModel(model, _keep(model), StudentSpec(shared_expert_mode="new"))
        _perturb(student)
        export_student(student, tmp_path / name / "export")
        ids = _ids(seed=5)
        torch.save(ids, tmp_path / name / "ids.pt")
        registered = AutoModelForCausalLM.from_pretrained(tmp_path / name / "export").eval()
        with torch.no_grad():
            expected[name] = registered(ids, use_cache=False).logits
        config = json.loads((tmp_path / name / "export" / "config.json").read_text())
        assert config["auto_map"]["AutoModelForCausalLM"].startswith("modeling_slimwise.Slimwise"), name
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "HF_MODULES_CACHE": str(tmp_path / "hf_modules")}
    proc = subprocess.run([sys.executable, "-c", NO_PROJECT, str(tmp_path), *SUPPORTED_TINY], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in SUPPORTED_TINY:
        remote = torch.load(tmp_path / name / "remote.pt")
        assert remote["class"].startswith("Slimwise"), name
        assert "trust_remote_code" in remote["refused"], (name, remote["refused"][:300])
        # Two implementations (the registered class here, modeling_slimwise.py there), two processes: equal here to
        # the bit, but GPT-OSS differed by 3.9e-7 on another machine of this kind (issue 24, item 17). A stated
        # tolerance, as every other cross-process comparison of exports uses (test_native_slot's EXPORT_TOL).
        diff = (remote["logits"] - expected[name]).abs().max().item()
        assert diff <= REMOTE_CODE_TOL, (name, diff)


def test_in_place_export_equals_the_copying_one(tmp_path):
    """A student rebuilt only to be exported (the ZeRO-3 path) folds into its own weights: same checkpoint."""
    from safetensors.torch import load_file

    folders = {}
    for in_place in (False, True):
        model = tiny_model("qwen3_moe")
        student = DistillModel(model, _keep(model))
        _perturb(student)
        folders[in_place] = export_student(student, tmp_path / str(in_place), in_place=in_place)
    copied, folded = (load_file(str(folders[k] / "model.safetensors")) for k in (False, True))
    assert copied.keys() == folded.keys() and all(torch.equal(copied[k], folded[k]) for k in copied)

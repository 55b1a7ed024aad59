"""The shared expert in the family's own slot (distill.student.shared_expert_mode=native) on every family that has one.

The student trains extra intermediate columns of the slot (Qwen's gated `shared_expert`, DeepSeek-V3's
`shared_experts`, Gemma 4's dense `mlp`); the export concatenates them into the slot and grows the config, so the
distilled decoder is the stock class. Exactness claims use torch.equal.

Student (slot + columns, routers and norms as stock + delta) vs the export (one wider slot, W + dW folded): same
math, different fp32 rounding. EXPORT_TOL 1e-5 holds with the slot's columns and the router deltas trained (measured
<= 1.5e-6 on every family). Folding a norm delta (w + dw) moves the first norm's output by ~1 ulp, which Qwen3.5's
tiny random linear attention and the norm after it amplify ~100x: 1e-5 .. 4e-5 in the logits for ANY nonzero norm
delta, in both shared-expert modes (the other families stay <= 4.3e-6). With norms trained too the check is
test_student's FOLD_TOL 1e-4.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from slimwise_train.distill.export import export_student, folded_decoder, load_trainable, save_trainable
from slimwise_train.distill.student import SHARED_EXPERT, SLOT_COLUMNS, DistillModel, StudentSpec
from slimwise_train.moe.adapters import get_adapter
from slimwise_train.moe.handoff import continue_on_cache, prefill
from slimwise_train.moe.masking import PhaseMasking
from slimwise_train.testing.tiny import SUPPORTED_TINY, tiny_config, tiny_model
from test_student import FOLD_TOL, _ids, _keep, _perturb

from helpers import train_cfg

EXPORT_TOL = 1e-5
SPLIT = 7  # the teacher prefills ids[:, :SPLIT]; the student / export decode the rest on its cache
SLOT_FAMILIES = tuple(t for t in SUPPORTED_TINY if get_adapter(tiny_config(t)).has_native_slot)
NO_SLOT_FAMILIES = tuple(t for t in SUPPORTED_TINY if t not in SLOT_FAMILIES)
NATIVE = StudentSpec(shared_expert_mode="native")
# The config field each tiny family grows by the default width (the routed expert size, 16 columns).
GROWN = {
    "qwen2_moe": ("shared_expert_intermediate_size", 24, 40),
    "qwen3_next": ("shared_expert_intermediate_size", 24, 40),
    "qwen3_5_moe_text": ("shared_expert_intermediate_size", 24, 40),
    "gemma4_text": ("intermediate_size", 48, 64),
    "deepseek_v3": ("n_shared_experts", 1, 2),  # one more shared expert of moe_intermediate_size columns
}
slot_families = pytest.mark.parametrize("model_type", SLOT_FAMILIES)


def test_the_families_with_a_slot():
    assert set(SLOT_FAMILIES) == set(GROWN)
    assert {"qwen3_moe", "mixtral", "olmoe", "gpt_oss"} <= set(NO_SLOT_FAMILIES)  # a new family without a slot joins


def run_fresh(root, names) -> dict:
    """FRESH in a process that never imports the project, over the exports `<root>/<name>/export`: {name: its class
    and logits on the teacher's cache}, after checking the process imported nothing of the project."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", FRESH, str(root), str(SPLIT), *names], cwd=root,
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    fresh = torch.load(root / "fresh.pt")
    assert fresh["project_modules"] == []  # the export needed nothing from the project
    return fresh


def export_perturbed_stock(family: str, spec, ids: torch.Tensor, folder):
    """A student of `family` with every trainable tensor perturbed, its logits on the teacher's cache, and its export
    to `folder`, checked to be a stock-class folder (no auto_map, no modeling file). Returns (student, logits, folder,
    config.json as a dict)."""
    model = tiny_model(family)
    student = DistillModel(model, _keep(model), spec)
    _perturb(student)
    expected = _on_teacher_cache(student, ids)
    folder = export_student(student, folder)
    config = json.loads((folder / "config.json").read_text())
    assert "auto_map" not in config and not (folder / "modeling_slimwise.py").exists(), folder
    return student, expected, folder, config


def _on_teacher_cache(student: DistillModel, ids: torch.Tensor) -> torch.Tensor:
    """The handoff: the stock model (teacher phase) prefills ids[:, :SPLIT]; the student continues on its cache."""
    batch, length = ids.shape
    with torch.no_grad():
        _, cache = prefill(student.model, ids[:, :SPLIT])
        return student(ids[:, SPLIT:], attention_mask=torch.ones(batch, length, dtype=torch.long),
                       position_ids=torch.arange(SPLIT, length).expand(batch, -1), past_key_values=cache,
                       phase="student")


@slot_families
def test_untrained_native_student_equals_masked_model_and_teacher_phase_the_stock_model(model_type):
    model = tiny_model(model_type)
    keep = _keep(model)
    stock = copy.deepcopy(model)
    masking = PhaseMasking(stock, keep)
    ids = _ids()
    with torch.no_grad():
        full = stock(ids).logits
        with masking.phase("decode"):
            masked = stock(ids).logits
    student = DistillModel(model, keep)  # auto -> native on these families
    assert student.spec.shared_expert_mode == "native"
    with torch.no_grad():
        assert torch.equal(student(ids, phase="student", use_cache=False), masked)
        assert torch.equal(student(ids, phase="teacher", use_cache=False), full)
        # Handoff form: the full-pool prefix cache, then the masked continuation on it.
        _, cache = prefill(stock, ids[:, :SPLIT])
        masked_cont, _ = continue_on_cache(stock, cache, ids[:, SPLIT:], phase="decode")
    assert torch.equal(_on_teacher_cache(student, ids), masked_cont)
    # Trained columns (and deltas) leave the teacher phase the stock model, bit for bit.
    _perturb(student)
    with torch.no_grad():
        assert torch.equal(student(ids, phase="teacher", use_cache=False), full)
        assert (student(ids, phase="student", use_cache=False) - masked).abs().max() > 1e-2


@slot_families
def test_native_columns_sit_in_the_slot_start_silent_and_train(model_type):
    model = tiny_model(model_type)
    student = DistillModel(model, _keep(model), NATIVE)
    adapter = get_adapter(model)
    names = [n for n, _ in student.trainable_named_parameters()]
    assert not any(SHARED_EXPERT in n for n in names)
    for moe in student.moe_layers:
        columns = getattr(adapter.native_slot(moe), SLOT_COLUMNS)
        assert student.trainable_shared_expert(moe) is columns
        assert columns.gate_proj.weight.shape == (16, 32) and columns.down_proj.weight.shape == (32, 16)
        assert columns.gate_proj.weight.any() and not columns.down_proj.weight.any()  # silent until trained
    assert sum(SLOT_COLUMNS in n for n in names) == 3 * len(student.moe_layers)
    assert student.parameter_counts()["shared_expert"] == 3 * 16 * 32 * len(student.moe_layers)
    student(_ids(), phase="student", use_cache=False).float().pow(2).mean().backward()
    down = [p for n, p in student.trainable_named_parameters() if SLOT_COLUMNS in n and "down_proj" in n]
    assert down and all(p.grad is not None and p.grad.abs().sum() > 0 for p in down)
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)  # the slot itself stays frozen


FRESH = r"""
import sys, torch
from transformers import AutoModelForCausalLM
root, split = sys.argv[1], int(sys.argv[2])
out = {}
for name in sys.argv[3:]:
    family = name.split("/")[0]
    teacher = AutoModelForCausalLM.from_pretrained(f"{root}/{family}/teacher").eval()
    decoder = AutoModelForCausalLM.from_pretrained(f"{root}/{name}/export").eval()
    ids = torch.load(f"{root}/{family}/ids.pt")
    batch, length = ids.shape
    with torch.no_grad():
        cache = teacher(ids[:, :split], attention_mask=torch.ones(batch, split, dtype=torch.long),
                        position_ids=torch.arange(split).expand(batch, -1), use_cache=True).past_key_values
        logits = decoder(ids[:, split:], attention_mask=torch.ones(batch, length, dtype=torch.long),
                         position_ids=torch.arange(split, length).expand(batch, -1), past_key_values=cache,
                         use_cache=True).logits
    out[name] = {"logits": logits, "class": type(decoder).__name__}
out["project_modules"] = sorted(m for m in sys.modules if m.startswith("slimwise_train"))
torch.save(out, f"{root}/fresh.pt")
"""
# What trains in each exported student, and the tolerance that applies (module docstring).
TRAINED = {"slot+routers": (StudentSpec(shared_expert_mode="native", train_norms=False), EXPORT_TOL),
           "everything": (NATIVE, FOLD_TOL)}


@pytest.mark.subprocess
def test_native_export_is_the_stock_class_and_decodes_on_the_teachers_cache_in_a_fresh_process(tmp_path):
    """Every slot family: trained (perturbed) tensors, export, then a process that never imports slimwise_train
    loads the teacher and the export with plain from_pretrained (no trust_remote_code) and decodes the continuation
    on the teacher's cache: equal to the student on the same cache."""
    expected = {}
    ids = _ids(seed=3)
    for family in SLOT_FAMILIES:
        tiny_model(family).save_pretrained(tmp_path / family / "teacher")
        torch.save(ids, tmp_path / family / "ids.pt")
        for variant, (spec, _) in TRAINED.items():
            name = f"{family}/{variant}"
            student, expected[name], folder, config = export_perturbed_stock(family, spec, ids, tmp_path / name / "export")
            assert not any(a.startswith("Slimwise") for a in config["architectures"]), name
            key, before, after = GROWN[family]
            assert getattr(student.model.config, key) == before  # the export grew a copy's config, not the student's
            assert config[key] == after, name
            info = json.loads((folder / "slimwise_export.json").read_text())
            assert info["architecture"] == "stock" and info["shared_expert"] == "native", name
    fresh = run_fresh(tmp_path, expected)
    for name, logits in expected.items():
        assert not fresh[name]["class"].startswith("Slimwise"), name
        diff = (fresh[name]["logits"] - logits).abs().max().item()
        assert diff <= TRAINED[name.split("/")[1]][1], (name, diff)


@slot_families
def test_native_zero3_export_path_rebuilds_from_the_small_file_and_folds_in_place(model_type, tmp_path):
    """The ZeRO-3 run exports by rebuilding the student on a fresh teacher from student_trainable.safetensors and
    folding in place (trainer._export): same checkpoint as folding a copy of the live student."""
    model = tiny_model(model_type)
    student = DistillModel(model, _keep(model))
    _perturb(student)
    path = save_trainable(tmp_path / "student.safetensors", student.trainable_state_dict(), student.keep_set,
                          student.spec, model_type)
    with safe_open(str(path), "pt") as handle:  # the resolved mode is recorded, never auto
        assert json.loads(handle.metadata()["spec"])["shared_expert_mode"] == "native"
    rebuilt = load_trainable(path, tiny_model(model_type))
    ids = _ids()
    with torch.no_grad():
        assert torch.equal(rebuilt(ids, phase="student", use_cache=False),
                           student(ids, phase="student", use_cache=False))
    copied = export_student(student, tmp_path / "copied")
    folded = export_student(rebuilt, tmp_path / "in_place", in_place=True)
    a, b = (load_file(str(folder / "model.safetensors")) for folder in (copied, folded))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_student_file_from_before_the_mode_existed_loads_as_a_new_shared_expert(tmp_path):
    model = tiny_model("qwen2_moe")
    student = DistillModel(model, _keep(model), StudentSpec(shared_expert_mode="new"))
    path = save_trainable(tmp_path / "student.safetensors", student.trainable_state_dict(), student.keep_set,
                          student.spec, "qwen2_moe")
    with safe_open(str(path), "pt") as handle:
        meta, state = handle.metadata(), {k: handle.get_tensor(k) for k in handle.keys()}
    spec = json.loads(meta["spec"])
    del spec["shared_expert_mode"]
    save_file(state, str(path), metadata={**meta, "spec": json.dumps(spec)})
    assert load_trainable(path, tiny_model("qwen2_moe")).spec.shared_expert_mode == "new"


@pytest.mark.parametrize("model_type", NO_SLOT_FAMILIES)
def test_native_on_a_family_without_a_slot_is_a_one_line_error_and_auto_means_none(model_type):
    model = tiny_model(model_type)
    with pytest.raises(ValueError, match="has no shared-expert slot.*use distill.student.shared_expert_mode=auto or "
                                         r"none \(stock-class export\) or new") as error:
        DistillModel(model, _keep(model), NATIVE)
    assert "\n" not in str(error.value)
    assert DistillModel(model, _keep(model)).spec.shared_expert_mode == "none"  # tests/test_stock_export.py


def test_widths_a_family_cannot_express_and_unknown_modes_are_refused():
    model = tiny_model("deepseek_v3")
    with pytest.raises(ValueError, match="=24 is not a multiple of moe_intermediate_size=16.*shared_expert_mode=none"):
        DistillModel(model, _keep(model), StudentSpec(shared_expert_mode="native", shared_expert_intermediate_size=24))
    student = DistillModel(model, _keep(model), StudentSpec(shared_expert_mode="native",
                                                           shared_expert_intermediate_size=32))
    assert folded_decoder(student).config.n_shared_experts == 3  # two more experts of 16 columns
    with pytest.raises(ValueError, match="unknown distill.student.shared_expert_mode 'slot'"):
        DistillModel(model, _keep(model), StudentSpec(shared_expert_mode="slot"))
    # Gemma 4's KV-shared layers of a double-wide config build their MLP at twice intermediate_size.
    double_wide = tiny_config("gemma4_text", use_double_wide_mlp=True, num_kv_shared_layers=1)
    with pytest.raises(ValueError, match="use_double_wide_mlp.*use distill.student.shared_expert_mode=none .* or new"):
        get_adapter(double_wide).widened_slot_config(double_wide, 16)


def test_trainer_runs_native_mode_end_to_end(tmp_path):
    """A few real steps on the tiny Qwen2-MoE (auto -> native); the export is the stock class with a wider slot and
    equals the trained student."""
    from transformers import AutoModelForCausalLM

    from slimwise_train.distill.trainer import Trainer

    cfg = train_cfg(tmp_path, "model=tiny_qwen2_moe", "distill.schedule.max_steps=3", "distill.eval.every=3",
                   "distill.checkpoint.every=3")
    trainer = Trainer(cfg).setup()
    try:
        summary = trainer.train()
        student = trainer.student
        assert student.spec.shared_expert_mode == "native"
        assert all(student.trainable_shared_expert(moe).down_proj.weight.abs().sum() > 0
                   for moe in student.moe_layers)  # the columns trained
        assert summary["trainable_params"] == student.parameter_counts()["trainable"] and summary["frozen_unchanged"]
        config = json.loads((tmp_path / "export" / "config.json").read_text())
        assert "auto_map" not in config and config["model_type"] == "qwen2_moe"
        assert config["shared_expert_intermediate_size"] == 24 + 16
        exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
        ids = torch.stack([torch.tensor(seq[:12]) for seq, _ in trainer.eval_seqs[:2]])
        with torch.no_grad():
            diff = (exported(ids).logits - student(ids, phase="student", use_cache=False)).abs().max().item()
        assert diff <= EXPORT_TOL, diff
    finally:
        trainer.close()

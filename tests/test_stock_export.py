"""The no-module student (distill.student.shared_expert_mode=none, the default on the families without a shared slot).

Qwen3-MoE, Mixtral, OLMoE and GPT-OSS have no shared slot of their own to widen, so by default (`auto` mode and the
`auto` trainable preset) their student adds no module: router and norm deltas plus LoRA on the kept experts, all
folded or merged at export. The export is then the stock class, loaded by plain `from_pretrained` in a process
that never imports the project (tests/test_native_slot.py's FRESH script), like the native-slot export of the other
five families. A new shared expert (remote code) stays available as shared_expert_mode=new.

Tolerance: the export against the student on the teacher's cache, EXPORT_TOL = 1e-5 (the issue's bar): same math,
other rounding (W + dW and w + dw folded, W + s B A merged). Measured on these tiny fp32 models with every trainable
tensor perturbed: 1.4e-6 .. 2.7e-6 over the eight exports (four families, expert and attention LoRA).
"""

from __future__ import annotations

import json
from typing import get_args

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from slimwise_train.config import SharedExpertMode, TrainablePreset
from slimwise_train.distill.export import load_trainable, save_trainable
from slimwise_train.distill.lora import TRAINABLE_PRESETS
from slimwise_train.distill.student import SHARED_EXPERT, SLOT_COLUMNS, DistillModel, StudentSpec
from slimwise_train.testing.tiny import SUPPORTED_TINY, tiny_model
from test_lora import ATTENTION
from test_native_slot import EXPORT_TOL, NO_SLOT_FAMILIES, SLOT_FAMILIES, export_perturbed_stock, run_fresh

from helpers import compose_config, train_cfg
from test_student import _ids, _keep, _perturb

# What the no-module student trains in each exported variant: the default, and the other LoRA kind.
NO_MODULE = {"default": StudentSpec(), "attention": StudentSpec(shared_expert_mode="none", lora=ATTENTION)}


def test_auto_resolves_to_the_slot_where_there_is_one_and_to_lora_on_kept_experts_elsewhere():
    for family in SUPPORTED_TINY:
        model = tiny_model(family)
        spec = DistillModel(model, _keep(model)).spec
        if family in SLOT_FAMILIES:
            assert (spec.shared_expert_mode, spec.train_shared_expert, spec.lora) == ("native", True, None), family
        else:
            assert (spec.shared_expert_mode, spec.train_shared_expert) == ("none", False), family
            assert spec.lora == {"kind": "experts", "rank": 8, "alpha": 16.0,
                                 "targets": ["gate_up_proj", "down_proj"]}, family
    # With a new shared expert asked for, the auto preset adds no LoRA: the new-expert preset as it was.
    model = tiny_model("qwen3_moe")
    spec = DistillModel(model, _keep(model), StudentSpec(shared_expert_mode="new")).spec
    assert (spec.shared_expert_mode, spec.lora) == ("new", None)
    # No shared expert, whichever way it is asked for, reads as mode none (what save_trainable records).
    model = tiny_model("qwen2_moe")
    spec = DistillModel(model, _keep(model), StudentSpec(train_shared_expert=False)).spec
    assert (spec.shared_expert_mode, spec.train_shared_expert, spec.lora["kind"]) == ("none", False, "experts")


@pytest.mark.parametrize("model_type", NO_SLOT_FAMILIES)
def test_no_module_student_adds_no_module_and_starts_as_the_masked_model(model_type):
    """No shared expert anywhere; the LoRA pairs are the only additions besides the deltas, and untrained (B = 0)
    the student is the masked model bit for bit (test_student checks that equality on every family's default)."""
    model = tiny_model(model_type)
    student = DistillModel(model, _keep(model))
    names = [n for n, _ in student.trainable_named_parameters()]
    assert not any(SHARED_EXPERT in n or SLOT_COLUMNS in n for n in names)
    assert all(student.trainable_shared_expert(moe) is None for moe in student.moe_layers)
    counts = student.parameter_counts()
    assert counts["shared_expert"] == 0 and counts["lora"] > 0 and counts["router"] > 0 and counts["norm"] > 0


@pytest.mark.subprocess
def test_no_module_export_is_the_stock_class_and_decodes_on_the_teachers_cache_in_a_fresh_process(tmp_path):
    """Every family without a slot, every trainable tensor perturbed: the export has no auto_map, no modeling file
    and a stock architecture; a process that never imports slimwise_train loads the teacher and the export with
    plain from_pretrained and decodes the continuation on the teacher's cache: equal to the student within 1e-5."""
    expected = {}
    ids = _ids(seed=3)
    for family in NO_SLOT_FAMILIES:
        teacher = tiny_model(family)
        teacher.save_pretrained(tmp_path / family / "teacher")
        torch.save(ids, tmp_path / family / "ids.pt")
        for variant, spec in NO_MODULE.items():
            name = f"{family}/{variant}"
            _, expected[name], folder, config = export_perturbed_stock(family, spec, ids, tmp_path / name / "export")
            assert config["model_type"] == family and config["architectures"] == [type(teacher).__name__], name
            info = json.loads((folder / "slimwise_export.json").read_text())
            assert info["architecture"] == "stock" and info["shared_expert"] is None, name
            assert info["trainable"] == f"always_on+lora_{'experts' if variant == 'default' else 'attention'}", name
    fresh = run_fresh(tmp_path, expected)
    for name, logits in expected.items():
        family = name.split("/")[0]
        assert fresh[name]["class"] == type(tiny_model(family)).__name__, name
        diff = (fresh[name]["logits"] - logits).abs().max().item()
        assert diff <= EXPORT_TOL, (name, diff)


def test_removed_hooks_leave_the_stock_model_even_after_a_student_forward():
    """remove_hooks switches the LoRA layers off: without their phase hook they would stay as the last forward
    (a student one) left them, and the teacher model would silently carry the adapters."""
    import copy

    model = tiny_model("gpt_oss")
    stock = copy.deepcopy(model)
    student = DistillModel(model, _keep(model))
    _perturb(student)
    ids = _ids()
    with torch.no_grad():
        student(ids, phase="student", use_cache=False)
        student.remove_hooks()
        assert torch.equal(model(ids).logits, stock(ids).logits)


def test_student_file_records_the_resolved_preset_and_old_files_keep_theirs(tmp_path):
    """save_trainable records mode none and LoRA on experts (never auto), so load_trainable rebuilds the same
    student; a file from before distill.trainable existed (no `lora` key) rebuilds without LoRA, not with the
    new default."""
    model = tiny_model("olmoe")
    student = DistillModel(model, _keep(model))
    _perturb(student)
    path = save_trainable(tmp_path / "student.safetensors", student.trainable_state_dict(), student.keep_set,
                          student.spec, "olmoe")
    with safe_open(str(path), "pt") as handle:
        meta = handle.metadata()
    spec = json.loads(meta["spec"])
    assert spec["shared_expert_mode"] == "none" and spec["lora"]["kind"] == "experts"
    rebuilt = load_trainable(path, tiny_model("olmoe"))
    ids = _ids()
    with torch.no_grad():
        assert torch.equal(rebuilt(ids, phase="student", use_cache=False),
                           student(ids, phase="student", use_cache=False))
    old = DistillModel(tiny_model("olmoe"), _keep(model), StudentSpec(shared_expert_mode="new", lora=None))
    old_spec = {k: v for k, v in old.spec.__dict__.items() if k not in ("lora",)}
    save_file(old.trainable_state_dict(), str(path), metadata={**meta, "spec": json.dumps(old_spec)})
    assert load_trainable(path, tiny_model("olmoe")).spec.lora is None


def test_choices_come_from_the_schema_and_bad_values_are_one_line_errors(tmp_path):
    from slimwise_train.distill.student import SHARED_EXPERT_MODES
    from slimwise_train.distill.trainer import validate_train_config

    assert SHARED_EXPERT_MODES == get_args(SharedExpertMode) == ("auto", "native", "new", "none")
    assert tuple(TRAINABLE_PRESETS) == get_args(TrainablePreset)

    def cfg(*overrides):
        return compose_config("train", f"output_dir={tmp_path}", *overrides)

    default = cfg()
    assert default.distill.trainable.name == "auto" and default.distill.student.shared_expert_mode == "auto"
    assert StudentSpec.from_config(default.distill) == StudentSpec()  # one set of defaults
    for override, message in (("distill.student.shared_expert_mode=shared",
                               "distill.student.shared_expert_mode='shared' is not one of: auto, native, new, none"),
                              ("distill.trainable.name=lora", "distill.trainable.name='lora' is not one of"),
                              ("distill.student.norm_scope=some",
                               "distill.student.norm_scope='some' is not one of: all, layer")):
        with pytest.raises(ValueError, match=message) as error:
            validate_train_config(cfg(override))
        assert "\n" not in str(error.value)
    model = tiny_model("mixtral")
    with pytest.raises(ValueError, match="nothing to train") as error:
        DistillModel(model, _keep(model), StudentSpec(train_routers=False, train_norms=False,
                                                     shared_expert_mode="none", lora=None))
    assert "\n" not in str(error.value)


def test_trainer_default_on_a_family_without_a_slot_exports_the_stock_class(tmp_path):
    """A few real steps on the tiny Qwen3-MoE with the default config: no shared expert, LoRA on the kept experts
    trained; export/ is plain Qwen3MoeForCausalLM with the kept experts only and equals the trained student."""
    from transformers import AutoModelForCausalLM

    from slimwise_train.distill.trainer import Trainer

    cfg = train_cfg(tmp_path, "model=tiny_qwen3_moe", "distill.schedule.max_steps=3", "distill.eval.every=3",
                   "distill.checkpoint.every=3")
    trainer = Trainer(cfg).setup()
    try:
        summary = trainer.train()
        student = trainer.student
        assert student.spec.shared_expert_mode == "none" and student.spec.lora["kind"] == "experts"
        lora_b = [p for n, p in student.trainable_named_parameters() if "lora_B" in n]
        assert lora_b and all(p.abs().sum() > 0 for p in lora_b)  # the LoRA trained
        assert summary["trainable_params"] == student.parameter_counts()["trainable"] and summary["frozen_unchanged"]
        config = json.loads((tmp_path / "export" / "config.json").read_text())
        assert "auto_map" not in config and config["model_type"] == "qwen3_moe"
        assert not (tmp_path / "export" / "modeling_slimwise.py").exists()
        exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
        assert type(exported).__name__ == "Qwen3MoeForCausalLM" and exported.config.num_experts == 4  # 8, half kept
        ids = torch.stack([torch.tensor(seq[:12]) for seq, _ in trainer.eval_seqs[:2]])
        with torch.no_grad():
            diff = (exported(ids).logits - student(ids, phase="student", use_cache=False)).abs().max().item()
        assert diff <= EXPORT_TOL, diff
    finally:
        trainer.close()


def test_resuming_a_run_of_another_student_is_a_one_line_error(tmp_path):
    """A run from before this default (a new shared expert on Qwen3-MoE) resumed under the default config would
    otherwise fail with a KeyError (engine=torch) or load partly (DeepSpeed); with its student named it resumes."""
    from slimwise_train.distill.trainer import run_train

    old = ["distill.student.shared_expert_mode=new", "distill/trainable=always_on"]
    common = ["model=tiny_qwen3_moe", "distill.checkpoint.every=2", "distill.eval.every=100", "distill.export=false",
              "resume=auto"]
    run_train(train_cfg(tmp_path, *common, *old, "distill.schedule.max_steps=2"))
    with pytest.raises(ValueError, match="it trained another student.*distill.student.shared_expert_mode=new with "
                                         "distill/trainable=always_on") as error:
        run_train(train_cfg(tmp_path, *common, "distill.schedule.max_steps=4"))
    assert "\n" not in str(error.value)
    assert run_train(train_cfg(tmp_path, *common, *old, "distill.schedule.max_steps=4"))["steps_this_run"] == 2

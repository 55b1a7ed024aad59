"""moe/keepset_rules.py: which keep set a run uses and whether it may, one rule for prune, train, eval and lm_eval.

Weights are compared by content: a byte-identical copy of the teacher at another path is the same model, a copy with
one byte changed is another (refused everywhere, before the weights load; allowed with a warning saying the model
changed). Keep sets from before the weights record are compared by name (the same folder by another path counts).
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from slimwise_train.config import ModelConfig
from slimwise_train.models import load_config, model_weights
from slimwise_train.moe.keepset import KeepSet, LayerKeep
from slimwise_train.moe.keepset_rules import ModelWeights, check_scored_on, keep_set_for_run, provenance

from helpers import CHILD_ENV, REPO, TINY_TRAIN, compose_config, train_steps

TEACHER = REPO / "slimwise_train" / "assets" / "teacher"


def model_cfg(**fields):
    return OmegaConf.structured(ModelConfig(name="m", **fields))


@pytest.fixture(scope="module")
def teachers(tmp_path_factory):
    """The shipped teacher, a byte-identical copy at another path, and a copy with one weight byte changed; a keep set
    scored on the changed one (what the prune app records on it)."""
    root = tmp_path_factory.mktemp("teachers")
    same, changed = root / "copy", root / "changed"
    shutil.copytree(TEACHER, same)
    shutil.copytree(TEACHER, changed)
    weights = changed / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # the last byte of the last tensor: another model, same layout
    weights.write_bytes(bytes(data))
    config = load_config(model_cfg(path=str(TEACHER)))
    half = tuple(range(config.num_experts // 2))
    layers = tuple(LayerKeep(i, config.num_experts, config.num_experts_per_tok, half)
                   for i in range(config.num_hidden_layers))
    for name, scored_on in (("scored_on_changed.json", changed), ("scored_on_copy.json", same)):
        KeepSet(layers, config.model_type, provenance(model_weights(model_cfg(path=str(scored_on))))).save(root / name)
    return {"root": root, "same": same, "changed": changed, "foreign": root / "scored_on_changed.json",
            "copy_keep": root / "scored_on_copy.json"}


# --------------------------------------------------------------------------- the content of a model


def test_a_byte_identical_copy_is_the_same_model_and_a_changed_byte_is_not(teachers):
    original = model_weights(model_cfg(path=str(TEACHER)))
    copy = model_weights(model_cfg(path=str(teachers["same"])))
    changed = model_weights(model_cfg(path=str(teachers["changed"])))
    assert original.folder != copy.folder and original.sha256 == copy.sha256 != changed.sha256
    assert copy.matches(original.record()) and not changed.matches(original.record())
    # serve names a folder alone: the same content
    assert ModelWeights.of_folder(teachers["same"]).sha256 == original.sha256


def test_a_checkpoint_rewritten_in_place_is_another_model(tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(TEACHER, folder)
    recorded = model_weights(model_cfg(path=str(folder))).record()
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))  # a fine-tune saved over the same folder: same path, new size/time
    assert model_weights(model_cfg(path=str(folder))).matches(recorded) is False


def test_a_tiny_model_is_its_recipe():
    base = model_weights(model_cfg(tiny="qwen3_moe"))
    assert base.sha256 == model_weights(model_cfg(tiny="qwen3_moe")).sha256
    assert base.sha256 != model_weights(model_cfg(tiny="qwen3_moe", seed=1)).sha256
    assert base.sha256 != model_weights(model_cfg(tiny="qwen3_moe", tiny_overrides={"num_experts": 16})).sha256


def test_a_keep_set_from_before_the_weights_record_is_compared_by_name(tmp_path, monkeypatch):
    (tmp_path / "ckpt").mkdir()
    monkeypatch.chdir(tmp_path)
    model = model_weights(model_cfg(path="ckpt"))
    assert model.has_name(f"{tmp_path / 'ckpt'}@main") and model.has_name("./ckpt@main")
    assert not model.has_name(f"{tmp_path / 'ckpt'}@v2") and not model.has_name("other/ckpt@main")


def test_scored_on_other_weights_is_refused_and_allowed_with_a_warning_that_the_model_changed(teachers, caplog):
    keep = KeepSet.load(teachers["foreign"])
    teacher = model_weights(model_cfg(path=str(TEACHER)))
    with pytest.raises(ValueError) as caught:
        check_scored_on(keep, teacher, "k=x", allow_key="a.allow")
    message = str(caught.value)
    assert message.startswith(f"k=x was scored on {teachers['changed']}@main (weights sha256 ")
    assert f"but this run's model is {TEACHER}@main (weights sha256 {teacher.sha256[:12]})" in message
    assert "prune again on this model" in message and "a.allow=true" in message and "\n" not in message
    with caplog.at_level(logging.WARNING):
        check_scored_on(keep, teacher, "k=x", allow_foreign=True, allow_key="a.allow")
    assert "the model changed since the keep set was scored" in caplog.text and "a.allow=true" in caplog.text
    check_scored_on(KeepSet.load(teachers["copy_keep"]), teacher, "k=x")  # the byte-identical copy: no error


# --------------------------------------------------------------------------- one rule in every app


@pytest.fixture
def no_load(monkeypatch):
    import slimwise_train.models as models

    def refuse(*_args, **_kwargs):
        raise AssertionError("the model was loaded before the keep set was refused")

    monkeypatch.setattr(models, "load_model", refuse)


def test_train_eval_and_lm_eval_refuse_it_before_the_model_loads(teachers, tmp_path, no_load):
    from slimwise_train.distill.trainer import Trainer
    from slimwise_train.eval.app import run_eval
    from slimwise_train.lm_eval.model import SlimwiseLM

    foreign = teachers["foreign"]
    expected = f"was scored on {teachers['changed']}@main"
    trainer = Trainer(compose_config("train", *TINY_TRAIN, *train_steps(1), f"model.path={TEACHER}",
                                     f"prune.keep_set={foreign}", f"output_dir={tmp_path / 'train'}"))
    with pytest.raises(ValueError, match=f"^prune.keep_set={foreign} {expected}.*distill.allow_foreign_keep_set=true"):
        trainer.setup()
    trainer.close()
    with pytest.raises(ValueError, match=f"^eval.keep_sets={foreign} {expected}.*eval.allow_foreign_keep_set=true"):
        run_eval(compose_config("eval", "model=teacher", f"eval.keep_sets=[{foreign}]",
                                f"output_dir={tmp_path / 'eval'}"))
    with pytest.raises(ValueError, match=f"^keep_set={foreign} {expected}.*model_args allow_foreign_keep_set=true"):
        SlimwiseLM(pretrained=str(TEACHER), keep_set=str(foreign), mode="slimwise", device="cpu")
    assert not any((tmp_path / name).exists() for name in ("train", "eval"))


def test_every_app_accepts_a_keep_set_scored_on_a_byte_identical_copy(teachers):
    config, teacher = load_config(model_cfg(path=str(TEACHER))), model_weights(model_cfg(path=str(TEACHER)))
    keep = keep_set_for_run(teachers["copy_keep"], "k", config=config, model=teacher)
    assert keep == KeepSet.load(teachers["copy_keep"])
    from slimwise_train.lm_eval.model import SlimwiseLM

    lm = SlimwiseLM(pretrained=str(TEACHER), keep_set=str(teachers["copy_keep"]), mode="slimwise", device="cpu",
                    progress=False)
    assert lm.keep_set == keep
    SlimwiseLM.instances.clear()


def test_the_prune_app_records_the_weights_it_scored(tmp_path):
    from slimwise_train.prune.app import run_prune

    cfg = compose_config("prune", "model=tiny_qwen3_moe", f"output_dir={tmp_path / 'p'}", "progress=false",
                         f"prune.cache_dir={tmp_path / 'cache'}")
    run_prune(cfg)
    meta = KeepSet.load(tmp_path / "p" / "keep_set.json").meta
    assert meta["model"] == "tiny:qwen3_moe:seed=0"
    assert meta["weights"] == {"sha256": model_weights(cfg.model).sha256}


def test_the_prune_app_refuses_prune_keep_set_which_it_would_ignore(tmp_path, no_load):
    from slimwise_train.prune.app import run_prune

    with pytest.raises(ValueError, match=r"^prune.keep_set=k.json is what the trainer and eval read; the prune app "
                                         r"scores a new keep set: drop prune.keep_set"):
        run_prune(compose_config("prune", "prune.keep_set=k.json", f"output_dir={tmp_path / 'p'}"))
    assert not (tmp_path / "p").exists()


@pytest.mark.subprocess
def test_eval_cli_refuses_a_foreign_keep_set_in_one_line_and_writes_nothing(teachers, tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "slimwise_train.eval", "model=teacher",
                           f"eval.keep_sets=[{teachers['foreign']}]", f"hydra.run.dir={out}"], cwd=REPO,
                          capture_output=True, text=True, timeout=300, env=CHILD_ENV)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith(f"slimwise_train.eval: error: eval.keep_sets={teachers['foreign']} was scored on "), line
    assert "eval.allow_foreign_keep_set=true" in line
    assert not out.exists() or {p.name for p in out.iterdir()} <= {"eval.log"}

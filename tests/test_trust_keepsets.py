"""Issue 24, keep sets and training input: every bad keep set, run folder, number or data source is one line naming the
config key and the fix, raised before the model loads (or, when it needs the model, before anything is written).

Items: 1 (keep set indices, model_type, other weights), 5 and 7 (a run folder rerun with another keep set), 12 (a
non-uniform keep set the family cannot export), 15 (distill numbers, a missing data file), 9 (an offline hub id).
"""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest

from slimwise_train.config import DataConfig
from slimwise_train.distill.trainer import Trainer, run_train
from slimwise_train.moe.adapters import get_adapter
from slimwise_train.moe.keepset import KeepSet
from slimwise_train.testing.tiny import tiny_model

from helpers import CHILD_ENV as ENV
from helpers import REPO, TINY_TRAIN, compose_config, train_steps

SMALL = [*TINY_TRAIN, "progress=false", *train_steps(2), "distill.eval.samples=8", "data.num_samples=16"]
SEED0 = "tiny:qwen3_moe:seed=0"  # models.model_identity of the default tiny_qwen3_moe preset
UNIFORM = [[0, 2, 5, 7], [1, 3, 4, 6]]
OTHER_UNIFORM = [[0, 1, 2, 3], [4, 5, 6, 7]]
NON_UNIFORM = [[0, 2, 5, 7], [1, 3, 4, 5, 6]]


def cfg_for(output_dir, *overrides):
    return compose_config("train", *SMALL, f"output_dir={output_dir}", *overrides)


def write_keep_set(path: Path, kept, model_type="qwen3_moe", model=SEED0) -> Path:
    layout = tiny_model(model_type)
    meta = {"model": model} if model else {}
    KeepSet.from_kept(get_adapter(layout).moe_layers(layout), kept, model_type=model_type, meta=meta).save(path)
    return path


def edit_keep_set(path: Path, edit) -> Path:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    return path


@pytest.fixture
def no_load(monkeypatch):
    """Loading the model or the data fails the test: the check under test must come first."""
    import slimwise_train.data.loading as loading
    import slimwise_train.models as models

    def refuse(*_args, **_kwargs):
        raise AssertionError("the model or the data was loaded before the bad input was refused")

    monkeypatch.setattr(models, "load_model", refuse)
    monkeypatch.setattr(loading, "load_pairs", refuse)


def refused_at_start(output_dir, *overrides, match: str, error=ValueError) -> str:
    """Set up a trainer that must fail with `match` before the output folder exists; the message, one line."""
    trainer = Trainer(cfg_for(output_dir, *overrides))
    try:
        with pytest.raises(error, match=match) as caught:
            trainer.setup()
    finally:
        trainer.close()
    assert not Path(output_dir).exists(), "the output folder was created before the check"
    message = str(caught.value)
    assert "\n" not in message
    return message


def snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): (p.stat().st_mtime_ns, p.read_bytes() if p.is_file() else None)
            for p in sorted(folder.rglob("*"))}


def train_cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "slimwise_train", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env={**ENV, **(env or {})})


def error_line(proc) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines[-1].startswith("slimwise_train: error: "), lines[-1]
    return lines[-1]


# --------------------------------------------------------------------------- 1. the keep set file


@pytest.mark.parametrize("bad, shown", [(3.7, "3.7"), (True, "true"), ("3", '"3"'), (3.0, "3.0")])
def test_keep_set_indices_must_be_json_integers(tmp_path, bad, shown):
    path = write_keep_set(tmp_path / "keep_set.json", UNIFORM)
    edit_keep_set(path, lambda data: data["layers"][1]["kept"].__setitem__(0, bad))
    with pytest.raises(ValueError, match=f"layer 1 lists kept expert {shown}, not an integer") as caught:
        KeepSet.load(path, key="prune.keep_set")
    assert str(caught.value).startswith(f"prune.keep_set={path}: ") and "prune again" in str(caught.value)


def test_keep_set_layer_fields_must_be_json_integers(tmp_path):
    path = write_keep_set(tmp_path / "keep_set.json", UNIFORM)
    edit_keep_set(path, lambda data: data["layers"][0].__setitem__("top_k", True))
    with pytest.raises(ValueError, match="layer 0 has top_k true, not an integer"):
        KeepSet.load(path)
    edit_keep_set(path, lambda data: data["layers"][0].__setitem__("layer", 0.5))
    with pytest.raises(ValueError, match=r"layers\[0\] has layer 0.5, not an integer"):
        KeepSet.load(path)


def test_keep_set_without_model_type_is_refused(tmp_path):
    path = write_keep_set(tmp_path / "keep_set.json", UNIFORM)
    edit_keep_set(path, lambda data: data.pop("model_type"))
    with pytest.raises(ValueError, match="records no model_type.*prune again on this model"):
        KeepSet.load(path)
    # Before, such a file was accepted on any family with the same layout (here: Mixtral's 2 x 8 experts, top-2).
    refused_at_start(tmp_path / "out", f"prune.keep_set={path}", "model=tiny_mixtral",
                     match=f"prune.keep_set={path} records no model_type")


def test_keep_set_of_another_family_is_refused_before_the_model_loads(tmp_path, no_load):
    path = write_keep_set(tmp_path / "keep_set.json", UNIFORM, model_type="mixtral", model="tiny:mixtral:seed=0")
    message = refused_at_start(tmp_path / "out", f"prune.keep_set={path}",
                               match="keep set was made for model_type 'mixtral' but the model is 'qwen3_moe'")
    assert message.startswith(f"prune.keep_set={path}: ") and "prune again on this model" in message


def test_keep_set_scored_on_other_weights_is_an_error_unless_allowed(tmp_path, no_load, monkeypatch, caplog):
    path = write_keep_set(tmp_path / "keep_set.json", UNIFORM)  # scored on the seed-0 model
    message = refused_at_start(tmp_path / "out", f"prune.keep_set={path}", "model.seed=1",
                               match=f"was scored on {SEED0} but this run's model is tiny:qwen3_moe:seed=1")
    assert "prune again on this model" in message and "distill.allow_foreign_keep_set=true" in message
    # The same model (another spelling of the same local folder, too) passes; opting in passes with a warning.
    trainer = Trainer(cfg_for(tmp_path / "out", f"prune.keep_set={path}", "model.seed=1",
                              "distill.allow_foreign_keep_set=true"))
    with caplog.at_level(logging.WARNING, logger="slimwise.train"):
        assert trainer._precheck_keep_set() == KeepSet.load(path)
    assert f"was scored on {SEED0}" in caplog.text and "allow_foreign_keep_set=true" in caplog.text
    assert Trainer(cfg_for(tmp_path / "out", f"prune.keep_set={path}"))._precheck_keep_set() is not None


# --------------------------------------------------------------------------- 12. non-uniform keep set, no export


def test_non_uniform_keep_set_the_family_cannot_export_is_refused_at_start(tmp_path, no_load):
    path = write_keep_set(tmp_path / "keep_set.json", NON_UNIFORM)
    message = refused_at_start(tmp_path / "out", f"prune.keep_set={path}",
                               match=r"qwen3_moe checkpoints hold one expert count .* \[4, 5\]\) cannot be exported")
    assert message.startswith(f"prune.keep_set={path}: ") and message.endswith("(distill.export=false)")
    # Without the export it trains (router masking); a family with a per-expert router bias exports it.
    assert Trainer(cfg_for(tmp_path / "out", f"prune.keep_set={path}",
                           "distill.export=false"))._precheck_keep_set().num_kept == (4, 5)
    gpt = write_keep_set(tmp_path / "gpt.json", NON_UNIFORM, model_type="gpt_oss", model="tiny:gpt_oss:seed=0")
    assert Trainer(cfg_for(tmp_path / "out", f"prune.keep_set={gpt}", "model=tiny_gpt_oss"))._precheck_keep_set()
    assert not (tmp_path / "out").exists()


def test_a_scored_non_uniform_keep_set_is_refused_before_the_data_loads(tmp_path):
    from slimwise_train.moe.keepset_rules import check_exportable

    model = tiny_model("qwen3_moe")
    keep = KeepSet.from_kept(get_adapter(model).moe_layers(model), NON_UNIFORM, model_type="qwen3_moe")
    with pytest.raises(ValueError, match=r"^the keep set scored with prune.scope=global: qwen3_moe .* cannot be "
                                         r"exported; .*distill.export=false"):
        check_exportable(keep, model.config, "the keep set scored with prune.scope=global", "distill.export")


# --------------------------------------------------------------------------- 5, 7. rerunning a run folder


def test_rerunning_a_run_folder_with_another_keep_set_is_refused_before_any_write(tmp_path):
    first = write_keep_set(tmp_path / "first.json", UNIFORM)
    out = tmp_path / "run"
    summary = run_train(cfg_for(out, f"prune.keep_set={first}"))
    assert summary["steps"] == 2 and (out / "export").is_dir()
    state = json.loads((out / "checkpoints" / "step_000002" / "trainer_state.json").read_text())
    assert KeepSet.from_dict(state["keep_set"]) == KeepSet.load(first)  # the checkpoint records its keep set
    before = snapshot(out)
    for kept, differs in ((OTHER_UNIFORM, r"layer 0 keeping experts \[0, 2, 5, 7\], this run asks for \[0, 1, 2, 3\]"),
                          (NON_UNIFORM, r"\[4, 4\] kept experts per layer, this run asks for \[4, 5\]")):
        other = write_keep_set(tmp_path / "other.json", kept)
        with pytest.raises(ValueError, match=f"output_dir {out} holds a run trained with another keep set") as caught:
            run_train(cfg_for(out, f"prune.keep_set={other}", "distill.export=false"))
        assert "resume=never" in str(caught.value) and "another output_dir" in str(caught.value)
        assert re.search(differs, str(caught.value)), str(caught.value)
        assert snapshot(out) == before  # nothing in the folder written or changed
    # resume=never is the explicit fresh start: it is not refused.
    trainer = Trainer(cfg_for(out, f"prune.keep_set={other}", "resume=never", "distill.export=false"))
    try:
        trainer.setup()
        assert trainer.step == 0 and KeepSet.load(out / "keep_set.json").num_kept == (4, 5)
    finally:
        trainer.close()


def test_a_rerun_that_scores_another_keep_set_is_refused_before_the_data_loads(tmp_path, monkeypatch):
    out, cache = tmp_path / "run", f"prune.cache_dir={tmp_path / 'cache'}"
    run_train(cfg_for(out, cache, "distill.export=false", "prune.ratio=0.5"))
    before = snapshot(out)

    import slimwise_train.data.loading as loading

    calls = []
    original = loading.load_pairs
    monkeypatch.setattr(loading, "load_pairs", lambda *a, **k: calls.append(k.get("key")) or original(*a, **k))
    with pytest.raises(ValueError, match=r"holds a run trained with another keep set .*\[4, 4\] kept experts per "
                                         r"layer, this run asks for \[6, 6\]"):
        run_train(cfg_for(out, cache, "distill.export=false", "prune.ratio=0.25"))
    assert "data" not in calls  # the training rows were never read
    assert snapshot(out) == before


# --------------------------------------------------------------------------- 15. numbers and data, before loading


@pytest.mark.parametrize("override, match", [
    ("distill.optim.lr=-1",
     r"distill.optim.lr=-1.0 is invalid: it must be a finite number > 0; e.g. distill.optim.lr=1e-4"),
    ("distill.optim.lr=0", r"distill.optim.lr=0.0 is invalid"),
    ("distill.optim.lr=nan", r"distill.optim.lr=nan is invalid"),
    ("distill.schedule.max_steps=0", r"distill.schedule.max_steps=0 is invalid: it must be an integer >= 1"),
    ("distill.eval.every=0", r"distill.eval.every=0 is invalid"),
    ("distill.schedule.warmup_steps=-1", r"distill.schedule.warmup_steps=-1 is invalid"),
    ("distill.loss.terms.kl=-0.5", r"distill.loss.terms.kl=-0.5 is invalid: it must be a finite number >= 0"),
    ("distill.schedule.min_lr_ratio=2", r"distill.schedule.min_lr_ratio=2.0 is invalid"),
    ("distill.optim.adam_beta2=1", r"distill.optim.adam_beta2=1.0 is invalid"),
    ("distill.optim.weight_decay=-0.1", r"distill.optim.weight_decay=-0.1 is invalid"),
    ("distill.optim.grad_clip=-1", r"distill.optim.grad_clip=-1.0 is invalid"),
    ("distill.student.shared_expert_intermediate_size=0",
     r"distill.student.shared_expert_intermediate_size=0 is invalid"),
    ("data.num_samples=0", r"data.num_samples=0 is invalid: it must be an integer >= 1"),
    ("calibration.seq_len=1", r"calibration.seq_len=1 is invalid: it must be an integer >= 2"),
])
def test_invalid_numbers_are_refused_before_the_model_loads(tmp_path, no_load, override, match):
    refused_at_start(tmp_path / "out", override, match=match)


@pytest.mark.parametrize("key", ["data", "calibration"])
def test_a_missing_local_data_file_is_refused_before_the_model_loads(tmp_path, no_load, key):
    missing = tmp_path / "rows.jsonl"
    refused_at_start(tmp_path / "out", f"{key}.source={missing}", error=FileNotFoundError,
                     match=f"{key}.source={missing} is neither a recipe .*an existing file or folder \\(no such "
                           f"path\\), nor a hub id \\(owner/name\\); point {key}.source at an existing")
    # A relative path with one slash and a data suffix is a file, not a hub id.
    refused_at_start(tmp_path / "out", f"{key}.source=data/rows.jsonl", error=FileNotFoundError,
                     match=f"{key}.source=data/rows.jsonl is neither a recipe .*no such path")


def test_a_recipe_reading_a_missing_local_file_is_refused_before_the_model_loads(tmp_path, no_load):
    recipe = tmp_path / "mix.yaml"
    recipe.write_text(f"name: mix\nsources:\n  - path: {tmp_path / 'gone.jsonl'}\n")
    refused_at_start(tmp_path / "out", f"data.source={recipe}", error=FileNotFoundError,
                     match=f"data.source={recipe}: the recipe .* reads {tmp_path / 'gone.jsonl'}, which does not exist")


# --------------------------------------------------------------------------- 9. an offline hub id


def test_an_offline_hub_id_is_one_line_naming_data_source(monkeypatch):
    from omegaconf import OmegaConf

    from slimwise_train.data.loading import load_pairs

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    expected = (r"^data.source=someorg/somedata: neither a local file or folder nor reachable on the hub \(.*\); "
                r"HF_HUB_OFFLINE is set.*point data.source at a local")
    with pytest.raises(ValueError, match=expected) as err:
        load_pairs(OmegaConf.structured(DataConfig(source="someorg/somedata")))
    assert "\n" not in str(err.value)


# --------------------------------------------------------------------------- the command line: one line, exit 2


def _cli_case(tmp_path, case):
    keep = write_keep_set(tmp_path / "keep_set.json", NON_UNIFORM if case == "non_uniform_export" else UNIFORM)
    if case == "bad_index":
        edit_keep_set(keep, lambda data: data["layers"][0]["kept"].__setitem__(1, 3.7))
        return [f"prune.keep_set={keep}"], f"prune.keep_set={keep}: layer 0 lists kept expert 3.7, not an integer"
    if case == "no_model_type":
        edit_keep_set(keep, lambda data: data.pop("model_type"))
        return [f"prune.keep_set={keep}"], "records no model_type"
    if case == "foreign":
        return [f"prune.keep_set={keep}", "model.seed=1"], f"was scored on {SEED0} but this run's model is"
    if case == "non_uniform_export":
        return [f"prune.keep_set={keep}"], "cannot be exported"
    if case == "lr":
        return ["distill.optim.lr=-1"], "distill.optim.lr=-1.0 is invalid: it must be a finite number > 0"
    return [f"data.source={tmp_path / 'missing.jsonl'}"], "missing.jsonl is neither a recipe"


@pytest.mark.parametrize("case", ["bad_index", "no_model_type", "foreign", "non_uniform_export", "lr", "missing_data"])
@pytest.mark.subprocess
def test_cli_refuses_bad_input_in_one_line_before_the_run_starts(tmp_path, case):
    args, expected = _cli_case(tmp_path, case)
    out = tmp_path / "out"
    proc = train_cli(*SMALL, *args, f"hydra.run.dir={out}")
    line = error_line(proc)
    assert expected in line, line
    assert not any(out.glob("*")) or {p.name for p in out.iterdir()} <= {"train.log"}  # Hydra's log at most
    assert "trainable parameters" not in proc.stdout + proc.stderr  # refused before the model loaded


@pytest.mark.subprocess
def test_cli_refuses_to_rerun_a_run_folder_with_another_keep_set(tmp_path):
    out = tmp_path / "run"
    run_train(cfg_for(out, f"prune.keep_set={write_keep_set(tmp_path / 'first.json', UNIFORM)}",
                      "distill.export=false"))
    before = snapshot(out)
    other = write_keep_set(tmp_path / "other.json", OTHER_UNIFORM)
    proc = train_cli(*SMALL, f"prune.keep_set={other}", "distill.export=false", f"hydra.run.dir={out}")
    line = error_line(proc)
    assert f"output_dir {out} holds a run trained with another keep set" in line and "resume=never" in line
    assert {k: v for k, v in snapshot(out).items() if k != "train.log"} == {
        k: v for k, v in before.items() if k != "train.log"}


@pytest.mark.subprocess
def test_cli_offline_hub_id_as_data_source_is_one_line(tmp_path):
    proc = train_cli(*SMALL, "data.source=someorg/somedata", f"hydra.run.dir={tmp_path / 'out'}")
    line = error_line(proc)
    assert "data.source=someorg/somedata: neither a local file or folder nor reachable on the hub" in line, line
    assert "HF_HUB_OFFLINE" in line

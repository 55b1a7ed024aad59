"""utils/rundir.py's check that a run's outputs spare its inputs, in every app that writes into a folder: a model,
tokenizer or data file lying in what the run writes (a train run's export/, a prune run's pruned/) is refused in one
line before anything loads or is written, instead of being replaced by the run's own output."""

from __future__ import annotations

import shutil

import pytest

from slimwise_train.utils.rundir import check_outputs_spare_inputs

from helpers import REPO, TINY_TRAIN, compose_config, train_steps

TEACHER = REPO / "slimwise_train" / "assets" / "teacher"


def test_an_input_equal_to_or_inside_an_output_is_refused(tmp_path):
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "tokenizer.json").write_text("{}")
    (tmp_path / "rows.jsonl").write_text("{}\n")
    with pytest.raises(ValueError, match=r"^model.tokenizer=.*tokenizer.json is inside .*export, which this run writes "
                                         r"\(export\)"):
        check_outputs_spare_inputs({"export": tmp_path / "export"},
                                   {"model.tokenizer": str(tmp_path / "export" / "tokenizer.json")})
    with pytest.raises(ValueError, match=r"^data.source=.*rows.jsonl is .*rows.jsonl, which this run writes"):
        check_outputs_spare_inputs({"summary": tmp_path / "rows.jsonl"}, {"data.source": str(tmp_path / "rows.jsonl")})
    # hub ids, recipe names and paths elsewhere pass
    check_outputs_spare_inputs({"export": tmp_path / "export"}, {"model.path": "owner/name", "data.source": "synthetic",
                                                                 "model.tokenizer": str(TEACHER), "x": None})


@pytest.fixture
def run_folder_holding_the_teacher(tmp_path):
    out = tmp_path / "run"
    for name in ("export", "pruned"):
        shutil.copytree(TEACHER, out / name)
    return out


def snapshot(folder):
    return sorted((str(p.relative_to(folder)), p.stat().st_mtime_ns) for p in folder.rglob("*"))


def test_train_refuses_to_export_over_the_model_it_trains(run_folder_holding_the_teacher):
    from slimwise_train.distill.trainer import Trainer

    out = run_folder_holding_the_teacher
    before = snapshot(out)
    trainer = Trainer(compose_config("train", *TINY_TRAIN, *train_steps(1), f"model.path={out / 'export'}",
                                     f"output_dir={out}"))
    with pytest.raises(ValueError, match=f"^model.path={out / 'export'} is {out / 'export'}, which this run writes "
                                         r"\(export\): it would replace its own input"):
        trainer.setup()
    trainer.close()
    assert snapshot(out) == before


def test_prune_refuses_to_write_pruned_over_the_model_it_scores(run_folder_holding_the_teacher):
    from slimwise_train.prune.app import run_prune

    out = run_folder_holding_the_teacher
    before = snapshot(out)
    with pytest.raises(ValueError, match=f"^model.path={out / 'pruned'} is {out / 'pruned'}, which this run writes"):
        run_prune(compose_config("prune", f"model.path={out / 'pruned'}", "prune.export_checkpoint=true",
                                 f"output_dir={out}"))
    assert snapshot(out) == before


def test_eval_refuses_an_output_folder_whose_results_json_is_a_keep_set(tmp_path):
    from slimwise_train.eval.app import run_eval

    (tmp_path / "results.json").write_text("{}")
    with pytest.raises(ValueError, match=r"^eval.keep_sets\[0\]=.*results.json is .*results.json, which this run "
                                         r"writes"):
        run_eval(compose_config("eval", "model=teacher", f"eval.keep_sets=[{tmp_path / 'results.json'}]",
                                f"output_dir={tmp_path}"))

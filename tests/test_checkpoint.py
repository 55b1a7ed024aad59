"""distill/checkpoint.py's run folder: resume=never starts a used folder over without leaving the earlier run's
checkpoints where resume=auto looks (they move, with the rest of that run, into replaced/<time>/), so metrics.jsonl
never holds two runs; the earlier run's files are kept, not deleted."""

from __future__ import annotations

import json

from slimwise_train.distill.checkpoint import REPLACED, complete_checkpoints
from slimwise_train.distill.trainer import RUN_OUTPUTS, run_train

from helpers import compose_config, TINY_TRAIN, train_steps

SMALL = [*TINY_TRAIN, "progress=false", "distill.eval.samples=8", "data.num_samples=16", "distill.checkpoint.keep=5"]


def steps_logged(folder) -> list[int]:
    return [json.loads(line)["step"] for line in (folder / "metrics.jsonl").read_text().splitlines()
            if "loss" in json.loads(line)]


def test_resume_never_sets_the_earlier_run_aside_so_a_later_resume_continues_the_new_one(tmp_path, caplog):
    out = tmp_path / "run"
    cfg = lambda *o: compose_config("train", *SMALL, f"output_dir={out}", *o)  # noqa: E731
    run_train(cfg(*train_steps(4, save_every=2)))
    first_outputs = {p.name for p in out.iterdir() if not p.name.startswith(".") and p.name != "train.log"}
    assert first_outputs <= set(RUN_OUTPUTS), "a run output RUN_OUTPUTS does not list would stay behind"
    assert steps_logged(out) == [1, 2, 3, 4]

    # Start over; the new run stops after its first step (as if killed: its checkpoint is the newest of this run).
    with caplog.at_level("WARNING"):
        run_train(cfg(*train_steps(1), "resume=never"))
    (aside,) = (out / REPLACED).iterdir()
    assert f"moved to {aside}" in caplog.text
    assert [step for step, _ in complete_checkpoints(aside / "checkpoints")] == [2, 4]  # finished work kept
    assert steps_logged(aside) == [1, 2, 3, 4] and (aside / "export").is_dir()
    assert [step for step, _ in complete_checkpoints(out / "checkpoints")] == [1]
    left = {p.name for p in out.iterdir() if not p.name.startswith(".")} - {REPLACED, "train.log"}
    assert left <= first_outputs and "export" in left  # only the new run's files at the top

    # resume=auto continues the NEW run from its step 1 (before: the old run's step 4, behind the new run's log).
    with caplog.at_level("INFO"):
        summary = run_train(cfg(*train_steps(3)))
    assert "resumed from" in caplog.text and "step_000001" in caplog.text
    assert summary["steps"] == 3 and summary["steps_this_run"] == 2
    assert steps_logged(out) == [1, 2, 3]

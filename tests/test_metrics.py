"""distill/metrics.py: the W&B run id of a run folder. A resumed run appends to the W&B run it started; a run from
step 0 in the same folder (resume=never) is a new W&B run, not a second history appended to the first."""

from __future__ import annotations

import hashlib

from slimwise_train.distill.metrics import RUN_ID_FILE, _run_id


def test_a_resume_keeps_the_wandb_run_and_a_fresh_start_gets_a_new_one(tmp_path):
    first = _run_id(tmp_path, resuming=False)
    assert (tmp_path / RUN_ID_FILE).read_text().strip() == first
    assert _run_id(tmp_path, resuming=True) == first
    second = _run_id(tmp_path, resuming=False)  # resume=never, or a start before any checkpoint
    assert second != first and _run_id(tmp_path, resuming=True) == second


def test_a_folder_from_before_the_id_file_resumes_its_old_wandb_run(tmp_path):
    assert _run_id(tmp_path, resuming=True) == hashlib.sha1(str(tmp_path.resolve()).encode()).hexdigest()[:12]

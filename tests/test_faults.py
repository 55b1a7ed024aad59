"""Faults recover as stated: output folders are locked and checked at start, leftovers are cleaned, a model or
checkpoint that cannot load is one clear line, checkpoints verify their checksums."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir

from slimwise_train.config import CONF_DIR, ModelConfig, register_configs
from slimwise_train.distill.checkpoint import CorruptCheckpoint, verify_checkpoint
from slimwise_train.distill.trainer import Trainer, run_train
from slimwise_train.models import load_model
from slimwise_train.utils.rundir import LOCK_NAME, acquire_lock, release_lock

register_configs()
SMALL = ["experiment=tiny_smoke", "logger=none", "resume=auto", "distill.schedule.max_steps=4",
         "distill.checkpoint.every=2", "distill.eval.every=4", "distill.log_every=1", "distill.checkpoint.keep=5",
         "distill.export=false"]


def cfg_for(output_dir, *overrides):
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return compose("train", overrides=[*SMALL, f"output_dir={output_dir}", *overrides])


def trainer_for(output_dir, *overrides) -> Trainer:
    return Trainer(cfg_for(output_dir, *overrides))


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


# --------------------------------------------------------------------------- 7. one live job per output folder


def test_a_live_jobs_folder_is_refused_with_host_and_pid(tmp_path):
    (tmp_path / LOCK_NAME).write_text(json.dumps({"host": socket.gethostname(), "pid": os.getppid(),
                                                  "started": "2026-12-01 10:00:00"}))
    trainer = trainer_for(tmp_path)
    with pytest.raises(ValueError, match=rf"in use by another job \(pid {os.getppid()} on {socket.gethostname()}"):
        trainer.setup()
    trainer.close()
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.subprocess
def test_a_stale_lock_is_taken_over_and_released_at_the_end(tmp_path, caplog):
    (tmp_path / LOCK_NAME).write_text(json.dumps({"host": socket.gethostname(), "pid": dead_pid()}))
    with caplog.at_level("WARNING"):
        lock = acquire_lock(tmp_path)
    assert "taking over the stale lock" in caplog.text
    assert json.loads(lock.read_text())["pid"] == os.getpid()
    with pytest.raises(ValueError, match="in use by another job"):  # now held: a second claim is refused
        acquire_lock(tmp_path)
    release_lock(lock)
    assert not lock.exists()


def test_a_lock_from_another_host_is_reported_not_taken(tmp_path):
    (tmp_path / LOCK_NAME).write_text(json.dumps({"host": "other-node-17", "pid": 1234}))
    with pytest.raises(ValueError, match=f"pid 1234 on other-node-17.*delete {tmp_path / LOCK_NAME}"):
        acquire_lock(tmp_path)


# --------------------------------------------------------------------------- 9. unwritable output at start


def test_an_unwritable_output_folder_fails_at_start(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    trainer = trainer_for(blocker / "run")
    with pytest.raises(ValueError, match="is not writable"):
        trainer.setup()
    assert trainer.engine is None  # failed before any model or engine was built
    trainer.close()


def test_prune_checks_its_output_folder_before_scoring(tmp_path):
    from slimwise_train.prune.app import run_prune

    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose("prune", overrides=[f"output_dir={blocker / 'out'}", "progress=false"])
    with pytest.raises(ValueError, match="cannot be created .* is not a folder"):
        run_prune(cfg)


# --------------------------------------------------------------------------- 10. leftovers, metrics after resume


def test_stale_export_temporaries_are_removed_at_start(tmp_path):
    (tmp_path / ".export.abc123.tmp").mkdir()
    (tmp_path / ".export.abc123.tmp" / "model.safetensors").write_text("half")
    (tmp_path / ".metrics.jsonl.x1.tmp").write_text("half")
    (tmp_path / "keep_me.txt").write_text("user file")
    trainer = trainer_for(tmp_path, "distill.schedule.max_steps=1", "distill.checkpoint.every=1",
                          "distill.eval.every=1")
    try:
        trainer.setup()
    finally:
        trainer.close()
    names = {p.name for p in tmp_path.iterdir()}
    assert ".export.abc123.tmp" not in names and ".metrics.jsonl.x1.tmp" not in names and "keep_me.txt" in names
    assert LOCK_NAME not in names  # released by close()


# --------------------------------------------------------------------------- the test faults (testing/faults.py)


def test_fault_hooks_fire_only_at_their_steps_and_an_unknown_one_is_refused(tmp_path):
    import math

    import torch

    from slimwise_train.distill.trainer import StepHooks
    from slimwise_train.testing.faults import FaultHooks, kill_self

    hooks = FaultHooks.from_config({"nan_at_steps": [2], "kill_in_checkpoint_at_step": 4})
    one = torch.tensor(1.0)
    assert math.isnan(hooks.loss(1, one)) and hooks.loss(0, one) is one and hooks.loss(2, one) is one  # step 2 = index 1
    assert hooks.before_checkpoint_publish(4) is kill_self and hooks.before_checkpoint_publish(2) is None
    hooks.after_step(5)  # kill_after_step unset: nothing
    assert trainer_for(tmp_path).hooks.__class__ is StepHooks  # no faults named: the trainer's no-op hooks
    with pytest.raises(ValueError, match="unknown extra.kill_after_stp: the test faults are extra.nan_at_steps"):
        trainer_for(tmp_path, "+extra.kill_after_stp=5")


# --------------------------------------------------------------------------- 8. checkpoints verify


def test_checkpoint_verification_names_the_problem(tmp_path):
    run_train(cfg_for(tmp_path, "distill.schedule.max_steps=2", "distill.eval.every=2"))
    ckpt = tmp_path / "checkpoints" / "step_000002"
    verify_checkpoint(ckpt)
    sums = json.loads((ckpt / "checksums.json").read_text())
    assert {"trainable.safetensors", "trainer_state.json", "rng.pt", "optimizer.pt"} <= set(sums)
    data = (ckpt / "trainable.safetensors").read_bytes()
    (ckpt / "trainable.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptCheckpoint, match="trainable.safetensors does not match its checksum"):
        verify_checkpoint(ckpt)
    (ckpt / "trainer_state.json").unlink()
    with pytest.raises(CorruptCheckpoint, match="trainer_state.json is missing"):
        verify_checkpoint(ckpt)
    # An explicit resume from it is a clear error.
    trainer = trainer_for(tmp_path / "other", f"resume={ckpt}")
    with pytest.raises(ValueError, match="trainer_state.json is missing"):
        trainer.setup()
    trainer.close()


# --------------------------------------------------------------------------- 12. models that cannot load


def test_missing_local_model_folder_is_one_line(tmp_path):
    with pytest.raises(ValueError, match=r"model.path=.*/nope: no such folder"):
        load_model(ModelConfig(name="x", path=str(tmp_path / "nope")), "cpu")


def test_hub_id_offline_is_one_line(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match=r"model.path=nobody-xyz/no-such-moe: cannot load it .*HF_HUB_OFFLINE"):
        load_model(ModelConfig(name="x", path="nobody-xyz/no-such-moe"), "cpu")


@pytest.mark.subprocess
def test_a_hub_id_without_network_fails_in_one_line_without_retries(tmp_path):
    # HF_HUB_OFFLINE unset and the hub unreachable (here: a closed port): huggingface_hub retried every file 5 times
    # (about 50 s, 20 retry lines) before the one line; one probe of the endpoint now sends it to the cache only.
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HTTPS_PROXY", "https_proxy",
                                                            "ALL_PROXY", "all_proxy")}
    proc = subprocess.run([sys.executable, "-m", "slimwise_train.prune", "model.path=nobody-xyz/no-such-moe",
                           f"hydra.run.dir={tmp_path / 'run'}"], capture_output=True, text=True, timeout=120,
                          env={**env, "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(tmp_path / "hf")})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "Retry" not in proc.stderr, proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("slimwise_train.prune: error: model.path=nobody-xyz/no-such-moe: cannot load it")
    assert "the hub cannot be reached (127.0.0.1:9: Connection refused)" in line
    assert not (tmp_path / "run").exists()


def test_truncated_safetensors_is_one_line(tmp_path):
    from transformers import AutoTokenizer

    from slimwise_train.models import SHIPPED_TOKENIZER
    from slimwise_train.testing.tiny import tiny_model

    tokenizer = AutoTokenizer.from_pretrained(str(SHIPPED_TOKENIZER))
    tiny_model("qwen3_moe", vocab_size=len(tokenizer)).save_pretrained(tmp_path / "ckpt")
    tokenizer.save_pretrained(tmp_path / "ckpt")
    weights = tmp_path / "ckpt" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])
    with pytest.raises(ValueError, match=r"model.path=.*ckpt: .*(truncated|corrupt)"):
        load_model(ModelConfig(name="x", path=str(tmp_path / "ckpt"), dtype="float32"), "cpu")


def test_truncated_student_export_is_one_line(tmp_path):
    from slimwise_train.eval.generation import load_student
    from slimwise_train.testing.tiny import tiny_model

    full = tiny_model("qwen3_moe")
    full.save_pretrained(tmp_path / "student")
    weights = tmp_path / "student" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:3000])
    with pytest.raises(ValueError, match=r"eval.student=.*student: .*(truncated|corrupt)"):
        load_student(tmp_path / "student", full)


@pytest.mark.subprocess
def test_cli_error_for_a_missing_model_folder(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "slimwise_train.prune", f"model.path={tmp_path / 'missing'}",
                           f"hydra.run.dir={tmp_path / 'run'}"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("slimwise_train.prune: error: model.path=") and "no such folder" in lines[-1]
    assert "Traceback" not in proc.stderr


# --------------------------------------------------------------------------- 14. progress on long steps


def test_training_shows_a_step_progress_bar(tmp_path, capsys):
    run_train(cfg_for(tmp_path, "distill.schedule.max_steps=2", "distill.eval.every=2", "progress=true"))
    err = capsys.readouterr().err
    assert "distill" in err and "2/2" in err


def test_scoring_shows_a_progress_bar(tmp_path, capsys):
    from slimwise_train.prune.app import run_prune

    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose("prune", overrides=[f"output_dir={tmp_path / 'out'}", f"prune.cache_dir={tmp_path / 'c'}",
                                          "progress=true", "data.num_samples=48", "data.batch_size=16"])
    run_prune(cfg)
    assert "scoring experts" in capsys.readouterr().err


def test_every_output_folder_honours_the_umask(tmp_path):
    """Issue 24 item 14: safetensors writes 0600 whatever the umask. A checkpoint, an export and a LoRA adapter folder
    written under umask 022 are 0644 / 0755 throughout; under 027, 0640 / 0750."""
    import stat

    from slimwise_train.distill.export import export_student
    from slimwise_train.distill.lora import export_adapter
    from slimwise_train.distill.student import DistillModel, StudentSpec
    from slimwise_train.testing.tiny import tiny_model
    from test_student import _keep

    for umask, file_mode, dir_mode in ((0o022, 0o644, 0o755), (0o027, 0o640, 0o750)):
        previous = os.umask(umask)
        try:
            model = tiny_model("qwen3_moe")
            student = DistillModel(model, _keep(model), StudentSpec())
            root = tmp_path / oct(umask)
            export_student(student, root / "export")
            export_adapter(student, root / "adapter")
        finally:
            os.umask(previous)
        for path in root.rglob("*"):
            mode = stat.S_IMODE(path.stat().st_mode)
            assert mode == (dir_mode if path.is_dir() else file_mode), (str(path), oct(mode))


# --------------------------------------------------------------------------- issue 24 item 10: checksums, full disk


def test_an_emptied_checksums_file_does_not_verify_and_resume_falls_back(tmp_path, caplog):
    run_train(cfg_for(tmp_path))  # checkpoints at steps 2 and 4
    newest = tmp_path / "checkpoints" / "step_000004"
    (newest / "checksums.json").write_text("{}")
    with pytest.raises(CorruptCheckpoint, match="checksums.json does not cover"):
        verify_checkpoint(newest)
    (newest / "checksums.json").write_text("[]")
    with pytest.raises(CorruptCheckpoint, match="not a mapping"):
        verify_checkpoint(newest)
    trainer = trainer_for(tmp_path, "distill.schedule.max_steps=6")
    try:
        with caplog.at_level("WARNING"):
            trainer.setup()
        assert trainer.step == 2, "resumed from the checkpoint that verifies"
        assert "skipping checkpoint step_000004" in caplog.text
    finally:
        trainer.close()


def test_a_full_disk_while_checkpointing_is_one_line_and_leaves_no_partial_checkpoint(tmp_path, monkeypatch, capsys):
    from safetensors import SafetensorError

    from slimwise_train.distill import checkpoint
    from slimwise_train.utils.cli import user_errors

    real_save = checkpoint.save_file
    calls = []

    def save_file(tensors, filename, *args, **kwargs):
        calls.append(filename)
        if len(calls) == 2:  # the second checkpoint meets a full disk, as safetensors reports it
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return real_save(tensors, filename, *args, **kwargs)

    monkeypatch.setattr(checkpoint, "save_file", save_file)
    trainer = trainer_for(tmp_path)
    with pytest.raises(SystemExit) as exit_info, user_errors("slimwise_train"):
        try:
            trainer.setup()
            trainer.train()
        finally:
            trainer.close()
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("slimwise_train: error:")]
    assert len(lines) == 1, err[-3000:]
    line = lines[0]
    assert "writing checkpoint step_000004" in line and "No space left on device" in line and "resume=auto" in line
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step_000002"]  # no .step_000004.tmp left behind
    verify_checkpoint(root / "step_000002")


def test_an_offline_hub_id_as_calibration_source_names_calibration(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    trainer = trainer_for(tmp_path, "prune.keep_set=null", "calibration.source=someorg/somedata")
    try:
        with pytest.raises(ValueError, match=r"^calibration.source=someorg/somedata: neither a local file or folder"):
            trainer.setup()
    finally:
        trainer.close()

"""scripts/train_teacher.py's flags: whatever no run can use, and an --out that would only be refused after the whole
training budget (its default is the shipped teacher), are one line naming the flag and the fix, exit status 2, before
anything trains or is written."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from helpers import CHILD_ENV, REPO

SCRIPT = REPO / "scripts" / "train_teacher.py"
TEACHER = REPO / "slimwise_train" / "assets" / "teacher"


@pytest.fixture(scope="module")
def T():
    spec = importlib.util.spec_from_file_location("train_teacher", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def no_training(T, monkeypatch):
    def refuse(*_args, **_kwargs):
        raise AssertionError("training started before the bad flags were refused")

    monkeypatch.setattr(T, "AutoTokenizer", type("Refuse", (), {"from_pretrained": staticmethod(refuse)}))


@pytest.mark.parametrize("flags, message", [
    (["--top-k", "8", "--experts", "4"], "--top-k 8 exceeds --experts 4: the router picks top-k of the experts"),
    (["--threads", "0"], "--threads 0 is invalid: it must be an integer >= 1"),
    (["--batch", "0"], "--batch 0 is invalid: it must be an integer >= 1"),
    (["--lr", "-1"], "--lr -1.0 is invalid: it must be a finite number > 0"),
    (["--lr", "nan"], "--lr nan is invalid: it must be a finite number > 0"),
    (["--warmup", "0"], "--warmup 0 is invalid: it must be an integer >= 1"),
    (["--hidden", "30"], "--hidden 30 is not a multiple of 4"),
    (["--final-lr", "2"], "--final-lr 2.0 is invalid: it must be a finite number in [0, 1.0]"),
])
def test_flags_no_run_can_use_are_refused_before_training(T, no_training, tmp_path, flags, message):
    with pytest.raises(T.UsageError, match="^" + message.replace("[", r"\[").replace("+", r"\+")):
        T.main([*flags, "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_an_existing_out_is_refused_before_training_and_the_deep_preset_spares_other_folders(T, no_training,
                                                                                             tmp_path):
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "model.safetensors").write_bytes(b"x")
    with pytest.raises(T.UsageError, match=f"^--out {tmp_path / 'old'} exists .*pass --overwrite"):
        T.main(["--out", str(tmp_path / "old")])
    with pytest.raises(T.UsageError, match="holds something other than a deep-teacher run"):
        T.main(["--preset", "deep", "--out", str(tmp_path / "old")])
    (tmp_path / "file").write_text("")
    with pytest.raises(T.UsageError, match="cannot be created .*not a folder"):
        T.main(["--out", str(tmp_path / "file" / "teacher")])


@pytest.mark.subprocess
def test_the_default_out_is_the_shipped_teacher_and_is_refused_in_one_line(tmp_path):
    before = {p.name: p.stat().st_mtime_ns for p in TEACHER.iterdir()}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--minutes", "0.01"], cwd=tmp_path, env=CHILD_ENV,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        f"train_teacher.py: error: --out {TEACHER} exists (the default is the shipped teacher); pass --overwrite to "
        "replace it at the end of training, or another --out"]
    assert {p.name: p.stat().st_mtime_ns for p in TEACHER.iterdir()} == before

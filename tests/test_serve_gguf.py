"""`python -m slimwise_train.serve gguf` (serve/gguf.py) when things go wrong: every input it cannot convert is one
line before the converter runs, nothing written; two runs to one new outfile never both succeed; Ctrl-C and kill -9
leave no converter running and, by the next run, no temporaries. The conversions themselves are tested in
tests/test_serve_llamacpp.py."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from slimwise_train.serve import gguf
from slimwise_train.serve.__main__ import main

from helpers import CHILD_ENV, REPO
from test_serve_llamacpp import TEACHER

pytestmark = [pytest.mark.engine, pytest.mark.subprocess]


def _quiet(*_):
    pass


def _copy_teacher(folder: Path, weights: bytes | None = None) -> Path:
    """The teacher's folder as links, its model.safetensors replaced by `weights` when given."""
    folder.mkdir()
    for item in TEACHER.iterdir():
        if item.name == "model.safetensors" and weights is not None:
            (folder / item.name).write_bytes(weights)
        else:
            (folder / item.name).symlink_to(item)
    return folder


@pytest.fixture(scope="module")
def bad_folders(tmp_path_factory):
    """Folders `serve gguf` must refuse before converting: a dense Qwen2, a shared_expert_mode=new export, a
    truncated and a corrupt model.safetensors."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from slimwise_train.distill.export import export_student
    from slimwise_train.distill.student import DistillModel, StudentSpec
    from slimwise_train.testing.tiny import tiny_model
    from test_student import _keep

    root = tmp_path_factory.mktemp("bad_folders")
    tokenizer = AutoTokenizer.from_pretrained(TEACHER)
    dense = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
    dense.save_pretrained(root / "dense")
    tokenizer.save_pretrained(root / "dense")
    model = tiny_model("qwen3_moe", vocab_size=len(tokenizer))
    student = DistillModel(model, _keep(model), StudentSpec(shared_expert_mode="new", lora=None))
    export_student(student, root / "new_expert", tokenizer=tokenizer)
    weights = (TEACHER / "model.safetensors").read_bytes()
    _copy_teacher(root / "truncated", weights[: len(weights) // 2])
    _copy_teacher(root / "corrupt", b"\x10\x00\x00\x00\x00\x00\x00\x00not json, not a header" + weights[40:])
    return root


def test_every_input_it_cannot_convert_is_one_line_before_the_converter_runs(bad_folders, tmp_path, monkeypatch,
                                                                             capsys):
    def no_converter(command):
        raise AssertionError("the converter ran")

    monkeypatch.setattr(gguf, "_run_converter", no_converter)
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "existing.gguf").write_text("mine")
    readonly = tmp_path / "readonly"
    readonly.mkdir()
    readonly.chmod(0o555)
    if os.access(readonly, os.W_OK):  # root writes anywhere: a folder of a read-only filesystem instead
        readonly = next((Path(p) for p in ("/sys", "/proc/sys") if Path(p).is_dir() and not _writable(Path(p))), None)
    texts = {"notjson.jsonl": "not json\n", "notext.jsonl": '{"txt": "a"}\n', "number.jsonl": '{"text": 3}\n'}
    for name, text in texts.items():
        (tmp_path / name).write_text(text)
    target = str(out / "x.gguf")
    cases = [
        ([str(bad_folders / "dense"), "--outfile", target], "is not an MoE model of a supported family (model_type "
                                                            "'qwen2')"),
        ([str(bad_folders / "new_expert"), "--outfile", target], "distill.student.shared_expert_mode=new"),
        ([str(bad_folders / "truncated"), "--outfile", target], "model.safetensors is truncated or corrupt"),
        ([str(bad_folders / "corrupt"), "--outfile", target], "model.safetensors is truncated or corrupt"),
        ([str(TEACHER), "--outfile", str(out)], "--outfile " + str(out) + " is a folder"),
        ([str(TEACHER), "--outfile", str(tmp_path / "existing.gguf")], "exists: pass --overwrite"),
        ([str(TEACHER), "--outfile", str(TEACHER / "model.safetensors"), "--overwrite"], "an input of this conversion"),
        ([str(TEACHER), "--outfile", str(TEACHER / "tokenizer.json"), "--overwrite"], "an input of this conversion"),
        ([str(TEACHER), "--outfile", target, "--pre-tokenizer", "gpt2"], "one of: "),
        ([str(TEACHER), "--outfile", target, "--pre-tokenizer", "no-such-name"], "one of: "),
        ([str(TEACHER), "--outfile", target, "--check-texts", str(tmp_path / "notjson.jsonl")], ":1: not JSON"),
        ([str(TEACHER), "--outfile", target, "--check-texts", str(tmp_path / "notext.jsonl")], ':1: needs a "text"'),
        ([str(TEACHER), "--outfile", target, "--check-texts", str(tmp_path / "number.jsonl")], ':1: needs a "text"'),
        ([str(TEACHER), "--outfile", str(tmp_path / "notext.jsonl"), "--check-texts", str(tmp_path / "notext.jsonl"),
          "--overwrite"], "--check-texts="),
    ]
    if readonly is not None:
        cases.append(([str(TEACHER), "--outfile", str(readonly / "x.gguf")], "is not writable"))
    teacher = {p.name: p.read_bytes() for p in TEACHER.iterdir()}
    for argv, message in cases:
        code = main(["gguf", *argv])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and message in err[0], (argv, err)
    assert list(out.iterdir()) == [] and (tmp_path / "existing.gguf").read_text() == "mine"
    assert {p.name: p.read_bytes() for p in TEACHER.iterdir()} == teacher
    # the docs' own example of a pre-tokenizer name is one this llama.cpp knows
    assert "`gpt-2`" in (REPO / "docs" / "serving.md").read_text()
    from slimwise_train.serve.llamacpp import pre_tokenizer_names
    assert {"default", "gpt-2", "llama3", "qwen2"} <= set(pre_tokenizer_names())


def _writable(folder: Path) -> bool:
    try:
        with tempfile.TemporaryFile(dir=folder):
            return True
    except OSError:
        return False


def test_two_runs_to_one_new_outfile_never_both_succeed(tmp_path, monkeypatch):
    """Another run publishes the outfile while this one converts (both passed the check at start): this run's
    GGUF is not written over it, and says so in one line; its temporaries are gone."""
    real = gguf.tokenization_report
    outfile = tmp_path / "teacher.gguf"

    def other_run_finishes_first(*args, **kwargs):
        outfile.write_text("the other run's GGUF")
        return real(*args, **kwargs)

    monkeypatch.setattr(gguf, "tokenization_report", other_run_finishes_first)
    with pytest.raises(FileExistsError, match="written by another run while this one converted") as error:
        gguf.convert(TEACHER, outfile, check_texts=["2+2=4"], log=_quiet)
    assert "\n" not in str(error.value)
    assert outfile.read_text() == "the other run's GGUF" and sorted(tmp_path.iterdir()) == [outfile]
    # with --overwrite this run's file replaces it
    monkeypatch.setattr(gguf, "tokenization_report", real)
    gguf.convert(TEACHER, outfile, check_texts=["2+2=4"], overwrite=True, log=_quiet)
    assert outfile.read_bytes()[:4] == b"GGUF" and sorted(tmp_path.iterdir()) == [outfile]


def _converter_child(parent: int, timeout: float = 120.0) -> int:
    """The pid of `parent`'s converter child, once it runs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                command = (entry / "cmdline").read_bytes()
            except (OSError, IndexError, ValueError):
                continue
            if ppid == parent and b"_run_converter" in command:
                return int(entry.name)
        time.sleep(0.05)
    raise AssertionError("the converter did not start")


def _gone(pid: int, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":  # exited; its parent (gone) no longer reaps it
            return True
        time.sleep(0.05)
    return False


def test_kill_9_leaves_no_converter_and_ctrl_c_is_one_line_leaving_nothing(tmp_path):
    out, temp = tmp_path / "out", tmp_path / "tmp"
    out.mkdir()
    temp.mkdir()
    env = {**CHILD_ENV, "PYTHONPATH": str(REPO), "TMPDIR": str(temp)}
    command = [sys.executable, "-m", "slimwise_train.serve", "gguf", str(TEACHER), "--outfile", str(out / "t.gguf")]

    killed = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    child = _converter_child(killed.pid)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert _gone(child), "the converter outlived its parent"
    left = [p.name for p in out.iterdir()] + [p.name for p in temp.iterdir()]
    assert any(n.startswith(".t.gguf.") and n.endswith(".tmp") for n in left), left  # what kill -9 leaves
    assert any(n.startswith(gguf.STAGING_PREFIX) for n in left), left

    # a background CI shell starts jobs with SIGINT ignored, which Python then keeps: restore a terminal's default
    interrupted = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                   preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    child = _converter_child(interrupted.pid)
    interrupted.send_signal(signal.SIGINT)
    _, err = interrupted.communicate(timeout=60)
    lines = [line for line in err.strip().splitlines() if not line.startswith("gguf: ")]
    assert interrupted.returncode == 130 and len(lines) == 1 and "interrupted (Ctrl-C)" in lines[0], err
    assert "removed what a killed conversion left" in err  # the first run's leftovers, at this run's start
    assert _gone(child)
    assert list(out.iterdir()) == [] and list(temp.iterdir()) == [], (list(out.iterdir()), list(temp.iterdir()))
    shutil.rmtree(temp)

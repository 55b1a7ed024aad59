"""`python -m slimwise_train.serve` (serve/__main__.py): bad input to generate, server and up is one line naming the
flag and the fix, exit 2, before anything loads or is created; no output ever replaces one of the run's inputs; a
run that fails or is interrupted midway writes the completions it finished.

The bad-input table calls the CLI's `main(argv)` in this process (each case costs milliseconds instead of a Python
start); the usage errors and one representative of each command run as the user runs them, in a child process.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from slimwise_train.serve.__main__ import main
from slimwise_train.serve.server import free_port

from helpers import CHILD_ENV, REPO

pytestmark = [pytest.mark.engine, pytest.mark.subprocess]

SERVE = [sys.executable, "-m", "slimwise_train.serve"]


def _cli(*args: str, cwd: Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*SERVE, *args], capture_output=True, text=True, timeout=120, cwd=cwd,
                          env={**CHILD_ENV, "PYTHONPATH": str(REPO), **(env or {})})


def _one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    return lines[0]


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def work(served, tmp_path_factory):
    """A folder with the teacher and pruned GGUFs (hard links of the session's) and a prompts file: the second row
    holds the token ids the out-of-vocabulary and context cases change."""
    root = tmp_path_factory.mktemp("serve_main")
    for name in ("teacher.gguf", "pruned.gguf"):
        os.link(served["root"] / name, root / name)
    rows = [{"prompt_ids": list(p.prompt_ids)} for p in served["problems"][:3]]
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def test_usage_errors_are_one_line_with_a_pointer_to_help(tmp_path):
    for args, flag in ((["generate", "--prefill", "x.gguf"], "--prompts"), (["generate", "--n-seq", "many"], "--n-seq"),
                       (["server", "--gguf", "x", "--port", "80.5", "--slot-dir", "s"], "--port"),
                       (["nosuchcommand"], "nosuchcommand"),
                       (["gguf", "folder", "--outfile", "x", "--bogus"], "--bogus")):
        proc = _cli(*args, cwd=tmp_path)
        line = _one_line(proc.stderr)
        assert proc.returncode == 2 and flag in line and "--help" in line and "usage:" not in line, line
    assert list(tmp_path.iterdir()) == []


def _refused(argv: list[str], capsys, message: str) -> str:
    code = main(argv)
    line = _one_line(capsys.readouterr().err)
    assert code == 2 and line.startswith("error: ") and message in line, (argv, line)
    return line


def test_generate_refuses_bad_input_in_one_line_and_writes_nothing(work, capsys, tmp_path):
    """Every case: exit 2, one line naming the flag (or the prompts line), no file created or changed."""
    def rows(*objects) -> str:
        path = tmp_path / f"rows{len(list(tmp_path.iterdir()))}.jsonl"
        path.write_text("".join(json.dumps(o) + "\n" for o in objects))
        return str(path)

    os.link(work / "prompts.jsonl", tmp_path / "linked.jsonl")
    ok = [3, 4, 5]
    base = ["generate", "--prefill", str(work / "teacher.gguf"), "--decode", str(work / "pruned.gguf")]
    prompts = ["--prompts", str(work / "prompts.jsonl")]
    cases = [
        # item 3: an --output that is one of the inputs, however spelled
        ([*base, *prompts, "--output", str(work / "pruned.gguf")], "--decode="),
        ([*base, *prompts, "--output", str(work / "teacher.gguf")], "--prefill="),
        ([*base, *prompts, "--output", str(work / "prompts.jsonl")], "--prompts="),
        ([*base, "--prompts", str(tmp_path / "linked.jsonl"), "--output", str(work / "prompts.jsonl")], "--prompts="),
        ([*base, *prompts, "--output", str(work / ".." / work.name / "pruned.gguf")], "--decode="),
        ([*base, *prompts, "--output", str(tmp_path)], "is a folder"),
        ([*base, *prompts, "--output", str(tmp_path / "none" / "out.jsonl")], "does not exist"),
        # item 7: flags out of range
        ([*base, *prompts, "--stop", ""], "--stop ''"),
        ([*base, *prompts, "--temperature", "nan"], "--temperature"),
        ([*base, *prompts, "--temperature", "inf"], "--temperature"),
        ([*base, *prompts, "--threads", "-3"], "--threads must be >= 1"),
        ([*base, *prompts, "--threads", "0"], "--threads must be >= 1"),
        ([*base, *prompts, "--top-k", "-1"], "--top-k"),
        ([*base, *prompts, "--seed", "-1"], "--seed"),
        ([*base, *prompts, "--n-ctx", "4"], "--n-ctx"),
        # prompts: integer ids in the vocabulary, an integer budget, within the context (named by their line)
        ([*base, "--prompts", rows({"prompt_ids": ok}, {"prompt_ids": [3, 1.7]})], ":2: \"prompt_ids\" must be"),
        ([*base, "--prompts", rows({"prompt_ids": [True, 4]})], ":1: \"prompt_ids\" must be"),
        ([*base, "--prompts", rows({"prompt_ids": []})], ":1: \"prompt_ids\" must be"),
        ([*base, "--prompts", rows({"prompt_ids": ok, "max_new_tokens": 2.5})], ":1: \"max_new_tokens\""),
        ([*base, "--prompts", rows({"prompt_ids": ok}, {"prompt_ids": [3, 384]})], ":2: token id 384 is not in the "
                                                                                    "vocabulary (0..383)"),
        ([*base, "--prompts", rows({"prompt_ids": [3, -1]})], ":1: token id -1 is not in the vocabulary"),
        ([*base, "--prompts", rows({"prompt_ids": [3] * 486, "max_new_tokens": 10 ** 9})],
         ":1: prompt of 486 tokens + a budget of 1000000000 exceeds the context of 512 tokens per request"),
        # files that are not what the flag wants
        (["generate", "--prefill", str(work / "prompts.jsonl"), *prompts], "--prefill"),
        ([*base[:3], "--decode", str(tmp_path), *prompts], "--decode"),
        # item 7: the roles reversed (the pruned model would prefill for the teacher)
        (["generate", "--prefill", str(work / "pruned.gguf"), "--decode", str(work / "teacher.gguf"), *prompts],
         "--allow-pruned-prefill"),
    ]
    inputs = _snapshot(work)
    before = sorted(tmp_path.iterdir())
    for argv, message in cases:
        _refused(argv, capsys, message)
    assert _snapshot(work) == inputs and sorted(tmp_path.iterdir()) == before


def test_reverse_roles_run_when_asked_and_a_pruned_model_alone_is_conventional_pruning(work, capsys, tmp_path):
    out = tmp_path / "out.jsonl"
    prompts = ["--prompts", str(work / "prompts.jsonl"), "--max-new-tokens", "4", "--threads", "1"]
    assert main(["generate", "--prefill", str(work / "pruned.gguf"), "--decode", str(work / "teacher.gguf"),
                 *prompts, "--allow-pruned-prefill", "--output", str(out)]) == 0
    assert len(out.read_text().splitlines()) == 3
    os.link(work / "pruned.gguf", tmp_path / "pruned-copy.gguf")  # the same model by content, at another path
    assert main(["generate", "--prefill", str(work / "pruned.gguf"), "--decode", str(tmp_path / "pruned-copy.gguf"),
                 *prompts]) == 0
    capsys.readouterr()


@pytest.mark.parametrize("fault", ["interrupt", "engine"])
def test_generate_interrupted_or_failing_midway_writes_the_waves_it_finished(work, capsys, tmp_path, monkeypatch,
                                                                             fault):
    from slimwise_train.serve.handoff import EngineHandoff

    real, calls = EngineHandoff._wave, []

    def wave(self, requests):
        calls.append(len(requests))
        if len(calls) == 2:  # the second wave: Ctrl-C, or llama.cpp failing
            raise KeyboardInterrupt if fault == "interrupt" else RuntimeError("llama_decode failed with code 1")
        return real(self, requests)

    monkeypatch.setattr(EngineHandoff, "_wave", wave)
    out = tmp_path / "out.jsonl"
    code = main(["generate", "--prefill", str(work / "teacher.gguf"), "--decode", str(work / "pruned.gguf"),
                 "--prompts", str(work / "prompts.jsonl"), "--n-seq", "2", "--max-new-tokens", "6", "--threads", "1",
                 "--output", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == (130 if fault == "interrupt" else 1)
    assert "the 2 of 3 completions finished are written to" in err[-1] and len(err[-1].splitlines()) == 1, err
    assert err[-1].startswith("serve: interrupted (Ctrl-C)" if fault == "interrupt" else "error: llama_decode failed")
    assert [json.loads(line)["index"] for line in out.read_text().splitlines()] == [0, 1]


def test_server_refuses_bad_input_before_creating_its_slot_folder_or_key(work, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    slots = tmp_path / "slots"
    (tmp_path / "a-file").write_text("x")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        free = ["--port", str(free_port())]
        base = ["server", "--gguf", str(work / "teacher.gguf"), "--slot-dir", str(slots)]
        cases = [([*base, "--port", port], f"--port {port} on 127.0.0.1: Address already in use"),
                 ([*base, "--port", "70000"], "--port 70000: use 1-65535"),
                 ([*base, "--port", "0"], "--port 0: use 1-65535"),
                 (["server", "--gguf", str(work / "prompts.jsonl"), *free, "--slot-dir", str(slots)],
                  "is not a GGUF file"),
                 ([*base, *free, "--threads", "0"], "--threads must be >= 1"),
                 ([*base[:3], "--slot-dir", str(tmp_path / "a-file"), *free], "--slot-dir"),
                 ([*base, *free, "--api-key-file", str(work / "teacher.gguf")], "--gguf="),
                 (["up", "--prefill", str(work / "teacher.gguf"), "--port", port], f"--port {port}"),
                 (["up", "--prefill", str(work / "prompts.jsonl"), *free], "--prefill"),
                 (["up", "--prefill", str(work / "teacher.gguf"), "--api-key-file", str(work / "teacher.gguf"), *free],
                  "--prefill="),
                 (["up", "--prefill", str(work / "teacher.gguf"), "--log-dir", str(tmp_path / "a-file"), *free],
                  "--log-dir"),
                 (["up", "--prefill", str(work / "pruned.gguf"), "--decode", str(work / "teacher.gguf"), *free],
                  "--allow-pruned-prefill")]
        for argv, message in cases:
            _refused(argv, capsys, message)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]  # no slot folder, no key file


def test_a_non_gguf_file_is_one_line_through_the_cli(work, tmp_path):
    """As the user sees it: no llama.cpp lines about the file, no slot folder."""
    proc = _cli("server", "--gguf", str(work / "prompts.jsonl"), "--port", str(free_port()), "--slot-dir",
                str(tmp_path / "s"), env={"XDG_CONFIG_HOME": str(tmp_path / "config")})
    assert proc.returncode == 2 and "is not a GGUF file" in _one_line(proc.stderr)
    assert list(tmp_path.iterdir()) == []

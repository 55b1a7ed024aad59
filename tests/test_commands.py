"""The `slimwise` console command (pyproject.toml's [project.scripts], slimwise_train/commands.py): each command is
its app's `python -m` module with the same arguments, so both spellings print and do the same."""

from __future__ import annotations

import os
import subprocess
import re
import sys

import pytest

from slimwise_train.commands import COMMANDS

from helpers import CHILD_ENV, REPO

pytestmark = pytest.mark.subprocess


@pytest.fixture(scope="module")
def slimwise(tmp_path_factory):
    """The console script as pip writes it for [project.scripts]: the venv's python importing the entry point."""
    section = (REPO / "pyproject.toml").read_text().split("[project.scripts]", 1)[1].split("\n[", 1)[0]
    (entry,) = re.findall(r'^(\w+) = "([\w.]+):(\w+)"', section, re.M)  # (tomllib is Python 3.11+)
    name, module, function = entry
    script = tmp_path_factory.mktemp("bin") / name
    script.write_text(f"#!{sys.executable}\nimport sys\nfrom {module} import {function}\nsys.exit({function}())\n")
    script.chmod(0o755)
    return script


def run(args, cwd):
    env = {**CHILD_ENV, "PYTHONPATH": os.pathsep.join([str(REPO), CHILD_ENV.get("PYTHONPATH", "")])}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("command, args", [("prune", ["model=teacher", "prune.ratio=0.25", "--help"]),
                                           ("bench", ["decode", "--help"])])  # a Hydra app, an argparse one
def test_a_command_prints_what_its_module_prints(slimwise, tmp_path, command, args):
    ours = run([str(slimwise), command, *args], tmp_path)
    theirs = run([sys.executable, "-m", COMMANDS[command][0], *args], tmp_path)
    assert ours.returncode == theirs.returncode == 0, ours.stderr[-2000:]
    assert ours.stdout == theirs.stdout and ours.stdout


def test_a_bad_override_exits_2_in_one_line_as_the_module_does(slimwise, tmp_path):
    proc = run([str(slimwise), "prune", "prune.ratoi=0.3"], tmp_path)
    assert proc.returncode == 2 and "did you mean ratio?" in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_the_command_list_and_an_unknown_command(slimwise, tmp_path):
    listed = run([str(slimwise), "--help"], tmp_path)
    assert listed.returncode == 0
    for name, (module, _) in COMMANDS.items():
        assert f"  {name} " in listed.stdout and f"[python -m {module}]" in listed.stdout
    unknown = run([str(slimwise), "pruen"], tmp_path)
    assert unknown.returncode == 2 and unknown.stderr.count("\n") == 1
    assert unknown.stderr.startswith("slimwise: error: unknown command 'pruen'")

"""`--help` of every app (issue 26 item 4): the app's own groups with their presets (never a `*_schema` entry), every
key with its value and a description from the typed schema, values composed with the overrides given beside it;
`bench <name> --help` shows the defaults; a run on a random tiny preset says so."""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Annotated, Literal, Optional

import pytest

from slimwise_train.utils.help import KEY_COLUMN, field_comments, key_lines

from helpers import APPS, REPO
from helpers import CHILD_ENV as ENV


def help_of(app: str, args: list[str], cwd: Path) -> str:
    env = {**ENV, "PYTHONPATH": os.pathsep.join([str(REPO), ENV.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", APPS[app], *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "_schema" not in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert list(cwd.iterdir()) == [], "help must not create anything (no outputs/, no log)"
    assert proc.stdout.startswith(f"usage: python -m {APPS[app]} ")
    return proc.stdout


def entry(out: str, prefix: str) -> Optional[tuple[str, str]]:
    """(head, text) of the first help line starting with `prefix`: `head` is the `name=value` part, `text` what
    follows from KEY_COLUMN on, with its wrapped continuation lines; None when there is no such line."""
    lines = out.splitlines()
    for i, line in enumerate(lines):
        if not line.startswith(prefix):
            continue
        if len(line) > KEY_COLUMN and line[KEY_COLUMN - 2:KEY_COLUMN] == "  ":
            head, parts = line[:KEY_COLUMN].strip(), [line[KEY_COLUMN:].strip()]
        else:
            head, parts = line.strip(), []
        for more in lines[i + 1:]:
            if not more.startswith(" " * KEY_COLUMN):
                break
            parts.append(more.strip())
        return head, " ".join(parts)
    return None


def group_line(out: str, group: str) -> Optional[str]:
    """`<group>=<default> options: ...` of the config groups section, or None."""
    found = entry(out.split("\nkeys:", 1)[0], f"  {group}=")
    return f"{found[0]} {found[1]}" if found and found[1].startswith("options: ") else None


def key_entry(out: str, key: str) -> tuple[str, str]:
    """(value, description) of `key` in the help's keys section."""
    found = entry(out.split("\nkeys:", 1)[1], f"  {key}=")
    assert found, f"{key} not in the help:\n{out}"
    return found[0].split("=", 1)[1], found[1]


@pytest.mark.parametrize("app, args, groups, not_groups, keys", [
    ("prune", ["model=teacher", "prune.ratio=0.25", "--help"], ["model", "data", "prune"],
     ["distill", "engine", "logger"], {"prune.ratio": "0.25", "model.path": "slimwise_train/assets/teacher",
                                       "prune.criterion": "reap", "data.source": None}),
    ("train", ["--help"], ["model", "data", "data@calibration", "prune", "distill", "distill/trainable", "engine",
                           "logger", "experiment"], [],
     {"distill.optim.lr": None, "distill.memory.recompute": "none", "engine.name": "torch", "prune.ratio": "0.5",
      "calibration.source": "synthetic"}),
    ("eval", ["-h"], ["model", "logger"], ["distill", "engine", "prune", "data"],
     {"eval.modes": None, "eval.num_per_family": "200", "logger.name": "none"}),
    ("plan", ["world_size=4", "--help"], ["model", "data", "prune", "distill", "engine"], ["logger"],
     {"world_size": "4", "gpu_memory_gib": None, "distill.memory.recompute": None}),
])
@pytest.mark.subprocess
def test_help_of_every_app(tmp_path, app, args, groups, not_groups, keys):
    out = help_of(app, args, tmp_path)
    for group in groups:
        assert group_line(out, group), f"group {group} missing:\n{out}"
    model = group_line(out, "model")
    assert "teacher" in model and "tiny_qwen3_moe" in model and "qwen3_moe_30b_a3b" in model
    for group in not_groups:
        assert group_line(out, group) is None, f"{app} does not use the {group} group:\n{out}"
        assert f"\n  {group}." not in out, f"{app} has no {group}.* keys:\n{out}"
    for key, value in keys.items():
        shown, description = key_entry(out, key)
        assert description, f"{key} has no description:\n{out}"
        if value is not None:
            assert shown == value, (key, shown)
    assert "examples:" in out and f"python -m {APPS[app]}" in out.split("examples:", 1)[1]
    long = [line for line in out.splitlines() if len(line) > 112 and not line.startswith("  python -m")]
    assert not long, long


@pytest.mark.subprocess
def test_an_override_beside_help_changes_the_groups_default(tmp_path):
    out = help_of("eval", ["model=teacher", "logger=wandb", "--help"], tmp_path)
    assert group_line(out, "model").startswith("model=teacher ")
    assert group_line(out, "logger").startswith("logger=wandb ")
    assert key_entry(out, "model.name")[0] == "teacher"
    assert key_entry(out, "eval.modes")[1].startswith("full | conventional")


@pytest.mark.subprocess
def test_help_refuses_a_bad_override_in_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", APPS["eval"], "model=nosuchpreset", "--help"], cwd=tmp_path,
                          env={**ENV, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.startswith("slimwise_train.eval: error: ") and len(proc.stderr.strip().splitlines()) == 1
    assert "Could not find 'model/nosuchpreset'; choose one of: " in proc.stderr and "_schema" not in proc.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.subprocess
def test_no_description_is_cut(tmp_path):
    """Every key of every app's help carries its schema comment whole (never cut mid-sentence): each field comment of
    the typed schemas, matched to the keys of that field name, is in the key's description from its first word to
    its last."""
    import slimwise_train.config as config

    comments = {}
    for cls in vars(config).values():
        if isinstance(cls, type) and dataclasses.is_dataclass(cls) and cls.__module__ == config.__name__:
            for name, text in field_comments(cls).items():
                text = re.sub(r"\s*\((?:see )?[A-Z]\w+ above\)", "", " ".join(text.split()))
                comments.setdefault(name, set()).add(text)
    checked = set()
    for app in ("train", "eval", "plan"):
        out = help_of(app, ["--help"], tmp_path)
        for line in out.split("\nkeys:", 1)[1].splitlines():
            match = re.match(r"  ([\w.@/]+)=", line)
            if not match:
                continue
            key = match.group(1)
            _, description = key_entry(out, key)
            description = re.sub(r"\s*\[one of: [^]]*\]$", "", description)
            for comment in comments.get(key.rsplit(".", 1)[-1], ()):
                if description.startswith(comment[:40]):
                    assert description == comment, f"{app} --help cuts {key}: {description!r}"
                    checked.add(key)
    assert "distill.split.prefix_from" in checked and len(checked) > 60, sorted(checked)


# --------------------------------------------------------------------------- descriptions from the schema source


@dataclasses.dataclass
class _Inner:
    """What the inner section is.

    More detail that the help leaves out."""

    mode: Annotated[str, Literal["a", "b"]] = "a"  # how it runs
    plain: int = 3


@dataclasses.dataclass
class _Base:
    # above the field,
    # over two lines
    first: int = 1
    listed: list = dataclasses.field(default_factory=lambda: [1,
                                                              2])  # trailing on the second line
    # a header over a field with its own comment
    second: Optional[str] = None  # its own comment wins
    inner: _Inner = dataclasses.field(default_factory=_Inner)


@dataclasses.dataclass
class _Child(_Base):
    third: float = 0.5  # only in the child


def test_field_comments_take_trailing_then_above_comments_and_base_classes():
    found = field_comments(_Child)
    assert found["first"] == "above the field, over two lines"
    assert found["listed"] == "trailing on the second line"
    assert found["second"] == "its own comment wins"
    assert found["third"] == "only in the child"
    assert "inner" not in found
    assert field_comments(_Inner) == {"mode": "how it runs"}


def test_key_lines_walk_nested_schemas_with_choices_and_docstrings():
    from omegaconf import OmegaConf

    lines = key_lines(OmegaConf.structured(_Child), _Child)
    text = "\n".join(lines)
    assert "  inner.mode=a" in text and "how it runs [one of: a, b]" in text
    assert "inner: What the inner section is." in text and "More detail" not in text
    assert "  listed=[1, 2]" in text and "  second=null" in text


# --------------------------------------------------------------------------- bench, tiny models


def test_bench_decode_help_shows_the_defaults(capsys):
    from slimwise_train.bench.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["decode", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "one batched decode step" in out
    for option, default in (("--batches BATCHES", "1,8,32,64"), ("--experts EXPERTS", "128"),
                            ("--dtype {fp32,bf16}", "fp32"), ("--cache {static,dynamic}", "static")):
        after = out.split(option, 2)[-1]
        assert f"(default: {default})" in " ".join(after.split()[:40]), (option, out)


def test_every_flag_of_every_bench_has_its_help():
    """`bench <name> --help` explains each flag in words, not only its default (bench serve's flags are its own)."""
    import argparse

    from slimwise_train.bench.cli import build_parser

    (subparsers,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    silent = {}
    for name, sub in subparsers.choices.items():
        if name == "serve":
            continue
        for action in sub._actions:
            if not action.option_strings or isinstance(action, argparse._HelpAction):
                continue
            words = re.sub(r"\(default: %\(default\)s\)", "", action.help or "").strip()
            if len(words) < 8:
                silent.setdefault(name, []).append(action.option_strings[0])
    assert not silent, silent


def test_a_tiny_preset_says_it_is_random(caplog, monkeypatch):
    from omegaconf import OmegaConf

    import slimwise_train.models as models
    from slimwise_train.config import ModelConfig

    monkeypatch.setattr(models, "_TINY_NOTICE_SHOWN", set())
    cfg = OmegaConf.structured(ModelConfig(name="tiny_qwen3_moe", tiny="qwen3_moe", dtype="float32",
                                           tiny_overrides={"num_hidden_layers": 1}))
    with caplog.at_level(logging.INFO, logger="slimwise"):
        models.load_model(cfg, "cpu")
        models.load_model(cfg, "cpu")  # once per process: the trainer loads the teacher twice
    notices = [r for r in caplog.records if "random tiny" in r.getMessage()]
    assert len(notices) == 1 and notices[0].name.startswith("slimwise.")
    assert notices[0].getMessage() == (
        "model=tiny_qwen3_moe is a random tiny qwen3_moe for smoke tests (no trained weights); use model=teacher for "
        "the shipped teacher or model.path=<folder or hub id> for your checkpoint")

"""Every app's entry point (utils/cli.py `hydra_app`): a bad override is one line and exit 2 before Hydra creates
anything, a run refused for bad input leaves the disk as it found it, and the thread count is chosen and logged."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slimwise_train.utils.cli import _check_whole_dict_overrides, _override_variants, threads_for_this_process

from helpers import APPS, compose_config
from helpers import CHILD_ENV as ENV


def run(app: str, args: list[str], cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", APPS[app], *args], cwd=cwd, env=env or ENV, capture_output=True,
                          text=True, timeout=300)


def the_error(proc, app: str) -> str:
    """The one `<prog>: error:` line; fails on a traceback or a multi-line Hydra block."""
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "Set the environment variable HYDRA_FULL_ERROR" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip() and "][slimwise" not in line]
    assert len(lines) == 1 and lines[0].startswith(f"{APPS[app]}: error: "), proc.stderr
    return lines[0]


def tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize("app, override, expected", [
    ("prune", "model=nosuchpreset", "Could not find 'model/nosuchpreset'; choose one of: "),
    ("train", "distill/trainable=bogus", "Could not find 'distill/trainable/bogus'; choose one of: always_on"),
    ("plan", "world_size=abc", "world_size=abc: Value 'abc' of type 'str' could not be converted to Integer"),
    ("plan", "world_size=1.5", "world_size=1.5: Value '1.5' of type 'float' could not be converted to Integer"),
    ("prune", "prune.ratoi=0.3", "Key 'ratoi' not in 'PruneConfig'; did you mean ratio?"),
    ("eval", "eval.budget=lots", "eval.budget must be >= 1 token per family"),
    # a dict given whole is merged by Hydra, not replaced: ce would keep training at 0.1
    ("train", "distill.loss.terms={kl:1.0}", "distill.loss.terms={kl:1.0}: Hydra merges a dict given whole into the one "
                                             "there ({ce: 0.1, kl: 0.9}): it would keep ce; to make distill.loss.terms "
                                             "{kl: 1.0} write ~distill.loss.terms.ce distill.loss.terms.kl=1.0"),
    ("train", "distill.loss.terms.full_kl=1.0", "Key 'full_kl' is not in struct; a new key of a dict is added with "
                                                "+distill.loss.terms.full_kl=1.0"),
    # an unquoted non-ASCII path: Hydra's lexer said only LexerNoViableAltException
    ("prune", "model.path=/tmp/mod\u00e8le", "model.path=/tmp/mod\u00e8le: Hydra's override grammar reads an unquoted "
                                            "value as ASCII letters, digits and a few symbols only; quote the value for "
                                            "Hydra inside the shell's quotes: 'model.path=\"/tmp/mod\u00e8le\"'"),
])
@pytest.mark.subprocess
def test_a_bad_override_is_one_line_and_creates_nothing(tmp_path, app, override, expected):
    start = time.perf_counter()
    proc = run(app, [override], cwd=tmp_path)
    line = the_error(proc, app)
    assert expected in line
    assert "_schema" not in line  # the typed schemas Hydra lists as choices are not presets
    assert tree(tmp_path) == []
    assert time.perf_counter() - start < 60  # before any model loads


@pytest.mark.parametrize("given, expected", [
    ("{kl:1.0}", {"kl": 1.0}), ("{full_kl:1.0}", {"full_kl": 1.0}),
    ("{ce:0.2,full_kl:1.0}", {"ce": 0.2, "full_kl": 1.0}),
    ("{}", {}),
])
def test_a_whole_dict_override_is_refused_with_the_spelling_that_makes_that_dict(given, expected):
    with pytest.raises(ValueError) as caught:
        _check_whole_dict_overrides([f"distill.loss.terms={given}"],
                                    lambda lines: compose_config("train", *lines))
    spelled = str(caught.value).rsplit(" write ", 1)[1].split()
    if expected:
        assert dict(compose_config("train", *spelled).distill.loss.terms) == expected
    # the same keys as there (only values change), and a null field given a dict, pass as Hydra means them
    _check_whole_dict_overrides(["distill.loss.terms={ce:0.5,kl:0.5}"], lambda lines: compose_config("train", *lines))
    _check_whole_dict_overrides(["eval.budget={math:3}", "output_dir=x"], lambda lines: compose_config("eval", *lines))
    with pytest.raises(ValueError, match="it would keep ce, kl"):  # + merges into a dict that is there, too
        _check_whole_dict_overrides(["+distill.loss.terms={full_kl:1.0}"], lambda lines: compose_config("train", *lines))


@pytest.mark.subprocess
def test_every_value_of_a_sweep_is_checked_before_the_first_job(tmp_path):
    proc = run("prune", ["--multirun", "prune.ratio=0.25,abc"], cwd=tmp_path)
    assert "prune.ratio=abc" in the_error(proc, "prune")
    assert tree(tmp_path) == []
    variants = _override_variants(["a=1,2", "b=x", "c=3,4,5"])
    assert variants == [["a=1", "b=x", "c=3"], ["a=2", "b=x", "c=3"], ["a=1", "b=x", "c=4"], ["a=1", "b=x", "c=5"]]


@pytest.mark.subprocess
def test_an_output_folder_that_cannot_be_created_is_named(tmp_path):
    (tmp_path / "a-file").write_text("")
    proc = run("prune", [f"hydra.run.dir={tmp_path / 'a-file' / 'run'}"], cwd=tmp_path)
    line = the_error(proc, "prune")
    assert "a-file/run cannot be created" in line and "not a folder" in line
    assert tree(tmp_path) == ["a-file"]


@pytest.mark.parametrize("app, bad", [
    ("prune", "prune.ratio=2"),
    ("train", "distill.loss.terms.kl=-1"),
    ("train", "prune.criterion=magic"),  # scored at start (prune.keep_set=null): refused before the model loads
    ("eval", "eval.num_per_family=0"),
    ("plan", "gpu_memory_gib=0"),
])
@pytest.mark.subprocess
def test_a_run_refused_for_bad_input_leaves_no_folder_and_no_log(tmp_path, app, bad):
    proc = run(app, [bad, f"hydra.run.dir={tmp_path / 'outputs' / 'deep' / 'run'}", f"output_dir={tmp_path / 'o'}"]
               if app == "train" else [bad, f"hydra.run.dir={tmp_path / 'outputs' / 'deep' / 'run'}"], cwd=tmp_path)
    assert bad.split("=")[0] in the_error(proc, app)
    assert tree(tmp_path) == []


@pytest.mark.parametrize("app, args, expected", [
    ("train", ["distill.lr=1e-4"], "distill.lr moved to distill.optim.lr"),
    ("train", ["distill.max_steps=10", "distill.eval_every=5"],
     "distill.max_steps moved to distill.schedule.max_steps; distill.eval_every moved to distill.eval.every"),
    ("train", ["--multirun", "+distill.save_every=2,4"], "distill.save_every moved to distill.checkpoint.every"),
    ("train", ["distill.prefix_from=student", "--help"], "distill.prefix_from moved to distill.split.prefix_from"),
    ("plan", ["distill.recompute=moe"], "distill.recompute moved to distill.memory.recompute"),
])
@pytest.mark.subprocess
def test_an_old_flat_distill_key_is_one_line_naming_its_new_place(tmp_path, app, args, expected):
    """The distill keys moved into groups (issue 25: config.MOVED_KEYS): the old flat key on the command line is one
    line naming the new key, exit 2, before any folder or log (a sweep, `+key` and --help alike)."""
    proc = run(app, [*args, f"hydra.run.dir={tmp_path / 'outputs' / 'run'}"], cwd=tmp_path)
    assert the_error(proc, app) == f"{APPS[app]}: error: {expected}"
    assert tree(tmp_path) == []


@pytest.mark.subprocess
def test_an_old_flat_distill_key_in_a_yaml_names_the_file_and_the_new_place(tmp_path):
    mine, work = tmp_path / "conf", tmp_path / "work"
    (mine / "experiment").mkdir(parents=True)
    work.mkdir()
    (mine / "experiment" / "old.yaml").write_text("# @package _global_\ndistill:\n  lr: 1.0e-4\n  max_steps: 9\n")
    proc = run("train", [f"hydra.searchpath=[file://{mine}]", "experiment=old",
                         f"hydra.run.dir={work / 'outputs' / 'run'}"], cwd=work)
    line = the_error(proc, "train")
    assert line == "slimwise_train: error: In 'experiment/old': distill.lr moved to distill.optim.lr"
    assert tree(work) == []


def test_only_a_renamed_key_gets_the_moved_line():
    from hydra.errors import ConfigCompositionException

    from slimwise_train.config import moved_key_message
    from slimwise_train.utils.cli import _moved_key

    exc = ConfigCompositionException("Could not override 'distill.lr'")
    assert _moved_key(["distill.lr=1", "~distill.lr"], exc, moved_key_message) == "distill.lr moved to distill.optim.lr"
    assert _moved_key(["distill.optim.lr=1", "distill.log_every=2"], exc, moved_key_message) is None


@pytest.mark.subprocess
def test_a_refused_rerun_keeps_the_folder_and_the_log_it_had(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "prune.log").write_text("the earlier run's log\n")
    (run_dir / "keep_set.json").write_text("{}")
    proc = run("prune", ["prune.ratio=2", f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    the_error(proc, "prune")
    assert tree(tmp_path) == ["run", "run/keep_set.json", "run/prune.log"]
    assert (run_dir / "prune.log").read_text() == "the earlier run's log\n"


@pytest.mark.subprocess
def test_the_thread_count_is_the_environment_s_or_the_physical_cores_and_is_logged(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert threads_for_this_process() == (3, "OMP_NUM_THREADS")
    monkeypatch.delenv("OMP_NUM_THREADS")
    threads, why = threads_for_this_process()
    assert 1 <= threads <= len(os.sched_getaffinity(0)) and "physical cores" in why
    env = {k: v for k, v in ENV.items() if k != "OMP_NUM_THREADS"}
    proc = run("prune", ["prune.ratio=2", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, env=env)
    the_error(proc, "prune")  # the app logs its threads first, then refuses
    assert f"torch threads: {threads} (physical cores" in proc.stdout + proc.stderr


@pytest.mark.subprocess
def test_a_run_stopped_with_ctrl_c_before_writing_anything_leaves_nothing(tmp_path):
    """An aborted eval used to leave a timestamped folder holding only eval.log (issue 26 item 7)."""
    import signal

    run_dir = tmp_path / "outputs" / "eval" / "run"
    proc = subprocess.Popen([sys.executable, "-m", APPS["eval"], "model=teacher", "eval.num_per_family=200",
                             f"hydra.run.dir={run_dir}", "progress=false"], cwd=tmp_path, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            # a background CI shell starts jobs with SIGINT ignored, which Python then keeps: restore
                            # the default, so the app gets Ctrl-C as a user's terminal delivers it
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        for line in proc.stdout:  # the job has started (its log exists) once it logs its threads
            if "torch threads:" in line:
                break
        assert (run_dir / "eval.log").is_file()
        time.sleep(2)  # inside model loading or generation
        proc.send_signal(signal.SIGINT)
        output = proc.communicate(timeout=120)[0]
    finally:
        proc.kill()
    # Once in many CI runs (2026-12-05, an Intel Xeon) the folder and its log stayed: the exit status and the app's
    # last output tell a KeyboardInterrupt the cleanup missed from a process killed by the signal itself (-2).
    assert tree(tmp_path) == [], f"exit status {proc.returncode}; the app's last output:\n{output[-3000:]}"
    # one line, exit 130 (128 + SIGINT), no traceback (it printed 113 lines)
    assert proc.returncode == 130 and "Traceback" not in output, output[-3000:]
    assert output.strip().splitlines()[-1] == ("slimwise_train.eval: interrupted (Ctrl-C): nothing was written "
                                               "(eval writes its outputs once every generation is done)")


@pytest.mark.subprocess
def test_training_stopped_with_ctrl_c_is_one_line_and_keeps_its_checkpoints(tmp_path):
    from helpers import TINY_TRAIN, ctrl_c_when

    run_dir = tmp_path / "run"
    # at step 2, step 1's checkpoint is published
    returncode, output = ctrl_c_when([sys.executable, "-m", APPS["train"], *TINY_TRAIN, "progress=false",
                                      "distill.schedule.max_steps=10000", "distill.checkpoint.every=1",
                                      "distill.log_every=1", "distill.eval.every=10000", f"hydra.run.dir={run_dir}"],
                                     "step 2/10000", cwd=tmp_path, env=ENV)
    assert returncode == 130 and "Traceback" not in output, output[-3000:]
    assert output.strip().splitlines()[-1] == (
        "slimwise_train: interrupted (Ctrl-C): the checkpoints written so far stay; rerun the same command "
        "(resume=auto) to continue from the newest")
    assert any((run_dir / "checkpoints").glob("step_*/complete"))
    assert not (run_dir / ".slimwise.lock").exists()  # released on the way out


def test_a_key_error_is_a_bug_and_bad_input_is_a_value_error(tmp_path, capsys):
    """KeyError is not a user error (a missing dictionary key is a bug: traceback, not exit 2); the places that
    reported bad input with a KeyError raise ValueError with the message (no quotes around it)."""
    import torch
    from safetensors.torch import save_file

    from slimwise_train.data.synthetic import check_recipe, load_recipe
    from slimwise_train.moe.keepset import KeepSet
    from slimwise_train.moe.adapters import get_adapter
    from slimwise_train.prune.statistics import STATS_FORMAT, load_scores
    from slimwise_train.testing.tiny import tiny_model
    from slimwise_train.utils.cli import USER_ERRORS, user_errors

    assert KeyError not in USER_ERRORS
    with pytest.raises(KeyError), user_errors("prog"):
        {}["missing"]
    with pytest.raises(SystemExit) as exit_info, user_errors("prog"):
        raise ValueError("keep set has no layer 7")
    assert exit_info.value.code == 2 and capsys.readouterr().err.strip() == "prog: error: keep set has no layer 7"

    model = tiny_model("qwen3_moe")
    keep = KeepSet.from_kept(get_adapter(model).moe_layers(model), [[0, 1, 2, 3]] * 2, model_type="qwen3_moe")
    with pytest.raises(ValueError, match="keep set has no layer 7"):
        keep.layer(7)
    scores = tmp_path / "scores.safetensors"
    save_file({"stats.num_tokens": torch.zeros(2)}, str(scores), metadata={"slimwise": json.dumps(
        {"format": STATS_FORMAT, "layer_indices": [0, 1], "num_experts": 8, "top_k": 2})})
    with pytest.raises(ValueError, match="incomplete scores file"):
        load_scores(scores)
    recipe = load_recipe()
    with pytest.raises(ValueError, match="needs splits.eval with n and seed"):
        check_recipe({**recipe, "splits": {"train": recipe["splits"]["train"]}})
    with pytest.raises(ValueError, match="needs a `families` mapping"):
        check_recipe({"splits": recipe["splits"]})


@pytest.mark.subprocess
def test_the_folder_checked_is_the_folder_hydra_runs_in_even_with_a_clock_in_its_name(tmp_path):
    """hydra.run.dir with ${now:...} resolves once in the pre-check and again in Hydra's own config (a new clock
    reading): microseconds always differ, so a refused run left Hydra's folder behind until the folder was pinned."""
    proc = run("prune", ["prune.ratio=2", "hydra.run.dir=outputs/x/${now:%H-%M-%S-%f}"], cwd=tmp_path)
    assert "prune.ratio" in the_error(proc, "prune")
    assert tree(tmp_path) == []
    ok = run("plan", ['hydra.run.dir="outputs/it\'s ${now:%f}"'], cwd=tmp_path)  # a quote in the name is kept
    assert ok.returncode == 0, ok.stderr[-2000:]
    (folder,) = (tmp_path / "outputs").iterdir()
    assert folder.name.startswith("it's ") and (folder / "plan.json").is_file()

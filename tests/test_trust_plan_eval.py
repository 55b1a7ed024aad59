"""Bad input to the planner and the eval app is one `<prog>: error:` line naming the key and its valid range, exit code
2, before the model (or the planner's meta model) is built: each CLI run below takes seconds."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import CHILD_ENV as ENV
from helpers import compose_config

FAST_S = 30  # a check that runs before the model is built answers in seconds


def run_app(app: str, args: list[str], cwd: Path) -> tuple[subprocess.CompletedProcess, float]:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", app, *args, f"hydra.run.dir={cwd / 'run'}"], cwd=cwd, env=ENV,
                          capture_output=True, text=True, timeout=300)
    return proc, time.perf_counter() - start


def assert_one_error(proc, seconds: float, prog: str, *needles: str) -> str:
    lines = [line for line in proc.stderr.strip().splitlines() if line.startswith(f"{prog}: error:")]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(lines) == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert seconds < FAST_S, f"{seconds:.1f} s: the check ran after expensive work"
    return lines[0]


# --------------------------------------------------------------------------- the planner (issue 24: 3, 8, 15)

QWEN = "model=qwen3_moe_30b_a3b"


@pytest.mark.parametrize("args,needles", [
    ([QWEN, "data.seq_len=10000000"], ["data.seq_len=10000000", "max_position_embeddings=40960", "[3, 40960]"]),
    ([QWEN, "gpu_memory_gib=-1"], ["gpu_memory_gib=-1", "> 0"]),
    ([QWEN, "gpu_memory_gib=0"], ["gpu_memory_gib=0", "> 0"]),
    ([QWEN, "data.batch_size=0"], ["data.batch_size=0", ">= 1"]),
    ([QWEN, "prefix_tokens=100000", "data.seq_len=4096"], ["prefix_tokens=100000", "[1, 4094]"]),
    ([QWEN, "prefix_tokens=-1"], ["prefix_tokens=-1", "[1, 2046]"]),
    ([QWEN, "continuation_tokens=-1"], ["continuation_tokens=-1", "[2, 2047]"]),
    ([QWEN, "prefix_tokens=3000", "continuation_tokens=3000", "data.seq_len=4096"],
     ["prefix_tokens=3000 + continuation_tokens=3000", "data.seq_len=4096"]),
    ([QWEN, "data.seq_len=0"], ["data.seq_len=0", "data.seq_len>=3"]),
    # deepseek_v3's meta model takes minutes to build on 2 cores: the check comes first
    (["model=deepseek_v3", "world_size=0"], ["world_size=0", "world_size>=1"]),
], ids=["seq_len_above_max_positions", "gpu_memory_negative", "gpu_memory_zero", "batch_size_zero",
        "prefix_above_seq_len", "prefix_negative", "continuation_negative", "prefix_plus_continuation",
        "seq_len_zero", "world_size_zero"])
@pytest.mark.subprocess
def test_plan_bad_input_is_one_line_before_the_model(tmp_path, args, needles):
    proc, seconds = run_app("slimwise_train.plan", args, tmp_path)
    line = assert_one_error(proc, seconds, "slimwise_train.plan", *needles)
    assert "continuation_tokens" not in line or "continuation_tokens" in " ".join(args)  # seq_len=0 blames seq_len
    assert proc.stdout.strip() == "" or "memory plan" not in proc.stdout


def _plan_cfg(*overrides: str):
    return compose_config("plan", *overrides)


def test_plan_shape_follows_the_split_rule():
    """One row: prefix and continuation are one sequence (<= seq_len, the rest of it by default); several rows pad to
    the longest prefix and the longest continuation, which may sum past seq_len."""
    from slimwise_train.plan.memory import resolve_shape

    assert resolve_shape(_plan_cfg("data.seq_len=4096")).__dict__ == {"batch": 1, "prefix": 1, "continuation": 4095}
    one = resolve_shape(_plan_cfg("data.seq_len=4096", "prefix_tokens=1000"))
    assert (one.prefix, one.continuation) == (1000, 3096)
    two = resolve_shape(_plan_cfg("data.seq_len=4096", "data.batch_size=2", "prefix_tokens=3000",
                                  "continuation_tokens=3000"))
    assert (two.batch, two.prefix, two.continuation) == (2, 3000, 3000)
    with pytest.raises(ValueError, match=r"continuation_tokens=1 is invalid: use continuation_tokens in \[2, 4095\]"):
        resolve_shape(_plan_cfg("data.seq_len=4096", "continuation_tokens=1"))


# --------------------------------------------------------------------------- eval.modes (issue 24: 4)


@pytest.mark.parametrize("args,needles", [
    (["eval.modes=[slimwise_distill]"], ["eval.modes=[slimwise_distill]", "eval.student", "eval.keep_sets"]),
    (["eval.modes=[slimwise_distill]", "eval.keep_sets=[keep_set.json]"],
     ["eval.modes=[slimwise_distill]", "needs eval.student"]),
    (["eval.modes=[conventional,slimwise,reverse]"], ["eval.modes=[conventional,slimwise,reverse]",
                                                      "need eval.keep_sets"]),
    (["eval.modes=[full,slimwize]"], ["eval.modes=['full', 'slimwize']: 'slimwize' is not one of: full, conventional, "
                                      "slimwise, reverse, conventional_distill, slimwise_distill"]),
], ids=["distill_without_student", "distill_with_keep_set_without_student", "pruned_modes_without_keep_sets",
        "unknown_mode"])
@pytest.mark.subprocess
def test_eval_modes_that_evaluate_nothing_are_one_line_before_the_model(tmp_path, args, needles):
    proc, seconds = run_app("slimwise_train.eval", args, tmp_path)
    assert_one_error(proc, seconds, "slimwise_train.eval", *needles)


def test_modes_that_cannot_run_beside_one_that_can_are_skipped():
    from slimwise_train.eval.generation import check_modes_run, missing_for_modes

    modes = ["full", "conventional", "slimwise", "reverse", "slimwise_distill"]  # the default list
    check_modes_run(modes, has_keep_sets=False, has_student=False)  # only full runs (evaluate notes the rest)
    assert missing_for_modes(modes, False, False) == {
        "conventional": ("eval.keep_sets",), "slimwise": ("eval.keep_sets",), "reverse": ("eval.keep_sets",),
        "slimwise_distill": ("eval.keep_sets", "eval.student")}
    assert missing_for_modes(modes, True, False) == {"slimwise_distill": ("eval.student",)}
    check_modes_run(["slimwise_distill"], has_keep_sets=True, has_student=True)
    with pytest.raises(ValueError, match=r"^eval.modes=\[slimwise_distill\] evaluates nothing: slimwise_distill "
                                         r"needs eval.student; set eval.student=<exported student folder>, or add "
                                         r"full to eval.modes$"):
        check_modes_run(["slimwise_distill"], has_keep_sets=True, has_student=False)

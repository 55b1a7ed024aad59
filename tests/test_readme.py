"""The README's code runs as written: the Python block of "The library in five calls", from a fresh folder after
the tour's step 1 (the prune command it names), in a process of its own as a user would paste it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.subprocess  # every block runs as a user pastes it: in a process of its own
REPO = Path(__file__).resolve().parents[1]


def readme_block(heading: str, language: str) -> str:
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index(heading):]
    return re.search(rf"```{language}\n(.*?)```", section, re.S).group(1)


def test_the_library_in_five_calls_runs_as_written(tmp_path):
    (tmp_path / "slimwise_train").symlink_to(REPO / "slimwise_train")  # a checkout's relative paths, outputs in tmp
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    tour = readme_block("## A five-minute tour", "bash")
    prune = next(line for line in tour.splitlines() if line.startswith("python -m slimwise_train.prune"))
    proc = subprocess.run([sys.executable, *prune.split()[1:]], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    code = readme_block("## The library in five calls", "python")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    texts, lengths = proc.stdout.strip().rsplit("] [", 1)
    assert "885" in texts and "40" in texts  # 6+916-37 and 12*3+4, answered by the pruned decoder
    assert (tmp_path / "decode_ckpt" / "config.json").is_file()
    assert (tmp_path / "decode_ckpt" / "slimwise_keep_set.json").is_file()


@pytest.mark.slow
def test_the_tour_runs_as_written_with_small_counts(tmp_path):
    """The tour's shell block as a user pastes it, from a checkout-like folder, with only the counts the README lets a
    user override made small (steps, problems, --limit): every stage writes what the README's table lists, and the
    lm-eval loop's one report compares every mode against full."""
    import json

    (tmp_path / "slimwise_train").symlink_to(REPO / "slimwise_train")
    tour = readme_block("## A five-minute tour", "bash")
    small = {
        "experiment=demo": "experiment=demo distill.schedule.max_steps=12 distill.eval.every=6 "
                           "distill.checkpoint.every=12 distill.eval.samples=8 data.num_samples=128",
        "eval.student=outputs/train/teacher/reap-r0.5": "eval.student=outputs/train/teacher/reap-r0.5 "
                                                        "eval.num_per_family=3 progress=false",
        "--output_path outputs/lm_eval": "--output_path outputs/lm_eval --limit 3",
    }
    for written, shortened in small.items():
        assert tour.count(written) == 1, written  # the README still says it this way
        tour = tour.replace(written, shortened)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run(["bash", "-e", "-c", tour], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "outputs"
    for name in ("keep_set.json", "router_mask.safetensors", "scores.safetensors", "prune_summary.json", "pruned"):
        assert (out / "prune" / "teacher" / "reap-r0.5" / name).exists(), name
    for name in ("export", "student_trainable.safetensors", "metrics.jsonl", "train_config.yaml", "checkpoints"):
        assert (out / "train" / "teacher" / "reap-r0.5" / name).exists(), name
    (eval_dir,) = (out / "eval" / "teacher").iterdir()
    for name in ("results.json", "report.md", "lengths_reap-r0.5.png"):
        assert (eval_dir / name).exists(), name
    modes = {row["mode"] for row in json.loads((eval_dir / "results.json").read_text())["rows"]}
    assert modes == {"full", "conventional", "slimwise", "reverse", "conventional_distill", "slimwise_distill"}
    (lm_dir,) = (out / "lm_eval").iterdir()
    assert lm_dir.name == "slimwise_train__assets__teacher"  # the README's "<pretrained, / as __>"
    for mode in ("conventional", "slimwise", "reverse"):
        assert len(list(lm_dir.glob(f"slimwise_lengths_{mode}_reap-r0.5-*.jsonl"))) == 1  # -<digest of keep set>
        assert len(list(lm_dir.glob(f"slimwise_summary_{mode}_reap-r0.5-*.json"))) == 1
    assert (lm_dir / "slimwise_lengths_reap-r0.5.png").is_file()
    report = (lm_dir / "slimwise_report.md").read_text()
    table = [line for line in report.splitlines() if line.startswith("| ") and not line.startswith("| mode")]
    assert [line.split(" | ")[0][2:] for line in table] == ["full", "conventional", "slimwise", "reverse"]
    assert "| mode | slimwise_math | slimwise_code | slimwise_tool | all | worst family" in report  # suite order
    assert table[0].endswith("| 1.00x |") and table[2].endswith("x |") and not table[2].endswith("1.00x |")
    assert "Custom kwargs can be passed to `--metadata`" not in proc.stderr + proc.stdout

"""The README's code runs as written: the Python block of "The library in five calls", from a fresh folder after
the tour's step 1 (the prune command it names), in a process of its own as a user would paste it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

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

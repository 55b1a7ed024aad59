"""What the study scripts (scripts/fidelity.py, scripts/prefix_ablation.py) share: one app call with its output in
a log, and the paired difference of two per-problem outcomes with its standard error."""

from __future__ import annotations

import math
import os
import subprocess
import time
from pathlib import Path


def run_app(cmd: list[str], log: Path, cwd: Path, who: str) -> float:
    """Run one app call (offline, W&B off, unbuffered) with stdout and stderr in `log`; its wall seconds. A failure
    is one line naming the command, the log and the log's last line."""
    print(f"$ {' '.join(cmd)}  (log: {log})", flush=True)
    start = time.time()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    with open(log, "w") as handle:
        proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=handle, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        tail = log.read_text().strip().splitlines()[-1:] or [""]
        raise SystemExit(f"{who}: failed (exit {proc.returncode}): {' '.join(cmd)}; see {log}: {tail[0]}")
    took = time.time() - start
    print(f"  done in {took:.0f} s", flush=True)
    return took


def paired_difference(a: list[bool], b: list[bool]) -> tuple[float, float, int]:
    """(mean of a - b, its standard error, n) over problems paired by index: the std of the per-problem differences
    (n - 1 in the denominator) / sqrt(n); 0 for a single problem."""
    diffs = [float(x) - float(y) for x, y in zip(a, b, strict=True)]
    n = len(diffs)
    mean = sum(diffs) / n
    var = sum((d - mean) ** 2 for d in diffs) / (n - 1) if n > 1 else 0.0
    return mean, math.sqrt(var / n), n

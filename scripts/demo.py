"""`make demo`: the whole SlimWise pipeline on the shipped model and data, ending in outputs/demo/report.md.

Steps (each is the same command a user would run):
  1. score experts (REAP) and prune 50%:  python -m slimwise_train.prune
  2. report what pruning keeps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "outputs" / "demo"


def run(cmd: list[str]) -> None:
    print("+", " ".join(cmd), flush=True)
    start = time.time()
    subprocess.run(cmd, cwd=REPO, check=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    print(f"  ({time.time() - start:.1f} s)", flush=True)


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    prune_dir = OUT / "prune"
    run([sys.executable, "-m", "slimwise_train.prune", "prune.criterion=reap", "prune.ratio=0.5",
         f"hydra.run.dir={prune_dir}", "prune.export_checkpoint=true"])
    summary = json.loads((prune_dir / "prune_summary.json").read_text())
    lines = ["# SlimWise demo", "", f"Model: `{summary['model']}` ({summary['family']})", "",
             f"Kept experts per layer: {summary['num_kept']} (criterion {summary['criterion']}, ratio {summary['ratio']})",
             f"Routing mass kept per layer: {[round(m, 3) for m in summary['kept_routing_mass']]}", ""]
    (OUT / "report.md").write_text("\n".join(lines) + "\n")
    print((OUT / "report.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Pruning-level sweep on a teacher: conventional vs SlimWise (handoff) vs reverse at several pruning ratios.

    python scripts/pruning_sweep.py                               # shipped teacher, REAP, 12.5/25/37.5/50%
    python scripts/pruning_sweep.py --criterion mass --per-family 200 --teacher <folder>

Scores experts once (cached), writes a keep set per ratio with `python -m slimwise_train.prune`, then runs
`python -m slimwise_train.eval` on all keep sets; the table lands in outputs/sweep/<criterion>/eval/report.md.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--criterion", default="reap")
    parser.add_argument("--ratios", default="0.125,0.25,0.375,0.5")
    parser.add_argument("--per-family", type=int, default=100)
    parser.add_argument("--teacher", default=None, help="teacher folder (default: the shipped one)")
    parser.add_argument("--modes", default="full,conventional,slimwise,reverse")
    args = parser.parse_args(argv)
    model = ["model=teacher"] + ([f"model.path={args.teacher}"] if args.teacher else [])
    out = REPO / "outputs" / "sweep" / args.criterion
    start = time.time()
    keep_sets = []
    for ratio in args.ratios.split(","):
        run_dir = out / f"{args.criterion}-r{ratio}"
        subprocess.run([sys.executable, "-m", "slimwise_train.prune", *model, f"prune.criterion={args.criterion}",
                        f"prune.ratio={ratio}", f"hydra.run.dir={run_dir}", "progress=false"], cwd=REPO, check=True)
        keep_sets.append(str(run_dir / "keep_set.json"))
    subprocess.run([sys.executable, "-m", "slimwise_train.eval", *model, f"eval.keep_sets=[{','.join(keep_sets)}]",
                    f"eval.modes=[{args.modes}]", f"eval.num_per_family={args.per_family}",
                    f"hydra.run.dir={out / 'eval'}", "progress=false"], cwd=REPO, check=True)
    print((out / "eval" / "report.md").read_text())
    print(f"sweep finished in {time.time() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

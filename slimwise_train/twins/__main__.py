"""python -m slimwise_train.twins <preset | all> <folder> [--seed N] [--overwrite]; --list shows the presets."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    from slimwise_train.twins.specs import PRESETS, SPECS, spec_of
    from slimwise_train.utils.cli import user_errors

    parser = argparse.ArgumentParser(prog="python -m slimwise_train.twins",
                                     description="Build a realistic twin of a shipped preset (docs/real-models.md).")
    parser.add_argument("preset", nargs="?", help=f"one of {', '.join(PRESETS)}, or all")
    parser.add_argument("folder", nargs="?", help="where to write it (with all: one subfolder per preset)")
    parser.add_argument("--seed", type=int, default=0, help="the weights' seed (the same seed gives the same twin)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing folder")
    parser.add_argument("--list", action="store_true", help="list the presets and their tokenizers, then exit")
    args = parser.parse_args(argv)
    if args.list:
        for spec in SPECS:
            print(f"{spec.preset}\t{spec.tokenizer_source}")
        return 0
    with user_errors(parser.prog):
        if not args.preset or not args.folder:
            raise ValueError("give a preset (or all) and a folder: python -m slimwise_train.twins <preset> <folder>")
        presets = PRESETS if args.preset == "all" else (spec_of(args.preset).preset,)
        root = Path(args.folder)
        targets = [(p, root / p if args.preset == "all" else root) for p in presets]
        for preset, folder in targets:  # every refusal before anything is written
            if folder.exists() and not args.overwrite:
                raise FileExistsError(f"{folder} exists: pass --overwrite or another folder")
        from slimwise_train.twins.build import build_twin

        for preset, folder in targets:
            start = time.perf_counter()
            build_twin(preset, folder, seed=args.seed, overwrite=args.overwrite,
                       log=lambda m: print(m, file=sys.stderr, flush=True))
            print(f"twins: {preset}: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What many test files need, written once: an app's config composed as its entry point would, the override lists of
the tiny fast runs, and the environment and module names of a CLI child process.

Plain functions and constants, not fixtures, so that module-scoped fixtures and module-level helpers can use them
too: `from helpers import compose_config, TINY_TRAIN` (pytest's default import mode puts tests/ on sys.path, as for
the `from test_lora import ...` between test modules).
"""

from __future__ import annotations

import os
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from slimwise_train.config import CONF_DIR, register_configs

REPO = Path(__file__).resolve().parents[1]

# `python -m <module>` of each app
APPS = {"prune": "slimwise_train.prune", "train": "slimwise_train", "eval": "slimwise_train.eval",
        "plan": "slimwise_train.plan"}

# A CLI child: unbuffered (its last lines reach the test), one OpenMP thread (2-core CI), never the network.
CHILD_ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}

# --------------------------------------------------------------------------- override lists of the tiny runs

# Every tiny training run: the tiny Qwen3-MoE on the offline synthetic data (experiment=tiny_smoke), no logger.
TINY_TRAIN = ("experiment=tiny_smoke", "logger=none")
# A learning rate at which the held-out loss visibly falls within a dozen steps.
FAST_LR = ("distill.optim.lr=2e-2", "distill.schedule.warmup_steps=2")
# The trainer tests' short real run (tests/test_trainer.py's SMALL): fresh run, fast lr, 2 eval batches, every step
# logged. `train_cfg` composes it.
FAST_TRAIN = (*TINY_TRAIN, "resume=never", *FAST_LR, "distill.eval.batches=2", "distill.log_every=1")


def train_steps(max_steps: int, *, save_every: int | None = None, eval_every: int | None = None,
                log_every: int | None = 1) -> list[str]:
    """distill.schedule.max_steps with a checkpoint and a held-out eval every `save_every` / `eval_every` steps
    (distill.checkpoint.every / distill.eval.every; default: at the last step only) and a metrics record every
    `log_every` steps (None: the config's default)."""
    out = [f"distill.schedule.max_steps={max_steps}", f"distill.eval.every={eval_every or max_steps}",
           f"distill.checkpoint.every={save_every or max_steps}"]
    return out + ([f"distill.log_every={log_every}"] if log_every is not None else [])


# --------------------------------------------------------------------------- composing a config


def compose_config(app: str, *overrides: str, **kwargs) -> DictConfig:
    """The config of `app` ("prune", "train", "eval", "plan": conf/<app>.yaml) with `overrides`, composed as the app's
    entry point composes it (the typed schemas registered). `kwargs` go to hydra's `compose`
    (e.g. return_hydra_config=True)."""
    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return compose(config_name=app, overrides=list(overrides), **kwargs)


def train_cfg(output_dir, *overrides: str) -> DictConfig:
    """The trainer tests' short real run (FAST_TRAIN) writing to `output_dir`, with `overrides` last."""
    return compose_config("train", *FAST_TRAIN, f"output_dir={output_dir}", *overrides)


# --------------------------------------------------------------------------- a checkout for the README's commands


def checkout_like(folder: Path, venv: bool = False) -> Path:
    """`folder` made to look like a clone to the README's commands, run from it: the package (which finds conf/ and
    the assets beside itself) and, with `venv`, the venv linked in, the repository's .gitignore, all committed to a
    git repository of its own, so that `untracked(folder)` lists whatever the commands leave outside git's ignores."""
    import subprocess

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "slimwise_train").symlink_to(REPO / "slimwise_train")
    if venv:
        (folder / ".venv").symlink_to(REPO / ".venv")
    (folder / ".gitignore").write_text((REPO / ".gitignore").read_text())
    git = ["git", "-c", "user.name=test", "-c", "user.email=test@example.invalid", "-c", "init.defaultBranch=main"]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "checkout"]):
        subprocess.run([*git, *args], cwd=folder, check=True, capture_output=True)
    return folder


def untracked(folder: Path) -> list[str]:
    """`git status --porcelain` of a `checkout_like` folder: what the commands left that git would show."""
    import subprocess

    out = subprocess.run(["git", "status", "--porcelain"], cwd=folder, check=True, capture_output=True, text=True)
    return out.stdout.splitlines()


def shell_without_venv() -> dict:
    """The environment of a fresh shell that has not activated the venv: this session's variables without the venv's
    bin folder on PATH or VIRTUAL_ENV, and no TORCH_EXTENSIONS_DIR (the Makefile's and the trainer's default are the
    same folder)."""
    import sys

    venv_bin = os.path.realpath(os.path.dirname(sys.executable))
    path = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p and os.path.realpath(p) != venv_bin]
    drop = {"VIRTUAL_ENV", "TORCH_EXTENSIONS_DIR", "PYTHONHOME"}
    return {**{k: v for k, v in CHILD_ENV.items() if k not in drop}, "PATH": os.pathsep.join(path),
            "WANDB_MODE": "disabled"}

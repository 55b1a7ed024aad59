"""Every file the apps write honours the umask (issue 24): a tiny prune + train + export + eval + lm_eval run under
umask 027, as a user runs them (the CLI, one process each), then one walk over every tree they wrote."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import CHILD_ENV

pytestmark = pytest.mark.subprocess  # each app runs as a CLI child
ENV = {**CHILD_ENV, "WANDB_MODE": "disabled"}
UMASK = 0o027


def run(args: list[str], cwd: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", *args], cwd=cwd, env=ENV, capture_output=True, text=True,
                          timeout=600, preexec_fn=lambda: os.umask(UMASK))
    assert proc.returncode == 0, (args[0], proc.stderr[-3000:])


@pytest.mark.slow
def test_every_file_of_a_prune_train_export_eval_lm_eval_run_honours_the_umask(tmp_path):
    from test_trust import save_checkpoint

    ckpt = save_checkpoint(tmp_path / "user-moe")  # the user's own folder: not checked
    work = tmp_path / "work"
    work.mkdir()
    small = ["data.num_samples=48", "data.batch_size=16", "data.seq_len=128", "progress=false"]
    prune_dir, train_dir = work / "prune", work / "train"
    run(["slimwise_train.prune", f"model.path={ckpt}", f"hydra.run.dir={prune_dir}", f"prune.cache_dir={work / 'cache'}",
         "prune.export_checkpoint=true", *small], cwd=work)
    keep = prune_dir / "keep_set.json"
    run(["slimwise_train", "experiment=tiny_smoke", f"model.path={ckpt}", "logger=none", f"prune.keep_set={keep}",
         f"output_dir={train_dir}", f"hydra.run.dir={train_dir}", "distill.schedule.max_steps=4",
         "distill.checkpoint.every=2", "distill.eval.every=2", "distill.eval.batches=1"], cwd=work)
    assert (train_dir / "export" / "config.json").is_file()
    run(["slimwise_train.eval", f"model.path={ckpt}", f"eval.keep_sets=[{keep}]", f"eval.student={train_dir}",
         "eval.num_per_family=2", "eval.budget=8", "eval.save_generations=true", f"hydra.run.dir={work / 'eval'}",
         "progress=false"], cwd=work)
    run(["slimwise_train.lm_eval", "--model", "slimwise", "--model_args",
         f"pretrained={ckpt},keep_set={keep},mode=slimwise", "--tasks", "slimwise_math", "--limit", "2",
         "--gen_kwargs", "max_gen_toks=8", "--output_path", str(work / "lm_eval"), "--log_samples"], cwd=work)

    checked, wrong = 0, []
    for path in work.rglob("*"):  # work itself is the test's own folder
        if path.is_symlink():
            continue
        mode = stat.S_IMODE(path.stat().st_mode)
        expected = (0o777 if path.is_dir() else 0o666) & ~UMASK
        if path.is_file() and mode & 0o111:
            expected |= 0o111 & ~UMASK  # an executable stays executable (none expected; named if any)
        checked += 1
        if mode != expected:
            wrong.append(f"{path.relative_to(work)} {oct(mode)}")
    assert not wrong, wrong
    names = {p.name for p in work.rglob("*")}
    # every stage's outputs were in the walk
    assert {"keep_set.json", "router_mask.safetensors", "scores.safetensors", "model.safetensors", "trainable.safetensors",
            "metrics.jsonl", "results.json", "report.md", "generations.jsonl", "slimwise_report.md"} <= names, names
    assert checked > 40

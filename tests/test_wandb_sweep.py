"""A Hydra multirun reads as one W&B experiment: every job of `python -m slimwise_train --multirun ...` shares one
group (the sweep), is named <criterion>-r<ratio>, carries the resolved config and ends with the summary a sweep
dashboard compares (held-out loss and its terms, trainable share, tokens seen, mean step time); an eval with the
same `logger.group` joins the group with accuracy and median / p90 length per mode.

The runs are offline (no network) and read back from their `.wandb` files: offline runs write no `files/`
summary or config, only the record log, a LevelDB-style log of `wandb.proto` records.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import compose_config

REPO = Path(__file__).resolve().parents[1]
# conftest / the Makefile default WANDB_MODE to disabled: these subprocesses must write real offline runs.
ENV = {**{k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}, "WANDB_MODE": "offline",
       "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
TRAIN_SUMMARY_KEYS = ("eval/loss", "eval/ce", "eval/kl", "trainable_share", "tokens_seen", "step_seconds_mean")

_BLOCK, _HEADER = 32768, 7  # wandb's record log: 32 KiB blocks, 7-byte chunk headers (crc32, length, kind)
_FULL, _LAST = 1, 4


def _records(path: Path):
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B record log"
    pos, chunks = _HEADER, []  # the file header (ident, magic, version) is 7 bytes too
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + _HEADER])
        if kind == 0:  # zero padding to the end of the block
            pos += left
            continue
        chunks.append(data[pos + _HEADER:pos + _HEADER + length])
        pos += _HEADER + length
        if kind in (_FULL, _LAST):
            record = pb.Record()
            record.ParseFromString(b"".join(chunks))
            chunks = []
            yield record


def read_offline_run(run_dir: Path) -> dict:
    """{id, name, group, job_type, config, summary} of one `wandb/offline-run-*` folder (last values win)."""
    (path,) = run_dir.glob("run-*.wandb")
    out = {"config": {}, "summary": {}}

    def items(updates, into):
        for item in updates:
            key = item.key or ".".join(item.nested_key)  # nested_key ["eval/loss"] is the flat key "eval/loss"
            into[key] = json.loads(item.value_json)

    for record in _records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
            out.update(id=run.run_id, name=run.display_name, group=run.run_group, job_type=run.job_type)
            items(run.config.update, out["config"])
        elif kind == "config":
            items(record.config.update, out["config"])
        elif kind == "summary":
            items(record.summary.update, out["summary"])
    return out


def _offline_run(output_dir: Path) -> dict:
    (run_dir,) = (output_dir / "wandb").glob("offline-run-*")
    return read_offline_run(run_dir)


@pytest.mark.subprocess
def test_a_multirun_is_one_wandb_group_with_named_runs_and_sweep_summaries(tmp_path):
    sweep = tmp_path / "sweep"
    proc = subprocess.run(
        [sys.executable, "-m", "slimwise_train", "--multirun", "prune.ratio=0.25,0.5", "logger=wandb",
         "logger.mode=offline", "experiment=tiny_smoke", "distill.schedule.max_steps=2", "distill.eval.batches=1",
         "distill.export=false", "data.num_samples=32", "progress=false", f"prune.cache_dir={tmp_path / 'cache'}",
         f"hydra.sweep.dir={sweep}"],
        cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    group = f"{tmp_path.name}/sweep"  # the sweep folder's last two parts
    runs = {}
    for ratio in ("0.25", "0.5"):
        out = sweep / f"reap-r{ratio}"
        run = runs[ratio] = _offline_run(out)
        assert (run["name"], run["group"], run["job_type"]) == (f"reap-r{ratio}", group, "train")
        # The resolved config travels with the run, the group and name included.
        config = run["config"]
        assert config["prune"]["ratio"] == float(ratio) and config["distill"]["schedule"]["max_steps"] == 2
        assert config["output_dir"] == str(out)
        assert config["logger"]["group"] == group and config["logger"]["run_name"] == f"reap-r{ratio}"
        # The end-of-run summary: the same numbers as summary.json, held-out loss = 0.1 CE + 0.9 KL.
        summary, local = run["summary"], json.loads((out / "summary.json").read_text())
        for key in TRAIN_SUMMARY_KEYS:
            assert summary[key] == local[key], key
        assert abs(summary["eval/loss"] - (0.1 * summary["eval/ce"] + 0.9 * summary["eval/kl"])) < 1e-9
        # the tiny Qwen3-MoE's default student trains rank-8 LoRA on its kept experts: ~21% of this tiny model
        # (test_trainer checks the share equals the student's own counts exactly)
        assert 0 < summary["trainable_share"] < 0.25 and summary["tokens_seen"] > 0
        assert summary["step_seconds_mean"] > 0 and summary["steps"] == 2
    assert runs["0.25"]["id"] != runs["0.5"]["id"]

    # An eval of one ratio joins the sweep's group under the keep set's name, with per-mode accuracy and lengths.
    keep_set = sweep / "reap-r0.5" / "keep_set.json"
    proc = subprocess.run(
        [sys.executable, "-m", "slimwise_train.eval", "logger=wandb", "logger.mode=offline", f"logger.group={group}",
         f"eval.keep_sets=[{keep_set}]", "eval.modes=[full,slimwise]", "eval.num_per_family=2", "eval.budget=8",
         "progress=false", f"hydra.run.dir={tmp_path / 'eval'}"],
        cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = _offline_run(tmp_path / "eval")
    assert (run["name"], run["group"], run["job_type"]) == ("reap-r0.5", group, "eval")
    for mode in ("full", "slimwise"):
        for metric in ("accuracy", "median_length", "p90_length"):
            assert isinstance(run["summary"][f"{metric}/{mode}"], (int, float)), (metric, mode)
            assert f"{metric}/{mode}/math" in run["summary"]


def test_sweep_group_names_a_multirun_and_leaves_a_single_run_ungrouped():
    from hydra.core.hydra_config import HydraConfig

    from slimwise_train.config import register_configs, sweep_group

    register_configs()
    assert sweep_group() is None  # composed outside an app: no Hydra run
    found = {}
    for mode, sweep_dir in (("RUN", "outputs/train/x"), ("MULTIRUN", "outputs/train/tiny_qwen3_moe"),
                            ("MULTIRUN", "/sweep"), ("MULTIRUN", "/scratch/me/lr-sweep-01")):
        cfg = compose_config("train", "logger=wandb", f"hydra.mode={mode}", f"hydra.sweep.dir={sweep_dir}",
                             return_hydra_config=True)
        HydraConfig.instance().set_config(cfg)
        try:
            found[(mode, sweep_dir)] = (sweep_group(), cfg.logger.group, cfg.logger.run_name)
        finally:
            HydraConfig.instance().cfg = None
    assert found == {("RUN", "outputs/train/x"): (None, None, "reap-r0.5"),
                     ("MULTIRUN", "outputs/train/tiny_qwen3_moe"): ("train/tiny_qwen3_moe",) * 2 + ("reap-r0.5",),
                     ("MULTIRUN", "/sweep"): ("sweep", "sweep", "reap-r0.5"),
                     ("MULTIRUN", "/scratch/me/lr-sweep-01"): ("me/lr-sweep-01",) * 2 + ("reap-r0.5",)}

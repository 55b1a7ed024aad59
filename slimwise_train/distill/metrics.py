"""Metric sinks, rank 0 only: logger=none (metrics.jsonl in the run folder) and logger=wandb (the same file, plus a
W&B run; offline when there is no WANDB_API_KEY, so it also works without network). Other ranks get a no-op sink.

The W&B run takes its name and group from the logger config (`logger.run_name`, default `<criterion>-r<ratio>` in
conf/train.yaml; `logger.group`, default the Hydra sweep in a multirun, see `slimwise_train.config.sweep_group`), so
the trainer needs no Hydra; its id is kept in the run folder (`wandb_run_id`), so a resumed run continues the same W&B
run and a fresh start in the same folder (resume=never) is a new one.

Named metrics.py, not logging.py, so it does not shadow the standard library inside the package.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from slimwise_train.config import wandb_mode
from slimwise_train.utils import distributed as du
from slimwise_train.utils.atomic import write_text_atomic

log = logging.getLogger("slimwise.train")


class NoopSink:
    def log(self, step: int, metrics: dict, histograms: dict | None = None) -> None:
        pass

    def summary(self, values: dict) -> None:
        pass

    def close(self) -> None:
        pass


class JsonlSink(NoopSink):
    """One JSON object per logged step in output_dir/metrics.jsonl.

    `resumed_step`: a run resumed from the checkpoint of that step keeps the records up to it and continues the file
    (the steps it replays are not logged twice); None starts the file afresh."""

    def __init__(self, output_dir: Path, resumed_step: int | None = None):
        self.path = Path(output_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if resumed_step is not None and self.path.is_file():
            for line in self.path.read_text().splitlines():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:  # a line cut by a kill
                    continue
                if int(record.get("step", 0)) <= resumed_step:
                    kept.append(line)
        write_text_atomic(self.path, "".join(line + "\n" for line in kept))
        self._file = open(self.path, "a", buffering=1)

    def log(self, step, metrics, histograms=None):
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        for name, values in (histograms or {}).items():
            record[name] = _histogram_summary(values)
        self._file.write(json.dumps(record) + "\n")

    def close(self):
        if self._file is not None:
            self._file.close()
            self._file = None


class WandbSink(JsonlSink):
    def __init__(self, output_dir: Path, logger_cfg, config: dict, resumed_step: int | None = None):
        super().__init__(output_dir, resumed_step)
        import wandb

        mode = wandb_mode(logger_cfg)
        self._wandb = wandb
        self.run = wandb.init(
            project=logger_cfg.project,
            entity=logger_cfg.entity,
            name=logger_cfg.run_name,
            group=logger_cfg.get("group"),
            job_type="train",
            tags=list(logger_cfg.tags or []),
            dir=str(output_dir),
            mode=mode,
            config=config,
            resume="allow",
            id=_run_id(output_dir, resuming=resumed_step is not None),
        )
        log.info("wandb: mode=%s group=%s name=%s dir=%s", mode, logger_cfg.get("group"), logger_cfg.run_name,
                 output_dir)

    def log(self, step, metrics, histograms=None):
        super().log(step, metrics, histograms)
        payload = {k: _plain(v) for k, v in metrics.items()}
        for name, values in (histograms or {}).items():
            if len(values):
                payload[name] = self._wandb.Histogram(list(values), num_bins=20)
        self.run.log(payload, step=step)

    def summary(self, values):
        for key, value in values.items():
            self.run.summary[key] = _plain(value)

    def close(self):
        super().close()
        if self.run is not None:
            self.run.finish()
            self.run = None


def build_sink(logger_cfg, output_dir: Path, config: dict, resumed_step: int | None = None):
    if not du.is_rank0():
        return NoopSink()
    if logger_cfg.name == "wandb":
        return WandbSink(output_dir, logger_cfg, config, resumed_step)
    return JsonlSink(output_dir, resumed_step)


RUN_ID_FILE = "wandb_run_id"


def _run_id(output_dir: Path, resuming: bool) -> str:
    """The W&B run id of this run, kept in `<output_dir>/wandb_run_id`: a resumed run appends to the W&B run it
    started, a run from step 0 gets a new id (it was the folder's path digest, so resume=never appended a second run
    to the first's W&B history). A folder from before the file, resumed: that path digest, the id it had."""
    import hashlib
    import os
    import time

    path = Path(output_dir) / RUN_ID_FILE
    if resuming and path.is_file() and path.read_text().strip():
        return path.read_text().strip()
    seed = str(Path(output_dir).resolve()) + ("" if resuming else f"|{time.time_ns()}|{os.getpid()}")
    run_id = hashlib.sha1(seed.encode()).hexdigest()[:12]
    write_text_atomic(path, run_id + "\n")
    return run_id


def _plain(value):
    if hasattr(value, "item"):
        return value.item()
    return value


def _histogram_summary(values) -> dict:
    values = sorted(float(v) for v in values)
    if not values:
        return {"count": 0}
    bins = [0] * 10
    for v in values:
        bins[min(9, max(0, int(v * 10)))] += 1
    return {"count": len(values), "min": values[0], "max": values[-1], "mean": sum(values) / len(values), "bins10": bins}

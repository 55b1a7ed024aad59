"""Faults a test injects into a training run: a non-finite loss, a SIGKILL after a step or inside a checkpoint write;
and into the prune app's layer-by-layer calibration: a SIGKILL after a layer (`+extra.kill_after_layer=1`).

The trainer calls three hooks (`distill/trainer.StepHooks`, which do nothing); `FaultHooks` fills them. A test
installs it in the process, or, for a run started as a command (torchrun tests), names it in the config:

    run_train(cfg, hooks=FaultHooks(nan_at_steps={2}))
    python -m slimwise_train ... +extra.kill_after_step=5            # extra.<field>: FaultHooks.from_config
"""

from __future__ import annotations

import dataclasses
import os
import signal
from dataclasses import dataclass, field


def kill_self(*_args) -> None:
    """Die as a preempted job does: SIGKILL, no cleanup, no exit handlers."""
    os.kill(os.getpid(), signal.SIGKILL)


@dataclass(frozen=True)
class FaultHooks:
    nan_at_steps: frozenset = field(default_factory=frozenset)  # 1-based steps whose loss is made NaN
    kill_after_step: int | None = None  # SIGKILL once this step (1-based) is done, its checkpoint included
    kill_in_checkpoint_at_step: int | None = None  # SIGKILL with that step's checkpoint written but unpublished
    # the prune app's layerwise calibration: SIGKILL once this decoder layer (0-based) is done, its resume point written
    kill_after_layer: int | None = None

    @classmethod
    def from_config(cls, extra) -> "FaultHooks":
        """From the config's `extra` mapping (`+extra.nan_at_steps=[2]`, ...); another key is a ValueError."""
        known = [f.name for f in dataclasses.fields(cls)]
        for key in extra:
            if key not in known:
                raise ValueError(f"unknown extra.{key}: the test faults are {', '.join(f'extra.{k}' for k in known)}")
        values = dict(extra)
        if "nan_at_steps" in values:
            values["nan_at_steps"] = frozenset(int(s) for s in values["nan_at_steps"] or ())
        return cls(**values)

    def loss(self, step: int, loss):
        """Step `step` is 0-based here: the loss of step step + 1 turns NaN (a loss that went non-finite)."""
        return loss * float("nan") if step + 1 in self.nan_at_steps else loss

    def before_checkpoint_publish(self, step: int):
        return kill_self if step == self.kill_in_checkpoint_at_step else None

    def after_step(self, step: int) -> None:
        if step == self.kill_after_step:
            kill_self()

    def after_layer(self, layer: int) -> None:
        if layer == self.kill_after_layer:
            kill_self()

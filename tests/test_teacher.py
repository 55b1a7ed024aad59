"""The shipped small teachers load with stock transformers and still perform as their training logs say.

`teacher` (the embedded default) meets the accuracy bar (>= 0.9 per family) on 200 held-out problems each (math 0.97,
code 0.92, tool 1.00; its training log). `teacher_lr_floor`, the previous default kept as the fidelity study's second
small teacher, logged math 0.89, code 0.92, tool 0.99 on the same 200. The test guards the shipped weights against
regressions on a 30-problem sample, with a margin for the smaller sample (binomial sd at p=0.5, n=30 is ~0.09).
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from slimwise_train.moe.adapters import get_adapter
from slimwise_train.data import synthetic
from slimwise_train.eval.generation import build_problems, greedy_accuracy
from slimwise_train.models import ASSETS

N = 30
# the default's log records its eval budgets (2x the longest reference per family); the older log predates the
# field, and its held-out problems (same suite, seed 0) and so its budgets are the same
BUDGETS = json.loads((ASSETS / "teacher" / "training_log.json").read_text())["budgets"]


@pytest.mark.parametrize("name", ["teacher", "teacher_lr_floor"])
def test_shipped_teacher_accuracy_matches_its_training_log(name):
    teacher = ASSETS / name
    log = json.loads((teacher / "training_log.json").read_text())
    if name == "teacher":  # the bar itself, on the log's full held-out evaluation (200 per family; ~+-2 points)
        assert log["final_eval_n"] >= 200
        assert all(r["accuracy"] >= 0.9 for r in log["final_eval"].values()), log["final_eval"]
    assert (teacher / "model.safetensors").stat().st_size < 30 * 2**20
    model = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(teacher)
    layers = get_adapter(model).moe_layers(model)
    assert len(layers) == 4 and layers[0].num_experts == 64 and layers[0].top_k == 4
    problems = build_problems(tok, synthetic.FAMILIES, N)  # the first 30 of the 200 the log was measured on
    result = greedy_accuracy(model, tok, problems, BUDGETS)
    accuracy = {family: r["accuracy"] for family, r in result.items()}
    for family, measured in accuracy.items():
        logged = log["final_eval"][family]["accuracy"]
        assert measured >= logged - 0.25, (family, measured, logged)
    assert accuracy["tool"] >= 0.9
    mean_logged = sum(log["final_eval"][f]["accuracy"] for f in accuracy) / len(accuracy)
    assert sum(accuracy.values()) / len(accuracy) >= mean_logged - 0.1  # 0.93 here vs 0.96 on the log's 200
    assert all(a > 0 for a in accuracy.values())  # an untrained or corrupted model scores 0 on every family

"""The eval app's serving modes, defined once: which phase (full or pruned experts) and which model (the full model
masked by a keep set, or the distilled student) runs the prefill and the decode. The eval app (generation), its
plots, and lm-eval's `slimwise` model (under the names in LM_EVAL_NAMES) all read them from here."""

from __future__ import annotations

from typing import get_args

from slimwise_train.config import EvalMode

MODES = get_args(EvalMode)  # eval.modes' choices, in report order: the Literal of the schema's EvalConfig.modes
# mode -> (prefill phase, decode phase) of the masked model (a plain model such as the student ignores phases).
MODE_PHASES = {
    "full": ("prefill", "prefill"),
    "conventional": ("decode", "decode"),
    "slimwise": ("prefill", "decode"),
    "reverse": ("decode", "prefill"),
    "conventional_distill": ("decode", "decode"),
    "slimwise_distill": ("prefill", "decode"),
}
# mode -> (prefill model, decode model): "model" = the full model (masked per keep set), "student" = eval.student.
# conventional_distill is the student alone, as a user serving the distilled checkpoint runs it (it is physically
# pruned, so no masking is involved): prefill and decode on its own KV cache.
MODE_MODELS = {mode: ("model", "model") for mode in MODES}
MODE_MODELS.update({"conventional_distill": ("student", "student"), "slimwise_distill": ("model", "student")})
MODE_DESCRIPTIONS = {
    "full": "full prefill, full decode",
    "conventional": "pruned prefill, pruned decode",
    "slimwise": "full prefill, pruned decode",
    "reverse": "pruned prefill, full decode",
    "conventional_distill": "distilled student prefill, distilled student decode (prune + distill, no full model)",
    "slimwise_distill": "full prefill, distilled student decode",
}


# lm-eval's `slimwise` model names a mode differently where it does (slimwise_train.lm_eval.model derives its modes
# and aliases from MODES and this table; the eval app's names are accepted there too).
LM_EVAL_NAMES = {"conventional_distill": "conventional_distilled", "slimwise_distill": "distilled"}

KEEP_SET_MODES = tuple(m for m in MODES if m != "full")  # every mode but full masks with a keep set
STUDENT_MODES = tuple(m for m in MODES if "student" in MODE_MODELS[m])  # the modes that run eval.student

"""Datasets and scoring of the packaged lm-eval tasks (slimwise_train/lm_eval/tasks/*.yaml).

The YAMLs point at the thin helper files beside them (lm-eval loads `!function` modules by file path), which
re-export these functions, so they are importable and tested here.

* slimwise_math / slimwise_code / slimwise_tool: the synthetic suite's held-out problems (the recipe's eval split
  first, exactly what `python -m slimwise_train.eval` evaluates), scored with the suite's own checker. The checker
  requires EOS, as the eval app does: the slimwise model's outputs say whether they ended (`GeneratedText.ended`);
  a plain string from another lm-eval model is taken as ended (it cannot say).
* slimwise_gsm8k / slimwise_math500 / slimwise_humaneval read the hub datasets; each has a `_local` variant that
  reads rows of the same schema from a file: `--metadata '{"data_files": "<rows.jsonl>"}'`.
* slimwise_humaneval RUNS THE GENERATED CODE (a subprocess per problem, `timeout` seconds, no sandbox beyond
  that): lm-eval refuses it without `--confirm_run_unsafe_code`.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

CODE_TIMEOUT_S = 10.0


# ----------------------------------------------------------------------------------------------- synthetic suite
def load_family(family: str, num_per_family: int = 200, seed: int | None = None, recipe: str | None = None,
                **_shared_metadata):
    """DatasetDict {"test": rows (family, prompt, answer)} of one family's held-out problems.

    lm-eval hands every task the run's whole metadata (incl. the model_args), so other keys are not ours."""
    import datasets

    from slimwise_train.eval.generation import heldout_examples

    rows = [{"family": family, "prompt": e.prompt, "answer": e.answer}
            for e in heldout_examples(family, int(num_per_family), seed, recipe)]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def synthetic_doc_to_text(doc: dict) -> str:
    from slimwise_train.data.synthetic import SEP

    return doc["prompt"] + SEP


def synthetic_doc_to_target(doc: dict) -> str:
    return doc["answer"]


def synthetic_process_results(doc: dict, results: list) -> dict:
    from slimwise_train.data.synthetic import check

    output = results[0]
    ended = getattr(output, "ended", True)
    return {"acc": float(check(doc["family"], doc["prompt"], str(output), ended=ended))}


# ----------------------------------------------------------------------------------------------- local files
def local_rows(data_files: str | dict | None = None, **_shared_metadata):
    """DatasetDict from a local file with the hub dataset's schema, for the `_local` task variants."""
    import datasets

    if not data_files:
        raise ValueError("a slimwise_*_local task reads a local file: pass --metadata "
                         "'{\"data_files\": \"<rows.jsonl>\"}' (rows with the hub dataset's fields)")
    files = {"test": data_files} if isinstance(data_files, str) else dict(data_files)
    for path in files.values():
        if not os.path.isfile(path):
            raise FileNotFoundError(f"--metadata data_files: {path} does not exist")
    kind = "parquet" if str(next(iter(files.values()))).endswith(".parquet") else "json"
    return datasets.load_dataset(kind, data_files=files)


# ----------------------------------------------------------------------------------------------- MATH-500
def math500_doc_to_text(doc: dict) -> str:
    return f"Problem:\n{doc['problem']}\n\nPut the final answer in \\boxed{{}}.\n\nSolution:"


def math500_process_results(doc: dict, results: list) -> dict:
    """1 when the last \\boxed{...} of the output equals the reference answer after lm-eval's hendrycks_math
    string normalisation (no symbolic equivalence: that needs lm-eval[math], which breaks Hydra)."""
    from lm_eval.tasks.hendrycks_math.utils import is_equiv, last_boxed_only_string, remove_boxed

    boxed = last_boxed_only_string(str(results[0]))
    answer = remove_boxed(boxed) if boxed else None
    return {"exact_match": int(answer is not None and is_equiv(answer, doc["answer"]))}


# ----------------------------------------------------------------------------------------------- HumanEval
def humaneval_program(doc: dict, completion: str) -> str:
    return f"{doc['prompt']}{completion}\n\n{doc['test']}\n\ncheck({doc['entry_point']})\n"


def run_python(program: str, timeout: float = CODE_TIMEOUT_S) -> bool:
    """True when `program` exits 0 within `timeout` seconds in a fresh interpreter (isolated mode, temp cwd)."""
    with tempfile.TemporaryDirectory() as cwd:
        try:
            proc = subprocess.run([sys.executable, "-I", "-c", program], cwd=cwd, capture_output=True,
                                  timeout=timeout, env={"PATH": os.environ.get("PATH", ""), "PYTHONHASHSEED": "0"})
        except subprocess.TimeoutExpired:
            return False
    return proc.returncode == 0


def humaneval_process_results(doc: dict, results: list) -> dict:
    """pass@1 of one greedy completion: prompt + completion + the problem's tests, executed."""
    return {"pass@1": float(run_python(humaneval_program(doc, str(results[0]))))}


# ----------------------------------------------------------------------------------------------- GSM8K
_GSM8K_NUMBER = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")


def gsm8k_reference(doc: dict) -> str:
    return doc["answer"].split("####")[-1].strip()


def gsm8k_process_results(doc: dict, results: list) -> dict:
    """1 when the last number in the output equals the reference after `####` (commas, $ and a final dot
    dropped): the stock task's flexible-extract rule."""
    found = _GSM8K_NUMBER.findall(str(results[0]))
    if not found:
        return {"exact_match": 0}
    last = [group for group in found[-1] if group][0]
    clean = lambda text: text.replace(",", "").replace("$", "").rstrip(".")  # noqa: E731
    return {"exact_match": int(clean(last) == clean(gsm8k_reference(doc)))}

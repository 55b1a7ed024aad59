"""The lm-eval `slimwise` model: the same numbers as `python -m slimwise_train.eval`, requests against per-request
loops, the packaged tasks (synthetic suite and the hub benchmarks' local variants), the CLI, data parallelism.

Model: the shipped teacher, a seeded random 50% keep set and a "distilled" student whose trainable tensors are
random (so distilled differs from slimwise). Budgets are capped at CAP tokens on both sides (--gen_kwargs
max_gen_toks / eval.budget) to keep the suite fast; the uncapped 200-problem comparison is `bench lm_eval`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from slimwise_train.eval.app import run_eval
from slimwise_train.eval.generation import build_problems, family_budgets, left_pad
from slimwise_train.moe.adapters import get_adapter
from slimwise_train.moe.handoff import continue_on_cache, prefill
from slimwise_train.moe.keepset import KeepSet

from helpers import compose_config

REPO = Path(__file__).resolve().parents[1]
TEACHER = REPO / "slimwise_train" / "assets" / "teacher"
PER_FAMILY = 30
CAP = 40
FAMILIES = ("math", "code", "tool")
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "disabled",
       "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}

lm_eval = pytest.importorskip("lm_eval")
from lm_eval.api.model import LM  # noqa: E402


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from slimwise_train.distill.export import export_student
    from slimwise_train.distill.student import DistillModel
    from slimwise_train.lm_eval.model import SlimwiseLM

    root = tmp_path_factory.mktemp("lm_eval")
    lm = SlimwiseLM(pretrained=str(TEACHER), mode="full", device="cpu", progress=False)
    model = lm.model
    layers = get_adapter(model).moe_layers(model)
    generator = torch.Generator().manual_seed(0)
    kept = [sorted(torch.randperm(m.num_experts, generator=generator)[: m.num_experts // 2].tolist()) for m in layers]
    keep = KeepSet.from_kept(layers, kept, model_type=model.config.model_type)
    keep.save(root / "keep" / "keep_set.json")
    student = DistillModel(model, keep)
    with torch.no_grad():
        for _, param in student.trainable_named_parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.02)
    export_student(student, root / "student", tokenizer=lm.tokenizer)
    student.remove_hooks()
    SlimwiseLM.instances.clear()
    return {"root": root, "keep": str(root / "keep" / "keep_set.json"), "student": str(root / "student")}


def _lm(assets, mode, **kwargs):
    from slimwise_train.lm_eval.model import SlimwiseLM

    extra = {"keep_set": assets["keep"]} if mode != "full" else {}
    if mode == "distilled":
        extra["student"] = assets["student"]
    return SlimwiseLM(pretrained=str(TEACHER), mode=mode, device="cpu", progress=False, **extra, **kwargs)


def _one(folder: Path, pattern: str) -> Path:
    """The one file of `folder` matching `pattern` (run names end in a digest of the keep set and student)."""
    (path,) = folder.glob(pattern)
    return path


class _Request:
    """What lm-eval hands a model: args, task_name, doc_id, idx."""

    def __init__(self, args, task_name="t", doc_id=0):
        self.args, self.task_name, self.doc_id, self.idx = args, task_name, doc_id, 0


# ------------------------------------------------------------------------------------ the tasks' budgets
def test_synthetic_task_budgets_are_the_eval_apps_default_for_200_problems():
    from slimwise_train.data.tokenizer import load_tokenizer
    from slimwise_train.lm_eval import TASKS_DIR, packaged_task_config

    tokenizer = load_tokenizer(TEACHER)
    budgets = family_budgets(build_problems(tokenizer, list(FAMILIES), 200))
    for family in FAMILIES:
        config = packaged_task_config(TASKS_DIR / f"slimwise_{family}.yaml")
        assert config["generation_kwargs"]["max_gen_toks"] == budgets[family], family


# ------------------------------------------------------------------------------------ equal to the eval app
@pytest.fixture(scope="module")
def both_tools(assets):
    from lm_eval.tasks import TaskManager

    from slimwise_train.lm_eval import TASKS_DIR, evaluate

    out = assets["root"] / "eval_app"
    cfg = compose_config("eval", f"output_dir={out}", "progress=false", "model=teacher",
                         f"eval.keep_sets=[{assets['keep']}]", f"eval.student={assets['student']}",
                         f"eval.num_per_family={PER_FAMILY}", f"eval.budget={CAP}")
    app = run_eval(cfg)
    manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False)
    lm_runs = {}
    for mode in ("full", "conventional", "slimwise", "reverse", "distilled"):
        lm = _lm(assets, mode)
        results = evaluate(lm, [f"slimwise_{f}" for f in FAMILIES], output_path=assets["root"] / "lm_eval",
                           limit=PER_FAMILY, gen_kwargs=f"max_gen_toks={CAP}", task_manager=manager)
        lm_runs[mode] = (lm, results)
        lm.masking and lm.masking.remove()
    return app, lm_runs


@pytest.mark.slow
def test_accuracy_and_lengths_equal_the_eval_app_for_every_mode_and_family(both_tools):
    app, lm_runs = both_tools
    app_mode = {"distilled": "slimwise_distill"}
    compared = 0
    for mode, (_, results) in lm_runs.items():
        lengths = results["slimwise_lengths"]
        for family in FAMILIES:
            (row,) = [r for r in app["rows"] if r["mode"] == app_mode.get(mode, mode) and r["family"] == family]
            ours = lengths[f"slimwise_{family}"]
            assert ours["n"] == row["n"] == PER_FAMILY
            assert results["results"][f"slimwise_{family}"]["acc,none"] == pytest.approx(row["accuracy"], abs=1e-12)
            for metric in ("accuracy", "median_length", "p90_length", "max_length", "hit_budget", "collapse",
                           "first_token_agreement_with_full"):
                assert ours[metric] == pytest.approx(row[metric], abs=1e-12), (mode, family, metric)
            compared += 1
    assert compared == 15
    # the modes differ somewhere (a test that cannot fail would pass with five copies of one mode)
    medians = {mode: tuple(r["slimwise_lengths"][f"slimwise_{f}"]["median_length"] for f in FAMILIES)
               for mode, (_, r) in lm_runs.items()}
    assert len(set(medians.values())) >= 3, medians


@pytest.mark.slow
def test_per_request_lengths_and_the_report(both_tools, assets):
    from slimwise_train.lm_eval.lengths import REPORT_NAME

    app, lm_runs = both_tools
    folder = assets["root"] / "lm_eval"
    records = [json.loads(x) for x in _one(folder, "slimwise_lengths_slimwise_keep-*.jsonl").read_text().splitlines()]
    assert len(records) == 3 * PER_FAMILY
    assert {r["end_reason"] for r in records} <= {"eos", "budget"}  # the suite's tasks have no stop strings
    (app_run,) = [r for r in app["runs"] if r["mode"] == "slimwise"]
    by_family = {f: [r for r in records if r["task"] == f"slimwise_{f}"] for f in FAMILIES}
    app_lengths = {f: [n for n, p in zip(app_run["length"], app["problems"]) if p["family"] == f] for f in FAMILIES}
    for family in FAMILIES:
        assert [r["num_tokens"] for r in sorted(by_family[family], key=lambda r: r["doc_id"])] == app_lengths[family]
    report = (folder / REPORT_NAME).read_text()
    for mode in ("| full |", "| conventional |", "| slimwise |", "| reverse |", "| distilled |"):
        assert mode in report
    assert (folder / "slimwise_lengths_keep.png").stat().st_size > 10_000


# ------------------------------------------------------------------------------------ against per-request loops
def _reference_generate(lm, context, until, budget):
    """One request alone: prefill pool over the prompt, then one token at a time from the decode pool."""
    prefill_phase, decode_phase = lm.phases
    ids = torch.tensor([lm.tok_encode(context)])
    with torch.no_grad():
        logits, cache = prefill(lm.model, ids, phase=prefill_phase)
        tokens = [int(logits[0, -1].argmax())]
        while True:
            text = lm.tokenizer.decode(tokens, skip_special_tokens=False)
            if tokens[-1] in lm.eos:
                return lm.tokenizer.decode(tokens[:-1]), len(tokens), "eos"
            if any(s in text for s in until):
                return text.split(next(s for s in until if s in text), 1)[0], len(tokens), "stop"
            if len(tokens) == budget:
                return text, len(tokens), "budget"
            logits, cache = continue_on_cache(lm.decoder, cache, torch.tensor([[tokens[-1]]]), phase=decode_phase)
            tokens.append(int(logits[0, -1].argmax()))


@pytest.mark.parametrize("mode", ["conventional", "slimwise", "reverse", "distilled"])
def test_generate_until_equals_a_per_request_loop_with_stop_strings(assets, mode):
    from slimwise_train.data import synthetic

    lm = _lm(assets, mode, batch_size=4)
    problems = [p for f in FAMILIES for p in synthetic.heldout(f, 3, 7)]
    # stop strings that do occur in answers (digits, a JSON quote, "(") and one that never does
    requests = [_Request((p.prompt + synthetic.SEP, {"until": [stop], "max_gen_toks": 24}), doc_id=i)
                for i, (p, stop) in enumerate(zip(problems, ["1", "2", "\"", "(", "zzz"] * 2))]
    texts = lm.generate_until(requests)
    reasons = []
    for req, text, record in zip(requests, texts, sorted(lm.records, key=lambda r: r["doc_id"])):
        context, kwargs = req.args
        expected, n, reason = _reference_generate(lm, context, kwargs["until"], kwargs["max_gen_toks"])
        assert (str(text), text.num_tokens, text.end_reason) == (expected, n, reason)
        assert (record["num_tokens"], record["end_reason"]) == (n, reason)
        assert text.ended == (reason == "eos")
        reasons.append(reason)
    assert "stop" in reasons and len(set(reasons)) >= 2, reasons
    lm.masking.remove()


def _reference_loglikelihood(lm, context_ids, continuation_ids):
    prefill_phase, decode_phase = lm.phases
    with torch.no_grad():
        logits, cache = prefill(lm.model, torch.tensor([context_ids]), phase=prefill_phase)
        total, greedy, last = 0.0, True, logits[0, -1]
        for k, token in enumerate(continuation_ids):
            logprobs = torch.log_softmax(last.double(), -1)
            total += float(logprobs[token])
            greedy &= int(last.argmax()) == token
            if k + 1 < len(continuation_ids):
                logits, cache = continue_on_cache(lm.decoder, cache, torch.tensor([[token]]), phase=decode_phase)
                last = logits[0, -1]
    return total, greedy


@pytest.mark.parametrize("mode", ["full", "conventional", "slimwise", "reverse", "distilled"])
def test_loglikelihood_and_rolling_equal_a_per_request_loop(assets, mode):
    from slimwise_train.data import synthetic

    lm = _lm(assets, mode, batch_size=3)
    pairs = []
    for family in FAMILIES:
        for example in synthetic.heldout(family, 2, 3):
            # The context ends inside the answer: lm-eval moves a context's trailing whitespace (the suite's SEP)
            # into the continuation, and the teacher never learnt to predict SEP itself.
            prompt, answer = synthetic.to_text(example)
            cut = max(1, len(answer) // 3)
            pairs += [(prompt + answer[:cut], answer[cut:] or "x"),
                      (prompt + answer[:cut], answer[cut:][::-1] or "x")]
    scores = lm.loglikelihood([_Request(pair) for pair in pairs])
    assert len({round(s[0], 3) for s in scores}) > 3
    for (context, continuation), (logprob, greedy) in zip(pairs, scores):
        context_ids, continuation_ids = lm._encode_pair(context, continuation)
        ref_logprob, ref_greedy = _reference_loglikelihood(lm, context_ids, continuation_ids)
        assert logprob == pytest.approx(ref_logprob, abs=2e-4, rel=1e-5)  # float32 batched vs float64 one by one
        assert greedy == ref_greedy
    if mode == "full":
        assert any(greedy for _, greedy in scores)  # the teacher predicts some answers exactly
    # rolling: lm-eval's disjoint windows; with max_length 16 a text spans several windows
    text = pairs[0][0] + pairs[0][1]
    lm._max_length = 16
    (total,) = lm.loglikelihood_rolling([_Request((text,))])
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    windows = map(make_disjoint_window, get_rolling_token_windows(
        token_list=lm.tok_encode(text, add_special_tokens=False), prefix_token=lm.prefix_token_id,
        max_seq_len=16, context_len=1))
    reference = sum(_reference_loglikelihood(lm, c, t)[0] for c, t in windows)
    assert total == pytest.approx(reference, abs=5e-4)
    if lm.masking is not None:
        lm.masking.remove()


# ------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("kwargs, message", [
    ({"mode": "slimwise"}, "mode=slimwise needs keep_set"),
    ({"mode": "sideways"}, "mode='sideways' is unknown"),
    ({"mode": "full", "batch_size": "auto"}, "automatic batch sizes are not supported"),
    ({"mode": "full", "temperature_": 1}, "unknown slimwise model_args ['temperature_']"),
    ({"mode": "slimwise", "keep_set": "/nonexistent/keep_set.json"}, "keep_set=/nonexistent"),
    ({"mode": "full", "device": "cuda:0"}, "no CUDA device"),
])
def test_bad_model_args_are_one_clear_error(kwargs, message):
    from slimwise_train.lm_eval.model import SlimwiseLM

    if "cuda" in str(kwargs.get("device")) and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises((ValueError, FileNotFoundError)) as info:
        SlimwiseLM(pretrained=str(TEACHER), progress=False, **kwargs)
    assert message in str(info.value)


def test_a_missing_keep_set_or_student_is_named_by_its_model_arg_before_the_model_loads(tmp_path, monkeypatch):
    import slimwise_train.models as models
    from slimwise_train.lm_eval.model import SlimwiseLM
    from slimwise_train.moe.keepset import LayerKeep

    def refuse(*_args, **_kwargs):
        raise AssertionError("the model loaded before the missing file was named")

    monkeypatch.setattr(models, "load_model", refuse)
    with pytest.raises(FileNotFoundError, match=f"^keep_set={tmp_path / 'missing.json'}: no such file"):
        SlimwiseLM(pretrained=str(TEACHER), mode="slimwise", keep_set=str(tmp_path / "missing.json"), device="cpu")
    text = models.load_config(compose_config("eval", "model=teacher", "output_dir=/tmp/x").model)
    keep = tmp_path / "keep_set.json"
    KeepSet(tuple(LayerKeep(i, text.num_experts, text.num_experts_per_tok, tuple(range(text.num_experts // 2)))
                  for i in range(text.num_hidden_layers)), text.model_type).save(keep)
    with pytest.raises(FileNotFoundError, match=f"^student={tmp_path / 'nowhere'} is not a checkpoint folder"):
        SlimwiseLM(pretrained=str(TEACHER), mode="distilled", keep_set=str(keep), student=str(tmp_path / "nowhere"),
                   device="cpu")


def test_sampling_generation_kwargs_are_refused(assets):
    lm = _lm(assets, "full")
    with pytest.raises(ValueError, match="decodes greedily"):
        lm.generate_until([_Request(("1+1=", {"until": [], "do_sample": True}))])
    with pytest.raises(ValueError, match="not supported"):
        lm.generate_until([_Request(("1+1=", {"until": [], "repetition_penalty": 1.2}))])


# ------------------------------------------------------------------------------------ hub tasks, local variants
def _hub_rows(folder: Path) -> dict[str, Path]:
    rows = {
        "gsm8k": [{"question": "Tom has 3 apples and buys 4 more. How many apples?",
                   "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
                  {"question": "A box holds 1,200 pens; 200 are sold. How many are left?",
                   "answer": "1200 - 200 = 1000\n#### 1,000"}],
        "math500": [{"problem": "What is $1+1$?", "solution": "$1+1=\\boxed{2}$", "answer": "2",
                     "subject": "Prealgebra", "level": 1, "unique_id": "test/prealgebra/1.json"},
                    {"problem": "Simplify $\\frac{2}{4}$.", "solution": "$\\boxed{\\frac{1}{2}}$",
                     "answer": "\\frac{1}{2}", "subject": "Prealgebra", "level": 1, "unique_id": "test/prealgebra/2.json"}],
        "humaneval": [{"task_id": "HumanEval/0", "prompt": "def add(a, b):\n    \"\"\"Sum of a and b.\"\"\"\n",
                       "canonical_solution": "    return a + b\n",
                       "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n", "entry_point": "add"},
                      {"task_id": "HumanEval/1", "prompt": "def neg(a):\n", "canonical_solution": "    return -a\n",
                       "test": "def check(candidate):\n    assert candidate(2) == -2\n", "entry_point": "neg"}],
    }
    paths = {}
    for name, items in rows.items():
        paths[name] = folder / f"{name}.jsonl"
        paths[name].write_text("".join(json.dumps(r) + "\n" for r in items))
    return paths


class _Oracle(LM):
    """Answers each request with a fixed text (the reference, or a wrong one) to test the tasks' scoring."""

    def __init__(self, answers):
        super().__init__()
        self.answers = answers

    def generate_until(self, requests, disable_tqdm=False):
        return [self.answers(req.doc) for req in requests]

    def loglikelihood(self, requests, disable_tqdm=False):
        raise NotImplementedError

    def loglikelihood_rolling(self, requests, disable_tqdm=False):
        raise NotImplementedError


ORACLE = {
    "gsm8k": lambda doc: "So the answer is " + doc["answer"].split("####")[-1].strip() + ".",
    "math500": lambda doc: "The answer is $\\boxed{" + doc["answer"] + "}$.",
    "humaneval": lambda doc: doc["canonical_solution"],
}
WRONG = {"gsm8k": lambda doc: "So the answer is 12345.", "math500": lambda doc: "$\\boxed{99}$",
         "humaneval": lambda doc: "    return None\n"}


@pytest.mark.parametrize("task", ["gsm8k", "math500", "humaneval"])
def test_hub_benchmarks_local_variants_score_references_right_and_wrong_answers_wrong(tmp_path, task):
    from slimwise_train.lm_eval import task_manager

    paths = _hub_rows(tmp_path)
    metadata = {"data_files": str(paths[task])}
    for answers, expected in ((ORACLE[task], 1.0), (WRONG[task], 0.0)):
        results = lm_eval.simple_evaluate(model=_Oracle(answers), tasks=[f"slimwise_{task}_local"],
                                          task_manager=task_manager(include_defaults=False, metadata=metadata),
                                          metadata=metadata, confirm_run_unsafe_code=True)
        (value,) = [v for k, v in results["results"][f"slimwise_{task}_local"].items()
                    if "," in k and "stderr" not in k]
        assert value == expected, (task, answers)


def test_humaneval_needs_the_unsafe_code_confirmation(tmp_path):
    from slimwise_train.lm_eval import task_manager

    metadata = {"data_files": str(_hub_rows(tmp_path)["humaneval"])}
    with pytest.raises(ValueError, match="unsafe"):
        lm_eval.simple_evaluate(model=_Oracle(ORACLE["humaneval"]), tasks=["slimwise_humaneval_local"],
                                task_manager=task_manager(include_defaults=False, metadata=metadata),
                                metadata=metadata)


def test_local_variant_without_data_files_says_how_to_pass_them():
    from slimwise_train.lm_eval import task_manager

    with pytest.raises(ValueError, match="data_files"):
        lm_eval.simple_evaluate(model=_Oracle(ORACLE["gsm8k"]), tasks=["slimwise_gsm8k_local"],
                                task_manager=task_manager(include_defaults=False))


def test_hub_variants_point_at_the_hub_datasets():
    from slimwise_train.lm_eval import TASKS_DIR, packaged_task_config

    expected = {"gsm8k": "openai/gsm8k", "math500": "HuggingFaceH4/MATH-500", "humaneval": "openai/openai_humaneval"}
    for task, dataset in expected.items():
        config = packaged_task_config(TASKS_DIR / f"slimwise_{task}.yaml")
        assert config["dataset_path"] == dataset and "custom_dataset" not in config


# ------------------------------------------------------------------------------------ CLI, Hydra, data parallel
def _cli(args, tmp_path, launcher=(sys.executable, "-m")):
    return subprocess.run([*launcher, "slimwise_train.lm_eval", *args], cwd=tmp_path, env=ENV, capture_output=True,
                          text=True, timeout=900)


@pytest.mark.slow
@pytest.mark.subprocess
def test_cli_runs_offline_and_writes_lengths_beside_lm_evals_results(assets, tmp_path):
    out = tmp_path / "out"
    proc = _cli(["--model", "slimwise", "--model_args",
                 f"pretrained={TEACHER},keep_set={assets['keep']},mode=slimwise,progress=false",
                 "--tasks", "slimwise_math,slimwise_code,slimwise_tool", "--limit", "3", "--gen_kwargs",
                 "max_gen_toks=12", "--output_path", str(out), "--log_samples"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (results_file,) = out.rglob("results_*.json")
    folder = results_file.parent
    records = [json.loads(x) for x in _one(folder, "slimwise_lengths_slimwise_keep-*.jsonl").read_text().splitlines()]
    assert len(records) == 9 and all(r["budget"] == 12 and r["reference_tokens"] for r in records)
    summary = json.loads(_one(folder, "slimwise_summary_slimwise_keep-*.json").read_text())
    results = json.loads(results_file.read_text())["results"]
    for family in FAMILIES:
        assert summary["tasks"][f"slimwise_{family}"]["accuracy"] == results[f"slimwise_{family}"]["acc,none"]
    assert "| slimwise |" in (folder / "slimwise_report.md").read_text()


@pytest.mark.subprocess
def test_accuracy_is_the_tasks_declared_metric_with_and_without_log_samples(tmp_path):
    # Without --log_samples the summary takes lm-eval's aggregate; it once took the first number of the task's results,
    # lm-eval's `sample_len` (2 documents at --limit 2), as the accuracy.
    for flags in ([], ["--log_samples"]):
        out = tmp_path / f"out{len(flags)}"
        proc = _cli(["--model", "slimwise", "--model_args", f"pretrained={TEACHER},mode=full,progress=false",
                     "--tasks", "slimwise_math", "--limit", "2", "--gen_kwargs", "max_gen_toks=4", "--output_path",
                     str(out), *flags], tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        (results_file,) = out.rglob("results_*.json")
        results = json.loads(results_file.read_text())["results"]["slimwise_math"]
        assert results["sample_len"] == 2
        row = json.loads(next(out.rglob("slimwise_summary_full.json")).read_text())["tasks"]["slimwise_math"]
        assert row["accuracy"] == results["acc,none"], (flags, row)
        assert row.get("accuracy_metric", "acc") == "acc"
        assert f"| full | {results['acc,none']:.2f} /" in next(out.rglob("slimwise_report.md")).read_text()


@pytest.mark.subprocess
def test_two_keep_sets_whose_paths_end_alike_keep_their_own_outputs(tmp_path):
    # .../a/r0.5 and .../b/r0.5 into one --output_path: each run's lengths and summary stay (they overwrote each other)
    from slimwise_train.models import load_config
    from slimwise_train.moe.keepset import LayerKeep

    text = load_config(compose_config("eval", "model=teacher", "output_dir=/tmp/x").model)
    keep_sets = {}
    for name, kept in (("a", range(0, text.num_experts, 2)), ("b", range(1, text.num_experts, 2))):
        layers = tuple(LayerKeep(i, text.num_experts, text.num_experts_per_tok, tuple(kept))
                       for i in range(text.num_hidden_layers))
        keep_sets[name] = tmp_path / name / "r0.5" / "keep_set.json"
        KeepSet(layers, text.model_type).save(keep_sets[name])
    out = tmp_path / "out"
    for name, keep in keep_sets.items():
        proc = _cli(["--model", "slimwise", "--model_args", f"pretrained={TEACHER},keep_set={keep},mode=slimwise,"
                     "progress=false", "--tasks", "slimwise_math", "--limit", "1", "--gen_kwargs", "max_gen_toks=2",
                     "--output_path", str(out)], tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
    (folder,) = {p.parent for p in out.rglob("results_*.json")}
    summaries = [json.loads(p.read_text()) for p in folder.glob("slimwise_summary_slimwise_r0.5-*.json")]
    assert sorted(s["keep_set"] for s in summaries) == sorted(str(k) for k in keep_sets.values())
    assert len(list(folder.glob("slimwise_lengths_slimwise_r0.5-*.jsonl"))) == 2
    assert len({s["run"] for s in summaries}) == 2


@pytest.mark.subprocess
def test_ctrl_c_is_one_line_and_exit_130(tmp_path):
    from helpers import ctrl_c_when

    returncode, output = ctrl_c_when([sys.executable, "-m", "slimwise_train.lm_eval", "--model", "slimwise",
                                      "--model_args", f"pretrained={TEACHER},mode=full,progress=false", "--tasks",
                                      "slimwise_math", "--output_path", str(tmp_path / "out")],
                                     "Running generate_until requests", cwd=tmp_path, env=ENV)
    assert returncode == 130 and "Traceback" not in output, output[-3000:]
    assert output.strip().splitlines()[-1].startswith("slimwise_train.lm_eval: interrupted (Ctrl-C): no results")
    assert not (tmp_path / "out").exists()


def test_primary_metric_is_the_first_declared_one_under_its_first_filter():
    from slimwise_train.lm_eval.lengths import per_sample, primary_metric

    # gsm8k-like: two filters, a bookkeeping count first, metric_list naming exact_match
    results = {"results": {"t": {"alias": "t", "sample_len": 5, "exact_match,strict-match": 0.2,
                                 "exact_match_stderr,strict-match": 0.1, "exact_match,flexible-extract": 0.4}},
               "configs": {"t": {"metric_list": [{"metric": "exact_match", "higher_is_better": True}]}},
               "higher_is_better": {"t": {"exact_match": True}}}
    assert primary_metric(results, "t") == ("exact_match", "strict-match", 0.2)
    del results["configs"]  # older results without configs: higher_is_better names the metric
    assert primary_metric(results, "t") == ("exact_match", "strict-match", 0.2)
    del results["higher_is_better"]  # nothing declared: no accuracy rather than a count
    assert primary_metric(results, "t") is None
    samples = [{"doc_id": 0, "filter": "strict-match", "exact_match": 0.0, "bookkeeping": 1, "target": ""},
               {"doc_id": 0, "filter": "flexible-extract", "exact_match": 1.0, "target": ""}]
    assert per_sample(samples, None, "exact_match", "strict-match") == {0: {"correct": False, "reference_tokens": None}}
    assert per_sample(samples, None, "exact_match", "flexible-extract")[0]["correct"] is True


@pytest.mark.subprocess
def test_cli_bad_model_args_is_one_line_with_exit_code_2(tmp_path):
    proc = _cli(["--model", "slimwise", "--model_args", f"pretrained={TEACHER},mode=slimwise",
                 "--tasks", "slimwise_math", "--limit", "1"], tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == ("slimwise_train.lm_eval: error: mode=slimwise needs "
                                                     "keep_set=<keep_set.json> (from python -m slimwise_train.prune)")


def test_hydra_configs_still_compose_after_lm_eval_is_installed_and_imported():
    import antlr4  # noqa: F401  lm-eval[math] would pull antlr4 4.11, which omegaconf/hydra reject
    from importlib.metadata import version

    import slimwise_train.lm_eval  # noqa: F401

    assert version("antlr4-python3-runtime").startswith("4.9."), version("antlr4-python3-runtime")
    for name in ("train", "prune", "eval"):
        cfg = compose_config(name, *(["output_dir=/tmp/x"] if name != "train" else []))
        assert cfg.model.name


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.subprocess
def test_two_process_data_parallel_equals_one_process(assets, tmp_path):
    common = ["--model", "slimwise", "--model_args",
              f"pretrained={TEACHER},keep_set={assets['keep']},mode=slimwise,progress=false",
              "--tasks", "slimwise_math,slimwise_tool", "--limit", "5", "--gen_kwargs", "max_gen_toks=16",
              "--log_samples", "--device", "cpu"]
    one = _cli([*common, "--output_path", str(tmp_path / "one")], tmp_path)
    assert one.returncode == 0, one.stderr[-3000:]
    two = _cli([*common, "--output_path", str(tmp_path / "two")], tmp_path,
               launcher=(sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                         "--master_port", "29581", "-m"))
    assert two.returncode == 0, two.stderr[-3000:]

    def read(name):
        (folder,) = {p.parent for p in (tmp_path / name).rglob("results_*.json")}
        records = sorted((json.loads(x) for x in _one(folder, "slimwise_lengths_slimwise_keep-*.jsonl").read_text()
                          .splitlines()), key=lambda r: (r["task"], r["doc_id"]))
        summary = json.loads(_one(folder, "slimwise_summary_slimwise_keep-*.json").read_text())
        return records, summary

    (rec1, sum1), (rec2, sum2) = read("one"), read("two")
    assert sum2["world_size"] == 2 and sum1["world_size"] == 1
    strip = lambda rs: [{k: v for k, v in r.items()} for r in rs]  # noqa: E731
    assert strip(rec1) == strip(rec2) and len(rec1) == 10
    assert sum1["tasks"] == sum2["tasks"]


@pytest.mark.subprocess
def test_lengths_go_to_a_wandb_run_in_lm_evals_project_and_group(tmp_path):
    from test_wandb_sweep import read_offline_run

    row = {"n": 3, "accuracy": 0.5, "median_length": 12.0, "p90_length": 20.0, "max_length": 21, "hit_budget": 0.25,
           "collapse": 0.0, "first_token_agreement_with_full": 1.0}
    summary = {"run": "slimwise_keep", "mode": "slimwise", "model": "m", "keep_set": "k/keep_set.json",
               "student": None, "keep_fraction": 0.5, "tasks": {"slimwise_math": row}}
    # in a child process: its exit flushes the offline record log before it is read back
    code = ("import json, sys; from slimwise_train.lm_eval.__main__ import log_lengths_to_wandb; "
            "log_lengths_to_wandb(sys.argv[1], json.loads(sys.argv[2]))")
    proc = subprocess.run([sys.executable, "-c", code, "project=slimwise-test,group=g1,name=nightly",
                           json.dumps(summary)], env={**ENV, "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path)},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    run = read_offline_run(run_dir)
    assert (run["group"], run["name"], run["job_type"]) == ("g1", "nightly-lengths", "slimwise-lengths")
    assert run["summary"]["median_length/slimwise/slimwise_math"] == 12.0
    summary_keys = run["summary"]
    assert summary_keys["slimwise/lengths._type"] == "table-file" and summary_keys["slimwise/lengths.nrows"] == 1
    assert run["config"]["mode"] == "slimwise"


def test_lm_evals_own_task_index_is_skipped_only_when_every_task_is_packaged():
    from slimwise_train.lm_eval import TASKS_DIR
    from slimwise_train.lm_eval.__main__ import only_packaged_tasks, with_defaults

    ours = with_defaults(["--model", "slimwise", "--tasks", "slimwise_math,slimwise_synthetic,slimwise_gsm8k_local"])
    assert only_packaged_tasks(ours)
    assert not only_packaged_tasks(with_defaults(["--tasks", "slimwise_math,gsm8k"]))  # a stock task needs the index
    assert not only_packaged_tasks(with_defaults(["--tasks", "slimwise_math", "--include_path", "/my/tasks"]))
    assert ours[ours.index("--include_path") + 1] == str(TASKS_DIR) and ours[ours.index("--device") + 1] == "auto"


@pytest.mark.slow
@pytest.mark.subprocess  # runs the lm_eval CLI (bench/lm_eval.py)
def test_bench_lm_eval_compares_all_three_routes_cell_by_cell(assets, tmp_path, capsys):
    from slimwise_train.bench import main

    assert main(["lm_eval", "--teacher", str(TEACHER), "--keep-set", assets["keep"], "--student", assets["student"],
                 "--num-per-family", "2", "--output-dir", str(tmp_path / "bench")]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["bench"] == "lm_eval" and result["equal"] and not result["mismatches"]
    assert len(result["cells"]) == 15
    assert all({"eval_app", "lm_eval_cli", "lm_eval_python"} <= set(cell) for cell in result["cells"].values())
    assert result["wall_ratio_python"] > 0 and result["wall_ratio_cli"] > 0


def test_bench_lm_eval_says_how_to_get_its_inputs(tmp_path):
    from slimwise_train.bench import main

    with pytest.raises(SystemExit, match="run `make demo` first"):
        main(["lm_eval", "--keep-set", str(tmp_path / "missing.json"), "--output-dir", str(tmp_path)])


@pytest.mark.subprocess
def test_the_stock_lm_eval_models_stay_available_beside_slimwise():
    """Issue 24 item 16: lm-eval 0.4.13 imports its own models only while its registry is empty, so registering
    `slimwise` first hid `hf` from `python -m slimwise_train.lm_eval --model hf` (the stock comparison)."""
    import subprocess
    import sys

    code = ("import slimwise_train.lm_eval.model\nfrom lm_eval.api.registry import get_model\n"
            "print(get_model('hf').__name__, get_model('slimwise').__name__)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["HFLM", "SlimwiseLM"]


# ------------------------------------------------------------------------------------ conventional_distilled (issue 23)
def _conventional_distilled(assets, mode="conventional_distilled", **kwargs):
    from slimwise_train.lm_eval.model import SlimwiseLM

    return SlimwiseLM(pretrained=str(TEACHER), mode=mode, keep_set=assets["keep"], student=assets["student"],
                      device="cpu", progress=False, **kwargs)


def test_conventional_distilled_generations_equal_the_eval_apps_conventional_distill(assets):
    from slimwise_train.data import synthetic
    from slimwise_train.eval.generation import evaluate, load_student

    lm = _conventional_distilled(assets, mode="conventional_distill", batch_size=2)  # the eval app's name
    assert lm.mode == "conventional_distilled" and lm.prefiller is lm.student and lm.decoder is lm.student
    full = _lm(assets, "full")  # the eval app wants the full model without masking
    problems = build_problems(full.tokenizer, list(FAMILIES), 2)
    budget = 24
    app = evaluate(full.model, full.tokenizer, {"keep": KeepSet.load(assets["keep"])}, ["conventional_distill"],
                   problems, budget, 2, student=load_student(assets["student"], full.model))
    (run,) = app["runs"]
    # one batch of two per family on both sides (same padding): the same tokens
    requests = [_Request((p.prompt + synthetic.SEP, {"until": [], "max_gen_toks": budget}),
                         task_name=f"slimwise_{p.family}", doc_id=i) for i, p in enumerate(problems)]
    texts = lm.generate_until(requests)
    assert [str(t) for t in texts] == run["text"]
    assert [t.num_tokens for t in texts] == run["length"]
    assert [t.ended for t in texts] == run["ended"]
    records = sorted(lm.records, key=lambda r: r["doc_id"])
    assert [r["first_token"] for r in records] == run["first_token"]
    assert [r["first_token_agrees"] for r in records] == run["first_token_agrees"]
    # not the distilled mode under another name: the student's own prefill changes outputs
    distilled = _lm(assets, "distilled", batch_size=2)
    assert [str(t) for t in distilled.generate_until(requests)] != run["text"]
    distilled.masking.remove()
    assert lm.describe()["mode_description"].startswith("distilled student prefill")
    lm.masking.remove()


def test_conventional_distilled_loglikelihood_is_the_student_alone(assets):
    from slimwise_train.data import synthetic

    lm = _conventional_distilled(assets, batch_size=3)
    pairs = []
    for family in FAMILIES:
        prompt, answer = synthetic.to_text(synthetic.heldout(family, 1, 3)[0])
        cut = max(1, len(answer) // 3)
        pairs.append((prompt + answer[:cut], answer[cut:] or "x"))
    scores = lm.loglikelihood([_Request(pair) for pair in pairs])
    distilled = _lm(assets, "distilled", batch_size=3).loglikelihood([_Request(pair) for pair in pairs])
    for (context, continuation), (logprob, greedy), (other, _) in zip(pairs, scores, distilled):
        context_ids, continuation_ids = lm._encode_pair(context, continuation)
        # by hand: one forward of the student over context + continuation, no cache, no full model
        with torch.no_grad():
            logits = lm.student(input_ids=torch.tensor([context_ids + continuation_ids[:-1]])).logits[0].double()
        dist = torch.log_softmax(logits[len(context_ids) - 1:], -1)
        target = torch.tensor(continuation_ids)
        assert logprob == pytest.approx(float(dist.gather(-1, target[:, None]).sum()), abs=2e-4, rel=1e-5)
        assert greedy == bool((dist.argmax(-1) == target).all())
    assert any(abs(a[0] - b[0]) > 1e-3 for a, b in zip(scores, distilled))  # the prefill model matters
    lm.masking.remove()


def test_lm_evals_modes_are_the_eval_apps_under_its_names():
    """One mode list (eval/modes.py): lm-eval's MODES, aliases and student modes, and the plots' look of a renamed
    mode, are derived from the eval app's MODES and LM_EVAL_NAMES."""
    from slimwise_train.eval import modes as app
    from slimwise_train.eval.plots import mode_styles
    from slimwise_train.lm_eval.model import MODE_ALIASES, MODES, STUDENT_MODES

    assert set(app.LM_EVAL_NAMES) <= set(app.MODES)
    assert MODES == tuple(app.LM_EVAL_NAMES.get(m, m) for m in app.MODES) and MODE_ALIASES == app.LM_EVAL_NAMES
    assert STUDENT_MODES == tuple(app.LM_EVAL_NAMES.get(m, m) for m in app.STUDENT_MODES)
    for app_name, lm_eval_name in app.LM_EVAL_NAMES.items():
        assert mode_styles([lm_eval_name])[lm_eval_name] == mode_styles([app_name])[app_name]


def test_unknown_mode_lists_conventional_distilled_and_it_needs_a_student(assets):
    from slimwise_train.lm_eval.model import MODE_ALIASES, MODES, SlimwiseLM

    assert "conventional_distilled" in MODES and MODE_ALIASES["conventional_distill"] == "conventional_distilled"
    with pytest.raises(ValueError) as info:
        SlimwiseLM(pretrained=str(TEACHER), mode="sideways", progress=False)
    assert "'conventional_distilled'" in str(info.value) and "'distilled'" in str(info.value)
    with pytest.raises(ValueError, match="mode=conventional_distilled needs student=<folder>"):
        SlimwiseLM(pretrained=str(TEACHER), mode="conventional_distilled", keep_set=assets["keep"], progress=False)
    with pytest.raises(ValueError, match="mode=conventional_distilled needs keep_set"):
        SlimwiseLM(pretrained=str(TEACHER), mode="conventional_distilled", student=assets["student"], progress=False)
    with pytest.raises(ValueError, match="only read by mode=conventional_distilled or mode=distilled, not "
                                         "mode=slimwise"):
        SlimwiseLM(pretrained=str(TEACHER), mode="slimwise", keep_set=assets["keep"], student=assets["student"],
                   progress=False)


def test_lengths_report_orders_conventional_distilled_before_distilled():
    from slimwise_train.lm_eval.lengths import combined_results

    records = [{"task": "t", "doc_id": 0, "idx": 0, "num_tokens": 3, "budget": 8}]
    runs = [({"run": m, "mode": m, "model": "m", "mode_description": m, "tasks": {}, "written_at": k}, records)
            for k, m in enumerate(["distilled", "conventional_distilled", "full"])]
    assert [r["mode"] for r in combined_results(runs)["runs"]] == ["full", "conventional_distilled", "distilled"]


# ------------------------------------------------------------------------------------ chat templates


def test_chat_template_contexts_are_the_templates_tokens_with_one_bos(tmp_path, chat_tokenizer_dir):
    """chat_template=true (and lm-eval's --apply_chat_template, which calls apply_chat_template then tok_encode): the
    context is the template's rendering tokenised as apply_chat_template tokenises it, and a template that writes its
    own BOS is not given a second one (as lm-eval's hf model)."""
    from transformers import AutoTokenizer

    from slimwise_train.lm_eval.model import SlimwiseLM
    from slimwise_train.testing.tiny import tiny_model

    from tokenizers import processors

    tokenizer = AutoTokenizer.from_pretrained(str(chat_tokenizer_dir))
    tokenizer.chat_template = "{{ bos_token }}" + tokenizer.chat_template  # as Gemma's and Llama's templates
    bos = tokenizer.bos_token_id  # and the tokenizer adds one by itself, as theirs do
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", bos)])
    tiny_model("qwen3_moe", vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
               eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>")).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    question = [{"role": "user", "content": "What is 2+2?"}]
    expected = tokenizer.apply_chat_template(question, add_generation_prompt=True)["input_ids"]
    assert expected[0] == bos and expected[1] != bos
    try:
        lm = SlimwiseLM(pretrained=str(tmp_path / "model"), mode="full", device="cpu", progress=False,
                        chat_template="true", add_bos_token="true", max_gen_toks=4)
        assert lm._context_ids("What is 2+2?") == expected  # chat_template=true
        assert lm.tok_encode("plain text") == [bos, *tokenizer("plain text", add_special_tokens=False)["input_ids"]]
        out = lm.generate_until([_Request(("What is 2+2?", {"until": ["<|im_end|>"], "max_gen_toks": 4}))])
        assert len(out) == 1 and isinstance(out[0], str)
        # --apply_chat_template as well would wrap the rendered conversation again as a user turn: refused
        for hook in (lambda: lm.apply_chat_template(question), lambda: lm.chat_template(True)):
            with pytest.raises(ValueError, match="--apply_chat_template and model_args chat_template=true both"):
                hook()
        lm = SlimwiseLM(pretrained=str(tmp_path / "model"), mode="full", device="cpu", progress=False,
                        add_bos_token="true", max_gen_toks=4)
        assert lm.tok_encode(lm.apply_chat_template(question)) == expected  # --apply_chat_template alone
        assert lm.chat_template(True) == tokenizer.chat_template
    finally:
        SlimwiseLM.instances.clear()


def test_cli_refuses_both_chat_template_switches_before_loading_anything(tmp_path, capsys):
    """--apply_chat_template and model_args chat_template=true: one line, exit 2, before lm-eval loads the model or
    writes anything (run in-process: the check comes before lm-eval's CLI)."""
    from slimwise_train.lm_eval.__main__ import main

    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", "slimwise", "--model_args", f"pretrained={tmp_path / 'nowhere'},mode=full,chat_template=true",
              "--tasks", "slimwise_math", "--apply_chat_template", "--output_path", str(out)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["slimwise_train.lm_eval: error: --apply_chat_template and model_args chat_template=true both "
                   "apply the chat template (the prompt would be wrapped twice): use one of them"]
    assert not out.exists()


def test_a_device_in_model_args_is_refused_in_one_line_naming_the_flag(tmp_path, capsys):
    """model_args device=cpu (as a user of lm-eval's hf model may write it): lm-eval passes its --device beside
    model_args (a TypeError after its start-up), so one line naming --device, exit 2, before lm-eval loads anything."""
    from slimwise_train.lm_eval.__main__ import main

    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", "slimwise", "--model_args", f"pretrained={tmp_path / 'nowhere'},mode=full,device=cpu",
              "--tasks", "slimwise_math", "--output_path", str(out)])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "slimwise_train.lm_eval: error: --model_args device=cpu: lm-eval passes the device from its own flag beside "
        "model_args; give it as --device cpu"]
    assert not out.exists()


def test_the_report_has_one_table_per_keep_set_content_not_per_path():
    from slimwise_train.lm_eval.lengths import combined_results

    records = [{"task": "t", "doc_id": 0, "idx": 0, "num_tokens": 3, "budget": 8}]

    def run(mode, path, digest, at):
        return ({"run": f"{mode}-{at}", "mode": mode, "model": "m", "mode_description": mode, "tasks": {},
                 "written_at": at, "keep_set": path, "keep_set_digest": digest, "num_kept": [2], "num_experts": [4]},
                records)

    # the same keep set by two paths: one table; two keep sets whose paths end alike: two
    same = combined_results([run("slimwise", "a/r0.5/keep_set.json", "d1", 1),
                             run("conventional", "./a/r0.5/keep_set.json", "d1", 2)])
    assert list(same["keep_sets"]) == ["r0.5"]
    two = combined_results([run("slimwise", "a/r0.5/keep_set.json", "d1", 1),
                            run("slimwise", "b/r0.5/keep_set.json", "d2", 2)])
    assert list(two["keep_sets"]) == ["r0.5", "r0.5-2"]

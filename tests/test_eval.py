"""`python -m slimwise_train.eval`: numbers against a plain per-example loop, metric definitions, the reverse and
slimwise_distill modes, outputs, and bad input.

The model is `tiny_qwen3_moe` saved as a checkpoint after one change: the EOS row of its LM head is a random
direction scaled so that EOS wins roughly 7% of greedy steps. A random model otherwise never stops, and every
length would equal the budget. Everything runs single-threaded: on 2 shared cores, torch's default of 2 threads
is ~10x slower for these tiny matrices.
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from slimwise_train.moe.adapters import get_adapter
from slimwise_train.data import synthetic
from slimwise_train.eval.app import run_eval
from slimwise_train.eval.generation import Generation, build_problems, family_budgets, plan_batches
from slimwise_train.eval.metrics import collapse_share, length_stats, p90, score_run, summarize
from slimwise_train.moe.handoff import continue_on_cache, handoff_generate, prefill
from slimwise_train.moe.keepset import KeepSet
from slimwise_train.moe.masking import PhaseMasking
from slimwise_train.models import SHIPPED_TOKENIZER, load_model
from slimwise_train.moe.pruning import export_pruned, prune_experts_
from slimwise_train.testing.tiny import tiny_model

from helpers import compose_config

REPO = Path(__file__).resolve().parents[1]
KEPT = [[0, 2, 5, 7], [1, 3, 4, 6]]
BUDGET = 16
PER_FAMILY = 4
EOS_RATE = 0.07



def _compose(out, *overrides):
    return compose_config("eval", f"output_dir={out}", "progress=false", *overrides)


def _boost_eos(model, tokenizer, rate=EOS_RATE):
    """Make EOS the greedy choice at about `rate` of positions (on teacher-forced suite text)."""
    texts = [p + a for p, a in map(synthetic.to_text, synthetic.generate_mixture(4, 7, shuffle=False))]
    ids = [torch.tensor(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
    eos = tokenizer.eos_token_id
    head = model.get_output_embeddings().weight
    direction = torch.randn(head.shape[1], generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        head[eos] = 0
        hidden = torch.cat([model(input_ids=x[None], output_hidden_states=True).hidden_states[-1][0] for x in ids])
        best_other = (hidden @ head.T).max(-1).values
        proj = hidden @ direction
        ratio = torch.where(proj > 0, best_other / proj, torch.full_like(proj, float("inf")))
        scale = torch.quantile(ratio[torch.isfinite(ratio)], rate * len(ratio) / int(torch.isfinite(ratio).sum()))
        head[eos] = direction * scale * 1.001


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    model, tokenizer = load_model(_compose(root / "unused").model, "cpu")
    _boost_eos(model, tokenizer)
    model.save_pretrained(root / "model")
    keep = KeepSet.from_kept(get_adapter(model).moe_layers(model), KEPT, model_type=model.config.model_type)
    keep.save(root / "r0.5" / "keep_set.json")
    export_pruned(model, keep, root / "student")  # physically pruned stand-in for a distilled student
    model_args = [f"model.path={root / 'model'}", "model.tiny=null", f"model.tokenizer={SHIPPED_TOKENIZER}"]
    out = root / "out"
    results = run_eval(_compose(out, *model_args, f"eval.keep_sets=[{root / 'r0.5' / 'keep_set.json'}]",
                                f"eval.student={root / 'student'}", f"eval.num_per_family={PER_FAMILY}",
                                f"eval.budget={BUDGET}", "eval.batch_size=3", "eval.save_generations=true",
                                "logger=wandb"))
    return {"root": root, "model": model, "tokenizer": tokenizer, "keep": keep, "results": results, "out": out,
            "model_args": model_args}


def _run(results, mode):
    (run,) = [r for r in results["runs"] if r["mode"] == mode]
    return run


# ------------------------------------------------------------------------------------ reference loops
def _greedy_no_cache(model, prompt, budget, eos):
    """Plain greedy decoding: one forward over the whole sequence per token, batch size 1, no cache."""
    ids, out = torch.tensor([prompt]), []
    with torch.no_grad():
        for _ in range(budget):
            token = int(model(input_ids=ids).logits[0, -1].argmax())
            out.append(token)
            if token == eos:
                break
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return out


def _greedy_handoff_stepwise(prefill_model, decode_model, prompt, budget, eos):
    """One prompt: `prefill_model` writes the cache and picks the first token, `decode_model` continues on it."""
    with torch.no_grad():
        logits, cache = prefill(prefill_model, torch.tensor([prompt]))
        out = [int(logits[0, -1].argmax())]
        while out[-1] != eos and len(out) < budget:
            logits, cache = continue_on_cache(decode_model, cache, torch.tensor([[out[-1]]]))
            out.append(int(logits[0, -1].argmax()))
    return out


def _median(values):
    s, n = sorted(values), len(values)
    return float(s[n // 2]) if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def test_app_numbers_equal_a_plain_per_example_loop(setup):
    model, tokenizer, results = setup["model"], setup["tokenizer"], setup["results"]
    eos = tokenizer.eos_token_id
    full = copy.deepcopy(model)
    pruned = prune_experts_(copy.deepcopy(model), setup["keep"])
    problems = build_problems(tokenizer, list(synthetic.FAMILIES), PER_FAMILY)
    assert [p.prompt for p in problems] == [p["prompt"] for p in results["problems"]]
    reference = {
        "full": [_greedy_no_cache(full, p.prompt_ids, BUDGET, eos) for p in problems],
        "conventional": [_greedy_no_cache(pruned, p.prompt_ids, BUDGET, eos) for p in problems],
        "slimwise": [_greedy_handoff_stepwise(full, pruned, p.prompt_ids, BUDGET, eos) for p in problems],
        "reverse": [_greedy_handoff_stepwise(pruned, full, p.prompt_ids, BUDGET, eos) for p in problems],
    }
    ended_all = [t[-1] == eos for t in reference["full"]]
    assert 0 < sum(ended_all) < len(ended_all)  # the EOS boost gives a mix of stopped and cut-off outputs
    assert reference["slimwise"] != reference["full"] and reference["conventional"] != reference["slimwise"]
    rows = {(r["mode"], r["family"]): r for r in results["rows"]}
    for mode, outputs in reference.items():
        run = _run(results, mode)
        assert run["length"] == [len(t) for t in outputs], mode
        assert run["ended"] == [t[-1] == eos for t in outputs], mode
        assert run["first_token"] == [t[0] for t in outputs], mode
        for family in [*synthetic.FAMILIES, "all"]:
            idx = [i for i, p in enumerate(problems) if family in ("all", p.family)]
            lengths = [len(outputs[i]) for i in idx]
            ended = [outputs[i][-1] == eos for i in idx]
            texts = [tokenizer.decode(outputs[i][:-1] if e else outputs[i]) for i, e in zip(idx, ended)]
            row = rows[(mode, family)]
            assert row["n"] == len(idx)
            assert row["accuracy"] == sum(synthetic.check(problems[i].family, problems[i].prompt, t, ended=e)
                                          for i, t, e in zip(idx, texts, ended)) / len(idx)
            assert row["median_length"] == _median(lengths)
            assert row["p90_length"] == sorted(lengths)[math.ceil(0.9 * len(lengths)) - 1]
            assert row["max_length"] == max(lengths)
            assert row["hit_budget"] == ended.count(False) / len(idx)
            assert row["collapse"] == sum(e and n < 0.5 * problems[i].reference_length
                                          for i, n, e in zip(idx, lengths, ended)) / len(idx)
            agree = [outputs[i][0] == reference["full"][i][0] for i in idx]
            assert row["first_token_agreement_with_full"] == sum(agree) / len(idx)
            assert row["exact_match_with_full"] == sum(outputs[i] == reference["full"][i] for i in idx) / len(idx)
    # the first answer token of slimwise comes from the full model; pruned prefill changes some
    assert rows[("slimwise", "all")]["first_token_agreement_with_full"] == 1.0
    assert rows[("conventional", "all")]["first_token_agreement_with_full"] < 1.0
    assert rows[("reverse", "all")]["first_token_agreement_with_full"] == \
        rows[("conventional", "all")]["first_token_agreement_with_full"]


def test_slimwise_distill_with_pruned_checkpoint_equals_slimwise(setup):
    results = setup["results"]
    slim, distill = _run(results, "slimwise_distill"), _run(results, "slimwise")
    for key in ("length", "ended", "correct", "first_token", "same_as_full"):
        assert slim[key] == distill[key], key
    lines = [json.loads(x) for x in (setup["out"] / "generations.jsonl").read_text().splitlines()]
    outputs = {m: [x["output"] for x in lines if x["mode"] == m] for m in ("slimwise", "slimwise_distill")}
    assert outputs["slimwise"] == outputs["slimwise_distill"] and len(outputs["slimwise"]) == 3 * PER_FAMILY
    rows = {(r["mode"], r["family"]): {k: v for k, v in r.items() if k != "mode"} for r in results["rows"]}
    for family in [*synthetic.FAMILIES, "all"]:
        assert rows[("slimwise", family)] == rows[("slimwise_distill", family)]


def test_reverse_with_one_masked_model_equals_two_models(setup):
    model, keep = setup["model"], setup["keep"]
    full, pruned = copy.deepcopy(model), prune_experts_(copy.deepcopy(model), keep)
    masked = copy.deepcopy(model)
    PhaseMasking(masked, keep)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(4, 300, (3, 11), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    mask[2, :2] = 0
    ids = ids.masked_fill(mask == 0, 0)
    kwargs = dict(max_new_tokens=BUDGET, eos_token_id=setup["tokenizer"].eos_token_id)
    one = handoff_generate(masked, masked, ids, mask, prefill_phase="decode", decode_phase="prefill", **kwargs)
    two = handoff_generate(pruned, full, ids, mask, **kwargs)
    for field in ("tokens", "lengths", "ended", "first_token"):
        assert torch.equal(getattr(one, field), getattr(two, field)), field
    slimwise = handoff_generate(masked, masked, ids, mask, **kwargs)  # default phases unchanged
    assert torch.equal(slimwise.tokens, handoff_generate(full, pruned, ids, mask, **kwargs).tokens)
    assert not torch.equal(slimwise.tokens, one.tokens)


# ------------------------------------------------------------------------------------ pure functions
def test_length_stats_hand_computed():
    lengths = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]  # sorted: 1 1 2 3 3 4 5 5 6 9
    stats = length_stats(lengths, budget=9)
    # median: mean of the 5th and 6th values (3, 4); p90: nearest rank ceil(0.9 * 10) = 9th value
    assert stats == {"median_length": 3.5, "p90_length": 6.0, "max_length": 9, "mean_length": 3.9, "hit_budget": 0.1}
    assert length_stats([5, 1, 3], budget=10) == {"median_length": 3.0, "p90_length": 5.0, "max_length": 5,
                                                  "mean_length": 3.0, "hit_budget": 0.0}
    # with `ended`, an EOS exactly at the budget is not a hit, a cut-off output is
    assert length_stats([4, 4, 2], budget=4, ended=[True, False, True])["hit_budget"] == pytest.approx(1 / 3)
    assert length_stats([4, 6], budget=[4, 8])["hit_budget"] == 0.5  # one budget per output
    assert length_stats([7], budget=7)["p90_length"] == 7.0
    assert p90(list(range(1, 21))) == 18.0  # ceil(18.0) = 18th of 20
    assert collapse_share([2, 10, 3], [10, 10, 6], ended=[True, True, False]) == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="at least one length"):
        length_stats([], budget=4)


def test_accuracy_needs_eos_and_budgets_default_to_twice_the_longest_answer(setup):
    tokenizer = setup["tokenizer"]
    problems = build_problems(tokenizer, ["math", "tool"], 2)
    eval_split = synthetic.generate_from_recipe(None, "eval")  # seed null = the recipe's eval split
    recipe_math = [e.prompt for e in eval_split if e.family == "math"]
    assert [p.prompt for p in problems if p.family == "math"] == recipe_math[:2]
    budgets = family_budgets(problems)
    for family in ("math", "tool"):
        longest = max(len(tokenizer(e.answer, add_special_tokens=False)["input_ids"]) + 1
                      for e in synthetic.heldout(family, 2, 0, **synthetic.load_recipe()["families"][family]["params"]))
        assert budgets[family] == 2 * longest
    assert family_budgets(problems, 40) == {"math": 40, "tool": 40}
    eos = tokenizer.eos_token_id
    answers = [tokenizer(p.answer, add_special_tokens=False)["input_ids"] for p in problems]
    right = [Generation(tuple(a + [eos]), True, a[0]) for a in answers]
    unterminated = [Generation(tuple(a), False, a[0]) for a in answers]
    first = [a[0] for a in answers]
    assert score_run(problems, right, tokenizer, first)["correct"] == [True] * 4
    assert score_run(problems, unterminated, tokenizer, first)["correct"] == [False] * 4
    summary = summarize(problems, score_run(problems, right[:2] + unterminated[2:], tokenizer, first), budgets)
    assert summary["math"]["accuracy"] == 1.0 and summary["tool"]["accuracy"] == 0.0
    assert summary["all"]["accuracy"] == 0.5 and summary["all"]["hit_budget"] == 0.5
    # batches: one family each, shortest prompts first
    batches = plan_batches(problems, 3)
    assert all(len({problems[i].family for i in b}) == 1 for b in batches)
    assert sorted(i for b in batches for i in b) == list(range(4))


# ------------------------------------------------------------------------------------ outputs
def test_outputs_report_plots_and_json_schema(setup):
    out, results = setup["out"], setup["results"]
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".") and p.name != "wandb") == [
        "eval_config.yaml", "family_accuracy_r0.5.png", "generations.jsonl", "lengths_r0.5.png", "report.md",
        "results.json", "tradeoff_r0.5.png"]
    for figure in ("lengths", "tradeoff", "family_accuracy"):
        assert (out / f"{figure}_r0.5.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({figure}_r0.5.png)" in (out / "report.md").read_text()  # linked under the keep set's table
    data = json.loads((out / "results.json").read_text())
    for key in ("format", "model", "families", "num_problems", "budget", "budget_rule", "modes", "keep_sets", "rows",
                "runs", "problems", "notes", "metric_definitions", "elapsed_s"):
        assert key in data, key
    assert data["modes"] == ["full", "conventional", "slimwise", "reverse", "conventional_distill", "slimwise_distill"]
    assert data["budget"] == {f: BUDGET for f in synthetic.FAMILIES}
    assert data["keep_sets"]["r0.5"]["num_kept"] == [4, 4]
    assert len(data["rows"]) == 6 * 4
    assert set(data["rows"][0]) == {"keep_set", "mode", "family", "n", "accuracy", "median_length", "p90_length",
                                    "max_length", "mean_length", "hit_budget", "collapse",
                                    "first_token_agreement_with_full", "exact_match_with_full"}
    assert {r["keep_set"] for r in data["rows"]} == {None, "r0.5"}
    assert set(data["runs"][0]) == {"keep_set", "mode", "length", "ended", "correct", "first_token",
                                    "first_token_agrees", "same_as_full"}
    report = (out / "report.md").read_text()
    assert "## keep set `r0.5`" in report and "| mode | math | code | tool | all | worst family | first tok" in report
    table = [line for line in report.splitlines() if line.startswith("| ")]
    assert [line.split(" | ")[0][2:] for line in table[1:]] == list(data["modes"])
    row = next(r for r in results["rows"] if r["mode"] == "slimwise" and r["family"] == "math")
    assert f"| slimwise | {row['accuracy']:.2f} / " in report
    # One H1, and every mode defined in one line.
    assert [line for line in report.splitlines() if line.startswith("# ")] == ["# SlimWise evaluation"]
    modes_line = next(line for line in report.splitlines() if line.startswith("- modes: "))
    assert all(f"**{mode}** = " in modes_line for mode in data["modes"])


def test_length_plot_has_a_legend_on_every_panel_and_separates_equal_lines(setup, tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    from slimwise_train.eval.plots import plot_lengths

    captured = {}
    monkeypatch.setattr(plt, "close", lambda fig: captured.setdefault("fig", fig))
    plot_lengths(setup["results"], "r0.5", tmp_path / "cdf.png")
    axes = captured["fig"].axes
    assert len(axes) == len(synthetic.FAMILIES)
    for ax in axes:
        legend = ax.get_legend()
        assert legend is not None
        labels = [t.get_text() for t in legend.get_texts()]
        assert set(setup["results"]["modes"]) <= set(labels)
        mode_lines = [line for line in ax.get_lines() if line.get_label() in setup["results"]["modes"]]
        # Identical distributions (full and reverse often are) must not draw on top of each other.
        styles = {(line.get_linestyle(), line.get_marker()) for line in mode_lines}
        assert len(styles) == len(mode_lines)
        assert len({tuple(line.get_ydata()) for line in mode_lines}) == len(mode_lines)


def test_no_keep_sets_runs_only_full_with_a_note(setup, tmp_path):
    out = tmp_path / "out"
    results = run_eval(_compose(out, *setup["model_args"], "eval.num_per_family=2", "eval.budget=6",
                                "eval.families=[code]"))
    assert results["modes"] == ["full"] and {r["mode"] for r in results["rows"]} == {"full"}
    assert any("no keep sets given" in n for n in results["notes"])
    assert (out / "lengths_full.png").is_file()
    assert "no keep set (full model only)" in (out / "report.md").read_text()


def test_long_context_families_are_the_deep_teachers_held_out_problems(setup, tmp_path):
    """eval.families takes the long-context families (the deep teacher's): their first held-out problems of seed 0,
    the ones scripts/train_teacher.py --preset deep keeps out of training, scored by the suite's checker."""
    keep = setup["root"] / "r0.5" / "keep_set.json"
    args = ("eval.num_per_family=2", "eval.budget=4", "eval.families=[lookup,steps]", f"eval.keep_sets=[{keep}]",
            "eval.modes=[full,slimwise]")
    # The tiny model's 256 positions cannot hold lookup's prompts: refused in one line naming the family and the fix,
    # nothing written (it used to score 0.00 on positions past the model's).
    with pytest.raises(ValueError, match=r"^eval.families: lookup: prompts of up to \d+ tokens \+ budget 4 exceed the "
                                         r"256 positions of .*; drop lookup from eval.families, lower eval.budget"):
        run_eval(_compose(tmp_path / "refused", *setup["model_args"], *args))
    assert not (tmp_path / "refused").exists()
    longer = tmp_path / "model_1k"  # the same weights with room for the prompts
    shutil.copytree(setup["root"] / "model", longer)
    config = json.loads((longer / "config.json").read_text())
    (longer / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 1024}))
    results = run_eval(_compose(tmp_path / "out", f"model.path={longer}", *setup["model_args"][1:], *args))
    assert [p["family"] for p in results["problems"]] == ["lookup", "lookup", "steps", "steps"]
    assert [p["prompt"] for p in results["problems"]] == [
        e.prompt for family in ("lookup", "steps") for e in synthetic.heldout(family, 2, 0)]
    assert {(r["family"], r["mode"]) for r in results["rows"]} >= {("lookup", "full"), ("steps", "slimwise")}


# ------------------------------------------------------------------------------------ bad input
def _other_model_keep_set(root):
    other = tiny_model("qwen3_moe", num_hidden_layers=3)
    keep = KeepSet.from_kept(get_adapter(other).moe_layers(other), KEPT + [[0, 1, 2, 3]], model_type="qwen3_moe")
    keep.save(root / "other" / "keep_set.json")
    return root / "other" / "keep_set.json"


def _different_student(root, model):
    path = root / "student_other"
    if not path.exists():
        keep = KeepSet.from_kept(get_adapter(model).moe_layers(model), [[0, 1, 2, 3], [4, 5, 6, 7]],
                                 model_type="qwen3_moe")
        export_pruned(model, keep, path)
    return path


@pytest.mark.parametrize("case,error,message", [
    ("missing_keep_set", FileNotFoundError, r"^eval.keep_sets=.*missing.json: no such file; write one with"),
    ("other_model_keep_set", ValueError, "it was made for another model"),
    ("missing_student", FileNotFoundError, r"^eval.student=.*nowhere is not a checkpoint folder"),
    ("student_of_another_keep_set", ValueError, "eval.student was pruned with a keep set .* none of eval.keep_sets"),
    ("unknown_mode", ValueError, r"^eval.modes=\['full', 'slimwize'\]: 'slimwize' is not one of: full, conventional, "
                                 r"slimwise, reverse, conventional_distill, slimwise_distill$"),
    ("zero_budget", ValueError, "eval.budget must be >= 1"),
    ("unknown_family", ValueError, r"^unknown eval.families \['lookups'\]; use some of \['math', 'code', 'tool', "
                                   r"'lookup', 'toolpick', 'steps', 'fewshot'\]$"),
    ("no_family", ValueError, r"^eval.families is empty; use some of"),
])
def test_bad_input_fails_with_one_line_and_writes_nothing(setup, tmp_path, case, error, message):
    root = setup["root"]
    keep = f"eval.keep_sets=[{root / 'r0.5' / 'keep_set.json'}]"
    overrides = {
        "missing_keep_set": [f"eval.keep_sets=[{tmp_path / 'missing.json'}]"],
        "other_model_keep_set": [f"eval.keep_sets=[{_other_model_keep_set(tmp_path)}]"],
        "missing_student": [keep, f"eval.student={tmp_path / 'nowhere'}"],
        "student_of_another_keep_set": [keep, f"eval.student={_different_student(root, setup['model'])}"],
        "unknown_mode": [keep, "eval.modes=[full,slimwize]"],
        "zero_budget": [keep, "eval.budget=0"],
        "unknown_family": [keep, "eval.families=[math,lookups]"],
        "no_family": [keep, "eval.families=[]"],
    }[case]
    out = tmp_path / "out"
    with pytest.raises(error, match=message) as info:
        run_eval(_compose(out, *setup["model_args"], "eval.num_per_family=1", *overrides))
    assert "\n" not in str(info.value)
    assert not out.exists()


@pytest.mark.subprocess
def test_cli_error_is_one_line_with_exit_code_2(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "slimwise_train.eval", f"eval.keep_sets=[{tmp_path / 'missing.json'}]",
         f"hydra.run.dir={tmp_path / 'run'}"],
        capture_output=True, text=True, cwd=REPO, env=env, timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.strip().splitlines() if line.startswith("slimwise_train.eval")]
    assert len(lines) == 1 and "missing.json: no such file" in lines[0]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "results.json").exists()


# ------------------------------------------------------------------------------------ conventional_distill (issue 23)
def _perturbed_student(root, model, keep):
    """A distilled stand-in that is not the pruned model: the pruned checkpoint with its attention projections
    perturbed (as merged attention LoRA would), so the cache it writes for a prompt is not the full model's."""
    from transformers import AutoModelForCausalLM

    path = root / "student_perturbed"
    if not path.exists():
        export_pruned(model, keep, root / "student_perturbed_tmp")
        student = AutoModelForCausalLM.from_pretrained(root / "student_perturbed_tmp")
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for name, param in student.named_parameters():
                if any(k in name for k in ("q_proj", "k_proj", "v_proj", "o_proj")):
                    param.add_(torch.randn(param.shape, generator=g) * param.std() * 0.5)
        student.save_pretrained(path)
        (path / "slimwise_keep_set.json").write_text((root / "student_perturbed_tmp" / "slimwise_keep_set.json")
                                                     .read_text())
    return path


def _student_alone_greedy(student, prompt, budget, eos):
    """Prune + distill served by hand: one forward of the student over the prompt (argmax = first token), then one
    token at a time on the student's own KV cache; batch size 1, no padding, stops at EOS or the budget."""
    with torch.no_grad():
        out = student(input_ids=torch.tensor([prompt]), use_cache=True)
        cache, tokens = out.past_key_values, [int(out.logits[0, -1].argmax())]
        while tokens[-1] not in eos and len(tokens) < budget:
            out = student(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


@pytest.fixture(scope="module")
def distill_modes(setup):
    from slimwise_train.eval.generation import MODES, evaluate, load_student

    model, tokenizer, keep, root = setup["model"], setup["tokenizer"], setup["keep"], setup["root"]
    problems = build_problems(tokenizer, list(synthetic.FAMILIES), PER_FAMILY)
    student = load_student(_perturbed_student(root, model, keep), model)
    results = evaluate(model, tokenizer, {"r0.5": keep}, list(MODES), problems, BUDGET, 3, student=student)
    return {"problems": problems, "student": student, "results": results}


def test_conventional_distill_equals_the_student_alone_by_hand(setup, distill_modes):
    from slimwise_train.eval.generation import eos_ids

    model, tokenizer, results = setup["model"], setup["tokenizer"], distill_modes["results"]
    student, student_keep = distill_modes["student"]
    assert student_keep == setup["keep"]
    eos = eos_ids(model, tokenizer)
    reference = [_student_alone_greedy(student, p.prompt_ids, BUDGET, eos) for p in distill_modes["problems"]]
    assert 0 < sum(t[-1] in eos for t in reference) < len(reference)  # some stop, some hit the budget
    run = _run(results, "conventional_distill")
    # The app left-pads batches of 3, the reference runs one unpadded prompt: the same tokens (as for the other
    # modes in test_app_numbers_equal_a_plain_per_example_loop) on this fp32 tiny model.
    assert run["length"] == [len(t) for t in reference]
    assert run["ended"] == [t[-1] in eos for t in reference]
    assert run["first_token"] == [t[0] for t in reference]
    assert run["text"] == [tokenizer.decode(t[:-1] if t[-1] in eos else t) for t in reference]
    # the student's own prefill: its first tokens are not always the full model's, unlike slimwise_distill's
    rows = {(r["mode"], r["family"]): r for r in results["rows"]}
    assert rows[("slimwise_distill", "all")]["first_token_agreement_with_full"] == 1.0
    assert rows[("conventional_distill", "all")]["first_token_agreement_with_full"] < 1.0


def test_conventional_distill_differs_from_slimwise_distill_where_the_prefill_matters(distill_modes):
    results = distill_modes["results"]
    conv, slim = _run(results, "conventional_distill"), _run(results, "slimwise_distill")
    different = [i for i, (a, b) in enumerate(zip(conv["text"], slim["text"])) if a != b]
    assert different, "the student decoding on its own cache gave the same outputs as on the full model's"
    # the same decoder after the first token: where the first tokens differ, the prefill is what differs
    assert any(conv["first_token"][i] != slim["first_token"][i] for i in different)
    # and it is not merely the undistilled conventional mode
    assert conv["text"] != _run(results, "conventional")["text"]


def test_conventional_distill_never_runs_the_full_model_beyond_the_first_token_reference(setup, distill_modes,
                                                                                         monkeypatch):
    import slimwise_train.eval.generation as generation

    model, tokenizer, keep = setup["model"], setup["tokenizer"], setup["keep"]
    student = distill_modes["student"]
    calls = []
    real = generation.generate_all

    def spy(prefill_model, decode_model, *args, **kwargs):
        calls.append((prefill_model, decode_model))
        return real(prefill_model, decode_model, *args, **kwargs)

    monkeypatch.setattr(generation, "generate_all", spy)
    forwards = {"model": 0, "student": 0}
    handles = [m.register_forward_pre_hook(lambda *_, k=k: forwards.__setitem__(k, forwards[k] + 1))
               for k, m in (("model", model), ("student", student[0]))]
    try:
        problems = distill_modes["problems"]
        # two keep sets, a student without a keep set file: the student-only run is made once and reused
        results = generation.evaluate(model, tokenizer, {"a": keep, "b": keep}, ["conventional_distill"], problems,
                                      BUDGET, 3, student=(student[0], None))
    finally:
        for h in handles:
            h.remove()
    assert calls == [(student[0], student[0])]
    assert forwards["model"] == len(plan_batches(problems, 3))  # only `first_tokens` (first-token agreement)
    assert forwards["student"] > len(plan_batches(problems, 3))  # prefill and every decode step
    runs = [r for r in results["runs"] if r["mode"] == "conventional_distill"]
    assert [r["keep_set"] for r in runs] == ["a", "b"] and runs[0]["length"] == runs[1]["length"]
    assert runs[0]["length"] == _run(distill_modes["results"], "conventional_distill")["length"]


def test_conventional_distill_with_a_pruned_checkpoint_equals_conventional(setup):
    from slimwise_train.eval.generation import evaluate, load_student

    model, tokenizer, keep = setup["model"], setup["tokenizer"], setup["keep"]
    problems = build_problems(tokenizer, list(synthetic.FAMILIES), PER_FAMILY)
    student = load_student(setup["root"] / "student", model)  # physically pruned, nothing distilled
    results = evaluate(model, tokenizer, {"r0.5": keep}, ["conventional", "conventional_distill"], problems, BUDGET,
                       3, student=student)
    conv, alone = _run(results, "conventional"), _run(results, "conventional_distill")
    for key in ("length", "ended", "correct", "first_token", "text"):
        assert conv[key] == alone[key], key


def test_conventional_distill_needs_a_student_and_is_reported(setup, distill_modes, tmp_path):
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    from slimwise_train.eval.generation import (MODE_DESCRIPTIONS, MODES, check_modes_run, evaluate,
                                                missing_for_modes)
    from slimwise_train.eval.plots import plot_lengths
    from slimwise_train.eval.report import render_markdown

    assert missing_for_modes(["conventional_distill"], False, False) == {
        "conventional_distill": ("eval.keep_sets", "eval.student")}
    assert missing_for_modes(list(MODES), True, False) == {"conventional_distill": ("eval.student",),
                                                           "slimwise_distill": ("eval.student",)}
    with pytest.raises(ValueError, match=r"^eval.modes=\[conventional_distill\] evaluates nothing: "
                                         r"conventional_distill needs eval.student; set eval.student="):
        check_modes_run(["conventional_distill"], has_keep_sets=True, has_student=False)
    # beside a mode that can run it is skipped with a note
    model, tokenizer = setup["model"], setup["tokenizer"]
    problems = build_problems(tokenizer, ["code"], 1)
    skipped = evaluate(model, tokenizer, {"r0.5": setup["keep"]}, ["conventional", "conventional_distill"], problems,
                       4, 3)
    assert skipped["modes"] == ["conventional"]
    assert any("conventional_distill skipped: no student" in n for n in skipped["notes"])
    # report: one row per mode in eval.modes order, with its description; six distinct lines in the plot
    results = distill_modes["results"]
    assert results["modes"] == list(MODES)
    report = render_markdown(results)
    table = [line.split(" | ")[0][2:] for line in report.splitlines() if line.startswith("| ")][1:]
    assert table == list(MODES)
    assert f"**conventional_distill** = {MODE_DESCRIPTIONS['conventional_distill']}" in report
    captured = {}
    original_close = plt.close
    plt.close = lambda fig: captured.setdefault("fig", fig)
    try:
        plot_lengths(results, "r0.5", tmp_path / "cdf.png")
    finally:
        plt.close = original_close
    for ax in captured["fig"].axes:
        lines = [line for line in ax.get_lines() if line.get_label() in MODES]
        assert len(lines) == len(MODES)
        assert len({(line.get_linestyle(), line.get_marker()) for line in lines}) == len(MODES)
    original_close(captured["fig"])


def test_demo_table_has_the_conventional_distill_row(distill_modes, tmp_path):
    import importlib.util

    from slimwise_train.eval.generation import MODES
    from slimwise_train.eval.report import render_markdown

    spec = importlib.util.spec_from_file_location("demo_script", REPO / "scripts" / "demo.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    assert list(demo.POOLS) == list(MODES)  # the demo's eval step runs eval.modes=[every mode]
    results = {k: v for k, v in distill_modes["results"].items() if k != "runs"}
    (tmp_path / "results.json").write_text(json.dumps(results))
    measured = {"speedup": 1.5, "speedup_quartiles": [1.4, 1.6], "bound": 1.8, "bound_quartiles": [1.7, 1.9],
                "probes": 10, "efficiency": 0.833, "above_bound": False, "beyond_noise": False}
    lines = demo.mode_table(tmp_path, measured, "a test", tmp_path / "no_export")
    modes = [line.split(" | ")[0][2:] for line in lines if line.startswith("| ")][1:]
    assert modes == list(MODES)
    row = next(line for line in lines if line.startswith("| conventional_distill |"))
    assert row.startswith("| conventional_distill | student | student | 1.50x (")
    # a speed-up above its bound is never shown as a result: every pruned-decode cell says so
    above = {**measured, "speedup": 2.12, "efficiency": 1.178, "above_bound": True, "beyond_noise": True}
    lines = demo.mode_table(tmp_path, above, demo.bound_sentence(above), tmp_path / "no_export")
    pruned = [line for line in lines if line.startswith("| ") and "2.12x" in line]
    assert len(pruned) == 4 and all("2.12x (ABOVE its bound 1.80x: not a result)" in line for line in pruned)
    assert "not a result" in lines[-1] and "bound missed something" in lines[-1]
    shared = demo.bound_sentence({**measured, "machine": {"shared": True, "other_cpu_share": 0.6, "cpus": 2}})
    assert "Shared machine" in shared and "60% of its 2 CPUs" in shared
    # the eval report it embeds has no second bound beside the measured one
    embedded = demo.embedded_eval_report(tmp_path)
    assert "bytes bound" not in embedded and "| mode |" in embedded
    assert "bytes bound" in render_markdown(results)


def test_the_report_names_the_worst_family_and_the_expert_bytes_bound():
    """A pooled accuracy hides a family collapsing: each mode's row names the family that loses most against full;
    and each mode's decoder gets its expert-bytes bound at batch 64 (1.00x where the full model decodes)."""
    from slimwise_train.eval.report import expert_bytes_bound, render_markdown, touched_experts

    def row(mode, family, accuracy):
        return {"keep_set": None if mode == "full" else "k", "mode": mode, "family": family, "accuracy": accuracy,
                "median_length": 10.0, "p90_length": 12.0, "hit_budget": 0.0, "collapse": 0.0,
                "first_token_agreement_with_full": 1.0, "exact_match_with_full": 1.0}

    accuracy = {"full": (0.9, 0.9, 1.0), "slimwise": (0.8, 0.85, 0.1), "reverse": (0.9, 0.8, 1.0)}
    rows = [row(m, f, a) for m, accs in accuracy.items() for f, a in zip(("math", "code", "tool"), accs)]
    rows += [row(m, "all", sum(accs) / 3) for m, accs in accuracy.items()]
    info = {"num_kept": [8, 8], "num_experts": [16, 16], "top_k": [2, 2], "keep_fraction": 0.5}
    results = {"families": ["math", "code", "tool"], "budget": {"math": 1, "code": 1, "tool": 1},
               "num_problems": {"math": 1, "code": 1, "tool": 1}, "budget_rule": "-", "rows": rows,
               "keep_sets": {"k": info}, "notes": [],
               "mode_descriptions": {"full": "full prefill, full decode", "slimwise": "full prefill, pruned decode",
                                     "reverse": "pruned prefill, full decode"}}
    expected = touched_experts(16, 2, 64) / touched_experts(8, 2, 64)  # per layer the same: the ratio of one layer
    assert expert_bytes_bound(info) == pytest.approx(expected)
    assert touched_experts(16, 2, 64) == pytest.approx(16 * (1 - (14 / 16) ** 64))
    table = {line.split(" | ")[0][2:]: line.split(" | ") for line in render_markdown(results).splitlines()
             if line.startswith("| ") and not line.startswith("| mode")}
    assert table["slimwise"][5] == "tool -0.90" and table["reverse"][5] == "code -0.10"
    assert table["slimwise"][-1] == f"{expected:.2f}x |" and table["reverse"][-1] == "1.00x |"
    assert table["full"][5] == "-"


def test_the_shipped_deep_teacher_loads_by_name_and_answers_its_held_out_problems(tmp_path):
    """`model=teacher_deep` loads the shipped deep teacher (at least 12 layers, 1024-token prompts) and, in the eval
    app, answers the first held-out problems of every family of its suite (greedy; the 100 per family the ship bar
    of 0.9 was measured on are in docs/teacher.md)."""
    from slimwise_train.models import ASSETS

    config = json.loads((ASSETS / "teacher_deep" / "config.json").read_text())
    assert config["num_hidden_layers"] >= 12 and config["max_position_embeddings"] >= 1024
    families = [*synthetic.LONG_FAMILIES, *synthetic.FAMILIES]  # the deep teacher's suite
    results = run_eval(_compose(tmp_path / "out", "model=teacher_deep", f"eval.families=[{','.join(families)}]",
                                "eval.num_per_family=3", "eval.modes=[full]"))
    accuracy = {row["family"]: row["accuracy"] for row in results["rows"]}
    assert set(accuracy) == {*families, "all"}
    assert accuracy["all"] >= 18 / 21, accuracy  # 0.9 per family on 100 leaves ~2 of 21 wrong


def test_a_student_distilled_from_another_model_is_refused_before_it_loads(tmp_path):
    from slimwise_train.eval.generation import _check_distilled_from, load_student
    from slimwise_train.utils.fingerprint import model_cache_fingerprint

    model = tiny_model("qwen3_moe")
    folder = tmp_path / "student"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "slimwise_export.json").write_text(json.dumps({"cache_fingerprint": "0" * 64}))
    with pytest.raises(ValueError, match=r"^eval.student=.*student was distilled from another model .*cache "
                                         r"fingerprint 000000000000.*evaluate it with the model it was trained from"):
        load_student(folder, model)
    (folder / "slimwise_export.json").write_text(json.dumps({"cache_fingerprint": model_cache_fingerprint(model)}))
    _check_distilled_from(folder, model, "eval.student")  # its own teacher: no error

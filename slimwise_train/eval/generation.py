"""Problems and batched greedy generation of the synthetic suite under the six serving modes of a keep set.

Modes (prefill pool -> decode pool, over one KV cache):

    full                  full     -> full
    conventional          pruned   -> pruned    (router-masked in both phases == a physically pruned model)
    slimwise              full     -> pruned    (the first answer token comes from the full model)
    reverse               pruned   -> full
    conventional_distill  student  -> student   (prune + distill: the distilled checkpoint served alone, no full model)
    slimwise_distill      full     -> student   (a distilled decode checkpoint, see `load_student`)

One model carries `PhaseMasking` for the keep set being evaluated; each mode is a pair of masking phases for
`handoff_generate` and a pair of models (`MODE_MODELS`: the masked full model or the student). Problems are
grouped by family (each family has its own token budget), sorted by prompt length to limit padding, left-padded
into batches, and put back in order afterwards. `evaluate` scores the runs with `slimwise_train.eval.metrics` (the
metric definitions) and returns the results dict that `slimwise_train.eval.report` renders.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Callable, Mapping, Sequence

import torch
from torch import nn

# Problem and Generation, the per-problem records, are defined in eval/metrics.py (which scores them); importable
# from here too.
from slimwise_train.eval.metrics import (  # noqa: F401
    METRIC_DEFINITIONS,
    Generation,
    Problem,
    decode_output,
    score_run,
    summarize,
)
from slimwise_train.eval.modes import (  # defined in eval/modes.py (no torch there); imported from here too
    KEEP_SET_MODES,
    MODE_DESCRIPTIONS,
    MODE_MODELS,
    MODE_PHASES,
    MODES,
    STUDENT_MODES,
)
from slimwise_train.moe.handoff import handoff_generate, prefill
from slimwise_train.moe.keepset import KeepSet
from slimwise_train.moe.masking import PhaseMasking, get_masking
from slimwise_train.utils.hf import text_config

log = logging.getLogger("slimwise.eval")

FORMAT = "slimwise-eval/1"
MODE_FIXES = {"eval.keep_sets": "eval.keep_sets=[<keep_set.json>]",
              "eval.student": "eval.student=<exported student folder>"}


def missing_for_modes(modes: Sequence[str], has_keep_sets: bool, has_student: bool) -> dict[str, tuple[str, ...]]:
    """{mode: the config keys it lacks} for the modes of `modes` that cannot run: every mode but full needs a keep
    set (eval.keep_sets), slimwise_distill and conventional_distill also a student (eval.student)."""
    out = {}
    for mode in dict.fromkeys(modes):
        keys = (("eval.keep_sets",) if mode in KEEP_SET_MODES and not has_keep_sets else ()) + \
               (("eval.student",) if mode in STUDENT_MODES and not has_student else ())
        if keys:
            out[mode] = keys
    return out


def check_modes_run(modes: Sequence[str], has_keep_sets: bool, has_student: bool) -> None:
    """Refuse no eval.modes, and a list of which no mode can run (eval.modes=[slimwise_distill] without
    eval.student, eval.modes=[conventional] without eval.keep_sets): one line naming eval.modes and the missing keys.
    Modes that cannot run beside one that can are skipped with a note (`evaluate`): the default list runs only full
    when no keep set is given. An unknown mode is refused before, by the schema (EvalConfig.modes: check_known_keys)."""
    if not modes:
        raise ValueError(f"eval.modes is empty; use some of {list(MODES)}")
    missing = missing_for_modes(modes, has_keep_sets, has_student)
    if len(missing) < len(dict.fromkeys(modes)):
        return
    by_keys: dict[tuple[str, ...], list[str]] = {}
    for mode, keys in missing.items():
        by_keys.setdefault(keys, []).append(mode)
    needs = "; ".join(f"{', '.join(group)} need{'s' if len(group) == 1 else ''} {' and '.join(keys)}"
                      for keys, group in by_keys.items())
    lacking = dict.fromkeys(key for keys in missing.values() for key in keys)
    raise ValueError(f"eval.modes=[{','.join(missing)}] evaluates nothing: {needs}; set "
                     f"{' and '.join(MODE_FIXES[key] for key in lacking)}, or add full to eval.modes")


# ----------------------------------------------------------------------------------------------- problems
def build_problems(
    tokenizer,
    families: Sequence[str],
    num_per_family: int,
    seed: int | None = None,
    recipe: str | Path | dict | None = None,
) -> list[Problem]:
    """`num_per_family` held-out problems of each family with the recipe's family parameters.

    `seed=None` uses the recipe's eval seed, so the first problems are exactly the recipe's eval split (which the
    training data excludes); the held-out stream is prefix-stable, so more problems extend that split.
    """
    from slimwise_train.data import synthetic

    problems = []
    for family in families:
        for example in heldout_examples(family, num_per_family, seed, recipe):
            prompt_text, answer_text = synthetic.to_text(example)
            prompt_ids = tuple(tokenizer(prompt_text, add_special_tokens=False)["input_ids"])
            answer_ids = tokenizer(answer_text, add_special_tokens=False)["input_ids"]
            problems.append(Problem(family, example.prompt, example.answer, prompt_ids, len(answer_ids) + 1))
    if not problems:
        raise ValueError(f"eval.families is empty; use some of {list(EVAL_FAMILIES())}")
    return problems


def EVAL_FAMILIES() -> tuple[str, ...]:
    """Every family the eval app can score: the suite's (math, code, tool) and the opt-in long-context ones
    (lookup, toolpick, steps, fewshot: the deep teacher's; docs/teacher.md)."""
    from slimwise_train.data import synthetic

    return (*synthetic.FAMILIES, *synthetic.LONG_FAMILIES)


def check_families(families: Sequence[str]) -> None:
    """One line naming every unknown family in eval.families (before any model loads)."""
    unknown = [f for f in families if f not in EVAL_FAMILIES()]
    if unknown or not families:
        what = f"unknown eval.families {unknown}" if unknown else "eval.families is empty"
        raise ValueError(f"{what}; use some of {list(EVAL_FAMILIES())}")


def heldout_examples(family: str, num: int, seed: int | None = None, recipe: str | Path | dict | None = None):
    """The first `num` held-out examples of one family: what the eval app and the lm-eval tasks
    (slimwise_train/lm_eval/tasks) both evaluate. `seed=None`: the recipe's eval seed."""
    from slimwise_train.data import synthetic

    if num < 1:
        raise ValueError(f"eval.num_per_family must be >= 1, got {num}")
    check_families([family])
    recipe = recipe if isinstance(recipe, dict) else synthetic.load_recipe(recipe)
    seed = int(recipe["splits"]["eval"]["seed"]) if seed is None else int(seed)
    # The long-context families are not in the recipe (it describes the small teacher's suite): their own default
    # parameters, the ones the deep teacher trained on, whose held-out problems it excluded (seed 0: the recipe's).
    return synthetic.heldout(family, num, seed, **synthetic.recipe_params(recipe).get(family, {}))


def family_budgets(problems: Sequence[Problem], budget: int | Mapping[str, int] | None = None,
                   factor: float = 2.0) -> dict[str, int]:
    """Max new tokens per family: a fixed int, a {family: int} mapping, or (None) `factor` x the longest
    reference answer of that family in tokens (incl. EOS), rounded up."""
    families = list(dict.fromkeys(p.family for p in problems))
    if budget is None:
        if factor <= 0:
            raise ValueError(f"eval.budget_factor must be > 0, got {factor}")
        return {f: max(1, math.ceil(factor * max(p.reference_length for p in problems if p.family == f)))
                for f in families}
    out = {f: int(budget[f]) for f in families} if isinstance(budget, Mapping) else {f: int(budget) for f in families}
    bad = {f: b for f, b in out.items() if b < 1}
    if bad:
        raise ValueError(f"eval.budget must be >= 1 token, got {bad}")
    return out


def check_context(problems: Sequence[Problem], budgets: Mapping[str, int], max_positions: int | None,
                  model_name: str) -> None:
    """Refuse families whose longest prompt plus budget exceeds the model's positions (max_position_embeddings):
    generation past them scores noise (the shipped teacher's 512 positions scored 0.00 on lookup prompts of up to 586
    tokens, without a word). None: the model states no limit."""
    if not max_positions:
        return
    longest: dict[str, int] = {}
    for problem in problems:
        longest[problem.family] = max(longest.get(problem.family, 0), len(problem.prompt_ids))
    over = {f: n for f, n in longest.items() if n + budgets[f] > max_positions}
    if over:
        what = "; ".join(f"{f}: prompts of up to {n} tokens + budget {budgets[f]}" for f, n in over.items())
        raise ValueError(f"eval.families: {what} exceed the {max_positions} positions of {model_name} "
                         f"(max_position_embeddings); drop {', '.join(over)} from eval.families, lower eval.budget, or "
                         "use a model with a longer context")


# ----------------------------------------------------------------------------------------------- generation
def plan_batches(problems: Sequence[Problem], batch_size: int) -> list[list[int]]:
    """Problem indices in batches: per family (one budget per batch), sorted by prompt length (stable)."""
    if batch_size < 1:
        raise ValueError(f"eval.batch_size must be >= 1, got {batch_size}")
    batches = []
    for family in dict.fromkeys(p.family for p in problems):
        idx = [i for i, p in enumerate(problems) if p.family == family]
        idx.sort(key=lambda i: len(problems[i].prompt_ids))
        batches += [idx[k : k + batch_size] for k in range(0, len(idx), batch_size)]
    return batches


def left_pad(rows: Sequence[Sequence[int]], pad_id: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, S] ids and 0/1 attention mask, padded on the left."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            ids[i, width - len(row):] = torch.tensor(row, dtype=torch.long)
            mask[i, width - len(row):] = 1
    return ids.to(device), mask.to(device)


def _device_of(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def generate_all(
    prefill_model: nn.Module,
    decode_model: nn.Module,
    problems: Sequence[Problem],
    budgets: Mapping[str, int],
    batch_size: int,
    pad_token_id: int,
    eos_token_id: int | list[int],
    prefill_phase: str = "prefill",
    decode_phase: str = "decode",
    on_batch: Callable[[], None] | None = None,
) -> list[Generation]:
    """Greedy generations for every problem, in the order of `problems`."""
    eos = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id)
    device = _device_of(prefill_model)
    out: list[Generation | None] = [None] * len(problems)
    for batch in plan_batches(problems, batch_size):
        ids, mask = left_pad([problems[i].prompt_ids for i in batch], pad_token_id, device)
        result = handoff_generate(prefill_model, decode_model, ids, mask, budgets[problems[batch[0]].family],
                                  eos_token_id, pad_token_id, prefill_phase=prefill_phase, decode_phase=decode_phase)
        tokens, lengths = result.tokens.tolist(), result.lengths.tolist()
        for row, i in enumerate(batch):
            seq = tuple(tokens[row][: lengths[row]])
            ended = bool(result.ended[row])
            assert ended == (seq[-1] in eos)
            out[i] = Generation(seq, ended, int(result.first_token[row]))
        if on_batch is not None:
            on_batch()
    return out  # type: ignore[return-value]


@torch.no_grad()
def first_tokens(model: nn.Module, problems: Sequence[Problem], batch_size: int, pad_token_id: int,
                 phase: str = "prefill", on_batch: Callable[[], None] | None = None) -> list[int]:
    """The greedy first answer token of every problem (prefill only)."""
    device = _device_of(model)
    out = [0] * len(problems)
    for batch in plan_batches(problems, batch_size):
        ids, mask = left_pad([problems[i].prompt_ids for i in batch], pad_token_id, device)
        logits, _ = prefill(model, ids, mask, phase=phase)
        for row, i in enumerate(batch):
            out[i] = int(logits[row, -1].argmax(-1))
        if on_batch is not None:
            on_batch()
    return out


# ----------------------------------------------------------------------------------------------- students
def check_student_path(path: str | Path, key: str = "eval.student") -> Path:
    """The checkpoint folder of a student (`key`: the config key or argument that named it): the folder itself, or the
    `export/` inside a training run's output folder."""
    path = Path(path)
    if not (path / "config.json").is_file() and (path / "export" / "config.json").is_file():
        path = path / "export"
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"{key}={path} is not a checkpoint folder (no config.json); point it at the student the trainer "
            "exported (<train output_dir>/export, a from_pretrained folder)"
        )
    return path


def load_student(path: str | Path, full_model: nn.Module,
                 key: str = "eval.student") -> tuple[nn.Module, KeepSet | None]:
    """(student model, the keep set it was pruned with or None) from an exported checkpoint folder: the decoder of
    slimwise_distill and the whole model of conventional_distill (as loaded: physically pruned, no masking).

    The one place that knows the student export format: a `from_pretrained` folder, optionally with
    `slimwise_keep_set.json` (as `pruning.export_pruned` and `distill.export.export_student` write). The default
    students are the stock class (the family's own shared slot widened, or LoRA merged into the kept experts); one
    with a new shared expert (distill.student.shared_expert_mode=new) is the registered `slimwise_<model_type>`
    architecture, so `slimwise_train.distill.export` is imported first. It must share the full model's vocabulary and
    layers (attention is never pruned), since slimwise_distill decodes it over the full model's cache.
    """
    from transformers import AutoModelForCausalLM

    try:  # registers the slimwise_<model_type> student classes with the Auto* factories
        import slimwise_train.distill.export  # noqa: F401
    except ImportError:  # pragma: no cover - the trainer's export module is optional here
        pass

    path = check_student_path(path, key)
    _check_distilled_from(path, full_model, key)
    param = next(full_model.parameters())
    from slimwise_train.models import from_pretrained_or_explain

    student = from_pretrained_or_explain(AutoModelForCausalLM.from_pretrained, str(path), key,
                                         dtype=param.dtype).to(param.device).eval()
    full_vocab = full_model.get_output_embeddings().weight.shape[0]
    student_vocab = student.get_output_embeddings().weight.shape[0]
    if student_vocab != full_vocab:
        raise ValueError(f"{key}={path} has a {student_vocab}-token vocabulary but the model has {full_vocab}; "
                         "it was made from another model")
    full_type, student_type = full_model.config.model_type, student.config.model_type
    full_layers = text_config(full_model).num_hidden_layers
    student_layers = text_config(student).num_hidden_layers
    if student_type not in (full_type, f"slimwise_{full_type}") or student_layers != full_layers:
        raise ValueError(f"{key}={path} is a {student_type} with {student_layers} layers but the model is a "
                         f"{full_type} with {full_layers}; it was made from another model")
    keep_file = path / "slimwise_keep_set.json"
    return student, KeepSet.load(keep_file) if keep_file.is_file() else None


def _check_distilled_from(path: Path, full_model: nn.Module, key: str) -> None:
    """A distilled export records its teacher's cache fingerprint (embeddings and attention, which distillation
    leaves alone): a student of another teacher would decode on a cache written by weights it never saw. Compared
    by content, before the student loads; an export without the record (a pruned checkpoint) is not checked."""
    from slimwise_train.utils.fingerprint import model_cache_fingerprint

    record = path / "slimwise_export.json"
    if not record.is_file():
        return
    try:
        recorded = json.loads(record.read_text()).get("cache_fingerprint")
    except (OSError, json.JSONDecodeError, AttributeError):
        raise ValueError(f"{key}={path}: {record.name} is not a JSON object; export the student again") from None
    if recorded and recorded != model_cache_fingerprint(full_model):
        raise ValueError(f"{key}={path} was distilled from another model (its teacher's embeddings and attention, "
                         f"cache fingerprint {recorded[:12]}, are not this model's): evaluate it with the model it was "
                         "trained from (the train run's model.*)")


# ----------------------------------------------------------------------------------------------- evaluate
def _keep_set_info(keep: KeepSet, path: str | None) -> dict:
    return {"path": path, "num_kept": list(keep.num_kept), "num_experts": [lk.num_experts for lk in keep],
            "top_k": [lk.top_k for lk in keep], "keep_fraction": keep.keep_fraction, "meta": keep.meta}


def eos_ids(model: nn.Module, tokenizer) -> list[int]:
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids += [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])
    ids = list(dict.fromkeys(int(i) for i in ids))
    if not ids:
        raise ValueError("the tokenizer has no EOS token; the suite's answers end with EOS")
    return ids


@torch.no_grad()
def greedy_accuracy(model: nn.Module, tokenizer, problems: Sequence[Problem], budgets: Mapping[str, int],
                    batch_size: int = 64) -> dict[str, dict]:
    """One model's greedy exact match and median output length per family: the quick check used while training
    a teacher and by the teacher's regression test (the full five-mode evaluation is `evaluate`)."""
    from slimwise_train.data.synthetic import check

    generations = generate_all(model, model, problems, budgets, batch_size, tokenizer.pad_token_id,
                               eos_ids(model, tokenizer))
    out: dict[str, dict] = {}
    for family in dict.fromkeys(p.family for p in problems):
        rows = [(p, g) for p, g in zip(problems, generations) if p.family == family]
        correct = [check(family, p.prompt, decode_output(tokenizer, g), ended=g.ended) for p, g in rows]
        out[family] = {"accuracy": sum(correct) / len(rows),
                       "median_length": sorted(g.length for _, g in rows)[len(rows) // 2]}
    return out


@torch.no_grad()
def evaluate(
    model: nn.Module,
    tokenizer,
    keep_sets: Mapping[str, KeepSet] | Sequence[KeepSet],
    modes: Sequence[str],
    problems: Sequence[Problem],
    budget: int | Mapping[str, int] | None,
    batch_size: int,
    *,
    budget_factor: float = 2.0,
    student: tuple[nn.Module, KeepSet | None] | None = None,
    keep_set_paths: Mapping[str, str] | None = None,
    progress: bool = False,
) -> dict:
    """Run every requested mode for every keep set; returns the results dict: summary `rows` (one per keep set,
    mode and family incl. `all`; the full model's rows have keep_set None) and per-problem `runs` (lengths, ended,
    correct, first tokens, output `text`), plus budgets, keep set info and notes.

    `model` is the full model (no masking installed); `keep_sets` maps a name to a keep set (a sequence gets names
    ks0, ks1, ...). `student` is `load_student`'s pair for slimwise_distill (the full model prefills, the student
    decodes) and conventional_distill (the student alone prefills and decodes). Modes that cannot run (no keep set, no
    student) are skipped with a note in `results["notes"]`; none that can run is an error (`check_modes_run`).
    """
    from tqdm.auto import tqdm

    check_modes_run(modes, bool(keep_sets), student is not None)
    if get_masking(model) is not None:
        raise ValueError("evaluate() wants the full model without PhaseMasking; it installs masking per keep set")
    if not isinstance(keep_sets, Mapping):
        keep_sets = {f"ks{i}": k for i, k in enumerate(keep_sets)}
    for name, keep in keep_sets.items():
        try:
            keep.check_model(model)
        except ValueError as exc:
            raise ValueError(f"keep set {name}: {exc}") from None
    modes = list(dict.fromkeys(modes))
    budgets = family_budgets(problems, budget, budget_factor)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    eos = eos_ids(model, tokenizer)
    notes: list[str] = []

    def note(text: str) -> None:
        notes.append(text)
        log.info("note: %s", text)

    pruned_modes = [m for m in modes if m != "full"]
    if not keep_sets and pruned_modes:
        note(f"no keep sets given: only the full model runs (skipped {', '.join(pruned_modes)})")
    # which keep sets run the student's modes (slimwise_distill, conventional_distill)
    student_modes = [m for m in modes if m in STUDENT_MODES]
    distill_under: list[str] = []
    if student_modes and keep_sets:
        if student is None:
            note(f"{', '.join(student_modes)} skipped: no student checkpoint (set eval.student=<folder>)")
        else:
            student_keep = student[1]
            if student_keep is None:
                distill_under = list(keep_sets)
                note(f"the student carries no slimwise_keep_set.json; {', '.join(student_modes)} ran under every "
                     "keep set")
            else:
                distill_under = [n for n, k in keep_sets.items() if k == student_keep]
                if not distill_under:
                    raise ValueError(
                        f"eval.student was pruned with a keep set (kept per layer {list(student_keep.num_kept)}) that "
                        "is none of eval.keep_sets; add its keep set to eval.keep_sets"
                    )
    elif student is not None and not student_modes:
        note(f"eval.student is set but none of {', '.join(STUDENT_MODES)} is in eval.modes; the student was not "
             "evaluated")

    runs_plan: list[tuple[str | None, str]] = [(None, "full")] if "full" in modes else []
    for name in keep_sets:
        for mode in pruned_modes:
            if mode in STUDENT_MODES and name not in distill_under:
                continue
            runs_plan.append((name, mode))
    batches_per_pass = len(plan_batches(problems, batch_size))
    total = batches_per_pass * (len(runs_plan) + (0 if "full" in modes else 1))
    bar = tqdm(total=total, desc="eval", unit="batch", disable=not progress, dynamic_ncols=True)

    runs: list[dict] = []
    full_gens: list[Generation] | None = None
    if "full" in modes:
        bar.set_description("eval full")
        full_gens = generate_all(model, model, problems, budgets, batch_size, pad_id, eos, "prefill", "prefill",
                                 on_batch=lambda: bar.update(1))
        full_first = [g.first_token for g in full_gens]
    else:
        bar.set_description("eval full first tokens")
        full_first = first_tokens(model, problems, batch_size, pad_id, on_batch=lambda: bar.update(1))
    if full_gens is not None:
        runs.append({"keep_set": None, "mode": "full", "generations": full_gens})

    # A mode that never touches the masked model (the student alone) gives the same outputs under every keep set.
    unmasked: dict[str, list[Generation]] = {}
    for name, keep in keep_sets.items():
        masking = PhaseMasking(model, keep)
        try:
            for run_name, mode in runs_plan:
                if run_name != name:
                    continue
                bar.set_description(f"eval {name} {mode}")
                prefill_phase, decode_phase = MODE_PHASES[mode]
                prefiller, decoder = (student[0] if role == "student" else model for role in MODE_MODELS[mode])
                if "model" not in MODE_MODELS[mode] and mode in unmasked:
                    gens = unmasked[mode]
                    bar.update(batches_per_pass)
                else:
                    gens = generate_all(prefiller, decoder, problems, budgets, batch_size, pad_id, eos, prefill_phase,
                                        decode_phase, on_batch=lambda: bar.update(1))
                if "model" not in MODE_MODELS[mode]:
                    unmasked[mode] = gens
                runs.append({"keep_set": name, "mode": mode, "generations": gens})
        finally:
            masking.remove()
    bar.close()

    rows, run_records = [], []
    for run in runs:
        record = score_run(problems, run["generations"], tokenizer, full_first, full_gens)
        for family, metrics in summarize(problems, record, budgets).items():
            rows.append({"keep_set": run["keep_set"], "mode": run["mode"], "family": family, **metrics})
        run_records.append({"keep_set": run["keep_set"], "mode": run["mode"], **record})
    families = list(dict.fromkeys(p.family for p in problems))
    return {
        "format": FORMAT,
        "families": families,
        "num_problems": {f: sum(p.family == f for p in problems) for f in families},
        "budget": budgets,
        "budget_rule": (f"{budget_factor} x the longest reference answer (tokens incl. EOS) per family"
                        if budget is None else "fixed"),
        "modes": [m for m in modes if any(r["mode"] == m for r in runs)],
        "mode_descriptions": {m: MODE_DESCRIPTIONS[m] for m in modes},
        "keep_sets": {n: _keep_set_info(k, (keep_set_paths or {}).get(n)) for n, k in keep_sets.items()},
        "eos_token_ids": eos,
        "rows": rows,
        "metric_definitions": METRIC_DEFINITIONS,
        "notes": notes,
        "problems": [{"family": p.family, "prompt": p.prompt, "reference_length": p.reference_length}
                     for p in problems],
        "runs": run_records,
    }

"""`python -m slimwise_train.eval`: greedy accuracy and output lengths on the held-out synthetic suite under
the full, conventional, slimwise, reverse, conventional_distill and slimwise_distill modes of one or more keep sets.

    python -m slimwise_train.eval model=tiny_qwen3_moe \\
        eval.keep_sets=[outputs/prune/tiny_qwen3_moe/reap-r0.5/keep_set.json]
    python -m slimwise_train.eval ... eval.student=outputs/train/student eval.num_per_family=50 logger=wandb

Writes into output_dir (each file atomically, only after every generation is done):
  results.json            per (keep set, mode, family) metrics rows, per-problem lengths/ended/correct, notes
  report.md               one table per keep set: rows = modes, cells = acc / median / p90 / hit-budget
  lengths_<keep set>.png  output-length CDFs per family, one line per mode
  tradeoff_<keep set>.png accuracy vs decode speed-up per mode (the expert-bytes bound at batch 64, not measured)
  family_accuracy_<keep set>.png  accuracy bars per family and pooled, one bar per mode
  eval_config.yaml        the resolved config
  generations.jsonl       every output text (eval.save_generations=true)
See `slimwise_train.eval.metrics` for the metric definitions.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from slimwise_train.config import (CONF_DIR, EvalAppConfig, check_known_keys, register_configs, to_container,
                                   wandb_mode)
from slimwise_train.utils import distributed as du
from slimwise_train.utils.cli import hydra_app, user_errors
from slimwise_train.utils.rundir import check_outputs_spare_inputs, check_writable, die_with_launcher

log = logging.getLogger("slimwise.eval")


def keep_set_name(path: str | Path, taken: set[str]) -> str:
    """A short unique name: the folder of a `keep_set.json` (e.g. `reap-r0.5`), else the file stem."""
    from slimwise_train.eval.report import safe_name

    path = Path(path)
    base = safe_name(path.parent.name if path.stem == "keep_set" and path.parent.name else path.stem)
    name, k = base, 2
    while name in taken:
        name, k = f"{base}-{k}", k + 1
    taken.add(name)
    return name


def validate_eval_config(cfg) -> None:
    from slimwise_train.eval.generation import STUDENT_MODES, check_families, check_modes_run, check_student_path
    from slimwise_train.models import resolve_path

    check_known_keys(cfg, EvalAppConfig)
    check_writable(Path(cfg.output_dir), create=False)
    out = Path(cfg.output_dir)
    check_outputs_spare_inputs(
        {name: out / name for name in ("results.json", "report.md", "eval_config.yaml", "generations.jsonl")},
        {"model.path": resolve_path(cfg.model.path), "model.tokenizer": resolve_path(cfg.model.tokenizer),
         "eval.student": cfg.eval.student, "eval.recipe": cfg.eval.recipe,
         **{f"eval.keep_sets[{i}]": path for i, path in enumerate(cfg.eval.keep_sets)}})
    ev = cfg.eval
    # unknown or empty eval.modes, or none that can run with these keep sets and student (before the model loads)
    check_modes_run(list(ev.modes), bool(ev.keep_sets), bool(ev.student))
    check_families(list(ev.families))
    if ev.num_per_family < 1:
        raise ValueError(f"eval.num_per_family must be >= 1, got {ev.num_per_family}")
    if ev.batch_size < 1:
        raise ValueError(f"eval.batch_size must be >= 1, got {ev.batch_size}")
    if ev.budget is not None:
        budgets = dict(ev.budget) if OmegaConf.is_dict(ev.budget) or isinstance(ev.budget, dict) else {"*": ev.budget}
        unknown = sorted(set(budgets) - {"*", *ev.families})
        if unknown:
            raise ValueError(f"eval.budget names families {unknown} that are not in eval.families {list(ev.families)}")
        missing = [] if "*" in budgets else [f for f in ev.families if f not in budgets]
        if missing:
            raise ValueError(f"eval.budget gives no budget for {missing}; give every family in eval.families one")
        bad = {f: b for f, b in budgets.items() if not isinstance(b, int) or isinstance(b, bool) or b < 1}
        if bad:
            raise ValueError(f"eval.budget must be >= 1 token per family (or null for {ev.budget_factor} x the longest "
                             f"answer), got {bad if '*' not in bad else ev.budget}")
    if ev.student and any(mode in STUDENT_MODES for mode in ev.modes):
        check_student_path(ev.student)


def load_keep_sets(cfg) -> tuple[dict, dict]:
    """({name: KeepSet}, {name: path}) of eval.keep_sets, each one this run may use (moe/keepset_rules.py: the file,
    its family, the weights it was scored on), checked with the model's config and weight files before the weights
    load; FileNotFoundError / ValueError name the key and the file."""
    from slimwise_train.models import load_config, model_weights
    from slimwise_train.moe.keepset_rules import keep_set_for_run

    if not cfg.eval.keep_sets:
        return {}, {}
    config, weights = load_config(cfg.model), model_weights(cfg.model)
    keep_sets, where, taken = {}, {}, set()
    for path in cfg.eval.keep_sets:
        keep = keep_set_for_run(path, "eval.keep_sets", config=config, model=weights,
                                allow_foreign=bool(cfg.eval.allow_foreign_keep_set),
                                allow_key="eval.allow_foreign_keep_set")
        name = keep_set_name(path, taken)
        keep_sets[name], where[name] = keep, str(path)
    return keep_sets, where


FIGURES = (("lengths", "output-length CDF per family"), ("tradeoff", "accuracy vs decode speed-up"),
           ("family_accuracy", "accuracy per family"))


def write_figures(results: dict, out: Path) -> dict[str | None, list[tuple[str, Path]]]:
    """`<figure>_<keep set>.png` for every figure in FIGURES and every keep set (`full` without one):
    {keep set name or None: [(caption, path)]}."""
    from slimwise_train.eval.plots import plot_family_accuracy, plot_lengths, plot_tradeoff

    plot = {"lengths": plot_lengths, "tradeoff": plot_tradeoff, "family_accuracy": plot_family_accuracy}
    images = {}
    for name in list(results["keep_sets"]) or [None]:
        images[name] = []
        for figure, caption in FIGURES:
            path = out / f"{figure}_{name or 'full'}.png"
            plot[figure](results, name, path)
            images[name].append((caption, path))
    return images


def log_to_wandb(cfg, results: dict, images: dict[str | None, list[tuple[str, Path]]]) -> None:
    import wandb

    from slimwise_train.eval.report import wandb_rows, wandb_summary

    # One keep set: the run is named after it (reap-r0.5, like its training run); logger.group joins a train sweep.
    keep_sets = list(results["keep_sets"])
    run = wandb.init(project=cfg.logger.project, entity=cfg.logger.entity, group=cfg.logger.get("group"),
                     name=cfg.logger.get("run_name") or (keep_sets[0] if len(keep_sets) == 1 else None),
                     mode=wandb_mode(cfg.logger),
                     tags=list(cfg.logger.tags), job_type="eval", dir=str(cfg.output_dir), config=to_container(cfg))
    columns, data = wandb_rows(results)
    payload = {"eval/results": wandb.Table(columns=columns, data=data)}
    # eval/lengths_<keep set>, eval/tradeoff_<keep set>, eval/family_accuracy_<keep set>: one media panel each
    payload.update({f"eval/{path.stem}": wandb.Image(str(path), caption=caption)
                    for figures in images.values() for caption, path in figures})
    payload.update(wandb_summary(results))  # accuracy / median / p90 length per mode: panels and the run summary
    run.log(payload)
    run.finish()


def run_eval(cfg) -> dict:
    """The whole eval job; returns the results dict. Importable for tests and notebooks."""
    from slimwise_train.eval.generation import (STUDENT_MODES, build_problems, check_context, evaluate,
                                                family_budgets, load_student)
    from slimwise_train.eval.report import render_markdown
    from slimwise_train.models import load_model, model_identity
    from slimwise_train.moe.keepset_rules import check_fits
    from slimwise_train.utils.atomic import atomic_path, write_json_atomic, write_text_atomic
    from slimwise_train.utils.hf import text_config

    start = time.perf_counter()
    validate_eval_config(cfg)
    keep_sets, keep_paths = load_keep_sets(cfg)
    model, tokenizer = load_model(cfg.model, cfg.device)
    for name, keep in keep_sets.items():
        check_fits(keep, model, f"eval.keep_sets={keep_paths[name]}")
    student = None
    if cfg.eval.student and any(mode in STUDENT_MODES for mode in cfg.eval.modes) and keep_sets:
        student = load_student(cfg.eval.student, model)
    problems = build_problems(tokenizer, list(cfg.eval.families), cfg.eval.num_per_family, cfg.eval.seed,
                              cfg.eval.recipe)
    budget = dict(cfg.eval.budget) if OmegaConf.is_dict(cfg.eval.budget) else cfg.eval.budget
    check_context(problems, family_budgets(problems, budget, cfg.eval.budget_factor),
                  getattr(text_config(model), "max_position_embeddings", None), model_identity(cfg.model))
    results = evaluate(model, tokenizer, keep_sets, list(cfg.eval.modes), problems, budget,
                       cfg.eval.batch_size, budget_factor=cfg.eval.budget_factor, student=student,
                       keep_set_paths=keep_paths, progress=cfg.progress and du.is_rank0())
    results["model"] = model_identity(cfg.model)
    results["student"] = cfg.eval.student if student is not None else None
    results["elapsed_s"] = round(time.perf_counter() - start, 3)
    texts = [run.pop("text") for run in results["runs"]]
    if du.is_rank0():
        out = Path(cfg.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        images = write_figures(results, out)
        links = {name: [(caption, path.name) for caption, path in figures] for name, figures in images.items()}
        header = [f"model: {results['model']}"] + ([f"student: {results['student']}"] if results["student"] else [])
        write_text_atomic(out / "report.md", render_markdown(results, header_lines=header, images=links))
        write_text_atomic(out / "eval_config.yaml", OmegaConf.to_yaml(cfg))
        if cfg.eval.save_generations:
            with atomic_path(out / "generations.jsonl") as tmp, open(tmp, "w") as f:
                for run, run_texts in zip(results["runs"], texts):
                    for problem, text, length, ended, correct in zip(results["problems"], run_texts, run["length"],
                                                                     run["ended"], run["correct"]):
                        f.write(json.dumps({"keep_set": run["keep_set"], "mode": run["mode"], **problem,
                                            "output": text, "length": length, "ended": ended,
                                            "correct": correct}) + "\n")
        write_json_atomic(out / "results.json", results)
        if cfg.logger.name == "wandb":
            log_to_wandb(cfg, results, images)
        for row in results["rows"]:
            if row["family"] == "all":
                log.info("%-10s %-16s acc %.3f  median %s  p90 %s  hit-budget %.3f  first-token %.3f",
                         row["keep_set"] or "-", row["mode"], row["accuracy"], row["median_length"],
                         row["p90_length"], row["hit_budget"], row["first_token_agreement_with_full"])
        log.info("wrote %s", out)
    du.barrier()
    return results


register_configs()


@hydra_app(CONF_DIR, "eval", "slimwise_train.eval", schema=EvalAppConfig, check=check_known_keys,
           interrupted="nothing was written (eval writes its outputs once every generation is done)")
def main(cfg: DictConfig) -> None:
    die_with_launcher()
    with du.job_process_group(), user_errors("slimwise_train.eval"):
        run_eval(cfg)


"""The report figures (`slimwise_train.eval.plots`) on small synthetic results dicts and a hand-written
metrics.jsonl: each writes a PNG, and the figure holds what it claims (captured by patching plt.close)."""

from __future__ import annotations

import json

import matplotlib
import pytest

matplotlib.use("Agg", force=True)
import matplotlib.pyplot as plt  # noqa: E402

from slimwise_train.eval import plots  # noqa: E402
from slimwise_train.eval.report import expert_bytes_bound, touched_experts  # noqa: E402

FAMILIES = ("math", "code", "tool")
MODES = ("full", "conventional", "slimwise", "reverse", "conventional_distill", "slimwise_distill")
DESCRIPTIONS = {"full": "full prefill, full decode", "conventional": "pruned prefill, pruned decode",
                "slimwise": "full prefill, pruned decode", "reverse": "pruned prefill, full decode",
                "conventional_distill": "distilled student prefill, distilled student decode",
                "slimwise_distill": "full prefill, distilled student decode"}
ACCURACY = {"full": (0.9, 0.8, 1.0), "conventional": (0.5, 0.4, 0.1), "slimwise": (0.5, 0.4, 0.1),
            "reverse": (0.9, 0.8, 0.9), "conventional_distill": (0.6, 0.5, 0.3), "slimwise_distill": (0.7, 0.6, 0.5)}
BUDGET = {"math": 60, "code": 90, "tool": 40}
PNG = b"\x89PNG\r\n\x1a\n"


def _results(keep_fraction=0.5, num_kept=8, name="k", top_k=True) -> dict:
    problems, per_family = [], 4
    for f in FAMILIES:
        problems += [{"family": f, "reference_length": 20 + 3 * i} for i in range(per_family)]
    rows, runs = [], []
    for mode, accs in ACCURACY.items():
        keep = None if mode == "full" else name
        for family, acc in zip(FAMILIES, accs):
            rows.append({"keep_set": keep, "mode": mode, "family": family, "n": per_family, "accuracy": acc})
        rows.append({"keep_set": keep, "mode": mode, "family": "all", "n": 3 * per_family,
                     "accuracy": sum(accs) / 3})
        # full and reverse, conventional and slimwise: equal lengths (the curves that used to hide each other)
        base = 21 if mode in ("full", "reverse") else 24
        runs.append({"keep_set": keep, "mode": mode,
                     "length": [base + 3 * (i % per_family) for i in range(len(problems))]})
    info = {"num_kept": [num_kept, num_kept], "num_experts": [16, 16], "keep_fraction": keep_fraction}
    if top_k:
        info["top_k"] = [2, 2]
    return {"families": list(FAMILIES), "budget": dict(BUDGET), "modes": list(MODES), "rows": rows, "runs": runs,
            "problems": problems, "keep_sets": {name: info}, "mode_descriptions": dict(DESCRIPTIONS), "notes": []}


@pytest.fixture
def capture(monkeypatch):
    """The figures the plot functions close: kept open for the test to read, closed after it."""
    real_close, figures = plt.close, []
    monkeypatch.setattr(plt, "close", lambda fig: figures.append(fig))
    yield figures
    for fig in figures:
        real_close(fig)


def _png(path):
    data = path.read_bytes()
    assert data[:8] == PNG and len(data) > 5_000


# ----------------------------------------------------------------------------------------------- lengths
def test_length_cdf_spans_the_data_and_shows_the_reference_and_every_mode(tmp_path, capture):
    plots.plot_lengths(_results(), "k", tmp_path / "lengths.png")
    _png(tmp_path / "lengths.png")
    (fig,) = capture
    assert len(fig.axes) == len(FAMILIES)
    longest = 33  # the outputs run 21..30 and 24..33 tokens, the references 20..29
    for ax, family in zip(fig.axes, FAMILIES):
        lo, hi = ax.get_xlim()
        # not from 0: from ~0.8x the shortest length (20 reference, 21 output) ...
        assert lo == pytest.approx(0.8 * 20) and 0 < lo < 20
        lines = {line.get_label(): line for line in ax.get_lines()}
        if family == "tool":  # ... to a little past a budget near the data (40 <= 1.25 x 33), with its line
            assert BUDGET[family] < hi <= BUDGET[family] * 1.1
            assert lines[f"budget {BUDGET[family]}"].get_xdata()[0] == BUDGET[family]
        else:  # ... or past the longest length, a far budget named in the title (no empty half axis)
            assert longest < hi <= longest * 1.1 and hi < BUDGET[family]
            assert f"budget {BUDGET[family]}" in ax.get_title() and "right of the axis" in ax.get_title()
            assert f"budget {BUDGET[family]}" not in lines
        assert set(MODES) <= set(lines) and "reference answers" in lines
        reference = lines["reference answers"]
        # the reference: wide, coloured (not grey), under the modes; full on top of the other modes
        assert reference.get_linewidth() >= 4 and matplotlib.colors.to_hex(reference.get_color()) != "#808080"
        assert reference.get_zorder() < min(lines[m].get_zorder() for m in MODES)
        assert lines["full"].get_zorder() > max(lines[m].get_zorder() for m in MODES if m != "full")
        mode_lines = [lines[m] for m in MODES]
        assert len({line.get_color() for line in mode_lines}) == len(MODES)
        assert len({(line.get_linestyle(), line.get_marker()) for line in mode_lines}) == len(MODES)
        assert all(line.get_alpha() < 1 for line in mode_lines)
        assert len({tuple(line.get_ydata()) for line in mode_lines}) == len(MODES)  # equal ones apart
        assert ax.get_legend() is not None


def test_length_cdf_without_references_and_unknown_modes(tmp_path, capture):
    """lm-eval results know no references and name their student modes otherwise; the styles stay distinct."""
    results = _results()
    for p in results["problems"]:
        p["reference_length"] = None
    names = {"conventional_distill": "conventional_distilled", "slimwise_distill": "distilled", "reverse": "other"}
    for run in results["runs"]:
        run["mode"] = names.get(run["mode"], run["mode"])
    plots.plot_lengths(results, "k", tmp_path / "lengths.png")
    (fig,) = capture
    lines = [line for line in fig.axes[0].get_lines() if not line.get_label().startswith("budget")]
    assert "reference answers" not in [line.get_label() for line in lines]
    assert len({(line.get_linestyle(), line.get_marker()) for line in lines}) == len(lines) == len(MODES)


def test_the_length_plot_has_one_home(tmp_path):
    """plot_lengths is defined in eval/plots.py only: report.py re-exporting it made an import cycle."""
    import slimwise_train.eval.report as report

    assert not hasattr(report, "plot_lengths")
    plots.plot_lengths(_results(), "k", tmp_path / "lengths.png")
    _png(tmp_path / "lengths.png")


# ----------------------------------------------------------------------------------------------- trade-off
def _points(ax) -> dict[str, tuple[float, float]]:
    return {line.get_label(): (line.get_xdata()[0], line.get_ydata()[0]) for line in ax.get_lines()
            if line.get_label() in MODES}


def test_tradeoff_places_each_mode_at_its_decoders_bound(tmp_path, capture):
    results = _results()
    plots.plot_tradeoff(results, "k", tmp_path / "tradeoff.png")
    _png(tmp_path / "tradeoff.png")
    (fig,) = capture
    (ax,) = fig.axes
    bound = touched_experts(16, 2, 64) / touched_experts(8, 2, 64)
    assert expert_bytes_bound(results["keep_sets"]["k"]) == pytest.approx(bound)
    points = _points(ax)
    assert set(points) == set(MODES)
    for mode, (x, y) in points.items():
        pruned_decode = mode in ("conventional", "slimwise", "conventional_distill", "slimwise_distill")
        assert x == pytest.approx(bound if pruned_decode else 1.0), mode
        assert y == pytest.approx(sum(ACCURACY[mode]) / 3), mode
    assert ax.get_xlabel() == "decode speed-up: expert-bytes bound at batch 64 (not measured)"
    assert "accuracy" in ax.get_ylabel()
    lo, hi = ax.get_ylim()
    assert lo == 0 and 1 <= hi <= 1.06
    # every point is labelled with its mode, pooled accuracy and each family's
    texts = [t.get_text() for t in ax.texts]
    for mode in MODES:
        label = f"{mode}  {sum(ACCURACY[mode]) / 3:.2f}\n" + "  ".join(
            f"{f[0]} {a:.2f}" for f, a in zip(FAMILIES, ACCURACY[mode]))
        assert label in texts, (mode, texts)
    # per family: a small tick per (mode, family) at the family's accuracy, beside the mode's x
    ticks = {line.get_color(): line for line in ax.get_lines() if line.get_marker() == "_"}
    assert len(ticks) == len(MODES)
    for mode in MODES:
        tick = ticks[plots.mode_styles(MODES)[mode]["color"]]
        assert sorted(tick.get_ydata()) == pytest.approx(sorted(ACCURACY[mode]))
        assert all(abs(x - points[mode][0]) < 0.05 for x in tick.get_xdata())


def test_tradeoff_with_measured_speedups_says_so(tmp_path, capture):
    speedups = {"conventional": 1.4, "slimwise": 1.4, "slimwise_distill": 1.3}
    plots.plot_tradeoff(_results(), "k", tmp_path / "tradeoff.png", speedups=speedups)
    (fig,) = capture
    (ax,) = fig.axes
    assert ax.get_xlabel() == "measured decode-step speed-up"
    points = _points(ax)
    # a pruned-decode mode without a measurement is left out (never mixed with the bound), and the title says so
    assert {m: x for m, (x, _) in points.items()} == {"full": 1.0, "reverse": 1.0, "conventional": 1.4,
                                                       "slimwise": 1.4, "slimwise_distill": 1.3}
    assert "conventional_distill: no measured speed-up given" in ax.get_title()


def test_tradeoff_of_old_results_without_top_k_and_of_the_full_model_only(tmp_path, capture):
    plots.plot_tradeoff(_results(top_k=False), "k", tmp_path / "old.png")
    assert set(_points(capture[-1].axes[0])) == {"full", "reverse"}
    full_only = _results()
    full_only["rows"] = [r for r in full_only["rows"] if r["mode"] == "full"]
    full_only["keep_sets"] = {}
    plots.plot_tradeoff(full_only, None, tmp_path / "full.png")
    _png(tmp_path / "full.png")
    assert _points(capture[-1].axes[0]) == {"full": (1.0, pytest.approx(0.9))}


# ----------------------------------------------------------------------------------------------- family bars
def test_family_accuracy_has_a_bar_per_mode_and_group_and_the_full_reference(tmp_path, capture):
    plots.plot_family_accuracy(_results(), "k", tmp_path / "family.png")
    _png(tmp_path / "family.png")
    (fig,) = capture
    (ax,) = fig.axes
    groups = [*FAMILIES, "all"]
    assert [t.get_text().split("\n")[0] for t in ax.get_xticklabels()] == groups
    assert len(ax.containers) == len(MODES)
    for container, mode in zip(ax.containers, MODES):
        assert container.get_label() == mode
        heights = [bar.get_height() for bar in container]
        assert heights == pytest.approx([*ACCURACY[mode], sum(ACCURACY[mode]) / 3])
    assert len(ax.patches) == len(MODES) * len(groups)
    reference = [c for c in ax.collections if c.get_label() == "full model (reference)"]
    assert len(reference) == 1
    full_levels = sorted(seg[0][1] for c in ax.collections for seg in c.get_segments())  # the hlines
    assert full_levels == pytest.approx(sorted([*ACCURACY["full"], sum(ACCURACY["full"]) / 3]))
    assert ax.get_ylabel() == "accuracy"
    assert len(ax.texts) == len(MODES) * len(groups)  # value labels


# ----------------------------------------------------------------------------------------------- training
def _metrics(path, losses, evals, extra=()):
    lines = [json.dumps({"step": 0, "trainable_params": 10, "trainable_share": 0.1})]
    for step, loss in evals.items():
        if step == 0:
            lines.append(json.dumps({"step": 0, "eval/loss": loss, "eval/ce": 5.0, "eval/kl": 0.1}))
    for step, loss in enumerate(losses, start=1):
        lines.append(json.dumps({"step": step, "loss": loss, "ce": 5.0, "kl": 0.1, "lr": 1e-3}))
        if step in evals:
            lines.append(json.dumps({"step": step, "eval/loss": evals[step], "eval/ce": 5.0, "eval/kl": 0.1}))
    lines += list(extra)
    path.write_text("\n".join(lines) + "\n")
    return path


def test_training_curves_raw_smoothed_and_held_out(tmp_path, capture):
    losses = [1.0 - 0.01 * s + (0.05 if s % 2 else -0.05) for s in range(1, 31)]
    evals = {0: 1.02, 10: 0.93, 20: 0.84, 30: 0.75}
    metrics = _metrics(tmp_path / "metrics.jsonl", losses, evals,
                       extra=['{"step": 31, "loss": NaN}', '{"step": 32, "lo'])  # a NaN and a cut last line
    plots.plot_training_curves(metrics, tmp_path / "curves.png")
    _png(tmp_path / "curves.png")
    (fig,) = capture
    (ax,) = fig.axes
    lines = {line.get_label(): line for line in ax.get_lines()}
    raw = lines["train loss (each logged step, on its own training batch)"]
    assert list(raw.get_xdata()) == list(range(1, 31)) and list(raw.get_ydata()) == pytest.approx(losses)
    (smoothed,) = [line for label, line in lines.items() if label.startswith("train loss, smoothed")]
    assert list(smoothed.get_xdata()) == list(range(1, 31))
    ys = list(smoothed.get_ydata())
    assert ys == pytest.approx(plots.ema(losses, plots.smoothing_span(30)))
    assert ys[0] == pytest.approx(losses[0])  # bias-corrected: starts at the first value
    jumps = lambda v: sum(abs(a - b) for a, b in zip(v, v[1:]))  # noqa: E731
    assert jumps(ys) < 0.5 * jumps(losses)  # smoother than the raw line
    held = lines["held-out loss (eval/loss: the same held-out sequences each time)"]
    assert list(held.get_xdata()) == list(evals) and list(held.get_ydata()) == pytest.approx(list(evals.values()))
    assert ax.get_yscale() == "linear" and ax.get_xlabel() == "optimizer step"
    assert "1 unreadable lines skipped" in ax.get_title()


def test_training_curves_say_that_train_and_held_out_are_on_different_sequences(tmp_path, capture):
    """The demo's case: the train batches sit below the held-out set from the start (0.27 vs 0.60 before training),
    so the train curve lies flat below the held-out one; the figure rings both starts and writes each curve's change
    from its own start, the numbers of the file."""
    losses = [0.27] + [0.15 - 0.0005 * s for s in range(2, 101)]
    evals = {0: 0.60, 50: 0.25, 100: 0.15}
    plots.plot_training_curves(_metrics(tmp_path / "metrics.jsonl", losses, evals), tmp_path / "curves.png")
    _png(tmp_path / "curves.png")
    fig = capture[-1]
    (ax,) = fig.axes
    (ring,) = [line for line in ax.get_lines() if line.get_label().startswith("before training")]
    assert list(ring.get_xdata()) == [1, 0] and list(ring.get_ydata()) == [0.27, 0.60]
    (note,) = [t.get_text() for t in fig.texts]
    end = plots.ema(losses, plots.smoothing_span(len(losses)))[-1]
    assert "different sequences" in note
    assert f"train 0.27 at step 1 -> {end:.3g} smoothed ({end / 0.27 - 1:+.0%})" in note
    assert "held-out 0.6 at step 0 -> 0.15 at step 100 (-75%)" in note
    # a resumed run (no step 1, no step 0 evaluation) has no start to read each curve against: no note
    assert plots.start_to_end({6: 0.2, 7: 0.19}, {7: 0.3}) is None


def test_the_smoothed_train_loss_weights_each_step_by_its_loss_tokens(tmp_path, capture):
    """A step with a few loss tokens logs a mean far from the rest (the demo's 1e-4 among 0.1s): weighted by loss
    tokens the trend stays where the tokens are, as the slow reference (a plain weighted EMA) says, and the axis stays
    linear."""
    losses = [0.1 if s % 5 else 1e-4 for s in range(1, 41)]
    tokens = [400 if s % 5 else 20 for s in range(1, 41)]
    rows = [json.dumps({"step": s, "loss": v, "loss_tokens": t}) for s, v, t in zip(range(1, 41), losses, tokens)]
    (tmp_path / "m.jsonl").write_text("\n".join(rows) + "\n")
    plots.plot_training_curves(tmp_path / "m.jsonl", tmp_path / "m.png")
    (ax,) = capture[-1].axes
    (smoothed,) = [line for line in ax.get_lines() if line.get_label().startswith("train loss, smoothed")]
    assert "weighted by their loss tokens" in smoothed.get_label()
    alpha, num, den, expected = 2 / (plots.smoothing_span(40) + 1), 0.0, 0.0, []
    for v, t in zip(losses, tokens):
        num, den = (1 - alpha) * num + alpha * t * v, (1 - alpha) * den + alpha * t
        expected.append(num / den)
    assert list(smoothed.get_ydata()) == pytest.approx(expected)
    assert min(smoothed.get_ydata()) > 0.08 and ax.get_yscale() == "linear"


def test_training_curves_go_log_over_a_decade_and_keep_a_resumed_steps_last_value(tmp_path, capture):
    losses = [10.0 * 0.8 ** s for s in range(20)]  # 10 -> ~0.14: two decades
    metrics = _metrics(tmp_path / "metrics.jsonl", losses, {20: 0.2},
                       extra=[json.dumps({"step": 20, "loss": 0.15})])  # resumed: step 20 logged again
    plots.plot_training_curves(metrics, tmp_path / "curves.png")
    (ax,) = capture[-1].axes
    assert ax.get_yscale() == "log" and "log" in ax.get_ylabel()
    raw = next(line for line in ax.get_lines() if line.get_label().startswith("train loss (each logged step"))
    assert len(raw.get_xdata()) == 20 and raw.get_ydata()[-1] == 0.15
    # a few steps with a handful of loss tokens log losses near 0: they alone do not make the axis log
    spikes = [1e-6 if s in (5, 40) else 0.7 + 0.01 * (s % 3) for s in range(1, 61)]
    plots.plot_training_curves(_metrics(tmp_path / "spiky.jsonl", spikes, {60: 0.72}), tmp_path / "spiky.png")
    assert capture[-1].axes[0].get_yscale() == "linear"
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"step": 0, "trainable_params": 1}) + "\n")
    with pytest.raises(ValueError, match="no 'loss' or 'eval/loss' rows"):
        plots.plot_training_curves(empty, tmp_path / "none.png")
    assert not (tmp_path / "none.png").exists()


# ----------------------------------------------------------------------------------------------- sweep
def _sweep(modes=("full", "conventional", "slimwise", "reverse")):
    results = {"modes": list(modes), "keep_sets": {}, "rows": []}
    results["rows"].append({"keep_set": None, "mode": "full", "family": "all", "accuracy": 0.9})
    for kept in (14, 12, 8):
        name = f"r{kept}"
        results["keep_sets"][name] = {"num_kept": [kept] * 2, "num_experts": [16] * 2, "top_k": [2, 2],
                                      "keep_fraction": kept / 16}
        for mode in modes[1:]:
            results["rows"].append({"keep_set": name, "mode": mode, "family": "all", "accuracy": kept / 16 - 0.1})
            results["rows"].append({"keep_set": name, "mode": mode, "family": "math", "accuracy": 0.0})
    return results


def test_accuracy_vs_ratio_one_line_per_mode_and_criterion(tmp_path, capture):
    plots.plot_accuracy_vs_ratio({"reap": _sweep()}, tmp_path / "sweep.png")
    _png(tmp_path / "sweep.png")
    (ax,) = capture[-1].axes
    (top,) = ax.child_axes  # the secondary x axis: each ratio's expert-bytes bound
    lines = {line.get_label(): line for line in ax.get_lines() if not line.get_label().startswith("_")}
    assert set(lines) == {"conventional", "slimwise", "reverse", "full model 0.90"}
    assert list(lines["slimwise"].get_xdata()) == pytest.approx([0.125, 0.25, 0.5])
    assert list(lines["slimwise"].get_ydata()) == pytest.approx([0.775, 0.65, 0.4])
    assert ax.get_xlabel().startswith("pruning ratio") and ax.get_ylim() == (0, 1)
    assert [t.get_text() for t in top.get_xticklabels()] == [
        f"{touched_experts(16, 2, 64) / touched_experts(k, 2, 64):.2f}x" for k in (14, 12, 8)]
    plots.plot_accuracy_vs_ratio({"reap": _sweep(), "mass": _sweep()}, tmp_path / "both.png")
    (ax,) = capture[-1].axes
    labels = [line.get_label() for line in ax.get_lines() if not line.get_label().startswith("_")]
    assert sorted(labels) == sorted([f"{m} ({c})" for c in ("reap", "mass") for m in ("conventional", "slimwise",
                                                                                      "reverse")]
                                    + ["full model 0.90"])


def test_sweep_script_plots_from_existing_results(tmp_path, monkeypatch):
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "pruning_sweep", Path(__file__).resolve().parents[1] / "scripts" / "pruning_sweep.py")
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    for criterion in ("reap", "mass"):
        (tmp_path / criterion / "eval").mkdir(parents=True)
        (tmp_path / criterion / "eval" / "results.json").write_text(json.dumps(_sweep()))
    assert sweep.main(["--criterion", "reap,mass", "--plot-only", "--out", str(tmp_path)]) == 0
    for path in (tmp_path / "reap" / "accuracy_vs_ratio.png", tmp_path / "mass" / "accuracy_vs_ratio.png",
                 tmp_path / "accuracy_vs_ratio.png"):
        _png(path)


def test_eval_app_writes_the_three_figures_per_keep_set_and_logs_them_to_wandb(tmp_path, monkeypatch):
    """run_eval's figure block: `<figure>_<keep set>.png` each, linked under the keep set's table, and each a
    W&B image `eval/<figure>_<keep set>` (a stand-in wandb module records the payload)."""
    import sys
    import types

    from omegaconf import OmegaConf

    from slimwise_train.eval.app import FIGURES, log_to_wandb, write_figures
    from slimwise_train.eval.report import render_markdown

    results = _results()
    results.update({"num_problems": {f: 4 for f in FAMILIES}, "budget_rule": "-"})
    for row in results["rows"]:
        row.update({"median_length": 10.0, "p90_length": 12.0, "max_length": 14, "mean_length": 10.0,
                    "hit_budget": 0.0, "collapse": 0.0, "first_token_agreement_with_full": 1.0,
                    "exact_match_with_full": 1.0})
    images = write_figures(results, tmp_path)
    assert [(caption, path.name) for caption, path in images["k"]] == [
        (caption, f"{figure}_k.png") for figure, caption in FIGURES]
    for _, path in images["k"]:
        _png(path)
    report = render_markdown(results, images={n: [(c, p.name) for c, p in f] for n, f in images.items()})
    table_end = report.index("| slimwise_distill |")
    for figure, caption in FIGURES:
        assert report.index(f"![{caption}]({figure}_k.png)") > table_end
    logged = {}
    fake = types.SimpleNamespace(
        init=lambda **kw: types.SimpleNamespace(log=logged.update, finish=lambda: None),
        Image=lambda path, caption=None: ("image", path, caption), Table=lambda columns, data: ("table",))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = OmegaConf.create({"logger": {"project": "p", "entity": None, "mode": "disabled", "tags": []},
                            "output_dir": str(tmp_path)})
    log_to_wandb(cfg, results, images)
    assert {key: value for key, value in logged.items() if key.startswith("eval/") and key != "eval/results"} == {
        f"eval/{figure}_k": ("image", str(tmp_path / f"{figure}_k.png"), caption) for figure, caption in FIGURES}

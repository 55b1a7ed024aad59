"""Each benchmark subcommand runs on a tiny config and prints one JSON line with its ratio."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slimwise_train.bench import BENCHES, main

MODEL = ["--hidden", "32", "--layers", "2", "--experts", "8", "--top-k", "2", "--moe-intermediate", "16",
         "--vocab", "64", "--batch", "2", "--seq", "16", "--repeats", "2"]
TINY = {
    "calib": MODEL,
    "phase": MODEL,
    "loss": ["--tokens", "64", "--vocab", "500", "--top-k", "16", "--chunk", "16", "--time-tokens", "32", "--repeats", "2"],
    "decode": [*MODEL, "--batches", "1,4", "--prompt", "8", "--kv-heads", "1", "--min-seconds", "0", "--warmup", "1"],
    "train": [*MODEL, "--loss-top-k", "8", "--chunk", "8"],
    "engine": ["--models", "teacher", "--batches", "2", "--ratios", "0.5", "--steps", "2", "--repeats", "1",
               "--threads", "1"],
}


# memory, prune, lm_eval and serve launch subprocesses on saved checkpoints or servers: their own tests (below,
# tests/test_lm_eval.py, tests/test_bench_serve.py)
# loss and train measure memory in a `python -c` child each, engine runs llama-server: those three are marked.
SPAWNING_BENCHES = ("engine", "loss", "train")


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.subprocess) if n in SPAWNING_BENCHES else n
                                  for n in sorted(n for n in BENCHES if n not in ("memory", "prune", "lm_eval", "serve"))])
def test_bench_subcommand_prints_one_json_line(name, capsys):
    assert main([name, *TINY[name]]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    result = json.loads(lines[0])
    assert result["bench"] == name
    assert result["ratio"] > 0


def test_bench_decode_bf16_and_bad_kv_heads(capsys):
    assert main(["decode", *TINY["decode"], "--dtype", "bf16"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["model"].endswith("bf16") and result["ratio"] > 0
    for row in result["results"]:  # the experts-only replay splits the step: a share of it, and its own speedup
        assert 0 < row["experts_share_of_step"] < 1.5
        assert set(row["experts_only_speedup"]) == set(row["speedup"])
        assert all(v > 0 for v in row["experts_only_speedup"].values())
    # Batch 64 was not measured: its two targets are undefined, not passed.
    assert result["targets_met"]["speedup_at_64"] is None and result["targets_met"]["bound_efficiency_at_64"] is None
    assert isinstance(result["targets_met"]["masked_over_pruned"], bool)
    with pytest.raises(ValueError, match="--kv-heads 3 must divide"):
        main(["decode", *MODEL, "--hidden", "256", "--kv-heads", "3"])


def test_bench_decode_targets_met_follow_the_batch_64_row(capsys):
    assert main(["decode", *MODEL, "--batches", "64", "--prompt", "8", "--kv-heads", "1", "--ratios", "0.5",
                 "--min-seconds", "0"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    row, met, targets = result["results"][0], result["targets_met"], result["targets"]
    assert met["speedup_at_64"] == (row["speedup"]["0.5"] >= targets["pruned_0.5_speedup_at_64_min"])
    assert met["bound_efficiency_at_64"] == (row["bound_efficiency"]["0.5"] >= targets["bound_efficiency_min"])
    assert met["masked_over_pruned"] == (row["masked_over_pruned"] <= targets["masked_over_pruned_max"])


@pytest.mark.parametrize("kind", ["static", "dynamic"])
def test_decode_cache_rewinds_so_repeated_steps_match_a_full_forward(kind):
    """The timed decode step runs again and again on one cache: after each rewind it must give the logits of a
    plain full-sequence forward (the slow reference), atol 1e-5 in fp32."""
    import torch

    from slimwise_train.bench.common import bench_model
    from slimwise_train.bench.decode import _decode_cache, _rewind_one_token

    model = bench_model("qwen3_moe", 32, 2, 8, 2, 16, 64, torch.device("cpu"), kv_heads=1).eval()
    g = torch.Generator().manual_seed(0)
    prompt, step = torch.randint(0, 64, (3, 8), generator=g), torch.randint(0, 64, (3, 1), generator=g)
    with torch.no_grad():
        reference = model(input_ids=torch.cat([prompt, step], 1)).logits[:, -1]
        cache = model(input_ids=prompt, past_key_values=_decode_cache(model, kind, 9), use_cache=True).past_key_values
        for _ in range(3):
            logits = model(input_ids=step, past_key_values=cache, use_cache=True).logits[:, -1]
            _rewind_one_token(cache)
            assert int(cache.get_seq_length()) == 8
            torch.testing.assert_close(logits, reference, atol=1e-5, rtol=0)


def test_paired_ratio_is_the_median_of_per_round_ratios():
    from slimwise_train.bench.common import _paired_ratio

    # Per-round ratios 2, 4, 3 -> median 3; the ratio of the medians would be 4 / 1 = 4.
    times = {"full": [2.0, 4.0, 6.0], "pruned": [1.0, 1.0, 2.0]}
    assert _paired_ratio(times, "full", "pruned") == 3.0


def test_the_speedup_carries_its_quartiles_over_rounds(capsys):
    from slimwise_train.bench.common import paired_ratio_quartiles

    # per-round ratios 1, 2, 3, 4, 5: quartiles (inclusive) 2 and 4
    times = {"full": [1.0, 2.0, 3.0, 4.0, 5.0], "pruned": [1.0] * 5}
    assert paired_ratio_quartiles(times, "full", "pruned") == (2.0, 4.0)
    assert paired_ratio_quartiles({"a": [3.0], "b": [1.5]}, "a", "b") == (2.0, 2.0)
    assert main(["decode", *TINY["decode"]]) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["results"][-1]
    for ratio, speed in row["speedup"].items():
        low, high = row["speedup_quartiles"][ratio]
        assert low <= speed <= high


def test_the_demo_report_names_the_settings_it_ran_with(monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location("demo_script", Path(__file__).resolve().parents[1] / "scripts" / "demo.py")
    for name in ("DEMO_STEPS", "DEMO_EVAL_N", "DEMO_RATIO", "DEMO_TEACHER", "DEMO_BENCH"):
        monkeypatch.delenv(name, raising=False)
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    assert demo.reproduce_command() == "make demo"
    monkeypatch.setenv("DEMO_STEPS", "100")
    monkeypatch.setenv("DEMO_EVAL_N", "20")
    assert demo.reproduce_command() == "DEMO_STEPS=100 DEMO_EVAL_N=20 make demo"


def test_bench_loss_measures_the_naive_memory_on_fewer_tokens(capsys):
    assert main(["loss", *TINY["loss"], "--naive-tokens", "32"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["tokens"] == {"topk_residual": 64, "naive_full": 32}
    assert result["logits_fp32_bytes"] == {"topk_residual": 64 * 500 * 4, "naive_full": 32 * 500 * 4}
    ours = result["peak_extra_over_logits"]["topk_residual"]
    assert result["targets_met"]["memory"] == (ours <= result["target_peak_extra_over_logits_max"])


def test_bench_help_lists_every_bench(capsys):
    """`--help` prints the package docstring and every subcommand (a bare `%` in a help string used to crash it)."""
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "side-by-side benchmarks that print one JSON line each" in out
    assert all(f"python -m slimwise_train.bench {name}" in out for name in BENCHES)


@pytest.mark.dist
@pytest.mark.subprocess  # launches torchrun (bench/memory.py)
def test_bench_memory_reports_every_rank_and_the_targets(capsys):
    """A small checkpoint at 2 ranks (the real run is ~240M parameters): the structure, and the one relation that
    holds at any size: a ZeRO-3 rank holds half the parameters an engine=torch rank holds."""
    small = ["--hidden", "64", "--layers", "2", "--experts", "8", "--top-k", "2", "--moe-intermediate", "32",
             "--vocab", "1024", "--seq-len", "64", "--steps", "1", "--engines", "torch,zero3,zero3_recompute"]
    assert main(["memory", *small]) == 0
    # DeepSpeed's logger prints its own "[date] [WARNING] ..." lines to stdout on a first import: keep the JSON ones.
    out = capsys.readouterr().out.strip().splitlines()
    lines = [json.loads(line) for line in out if line.startswith('{"bench"')]
    engines = {line["engine"]: line for line in lines if "engine" in line}
    assert sorted(engines) == ["torch", "zero3", "zero3_recompute"]
    for line in engines.values():
        assert [r["rank"] for r in line["ranks"]] == [0, 1]
        for r in line["ranks"]:
            assert 0 < r["baseline"] <= r["load_peak"] and r["after_setup"] > 0 and r["step_peak"] > 0
    torch_held = engines["torch"]["ranks"][0]["held_bytes"]
    for r in engines["zero3"]["ranks"]:
        assert r["held_bytes"] <= 0.55 * torch_held and r["gathered_per_micro_batch"] > 0
    assert engines["torch"]["ranks"][0]["gathered_per_micro_batch"] == 0
    summary = lines[-1]
    assert summary["bench"] == "memory" and isinstance(summary["targets_met"], bool)
    assert len(summary["targets"]) == 5


@pytest.mark.slow
@pytest.mark.subprocess  # a fresh process per variant (bench/prune.py)
def test_bench_prune_reports_each_variant_and_the_targets(capsys):
    """A small checkpoint (the real run is ~240M parameters): one line per variant, each peak at or above its
    process's baseline, and the targets computed from them. Whether they are met is the real run's finding
    (docs/scale.md): at this size the modules a job imports on its way outweigh the model."""
    small = ["--hidden", "64", "--layers", "3", "--experts", "8", "--top-k", "2", "--moe-intermediate", "64",
             "--vocab", "1024", "--shard-mb", "1", "--samples", "40", "--seq-len", "64",
             "--variants", "calibrate_whole,calibrate_layerwise,export_streamed"]
    assert main(["prune", *small]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines() if line.startswith('{"bench"')]
    variants = {line["variant"]: line for line in lines if "variant" in line}
    assert sorted(variants) == ["calibrate_layerwise", "calibrate_whole", "export_streamed"]
    for line in variants.values():
        assert 0 < line["baseline"] <= line["peak"]
    summary = lines[-1]
    assert summary["bench"] == "prune" and summary["ratio"] > 0
    assert len(summary["targets"]) == 2 and summary["targets_met"] == all(summary["targets"].values())
    assert summary["largest_shard_mib"] <= 1.0 and summary["largest_layer_mib"] > 0


def test_the_demo_gives_the_cost_of_a_shared_expert_as_a_number(tmp_path):
    import importlib.util

    from slimwise_train.testing.tiny import tiny_model

    spec = importlib.util.spec_from_file_location("demo_script", Path(__file__).resolve().parents[1] / "scripts" / "demo.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    model = tiny_model("qwen2_moe")
    model.save_pretrained(tmp_path / "export")
    shared = sum(p.numel() for n, p in model.named_parameters() if "shared_expert" in n)
    routed = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert demo.shared_expert_cost(tmp_path / "export") == (
        f"{shared:,} parameters, {shared / routed:.1%} of the kept routed experts', read every step")
    tiny_model("qwen3_moe").save_pretrained(tmp_path / "plain")
    assert demo.shared_expert_cost(tmp_path / "plain") == "no shared-expert tensors found in the export"


def test_bench_models_of_every_family_have_the_asked_experts_and_top_k():
    """bench_model reads the expert-count and top-k config keys from the family's adapter (no table of families in
    the bench): every family's model routes the asked top-k of the asked experts."""
    import torch

    from slimwise_train.bench.common import bench_model
    from slimwise_train.moe.adapters import get_adapter
    from slimwise_train.testing.tiny import SUPPORTED_TINY

    for model_type in SUPPORTED_TINY:
        model = bench_model(model_type, 128, 2, 4, 1, 32, 96, torch.device("cpu"))
        layers = get_adapter(model).moe_layers(model)
        assert [(m.num_experts, m.top_k) for m in layers] == [(4, 1)] * 2, model_type

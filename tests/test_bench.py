"""Each benchmark subcommand runs on a tiny config and prints one JSON line with its ratio."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from slimwise_train.bench import BENCHES, main

MODEL = ["--hidden", "32", "--layers", "2", "--experts", "8", "--top-k", "2", "--moe-intermediate", "16",
         "--vocab", "64", "--batch", "2", "--seq", "16", "--repeats", "2"]
# bench decode takes its batch sizes from --batches and its cache length from --prompt
DECODE_MODEL = [flag for i, flag in enumerate(MODEL) if flag not in ("--batch", "--seq") and
                MODEL[i - 1] not in ("--batch", "--seq")]
TINY = {
    "calib": MODEL,
    "phase": MODEL,
    "loss": ["--tokens", "64", "--vocab", "500", "--top-k", "16", "--chunk", "16", "--time-tokens", "32", "--repeats", "2"],
    "decode": [*DECODE_MODEL, "--batches", "1,4", "--prompt", "8", "--kv-heads", "1", "--min-seconds", "0",
               "--warmup", "1"],
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
    # Batch 64 was not measured: its two targets are undefined, not passed.
    assert result["targets_met"]["speedup_at_64"] is None and result["targets_met"]["efficiency_at_64"] is None
    assert isinstance(result["targets_met"]["masked_over_pruned"], bool)
    with pytest.raises(ValueError, match="--kv-heads 3 must divide"):
        main(["decode", *DECODE_MODEL, "--hidden", "256", "--kv-heads", "3"])


def test_bench_decode_targets_met_follow_the_batch_64_row(capsys):
    assert main(["decode", *DECODE_MODEL, "--batches", "64", "--prompt", "8", "--kv-heads", "1", "--ratios", "0.5",
                 "--min-seconds", "0"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    row, met, targets = result["results"][0], result["targets_met"], result["targets"]
    cell = row["pruned"]["0.5"]
    assert met["speedup_at_64"] == (cell["speedup"] >= targets["pruned_0.5_speedup_at_64_min"])
    assert met["efficiency_at_64"] == (targets["efficiency_min"] <= cell["efficiency"] <= 1)
    assert met["masked_over_pruned"] == (row["masked_over_pruned"] <= targets["masked_over_pruned_max"])
    assert met["within_bound"] == (not cell["above_bound"] and not row["faster_than_bound"])


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
    for cell in row["pruned"].values():
        low, high = cell["speedup_quartiles"]
        assert low <= cell["speedup"] <= high


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


# --------------------------------------------------------------------------- the bound beside the rounds


def test_bench_decode_gives_one_bound_per_speedup_from_probes_between_its_rounds(capsys):
    """Every pruned ratio at every batch size carries one bound (its spread over the probes taken between that batch
    size's rounds), efficiency = speed-up / bound, and a flag exactly where the speed-up is above it; the machine's
    rates come with their spread and whether other processes shared it. No second bound field anywhere."""
    assert main(["decode", *TINY["decode"], "--ratios", "0.25,0.5", "--repeats", "4"]) == 0
    out = capsys.readouterr()
    result = json.loads(out.out.strip().splitlines()[-1])
    machine = result["machine"]
    assert machine["probes"] >= 2 * 4 and isinstance(machine["shared"], bool) and 0 <= machine["other_cpu_share"]
    low, mid, high = machine["bandwidth_gbs"]
    assert 0 < low <= mid <= high
    assert set(machine["expert_gflops_at_rows"]) >= {"1", "4"}  # the batch sizes are among the timed row counts
    flagged = []
    for row in result["results"]:
        assert not {"bytes_bound", "roofline_bound", "bound_efficiency", "roofline_efficiency"} & set(row)
        for ratio, cell in row["pruned"].items():
            assert cell["probes"] == 4  # one probe after each of the 4 timed rounds
            q1, q3 = cell["bound_quartiles"]
            assert 1.0 <= q1 <= cell["bound"] <= q3
            assert cell["efficiency"] == pytest.approx(cell["speedup"] / cell["bound"], abs=2e-3)
            assert cell["above_bound"] == (cell["efficiency"] > 1)
            if cell["above_bound"]:
                flagged.append({"batch": row["batch"], "ratio": float(ratio)})
                assert f"batch {row['batch']}, pruned {ratio}: speed-up" in out.err and "ABOVE its bound" in out.err
        # the step's own routing: batch 1 sends its one token to top-k distinct experts, one row each
        if row["batch"] == 1:
            assert row["rows_per_touched_expert"]["full"] == 1.0
    assert result["above_bound"] == flagged
    faster = [row["faster_than_bound"] for row in result["results"]]
    assert all(set(f) == {v for v, x in row["roofline_fraction"].items() if x > 1} for f, row in zip(faster, result["results"]))
    assert result["targets_met"]["within_bound"] == (not flagged and not any(faster))


def test_the_step_bound_against_a_slow_reference():
    """step_bound_s on a hand-made shape and rates equals the sum written out part by part, and the compute side
    follows the row counts: the same FLOPs on fewer experts with more rows each is faster when the matmul rate rises
    with the rows (as measured), equal when it does not."""
    from slimwise_train.bench.roofline import DecodeShape, MachineRates, step_bound_s

    shape = DecodeShape(layers=2, experts=8, top_k=2, expert_params=3 * 64 * 32, other_params=10_000,
                        weight_bytes=2, kv_bytes_per_token=512, attention_flops_per_ctx_token=1000)
    expert = (64, 32)
    seconds = {1: 1e-5, 2: 1.2e-5, 4: 1.6e-5, 8: 2.4e-5}  # per expert matmul pair: the rate rises with rows
    rates = MachineRates(bandwidth_gbs=10.0, matmul_gflops=50.0, threads=2, expert=expert, expert_seconds=seconds)
    rows = [[2, 0, 1, 1, 0, 0, 0, 0], [3, 1, 0, 0, 0, 0, 0, 0]]  # 4 tokens x top-2 per layer
    bw, width = 10e9, 2 / 4  # f16 weights stream through the cache in half the measured fp32 time
    dense = max((10_000 * 2 + 4 * 16 * 512) / bw,  # n = 4 rows through the dense weights
                seconds[4] * 10_000 / (3 * 64 * 32) * width + 4 * 16 * 1000 / 50e9)
    read = 3 * 64 * 32 * 2 / bw
    at = {1: seconds[1], 2: seconds[2], 3: (seconds[2] + seconds[4]) / 2}  # 3 rows: between the measured 2 and 4
    experts = sum(max(read, at[r] * width) for layer in rows for r in layer if r)
    assert step_bound_s(shape, 4, 16, rates, rows=rows) == pytest.approx(dense + experts, rel=1e-12)
    # fp32 weights: the measured time as it is; never below the large-matmul peak
    assert rates.matmul_seconds(3, 3 * 64 * 32, 4) == pytest.approx(at[3])
    slow_peak = MachineRates(bandwidth_gbs=10.0, matmul_gflops=1e-3, threads=2, expert=expert, expert_seconds=seconds)
    assert slow_peak.matmul_seconds(2, 100, 2) == pytest.approx(2 * 2 * 100 / 1e6)
    # 8 tokens, top-2: 8 experts get 2 rows each, 4 experts (half pruned) 4 each: the same FLOPs (one layer's
    # rows given: both MoE layers route so)
    full, half = [[2] * 8], [[4] * 4]
    fast_memory = MachineRates(bandwidth_gbs=1e6, matmul_gflops=50.0, threads=2, expert=expert, expert_seconds=seconds)
    assert step_bound_s(shape.with_experts(4), 8, 16, fast_memory, rows=half) == pytest.approx(
        step_bound_s(shape, 8, 16, fast_memory, rows=full) - 2 * (8 * seconds[2] - 4 * seconds[4]) * width)
    flat = MachineRates(bandwidth_gbs=1e6, matmul_gflops=50.0, threads=2)  # the peak rate at every row count
    assert step_bound_s(shape.with_experts(4), 8, 16, flat, rows=half) == pytest.approx(
        step_bound_s(shape, 8, 16, flat, rows=full))


def test_a_speedup_above_its_bound_is_flagged_and_said_to_be_noise_or_not():
    from slimwise_train.bench.roofline import above_bound_note, against_bound

    bound = {"bound": 1.5, "bound_quartiles": [1.45, 1.55], "probes": 5}
    within = against_bound(1.4, [1.3, 1.5], bound)
    assert within["efficiency"] == pytest.approx(1.4 / 1.5, abs=1e-3) and not within["above_bound"]
    noisy = against_bound(1.6, [1.5, 1.7], bound)
    assert noisy["above_bound"] and not noisy["beyond_noise"]
    wrong = against_bound(2.1, [2.0, 2.2], bound)
    assert wrong["above_bound"] and wrong["beyond_noise"]
    assert "ABOVE its bound 1.500x" in above_bound_note("x", wrong) and "missed something" in above_bound_note("x", wrong)
    assert "noise" in above_bound_note("x", noisy)
    assert not against_bound(1.50049, [1.4, 1.6], bound)["above_bound"]  # efficiency 1.000 as reported: not above


@pytest.mark.subprocess
def test_cpu_share_counts_other_processes_and_not_the_benchs_own():
    """Two CpuShare over the same second, one told that a busy child is the bench's own: they differ by that
    child's CPU time over the CPUs and the wall time."""
    import subprocess
    import sys
    import time

    from slimwise_train.bench.roofline import CpuShare

    child = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 1.5\nwhile time.time() < end: pass"])
    try:
        time.sleep(0.2)
        theirs, ours = CpuShare(), CpuShare(own_pids=[child.pid])
        with open(f"/proc/{child.pid}/stat") as f:
            start = sum(int(v) for v in f.read().rsplit(")", 1)[1].split()[11:13])
        begin = time.monotonic()
        time.sleep(1.0)
        with open(f"/proc/{child.pid}/stat") as f:
            spent = (sum(int(v) for v in f.read().rsplit(")", 1)[1].split()[11:13]) - start) / os.sysconf("SC_CLK_TCK")
        share_theirs, share_ours = theirs.share(), ours.share()
        wall = time.monotonic() - begin
    finally:
        child.wait()
    assert spent > 0.3  # the child did run
    assert share_theirs - share_ours == pytest.approx(spent / (wall * len(theirs.cpus)), abs=0.06)

"""`python -m slimwise_train.bench serve`: GuideLLM drives `serve up` endpoints (full, pruned, SlimWise) and the bench
reports throughput, per-user speed, TTFT, the best throughput under the per-user target, and each ratio beside
the roofline bound, in one JSON line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers import CHILD_ENV


@pytest.mark.slow
@pytest.mark.engine
@pytest.mark.subprocess
def test_bench_serve_reports_guidellm_runs_ratios_bounds_and_targets(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "slimwise_train.bench", "serve", "--models", "teacher", "--ratios",
                           "0.5", "--concurrency", "2", "--min-requests", "4", "--rounds", "1", "--prompt", "16",
                           "--output", "8",
                           "--work-dir", str(tmp_path)], env=CHILD_ENV, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["bench"] == "serve" and result["load_generator"].startswith("guidellm")
    teacher = result["results"]["teacher"]
    assert set(teacher["runs"]) == {"full", "pruned_0.5", "slimwise_0.5"}
    for runs in teacher["runs"].values():
        row = runs["2"]
        assert row["requests"] == 8 and row["errored"] == 0 and row["output_tokens_per_request"] == 8
        assert row["output_tok_s"] > 0 and row["per_user_tok_s"]["p50"] >= row["per_user_tok_s"]["p90"] > 0
        assert row["ttft_ms"]["p90"] >= row["ttft_ms"]["p50"] > 0
    for variant in ("pruned_0.5", "slimwise_0.5"):
        at = teacher["ratios_vs_full"][variant]["at_concurrency"]["2"]
        full, mine = teacher["runs"]["full"]["2"]["output_tok_s"], teacher["runs"][variant]["2"]["output_tok_s"]
        assert at["ratio"] == pytest.approx(mine / full, abs=2e-3) and at["bound"] >= 1.0
        assert at["efficiency"] == pytest.approx(at["ratio"] / at["bound"], abs=2e-3)
        assert at["bound_quartiles"][0] <= at["bound"] <= at["bound_quartiles"][1] and at["probes"] == 1
        flagged = any(variant in flag for flag in result["flags"])
        assert flagged == (at["efficiency"] > 1)
    # the machine probed beside the level's runs (bench/roofline.py), the other processes' CPU share measured
    assert teacher["machine"]["probes"] == 1 and teacher["machine"]["bandwidth_gbs"][1] > 0
    assert result["shared"] == teacher["machine"]["shared"]
    # every variant ran as a prefill and a decode server with the handoff between them
    assert all(h["bytes_per_request"] > 0 for h in teacher["handoff"].values())
    assert teacher["target_per_user_tok_s"] > 0 and set(result["targets_met"]) == {
        "errored_requests", "bound_holds", "slimwise_0.5_not_slower"}
    assert list(tmp_path.iterdir()) == []  # GGUF files and GuideLLM's reports went with the run


@pytest.mark.subprocess
def test_bench_serve_flags_out_of_range_are_one_line_before_any_work(tmp_path):
    for args, message in ((["--threads", "0"], "--threads must be >= 1"), (["--rounds", "x"], "--rounds"),
                          (["--work-dir", str(tmp_path / "none")], "--work-dir")):
        proc = subprocess.run([sys.executable, "-m", "slimwise_train.bench", "serve", *args], env=CHILD_ENV,
                              capture_output=True, text=True, timeout=120, cwd=tmp_path)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], proc.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []

"""`python -m slimwise_train.prune`: outputs, sweeps, distributed statistics and bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from slimwise_train.moe.keepset import KeepSet
from slimwise_train.prune.app import run_prune
from slimwise_train.prune.statistics import load_scores

from helpers import compose_config

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def _cfg(tmp_path, *overrides):
    return compose_config("prune", f"output_dir={tmp_path / 'out'}", f"prune.cache_dir={tmp_path / 'cache'}",
                          "progress=false", "data.num_samples=24", "data.batch_size=8", *overrides)


def test_prune_writes_scores_keep_set_mask_and_checkpoint(tmp_path):
    summary = run_prune(_cfg(tmp_path, "prune.export_checkpoint=true", "prune.criterion=ean", "prune.ratio=0.25"))
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == [
        "keep_set.json", "prune_config.yaml", "prune_summary.json", "pruned", "router_mask.safetensors",
        "scores.safetensors"]
    keep = KeepSet.load(out / "keep_set.json")
    assert keep.num_kept == (6, 6) and summary["num_kept"] == [6, 6]
    stats, meta = load_scores(out / "scores.safetensors")
    assert meta["model"]["family"] == "qwen3_moe" and meta["calibration"]["num_sequences"] == 24
    scores = load_file(str(out / "scores.safetensors"))
    for layer, lk in zip(stats.layer_indices, keep):
        ranked = torch.sort(-scores["score.ean"][stats.layer_indices.index(layer)], stable=True).indices[:6]
        assert sorted(ranked.tolist()) == list(lk.kept)
    mask = load_file(str(out / "router_mask.safetensors"))
    bias = mask["layers.0.router_logit_bias"]
    assert torch.isinf(bias[list(keep.layer(0).removed)]).all() and (bias[list(keep.layer(0).kept)] == 0).all()
    assert (out / "pruned" / "config.json").is_file()


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["prune.ratio=1.0"], r"prune.ratio must be in \(0, 1\)"),
        (["prune.ratio=0"], r"prune.ratio must be in \(0, 1\)"),
        (["prune.ratio=0.9"], "fewer than the router's top-2"),
        (["prune.criterion=magic"], "^prune.criterion='magic' is not one of: frequency, mass, mass_routed, ean, reap$"),
        (["data.source=/nonexistent/calib.jsonl"], "neither a recipe"),
    ],
)
def test_bad_input_fails_before_writing(tmp_path, overrides, message):
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        run_prune(_cfg(tmp_path, *overrides))
    assert not (tmp_path / "out").exists()


def test_empty_calibration_file(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="no usable rows"):
        run_prune(_cfg(tmp_path, f"data.source={empty}"))
    assert not (tmp_path / "out").exists()


def test_local_jsonl_calibration(tmp_path):
    rows = tmp_path / "calib.jsonl"
    rows.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"Q: {i}+{i}="},
                                                       {"role": "assistant", "content": f"A={2 * i}"}]})
                              for i in range(120)) + "\n")
    summary = run_prune(_cfg(tmp_path, f"data.source={rows}", "data.num_samples=120"))
    assert summary["statistics"] == "computed" and summary["calibration_tokens"] >= 1024


def test_statistics_cache_is_invalidated_when_the_calibration_file_changes(tmp_path):
    rows = tmp_path / "calib.jsonl"

    def write(offset):
        rows.write_text("\n".join(json.dumps({"prompt": f"Q: {i}+{offset}=", "answer": f"A={i + offset}"})
                                  for i in range(30)) + "\n")

    def prune(run):  # 24 short rows: a floor of 256 tokens keeps the test about the cache, not the minimum
        cfg = compose_config("prune", f"output_dir={tmp_path / run}", f"prune.cache_dir={tmp_path / 'cache'}",
                             "progress=false", "data.num_samples=24", "data.batch_size=8", f"data.source={rows}",
                             "prune.min_calibration_tokens=256")
        return run_prune(cfg)["statistics"]

    write(1)
    assert [prune("a"), prune("b")] == ["computed", "cache"]
    write(7)  # same name, new content (and size/mtime)
    assert [prune("c"), prune("d")] == ["computed", "cache"]


def test_scores_file_from_another_model_is_rejected(tmp_path):
    run_prune(_cfg(tmp_path))
    scores = tmp_path / "scores.safetensors"
    (tmp_path / "out" / "scores.safetensors").rename(scores)
    other = tmp_path / "other"
    with pytest.raises(ValueError, match="computed on another model"):
        run_prune(_cfg(other, "model.seed=1", f"prune.scores={scores}"))
    assert not (other / "out").exists()
    same = run_prune(_cfg(other, f"prune.scores={scores}", "prune.ratio=0.75"))
    assert same["statistics"] == "file"


def test_dense_model_is_rejected(tmp_path):
    dense = LlamaForCausalLM(LlamaConfig(vocab_size=384, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    dense.save_pretrained(tmp_path / "dense")
    tok = REPO / "slimwise_train" / "assets" / "tokenizer"
    with pytest.raises(ValueError, match="not a supported MoE model.*supported families: qwen3_moe"):
        run_prune(_cfg(tmp_path, "model.tiny=null", f"model.path={tmp_path / 'dense'}", f"model.tokenizer={tok}"))
    assert not (tmp_path / "out").exists()


@pytest.mark.subprocess
def test_cli_error_is_one_line_and_exit_code_2(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "slimwise_train.prune", "prune.ratio=1.5", f"hydra.run.dir={tmp_path / 'run'}",
         f"prune.cache_dir={tmp_path / 'cache'}"],
        cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert lines[-1].startswith("slimwise_train.prune: error: prune.ratio must be in (0, 1)")
    assert "Traceback" not in proc.stderr
    assert not any((tmp_path / "run").glob("*.safetensors"))


@pytest.mark.subprocess
def test_unknown_config_key_is_rejected(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "slimwise_train.prune", "prune.raito=0.5", f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode != 0
    assert "raito" in proc.stderr


@pytest.mark.subprocess
def test_sweep_over_ratios_and_criteria_calibrates_once(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "slimwise_train.prune", "--multirun", "prune.ratio=0.25,0.5,0.75",
         "prune.criterion=mass,ean,reap", f"hydra.sweep.dir={tmp_path / 'sweep'}", f"prune.cache_dir={tmp_path / 'cache'}",
         "data.num_samples=24", "progress=false"],
        cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    summaries = [json.loads(p.read_text()) for p in sorted((tmp_path / "sweep").glob("*/prune_summary.json"))]
    assert len(summaries) == 9
    assert sorted(s["statistics"] for s in summaries) == ["cache"] * 8 + ["computed"]
    assert {tuple(s["num_kept"]) for s in summaries} == {(6, 6), (4, 4), (2, 2)}


@pytest.mark.dist
@pytest.mark.subprocess
def test_two_process_statistics_equal_single_process(tmp_path):
    common = ["prune.use_cache=false", "data.num_samples=24", "data.batch_size=4", "progress=false"]
    single = subprocess.run([sys.executable, "-m", "slimwise_train.prune", f"hydra.run.dir={tmp_path / 'one'}", *common],
                            cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert single.returncode == 0, single.stderr[-2000:]
    double = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "slimwise_train.prune",
         f"hydra.run.dir={tmp_path / 'two'}", *common],
        cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300,
    )
    assert double.returncode == 0, double.stderr[-2000:]
    one, _ = load_scores(tmp_path / "one" / "scores.safetensors")
    two, _ = load_scores(tmp_path / "two" / "scores.safetensors")
    assert json.loads((tmp_path / "two" / "prune_summary.json").read_text())["world_size"] == 2
    for name in ("num_tokens", "frequency"):
        assert torch.equal(getattr(two, name), getattr(one, name)), name  # counts: exact
    for name in ("mass_all", "mass_routed", "gate_sum", "ean_sum", "reap_sum"):
        # Sums are float64, but each token's value comes from an fp32 forward whose rounding depends on the
        # batch it ran in (each rank batches its own shard): measured ~4e-9 relative apart.
        torch.testing.assert_close(getattr(two, name), getattr(one, name), rtol=1e-6, atol=1e-9)
    assert KeepSet.load(tmp_path / "one" / "keep_set.json") == KeepSet.load(tmp_path / "two" / "keep_set.json")


def test_one_function_builds_keep_sets_from_scores_for_every_caller():
    """keep_set_from_scores is the prune app's, the trainer's and the planner's: groups from the adapter (DeepSeek-V3
    with n_group=2 keeps each group balanced), top-k from the model, the model's model_type recorded."""
    from slimwise_train.moe.adapters import get_adapter
    from slimwise_train.prune.criteria import keep_set_from_scores, select_keep
    from slimwise_train.testing.tiny import tiny_model

    grouped = tiny_model("deepseek_v3", n_group=2, topk_group=1)
    scores = torch.rand(len(get_adapter(grouped).moe_layers(grouped)), 8, generator=torch.Generator().manual_seed(0))
    keep = keep_set_from_scores(grouped, scores, 0.5, meta={"criterion": "test"})
    keep.check_model(grouped)  # group-balanced, or check_keep would refuse it
    assert keep.model_type == "deepseek_v3" and keep.meta == {"criterion": "test"}
    assert [lk.kept for lk in keep] == [tuple(k) for k in select_keep(scores, 0.5, 2, "layer", num_groups=2)]
    assert keep_set_from_scores(grouped, None, 0.5).num_kept == (4,) * len(keep)  # the ratio check, the planner's
    with pytest.raises(ValueError, match="global cannot keep expert groups balanced"):
        keep_set_from_scores(grouped, scores, 0.5, "global")
    plain = tiny_model("qwen3_moe")
    with pytest.raises(ValueError, match="fewer than the router's top-2"):
        keep_set_from_scores(plain, None, 0.9)
    # No caller selects on its own: select_keep is called only inside prune/criteria.py.
    package = Path(__file__).resolve().parents[1] / "slimwise_train"
    callers = sorted(str(p.relative_to(package)) for p in package.rglob("*.py") if "select_keep(" in p.read_text())
    assert callers == ["prune/criteria.py"]


@pytest.mark.subprocess
def test_cli_calibrates_on_tool_conversations_rendered_whole_by_a_chat_template(tmp_path, chat_tokenizer_dir):
    """Issue 47: with a chat template the first command of the tour failed on every real model (BatchEncoding). The
    shipped tool conversations are rendered whole (system, tools, every turn): the calibration tokens are those of
    transformers' own rendering of each row, cut at data.seq_len."""
    from transformers import AutoTokenizer

    from helpers import TOOL_CHATS

    proc = subprocess.run(
        [sys.executable, "-m", "slimwise_train.prune", "model=tiny_qwen3_moe", f"model.tokenizer={chat_tokenizer_dir}",
         f"data.source={TOOL_CHATS['openai']}", f"hydra.run.dir={tmp_path / 'run'}",
         f"prune.cache_dir={tmp_path / 'cache'}", "progress=false"],
        cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = proc.stdout + proc.stderr
    assert "rows rendered whole by the chat template" in log and "truncated" in log
    summary = json.loads((tmp_path / "run" / "prune_summary.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(str(chat_tokenizer_dir))
    rows = [json.loads(line) for line in TOOL_CHATS["openai"].read_text().splitlines()]
    seq_len = compose_config("prune").data.seq_len
    expected = sum(min(len(tokenizer.apply_chat_template(r["messages"], tools=r.get("tools"))["input_ids"]), seq_len)
                   for r in rows)
    assert summary["calibration_tokens"] == expected
    assert KeepSet.load(tmp_path / "run" / "keep_set.json").num_kept == (4, 4)


def test_the_statistics_cache_key_follows_the_chat_template(chat_tokenizer_dir):
    """Calibration tokens depend on the chat template's text: an edited template is another key; with
    data.chat_template=false (plain rendering) the template does not matter."""
    from transformers import AutoTokenizer

    from slimwise_train.prune.statistics import statistics_key

    tokenizer = AutoTokenizer.from_pretrained(str(chat_tokenizer_dir))
    data, plain = compose_config("prune").data, compose_config("prune", "data.chat_template=false").data
    before = statistics_key({"weights": "w"}, data, tokenizer), statistics_key({"weights": "w"}, plain, tokenizer)
    tokenizer.chat_template = tokenizer.chat_template.replace("<|im_start|>system\n", "<|im_start|>system \n")
    after = statistics_key({"weights": "w"}, data, tokenizer), statistics_key({"weights": "w"}, plain, tokenizer)
    assert before[0] != after[0] and before[1] == after[1]

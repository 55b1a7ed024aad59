"""prune.calibration.mode=layerwise (prune/layerwise.py): a model read from its checkpoint one decoder layer at a time
gives the whole model's statistics on every family and criterion; the prune app in that mode; a rerun after kill -9
resumes from the last finished layer; 2 ranks; bad input.

Tolerance: every criterion's [L, E] scores within rtol 1e-6 / atol 1e-12 of the whole-model path (from_pretrained, one
forward per batch) on the same batches. The layers run the same arithmetic in the same order, so the measured
difference is 0 on all 9 families (fp32, CPU); across ranks (each rank batches its own shard) 1e-6 as in
tests/test_prune_app.py.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from slimwise_train.moe.checkpoint import LazyCheckpoint
from slimwise_train.moe.keepset import KeepSet
from slimwise_train.prune.app import run_prune
from slimwise_train.prune.scoring import score_keep_set
from slimwise_train.prune.criteria import CRITERIA
from slimwise_train.prune.layerwise import collect_statistics_layerwise, streamed_weights_digest
from slimwise_train.prune.statistics import collect_statistics, load_scores, weights_digest
from slimwise_train.testing.tiny import SUPPORTED_TINY

from helpers import CHILD_ENV, REPO, compose_config


def _batches(vocab: int) -> list[dict]:
    """Three right-padded batches of random tokens, as calibration_batches makes them (pad id 0 after the end)."""
    g = torch.Generator().manual_seed(5)
    out = []
    for width in (12, 9, 16):
        ids = torch.randint(3, vocab, (3, width), generator=g)
        mask = torch.ones_like(ids)
        mask[1, width - 4:] = 0
        mask[2, 3:] = 0
        out.append({"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask})
    return out


@pytest.fixture(scope="module")
def both_paths(tiny_checkpoint):
    """model_type -> (whole-model statistics, layerwise statistics, whole digest, streamed digest), computed once."""
    done: dict = {}

    def get(model_type: str):
        if model_type not in done:
            folder = tiny_checkpoint(model_type)
            whole = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
            batches = _batches(whole.config.get_text_config().vocab_size)
            reference = collect_statistics(whole, batches, progress=False)
            checkpoint = LazyCheckpoint(folder, torch.float32)
            layerwise = collect_statistics_layerwise(checkpoint, batches, device="cpu", progress=False)
            done[model_type] = (reference, layerwise, weights_digest(whole),
                                streamed_weights_digest(checkpoint, progress=False))
        return done[model_type]

    return get


@pytest.mark.parametrize("criterion", list(CRITERIA))
@pytest.mark.parametrize("model_type", SUPPORTED_TINY)
def test_layerwise_scores_equal_the_whole_models(both_paths, model_type, criterion):
    reference, layerwise, _, _ = both_paths(model_type)
    assert layerwise.layer_indices == reference.layer_indices
    assert torch.equal(layerwise.num_tokens, reference.num_tokens)
    torch.testing.assert_close(CRITERIA[criterion](layerwise), CRITERIA[criterion](reference), rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("model_type", SUPPORTED_TINY)
def test_streamed_fingerprint_is_the_whole_models(both_paths, model_type):
    """The statistics key hashes every weight: streamed one layer at a time it is the same hash, so the cache and
    scores files are shared by the two modes."""
    _, _, whole, streamed = both_paths(model_type)
    assert streamed == whole


def test_one_decoder_layer_is_held_at_a_time(tiny_checkpoint):
    """While a layer runs, every other decoder layer's tensors are on the meta device (hybrid linear attention)."""
    checkpoint = LazyCheckpoint(tiny_checkpoint("qwen3_next"), torch.float32)
    layers = list(checkpoint.model.model.layers)
    held = []
    real_materialize = checkpoint.materialize

    def materialize(targets, device="cpu"):
        real_materialize(targets, device)
        held.append([i for i, layer in enumerate(layers)
                     if any(t.device.type != "meta" for t in layer.state_dict().values())])

    checkpoint.materialize = materialize
    collect_statistics_layerwise(checkpoint, _batches(96), device="cpu", progress=False)
    assert held == [[], [0], [1]]  # the embeddings alone, then one layer each
    assert all(t.device.type == "meta" for t in checkpoint.model.state_dict().values())


# --------------------------------------------------------------------------- the prune app


def _prune_cfg(tmp_path, folder, name, *overrides):
    return compose_config("prune", f"output_dir={tmp_path / name}", f"prune.cache_dir={tmp_path / 'cache'}",
                          "progress=false", "data.num_samples=24", "data.batch_size=8", f"model.path={folder}",
                          *overrides)


def test_prune_app_layerwise_writes_what_the_whole_model_writes(tmp_path, tiny_checkpoint):
    folder = tiny_checkpoint("qwen3_moe")
    layer = run_prune(_prune_cfg(tmp_path, folder, "layer", "prune.calibration.mode=layerwise",
                                 "prune.export_checkpoint=true"))
    whole = run_prune(_prune_cfg(tmp_path, folder, "whole", "prune.export_checkpoint=true"))
    assert (layer["statistics"], whole["statistics"]) == ("computed", "cache")  # one cache for both modes
    assert layer["calibration_mode"] == "layerwise" and layer["num_kept"] == whole["num_kept"]
    assert KeepSet.load(tmp_path / "layer" / "keep_set.json") == KeepSet.load(tmp_path / "whole" / "keep_set.json")
    pruned = {}
    for name in ("layer", "whole"):
        pruned[name] = {}
        for path in (tmp_path / name / "pruned").glob("*.safetensors"):
            pruned[name].update(load_file(str(path)))
    assert pruned["layer"].keys() == pruned["whole"].keys()
    assert all(torch.equal(pruned["layer"][k], pruned["whole"][k]) for k in pruned["whole"])
    # layerwise calibrated; the same statistics again, computed by the whole model, within the stated tolerance
    fresh = run_prune(_prune_cfg(tmp_path, folder, "fresh", "prune.use_cache=false"))
    assert fresh["statistics"] == "computed"
    a, _ = load_scores(tmp_path / "layer" / "scores.safetensors")
    b, _ = load_scores(tmp_path / "fresh" / "scores.safetensors")
    for criterion, fn in CRITERIA.items():
        torch.testing.assert_close(fn(a), fn(b), rtol=1e-6, atol=1e-12, msg=criterion)
    assert not list((tmp_path / "cache").glob("*.layerwise-*"))  # resume points go once the statistics are done


@pytest.mark.subprocess
def test_kill_during_layerwise_calibration_resumes_from_the_last_finished_layer(tmp_path, tiny_checkpoint, caplog):
    folder = tiny_checkpoint("deepseek_v3")  # 3 layers: dense first layer, MLA
    common = [f"model.path={folder}", "prune.calibration.mode=layerwise", f"prune.cache_dir={tmp_path / 'cache'}",
              "progress=false", "data.num_samples=24", "data.batch_size=8"]
    killed = subprocess.run([sys.executable, "-m", "slimwise_train.prune", f"hydra.run.dir={tmp_path / 'killed'}",
                             *common, "+extra.kill_after_layer=1"], cwd=REPO, env=CHILD_ENV, capture_output=True,
                            text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr[-2000:]
    points = list((tmp_path / "cache").glob("*.layerwise-w1-b8/rank0-layer*.safetensors"))
    assert [p.name for p in points] == ["rank0-layer00001.safetensors"]  # the older point went, the newest stays
    assert not (tmp_path / "killed" / "scores.safetensors").exists()
    with caplog.at_level("INFO", logger="slimwise.prune"):
        resumed = run_prune(compose_config("prune", f"output_dir={tmp_path / 'resumed'}", *common))
    assert "resuming after layer 1 of 3" in caplog.text and resumed["statistics"] == "computed"
    straight = run_prune(compose_config("prune", f"output_dir={tmp_path / 'whole'}", *common[:1], *common[2:],
                                        "prune.use_cache=false"))
    assert straight["num_kept"] == resumed["num_kept"]
    a, _ = load_scores(tmp_path / "resumed" / "scores.safetensors")
    b, _ = load_scores(tmp_path / "whole" / "scores.safetensors")
    for criterion, fn in CRITERIA.items():
        torch.testing.assert_close(fn(a), fn(b), rtol=1e-6, atol=1e-12, msg=criterion)
    assert not list((tmp_path / "cache").glob("*.layerwise-*/*"))


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.subprocess
def test_two_ranks_split_the_batches_and_equal_one_whole_model(tmp_path, tiny_checkpoint):
    folder = tiny_checkpoint("gpt_oss")  # sliding-window layers
    common = [f"model.path={folder}", "prune.use_cache=false", "data.num_samples=24", "data.batch_size=4",
              "progress=false", f"prune.cache_dir={tmp_path / 'cache'}"]
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m",
                          "slimwise_train.prune", f"hydra.run.dir={tmp_path / 'two'}", *common,
                          "prune.calibration.mode=layerwise"], cwd=REPO, env=CHILD_ENV, capture_output=True,
                         text=True, timeout=300)
    assert two.returncode == 0, two.stderr[-2000:]
    run_prune(compose_config("prune", f"output_dir={tmp_path / 'one'}", *common))
    assert json.loads((tmp_path / "two" / "prune_summary.json").read_text())["world_size"] == 2
    one, _ = load_scores(tmp_path / "one" / "scores.safetensors")
    both, _ = load_scores(tmp_path / "two" / "scores.safetensors")
    assert torch.equal(both.num_tokens, one.num_tokens) and torch.equal(both.frequency, one.frequency)
    for name in ("mass_all", "mass_routed", "gate_sum", "ean_sum", "reap_sum"):
        torch.testing.assert_close(getattr(both, name), getattr(one, name), rtol=1e-6, atol=1e-9)


@pytest.mark.gpu
@pytest.mark.parametrize("hidden_states", ["cpu", "device"])
def test_layerwise_on_a_gpu_holds_the_layer_there(tiny_checkpoint, hidden_states):
    """One GPU: the layer on the GPU, the skeleton on the CPU, the hidden states on either; the scores equal the
    CPU whole model's within 1e-4 relative (GPU fp32 kernels sum in another order)."""
    folder = tiny_checkpoint("qwen3_5_moe_text")
    whole = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    batches = _batches(whole.config.vocab_size)
    reference = collect_statistics(whole, batches, progress=False)
    checkpoint = LazyCheckpoint(folder, torch.float32)
    layerwise = collect_statistics_layerwise(checkpoint, batches, device="cuda", hidden_states=hidden_states,
                                             progress=False)
    assert all(t.device.type == "meta" for t in checkpoint.model.state_dict().values())
    for criterion, fn in CRITERIA.items():
        torch.testing.assert_close(fn(layerwise), fn(reference), rtol=1e-4, atol=1e-6, msg=criterion)


# --------------------------------------------------------------------------- bad input


def _copy(folder, tmp_path):
    copied = tmp_path / "ckpt"
    shutil.copytree(folder, copied)
    return copied


def test_a_shard_that_disagrees_with_the_index_is_one_line(tmp_path, tiny_checkpoint):
    folder = _copy(tiny_checkpoint("mixtral"), tmp_path)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    key = sorted(index["weight_map"])[0]
    others = sorted(set(index["weight_map"].values()) - {index["weight_map"][key]})
    index["weight_map"][key] = others[0]  # the index now puts a tensor in a shard that does not hold it
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"^model.path=.*: shard model-\d+-of-\d+.safetensors disagrees with "
                                         r"model.safetensors.index.json: it .*; the folder mixes two checkpoints"):
        run_prune(_prune_cfg(tmp_path, folder, "out", "prune.calibration.mode=layerwise"))
    assert not (tmp_path / "out").exists()


def test_a_truncated_shard_is_one_line(tmp_path, tiny_checkpoint):
    folder = _copy(tiny_checkpoint("qwen2_moe"), tmp_path)
    shard = sorted(folder.glob("model-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(ValueError, match=rf"shard {shard.name} is truncated or corrupt .*; copy the checkpoint again$"):
        run_prune(_prune_cfg(tmp_path, folder, "out", "prune.calibration.mode=layerwise"))
    assert not (tmp_path / "out").exists()


def test_a_missing_shard_is_one_line(tmp_path, tiny_checkpoint):
    folder = _copy(tiny_checkpoint("olmoe"), tmp_path)
    shard = sorted(folder.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=rf"shard {shard.name} named by model.safetensors.index.json is "
                                                r"missing; copy the checkpoint again$"):
        run_prune(_prune_cfg(tmp_path, folder, "out", "prune.calibration.mode=layerwise"))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("overrides,message", [
    (["model.path=null"], "reads a checkpoint's safetensors files: set model.path to a local checkpoint folder"),
    (["model.path=someone/some-moe"], "needs a local checkpoint folder; model.path=someone/some-moe is not one"),
    (["prune.calibration.mode=whole", "prune.calibration.hidden_states=device"],
     "prune.calibration.hidden_states applies to prune.calibration.mode=layerwise"),
    (["prune.calibration.resume_every=-1"], "prune.calibration.resume_every=-1: use a number of layers"),
    (["prune.calibration.mode=sideways"], "sideways"),
])
def test_bad_layerwise_input_fails_before_writing(tmp_path, overrides, message):
    cfg = compose_config("prune", f"output_dir={tmp_path / 'out'}", f"prune.cache_dir={tmp_path / 'cache'}",
                         "progress=false", "prune.calibration.mode=layerwise", *overrides)
    with pytest.raises(ValueError, match=message):
        run_prune(cfg)
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache").exists()


def test_the_trainer_refuses_layerwise_scoring(tiny_checkpoint):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint("qwen3_moe"), dtype=torch.float32)
    cfg = compose_config("train", "prune.calibration.mode=layerwise")
    with pytest.raises(ValueError, match="is the prune app's .*; drop it, or prune first and pass prune.keep_set"):
        score_keep_set(model, None, cfg, data_key="calibration")

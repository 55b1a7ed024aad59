"""moe/checkpoint.py and the exports of moe/pruning.py: the pruned checkpoint streamed from a checkpoint's files
(`export_pruned_from_checkpoint`) and the one written from a model in memory (`export_pruned`, no copy of the model)
are bitwise what the old path wrote (`prune_experts_(copy.deepcopy(model)).save_pretrained(...)`, the reference
here): the same tensor names, dtypes and values, config.json, generation_config.json and index metadata, on every
family; a full disk leaves nothing under the final name.
"""

from __future__ import annotations

import copy
import errno
import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from slimwise_train.moe.adapters import get_adapter
from slimwise_train.moe.checkpoint import LazyCheckpoint, PlannedSafetensorsWriter, PlannedTensor
from slimwise_train.moe.keepset import KeepSet
from slimwise_train.moe.pruning import drop_mtp, export_pruned, export_pruned_from_checkpoint, prune_experts_
from slimwise_train.testing.tiny import SUPPORTED_TINY, tiny_model


def _tensors(folder) -> dict:
    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(path)))
    return out


def _keep_set(model) -> KeepSet:
    """Half the experts per layer at random; non-uniform (4 and 5 kept) where the family can export that."""
    adapter = get_adapter(model)
    layers = adapter.moe_layers(model)
    g = torch.Generator().manual_seed(1)
    counts = [4 + (adapter.supports_non_uniform_export and i % 2) for i in range(len(layers))]
    kept = [sorted(torch.randperm(8, generator=g)[:n].tolist()) for n in counts]
    return KeepSet.from_kept(layers, kept, model_type=model.config.model_type)


def _assert_same_checkpoint(got, reference):
    a, b = _tensors(got), _tensors(reference)
    assert a.keys() == b.keys()
    for name in b:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    for name in ("config.json", "generation_config.json"):
        assert json.loads((got / name).read_text()) == json.loads((reference / name).read_text()), name
    index = "model.safetensors.index.json"
    if (reference / index).exists():
        assert json.loads((got / index).read_text())["metadata"] == json.loads((reference / index).read_text())["metadata"]


def _reference(model, keep, folder):
    # the old path, with the export's MTP rule (its config says 0 MTP layers: moe/pruning.py drop_mtp) applied
    pad_to = None if keep.is_uniform else max(keep.num_kept)
    pruned = prune_experts_(copy.deepcopy(model), keep, pad_to=pad_to)
    drop_mtp(pruned)
    pruned.save_pretrained(folder, max_shard_size="40KB")
    return folder


@pytest.mark.parametrize("model_type", SUPPORTED_TINY)
def test_streamed_and_in_memory_exports_are_bitwise_the_old_export(tmp_path, tiny_checkpoint, model_type):
    source = tiny_checkpoint(model_type)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    keep = _keep_set(model)
    reference = _reference(model, keep, tmp_path / "reference")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    export_pruned(model, keep, tmp_path / "memory", max_shard_size="40KB")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the model is left as it was
    checkpoint = LazyCheckpoint(source, torch.float32)
    export_pruned_from_checkpoint(checkpoint, keep, tmp_path / "streamed")
    for folder in (tmp_path / "memory", tmp_path / "streamed"):
        _assert_same_checkpoint(folder, reference)
        assert KeepSet.load(folder / "slimwise_keep_set.json") == keep
    # output shards no larger than the source's largest (the streamed export's default)
    largest = max(p.stat().st_size for p in source.glob("*.safetensors"))
    assert all(p.stat().st_size <= largest + 4096 for p in (tmp_path / "streamed").glob("*.safetensors"))
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "streamed")
    assert get_adapter(reloaded).moe_layers(reloaded)[0].num_experts == max(keep.num_kept)


def test_tied_embeddings_and_a_bf16_source_loaded_in_fp32(tmp_path):
    """A tied output embedding is written once (as save_pretrained does); a bf16 checkpoint scored in fp32 is exported
    in fp32 by both paths, as from_pretrained(dtype=float32) + save_pretrained would."""
    source = tmp_path / "source"
    tiny_model("gemma4_text", tie_word_embeddings=True).to(torch.bfloat16).save_pretrained(source,
                                                                                         max_shard_size="30KB")
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    keep = _keep_set(model)
    reference = _reference(model, keep, tmp_path / "reference")
    assert "lm_head.weight" not in _tensors(reference)
    export_pruned_from_checkpoint(LazyCheckpoint(source, torch.float32), keep, tmp_path / "streamed")
    _assert_same_checkpoint(tmp_path / "streamed", reference)
    assert {t.dtype for t in _tensors(tmp_path / "streamed").values()} == {torch.float32}


@pytest.mark.parametrize("model_type", ["deepseek_v3", "gemma4_text"])
def test_the_streamed_export_holds_one_tensor_or_one_load_group_at_a_time(tmp_path, tiny_checkpoint, model_type):
    """Per-expert checkpoint tensors (DeepSeek-V3 here) are copied one at a time; tensors with an expert dimension
    stored fused (Gemma 4) are loaded one conversion group at a time, sliced and released."""
    import weakref

    checkpoint = LazyCheckpoint(tiny_checkpoint(model_type), torch.float32)
    model = checkpoint.model
    alive, most_alive, groups = [], [0], []
    real_read, real_materialize = checkpoint.read_tensors, checkpoint.materialize

    def read_tensors(keys):
        for tensor in real_read(keys):
            alive.append(weakref.ref(tensor))
            most_alive[0] = max(most_alive[0], sum(ref() is not None for ref in alive))
            yield tensor

    def materialize(targets, device="cpu"):
        real_materialize(targets, device)
        groups.append(sorted(name for name, t in model.state_dict().items() if t.device.type != "meta"))

    checkpoint.read_tensors, checkpoint.materialize = read_tensors, materialize
    export_pruned_from_checkpoint(checkpoint, _keep_set(model), tmp_path / "streamed")
    assert most_alive[0] == 1 and len(alive) > 0
    assert all(group == sorted(checkpoint.load_groups(group)[0]) for group in groups)  # one group each time
    # only tensors stored fused are loaded: the routers (both), Gemma 4's fused experts
    assert any(".experts." in name for group in groups for name in group) == (model_type == "gemma4_text")
    assert all(t.device.type == "meta" for t in model.state_dict().values())  # every part released after its write


def test_a_full_disk_leaves_nothing_under_the_final_name(tmp_path, tiny_checkpoint, monkeypatch, capsys):
    from slimwise_train.utils.cli import user_errors

    checkpoint = LazyCheckpoint(tiny_checkpoint("qwen3_next"), torch.float32)
    keep = _keep_set(checkpoint.model)
    real_write = PlannedSafetensorsWriter.write
    calls = {"n": 0}

    def write(self, name, tensor):
        calls["n"] += 1
        if calls["n"] == 6:  # halfway through the second shard
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(self, name, tensor)

    monkeypatch.setattr(PlannedSafetensorsWriter, "write", write)
    with pytest.raises(SystemExit) as exit_info, user_errors("slimwise_train.prune"):
        export_pruned_from_checkpoint(checkpoint, keep, tmp_path / "pruned")
    assert exit_info.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("slimwise_train.prune: error: no space left on the device")
    assert list(tmp_path.iterdir()) == []  # neither the folder nor its temporary sibling


def test_a_tensor_out_of_plan_is_refused(tmp_path):
    writer = PlannedSafetensorsWriter(tmp_path, [PlannedTensor("a", torch.float32, (2,))], 1 << 20)
    with pytest.raises(RuntimeError, match="export out of plan"):
        writer.write("a", torch.zeros(3))
    writer.abort()
    with pytest.raises(RuntimeError, match="stopped after 0 of 1 planned tensors"):
        writer.close(2)

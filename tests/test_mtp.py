"""Multi-token-prediction (MTP) layers: the decision is that a pruned or distilled export drops them and its config
says so (`mtp_num_hidden_layers` / `num_nextn_predict_layers`: 0; moe/pruning.py `drop_mtp`), so that no engine builds a
full-width MTP head over a pruned trunk. Exercised on the twins of Qwen3.6-35B-A3B and DeepSeek-V3, whose safetensors
carry an MTP layer under the real names (which llama.cpp's converter reads: checked here)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM

from slimwise_train.config import ModelConfig
from slimwise_train.distill.export import export_student
from slimwise_train.distill.student import DistillModel
from slimwise_train.models import load_model
from slimwise_train.moe.adapters import get_adapter
from slimwise_train.moe.keepset import KeepSet
from slimwise_train.moe.pruning import drop_mtp, export_pruned
from slimwise_train.testing.tiny import tiny_model
from slimwise_train.utils.hf import text_config

MTP_PRESETS = ("qwen3_5_moe_35b_a3b", "deepseek_v3")


def _tensor_names(folder):
    names = []
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), "pt") as handle:
            names += list(handle.keys())
    return names


@pytest.mark.parametrize("preset", MTP_PRESETS)
def test_twin_carries_an_mtp_layer_under_the_real_names(twins, preset):
    """The MTP layer is a decoder layer of the trunk's kind (the same tensors as the trunk's last layer of that kind,
    under the MTP prefix) plus its head tensors; transformers leaves all of them unloaded."""
    folder = twins[preset]
    config = AutoConfig.from_pretrained(folder)
    adapter = get_adapter(config)
    assert adapter.mtp_layers(config) == 1
    names = _tensor_names(folder)
    mtp = {n for n in names if adapter.is_mtp_tensor(n, config)}
    head = set(adapter.mtp_head_tensors(config, 0))
    assert head <= mtp
    prefix = adapter.mtp_layer_prefix(config, 0)
    layer = {n[len(prefix):] for n in mtp - head if n.startswith(prefix)}
    assert mtp - head == {prefix + suffix for suffix in layer}
    trunk = text_config(config)
    last = max(i for i in range(trunk.num_hidden_layers)
               if (getattr(trunk, "layer_types", None) or ["full_attention"] * trunk.num_hidden_layers)[i]
               == "full_attention")
    trunk_prefix = next(n for n in names if f"layers.{last}." in n and not adapter.is_mtp_tensor(n, config))
    trunk_prefix = trunk_prefix[: trunk_prefix.index(f"layers.{last}.") + len(f"layers.{last}.")]
    assert layer == {n[len(trunk_prefix):] for n in names if n.startswith(trunk_prefix)}
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert not [n for n in model.state_dict() if adapter.is_mtp_tensor(n, model)]
    record = json.loads((folder / "slimwise_twin.json").read_text())
    assert record["mtp"]["tensors"] == sorted(mtp) and record["mtp"]["key"] == adapter.mtp_layers_key


@pytest.mark.parametrize("preset", MTP_PRESETS)
def test_pruned_and_distilled_exports_drop_the_mtp_layers_and_say_so(twins, preset, tmp_path):
    model, tokenizer = load_model(ModelConfig(name=preset, path=str(twins[preset])), "cpu")
    adapter = get_adapter(model)
    layers = adapter.moe_layers(model)
    keep = KeepSet.from_kept(layers, [list(range(0, m.num_experts, 2)) for m in layers],
                             model_type=text_config(model).model_type)
    export_pruned(model, keep, tmp_path / "pruned", tokenizer=tokenizer)
    assert adapter.mtp_layers(model) == 1  # the model exported from is left as it was
    export_student(DistillModel(model, keep), tmp_path / "distilled", tokenizer=tokenizer)
    for name in ("pruned", "distilled"):
        folder = tmp_path / name
        config = AutoConfig.from_pretrained(folder)
        assert getattr(text_config(config), adapter.mtp_layers_key) == 0, name
        assert not [n for n in _tensor_names(folder) if adapter.is_mtp_tensor(n, config)], name
        _, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
        assert not any(info.values()), (name, info)
    record = json.loads((tmp_path / "distilled" / "slimwise_export.json").read_text())
    assert record["mtp"] == f"dropped: {adapter.mtp_layers_key} 1 -> 0 (no MTP tensors exported)"


def test_drop_mtp_refuses_a_model_that_holds_mtp_tensors():
    model = tiny_model("qwen3_5_moe_text")
    assert drop_mtp(model) == {"key": "mtp_num_hidden_layers", "was": 0}
    model.mtp = torch.nn.Module()
    model.mtp.fc = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="multi-token-prediction tensors"):
        drop_mtp(model)
    assert drop_mtp(tiny_model("olmoe")) is None  # a family without MTP layers


# Run in a child: llama.cpp's converter code as a library (its `conversion` package and gguf-py), asked where it puts
# each checkpoint tensor name, without converting (a 248k vocabulary costs half a minute there).
_MAP_NAMES = """
import json, sys
source, architecture, trunk = sys.argv[1], sys.argv[2], int(sys.argv[3])
sys.path[:0] = [source, source + "/gguf-py"]
import gguf
from conversion import get_model_class
cls = get_model_class(architecture)
cls.no_mtp = cls.mtp_only = False
cls._original_block_count = trunk
names = json.loads(sys.stdin.read())
tensor_map = gguf.get_tensor_name_map(cls.model_arch, trunk + 1)
out = {}
for name in names:
    item = cls.filter_tensors((name, None))
    out[name] = None if item is None else tensor_map.get_name(item[0], try_suffixes=(".weight", ".bias"))
print(json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.engine
@pytest.mark.subprocess
def test_llama_cpp_reads_the_twins_mtp_layer_and_the_exports_carry_none(twins, twin_ggufs, tmp_path):
    """llama.cpp's converter code maps the Qwen3.6 twin's MTP tensors to a nextn layer after the trunk (so they carry
    the names it reads: without --no-mtp it writes them as blk.<trunk>.nextn.* and the layer as blk.<trunk>.*);
    `serve gguf` passes --no-mtp (the project serves the trunk), and the pruned export's GGUF has no nextn layer
    either. DeepSeek-V3's converter skips layers past num_hidden_layers itself (test_twins checks that its GGUF has 5
    blocks and no nextn key)."""
    from slimwise_train.serve.gguf import convert
    from slimwise_train.serve.llamacpp import GGUFModel, source_dir

    folder = twins["qwen3_5_moe_35b_a3b"]
    config = AutoConfig.from_pretrained(folder)
    adapter, trunk = get_adapter(config), text_config(config).num_hidden_layers
    names = [n for n in _tensor_names(folder) if adapter.is_mtp_tensor(n, config) and ".experts." not in n]
    proc = subprocess.run([sys.executable, "-c", _MAP_NAMES, str(source_dir()), config.architectures[0], str(trunk)],
                          input=json.dumps(names), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    mapped = json.loads(proc.stdout.strip().splitlines()[-1])
    assert mapped["mtp.fc.weight"] == f"blk.{trunk}.nextn.eh_proj.weight"
    assert mapped["mtp.pre_fc_norm_embedding.weight"] == f"blk.{trunk}.nextn.enorm.weight"
    assert mapped["mtp.pre_fc_norm_hidden.weight"] == f"blk.{trunk}.nextn.hnorm.weight"
    assert mapped["mtp.norm.weight"] == f"blk.{trunk}.nextn.shared_head_norm.weight"
    assert all(value and value.startswith(f"blk.{trunk}.") for value in mapped.values()), mapped

    model, tokenizer = load_model(ModelConfig(name="q", path=str(folder)), "cpu")
    layers = get_adapter(model).moe_layers(model)
    keep = KeepSet.from_kept(layers, [list(range(0, m.num_experts, 2)) for m in layers],
                             model_type=text_config(model).model_type)
    export_pruned(model, keep, tmp_path / "pruned", tokenizer=tokenizer)
    for path in (twin_ggufs["qwen3_5_moe_35b_a3b"], convert(tmp_path / "pruned", tmp_path / "pruned.gguf",
                                                          log=lambda _: None)):
        with GGUFModel(path, vocab_only=True) as gguf_model:
            meta = gguf_model.metadata()
        assert "qwen35moe.nextn_predict_layers" not in meta and meta["qwen35moe.block_count"] == str(trunk), path

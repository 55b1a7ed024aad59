"""Adapters, keep sets, phase-aware masking, physical pruning, export and KV handoff on every family.

Each family is a tiny random model of the stock transformers class (slimwise_train.testing.tiny). Tolerances:
fp32 throughout; masked vs pruned logits within 1e-4 (measured ~1e-6: same math, different expert order).
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from slimwise_train.moe.adapters import SUPPORTED_FAMILIES, adapter_class, get_adapter
from slimwise_train.moe.handoff import continue_on_cache, copy_cache, handoff_generate, make_cache_autograd_safe, prefill
from slimwise_train.moe.keepset import KeepSet
from slimwise_train.moe.masking import PhaseMasking
from slimwise_train.moe.pruning import export_pruned, prune_experts_
from slimwise_train.moe.stats import record_expert_stats
from slimwise_train.testing.tiny import SUPPORTED_TINY, TINY_VOCAB, tiny_config, tiny_model

TOL = 1e-4
UNIFORM = [[0, 2, 5, 7], [1, 3, 4, 6]]
NON_UNIFORM = [[1, 5, 6], [0, 2, 3, 4, 7]]
# The tiny model types whose family can export a non-uniform keep set (padded experts a router bias disables).
NON_UNIFORM_EXPORTABLE = {mt for mt in SUPPORTED_TINY if adapter_class(mt).supports_non_uniform_export}

families = pytest.mark.parametrize("model_type", SUPPORTED_TINY)


def _ids(batch=2, length=14, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, TINY_VOCAB, (batch, length), generator=g)


def _keep(model, kept):
    return KeepSet.from_kept(get_adapter(model).moe_layers(model), kept, model_type=model.config.model_type)


def test_every_issue_family_has_a_tiny_model():
    covered = {get_adapter(tiny_model(mt)).family for mt in SUPPORTED_TINY}
    assert covered == set(SUPPORTED_FAMILIES)
    assert {"gpt_oss", "deepseek_v3"} <= NON_UNIFORM_EXPORTABLE and "qwen3_moe" not in NON_UNIFORM_EXPORTABLE


@families
def test_the_adapter_names_the_config_keys_and_expert_groups(model_type):
    """What code outside the adapters used to branch on a family for: the expert-count and top-k keys (the bench's
    sized models), the expert groups (keep sets and exports), the BOS convention (lm-eval), a dense member."""
    from slimwise_train.moe.adapters import adapter_class, family_of
    from slimwise_train.utils.hf import text_config

    config = tiny_config(model_type)
    adapter = get_adapter(config)
    assert type(adapter) is adapter_class(model_type) and family_of(model_type) == adapter.family
    assert getattr(text_config(config), adapter.num_experts_key) == 8
    assert getattr(text_config(config), adapter.top_k_key) == 2
    assert adapter.expert_groups(config) == 1 and adapter.has_experts(config)
    assert adapter.add_bos_token == (adapter.family == "gemma4")  # lm-eval's hf rule: Gemma scores with its BOS
    grouped = tiny_config(model_type, n_group=2, topk_group=1)
    assert adapter.expert_groups(grouped) == (2 if adapter.family == "deepseek_v3" else 1)


def test_dense_members_and_unknown_types_have_no_adapter():
    from slimwise_train.moe.adapters import adapter_class

    with pytest.raises(ValueError, match="dense models have no experts"):
        get_adapter(tiny_config("gemma4_text", enable_moe_block=False))
    with pytest.raises(ValueError, match="'llama' is not a supported MoE model"):
        adapter_class("llama")


def test_text_config_of_a_model_a_config_and_a_multimodal_config():
    from transformers import AutoConfig

    from slimwise_train.utils.hf import text_config

    model = tiny_model("qwen3_moe")
    assert text_config(model) is model.config and text_config(model.config) is model.config
    wrapper = AutoConfig.for_model("gemma4", text_config=tiny_config("gemma4_text").to_dict())
    assert text_config(wrapper) is wrapper.get_text_config() and text_config(wrapper).model_type == "gemma4_text"


@families
def test_reroute_with_nothing_removed_reproduces_the_stock_router(model_type):
    model = tiny_model(model_type)
    adapter = get_adapter(model)
    mismatches = []
    for moe in adapter.moe_layers(model):
        def hook(module, args, out, moe=moe):
            new = adapter.reroute(moe, out, torch.zeros(moe.num_experts, dtype=torch.bool))
            pairs = zip(out, new) if isinstance(out, tuple) else [(out, new)]
            if not all(torch.equal(a, b) for a, b in pairs):
                mismatches.append(moe.layer_index)
        adapter.mask_hook_target(moe).register_forward_hook(hook)
    model(_ids())
    assert mismatches == []


@families
@pytest.mark.parametrize("kept", [UNIFORM, NON_UNIFORM], ids=["uniform", "non_uniform"])
def test_masked_decode_equals_physically_pruned(model_type, kept):
    model = tiny_model(model_type)
    keep = _keep(model, kept)
    ids = _ids()
    with torch.no_grad():
        full = model(ids).logits
        pruned = prune_experts_(copy.deepcopy(model), keep)(ids).logits
        masking = PhaseMasking(model, keep)
        with masking.phase("decode"):
            masked = model(ids).logits
        with masking.phase("prefill"):
            prefill_logits = model(ids).logits
    assert (masked - pruned).abs().max() <= TOL
    assert (masked - full).abs().max() > 0.1  # the mask really changes the model
    assert torch.equal(prefill_logits, full)  # prefill phase is the untouched full model
    assert [m.num_experts for m in get_adapter(model).moe_layers(model)] == [8, 8]


@families
def test_masked_experts_receive_zero_tokens_in_decode(model_type):
    model = tiny_model(model_type)
    keep = _keep(model, NON_UNIFORM)
    masking = PhaseMasking(model, keep)
    counts = {"prefill": 0, "decode": 0}
    for phase in counts:
        records = []
        with torch.no_grad(), masking.phase(phase), record_expert_stats(model, records.append):
            model(_ids(batch=4, length=16))
        for rec in records:
            removed = keep.layer(rec.layer_index).removed_mask()
            counts[phase] += int(removed[rec.top_k_index].sum())
    assert counts["decode"] == 0
    assert counts["prefill"] > 0  # the same experts are used when nothing masks them


@families
def test_stats_hook_is_exact_and_norms_match_a_per_expert_loop(model_type):
    model = tiny_model(model_type)
    adapter = get_adapter(model)
    ids = _ids(batch=2, length=6)
    with torch.no_grad():
        reference = model(ids).logits
        records, inputs = [], {}
        hooks = [
            moe.experts.register_forward_pre_hook(lambda mod, args, i=moe.layer_index: inputs.__setitem__(i, args[0]))
            for moe in adapter.moe_layers(model)
        ]
        with record_expert_stats(model, records.append):
            recorded = model(ids).logits
        for h in hooks:
            h.remove()
    assert torch.equal(recorded, reference)  # collecting statistics does not change the forward
    assert len(records) == len(adapter.moe_layers(model))
    for rec in records:
        moe = next(m for m in adapter.moe_layers(model) if m.layer_index == rec.layer_index)
        eager = type(moe.experts).forward.__wrapped__  # the stock per-expert loop, independent of grouped_mm
        hidden = inputs[rec.layer_index]
        assert rec.probs.shape == (hidden.shape[0], moe.num_experts)
        for t in range(hidden.shape[0]):
            for k in range(moe.top_k):
                j = rec.top_k_index[t, k].view(1, 1)
                out = eager(moe.experts, hidden[t : t + 1], j, torch.ones(1, 1))
                torch.testing.assert_close(rec.output_norm[t, k], out.norm(), rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- export and reload


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Export every family (uniform; non-uniform where expressible), then reload all of them in ONE fresh
    process that imports only transformers, and return the logits it computed."""
    root = tmp_path_factory.mktemp("export")
    ids = _ids()
    torch.save(ids, root / "ids.pt")
    expected, dirs = {}, {}
    for model_type in SUPPORTED_TINY:
        model = tiny_model(model_type)
        for name, kept in (("uniform", UNIFORM), ("non_uniform", NON_UNIFORM)):
            keep = _keep(model, kept)
            if name == "non_uniform" and model_type not in NON_UNIFORM_EXPORTABLE:
                continue
            out = export_pruned(model, keep, root / f"{model_type}-{name}")
            masking = PhaseMasking(model, keep)
            with torch.no_grad(), masking.phase("decode"):
                expected[(model_type, name)] = model(ids).logits
            masking.remove()
            dirs[f"{model_type}-{name}"] = str(out)
    script = textwrap.dedent(
        """
        import json, sys, torch
        from transformers import AutoModelForCausalLM
        dirs = json.loads(sys.argv[1]); ids = torch.load(sys.argv[2])
        assert not any(m.startswith("slimwise") for m in sys.modules)
        out = {}
        for key, path in dirs.items():
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            with torch.no_grad():
                out[key] = model(ids).logits
        assert not any(m.startswith("slimwise") for m in sys.modules)
        torch.save(out, sys.argv[3])
        """
    )
    result_path = root / "reloaded.pt"
    proc = subprocess.run(
        [sys.executable, "-c", script, json.dumps(dirs), str(root / "ids.pt"), str(result_path)],
        capture_output=True, text=True, cwd=root, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return expected, torch.load(result_path), dirs


EXPORT_CASES = [(mt, "uniform") for mt in SUPPORTED_TINY] + [
    (mt, "non_uniform") for mt in SUPPORTED_TINY if mt in NON_UNIFORM_EXPORTABLE
]


def _full_size(model_type):
    return sum(p.numel() * p.element_size() for p in tiny_model(model_type).parameters())


@pytest.mark.parametrize("model_type,name", EXPORT_CASES)
@pytest.mark.subprocess
def test_reloaded_checkpoint_equals_masked_model(exported, model_type, name):
    expected, reloaded, _ = exported
    key = (model_type, name)
    assert (reloaded[f"{model_type}-{name}"] - expected[key]).abs().max() <= TOL


@families
@pytest.mark.subprocess
def test_exported_checkpoint_is_smaller_and_carries_the_keep_set(exported, model_type):
    _, _, dirs = exported
    path = Path(dirs[f"{model_type}-uniform"])
    config = AutoConfig.from_pretrained(path).get_text_config()
    assert getattr(config, get_adapter(tiny_model(model_type)).num_experts_key) == 4
    assert (path / "model.safetensors").stat().st_size < 0.8 * _full_size(model_type)
    assert KeepSet.load(path / "slimwise_keep_set.json").num_kept == (4, 4)


@pytest.mark.parametrize("model_type", [mt for mt in SUPPORTED_TINY if mt not in NON_UNIFORM_EXPORTABLE])
def test_non_uniform_export_errors_clearly_and_writes_nothing(tmp_path, model_type):
    model = tiny_model(model_type)
    with pytest.raises(ValueError, match="non-uniform keep set"):
        export_pruned(model, _keep(model, NON_UNIFORM), tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- KV handoff


@families
def test_pruned_model_on_full_prefix_cache_equals_masked_decode(model_type):
    model = tiny_model(model_type)
    keep = _keep(model, NON_UNIFORM)
    pruned = prune_experts_(copy.deepcopy(model), keep)
    PhaseMasking(model, keep)
    ids = _ids(length=20)
    prompt, cont = ids[:, :12], ids[:, 12:]
    with torch.no_grad():
        whole = model(ids).logits
        _, cache = prefill(model, prompt)
        cache_a, cache_b = copy_cache(cache), copy_cache(cache)
        full_cont, _ = continue_on_cache(model, cache, cont, phase="prefill")
        masked_cont, _ = continue_on_cache(model, cache_a, cont, phase="decode")
        pruned_cont, _ = continue_on_cache(pruned, cache_b, cont)
    assert (full_cont - whole[:, 12:]).abs().max() <= TOL  # cached continuation == one full pass
    assert (masked_cont - pruned_cont).abs().max() <= TOL
    assert (masked_cont - full_cont).abs().max() > 0.1


@families
@pytest.mark.subprocess
def test_greedy_handoff_generation_matches_token_for_token(exported, model_type):
    _, _, dirs = exported
    model = tiny_model(model_type)
    keep = _keep(model, UNIFORM)
    checkpoint = AutoModelForCausalLM.from_pretrained(dirs[f"{model_type}-uniform"], dtype=torch.float32).eval()
    full_model = copy.deepcopy(model)
    PhaseMasking(model, keep)
    ids = _ids(batch=3, length=10, seed=3)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding in one row
    ids = ids.masked_fill(mask == 0, 0)
    one_model = handoff_generate(model, model, ids, mask, max_new_tokens=12, eos_token_id=2)
    two_models = handoff_generate(full_model, checkpoint, ids, mask, max_new_tokens=12, eos_token_id=2)
    no_pruning = handoff_generate(full_model, full_model, ids, mask, max_new_tokens=12, eos_token_id=2)
    assert torch.equal(one_model.tokens, two_models.tokens)
    assert torch.equal(one_model.first_token, no_pruning.first_token)  # the first token comes from the full pool
    assert not torch.equal(one_model.tokens, no_pruning.tokens)  # decode really ran pruned


@families
def test_auto_phase_makes_hf_generate_run_slimwise(model_type):
    model = tiny_model(model_type)
    keep = _keep(model, UNIFORM)
    masking = PhaseMasking(model, keep, phase="auto")
    ids = _ids(batch=1, length=8, seed=5)
    generated = model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)[:, 8:]
    masking.set_phase("prefill")
    ours = handoff_generate(model, model, ids, None, max_new_tokens=8, eos_token_id=-1)
    assert torch.equal(generated, ours.tokens)


@families
def test_gradients_reach_routers_and_norms_through_a_teacher_cache(model_type):
    model = tiny_model(model_type)
    adapter = get_adapter(model)
    keep = _keep(model, NON_UNIFORM)
    PhaseMasking(model, keep)
    for p in model.parameters():
        p.requires_grad_(False)
    trainable = {}
    for name, module in model.named_modules():
        is_norm = "norm" in type(module).__name__.lower()
        for pname, p in module.named_parameters(recurse=False):
            if is_norm or any(module is adapter.mask_hook_target(m) or module is m.router for m in adapter.moe_layers(model)):
                p.requires_grad_(True)
                trainable[f"{name}.{pname}"] = p
    experts = [m.experts for m in adapter.moe_layers(model)]
    for e in experts:
        for p in e.parameters():
            p.requires_grad_(True)
    ids = _ids(length=18)
    with torch.no_grad():
        _, cache = prefill(model, ids[:, :10])
    make_cache_autograd_safe(cache)
    logits, _ = continue_on_cache(model, cache, ids[:, 10:], phase="decode")
    logits.float().logsumexp(-1).mean().backward()
    routers = [p for n, p in trainable.items() if "router" in n or "gate" in n]
    norms = [p for n, p in trainable.items() if "norm" in n]
    assert routers and norms
    for p in routers + norms:
        assert p.grad is not None and torch.isfinite(p.grad).all()
    assert any(p.grad.abs().sum() > 0 for p in routers)
    assert sum(int(p.grad.abs().sum() > 0) for p in norms) >= len(norms) // 2
    for moe, e in zip(adapter.moe_layers(model), experts):
        removed = keep.layer(moe.layer_index).removed
        for name, p in e.named_parameters():
            assert p.grad[list(removed)].abs().max() == 0, name  # masked experts get exactly zero gradient
            assert p.grad[list(keep.layer(moe.layer_index).kept)].abs().sum() > 0, name


# --------------------------------------------------------------------------- bad input


def test_keep_set_validation_errors():
    model = tiny_model("qwen3_moe")
    layers = get_adapter(model).moe_layers(model)
    with pytest.raises(ValueError, match="keep at least 2"):
        KeepSet.from_kept(layers, [[0], [1, 2]])
    with pytest.raises(ValueError, match="out of range"):
        KeepSet.from_kept(layers, [[0, 8], [1, 2]])
    with pytest.raises(ValueError, match="duplicate"):
        KeepSet.from_kept(layers, [[1, 1, 2], [1, 2]])
    with pytest.raises(ValueError, match="2 MoE layers"):
        KeepSet.from_kept(layers, [[0, 1]])


def test_keep_set_from_another_model_is_rejected(tmp_path):
    qwen = tiny_model("qwen3_moe")
    deep = tiny_model("qwen3_moe", num_hidden_layers=3)
    keep = _keep(qwen, UNIFORM)
    with pytest.raises(ValueError, match="another model"):
        PhaseMasking(deep, keep)
    with pytest.raises(ValueError, match="made for model_type 'qwen3_moe'"):
        keep.check_model(tiny_model("mixtral"))
    with pytest.raises(ValueError, match="another model"):
        export_pruned(deep, keep, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []
    bigger = tiny_model("qwen3_moe", num_experts=16)
    with pytest.raises(ValueError, match="is for 8 experts but the model layer has 16"):
        keep.check_model(bigger)


def test_dense_model_is_rejected_with_the_supported_list(tmp_path):
    dense = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    with pytest.raises(ValueError, match=r"not a supported MoE model.*qwen3_moe.*gpt_oss"):
        get_adapter(dense)
    with pytest.raises(ValueError, match="not a supported MoE model"):
        export_pruned(dense, _keep(tiny_model("qwen3_moe"), UNIFORM), tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_keep_set_json_round_trip_and_bad_files(tmp_path):
    model = tiny_model("gpt_oss")
    keep = _keep(model, NON_UNIFORM)
    path = tmp_path / "keep.json"
    keep.save(path)
    assert KeepSet.load(path) == keep
    assert [p.name for p in tmp_path.iterdir()] == ["keep.json"]  # no temp file left
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        KeepSet.load(tmp_path / "bad.json")
    (tmp_path / "other.json").write_text(json.dumps({"layers": []}))
    with pytest.raises(ValueError, match="not a keep set"):
        KeepSet.load(tmp_path / "other.json")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        KeepSet.load(tmp_path / "missing.json")


def test_export_refuses_to_overwrite_and_keeps_old_output(tmp_path):
    model = tiny_model("qwen3_moe")
    keep = _keep(model, UNIFORM)
    out = export_pruned(model, keep, tmp_path / "ckpt")
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(FileExistsError, match="overwrite"):
        export_pruned(model, keep, out)
    assert sorted(p.name for p in out.iterdir()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_deepseek_group_limited_routing_needs_balanced_groups():
    model = tiny_model("deepseek_v3", n_group=2, topk_group=1)
    layers = get_adapter(model).moe_layers(model)
    unbalanced = KeepSet.from_kept(layers, [[0, 1, 2, 4], [0, 4, 5, 6]])
    with pytest.raises(ValueError, match="per-group counts"):
        PhaseMasking(model, unbalanced)
    balanced = KeepSet.from_kept(layers, [[0, 2, 4, 6], [1, 3, 5, 7]])
    ids = _ids()
    with torch.no_grad():
        pruned = prune_experts_(copy.deepcopy(model), balanced)(ids).logits
        masking = PhaseMasking(model, balanced)
        with masking.phase("decode"):
            masked = model(ids).logits
    assert (masked - pruned).abs().max() <= TOL

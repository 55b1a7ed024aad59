"""Expert statistics, criteria and selection against brute-force references, on every family.

Tolerance: criteria within 1e-5 relative of a float64 brute-force loop that runs each expert on the tokens
routed to it with the stock per-expert (eager) code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import pytest

from slimwise_train.moe.adapters import get_adapter
from slimwise_train.prune.criteria import CRITERIA, get_criterion, select_keep
from slimwise_train.prune.statistics import ExpertStatistics, collect_statistics
from slimwise_train.testing.tiny import SUPPORTED_TINY, TINY_VOCAB, tiny_model


def _batch():
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(3, TINY_VOCAB, (3, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0  # right padding: these tokens must not count
    mask[2, 4:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _reference_probs(adapter, moe, router_in, router_out):
    """Router probabilities over all experts, recomputed in float64 from the router's input."""
    if adapter.family == "gemma4":
        return router_out[0].double()  # Gemma 4's router returns probabilities itself
    weight = moe.router.weight.double()
    bias = getattr(moe.router, "bias", None)
    logits = F.linear(router_in.double(), weight, bias.double() if isinstance(bias, torch.Tensor) else None)
    return logits.sigmoid() if adapter.family == "deepseek_v3" else logits.softmax(-1)


def brute_force_statistics(model, batch):
    adapter = get_adapter(model)
    layers = adapter.moe_layers(model)
    captured = {}
    hooks = []
    for moe in layers:
        i = moe.layer_index
        hooks.append(moe.router.register_forward_hook(
            lambda m, a, o, i=i: captured.__setitem__(("router", i), (a[0].reshape(-1, a[0].shape[-1]), o))))
        hooks.append(moe.experts.register_forward_pre_hook(lambda m, a, i=i: captured.__setitem__(("experts", i), a[0])))
    with torch.no_grad():
        model(**batch, use_cache=False)
    for h in hooks:
        h.remove()
    valid = batch["attention_mask"].reshape(-1).bool()
    E = layers[0].num_experts
    out = {name: torch.zeros(len(layers), E, dtype=torch.float64) for name in
           ("frequency", "mass_all", "mass_routed", "gate_sum", "ean_sum", "reap_sum")}
    for row, moe in enumerate(layers):
        router_in, router_out = captured[("router", moe.layer_index)]
        probs = _reference_probs(adapter, moe, router_in, router_out)
        weights, index = router_out[1].double(), router_out[2]
        expert_in = captured[("experts", moe.layer_index)]
        eager = type(moe.experts).forward.__wrapped__
        for j in range(E):
            tokens, slots = torch.where(index == j)
            keep = valid[tokens]
            tokens, slots = tokens[keep], slots[keep]
            if len(tokens) == 0:
                continue
            f = eager(moe.experts, expert_in[tokens], torch.zeros(len(tokens), 1, dtype=torch.long) + j,
                      torch.ones(len(tokens), 1))
            norms = f.double().norm(dim=-1)
            g = weights[tokens, slots]
            out["frequency"][row, j] = len(tokens)
            out["mass_routed"][row, j] = probs[tokens, j].sum()
            out["gate_sum"][row, j] = g.sum()
            out["ean_sum"][row, j] = norms.sum()
            out["reap_sum"][row, j] = (g * norms).sum()
        out["mass_all"][row] = probs[valid].sum(0)
    return out


@pytest.mark.parametrize("model_type", SUPPORTED_TINY)
def test_criteria_match_brute_force(model_type):
    model = tiny_model(model_type)
    batch = _batch()
    stats = collect_statistics(model, [batch], progress=False)
    ref = brute_force_statistics(model, batch)
    assert int(stats.num_tokens[0]) == int(batch["attention_mask"].sum())
    for name, tensor in ref.items():
        torch.testing.assert_close(getattr(stats, name), tensor, rtol=1e-5, atol=1e-9, msg=name)
    expected = {
        "frequency": ref["frequency"],
        "mass": ref["mass_all"],
        "mass_routed": ref["mass_routed"],
        "ean": ref["ean_sum"],
        "reap": torch.where(ref["frequency"] > 0, ref["reap_sum"] / ref["frequency"].clamp(min=1), 0.0),
    }
    for name, fn in CRITERIA.items():
        torch.testing.assert_close(fn(stats), expected[name], rtol=1e-5, atol=1e-9, msg=name)
    assert stats.frequency.sum() == 2 * stats.num_tokens.sum()  # top-2: every valid token picks two experts


def test_padding_is_excluded_from_statistics():
    model = tiny_model("qwen3_moe")
    batch = _batch()
    trimmed = collect_statistics(model, [{k: v[:1] for k, v in batch.items()}], progress=False)
    with_padded_rows = collect_statistics(model, [batch], progress=False)
    assert with_padded_rows.num_tokens[0] == batch["attention_mask"].sum()
    assert trimmed.num_tokens[0] == 9


def test_selection_is_deterministic_on_ties():
    scores = torch.tensor([[1.0, 2.0, 2.0, 0.5, 2.0, 1.0, 0.0, 1.0]])
    # Stable ranking: the three 2.0s first (1, 2, 4), then among the 1.0s the lowest index (0).
    assert select_keep(scores, 0.5, top_k=2) == [[0, 1, 2, 4]]
    assert select_keep(torch.zeros(2, 8), 0.5, top_k=2) == [[0, 1, 2, 3], [0, 1, 2, 3]]
    for _ in range(3):
        assert select_keep(scores, 0.25, top_k=2) == select_keep(scores.clone(), 0.25, top_k=2)


def test_global_scope_keeps_total_and_at_least_top_k():
    scores = torch.tensor([[10.0, 9, 8, 7, 6, 5, 4, 3], [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8]])
    kept = select_keep(scores, 0.5, top_k=2, scope="global")
    assert sum(len(k) for k in kept) == 8
    assert kept[1] == [6, 7]  # only its best top-2 survive: layer 0's scores dominate
    assert kept[0] == [0, 1, 2, 3, 4, 5]
    uniform = select_keep(scores, 0.5, top_k=2)
    assert [len(k) for k in uniform] == [4, 4]


def test_group_balanced_selection():
    scores = torch.arange(8.0).view(1, 8)
    assert select_keep(scores, 0.5, top_k=2, num_groups=2) == [[2, 3, 6, 7]]
    with pytest.raises(ValueError, match="split evenly"):
        select_keep(scores, 0.75, top_k=2, num_groups=2)


@pytest.mark.parametrize("ratio", [0.0, 1.0, -0.5, 1.5])
def test_bad_ratio(ratio):
    with pytest.raises(ValueError, match=r"prune.ratio must be in \(0, 1\)"):
        select_keep(torch.zeros(1, 8), ratio, top_k=2)


def test_ratio_leaving_fewer_than_top_k():
    with pytest.raises(ValueError, match="fewer than the router's top-2; use prune.ratio <= 0.75"):
        select_keep(torch.zeros(1, 8), 0.9, top_k=2)


def test_unknown_criterion():
    with pytest.raises(ValueError, match="prune.criterion='nope' is not one of: frequency, mass"):
        get_criterion("nope")


def test_statistics_round_trip(tmp_path):
    from slimwise_train.prune.statistics import load_scores, save_scores

    model = tiny_model("mixtral")
    stats = collect_statistics(model, [_batch()], progress=False)
    save_scores(tmp_path / "s.safetensors", stats, {"model": {"x": 1}})
    loaded, meta = load_scores(tmp_path / "s.safetensors")
    assert meta["model"] == {"x": 1}
    for name in ("frequency", "reap_sum", "num_tokens"):
        assert torch.equal(getattr(loaded, name), getattr(stats, name))
    assert isinstance(loaded, ExpertStatistics)

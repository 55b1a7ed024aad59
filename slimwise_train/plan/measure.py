"""Measure what the planner estimates, on a real (small) model on CPU: the bytes the student's forward saves for
backward, the KV cache after it, and the logits.

    measured = saved_activations(model_cfg, prune_cfg, distill_cfg, batch=2, prefix=40, continuation=48)

It runs the trainer's own pieces (DistillModel over a tiny random model of the family, a teacher prefill into a
DynamicCache, the student's continuation on it) under `torch.autograd.graph.saved_tensors_hooks` and sums the
distinct storages the autograd graph keeps, leaving out parameters and the cache's own tensors (counted as the KV
cache). tests/test_plan.py compares these with the planner's formulas family by family; docs/planning.md has the
numbers.
"""

from __future__ import annotations

import torch


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    st = t.untyped_storage()
    return st.data_ptr(), st.nbytes()


def _cache_storages(cache) -> set[int]:
    keys = set()
    for layer in getattr(cache, "layers", []):
        for value in vars(layer).values():
            tensors = value if isinstance(value, (list, tuple)) else [value]
            for t in tensors:
                if torch.is_tensor(t) and t.numel():
                    keys.add(t.untyped_storage().data_ptr())
    return keys


def _cache_bytes(cache) -> int:
    seen, total = set(), 0
    for layer in getattr(cache, "layers", []):
        for value in vars(layer).values():
            tensors = value if isinstance(value, (list, tuple)) else [value]
            for t in tensors:
                if torch.is_tensor(t) and t.numel() and t.untyped_storage().data_ptr() not in seen:
                    seen.add(t.untyped_storage().data_ptr())
                    total += t.untyped_storage().nbytes()
    return total


def saved_activations(model_cfg, prune_cfg, distill_cfg, batch: int, prefix: int, continuation: int,
                      dtype: torch.dtype = torch.float32, seed: int = 0) -> dict:
    """{"activations": bytes saved for backward (no parameters, no cache tensors), "kv_cache": bytes of the cache after
    the student's forward, "logits": bytes of the student's logits, "by_module": {attention|moe|norms|other: bytes}}."""
    from transformers import DynamicCache

    from slimwise_train.distill.student import DistillModel, StudentSpec
    from slimwise_train.moe.adapters import get_adapter
    from slimwise_train.moe.handoff import make_cache_autograd_safe
    from slimwise_train.plan.architecture import tiny_overrides
    from slimwise_train.prune.criteria import keep_set_from_scores
    from slimwise_train.testing.tiny import tiny_model
    from slimwise_train.utils.hf import text_config

    model = tiny_model(model_cfg.tiny, seed=seed, **tiny_overrides(model_cfg)).to(dtype)
    adapter = get_adapter(model)
    keep_set = keep_set_from_scores(model, None, prune_cfg.ratio, prune_cfg.scope, adapter=adapter)
    student = DistillModel(model, keep_set, StudentSpec.from_config(distill_cfg), adapter=adapter,
                           recompute=str(distill_cfg.memory.recompute))
    vocab = model.get_output_embeddings().weight.shape[0]
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, prefix + continuation), generator=generator)
    mask = torch.ones_like(ids)
    cache = DynamicCache(config=text_config(model))
    with torch.no_grad():
        student(ids[:, :prefix], attention_mask=mask[:, :prefix], phase="teacher", past_key_values=cache,
                logits_to_keep=1)
    make_cache_autograd_safe(cache)
    params = {p.untyped_storage().data_ptr() for p in student.parameters()}

    kinds = ["other"]
    handles = []
    for name, module in student.model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        kind = ("norms" if type(module).__name__.endswith("RMSNorm") else
                "attention" if leaf in ("self_attn", "linear_attn") else
                "moe" if leaf in ("mlp", "experts", "router", "shared_expert") else None)
        if kind:
            handles.append(module.register_forward_pre_hook(lambda m, a, k=kind: kinds.append(k)))
            handles.append(module.register_forward_hook(lambda m, a, o: kinds.pop() and None))
    seen: dict[int, tuple[str, int]] = {}

    def pack(t):
        ptr, nbytes = _storage_key(t)
        if ptr not in params and ptr not in seen and nbytes:
            seen[ptr] = (kinds[-1], nbytes)
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logits = student(ids[:, prefix:], attention_mask=mask, phase="student", past_key_values=cache)
    finally:
        for handle in handles:
            handle.remove()
        student.remove_hooks()
    in_cache = _cache_storages(cache)
    logits_ptr = logits.untyped_storage().data_ptr()
    by_module: dict[str, int] = {}
    for ptr, (kind, nbytes) in seen.items():
        if ptr in in_cache or ptr == logits_ptr:
            continue
        by_module[kind] = by_module.get(kind, 0) + nbytes
    return {"activations": sum(by_module.values()), "kv_cache": _cache_bytes(cache),
            "logits": logits.untyped_storage().nbytes(), "by_module": by_module}

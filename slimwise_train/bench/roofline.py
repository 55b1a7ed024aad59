"""What this machine allows a decode step: measured memory bandwidth and matmul throughput, and the roofline bound
of a step from the bytes it must move and the FLOPs it must do.

A decode step of `n` sequences must read every non-expert weight once, the experts its tokens route to (expected
under uniform routing: E (1 - (1 - k/E)^n) of E experts per layer for top-k routing), and each sequence's KV cache;
it must do 2 FLOPs per weight per token for the attention projections, router, the k routed experts and the LM
head, plus the attention over the cache. Its time is at least max(bytes / bandwidth, FLOPs / matmul rate): the
roofline. The ratio of two such bounds (full / pruned) is the speed-up the hardware allows; a measured speed-up
reads against it (`efficiency`). Routing in a real model is not uniform, so fewer distinct experts are touched
than the bound assumes at small batches: the bound is an estimate, stated as such.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, replace

import torch


@dataclass
class MachineRates:
    bandwidth_gbs: float  # GB/s, a large copy (read + write counted)
    matmul_gflops: float  # GFLOP/s, fp32 GEMM at the given threads
    threads: int

    def as_dict(self) -> dict:
        return {k: round(v, 2) if isinstance(v, float) else v for k, v in asdict(self).items()}


def measure_machine(threads: int, megabytes: int = 512, gemm: int = 1024, repeats: int = 5) -> MachineRates:
    """Median of `repeats` runs of a `megabytes` copy and a gemm x gemm fp32 matmul, with `threads` threads."""
    def median_seconds(fn) -> float:
        fn()  # untimed: first touch of the pages, kernel selection
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        src = torch.ones(megabytes * 2**20 // 4)
        dst = torch.empty_like(src)
        bandwidth = 2 * src.numel() * 4 / median_seconds(lambda: dst.copy_(src)) / 1e9
        a, b = torch.randn(gemm, gemm), torch.randn(gemm, gemm)
        flops = 2 * gemm**3 / median_seconds(lambda: a @ b) / 1e9
    finally:
        torch.set_num_threads(previous)
    return MachineRates(bandwidth, flops, threads)


@dataclass
class DecodeShape:
    """The sizes a decode step's cost depends on (bytes per weight element as stored)."""

    layers: int  # MoE layers
    experts: int  # routed experts per layer
    top_k: int
    expert_params: int  # one expert's weights
    other_params: int  # weights read every step besides the routed experts (attention, router, norms, shared, head)
    weight_bytes: float
    kv_bytes_per_token: float  # all layers, K and V
    attention_flops_per_ctx_token: float  # per token of context, all layers

    def with_experts(self, experts: int) -> "DecodeShape":
        """The same model with `experts` routed experts per layer (a pruned variant)."""
        return replace(self, experts=experts)


def expected_touched(experts: int, top_k: int, tokens: int) -> float:
    """Distinct experts of one layer that `tokens` tokens route to, top-k of `experts` uniformly at random."""
    return experts * (1 - (1 - top_k / experts) ** tokens)


def step_bound_s(shape: DecodeShape, sequences: int, context: int, rates: MachineRates,
                 touched: float | None = None) -> float:
    """Roofline time of one decode step of `sequences` sequences at `context` cached tokens each; `touched`: the
    distinct experts per layer if measured, else the uniform-routing expectation."""
    touched = expected_touched(shape.experts, shape.top_k, sequences) if touched is None else touched
    weights = (shape.other_params + shape.layers * touched * shape.expert_params) * shape.weight_bytes
    kv = sequences * context * shape.kv_bytes_per_token
    flops = sequences * (2 * (shape.other_params + shape.layers * shape.top_k * shape.expert_params)
                         + context * shape.attention_flops_per_ctx_token)
    return max((weights + kv) / (rates.bandwidth_gbs * 1e9), flops / (rates.matmul_gflops * 1e9))


def decode_shape(model, weight_bytes: float, kv_bytes: float) -> DecodeShape:
    """The DecodeShape of an HF MoE model whose weights are stored at `weight_bytes` per element, KV at `kv_bytes`."""
    from slimwise_train.moe.adapters import get_adapter

    adapter = get_adapter(model)
    layers = adapter.moe_layers(model)
    config = model.config
    per_expert = sum(getattr(m, n).numel() // layers[0].num_experts
                     for m, n, _ in adapter.expert_tensors(layers[0]) if m is layers[0].experts)
    total = sum(p.numel() for p in model.parameters())
    embed = model.get_input_embeddings().weight.numel()
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    other = total - len(layers) * layers[0].num_experts * per_expert - (0 if tied else embed)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return DecodeShape(
        layers=len(layers), experts=layers[0].num_experts, top_k=config.num_experts_per_tok, expert_params=per_expert,
        other_params=other, weight_bytes=weight_bytes,
        kv_bytes_per_token=config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * kv_bytes,
        attention_flops_per_ctx_token=4 * config.num_hidden_layers * config.num_attention_heads * head_dim)

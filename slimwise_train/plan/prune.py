"""What pruning a model holds, planned from its architecture (`python -m slimwise_train.plan` reports it beside the
distillation step): the peak GPU and host bytes of the statistics' calibration, the whole model vs one decoder layer
at a time (`prune.calibration.mode`), and of writing the pruned checkpoint; which mode fits.

Notation: s bytes per element (2 in bf16 on a GPU, 4 in fp32 on CPU), N calibration sequences of S tokens
(data.num_samples, data.seq_len), B sequences per calibration batch (calibration_batch_size), T = B S, H hidden, V
vocabulary, E experts, K top-k, I the routed experts' intermediate size.

  one layer's forward     the hidden states in and out (2 T H s), the attention's projections (T x their widths x s),
                          the experts under the statistics backend (every token's K choices: the repeated input,
                          gate_up, the activation, the unweighted outputs: T K (2 H + 3 I) s), the router's fp32
                          probabilities twice (T E 8) and the recorder's float64 copy on the host
  loading a layer         transformers stacks per-expert checkpoint tensors into one: the largest expert tensor once
                          more while it does (checkpoints that store one tensor per expert)
  whole (one device)      every weight + the largest layer's forward; the host holds the framework only (from_pretrained
                          loads onto the GPU); on CPU the host holds it all, plus the per-expert tensors the load fused,
                          which glibc keeps (1x the expert bytes, as the distillation plan counts them)
  whole over the GPUs     model.device_map=auto: the weights / world_size + one layer's forward, per GPU
  layerwise               device: max(the embeddings + the first layer's input, the largest layer + its forward), plus
                          the hidden states and the recorded masks if prune.calibration.hidden_states=device; host:
                          the hidden states of every calibration token (N S H s) and the recorded 4D masks (N S^2
                          bytes per attention kind that needs one, worst case: every batch padded), the layer being
                          read (its pages while it is copied to the device)
  export (streamed)       host: one checkpoint tensor at a time where experts are stored one tensor per expert (the
                          largest: the embeddings); where they are stored fused, the largest expert tensor and its
                          kept slice (the writer holds no tensor)
Weights and per-token terms are exact counts of the meta model; the framework baselines are the planner's (CPU: the
measured B; GPU: an estimate), so on a GPU the totals are estimates until a GPU run is recorded (docs/scale.md).
"""

from __future__ import annotations

from slimwise_train.plan.architecture import Architecture, LayerShape

GIB = 1 << 30
MIB = 1 << 20


def _attention_bytes(layer: LayerShape, tokens: int, hidden: int, s: int) -> int:
    if layer.attention == "linear":  # q, k, v, z projections and the gated delta rule's per-token outputs
        width = 2 * layer.lin_k_heads * layer.lin_k_dim + 3 * layer.lin_v_heads * layer.lin_v_dim
    elif layer.attention == "mla":  # the latent, decompressed keys and values, queries, output
        width = layer.kv_lora_rank + layer.heads * (2 * layer.head_dim + 2 * layer.v_head_dim)
    else:
        width = layer.heads * (layer.head_dim * (2 if layer.gated_output else 1) + layer.v_head_dim) + \
            2 * layer.kv_heads * layer.head_dim
    return tokens * width * s


def _moe_bytes(layer: LayerShape, tokens: int, hidden: int, s: int) -> int:
    if not layer.moe:
        return tokens * 3 * max(layer.dense_mlp_size, 1) * s
    routed = tokens * layer.top_k * (2 * hidden + 3 * layer.expert_size) * s
    routing = tokens * layer.experts * 8 + tokens * layer.top_k * 8  # fp32 probabilities twice; norms and weights
    shared = tokens * 3 * max(layer.stock_shared_size, layer.dense_mlp_size) * s
    return routed + routing + shared


def layer_forward_bytes(arch: Architecture, layer: LayerShape, tokens: int, s: int) -> int:
    """Transient bytes of one decoder layer's no-grad forward over `tokens` tokens with the statistics recorder."""
    residual = 2 * tokens * arch.hidden * s
    return residual + max(_attention_bytes(layer, tokens, arch.hidden, s), _moe_bytes(layer, tokens, arch.hidden, s))


def _mask_kinds(arch: Architecture) -> int:
    """Distinct 4D attention masks a padded batch records (full and sliding; linear attention takes the 2D one)."""
    return len({"sliding" if layer.attention == "sliding" else "full" for layer in arch.layers
                if layer.attention != "linear"})


def plan_prune(arch: Architecture, *, s: int, device: str, num_samples: int, seq_len: int, batch: int, world: int,
               gpu_memory_gib: float, host_memory_gib: float, gpu_baseline: int, host_baseline: int) -> dict:
    """{mode: {gpu_bytes, host_bytes, fits}, ...} for calibration (whole, whole over the GPUs, layerwise with the hidden
    states on the host or the device) and the streamed export, and the mode to use."""
    model = arch.frozen_params * s
    layers = [layer.params * s for layer in arch.layers]
    largest_layer = max(layers)
    embeddings = arch.vocab * arch.hidden * s
    tokens = batch * seq_len
    forward = max(layer_forward_bytes(arch, layer, tokens, s) for layer in arch.layers)
    first_input = tokens * arch.hidden * s
    hidden_all = num_samples * seq_len * arch.hidden * s
    masks = num_samples * seq_len * seq_len * _mask_kinds(arch)
    kept = arch.kept_expert_params / max(arch.expert_params, 1)
    fused_tensor = arch.largest_expert_tensor_params * s
    loading = fused_tensor if arch.experts_stored_per_expert else 0  # the per-expert tensors being stacked
    experts = max(layer.experts for layer in arch.layers if layer.moe)
    export = (max(arch.largest_other_module_params * s, fused_tensor / experts)
              if arch.experts_stored_per_expert else
              max(arch.largest_other_module_params * s, fused_tensor * (1 + kept)))
    host_forward = tokens * experts * 8  # the recorder's float64 copy of the router probabilities
    gpu, host = device != "cpu", host_baseline
    plans = {}
    if gpu:
        plans["whole"] = {"gpu_bytes": gpu_baseline + model + forward, "host_bytes": host + host_forward}
        plans["whole_device_map"] = {"gpu_bytes": gpu_baseline + model / world + forward, "gpus": world,
                                     "host_bytes": host + host_forward}
        layer_peak = max(embeddings + 2 * first_input, largest_layer + max(forward, loading))
        plans["layerwise_hidden_on_host"] = {"gpu_bytes": gpu_baseline + layer_peak,
                                             "host_bytes": host + hidden_all + masks + largest_layer + host_forward}
        plans["layerwise_hidden_on_device"] = {"gpu_bytes": gpu_baseline + layer_peak + hidden_all + masks,
                                               "host_bytes": host + largest_layer + host_forward}
    else:
        retained = arch.expert_params * s if arch.experts_stored_per_expert else 0
        plans["whole"] = {"gpu_bytes": 0, "host_bytes": host + model + retained + forward + host_forward}
        plans["layerwise_hidden_on_host"] = {
            "gpu_bytes": 0, "host_bytes": host + hidden_all + masks + max(embeddings + 2 * first_input,
                                                                          largest_layer + max(forward, loading))
            + host_forward}
    plans["export_streamed"] = {"gpu_bytes": 0, "host_bytes": host + int(export)}
    for line in plans.values():
        line["gpu_bytes"], line["host_bytes"] = int(line["gpu_bytes"]), int(line["host_bytes"])
        line["fits"] = line["gpu_bytes"] <= gpu_memory_gib * GIB and line["host_bytes"] <= host_memory_gib * GIB
    order = ["whole", "whole_device_map", "layerwise_hidden_on_device", "layerwise_hidden_on_host"]
    use = next((mode for mode in order if mode in plans and plans[mode]["fits"]), None)
    overrides = {"whole": "", "whole_device_map": "model.device_map=auto",
                 "layerwise_hidden_on_device": "prune.calibration.mode=layerwise prune.calibration.hidden_states=device",
                 "layerwise_hidden_on_host": "prune.calibration.mode=layerwise"}
    return {
        "calibration": {k: v for k, v in plans.items() if k != "export_streamed"},
        "export_streamed": plans["export_streamed"],
        "use": use, "use_overrides": overrides.get(use) if use else None,
        "terms": {"model_bytes": model, "largest_layer_bytes": largest_layer, "embedding_bytes": embeddings,
                  "layer_forward_bytes": forward, "hidden_states_bytes": hidden_all, "recorded_masks_bytes": masks,
                  "calibration_tokens": num_samples * seq_len, "batch_tokens": tokens},
        "gpu_memory_gib": gpu_memory_gib, "host_memory_gib": host_memory_gib,
    }


def prune_table(prune: dict, device: str) -> str:
    unit, div = ("GiB", GIB) if device != "cpu" else ("MiB", MIB)
    terms = prune["terms"]
    rows = [f"pruning (python -m slimwise_train.prune): {terms['calibration_tokens']} calibration tokens, batches of "
            f"{terms['batch_tokens']}; GPU {prune['gpu_memory_gib']:g} GiB, host {prune['host_memory_gib']:g} GiB",
            f"{'mode':<30}{'GPU (' + unit + ')':>14}{'host (' + unit + ')':>14}   fits"]
    for mode, line in {**prune["calibration"], "export_streamed": prune["export_streamed"]}.items():
        rows.append(f"{mode:<30}{line['gpu_bytes'] / div:>14.2f}{line['host_bytes'] / div:>14.2f}   "
                    f"{'yes' if line['fits'] else 'no'}")
    use = prune["use"]
    rows.append(f"use: {use} ({prune['use_overrides'] or 'the default'})" if use else
                "no calibration mode fits: more GPU or host memory, fewer calibration tokens (data.num_samples)")
    return "\n".join(rows)

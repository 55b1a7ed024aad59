"""Shared pieces of the benches: interleaved timing and paired ratios, the random bench model, the model flags,
and the peak-memory probes the fresh child processes use."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def interleaved_times(fns: dict[str, Callable[[], None]], repeats: int, warmup: int, device,
                      between_rounds: Callable[[int], None] | None = None) -> dict[str, list[float]]:
    """Run each callable `repeats` times in round-robin order (after `warmup` rounds); seconds per run.
    `between_rounds(i)` runs untimed after timed round i (a machine probe beside the rounds: bench/roofline.py)."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times = {name: [] for name in fns}
    for i in range(repeats):
        for name, fn in fns.items():
            _sync(device)
            start = time.perf_counter()
            fn()
            _sync(device)
            times[name].append(time.perf_counter() - start)
        if between_rounds is not None:
            between_rounds(i)
    return times


def bench_model(model_type: str, hidden: int, layers: int, experts: int, top_k: int, moe_intermediate: int,
                vocab: int, device, kv_heads: int | None = None, dtype: torch.dtype = torch.float32):
    """A random stock model of `model_type` with 64-wide heads; `kv_heads` defaults to one per two query heads."""
    from slimwise_train.moe.adapters import adapter_class
    from slimwise_train.testing.tiny import tiny_model

    heads = max(hidden // 64, 1)
    kv_heads = kv_heads or max(heads // 2, 1)
    if heads % kv_heads:
        raise ValueError(f"--kv-heads {kv_heads} must divide the {heads} query heads (hidden {hidden} / 64)")
    overrides = dict(hidden_size=hidden, num_hidden_layers=layers, moe_intermediate_size=moe_intermediate,
                     intermediate_size=moe_intermediate, num_attention_heads=heads,
                     num_key_value_heads=kv_heads, head_dim=64, vocab_size=vocab)
    family = adapter_class(model_type)  # the config keys that count experts and the router's top-k
    overrides[family.num_experts_key] = experts
    overrides[family.top_k_key] = top_k
    return tiny_model(model_type, init_std=0.02, **overrides).to(device=device, dtype=dtype)



def _model_args(parser, without: tuple[str, ...] = (), **defaults):
    """The flags of the random bench model (bench_model) and the timing, each with its help; `without`: flags this
    bench does not read (left out of its --help and its namespace)."""
    flags = [
        ("--model-type", dict(default=defaults.get("model_type", "qwen3_moe"),
                              help="MoE family of the random model (a model_type with an adapter)")),
        ("--hidden", dict(type=int, default=defaults.get("hidden", 256), help="hidden size (heads of 64)")),
        ("--layers", dict(type=int, default=defaults.get("layers", 4), help="decoder layers, each an MoE layer")),
        ("--experts", dict(type=int, default=defaults.get("experts", 32), help="routed experts per MoE layer")),
        ("--top-k", dict(type=int, default=defaults.get("top_k", 4), help="experts each token is routed to")),
        ("--moe-intermediate", dict(type=int, default=defaults.get("moe_intermediate", 256),
                                    help="intermediate size of one expert")),
        ("--vocab", dict(type=int, default=defaults.get("vocab", 4096), help="vocabulary size")),
        ("--batch", dict(type=int, default=defaults.get("batch", 8), help="sequences per batch")),
        ("--seq", dict(type=int, default=defaults.get("seq", 256), help="tokens per sequence")),
        ("--repeats", dict(type=int, default=defaults.get("repeats", 5),
                           help="timed rounds (each runs every variant once, in turn; ratios are paired per round)")),
        ("--device", dict(default="cuda" if torch.cuda.is_available() else "cpu",
                          help="cpu or cuda (default: cuda when one is visible)")),
    ]
    for flag, kwargs in flags:
        if flag.removeprefix("--") not in without:
            parser.add_argument(flag, **kwargs)


def _peak_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _rss_now_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return _peak_rss_bytes()


def _reset_peak_rss() -> bool:
    """Reset the peak RSS (VmHWM, which getrusage's ru_maxrss reads) to the current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False



def _paired_ratio(times: dict[str, list[float]], numerator: str, denominator: str) -> float:
    """Median over rounds of the two variants' time ratio within one round. The variants of a round run back to
    back, so a slow spell of the machine (seconds long here) scales both and cancels, where a ratio of the two
    medians would take it in whenever it hits one variant's rounds more than the other's."""
    return statistics.median(a / b for a, b in zip(times[numerator], times[denominator]))


def paired_ratio_quartiles(times: dict[str, list[float]], numerator: str, denominator: str) -> tuple[float, float]:
    """The 25th and 75th percentile over rounds of the within-round ratio `_paired_ratio` takes the median of: the
    run's own noise estimate for that ratio (equal quartiles with a single round)."""
    ratios = sorted(a / b for a, b in zip(times[numerator], times[denominator]))
    if len(ratios) < 2:
        return ratios[0], ratios[0]
    q = statistics.quantiles(ratios, n=4, method="inclusive")
    return q[0], q[2]


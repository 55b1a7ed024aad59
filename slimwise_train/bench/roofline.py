"""What this machine allows a decode step, measured beside a bench's own timed rounds, and the bound on a pruned
decoder's speed-up that follows.

A decode step of `n` sequences reads every non-expert weight once, each expert its tokens route to, and each
sequence's KV cache; it does 2 FLOPs per weight per token for the attention projections, router and LM head, 2 per
expert weight per row routed to that expert, and the attention over the cache. Its least time is, part by part,
the larger of bytes / bandwidth and compute time, summed over the parts (they run one after the other):

    dense part    max((non-expert weights + KV) / bandwidth, its matmuls at n rows + attention at the peak rate)
    each expert   max(its weights / bandwidth, its matmuls at the rows routed to it)

The compute side is modelled at the row counts that occur: an expert matmul of a few rows runs far below a large
matmul's peak, and pruning gives each kept expert more rows (at batch 64, 8 of 128 experts: ~4 rows each in the full
model, ~8 at 50%, ~16 at 75%), so the pruned step gains on compute as well as on bytes. The matmul time at each row
count is measured on the expert's own shape with its weights hot in cache (what the cores can do at that shape when
memory is not the limit), at the bench's threads and on one thread (scaled as if perfectly parallel), whichever is
less; for weights narrower than fp32 (llama.cpp's f16) that time is scaled by their width, since at a few rows it is
the weights streaming through the cache, and it is never below the large-matmul peak. A variant that runs faster than its own least time (`roofline_fraction` above 1) shows the probes understated
the machine: it is flagged too (`faster_than_bound`). Rows come from the step's own routing where the bench sees it (`bench decode`), else from
uniform routing simulated with a fixed seed (`bench engine`, llama.cpp).

The bound of a speed-up is full step bound / pruned step bound; a measured speed-up reads against it (efficiency).
A speed-up above its bound (efficiency > 1) means the bound missed something: it is flagged, never reported as a
result. Because another job on the machine slows the copy and the matmuls as much as the steps, the rates are
measured between the timed rounds (`RooflineMonitor.probe`), not once at the start, and the bound is given with
its spread over those probes; the CPU time other processes took during the run is measured too, and a run with
more than `SHARED_SHARE` of this process's CPUs used by others is marked `shared`.

The API another bench uses beside its own rounds (bench decode, bench engine; bench serve):

    monitor = RooflineMonitor(threads, expert=(hidden, moe_intermediate), rows=rows_to_measure(...))
    for round in rounds:
        ...time the variants...
        monitor.probe()                                   # between rounds, ~0.1-0.5 s
    bound = monitor.bound(lambda rates: step_bound_s(full_shape, n, context, rates),
                          lambda rates: step_bound_s(pruned_shape, n, context, rates))
    row.update(against_bound(speedup, speedup_quartiles, bound))   # speedup, bound, efficiency, above_bound
    result["machine"] = monitor.machine()                  # rates with their spread, other_cpu_share, shared
"""

from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Sequence

import torch

SHARED_SHARE = 0.1  # other processes' share of this process's CPUs above which a run is marked `shared`


@dataclass
class MachineRates:
    """One probe of this machine: copy bandwidth, a large matmul's rate, and one expert's matmul time per row count
    (`expert_seconds`: {rows: seconds} for the expert shape `expert` = (hidden, intermediate), weights in cache)."""

    bandwidth_gbs: float  # GB/s, a large copy (read + write counted)
    matmul_gflops: float  # GFLOP/s, fp32 GEMM of two large square matrices
    threads: int
    expert: tuple[int, int] | None = None
    expert_seconds: dict[int, float] = field(default_factory=dict)

    @property
    def expert_params(self) -> int:
        return 3 * self.expert[0] * self.expert[1] if self.expert else 0

    def matmul_seconds(self, rows: int, params: int, weight_bytes: float = 4) -> float:
        """Least time of `rows` rows through `params` weights stored at `weight_bytes` each (2 FLOPs per weight and
        row): the measured fp32 expert matmul time at that row count (interpolated between measured counts, scaled
        by params) times weight_bytes / 4, never below the large-matmul peak; without row timings the peak alone.
        At a few rows the measured time is the weights streaming through the cache, so weights half as wide stream
        in half the time (llama.cpp's f16 kernels do so: an fp32 time left as it is would understate them)."""
        if rows <= 0 or params <= 0:
            return 0.0
        peak = 2 * rows * params / (self.matmul_gflops * 1e9)
        if not self.expert_seconds:
            return peak
        grid = sorted(self.expert_seconds)
        if rows >= grid[-1]:
            seconds = self.expert_seconds[grid[-1]] * rows / grid[-1]  # beyond the grid: the rate stays
        elif rows <= grid[0]:
            seconds = self.expert_seconds[grid[0]] * rows / grid[0]
        else:
            high = next(g for g in grid if g >= rows)
            low = max(g for g in grid if g <= rows)
            share = 0.0 if high == low else (rows - low) / (high - low)
            seconds = self.expert_seconds[low] + share * (self.expert_seconds[high] - self.expert_seconds[low])
        return max(seconds * params / self.expert_params * min(weight_bytes, 4) / 4, peak)

    def as_dict(self) -> dict:
        out = {"bandwidth_gbs": round(self.bandwidth_gbs, 2), "matmul_gflops": round(self.matmul_gflops, 2),
               "threads": self.threads}
        if self.expert_seconds:
            out["expert_gflops_at_rows"] = {str(r): round(2 * r * self.expert_params / s / 1e9, 2)
                                            for r, s in sorted(self.expert_seconds.items())}
        return out


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


def uniform_rows(experts: int, top_k: int, tokens: int, draws: int = 32, seed: int = 0) -> list[list[int]]:
    """Rows per expert of one layer when `tokens` tokens each pick `top_k` distinct experts uniformly: `draws`
    simulated layers (a fixed seed, so a bound is the same in every run)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(draws):
        picks = torch.rand(tokens, experts, generator=g).argsort(dim=1)[:, :top_k]
        out.append(torch.bincount(picks.flatten(), minlength=experts).tolist())
    return out


def rows_to_measure(sequences: Iterable[int], top_k: int, kept_experts: Iterable[int]) -> list[int]:
    """The row counts to time the expert matmul at: powers of two up to three times the largest mean rows per kept
    expert (a busy expert takes ~2-3x the mean), and each batch size (the dense part's matmuls run at n rows)."""
    sequences, kept = list(sequences), list(kept_experts)
    most = max(3 * n * top_k / e for n in sequences for e in kept)
    grid = [2 ** i for i in range(int(math.ceil(math.log2(max(most, 1)))) + 1)]
    return sorted(set(grid) | set(sequences))


def step_bound_s(shape: DecodeShape, sequences: int, context: float, rates: MachineRates,
                 rows: Sequence[Sequence[int]] | None = None) -> float:
    """Least time of one decode step of `sequences` sequences at `context` cached tokens each (the module's
    docstring). `rows`: per MoE layer, the rows routed to each expert in the step (measured), else uniform routing
    simulated (`uniform_rows`) for every layer."""
    bandwidth = rates.bandwidth_gbs * 1e9
    dense_bytes = shape.other_params * shape.weight_bytes + sequences * context * shape.kv_bytes_per_token
    attention = sequences * context * shape.attention_flops_per_ctx_token / (rates.matmul_gflops * 1e9)
    dense = max(dense_bytes / bandwidth,
                rates.matmul_seconds(sequences, shape.other_params, shape.weight_bytes) + attention)
    expert_read = shape.expert_params * shape.weight_bytes / bandwidth

    def layer_s(counts: Sequence[int]) -> float:
        return sum(max(expert_read, rates.matmul_seconds(r, shape.expert_params, shape.weight_bytes))
                   for r in counts if r > 0)

    if rows is None:
        draws = uniform_rows(shape.experts, shape.top_k, sequences)
        experts = shape.layers * statistics.fmean(layer_s(d) for d in draws)
    else:
        experts = sum(layer_s(layer) for layer in rows) * shape.layers / len(rows)
    return dense + experts


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


# ----------------------------------------------------------------------------------------------- measuring


class CpuShare:
    """The share of this process's CPUs that other processes used since `start()`: the CPUs' busy time
    (/proc/stat) minus this process's own (and `own_pids`', e.g. servers it started) CPU time. Linux only; None
    elsewhere."""

    def __init__(self, own_pids: Iterable[int] = ()):
        self.cpus = sorted(os.sched_getaffinity(0))
        self.own_pids = list(own_pids)
        self.start()

    def start(self) -> None:
        self._start = (time.monotonic(), self._busy(), self._own())

    def _busy(self) -> float | None:
        try:
            with open("/proc/stat") as f:
                lines = {line.split()[0]: line.split()[1:] for line in f if line.startswith("cpu")}
        except OSError:
            return None
        ticks = os.sysconf("SC_CLK_TCK")
        busy = 0
        for cpu in self.cpus:
            values = [int(v) for v in lines.get(f"cpu{cpu}", [])]
            if len(values) < 5:
                return None
            busy += sum(values[:8]) - values[3] - values[4]  # all but idle and iowait (guest time is inside user)
        return busy / ticks

    def _own(self) -> float:
        own = sum(os.times()[:4])  # this process and the children it waited for
        for pid in self.own_pids:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                own += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
            except (OSError, IndexError, ValueError):
                continue
        return own

    def share(self) -> float | None:
        start, busy0, own0 = self._start
        busy = self._busy()
        if busy is None or busy0 is None:
            return None
        wall = time.monotonic() - start
        others = (busy - busy0) - (self._own() - own0)
        return max(0.0, others) / (wall * len(self.cpus)) if wall > 0 else None


def _best_seconds(fns: dict, repeats: int, least_s: float = 0.0) -> dict:
    """{name: the least of `repeats` timings of fns[name]}, the callables taken in turn within each repeat (a slow
    spell of the machine hits one repeat of each, not every repeat of one), each timing looping its callable until
    `least_s` seconds have passed: what the machine can do, as a bound needs (another job slows a timing, never
    speeds one up)."""
    for fn in fns.values():
        fn()  # untimed: first touch of the pages, kernel selection
    best = dict.fromkeys(fns, math.inf)
    for _ in range(repeats):
        for name, fn in fns.items():
            loops, start = 0, time.perf_counter()
            while True:
                fn()
                loops += 1
                elapsed = time.perf_counter() - start
                if elapsed >= least_s:
                    break
            best[name] = min(best[name], elapsed / loops)
    return best


class RooflineMonitor:
    """This machine's rates, measured whenever `probe()` is called (between a bench's timed rounds), and the bound
    of a speed-up over those probes. `expert` = (hidden, moe_intermediate) and `rows` (row counts) say at which
    shapes the expert matmuls are timed; `own_pids`: processes whose CPU time is the bench's own (servers it
    started). Buffers are allocated once: a probe only measures."""

    def __init__(self, threads: int, expert: tuple[int, int] | None = None, rows: Iterable[int] = (),
                 own_pids: Iterable[int] = (), megabytes: int = 256, gemm: int = 1024, repeats: int = 3):
        self.threads, self.expert, self.repeats = threads, expert, repeats
        self.rows = sorted(set(int(r) for r in rows if int(r) > 0)) if expert else []
        self.samples: list[MachineRates] = []
        self.cpu = CpuShare(own_pids)
        self._src = torch.ones(megabytes * 2**20 // 4)
        self._dst = torch.empty_like(self._src)
        self._a, self._b = torch.randn(gemm, gemm), torch.randn(gemm, gemm)
        self._gemm = gemm
        if expert:
            hidden, inter = expert
            self._up, self._down = torch.randn(hidden, 2 * inter), torch.randn(inter, hidden)
            self._inputs = {r: (torch.randn(r, hidden), torch.randn(r, inter)) for r in self.rows}

    def probe(self) -> MachineRates:
        """One measurement of the rates. A matmul's time is the lesser of its time at `threads` threads and its
        one-thread time / `threads` (perfect scaling: no faster is possible): on a shared machine a small
        multi-threaded matmul waits for whichever of its threads was descheduled, a single thread does not, so the
        second keeps a busy machine's probe from understating what the cores can do."""
        previous = torch.get_num_threads()
        matmuls = {"gemm": lambda: self._a @ self._b}
        # gate+up then down, as an MoE expert runs (x W_up, then y W_down), weights hot in cache
        matmuls.update({r: (lambda x=x, y=y: (x @ self._up, y @ self._down))
                        for r, (x, y) in getattr(self, "_inputs", {}).items()})
        try:
            torch.set_num_threads(self.threads)
            copy_s = _best_seconds({"copy": lambda: self._dst.copy_(self._src)}, self.repeats)["copy"]
            together = _best_seconds(matmuls, self.repeats, least_s=0.002)
            torch.set_num_threads(1)
            alone = _best_seconds(matmuls, self.repeats, least_s=0.002)
        finally:
            torch.set_num_threads(previous)
        best = {k: min(together[k], alone[k] / self.threads) for k in matmuls}
        gemm_s = best.pop("gemm")
        rates = MachineRates(2 * self._src.numel() * 4 / copy_s / 1e9, 2 * self._gemm ** 3 / gemm_s / 1e9,
                             self.threads, self.expert, best)
        self.samples.append(rates)
        return rates

    def median_rates(self, since: int = 0, until: int | None = None) -> MachineRates:
        """The per-field median over probes since:until (each variant's step against its own roofline)."""
        if len(self.samples) <= since:
            self.probe()
        s = self.samples[since:until]
        return MachineRates(statistics.median(r.bandwidth_gbs for r in s), statistics.median(r.matmul_gflops for r in s),
                            self.threads, self.expert,
                            {k: statistics.median(r.expert_seconds[k] for r in s) for k in s[0].expert_seconds})

    def bound(self, full_s: Callable[[MachineRates], float], pruned_s: Callable[[MachineRates], float],
              since: int = 0, until: int | None = None, probes: Sequence[int] | None = None) -> dict:
        """{"bound": median over probes since:until (those beside the rounds being judged), or over the probes of
        index `probes` (rounds that interleave with others'), of full_s(rates) / pruned_s(rates), "bound_quartiles":
        [q1, q3], "probes": how many}."""
        if probes is None and len(self.samples) <= since:
            self.probe()
        samples = [self.samples[i] for i in probes] if probes is not None else self.samples[since:until]
        ratios = [full_s(r) / pruned_s(r) for r in samples]
        low, high = quartiles(ratios)
        return {"bound": round(statistics.median(ratios), 3), "bound_quartiles": [round(low, 3), round(high, 3)],
                "probes": len(ratios)}

    def machine(self) -> dict:
        """The probes' rates as [q1, median, q3], the other processes' CPU share over the run, `shared`."""
        share = self.cpu.share()

        def spread(values):
            return [round(v, 2) for v in (quartiles(values)[0], statistics.median(values), quartiles(values)[1])]

        out = {"threads": self.threads, "probes": len(self.samples), "cpus": len(self.cpu.cpus),
               "bandwidth_gbs": spread([r.bandwidth_gbs for r in self.samples]),
               "matmul_gflops": spread([r.matmul_gflops for r in self.samples])}
        if self.samples and self.samples[0].expert_seconds:
            params = self.samples[0].expert_params
            out["expert_shape"] = list(self.expert)
            out["expert_gflops_at_rows"] = {str(r): spread([2 * r * params / p.expert_seconds[r] / 1e9
                                                            for p in self.samples])
                                            for r in sorted(self.samples[0].expert_seconds)}
        out["other_cpu_share"] = None if share is None else round(share, 3)
        out["shared"] = share is not None and share > SHARED_SHARE
        return out


def quartiles(values: Sequence[float]) -> tuple[float, float]:
    """25th and 75th percentile (both the value itself for a single one)."""
    values = sorted(values)
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[2]


def against_bound(speedup: float, speedup_quartiles: Sequence[float], bound: dict) -> dict:
    """A measured speed-up beside its bound: efficiency = speed-up / bound; `above_bound` when it exceeds 1 (the
    speed-up is then not a result), `beyond_noise` when even the speed-up's lower quartile is above the bound's
    upper one (the bound missed something, rather than the noise of a shared machine)."""
    efficiency = round(speedup / bound["bound"], 3)  # as reported: a flag on 1.0004 would read "1.000 is above 1"
    return {"speedup": round(speedup, 3), "speedup_quartiles": [round(q, 3) for q in speedup_quartiles],
            **bound, "efficiency": efficiency, "above_bound": efficiency > 1,
            "beyond_noise": efficiency > 1 and speedup_quartiles[0] > bound["bound_quartiles"][1]}


def above_bound_note(what: str, cell: dict) -> str:
    """The line a bench prints for a speed-up above its bound (`cell`: an against_bound dict)."""
    why = ("beyond the noise of both: the bound missed something here" if cell["beyond_noise"] else
           "within the noise (the quartiles overlap): a shared or noisy machine")
    return (f"{what}: speed-up {cell['speedup']:.3f}x is ABOVE its bound {cell['bound']:.3f}x (efficiency "
            f"{cell['efficiency']:.3f}; {why}): not a result")


def faster_than_bound(fractions: dict) -> list[str]:
    """The variants of a `roofline_fraction` row ({variant: least time / measured time}) that ran faster than their
    least time: the probes understated the machine there (a busy machine's probes), so that row's bound is suspect."""
    return [variant for variant, fraction in fractions.items() if fraction > 1]


def shared_note(machine: dict, what: str) -> str | None:
    """The line a bench prints when the machine was shared during its run, else None."""
    if not machine.get("shared"):
        return None
    return (f"{what}: this machine was shared: other processes used {machine['other_cpu_share']:.0%} of its "
            f"{machine['cpus']} CPUs during the run (ratios and bounds were measured side by side; absolute times "
            "and rates are not this machine's)")

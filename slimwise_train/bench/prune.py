"""`python -m slimwise_train.bench prune`: peak host memory of pruning a saved checkpoint, the whole model vs one
decoder layer at a time, and of writing the pruned checkpoint, each variant in a fresh process.

The parent saves the bench memory model (Qwen3-MoE, default ~240M parameters, fp32) as a checkpoint in shards of
`--shard-mb` (cached under .cache/slimwise/bench_memory/) and a 50% keep set, then runs one child per variant:

    calibrate_whole       python -m slimwise_train.prune (prune.calibration.mode=whole): load, hash, calibrate
    calibrate_layerwise   the same with prune.calibration.mode=layerwise (hash and calibration one layer at a time)
    export_deepcopy       load, then `prune_experts_(copy.deepcopy(model)).save_pretrained(...)`: the export before
                          export_pruned lost its copy (the reference)
    export_memory         load, then `export_pruned(model, ...)` (no copy: one layer's slices at a time)
    export_streamed       `export_pruned_from_checkpoint` from the files (nothing loaded before)

Each child measures its baseline B (RSS with torch, transformers and slimwise_train imported, VmHWM reset after), then
the peak RSS of its job (and, for the two in-memory exports, RSS after the load: what the export itself adds is
peak - after_load). One JSON line per variant, then the targets (peaks over each child's B):
  calibrate_layerwise peak <= 0.35 x calibrate_whole peak
  export_streamed peak <= the largest source shard + the largest decoder layer
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VARIANTS = ("calibrate_whole", "calibrate_layerwise", "export_deepcopy", "export_memory", "export_streamed")
MIB = 1 << 20


def _largest_layer_bytes(folder: Path) -> int:
    """Bytes of the largest decoder layer of the saved checkpoint (its tensors' sizes on disk)."""
    import torch

    from slimwise_train.moe.checkpoint import LazyCheckpoint

    checkpoint = LazyCheckpoint(folder, torch.float32)
    state = checkpoint.model.state_dict()
    sizes = [sum(state[n].numel() * state[n].element_size() for n in checkpoint.layer_targets(i))
             for i in range(checkpoint.num_layers)]
    return max(sizes)


def run_prune_bench(args) -> dict:
    from slimwise_train.bench.memory import _checkpoint

    folder, keep_path, model_bytes = _checkpoint(args, max_shard_size=f"{args.shard_mb}MB")
    shard_bytes = max(p.stat().st_size for p in folder.glob("*.safetensors"))
    layer_bytes = _largest_layer_bytes(folder)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "HF_DEACTIVATE_ASYNC_LOAD": "1"}  # transformers' loader threads would race each other's copies in the peak
    work = REPO / ".cache" / "slimwise" / "bench_prune"
    results = {}
    for name in args.variants.split(","):
        if name not in VARIANTS:
            raise SystemExit(f"bench prune: unknown variant {name!r}; choose from {', '.join(VARIANTS)}")
        report = work / f"{name}.json"
        report.unlink(missing_ok=True)
        spec = {"variant": name, "folder": str(folder), "keep_set": str(keep_path), "work": str(work / name),
                "samples": args.samples, "seq_len": args.seq_len, "batch": args.batch}
        start = time.time()
        proc = subprocess.run([sys.executable, "-m", "slimwise_train.bench.prune", "--child", str(report),
                               json.dumps(spec)], cwd=REPO, env=env, capture_output=True, text=True)
        if proc.returncode != 0 or not report.is_file():
            raise SystemExit(f"bench prune: {name} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        line = {"bench": "prune", "variant": name, **json.loads(report.read_text()),
                "seconds": round(time.time() - start, 1)}
        print(json.dumps(line), flush=True)
        results[name] = line
    return _targets(results, model_bytes, shard_bytes, layer_bytes)


def _over(line: dict, key: str = "peak") -> int:
    return line[key] - line["baseline"]


def _targets(results: dict, model_bytes: int, shard_bytes: int, layer_bytes: int) -> dict:
    out = {"bench": "prune", "model_mib": round(model_bytes / MIB, 1), "largest_shard_mib": round(shard_bytes / MIB, 1),
           "largest_layer_mib": round(layer_bytes / MIB, 1), "measured": {}, "targets": {}}
    for name, line in results.items():
        out["measured"][f"{name}_peak_over_baseline_mib"] = round(_over(line) / MIB, 1)
        if "after_load" in line:
            out["measured"][f"{name}_added_by_the_export_mib"] = round((line["peak"] - line["after_load"]) / MIB, 1)
    out["baseline_mib"] = {name: round(line["baseline"] / MIB, 1) for name, line in results.items()}
    if "calibrate_whole" in results and "calibrate_layerwise" in results:
        ratio = _over(results["calibrate_layerwise"]) / _over(results["calibrate_whole"])
        out["ratio"] = round(ratio, 3)  # layerwise / whole-model calibration peak, over each child's baseline
        out["targets"]["calibrate_layerwise_peak <= 0.35 x calibrate_whole_peak"] = ratio <= 0.35
    if "export_streamed" in results:
        out["targets"]["export_streamed_peak <= largest shard + largest layer"] = (
            _over(results["export_streamed"]) <= shard_bytes + layer_bytes)
    if "export_deepcopy" in results and "export_memory" in results:
        added = {n: results[n]["peak"] - results[n]["after_load"] for n in ("export_deepcopy", "export_memory")}
        out["measured"]["export_memory_over_export_deepcopy_added"] = round(added["export_memory"]
                                                                              / added["export_deepcopy"], 3)
    out["targets_met"] = all(out["targets"].values()) if out["targets"] else None
    return out


# --------------------------------------------------------------------------- the child (one variant, fresh process)


def _child(report: str, spec: dict) -> None:
    import copy
    import shutil

    import torch
    # What every variant imports on its way, in the baseline of every variant (not in one variant's peak):
    import transformers.conversion_mapping  # noqa: F401
    import transformers.core_model_loading  # noqa: F401
    import transformers.models.qwen3_moe.modeling_qwen3_moe  # noqa: F401
    from hydra import compose, initialize_config_dir
    from safetensors.torch import save_file  # noqa: F401

    import slimwise_train.data.loading  # noqa: F401
    import slimwise_train.moe.stats  # noqa: F401
    import slimwise_train.prune.statistics  # noqa: F401

    from slimwise_train.bench.common import _peak_rss_bytes, _reset_peak_rss, _rss_now_bytes
    from slimwise_train.config import CONF_DIR, register_configs
    from slimwise_train.models import load_model
    from slimwise_train.moe.checkpoint import LazyCheckpoint
    from slimwise_train.moe.keepset import KeepSet
    from slimwise_train.moe.pruning import export_pruned, export_pruned_from_checkpoint, prune_experts_
    from slimwise_train.prune import layerwise  # noqa: F401
    from slimwise_train.prune.app import run_prune

    torch.set_num_threads(1)
    variant, folder, work = spec["variant"], spec["folder"], Path(spec["work"])
    shutil.rmtree(work, ignore_errors=True)
    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose("prune", overrides=[
            f"model.path={folder}", f"output_dir={work / 'out'}", f"prune.cache_dir={work / 'cache'}",
            "prune.use_cache=false", "progress=false", "device=cpu", "data.source=synthetic",
            f"data.num_samples={spec['samples']}", f"data.seq_len={spec['seq_len']}", f"data.batch_size={spec['batch']}",
            f"prune.calibration.mode={'layerwise' if variant == 'calibrate_layerwise' else 'whole'}"])
    keep = KeepSet.load(spec["keep_set"])
    _reset_peak_rss()
    measured = {"baseline": _rss_now_bytes()}
    if variant.startswith("calibrate"):
        run_prune(cfg)
    elif variant == "export_streamed":
        export_pruned_from_checkpoint(LazyCheckpoint(folder, torch.float32), keep, work / "pruned")
    else:
        model, _ = load_model(cfg.model, "cpu")
        measured["after_load"] = _rss_now_bytes()
        if variant == "export_deepcopy":
            prune_experts_(copy.deepcopy(model), keep).save_pretrained(work / "pruned")
        else:
            export_pruned(model, keep, work / "pruned")
    measured["peak"] = _peak_rss_bytes()
    shutil.rmtree(work, ignore_errors=True)
    Path(report).parent.mkdir(parents=True, exist_ok=True)
    Path(report).write_text(json.dumps(measured))


if __name__ == "__main__":
    if len(sys.argv) > 3 and sys.argv[1] == "--child":
        _child(sys.argv[2], json.loads(sys.argv[3]))

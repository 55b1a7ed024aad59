"""`python -m slimwise_train.bench memory`: what each rank holds when the trainer runs a model saved as a checkpoint.

The parent saves a Qwen3-MoE checkpoint once (default ~240M parameters, 917 MiB fp32, cached under
.cache/slimwise/bench_memory/) and a 50% keep set, then launches `torchrun --nproc_per_node N` of this module's
child for each engine. Every rank measures, with VmHWM reset between phases (/proc/self/clear_refs):

    baseline   the framework alone: torch + transformers + deepspeed + slimwise_train, process group up (B)
    load       peak RSS while the model loads (`models.load_model`, partitioned under zero3)
    setup      peak RSS through the rest of Trainer.setup (student, engine) and RSS after it
    step       peak RSS during `--steps` training steps
    held       bytes of the frozen + trainable parameters this rank holds (its ZeRO-3 partitions, or whole)
    gathered   bytes received by all-gathers per micro-batch during the steps (ZeRO-3 fetches weights this way)

One JSON line per engine (ranks listed), then a line with the targets (M = full model bytes, N = ranks):
  zero3, rank(s) not reading the checkpoint: load peak <= B + M/N + 0.25 M; the reading rank: <= B + 2 M
  zero3 after set-up, every rank: RSS <= B + M/N + 0.25 M
  zero3 with recompute: step peak <= the DDP (engine=torch) step peak
  zero3: gathered bytes per micro-batch <= 3.2 M
On a CUDA machine the same command reports device memory (torch.cuda.max_memory_allocated) beside RSS, in bf16.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ENGINES = {  # name -> overrides
    "torch": ["engine=torch"],
    "zero2": ["engine=zero2"],
    "zero3": ["engine=zero3"],
    "zero3_recompute": ["engine=zero3", "distill.memory.recompute=moe"],
    "zero3_replicated_load": ["engine=zero3", "engine.partitioned_load=false"],
}


def _checkpoint(args, max_shard_size: str | None = None) -> tuple[Path, Path, int]:
    """(checkpoint folder, keep set, model bytes); built once per shape (and shard size: `bench prune` saves it in
    shards, save_pretrained's default writes one file)."""
    import torch

    from slimwise_train.models import SHIPPED_TOKENIZER
    from slimwise_train.moe.adapters import get_adapter
    from slimwise_train.moe.keepset import KeepSet
    from slimwise_train.testing.tiny import tiny_config

    shape = dict(hidden_size=args.hidden, num_hidden_layers=args.layers, num_experts=args.experts,
                 num_experts_per_tok=args.top_k, moe_intermediate_size=args.moe_intermediate, vocab_size=args.vocab,
                 intermediate_size=4 * args.hidden, num_attention_heads=8, num_key_value_heads=4,
                 head_dim=args.hidden // 8, max_position_embeddings=4096)
    key = hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:12]
    key += f"-shards{max_shard_size}" if max_shard_size else ""
    root = REPO / ".cache" / "slimwise" / "bench_memory" / key
    folder, keep_path = root / "model", root / "keep_set.json"
    config = tiny_config("qwen3_moe", **shape)
    if not (folder / "config.json").is_file():
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from slimwise_train.utils.atomic import atomic_dir

        print(f"bench memory: saving a {args.layers}-layer Qwen3-MoE checkpoint to {folder} (once)", file=sys.stderr)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with atomic_dir(folder, overwrite=True) as tmp:
            model.save_pretrained(tmp, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
            AutoTokenizer.from_pretrained(str(SHIPPED_TOKENIZER)).save_pretrained(tmp)
        del model
    with torch.device("meta"):
        from transformers import AutoModelForCausalLM

        meta = AutoModelForCausalLM.from_config(config)
    layers = get_adapter(meta).moe_layers(meta)
    KeepSet.from_kept(layers, [list(range(m.num_experts // 2)) for m in layers], model_type="qwen3_moe").save(keep_path)
    model_bytes = sum(p.numel() for p in meta.parameters()) * 4  # fp32 on CPU
    return folder, keep_path, model_bytes


def run_memory(args) -> dict:
    folder, keep_path, model_bytes = _checkpoint(args)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1"}
    results = {}
    out_root = REPO / ".cache" / "slimwise" / "bench_memory" / "runs"
    for name in args.engines.split(","):
        if name not in ENGINES:
            raise SystemExit(f"bench memory: unknown engine {name!r}; choose from {', '.join(ENGINES)}")
        report = out_root / f"{name}.json"
        report.unlink(missing_ok=True)
        overrides = [f"model.path={folder}", f"prune.keep_set={keep_path}", *ENGINES[name],
                     f"output_dir={out_root / name}", "resume=never", "logger=none", "progress=false",
                     "data.source=synthetic", "data.num_samples=64", f"data.seq_len={args.seq_len}",
                     f"data.batch_size={args.batch}", f"distill.schedule.max_steps={args.steps}",
                     "distill.eval.every=100000", "distill.checkpoint.every=100000", "distill.eval.batches=1",
                     "distill.eval.samples=8",
                     "distill.export=false", "distill.check_frozen=false", "distill.schedule.warmup_steps=1"]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
               "-m", "slimwise_train.bench.memory", "--child", str(report), *overrides]
        start = time.time()
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        if proc.returncode != 0 or not report.is_file():
            raise SystemExit(f"bench memory: engine {name} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        ranks = json.loads(report.read_text())
        line = {"bench": "memory", "engine": name, "ranks": ranks, "model_bytes": model_bytes,
                "seconds": round(time.time() - start, 1)}
        print(json.dumps(line), flush=True)
        results[name] = line
    return _targets(results, model_bytes, args.nproc)  # printed by the CLI as the last line


def _targets(results: dict, M: int, N: int) -> dict:
    mib = 1 << 20
    out = {"bench": "memory", "model_mib": round(M / mib, 1), "ranks": N, "targets": {}, "measured": {}}
    if "zero3" in results:
        ranks = results["zero3"]["ranks"]
        B = max(r["baseline"] for r in ranks)
        readers = [r for r in ranks if r["rank"] == 0]
        others = [r for r in ranks if r["rank"] != 0]
        out["baseline_mib"] = round(B / mib, 1)
        out["measured"]["zero3_load_peak_mib"] = [round(r["load_peak"] / mib, 1) for r in ranks]
        out["measured"]["zero3_after_setup_mib"] = [round(r["after_setup"] / mib, 1) for r in ranks]
        out["measured"]["zero3_gathered_per_micro_batch_over_M"] = round(
            max(r["gathered_per_micro_batch"] for r in ranks) / M, 2)
        out["targets"]["zero3_load_non_reading_rank <= B + M/N + 0.25M"] = all(
            r["load_peak"] <= r["baseline"] + M / N + 0.25 * M for r in others)
        out["targets"]["zero3_load_reading_rank <= B + 2M"] = all(
            r["load_peak"] <= r["baseline"] + 2 * M for r in readers)
        out["targets"]["zero3_after_setup <= B + M/N + 0.25M"] = all(
            r["after_setup"] <= r["baseline"] + M / N + 0.25 * M for r in ranks)
        out["targets"]["zero3_gathered_per_micro_batch <= 3.2M"] = all(
            r["gathered_per_micro_batch"] <= 3.2 * M for r in ranks)
    if "zero3_recompute" in results and "torch" in results:
        rc = max(r["step_peak"] for r in results["zero3_recompute"]["ranks"])
        ddp = max(r["step_peak"] for r in results["torch"]["ranks"])
        out["measured"]["step_peak_mib"] = {name: [round(r["step_peak"] / mib, 1) for r in line["ranks"]]
                                            for name, line in results.items()}
        out["targets"]["zero3_recompute_step_peak <= DDP step peak"] = rc <= ddp
    out["targets_met"] = all(out["targets"].values()) if out["targets"] else None
    return out


# --------------------------------------------------------------------------- the child (one rank under torchrun)


def _child(report: str, overrides: list[str]) -> None:
    import torch
    import torch.distributed as dist
    from hydra import compose, initialize_config_dir

    import slimwise_train.distill.trainer as trainer_module
    from slimwise_train.bench.common import _peak_rss_bytes, _reset_peak_rss, _rss_now_bytes
    from slimwise_train.config import CONF_DIR, register_configs
    from slimwise_train.distill.engine import import_backend
    from slimwise_train.utils import distributed as du

    du.init_if_launched("gloo")
    import_backend()  # DeepSpeed's own footprint belongs in the baseline, for every engine alike

    torch.set_num_threads(1)
    _reset_peak_rss()
    measured = {"rank": du.rank(), "baseline": _peak_rss_bytes()}

    # Phase boundaries: the load is `load_model` inside Trainer.setup; count all-gather bytes during the steps.
    import slimwise_train.models as models

    real_load = models.load_model

    def timed_load(*a, **k):
        _reset_peak_rss()
        result = real_load(*a, **k)
        measured["load_peak"] = _peak_rss_bytes()
        _reset_peak_rss()
        return result

    models.load_model = timed_load
    gathered = {"bytes": 0, "on": False, "depth": 0}
    for fn_name in ("all_gather_into_tensor", "all_gather", "_all_gather_base"):
        real = getattr(dist, fn_name, None)
        if real is None:
            continue

        def counting(*a, _real=real, **k):
            # Outermost call only: torch's _all_gather_base forwards to all_gather_into_tensor.
            if gathered["on"] and gathered["depth"] == 0:
                output = a[0] if a else k.get("output_tensor", k.get("tensor_list"))
                tensors = output if isinstance(output, (list, tuple)) else [output]
                gathered["bytes"] += sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))
            gathered["depth"] += 1
            try:
                return _real(*a, **k)
            finally:
                gathered["depth"] -= 1

        setattr(dist, fn_name, counting)

    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose("train", overrides=overrides)
    trainer = trainer_module.Trainer(cfg)
    try:
        trainer.setup()
        measured["setup_peak"] = _peak_rss_bytes()
        measured["after_setup"] = _rss_now_bytes()
        held = 0
        for p in trainer.student.parameters():
            n = p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel()
            held += n * p.element_size()
        measured["held_bytes"] = held
        _reset_peak_rss()
        gathered["on"] = True
        for step in range(int(cfg.distill.schedule.max_steps)):
            trainer.train_step(step)
        gathered["on"] = False
        measured["step_peak"] = _peak_rss_bytes()
        micro = int(cfg.distill.schedule.max_steps) * int(cfg.distill.schedule.grad_accum)
        measured["gathered_per_micro_batch"] = gathered["bytes"] / micro
        if torch.cuda.is_available():
            measured["cuda_max_allocated"] = torch.cuda.max_memory_allocated()
    finally:
        trainer.close()
        models.load_model = real_load
    ranks = [None] * du.world_size()
    dist.all_gather_object(ranks, measured) if du.world_size() > 1 else ranks.__setitem__(0, measured)
    if du.rank() == 0:
        Path(report).write_text(json.dumps(ranks))
    du.shutdown()


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        _child(sys.argv[2], sys.argv[3:])

"""Planned vs measured: run `python -m slimwise_train.bench memory`'s child on a small Qwen3-MoE and plan the same run.

    python -m slimwise_train.plan.bench_compare --hidden 128 --layers 2 --experts 8 --top-k 2 \
        --moe-intermediate 64 --vocab 4096 --seq-len 128 --engines torch,zero2,zero3

The bench's own command trains on the synthetic suite split at random points: its micro-batches are a few dozen
tokens wide (the 240M run's were 3-61 continuation tokens). Here `distill.split.min_continuation = seq_len - 1` keeps
only the synthetic rows at least `--seq-len` tokens long (cut to it; 1024 rows are read to find enough) and puts every
split at s = 1, so each micro-batch is exactly the planner's worst case: a 1-token prefix and a (seq_len - 1)-token
continuation. Everything else (the checkpoint, the keep set, the child that measures per-rank RSS with VmHWM reset
between phases, the synthetic data source) is the bench's.

Prints one JSON line per engine: measured (per rank, MiB) and planned (MiB), and the relative error of the step peak
minus the framework baseline B (the bench's `baseline`, measured in the same process before anything loads).

A saved checkpoint instead of the bench's (a realistic twin, docs/real-models.md):

    python -m slimwise_train.plan.bench_compare --model-path twins/qwen36 --keep-set keep_set.json --seq-len 64 \
        --batch 1 --engines zero3

measures that folder with that keep set and plans `model.path=<folder>` (its config.json); the rows are the shipped
tool conversations rendered plain (`data.chat_template=false`: cut at exactly `--seq-len`, where a chat rendering is
cut at whole turns and would leave too few rows that long), since the peaks depend on the shapes, not the text. The
64 shipped rows average 126 tokens in Qwen3.6's vocabulary: a longer --seq-len leaves too few full-length rows.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MIB = 1 << 20


TOOL_CHATS = Path(__file__).resolve().parents[1] / "assets" / "data" / "tool_chats_openai.jsonl"


def data_overrides(args) -> list[str]:
    """The rows: the synthetic suite for the bench's checkpoint; the shipped tool conversations, rendered plain, for
    a checkpoint of one's own (`--model-path`)."""
    if args.model_path:
        return [f"data.source={TOOL_CHATS}", "data.chat_template=false", "data.num_samples=64"]
    return ["data.source=synthetic", "data.num_samples=1024"]


def bench_overrides(args, folder: Path, keep_path: Path, out: Path, engine: str) -> list[str]:
    """The bench child's overrides (slimwise_train/bench/memory.py), with full-length rows split at s = 1."""
    from slimwise_train.bench.memory import ENGINES

    return [f"model.path={folder}", f"prune.keep_set={keep_path}", *ENGINES[engine], f"output_dir={out / engine}",
            "resume=never", "logger=none", "progress=false", *data_overrides(args),
            f"data.seq_len={args.seq_len}", f"data.batch_size={args.batch}", f"distill.schedule.max_steps={args.steps}",
            f"distill.split.min_continuation={args.seq_len - 1}", "distill.eval.every=100000",
            "distill.checkpoint.every=100000", "distill.eval.batches=1", "distill.eval.split=train",
            f"distill.eval.samples={8 if args.model_path else 128}", "distill.export=false", "distill.check_frozen=false",
            "distill.schedule.warmup_steps=1"]


def measure(args) -> dict:
    """{engine: [rank measurements]} from the bench memory child (torchrun, gloo, fp32 on CPU)."""
    from slimwise_train.bench.memory import REPO, _checkpoint

    folder, keep_path = (Path(args.model_path), Path(args.keep_set)) if args.model_path else _checkpoint(args)[:2]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1"}
    results = {}
    with tempfile.TemporaryDirectory(prefix="slimwise_plan_bench_") as tmp:
        tmp = Path(tmp)
        for engine in args.engines.split(","):
            report = tmp / f"{engine}.json"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
                   "-m", "slimwise_train.bench.memory", "--child", str(report),
                   *bench_overrides(args, folder, keep_path, tmp / "runs", engine)]
            start = time.time()
            proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=False)
            if proc.returncode != 0 or not report.is_file():
                raise RuntimeError(f"bench memory child, engine {engine}, failed (exit {proc.returncode}):\n"
                                   f"{proc.stderr[-3000:]}")
            results[engine] = {"ranks": json.loads(report.read_text()), "seconds": round(time.time() - start, 1)}
    return results


def plan_overrides(args, engine: str) -> list[str]:
    """The planner's overrides for the bench's shape (conf/model/bench_memory.yaml mirrors the bench's model), or for
    the checkpoint of `--model-path` (its config.json; the keep set's ratio)."""
    from slimwise_train.bench.memory import ENGINES

    if args.model_path:
        from slimwise_train.moe.keepset import KeepSet

        keep = KeepSet.load(args.keep_set)
        ratio = 1 - sum(keep.num_kept) / sum(layer.num_experts for layer in keep.layers)
        folder = Path(args.model_path).resolve()
        return [f"model.path={folder}", f"model.name={folder.name}", "model.tiny=null", "model.architecture=null",
                "model.dtype=float32", *ENGINES[engine], "device=cpu", f"world_size={args.nproc}",
                f"data.seq_len={args.seq_len}", f"data.batch_size={args.batch}", f"prune.ratio={ratio:g}"]

    shape = {"hidden_size": args.hidden, "num_hidden_layers": args.layers, "num_experts": args.experts,
             "num_experts_per_tok": args.top_k, "moe_intermediate_size": args.moe_intermediate,
             "vocab_size": args.vocab, "intermediate_size": 4 * args.hidden, "num_attention_heads": 8,
             "num_key_value_heads": 4, "head_dim": args.hidden // 8, "max_position_embeddings": 4096}
    return ["model=bench_memory", *[f"++model.tiny_overrides.{k}={v}" for k, v in shape.items()], *ENGINES[engine],
            "device=cpu", f"world_size={args.nproc}", f"data.seq_len={args.seq_len}", f"data.batch_size={args.batch}",
            "prune.ratio=0.5"]


def plan(overrides: list[str]) -> dict:
    from hydra import compose, initialize_config_dir

    from slimwise_train.config import CONF_DIR, register_configs
    from slimwise_train.plan.memory import plan_from_config

    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose("plan", overrides=overrides)
    return plan_from_config(cfg).to_json()


def compare(args) -> list[dict]:
    """Measure, then plan each engine with the measured baseline B (`baseline_mib`): the plan's framework_baseline is
    B plus the trainer's calibrated runtime, so (total - B) is what the plan says the run adds to the bare process."""
    measured = measure(args)
    lines = []
    for engine, result in measured.items():
        ranks = result["ranks"]
        base = max(r["baseline"] for r in ranks)
        peak = max(r["step_peak"] for r in ranks)
        planned = plan([*plan_overrides(args, engine), f"baseline_mib={base / MIB}"])
        total = planned["total_bytes"]
        lines.append({
            "engine": engine,
            "measured_mib": {key: [round(r[key] / MIB, 1) for r in ranks]
                             for key in ("baseline", "load_peak", "after_setup", "step_peak")},
            "planned_total_mib": round(total / MIB, 1),
            "planned_beyond_baseline_mib": round((total - base) / MIB, 1),
            "measured_beyond_baseline_mib": round((peak - base) / MIB, 1),
            "relative_error_total": round(total / peak - 1, 3),
            "relative_error_beyond_baseline": round((total - base) / (peak - base) - 1, 3),
            "planned_components_mib": {k: round(v / MIB, 1) for k, v in planned["components"].items()},
            "seconds": result["seconds"],
        })
    return lines


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m slimwise_train.plan.bench_compare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in (("hidden", 128), ("layers", 2), ("experts", 8), ("top-k", 2), ("moe-intermediate", 64),
                          ("vocab", 4096), ("seq-len", 128), ("batch", 2), ("steps", 2), ("nproc", 2)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--engines", default="torch,zero2,zero3")
    parser.add_argument("--model-path", default=None, help="a saved checkpoint to measure and plan instead of the "
                        "bench's (the shape flags other than --seq-len, --batch, --steps, --nproc are then unused)")
    parser.add_argument("--keep-set", default=None, help="with --model-path: its keep_set.json (prune's)")
    parser.add_argument("--measure-only", action="store_true", help="print the measurements, skip the planner")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if bool(args.model_path) != bool(args.keep_set):
        print("bench_compare: error: --model-path and --keep-set go together: pass both (a checkpoint and its "
              "keep_set.json) or neither (the bench's own checkpoint)", file=sys.stderr)
        return 2
    if args.measure_only:
        for engine, result in measure(args).items():
            print(json.dumps({"engine": engine, **result}), flush=True)
        return 0
    for line in compare(args):
        print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

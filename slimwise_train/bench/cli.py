"""The `BENCHES` registry and `main(argv)`, the argument parsing of `python -m slimwise_train.bench`."""

from __future__ import annotations

import argparse
import json

from slimwise_train.bench.calib import run_calib
from slimwise_train.bench.common import _model_args
from slimwise_train.bench.decode import run_decode
from slimwise_train.bench.engine import run_engine
from slimwise_train.bench.lm_eval import run_lm_eval_bench
from slimwise_train.bench.loss import run_loss
from slimwise_train.bench.memory import ENGINES as MEMORY_ENGINES
from slimwise_train.bench.memory import run_memory
from slimwise_train.bench.phase import run_phase
from slimwise_train.bench.prune import VARIANTS as PRUNE_VARIANTS
from slimwise_train.bench.prune import run_prune_bench
from slimwise_train.bench.serve import run_serve_bench
from slimwise_train.bench.train import run_train

USAGE = """`python -m slimwise_train.bench <name>`: side-by-side benchmarks that print one JSON line each.

Every figure that matters is a ratio of two things timed in the same process, interleaved, so it holds on a
noisy shared machine; absolute times are printed too and become meaningful on a GPU.

    python -m slimwise_train.bench calib      # statistics collection vs a plain no-grad forward
    python -m slimwise_train.bench phase      # phase-aware masking hooks in the prefill phase vs no hooks
    python -m slimwise_train.bench loss       # top-k + residual KL vs naive full-vocabulary KL
    python -m slimwise_train.bench decode     # decode step: full vs masked vs pruned pools, batch 1..64
    python -m slimwise_train.bench train      # distillation step vs a naive two-copy step and the lower bound
    python -m slimwise_train.bench memory     # per-rank memory of the trainer on a saved checkpoint, per engine
    python -m slimwise_train.bench prune      # peak RSS of pruning a saved checkpoint: whole vs layerwise, exports
    python -m slimwise_train.bench lm_eval    # lm-eval's slimwise model vs the eval app: same cells, wall-time ratio
    python -m slimwise_train.bench engine     # llama.cpp decode/prefill: full vs pruned, beside this machine's roofline
    python -m slimwise_train.bench serve      # `serve up` endpoints under GuideLLM load: throughput at a per-user target

`memory` launches torchrun itself (2 ranks) and prints one JSON line per engine, then its targets; `prune` one fresh
process per variant, one JSON line each, then its targets.
"""

BENCHES = {"calib": run_calib, "phase": run_phase, "loss": run_loss, "decode": run_decode, "train": run_train,
           "memory": run_memory, "lm_eval": run_lm_eval_bench, "engine": run_engine, "prune": run_prune_bench,
           "serve": run_serve_bench}


def _show_defaults(parser: argparse.ArgumentParser) -> None:
    """`(default: ...)` after every option of every subcommand in `--help`, also for options without a help text
    (argparse's ArgumentDefaultsHelpFormatter skips those)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            listed = {choice.dest: choice.help for choice in action._choices_actions}
            for name, child in action.choices.items():
                if child.description is None and listed.get(name):
                    child.description = listed[name].replace("%%", "%")  # `bench <name> --help` says what it is
                _show_defaults(child)
        elif action.option_strings and action.default is not argparse.SUPPRESS and action.help is not argparse.SUPPRESS:
            help_text = action.help or ""
            if "default" not in help_text.lower():  # "(default 2: ...)" written out already
                action.help = f"{help_text} (default: %(default)s)".strip()


def build_parser() -> argparse.ArgumentParser:
    """The parser of `python -m slimwise_train.bench`: one subcommand per bench, every flag with its help."""
    from slimwise_train.utils.cli import OneLineParser

    parser = OneLineParser(prog="python -m slimwise_train.bench", description=USAGE,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="name", required=True)
    calib = sub.add_parser("calib", help="statistics collection vs plain no-grad forward")
    _model_args(calib)
    calib.add_argument("--batches", type=int, default=4, help="calibration batches of --batch x --seq tokens")
    phase = sub.add_parser("phase", help="phase-aware masking overhead")
    _model_args(phase)
    loss = sub.add_parser("loss", help="top-k + residual KL vs naive full-vocabulary KL: time, peak memory")
    loss.add_argument("--tokens", type=int, default=8192, help="tokens for the memory of the top-k + residual KL")
    loss.add_argument("--naive-tokens", type=int, default=2048,
                      help="tokens for the memory of the naive KL (at 8192 it needs ~30 GB on CPU)")
    loss.add_argument("--vocab", type=int, default=151936, help="vocabulary size (Qwen3's by default)")
    loss.add_argument("--top-k", type=int, default=64, help="teacher tokens the KL keeps besides one residual bucket")
    loss.add_argument("--chunk", type=int, default=256, help="tokens per chunk of the fused loss")
    loss.add_argument("--time-tokens", type=int, default=1024, help="tokens for the timing part")
    loss.add_argument("--repeats", type=int, default=3, help="timed rounds of both losses, in turn")
    decode = sub.add_parser("decode", help="one batched decode step: full, masked, pruned 25/50/75%%")
    # 8 of 128 experts as Qwen3-30B-A3B routes (the paper's models route 8 of 128 or 256). I768 puts 1.2 GB of fp32
    # experts in a layer, the bytes of Qwen3-30B-A3B's bf16 experts: the per-op costs of attention, router and cache
    # do not grow with the experts, so at I256 (400 MB) they took 28% of the batch-64 step, at I512 6-12%.
    _model_args(decode, without=("batch", "seq"), hidden=1024, layers=2, experts=128, top_k=8, moe_intermediate=768,
                vocab=2048, repeats=15)
    decode.add_argument("--batches", default="1,8,32,64", help="comma-separated sequences decoded together, one row each")
    decode.add_argument("--ratios", default="0.25,0.5,0.75",
                        help="comma-separated shares of the experts removed per layer (one pruned variant each; the "
                             "masked variant uses 0.5, or the first)")
    decode.add_argument("--prompt", type=int, default=256, help="tokens already in each sequence's KV cache")
    decode.add_argument("--kv-heads", type=int, default=2,
                        help="key/value heads of 64 (default 2: 8 query heads per KV head, as Qwen3-30B-A3B's 32/4)")
    decode.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="weights, activations and KV cache")
    decode.add_argument("--min-seconds", type=float, default=2.0,
                        help="timed seconds per variant and batch size at least (more repeats for small batches)")
    decode.add_argument("--warmup", type=int, default=4,
                        help="untimed rounds of every variant first (the first few rounds after the models are "
                             "built run slow and uneven here)")
    decode.add_argument("--cache", choices=["static", "dynamic"], default="static",
                        help="KV cache: preallocated and written in place (static, as serving engines do) or HF's "
                             "DynamicCache, which re-copies it on every step")
    memory = sub.add_parser("memory", help="per-rank memory of the trainer on a saved checkpoint, per engine (2 ranks)")
    memory.add_argument("--hidden", type=int, default=512, help="hidden size of the saved checkpoint")
    memory.add_argument("--layers", type=int, default=8, help="decoder layers, each an MoE layer")
    memory.add_argument("--experts", type=int, default=32, help="routed experts per MoE layer")
    memory.add_argument("--top-k", type=int, default=4, help="experts each token is routed to")
    memory.add_argument("--moe-intermediate", type=int, default=512, help="intermediate size of one expert")
    memory.add_argument("--vocab", type=int, default=32768, help="vocabulary size")
    memory.add_argument("--seq-len", type=int, default=256, help="tokens per training sequence (data.seq_len)")
    memory.add_argument("--batch", type=int, default=2, help="sequences per rank and micro-batch (data.batch_size)")
    memory.add_argument("--steps", type=int, default=2, help="training steps each engine runs")
    memory.add_argument("--nproc", type=int, default=2, help="ranks torchrun starts per engine")
    memory.add_argument("--engines", default="torch,zero2,zero3,zero3_recompute",
                        help=f"comma-separated, of {', '.join(MEMORY_ENGINES)}")
    prune = sub.add_parser("prune", help="peak RSS of pruning a saved checkpoint: whole model vs layer by layer, "
                           "and the exports (deep copy, from memory, streamed from the files); a process each")
    prune.add_argument("--hidden", type=int, default=512, help="hidden size of the saved Qwen3-MoE checkpoint")
    prune.add_argument("--layers", type=int, default=8, help="its decoder layers (all MoE)")
    prune.add_argument("--experts", type=int, default=32, help="routed experts per layer")
    prune.add_argument("--top-k", type=int, default=4, help="experts each token is routed to")
    prune.add_argument("--moe-intermediate", type=int, default=512, help="one expert's intermediate size")
    prune.add_argument("--vocab", type=int, default=32768, help="vocabulary size")
    prune.add_argument("--shard-mb", type=int, default=100, help="the saved checkpoint's shard size in MB")
    prune.add_argument("--samples", type=int, default=64, help="calibration sequences")
    prune.add_argument("--seq-len", type=int, default=256, help="tokens per calibration sequence")
    prune.add_argument("--batch", type=int, default=8, help="calibration sequences per forward")
    prune.add_argument("--variants", default=",".join(PRUNE_VARIANTS), help=f"comma-separated, of {', '.join(PRUNE_VARIANTS)}")
    train = sub.add_parser("train", help="distillation step: ours vs naive two-copy step vs lower bound; memory")
    _model_args(train, hidden=512, layers=4, experts=32, top_k=4, moe_intermediate=256, vocab=32768, batch=4, seq=256,
                repeats=3)
    train.add_argument("--prune-ratio", type=float, default=0.5, help="share of routed experts removed per layer")
    train.add_argument("--loss-top-k", type=int, default=64, help="distill.loss.top_k of the KL")
    train.add_argument("--chunk", type=int, default=1024, help="distill.loss.chunk_size of the loss")
    train.add_argument("--split", default="0.5",
                       help="split point as a fraction of --seq for every row, or 'random' (s ~ U{1..seq-2} per row)")
    train.add_argument("--seed", type=int, default=0, help="seed of the random model, data and split points")
    lm_eval = sub.add_parser("lm_eval", help="lm-eval's slimwise model vs the eval app: same numbers, wall time")
    lm_eval.add_argument("--teacher", default="slimwise_train/assets/teacher", help="the full model's folder")
    lm_eval.add_argument("--keep-set", default="outputs/demo/reap-r0.5/keep_set.json",
                         help="keep_set.json of the pruned modes (make demo writes this one)")
    lm_eval.add_argument("--student", default="outputs/demo/distill/export",
                         help="the distilled export of the *_distill modes (make demo writes this one)")
    lm_eval.add_argument("--num-per-family", type=int, default=200, help="held-out problems per family")
    lm_eval.add_argument("--batch-size", type=int, default=32, help="problems generated together, in both tools")
    lm_eval.add_argument("--output-dir", default="outputs/bench/lm_eval", help="where both tools write their runs")
    engine = sub.add_parser("engine", help="llama.cpp decode/prefill throughput, full vs pruned, with this machine's "
                            "roofline bound")
    engine.add_argument("--models", default="teacher,bench",
                        help="teacher (the shipped one) and/or bench (bench decode's shape: L2 H1024 E128 top-8 I768)")
    engine.add_argument("--batches", default="1,16,64", help="sequences decoded together")
    engine.add_argument("--ratios", default="0.25,0.5,0.75",
                        help="comma-separated shares of the experts removed per layer (one pruned GGUF each)")
    engine.add_argument("--prompt", type=int, default=64, help="prompt tokens per sequence")
    engine.add_argument("--steps", type=int, default=16, help="decode steps timed per round")
    engine.add_argument("--repeats", type=int, default=3, help="timed rounds (one untimed round first)")
    engine.add_argument("--threads", type=int, default=None, help="default: the CPUs this process may use")
    engine.add_argument("--outtype", default="f16", choices=["f32", "f16", "bf16"], help="GGUF weight type")
    engine.add_argument("--kv-type", default="f16", choices=["f16", "f32"], help="llama.cpp's KV cache type")
    engine.add_argument("--work-dir", default=None, help="where the GGUF files go for the run (default: the temp dir)")
    serve = sub.add_parser("serve", help="`serve up` endpoints under GuideLLM load: full, pruned and SlimWise at 50/75%%, "
                           "throughput at a per-user speed target beside the roofline bound")
    serve.add_argument("--models", default="teacher,bench",
                       help="teacher (the shipped one) and/or bench (bench engine's shape: L2 H1024 E128 top-8 I768)")
    serve.add_argument("--concurrency", default="1,4,16", help="concurrent streams GuideLLM keeps open, per level")
    serve.add_argument("--ratios", default="0.5,0.75", help="shares of experts removed (pruned and SlimWise variants)")
    serve.add_argument("--prompt", type=int, default=64, help="prompt tokens per request (GuideLLM synthetic text)")
    serve.add_argument("--output", type=int, default=64, help="output tokens per request (ignore_eos)")
    serve.add_argument("--min-requests", type=int, default=16, help="requests per run at least (4 x concurrency "
                       "when that is more)")
    serve.add_argument("--rounds", type=int, default=2, help="rounds over every level and variant (medians, paired "
                       "ratios)")
    serve.add_argument("--target-fraction", type=float, default=0.5, help="per-user speed target as a fraction of "
                       "the full model's p50 single-request speed measured in the run")
    serve.add_argument("--target-tok-s", type=float, default=None, help="per-user speed target in tokens/s instead "
                       "(the paper's 50 on a GPU)")
    serve.add_argument("--threads", type=int, default=None, help="threads of each llama-server; default: half the "
                       "CPUs this process may use (a prefill and a decode server share them)")
    serve.add_argument("--outtype", default="f16", choices=["f32", "f16", "bf16"], help="GGUF weight type")
    serve.add_argument("--work-dir", default=None, help="where the GGUF files and GuideLLM's reports go for the run "
                       "(default: the temp dir; removed at the end)")
    _show_defaults(parser)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    result = BENCHES[args.name](args)
    print(json.dumps(result), flush=True)
    return 0

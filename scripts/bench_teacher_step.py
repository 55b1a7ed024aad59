"""Training step time of the deep teacher per experts implementation and autocast dtype, side by side in one run.

    python scripts/bench_teacher_step.py                      # 4 layers, 4 x 1024 tokens, the recipe's stage shape
    python scripts/bench_teacher_step.py --layers 12 --steps 3

Every variant trains the same freshly initialised model (same seed) on the same random batch: forward with the
router aux loss, backward, AdamW step. The time per step is the median over `--steps` after one warm-up step; the
ratio is against transformers' default for this model (`grouped_mm`, float32), the one `train_teacher.py` uses.
The first step's loss of each variant is printed beside the default's: a variant that computes something else is an
error, not a faster result (bf16 autocast differs by rounding; the tolerance is stated below).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_teacher  # noqa: E402  (the sibling script: its deep preset and model config)

IMPLEMENTATIONS = ("grouped_mm", "eager", "batched_mm")
DTYPES = ("float32", "bfloat16")
LOSS_TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2}  # |loss - default's loss| on the first step, relative


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4, help="sequences per step (the deep preset's)")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per variant, after one warm-up step")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--implementations", nargs="+", choices=IMPLEMENTATIONS, default=list(IMPLEMENTATIONS))
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES))
    args = parser.parse_args(argv)
    if args.steps < 1 or args.batch < 1 or args.seq_len < 2 or args.layers < 1:
        raise SystemExit("--steps, --batch and --layers must be >= 1 and --seq-len >= 2")
    return args


def time_variant(config, ids: torch.Tensor, implementation: str, dtype: str, steps: int) -> tuple[float, float]:
    """(median seconds per training step, first step's loss) of one variant."""
    from transformers import Qwen3MoeForCausalLM
    torch.manual_seed(0)
    config._experts_implementation = implementation
    model = Qwen3MoeForCausalLM(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    seconds, first_loss = [], None
    for _ in range(steps + 1):
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
            out = model(input_ids=ids, labels=ids, output_router_logits=True)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seconds.append(time.perf_counter() - start)
        first_loss = float(out.loss.detach()) if first_loss is None else first_loss
    return statistics.median(seconds[1:]), first_loss


def main(argv=None) -> None:
    args = parse_args(argv)
    from transformers import AutoTokenizer
    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(train_teacher.TOKENIZER)
    preset = train_teacher.parse_args(["--preset", "deep", "--layers", str(args.layers)])
    config = train_teacher.teacher_config(tokenizer, preset)
    config._attn_implementation = "sdpa"
    ids = torch.randint(len(tokenizer.all_special_ids), len(tokenizer), (args.batch, args.seq_len),
                        generator=torch.Generator().manual_seed(0))
    tokens = args.batch * args.seq_len
    print(f"{args.layers} layers, {args.batch} x {args.seq_len} tokens per step, {args.threads} threads, "
          f"torch {torch.__version__}; median of {args.steps} steps", flush=True)
    print("| experts | autocast | s / step | tokens / s | vs grouped_mm float32 | first loss |")
    print("|---|---|---|---|---|---|")
    baseline = None
    variants = [("grouped_mm", "float32")] + [(i, d) for i in args.implementations for d in args.dtypes
                                              if (i, d) != ("grouped_mm", "float32")]
    for implementation, dtype in variants:
        seconds, loss = time_variant(config, ids, implementation, dtype, args.steps)
        if baseline is None:
            baseline = (seconds, loss)
        elif abs(loss - baseline[1]) > LOSS_TOLERANCE[dtype] * abs(baseline[1]):
            raise SystemExit(f"{implementation} {dtype}: first loss {loss:.5f} vs the default's {baseline[1]:.5f}, "
                             f"beyond the {LOSS_TOLERANCE[dtype]:g} relative tolerance: it computes something else")
        print(f"| {implementation} | {dtype} | {seconds:.3f} | {tokens / seconds:,.0f} | "
              f"{baseline[0] / seconds:.2f}x | {loss:.4f} |", flush=True)


if __name__ == "__main__":
    main()

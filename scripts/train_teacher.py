"""Train the small MoE teacher that ships with slimwise_train (slimwise_train/assets/teacher).

    python scripts/train_teacher.py                      # ~60 min on 2 CPU cores, stops by itself
    python scripts/train_teacher.py --minutes 5 --out /tmp/teacher   # a quick smoke run

Leave OMP_WAIT_POLICY unset: PASSIVE nearly halves the throughput of this small model (6.2k vs 11.5k tokens/s
measured on 2 idle cores in 45 s; whole hour-long runs: 6.3k with it, 9.4k without, periodic evals included).

The shipped teacher: 3300 s, 13,854 steps, 33.3M tokens, lr cosine-decayed to zero; greedy exact match on 200
held-out problems per family math 0.97, code 0.92, tool 1.00. The same seed and data with the cosine ending at
0.1x the peak lr (`--final-lr 0.1`, the earlier default): 12,961 steps, 0.89 / 0.92 / 0.99; with it, tool weighted
0.6 instead of 0.35 in the mix (and evals every 6 min): 0.89 / 0.88 / 1.00; math : code : tool 1.5 : 1.2 : 0.3 ->
0.91 / 0.83 / 0.985 and 1.3 : 1.3 : 0.25 -> 0.93 / 0.835 / 0.985 (run-to-run spread of several points per family);
with OMP_WAIT_POLICY=PASSIVE (20.6M tokens): 0.84 / 0.705 / 0.995.

A stock `Qwen3MoeForCausalLM` (64 experts, top-4, weak load balancing) learns the offline synthetic suite
(math / code / tool). The design follows the pilots in ../shared/notes/pilot-tiny-teacher.md and short
side-by-side runs here on the same data (answer cross-entropy at a given step, lower learns faster; tokens/s
under OMP_WAIT_POLICY=PASSIVE):
  - 16 experts, top-2, moe_intermediate 128, aux 0.01 (the pilot): no redundancy (50% pruning -> ~0 on every
    family); 1.20 at step 500 vs 0.94 for the default in 4-minute schedules (10.3k vs 6.9k tokens/s);
  - 32 experts, top-2, moe_intermediate 128, aux 0.001: routing drifts out of balance (aux 2.7, balanced 2.0)
    and it learns slowest: 1.42 / 1.03 at steps 500 / 1000 vs 1.03 / 0.50 for the default (55-minute schedule,
    9.2k vs 7.0k tokens/s);
  - 64 experts, top-4, moe_intermediate 48, aux 0.001 (the default): fastest per step, about even per minute;
    on the shipped teacher pruning 12.5% costs 3 points (all families), 25% costs math 3, code 31 and tool 39
    points (1.00 -> 0.61), 50% leaves 0.31 (README, pruning sweep).

Training: loss on answer + EOS only; AdamW, warm-up then cosine decay to zero over the time budget;
length-bucketed batches. Every `--eval-every` minutes it decodes held-out problems greedily and stops once every
family reaches `--target` (or the time budget ends); then it evaluates the final model on `--final-eval`
held-out problems per family and writes the checkpoint (safetensors) and a training log, atomically.

`--preset deep` trains the second, deep teacher for the fidelity study (docs/teacher.md, "A deep teacher for the
fidelity study"); its staged recipe (recall, mixture at 4 layers, then depth) is scripts/train_deep_teacher.py, each
stage one `--preset deep` run. By default the preset grows the model from the shipped teacher (`--grow-from`: 4 -> 12
layers, each layer repeated with the repeats' outputs zeroed, so training starts from exactly the shipped model) and
trains it on the long-context suite (slimwise_train/data/synthetic/long_context.py: lookup, toolpick, steps, fewshot,
plus math / code / tool) packed into 1024-token sequences; it is resumable:

    python scripts/train_teacher.py --preset deep --warm-params lookup.min_rows=2,lookup.max_rows=12 --warm-chunks 6
    python scripts/train_teacher.py --preset deep --resume             # continue from outputs/teacher_deep/checkpoint

Its schedule is by steps (`--max-steps`; the cosine ends at zero there, whatever the wall time), `--minutes` only
pauses a run (checkpoint, then `--resume`); a checkpoint (`<out>/checkpoint/`: model, optimizer, step, RNG, data
position) is written every `--checkpoint-every` minutes and at a pause, and the finished model goes to
`<out>/final/` (copy it into slimwise_train/assets/ to ship it). Flags given explicitly override the preset; on
`--resume` the checkpoint's own settings win except the run controls (--minutes, --steps-this-run, --threads,
--checkpoint-every, --eval-every, --log-every) and the data flags, which start a new phase from the checkpoint's data
position: `--mix lookup=2,code=1.5` (the mixture's weights) and `--warm-params lookup.min_rows=2,lookup.max_rows=10
--warm-chunks 20` (a curriculum: those generator parameters for the next 20 data chunks, then the defaults).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import sys
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from slimwise_train.data import synthetic  # noqa: E402
from slimwise_train.eval.generation import build_problems, family_budgets, greedy_accuracy  # noqa: E402
from slimwise_train.utils.atomic import atomic_dir  # noqa: E402

TOKENIZER = REPO / "slimwise_train" / "assets" / "tokenizer"


def teacher_config(tokenizer, args) -> Qwen3MoeConfig:
    return Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 2,
        moe_intermediate_size=args.moe_intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=args.hidden // 4,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        norm_topk_prob=True,
        router_aux_loss_coef=args.aux,
        output_router_logits=False,  # training asks for them per call; generation must not (HF aux-loss mask bug)
        max_position_embeddings=args.max_positions,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        initializer_range=0.02,
    )


def encode(tokenizer, example):
    prompt, answer = synthetic.to_text(example)
    p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    a = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return p, a


def batches(tokenizer, args, exclude):
    """Endless length-bucketed training batches: (input_ids, attention_mask, labels) right-padded, families
    mixed by the recipe's weights with the recipe's parameters."""
    recipe = synthetic.load_recipe()
    params = synthetic.recipe_params(recipe)
    counts = synthetic.recipe_counts(recipe, args.batch * 64)
    chunk = 0
    while True:
        examples = synthetic.generate_mixture(counts, seed=args.seed + 1000 * chunk, exclude=exclude, params=params)
        chunk += 1
        encoded = [encode(tokenizer, e) for e in examples]
        encoded.sort(key=lambda pa: len(pa[0]) + len(pa[1]))
        groups = [encoded[i : i + args.batch] for i in range(0, len(encoded), args.batch)]
        random.Random(chunk).shuffle(groups)
        for group in groups:
            width = max(len(p) + len(a) for p, a in group)
            ids = torch.full((len(group), width), tokenizer.pad_token_id, dtype=torch.long)
            labels = torch.full((len(group), width), -100, dtype=torch.long)
            mask = torch.zeros((len(group), width), dtype=torch.long)
            for row, (p, a) in enumerate(group):
                seq = p + a
                ids[row, : len(seq)] = torch.tensor(seq)
                mask[row, : len(seq)] = 1
                labels[row, len(p) : len(seq)] = torch.tensor(a)  # HF shifts labels inside the loss
            yield ids, mask, labels


# The deep teacher (docs/teacher.md, "A deep teacher for the fidelity study"). Measured on 2 quiet cores: the
# first design (random init, 32 experts x moe_intermediate 32, 5.4M parameters) trained at 2.4-2.9k tokens/s and
# never learnt retrieval from the prompt in 30M tokens (7.5 h; lookup 0.0-0.1). Since 2026-12-03 (fourth session) it
# is grown from the shipped teacher (--grow-from, below), which needs the shipped MoE shape (64 experts x 48):
# 14.9M parameters, 2.3-2.8k tokens/s on 2 quiet cores: 3000 steps x 4 x 1024 = 12.3M tokens took 103 min.
DEEP_PRESET = {
    "out": str(REPO / "outputs" / "teacher_deep"),
    "layers": 12,
    "hidden": 128,
    "top_k": 4,
    "experts": 64,  # the shipped teacher's MoE shape, so it can be grown from it (--grow-from)
    "moe_intermediate": 48,
    "aux": 0.001,
    "grow_from": str(REPO / "slimwise_train" / "assets" / "teacher"),
    "max_positions": 2048,  # twice the training length: long prompts plus long answers in evaluation
    "seq_len": 1024,
    "batch": 4,  # more updates for a small token budget; 4 x 1024 tokens keep ~500 rows per expert matmul
    "lr": 1.5e-3,
    "warmup": 100,
    "max_steps": 3000,
    "minutes": 100.0,  # a pause, not the schedule: resume with --resume
    "eval_every": 30.0,
    "eval_n": 10,
    "final_eval": 100,
    "target": 2.0,  # never stop early: the schedule is by steps
}
# Flags a resumed run takes from the command line; everything else comes from the checkpoint.
RUN_CONTROLS = ("minutes", "steps_this_run", "threads", "checkpoint_every", "eval_every", "log_every", "resume",
                "overwrite", "out", "extend_schedule")
DEEP_FAMILIES = ("lookup", "toolpick", "steps", "fewshot", "math", "code", "tool")


def parse_mix(text: str) -> dict[str, float]:
    """`--mix lookup=2,code=1.5`: the long-context mixture's weights (in examples); a family not named keeps its
    weight in long_context.LONG_SUITE_WEIGHTS, 0 leaves it out."""
    from slimwise_train.data.synthetic.long_context import LONG_SUITE_WEIGHTS

    weights = dict(LONG_SUITE_WEIGHTS)  # same order: the mixture's shuffle seed is derived from the family names
    for item in text.split(","):
        family, sep, value = item.partition("=")
        if not sep or family not in weights:
            raise argparse.ArgumentTypeError(f"{item!r}: expected FAMILY=WEIGHT, FAMILY one of {', '.join(weights)}")
        try:
            weight = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r}: the weight must be a number") from None
        if not (math.isfinite(weight) and weight >= 0):
            raise argparse.ArgumentTypeError(f"{item!r}: the weight must be finite and >= 0")
        weights[family] = weight
    if not sum(weights.values()) > 0:
        raise argparse.ArgumentTypeError("every weight is 0; give at least one family a positive weight")
    return weights


def parse_family_params(text: str) -> dict[str, dict]:
    """`--warm-params lookup.min_rows=2,lookup.max_rows=10`: generator parameters (long_context.LONG_DEFAULT_PARAMS,
    synthetic DEFAULT_PARAMS) per family, checked by generating one example with them."""
    params: dict[str, dict] = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        family, dot, name = key.partition(".")
        if not (sep and dot and name):
            raise argparse.ArgumentTypeError(f"{item!r}: expected FAMILY.PARAM=VALUE, e.g. lookup.max_rows=10")
        if family not in DEEP_FAMILIES:
            raise argparse.ArgumentTypeError(f"{item!r}: FAMILY must be one of {', '.join(DEEP_FAMILIES)}")
        try:
            number = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r}: the value must be a number") from None
        params.setdefault(family, {})[name] = int(number) if number.is_integer() else number
    for family, overrides in params.items():
        try:
            synthetic.generate(family, 1, 0, **overrides)
        except (TypeError, ValueError) as error:
            raise argparse.ArgumentTypeError(f"{family}: {error}") from None
    return params


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, with `--preset deep`'s values as defaults (explicit flags still win)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(REPO / "slimwise_train" / "assets" / "teacher"))
    parser.add_argument("--minutes", type=float, default=55.0, help="training time budget (wall clock); + final eval < 60 min")
    parser.add_argument("--target", type=float, default=0.93, help="stop early once every family reaches this")
    parser.add_argument("--eval-every", type=float, default=10.0, help="minutes between held-out checks")
    parser.add_argument("--eval-n", type=int, default=60, help="held-out problems per family during training")
    parser.add_argument("--final-eval", type=int, default=200, help="held-out problems per family at the end")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--moe-intermediate", type=int, default=48)
    parser.add_argument("--aux", type=float, default=0.001)
    parser.add_argument("--max-steps", type=int, default=20000, help="the schedule ends at whichever comes first")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--final-lr", type=float, default=0.0,
                        help="lr at the end of the cosine, as a share of --lr (0.1 gave math 0.89 instead of 0.97)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seed", type=int, default=2025)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--overwrite", action="store_true")
    parser.add_argument("--max-positions", type=int, default=512, help="max_position_embeddings of the model")
    deep = parser.add_argument_group("deep teacher (--preset deep)")
    deep.add_argument("--preset", choices=["deep"], default=None,
                      help="deep: the long-context teacher (12 layers, packed 1024-token sequences, resumable)")
    deep.add_argument("--seq-len", type=int, default=1024, help="tokens per packed training sequence")
    deep.add_argument("--resume", action="store_true", help="continue from <out>/checkpoint")
    deep.add_argument("--extend-schedule", type=int, default=None, metavar="STEPS",
                      help="with --resume: a longer schedule, the cosine re-planned to end at STEPS (the lr steps up "
                           "to the new curve's value at the current step); STEPS >= the checkpoint's step")
    deep.add_argument("--end-at", type=int, default=None, metavar="STEP",
                      help="finish (final eval, <out>/final) at this step, before the cosine planned to --max-steps "
                           "ends: a stage of a longer schedule (scripts/train_deep_teacher.py)")
    deep.add_argument("--checkpoint-every", type=float, default=10.0, help="minutes between checkpoints")
    deep.add_argument("--steps-this-run", type=int, default=0,
                      help="pause (checkpoint) after this many steps; 0: no limit")
    deep.add_argument("--log-every", type=int, default=20,
                      help="steps between progress lines (tokens/s, lr, answer CE overall and per family)")
    deep.add_argument("--examples-per-chunk", type=int, default=2048, help="examples generated and packed at a time")
    deep.add_argument("--heldout-exclude", type=int, default=400,
                      help="held-out problems per family kept out of training (at least --final-eval are)")
    deep.add_argument("--mix", type=parse_mix, default=None, metavar="FAMILY=WEIGHT,...",
                      help="the long-context mixture's weights in examples (others keep LONG_SUITE_WEIGHTS'); on "
                           "--resume it replaces the checkpoint's from its data position on")
    deep.add_argument("--warm-params", type=parse_family_params, default=None, metavar="FAMILY.PARAM=VALUE,...",
                      help="generator parameters for the next --warm-chunks data chunks (a curriculum, e.g. "
                           "lookup.min_rows=2,lookup.max_rows=10); then the defaults")
    deep.add_argument("--warm-chunks", type=int, default=0, help="data chunks that use --warm-params")
    # not a flag: the data chunk the curriculum starts at (0; a resume that sets --warm-params moves it there)
    parser.set_defaults(warm_from_chunk=0)
    deep.add_argument("--grow-from", default=None, metavar="PATH|none",
                      help="a fresh run starts from this shallower Qwen3-MoE teacher grown in depth (each of its layers "
                           "repeated, the repeats' outputs zeroed, so the grown model computes exactly what it did); "
                           "the preset grows from the shipped teacher; none: random init")
    deep.add_argument("--no-shot-loss", action="store_true",
                      help="no loss on the solved examples' answers inside few-shot prompts (final answer + EOS only)")
    preset = argparse.ArgumentParser(add_help=False)
    preset.add_argument("--preset", choices=["deep"], default=None)
    if preset.parse_known_args(argv)[0].preset == "deep":
        parser.set_defaults(**DEEP_PRESET)
    return parser.parse_args(argv)


class UsageError(SystemExit):
    """Bad flags: `train_teacher.py: error: <message>` on one line and exit status 2 (run as a script), raised before
    anything trains or is written; callers in the same process read the message from str()."""

    def __init__(self, message: str):
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message


def check_flags(args) -> None:
    """Every flag no run can use, and an --out that would be refused only after the whole budget (55 min by default),
    refused now in one line naming the flag and the fix."""
    from slimwise_train.utils.rundir import check_writable

    at_least = {"layers": 1, "hidden": 4, "experts": 1, "top_k": 1, "moe_intermediate": 1, "max_steps": 1, "warmup": 1,
                "batch": 1, "threads": 1, "eval_n": 1, "final_eval": 1, "max_positions": 2, "seq_len": 2,
                "log_every": 1, "examples_per_chunk": 1}
    for name, low in at_least.items():
        value = getattr(args, name, None)
        if value is not None and value < low:
            raise UsageError(f"--{name.replace('_', '-')} {value} is invalid: it must be an integer >= {low}")
    for name in ("lr", "minutes", "eval_every", "checkpoint_every"):
        value = getattr(args, name, None)
        if value is not None and not (math.isfinite(value) and value > 0):
            raise UsageError(f"--{name.replace('_', '-')} {value} is invalid: it must be a finite number > 0")
    for name in ("final_lr", "target", "aux"):  # target above 1: never stop early (the deep preset's)
        value = getattr(args, name, None)
        high = 1.0 if name == "final_lr" else None
        if value is not None and not (math.isfinite(value) and value >= 0 and (high is None or value <= high)):
            raise UsageError(f"--{name.replace('_', '-')} {value} is invalid: it must be a finite number in "
                             f"[0, {high if high is not None else 'inf'}]")
    if args.top_k > args.experts:
        raise UsageError(f"--top-k {args.top_k} exceeds --experts {args.experts}: the router picks top-k of the "
                         "experts; lower --top-k or raise --experts")
    if args.hidden % 4:
        raise UsageError(f"--hidden {args.hidden} is not a multiple of 4 (4 attention heads share it); pass e.g. "
                         f"--hidden {args.hidden - args.hidden % 4 or 4}")
    out = Path(args.out)
    if args.preset != "deep" and out.exists() and not args.overwrite:
        raise UsageError(f"--out {out} exists (the default is the shipped teacher); pass --overwrite to replace it "
                         "at the end of training, or another --out")
    if (args.preset == "deep" and not args.resume and not args.overwrite and out.is_dir()
            and not (out / "checkpoint").exists() and any(out.iterdir())):
        raise UsageError(f"--out {out} holds something other than a deep-teacher run (the default is the shipped "
                         "teacher); pass an empty or new --out, or --overwrite to write checkpoint/ and final/ into it")
    try:  # the plain teacher replaces --out from its parent at the end; the deep one writes inside --out as it goes
        check_writable(out if args.preset == "deep" else out.parent, what="--out", create=False)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def main(argv=None):
    args = parse_args(argv)
    check_flags(args)
    if args.preset != "deep" and (args.mix is not None or args.warm_params is not None or args.warm_chunks):
        raise UsageError("--mix, --warm-params and --warm-chunks shape the long-context suite: add --preset deep")
    if args.preset != "deep" and args.grow_from is not None:
        raise UsageError("--grow-from starts the deep teacher from a shallower one: add --preset deep")
    if args.preset == "deep":
        return train_deep(args)

    if os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE":
        # measured here: 6.2k vs 11.5k tokens/s for this model on 2 idle cores (its ops are small, so sleeping
        # OpenMP threads cost more than they save); an hour under it gave 0.84 / 0.705 / 0.995 where the same
        # schedule (0.1x lr floor) gave 0.89 / 0.92 / 0.99 without it
        print("warning: OMP_WAIT_POLICY=PASSIVE halves training throughput here; unset it unless the cores are "
              "shared", file=sys.stderr, flush=True)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    model = Qwen3MoeForCausalLM(teacher_config(tokenizer, args))
    num_params = sum(p.numel() for p in model.parameters())
    print(f"teacher: {num_params:,} parameters; {args.experts} experts top-{args.top_k}, aux {args.aux}", flush=True)

    # The recipe's held-out split (eval seed 0): training never sees these prompts.
    heldout = build_problems(tokenizer, synthetic.FAMILIES, args.final_eval)
    exclude = frozenset(p.prompt for p in heldout)
    budgets = family_budgets(heldout)  # 2x the longest reference answer (incl. EOS) per family
    probe = [p for f in synthetic.FAMILIES for p in [q for q in heldout if q.family == f][: args.eval_n]]

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    budget_s = args.minutes * 60
    start = time.time()
    log = {"args": vars(args), "num_parameters": num_params, "curve": [], "evals": []}
    tokens = answer_tokens = step = 0
    next_eval = args.eval_every * 60
    window = {"ce": 0.0, "aux": 0.0, "n": 0}
    model.train()
    stop_reason = "time or step budget"
    for ids, mask, labels in batches(tokenizer, args, exclude):
        elapsed = time.time() - start
        if elapsed >= budget_s or step >= args.max_steps:
            break
        # Anneal by whichever budget runs out first, so a slower (shared) machine still ends at a low lr.
        progress = min(max(elapsed / budget_s, step / args.max_steps), 1.0)
        cosine = 0.5 * (1 + math.cos(math.pi * progress))
        lr = args.lr * min(1.0, (step + 1) / args.warmup) * (args.final_lr + (1 - args.final_lr) * cosine)
        for group in optimizer.param_groups:
            group["lr"] = lr
        out = model(input_ids=ids, attention_mask=mask, labels=labels, output_router_logits=True)
        ce = out.loss - args.aux * out.aux_loss
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        tokens += int(mask.sum())
        answer_tokens += int((labels != -100).sum())
        window["ce"] += float(ce.detach())
        window["aux"] += float(out.aux_loss.detach())
        window["n"] += 1
        if step % 100 == 0:
            row = {"minute": round(elapsed / 60, 2), "step": step, "answer_ce": round(window["ce"] / window["n"], 4),
                   "aux": round(window["aux"] / window["n"], 3), "tok_per_s": round(tokens / elapsed), "lr": lr}
            log["curve"].append(row)
            print(json.dumps(row), flush=True)
            window = {"ce": 0.0, "aux": 0.0, "n": 0}
        if elapsed >= next_eval:
            model.eval()
            result = greedy_accuracy(model, tokenizer, probe, budgets)
            model.train()
            entry = {"minute": round((time.time() - start) / 60, 2), "step": step,
                     **{f: r["accuracy"] for f, r in result.items()}}
            log["evals"].append(entry)
            print("eval", json.dumps(entry), flush=True)
            next_eval = (time.time() - start) + args.eval_every * 60
            if all(r["accuracy"] >= args.target for r in result.values()):
                stop_reason = f"every family >= {args.target} on {args.eval_n} held-out problems"
                break
    train_s = time.time() - start
    model.eval()
    final = greedy_accuracy(model, tokenizer, heldout, budgets)
    log.update({"stop_reason": stop_reason, "train_seconds": round(train_s), "steps": step, "tokens": tokens,
                "answer_tokens": answer_tokens, "final_eval": final, "final_eval_n": args.final_eval,
                "budgets": budgets})
    print("final", json.dumps(final), "stop:", stop_reason, flush=True)
    with atomic_dir(args.out, overwrite=args.overwrite) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "training_log.json").write_text(json.dumps(log, indent=2) + "\n")
    print(f"saved to {args.out}", flush=True)



# ----------------------------------------------------------------------------------------------- the deep teacher
def cosine_lr(args, step: int) -> float:
    """Warm-up, then cosine from --lr to --final-lr x --lr over --max-steps (by steps, so a resumed or slower run
    follows the same schedule)."""
    cosine = 0.5 * (1 + math.cos(math.pi * min(step / args.max_steps, 1.0)))
    return args.lr * min(1.0, (step + 1) / args.warmup) * (args.final_lr + (1 - args.final_lr) * cosine)


def save_checkpoint(folder: Path, model, optimizer, state: dict) -> None:
    """Model, optimizer, RNG and `state` (step, tokens, data position, args, log) into `folder`, atomically: a crash
    while writing leaves the previous checkpoint whole."""
    with atomic_dir(folder, overwrite=True) as tmp:
        model.save_pretrained(tmp)
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save({"torch": torch.get_rng_state(), "python": random.getstate()}, tmp / "rng.pt")
        (tmp / "state.json").write_text(json.dumps(state, indent=1) + "\n")


def load_checkpoint_state(folder: Path) -> dict:
    """state.json of a checkpoint folder, or a one-line error naming --resume and the fix."""
    if not (folder / "state.json").is_file():
        raise UsageError(f"--resume: no checkpoint at {folder}; run without --resume first, or pass the --out of "
                         "the run to continue")
    return json.loads((folder / "state.json").read_text())


def deep_args_for_resume(args, state: dict) -> argparse.Namespace:
    """The checkpoint's settings with this command's run controls (--minutes, --threads, ...) on top."""
    # keys a checkpoint written before a flag existed lacks take the preset's default (the behaviour it ran with)
    merged = {**vars(parse_args(["--preset", "deep"])), **state["args"]}
    merged.update({k: getattr(args, k) for k in RUN_CONTROLS})
    if args.mix is not None:  # a new data phase from the checkpoint's data position on
        merged["mix"] = args.mix
    if args.warm_params is not None:
        merged["warm_params"], merged["warm_chunks"] = args.warm_params, args.warm_chunks
        merged["warm_from_chunk"] = state["position"][0]  # the curriculum starts at this run's data position
    if args.extend_schedule is not None:
        if args.extend_schedule < state["step"]:
            raise UsageError(f"--extend-schedule {args.extend_schedule} is before the checkpoint's step "
                             f"{state['step']}; pass a step count >= {state['step']}")
        merged["max_steps"] = args.extend_schedule
        merged["end_at"] = None  # the longer schedule runs to its end
    return argparse.Namespace(**merged)


# The deep teacher starts from the shipped one grown in depth. From random init, retrieval from the prompt did not
# form: 12 layers at 30M tokens still answered lookups with a value of the right column from a random row (value
# tokens ~1.0 nats, tables of 2-12 rows included), and 4-layer models trained on lookups alone with tables of 2-12
# rows sat at answer CE 0.75-0.82 for 3-5M tokens. The same 4-layer model started from the shipped teacher was below
# that plateau by step 160 and answered 6 of 30 small-table lookups at ~1.6M tokens (docs/teacher.md).
GROWTH_SHAPE = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "num_experts",
                "num_experts_per_tok", "moe_intermediate_size", "vocab_size", "norm_topk_prob", "tie_word_embeddings",
                "rope_parameters", "mlp_only_layers", "decoder_sparse_step")


def depth_map(source_layers: int, layers: int) -> list[int]:
    """Which source layer each grown layer copies: each source layer repeated in place (4 -> 12: 0,0,0,1,1,1,...)."""
    return [j * source_layers // layers for j in range(layers)]


def load_growth_source(args, want: Qwen3MoeConfig):
    """The --grow-from teacher (or None for `none` / no flag), checked against the run's config `want` before
    anything is written: a mismatch is a one-line error naming every differing key."""
    if args.grow_from in (None, "none"):
        return None
    path = Path(args.grow_from)
    if not (path / "config.json").is_file():
        raise UsageError(f"--grow-from {path}: no config.json there; pass a saved Qwen3-MoE teacher folder or none")
    source = Qwen3MoeForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    differ = [f"{key} {getattr(source.config, key, None)} (run: {getattr(want, key, None)})" for key in GROWTH_SHAPE
              if getattr(source.config, key, None) != getattr(want, key, None)]
    if source.config.num_hidden_layers > args.layers:
        differ.append(f"num_hidden_layers {source.config.num_hidden_layers} (run: {args.layers}, must be >= it)")
    if differ:
        raise UsageError(f"--grow-from {path} does not fit this run: {'; '.join(differ)}; match the flags "
                         "(--hidden, --experts, --top-k, --moe-intermediate, --layers) or pass --grow-from none")
    return source


@torch.no_grad()
def grow_depth(source: Qwen3MoeForCausalLM, config: Qwen3MoeConfig) -> Qwen3MoeForCausalLM:
    """A `config.num_hidden_layers`-layer model computing exactly what `source` computes.

    Every layer is a copy of source layer `depth_map(...)[j]`; the first copy keeps its weights and the others get
    zero output projections (attention o_proj and every expert's down_proj), so they add nothing to the residual
    stream until training moves those weights (their gradients are not zero: the inputs of the projections are
    not). Embeddings, final norm and the tied head are copied. Shapes must match (`load_growth_source` checks)."""
    grown = Qwen3MoeForCausalLM(config)
    grown.model.embed_tokens.weight.copy_(source.model.embed_tokens.weight)
    grown.model.norm.weight.copy_(source.model.norm.weight)
    if not config.tie_word_embeddings:
        grown.lm_head.weight.copy_(source.lm_head.weight)
    mapping = depth_map(source.config.num_hidden_layers, config.num_hidden_layers)
    for j, i in enumerate(mapping):
        grown.model.layers[j].load_state_dict(source.model.layers[i].state_dict())
        if j > 0 and mapping[j - 1] == i:  # a repeat: silent until trained
            grown.model.layers[j].self_attn.o_proj.weight.zero_()
            grown.model.layers[j].mlp.experts.down_proj.zero_()
    return grown


def format_eta(seconds: float) -> str:
    return f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m" if seconds >= 3600 else f"{seconds / 60:.1f}m"


def train_deep(args) -> None:
    """Train (or resume) the deep teacher on packed long-context sequences; see the module docstring."""
    from slimwise_train.data.synthetic.long_context import packed_batches
    from slimwise_train.data.synthetic.suite import long_suite

    out = Path(args.out)
    ckpt = out / "checkpoint"
    state = None
    if args.extend_schedule is not None and not args.resume:
        raise UsageError("--extend-schedule lengthens a resumed run's schedule; pass --resume too, or --max-steps "
                         "for a new run")
    if (args.warm_params is None) != (args.warm_chunks <= 0):
        raise UsageError("--warm-params and --warm-chunks go together: give both (--warm-chunks N > 0) or neither")
    if args.resume:
        state = load_checkpoint_state(ckpt)
        args = deep_args_for_resume(args, state)
    elif ckpt.exists() and not args.overwrite:
        raise UsageError(f"--out {out} already holds a checkpoint; pass --resume to continue it or --overwrite to "
                         "start over")
    end_at = args.max_steps if getattr(args, "end_at", None) is None else args.end_at
    if not 1 <= end_at <= args.max_steps:
        raise UsageError(f"--end-at {end_at} must be between 1 and --max-steps {args.max_steps}; pass a step "
                         "inside the schedule")
    if args.seq_len > args.max_positions:
        raise UsageError(f"--seq-len {args.seq_len} exceeds --max-positions {args.max_positions}; raise "
                         "--max-positions")
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    config = teacher_config(tokenizer, args) if state is None else None
    source = load_growth_source(args, config) if state is None else None
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    if state is None:
        config._attn_implementation = "sdpa"
        model = Qwen3MoeForCausalLM(config) if source is None else grow_depth(source, config)
        if source is not None:
            print(f"grown from {args.grow_from}: {source.config.num_hidden_layers} -> {args.layers} layers (layer "
                  f"map {depth_map(source.config.num_hidden_layers, args.layers)})", flush=True)
    else:  # from_pretrained: save_pretrained writes the experts per expert, the model holds them fused
        model = Qwen3MoeForCausalLM.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="sdpa")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    num_params = sum(p.numel() for p in model.parameters())
    step = tokens = answer_tokens = 0
    train_seconds = 0.0
    position = (0, 0)
    log = {"args": vars(args), "num_parameters": num_params, "curve": [], "evals": [], "runs": []}
    if state is not None:
        optimizer.load_state_dict(torch.load(ckpt / "optimizer.pt"))
        rng = torch.load(ckpt / "rng.pt", weights_only=False)
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        step, tokens, answer_tokens = state["step"], state["tokens"], state["answer_tokens"]
        train_seconds, position, log = state["train_seconds"], tuple(state["position"]), state["log"]
        print(f"resumed from {ckpt}: step {step}, {tokens:,} tokens, data chunk {position[0]} batch {position[1]}, "
              f"{train_seconds / 60:.1f} min trained", flush=True)
    planned = args.max_steps * args.batch * args.seq_len
    print(f"deep teacher: {num_params:,} parameters; {args.layers} layers, hidden {args.hidden}, {args.experts} "
          f"experts top-{args.top_k}, moe_intermediate {args.moe_intermediate}; {args.max_steps} steps x "
          f"{args.batch} x {args.seq_len} = {planned / 1e6:.1f}M token slots", flush=True)

    # Held-out problems (the "heldout" stream, first problems of each family) never enter training: the first
    # max(final_eval, heldout_exclude) per family are excluded; the default 400 covers the eval app's default sample
    # of math / code / tool (200) and leaves room to evaluate more.
    # seed 0: the eval app's held-out problems for these families, so what this run excludes is what it scores
    heldout = build_problems(tokenizer, DEEP_FAMILIES, max(args.final_eval, args.heldout_exclude), seed=0)
    exclude = frozenset(p.prompt for p in heldout)
    final_problems = [p for f in DEEP_FAMILIES for p in [q for q in heldout if q.family == f][: args.final_eval]]
    budgets = family_budgets(final_problems)
    probe = [p for f in DEEP_FAMILIES for p in [q for q in final_problems if q.family == f][: args.eval_n]]

    def current_state() -> dict:
        return {"format": "slimwise-teacher-checkpoint/1", "step": step, "tokens": tokens,
                "answer_tokens": answer_tokens, "train_seconds": round(train_seconds, 1), "position": list(position),
                "args": vars(args), "log": log}

    run_start = last_checkpoint = time.time()
    run_cpu = time.process_time()  # cores actually obtained = CPU seconds / wall seconds (the machine may be shared)
    next_eval = (math.floor(train_seconds / (args.eval_every * 60)) + 1) * args.eval_every * 60
    first_step, run_tokens = step, 0
    window = {"ce": 0.0, "aux": 0.0, "n": 0}
    # answer CE per family, token-weighted over the window: the mixture's average hides which skill is forming
    # (retrieval shows as a drop of lookup's alone; docs/teacher.md)
    family_ce, family_tokens = torch.zeros(len(DEEP_FAMILIES), dtype=torch.float64), torch.zeros(len(DEEP_FAMILIES))
    stop_reason = None
    # SIGTERM / Ctrl-C: finish the step, checkpoint, exit as a pause (`--resume` continues it)
    stop_signal: list[int] = []
    previous_handlers = {sig: signal.signal(sig, lambda number, frame: stop_signal.append(number))
                         for sig in (signal.SIGTERM, signal.SIGINT)}
    model.train()

    def chunk_examples(chunk: int):
        warm = args.warm_params is not None and 0 <= chunk - args.warm_from_chunk < args.warm_chunks
        return long_suite(args.examples_per_chunk, args.seed + 1000 * chunk, weights=args.mix, exclude=exclude,
                          params=args.warm_params if warm else None)

    batches = packed_batches(
        tokenizer, chunk_examples,
        seq_len=args.seq_len, batch_size=args.batch, seed=args.seed, start=position,
        supervise_shots=not args.no_shot_loss, token_families=DEEP_FAMILIES)
    for next_position, ids, labels, families in ([] if step >= end_at else batches):
        lr = cosine_lr(args, step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        step_start = time.time()
        out_ = model(input_ids=ids, labels=labels, output_router_logits=True)
        ce = out_.loss - args.aux * out_.aux_loss
        with torch.no_grad():  # the label at t+1 is predicted at t, as in the model's own loss
            target, owner = labels[:, 1:].reshape(-1), families[:, 1:].reshape(-1)
            supervised = target != -100
            token_ce = torch.nn.functional.cross_entropy(
                out_.logits[:, :-1].reshape(-1, out_.logits.shape[-1])[supervised].float(), target[supervised],
                reduction="none")
            family_ce += torch.bincount(owner[supervised], weights=token_ce.double(), minlength=len(DEEP_FAMILIES))
            family_tokens += torch.bincount(owner[supervised], minlength=len(DEEP_FAMILIES))
        optimizer.zero_grad(set_to_none=True)
        out_.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        train_seconds += time.time() - step_start
        step += 1
        position = next_position
        batch_tokens = int((ids != tokenizer.pad_token_id).sum())
        tokens += batch_tokens
        run_tokens += batch_tokens
        answer_tokens += int((labels != -100).sum())
        window["ce"] += float(ce.detach())
        window["aux"] += float(out_.aux_loss.detach())
        window["n"] += 1
        if step % args.log_every == 0 or step == end_at:
            run_elapsed = time.time() - run_start
            per_step = run_elapsed / max(step - first_step, 1)
            row = {"step": step, "tokens": tokens, "answer_ce": round(window["ce"] / window["n"], 4),
                   "aux": round(window["aux"] / window["n"], 3), "tok_per_s": round(run_tokens / run_elapsed),
                   "cores": round((time.process_time() - run_cpu) / run_elapsed, 2),
                   "lr": round(lr, 6), "train_min": round(train_seconds / 60, 2),
                   "eta": format_eta(per_step * (end_at - step)),
                   "family_ce": {f: round(float(family_ce[i] / family_tokens[i]), 4)
                                 for i, f in enumerate(DEEP_FAMILIES) if family_tokens[i] > 0},
                   "family_tokens": {f: int(family_tokens[i]) for i, f in enumerate(DEEP_FAMILIES)
                                     if family_tokens[i] > 0}}
            log["curve"].append(row)
            print(json.dumps(row), flush=True)
            window = {"ce": 0.0, "aux": 0.0, "n": 0}
            family_ce.zero_()
            family_tokens.zero_()
        if train_seconds >= next_eval and step < end_at:
            model.eval()
            result = greedy_accuracy(model, tokenizer, probe, budgets, batch_size=50)
            model.train()
            entry = {"step": step, "train_min": round(train_seconds / 60, 2),
                     **{f: r["accuracy"] for f, r in result.items()}}
            log["evals"].append(entry)
            print("eval", json.dumps(entry), flush=True)
            next_eval = train_seconds + args.eval_every * 60
        if time.time() - last_checkpoint >= args.checkpoint_every * 60:
            save_checkpoint(ckpt, model, optimizer, current_state())
            last_checkpoint = time.time()
            print(f"checkpoint at step {step} -> {ckpt}", flush=True)
        if step >= end_at:
            break
        out_of_time = time.time() - run_start >= args.minutes * 60
        if out_of_time or stop_signal or (args.steps_this_run and step - first_step >= args.steps_this_run):
            stop_reason = "paused"
            break
    for sig, handler in previous_handlers.items():
        signal.signal(sig, handler)
    stop_reason = stop_reason or "finished"
    log["runs"].append({"from_step": first_step, "to_step": step, "max_steps": args.max_steps, "mix": args.mix,
                        "warm_params": args.warm_params, "warm_chunks": [args.warm_from_chunk,
                                                                        args.warm_from_chunk + args.warm_chunks],
                        "seconds": round(time.time() - run_start),
                        "tokens": run_tokens, "stop": stop_reason})
    save_checkpoint(ckpt, model, optimizer, current_state())
    if stop_reason == "paused":
        print(f"paused at step {step} of {end_at}; checkpoint {ckpt}; continue with --preset deep --out "
              f"{out} --resume", flush=True)
        return
    model.eval()
    final = greedy_accuracy(model, tokenizer, final_problems, budgets, batch_size=50)
    log.update({"train_seconds": round(train_seconds), "steps": step, "tokens": tokens,
                "answer_tokens": answer_tokens, "final_eval": final, "final_eval_n": args.final_eval,
                "budgets": budgets, "families": list(DEEP_FAMILIES)})
    print("final", json.dumps(final), flush=True)
    with atomic_dir(out / "final", overwrite=True) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "training_log.json").write_text(json.dumps(log, indent=2) + "\n")
    print(f"saved to {out / 'final'}", flush=True)


if __name__ == "__main__":
    try:
        main()
    except UsageError as exc:
        print(f"train_teacher.py: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None

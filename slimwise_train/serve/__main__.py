"""Serve SlimWise decoders with llama.cpp.

    python -m slimwise_train.serve gguf <hf checkpoint folder> --outfile model.gguf [--outtype f32|f16|bf16|q8_0]
    python -m slimwise_train.serve generate --prefill full.gguf --decode pruned.gguf --prompts prompts.jsonl \\
        [--max-new-tokens 256] [--temperature 0] [--stop STR ...] [--output completions.jsonl]
    python -m slimwise_train.serve server --gguf full.gguf --port 8081 --slot-dir slots   # llama-server, our flags
    python -m slimwise_train.serve client --prefill-url http://127.0.0.1:8081 --decode-url http://127.0.0.1:8082 \\
        --slot-dir /srv/slots --prompts prompts.jsonl [same generation flags]

prompts.jsonl: one JSON object per line with "prompt" (text, tokenized by the GGUF's vocabulary, which the
conversion checked equal to transformers') or "prompt_ids" (token ids); optional per-line "max_new_tokens".
Output: one JSON line per prompt (completion text, tokens, length, end reason: eos | stop | budget) and a summary
on stderr (median / p90 length, end reasons, throughput).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


def _read_prompts(path: str) -> list[dict]:
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--prompts {path}: no such file")
    rows = []
    for number, line in enumerate(file.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"--prompts {path}:{number}: not JSON ({error.msg})") from None
        if not isinstance(row, dict) or not (isinstance(row.get("prompt"), str) or isinstance(row.get("prompt_ids"), list)):
            raise ValueError(f"--prompts {path}:{number}: needs a \"prompt\" string or a \"prompt_ids\" list")
        rows.append(row)
    if not rows:
        raise ValueError(f"--prompts {path}: no prompts")
    return rows


def _add_generation_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompts", required=True, help="JSONL with \"prompt\" or \"prompt_ids\" per line")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="token budget per request, first token included")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0, help="request i samples with seed + i")
    parser.add_argument("--stop", nargs="*", default=[], help="stop strings")
    parser.add_argument("--output", default=None, help="JSONL of completions (default: stdout)")


def _requests(args, rows: list[dict], tokenize):
    from slimwise_train.serve.handoff import Request

    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        raise ValueError("--temperature must be >= 0 and --top-p in (0, 1]")
    out = []
    for i, row in enumerate(rows):
        ids = row["prompt_ids"] if "prompt_ids" in row else tokenize(row["prompt"])
        out.append(Request(prompt_ids=[int(t) for t in ids], max_new_tokens=int(row.get("max_new_tokens", args.max_new_tokens)),
                           stop=tuple(args.stop), temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                           seed=args.seed + i))
    return out


def _write(args, rows, completions, seconds: float) -> None:
    lines = [json.dumps({"index": i, "prompt": row.get("prompt"), "completion": c.text, "tokens": c.tokens,
                         "length": c.length, "end": c.end}) for i, (row, c) in enumerate(zip(rows, completions))]
    text = "\n".join(lines) + "\n"
    if args.output:
        from slimwise_train.utils.atomic import write_text_atomic

        write_text_atomic(args.output, text)
    else:
        sys.stdout.write(text)
    lengths = sorted(c.length for c in completions)
    p90 = lengths[min(len(lengths) - 1, int(0.9 * len(lengths)))]
    ends = {e: sum(c.end == e for c in completions) for e in ("eos", "stop", "budget")}
    print(f"serve: {len(completions)} completions in {seconds:.1f} s; length median {statistics.median(lengths):g}, "
          f"p90 {p90}; end {ends}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m slimwise_train.serve", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("gguf", help="convert an HF checkpoint folder to GGUF with llama.cpp's own converter",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("folder", help="a teacher, prune's export/ or a distilled export/ (config.json + weights + tokenizer)")
    p.add_argument("--outfile", required=True)
    p.add_argument("--outtype", default="f32", choices=["f32", "f16", "bf16", "q8_0"])
    p.add_argument("--pre-tokenizer", default=None,
                   help="llama.cpp pre-tokenizer name for a tokenizer llama.cpp does not recognise (docs/serving.md)")
    p.add_argument("--check-texts", default=None, help="JSONL with \"text\" per line: tokenization must match on these")
    p.add_argument("--overwrite", action="store_true")

    p = sub.add_parser("generate", help="full prefill -> pruned decode in one process (two llama.cpp contexts)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--prefill", required=True, help="GGUF of the full model")
    p.add_argument("--decode", default=None, help="GGUF of the pruned / distilled decoder (default: --prefill)")
    p.add_argument("--n-seq", type=int, default=16, help="sequences decoded together")
    p.add_argument("--n-ctx", type=int, default=None, help="context per sequence (default: the model's, at most 4096)")
    p.add_argument("--kv-type", default="f16", choices=["f16", "f32"])
    p.add_argument("--threads", type=int, default=None, help="default: the CPUs this process may use")
    _add_generation_flags(p)

    p = sub.add_parser("server", help="start llama-server (the one make built) with the flags the handoff needs",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--gguf", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--slot-dir", required=True, help="--slot-save-path, shared by the prefill and decode servers")
    p.add_argument("--n-ctx", type=int, default=2048)
    p.add_argument("--threads", type=int, default=None, help="default: the CPUs this process may use")
    p.add_argument("--kv-type", default="f16", choices=["f16", "f32"], help="must be equal on both servers")

    p = sub.add_parser("client", help="full prefill on one llama-server, pruned decode on another",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--prefill-url", required=True)
    p.add_argument("--decode-url", required=True)
    p.add_argument("--slot-dir", required=True, help="the --slot-save-path both servers share")
    p.add_argument("--prefill-gguf", default=None, help="the prefill server's GGUF, if /props' model_path is not visible here")
    p.add_argument("--decode-gguf", default=None)
    p.add_argument("--tokenizer-gguf", default=None, help="GGUF whose vocabulary tokenizes text prompts (default: the prefill one)")
    p.add_argument("--wait", type=float, default=60.0, help="seconds to wait for both servers to be healthy")
    _add_generation_flags(p)

    args = parser.parse_args(argv)
    try:
        if args.command == "gguf":
            from slimwise_train.serve.gguf import convert

            texts = None
            if args.check_texts:
                texts = [json.loads(line)["text"] for line in Path(args.check_texts).read_text().splitlines() if line.strip()]
            convert(args.folder, args.outfile, args.outtype, args.pre_tokenizer, texts, args.overwrite,
                    log=lambda m: print(m, file=sys.stderr))
        elif args.command == "generate":
            from slimwise_train.serve.handoff import EngineHandoff

            rows = _read_prompts(args.prompts)
            with EngineHandoff(args.prefill, args.decode, n_seq=args.n_seq, n_ctx_per_seq=args.n_ctx,
                               kv_type=args.kv_type, threads=args.threads) as engine:
                requests = _requests(args, rows, engine.prefill_model.tokenize)
                start = time.perf_counter()
                completions = engine.generate(requests)
                _write(args, rows, completions, time.perf_counter() - start)
                s = engine.stats
                print(f"serve: prefill {s.prefill_tokens} tokens in {s.prefill_s:.2f} s, decode {s.decode_tokens} tokens "
                      f"in {s.decode_s:.2f} s ({s.decode_tokens / max(s.decode_s, 1e-9):.1f} tok/s), "
                      f"{s.state_bytes / 1e6:.2f} MB of state moved in {s.transfer_s:.3f} s", file=sys.stderr)
        elif args.command == "server":
            import os

            from slimwise_train.serve.server import ServerSpec

            if not Path(args.gguf).is_file():
                raise ValueError(f"--gguf {args.gguf}: no such file")
            slots = Path(args.slot_dir)
            slots.mkdir(parents=True, exist_ok=True)
            spec = ServerSpec(Path(args.gguf), args.port, slots.resolve(), args.n_ctx,
                              args.threads or len(os.sched_getaffinity(0)), args.kv_type)
            command = spec.command()
            print("serve: " + " ".join(command), file=sys.stderr, flush=True)
            os.execv(command[0], command)
        else:
            from slimwise_train.serve.llamacpp import GGUFModel
            from slimwise_train.serve.server import DisaggregatedClient

            rows = _read_prompts(args.prompts)
            client = DisaggregatedClient(args.prefill_url, args.decode_url, args.slot_dir, args.prefill_gguf,
                                         args.decode_gguf, wait_s=args.wait)
            vocab_file = args.tokenizer_gguf or client.prefill_gguf
            vocab = GGUFModel(vocab_file, vocab_only=True)
            requests = _requests(args, rows, vocab.tokenize)
            start = time.perf_counter()
            completions = client.generate(requests)
            _write(args, rows, completions, time.perf_counter() - start)
    except (ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except RuntimeError as error:  # EngineUnavailable, converter and server failures: named, without a traceback
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

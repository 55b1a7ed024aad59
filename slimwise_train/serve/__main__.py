"""Serve SlimWise decoders with llama.cpp.

    python -m slimwise_train.serve gguf <hf checkpoint folder> --outfile model.gguf [--outtype f32|f16|bf16|q8_0]
    python -m slimwise_train.serve generate --prefill full.gguf --decode pruned.gguf --prompts prompts.jsonl \\
        [--max-new-tokens 256] [--temperature 0] [--stop STR ...] [--output completions.jsonl]
    python -m slimwise_train.serve server --gguf full.gguf --port 8081 --slot-dir slots   # llama-server, our flags
    python -m slimwise_train.serve client --prefill-url http://127.0.0.1:8081 --decode-url http://127.0.0.1:8082 \\
        --slot-dir /srv/slots --prompts prompts.jsonl [same generation flags]
    python -m slimwise_train.serve up --prefill full.gguf --decode pruned.gguf --parallel 4 [--port 8080]
        # an OpenAI-compatible endpoint (/v1/completions, /v1/chat/completions) over two llama-servers

Every server needs an API key: `server` and `up` take --api-key, or read --api-key-file (written with a new key
when missing; default ~/.config/slimwise_train/api-key), and `client` reads the same file.

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
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0: greedy")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep the smallest set of tokens "
                        "whose probability reaches this (1: off)")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: off)")
    parser.add_argument("--seed", type=int, default=0, help="request i samples with seed + i")
    parser.add_argument("--stop", nargs="*", default=[], help="stop strings (none by default)")
    parser.add_argument("--output", default=None, help="JSONL of completions; default: stdout")


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


class _Help(argparse.HelpFormatter):
    """Every flag's help ends with its default, once, and only where there is one to show."""

    def _get_help_string(self, action):
        text = action.help or ""
        shown = action.default not in (None, False, argparse.SUPPRESS) and action.option_strings
        if shown and "default" not in text and "%(default)" not in text:
            text += " (default: %(default)s)"
        return text


def _sub(sub, name: str, help_text: str) -> argparse.ArgumentParser:
    return sub.add_parser(name, help=help_text, description=help_text, formatter_class=_Help)


def _add_key_flags(p: argparse.ArgumentParser, role: str, writes: bool = True) -> None:
    p.add_argument("--api-key", default=None,
                   help=f"the API key {role} (visible to `ps`: prefer --api-key-file)")
    made = ": read if it exists, else a new key is written there (mode 0600)" if writes else ""
    p.add_argument("--api-key-file", default=None,
                   help=f"file holding the API key{made}; default: $XDG_CONFIG_HOME/slimwise_train/api-key "
                        "(~/.config/...)")


def _server_key(args) -> tuple[str, str]:
    """(key, where it came from) for a server: --api-key, or the key file (made now when missing)."""
    from slimwise_train.serve.server import api_key_for_server, default_key_file, masked

    if args.api_key:
        return args.api_key, "--api-key"
    path = Path(args.api_key_file) if args.api_key_file else default_key_file()
    key, made = api_key_for_server(path)
    return key, f"{'new key written to' if made else 'key read from'} {path} ({masked(key)})"


def _client_key(args) -> str:
    """--api-key, or the key file; a client started beside its servers waits (--wait) for them to write it."""
    from slimwise_train.serve.server import default_key_file, read_api_key

    if args.api_key:
        return args.api_key
    path = Path(args.api_key_file) if args.api_key_file else default_key_file()
    deadline = time.monotonic() + args.wait
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.25)
    return read_api_key(path)


def _check_port(host: str, port: int) -> None:
    import socket

    if not 0 < port < 65536:
        raise ValueError(f"--port {port}: use 1-65535")
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError as error:
            raise ValueError(f"--port {port} on {host}: {error.strerror}; choose another port") from None


def _up(args) -> int:
    import asyncio
    import signal

    import uvicorn

    from slimwise_train.serve.disaggregated import LlamaCppEngine
    from slimwise_train.serve.endpoint import EndpointSettings, build_app

    def log(message):
        print(message, file=sys.stderr, flush=True)

    if args.parallel < 1 or args.queue < 0 or args.ctx < 16:
        raise ValueError("--parallel must be >= 1, --queue >= 0 and --ctx >= 16")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    if "*" in args.cors_origin:
        raise ValueError("--cors-origin '*' would let any web page call the endpoint: name the origins")
    _check_port(args.host, args.port)
    engine = LlamaCppEngine(args.prefill, args.decode, parallel=args.parallel, n_ctx=args.ctx, threads=args.threads,
                            kv_type=args.kv_type, chat_template_file=args.chat_template_file, log_dir=args.log_dir,
                            log=log)  # refuses a decoder whose cache does not match before anything starts
    key, where = _server_key(args)
    settings = EndpointSettings(api_key=key, queue=args.queue, cors_origins=tuple(args.cors_origin))
    app = build_app(engine, settings, log=log, manage_engine=False)

    async def serve() -> None:
        log(f"serve: starting llama-server for {engine.prefill_gguf.name}"
            + (f" (prefill) and {engine.decode_gguf.name} (decode)" if engine.decode_gguf else " (alone)")
            + f", {args.parallel} slots each")
        await engine.start()
        log(f"serve: http://{args.host}:{args.port}/v1 serves {engine.model_name!r}, {engine.slots} requests at once, "
            f"{engine.n_ctx} tokens each; API key: {where}")
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", access_log=False,
                                lifespan="off")
        await uvicorn.Server(config).serve()
        await engine.close()

    def interrupted(signum, frame):
        raise KeyboardInterrupt

    # uvicorn stops on SIGINT/SIGTERM and raises the signal again once it has: ours then ends the run in order
    signal.signal(signal.SIGTERM, interrupted)
    try:
        asyncio.run(serve())
    except KeyboardInterrupt:
        pass
    finally:
        engine.shutdown()  # the llama-servers stopped and the slot folder gone, however the loop ended
        log("serve: stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m slimwise_train.serve", description=__doc__.split("\n\n")[0],
                                     formatter_class=_Help)
    sub = parser.add_subparsers(dest="command", required=True)

    p = _sub(sub, "gguf", "convert an HF checkpoint folder to GGUF with llama.cpp's own converter")
    p.add_argument("folder", help="a teacher, prune's export/ or a distilled export/ (config.json + weights + tokenizer)")
    p.add_argument("--outfile", required=True, help="the GGUF file to write (written under a temporary name, renamed "
                   "when every check passed)")
    p.add_argument("--outtype", default="f32", choices=["f32", "f16", "bf16", "q8_0"],
                   help="weight type in the GGUF (the cache fingerprint does not depend on it)")
    p.add_argument("--pre-tokenizer", default=None,
                   help="llama.cpp pre-tokenizer name for a tokenizer llama.cpp does not recognise (docs/serving.md)")
    p.add_argument("--check-texts", default=None, help="JSONL with \"text\" per line: tokenization must match on these")
    p.add_argument("--overwrite", action="store_true", help="replace --outfile if it exists")

    p = _sub(sub, "generate", "full prefill -> pruned decode in one process (two llama.cpp contexts)")
    p.add_argument("--prefill", required=True, help="GGUF of the full model")
    p.add_argument("--decode", default=None, help="GGUF of the pruned / distilled decoder; left out: --prefill's "
                   "model decodes too (the full baseline, or conventional pruning with a pruned file)")
    p.add_argument("--n-seq", type=int, default=16, help="sequences decoded together")
    p.add_argument("--n-ctx", type=int, default=None, help="context per sequence in tokens; default: the model's, at "
                   "most 4096")
    p.add_argument("--kv-type", default="f16", choices=["f16", "f32"], help="KV cache element type of both contexts")
    p.add_argument("--threads", type=int, default=None, help="llama.cpp threads; default: the CPUs this process may use")
    _add_generation_flags(p)

    p = _sub(sub, "server", "start llama-server (the one make built) with the flags the handoff needs")
    p.add_argument("--gguf", required=True, help="the GGUF file this server serves")
    p.add_argument("--port", type=int, required=True, help="port on 127.0.0.1")
    p.add_argument("--slot-dir", required=True, help="--slot-save-path, shared by the prefill and decode servers")
    p.add_argument("--n-ctx", type=int, default=2048, help="context in tokens (one slot)")
    p.add_argument("--threads", type=int, default=None, help="llama.cpp threads; default: the CPUs this process may use")
    p.add_argument("--kv-type", default="f16", choices=["f16", "f32"], help="KV cache type: must be equal on both servers")
    _add_key_flags(p, "clients must send")

    p = _sub(sub, "client", "full prefill on one llama-server, pruned decode on another")
    p.add_argument("--prefill-url", required=True, help="base URL of the full model's llama-server")
    p.add_argument("--decode-url", required=True, help="base URL of the decoder's llama-server")
    p.add_argument("--slot-dir", required=True, help="the --slot-save-path both servers share")
    p.add_argument("--prefill-gguf", default=None, help="the prefill server's GGUF, if /props' model_path is not visible here")
    p.add_argument("--decode-gguf", default=None, help="the decode server's GGUF, if /props' model_path is not visible here")
    p.add_argument("--tokenizer-gguf", default=None, help="GGUF whose vocabulary tokenizes text prompts; default: the "
                   "prefill one")
    p.add_argument("--wait", type=float, default=60.0, help="seconds to wait for both servers to be healthy")
    _add_key_flags(p, "the servers were started with", writes=False)
    _add_generation_flags(p)

    p = _sub(sub, "up", "an OpenAI-compatible endpoint: full prefill on one llama-server, pruned decode on another")
    p.add_argument("--prefill", required=True, help="GGUF of the full model (prefills every prompt)")
    p.add_argument("--decode", default=None, help="GGUF of the pruned / distilled decoder; left out: --prefill's "
                   "model serves alone (the baseline, same endpoint)")
    p.add_argument("--parallel", type=int, default=4, help="requests decoded at once (slots of each llama-server)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (another than 127.0.0.1 exposes the "
                   "endpoint to the network: it still needs the key)")
    p.add_argument("--port", type=int, default=8080, help="port to listen on")
    _add_key_flags(p, "clients must send (Authorization: Bearer KEY)")
    p.add_argument("--ctx", type=int, default=2048, help="tokens per request, prompt and completion together (capped "
                   "at the model's training context)")
    p.add_argument("--queue", type=int, default=64, help="requests that may wait for a slot; more are answered 429 "
                   "with Retry-After")
    p.add_argument("--threads", type=int, default=None, help="llama.cpp threads of each llama-server; default: the "
                   "CPUs this process may use")
    p.add_argument("--kv-type", default="f16", choices=["f16", "f32"], help="KV cache element type of both servers")
    p.add_argument("--chat-template-file", default=None, help="Jinja chat template for /v1/chat/completions, instead "
                   "of the one in the decoder's GGUF (for a GGUF without one)")
    p.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                   help="a web origin allowed to call the endpoint from a browser (repeatable); none by default")
    p.add_argument("--log-dir", default=None, help="folder for the llama-servers' logs; default: a temporary folder, "
                   "removed at exit")

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
            _check_port("127.0.0.1", args.port)
            key, where = _server_key(args)
            slots = Path(args.slot_dir)
            slots.mkdir(parents=True, exist_ok=True)
            spec = ServerSpec(Path(args.gguf), args.port, slots.resolve(), args.n_ctx,
                              args.threads or len(os.sched_getaffinity(0)), args.kv_type, api_key=key)
            command = spec.command()
            print("serve: " + " ".join(command), file=sys.stderr)
            print(f"serve: API key: {where}", file=sys.stderr, flush=True)
            os.execve(command[0], command, spec.env())
        elif args.command == "up":
            return _up(args)
        else:
            from slimwise_train.serve.llamacpp import GGUFModel
            from slimwise_train.serve.server import DisaggregatedClient

            rows = _read_prompts(args.prompts)
            client = DisaggregatedClient(args.prefill_url, args.decode_url, args.slot_dir, args.prefill_gguf,
                                         args.decode_gguf, wait_s=args.wait, api_key=_client_key(args))
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

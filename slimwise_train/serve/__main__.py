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
conversion checked equal to transformers') or "prompt_ids" (token ids); optional per-line "max_new_tokens". A text
prompt is read as transformers' `tokenizer(text, add_special_tokens=False)` reads it: special-token text (a chat
template's `<|im_start|>`, the BOS it writes) is parsed as those tokens and nothing is added, so a prompt rendered by
`apply_chat_template(..., tokenize=False)` gives the template's own tokens.
Output: one JSON line per prompt (completion text, tokens, length, end reason: eos | stop | budget) and a summary
on stderr (median / p90 length, end reasons, throughput).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _read_prompts(path: str) -> list[tuple[int, dict]]:
    """(line number, row) per prompt of a prompts JSONL, each row checked: a "prompt" string or a non-empty
    "prompt_ids" list of integers, an optional integer "max_new_tokens" >= 1."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--prompts {path}: no such file")
    rows = []
    try:
        lines = file.read_text().splitlines()
    except UnicodeDecodeError:
        raise ValueError(f"--prompts {path} is not text (JSONL, one object per line)") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"--prompts {path}:{number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{where}: not JSON ({error.msg})") from None
        if not isinstance(row, dict) or not (isinstance(row.get("prompt"), str) or isinstance(row.get("prompt_ids"), list)):
            raise ValueError(f"{where}: needs a \"prompt\" string or a \"prompt_ids\" list")
        ids = row.get("prompt_ids")
        if ids is not None:
            bad = next((t for t in ids if not _is_int(t)), None) if isinstance(ids, list) else ids
            if not isinstance(ids, list) or not ids or bad is not None:
                raise ValueError(f"{where}: \"prompt_ids\" must be a non-empty list of integer token ids"
                                 + (f", not {bad!r}" if bad is not None else ""))
        budget = row.get("max_new_tokens")
        if budget is not None and (not _is_int(budget) or budget < 1):
            raise ValueError(f"{where}: \"max_new_tokens\" must be an integer >= 1, got {budget!r}")
        rows.append((number, row))
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
    parser.add_argument("--output", default=None, help="JSONL of completions; default: stdout. Never one of the run's "
                        "inputs; on a failure midway the completions finished so far are written")
    parser.add_argument("--allow-pruned-prefill", action="store_true",
                        help="let a pruned or distilled model prefill for another model (slimwise.role); by default "
                             "the full model prefills and such a pair is refused")


def _check_generation_flags(args) -> None:
    """Every generation flag in its range, before anything loads (one line naming the flag)."""
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise ValueError(f"--temperature must be a finite number >= 0 (0: greedy), got {args.temperature}")
    if not 0 < args.top_p <= 1:  # NaN fails this too
        raise ValueError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.top_k < 0:
        raise ValueError(f"--top-k must be >= 0 (0: off), got {args.top_k}")
    if args.seed < 0:
        raise ValueError(f"--seed must be >= 0, got {args.seed}")
    if any(stop == "" for stop in args.stop):
        raise ValueError("--stop '': an empty stop string would end every output at once; leave it out or name the "
                         "text to stop at")
    _check_threads(args)


def _check_threads(args) -> None:
    if getattr(args, "threads", None) is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads} (leave it out: the CPUs this process may use)")


def _check_output(args, inputs: dict[str, str | None]) -> None:
    """--output: a file in an existing, writable folder, and none of `inputs` ({flag: path}), before any work."""
    if not args.output:
        return
    from slimwise_train.utils.rundir import check_outputs_spare_inputs

    out = Path(args.output)
    if out.is_dir():
        raise ValueError(f"--output {out} is a folder: name the JSONL file to write")
    if not out.parent.is_dir():
        raise ValueError(f"the folder of --output does not exist: {out.parent}")
    try:
        with tempfile.TemporaryFile(dir=out.parent):
            pass
    except OSError as error:
        raise ValueError(f"the folder of --output {out.parent} is not writable ({error.strerror}): choose another "
                         "--output") from None
    check_outputs_spare_inputs({"--output": out}, inputs, fix="choose another --output")


def _requests(args, rows: list[tuple[int, dict]], vocab, n_vocab: int, n_ctx: int, fix: str):
    """The requests of the prompts' rows, each checked: token ids in the vocabulary, prompt + budget within the
    context (the one rule of every engine: `check_fits`), naming the prompts line. Text prompts are tokenized by
    `vocab` (a GGUFModel) with special-token text parsed and nothing added (the module docstring's rule)."""
    from slimwise_train.serve.engine import Request, check_fits

    out = []
    for i, (number, row) in enumerate(rows):
        where = f"--prompts {args.prompts}:{number}: "
        ids = row["prompt_ids"] if "prompt_ids" in row else vocab.tokenize(row["prompt"], parse_special=True)
        if not ids:
            raise ValueError(f"{where}the prompt is empty")
        bad = next((t for t in ids if not 0 <= t < n_vocab), None)
        if bad is not None:
            raise ValueError(f"{where}token id {bad} is not in the vocabulary (0..{n_vocab - 1})")
        budget = row.get("max_new_tokens", args.max_new_tokens)
        check_fits(len(ids), budget, n_ctx, fix, where=where)
        out.append(Request(prompt_ids=list(ids), max_new_tokens=budget, stop=tuple(args.stop),
                           temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed + i))
    return out


def _write(args, rows, completions, seconds: float) -> None:
    lines = [json.dumps({"index": i, "prompt": row.get("prompt"), "completion": c.text, "tokens": c.tokens,
                         "length": c.length, "end": c.end}) for i, ((_, row), c) in enumerate(zip(rows, completions))]
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


def _generate_and_write(args, rows, batches) -> int:
    """Run `batches` (an iterator of lists of completions, in request order) and write the completions; when it
    fails midway (a server killed, Ctrl-C) the completions finished so far are written and one line says how many."""
    done = []
    start = time.perf_counter()
    shown = start
    try:
        for batch in batches:
            done += batch
            if time.perf_counter() - shown > 10 and len(done) < len(rows):
                shown = time.perf_counter()
                print(f"serve: {len(done)}/{len(rows)} completions", file=sys.stderr, flush=True)
    except (KeyboardInterrupt, RuntimeError, OSError) as error:
        if done:
            _write(args, rows, done, time.perf_counter() - start)
        where = args.output or "stdout"
        kept = (f"the {len(done)} of {len(rows)} completions finished are written to {where}" if done else
                "no completion had finished; nothing written")
        if isinstance(error, KeyboardInterrupt):
            print(f"serve: interrupted (Ctrl-C): {kept}", file=sys.stderr)
            return 130
        print(f"error: {_one_line(error)}; {kept}", file=sys.stderr)
        return 1
    _write(args, rows, done, time.perf_counter() - start)
    return 0


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


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


def _check_key_file(args, inputs: dict[str, str | None]) -> None:
    """--api-key-file is never one of the run's inputs (a server would read a model as its key, or write over it)."""
    if args.api_key or not args.api_key_file:
        return
    from slimwise_train.utils.rundir import check_outputs_spare_inputs

    check_outputs_spare_inputs({"--api-key-file": Path(args.api_key_file)}, inputs,
                               fix="pass the key's own file as --api-key-file")


def _check_url(flag: str, url: str) -> None:
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"{flag} {url}: the port is not in 1-65535") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or port == 0:
        raise ValueError(f"{flag} {url}: pass a llama-server's base URL, e.g. http://127.0.0.1:8081")


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
    _check_threads(args)
    if "*" in args.cors_origin:
        raise ValueError("--cors-origin '*' would let any web page call the endpoint: name the origins")
    _check_port(args.host, args.port)
    _check_key_file(args, {"--prefill": args.prefill, "--decode": args.decode,
                           "--chat-template-file": args.chat_template_file})
    engine = LlamaCppEngine(args.prefill, args.decode, parallel=args.parallel, n_ctx=args.ctx, threads=args.threads,
                            kv_type=args.kv_type, chat_template_file=args.chat_template_file, log_dir=args.log_dir,
                            log=log, allow_pruned_prefill=args.allow_pruned_prefill)
    # ^ refuses a decoder whose cache does not match, or reversed roles, before anything starts
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
    from slimwise_train.utils.cli import OneLineParser

    parser = OneLineParser(prog="python -m slimwise_train.serve", description=__doc__.split("\n\n")[0],
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
    p.add_argument("--overwrite", action="store_true", help="replace --outfile if it exists (never an input of the "
                   "conversion); without it an --outfile that exists, or that another run writes meanwhile, is kept")

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
    p.add_argument("--port", type=int, required=True, help="port on 127.0.0.1 (1-65535, free)")
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
    p.add_argument("--allow-pruned-prefill", action="store_true",
                   help="let a pruned or distilled --prefill model prefill for another --decode model (slimwise.role); "
                        "by default the full model prefills and such a pair is refused")

    args = parser.parse_args(argv)
    try:
        if args.command == "gguf":
            return _gguf(args)
        if args.command == "generate":
            return _generate(args)
        if args.command == "server":
            return _server(args)
        if args.command == "up":
            return _up(args)
        return _client(args)
    except (ValueError, FileNotFoundError, FileExistsError) as error:
        print(f"error: {_one_line(error)}", file=sys.stderr)
        return 2
    except RuntimeError as error:  # EngineUnavailable, converter and server failures: named, without a traceback
        print(f"error: {_one_line(error)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"serve: interrupted (Ctrl-C): {INTERRUPTED.get(args.command, 'nothing was written')}", file=sys.stderr)
        return 130


INTERRUPTED = {"gguf": "nothing was written (the converter stopped, its temporaries removed)"}


def _check_texts(path: str) -> list[str]:
    """--check-texts: JSONL with a "text" string per line."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--check-texts {path}: no such file")
    texts = []
    try:
        lines = file.read_text().splitlines()
    except UnicodeDecodeError:
        raise ValueError(f"--check-texts {path} is not text (JSONL with a \"text\" string per line)") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"--check-texts {path}:{number}: not JSON ({error.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("text"), str):
            raise ValueError(f"--check-texts {path}:{number}: needs a \"text\" string, e.g. {{\"text\": \"2+2=4\"}}")
        texts.append(row["text"])
    if not texts:
        raise ValueError(f"--check-texts {path}: no texts")
    return texts


def _gguf(args) -> int:
    from slimwise_train.serve.gguf import convert
    from slimwise_train.utils.rundir import check_outputs_spare_inputs

    texts = None
    if args.check_texts:
        check_outputs_spare_inputs({"--outfile": Path(args.outfile)}, {"--check-texts": args.check_texts},
                                   fix="choose another --outfile")
        texts = _check_texts(args.check_texts)
    convert(args.folder, args.outfile, args.outtype, args.pre_tokenizer, texts, args.overwrite,
            log=lambda m: print(m, file=sys.stderr))
    return 0


def _generate(args) -> int:
    from slimwise_train.serve.handoff import EngineHandoff
    from slimwise_train.serve.llamacpp import check_gguf_file

    _check_generation_flags(args)
    if args.n_seq < 1 or (args.n_ctx is not None and args.n_ctx < 8):
        raise ValueError(f"--n-seq must be >= 1 and --n-ctx >= 8, got {args.n_seq} and {args.n_ctx}")
    rows = _read_prompts(args.prompts)
    check_gguf_file(args.prefill, "--prefill")
    if args.decode is not None:
        check_gguf_file(args.decode, "--decode")
    _check_output(args, {"--prefill": args.prefill, "--decode": args.decode, "--prompts": args.prompts})
    with EngineHandoff(args.prefill, args.decode, n_seq=args.n_seq, n_ctx_per_seq=args.n_ctx, kv_type=args.kv_type,
                       threads=args.threads, allow_pruned_prefill=args.allow_pruned_prefill) as engine:
        model = engine.prefill_model
        requests = _requests(args, rows, model, model.n_vocab, engine.settings.n_ctx_per_seq,
                             "raise --n-ctx or lower the budget")
        code = _generate_and_write(args, rows, engine.waves(requests))
        s = engine.stats
        if code == 0:
            print(f"serve: prefill {s.prefill_tokens} tokens in {s.prefill_s:.2f} s, decode {s.decode_tokens} tokens "
                  f"in {s.decode_s:.2f} s ({s.decode_tokens / max(s.decode_s, 1e-9):.1f} tok/s), "
                  f"{s.state_bytes / 1e6:.2f} MB of state moved in {s.transfer_s:.3f} s", file=sys.stderr)
    return code


def _server(args) -> int:
    import os

    from slimwise_train.serve.llamacpp import GGUFModel, check_gguf_file
    from slimwise_train.serve.server import ServerSpec

    if args.n_ctx < 16:
        raise ValueError(f"--n-ctx must be >= 16, got {args.n_ctx}")
    _check_threads(args)
    check_gguf_file(args.gguf, "--gguf")
    with GGUFModel(args.gguf, vocab_only=True):  # a file llama.cpp cannot load fails here, in one line
        pass
    slots = Path(args.slot_dir)
    if slots.exists() and not slots.is_dir():
        raise ValueError(f"--slot-dir {slots} is a file: pass a folder (made when missing)")
    _check_port("127.0.0.1", args.port)
    _check_key_file(args, {"--gguf": args.gguf})
    key, where = _server_key(args)
    slots.mkdir(parents=True, exist_ok=True)
    spec = ServerSpec(Path(args.gguf), args.port, slots.resolve(), args.n_ctx,
                      args.threads or len(os.sched_getaffinity(0)), args.kv_type, api_key=key)
    command = spec.command()
    print("serve: " + " ".join(command), file=sys.stderr)
    print(f"serve: API key: {where}", file=sys.stderr, flush=True)
    os.execve(command[0], command, spec.env())


def _client(args) -> int:
    from slimwise_train.serve.llamacpp import GGUFModel, check_gguf_file
    from slimwise_train.serve.server import DisaggregatedClient, default_key_file

    _check_generation_flags(args)
    if not math.isfinite(args.wait) or args.wait < 0:
        raise ValueError(f"--wait must be a number of seconds >= 0, got {args.wait}")
    _check_url("--prefill-url", args.prefill_url)
    _check_url("--decode-url", args.decode_url)
    rows = _read_prompts(args.prompts)
    given = {"--prefill-gguf": args.prefill_gguf, "--decode-gguf": args.decode_gguf,
             "--tokenizer-gguf": args.tokenizer_gguf}
    for flag, path in given.items():
        if path is not None:
            check_gguf_file(path, flag)
    key_file = None if args.api_key else (args.api_key_file or str(default_key_file()))
    _check_output(args, {"--prompts": args.prompts, "--api-key-file": key_file, **given})
    client = DisaggregatedClient(args.prefill_url, args.decode_url, args.slot_dir, args.prefill_gguf,
                                 args.decode_gguf, wait_s=args.wait, api_key=_client_key(args),
                                 allow_pruned_prefill=args.allow_pruned_prefill)
    _check_output(args, {"the prefill server's model": client.prefill_gguf,
                         "the decode server's model": client.decode_gguf})
    with GGUFModel(args.tokenizer_gguf or client.prefill_gguf, vocab_only=True) as vocab:
        if vocab.n_vocab != client.n_vocab:
            raise ValueError(f"--tokenizer-gguf {args.tokenizer_gguf} has {vocab.n_vocab} tokens, the served models "
                             f"{client.n_vocab}: pass the GGUF of the served models' vocabulary")
        requests = _requests(args, rows, vocab, client.n_vocab, client.n_ctx,
                             "start the servers with a larger --n-ctx or lower the budget")
    return _generate_and_write(args, rows, ([c] for c in client.completions(requests)))


if __name__ == "__main__":
    sys.exit(main())

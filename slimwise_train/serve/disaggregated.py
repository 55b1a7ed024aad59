"""llama.cpp as a `ServingEngine` (serve/engine.py): two llama-servers with N slots each, the full model's prefill
handed to the pruned decoder per request through llama-server's slot files.

Per request: a free slot of the decode server is taken first (it is held for the whole generation, so it bounds
how many requests run), then a free slot of the prefill server; the prefill server evaluates the prompt and picks
the first token (`/completion`, n_predict 1); that slot is saved to a file (`/slots/{id}?action=save`: its tokens
and KV cells) and freed; the file is restored into the decode slot (`action=restore`) and deleted; the decode
server continues from prompt + first token on the restored cache, so it evaluates exactly one prompt token (checked
from its timings) and streams the rest. Which slots are free is tracked here; llama-server itself queues a task
for a busy slot, so a slot handed back while llama-server still winds down a cancelled request is safe to reuse.

The slot folder is on tmpfs (/dev/shm) where there is one: a state file is written and read once, in memory.
Chat requests are rendered with the decode server's own chat template (`/apply-template`, `--jinja`); the decode
server then answers `/v1/chat/completions` with the first token as a continued assistant message, so its own
parser (tool calls) reads the whole answer, first token included.

A llama-server that dies (kill -9) fails its in-flight requests with `BackendFailed` (one line: which server, its
exit status) and is restarted; requests that come meanwhile wait for it. `decode_gguf=None` serves the full model
alone: one llama-server, no handoff; the same file as both is two servers of one model with the handoff between
them (the disaggregated baseline `bench serve` compares against).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import AsyncIterator

import httpx

from slimwise_train.serve.engine import (BackendFailed, Delta, Request, RequestTiming, check_cache_compatible,
                                         check_fits, check_roles, same_file_content)
from slimwise_train.serve.server import LlamaServer, ServerError, ServerSpec, free_port, new_api_key, sampling_params

END_OF = {"eos": "eos", "word": "stop", "limit": "budget"}  # llama-server's stop_type -> ours
FINISH_TO_END = {"stop": "eos", "length": "budget", "tool_calls": "tool_calls"}


def slot_folder_root() -> Path | None:
    """tmpfs where the machine has one (a slot file lives for one handoff), else the temp folder."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else None


def _wait_exit(server: LlamaServer | None, timeout: float = 1.0) -> None:
    """Give a process whose connection just broke a moment to be reaped, so its exit status can be named."""
    if server is not None:
        try:
            server.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:  # still running: the connection broke for another reason
            pass


class _Backend:
    """One supervised llama-server and the slots of it that are free."""

    def __init__(self, role: str, spec: ServerSpec, log_file: Path, startup_timeout: float, log):
        self.role, self.spec, self.log_file, self.startup_timeout, self._log = role, spec, log_file, startup_timeout, log
        self.server: LlamaServer | None = None
        self.client: httpx.AsyncClient | None = None
        self.ready = asyncio.Event()
        self.generation = 0
        self.restarts = 0
        self.state = "starting"
        self.free: asyncio.Queue[int] = asyncio.Queue()

    @property
    def url(self) -> str:
        return f"http://{self.spec.host}:{self.spec.port}"

    async def start(self) -> None:
        self.ready.clear()
        self.state = "starting" if self.generation == 0 else "restarting"
        self.server = await asyncio.to_thread(LlamaServer, self.spec, self.log_file, self.startup_timeout)
        # a client per process: no pooled connection of a dead server is ever reused
        n = self.spec.parallel
        self.client = httpx.AsyncClient(headers={"Authorization": f"Bearer {self.spec.api_key}"},
                                        limits=httpx.Limits(max_connections=2 * n + 4, max_keepalive_connections=n + 2),
                                        timeout=httpx.Timeout(600.0, connect=10.0))
        self.generation += 1
        self.free = asyncio.Queue()
        for slot in range(self.spec.parallel):
            self.free.put_nowait(slot)
        self.state = "ok"
        self.ready.set()

    def exit_status(self) -> int | None:
        return None if self.server is None else self.server.proc.poll()

    def describe_exit(self, server: LlamaServer | None = None) -> str:
        server = server or self.server
        code = server.proc.poll()
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exited with status {code}"
        return f"the {self.role} llama-server (pid {server.proc.pid}, {self.spec.gguf.name}) {how}"

    async def acquire(self) -> tuple[int, int]:
        """(slot, generation): a free slot of the running server, waiting for a restart to finish if one is going on."""
        while True:
            await asyncio.wait_for(self.ready.wait(), timeout=self.startup_timeout)
            queue, generation = self.free, self.generation
            slot = await queue.get()
            if generation == self.generation:
                return slot, generation
            # the server restarted while this request waited: the slot belongs to the old process

    def release(self, slot: int, generation: int) -> None:
        if generation == self.generation:
            self.free.put_nowait(slot)

    async def stop(self) -> None:
        if self.client is not None:
            await self.client.aclose()
            self.client = None
        if self.server is not None:
            await asyncio.to_thread(self.server.stop)


class LlamaCppEngine:
    """`ServingEngine` over llama-server processes (module docstring)."""

    def __init__(self, prefill_gguf: str | os.PathLike, decode_gguf: str | os.PathLike | None = None, *,
                 parallel: int = 4, n_ctx: int = 2048, threads: int | None = None, kv_type: str = "f16",
                 chat_template_file: str | os.PathLike | None = None, log_dir: str | os.PathLike | None = None,
                 startup_timeout: float = 120.0, log=None, allow_pruned_prefill: bool = False):
        from slimwise_train.serve.llamacpp import GGUFModel, check_gguf_file
        from slimwise_train.utils.rundir import check_outputs_spare_inputs

        self._log = log or (lambda message: print(message, file=sys.stderr, flush=True))
        self.prefill_gguf = check_gguf_file(prefill_gguf, "--prefill")
        self.decode_gguf = check_gguf_file(decode_gguf, "--decode") if decode_gguf is not None else None
        if parallel < 1 or n_ctx < 16:
            raise ValueError(f"--parallel must be >= 1 and --ctx >= 16, got {parallel} and {n_ctx}")
        if chat_template_file is not None and not Path(chat_template_file).is_file():
            raise FileNotFoundError(f"--chat-template-file {chat_template_file}: no such file")
        if log_dir is not None:
            if Path(log_dir).exists() and not Path(log_dir).is_dir():
                raise ValueError(f"--log-dir {log_dir} is a file: pass a folder (made when missing)")
            check_outputs_spare_inputs({f"--log-dir ({role} log)": Path(log_dir) / f"{role}-llama-server.log"
                                        for role in ("prefill", "decode")},
                                       {"--prefill": prefill_gguf, "--decode": decode_gguf,
                                        "--chat-template-file": chat_template_file}, fix="choose another --log-dir")
        metas = {}
        for role, path in (("prefill", self.prefill_gguf), ("decode", self.decode_gguf)):
            if path is not None:
                with GGUFModel(path, vocab_only=True) as model:
                    metas[role] = model.metadata()
                    n_ctx_train = model.n_ctx_train
                    self.n_vocab = model.n_vocab
        if self.decode_gguf is not None:  # refused before anything starts
            check_cache_compatible(metas["prefill"], metas["decode"], self.prefill_gguf.name, self.decode_gguf.name)
            if metas["prefill"].get("slimwise.role", "full") != "full":
                check_roles(metas["prefill"], metas["decode"], f"--prefill {self.prefill_gguf.name}",
                            f"--decode {self.decode_gguf.name}",
                            same_file_content(self.prefill_gguf, self.decode_gguf), allow_pruned_prefill)
        self.model_name = (self.decode_gguf or self.prefill_gguf).stem
        self.n_ctx = n_ctx
        self.n_ctx_train = n_ctx_train
        self.slots = parallel
        self.kv_type = kv_type
        self.threads = threads or len(os.sched_getaffinity(0))
        self.chat_template_file = Path(chat_template_file).resolve() if chat_template_file else None
        self.startup_timeout = startup_timeout
        self._log_dir = Path(log_dir) if log_dir else None
        self._own_log_dir = False
        self.slot_dir: Path | None = None
        self.backends: dict[str, _Backend] = {}
        self._supervisor: asyncio.Task | None = None
        self._key = new_api_key()  # between this process and its llama-servers only; never written anywhere
        self.prompt_mismatches = 0  # decode evaluations of more than the one handed-over token (chat re-tokenization)

    # ------------------------------------------------------------------------------------------ life cycle
    async def start(self) -> None:
        self.slot_dir = Path(tempfile.mkdtemp(prefix="slimwise-slots-", dir=slot_folder_root()))
        if self._log_dir is None:
            self._log_dir = Path(tempfile.mkdtemp(prefix="slimwise-serve-logs-"))
            self._own_log_dir = True
        self._log_dir.mkdir(parents=True, exist_ok=True)
        roles = {"prefill": self.prefill_gguf} if self.decode_gguf is None else {"prefill": self.prefill_gguf,
                                                                                 "decode": self.decode_gguf}
        for role, gguf in roles.items():
            spec = ServerSpec(gguf.resolve(), free_port(), self.slot_dir, self.n_ctx, self.threads, self.kv_type,
                              parallel=self.slots, api_key=self._key, chat_template_file=self.chat_template_file)
            self.backends[role] = _Backend(role, spec, self._log_dir / f"{role}-llama-server.log",
                                           self.startup_timeout, self._log)
        try:
            await asyncio.gather(*(b.start() for b in self.backends.values()))
            # llama-server caps a slot's context at the model's training context: the limit is what it reports
            for backend in self.backends.values():
                props = await self._json(backend, "GET", "/props")
                self.n_ctx = min(self.n_ctx, int(props["default_generation_settings"]["n_ctx"]))
        except BaseException:
            await self.close()
            raise
        self._supervisor = asyncio.create_task(self._supervise())

    async def close(self) -> None:
        if self._supervisor is not None:
            self._supervisor.cancel()
            self._supervisor = None
        for backend in self.backends.values():
            if backend.client is not None:
                await backend.client.aclose()
                backend.client = None
        await asyncio.to_thread(self.shutdown)

    def shutdown(self) -> None:
        """Stop the llama-servers and remove the slot folder; synchronous, so it also runs after the event loop was
        torn down by a signal. Idempotent."""
        for backend in self.backends.values():
            if backend.server is not None:
                backend.server.stop()
        if self.slot_dir is not None:
            shutil.rmtree(self.slot_dir, ignore_errors=True)
        if self._own_log_dir and self._log_dir is not None:
            shutil.rmtree(self._log_dir, ignore_errors=True)

    async def _supervise(self) -> None:
        while True:
            await asyncio.sleep(0.2)
            for backend in self.backends.values():
                if backend.ready.is_set() and backend.exit_status() is not None:
                    self._log(f"serve: {backend.describe_exit()}; restarting it")
                    backend.restarts += 1
                    await backend.stop()
                    try:
                        await backend.start()
                        self._log(f"serve: the {backend.role} llama-server is back (pid {backend.server.proc.pid})")
                    except (ServerError, OSError) as error:
                        backend.state = f"failed to restart: {error}"
                        self._log(f"serve: the {backend.role} llama-server did not restart: {error}")
                        await asyncio.sleep(2.0)

    def health(self) -> dict[str, str]:
        return {role: backend.state for role, backend in self.backends.items()}

    def restarts(self) -> dict[str, int]:
        return {role: backend.restarts for role, backend in self.backends.items()}

    # ------------------------------------------------------------------------------------------ HTTP to llama-server
    @staticmethod
    def _failed(backend: _Backend, server: LlamaServer, what: str, error: Exception | str) -> BackendFailed:
        """One line for a failed call to `server` (the process the call went to, even if a restart replaced it)."""
        if server is not None and server.proc.poll() is not None:
            return BackendFailed(f"{backend.describe_exit(server)} during {what}; it is being restarted, retry the "
                                 "request")
        return BackendFailed(f"the {backend.role} llama-server failed during {what}: {str(error)[:200]}")

    async def _json(self, backend: _Backend, method: str, path: str, body: dict | None = None) -> dict:
        server, client = backend.server, backend.client
        try:
            response = await client.request(method, backend.url + path, json=body)
        except httpx.HTTPError as error:
            await asyncio.to_thread(_wait_exit, server)  # a dying process: name how it ended
            raise self._failed(backend, server, path.split("?")[0], f"{type(error).__name__} {error}") from None
        if response.status_code != 200:
            raise self._failed(backend, server, path.split("?")[0],
                               f"HTTP {response.status_code}: {response.text[:200]}")
        return response.json()

    async def _events(self, backend: _Backend, path: str, body: dict) -> AsyncIterator[dict]:
        """The server-sent events of a streamed llama-server request, as JSON objects."""
        server, client = backend.server, backend.client
        try:
            async with client.stream("POST", backend.url + path, json=body) as response:
                if response.status_code != 200:
                    text = (await response.aread()).decode(errors="replace")
                    raise self._failed(backend, server, path, f"HTTP {response.status_code}: {text[:200]}")
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: "):]
                    if data.strip() == "[DONE]":
                        return
                    event = json.loads(data)
                    if "error" in event:
                        raise self._failed(backend, server, path, event["error"])
                    yield event
        except httpx.HTTPError as error:
            await asyncio.to_thread(_wait_exit, server)
            raise self._failed(backend, server, path, f"{type(error).__name__} {error}") from None

    async def tokenize(self, text: str) -> list[int]:
        backend = self.backends["prefill"]
        await backend.ready.wait()
        # as llama-server tokenizes a text prompt itself: with the model's own BOS convention
        return (await self._json(backend, "POST", "/tokenize", {"content": text, "add_special": True}))["tokens"]

    async def chat_prompt(self, chat: dict) -> str:
        """The decode model's chat template applied to an OpenAI chat body (messages, tools, ...)."""
        backend = self.backends.get("decode", self.backends["prefill"])
        await backend.ready.wait()
        return (await self._json(backend, "POST", "/apply-template", chat))["prompt"]

    # ------------------------------------------------------------------------------------------ generation
    def _check_fits(self, prompt_len: int, budget: int) -> None:
        check_fits(prompt_len, budget, self.n_ctx, f"lower max_tokens, or start `serve up` with a larger --ctx (the "
                   f"model was trained on {self.n_ctx_train})")

    async def prompt_length(self, request: Request) -> int:
        return (await self._prompt(request))[1]

    async def _prompt(self, request: Request) -> tuple[list[int] | str, int]:
        """What the engine sends as the prompt (token ids, or the rendered chat text) and its length in tokens."""
        if request.chat is None:
            bad = next((t for t in request.prompt_ids if not 0 <= t < self.n_vocab), None)
            if bad is not None:
                raise ValueError(f"prompt token id {bad} is not in the vocabulary (0..{self.n_vocab - 1})")
            return list(request.prompt_ids), len(request.prompt_ids)
        text = await self.chat_prompt(request.chat)
        backend = self.backends["prefill"]
        tokens = (await self._json(backend, "POST", "/tokenize", {"content": text, "add_special": True,
                                                                   "parse_special": True}))["tokens"]
        return text, len(tokens)

    async def generate(self, request: Request, timing: RequestTiming) -> AsyncIterator[Delta]:
        prompt, prompt_len = await self._prompt(request)
        if prompt_len == 0:
            raise ValueError("the prompt is empty")
        self._check_fits(prompt_len, request.max_new_tokens)
        if "decode" not in self.backends:
            async for delta in self._alone(request, prompt, prompt_len, timing):
                yield delta
            return
        async for delta in self._handoff(request, prompt, prompt_len, timing):
            yield delta

    def _body(self, request: Request, prompt, n_predict: int, slot: int, stream: bool) -> dict:
        return {"prompt": prompt, "n_predict": n_predict, "id_slot": slot, "cache_prompt": True,
                "return_tokens": True, "stream": stream, "stop": list(request.stop), **sampling_params(request)}

    def _chat_body(self, request: Request, max_tokens: int, slot: int, continued: str | None) -> dict:
        body = dict(request.chat)
        if continued is not None:  # the first token, continued as the assistant's message so far
            body["messages"] = list(body["messages"]) + [{"role": "assistant", "content": continued}]
        body.update({"max_tokens": max_tokens, "id_slot": slot, "cache_prompt": True, "stream": True,
                     "stop": list(request.stop), **sampling_params(request)})
        return body

    async def _alone(self, request: Request, prompt, prompt_len: int, timing: RequestTiming) -> AsyncIterator[Delta]:
        """One model in both phases (the full baseline, or a pruned model alone): one llama-server, no handoff."""
        backend = self.backends["prefill"]
        slot, generation = await backend.acquire()
        start = time.perf_counter()
        first_at = None
        produced = 0
        try:
            if request.chat is None:
                events = self._events(backend, "/completion",
                                      self._body(request, prompt, request.max_new_tokens, slot, True))
            else:
                events = self._events(backend, "/v1/chat/completions",
                                      self._chat_body(request, request.max_new_tokens, slot, None))
            async for event in events:
                delta = self._delta(event, request.chat is not None)
                if delta.text or delta.tool_calls:
                    if first_at is None:
                        first_at = time.perf_counter()
                        timing.ttft_s = first_at - start
                produced = self._produced(event, produced)
                if delta.end is not None:
                    timing.decode_tokens = max(produced - 1, 0)
                    timing.decode_s = time.perf_counter() - (first_at or start)
                    delta.usage = {"prompt_tokens": prompt_len, "completion_tokens": produced}
                yield delta
        finally:
            backend.release(slot, generation)

    @staticmethod
    def _produced(event: dict, so_far: int) -> int:
        if "tokens_predicted" in event:
            return int(event["tokens_predicted"])
        if "usage" in event and event["usage"]:
            return int(event["usage"].get("completion_tokens", so_far))
        if "timings" in event:
            return int(event["timings"].get("predicted_n", so_far))
        return so_far + (1 if event.get("choices") and event["choices"][0].get("delta", {}).get("content") else 0)

    @staticmethod
    def _delta(event: dict, chat: bool) -> Delta:
        if not chat:
            end = END_OF.get(event.get("stop_type"), "budget") if event.get("stop") else None
            return Delta(text=event.get("content", ""), end=end)
        choice = (event.get("choices") or [{}])[0]
        delta = choice.get("delta") or {}
        finish = choice.get("finish_reason")
        return Delta(text=delta.get("content") or "", tool_calls=delta.get("tool_calls"),
                     end=None if finish is None else FINISH_TO_END.get(finish, "eos"))

    async def _handoff(self, request: Request, prompt, prompt_len: int, timing: RequestTiming) -> AsyncIterator[Delta]:
        prefill, decode = self.backends["prefill"], self.backends["decode"]
        d_slot, d_generation = await decode.acquire()
        try:
            start = time.perf_counter()
            p_slot, p_generation = await prefill.acquire()
            name = f"slimwise-{uuid.uuid4().hex}.bin"
            try:
                first = await self._json(prefill, "POST", "/completion", self._body(request, prompt, 1, p_slot, False))
                if not first.get("tokens"):
                    raise self._failed(prefill, prefill.server, "the prefill", f"no token returned: {str(first)[:200]}")
                timing.ttft_s = time.perf_counter() - start
                moved = time.perf_counter()
                saved = await self._json(prefill, "POST", f"/slots/{p_slot}?action=save", {"filename": name})
            finally:
                prefill.release(p_slot, p_generation)
            try:
                await self._json(decode, "POST", f"/slots/{d_slot}?action=restore", {"filename": name})
            finally:
                (self.slot_dir / name).unlink(missing_ok=True)
            timing.handoff_bytes = int(saved.get("n_written", 0))
            timing.handoff_s = time.perf_counter() - moved
            token = int(first["tokens"][0])
            text = first.get("content", "")
            stopped = any(s and s in text for s in request.stop)
            if first.get("stop_type") == "eos" or stopped or request.max_new_tokens == 1:
                end = "eos" if first.get("stop_type") == "eos" else "stop" if stopped else "budget"
                if stopped:
                    text = text[:min(text.index(s) for s in request.stop if s and s in text)]
                yield Delta(text=text, end=end, usage={"prompt_tokens": prompt_len, "completion_tokens": 1})
                return
            chat = request.chat is not None
            if not chat:  # the first token is the full model's: sent now; chat sends it within the parsed message
                yield Delta(text=text)
            decode_start = time.perf_counter()
            if chat:
                events = self._events(decode, "/v1/chat/completions",
                                      self._chat_body(request, request.max_new_tokens - 1, d_slot, text))
            else:
                events = self._events(decode, "/completion",
                                      self._body(request, list(prompt) + [token], request.max_new_tokens - 1,
                                                 d_slot, True))
            produced = 0
            async for event in events:
                delta = self._delta(event, chat)
                produced = self._produced(event, produced)
                if delta.end is not None:
                    evaluated = int(event.get("timings", {}).get("prompt_n", -1))
                    if evaluated != 1:
                        self.prompt_mismatches += 1
                        self._log(f"serve: the decode server evaluated {evaluated} prompt tokens instead of the one "
                                  "handed over (the chat text of the first token re-tokenized differently)")
                    timing.decode_tokens = produced
                    timing.decode_s = time.perf_counter() - decode_start
                    delta.usage = {"prompt_tokens": prompt_len, "completion_tokens": produced + 1}
                yield delta
        finally:
            decode.release(d_slot, d_generation)

"""The disaggregated handoff over two llama-server processes: the full model prefills on one, the pruned model
decodes on the other, the sequence state moving between them through llama-server's slot files.

    llama-server -m teacher.gguf --port 8081 --slot-save-path /srv/slots/ -np 1 -c 2048
    llama-server -m pruned.gguf  --port 8082 --slot-save-path /srv/slots/ -np 1 -c 2048

`DisaggregatedClient.generate` then, per request: (1) asks the prefill server for one token on the prompt
(`/completion`, n_predict 1): the full model's prefill and its first token; (2) saves that slot
(`POST /slots/0?action=save`: KV cells + token list, llama_state_seq_save_file); (3) restores the file into the
decode server's slot (`action=restore`; both servers read one slot folder, a shared volume across hosts); (4) asks
the decode server to continue from prompt + first token with `cache_prompt`, so it evaluates only the first token
on the restored cache (checked: the response's `timings.prompt_n` must be 1) and decodes the rest.

llama-server compares nothing but shapes on restore, so the client first compares the two GGUF headers it finds at
each server's `model_path` (`/props`), as the in-process handoff does (`check_cache_compatible`).
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from slimwise_train.serve.engine import CacheMismatch, Completion, Request, check_cache_compatible


class ServerError(RuntimeError):
    pass


def _call(url: str, body: dict | None = None, timeout: float = 600.0, api_key: str | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(url, data=data, headers=headers, method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read().decode() or "{}")
    except urllib.error.HTTPError as error:
        detail = error.read().decode(errors="replace")[:300]
        hint = " (pass the servers' key: --api-key-file)" if error.code == 401 else ""
        raise ServerError(f"{url}: HTTP {error.code}: {detail}{hint}") from None
    except urllib.error.URLError as error:
        raise ServerError(f"{url}: {error.reason}") from None


# ------------------------------------------------------------------------------------------------ API keys
def default_key_file() -> Path:
    """Where `serve server`, `serve client` and `serve up` keep the API key they share unless told otherwise."""
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "slimwise_train" / "api-key"


def new_api_key() -> str:
    return "sk-slimwise-" + secrets.token_urlsafe(24)


def masked(key: str) -> str:
    """The key as logs show it: never whole."""
    return f"{key[:12]}...{key[-4:]}" if len(key) > 20 else "****"


def read_api_key(path: str | os.PathLike) -> str:
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"--api-key-file {file}: no such file (a `serve server` or `serve up` writes it when it "
                                "starts without --api-key)")
    key = next((line.strip() for line in file.read_text().splitlines() if line.strip() and not line.startswith("#")), "")
    if not key:
        raise ValueError(f"--api-key-file {file}: holds no key")
    return key


def api_key_for_server(path: str | os.PathLike) -> tuple[str, bool]:
    """The key in `path`, or a new one written there (mode 0600: it is a secret, whatever the umask) when the file
    does not exist yet; (key, whether it was made now). Two servers started at once agree on one key: the file is
    published with a hard link, which fails when the other was first."""
    file = Path(path)
    if file.exists():
        return read_api_key(file), False
    file.parent.mkdir(parents=True, exist_ok=True)
    key = new_api_key()
    fd, tmp = tempfile.mkstemp(prefix=f".{file.name}.", dir=file.parent)  # 0600
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(key + "\n")
        try:
            os.link(tmp, file)
        except FileExistsError:
            return read_api_key(file), False
    finally:
        os.unlink(tmp)
    return key, True


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the thread that started it ends (Linux PR_SET_PDEATHSIG)."""
    import ctypes
    import signal

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    except OSError:  # not Linux: the parent's own shutdown still stops it
        pass


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class ServerSpec:
    """One llama-server: `parallel` slots of `n_ctx` tokens each, KV in `kv_type`, slot files in `slot_dir`, the API
    key `api_key` (handed over in its environment, not on the command line that `ps` shows), CORS for localhost
    origins only and never with credentials. `chat_template_file` overrides the GGUF's chat template (`--jinja`)."""

    gguf: Path
    port: int
    slot_dir: Path
    n_ctx: int = 2048
    threads: int = 1
    kv_type: str = "f16"
    parallel: int = 1
    api_key: str | None = None
    chat_template_file: Path | None = None
    host: str = "127.0.0.1"

    def command(self) -> list[str]:
        from slimwise_train.serve.llamacpp import server_binary

        # --slot-save-path is joined to the file name as a string: it needs its trailing slash. -c is the context
        # of all slots together: without a unified KV buffer each slot gets n_ctx of its own.
        command = [str(server_binary()), "-m", str(self.gguf), "--host", self.host, "--port", str(self.port),
                   "--slot-save-path", str(self.slot_dir) + os.sep, "-np", str(self.parallel),
                   "-c", str(self.n_ctx * self.parallel), "--no-kv-unified", "-t", str(self.threads),
                   "-tb", str(self.threads), "--cache-type-k", self.kv_type, "--cache-type-v", self.kv_type,
                   "--no-warmup", "--cache-ram", "0", "--jinja", "--no-webui", "--cors-origins", "localhost",
                   "--no-cors-credentials"]
        if self.chat_template_file is not None:
            command += ["--chat-template-file", str(self.chat_template_file)]
        return command

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != "LLAMA_API_KEY"}
        if self.api_key:
            env["LLAMA_API_KEY"] = self.api_key
        return env


class LlamaServer:
    """One llama-server process (started here, for tests, the demo and the bench); `url` once healthy."""

    def __init__(self, spec: ServerSpec, log_file: Path, startup_timeout: float = 120.0):
        self.spec = spec
        self.url = f"http://127.0.0.1:{spec.port}"
        self._log = open(log_file, "w")
        # its own session: a Ctrl-C in the terminal reaches only the process that started it, which stops it in
        # order; and it dies with that process if that one is killed outright (no orphaned server holding a port)
        self.proc = subprocess.Popen(spec.command(), stdout=self._log, stderr=subprocess.STDOUT, env=spec.env(),
                                     start_new_session=True, preexec_fn=_die_with_parent)
        try:
            wait_healthy(self.url, startup_timeout, process=self.proc)
        except ServerError:
            exited = self.proc.poll() is not None  # on its own, before the stop below
            self.stop()
            if exited:
                tail = Path(log_file).read_text(errors="replace").strip().splitlines()[-5:]
                raise ServerError(f"llama-server for {spec.gguf} exited ({self.proc.returncode}): "
                                  + " | ".join(tail)) from None
            raise ServerError(f"llama-server for {spec.gguf} not healthy after {startup_timeout:.0f} s "
                              f"(log: {log_file})") from None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not self._log.closed:
            self._log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def served_gguf(url: str, api_key: str | None = None) -> str:
    """The GGUF file a llama-server serves (`/props` model_path), if this process can read it."""
    path = _call(url + "/props", api_key=api_key).get("model_path")
    if not path or not Path(path).is_file():
        raise CacheMismatch(f"{url}/props names model_path {path!r}, which this client cannot read: run the client "
                            "where both GGUF files are visible (or pass the files with --prefill-gguf/--decode-gguf)")
    return path


def sampling_params(req: Request) -> dict:
    """llama-server's sampling fields for `req`: greedy as top-k 1, else the in-process sampler chain's steps
    (top-k, top-p, temperature, a seeded draw) with llama-server's other default samplers (min-p 0.05) off."""
    extra = {"ignore_eos": True} if req.ignore_eos else {}
    if req.temperature <= 0:
        return {"temperature": 0.0, "top_k": 1, **extra}
    return {"temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k, "seed": req.seed, "min_p": 0.0,
            **extra}


def wait_healthy(url: str, timeout: float, process: subprocess.Popen | None = None) -> None:
    """Wait until a llama-server answers /health with ok (it loads its model first), at most `timeout` seconds;
    with `process`, stop waiting as soon as it has exited."""
    deadline = time.monotonic() + timeout
    while True:
        if process is not None and process.poll() is not None:
            raise ServerError(f"the llama-server behind {url} exited ({process.returncode})")
        try:
            if _call(url + "/health", timeout=2).get("status") == "ok":
                return
        except ServerError:
            pass
        if time.monotonic() > deadline:
            raise ServerError(f"{url} is not a healthy llama-server after {timeout:.0f} s")
        time.sleep(0.25)


class DisaggregatedClient:
    """Prefill on one llama-server, decode on another (module docstring); greedy or sampled, one request at a
    time per slot."""

    def __init__(self, prefill_url: str, decode_url: str, slot_dir: str | os.PathLike,
                 prefill_gguf: str | None = None, decode_gguf: str | None = None, wait_s: float = 0.0,
                 api_key: str | None = None):
        self.prefill_url, self.decode_url = prefill_url.rstrip("/"), decode_url.rstrip("/")
        self.api_key = api_key
        for url in (self.prefill_url, self.decode_url):
            wait_healthy(url, wait_s)
        self.slot_dir = Path(slot_dir)
        from slimwise_train.serve.llamacpp import GGUFModel

        self.prefill_gguf = prefill_gguf or served_gguf(self.prefill_url, api_key)
        self.decode_gguf = decode_gguf or served_gguf(self.decode_url, api_key)
        metas = []
        for path in (self.prefill_gguf, self.decode_gguf):
            with GGUFModel(path, vocab_only=True) as model:
                metas.append(model.metadata())
        check_cache_compatible(metas[0], metas[1], self.prefill_url, self.decode_url)
        self.prompt_tokens_evaluated_on_decode: list[int] = []

    def generate_one(self, req: Request) -> Completion:
        prompt = [int(t) for t in req.prompt_ids]
        first = _call(self.prefill_url + "/completion", {
            "prompt": prompt, "n_predict": 1, "id_slot": 0, "cache_prompt": True, "return_tokens": True,
            **sampling_params(req)}, api_key=self.api_key)
        if not first.get("tokens"):
            raise ServerError(f"{self.prefill_url}/completion returned no token: {str(first)[:200]}")
        token = int(first["tokens"][0])
        name = f"slimwise-{uuid.uuid4().hex}.bin"
        try:
            _call(self.prefill_url + "/slots/0?action=save", {"filename": name}, api_key=self.api_key)
            _call(self.decode_url + "/slots/0?action=restore", {"filename": name}, api_key=self.api_key)
        finally:
            (self.slot_dir / name).unlink(missing_ok=True)
        tokens = [token]
        if first.get("stop_type") == "eos" or first.get("stopping_word") or req.max_new_tokens == 1:
            end = "eos" if first.get("stop_type") == "eos" else "budget"
            return Completion(tokens=tokens, text=first.get("content", ""), end=end, first_token=token)
        rest = _call(self.decode_url + "/completion", {
            "prompt": prompt + [token], "n_predict": req.max_new_tokens - 1, "id_slot": 0, "cache_prompt": True,
            "return_tokens": True, "stop": list(req.stop), **sampling_params(req)}, api_key=self.api_key)
        evaluated = int(rest.get("timings", {}).get("prompt_n", -1))
        self.prompt_tokens_evaluated_on_decode.append(evaluated)
        if evaluated != 1:
            raise ServerError(f"the decode server evaluated {evaluated} prompt tokens instead of 1: the restored "
                              "slot was not reused (check that both servers share --slot-save-path)")
        tokens += [int(t) for t in rest.get("tokens", [])]
        stop_type = rest.get("stop_type")
        end = {"eos": "eos", "word": "stop", "limit": "budget"}.get(stop_type, "budget")
        return Completion(tokens=tokens, text=first.get("content", "") + rest.get("content", ""), end=end,
                          first_token=token)

    def generate(self, requests: Sequence[Request]) -> list[Completion]:
        return [self.generate_one(r) for r in requests]

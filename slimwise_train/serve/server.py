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

import http.client
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
from typing import Iterator, Sequence

from slimwise_train.serve.engine import (CacheMismatch, Completion, Request, check_cache_compatible, check_fits,
                                         check_roles, same_file_content)


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
        detail = " ".join(error.read().decode(errors="replace").split())[:300]
        hint = " (pass the servers' key: --api-key-file)" if error.code == 401 else ""
        raise ServerError(f"{url}: HTTP {error.code}: {detail}{hint}") from None
    except urllib.error.URLError as error:
        raise ServerError(f"{url}: {error.reason}") from None
    except (OSError, http.client.HTTPException) as error:  # the server went away mid-answer (killed, restarted)
        raise ServerError(f"{url}: the connection broke ({type(error).__name__}: {error})") from None


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
    try:
        with open(file, "rb") as handle:
            text = handle.read(4096).decode("ascii")
    except UnicodeDecodeError:
        raise ValueError(f"--api-key-file {file} is not a key file (not text): pass the file `serve server` or "
                         "`serve up` wrote, not a model or another input") from None
    key = next((line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")), "")
    if not key or not key.isprintable() or " " in key:
        raise ValueError(f"--api-key-file {file}: holds no key (one line of printable characters)")
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


def die_with_parent() -> None:
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
                                     start_new_session=True, preexec_fn=die_with_parent)
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


def served_gguf(url: str, props: dict, given: str | None = None, meta: dict | None = None,
                flag: str = "--decode-gguf") -> str:
    """The GGUF file the llama-server at `url` serves, as a file this process can read: `props`' model_path (its
    /props), or `given` (the --prefill-gguf / --decode-gguf flag), which must then be that model: the same bytes when
    model_path is readable here, else the same parameter count and size as the server reports (`meta`, its
    /v1/models entry's `meta`). ValueError (one line) otherwise."""
    from slimwise_train.serve.llamacpp import GGUFModel, check_gguf_file

    path = props.get("model_path")
    visible = bool(path) and Path(path).is_file()
    if given is None:
        if not visible:
            raise CacheMismatch(f"{url}/props names model_path {path!r}, which this client cannot read: run the "
                                "client where both GGUF files are visible (or pass the files with "
                                "--prefill-gguf/--decode-gguf)")
        return path
    check_gguf_file(given, flag)
    if visible:
        if not same_file_content(given, path):
            raise ValueError(f"{flag} {given} is not the model {url} serves ({path}): leave {flag} out (the file is "
                             "readable here) or pass that file")
        return given
    with GGUFModel(given, vocab_only=True) as model:
        mine = {"n_params": model.n_params, "size": model.size, "n_vocab": model.n_vocab}
    theirs = {key: (meta or {}).get(key) for key in mine}
    if mine != theirs:
        raise ValueError(f"{flag} {given} is not the model {url} serves ({path}): {mine} here, {theirs} there; pass "
                         "a copy of the file that server loaded")
    return given


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
    time per slot.

    Checked before any request (each a one-line ValueError): the GGUF each server serves (given files must be those
    models), that the decoder can read the prefill model's cache and that the roles are not reversed
    (`allow_pruned_prefill` allows a pruned prefill), and one probe handoff: the prefill server's slot file must
    appear in `slot_dir` (the client deletes each file after use: a folder that is not the servers' would leak one
    per request) and restore on the decode server (which fails when the servers' --kv-type or slot folders differ).
    `n_ctx`: the smaller server's context per slot; `n_vocab`: the vocabulary's size."""

    def __init__(self, prefill_url: str, decode_url: str, slot_dir: str | os.PathLike,
                 prefill_gguf: str | None = None, decode_gguf: str | None = None, wait_s: float = 0.0,
                 api_key: str | None = None, allow_pruned_prefill: bool = False):
        from slimwise_train.serve.llamacpp import GGUFModel

        self.prefill_url, self.decode_url = prefill_url.rstrip("/"), decode_url.rstrip("/")
        self.api_key = api_key
        self.slot_dir = Path(slot_dir)
        if not self.slot_dir.is_dir():
            raise ValueError(f"--slot-dir {slot_dir}: no such folder (pass the --slot-dir both servers were started "
                             "with)")
        for url in (self.prefill_url, self.decode_url):
            wait_healthy(url, wait_s)
        props = {url: _call(url + "/props", api_key=api_key) for url in (self.prefill_url, self.decode_url)}
        models = {url: ((_call(url + "/v1/models", api_key=api_key).get("data") or [{}])[0].get("meta") or {})
                  for url in (self.prefill_url, self.decode_url)}
        self.prefill_gguf = served_gguf(self.prefill_url, props[self.prefill_url], prefill_gguf,
                                        models[self.prefill_url], "--prefill-gguf")
        self.decode_gguf = served_gguf(self.decode_url, props[self.decode_url], decode_gguf,
                                       models[self.decode_url], "--decode-gguf")
        metas = []
        for path in (self.prefill_gguf, self.decode_gguf):
            with GGUFModel(path, vocab_only=True) as model:
                metas.append(model.metadata())
                self.n_vocab = model.n_vocab
        check_cache_compatible(metas[0], metas[1], self.prefill_url, self.decode_url)
        if metas[0].get("slimwise.role", "full") != "full":
            check_roles(metas[0], metas[1], f"the prefill server's model ({Path(self.prefill_gguf).name})",
                        f"the decode server's ({Path(self.decode_gguf).name})",
                        same_file_content(self.prefill_gguf, self.decode_gguf), allow_pruned_prefill)
        self.n_ctx = min(int(props[url]["default_generation_settings"]["n_ctx"]) for url in props)
        self.prompt_tokens_evaluated_on_decode: list[int] = []
        self._check_handoff()

    def _check_handoff(self) -> None:
        """One handoff of a one-token prompt: the slot file must appear in `slot_dir` and restore on the decode
        server."""
        name = f"slimwise-probe-{uuid.uuid4().hex}.bin"
        _call(self.prefill_url + "/completion", {"prompt": [0], "n_predict": 1, "id_slot": 0, "cache_prompt": True,
                                                 "temperature": 0.0, "top_k": 1}, api_key=self.api_key)
        _call(self.prefill_url + "/slots/0?action=save", {"filename": name}, api_key=self.api_key)
        file = self.slot_dir / name
        if not file.is_file():
            raise ValueError(f"--slot-dir {self.slot_dir} is not the servers' slot folder: the slot file the prefill "
                             f"server just saved ({name}) is not in it; pass the --slot-dir both servers were started "
                             f"with (and delete {name} from that folder)")
        try:
            _call(self.decode_url + "/slots/0?action=restore", {"filename": name}, api_key=self.api_key)
        except ServerError as error:
            raise ValueError(f"the decode server cannot restore a slot the prefill server saved ({error}): start both "
                             "servers with the same --kv-type and --slot-dir") from None
        finally:
            file.unlink(missing_ok=True)

    def check(self, requests: Sequence[Request]) -> None:
        for i, req in enumerate(requests):
            check_fits(len(req.prompt_ids), req.max_new_tokens, self.n_ctx,
                       "start the servers with a larger --n-ctx or lower the budget", where=f"request {i}: ")

    def _on(self, role: str, path: str, body: dict) -> dict:
        """A call to the prefill or decode server; its failure names the server (one line)."""
        base = self.prefill_url if role == "prefill" else self.decode_url
        try:
            return _call(base + path, body, api_key=self.api_key)
        except ServerError as error:
            raise ServerError(f"the {role} server failed ({error})") from None

    def generate_one(self, req: Request) -> Completion:
        prompt = [int(t) for t in req.prompt_ids]
        first = self._on("prefill", "/completion", {
            "prompt": prompt, "n_predict": 1, "id_slot": 0, "cache_prompt": True, "return_tokens": True,
            **sampling_params(req)})
        if not first.get("tokens"):
            raise ServerError(f"{self.prefill_url}/completion returned no token: {str(first)[:200]}")
        token = int(first["tokens"][0])
        name = f"slimwise-{uuid.uuid4().hex}.bin"
        try:
            self._on("prefill", "/slots/0?action=save", {"filename": name})
            self._on("decode", "/slots/0?action=restore", {"filename": name})
        finally:
            (self.slot_dir / name).unlink(missing_ok=True)
        tokens = [token]
        if first.get("stop_type") == "eos" or first.get("stopping_word") or req.max_new_tokens == 1:
            end = "eos" if first.get("stop_type") == "eos" else "budget"
            return Completion(tokens=tokens, text=first.get("content", ""), end=end, first_token=token)
        rest = self._on("decode", "/completion", {
            "prompt": prompt + [token], "n_predict": req.max_new_tokens - 1, "id_slot": 0, "cache_prompt": True,
            "return_tokens": True, "stop": list(req.stop), **sampling_params(req)})
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

    def completions(self, requests: Sequence[Request]) -> Iterator[Completion]:
        """Each request's completion in turn, as it finishes (after `check`)."""
        self.check(requests)
        for req in requests:
            yield self.generate_one(req)

    def generate(self, requests: Sequence[Request]) -> list[Completion]:
        return list(self.completions(requests))

"""`python -m slimwise_train.serve up`: the OpenAI-compatible endpoint over two llama-servers, tested as a user calls
it, with the official `openai` client, lm-eval's `local-completions` model, curl-like raw requests and signals.

One endpoint is started per module (the shipped teacher prefills, its 50% REAP pruned checkpoint decodes, 4 slots
each, a queue of 16); tests that kill or refuse start their own. Greedy answers are compared with the in-process
handoff (`serve generate`'s EngineHandoff) under the near-tie rule of tests/test_serve_llamacpp.py: a text may
differ only where transformers' top-2 logits are within TIE_GAP at the first differing token, and at least
MIN_EXACT of the answers must be equal throughout.
"""

from __future__ import annotations

import concurrent.futures as futures
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from slimwise_train.serve.handoff import EngineHandoff, Request
from slimwise_train.serve.server import free_port

from helpers import CHILD_ENV, REPO
from test_serve_llamacpp import MIN_EXACT, TEACHER, TIE_GAP, _gap_at

pytestmark = [pytest.mark.engine, pytest.mark.subprocess]

PARALLEL = 4
QUEUE = 16
BUDGET = 32
# the teacher has no chat template: a plain one renders each message's text on its own line, the teacher's format
PLAIN_TEMPLATE = "{%- for message in messages -%}{{ message['content'] }}{{ '\\n' if message['role'] != 'assistant' " \
                 "else '' }}{%- endfor -%}"


def _env(config_home: Path) -> dict:
    return {**CHILD_ENV, "XDG_CONFIG_HOME": str(config_home), "PYTHONPATH": str(REPO)}


class Endpoint:
    """A `serve up` child process: its URL, API key, and the pids of its llama-servers."""

    def __init__(self, root: Path, *args: str, name: str = "up", wait: float = 180.0):
        self.root = root
        self.port = free_port()
        self.key_file = root / f"{name}.key"
        self.log = root / f"{name}.log"
        self.command = [sys.executable, "-m", "slimwise_train.serve", "up", *args, "--port", str(self.port),
                        "--api-key-file", str(self.key_file), "--threads", "1", "--log-dir", str(root / f"{name}-logs")]
        self.proc = subprocess.Popen(self.command, stdout=subprocess.DEVNULL, stderr=open(self.log, "w"),
                                     env=_env(root / "config"), cwd=root)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + wait
        while True:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, self.log.read_text()[-3000:]
            time.sleep(0.3)
        self.key = self.key_file.read_text().strip()

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.key}"}

    def llama_servers(self) -> dict[str, int]:
        """{"prefill": pid, "decode": pid} of the running llama-servers."""
        out = {}
        for pid in subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout.split():
            command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if command and command[0].endswith(b"llama-server"):
                gguf = command[command.index(b"-m") + 1].decode()
                out["decode" if gguf.endswith("pruned.gguf") else "prefill"] = int(pid)
        return out

    def slot_dir(self) -> Path:
        pid = next(iter(self.llama_servers().values()))
        command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        return Path(command[command.index(b"--slot-save-path") + 1].decode())

    def metric(self, name: str, labels: str = "") -> float:
        text = httpx.get(self.url + "/metrics", headers=self.headers()).text
        match = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M)
        return float(match.group(1)) if match else 0.0

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=60)
        return self.proc.returncode


@pytest.fixture(scope="module")
def endpoint(served):
    root = served["root"] / "endpoint"
    root.mkdir(exist_ok=True)
    (root / "plain.jinja").write_text(PLAIN_TEMPLATE)
    up = Endpoint(root, "--prefill", str(served["root"] / "teacher.gguf"), "--decode",
                  str(served["root"] / "pruned.gguf"), "--parallel", str(PARALLEL), "--queue", str(QUEUE),
                  "--chat-template-file", str(root / "plain.jinja"))
    slot_dir = up.slot_dir()
    yield up
    assert up.stop() == 0, up.log.read_text()[-2000:]
    assert not slot_dir.exists(), "the slot folder outlived the endpoint"
    assert "Traceback" not in up.log.read_text()


@pytest.fixture(scope="module")
def reference(served):
    """The in-process handoff's greedy answers (`serve generate`'s engine) for 16 suite prompts: token ids and text,
    and the chat prompt text (the plain template's rendering) of each."""
    problems = served["problems"][::2] + served["problems"][1:2]  # 16 of the 30, every family
    prompts = [list(p.prompt_ids) for p in problems]
    with EngineHandoff(served["root"] / "teacher.gguf", served["root"] / "pruned.gguf", n_seq=16, threads=1) as engine:
        completions = engine.generate([Request(p, BUDGET) for p in prompts])
        pieces = [[engine.decode_model.piece(t).decode("utf-8", "replace") for t in c.tokens] for c in completions]
        texts = [p.prompt + "\n" for p in problems]  # the suite's prompt format: question, newline
        assert [engine.prefill_model.tokenize(t) for t in texts] == prompts
    return dict(prompts=prompts, texts=texts, completions=completions, pieces=pieces)


def assert_same_answers(got: list[str], reference, served, label: str) -> int:
    """Near-tie rule on text: where an answer differs, the first reference token it does not contain must sit at a
    transformers top-2 gap below TIE_GAP."""
    exact = 0
    for text, completion, pieces, prompt in zip(got, reference["completions"], reference["pieces"],
                                                  reference["prompts"]):
        if text == completion.text:
            exact += 1
            continue
        step, prefix = 0, ""
        while step < len(pieces) and text.startswith(prefix + pieces[step]):
            prefix += pieces[step]
            step += 1
        gap = _gap_at(served["teacher"], served["pruned"], prompt, completion.tokens[:step])
        assert gap < TIE_GAP["f16"], f"{label}: {text!r} != {completion.text!r} from token {step}, top-2 gap {gap:.4f}"
    assert exact >= MIN_EXACT * len(got), f"{label}: {exact}/{len(got)} equal to the in-process handoff"
    print(f"{label}: {exact}/{len(got)} equal to the in-process handoff")
    return exact


def _client(endpoint, **kwargs):
    import openai

    return openai.OpenAI(base_url=endpoint.url + "/v1", api_key=endpoint.key, max_retries=0, **kwargs)


# ------------------------------------------------------------------------------------------------ correctness
def test_openai_client_answers_equal_the_in_process_handoff_at_1_and_16_at_once(endpoint, reference, served):
    client = _client(endpoint)
    (model,) = [m.id for m in client.models.list().data]
    n = len(reference["prompts"])

    def completion(i, stream):
        kwargs = dict(model=model, prompt=reference["prompts"][i], max_tokens=BUDGET, temperature=0)
        if not stream:
            return client.completions.create(**kwargs).choices[0].text
        return "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices)

    def chat(i, stream):
        # the plain template renders the message and the newline
        kwargs = dict(model=model, messages=[{"role": "user", "content": reference["texts"][i][:-1]}],
                      max_tokens=BUDGET, temperature=0)
        if not stream:
            return client.chat.completions.create(**kwargs).choices[0].message.content or ""
        return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kwargs)
                       if c.choices)

    handoffs = endpoint.metric("slimwise_handoff_seconds_count")
    for label, call, stream, at_once in (("completions, 1 at a time", completion, False, 1),
                                         ("completions streamed, 16 at once", completion, True, 16),
                                         ("chat streamed, 1 at a time", chat, True, 1),
                                         ("chat, 16 at once", chat, False, 16)):
        with futures.ThreadPoolExecutor(at_once) as pool:
            got = list(pool.map(lambda i: call(i, stream), range(n)))
        assert_same_answers(got, reference, served, label)
    # every request went through the handoff (none ended at its first token here), each state file removed after
    assert endpoint.metric("slimwise_handoff_seconds_count") - handoffs == 4 * n
    assert endpoint.metric("slimwise_handoff_bytes_total") > 0
    assert list(endpoint.slot_dir().iterdir()) == []


def test_curl_like_requests_usage_stop_and_metrics(endpoint, reference):
    headers = endpoint.headers()
    body = {"prompt": reference["texts"][0], "max_tokens": 8, "temperature": 0}
    answer = httpx.post(endpoint.url + "/v1/completions", json=body, headers=headers, timeout=60).json()
    (choice,) = answer["choices"]
    assert choice["finish_reason"] == "length" and answer["usage"]["completion_tokens"] == 8
    assert answer["usage"]["prompt_tokens"] == len(reference["prompts"][0])
    # a stop string taken from the greedy answer ends it there (the stop string itself not included)
    stop = reference["completions"][0].text[3:5]
    stopped = httpx.post(endpoint.url + "/v1/completions", json={**body, "max_tokens": BUDGET, "stop": [stop]},
                         headers=headers, timeout=60).json()["choices"][0]
    assert stopped["finish_reason"] == "stop" and stop not in stopped["text"]
    assert reference["completions"][0].text.startswith(stopped["text"])
    text = httpx.get(endpoint.url + "/metrics", headers=headers).text
    for name in ("slimwise_requests_total", "slimwise_queue_depth", "slimwise_time_to_first_token_seconds_bucket",
                 "slimwise_decode_tokens_per_second_bucket", "slimwise_handoff_bytes_total",
                 "slimwise_handoff_seconds_bucket"):
        assert name in text, name


@pytest.mark.slow
def test_lm_eval_local_completions_against_the_endpoint_equals_the_slimwise_model(endpoint, served, tmp_path):
    """lm-eval's stock `local-completions` model against the endpoint and lm-eval's `slimwise` model in
    mode=slimwise (transformers, the same keep set) give the same answer per sample on the shipped tasks."""
    from test_serve_llamacpp import _reference

    tasks = "slimwise_math,slimwise_code,slimwise_tool"
    common = ["--tasks", tasks, "--limit", "6", "--log_samples", "--gen_kwargs", "max_gen_toks=48"]
    env = {**_env(tmp_path), "OPENAI_API_KEY": endpoint.key}
    runs = {"endpoint": ["--model", "local-completions", "--model_args",
                         f"base_url={endpoint.url}/v1/completions,model=pruned,tokenizer_backend=huggingface,"
                         f"tokenizer={TEACHER},num_concurrent=4,max_retries=1,tokenized_requests=True"],
            "slimwise": ["--model", "slimwise", "--model_args",
                         f"pretrained={TEACHER},keep_set={served['root'] / 'keep_set.json'},mode=slimwise,progress=false"]}
    answers = {}
    for name, args in runs.items():
        out = tmp_path / name
        proc = subprocess.run([sys.executable, "-m", "slimwise_train.lm_eval", *args, *common, "--output_path", str(out)],
                              env=env, cwd=tmp_path, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        answers[name] = {}
        for file in out.rglob("samples_*.jsonl"):
            task = re.match(r"samples_(.+?)_\d{4}-", file.name).group(1)
            for line in file.read_text().splitlines():
                sample = json.loads(line)
                answers[name][(task, sample["doc_id"])] = (sample["arguments"], sample["resps"][0][0])
    assert answers["endpoint"].keys() == answers["slimwise"].keys() and len(answers["endpoint"]) == 18
    tokenizer = served["tokenizer"]
    exact = 0
    for key, (arguments, got) in answers["endpoint"].items():
        want = answers["slimwise"][key][1]
        if got == want:
            exact += 1
            continue
        prompt = tokenizer(arguments["gen_args_0"]["arg_0"])["input_ids"]
        tokens = _reference(served["teacher"], served["pruned"], [prompt], 48)[0]
        step = next((i for i in range(len(tokens)) if not got.startswith(tokenizer.decode(tokens[:i + 1]))),
                    len(tokens))
        gap = _gap_at(served["teacher"], served["pruned"], prompt, tokens[:step])
        assert gap < TIE_GAP["f16"], f"{key}: {got!r} vs {want!r}, top-2 gap {gap:.4f} at token {step}"
    print(f"lm-eval local-completions vs slimwise: {exact}/{len(answers['endpoint'])} answers equal")
    assert exact >= MIN_EXACT * len(answers["endpoint"])


# ------------------------------------------------------------------------------------------------ security
def test_requests_need_the_key_and_no_foreign_origin_is_allowed(endpoint):
    evil = {"Origin": "https://evil.example"}
    body = {"prompt": "Q: 1+1=\n", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": endpoint.key}):
        for method, route in (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
                              ("GET", "/metrics")):
            response = httpx.request(method, endpoint.url + route, json=body, headers={**headers, **evil})
            assert response.status_code == 401, (route, headers)
            assert "access-control-allow-origin" not in response.headers
    preflight = httpx.options(endpoint.url + "/v1/completions", headers={**evil, "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in preflight.headers and "access-control-allow-credentials" not in \
        preflight.headers
    with_key = httpx.post(endpoint.url + "/v1/completions", json=body, headers={**endpoint.headers(), **evil})
    assert with_key.status_code == 200 and "access-control-allow-origin" not in with_key.headers
    assert httpx.get(endpoint.url + "/health").json()["status"] == "ok"  # liveness needs no key
    # the key is written for the user only and never logged whole
    assert endpoint.key_file.stat().st_mode & 0o777 == 0o600
    assert endpoint.key not in endpoint.log.read_text()
    # the llama-servers behind it: a key of their own (not the endpoint's), never on their command line, localhost
    # CORS without credentials
    for pid in endpoint.llama_servers().values():
        command = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        port = command.split("\0")[command.split("\0").index("--port") + 1]
        assert "api-key" not in command and endpoint.key not in command
        for headers in ({}, {"Authorization": f"Bearer {endpoint.key}"}):
            response = httpx.post(f"http://127.0.0.1:{port}/completion", json={"prompt": "x", "n_predict": 1},
                                  headers={**headers, **evil})
            assert response.status_code == 401
            assert response.headers.get("access-control-allow-origin") in (None, "")
        response = httpx.options(f"http://127.0.0.1:{port}/slots/0", headers=evil)
        assert response.headers.get("access-control-allow-origin") in (None, "")
        assert response.headers.get("access-control-allow-credentials") != "true"


def _listening_addresses(port: int) -> set[str]:
    found = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, port_hex = local.split(":")
        if state == "0A" and int(port_hex, 16) == port:  # LISTEN
            found.add(socket.inet_ntoa(bytes.fromhex(address)[::-1]))
    return found


def test_binds_localhost_only_by_default(endpoint):
    assert _listening_addresses(endpoint.port) == {"127.0.0.1"}
    for pid in endpoint.llama_servers().values():
        command = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        assert _listening_addresses(int(command[command.index("--port") + 1])) == {"127.0.0.1"}


def test_serve_server_runs_with_a_key_and_localhost_cors(served, tmp_path):
    """`serve server` (the two-server form without the endpoint): a key is generated into the key file, required
    on every route but /health, and no foreign origin gets a CORS grant."""
    port = free_port()
    key_file = tmp_path / "key"
    proc = subprocess.Popen([sys.executable, "-m", "slimwise_train.serve", "server", "--gguf",
                             str(served["root"] / "teacher.gguf"), "--port", str(port), "--slot-dir",
                             str(tmp_path / "slots"), "--api-key-file", str(key_file), "--threads", "1"],
                            env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.3)
        key = key_file.read_text().strip()
        evil = {"Origin": "https://evil.example"}
        assert httpx.post(url + "/completion", json={"prompt": "x", "n_predict": 1}, headers=evil).status_code == 401
        assert httpx.post(url + "/slots/0?action=erase", headers=evil).status_code == 401
        good = httpx.post(url + "/completion", json={"prompt": "Q: 1+1=\n", "n_predict": 2},
                          headers={"Authorization": f"Bearer {key}", **evil})
        assert good.status_code == 200 and good.headers.get("access-control-allow-origin") in (None, "")
        local = httpx.options(url + "/completion", headers={"Origin": "http://localhost:3000"})
        assert local.headers.get("access-control-allow-credentials") == "false"
        assert _listening_addresses(port) == {"127.0.0.1"}
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    assert key not in out + err and "API key: new key written to" in err


# ------------------------------------------------------------------------------------------------ faults
def test_prompt_longer_than_the_context_is_a_400_naming_the_limit(endpoint):
    long_prompt = [5] * 600
    for route, body in (("/v1/completions", {"prompt": long_prompt, "max_tokens": 4}),
                        ("/v1/completions", {"prompt": [5] * 500, "max_tokens": 100}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a " * 600}]})):
        response = httpx.post(endpoint.url + route, json=body, headers=endpoint.headers(), timeout=30)
        assert response.status_code == 400, response.text
        message = response.json()["error"]["message"]
        assert "512 tokens per request" in message and "\n" not in message


def test_bad_requests_are_400_in_one_line(endpoint):
    cases = [({"prompt": "x", "n": 2}, "n=2 is not supported"), ({"prompt": "x", "model": "gpt-4"}, "'gpt-4' is not served"),
             ({"prompt": 3}, "prompt must be"), ({"prompt": "x", "temperature": -1}, "temperature must be in"),
             ({"prompt": "x", "max_tokens": 0}, "max_tokens must be in"), ({"prompt": "x", "logprobs": 2}, "logprobs"),
             ({"prompt": [5, 99999]}, "token id 99999 is not in the vocabulary"),
             ({"prompt": [[5], [-1]]}, "token id -1 is not in the vocabulary")]
    for body, message in cases:
        response = httpx.post(endpoint.url + "/v1/completions", json=body, headers=endpoint.headers(), timeout=30)
        assert response.status_code == 400 and message in response.json()["error"]["message"], response.text
    response = httpx.post(endpoint.url + "/v1/completions", content=b"{not json", headers=endpoint.headers())
    assert response.status_code == 400


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_a_full_queue_answers_429_with_retry_after_memory_stays_bounded_and_slot_files_go(endpoint):
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 300, "temperature": 0}
    statuses, retry = [], []

    def one(_):
        response = httpx.post(endpoint.url + "/v1/completions", json=body, headers=endpoint.headers(), timeout=300)
        statuses.append(response.status_code)
        if response.status_code == 429:
            retry.append(response.headers.get("retry-after"))
        return response.status_code

    before = _rss_kib(endpoint.proc.pid)
    for _ in range(2):  # the second round: memory after a first full load does not grow again
        statuses.clear()
        with futures.ThreadPoolExecutor(60) as pool:
            list(pool.map(one, range(60)))
        after = _rss_kib(endpoint.proc.pid)
    assert set(statuses) == {200, 429}, statuses
    assert statuses.count(200) >= PARALLEL + QUEUE
    assert retry and all(r == "1" for r in retry)
    assert after - before < 30 * 1024, f"the endpoint grew by {(after - before) / 1024:.0f} MiB"
    assert endpoint.metric("slimwise_requests_total", '{outcome="rejected_busy",route="completions"}') >= len(retry)
    assert endpoint.metric("slimwise_queue_depth") == 0 and endpoint.metric("slimwise_requests_running") == 0
    assert list(endpoint.slot_dir().iterdir()) == []  # one state file per request, each removed after its restore


def test_a_client_that_leaves_mid_stream_frees_both_slots(endpoint):
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 400, "temperature": 0, "stream": True}
    for _ in range(PARALLEL + 1):  # more than the slots: a leaked slot would make the last ones wait forever
        with httpx.stream("POST", endpoint.url + "/v1/completions", json=body, headers=endpoint.headers(),
                          timeout=60) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            next(lines)
        # connection closed after the first chunks
    deadline = time.monotonic() + 10
    while endpoint.metric("slimwise_requests_running") != 0:
        assert time.monotonic() < deadline, "a request still runs after its client left"
        time.sleep(0.1)
    assert endpoint.metric("slimwise_requests_total", '{outcome="client_gone",route="completions"}') >= PARALLEL + 1
    # every slot of both servers is free: PARALLEL requests at once all finish promptly
    start = time.monotonic()
    with futures.ThreadPoolExecutor(PARALLEL) as pool:
        codes = list(pool.map(lambda _: httpx.post(endpoint.url + "/v1/completions", headers=endpoint.headers(),
                                                   json={**body, "stream": False, "max_tokens": 8},
                                                   timeout=60).status_code, range(PARALLEL)))
    assert codes == [200] * PARALLEL and time.monotonic() - start < 30


@pytest.mark.parametrize("victim", ["decode", "prefill"])
def test_kill_9_of_a_llama_server_is_a_502_then_it_is_restarted_and_serves(endpoint, reference, victim):
    """The victim is frozen (SIGSTOP) so that requests are surely in flight on it, then killed with SIGKILL: each
    in-flight request gets a 502 (non-streamed) or an error event (streamed after its first token) with one line
    naming the server; `serve up` restarts it and the next request is answered as before."""
    pid = endpoint.llama_servers()[victim]
    results = []
    body = {"prompt": reference["prompts"][0], "max_tokens": BUDGET, "temperature": 0}

    def post():
        response = httpx.post(endpoint.url + "/v1/completions", json=body, headers=endpoint.headers(), timeout=120)
        results.append((response.status_code, response.json()))

    if victim == "decode":  # a stream already receiving tokens from the decode server
        stream = httpx.stream("POST", endpoint.url + "/v1/completions", headers=endpoint.headers(), timeout=120,
                              json={**body, "max_tokens": 400, "stream": True})
        response = stream.__enter__()
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
    os.kill(pid, signal.SIGSTOP)
    threads = [threading.Thread(target=post) for _ in range(2)]
    for thread in threads:
        thread.start()
    time.sleep(1.0)
    os.kill(pid, signal.SIGKILL)
    for thread in threads:
        thread.join(timeout=120)
    assert [code for code, _ in results] == [502, 502], results
    for _, answer in results:
        message = answer["error"]["message"]
        assert f"the {victim} llama-server (pid {pid}" in message and "killed by signal 9" in message
        assert "\n" not in message
    if victim == "decode":
        events = [line for line in lines if line.startswith("data: ")]
        stream.__exit__(None, None, None)
        error = json.loads(events[-1][len("data: "):])
        assert "killed by signal 9" in error["error"]["message"]
    deadline = time.monotonic() + 60
    while endpoint.llama_servers().get(victim) in (None, pid) or \
            httpx.get(endpoint.url + "/health").status_code != 200:
        assert time.monotonic() < deadline, endpoint.log.read_text()[-2000:]
        time.sleep(0.3)
    again = httpx.post(endpoint.url + "/v1/completions", json=body, headers=endpoint.headers(), timeout=120)
    assert again.status_code == 200
    assert again.json()["choices"][0]["text"] == reference["completions"][0].text
    assert endpoint.metric("slimwise_engine_restarts", f'{{process="{victim}"}}') >= 1
    assert list(endpoint.slot_dir().iterdir()) == []


def test_a_decoder_whose_cache_does_not_match_is_refused_before_anything_starts(served, tmp_path):
    from slimwise_train.serve import gguf
    from slimwise_train.testing.tiny import tiny_model

    model = tiny_model("qwen3_moe", vocab_size=len(served["tokenizer"]))
    model.save_pretrained(tmp_path / "other")
    served["tokenizer"].save_pretrained(tmp_path / "other")
    gguf.convert(tmp_path / "other", tmp_path / "other.gguf", check_texts=[], log=lambda *_: None)
    port = free_port()
    proc = subprocess.run([sys.executable, "-m", "slimwise_train.serve", "up", "--prefill",
                           str(served["root"] / "teacher.gguf"), "--decode", str(tmp_path / "other.gguf"), "--port",
                           str(port), "--api-key-file", str(tmp_path / "key")], env=_env(tmp_path),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().startswith("error:") and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "cannot decode on teacher.gguf's cache" in proc.stderr
    assert not (tmp_path / "key").exists() and _listening_addresses(port) == set()


# ------------------------------------------------------------------------------------------------ CLI and docs
def test_every_serve_flag_has_help_and_shows_its_default_once():
    for command in ("gguf", "generate", "server", "client", "up"):
        proc = subprocess.run([sys.executable, "-m", "slimwise_train.serve", command, "--help"], env=CHILD_ENV,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        entries = re.split(r"\n  (?=-)", proc.stdout.split("options:", 1)[1])[1:]
        for entry in entries:
            flag, _, text = entry.partition("  ")
            words = " ".join(text.split())
            assert words and not words.startswith("(default"), f"serve {command} {flag.split()[0]}: no help text"
            assert words.count("(default") <= 1, f"serve {command} {flag.split()[0]}: {words}"


def test_serving_docs_endpoint_blocks_run_as_written(served, tmp_path):
    """docs/serving.md's endpoint section, its blocks run in order in a fresh folder holding teacher.gguf and
    pruned.gguf: `serve up` in the background, the `openai` client call, the curl call."""
    doc = (REPO / "docs" / "serving.md").read_text()
    section = doc[doc.index("### An OpenAI-compatible endpoint"):]
    section = section[:section.index("\n### ", 10)]
    blocks = re.findall(r"```(bash|python)\n(.*?)```", section, re.S)
    assert [kind for kind, _ in blocks] == ["bash", "python", "bash"], blocks
    for name in ("teacher", "pruned"):
        (tmp_path / f"{name}.gguf").symlink_to(served["root"] / f"{name}.gguf")
    env = {**_env(tmp_path / "config"), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    server = subprocess.Popen(["bash", "-e", "-c", blocks[0][1]], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        assert server.wait(timeout=240) == 0  # the block returns once the endpoint answers /health
        python = subprocess.run([sys.executable, "-c", blocks[1][1]], cwd=tmp_path, env=env, capture_output=True,
                                text=True, timeout=120)
        assert python.returncode == 0, python.stderr[-2000:]
        assert python.stdout.strip(), "the openai call printed nothing"
        curl = subprocess.run(["bash", "-e", "-c", blocks[2][1]], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=120)
        assert curl.returncode == 0, curl.stderr[-2000:]
        assert json.loads(curl.stdout)["choices"][0]["text"]
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # `serve up` went on in the background of the first block
        output = server.communicate(timeout=60)[0]
    assert "serve: stopped" in output and "Traceback" not in output, output[-2000:]


def test_llama_cpp_is_one_implementation_of_the_engine_protocol(served):
    """The endpoint sees only `ServingEngine`; llama.cpp's engine is one implementation (built here, not started)."""
    from slimwise_train.serve.disaggregated import LlamaCppEngine
    from slimwise_train.serve.engine import ServingEngine

    engine = LlamaCppEngine(served["root"] / "teacher.gguf", served["root"] / "pruned.gguf", parallel=2)
    assert isinstance(engine, ServingEngine)
    assert engine.model_name == "pruned" and engine.slots == 2 and engine.health() == {}

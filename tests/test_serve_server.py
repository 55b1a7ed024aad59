"""`serve client` against two llama-servers (serve/server.py) when the set-up is wrong or a server dies: a
--decode-gguf that is not the served model, a slot folder that is not the servers', servers of different KV types,
roles reversed, a prompt + budget beyond the servers' context, out-of-vocabulary ids: each refused at start in one
line, before any request; a decode server killed midway: one line, the completions finished are written.

Servers are started once per module (the teacher prefills, the pruned model decodes, f16 KV, one slot folder;
a second decoder with f32 KV); the test that kills a server starts its own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slimwise_train.serve.__main__ import main
from slimwise_train.serve.server import DisaggregatedClient, LlamaServer, ServerSpec, free_port, served_gguf

pytestmark = [pytest.mark.engine, pytest.mark.subprocess]

KEY = "sk-slimwise-test-key-of-this-module"
N_CTX = 256


def _server(gguf: Path, slots: Path, log: Path, kv_type: str = "f16") -> LlamaServer:
    return LlamaServer(ServerSpec(gguf, free_port(), slots, n_ctx=N_CTX, kv_type=kv_type, api_key=KEY), log)


@pytest.fixture(scope="module")
def servers(served, tmp_path_factory):
    root = tmp_path_factory.mktemp("servers")
    slots = root / "slots"
    slots.mkdir()
    rows = [{"prompt_ids": list(p.prompt_ids)} for p in served["problems"][:4]]
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    started = {}
    try:
        for name, gguf, kv_type in (("prefill", "teacher.gguf", "f16"), ("decode", "pruned.gguf", "f16"),
                                    ("decode_f32", "pruned.gguf", "f32")):
            started[name] = _server(served["root"] / gguf, slots, root / f"{name}.log", kv_type)
        yield {**served, "work": root, "slots": slots, "urls": {k: s.url for k, s in started.items()}}
    finally:
        for server in started.values():
            server.stop()


def _client_argv(servers, *extra: str, decode: str = "decode") -> list[str]:
    return ["client", "--prefill-url", servers["urls"]["prefill"], "--decode-url", servers["urls"][decode],
            "--slot-dir", str(servers["slots"]), "--api-key", KEY, "--prompts", str(servers["work"] / "prompts.jsonl"),
            "--max-new-tokens", "8", *extra]


def test_a_decode_gguf_must_be_the_model_the_server_serves(servers, tmp_path):
    root, urls = servers["root"], servers["urls"]
    with pytest.raises(ValueError, match="is not the model") as error:
        DisaggregatedClient(urls["prefill"], urls["decode"], servers["slots"], decode_gguf=str(root / "teacher.gguf"),
                            api_key=KEY)
    assert "\n" not in str(error.value)
    copy = tmp_path / "copy.gguf"  # the same bytes at another path: the same model
    copy.write_bytes((servers["root"] / "pruned.gguf").read_bytes())
    client = DisaggregatedClient(urls["prefill"], urls["decode"], servers["slots"], decode_gguf=str(copy), api_key=KEY)
    assert client.decode_gguf == str(copy)
    # a server on another host: its model_path is not readable here, so its parameters and size are compared
    from slimwise_train.serve.server import _call

    meta = _call(urls["decode"] + "/v1/models", api_key=KEY)["data"][0]["meta"]
    elsewhere = {"model_path": "/models/on/another/host/pruned.gguf"}
    assert served_gguf(urls["decode"], elsewhere, str(copy), meta) == str(copy)
    with pytest.raises(ValueError, match="is not the model"):
        served_gguf(urls["decode"], elsewhere, str(root / "teacher.gguf"), meta)
    assert list(servers["slots"].iterdir()) == []


def test_another_slot_folder_or_kv_type_is_refused_at_start_without_a_file_per_request(servers, tmp_path, capsys):
    urls, slots = servers["urls"], servers["slots"]
    other = tmp_path / "other-slots"
    other.mkdir()
    with pytest.raises(ValueError, match="is not the servers' slot folder") as error:
        DisaggregatedClient(urls["prefill"], urls["decode"], other, api_key=KEY)
    probe = next(word.strip("():,") for word in str(error.value).split() if word.startswith("(slimwise-probe-"))
    assert [p.name for p in slots.iterdir()] == [probe]  # the one probe, named in the message: no per-request leak
    (slots / probe).unlink()
    with pytest.raises(ValueError, match="same --kv-type") as error:
        DisaggregatedClient(urls["prefill"], urls["decode_f32"], slots, api_key=KEY)
    assert "\n" not in str(error.value) and list(slots.iterdir()) == []
    # through the CLI: one line, exit 2, no output
    out = tmp_path / "out.jsonl"
    assert main(_client_argv(servers, "--output", str(out), decode="decode_f32")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--kv-type" in err[0] and not out.exists()


def test_roles_context_and_vocabulary_are_checked_before_any_request(servers, tmp_path, capsys):
    urls = servers["urls"]
    with pytest.raises(ValueError, match="--allow-pruned-prefill"):  # the pruned model would prefill for the teacher
        DisaggregatedClient(urls["decode"], urls["prefill"], servers["slots"], api_key=KEY)
    client = DisaggregatedClient(urls["decode"], urls["prefill"], servers["slots"], api_key=KEY,
                                 allow_pruned_prefill=True)
    assert client.n_ctx == N_CTX and client.n_vocab == len(servers["tokenizer"])

    def rows(*objects) -> str:
        path = tmp_path / f"rows{len(list(tmp_path.iterdir()))}.jsonl"
        path.write_text("".join(json.dumps(o) + "\n" for o in objects))
        return path

    prompt = list(servers["problems"][0].prompt_ids)
    cases = [  # the rule `serve generate` and the endpoint apply: prompt + budget within the context, else refused
        ([{"prompt_ids": prompt}, {"prompt_ids": [3] * 230, "max_new_tokens": 10 ** 9}],
         f":2: prompt of 230 tokens + a budget of 1000000000 exceeds the context of {N_CTX} tokens per request"),
        ([{"prompt_ids": prompt}, {"prompt_ids": [3] * 250}], ":2: prompt of 250 tokens + a budget of 8 exceeds"),
        ([{"prompt_ids": [3, 384]}], ":1: token id 384 is not in the vocabulary (0..383)"),
    ]
    out = tmp_path / "out.jsonl"
    for objects, message in cases:
        argv = _client_argv(servers, "--output", str(out))
        argv[argv.index("--prompts") + 1] = str(rows(*objects))
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
    assert not out.exists() and list(servers["slots"].iterdir()) == []


def test_a_decode_server_killed_midway_is_one_line_and_the_finished_completions_are_written(servers, tmp_path,
                                                                                            capsys, monkeypatch):
    decoder = _server(servers["root"] / "pruned.gguf", servers["slots"], tmp_path / "decode.log")
    real, done = DisaggregatedClient.generate_one, []

    def generate_one(self, req):
        if len(done) == 2:
            decoder.proc.kill()  # kill -9 of the decode server after two completions
            decoder.proc.wait()
        done.append(real(self, req))
        return done[-1]

    monkeypatch.setattr(DisaggregatedClient, "generate_one", generate_one)
    out = tmp_path / "out.jsonl"
    argv = _client_argv(servers, "--output", str(out))
    argv[argv.index("--decode-url") + 1] = decoder.url
    try:
        code = main(argv)
    finally:
        decoder.stop()
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and err[-1].startswith(f"error: the decode server failed ({decoder.url}") and len(done) == 2, err
    assert "the 2 of 4 completions finished are written to" in err[-1]
    assert [json.loads(line)["index"] for line in out.read_text().splitlines()] == [0, 1]
    assert list(servers["slots"].iterdir()) == []  # the failed handoff's slot file removed too

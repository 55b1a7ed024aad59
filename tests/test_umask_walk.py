"""Every file the apps write honours the umask (issue 24): a tiny prune + train + export + eval + lm_eval run under
umask 027, as a user runs them (the CLI, one process each), then one walk over every tree they wrote; the same for
serve's outputs (a GGUF, completions, the endpoint's and the llama-servers' logs and slot folder, API key files,
which alone are 0600 whatever the umask: they hold a secret)."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import CHILD_ENV

pytestmark = pytest.mark.subprocess  # each app runs as a CLI child
ENV = {**CHILD_ENV, "WANDB_MODE": "disabled"}
UMASK = 0o027


def run(args: list[str], cwd: Path, env: dict | None = None) -> None:
    proc = subprocess.run([sys.executable, "-m", *args], cwd=cwd, env=env or ENV, capture_output=True, text=True,
                          timeout=600, preexec_fn=lambda: os.umask(UMASK))
    assert proc.returncode == 0, (args[0], proc.stderr[-3000:])


def wrong_modes(work: Path, secrets: tuple[str, ...] = ()) -> tuple[int, list[str]]:
    """(paths checked, those whose mode is not what a plain open/mkdir gives under UMASK); files named in
    `secrets` must be 0600 instead."""
    checked, wrong = 0, []
    for path in work.rglob("*"):  # work itself is the test's own folder
        if path.is_symlink():
            continue
        mode = stat.S_IMODE(path.stat().st_mode)
        expected = (0o777 if path.is_dir() else 0o666) & ~UMASK
        if path.is_file() and mode & 0o111:
            expected |= 0o111 & ~UMASK  # an executable stays executable (none expected; named if any)
        if path.name in secrets:
            expected = 0o600
        checked += 1
        if mode != expected:
            wrong.append(f"{path.relative_to(work)} {oct(mode)}")
    return checked, wrong


@pytest.mark.slow
def test_every_file_of_a_prune_train_export_eval_lm_eval_run_honours_the_umask(tmp_path):
    from test_trust import save_checkpoint

    ckpt = save_checkpoint(tmp_path / "user-moe")  # the user's own folder: not checked
    work = tmp_path / "work"
    work.mkdir()
    small = ["data.num_samples=48", "data.batch_size=16", "data.seq_len=128", "progress=false"]
    prune_dir, train_dir = work / "prune", work / "train"
    run(["slimwise_train.prune", f"model.path={ckpt}", f"hydra.run.dir={prune_dir}", f"prune.cache_dir={work / 'cache'}",
         "prune.export_checkpoint=true", *small], cwd=work)
    keep = prune_dir / "keep_set.json"
    run(["slimwise_train", "experiment=tiny_smoke", f"model.path={ckpt}", "logger=none", f"prune.keep_set={keep}",
         f"output_dir={train_dir}", f"hydra.run.dir={train_dir}", "distill.schedule.max_steps=4",
         "distill.checkpoint.every=2", "distill.eval.every=2", "distill.eval.batches=1"], cwd=work)
    assert (train_dir / "export" / "config.json").is_file()
    run(["slimwise_train.eval", f"model.path={ckpt}", f"eval.keep_sets=[{keep}]", f"eval.student={train_dir}",
         "eval.num_per_family=2", "eval.budget=8", "eval.save_generations=true", f"hydra.run.dir={work / 'eval'}",
         "progress=false"], cwd=work)
    run(["slimwise_train.lm_eval", "--model", "slimwise", "--model_args",
         f"pretrained={ckpt},keep_set={keep},mode=slimwise", "--tasks", "slimwise_math", "--limit", "2",
         "--gen_kwargs", "max_gen_toks=8", "--output_path", str(work / "lm_eval"), "--log_samples"], cwd=work)

    checked, wrong = wrong_modes(work)
    assert not wrong, wrong
    names = {p.name for p in work.rglob("*")}
    # every stage's outputs were in the walk
    assert {"keep_set.json", "router_mask.safetensors", "scores.safetensors", "model.safetensors", "trainable.safetensors",
            "metrics.jsonl", "results.json", "report.md", "generations.jsonl", "slimwise_report.md"} <= names, names
    assert checked > 40


@pytest.mark.slow
@pytest.mark.engine
def test_every_file_serve_writes_honours_the_umask(served, tmp_path):
    """`serve gguf`, `serve generate --output`, `serve up` with its logs and a request, two `serve server`s with a
    slot folder and `serve client --output`, all under umask 027 into one folder, then one walk."""
    import httpx

    from slimwise_train.serve.server import free_port

    inputs, work = tmp_path / "inputs", tmp_path / "work"
    inputs.mkdir()
    work.mkdir()
    env = {**ENV, "XDG_CONFIG_HOME": str(work / "config")}  # the servers' default key file is written under work
    prompts = inputs / "prompts.jsonl"
    prompts.write_text("".join(f'{{"prompt_ids": {list(p.prompt_ids)}}}\n' for p in served["problems"][:2]))
    (inputs / "texts.jsonl").write_text('{"text": "Q: 6+916-37=\\n"}\n')
    teacher = served["root"] / "teacher.gguf"
    run(["slimwise_train.serve", "gguf", str(served["root"] / "pruned"), "--outfile", str(work / "pruned.gguf"),
         "--check-texts", str(inputs / "texts.jsonl")], cwd=work, env=env)
    generation = ["--prompts", str(prompts), "--max-new-tokens", "4"]
    run(["slimwise_train.serve", "generate", "--prefill", str(teacher), "--decode", str(work / "pruned.gguf"),
         *generation, "--threads", "1", "--output", str(work / "generate.jsonl")], cwd=work, env=env)

    def start(*args: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "slimwise_train.serve", *args], cwd=work, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                preexec_fn=lambda: os.umask(UMASK))

    def healthy(url: str, proc: subprocess.Popen) -> None:
        for _ in range(600):
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"{url} not healthy")

    port = free_port()
    up = start("up", "--prefill", str(teacher), "--decode", str(work / "pruned.gguf"), "--port", str(port),
               "--threads", "1", "--parallel", "1", "--api-key-file", str(work / "keys" / "up.key"), "--log-dir",
               str(work / "up-logs"))
    try:
        healthy(f"http://127.0.0.1:{port}", up)
        key = (work / "keys" / "up.key").read_text().strip()
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "Q: 1+1=", "max_tokens": 4},
                            headers={"Authorization": f"Bearer {key}"}, timeout=60)
        assert answer.status_code == 200, answer.text
    finally:
        up.send_signal(signal.SIGTERM)
        up.communicate(timeout=60)

    ports = free_port(), free_port()
    servers = [start("server", "--gguf", str(gguf), "--port", str(p), "--slot-dir", str(work / "slots"),
                     "--threads", "1") for gguf, p in zip((teacher, work / "pruned.gguf"), ports)]
    try:
        for p, proc in zip(ports, servers):
            healthy(f"http://127.0.0.1:{p}", proc)
        run(["slimwise_train.serve", "client", "--prefill-url", f"http://127.0.0.1:{ports[0]}", "--decode-url",
             f"http://127.0.0.1:{ports[1]}", "--slot-dir", str(work / "slots"), *generation, "--output",
             str(work / "client.jsonl")], cwd=work, env=env)
    finally:
        for proc in servers:
            proc.send_signal(signal.SIGTERM)
            proc.communicate(timeout=60)

    checked, wrong = wrong_modes(work, secrets=("up.key", "api-key"))
    assert not wrong, wrong
    names = {str(p.relative_to(work)) for p in work.rglob("*")}
    assert {"pruned.gguf", "generate.jsonl", "client.jsonl", "keys/up.key", "up-logs/prefill-llama-server.log",
            "up-logs/decode-llama-server.log", "slots", "config/slimwise_train/api-key"} <= names, names

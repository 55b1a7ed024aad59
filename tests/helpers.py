"""What many test files need, written once: an app's config composed as its entry point would, the override lists of
the tiny fast runs, and the environment and module names of a CLI child process.

Plain functions and constants, not fixtures, so that module-scoped fixtures and module-level helpers can use them
too: `from helpers import compose_config, TINY_TRAIN` (pytest's default import mode puts tests/ on sys.path, as for
the `from test_lora import ...` between test modules).
"""

from __future__ import annotations

import os
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from slimwise_train.config import CONF_DIR, register_configs

REPO = Path(__file__).resolve().parents[1]

# `python -m <module>` of each app
APPS = {"prune": "slimwise_train.prune", "train": "slimwise_train", "eval": "slimwise_train.eval",
        "plan": "slimwise_train.plan"}

# A CLI child: unbuffered (its last lines reach the test), one OpenMP thread (2-core CI), never the network.
CHILD_ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}

# --------------------------------------------------------------------------- override lists of the tiny runs

# Every tiny training run: the tiny Qwen3-MoE on the offline synthetic data (experiment=tiny_smoke), no logger.
TINY_TRAIN = ("experiment=tiny_smoke", "logger=none")
# A learning rate at which the held-out loss visibly falls within a dozen steps.
FAST_LR = ("distill.optim.lr=2e-2", "distill.schedule.warmup_steps=2")
# The trainer tests' short real run (tests/test_trainer.py's SMALL): fresh run, fast lr, 2 eval batches, every step
# logged. `train_cfg` composes it.
FAST_TRAIN = (*TINY_TRAIN, "resume=never", *FAST_LR, "distill.eval.batches=2", "distill.log_every=1")


def train_steps(max_steps: int, *, save_every: int | None = None, eval_every: int | None = None,
                log_every: int | None = 1) -> list[str]:
    """distill.schedule.max_steps with a checkpoint and a held-out eval every `save_every` / `eval_every` steps
    (distill.checkpoint.every / distill.eval.every; default: at the last step only) and a metrics record every
    `log_every` steps (None: the config's default)."""
    out = [f"distill.schedule.max_steps={max_steps}", f"distill.eval.every={eval_every or max_steps}",
           f"distill.checkpoint.every={save_every or max_steps}"]
    return out + ([f"distill.log_every={log_every}"] if log_every is not None else [])


# --------------------------------------------------------------------------- composing a config


def compose_config(app: str, *overrides: str, **kwargs) -> DictConfig:
    """The config of `app` ("prune", "train", "eval", "plan": conf/<app>.yaml) with `overrides`, composed as the app's
    entry point composes it (the typed schemas registered). `kwargs` go to hydra's `compose`
    (e.g. return_hydra_config=True)."""
    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return compose(config_name=app, overrides=list(overrides), **kwargs)


def train_cfg(output_dir, *overrides: str) -> DictConfig:
    """The trainer tests' short real run (FAST_TRAIN) writing to `output_dir`, with `overrides` last."""
    return compose_config("train", *FAST_TRAIN, f"output_dir={output_dir}", *overrides)


# --------------------------------------------------------------------------- a tokenizer with a chat template

# A ChatML template in the Qwen manner, written for the tests: system prompt and tools in the first system turn, an
# assistant turn's tool calls as <tool_call> JSON, tool results as <tool_response> in a user turn, and every assistant
# turn's output (content, calls, <|im_end|> and its newline) between {% generation %} markers. A role it does not know
# and a system turn after the first are template errors (raise_exception), as in real templates.
CHATML_TOOLS_TEMPLATE = """\
{%- if tools %}
<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Call a tool as <tool_call>{"name": <name>, "arguments": <object>}</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}
<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- if not loop.first %}{{ raise_exception('a system turn must come first') }}{% endif %}
{%- elif message.role == 'user' %}
<|im_start|>user
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}
<|im_start|>assistant
{% generation %}
{%- if message.content %}{{ message.content }}{% endif %}
{%- for call in message.tool_calls or [] %}
<tool_call>{"name": "{{ call.function.name }}", "arguments": \
{{ call.function.arguments if call.function.arguments is string else call.function.arguments | tojson }}}</tool_call>
{%- endfor %}
<|im_end|>
{% endgeneration %}
{%- elif message.role == 'tool' %}
<|im_start|>user
<tool_response>{{ message.content }}</tool_response><|im_end|>
{% else %}
{{- raise_exception('unknown role ' + message.role) }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% endif %}
"""
CHAT_SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>")
CHAT_TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")


def write_chat_tokenizer(folder, generation_markers: bool = True) -> Path:
    """The shipped tokenizer (slimwise_train/assets/tokenizer) with ChatML tokens and CHATML_TOOLS_TEMPLATE saved in
    `folder`; generation_markers=False strips the {% generation %} markers (assistant turns found by prefixes) by
    putting a block that does nothing in their place, so the template renders the same text."""
    from transformers import AutoTokenizer

    from slimwise_train.models import SHIPPED_TOKENIZER

    tokenizer = AutoTokenizer.from_pretrained(str(SHIPPED_TOKENIZER))
    tokenizer.add_special_tokens({"additional_special_tokens": list(CHAT_SPECIAL_TOKENS)})
    tokenizer.add_tokens(list(CHAT_TOOL_TOKENS))
    template = CHATML_TOOLS_TEMPLATE
    if not generation_markers:
        template = template.replace("{% generation %}", "{% if true %}").replace("{% endgeneration %}", "{% endif %}")
    tokenizer.chat_template = template
    tokenizer.model_max_length = 1 << 16  # tool conversations with their schemas run past the suite's 1024 tokens
    tokenizer.save_pretrained(str(folder))
    return Path(folder)


# The shipped conversations (slimwise_train/data/tool_chats.py) in each row form.
TOOL_CHATS = {form: REPO / "slimwise_train" / "assets" / "data" / f"tool_chats_{form}.jsonl"
              for form in ("openai", "sharegpt")}


# --------------------------------------------------------------------------- realistic twins (slimwise_train/twins)

# Built once per code version (the twins' source, adapters, shipped configs, library versions: twins.code_version)
# and reused by later sessions; .gitignore covers .cache/.
TWIN_CACHE = REPO / ".cache" / "slimwise" / "twins"
TWIN_BUILD_SECONDS: dict[str, float] = {}  # preset -> seconds this session spent building it (0: from the cache)


def twin_folder(preset: str, seed: int = 0) -> Path:
    """The twin of `preset` with `seed`: TWIN_CACHE/<code version>/<preset>-seed<seed>, built there on first use
    (under a lock, so concurrent sessions build it once) and reused while its record names the same code version;
    the folders of other code versions are removed."""
    import fcntl
    import shutil
    import time

    from slimwise_train.twins import build_twin, code_version, read_record

    version = code_version()
    folder = TWIN_CACHE / version / f"{preset}-seed{seed}"
    TWIN_CACHE.mkdir(parents=True, exist_ok=True)
    with open(TWIN_CACHE / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for old in TWIN_CACHE.iterdir():  # twins of an older code version are never read again (~370 MB each)
            if old.is_dir() and old.name != version:
                shutil.rmtree(old, ignore_errors=True)
        folder.parent.mkdir(exist_ok=True)
        record = read_record(folder) if folder.is_dir() else None
        if record and record["code_version"] == version and record["seed"] == seed:
            TWIN_BUILD_SECONDS.setdefault(preset, 0.0)
            return folder
        start = time.perf_counter()
        build_twin(preset, folder, seed=seed, overwrite=folder.exists(), log=lambda _: None)
        TWIN_BUILD_SECONDS[preset] = time.perf_counter() - start
    return folder

# --------------------------------------------------------------------------- a checkout for the README's commands


def checkout_like(folder: Path, venv: bool = False) -> Path:
    """`folder` made to look like a clone to the README's commands, run from it: the package (which finds conf/ and
    the assets beside itself) and, with `venv`, the venv linked in, the repository's .gitignore, all committed to a
    git repository of its own, so that `untracked(folder)` lists whatever the commands leave outside git's ignores."""
    import subprocess

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "slimwise_train").symlink_to(REPO / "slimwise_train")
    if venv:
        (folder / ".venv").symlink_to(REPO / ".venv")
    (folder / ".gitignore").write_text((REPO / ".gitignore").read_text())
    git = ["git", "-c", "user.name=test", "-c", "user.email=test@example.invalid", "-c", "init.defaultBranch=main"]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "checkout"]):
        subprocess.run([*git, *args], cwd=folder, check=True, capture_output=True)
    return folder


def untracked(folder: Path) -> list[str]:
    """`git status --porcelain` of a `checkout_like` folder: what the commands left that git would show."""
    import subprocess

    out = subprocess.run(["git", "status", "--porcelain"], cwd=folder, check=True, capture_output=True, text=True)
    return out.stdout.splitlines()


def shell_without_venv() -> dict:
    """The environment of a fresh shell that has not activated the venv: this session's variables without the venv's
    bin folder on PATH or VIRTUAL_ENV, and no TORCH_EXTENSIONS_DIR (the Makefile's and the trainer's default are the
    same folder)."""
    import sys

    venv_bin = os.path.realpath(os.path.dirname(sys.executable))
    path = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p and os.path.realpath(p) != venv_bin]
    drop = {"VIRTUAL_ENV", "TORCH_EXTENSIONS_DIR", "PYTHONHOME"}
    return {**{k: v for k, v in CHILD_ENV.items() if k not in drop}, "PATH": os.pathsep.join(path),
            "WANDB_MODE": "disabled"}


# --------------------------------------------------------------------------- Ctrl-C as a user presses it


def ctrl_c_when(command: list[str], marker: str, **popen) -> tuple[int, str]:
    """Run `command` (stdout and stderr together, SIGINT at its default action as in a terminal), send SIGINT once a
    line of its output contains `marker`, and return (exit code, whole output)."""
    import signal
    import subprocess

    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL), **popen)
    try:
        for line in proc.stdout:
            if marker in line:
                break
        proc.send_signal(signal.SIGINT)
        output = proc.communicate(timeout=120)[0]
    finally:
        proc.kill()
    return proc.returncode, output

"""The serving engine interface: what the OpenAI endpoint (`serve/endpoint.py`) needs of an engine that prefills
with the full model and decodes with a pruned (or distilled) one, the types it passes, and the check that the
decoder can read the prefill model's cache.

llama.cpp is one implementation (`serve/disaggregated.py`: two llama-servers, slot state moved per request); the
in-process handoff (`serve/handoff.py`) uses the same request, completion and cache types. A second engine (vLLM,
SGLang) is one new module implementing `ServingEngine`, plus its tests; the endpoint does not change.

Errors an engine raises, and what the endpoint answers:
    PromptTooLong  (a ValueError)  400, the message names the limit
    Overloaded                     429 with Retry-After (the endpoint's own queue is full)
    BackendFailed                  502, one line naming the engine process and why
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Protocol, Sequence, runtime_checkable

FINGERPRINT = "slimwise.cache_fingerprint"
ROLE = "slimwise.role"  # full | pruned | distilled, written by `serve gguf`
END_REASONS = ("eos", "stop", "budget")


class CacheMismatch(ValueError):
    """The decode model cannot read the prefill model's cache (one line naming the field)."""


class PromptTooLong(ValueError):
    """Prompt + budget do not fit the engine's context per request (the message names the limit)."""


class Overloaded(RuntimeError):
    """No room for another request now (every slot busy and the queue full)."""


class BackendFailed(RuntimeError):
    """An engine process failed while serving a request (one line: which process, and why)."""


def _cache_keys(meta: dict[str, str]) -> dict[str, str]:
    arch = meta.get("general.architecture", "?")
    keys = {"general.architecture": arch}
    for key, value in meta.items():
        rest = key[len(arch) + 1:] if key.startswith(arch + ".") else None
        if rest is None:
            continue
        if (rest in ("block_count", "embedding_length", "attention.head_count", "attention.head_count_kv",
                     "attention.key_length", "attention.value_length", "attention.sliding_window",
                     "attention.layer_norm_rms_epsilon")
                or rest.startswith("rope.") or rest.startswith("attention.sliding_window")):
            keys[key] = value
    return keys


def check_cache_compatible(prefill_meta: dict[str, str], decode_meta: dict[str, str], prefill_name: str = "prefill",
                           decode_name: str = "decode") -> None:
    """Raise CacheMismatch (one line) unless `decode` can continue on a cache `prefill` wrote. The metadata are GGUF
    header keys (llama.cpp's names); another engine maps its own model config onto the same keys."""
    for name, meta in ((prefill_name, prefill_meta), (decode_name, decode_meta)):
        if FINGERPRINT not in meta:
            raise CacheMismatch(f"{name} has no {FINGERPRINT}: convert it with `python -m slimwise_train.serve gguf` "
                                "(a plain convert_hf_to_gguf.py file cannot be checked)")
    a, b = _cache_keys(prefill_meta), _cache_keys(decode_meta)
    for key in sorted(set(a) | set(b)):
        if a.get(key) != b.get(key):
            raise CacheMismatch(f"{decode_name} cannot decode on {prefill_name}'s cache: {key} is {b.get(key)} there, "
                                f"{a.get(key)} here")
    if prefill_meta[FINGERPRINT] != decode_meta[FINGERPRINT]:
        raise CacheMismatch(f"{decode_name} cannot decode on {prefill_name}'s cache: its attention weights differ "
                            f"({FINGERPRINT} {decode_meta[FINGERPRINT][:12]}... vs {prefill_meta[FINGERPRINT][:12]}...); "
                            "pair a teacher with its own pruned or distilled checkpoint")


def same_file_content(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether two model files hold the same bytes: one file (another spelling of its path, a hard link), or equal
    sizes and equal SHA-256 (read only when the sizes agree), so a copy at another path is the same model."""
    a, b = Path(a), Path(b)
    if os.path.samefile(a, b):
        return True
    if a.stat().st_size != b.stat().st_size:
        return False
    digests = []
    for path in (a, b):
        digest = hashlib.sha256()
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 22), b""):
                digest.update(block)
        digests.append(digest.digest())
    return digests[0] == digests[1]


def check_roles(prefill_meta: dict[str, str], decode_meta: dict[str, str], prefill_name: str, decode_name: str,
                same_model: bool, allow_pruned_prefill: bool = False) -> None:
    """The full model prefills: a pair whose prefill model is a pruned or distilled one (the roles reversed, as
    `slimwise.role` records them) is refused in one line, unless both files hold one model (conventional pruning:
    a pruned model alone) or `allow_pruned_prefill` asks for it."""
    role = prefill_meta.get(ROLE)
    if allow_pruned_prefill or same_model or role in (None, "full"):
        return
    raise ValueError(f"{prefill_name} is a {role} model ({ROLE}) and would prefill for {decode_name} (a "
                     f"{decode_meta.get(ROLE, 'unlabelled')} model): the full model prefills and the pruned one "
                     "decodes; swap the two, or pass --allow-pruned-prefill to run it this way")


def check_fits(prompt_len: int, budget: int, n_ctx: int, fix: str, where: str = "") -> None:
    """The one rule of every engine: a request's prompt and budget (its first token included) fit the context of a
    request, else PromptTooLong naming the limit and `fix` (not a generation cut short at the context's end and
    reported as "budget")."""
    if prompt_len + budget > n_ctx:
        raise PromptTooLong(f"{where}prompt of {prompt_len} tokens + a budget of {budget} exceeds the context of "
                            f"{n_ctx} tokens per request; {fix}")


@dataclass
class Request:
    """One generation: prompt token ids (as the HF tokenizer gives them), a token budget (first token included),
    stop strings, and sampling (temperature 0: greedy). `chat`: an OpenAI chat request's `messages` (and `tools`,
    `tool_choice`, ...) instead of token ids: the engine renders them with the decoder's own chat template.
    `ignore_eos`: end-of-generation tokens are never picked (vLLM's and llama-server's extension)."""

    prompt_ids: Sequence[int]
    max_new_tokens: int
    stop: Sequence[str] = ()
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    chat: dict | None = None
    ignore_eos: bool = False  # generate the whole budget (load generators ask for fixed output lengths)


@dataclass
class Completion:
    """tokens made (EOS included when it ended there); `length` = len(tokens); `end` eos | stop | budget, as the
    eval app counts lengths; `first_token` came from the prefill model."""

    tokens: list[int]
    text: str
    end: str
    first_token: int

    @property
    def length(self) -> int:
        return len(self.tokens)


@dataclass
class Delta:
    """A piece of a streamed answer. `text`: new completion text (chat: new message content); `tool_calls`: OpenAI
    chat `delta.tool_calls` entries the engine's parser found; `end` (last delta only): eos | stop | budget |
    tool_calls; `usage` (last delta only): prompt and completion token counts."""

    text: str = ""
    tool_calls: list[dict] | None = None
    end: str | None = None
    usage: dict[str, int] | None = None


@dataclass
class HandoffStats:
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    decode_tokens: int = 0
    decode_s: float = 0.0
    state_bytes: int = 0
    transfer_s: float = 0.0
    waves: int = 0


@dataclass
class RequestTiming:
    """What one served request measured, for /metrics: time to its first token (prefill + first token), the state
    moved between the engines (bytes and seconds), and the decode phase (tokens and seconds)."""

    ttft_s: float = 0.0
    handoff_bytes: int = 0
    handoff_s: float = 0.0
    decode_tokens: int = 0
    decode_s: float = 0.0


@runtime_checkable
class ServingEngine(Protocol):
    """A full-prefill -> pruned-decode engine serving many requests at once.

    `generate` is an async iterator of `Delta`s for one request; it holds whatever the engine needs (a prefill
    slot, then a decode slot) only while it runs, and releases it when the caller stops iterating early (a client
    that went away); it fills `timing` as it goes. `prompt_length` is the prompt's length in tokens as the engine
    will see it (a chat request rendered with the engine's template): the endpoint checks it against `n_ctx`. `health` maps each engine process to "ok" or what it is doing
    instead (restarting)."""

    model_name: str  # what /v1/models lists
    n_ctx: int  # tokens per request: prompt + completion
    slots: int  # requests decoded at once

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def tokenize(self, text: str) -> list[int]: ...

    async def prompt_length(self, request: Request) -> int: ...

    def generate(self, request: Request, timing: RequestTiming) -> AsyncIterator[Delta]: ...

    def health(self) -> dict[str, str]: ...

"""llama.cpp through llama-cpp-python's ctypes layer: the few calls the handoff needs, with the memory owned here.

`make` builds libllama and llama-server once per CPU kind (scripts/build_llama_cpp.sh) and writes the build's home
folder to `<venv>/slimwise-llama-cpp-home`; `SLIMWISE_LLAMA_CPP_HOME` overrides it. The bindings are imported only
after `LLAMA_CPP_LIB_PATH` points at that build, so they never load another libllama.

Shapes: a logits row is a float32 numpy array [V]. Token ids are Python ints, as llama.cpp counts them.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HOME_FILE = "slimwise-llama-cpp-home"  # written into the venv by scripts/build_llama_cpp.sh
# KV cache element types (ggml_type values) a handoff may use; both contexts of a handoff must agree.
KV_TYPES = {"f32": 0, "f16": 1}

_lock = threading.Lock()
_lib = None


class EngineUnavailable(RuntimeError):
    """llama.cpp is not built for this venv (a one-line message saying how to build it)."""


def llama_cpp_home() -> Path:
    """The folder holding the llama.cpp build (`build/bin`) and its sources (the converter)."""
    env = os.environ.get("SLIMWISE_LLAMA_CPP_HOME")
    if env:
        home = Path(env)
    else:
        marker = Path(sys.prefix) / HOME_FILE
        if not marker.is_file():
            raise EngineUnavailable(f"llama.cpp is not built for this environment ({marker} is missing): run `make venv` "
                                    "(or scripts/build_llama_cpp.sh <venv python>), or set SLIMWISE_LLAMA_CPP_HOME")
        home = Path(marker.read_text().strip())
    if not (home / "build" / "bin" / "libllama.so").is_file():
        raise EngineUnavailable(f"no llama.cpp build in {home} (build/bin/libllama.so missing): rerun "
                                "scripts/build_llama_cpp.sh <venv python>")
    return home


def server_binary() -> Path:
    return llama_cpp_home() / "build" / "bin" / "llama-server"


def source_dir() -> Path:
    """llama.cpp's own sources (convert_hf_to_gguf.py and gguf-py) vendored in the llama-cpp-python sdist."""
    found = sorted(llama_cpp_home().glob("llama_cpp_python-*/vendor/llama.cpp"))
    if not found:
        raise EngineUnavailable(f"llama.cpp sources missing under {llama_cpp_home()}: rerun scripts/build_llama_cpp.sh")
    return found[-1]


def check_gguf_file(path: str | os.PathLike, flag: str) -> Path:
    """`path` as a GGUF file, or a one-line ValueError naming `flag` (no such file, a folder, not a GGUF file), before
    llama.cpp, which would print its own lines about it, sees it."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{flag} {path} is a folder: pass the .gguf file (`python -m slimwise_train.serve gguf "
                         "<folder> --outfile <file>` makes one)")
    if not path.is_file():
        raise FileNotFoundError(f"{flag} {path}: no such file")
    try:
        with open(path, "rb") as handle:
            magic = handle.read(4)
    except OSError as error:
        raise ValueError(f"{flag} {path}: cannot be read ({error.strerror})") from None
    if magic != b"GGUF":
        raise ValueError(f"{flag} {path} is not a GGUF file (it starts with {magic!r}, not b'GGUF'): convert the "
                         "checkpoint with `python -m slimwise_train.serve gguf`")
    return path


def pre_tokenizer_names() -> tuple[str, ...]:
    """The pre-tokenizer names this llama.cpp build loads (`tokenizer.ggml.pre`), read from its own source
    (src/llama-vocab.cpp), in its order; a GGUF with another name does not load."""
    import re

    text = (source_dir() / "src" / "llama-vocab.cpp").read_text(errors="replace")
    return tuple(dict.fromkeys(re.findall(r'tokenizer_pre == "([^"]+)"', text)))


def lib():
    """The `llama_cpp.llama_cpp` ctypes module bound to our build, backend initialised once, logging quiet."""
    global _lib
    with _lock:
        if _lib is None:
            os.environ["LLAMA_CPP_LIB_PATH"] = str(llama_cpp_home() / "build" / "bin")
            import llama_cpp.llama_cpp as L

            L.llama_backend_init()
            _quiet_logs(L)
            _lib = L
    return _lib


_log_callback = None  # kept alive: llama.cpp holds the pointer


def _quiet_logs(L) -> None:
    """Only llama.cpp's errors reach stderr (its info lines would bury ours); SLIMWISE_LLAMA_CPP_VERBOSE=1 keeps all."""
    global _log_callback
    if os.environ.get("SLIMWISE_LLAMA_CPP_VERBOSE") == "1":
        return

    last = [0]

    @L.llama_log_callback
    def callback(level, text, user_data):
        # ggml.h: 4 = GGML_LOG_LEVEL_ERROR, 5 = a continuation of the previous line
        if level != 5:
            last[0] = level
        if last[0] == 4:
            sys.stderr.write(text.decode("utf-8", "replace"))

    _log_callback = callback
    L.llama_log_set(callback, ctypes.c_void_p(0))


class _Owned:
    """A llama.cpp object this process owns: freed once, by `close()`, on leaving a `with` block, or when collected."""

    handle = None

    def _free(self) -> None:  # override: the llama.cpp call that frees `self.handle`
        raise NotImplementedError

    def close(self) -> None:
        if self.handle:
            self._free()
            self.handle = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: the library may be gone already
            pass


class GGUFModel(_Owned):
    """A GGUF file loaded read-only (weights mmapped): vocabulary, metadata, and contexts made from it."""

    def __init__(self, path: str | os.PathLike, vocab_only: bool = False):
        L = lib()
        self.path = check_gguf_file(path, "GGUF")
        params = L.llama_model_default_params()
        params.n_gpu_layers = 0 if os.environ.get("SLIMWISE_LLAMA_CPP_GPU") != "1" else 999
        params.vocab_only = vocab_only
        handle = L.llama_model_load_from_file(str(self.path).encode(), params)
        if not handle:
            raise ValueError(f"llama.cpp could not load {self.path} (run with SLIMWISE_LLAMA_CPP_VERBOSE=1 to see why)")
        self._L, self.handle = L, handle
        self.vocab = L.llama_model_get_vocab(handle)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)
        self.n_layer = L.llama_model_n_layer(handle)
        self.n_ctx_train = L.llama_model_n_ctx_train(handle)
        # what llama-server reports of its model (/v1/models meta): known from the header, also with vocab_only
        self.n_params = int(L.llama_model_n_params(handle))
        self.size = int(L.llama_model_size(handle))

    def metadata(self) -> dict[str, str]:
        """Every key/value of the GGUF header as strings (llama.cpp's own view of them)."""
        L, out, buf = self._L, {}, ctypes.create_string_buffer(1 << 16)
        for i in range(L.llama_model_meta_count(self.handle)):
            L.llama_model_meta_key_by_index(self.handle, i, buf, len(buf))
            key = buf.value.decode("utf-8", "replace")
            L.llama_model_meta_val_str_by_index(self.handle, i, buf, len(buf))
            out[key] = buf.value.decode("utf-8", "replace")
        return out

    def tokenize(self, text: str, add_special: bool = False, parse_special: bool = False) -> list[int]:
        """llama.cpp's tokenization of `text`. `parse_special`: special-token text (`<|im_start|>`, a BOS a chat
        template writes) becomes those tokens, as transformers' tokenizer reads it; without it that text is plain
        text. `add_special`: the vocabulary's own BOS/EOS added around it (transformers' add_special_tokens)."""
        L, data = self._L, text.encode("utf-8")
        n = len(data) + 8
        while True:
            out = (L.llama_token * n)()
            got = L.llama_tokenize(self.vocab, data, len(data), out, n, add_special, parse_special)
            if got >= 0:
                return list(out[:got])
            n = -got

    def piece(self, token: int) -> bytes:
        buf = ctypes.create_string_buffer(256)
        n = self._L.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, False)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = self._L.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, False)
        return buf.raw[:n]

    def detokenize(self, tokens: list[int]) -> str:
        return b"".join(self.piece(t) for t in tokens).decode("utf-8", "replace")

    def is_end_of_generation(self, token: int) -> bool:
        return bool(self._L.llama_vocab_is_eog(self.vocab, token))

    def _free(self) -> None:
        self._L.llama_model_free(self.handle)


@dataclass
class ContextSettings:
    """One context: `n_seq` sequences of at most `n_ctx_per_seq` tokens each, KV in `kv_type` (f32 | f16)."""

    n_seq: int = 1
    n_ctx_per_seq: int = 1024
    n_batch: int = 512
    kv_type: str = "f16"
    threads: int = 1


class Context(_Owned):
    """A llama.cpp context over `model`: batched decode calls, logits rows, per-sequence state in and out."""

    def __init__(self, model: GGUFModel, settings: ContextSettings):
        if settings.kv_type not in KV_TYPES:
            raise ValueError(f"kv_type={settings.kv_type!r}: use one of {', '.join(KV_TYPES)}")
        L = model._L
        params = L.llama_context_default_params()
        params.n_seq_max = settings.n_seq
        # llama.cpp rounds each sequence's context up to a multiple of 256; asking for that avoids its warning
        params.n_ctx = -(-settings.n_ctx_per_seq // 256) * 256 * settings.n_seq
        params.n_batch = params.n_ubatch = settings.n_batch
        params.n_threads = params.n_threads_batch = settings.threads
        params.type_k = params.type_v = KV_TYPES[settings.kv_type]
        params.kv_unified = False
        params.no_perf = True
        handle = L.llama_init_from_model(model.handle, params)
        if not handle:
            raise ValueError(f"llama.cpp could not create a context for {model.path} ({settings})")
        self._L, self.model, self.settings, self.handle = L, model, settings, handle
        self.memory = L.llama_get_memory(handle)
        self._batch = L.llama_batch_init(settings.n_batch, 0, 1)
        self._logit_rows: dict[int, int] = {}

    def clear(self) -> None:
        self._L.llama_memory_clear(self.memory, True)

    def decode(self, items: list[tuple[int, list[int], int]]) -> None:
        """Evaluate tokens for several sequences: each item is (seq_id, tokens, first position); the logits of each
        item's last token are kept (`logits(seq_id)`). Logits live only until the next llama_decode call, so all
        tokens but each item's last go first (packed into as many batches as they need), then the last token of
        every item together in one final batch, whose logits rows are the ones kept."""
        if len(items) > self.settings.n_batch:
            raise ValueError(f"{len(items)} sequences in one decode call: at most n_batch={self.settings.n_batch}")
        heads = [(seq, list(tokens[:-1]), pos) for seq, tokens, pos in items if len(tokens) > 1]
        tails = [(seq, [tokens[-1]], pos + len(tokens) - 1) for seq, tokens, pos in items if tokens]
        self._logit_rows = {}
        self._run(heads, keep_logits=False)
        self._logit_rows = self._run(tails, keep_logits=True)

    def _run(self, items: list[tuple[int, list[int], int]], keep_logits: bool) -> dict[int, int]:
        """llama_decode over `items` in batches of at most n_batch tokens (an item longer than the room left is
        split); with `keep_logits`, the batch row of each item's last token (the items then fit one batch)."""
        L, cap, batch = self._L, self.settings.n_batch, self._batch
        pending = [(seq, list(tokens), pos) for seq, tokens, pos in items if tokens]
        rows: dict[int, int] = {}
        while pending:
            n, rest = 0, []
            for seq, tokens, pos in pending:
                room = cap - n
                if room <= 0:
                    rest.append((seq, tokens, pos))
                    continue
                take, left = tokens[:room], tokens[room:]
                for j, token in enumerate(take):
                    batch.token[n] = token
                    batch.pos[n] = pos + j
                    batch.n_seq_id[n] = 1
                    batch.seq_id[n][0] = seq
                    batch.logits[n] = 1 if (keep_logits and not left and j == len(take) - 1) else 0
                    if batch.logits[n]:
                        rows[seq] = n
                    n += 1
                if left:
                    rest.append((seq, left, pos + len(take)))
            batch.n_tokens = n
            code = L.llama_decode(self.handle, batch)
            if code != 0:
                raise RuntimeError(f"llama_decode failed with code {code} (context full? n_ctx_per_seq="
                                   f"{self.settings.n_ctx_per_seq}, n_seq={self.settings.n_seq})")
            pending = rest
        return rows

    def logits(self, seq: int) -> np.ndarray:
        """float32 [V]: the logits after the last token `decode` evaluated for `seq` (a copy)."""
        ptr = self._L.llama_get_logits_ith(self.handle, self._logit_rows[seq])
        return np.ctypeslib.as_array(ptr, shape=(self.model.n_vocab,)).copy()

    def logits_row(self, seq: int) -> int:
        """The batch index of `seq`'s logits in the last decode call (what llama.cpp's samplers take)."""
        return self._logit_rows[seq]

    def get_state(self, seq: int) -> bytes:
        L = self._L
        size = L.llama_state_seq_get_size(self.handle, seq)
        buf = (ctypes.c_uint8 * size)()
        written = L.llama_state_seq_get_data(self.handle, buf, size, seq)
        if written != size:
            raise RuntimeError(f"llama_state_seq_get_data wrote {written} of {size} bytes for sequence {seq}")
        return bytes(buf)

    def set_state(self, seq: int, state: bytes) -> None:
        L = self._L
        buf = (ctypes.c_uint8 * len(state)).from_buffer_copy(state)
        read = L.llama_state_seq_set_data(self.handle, buf, len(state), seq)
        if read != len(state):
            raise ValueError(f"llama.cpp refused the sequence state ({read} of {len(state)} bytes read): the two "
                             "models' caches do not have the same shape or KV type")

    def _free(self) -> None:
        self._L.llama_batch_free(self._batch)
        self._L.llama_free(self.handle)


class Sampler(_Owned):
    """llama.cpp's own sampler chain for one request: top-k, top-p, temperature, then a draw seeded per request."""

    def __init__(self, temperature: float, top_p: float = 1.0, top_k: int = 0, seed: int = 0):
        L = lib()
        self._L = L
        self.handle = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
        if top_k > 0:
            L.llama_sampler_chain_add(self.handle, L.llama_sampler_init_top_k(top_k))
        if top_p < 1.0:
            L.llama_sampler_chain_add(self.handle, L.llama_sampler_init_top_p(top_p, 1))
        L.llama_sampler_chain_add(self.handle, L.llama_sampler_init_temp(temperature))
        L.llama_sampler_chain_add(self.handle, L.llama_sampler_init_dist(seed & 0xFFFFFFFF))

    def sample(self, context: Context, seq: int) -> int:
        token = self._L.llama_sampler_sample(self.handle, context.handle, context.logits_row(seq))
        return int(token)

    def _free(self) -> None:
        self._L.llama_sampler_free(self.handle)

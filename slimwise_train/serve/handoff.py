"""The SlimWise handoff inside llama.cpp, in one process: the full model prefills, the pruned decoder decodes.

Two llama.cpp contexts, one per GGUF. Each wave of up to `n_seq` requests is prefilled in the full model's context
(prompts packed into shared batches), the first token is picked from the full model's logits, each sequence's state
(its KV cells) is copied into the pruned model's context, and the pruned model decodes all sequences of the wave
together, one token per sequence per llama_decode call. Greedy equals `slimwise_train.moe.handoff.handoff_generate`
token for token (tests/test_serve_llamacpp.py); sampling uses llama.cpp's own sampler chain, seeded per request.

llama.cpp checks only a state's shapes, so `check_cache_compatible` refuses first a pair whose cache is written
differently: layer count, KV heads, head sizes, rope settings, and the `slimwise.cache_fingerprint` that
`python -m slimwise_train.serve gguf` writes (attention weights). Both contexts always use one KV type.
Co-located masking (one model, a per-phase expert mask) is not available in llama.cpp: it would need a change there.
"""

from __future__ import annotations

import os
import time
from typing import Iterator, Sequence

import numpy as np

from slimwise_train.serve.engine import (CacheMismatch, Completion, HandoffStats, Request,  # noqa: F401 (re-exported)
                                         check_cache_compatible, check_fits, check_roles, same_file_content)
from slimwise_train.serve.llamacpp import Context, ContextSettings, GGUFModel, Sampler


class EngineHandoff:
    """Full-prefill -> pruned-decode over llama.cpp contexts. `decode_gguf=None` (or the same file) runs one model
    in both phases: the full baseline, or a pruned model alone (conventional pruning). A pruned or distilled model
    prefilling for another is refused unless `allow_pruned_prefill` (`check_roles`)."""

    def __init__(self, prefill_gguf: str | os.PathLike, decode_gguf: str | os.PathLike | None = None, *,
                 n_seq: int = 16, n_ctx_per_seq: int | None = None, n_batch: int = 512, kv_type: str = "f16",
                 threads: int | None = None, allow_pruned_prefill: bool = False):
        """`n_ctx_per_seq` None: the model's training context, at most 4096 (prompt + budget must fit)."""
        if n_seq < 1 or (n_ctx_per_seq is not None and n_ctx_per_seq < 8):
            raise ValueError(f"n_seq must be >= 1 and n_ctx_per_seq >= 8, got {n_seq} and {n_ctx_per_seq}")
        threads = threads or max(1, len(os.sched_getaffinity(0)))
        self.prefill_model = GGUFModel(prefill_gguf)
        n_ctx_per_seq = n_ctx_per_seq or min(self.prefill_model.n_ctx_train or 4096, 4096)
        same = decode_gguf is None or os.path.realpath(decode_gguf) == os.path.realpath(prefill_gguf)
        self.decode_model = self.prefill_model if same else GGUFModel(decode_gguf)
        if not same:
            metas = self.prefill_model.metadata(), self.decode_model.metadata()
            names = os.path.basename(prefill_gguf), os.path.basename(decode_gguf)
            check_cache_compatible(*metas, *names)
            if metas[0].get("slimwise.role", "full") != "full":  # a copy of one file is still that model
                check_roles(*metas, *names, same_file_content(prefill_gguf, decode_gguf), allow_pruned_prefill)
        settings = ContextSettings(n_seq=n_seq, n_ctx_per_seq=n_ctx_per_seq, n_batch=n_batch, kv_type=kv_type,
                                   threads=threads)
        self.settings = settings
        self.prefill_ctx = Context(self.prefill_model, settings)
        self.decode_ctx = self.prefill_ctx if same else Context(self.decode_model, settings)
        self.stats = HandoffStats()

    def close(self) -> None:
        # contexts before their models; a context or model used for both phases is closed once (close is idempotent)
        for owned in (self.decode_ctx, self.prefill_ctx, self.decode_model, self.prefill_model):
            owned.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------------------------------ generation
    def check(self, requests: Sequence[Request]) -> None:
        """Every request servable here (ValueError naming the request otherwise), before any is generated."""
        for i, req in enumerate(requests):
            if req.max_new_tokens < 1:
                raise ValueError(f"request {i}: max_new_tokens must be >= 1, got {req.max_new_tokens}")
            if not req.prompt_ids:
                raise ValueError(f"request {i}: empty prompt")
            if req.ignore_eos or req.chat is not None:
                raise ValueError(f"request {i}: ignore_eos and chat requests are served by `serve up`, not here")
            check_fits(len(req.prompt_ids), req.max_new_tokens, self.settings.n_ctx_per_seq,
                       "raise --n-ctx or lower the budget", where=f"request {i}: ")

    def waves(self, requests: Sequence[Request]) -> Iterator[list[Completion]]:
        """The completions of each wave of `n_seq` requests in turn, as each finishes (after `check`)."""
        self.check(requests)
        n = self.settings.n_seq
        for start in range(0, len(requests), n):
            yield self._wave(list(requests[start:start + n]))

    def generate(self, requests: Sequence[Request]) -> list[Completion]:
        """Completions in request order, waves of `n_seq` requests."""
        return [completion for wave in self.waves(requests) for completion in wave]

    def _pick(self, ctx: Context, seq: int, sampler: Sampler | None) -> int:
        if sampler is None:
            return int(np.argmax(ctx.logits(seq)))
        return sampler.sample(ctx, seq)

    def _wave(self, requests: list[Request]) -> list[Completion]:
        stats = self.stats
        stats.waves += 1
        self.prefill_ctx.clear()
        if self.decode_ctx is not self.prefill_ctx:
            self.decode_ctx.clear()
        samplers = [Sampler(r.temperature, r.top_p, r.top_k, r.seed) if r.temperature > 0 else None for r in requests]
        try:
            t0 = time.perf_counter()
            self.prefill_ctx.decode([(seq, list(r.prompt_ids), 0) for seq, r in enumerate(requests)])
            first = [self._pick(self.prefill_ctx, seq, samplers[seq]) for seq in range(len(requests))]
            stats.prefill_s += time.perf_counter() - t0
            stats.prefill_tokens += sum(len(r.prompt_ids) for r in requests)
            if self.decode_ctx is not self.prefill_ctx:
                t0 = time.perf_counter()
                for seq in range(len(requests)):
                    state = self.prefill_ctx.get_state(seq)
                    stats.state_bytes += len(state)
                    self.decode_ctx.set_state(seq, state)
                stats.transfer_s += time.perf_counter() - t0
            tokens = [[t] for t in first]
            texts = [bytearray() for _ in requests]  # each request's output bytes so far, kept only for stop strings
            end = [self._ended(tokens[seq], req, texts[seq]) for seq, req in enumerate(requests)]
            t0 = time.perf_counter()
            while True:
                active = [seq for seq in range(len(requests)) if end[seq] is None]
                if not active:
                    break
                self.decode_ctx.decode([(seq, [tokens[seq][-1]], len(requests[seq].prompt_ids) + len(tokens[seq]) - 1)
                                        for seq in active])
                stats.decode_tokens += len(active)
                for seq in active:
                    tokens[seq].append(self._pick(self.decode_ctx, seq, samplers[seq]))
                    end[seq] = self._ended(tokens[seq], requests[seq], texts[seq])
            stats.decode_s += time.perf_counter() - t0
        finally:
            for sampler in samplers:
                if sampler is not None:
                    sampler.close()
        return [Completion(tokens=toks, text=self.decode_model.detokenize([t for t in toks if not self.decode_model.is_end_of_generation(t)]),
                           end=why, first_token=toks[0]) for toks, why in zip(tokens, end)]

    def _ended(self, tokens: list[int], req: Request, text: bytearray) -> str | None:
        """eos | stop | budget once the request is done, else None (the order handoff_generate checks them in).
        `text` holds the output's bytes before this token and gets its piece: a stop string that appears now ends
        within that piece, so only the tail is searched (not the whole output again at every step)."""
        if self.decode_model.is_end_of_generation(tokens[-1]):
            return "eos"
        if req.stop:
            piece = self.decode_model.piece(tokens[-1])
            text += piece
            for stop in req.stop:
                needle = stop.encode("utf-8")
                if needle in text[max(0, len(text) - len(piece) - len(needle)):]:
                    return "stop"
        if len(tokens) >= req.max_new_tokens:
            return "budget"
        return None

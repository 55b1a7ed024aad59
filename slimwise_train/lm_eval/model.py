"""The `slimwise` model of lm-evaluation-harness: any supported MoE checkpoint served in one of six modes.

    python -m slimwise_train.lm_eval --model slimwise \\
        --model_args pretrained=<checkpoint>,keep_set=<keep_set.json>,mode=slimwise --tasks slimwise_math ...

Modes (prefill pool -> decode pool over one KV cache, the same definitions as `python -m slimwise_train.eval`):

    full                    full     -> full
    conventional            pruned   -> pruned
    slimwise                full     -> pruned
    reverse                 pruned   -> full
    conventional_distilled  student  -> student   (prune + distill: the student served alone; student=<folder>)
    distilled               full     -> student   (model_args student=<exported student folder>)

The eval app calls distilled `slimwise_distill` and conventional_distilled `conventional_distill`; both names are
accepted here.

What each request type means under a mode:

* generate_until: greedy; the prompt is prefilled by the prefill pool (which also picks the first token), every
  later token comes from the decode pool. Stops at EOS, at a stop string (`until`; the text is cut before it) or
  at `max_gen_toks`. Each request leaves a length record (generated tokens, why it ended, whether its first token
  equals the full model's), see `slimwise_train.lm_eval.lengths`.
* loglikelihood(context, continuation): the context is prefilled by the prefill pool, whose last position scores
  the first continuation token; the continuation tokens are then fed to the decode pool on that cache, which
  scores the rest. So slimwise scores the continuation with the pruned decoder on the full model's cache,
  conventional scores everything pruned and reverse the opposite; conventional_distilled scores everything with the
  student.
* loglikelihood_rolling: lm-eval's disjoint rolling windows, each window's context and continuation as above.

Generated texts are `GeneratedText` strings that also carry `ended` (EOS produced), `num_tokens` and
`end_reason`, so a task's process_results can require EOS as the eval app does (slimwise_train/lm_eval/tasks).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from pathlib import Path
from typing import Sequence

import lm_eval.models  # noqa: F401  before ours: lm-eval imports its stock models only into an empty registry
import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from slimwise_train.eval.generation import eos_ids, left_pad
from slimwise_train.eval.modes import LM_EVAL_NAMES, MODE_DESCRIPTIONS, MODE_MODELS, MODE_PHASES
from slimwise_train.eval.modes import MODES as EVAL_MODES
from slimwise_train.moe.adapters import get_adapter
from slimwise_train.moe.handoff import continue_on_cache, handoff_generate, prefill
from slimwise_train.utils.hf import text_config

log = logging.getLogger("slimwise.lm_eval")

# The eval app's modes (slimwise_train.eval.generation.MODES) under lm-eval's names (LM_EVAL_NAMES), in its order.
MODES = tuple(LM_EVAL_NAMES.get(m, m) for m in EVAL_MODES)
# the eval app's names of the renamed modes; accepted so one mode list serves both tools
MODE_ALIASES = dict(LM_EVAL_NAMES)
END_REASONS = ("eos", "stop", "budget")
_EVAL_MODE = {ours: app for app, ours in MODE_ALIASES.items()}  # our mode -> the eval app's MODE_PHASES key
STUDENT_MODES = tuple(m for m in MODES if "student" in MODE_MODELS[_EVAL_MODE.get(m, m)])  # need student=
# generation kwargs lm-eval tasks pass that greedy decoding honours as they are
_GREEDY_KWARGS = {"do_sample": (False, None), "temperature": (0, 0.0, None), "top_k": (None,), "top_p": (None, 1.0),
                  "num_beams": (1, None)}


class GeneratedText(str):
    """A generated continuation (text up to EOS / the stop string) that also says how it ended."""

    ended: bool  # EOS produced (the eval app's correctness needs it)
    num_tokens: int  # generated tokens incl. EOS or the token that completed the stop string
    end_reason: str  # eos | stop | budget

    def __new__(cls, text: str, ended: bool, num_tokens: int, end_reason: str):
        obj = super().__new__(cls, text)
        obj.ended, obj.num_tokens, obj.end_reason = ended, num_tokens, end_reason
        return obj

    def __reduce__(self):  # pickles (lm-eval gathers results across ranks) as itself
        return GeneratedText, (str(self), self.ended, self.num_tokens, self.end_reason)


def _as_bool(value, name: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off"):
        return False
    raise ValueError(f"slimwise model_args {name}={value!r} is not a boolean; use true or false")


def _as_int(value, name: str, minimum: int = 1) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"slimwise model_args {name}={value!r} is not an integer"
                         + ("; automatic batch sizes are not supported, give a number" if name == "batch_size" else ""))
    if number < minimum:
        raise ValueError(f"slimwise model_args {name} must be >= {minimum}, got {number}")
    return number


# lm-eval's --apply_chat_template renders each request's conversation with the model's template; model_args
# chat_template=true wraps each context as one user turn. Both at once would wrap the rendered text again.
DOUBLE_CHAT_TEMPLATE = ("--apply_chat_template and model_args chat_template=true both apply the chat template (the "
                        "prompt would be wrapped twice): use one of them")


@register_model("slimwise")
class SlimwiseLM(TemplateLM):
    """See the module docstring. Constructor arguments are lm-eval's model_args (strings from the CLI)."""

    backend = "causal"
    instances: list["SlimwiseLM"] = []  # every instance made in this process; the CLI writes their lengths

    def __init__(self, pretrained: str, keep_set: str | None = None, mode: str = "slimwise", student: str | None = None,
                 dtype: str = "auto", device: str | None = "auto", batch_size: int | str = 32,
                 max_batch_size: int | None = None, max_gen_toks: int | str = 256, max_length: int | str | None = None,
                 chat_template: bool | str = False, add_bos_token: bool | str | None = None,
                 skip_special_tokens: bool | str = False, trust_remote_code: bool | str = False,
                 revision: str | None = None, progress: bool | str = True,
                 allow_foreign_keep_set: bool | str = False, **unknown):
        super().__init__()
        if unknown:
            raise ValueError(f"unknown slimwise model_args {sorted(unknown)}; known: pretrained, keep_set, mode, "
                             "student, dtype, device, batch_size, max_gen_toks, max_length, chat_template, "
                             "add_bos_token, skip_special_tokens, trust_remote_code, revision, progress, "
                             "allow_foreign_keep_set")
        mode = MODE_ALIASES.get(str(mode), str(mode))
        if mode not in MODES:
            raise ValueError(f"slimwise model_args mode={mode!r} is unknown; use one of {list(MODES)}")
        if mode != "full" and not keep_set:
            raise ValueError(f"mode={mode} needs keep_set=<keep_set.json> (from python -m slimwise_train.prune)")
        if mode in STUDENT_MODES and not student:
            raise ValueError(f"mode={mode} needs student=<folder> (the trainer's export, <train output>/export)")
        if student and mode not in STUDENT_MODES:
            raise ValueError(f"student= is only read by mode={' or mode='.join(STUDENT_MODES)}, not mode={mode}; "
                             "drop it or change the mode")
        self.mode = mode
        self.batch_size = _as_int(batch_size, "batch_size")
        self.max_gen_toks = _as_int(max_gen_toks, "max_gen_toks")
        self.chat_template_on = _as_bool(chat_template, "chat_template")
        self.skip_special_tokens = _as_bool(skip_special_tokens, "skip_special_tokens")
        self.progress = _as_bool(progress, "progress")
        self._init_distributed(device)
        self._load(pretrained, keep_set, student, dtype, _as_bool(trust_remote_code, "trust_remote_code"), revision,
                   _as_bool(allow_foreign_keep_set, "allow_foreign_keep_set"))
        config = text_config(self.model)
        self._max_length = (_as_int(max_length, "max_length", 2) if max_length is not None
                            else int(getattr(config, "max_position_embeddings", 2048)))
        if add_bos_token is None:  # as lm-eval's hf model: Gemma needs its BOS, the others are scored without one
            add_bos_token = get_adapter(self.model).add_bos_token
        self.add_bos_token = _as_bool(add_bos_token, "add_bos_token")
        self.eos = eos_ids(self.model, self.tokenizer)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos[0]
        self.records: list[dict] = []
        self.truncated = 0
        SlimwiseLM.instances.append(self)

    # ------------------------------------------------------------------------------------------- set-up
    def _init_distributed(self, device: str | None) -> None:
        """Data parallel under torchrun / accelerate launch: one rank per process, lm-eval shards the documents."""
        from slimwise_train.models import resolve_device
        from slimwise_train.utils import distributed as du

        du.init_if_launched()
        self._rank, self._world_size = du.rank(), du.world_size()
        device = device or "auto"
        if str(device).startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device={device} but this machine has no CUDA device; pass --device cpu (or auto)")
        resolved = resolve_device(str(device))
        if resolved.type == "cuda" and self._world_size > 1:
            resolved = torch.device("cuda", du.cuda_index())
        self._device = resolved

    def _load(self, pretrained, keep_set, student, dtype, trust_remote_code, revision, allow_foreign) -> None:
        """The keep set and the student are checked before the weights load (moe/keepset_rules.py: the file, its
        family, the weights it was scored on; the student's folder), then the model, then what needs its weights."""
        from omegaconf import OmegaConf

        from slimwise_train.config import ModelConfig
        from slimwise_train.eval.generation import check_student_path, load_student
        from slimwise_train.models import load_config, load_model, model_identity, model_weights
        from slimwise_train.moe.keepset_rules import check_fits, keep_set_for_run
        from slimwise_train.moe.masking import PhaseMasking

        model_cfg = OmegaConf.structured(ModelConfig(name=Path(str(pretrained)).name or str(pretrained),
                                                     path=str(pretrained), dtype=str(dtype), revision=revision,
                                                     trust_remote_code=trust_remote_code))
        self.keep_set, self.keep_set_path, self.masking, self.student, self.student_path = None, None, None, None, None
        if keep_set:
            self.keep_set_path = str(keep_set)
            self.keep_set = keep_set_for_run(keep_set, "keep_set", config=load_config(model_cfg),
                                             model=model_weights(model_cfg), allow_foreign=allow_foreign,
                                             allow_key="model_args allow_foreign_keep_set")
        if student:
            self.student_path = str(check_student_path(student, key="student"))
        self.model, self.tokenizer = load_model(model_cfg, self._device)
        self.identity = model_identity(model_cfg)
        if self.keep_set is not None:
            check_fits(self.keep_set, self.model, f"keep_set={keep_set}")
            # One masking for the model's lifetime: every request picks its phases explicitly.
            self.masking = PhaseMasking(self.model, self.keep_set)
        if student:
            self.student, student_keep = load_student(student, self.model, key="student")
            if student_keep is not None and student_keep != self.keep_set:
                raise ValueError(f"student={student} was pruned with another keep set (kept per layer "
                                 f"{list(student_keep.num_kept)}) than keep_set={keep_set}; pass its own keep set")

    # ------------------------------------------------------------------------------------------- lm-eval API
    @property
    def eot_token_id(self) -> int:
        return self.eos[0]

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        if chat_template:  # lm-eval asks for it when --apply_chat_template is on: refuse before any request
            self._check_one_chat_wrap()
        return self.tokenizer.chat_template

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """lm-eval's hook, called for every request when --apply_chat_template is on. With model_args
        chat_template=true as well the context would be wrapped twice (lm-eval renders the conversation, then
        `_context_ids` would wrap that text as a user turn): refused."""
        self._check_one_chat_wrap()
        return self._render_chat(chat_history, add_generation_prompt)

    def _check_one_chat_wrap(self) -> None:
        if self.chat_template_on:
            raise ValueError(DOUBLE_CHAT_TEMPLATE)

    def _render_chat(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if not self.tokenizer.chat_template:
            raise ValueError(f"the tokenizer of {self.identity} has no chat template; drop --apply_chat_template "
                             "(or chat_template=true)")
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        add = self.add_bos_token if add_special_tokens is None else add_special_tokens
        bos = self.tokenizer.bos_token
        if add_special_tokens is None and bos and string.startswith(bos):
            add = False  # a chat template that writes its own BOS (as lm-eval's hf model: never two)
        return self.tokenizer(string, add_special_tokens=add)["input_ids"]

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._world_size == 1:
            return tensor
        parts = [torch.zeros_like(tensor) for _ in range(self._world_size)]
        torch.distributed.all_gather(parts, tensor)
        return torch.stack(parts) if tensor.dim() == 0 else torch.cat(parts)

    def gather_object(self, obj, dst: int = 0):
        if self._world_size == 1:
            return [obj]
        out = [None] * self._world_size if self._rank == dst else None
        torch.distributed.gather_object(obj, out, dst=dst)
        return out

    def barrier(self) -> None:
        if self._world_size > 1:
            torch.distributed.barrier()

    # ------------------------------------------------------------------------------------------- helpers
    @property
    def phases(self) -> tuple[str, str]:
        return MODE_PHASES[_EVAL_MODE.get(self.mode, self.mode)]

    def _role(self, role: str) -> torch.nn.Module:
        return self.student if role == "student" else self.model

    @property
    def prefiller(self) -> torch.nn.Module:
        """The model that reads the prompt (and picks the first token): the student in conventional_distilled."""
        return self._role(MODE_MODELS[_EVAL_MODE.get(self.mode, self.mode)][0])

    @property
    def decoder(self) -> torch.nn.Module:
        return self._role(MODE_MODELS[_EVAL_MODE.get(self.mode, self.mode)][1])

    def _bar(self, total: int, desc: str):
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=f"{desc} ({self.mode})", unit="batch", dynamic_ncols=True,
                    disable=not self.progress or self._rank != 0)

    def _context_ids(self, context: str) -> list[int]:
        if self.chat_template_on:
            context = self._render_chat([{"role": "user", "content": context}])
        return self.tok_encode(context)

    @staticmethod
    def _generation_settings(gen_kwargs: dict, default_budget: int) -> tuple[tuple[str, ...], int]:
        gen_kwargs = dict(gen_kwargs or {})
        until = gen_kwargs.pop("until", None) or []
        until = (until,) if isinstance(until, str) else tuple(until)
        budget = gen_kwargs.pop("max_gen_toks", gen_kwargs.pop("max_new_tokens", default_budget))
        for key, value in gen_kwargs.items():
            if key not in _GREEDY_KWARGS:
                raise ValueError(f"generation kwarg {key}={value!r} is not supported by the slimwise model (greedy "
                                 f"decoding; it reads until, max_gen_toks, {', '.join(_GREEDY_KWARGS)})")
            if value not in _GREEDY_KWARGS[key]:
                raise ValueError(f"generation kwarg {key}={value!r} asks for sampling or beams; the slimwise model "
                                 f"decodes greedily (set {key} to {_GREEDY_KWARGS[key][0]!r} in the task or --gen_kwargs)")
        return until, _as_int(budget, "max_gen_toks")

    def _stop_fn(self, stops: Sequence[str]):
        """stop_fn for handoff_generate: a running row stops once its decoded text contains a stop string."""
        if not stops:
            return None

        def stop(tokens: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
            out = torch.zeros(tokens.shape[0], dtype=torch.bool, device=tokens.device)
            for row in active.nonzero().flatten().tolist():
                text = self.tokenizer.decode(tokens[row].tolist(), skip_special_tokens=self.skip_special_tokens)
                out[row] = any(s in text for s in stops)
            return out

        return stop

    # ------------------------------------------------------------------------------------------- generate_until
    @torch.no_grad()
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy handoff generation, batched per (task, stop strings, budget) and sorted by prompt length, as the
        eval app batches per family."""
        prepared = []
        for req in requests:
            context, gen_kwargs = req.args
            until, budget = self._generation_settings(gen_kwargs, self.max_gen_toks)
            ids = self._context_ids(context)
            room = self.max_length - budget
            if room < 1:
                raise ValueError(f"max_gen_toks {budget} leaves no room for a prompt within max_length "
                                 f"{self.max_length}; lower max_gen_toks")
            if len(ids) > room:  # as lm-eval's hf model: keep the prompt's end
                ids = ids[-room:]
                self.truncated += 1
            prepared.append((ids, until, budget))
        groups: dict[tuple, list[int]] = defaultdict(list)
        for i, (req, (ids, until, budget)) in enumerate(zip(requests, prepared)):
            groups[(getattr(req, "task_name", None), until, budget)].append(i)
        batches = []
        for (_, until, budget), idx in groups.items():
            idx.sort(key=lambda i: len(prepared[i][0]))
            batches += [(until, budget, idx[k: k + self.batch_size]) for k in range(0, len(idx), self.batch_size)]
        out: list[str | None] = [None] * len(requests)
        prefill_phase, decode_phase = self.phases
        bar = self._bar(len(batches), "generate")
        for until, budget, batch in batches:
            ids, mask = left_pad([prepared[i][0] for i in batch], self.pad_id, self._device)
            result = handoff_generate(self.prefiller, self.decoder, ids, mask, budget, self.eos, self.pad_id,
                                      prefill_phase=prefill_phase, decode_phase=decode_phase,
                                      stop_fn=self._stop_fn(until))
            if prefill_phase == "prefill" and self.prefiller is self.model:
                full_first = result.first_token.tolist()
            else:  # pruned or student prefill: what would the full model have said first?
                logits, _ = prefill(self.model, ids, mask, phase="prefill")
                full_first = logits[:, -1].argmax(-1).tolist()
            tokens, lengths = result.tokens.tolist(), result.lengths.tolist()
            for row, i in enumerate(batch):
                n, ended, stopped = lengths[row], bool(result.ended[row]), bool(result.stopped[row])
                seq = tokens[row][:n]
                text = self.tokenizer.decode(seq[:-1] if ended else seq, skip_special_tokens=self.skip_special_tokens)
                for stop in until:  # cut at the first stop string, as lm-eval's hf model does
                    if stop in text:
                        text = text.split(stop, 1)[0]
                reason = "eos" if ended else "stop" if stopped else "budget"
                out[i] = GeneratedText(text, ended, n, reason)
                req = requests[i]
                self.records.append({
                    "task": getattr(req, "task_name", None), "doc_id": getattr(req, "doc_id", None),
                    "idx": getattr(req, "idx", 0), "mode": self.mode,
                    "num_tokens": n, "end_reason": reason, "budget": budget, "prompt_tokens": len(prepared[i][0]),
                    "first_token": int(result.first_token[row]), "full_first_token": int(full_first[row]),
                    "first_token_agrees": int(result.first_token[row]) == int(full_first[row]),
                })
            bar.update(1)
        bar.close()
        if self.truncated:
            log.warning("%d prompts were longer than max_length - max_gen_toks and lost their beginning", self.truncated)
        return out  # type: ignore[return-value]

    # ------------------------------------------------------------------------------------------- loglikelihood
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(sum of log-probs of the continuation, every continuation token is the greedy one) per request of
        ((context, continuation), context ids, continuation ids), under the mode's prefill/decode pools."""
        prepared = []
        for _, context_ids, continuation_ids in requests:
            if not continuation_ids:
                raise ValueError("a loglikelihood request has an empty continuation")
            if len(continuation_ids) > self.max_length:
                raise ValueError(f"a continuation of {len(continuation_ids)} tokens does not fit max_length "
                                 f"{self.max_length}")
            # the model reads context + continuation[:-1]: as lm-eval's hf model, keep the context's end
            room = self.max_length - len(continuation_ids) + 1
            context_ids = list(context_ids)[-room:] or [self.prefix_token_id]
            prepared.append((context_ids, list(continuation_ids)))
        order = sorted(range(len(prepared)), key=lambda i: -(len(prepared[i][0]) + len(prepared[i][1])))
        batches = [order[k: k + self.batch_size] for k in range(0, len(order), self.batch_size)]
        out: list[tuple[float, bool] | None] = [None] * len(prepared)
        bar = self._bar(len(batches), "loglikelihood")
        for batch in batches:
            for i, score in zip(batch, self._score_batch([prepared[i] for i in batch])):
                out[i] = score
                if self.cache_hook is not None and requests[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], score)
            bar.update(1)
        bar.close()
        return out  # type: ignore[return-value]

    @torch.no_grad()
    def _score_batch(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        prefill_phase, decode_phase = self.phases
        ids, mask = left_pad([c for c, _ in pairs], self.pad_id, self._device)
        logits, cache = prefill(self.prefiller, ids, mask, phase=prefill_phase)
        first = F.log_softmax(logits[:, -1].float(), dim=-1)  # [B, V]: scores each continuation's first token
        width = max(len(t) for _, t in pairs)
        rest = None
        if width > 1:  # the continuation minus its last token, right-padded, on the prefill cache
            cont = torch.full((len(pairs), width - 1), self.pad_id, dtype=torch.long)
            cont_mask = torch.zeros((len(pairs), width - 1), dtype=mask.dtype)
            for row, (_, tokens) in enumerate(pairs):
                cont[row, : len(tokens) - 1] = torch.tensor(tokens[:-1])
                cont_mask[row, : len(tokens) - 1] = 1
            logits, _ = continue_on_cache(self.decoder, cache, cont.to(self._device),
                                          torch.cat([mask, cont_mask.to(self._device)], dim=-1), phase=decode_phase)
            rest = F.log_softmax(logits.float(), dim=-1)  # [B, width-1, V]
        scores = []
        for row, (_, tokens) in enumerate(pairs):
            target = torch.tensor(tokens, device=self._device)
            dist = first[row: row + 1] if rest is None else torch.cat([first[row: row + 1], rest[row, : len(tokens) - 1]])
            logprob = dist.gather(-1, target[:, None]).sum().item()
            greedy = bool((dist.argmax(-1) == target).all())
            scores.append((float(logprob), greedy))
        return scores

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Sum of log-probs of each whole text over lm-eval's disjoint rolling windows (each window: its context
        prefilled by the prefill pool, its tokens scored as a continuation)."""
        windows, owner = [], []
        for i, req in enumerate(requests):
            (text,) = req.args
            for window in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(text, add_special_tokens=False), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, *window))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owner, self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)):
            totals[i] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # ------------------------------------------------------------------------------------------- lengths
    def describe(self) -> dict:
        """What this run evaluated, for the lengths files and the report."""
        info = {"model": self.identity, "mode": self.mode, "mode_description": MODE_DESCRIPTIONS[
            _EVAL_MODE.get(self.mode, self.mode)], "keep_set": self.keep_set_path, "student": self.student_path,
            "batch_size": self.batch_size, "world_size": self._world_size, "prompts_truncated": self.truncated}
        if self.keep_set is not None:
            info["num_kept"] = list(self.keep_set.num_kept)
            info["num_experts"] = [layer.num_experts for layer in self.keep_set]
            info["top_k"] = [layer.top_k for layer in self.keep_set]  # the report's expert-bytes bound
            info["keep_fraction"] = self.keep_set.keep_fraction
            info["keep_set_digest"] = self.keep_set.digest()  # the report's tables: one per keep set content
            info["run_digest"] = self.run_digest()
        return info

    def run_digest(self) -> str:
        """sha256 of what the pruned decoder is made of: the keep set's content and, in the student modes, the
        student's weight files (their content, not their path): names this run's output files."""
        import hashlib

        from slimwise_train.utils.fingerprint import weight_files_digest

        parts = [self.keep_set.digest()]
        if self.student_path:
            parts.append(weight_files_digest(self.student_path) or str(Path(self.student_path).resolve()))
        return hashlib.sha256("\n".join(parts).encode()).hexdigest()

    def gathered_records(self) -> list[dict] | None:
        """Every rank's length records on rank 0 (None elsewhere); a collective under data parallelism."""
        parts = self.gather_object(self.records)
        if parts is None:
            return None
        # lm-eval pads the shorter ranks with copies of their last request, and repeats clone requests: greedy
        # decoding answers copies alike, so each (task, doc, request index) counts once.
        unique = {}
        for record in (r for part in parts for r in part):
            unique.setdefault((record["task"], record["doc_id"], record["idx"]), record)
        return list(unique.values())


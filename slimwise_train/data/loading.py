"""Text data through Hugging Face `datasets`: hub ids, local files, or declarative recipes in data_recipes/.

`DataConfig.source` is resolved in this order:
  1. a recipe name: data_recipes/<source>.yaml (or a path to a .yaml recipe);
  2. a local file or folder: .jsonl/.json -> "json", .parquet -> "parquet", .txt -> "text" builders;
  3. otherwise a hub id for `load_dataset(source, subset, split=...)`.

Rows become examples (`load_pairs`):
  * `messages` / `conversations` columns (OpenAI or ShareGPT form, with optional `tools` and `system` columns):
    a `Conversation` (data/chat.py), rendered whole by the tokenizer's chat template;
  * `prompt` + `answer` (or `response`/`completion`/`output`) columns: a `TextPair` (with a chat template: one user
    turn and one assistant turn);
  * a plain `text` column (or `DataConfig.text_field`): a `TextPair` with no prompt, tokenised as it is.
Rows with nothing to learn from (no assistant turn, blank) are skipped and counted; a row that cannot be rendered as
given is a one-line error naming it (or, with data.bad_rows=skip, a counted skip).

Examples become token sequences (`encode_example`, `encode_all`): `(ids, prompt_len)`, or `(ids, prompt_len,
supervised)` where only the tokens with supervised[i] = 1 are loss targets (data.supervise). prompt_len is the index
of the first assistant token (what distill.split.split_after_prompt reads). Without a chat template (or with
data.chat_template=false) the rendering is plain: prompt text, answer text, EOS (a conversation: its turns before
the last assistant turn as "role: content" lines, that turn as the answer), said once in the log.
"""

from __future__ import annotations

import json
import logging
import os
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Union

import torch
import yaml

from slimwise_train.data.chat import (CUT_AT_LIMIT, CUT_AT_TURN, CUT_IN_ANSWER, BadRow, Conversation, SkipRow,
                                      conversation_from_row, has_generation_markers, render_within, template_of)
from slimwise_train.utils import distributed as du
from slimwise_train.utils.hf import text_config

log = logging.getLogger("slimwise.data")
RECIPES_DIR = Path(__file__).resolve().parents[2] / "data_recipes"


@dataclass(frozen=True)
class TextPair:
    """One training/calibration sequence: `prompt` text (may be empty) then `answer` text. `origin` names the row in
    messages; it is not part of the value."""

    prompt: str
    answer: str
    family: str = ""
    origin: str = field(default="", compare=False)


# What a row becomes: a conversation (rendered by the chat template) or a prompt/answer pair (a text row: no prompt).
Example = Union[TextPair, Conversation]


def recipe_path(source: str) -> Path | None:
    path = Path(source)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        return path
    candidate = RECIPES_DIR / f"{source}.yaml"
    return candidate if candidate.is_file() else None


def load_recipe(source: str) -> dict:
    path = recipe_path(source)
    if path is None:
        raise FileNotFoundError(f"no data recipe {source!r}; recipes: {', '.join(list_recipes())}")
    return yaml.safe_load(path.read_text())


def source_digest(source: str) -> str | None:
    """What a cache of results computed from `source` must be keyed on besides its name: the text of a recipe
    (plus the synthetic suite's version) or the names, sizes and modification times of local files, so editing
    them invalidates the cache. None for hub ids (their revision is the hub's business)."""
    import hashlib

    digest = hashlib.sha256()
    recipe = recipe_path(source)
    path = Path(source)
    if recipe is not None:
        from slimwise_train.data.synthetic import _SUITE_VERSION

        digest.update(recipe.read_bytes() + _SUITE_VERSION.encode())
    elif path.exists():
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for f in files:
            stat = f.stat()
            digest.update(f"{f.relative_to(path) if path.is_dir() else f.name}|{stat.st_size}|{stat.st_mtime_ns}\n".encode())
    else:
        return None
    return digest.hexdigest()[:16]


def has_named_splits(source: str) -> bool:
    """False for a local file or folder: every split name reads the same rows."""
    return recipe_path(source) is not None or not Path(source).exists()


def list_recipes() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def _load_rows(source: str, split: str, subset: str | None = None, data_files=None, key: str = "data",
               recipe: str | None = None):
    from datasets import load_dataset

    path = Path(source)
    if path.exists():
        files = [str(p) for p in sorted(path.iterdir())] if path.is_dir() else [str(path)]
        suffix = Path(files[0]).suffix if files else ""
        builder = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}.get(suffix)
        if builder is None:
            raise ValueError(f"data source {source}: unsupported file type {suffix!r}; use .jsonl, .json, .parquet or .txt")
        if all(Path(f).stat().st_size == 0 for f in files):
            return []
        try:
            return load_dataset(builder, data_files=files, split="train")
        except Exception as exc:  # datasets raises many types for malformed files; one clear message
            raise ValueError(f"data source {source}: cannot read it as {builder}: {exc}") from None
    try:
        return load_dataset(source, subset, split=split, data_files=data_files)
    except _hub_errors() as exc:
        where = f"{key}.source={recipe}: its source {source}" if recipe else f"{key}.source={source}"
        raise ValueError(_unreachable_message(where, key, exc)) from None


def _hub_errors() -> tuple[type[BaseException], ...]:
    """What `load_dataset(<hub id>)` raises when the id cannot be reached or found: offline (datasets wraps
    huggingface_hub's OfflineModeIsEnabled into a ConnectionError), no network, no such dataset (online), or not in
    the local cache (offline)."""
    from datasets.exceptions import DatasetNotFoundError
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError

    return (ConnectionError, DatasetNotFoundError, LocalEntryNotFoundError, RepositoryNotFoundError)


def _unreachable_message(where: str, key: str, exc: BaseException) -> str:
    first = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        hint = ("HF_HUB_OFFLINE is set, so a hub dataset must already be in the local cache: fetch it once with the "
                "network, or")
    else:
        hint = "check the hub id (owner/name) and the network, or"
    recipes = ", ".join(list_recipes())
    return (f"{where}: neither a local file or folder nor reachable on the hub ({first[:160]}); {hint} point "
            f"{key}.source at a local .jsonl/.json/.parquet/.txt file or folder or a recipe ({recipes})")


_FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".txt", ".csv", ".yaml", ".yml", ".arrow", ".gz")


def _looks_like_hub_id(source: str) -> bool:
    """owner/name: one slash, not a path (./x, /x, ~/x) and no data file suffix (data/train.jsonl is a file)."""
    return (source.count("/") == 1 and not source.startswith((".", "/", "~"))
            and Path(source).suffix.lower() not in _FILE_SUFFIXES)


def check_source(source: str, key: str = "data") -> None:
    """Raise a one-line FileNotFoundError naming `<key>.source` when it is neither a recipe, an existing local file or
    folder, nor a hub id, or a recipe lists a local path that does not exist. Reads no data (the trainer calls it
    before the model loads); whether a hub id is reachable is only known when it loads (`load_pairs`)."""
    source = str(source)
    recipe = recipe_path(source)
    if recipe is not None:
        data = yaml.safe_load(recipe.read_text())
        for entry in (data.get("sources") if isinstance(data, dict) else None) or []:
            local = entry.get("path") if isinstance(entry, dict) else None
            if local and not Path(local).exists():
                raise FileNotFoundError(f"{key}.source={source}: the recipe {recipe} reads {local}, which does not "
                                        "exist; fix its path or point it at a hub id (id: owner/name)")
        return
    if Path(source).exists() or _looks_like_hub_id(source):
        return
    recipes = ", ".join(list_recipes())
    if "/" in source or source.startswith("~") or Path(source).suffix.lower() in _FILE_SUFFIXES:
        raise FileNotFoundError(f"{key}.source={source} is neither a recipe ({recipes}), an existing file or folder "
                                f"(no such path), nor a hub id (owner/name); point {key}.source at an existing "
                                ".jsonl/.json/.parquet/.txt file or folder")
    raise FileNotFoundError(f"{key}.source={source!r} is neither a recipe ({recipes}), an existing file or folder, nor "
                            f"a hub id (owner/name); point {key}.source at one of them")


def _string(row: dict, key: str, origin: str = "") -> str:
    """row[key] as text; a null, number, list or mapping is an error: str() would train on "None" or on digits."""
    value = row[key]
    if not isinstance(value, str):
        raise BadRow("content not text", f"{origin or 'a data row'}: its {key!r} is {type(value).__name__} "
                                          f"{str(value)[:40]!r}, not text: fix or drop such rows (or point "
                                          "data.text_field at a text column)")
    return value


def _blank(example: Example) -> bool:
    # A blank line of a .txt file (or an empty text cell) would become an EOS-only sequence that gets scored.
    return isinstance(example, TextPair) and not (example.prompt.strip() or example.answer.strip())


def row_to_pair(row: dict, text_field: str | None = None, family: str = "", origin: str = "") -> Example | None:
    """The row as an example (a Conversation or a TextPair); None for a row with nothing to learn from (no assistant
    turn, blank). A row that cannot be read as given raises a one-line ValueError (BadRow) naming it."""
    try:
        example = _row_to_pair(row, text_field, family, origin)
    except SkipRow:
        return None
    return None if _blank(example) else example


def _row_to_pair(row: dict, text_field: str | None = None, family: str = "", origin: str = "") -> Example:
    if text_field:
        return TextPair("", _string(row, text_field, origin), family, origin)
    for key in ("messages", "conversations"):
        if key in row and row[key]:
            return conversation_from_row(row[key], system=row.get("system"), tools=row.get("tools"), family=family,
                                         origin=origin)
    if "prompt" in row:
        for key in ("answer", "response", "completion", "output"):
            if key in row:
                return TextPair(_string(row, "prompt", origin), _string(row, key, origin),
                                row.get("family", family) or family, origin)
    if "text" in row:
        return TextPair("", _string(row, "text", origin), family, origin)
    raise ValueError(
        f"cannot read a row with columns {sorted(row)}; expected messages/conversations, prompt+answer, or text "
        "(or set data.text_field)"
    )


@dataclass
class DataCounts:
    """What became of the rows read, for the run's log and `python -m slimwise_train.data show`: rows read, sequences
    and their tokens, supervised tokens (loss targets under data.supervise), sequences cut to data.seq_len by how, and
    rows skipped by reason, each kind with the first row it happened to."""

    rows: int = 0
    sequences: int = 0
    tokens: int = 0
    supervised: int = 0
    cut: Counter = field(default_factory=Counter)
    skipped: Counter = field(default_factory=Counter)
    first: dict = field(default_factory=dict)

    def count(self, kind: str, origin: str, table: Counter) -> None:
        table[kind] += 1
        self.first.setdefault(kind, origin)

    def described(self, table: Counter) -> str:
        return ", ".join(f"{kind}: {n} row{'s' if n != 1 else ''}" + (f" (first: {self.first[kind]})"
                                                                       if self.first.get(kind) else "")
                         for kind, n in table.most_common())


def _examples(rows, *, text_field: str | None, family: str, where: str, bad_rows: str, key: str, counts: DataCounts,
              limit: int | None = None) -> list[Example]:
    """The rows' examples; skips counted by reason; a bad row an error naming it (bad_rows=skip: counted too)."""
    got: list[Example] = []
    for index, row in enumerate(rows):
        origin = f"row {index} of {where}"
        counts.rows += 1
        try:
            example = _row_to_pair(row, text_field, family, origin)
        except SkipRow as skip:
            counts.count(skip.reason, origin, counts.skipped)
            continue
        except BadRow as bad:
            if bad_rows != "skip":
                raise ValueError(f"{bad}; or set {key}.bad_rows=skip to skip and count such rows") from None
            counts.count(bad.reason, origin, counts.skipped)
            continue
        if _blank(example):
            counts.count("blank", origin, counts.skipped)
            continue
        got.append(example)
        if limit is not None and len(got) >= limit:
            break
    return got


def load_pairs(data_cfg, split: str | None = None, num_samples: int | None = None, key: str = "data",
               counts: DataCounts | None = None) -> list[Example]:
    """Read `num_samples` (default data_cfg.num_samples) examples from the configured source, shuffled with
    data_cfg.seed. Raises a clear error for a missing, unreachable or empty source (`key`: its config group in
    messages, data or calibration). Skipped rows are added to `counts`; without one, they are logged (rank 0)."""
    split = split or data_cfg.split
    num_samples = num_samples if num_samples is not None else data_cfg.num_samples
    check_source(data_cfg.source, key)
    tally = counts if counts is not None else DataCounts()
    bad_rows = str(getattr(data_cfg, "bad_rows", "error"))
    if recipe_path(data_cfg.source) is not None:
        pairs = _pairs_from_recipe(load_recipe(data_cfg.source), split, num_samples, data_cfg.seed, key=key,
                                   name=data_cfg.source, bad_rows=bad_rows, counts=tally)
    else:
        rows = _load_rows(data_cfg.source, split, data_cfg.subset, key=key)
        pairs = _examples(rows, text_field=data_cfg.text_field, family="", where=str(data_cfg.source),
                          bad_rows=bad_rows, key=key, counts=tally)
    if counts is None and tally.skipped and du.is_rank0():
        log.warning("data %s: skipped %d of %d rows read: %s", data_cfg.source, sum(tally.skipped.values()),
                    tally.rows, tally.described(tally.skipped))
    if not pairs:
        raise ValueError(f"data source {data_cfg.source!r} (split {split}) has no usable rows"
                         + (f" (skipped: {tally.described(tally.skipped)})" if tally.skipped else ""))
    if data_cfg.shuffle:
        random.Random(data_cfg.seed).shuffle(pairs)
    return pairs[:num_samples]


def _pairs_from_recipe(recipe: dict, split: str, num_samples: int, seed: int, key: str = "data",
                       name: str | None = None, bad_rows: str = "error",
                       counts: DataCounts | None = None) -> list[Example]:
    counts = counts if counts is not None else DataCounts()
    if "families" in recipe:  # the offline synthetic suite
        from slimwise_train.data import synthetic

        which = "eval" if split in ("eval", "test", "validation") else "train"
        examples = synthetic.generate_from_recipe(recipe, split=which, n=num_samples)
        counts.rows += len(examples)
        return [TextPair(e.prompt + recipe.get("separator", "\n"), e.answer, e.family) for e in examples]
    sources = recipe.get("sources") or []
    if not sources:
        raise ValueError(f"recipe {recipe.get('name')!r} lists no sources")
    total = sum(float(s.get("weight", 1.0)) for s in sources)
    pairs: list[Example] = []
    for position, src in enumerate(sources):
        recipe_name = name or recipe.get("name")
        if not (src.get("path") or src.get("id")):
            raise ValueError(f"recipe {recipe_name!r}: sources[{position}] names neither a path nor an id")
        if src.get("context_fields"):
            raise ValueError(f"recipe {recipe_name!r}: sources[{position}].context_fields is no longer read: a "
                             "`system` column becomes the conversation's system turn and a `tools` column the chat "
                             "template's tools; drop context_fields")
        want = max(1, round(num_samples * float(src.get("weight", 1.0)) / total))
        source = src.get("path") or src["id"]
        rows = _load_rows(source, src.get("split", split), src.get("subset"), key=key, recipe=recipe_name)
        pairs += _examples(rows, text_field=src.get("text_field"), family=src.get("family", src.get("id", "")),
                           where=str(source), bad_rows=bad_rows, key=key, counts=counts, limit=want)
    return pairs


# --------------------------------------------------------------------------- tokenisation and batching


# Bumped when the same rows and tokenizer give other token ids (caches of results computed from them are keyed on it):
# 2 = conversations rendered whole by the chat template, a `system` column as the first turn.
RENDERING_VERSION = 2

# Which tokens are loss targets (data.supervise; config.Supervise is the same list): auto = the assistant turns when a
# chat template renders the rows, every token with the plain rendering (as before conversations were rendered whole) |
# assistant = the assistant turns (plain rendering: the answer and EOS) | all = every token.
SUPERVISE = ("auto", "assistant", "all")


@dataclass(frozen=True)
class TokenSequence:
    """One example as tokens: `ids`, `prompt_len` (index of the first assistant token; 0 for a text row),
    `supervised` (1 per loss target, None: every token), how it was cut to data.seq_len (None: it fits; chat.CUT_*)
    and how it was rendered (`rendering`: "plain" or "chat template (<how the turns were found>)")."""

    ids: list[int]
    prompt_len: int
    supervised: list[int] | None
    cut: str | None
    rendering: str

    def as_tuple(self) -> tuple:
        """What distill/batches.py and calibration read: (ids, prompt_len), or (ids, prompt_len, supervised)."""
        return (self.ids, self.prompt_len) if self.supervised is None else (self.ids, self.prompt_len, self.supervised)


def _plain_pair(conversation: Conversation) -> TextPair:
    """A conversation without a chat template, as before conversations were rendered whole: the turns before its last
    assistant turn as "role: content" lines (a tool call as its JSON), that turn as the answer."""
    def text(message: dict) -> str:
        calls = [json.dumps(c["function"], ensure_ascii=False) for c in message.get("tool_calls", [])]
        return "\n".join(part for part in (message.get("content") or "", *calls) if part)

    messages = conversation.messages
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    prompt = "".join(f"{m['role']}: {text(m)}\n" for m in messages[:last])
    return TextPair(prompt, text(messages[last]), conversation.family, conversation.origin)


def uses_template(tokenizer, chat_template: bool) -> bool:
    """Whether rows are rendered by the tokenizer's chat template (it has one and data.chat_template is on)."""
    return bool(chat_template and template_of(tokenizer))


def encode_example(tokenizer, example: Example, *, chat_template: bool = True, supervise: str = "auto",
                   max_len: int = 1 << 62, find_turns: bool = True) -> TokenSequence:
    """One example as tokens within max_len.

    With the chat template (uses_template): a Conversation, or a TextPair with a prompt as one user + one assistant
    turn, rendered whole (chat.render_within: cut after whole turns when too long); its assistant tokens are the
    supervised ones unless supervise=all. find_turns=False skips looking for the turns (calibration: ids only, every
    token counted as supervised). Plain (no template, chat_template=false, or a text row): prompt ids + answer ids +
    EOS, cut at max_len; supervised only with supervise=assistant (the answer and EOS).
    Raises SkipRow (no assistant token within max_len) or BadRow (the template refuses the row)."""
    if supervise not in SUPERVISE:
        raise ValueError(f"data.supervise={supervise!r} is not one of {', '.join(SUPERVISE)}")
    templated = uses_template(tokenizer, chat_template)
    if templated and isinstance(example, TextPair) and example.prompt:
        example = Conversation.of([{"role": "user", "content": example.prompt},
                                   {"role": "assistant", "content": example.answer}], None, example.family,
                                  example.origin)
    if templated and isinstance(example, Conversation):
        rendered, cut = render_within(tokenizer, example, max_len, find_turns=find_turns)
        supervised = rendered.supervised if supervise != "all" else None
        how = "chat template" + (f" ({rendered.method})" if rendered.method else "")
        return TokenSequence(rendered.ids, rendered.first_supervised or 0,
                             None if supervised is None or all(supervised) else supervised, cut, how)
    pair = _plain_pair(example) if isinstance(example, Conversation) else example
    prompt_ids = tokenizer(pair.prompt, add_special_tokens=False)["input_ids"] if pair.prompt else []
    answer_ids = tokenizer(pair.answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    ids = list(prompt_ids) + answer_ids
    cut = CUT_AT_LIMIT if len(ids) > max_len else None
    ids = ids[:max_len]
    prompt_len = min(len(prompt_ids), len(ids))
    supervised = ([0] * prompt_len + [1] * (len(ids) - prompt_len)) if supervise == "assistant" and prompt_len else None
    return TokenSequence(ids, prompt_len, supervised, cut, "plain")


def encode_pair(tokenizer, pair: Example, chat_template: bool, max_len: int) -> tuple[list[int], int]:
    """Token ids of one example (prompt + answer + EOS, or its chat-template rendering) within max_len, and the
    prompt length in tokens (the first assistant token)."""
    sequence = encode_example(tokenizer, pair, chat_template=chat_template, max_len=max_len)
    return sequence.ids, sequence.prompt_len


def rendering_description(tokenizer, data_cfg, key: str = "data") -> str:
    """One sentence: how rows are rendered with this tokenizer and data config, and which tokens are loss targets."""
    name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    supervise = str(getattr(data_cfg, "supervise", "auto"))
    if uses_template(tokenizer, data_cfg.chat_template):
        how = ("its generation markers" if has_generation_markers(tokenizer) else
               "rendering prefixes (it has no generation markers)")
        targets = "every token" if supervise == "all" else "the assistant turns"
        return (f"rows rendered whole by the chat template of {name}; assistant turns found by {how}; loss targets: "
                f"{targets} ({key}.supervise={supervise})")
    why = "has no chat template" if not template_of(tokenizer) else f"has one but {key}.chat_template=false"
    targets = "the answer and EOS" if supervise == "assistant" else "every token"
    return (f"the tokenizer {name} {why}: plain rendering (prompt text, answer text, EOS; a conversation's turns "
            f"before its last assistant turn as 'role: content' lines, tools not shown); loss targets: {targets} "
            f"({key}.supervise={supervise})")


_RENDERING_SAID: set = set()


def _say_rendering(tokenizer, data_cfg, key: str) -> None:
    """Log `rendering_description` once per process and setting (rank 0)."""
    said = rendering_description(tokenizer, data_cfg, key)
    if said not in _RENDERING_SAID and du.is_rank0():
        _RENDERING_SAID.add(said)
        log.info("data: %s", said)


def encode_examples(tokenizer, pairs: list[Example], data_cfg, *, find_turns: bool = True, key: str = "data",
                    counts: DataCounts | None = None) -> Iterator[tuple[Example, TokenSequence]]:
    """(example, its TokenSequence) for each example that is kept, within data.seq_len; cuts, skips, sequences and
    their (supervised) tokens counted into `counts`. A bad row (the template refuses it) is an error naming it, or a
    counted skip with data.bad_rows=skip."""
    tally = counts if counts is not None else DataCounts()
    supervise = str(getattr(data_cfg, "supervise", "auto"))
    bad_rows = str(getattr(data_cfg, "bad_rows", "error"))
    for pair in pairs:
        try:
            sequence = encode_example(tokenizer, pair, chat_template=data_cfg.chat_template, supervise=supervise,
                                      max_len=int(data_cfg.seq_len), find_turns=find_turns)
        except SkipRow as skip:
            tally.count(skip.reason, pair.origin, tally.skipped)
            continue
        except BadRow as bad:
            if bad_rows != "skip":
                raise ValueError(f"{bad}; or set {key}.bad_rows=skip to skip and count such rows") from None
            tally.count(bad.reason, pair.origin, tally.skipped)
            continue
        if sequence.cut:
            tally.count(sequence.cut, pair.origin, tally.cut)
        if not sequence.ids:
            continue
        tally.sequences += 1
        tally.tokens += len(sequence.ids)
        tally.supervised += len(sequence.ids) if sequence.supervised is None else sum(sequence.supervised)
        yield pair, sequence


def encode_all(tokenizer, pairs: list[Example], data_cfg, *, find_turns: bool = True, key: str = "data",
               counts: DataCounts | None = None) -> list[tuple]:
    """Token sequences (`TokenSequence.as_tuple`) of the examples within data.seq_len (`encode_examples`). Cuts and
    skips are counted into `counts`; without one they are logged (rank 0), never silent."""
    tally = counts if counts is not None else DataCounts()
    _say_rendering(tokenizer, data_cfg, key)
    encoded = [sequence.as_tuple() for _, sequence in
               encode_examples(tokenizer, pairs, data_cfg, find_turns=find_turns, key=key, counts=tally)]
    if not encoded:
        raise ValueError(f"data source {data_cfg.source!r}: every sequence tokenised to nothing"
                         + (f" (skipped: {tally.described(tally.skipped)})" if tally.skipped else ""))
    if counts is None and du.is_rank0():  # every rank encodes the same rows: say it once
        log_counts(tally, data_cfg, len(pairs), key)
    return encoded


def log_counts(tally: DataCounts, data_cfg, num_examples: int, key: str = "data") -> None:
    """Warn of every sequence cut to data.seq_len and every example skipped (by kind, with the first one)."""
    if tally.cut[CUT_AT_LIMIT]:
        log.warning("data %s: truncated %d of %d sequences to data.seq_len=%d tokens", data_cfg.source,
                    tally.cut[CUT_AT_LIMIT], num_examples, data_cfg.seq_len)
    turns = {kind: n for kind, n in tally.cut.items() if kind in (CUT_AT_TURN, CUT_IN_ANSWER)}
    if turns:
        log.warning("data %s: %d of %d conversations longer than %s.seq_len=%d: %s", data_cfg.source,
                    sum(turns.values()), num_examples, key, data_cfg.seq_len,
                    tally.described(Counter(turns)))
    if tally.skipped:
        log.warning("data %s: skipped %d of %d examples: %s", data_cfg.source, sum(tally.skipped.values()),
                    num_examples, tally.described(tally.skipped))


def max_positions(model) -> int | None:
    return getattr(text_config(model), "max_position_embeddings", None)


def check_seq_len(data_cfg, model, key: str = "data") -> None:
    """Refuse rows the model cannot take: data.seq_len above the model's max_position_embeddings."""
    limit = max_positions(model)
    if limit is not None and int(data_cfg.seq_len) > int(limit):
        raise ValueError(f"{key}.seq_len={data_cfg.seq_len} exceeds the model's max_position_embeddings={limit}; "
                         f"set {key}.seq_len<={limit}")
    if int(data_cfg.seq_len) < 2:
        raise ValueError(f"{key}.seq_len={data_cfg.seq_len} leaves no room for a sequence; use {key}.seq_len>=2")


def pad_batch(sequences: list[list[int]], pad_id: int, side: str = "right") -> dict[str, torch.Tensor]:
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, seq in enumerate(sequences):
        if side == "right":
            ids[i, : len(seq)] = torch.tensor(seq)
            mask[i, : len(seq)] = 1
        else:
            ids[i, width - len(seq):] = torch.tensor(seq)
            mask[i, width - len(seq):] = 1
    return {"input_ids": ids, "attention_mask": mask}


def calibration_batches(encoded, batch_size: int, pad_id: int, rank: int = 0, world_size: int = 1) -> Iterator[dict]:
    """Right-padded batches of this rank's shard (sequence i goes to rank i % world_size), sorted by length
    so padding stays small."""
    shard = [sequence[0] for i, sequence in enumerate(encoded) if i % world_size == rank]
    shard.sort(key=len)
    for start in range(0, len(shard), batch_size):
        yield pad_batch(shard[start : start + batch_size], pad_id)


def num_batches(num_sequences: int, batch_size: int, rank: int = 0, world_size: int = 1) -> int:
    mine = len(range(rank, num_sequences, world_size))
    return -(-mine // batch_size)

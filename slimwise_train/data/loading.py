"""Text data through Hugging Face `datasets`: hub ids, local files, or declarative recipes in data_recipes/.

`DataConfig.source` is resolved in this order:
  1. a recipe name: data_recipes/<source>.yaml (or a path to a .yaml recipe);
  2. a local file or folder: .jsonl/.json -> "json", .parquet -> "parquet", .txt -> "text" builders;
  3. otherwise a hub id for `load_dataset(source, subset, split=...)`.

Rows become (prompt, answer) conversations and then text:
  * `messages` / `conversations` columns (OpenAI role/content or ShareGPT from/value);
  * `prompt` + `answer` (or `response`/`completion`) columns;
  * a plain `text` column (or `DataConfig.text_field`): no prompt, the whole text is the answer.
The tokenizer's chat template is used when it has one and `chat_template` is on.
"""

from __future__ import annotations

import logging
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
import yaml

from slimwise_train.utils import distributed as du
from slimwise_train.utils.hf import text_config

log = logging.getLogger("slimwise.data")
RECIPES_DIR = Path(__file__).resolve().parents[2] / "data_recipes"
_ROLE = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
         "function_call": "assistant", "observation": "tool", "tool": "tool", "function": "tool"}


@dataclass(frozen=True)
class TextPair:
    """One training/calibration sequence: `prompt` text (may be empty) then `answer` text."""

    prompt: str
    answer: str
    family: str = ""


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


def _string(row: dict, key: str) -> str:
    """row[key] as text; a null, number, list or mapping is an error: str() would train on "None" or on digits."""
    value = row[key]
    if not isinstance(value, str):
        raise ValueError(f"a data row's {key!r} is {type(value).__name__} {str(value)[:40]!r}, not text: fix or drop "
                         "such rows (or point data.text_field at a text column)")
    return value


def _messages_to_pair(messages, family="") -> TextPair | None:
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise ValueError(f"a data row's messages are {type(messages).__name__} {str(messages)[:40]!r}: expected a list "
                         'of {"role": ..., "content": ...} turns')
    turns = []
    for m in messages:
        role = _ROLE.get(m.get("role", m.get("from", "")), "user")
        content = m.get("content", m.get("value", ""))
        if not isinstance(content, str):
            raise ValueError(f"a data row's message content is {type(content).__name__} {str(content)[:40]!r}, not "
                             "text: fix or drop such rows")
        turns.append((role, content))
    last = max((i for i, (role, _) in enumerate(turns) if role == "assistant"), default=None)
    if last is None:
        return None
    return TextPair(prompt=_render_turns(turns[:last]), answer=turns[last][1], family=family)


def _render_turns(turns) -> str:
    # Plain rendering for tokenizers without a chat template; the chat-template path re-renders from pairs.
    return "".join(f"{role}: {content}\n" for role, content in turns)


def _blank_to_none(pair: TextPair | None) -> TextPair | None:
    # A blank line of a .txt file (or an empty text cell) would become an EOS-only sequence that gets scored.
    return None if pair is None or not (pair.prompt.strip() or pair.answer.strip()) else pair


def row_to_pair(row: dict, text_field: str | None = None, family: str = "") -> TextPair | None:
    """The row as a (prompt, answer) pair; None for a row with nothing to learn from (no assistant turn, blank)."""
    return _blank_to_none(_row_to_pair(row, text_field, family))


def _row_to_pair(row: dict, text_field: str | None = None, family: str = "") -> TextPair | None:
    if text_field:
        return TextPair("", _string(row, text_field), family)
    for key in ("messages", "conversations"):
        if key in row and row[key]:
            return _messages_to_pair(row[key], family)
    if "prompt" in row:
        for key in ("answer", "response", "completion", "output"):
            if key in row:
                return TextPair(_string(row, "prompt"), _string(row, key), row.get("family", family) or family)
    if "text" in row:
        return TextPair("", _string(row, "text"), family)
    raise ValueError(
        f"cannot read a row with columns {sorted(row)}; expected messages/conversations, prompt+answer, or text "
        "(or set data.text_field)"
    )


def load_pairs(data_cfg, split: str | None = None, num_samples: int | None = None, key: str = "data") -> list[TextPair]:
    """Read `num_samples` (default data_cfg.num_samples) sequences from the configured source, shuffled with
    data_cfg.seed. Raises a clear error for a missing, unreachable or empty source (`key`: its config group in
    messages, data or calibration)."""
    split = split or data_cfg.split
    num_samples = num_samples if num_samples is not None else data_cfg.num_samples
    check_source(data_cfg.source, key)
    if recipe_path(data_cfg.source) is not None:
        pairs = _pairs_from_recipe(load_recipe(data_cfg.source), split, num_samples, data_cfg.seed, key=key,
                                   name=data_cfg.source)
    else:
        rows = _load_rows(data_cfg.source, split, data_cfg.subset, key=key)
        pairs = [p for p in (row_to_pair(r, data_cfg.text_field) for r in rows) if p is not None]
    if not pairs:
        raise ValueError(f"data source {data_cfg.source!r} (split {split}) has no usable rows")
    if data_cfg.shuffle:
        random.Random(data_cfg.seed).shuffle(pairs)
    return pairs[:num_samples]


def _pairs_from_recipe(recipe: dict, split: str, num_samples: int, seed: int, key: str = "data",
                       name: str | None = None) -> list[TextPair]:
    if "families" in recipe:  # the offline synthetic suite
        from slimwise_train.data import synthetic

        which = "eval" if split in ("eval", "test", "validation") else "train"
        examples = synthetic.generate_from_recipe(recipe, split=which, n=num_samples)
        return [TextPair(e.prompt + recipe.get("separator", "\n"), e.answer, e.family) for e in examples]
    sources = recipe.get("sources") or []
    if not sources:
        raise ValueError(f"recipe {recipe.get('name')!r} lists no sources")
    total = sum(float(s.get("weight", 1.0)) for s in sources)
    pairs: list[TextPair] = []
    for position, src in enumerate(sources):
        if not (src.get("path") or src.get("id")):
            raise ValueError(f"recipe {name or recipe.get('name')!r}: sources[{position}] names neither a path nor "
                             "an id")
        want = max(1, round(num_samples * float(src.get("weight", 1.0)) / total))
        rows = _load_rows(src.get("path") or src["id"], src.get("split", split), src.get("subset"), key=key,
                          recipe=name or recipe.get("name"))
        got = []
        context = list(src.get("context_fields") or [])
        for row in rows:
            pair = row_to_pair(row, src.get("text_field"), family=src.get("family", src.get("id", "")))
            if pair is not None:
                prefix = "".join(f"{name}: {row[name]}\n" for name in context if row.get(name))
                got.append(TextPair(prefix + pair.prompt, pair.answer, pair.family) if prefix else pair)
            if len(got) >= want:
                break
        pairs.extend(got)
    return pairs


# --------------------------------------------------------------------------- tokenisation and batching


def encode_pair(tokenizer, pair: TextPair, chat_template: bool, max_len: int) -> tuple[list[int], int]:
    """Token ids of prompt+answer+EOS truncated to max_len, and the prompt length in tokens."""
    if chat_template and getattr(tokenizer, "chat_template", None) and pair.prompt:
        prompt_ids = tokenizer.apply_chat_template([{"role": "user", "content": pair.prompt}], add_generation_prompt=True,
                                                   tokenize=True)
        if isinstance(prompt_ids, dict):
            prompt_ids = prompt_ids["input_ids"]
    else:
        prompt_ids = tokenizer(pair.prompt, add_special_tokens=False)["input_ids"] if pair.prompt else []
    answer_ids = tokenizer(pair.answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    ids = (list(prompt_ids) + answer_ids)[:max_len]
    return ids, min(len(prompt_ids), len(ids))


def encode_all(tokenizer, pairs: list[TextPair], data_cfg) -> list[tuple[list[int], int]]:
    """Token ids per pair, truncated to data.seq_len (how many were cut is logged, never silent)."""
    encoded, truncated = [], 0
    for pair in pairs:
        ids, prompt_len = encode_pair(tokenizer, pair, data_cfg.chat_template, 1 << 62)
        if len(ids) > data_cfg.seq_len:
            truncated += 1
            ids, prompt_len = ids[: data_cfg.seq_len], min(prompt_len, data_cfg.seq_len)
        if ids:
            encoded.append((ids, prompt_len))
    if not encoded:
        raise ValueError(f"data source {data_cfg.source!r}: every sequence tokenised to nothing")
    if truncated and du.is_rank0():  # every rank encodes the same rows: say it once
        log.warning("data %s: truncated %d of %d sequences to data.seq_len=%d tokens", data_cfg.source, truncated,
                    len(pairs), data_cfg.seq_len)
    return encoded


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
    shard = [seq for i, (seq, _) in enumerate(encoded) if i % world_size == rank]
    shard.sort(key=len)
    for start in range(0, len(shard), batch_size):
        yield pad_batch(shard[start : start + batch_size], pad_id)


def num_batches(num_sequences: int, batch_size: int, rank: int = 0, world_size: int = 1) -> int:
    mine = len(range(rank, num_sequences, world_size))
    return -(-mine // batch_size)

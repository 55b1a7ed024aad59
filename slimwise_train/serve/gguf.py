"""HF checkpoint folder -> GGUF, through llama.cpp's own `convert_hf_to_gguf.py`, run unchanged in a subprocess.

What this module adds around the converter, and why:

* **Byte-level vocabulary.** llama.cpp reads every "gpt2"-model vocabulary as byte-level (GPT-2's bytes-to-unicode
  alphabet: a space is `Ġ`). A BPE vocabulary that stores raw characters (the project's own tokenizer does) loads
  with only a warning and then drops every space. Such a tokenizer is rewritten, in a staging copy of the folder,
  to the byte-level form with the same ids and merges, and the rewrite is checked to tokenize exactly as the
  original before the converter sees it.
* **An explicit pre-tokenizer.** The converter recognises a tokenizer by hashing its output on a fixed text and
  refuses unknown hashes. The project's tokenizer (letter runs with an optional leading space; every other
  character alone) maps to llama.cpp's `default` pre-tokenizer, whose first pass splits punctuation and whose
  second keeps ` ?letters` together: the same chunks wherever merges exist. Any other unrecognised tokenizer needs
  `--pre-tokenizer NAME`; nothing is guessed. Either way the GGUF's tokenization is compared with transformers' on
  `check_texts` after conversion, and a difference is an error (the file is not kept).
* **A cache fingerprint.** llama.cpp accepts any sequence state whose tensor shapes fit. The handoff (handoff.py)
  must refuse a state written by another model's attention, so `slimwise.cache_fingerprint` records a SHA-256 of
  the weights that write the KV cache and that pruning and distillation never change (token embeddings and the
  attention projections, not norms), as float32 values so the storage dtype and the GGUF type do not matter.

Writes are atomic: the GGUF appears complete under its name or not at all, and never over a file that appeared
meanwhile unless `overwrite`. Everything that can be checked before the conversion is (the folder is a supported
MoE checkpoint with intact weight files, the outfile is writable, new and none of the inputs), each a one-line
error; the converter runs as a child that dies with this process, and a later conversion removes what a killed one
left (its temporary GGUF beside the outfile, its staging folder).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Iterator, Sequence

from slimwise_train.utils.atomic import atomic_path, owner_tag, pid_alive, remove_stale_temporaries

OUTTYPES = ("f32", "f16", "bf16", "q8_0")
FORMAT = "slimwise-gguf/1"
# The project's tokenizer (slimwise_train/data/tokenizer.py) and the llama.cpp pre-tokenizer that chunks text the
# same way wherever its vocabulary has merges (see the module docstring); checked on every conversion anyway.
PROJECT_PRETOKENIZER_PATTERN = r" ?[A-Za-z]+|[^A-Za-z]"
PROJECT_PRETOKENIZER = "default"
UNRECOGNISED_EXIT = 3  # the converter wrapper's exit code for "pre-tokenizer not recognised"


# ------------------------------------------------------------------------------------------------ byte level
@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (the alphabet of every byte-level BPE vocabulary)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def _byte_level(text: str) -> str:
    table = bytes_to_unicode()
    return "".join(table[b] for b in text.encode("utf-8"))


def _components(node) -> list[dict]:
    """The parts of a tokenizer.json pre-tokenizer or decoder, a Sequence flattened (a pre-tokenizer Sequence lists
    `pretokenizers`, a decoder Sequence `decoders`: Gemma's byte-fallback decoder is one)."""
    if not node:
        return []
    if node.get("type") != "Sequence":
        return [node]
    return [c for item in node.get("pretokenizers") or node.get("decoders") or [] for c in _components(item)]


def is_byte_level(tokenizer_json: dict) -> bool:
    """Whether a tokenizer.json's BPE vocabulary is in GPT-2's byte-level alphabet (a ByteLevel pre-tokenizer or
    decoder says so); non-BPE models (SentencePiece, WordPiece) are not this module's concern."""
    parts = _components(tokenizer_json.get("pre_tokenizer")) + _components(tokenizer_json.get("decoder"))
    return any(p.get("type") == "ByteLevel" for p in parts)


def to_byte_level(tokenizer_json: dict) -> dict:
    """The same BPE tokenizer with its vocabulary and merges in the byte-level alphabet: the original
    pre-tokenizer, then ByteLevel without its own regex; a ByteLevel decoder. Ids are unchanged; special (added)
    tokens keep their text."""
    model = tokenizer_json["model"]
    if model.get("type") != "BPE":
        raise ValueError(f"tokenizer.json model is {model.get('type')}, not BPE: no byte-level rewrite applies")
    special = {t["content"] for t in tokenizer_json.get("added_tokens", [])}
    vocab = {(t if t in special else _byte_level(t)): i for t, i in model["vocab"].items()}
    if len(vocab) != len(model["vocab"]):
        raise ValueError("tokenizer.json: two tokens map to the same byte-level text; cannot rewrite the vocabulary")
    merges = []
    for merge in model.get("merges", []):
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        merges.append([_byte_level(left), _byte_level(right)])
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    original = tokenizer_json.get("pre_tokenizer")
    pre = {"type": "Sequence", "pretokenizers": ([original] if original else []) + [byte_level]}
    return {**tokenizer_json, "pre_tokenizer": pre, "decoder": byte_level,
            "model": {**model, "vocab": vocab, "merges": merges}}


def project_check_texts(n_per_family: int = 100) -> list[str]:
    """Prompt + answer of the first held-out suite problems of every family (the texts the model serves)."""
    from slimwise_train.data import synthetic
    from slimwise_train.eval.generation import heldout_examples

    texts = []
    for family in synthetic.FAMILIES:
        for example in heldout_examples(family, n_per_family):
            prompt, answer = synthetic.to_text(example)
            texts.append(prompt + answer)
    return texts


PROBE_TEXTS = (
    "".join(chr(c) for c in range(32, 127)) + "\n\t",
    "it's 'data' don't  two  spaces\n\nnew line\tTab (x+y)*3 = 12.5; f(\"a b\") -> {'k': [1, 2]}",
    "   leading spaces, trailing spaces   ",
)


def _encode_all(tokenizer, texts: Sequence[str]) -> list[list[int]]:
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


# llama.cpp pre-tokenizers whose regex, adapted to llama.cpp's engine, leaves combining marks out of words (o200k's
# keeps them in: src/llama-vocab.cpp, LLAMA_VOCAB_PRE_TYPE_GPT4O): texts with such marks are reported, not refused.
MARKS_OUTSIDE_WORDS = ("gpt-4o",)
VARIED_CHECK_TEXTS = 200  # varied texts (code, CJK, emoji, numbers, whitespace runs, ...) every conversion checks
VARIED_CHECK_SEED = 20261207


def default_check_texts(folder: Path, log=print, tokenizer=None) -> tuple[list[str], list[str]]:
    """(checked, marked): what every conversion checks besides PROBE_TEXTS. `checked`: varied texts (data/probes.py)
    with the tokenizer's added tokens among them that the tokenizer decodes back exactly, NFC-normalised (llama.cpp
    does not apply a tokenizer's NFC normaliser, so text that is not in NFC can differ; the check covers text that
    is), and, where the tokenizer has a chat template, the probe conversations rendered by it (system, tools, tool
    calls, tool results, generation prompt). `marked`: the varied texts with a letter followed by a combining mark (Devanagari, Thai, a decomposed
    accent), kept apart: llama.cpp's gpt-4o pre-tokenizer splits words at such marks where o200k's regex does not,
    so a real GPT-OSS tokenizes them differently in llama.cpp; `convert` reports them for that pre-tokenizer
    (MARKS_OUTSIDE_WORDS) and refuses a difference for any other."""
    import regex
    from transformers import AutoTokenizer

    from slimwise_train.data.probes import chat_probe_texts, varied_texts

    tokenizer = tokenizer or AutoTokenizer.from_pretrained(folder)
    added = sorted(tokenizer.get_added_vocab())[:64]
    texts = varied_texts(VARIED_CHECK_TEXTS, VARIED_CHECK_SEED, added, nfc=True)
    # A vocabulary without bytes (the project's own) cannot hold every script: check what it writes back exactly.
    exact = [t for t in texts if tokenizer.decode(tokenizer.encode(t, add_special_tokens=False),
                                                  clean_up_tokenization_spaces=False) == t]
    if len(exact) < len(texts):
        log(f"gguf: {folder.name}: {len(texts) - len(exact)} of {len(texts)} varied check texts do not decode back "
            f"to themselves with this tokenizer (characters outside its vocabulary); checked on the other {len(exact)}")
    texts = exact
    mark = regex.compile(r"\p{L}\p{M}")
    marked = [t for t in texts if mark.search(t)]
    rendered, problems = chat_probe_texts(tokenizer)
    if problems and rendered == []:
        log(f"gguf: {folder.name}: {problems[0]}: tokenization checked on plain texts only")
    elif problems:
        log(f"gguf: {folder.name}: the chat template did not render {len(problems)} probe conversation(s) "
            f"({problems[0]}); checked on the {len(rendered)} it rendered")
    return [t for t in texts if not mark.search(t)] + rendered, marked


# ------------------------------------------------------------------------------------------------ fingerprint
def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / n for n in names]
    files = sorted(folder.glob("*.safetensors"))
    return [f for f in files if f.name not in ("student_trainable.safetensors",)]


def cache_fingerprint(folder: str | os.PathLike) -> str:
    """utils/fingerprint.py's fingerprint of a checkpoint folder: the one its export recorded (a distilled export
    records its teacher's, which differs from its own weights only where attention LoRA was merged), else computed
    from its safetensors, over the tensors the served text model loads under the names it loads them by: a
    multimodal checkpoint's text model (`text_model_name`) without its other towers, and no multi-token-prediction
    layer (the family adapter's `is_mtp_tensor`; exports drop them). So a teacher saved as the real checkpoint is
    (Qwen3.6's and Gemma 4's ConditionalGeneration layout, MTP tensors beside the trunk) and its pruned and distilled
    exports (the causal-LM class, no MTP) have the same fingerprint."""
    from safetensors import safe_open
    from transformers import AutoConfig

    from slimwise_train.moe.adapters import get_adapter
    from slimwise_train.utils.fingerprint import (cache_fingerprint_of, is_cache_tensor, is_multimodal_layout,
                                                  text_model_name)

    folder = Path(folder)
    record = folder / "slimwise_export.json"
    if record.is_file():
        recorded = json.loads(record.read_text()).get("cache_fingerprint")
        if recorded:
            return recorded
    files = _safetensors_files(folder)
    if not files:
        raise ValueError(f"no *.safetensors weights in {folder}")
    config = AutoConfig.from_pretrained(folder)
    adapter = get_adapter(config)
    names = {}
    for path in files:
        with safe_open(str(path), "pt") as handle:
            names[path] = list(handle.keys())
    multimodal = is_multimodal_layout(n for keys in names.values() for n in keys)

    def named():
        for path, keys in names.items():
            with safe_open(str(path), "pt") as handle:
                for name in keys:
                    served = None if adapter.is_mtp_tensor(name, config) else text_model_name(name, multimodal)
                    if served is not None and is_cache_tensor(served):
                        yield served, handle.get_tensor(name)

    return cache_fingerprint_of(named())


def _role(folder: Path) -> str:
    """full | pruned | distilled, from the record the project writes beside its checkpoints (prune's export/ holds
    slimwise_keep_set.json, a distilled export slimwise_export.json)."""
    if (folder / "slimwise_export.json").is_file():
        return "distilled"
    return "pruned" if (folder / "slimwise_keep_set.json").is_file() else "full"


# ------------------------------------------------------------------------------------------------ checks before work
def _bad_weights(path: Path, why: str) -> ValueError:
    return ValueError(f"{path} is truncated or corrupt ({why}): copy or export the checkpoint again")


def _check_safetensors(path: Path) -> None:
    """The file holds the whole of what its header lists (a truncated copy does not): read from the header alone."""
    size = path.stat().st_size
    with open(path, "rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            raise _bad_weights(path, f"{size} bytes, shorter than a safetensors header")
        length = int.from_bytes(head, "little")
        if length > size - 8:
            raise _bad_weights(path, f"its header claims {length} bytes, the file holds {size}")
        try:
            header = json.loads(handle.read(length))
            end = max((int(entry["data_offsets"][1]) for key, entry in header.items() if key != "__metadata__"),
                      default=0)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            raise _bad_weights(path, "its header is not a safetensors header") from None
    if 8 + length + end != size:
        raise _bad_weights(path, f"{size} bytes where its header lists {8 + length + end}")


def _check_weight_files(folder: Path) -> None:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise _bad_weights(index, "not a weight map") from None
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise ValueError(f"{folder} lacks {missing[0]} (listed in {index.name}): copy or export the checkpoint "
                             "again")
    files = _safetensors_files(folder)
    if not files:
        raise ValueError(f"{folder} has no *.safetensors weights: save the model with save_pretrained (the project's "
                         "apps do)")
    for path in files:
        _check_safetensors(path)


def _check_convertible(folder: Path) -> None:
    """One line, before any work, for a folder this conversion cannot serve: a distilled export with a remote-code
    class, a model that is not a supported MoE, weight files missing or truncated."""
    from slimwise_train.moe.adapters import SUPPORTED_FAMILIES, get_adapter

    try:
        config = json.loads((folder / "config.json").read_text())
    except ValueError as error:
        raise ValueError(f"{folder}/config.json is not JSON ({error}): copy or export the checkpoint again") from None
    model_type = str(config.get("model_type", ""))
    if config.get("auto_map"):  # a class of its own in the folder: the new-shared-expert student's export
        raise ValueError(f"{folder} holds remote code (an auto_map in config.json, model_type {model_type!r}): a "
                         "distilled export with a new shared expert (distill.student.shared_expert_mode=new) is a "
                         "class of its own, which llama.cpp's "
                         "converter cannot read; distill with the default student (LoRA merged into the kept experts: "
                         "a stock class) to serve it in llama.cpp")
    from transformers import AutoConfig

    try:
        get_adapter(AutoConfig.from_pretrained(folder))
    except (ValueError, KeyError, OSError):
        raise ValueError(f"{folder} is not an MoE model of a supported family (model_type {model_type!r}): `serve "
                         "gguf` converts a teacher, prune's export/ or a distilled export/ of "
                         f"{', '.join(SUPPORTED_FAMILIES)}") from None
    _check_weight_files(folder)


def _check_outfile(outfile: Path, folder: Path, overwrite: bool) -> None:
    """The outfile is a file name in an existing, writable folder, new unless `overwrite`, and never one of the
    folder's files (followed through links: the staging copy links to them)."""
    if outfile.is_dir():
        raise ValueError(f"--outfile {outfile} is a folder: name the .gguf file to write")
    if not outfile.parent.is_dir():
        raise ValueError(f"the folder of --outfile does not exist: {outfile.parent}")
    try:
        with tempfile.TemporaryFile(dir=outfile.parent):  # nothing left behind, whatever happens next
            pass
    except OSError as error:
        raise ValueError(f"the folder of --outfile {outfile.parent} is not writable ({error.strerror}): choose "
                         "another --outfile") from None
    if outfile.exists():
        inputs = [item for item in folder.iterdir() if item.exists()]
        same = next((item for item in inputs if os.path.samefile(item, outfile)), None)
        if same is not None:
            raise ValueError(f"--outfile {outfile} is {same.name} of {folder} (the same file), an input of this "
                             "conversion: it would replace it; choose another --outfile")
        if not overwrite:
            raise ValueError(f"{outfile} exists: pass --overwrite or another --outfile")


def _check_pre_tokenizer(name: str) -> None:
    from slimwise_train.serve.llamacpp import pre_tokenizer_names

    names = pre_tokenizer_names()
    if name not in names:
        raise ValueError(f"--pre-tokenizer {name!r} is not a pre-tokenizer this llama.cpp knows; use one of: "
                         f"{', '.join(names)}")


# ------------------------------------------------------------------------------------------------ process handling
STAGING_PREFIX = "slimwise-gguf-"


def remove_leftovers(outfile: Path) -> list[str]:
    """What conversions killed outright (kill -9) left behind: their temporary GGUF beside `outfile` and their staging
    folders, those of processes of this host that no longer run (a live conversion's are left alone)."""
    removed = remove_stale_temporaries(outfile)
    host = owner_tag().split(".")[0]
    pattern = re.compile(re.escape(STAGING_PREFIX) + re.escape(host) + r"\.(\d+)-.*")
    for folder in Path(tempfile.gettempdir()).glob(f"{STAGING_PREFIX}{host}.*"):
        match = pattern.fullmatch(folder.name)
        if match and folder.is_dir() and not pid_alive(int(match.group(1))):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(str(folder))
    return removed


@contextlib.contextmanager
def _output(outfile: Path, overwrite: bool) -> Iterator[Path]:
    """The temporary the GGUF is written to (`.<name>.<host>.<pid>.<random>.tmp`), published as `outfile` when the
    block succeeds: replacing it only with `overwrite`; a file another run published there
    meanwhile is kept and this run's result is refused (FileExistsError)."""
    try:
        with atomic_path(outfile, replace=overwrite) as tmp:
            yield tmp
    except FileExistsError:
        if not outfile.exists():
            raise
        raise FileExistsError(f"{outfile} was written by another run while this one converted: that file is kept "
                              "and this conversion is not written (pass --overwrite to replace it)") from None


def _run_converter(command: list[str]) -> subprocess.CompletedProcess:
    """The converter as a child in its own session that dies with this process (a kill -9 of this one leaves no
    orphan writing a GGUF); stopped and reaped when this process stops waiting for it (Ctrl-C)."""
    from slimwise_train.serve.server import die_with_parent

    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=die_with_parent)
    try:
        out, err = proc.communicate()
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def _converter_failure(folder: Path, proc: subprocess.CompletedProcess) -> RuntimeError:
    """One line from the converter's output (its last line: the exception it stopped on); all of it with
    SLIMWISE_LLAMA_CPP_VERBOSE=1."""
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    if os.environ.get("SLIMWISE_LLAMA_CPP_VERBOSE") == "1":
        sys.stderr.write(proc.stderr)
        hint = ""
    else:
        hint = " (SLIMWISE_LLAMA_CPP_VERBOSE=1 shows its whole output)"
    last = lines[-1].strip() if lines else "no output"
    return RuntimeError(f"llama.cpp's converter failed on {folder} (exit {proc.returncode}): {last[:300]}{hint}")


# ------------------------------------------------------------------------------------------------ conversion
def _stage(folder: Path, staging: Path, pre_tokenizer: str | None) -> tuple[str | None, bool]:
    """Symlink `folder` into `staging`, rewriting tokenizer.json to byte level where needed. Returns (the
    pre-tokenizer to force or None, whether the tokenizer was rewritten)."""
    for item in folder.iterdir():
        if item.name != "tokenizer.json":
            (staging / item.name).symlink_to(item.resolve())
    tok_file = folder / "tokenizer.json"
    if not tok_file.is_file():
        raise ValueError(f"{folder} has no tokenizer.json: save the tokenizer beside the weights (the project's apps do)")
    tok = json.loads(tok_file.read_text())
    components = _components(tok.get("pre_tokenizer"))
    is_project = any(c.get("type") == "Split" and (c.get("pattern") or {}).get("Regex") == PROJECT_PRETOKENIZER_PATTERN
                     for c in components)
    # A SentencePiece-style BPE (spaces as "▁", byte fallback: Llama, Gemma) is read by llama.cpp as such, not as a
    # byte-level vocabulary: only a raw-character BPE without byte fallback (the project's) needs the rewrite.
    model = tok.get("model", {})
    rewritten = model.get("type") == "BPE" and not is_byte_level(tok) and not model.get("byte_fallback")
    if rewritten:
        tok = to_byte_level(tok)
    (staging / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    if pre_tokenizer is None and is_project:
        pre_tokenizer = PROJECT_PRETOKENIZER
    return pre_tokenizer, rewritten


def _check_rewrite(original: Path, staged: Path, texts: Sequence[str]) -> None:
    from transformers import AutoTokenizer

    a = AutoTokenizer.from_pretrained(original)
    b = AutoTokenizer.from_pretrained(staged)
    bad = [t for t, x, y in zip(texts, _encode_all(a, texts), _encode_all(b, texts)) if x != y]
    if bad:
        raise RuntimeError(f"the byte-level rewrite of {original}/tokenizer.json tokenizes {len(bad)} of {len(texts)} "
                           f"check texts differently (first: {bad[0][:80]!r}); this tokenizer cannot be converted")


def _equal(model, tokenizer, texts: Sequence[str]) -> int:
    return sum(model.tokenize(t, parse_special=True) == ids for t, ids in zip(texts, _encode_all(tokenizer, texts)))


def check_tokenization(gguf_file: str | os.PathLike, hf_folder: str | os.PathLike, texts: Sequence[str]) -> tuple[int, int]:
    """(equal, total): texts that llama.cpp tokenizes to the same ids as transformers (no special tokens added,
    special-token text parsed by both)."""
    from transformers import AutoTokenizer

    equal, _, _ = tokenization_report(gguf_file, AutoTokenizer.from_pretrained(hf_folder), texts)
    return equal, len(texts)


def tokenization_report(gguf_file: str | os.PathLike, tokenizer, texts: Sequence[str],
                        marked: Sequence[str] = ()) -> tuple[int, int, dict]:
    """(texts equal, texts with combining marks equal, the GGUF's metadata): `check_tokenization` against a loaded
    tokenizer, and what `convert` logs of the vocabulary llama.cpp wrote."""
    from slimwise_train.serve.llamacpp import GGUFModel

    with GGUFModel(gguf_file, vocab_only=True) as model:
        return _equal(model, tokenizer, texts), _equal(model, tokenizer, marked), model.metadata()


def convert(
    folder: str | os.PathLike,
    outfile: str | os.PathLike,
    outtype: str = "f32",
    pre_tokenizer: str | None = None,
    check_texts: Iterable[str] | None = None,
    overwrite: bool = False,
    log=print,
) -> Path:
    """Convert an HF checkpoint folder (a teacher, a pruned checkpoint or a distilled export) to one GGUF file.

    `check_texts`: texts whose llama.cpp tokenization must equal transformers', besides the built-in probes, the
    varied texts and the chat template's renders of the probe conversations (`default_check_texts`), and the suite's
    300 held-out problems when the tokenizer is the project's. Raises ValueError with one line
    on bad input, RuntimeError when the converter or the tokenization check fails; the outfile is then not written.
    """
    from transformers import AutoTokenizer

    from slimwise_train.serve.llamacpp import source_dir

    folder, outfile = Path(folder), Path(outfile)
    if outtype not in OUTTYPES:
        raise ValueError(f"--outtype {outtype!r}: use one of {', '.join(OUTTYPES)}")
    if not (folder / "config.json").is_file():
        raise ValueError(f"{folder} is not an HF checkpoint folder (no config.json): pass the folder save_pretrained "
                         "wrote (a teacher, prune's export/ or a distilled export/)")
    _check_outfile(outfile, folder, overwrite)
    if pre_tokenizer is not None:
        _check_pre_tokenizer(pre_tokenizer)
    _check_convertible(folder)
    source = source_dir()
    removed = remove_leftovers(outfile)
    if removed:
        log(f"gguf: removed what a killed conversion left: {', '.join(removed)}")

    with _output(outfile, overwrite) as tmp_out, \
            tempfile.TemporaryDirectory(prefix=f"{STAGING_PREFIX}{owner_tag()}-") as tmp:
        staging = Path(tmp) / folder.name
        staging.mkdir()
        pre, rewritten = _stage(folder, staging, pre_tokenizer)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        checked, marked = default_check_texts(folder, log, tokenizer)
        texts = list(PROBE_TEXTS) + checked
        if check_texts is not None:
            texts += list(check_texts)
        elif pre == PROJECT_PRETOKENIZER and pre_tokenizer is None:
            texts += project_check_texts()
        if rewritten:
            log(f"gguf: {folder.name}: the BPE vocabulary is not byte-level; converting a byte-level rewrite of it "
                "(same ids, checked equal on the check texts)")
            _check_rewrite(folder, staging, texts)
        metadata = {
            "slimwise.format": FORMAT,
            "slimwise.cache_fingerprint": cache_fingerprint(folder),
            "slimwise.role": _role(folder),
            "slimwise.source": folder.resolve().name,
        }
        log(f"gguf: {folder} -> {outfile} ({outtype}, role {metadata['slimwise.role']}, "
            f"pre-tokenizer {pre or 'chosen by llama.cpp'})")
        command = [sys.executable, "-m", "slimwise_train.serve._run_converter", "--source", str(source),
                   "--metadata-json", json.dumps(metadata), "--pre-tokenizer", pre or "",
                   "--", str(staging), "--outfile", str(tmp_out), "--outtype", outtype]
        proc = _run_converter(command)
        if proc.returncode == UNRECOGNISED_EXIT:
            from slimwise_train.serve.llamacpp import pre_tokenizer_names

            raise ValueError(f"llama.cpp does not recognise the pre-tokenizer of {folder}/tokenizer.json: pass "
                             f"--pre-tokenizer NAME, one of this llama.cpp's: {', '.join(pre_tokenizer_names())} "
                             "(the tokenization is then checked against transformers)")
        if proc.returncode != 0:
            raise _converter_failure(folder, proc)
        equal, marked_equal, meta = tokenization_report(tmp_out, tokenizer, texts, marked)
        total = len(texts)
        if equal != total:
            raise RuntimeError(f"the GGUF of {folder} tokenizes {total - equal} of {total} check texts differently "
                               f"from transformers (pre-tokenizer {pre!r}): not written; try another "
                               "--pre-tokenizer")
        vocabulary, named = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre")
        how = ("as given" if pre else "recognised from the tokenizer") if named else "set by the vocabulary type"
        log(f"gguf: tokenization equal to transformers on {equal}/{total} check texts (llama.cpp vocabulary "
            f"{vocabulary}, pre-tokenizer {named or vocabulary} {how})")
        equal, total = marked_equal, len(marked)
        if equal != total and named not in MARKS_OUTSIDE_WORDS:
            raise RuntimeError(f"the GGUF of {folder} tokenizes {total - equal} of {total} texts with combining "
                               f"marks differently from transformers (pre-tokenizer {named!r}): not written; try "
                               "another --pre-tokenizer")
        if total:
            log(f"gguf: and on {equal}/{total} texts with combining marks" + ("" if equal == total else
                f": llama.cpp's {named} pre-tokenizer splits words at combining marks where this tokenizer does "
                "not (not refused: the real model has the same difference in llama.cpp; check your languages)"))
    return outfile

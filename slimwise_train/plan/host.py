"""Host memory of a CPU run that the architecture does not determine: the tokenizer.

A real vocabulary's fast tokenizer keeps hundreds of MiB in the process (the Qwen3.6 twin's 248,077 tokens: 344 MiB
retained after loading, 2026-12-07), while the planner's calibrated runtime (plan/memory.py, CPU_RUNTIME_MIB) was
fitted on runs with the shipped 384-token one. So a CPU plan adds what the run's tokenizer keeps beyond the shipped
one's, measured: each is loaded in a fresh process and its resident memory after loading (not the load's transient
peak) minus before is the figure. A GPU plan leaves it out: it is host memory, not the GPU's.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from slimwise_train.models import SHIPPED_TOKENIZER
from slimwise_train.utils.hf import resolve_path

# Loads the tokenizer as the trainer does (AutoTokenizer.from_pretrained) once transformers is imported (its import
# is in the baseline, not the tokenizer's), and prints the resident bytes the tokenizer added.
_MEASURE = """
import gc, os, sys
import transformers
from transformers import AutoTokenizer

def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

gc.collect()
before = resident()
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
gc.collect()
print(resident() - before)
"""


def _has_tokenizer(folder: Path) -> bool:
    return folder.is_dir() and any((folder / name).is_file() for name in
                                   ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))


def resident_bytes_of_tokenizer(folder: str | Path) -> int:
    """Resident bytes a fresh process keeps after loading the tokenizer in `folder` (Linux: /proc/self/statm)."""
    proc = subprocess.run([sys.executable, "-c", _MEASURE, str(folder)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    if proc.returncode != 0:
        raise RuntimeError(f"measuring the tokenizer of {folder} failed: {proc.stderr.strip().splitlines()[-1:]}")
    return max(0, int(proc.stdout.strip().splitlines()[-1]))


def tokenizer_beyond_shipped(model_cfg) -> tuple[int, str]:
    """(bytes, what) the run's tokenizer keeps beyond the shipped one's, for a CPU plan. 0 when the run uses the
    shipped tokenizer (a tiny preset) or when no local folder holds its tokenizer (a hub id: the planner stays
    offline, and says it did not count it)."""
    source = resolve_path(model_cfg.get("tokenizer") or model_cfg.get("path"))  # as models.load_tokenizer finds it
    if source is None:
        return 0, "the shipped tokenizer (inside the calibrated runtime)"
    folder = Path(str(source)).expanduser()
    if not _has_tokenizer(folder):
        return 0, f"not counted: {source} is not a local folder with a tokenizer"
    if not Path("/proc/self/statm").is_file():
        return 0, "not counted: measured through /proc (Linux only)"
    shipped_file, own_file = Path(SHIPPED_TOKENIZER) / "tokenizer.json", folder / "tokenizer.json"
    if own_file.is_file() and own_file.read_bytes() == shipped_file.read_bytes():  # the teacher's is the shipped one
        return 0, "the shipped tokenizer (inside the calibrated runtime)"
    own = resident_bytes_of_tokenizer(folder)
    shipped = resident_bytes_of_tokenizer(SHIPPED_TOKENIZER)
    return max(0, own - shipped), (f"{folder.name}'s tokenizer, measured: {own / (1 << 20):.0f} MiB resident after "
                                   f"loading, minus the shipped one's {shipped / (1 << 20):.0f}")

"""Training checkpoints: written atomically, resumed from the newest complete one.

    output_dir/checkpoints/step_000040/
        trainable.safetensors   every trainable tensor, full (gathered), fp32
        optimizer.pt, scheduler.pt     engine=torch (replicated state; rank 0 writes)
        deepspeed/              engine=zero*: DeepSpeed's own layout (each rank writes its optimizer partition)
        rng.pt                  every rank's torch / python / numpy (/ cuda) RNG state, gathered to rank 0
        trainer_state.json      step, data position, counters, run fingerprint
        checksums.json          sha256 of every file above, verified on resume
        complete                written last

Atomicity: all ranks write into `checkpoints/.step_000040.tmp/` (rank 0 clears a stale one first) and rank 0
renames it to `step_000040` only after every rank is done and the marker is written, so a process killed at any
point leaves either the previous checkpoints or a `.tmp` folder that is ignored and cleaned up later. Only the
newest `keep` complete checkpoints are kept. Assumes the ranks share the filesystem (one node, or a shared disk).

Resume verifies the checksums: with resume=auto a corrupt newest checkpoint (a truncated file, a disk error)
is skipped with a warning for the newest one that verifies; an explicit resume=<folder> that fails is an error.

The run folder (checked before anything is written, `check_run_folder`): a folder whose checkpoints (or own
keep_set.json) record another keep set is not continued with this one. resume=never starts the folder over: the
earlier run's files move, each by one rename, into `<output_dir>/replaced/<time>/` (`set_aside_previous_run`), so
no later resume=auto finds its checkpoints and metrics.jsonl never holds two runs; nothing of it is deleted.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from slimwise_train.moe.keepset import KeepSet
from slimwise_train.moe.keepset_rules import keep_set_difference
from slimwise_train.utils import distributed as du
from slimwise_train.utils.atomic import honour_umask
from slimwise_train.utils.cli import MachineFault

MARKER = "complete"
REPLACED = "replaced"  # where resume=never moves an earlier run's files
CHECKSUMS = "checksums.json"
PREFIX = "step_"
log = logging.getLogger("slimwise.train")


class CorruptCheckpoint(ValueError):
    pass


class CheckpointWriteError(MachineFault):
    pass


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def write_checksums(folder: Path) -> None:
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name not in (CHECKSUMS, MARKER))
    sums = {str(p.relative_to(folder)): _sha256(p) for p in files}
    (folder / CHECKSUMS).write_text(json.dumps(sums, indent=1, sort_keys=True) + "\n")


def verify_checkpoint(path: Path) -> None:
    """Raise CorruptCheckpoint naming the first problem: a missing marker, state or file, a changed checksum."""
    if not (path / MARKER).is_file():
        raise CorruptCheckpoint(f"{path}: not a complete checkpoint folder (no '{MARKER}' marker)")
    if not (path / "trainer_state.json").is_file():
        raise CorruptCheckpoint(f"{path}: trainer_state.json is missing")
    if not (path / CHECKSUMS).is_file():
        raise CorruptCheckpoint(f"{path}: {CHECKSUMS} is missing (written by every checkpoint since 2026-12-01)")
    try:
        sums = json.loads((path / CHECKSUMS).read_text())
    except json.JSONDecodeError as exc:
        raise CorruptCheckpoint(f"{path}: {CHECKSUMS} is unreadable ({exc})") from None
    if not isinstance(sums, dict) or not all(isinstance(v, str) for v in sums.values()):
        raise CorruptCheckpoint(f"{path}: {CHECKSUMS} is not a mapping of file names to sha256 digests")
    present = {str(p.relative_to(path)) for p in path.rglob("*") if p.is_file() and p.name not in (CHECKSUMS, MARKER)}
    unlisted = sorted(present - set(sums))
    if unlisted:  # an emptied or edited checksums.json must not make a checkpoint "verify" by listing nothing
        raise CorruptCheckpoint(f"{path}: {CHECKSUMS} does not cover {', '.join(unlisted[:3])}"
                                f"{' and more' if len(unlisted) > 3 else ''}")
    for name, expected in sums.items():
        file = path / name
        if not file.is_file():
            raise CorruptCheckpoint(f"{path}: {name} is missing")
        if _sha256(file) != expected:
            raise CorruptCheckpoint(f"{path}: {name} does not match its checksum (truncated or corrupted)")


def step_dir_name(step: int) -> str:
    return f"{PREFIX}{step:06d}"


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, path) of complete checkpoints under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        if path.is_dir() and path.name.startswith(PREFIX) and (path / MARKER).is_file():
            try:
                found.append((int(path.name[len(PREFIX):]), path))
            except ValueError:
                continue
    return sorted(found)


def newest_checkpoint(root: Path) -> Path | None:
    found = complete_checkpoints(root)
    return found[-1][1] if found else None


def resolve_resume(resume: str, root: Path) -> Path | None:
    """resume: auto -> newest checkpoint that verifies (or None); never -> None; else that folder, verified.

    Rank 0 verifies and decides; every rank gets the same answer."""
    if resume == "never":
        return None
    choice = _choose_resume(resume, root) if du.is_rank0() else None
    choice = du.broadcast_object(choice)
    if isinstance(choice, dict):  # rank 0 found the explicit folder unusable
        raise ValueError(choice["error"])
    return None if choice is None else Path(choice)


def _choose_resume(resume: str, root: Path):
    if resume != "auto":
        try:
            verify_checkpoint(Path(resume))
        except CorruptCheckpoint as exc:
            return {"error": f"resume={resume}: {exc}; pick another checkpoint or resume=never"}
        return str(resume)
    skipped = []
    for _, path in reversed(complete_checkpoints(root)):
        try:
            verify_checkpoint(path)
        except CorruptCheckpoint as exc:
            log.warning("skipping checkpoint %s: %s", path.name, exc)
            skipped.append(path.name)
            continue
        if skipped:
            log.warning("resuming from %s instead of the newer %s, which failed verification", path.name,
                        ", ".join(skipped))
        return str(path)
    if skipped:
        log.warning("no checkpoint in %s verifies (%s): starting from step 0", root, ", ".join(skipped))
    return None


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def gather_objects(obj) -> list:
    """`obj` from every rank, in rank order (a one-element list without a process group)."""
    if not du.is_initialized():
        return [obj]
    out = [None] * du.world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


def save_checkpoint(root: Path, step: int, engine, trainer_state: dict, keep: int, before_rename=None) -> Path:
    """Collective: every rank calls it. Returns the final folder."""
    final = root / step_dir_name(step)
    tmp = root / f".{step_dir_name(step)}.tmp"
    if du.is_rank0():
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    du.barrier()
    try:
        _write_checkpoint(root, final, tmp, step, engine, trainer_state, keep, before_rename)
    except Exception as exc:
        if not du.is_rank0():
            raise
        # A full disk (or any failed write) must not leave half a checkpoint behind: the published ones stay intact.
        free = shutil.disk_usage(root).free if root.exists() else 0
        shutil.rmtree(tmp, ignore_errors=True)
        cause = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CheckpointWriteError(
            f"writing checkpoint {final.name} in {root} failed ({cause}; {free / 2**20:.0f} MiB free on that disk); "
            "the earlier checkpoints are intact and the partial one was removed: free space (or set another "
            "output_dir) and rerun with resume=auto to continue from the newest") from exc
    du.barrier()
    return final


def _write_checkpoint(root: Path, final: Path, tmp: Path, step: int, engine, trainer_state: dict, keep: int,
                      before_rename) -> None:
    trainable = engine.trainable_state_dict()  # collective under ZeRO-3
    engine.save(tmp)  # collective under DeepSpeed
    rng_states = gather_objects(rng_state())
    du.barrier()
    if du.is_rank0():
        save_file({k: v.contiguous() for k, v in trainable.items()}, str(tmp / "trainable.safetensors"))
        torch.save(rng_states, tmp / "rng.pt")
        (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=2) + "\n")
        write_checksums(tmp)
        honour_umask(tmp)  # safetensors writes 0600 whatever the umask
        _fsync_tree(tmp)
        if before_rename is not None:  # test hook: die with a finished but unpublished folder
            before_rename(tmp)
        (tmp / MARKER).write_text(f"step {step}\n")
        if final.exists():
            old = root / f".{final.name}.old"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _prune(root, keep)


def _fsync_tree(path: Path) -> None:
    for file in path.rglob("*"):
        if file.is_file():
            with open(file, "rb") as handle:
                os.fsync(handle.fileno())


def _prune(root: Path, keep: int) -> None:
    for _, path in complete_checkpoints(root)[: -keep] if keep > 0 else []:
        shutil.rmtree(path, ignore_errors=True)
    for path in root.iterdir():
        # Leftovers of killed writers (never published).
        if path.name.startswith(".") and path.name.endswith((".tmp", ".old")) and path.is_dir():
            shutil.rmtree(path, ignore_errors=True)


def load_checkpoint(path: Path, engine) -> dict:
    """Restore trainable tensors, optimizer, scheduler and this rank's RNG; returns trainer_state."""
    state = json.loads((path / "trainer_state.json").read_text())
    trainable = load_file(str(path / "trainable.safetensors"))
    engine.load(path, trainable)
    rng_states = torch.load(path / "rng.pt", map_location="cpu", weights_only=False)
    if len(rng_states) == du.world_size():
        set_rng_state(rng_states[du.rank()])
    else:  # another world size: RNG streams cannot map one to one; data order and splits do not depend on them
        set_rng_state(rng_states[0])
    return state


# ----------------------------------------------------------------------------------------------- the run folder
def recorded_keep_sets(output_dir: Path, resume: str) -> list[tuple[Path, KeepSet]]:
    """(file, KeepSet) of every keep set the run folder records: its keep_set.json and each complete checkpoint's
    trainer_state.json (and resume=<checkpoint>'s). Unreadable states are left to resume's verification."""
    recorded: list[tuple[Path, KeepSet]] = []
    folder_keep = output_dir / "keep_set.json"
    if folder_keep.is_file():
        recorded.append((folder_keep, KeepSet.load(folder_keep, require_model_type=False)))
    checkpoints = [path for _, path in complete_checkpoints(output_dir / "checkpoints")]
    if resume not in ("auto", "never"):
        checkpoints.append(Path(resume))
    for path in checkpoints:
        state_file = path / "trainer_state.json"
        try:
            state = json.loads(state_file.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(state, dict) and state.get("keep_set"):
            recorded.append((state_file, KeepSet.from_dict(state["keep_set"], f"{state_file}: keep_set",
                                                           require_model_type=False)))
    return recorded


def check_run_folder(output_dir: Path, keep_set: KeepSet, resume: str) -> None:
    """Unless resume=never, a run folder (or resume=<checkpoint>) trained with another keep set is refused before
    anything is written: continuing it would train one keep set on another's checkpoint and leave a folder describing
    two runs."""
    if resume == "never":
        return
    for where, other in recorded_keep_sets(Path(output_dir), resume):
        if not other.same_experts(keep_set):
            raise ValueError(
                f"output_dir {output_dir} holds a run trained with another keep set ({where} records "
                f"{keep_set_difference(other, keep_set)}); resuming it would mix two runs in one folder: choose "
                "another output_dir, or resume=never to train this folder over from step 0 (the earlier run moves to "
                f"{Path(output_dir) / REPLACED})")


def set_aside_previous_run(output_dir: Path, names) -> Path | None:
    """resume=never in a folder an earlier run wrote: move its files among `names` (the trainer's outputs, checkpoints
    first) into `<output_dir>/replaced/<time>/`, each by one rename, and return that folder (None: nothing there).
    Rank 0, holding the folder's lock. Moving, not deleting: a resume=never typed by mistake loses nothing; the
    checkpoints move first, so a kill midway leaves no checkpoint of the earlier run where resume=auto looks."""
    output_dir = Path(output_dir)
    present = [name for name in names if (output_dir / name).exists()]
    if not present:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = output_dir / REPLACED / stamp
    suffix = 1
    while target.exists():
        suffix += 1
        target = output_dir / REPLACED / f"{stamp}-{suffix}"
    target.mkdir(parents=True)
    for name in present:
        os.replace(output_dir / name, target / name)
    log.warning("resume=never: the earlier run in %s (%s) moved to %s; delete it when it is no longer needed",
                output_dir, ", ".join(present), target)
    return target

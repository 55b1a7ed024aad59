"""An output folder owned by one live job: a lock with host and pid, checked writable at start, leftovers of
killed writers cleaned once the lock is held; and ranks that die with their launcher.

    with claim_output_dir(path):      # rank 0; refuses a folder a live job holds, takes over a stale lock
        ...
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import random
import shutil
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

from slimwise_train.utils.atomic import pid_alive

log = logging.getLogger("slimwise")
LOCK_NAME = ".slimwise.lock"


def check_writable(path: Path, what: str = "output folder", create: bool = True) -> None:
    """Create `path` and a file in it now, so an unwritable location fails at start, not at the first save.
    With create=False nothing is written: the nearest existing folder on the way must be writable."""
    path = Path(path)
    if not create:
        existing = next(p for p in (path, *path.parents) if p.exists())
        if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
            raise ValueError(f"{what} {path} cannot be created ({existing} is "
                             f"{'not a folder' if not existing.is_dir() else 'not writable'}); choose another one")
        return
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-check.", delete=True):
            pass
    except OSError as exc:
        raise ValueError(f"{what} {path} is not writable ({exc.strerror}); choose another one "
                         "(output_dir=... or hydra.run.dir=...)") from None


def check_outputs_spare_inputs(outputs: dict[str, Path], inputs: dict[str, str | None],
                               fix: str = "choose another output folder, or move the input out of it") -> None:
    """Refuse, before anything is written, a run whose outputs would replace one of its own inputs: an input path (a
    model folder, a tokenizer, a data file: `inputs`, {config key: path}) equal to, or inside, an output the run
    writes or replaces (`outputs`, {what: path}; a folder output is replaced whole). Files are compared as the
    filesystem knows them (a hard link or another spelling of the same file is the same file). Inputs that are not
    local paths (hub ids, recipe names) are skipped. `fix` ends the message."""
    resolved = {what: Path(os.path.realpath(path)) for what, path in outputs.items()}
    for key, value in inputs.items():
        if not value or not Path(str(value)).expanduser().exists():
            continue
        source = Path(os.path.realpath(Path(str(value)).expanduser()))
        for what, target in resolved.items():
            same = source == target or (target.exists() and os.path.samefile(source, target))
            if same or target in source.parents:
                raise ValueError(f"{key}={value} is {'' if same else 'inside '}{target}, which this run "
                                 f"writes ({what}): it would replace its own input; {fix}")


def _parse_lock(text: str) -> tuple[dict | None, str]:
    """(holder, "") for a lock naming a host and a pid, else (None, why it names no job)."""
    if not text.strip():
        return None, "it is empty"
    try:
        holder = json.loads(text)
    except json.JSONDecodeError:
        return None, f"it is not JSON: {text[:60]!r}"
    if not isinstance(holder, dict):
        return None, f"it is not a JSON object: {text[:60]!r}"
    host, pid = holder.get("host"), holder.get("pid")
    if isinstance(pid, str) and pid.isdigit():
        pid = int(pid)
    if not isinstance(host, str) or not host or isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        return None, f"it names no host and pid: {text[:60]!r}"
    return {**holder, "pid": pid}, ""


def _read_lock(lock: Path) -> dict | None:
    try:
        return _parse_lock(lock.read_text())[0]
    except (OSError, UnicodeDecodeError):
        return None


GUARD_NAME = LOCK_NAME + ".guard"
GUARD_TIMEOUT_S = 30.0


@contextlib.contextmanager
def _guarded(folder: Path) -> Iterator[bool]:
    """Hold an exclusive flock on `folder`/.slimwise.lock.guard while checking and taking (or releasing) the lock,
    so no two processes ever decide on the lock at once. flock works across hosts on NFS (as a POSIX lock) and is
    released by the kernel when its holder dies. The holder deletes the guard before unlocking it (nothing is left
    in the folder); whoever then gets the flock of an unlinked guard sees it is no longer the file at that path and
    retries. Yields False, after a warning, where the filesystem offers no flock: then only O_EXCL protects."""
    guard = folder / GUARD_NAME
    deadline = time.monotonic() + GUARD_TIMEOUT_S
    fd = None
    while fd is None:
        if time.monotonic() > deadline:  # held for far longer than a check takes
            raise ValueError(f"could not take the lock of {folder}: another process has held {guard} for over "
                             f"{GUARD_TIMEOUT_S:.0f} s (a stopped job?); stop it, or delete {guard} if none is "
                             "running")
        read_only = False
        try:
            fd = os.open(guard, os.O_RDWR | os.O_CREAT, 0o666)
        except PermissionError:  # another user's guard, in use right now: lock it through a read-only descriptor
            read_only = True
            with contextlib.suppress(FileNotFoundError):
                fd = os.open(guard, os.O_RDONLY)
            if fd is None:
                if not os.access(folder, os.W_OK | os.X_OK):  # not gone meanwhile: it cannot be created here
                    raise
                continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            same = os.path.samestat(os.fstat(fd), os.stat(guard))
        except (BlockingIOError, FileNotFoundError):  # held; or deleted by its holder before unlocking
            same = False
        except OSError as exc:
            # ESTALE: deleted by its holder on another NFS host; EBADF: NFS locks need a writable descriptor
            if exc.errno == errno.ESTALE or (read_only and exc.errno == errno.EBADF):
                same = False
            else:
                log.warning("cannot flock %s (%s): taking the lock of %s is not serialised between jobs on this "
                            "filesystem", guard, exc.strerror or exc, folder)
                os.close(fd)
                with contextlib.suppress(OSError):
                    guard.unlink()  # no flock on this filesystem: no one holds it
                fd = -1
                break
        if not same:
            os.close(fd)
            fd = None
            time.sleep(0.002 + 0.008 * random.random())
    try:
        yield fd >= 0
    finally:
        if fd >= 0:
            with contextlib.suppress(OSError):
                guard.unlink()  # still holding the flock: see above
            os.close(fd)


def _write_json(path: Path, flags: int, content: dict) -> None:
    """`content` as JSON into `path` opened with `flags` (mode 0o666: the umask applies); a failed write removes it.
    The open's own error (FileExistsError under O_EXCL) propagates with nothing created."""
    fd = os.open(path, flags | os.O_WRONLY, 0o666)
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(content, handle)
    except BaseException:
        with contextlib.suppress(OSError):
            path.unlink()
        raise


def acquire_lock(folder: Path) -> Path:
    """Take `folder`'s lock or raise ValueError naming the job that holds it. A lock left by a dead process on
    this host is taken over (with a warning), and so is one that names no job (empty or garbage); one from another
    host is only reported (its pid cannot be checked). Every check-and-take runs under the folder's flock guard, so
    two starters never both take a stale lock."""
    folder = Path(folder)
    lock = folder / LOCK_NAME
    me = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
          "argv": " ".join(sys.argv)}
    with _guarded(folder) as serialised:
        for _ in range(3):
            try:  # written under the guard: a reader under the guard never sees it half-written
                _write_json(lock, os.O_CREAT | os.O_EXCL, me)
            except FileExistsError:
                pass
            else:
                return lock
            try:
                text = lock.read_text()
                if not serialised and not _parse_lock(text)[0]:  # maybe being written right now: look again
                    time.sleep(0.2)
                    text = lock.read_text()
            except FileNotFoundError:  # removed meanwhile (by hand, or unserialised): create it again
                continue
            except (OSError, UnicodeDecodeError) as exc:
                raise ValueError(f"cannot read the lock {lock} of output folder {folder} ({exc}); choose another "
                                 f"output folder, or delete {lock} if no job uses it") from None
            holder, why = _parse_lock(text)
            if holder is None:
                log.warning("the lock %s is unreadable (%s): it names no job, taking it over as stale", lock, why)
            else:
                pid = holder["pid"]
                if holder["host"] != me["host"] or pid_alive(pid):
                    since = f" since {holder['started']}" if "started" in holder else ""
                    raise ValueError(
                        f"output folder {folder} is in use by another job (pid {pid} on {holder['host']}{since}); "
                        f"wait for it, choose another output folder, or delete {lock} if that job is gone")
                log.warning("taking over the stale lock of %s (pid %s, no longer running)", folder, pid)
            tmp = folder / f"{LOCK_NAME}.{os.getpid()}.tmp"  # replaced in one step: the lock never goes missing
            _write_json(tmp, os.O_CREAT | os.O_TRUNC, me)
            try:
                os.replace(tmp, lock)
            except BaseException:
                with contextlib.suppress(OSError):
                    tmp.unlink()
                raise
            return lock
    raise ValueError(f"could not take the lock {lock}: another job keeps taking it; choose another output folder")


def release_lock(lock: Path) -> None:
    lock = Path(lock)
    if not lock.exists():
        return
    with _guarded(lock.parent):
        holder = _read_lock(lock)
        if holder and holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
            with contextlib.suppress(FileNotFoundError):
                lock.unlink()


def clean_stale_temporaries(folder: Path) -> list[str]:
    """Remove `.<name>.*.tmp` / `.old` leftovers of writers killed mid-write (atomic_path / atomic_dir). Only safe
    while holding the folder's lock: no live writer of this folder exists then."""
    removed = []
    for path in folder.iterdir():
        if path.name in (LOCK_NAME, GUARD_NAME):  # the lock; the guard of a job starting right now
            continue
        if path.name.startswith(".") and path.name.endswith((".tmp", ".old")):
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
            removed.append(path.name)
    if removed:
        log.info("removed %d leftover temporaries of a killed writer in %s: %s", len(removed), folder,
                 ", ".join(sorted(removed)))
    return removed


@contextlib.contextmanager
def claim_output_dir(folder: str | os.PathLike) -> Iterator[Path]:
    """Check writable, lock, clean leftovers; release the lock on exit (a killed job leaves a stale lock that the
    next job on this host takes over)."""
    folder = Path(folder)
    check_writable(folder)
    lock = acquire_lock(folder)
    try:
        clean_stale_temporaries(folder)
        yield folder
    finally:
        release_lock(lock)


def die_with_launcher() -> None:
    """Under torchrun, have the kernel kill this rank when its launcher dies (Linux PR_SET_PDEATHSIG), so killing
    the torchrun parent never leaves ranks running as orphans that keep writing the output folder."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:  # set by torchrun's agent for its workers only
        return
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1
    libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the launcher died before the call took effect
        os._exit(1)

"""An output folder owned by one live job: a lock with host and pid, checked writable at start, leftovers of
killed writers cleaned once the lock is held; and ranks that die with their launcher.

    with claim_output_dir(path):      # rank 0; refuses a folder a live job holds, takes over a stale lock
        ...
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

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


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _read_lock(lock: Path) -> dict | None:
    try:
        return json.loads(lock.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def acquire_lock(folder: Path) -> Path:
    """Take `folder`'s lock or raise ValueError naming the job that holds it. A lock left by a dead process on
    this host is taken over (with a warning); one from another host is only reported (its pid cannot be checked)."""
    lock = folder / LOCK_NAME
    me = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
          "argv": " ".join(sys.argv)}
    for _ in range(3):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
        except FileExistsError:
            holder = _read_lock(lock)
            if holder is None:  # being written right now, or garbage: look again
                time.sleep(0.2)
                holder = _read_lock(lock) or {}
            same_host = holder.get("host") == me["host"]
            pid = int(holder.get("pid", -1))
            if not same_host or (pid > 0 and _pid_alive(pid)):
                since = f" since {holder['started']}" if "started" in holder else ""
                where = f"pid {pid} on {holder.get('host', '?')}{since}"
                raise ValueError(
                    f"output folder {folder} is in use by another job ({where}); wait for it, choose another output "
                    f"folder, or delete {lock} if that job is gone") from None
            log.warning("taking over the stale lock of %s (pid %s, no longer running)", folder, pid)
            with contextlib.suppress(FileNotFoundError):
                lock.unlink()
            continue
        with os.fdopen(fd, "w") as handle:
            json.dump(me, handle)
        return lock
    raise ValueError(f"could not take the lock {lock}: another job keeps taking it; choose another output folder")


def release_lock(lock: Path) -> None:
    holder = _read_lock(lock)
    if holder and holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
        with contextlib.suppress(FileNotFoundError):
            lock.unlink()


def clean_stale_temporaries(folder: Path) -> list[str]:
    """Remove `.<name>.*.tmp` / `.old` leftovers of writers killed mid-write (atomic_path / atomic_dir). Only safe
    while holding the folder's lock: no live writer of this folder exists then."""
    removed = []
    for path in folder.iterdir():
        if path.name.startswith(".") and path.name.endswith((".tmp", ".old")) and path.name != LOCK_NAME:
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

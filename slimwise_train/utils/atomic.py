"""Atomic writes: a reader sees the old file, the new file, or nothing; never half a file or half a folder."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Iterator


def current_umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def owner_tag() -> str:
    """`<host>.<pid>` of this process, as temporaries name their writer (the host's first label: no dots)."""
    return f"{socket.gethostname().split('.')[0] or 'host'}.{os.getpid()}"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def remove_stale_temporaries(path: str | os.PathLike) -> list[str]:
    """Remove the temporaries `atomic_path` left beside `path` when its writer was killed outright (kill -9, a power
    cut): those whose name records this host and a process that no longer runs. A live writer's (or another
    host's) are left alone, so this is safe without a lock. Returns the names removed."""
    path = Path(path)
    host = owner_tag().split(".")[0]
    pattern = re.compile(re.escape(f".{path.name}.") + r"(?P<host>[^.]+)\.(?P<pid>\d+)\.[^.]*\.tmp")
    removed = []
    if not path.parent.is_dir():
        return removed
    for sibling in path.parent.iterdir():
        match = pattern.fullmatch(sibling.name)
        if match and match["host"] == host and not pid_alive(int(match["pid"])) and not sibling.is_dir():
            with contextlib.suppress(FileNotFoundError):
                sibling.unlink()
            removed.append(sibling.name)
    return removed


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, replace: bool = True) -> Iterator[Path]:
    """Yield a temporary sibling path to write; it is published as `path` only if the block succeeds.

    The temporary exists (empty) when the block starts, so an unwritable folder fails before any work, and its name
    records this host and pid (`.<name>.<host>.<pid>.<random>.tmp`: `remove_stale_temporaries` finds a killed
    writer's). `replace=False` publishes with a hard link, which fails with FileExistsError if `path` exists by
    then: of two writers of one new path exactly one succeeds, the other's result is not published."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.{owner_tag()}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp)
    try:
        yield tmp
        if tmp.exists():
            # mkstemp makes 0600; the result should be readable like any file the user makes (shared filesystems).
            tmp.chmod(0o666 & ~current_umask())
        if replace:
            os.replace(tmp, path)
        else:
            _publish_new(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _publish_new(tmp: Path, path: Path) -> None:
    try:
        os.link(tmp, path)  # atomic, and never over an existing file
    except FileExistsError:
        raise FileExistsError(f"{path} exists (written by another run meanwhile): not replaced") from None
    except OSError as error:
        if error.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
            raise
        # a filesystem without hard links: the check and the rename are two steps here
        if path.exists():
            raise FileExistsError(f"{path} exists (written by another run meanwhile): not replaced") from None
        os.replace(tmp, path)
        return
    tmp.unlink()


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def write_json_atomic(path: str | os.PathLike, obj) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def honour_umask(root: Path) -> None:
    """Give every file and folder under `root` the mode a plain `open`/`mkdir` would: some writers (safetensors'
    save_file, mkstemp) create 0600 files whatever the umask, and a shared output folder must stay readable."""
    umask = current_umask()
    for folder, dirs, files in os.walk(root):
        for name in dirs:
            os.chmod(os.path.join(folder, name), 0o777 & ~umask)
        for name in files:
            full = os.path.join(folder, name)
            if not os.path.islink(full):
                os.chmod(full, 0o666 & ~umask)


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling folder; it replaces `path` only if the block succeeds.

    An existing `path` is an error unless `overwrite`; then it is swapped out only after the new folder is
    complete, so a failure leaves the old one in place.
    """
    path = Path(path)
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} already exists; pass overwrite=true or choose another output folder")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    tmp.chmod(0o777 & ~current_umask())  # mkdtemp makes 0700; the result should look like any folder the user makes
    try:
        yield tmp
        honour_umask(tmp)
        if path.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".old", dir=path.parent))
            os.replace(path, old / "x")
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)

"""The output folder's lock: one holder at a time, also when many jobs start at once against a stale lock; a lock
that names no job is taken over with a warning; a live job's or another host's lock is refused."""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from slimwise_train.utils import rundir
from slimwise_train.utils.rundir import GUARD_NAME, LOCK_NAME, acquire_lock, clean_stale_temporaries, release_lock

STARTERS, TRIALS, HOLD_S = 8, 20, 0.2

# Each starter waits for trial t's start file, tries the lock, and while it believes it holds it owns `holding`
# (created with O_EXCL): a second holder at the same time finds it there.
STARTER = textwrap.dedent(f"""
    import os, sys, time
    from pathlib import Path
    from slimwise_train.utils.rundir import acquire_lock, release_lock

    folder, work, trials, name = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    for trial in range(trials):
        while not (work / f"go.{{trial}}").exists():
            time.sleep(0.0005)
        try:
            lock = acquire_lock(folder)
        except ValueError:
            outcome = "refused"
        else:
            try:
                fd = os.open(work / "holding", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                outcome = "overlap"
                time.sleep({HOLD_S})
            else:
                outcome = "held"
                with open(work / "holders.log", "a") as log:
                    log.write(f"{{trial}} {{os.getpid()}}\\n")
                time.sleep({HOLD_S})
                os.close(fd)
                os.unlink(work / "holding")
            release_lock(lock)
        (work / f"part.{{trial}}.{{name}}").write_text(outcome)
        os.replace(work / f"part.{{trial}}.{{name}}", work / f"done.{{trial}}.{{name}}")  # never seen half-written
""")


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def stale_lock(folder, **extra) -> dict:
    content = {"host": socket.gethostname(), "pid": dead_pid(), "started": "2026-01-01 00:00:00", **extra}
    (folder / LOCK_NAME).write_text(json.dumps(content))
    return content


@pytest.mark.subprocess
def test_concurrent_starters_never_both_hold_a_stale_lock(tmp_path):
    folder, work = tmp_path / "out", tmp_path / "work"
    folder.mkdir()
    work.mkdir()
    procs = [subprocess.Popen([sys.executable, "-c", STARTER, str(folder), str(work), str(TRIALS), str(i)],
                              stderr=subprocess.PIPE, text=True) for i in range(STARTERS)]
    results = []
    try:
        for trial in range(TRIALS):
            stale_lock(folder)
            (work / f"go.{trial}").touch()
            deadline = time.monotonic() + 60
            while len(list(work.glob(f"done.{trial}.*"))) < STARTERS:
                for proc in procs:
                    if proc.poll() not in (None, 0):
                        pytest.fail(f"a starter failed in trial {trial}:\n{proc.communicate()[1]}")
                assert time.monotonic() < deadline, f"trial {trial} did not finish"
                time.sleep(0.01)
            outcomes = sorted(p.read_text() for p in work.glob(f"done.{trial}.*"))
            results.append(outcomes)
            assert not (folder / LOCK_NAME).exists(), "every holder released the lock"
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()
    overlaps = sum("overlap" in outcomes for outcomes in results)
    assert overlaps == 0, f"{overlaps} of {TRIALS} trials had two holders at once: {results}"
    assert all("held" in outcomes for outcomes in results), results  # the stale lock was taken over every time
    assert sorted(p.name for p in folder.iterdir()) == []  # no guard, no temporary left behind


@pytest.mark.parametrize("content", ["", " \n", '{"host": "node-1", "pi', "garbage\n", "[1, 2]",
                                     '{"started": "2026-01-01 00:00:00"}', '{"host": "node-1"}',
                                     '{"host": "node-1", "pid": "abc"}', '{"pid": 1234}'])
def test_a_lock_naming_no_job_is_taken_over_with_a_warning_at_once(tmp_path, caplog, monkeypatch, content):
    lock = tmp_path / LOCK_NAME
    lock.write_text(content)
    sleeps = []
    monkeypatch.setattr(rundir.time, "sleep", sleeps.append)
    with caplog.at_level("WARNING", logger="slimwise"):
        assert acquire_lock(tmp_path) == lock
    assert f"the lock {lock} is unreadable" in caplog.text and "taking it over as stale" in caplog.text
    assert sleeps == []  # no grace wait: under the guard a lock is never seen half-written
    assert json.loads(lock.read_text())["pid"] == os.getpid()
    release_lock(lock)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.subprocess
def test_a_stale_lock_is_taken_over_in_one_step_and_honours_the_umask(tmp_path, caplog):
    old = stale_lock(tmp_path)
    previous = os.umask(0o002)
    try:
        with caplog.at_level("WARNING", logger="slimwise"):
            lock = acquire_lock(tmp_path)
    finally:
        os.umask(previous)
    assert f"taking over the stale lock of {tmp_path} (pid {old['pid']}, no longer running)" in caplog.text
    held = json.loads(lock.read_text())
    assert held["pid"] == os.getpid() and held["host"] == socket.gethostname() and {"started", "argv"} <= set(held)
    assert lock.stat().st_mode & 0o777 == 0o664
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_NAME]
    release_lock(lock)
    previous = os.umask(0o022)
    try:
        lock = acquire_lock(tmp_path)  # a fresh lock too
    finally:
        os.umask(previous)
    assert lock.stat().st_mode & 0o777 == 0o644
    release_lock(lock)


@pytest.mark.subprocess
def test_a_live_holder_on_this_host_is_refused_with_its_pid(tmp_path):
    lock = tmp_path / LOCK_NAME
    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": "2026-12-01 10:00:00"}))
    before = lock.read_text()
    code = ("import sys; from pathlib import Path; from slimwise_train.utils.rundir import acquire_lock\n"
            "try:\n    acquire_lock(Path(sys.argv[1]))\nexcept ValueError as exc:\n    print(exc)\n    sys.exit(3)")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3, proc.stderr
    assert (f"in use by another job (pid {os.getpid()} on {socket.gethostname()} since 2026-12-01 10:00:00)"
            in proc.stdout)
    assert f"delete {lock} if that job is gone" in proc.stdout
    assert lock.read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_NAME]


@pytest.mark.subprocess
def test_another_hosts_lock_is_refused_and_left_alone(tmp_path):
    lock = tmp_path / LOCK_NAME
    lock.write_text(json.dumps({"host": "other-node-17", "pid": dead_pid()}))
    before = lock.read_text()
    with pytest.raises(ValueError, match=rf"pid \d+ on other-node-17\).*delete {lock}"):
        acquire_lock(tmp_path)
    assert lock.read_text() == before
    release_lock(lock)  # not ours: stays
    assert lock.read_text() == before


def test_an_unreadable_lock_is_refused(tmp_path):
    (tmp_path / LOCK_NAME).mkdir()  # cannot be read: nothing says it names no job
    with pytest.raises(ValueError, match=f"cannot read the lock {tmp_path / LOCK_NAME}"):
        acquire_lock(tmp_path)


@pytest.mark.subprocess
def test_the_guard_serialises_and_a_leftover_guard_does_not_block(tmp_path):
    guard = tmp_path / GUARD_NAME
    guard.touch()  # left by a starter killed while checking: no one holds its flock
    lock = acquire_lock(tmp_path)
    assert not guard.exists()
    release_lock(lock)
    holder = ("import fcntl, os, sys, time\nfd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o666)\n"
              "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('locked', flush=True)\ntime.sleep(0.6)\nos.unlink(sys.argv[1])")
    proc = subprocess.Popen([sys.executable, "-c", holder, str(guard)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "locked"
        start = time.monotonic()
        lock = acquire_lock(tmp_path)  # waits for the guard's holder
        assert time.monotonic() - start > 0.3
    finally:
        proc.wait(timeout=60)
    release_lock(lock)
    assert list(tmp_path.iterdir()) == []


def test_cleaning_temporaries_keeps_the_lock_and_the_guard(tmp_path):
    for name in (LOCK_NAME, GUARD_NAME, ".model.abc.tmp"):
        (tmp_path / name).write_text("x")
    assert clean_stale_temporaries(tmp_path) == [".model.abc.tmp"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_NAME, GUARD_NAME]


def test_without_flock_the_lock_is_still_taken_with_a_warning(tmp_path, caplog, monkeypatch):
    def no_flock(fd, op):
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))

    monkeypatch.setattr(rundir.fcntl, "flock", no_flock)
    sleeps = []
    monkeypatch.setattr(rundir.time, "sleep", sleeps.append)
    (tmp_path / LOCK_NAME).write_text("")  # unserialised, it may be being written: looked at again after a grace
    with caplog.at_level("WARNING", logger="slimwise"):
        lock = acquire_lock(tmp_path)
    assert "not serialised" in caplog.text and "taking it over as stale" in caplog.text and sleeps == [0.2]
    assert json.loads(lock.read_text())["pid"] == os.getpid()
    release_lock(lock)
    assert list(tmp_path.iterdir()) == []

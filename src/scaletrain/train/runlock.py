"""One job per run directory: an ``fcntl.flock`` on ``run.lock`` in it, with the holder's pid and host.

Why flock: the kernel releases it when the holding process dies, however it dies (SIGKILL, power
loss of a client), so a stale lock needs no pid check and no timeout — the next job simply gets it
and writes its own pid and host in the file. The pid and host are only for the message of a job
that is refused: "run directory X is in use by pid P on host H".

Who holds it. The process that owns the run directory: a one-process run, rank 0 under the user's
own torchrun, or scaletrain's launcher (``--nproc-per-node``), which holds it across all its
attempts and tells its ranks so (:data:`~.job_env.LAUNCHER_PID_ENV`), so that an attempt never
refuses its own launcher's lock. Other ranks never take it.

A fresh run's directory is created to hold the lock; if the job ends before its first step (a bad
input found later), :func:`RunLock.release` removes the lock file and the directory it created,
so nothing is left behind. The lock file is removed on release only while still held, and a job
that acquires it checks that the file it locked is still the one at the path (else it retries), so
removal never lets two jobs hold it at once.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
from pathlib import Path

from scaletrain.errors import ConfigError
from scaletrain.train.job_env import LAUNCHER_PID_ENV

LOCK_FILE = "run.lock"


class _Held:
    """The flock this process holds on one run directory, shared by its :class:`RunLock` handles."""

    def __init__(self, out: Path, fd: int, created: list[Path]) -> None:
        self.out, self.fd, self.created, self.handles = out, fd, created, 0


_HELD: dict[str, _Held] = {}
"""Locks this process holds, by run directory: a second acquire in the same process (a resume
right after a run, in one Python session) shares it instead of refusing itself."""


class RunLock:
    """One holder's handle on a run directory's lock; :meth:`release` it once (again: no effect)."""

    def __init__(self, held: _Held | None = None) -> None:
        self._held = held
        if held is not None:
            held.handles += 1

    def release(self) -> None:
        """Drop this handle; the last one removes the lock file (while still locked), unlocks, and
        removes the directories that acquiring created if they are still empty (nothing was run)."""
        held, self._held = self._held, None
        if held is None:
            return
        held.handles -= 1
        if held.handles > 0:
            return
        _HELD.pop(_key(held.out), None)
        try:
            (held.out / LOCK_FILE).unlink(missing_ok=True)  # before unlocking: see the module docstring
        except OSError:
            pass
        os.close(held.fd)
        _remove_empty(held.created)


NO_LOCK = RunLock()
"""The handle of a process that does not own the run directory (a rank other than 0, no --out)."""


def _remove_empty(created: list[Path]) -> None:
    """Remove the directories of ``created`` (outermost first in the list) that are still empty."""
    for d in reversed(created):
        try:
            d.rmdir()  # only if empty: the run wrote nothing
        except OSError:
            break


def _key(out: Path) -> str:
    return os.path.realpath(out)


def holder(out: Path) -> str:
    """'pid P on host H' as the lock file says (or 'another process')."""
    try:
        d = json.loads((out / LOCK_FILE).read_text())
        return f"pid {int(d['pid'])} on host {d['host']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process"


def _in_use(out: Path) -> ConfigError:
    return ConfigError(f"run directory {str(out)!r} is in use by {holder(out)}; wait for that job to end, or "
                       f"choose another --out")


def _held_by_launcher(out: Path) -> bool:
    """True when this process's launcher says it holds the lock, and the lock file agrees."""
    pid = os.environ.get(LAUNCHER_PID_ENV)
    if not pid:
        return False
    try:
        return int(json.loads((out / LOCK_FILE).read_text())["pid"]) == int(pid)
    except (OSError, ValueError, KeyError, TypeError):
        return False


def acquire(out: Path) -> RunLock:
    """Lock run directory ``out`` for this job (creating it if needed); ConfigError, one line, when
    another live process holds it."""
    held = _HELD.get(_key(out))
    if held is not None:
        return RunLock(held)
    if _held_by_launcher(out):
        return NO_LOCK
    created: list[Path] = []
    missing = out
    while not missing.exists():
        created.append(missing)
        missing = missing.parent
    created.reverse()
    for d in created:
        try:
            d.mkdir()
        except FileExistsError:
            pass
        except OSError as e:
            raise ConfigError(f"--out {str(out)!r} cannot be created ({e.strerror})") from None
    path = out / LOCK_FILE
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError as e:
            _remove_empty(created)
            if e.errno == errno.ELOOP:
                raise ConfigError(f"{str(path)!r} is a symbolic link; remove it (a run directory's lock is a plain "
                                  f"file)") from None
            raise ConfigError(f"cannot lock run directory {str(out)!r}: {path} ({e.strerror})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            _remove_empty(created)
            raise _in_use(out) from None
        try:
            same = os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # its holder removed it as we opened it: lock the new one
    os.ftruncate(fd, 0)
    os.write(fd, (json.dumps({"pid": os.getpid(), "host": socket.gethostname()}) + "\n").encode())
    held = _HELD[_key(out)] = _Held(out, fd, created)
    return RunLock(held)

"""The launcher owns its process tree: nothing of a job outlives the launcher or its attempt.

Why: ``scaletrain train --nproc-per-node N`` starts ``launcher -> torchrun agent -> ranks``. If the
launcher is SIGKILLed, torchrun and the ranks would go on unattended; if the agent is, its ranks
would be orphaned and the launcher's next attempt would start beside them in the same run
directory. Three mechanisms, each closing one gap:

1. **Death follows the parent** (:func:`die_with_parent`): the agent and every rank ask the kernel
   for SIGKILL when their parent dies (Linux ``prctl(PR_SET_PDEATHSIG)``; elsewhere a thread
   polling the parent pid). A process whose parent died before it asked exits at once: it compares
   its parent with the pid it was told (:data:`~.job_env.AGENT_PID_ENV`, the launcher's pid).
2. **The launcher reaps** (:func:`reap`): after every attempt it SIGKILLs every process that still
   carries the job's directory in its environment (``/proc/<pid>/environ``; the ranks' pid files
   elsewhere) — however the attempt ended.
3. **An attempt never starts beside another**: each rank holds a shared ``flock`` on the job's
   ``attempt.lock`` for its whole life (:func:`join_attempt`); the launcher starts the next attempt
   only once it can take that lock exclusively, i.e. once the kernel says no process of an earlier
   attempt is alive.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import signal
import sys
import threading
import time
from pathlib import Path

from scaletrain.train.job_env import AGENT_PID_ENV, JOB_DIR_ENV

PR_SET_PDEATHSIG = 1
ATTEMPT_LOCK = "attempt.lock"
_ATTEMPT_FD: int | None = None  # a rank's shared lock, held until it exits


def die_with_parent(expected_parent: int | None = None) -> None:
    """Have the kernel SIGKILL this process when its parent dies; if ``expected_parent`` is given and
    is no longer the parent (it died before this call), exit at once (status 137, as SIGKILL)."""
    armed = False
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            armed = libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    parent = os.getppid()
    if expected_parent is not None and parent != expected_parent:
        os._exit(128 + signal.SIGKILL)
    if not armed:  # no prctl: a watchdog on the parent pid
        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def enter_rank(rank: int) -> None:
    """In a rank started by torchrun: die with the agent, and join the launcher's attempt (if any)."""
    agent = os.environ.get(AGENT_PID_ENV, "")
    die_with_parent(int(agent) if agent.isdigit() else None)
    join_attempt(rank)


def join_attempt(rank: int) -> None:
    """In a rank started by the launcher: leave its pid and hold the attempt's shared lock."""
    global _ATTEMPT_FD
    job = os.environ.get(JOB_DIR_ENV)
    if not job:
        return
    with contextlib.suppress(OSError):
        (Path(job) / f"pid-rank{rank}").write_text(str(os.getpid()))
        fd = os.open(Path(job) / ATTEMPT_LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_SH)
        _ATTEMPT_FD = fd


def _environ_has(pid: int, marker: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = b"\0" + f.read()
        with open(f"/proc/{pid}/stat", "rb") as f:
            zombie = f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except (OSError, IndexError):
        return False
    return not zombie and marker in env


def job_pids(job: Path) -> list[int]:
    """Live processes (not this one) whose environment names ``job`` as their job directory."""
    if not Path("/proc/self/environ").exists():  # no /proc: the ranks' own pid files
        pids = []
        for p in job.glob("pid-rank*"):
            with contextlib.suppress(OSError, ValueError):
                pid = int(p.read_text())
                os.kill(pid, 0)
                pids.append(pid)
        return pids
    marker = b"\0" + f"{JOB_DIR_ENV}={job}".encode() + b"\0"
    return [int(d) for d in os.listdir("/proc") if d.isdigit() and int(d) != os.getpid()
            and _environ_has(int(d), marker)]


def _attempt_free(job: Path) -> bool:
    """True when no process holds the attempt lock (no rank of an earlier attempt is alive)."""
    try:
        fd = os.open(job / ATTEMPT_LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def reap(job: Path, timeout_s: float = 30.0) -> list[int]:
    """SIGKILL every process of ``job`` and wait until they are gone and the attempt lock is free.
    Returns the pids still alive after ``timeout_s`` seconds (empty: the job is clean)."""
    deadline = time.monotonic() + timeout_s
    while True:
        pids = job_pids(job)
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        if not pids and _attempt_free(job):
            for p in job.glob("pid-rank*"):
                p.unlink(missing_ok=True)
            return []
        if time.monotonic() > deadline:
            return pids or [-1]
        time.sleep(0.05)

"""Automatic recovery: ``scaletrain train --nproc-per-node N --max-restarts K``.

Every attempt is a fresh ``torchrun --standalone`` (a new rendezvous on a new free port) and, once
the run has a checkpoint, carries ``--resume``: the ranks load the newest complete checkpoint (an
unloadable newest one is skipped with a warning) and the data position follows from its step, so
no sample is lost or repeated and the final parameters equal an uninterrupted run's.

Across several machines, run torchrun yourself on each node with its own ``--max-restarts``
(``torchrun --nnodes 2 --nproc-per-node 2 --max-restarts 2 --rdzv-backend c10d --rdzv-endpoint
HOST:PORT -m scaletrain.cli train --out DIR ...``, ``--out`` on a shared filesystem): the
restarted round resumes the same way, because its ranks recognise the run directory as this job's
and init each round's process group on a fresh store (:mod:`.elastic` says why both are needed:
with torch's defaults the restarted ranks started over and hung in gloo's ``connectFullMesh``). The
restart row is logged there too (``detect_s`` then runs from the failure to the new processes'
start: torchrun's detection and re-rendezvous). Measured on a 2-core machine, two "nodes" on
localhost, gpt2-tiny: 3.6-8 s lost per failure with 2 x 1 processes (static and c10d), ~8 s with
2 x 2, mostly the new processes' start-up (tests/test_recovery_torchrun.py). A hung (stopped) rank
costs more there: ``parallel.timeout_s`` plus the 30 s torchrun's agent waits for a process to
honour SIGTERM before it sends SIGKILL (measured: 37 s of detection with ``parallel.timeout_s=5``);
scaletrain's own launcher kills the hung rank 3 s after its peer's report (:data:`GRACE_S`).

The launcher owns its process tree (:mod:`.process_tree`): the agent and the ranks die with their
parent, every attempt ends with no process of it left, and the next one starts only once the
previous one's ranks have released their shared attempt lock. It holds the run directory's lock
(:mod:`.runlock`) across all attempts. SIGTERM to it ends the job in one line, exit 143.

A failure is restarted unless a rank reported a bad input (:attr:`UserError.restartable` False),
which would fail the same way again. A rank that hangs is caught by the collective timeout
(``parallel.timeout_s``) of the ranks waiting for it.

Time lost per failure (seconds, wall clock) is measured in four parts and logged by rank 0 as a
``{"event": "restart", ...}`` metrics row once the job is back where it failed:
``detect_s`` (the failure until the launcher saw the job end), ``restart_s`` (until the new
processes were ready to load), ``reload_s`` (loading the checkpoint), ``recompute_s`` (re-running
the steps after the checkpoint); ``lost_s`` is their sum. The failure's moment is the fault
injector's record (:mod:`.faults`) or, for a real failure, the last completed step's heartbeat
(so ``detect_s`` then also holds the unfinished step).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from scaletrain.errors import ERROR_DIR_ENV, read_reports, summarize
from scaletrain.train.agent import SHUTDOWN_S
from scaletrain.train import checkpoint as ckpt
from scaletrain.train import process_tree
from scaletrain.train.job_env import ATTEMPT_ENV, JOB_DIR_ENV, LAUNCHER_PID_ENV, RESTART_ENV

DIED_FILE = "launcher.json"
"""torchrun's first failed rank ({"rank", "exitcode", "signal"}), written into the error directory."""


@dataclass
class RestartClock:
    """Rank 0's account of one restart: when the failure happened, when the job was back."""

    attempt: int
    t_fault: float
    t_exit: float
    failed_step: int
    start_step: int
    t_load0: float | None = None
    t_load1: float | None = None
    done: bool = False

    @classmethod
    def from_env(cls, start_step: int) -> "RestartClock | None":
        text = os.environ.get(RESTART_ENV)
        if not text:
            return None
        try:
            d = json.loads(text)
            return cls(int(d["attempt"]), float(d["t_fault"]), float(d["t_exit"]), int(d["failed_step"]), start_step)
        except (ValueError, KeyError, TypeError):
            return None

    def note_reload(self, t0: float, t1: float, step: int) -> None:
        """The checkpoint load took ``t1 - t0`` seconds and put the run at ``step``."""
        self.t_load0, self.t_load1, self.start_step = t0, t1, step

    def caught_up(self, step: int, now: float) -> dict[str, Any] | None:
        """The restart row, once (when ``step`` reaches the step the failed attempt had completed)."""
        if self.done or step < self.failed_step:
            return None
        self.done = True
        t0 = self.t_load0 if self.t_load0 is not None else now
        t1 = self.t_load1 if self.t_load1 is not None else t0
        parts = {"detect_s": self.t_exit - self.t_fault, "restart_s": t0 - self.t_exit, "reload_s": t1 - t0,
                 "recompute_s": now - t1}
        return {"event": "restart", "step": step, "attempt": self.attempt, "failed_at_step": self.failed_step,
                "resumed_from_step": self.start_step, "recomputed_steps": self.failed_step - self.start_step,
                **{k: round(v, 4) for k, v in parts.items()}, "lost_s": round(now - self.t_fault, 4)}

    @staticmethod
    def describe(row: dict[str, Any]) -> str:
        return (f"restart {row['attempt']}: {row['lost_s']:.1f} s lost (detection {row['detect_s']:.1f} s, restart "
                f"{row['restart_s']:.1f} s, reload {row['reload_s']:.2f} s, {row['recomputed_steps']} recomputed "
                f"steps {row['recompute_s']:.1f} s); back at step {row['failed_at_step']}")


# --------------------------------------------------------------------------- the launcher


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        d = json.loads(path.read_text())
        return d if isinstance(d, dict) else None
    except (OSError, ValueError):
        return None


def fault_time(job: Path, since: float) -> float | None:
    """When the fault injector last fired at or after ``since`` (its markers' record in ``job``), if it did."""
    times = [d["time"] for p in job.glob("fault-*.json") if (d := _read_json(p)) and d.get("time", 0) >= since]
    return max(times) if times else None


GRACE_S = 3.0
"""Seconds a job may take to end by itself after a rank reported its error; then every process of
the attempt is killed. Why: torchrun waits 30 s (whatever ``--shutdown-timeout`` says, torch 2.13)
for a stopped — hung — rank to honour SIGTERM before it sends SIGKILL."""


def _run_attempt(cmd: list[str], env: dict[str, str], errors: Path) -> int:
    """Run one attempt in its own session; its exit code (-9 when it had to be killed). Whatever
    ends it, no process of it is left (:func:`.process_tree.reap`, by the caller)."""
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    first_report: float | None = None
    try:
        while proc.poll() is None:
            time.sleep(0.1)
            if first_report is None and any(errors.glob("rank*.json")):
                first_report = time.monotonic()
            if first_report is not None and time.monotonic() - first_report > GRACE_S:
                process_tree.reap(errors.parent, timeout_s=0)  # the agent and each rank (own sessions)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return -9
    except (KeyboardInterrupt, SystemExit):  # the attempt has its own session: pass Ctrl-C / SIGTERM on
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=GRACE_S + SHUTDOWN_S)  # torchrun stops its ranks; then they are killed anyway
        raise
    return proc.returncode


def _exit_on_term(signum: int, frame: Any) -> None:
    """SIGTERM handler of the launcher: unwind (the attempt's processes are stopped on the way), exit 143."""
    raise SystemExit(128 + signum)


def run_job(torchrun: Callable[[list[str]], list[str]], argv: list[str], out: Path, *, resume: bool,
            reset_optimizer: bool, max_restarts: int, log: Callable[[str], None]) -> int:
    """Run ``scaletrain ARGV`` under torchrun (``torchrun(argv)`` is the command), restarting it up
    to ``max_restarts`` times after a failure a restart may cure; one line on failure. Exit code:
    0, 2 for a bad input, 1 when the restarts are spent."""
    job = Path(tempfile.mkdtemp(prefix="scaletrain-job-"))
    first_newest = ckpt.latest(out / "checkpoints")
    info: dict[str, Any] | None = None
    on_term = None
    if threading.current_thread() is threading.main_thread():  # a SIGTERM to the launcher ends the job too
        on_term = signal.signal(signal.SIGTERM, _exit_on_term)
    try:
        for attempt in range(max_restarts + 1):
            if process_tree.reap(job):  # an earlier attempt's process that SIGKILL cannot end (e.g. stuck in I/O)
                print(f"scaletrain: error: processes of attempt {attempt - 1} are still alive after SIGKILL; not "
                      f"starting attempt {attempt} beside them in {str(out)!r}", file=sys.stderr, flush=True)
                return 1
            errors = job / f"attempt{attempt}"
            errors.mkdir()
            newest = ckpt.latest(out / "checkpoints")
            args = list(argv) + (["--resume"] if resume or (attempt and newest is not None) else [])
            if reset_optimizer and newest == first_newest:  # not once the run has its own new checkpoints
                args.append("--reset-optimizer")
            env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
                       **{ERROR_DIR_ENV: str(errors), JOB_DIR_ENV: str(job), ATTEMPT_ENV: str(attempt),
                          LAUNCHER_PID_ENV: str(os.getpid())})
            env.pop(RESTART_ENV, None)
            if info is not None:
                env[RESTART_ENV] = json.dumps(info)
            t_launch = time.time()
            try:
                rc = _run_attempt(torchrun(args), env, errors)
            finally:
                t_exit = time.time()
                process_tree.reap(job, timeout_s=GRACE_S)  # a killed agent's ranks, or any straggler
            if rc == 0:
                return 0
            reports, died = read_reports(errors), _read_json(errors / DIED_FILE)
            line, restartable = summarize(reports, died)
            if rc < 0 and not reports and died is None:  # the agent itself was killed: its ranks were reaped
                line, restartable = f"torchrun's agent died ({signal.Signals(-rc).name}); its ranks were stopped", True
            if not restartable or attempt == max_restarts:
                spent = f" (after {attempt} restart{'s' * (attempt != 1)})" if attempt else ""
                print(f"scaletrain: error: {line}{spent}", file=sys.stderr, flush=True)
                return 1 if restartable else 2
            progress = _read_json(job / "progress.json") or {}
            failed_step = int(progress.get("step", 0)) if progress.get("time", 0) >= t_launch else 0
            t_fault = fault_time(job, t_launch) or float(progress.get("time", 0)) or t_launch
            info = {"attempt": attempt + 1, "t_fault": t_fault, "t_exit": t_exit, "failed_step": failed_step}
            newest = ckpt.latest(out / "checkpoints")
            log(f"scaletrain: {line}; restart {attempt + 1} of {max_restarts} "
                f"from {newest.name if newest else 'the start'} (the failed attempt had reached step {failed_step})")
        return 1  # not reached
    except SystemExit as e:
        if e.code != 128 + signal.SIGTERM:
            raise
        print("scaletrain: stopped by SIGTERM; the job's processes are ended (continue the run with --resume)",
              file=sys.stderr, flush=True)
        return 128 + signal.SIGTERM
    finally:
        if on_term is not None:
            signal.signal(signal.SIGTERM, on_term)
        shutil.rmtree(job, ignore_errors=True)

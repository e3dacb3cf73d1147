"""Fault injection for recovery tests: kill, stop or fail one rank at chosen steps and places.

Environment (read on every call, so a test can set it per run; with it unset every hook is one
dictionary lookup, nothing else):

- ``SCALETRAIN_FAULT_AT_STEP``: comma-separated optimizer steps (1-based), e.g. ``7,15``;
- ``SCALETRAIN_FAULT_RANK``: the global rank that faults (default 0);
- ``SCALETRAIN_FAULT_KIND``: ``kill`` (SIGKILL, default), ``stop`` (SIGSTOP: a hang, caught by the
  other ranks' collective timeout), ``raise`` (an ordinary exception) or ``enospc`` (an
  ``OSError(ENOSPC)``: the checkpoint disk is full — only meaningful at a save) or ``pause`` (sleep
  ``SCALETRAIN_FAULT_PAUSE_S`` seconds, default 60, ended at once by a SIGTERM: holds the job at a
  known step while a test changes its nodes — the elastic re-planning test);
- ``SCALETRAIN_FAULT_WHERE``: where in step N it fires (default ``step``), one per listed step or
  one for all:

  - ``step``: at the start of step N (a step boundary);
  - ``collective``: inside step N, after the forward/backward micro-batches (their collectives
    done) and before the gradient clip and optimizer step (whose collectives the peers then wait
    in) — the trainer's one point that exists under every layout;
  - ``save``: inside the (synchronous) checkpoint save after step N, once this rank has written
    part of its file, before the manifest and the rename (consolidated: after the temp file,
    before the rename);
  - ``async-save``: the same inside the background writer thread of ``train.checkpoint_async``,
    while the training thread goes on.

Each (step, place) fires once per job: a marker file ``fault-<step>[-<where>].json`` (holding the
moment it fired, in seconds since the epoch, which the launcher uses to measure detection time) is
written first in the launcher's job directory (else the run directory), and a marker that exists
disarms it. So ``7,15`` kills twice, and the restarted attempts run through step 7 untouched.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import time
from pathlib import Path

from scaletrain.train.job_env import JOB_DIR_ENV
from scaletrain.train.safe_write import write_atomic

PLACES = ("step", "collective", "save", "async-save")


def armed() -> dict[int, str]:
    """{step: place} from ``SCALETRAIN_FAULT_AT_STEP`` / ``_WHERE`` (empty when unset or unreadable)."""
    text = os.environ.get("SCALETRAIN_FAULT_AT_STEP", "")
    if not text:
        return {}
    try:
        steps = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        return {}
    where = [w.strip() for w in os.environ.get("SCALETRAIN_FAULT_WHERE", "step").split(",") if w.strip()] or ["step"]
    if len(where) == 1:
        where = where * len(steps)
    return dict(zip(steps, where))


def armed_steps() -> set[int]:
    """The steps of ``SCALETRAIN_FAULT_AT_STEP`` (empty when unset or unreadable)."""
    return set(armed())


def maybe_fire(step: int, rank: int, run_dir: Path | None, where: str = "step") -> None:
    """Fire the configured fault if ``rank`` is the faulty one and (``step``, ``where``) is armed
    and has not fired yet in this job."""
    if "SCALETRAIN_FAULT_AT_STEP" not in os.environ:  # the normal case: no cost
        return
    if armed().get(step) != where or str(rank) != os.environ.get("SCALETRAIN_FAULT_RANK", "0").strip():
        return
    marker_dir = Path(os.environ[JOB_DIR_ENV]) if os.environ.get(JOB_DIR_ENV) else run_dir
    kind = os.environ.get("SCALETRAIN_FAULT_KIND", "kill")
    if marker_dir is not None and marker_dir.is_dir():
        marker = marker_dir / (f"fault-{step}.json" if where == "step" else f"fault-{step}-{where}.json")
        if marker.exists():
            return
        write_atomic(marker, json.dumps({"step": step, "rank": rank, "kind": kind, "where": where,
                                         "time": time.time()}))
    if kind == "raise":
        raise RuntimeError(f"injected fault at step {step} ({where}) on rank {rank}")
    if kind == "enospc":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC) + " (injected)")
    if kind == "pause":
        old = signal.signal(signal.SIGTERM, signal.SIG_DFL)  # an agent's stop ends it now, not after its 30 s grace
        time.sleep(float(os.environ.get("SCALETRAIN_FAULT_PAUSE_S", "60")))
        signal.signal(signal.SIGTERM, old)
        return
    os.kill(os.getpid(), signal.SIGSTOP if kind == "stop" else signal.SIGKILL)

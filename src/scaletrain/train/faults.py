"""Fault injection for recovery tests: kill, stop or fail one rank at chosen steps.

Environment (read on every call, so a test can set it per run):

- ``SCALETRAIN_FAULT_AT_STEP``: comma-separated optimizer steps (1-based) at whose start the
  fault fires, e.g. ``7,15``;
- ``SCALETRAIN_FAULT_RANK``: the global rank that faults (default 0);
- ``SCALETRAIN_FAULT_KIND``: ``kill`` (SIGKILL, default), ``stop`` (SIGSTOP: a hang, caught by the
  other ranks' collective timeout) or ``raise`` (an ordinary exception).

Each step fires once per job: a marker file ``fault-<step>.json`` (holding the moment it fired, in
seconds since the epoch, which the launcher uses to measure detection time) is written first in
the launcher's job directory (else the run directory), and a marker that exists disarms it. So
``7,15`` kills twice, and the restarted attempts run through step 7 untouched.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from scaletrain.train.rundir import JOB_DIR_ENV


def armed_steps() -> set[int]:
    """The steps of ``SCALETRAIN_FAULT_AT_STEP`` (empty when unset or unreadable)."""
    text = os.environ.get("SCALETRAIN_FAULT_AT_STEP", "")
    try:
        return {int(s) for s in text.split(",") if s.strip()}
    except ValueError:
        return set()


def maybe_fire(step: int, rank: int, run_dir: Path | None) -> None:
    """Fire the configured fault if ``rank`` is the faulty one and ``step`` is armed and not yet fired."""
    if step not in armed_steps() or str(rank) != os.environ.get("SCALETRAIN_FAULT_RANK", "0").strip():
        return
    marker_dir = Path(os.environ[JOB_DIR_ENV]) if os.environ.get(JOB_DIR_ENV) else run_dir
    kind = os.environ.get("SCALETRAIN_FAULT_KIND", "kill")
    if marker_dir is not None and marker_dir.is_dir():
        marker = marker_dir / f"fault-{step}.json"
        if marker.exists():
            return
        marker.write_text(json.dumps({"step": step, "rank": rank, "kind": kind, "time": time.time()}))
    if kind == "raise":
        raise RuntimeError(f"injected fault at step {step} on rank {rank}")
    os.kill(os.getpid(), signal.SIGSTOP if kind == "stop" else signal.SIGKILL)

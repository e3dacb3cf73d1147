"""Pipeline parallelism: schedules as data, a discrete-event simulator, timelines, a partitioner.

* :mod:`.schedules` — per-rank action lists for gpipe, 1f1b, interleaved, zb1p, chimera,
  pipedream and pipedream-2bw, and :func:`validate`.
* :mod:`.simulate` — step time, bubble fraction, in-flight micro-batches, peak memory.
* :mod:`.timeline` — a PNG of ranks × time, simulated or measured.
* :mod:`.partition` — memory-aware DP splitting a Profile's blocks into stages.
"""

from .schedules import SCHEDULES, Action, Schedule, build, validate
from .simulate import DeadlockError, Event, Link, SimResult, StageCosts, simulate

__all__ = ["SCHEDULES", "Action", "Schedule", "build", "validate", "simulate", "StageCosts", "Link",
           "SimResult", "Event", "DeadlockError"]

"""Pipeline parallelism: schedules as data, a discrete-event simulator, timelines, a partitioner.

* :mod:`.schedules` — per-rank action lists for gpipe, 1f1b, interleaved, zb1p, chimera,
  pipedream and pipedream-2bw.
* :mod:`.checks` — :func:`validate` (dependencies, matching, no deadlock) and
  :func:`rendezvous_safe` (reorder transfers for blocking sends).
* :mod:`.simulate` — step time, bubble fraction, in-flight micro-batches, peak memory.
* :mod:`.timeline` — a PNG of ranks × time, simulated or measured.
* :mod:`.partition` — memory-aware DP splitting a Profile's blocks into stages.
* :mod:`.runtime` — executes the lists with ``torch.distributed`` (:class:`~.runtime.PipelineRuntime`;
  stage replicas in :mod:`.stage`, transfers and timeouts in :mod:`.p2p`).
* :mod:`.apply` — config values → a :class:`~.runtime.PipelineRuntime` (stage split included);
  :mod:`.strategy` — :class:`~.strategy.PipelineStrategy`, what ``scaletrain train parallel.pp=N``
  runs: the trainer's loop, evaluation, global clipping and single-process-layout checkpoints
  over the runtime.
* :mod:`.tensor_parallel` — tensor parallelism inside the stages (``parallel.tp`` with
  ``parallel.pp``): the world mesh's (pp, dp, tp) layout, one pipeline per TP index on local shards.
* :mod:`.experts` — expert parallelism inside the stages (``parallel.ep`` with ``parallel.pp``): EP
  groups of data-parallel replicas, expert gradient groups, expert slices in checkpoints, the
  all-to-alls' bytes.
"""

from .schedules import SCHEDULES, Action, Schedule, build
from .checks import ScheduleError, rendezvous_safe, validate
from .simulate import DeadlockError, Event, Link, SimResult, StageCosts, simulate, summarise

__all__ = ["SCHEDULES", "Action", "Schedule", "build", "validate", "rendezvous_safe", "ScheduleError",
           "simulate", "summarise", "StageCosts", "Link", "SimResult", "Event", "DeadlockError"]

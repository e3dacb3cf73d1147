"""Environment variables between scaletrain's launcher (:mod:`.recovery`) and the ranks it starts.

A module of its own, below both sides: the run directory (:mod:`.rundir`), fault injection
(:mod:`.faults`) and the launcher read the same names without importing each other.
"""

JOB_DIR_ENV = "SCALETRAIN_JOB_DIR"
"""The launcher's scratch directory (heartbeat, fault markers), kept across its restarts."""
ATTEMPT_ENV = "SCALETRAIN_ATTEMPT"
"""Which attempt of the launcher's job this is (0 = the first)."""
RESTART_ENV = "SCALETRAIN_RESTART_INFO"
"""JSON from the launcher about the failure this attempt recovers from (see :mod:`.recovery`)."""
LAUNCHER_PID_ENV = "SCALETRAIN_LAUNCHER_PID"
"""The launcher's pid: it holds the run directory's lock (:mod:`.runlock`) for its ranks, and its
torchrun agent dies with it (:mod:`.process_tree`)."""
AGENT_PID_ENV = "SCALETRAIN_AGENT_PID"
"""The torchrun agent's pid, set by :func:`~scaletrain.train.agent.torchrun_main`:
a rank whose parent is no longer that process exits at once (:mod:`.process_tree`)."""

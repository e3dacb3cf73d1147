"""Recovery under the user's own ``torchrun --max-restarts`` (one node or several).

torchrun's agents restart every worker of the job (on every node) when one fails, with the same
command line. Two things make such a restart a resume that loses and repeats no sample:

1. **The run directory is this job's.** A restarted round finds the run directory that an
   earlier round created (``config.toml``, metrics, checkpoints), which
   :func:`.rundir.check_target` would refuse as "already holds a run". The proof that it is this
   job's own is a key in the agent's TCP store (``MASTER_ADDR``/``MASTER_PORT`` when
   ``TORCHELASTIC_USE_AGENT_STORE=True``, torchrun's default for the static and c10d rendezvous
   backends): that store lives in node 0's agent for the whole job, across rounds, and every node
   reaches it. Every rank that accepts the run directory claims it (:func:`claim`); a later round
   :func:`owns` it and resumes from its newest complete checkpoint (:func:`resume_round`), or
   starts over when the failure came before the first checkpoint. A run directory of an earlier
   job is still refused: the key is not in this job's store. Should the node hosting that store
   be lost for good (an elastic ``--nnodes MIN:MAX`` job goes on without it), the next round's store
   is a new one, and with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` there is none; the job's
   ``--rdzv-id``, recorded in the run directory (:func:`record`), then stands in for the claim
   (torch asks it to be unique per job; with its default ``none``, which proves nothing, such a
   restarted round refuses the directory in one line).
2. **Each round gets a fresh process-group store.** Under plain ``env://`` every round's default
   process group keeps its keys in that same job-long agent store, under fixed names
   (``default_pg/...``: torch/distributed/distributed_c10d.py ``init_process_group``, ~line 1897;
   torch/distributed/rendezvous.py ~line 189 assumes "a new TCPStore for every retry", but the
   agent creates its store once: elastic/rendezvous/dynamic_rendezvous.py ~line 1209,
   static_tcp_rendezvous.py ~line 66). A restarted round then reads the dead round's gloo
   addresses: ``connectFullMesh`` is refused or hangs until the timeout (seen with 2 nodes x 2
   processes). A per-round key prefix is no cure: no round number is the same on every node —
   ``TORCHELASTIC_RESTART_COUNT`` counts only the restarts after this node's own worker failed,
   and an agent that restarts because another node rejoined (elastic/agent/server/api.py ~line
   961, "Detected N new nodes") keeps its count (seen with c10d: counts 0 and 1 in one round). So
   rank 0 hosts a new store each round and publishes its address (:func:`group_store`).

Backends. With c10d (recommended) a new round's workers start only after every agent has
stopped its old ones and joined the new rendezvous, so the address a worker reads is either the
new rank 0's store or a dead one's. The static backend does not synchronise the agents: a node
restarts as soon as its own workers fail. A killed rank is recovered (its peers see the lost
connection within milliseconds and fail too, long before a restarted worker has imported torch),
but a hung one on another node is not: torchrun's static agents never restart a node whose worker
is stopped rather than failed, with or without scaletrain (read in torch's code, not tested:
static_tcp_rendezvous.py ``num_nodes_waiting`` is always 0, so only a failed worker restarts a node).

Every node must see the same run directory (a shared filesystem), as any multi-node resume needs,
and the command must name it (``--out DIR``: without it each round would pick a new one and start
over).
"""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import torch.distributed as dist

from scaletrain.train.job_env import JOB_DIR_ENV
from scaletrain.train.safe_write import write_atomic

if TYPE_CHECKING:
    from scaletrain.train.recovery import RestartClock

AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"
"""``"True"`` when the agent hosts the store at ``MASTER_ADDR:MASTER_PORT`` for the whole job."""

_STORE: dist.TCPStore | None = None
_STORE_FOR: tuple[str, int] | None = None


def agent_store(timeout_s: float = 60.0) -> dist.TCPStore | None:
    """A client of the torchrun agent's job-long store, or None when not under one (cached)."""
    global _STORE, _STORE_FOR
    if os.environ.get(AGENT_STORE_ENV) != "True" or not os.environ.get("MASTER_ADDR"):
        return None
    try:
        where = (os.environ["MASTER_ADDR"], int(os.environ.get("MASTER_PORT", "")))
    except ValueError:
        return None
    if _STORE is None or _STORE_FOR != where:
        _STORE = dist.TCPStore(where[0], where[1], None, False, timeout=timedelta(seconds=timeout_s))
        _STORE_FOR = where
    return _STORE


GROUP_STORE_KEY = "scaletrain/group_store"
"""Agent-store key where rank 0 publishes ``host:port`` of the round's own store (:func:`group_store`)."""


def group_store(rank: int, world: int, timeout_s: float) -> dist.Store | None:
    """A fresh store for this round's default process group (None when not under an agent store:
    then ``env://`` as usual).

    Rank 0 hosts it (on ``MASTER_ADDR``'s machine, which is rank 0's: torchrun puts global rank 0
    on the node that hosts the agent store) and publishes its address in the agent store. A rank
    that reads a dead round's address cannot connect (every worker of the previous round is
    stopped before any agent finishes the new rendezvous, agent/server/api.py ``_restart_workers``)
    and reads again until the new address is there. Why not the agent store itself with a
    per-round prefix: no round number is the same on every node (see the module docstring).
    """
    agent = agent_store(timeout_s)
    if agent is None:
        return None
    timeout = timedelta(seconds=timeout_s)
    if rank == 0:
        own = dist.TCPStore(os.environ["MASTER_ADDR"], 0, world, True, timeout=timeout, wait_for_workers=False)
        agent.set(GROUP_STORE_KEY, f"{os.environ['MASTER_ADDR']}:{own.port}")
        return own
    deadline = time.monotonic() + timeout_s
    while True:
        try:  # get() waits for a first round's rank 0; a dead round's address fails to connect
            host, _, port = agent.get(GROUP_STORE_KEY).decode().rpartition(":")
            store = dist.TCPStore(host, int(port), None, False, timeout=timedelta(seconds=1))
        except (RuntimeError, ValueError):  # DistStoreError / DistNetworkError are RuntimeErrors
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
            continue
        store.set_timeout(timeout)
        return store


def _key(out: Path) -> str:
    return f"scaletrain/run_dir/{out}"


_ROUND: dict[str, int] = {}
"""Rank 0's round of the job for each run directory it claimed (1: the job's first round)."""


def claim(out: Path) -> None:
    """Record in the agent's store that this job accepted ``out`` as its run directory; rank 0 also
    counts the rounds that got this far, so that a first round never logs a restart."""
    store = agent_store()
    rounds = 2 if _recorded(out) else 1  # an earlier round of this job opened it (no store, or a new one)
    if store is not None:
        store.set(_key(out), "1")
        if os.environ.get("RANK", "0") == "0":
            rounds = max(rounds, int(store.add(f"scaletrain/rounds/{out}", 1)))
    _ROUND[str(out)] = rounds


JOB_FILE = "torchrun.json"
"""In the run directory: ``{"run_id": ...}``, the ``--rdzv-id`` of the torchrun job that runs in it."""


def _run_id() -> str | None:
    """This torchrun job's ``--rdzv-id`` (None when not under torchrun, or torchrun's default "none",
    which is no job's own)."""
    rid = os.environ.get("TORCHELASTIC_RUN_ID", "")
    return rid if rid and rid != "none" else None


def record(out: Path) -> None:
    """Rank 0, when the run directory is created: note the job's ``--rdzv-id`` in it. Why: the agent
    store lives in the agent of the first round's node rank 0 (the first of the nodes' sorted
    addresses, torch/distributed/elastic/rendezvous/dynamic_rendezvous.py ``_mark_rendezvous_complete``
    and ``next_rendezvous``); when that node is lost for good, the next round's rank-0 agent hosts a
    new, empty store, and the claim is gone with the old one; and with
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (needed for a node to join a running job, see
    :mod:`.replan`) there is no agent store at all. torch asks ``--rdzv-id`` to be unique per job, so
    a directory that records this job's id is this job's."""
    rid = _run_id()
    if rid is not None and not os.environ.get(JOB_DIR_ENV):  # scaletrain's own launcher: its attempts prove it
        write_atomic(out / JOB_FILE, json.dumps({"run_id": rid}))


def _recorded(out: Path) -> bool:
    rid = _run_id()
    try:
        return rid is not None and json.loads((out / JOB_FILE).read_text()).get("run_id") == rid
    except (OSError, ValueError, AttributeError):
        return False


def owns(out: Path) -> bool:
    """True when a rank of this torchrun job (this round or an earlier one) accepted ``out`` (its
    claim in the agent store, or the job's id recorded in the directory: :func:`record`), so the
    files in it are this job's."""
    store = agent_store()
    return (store is not None and store.check([_key(out)])) or _recorded(out)


def resume_round(out: Path | None) -> bool:
    """True when this is a restarted round of a job whose run directory ``out`` has a checkpoint:
    the round resumes from the newest complete one instead of starting over. (In the first round
    no checkpoint of this job can exist before every rank has joined.)"""
    if out is None or not owns(out):
        return False
    from scaletrain.train import checkpoint as ckpt

    return ckpt.latest(out / "checkpoints") is not None


def _process_start() -> float:
    """When this process started (seconds since the epoch; Linux's /proc, else now). The boot
    moment comes from CLOCK_BOOTTIME, not /proc/stat's whole-second ``btime`` (up to 1 s off)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return time.time()


def _last_step(metrics: Path) -> int:
    """The last training step logged in ``metrics`` (0 when none)."""
    last = 0
    try:
        lines = metrics.read_text(errors="replace").splitlines()
    except OSError:
        return 0
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and "loss" in row and isinstance(row.get("step"), int):
            last = row["step"]
    return last


def restart_clock(out: Path, start_step: int) -> RestartClock | None:
    """Rank 0's account of a torchrun restart, so that it logs the ``restart`` row as under
    scaletrain's own launcher. The failure's moment is the newest fault-injector marker or, for a
    real failure, the last metrics write (the last completed step); torchrun tells the worker no
    exit time, so this process's start stands in for it: ``detect_s`` then holds the agents'
    detection and re-rendezvous, ``restart_s`` this process's start-up until the checkpoint load."""
    rounds = _ROUND.get(str(out), 1)
    if rounds < 2 or not out.is_dir() or not (out / "metrics.jsonl").is_file() or not owns(out):
        return None  # the job's first round (a --resume of a finished run included) or nothing ran before
    from scaletrain.train.recovery import RestartClock, fault_time

    metrics = out / "metrics.jsonl"
    times = [t for t in [fault_time(out, 0.0)] if t is not None]
    if metrics.is_file():
        times.append(metrics.stat().st_mtime)
    started = _process_start()
    t_fault = min(max(times, default=started), started)
    # the round count, not TORCHELASTIC_RESTART_COUNT: that may lag on some nodes
    return RestartClock(rounds - 1, t_fault, started, _last_step(metrics), start_step)

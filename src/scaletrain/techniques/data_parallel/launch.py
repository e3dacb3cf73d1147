"""Launch: where this process sits in the job, process groups with timeouts, teardown, failures.

``scaletrain train`` runs unchanged under ``torchrun`` (one process per device): the rank, world
size and rendezvous come from torchrun's environment variables (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``, multi-node rendezvous included). The backend is
chosen from the device: NCCL for CUDA, gloo for CPU. Every collective has the process group's
timeout (``parallel.timeout_s``); when one expires, the step fails with one line naming the rank,
the collective and its size (:func:`explain_comm_failure`) instead of waiting forever (the hangs of
DeepSpeed #5066 / Megatron-LM #1027).

Teardown. ``destroy_process_group`` is called only after the DDP/FSDP objects are deleted and
garbage-collected; destroying the group while a DDP reducer is still alive is what makes the
interpreter print "terminate called without an active exception" at exit.
"""

from __future__ import annotations

import contextlib
import gc
import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from scaletrain.errors import ERROR_DIR_ENV, ConfigError, UserError
from scaletrain.measure.comm import LEDGER

# --------------------------------------------------------------------------- launch


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the job, as torchrun (or any launcher setting its variables) says."""

    rank: int
    world: int
    local_rank: int
    local_world: int

    @property
    def distributed(self) -> bool:
        return self.world > 1


def launch_env() -> LaunchEnv:
    """Read torchrun's environment; a plain ``python`` start is rank 0 of 1."""
    def get(name: str, default: int) -> int:
        value = os.environ.get(name, "")
        try:
            return int(value) if value else default
        except ValueError:
            raise ConfigError(f"environment variable {name}={value!r} is not an integer") from None

    world = get("WORLD_SIZE", 1)
    rank = get("RANK", 0)
    if not 0 <= rank < max(world, 1):
        raise ConfigError(f"RANK={rank} is outside 0..WORLD_SIZE-1 (WORLD_SIZE={world})")
    return LaunchEnv(rank, world, get("LOCAL_RANK", rank), get("LOCAL_WORLD_SIZE", world))


def backend_for(device: torch.device) -> str:
    """NCCL for CUDA devices, gloo otherwise (CPU)."""
    return "nccl" if device.type == "cuda" else "gloo"


def init_process_group(device: torch.device, timeout_s: float,
                       group_store: Callable[[int, int, float], Any] | None = None) -> bool:
    """Join the job's default process group if the launcher started several processes.

    ``group_store(rank, world, timeout_s)`` may give the group a store of its own (None: ``env://``).
    The trainer passes :func:`scaletrain.train.elastic.group_store`, which under torchrun's agent
    makes a fresh store each round: plain ``env://`` uses the agent's job-long store, where a
    restarted round reads the dead round's gloo addresses and hangs or fails in ``connectFullMesh``.

    Returns True if this call created the group (so the caller must tear it down), False if
    there is nothing to do (one process) or a group already exists (a test harness made it).
    """
    env = launch_env()
    if dist.is_initialized() or not env.distributed:
        return False
    if device.type == "cuda":
        torch.cuda.set_device(device)
    kw: dict[str, Any] = {}
    if device.type == "cuda":
        kw["device_id"] = device
    store = group_store(env.rank, env.world, timeout_s) if group_store is not None else None
    if store is not None:
        kw.update(store=store, rank=env.rank, world_size=env.world)
    dist.init_process_group(backend_for(device), timeout=timedelta(seconds=timeout_s), **kw)
    return True


def shutdown(created: bool, finished: bool = False) -> None:
    """Collect garbage (DDP reducers, FSDP states), then destroy the group we created.

    ``finished``: the job ended normally on this rank, so every peer will reach this point too;
    a barrier then keeps a rank from closing its gloo pairs while a peer is still in its last
    collective or writing the last checkpoint (a rank that tore down early was seen to abort its
    peer with "terminate called without an active exception", CI 2026-11-24). After an error the
    barrier is skipped: peers may be dead, and waiting for them would only delay the exit.
    Without a group there is nothing to order, so no collection (it costs ~0.3 s in a large process).
    """
    if dist.is_initialized():
        gc.collect()
    if created and dist.is_initialized():
        if finished:
            dist.barrier()
        dist.destroy_process_group()


SHUTDOWN_S = 3
"""Seconds torchrun waits after SIGTERM before SIGKILL when it stops the other ranks of a failed job
(its default, 30 s, is what a stopped — hung — rank costs in detection time before a restart)."""


def torchrun_command(nproc: int, argv: list[str]) -> list[str]:
    """The command that runs ``scaletrain ARGV`` on ``nproc`` local processes under torchrun.

    It is ``python -m torch.distributed.run --standalone --nproc-per-node N -m scaletrain.cli
    ARGV``, entered through :func:`torchrun_main` so that a failed rank ends the job with that
    rank's own one-line message instead of torchrun's traceback and failure report.
    """
    import sys

    return [sys.executable, "-c", "import sys; from scaletrain.techniques.data_parallel.launch import torchrun_main; "
            "sys.exit(torchrun_main())", "--standalone", f"--nproc-per-node={nproc}",
            f"--shutdown-timeout={SHUTDOWN_S}",
            "-m", "scaletrain.cli", *argv]


def torchrun_main(argv: list[str] | None = None) -> int:
    """``torch.distributed.run.main`` with its failure report reduced to one line (or none when the
    failed rank already printed its ``scaletrain: error:`` line, exit code 2)."""
    import logging
    import sys

    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from torch.distributed.elastic.multiprocessing.api import SignalException

    from scaletrain.train import process_tree
    from scaletrain.train.job_env import AGENT_PID_ENV, LAUNCHER_PID_ENV

    launcher = os.environ.get(LAUNCHER_PID_ENV, "")
    if launcher.isdigit():  # under scaletrain's launcher: this agent (and so its ranks) die with it
        process_tree.die_with_parent(int(launcher))
    os.environ[AGENT_PID_ENV] = str(os.getpid())  # each rank checks it is still this agent's child
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic") or name.startswith("torch.distributed.run"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        torchrun.main(argv if argv is not None else sys.argv[1:])
    except SignalException as e:  # SIGTERM / SIGINT to the agent: it stopped its ranks; no traceback
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        code = failure.exitcode
        errors = os.environ.get(ERROR_DIR_ENV)
        if errors:  # under scaletrain's launcher: it says the one line (scaletrain.train.recovery)
            import json

            died = {"rank": rank, "exitcode": code, "signal": failure.signal_name() if code < 0 else None}
            with contextlib.suppress(OSError):
                (Path(errors) / "launcher.json").write_text(json.dumps(died))
            return 2 if code == 2 else 1
        if code == 2:  # a UserError: the rank printed its one-line message
            return 2
        how = f"signal {failure.signal_name()}" if code < 0 else f"exit code {code}"
        print(f"scaletrain: error: rank {rank} failed ({how}); its output is above", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0



class CommFailure(UserError):
    """A collective timed out or lost a peer; the message names the rank and the collective."""

    restartable = True  # a fresh attempt (new rendezvous, resume) may well succeed


_TIMEOUT_WORDS = ("timed out", "timeout", "time out")
_PEER_WORDS = ("connection closed by peer", "connection reset by peer", "broken pipe", "connection refused")


def explain_comm_failure(exc: BaseException, rank: int, step: int, timeout_s: float) -> CommFailure | None:
    """One line for a collective that failed, or None when ``exc`` is not a communication failure."""
    text = str(exc).lower()
    if isinstance(exc, CommFailure):
        return exc
    timed_out = any(w in text for w in _TIMEOUT_WORDS)
    lost_peer = any(w in text for w in _PEER_WORDS)
    if not (timed_out or lost_peer or isinstance(exc, getattr(dist, "DistBackendError", ()))):
        return None
    op = "a collective"
    if LEDGER.last is not None:
        name, size, n = LEDGER.last
        op = f"{name} of {size / 2**20:.2f} MiB over {n} ranks"
    if timed_out:
        why = (f"timed out after {timeout_s:g} s: another rank stopped, crashed or took a different path "
               f"(raise parallel.timeout_s if one step legitimately takes longer)")
    else:
        why = "lost its peer: another rank exited or crashed (see that rank's message)"
    return CommFailure(f"rank {rank}: {op} at step {step + 1} {why}")

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

import gc
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from scaletrain.errors import ConfigError, UserError
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

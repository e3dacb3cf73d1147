"""Run a function on N local processes with a gloo process group — for tests and benchmarks.

``run_distributed(fn, world_size, *args)`` starts ``world_size`` processes (spawn), initialises
``torch.distributed`` with gloo on a free loopback port in each, calls ``fn(rank, world_size,
*args)``, and returns the per-rank return values (which must be picklable). A rank that raises
makes the whole call raise with that rank's traceback; a hang ends after ``timeout_s``.

On Linux the processes are forks of a ``forkserver`` that imported torch and the trainer once per
Python session (each spawned rank re-imported them: ~3.5 s of CPU per rank, most of a small
multi-process test on a 2-core machine); each rank takes the caller's environment at the call, as
a spawned one would. Elsewhere they are spawned.

Each process tears down cleanly (``gc.collect()`` then ``destroy_process_group()``), which avoids
the "terminate called without an active exception" abort seen with DDP at interpreter exit.
"""

from __future__ import annotations

import gc
import os
import pickle
import socket
import sys
import tempfile
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist
import torch.multiprocessing as mp


PRELOAD = ["torch", "torch.distributed", "scaletrain.train.trainer"]
"""What the forkserver imports once, before any rank is forked from it (no threads are started by them)."""


def start_method() -> str:
    """``forkserver`` (preloading :data:`PRELOAD`) on Linux, ``spawn`` elsewhere."""
    if not sys.platform.startswith("linux"):
        return "spawn"
    import multiprocessing

    multiprocessing.set_forkserver_preload(PRELOAD)  # read when the server starts (the first call)
    return "forkserver"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, outdir: str, fn: Callable, args: tuple, timeout_s: float,
            threads: int, environ: dict[str, str]) -> None:
    import torch

    os.environ.clear()  # a fork of the forkserver has the server's environment: take the caller's
    os.environ.update(environ)
    torch.set_num_threads(threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    out = Path(outdir) / f"rank{rank}.pkl"
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
        result = ("ok", fn(rank, world, *args))
    except BaseException:  # noqa: BLE001 - reported to the parent
        result = ("error", traceback.format_exc())
    finally:
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()
    out.write_bytes(pickle.dumps(result))


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 300.0,
                    threads_per_rank: int = 1) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes; return their results."""
    with tempfile.TemporaryDirectory() as d:
        ctx = mp.start_processes(_worker, args=(world_size, free_port(), d, fn, args, timeout_s, threads_per_rank,
                                                     dict(os.environ)),
                                 nprocs=world_size, join=False, start_method=start_method())
        while not ctx.join(timeout=timeout_s + 30):
            pass
        results = []
        for r in range(world_size):
            p = Path(d) / f"rank{r}.pkl"
            if not p.exists():
                raise RuntimeError(f"rank {r} produced no result")
            status, value = pickle.loads(p.read_bytes())
            if status == "error":
                raise RuntimeError(f"rank {r} failed:\n{value}")
            results.append(value)
        return results

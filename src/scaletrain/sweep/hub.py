"""The coordinator's side of the devices: worker processes, the ready queue and the timeline.

Each run of a sweep trains in a thread of the coordinator (its own :class:`Trainer`, unchanged);
whenever its runtime needs a shard task or a host core it calls :meth:`Hub.call` /
:meth:`Hub.host`, which block that thread until the task has run. The hub places ready tasks
with :func:`.policy.assign` the moment a device or core frees, records every task's start and
end (the measured timeline), and keeps each model's remaining predicted time for Sharded-LRTF.

Workers are ``spawn``-ed processes (:mod:`.worker`); tensors travel through
``torch.multiprocessing`` queues as shared-memory handles, never pickled bytes.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Iterator

import torch.multiprocessing as tmp

from scaletrain.errors import UserError
from scaletrain.sweep.policy import HOST_KIND, Pending, Policy, Resources, assign
from scaletrain.sweep.worker import worker_main


class SweepTaskError(UserError):
    """A shard task failed in a worker (out of the device budget, a model error): one line."""


@dataclass
class Span:
    """One task as it ran (seconds on ``time.monotonic``; ``device`` None for host tasks)."""

    model: int
    kind: str
    shard: int
    device: int | None
    start: float
    end: float


class Hub:
    """Starts ``devices`` workers with ``budget`` bytes each and schedules tasks onto them."""

    def __init__(self, devices: int, cores: int, budget: int | None, policy: str, n_models: int,
                 threads: int = 1, track: bool = True, device_holds_core: bool = True):
        self.devices = devices
        ctx = tmp.get_context("spawn")
        self._tasks = [ctx.Queue() for _ in range(devices)]
        self._results = ctx.Queue()
        self._procs = [ctx.Process(target=worker_main, args=(i, budget, threads, self._tasks[i], self._results, track),
                                   daemon=True) for i in range(devices)]
        for p in self._procs:
            p.start()
        ready, t0 = 0, time.monotonic()
        while ready < devices:
            try:
                msg = self._results.get(timeout=1)
            except Exception:  # noqa: BLE001 - queue.Empty: is everyone still alive?
                dead = [i for i, p in enumerate(self._procs) if not p.is_alive()]
                if dead or time.monotonic() - t0 > 300:
                    self._kill()
                    code = self._procs[dead[0]].exitcode if dead else "none: timed out"
                    raise SweepTaskError(f"sweep device {dead[0] if dead else '?'} did not start "
                                         f"(exit code {code})") from None
                continue
            ready += "ready" in msg
        self._cv = threading.Condition()
        self._ids = itertools.count()
        self._seq = itertools.count()
        self._futures: dict[int, Future] = {}
        self._ready: list[Pending] = []
        self._running: dict[int, tuple[Pending, int | None, float]] = {}
        self.res = Resources(devices, cores, device_holds_core)
        self.policy = Policy(policy if policy != "auto" else "lrtf", n_models, devices)
        """Replaced by the run's chosen policy before any task is placed."""
        self.remaining: dict[int, float] = {}
        """Predicted seconds of work left per model (Sharded-LRTF's key)."""
        self.predict: dict[int, dict[tuple[str, int], float]] = {}
        """Per model: predicted seconds of each (kind, shard) task."""
        self.timeline: list[Span] = []
        self._closed = False
        self._reader = threading.Thread(target=self._read, name="sweep-results", daemon=True)
        self._reader.start()

    # -- workers, directly ---------------------------------------------------------------------
    def direct(self, device: int, msg: dict[str, Any]) -> Future:
        """Send ``msg`` to one worker outside the schedule (registration, stats)."""
        fut: Future = Future()
        tid = next(self._ids)
        with self._cv:
            self._futures[tid] = fut
        self._tasks[device].put({**msg, "id": tid})
        return fut

    def broadcast(self, msg: dict[str, Any]) -> list[dict[str, Any]]:
        futs = [self.direct(d, msg) for d in range(self.devices)]
        return [self._check(f.result()) for f in futs]

    # -- scheduled tasks -------------------------------------------------------------------------
    def call(self, model: int, kind: str, shard: int, payload: dict[str, Any],
             pin: int | None = None) -> dict[str, Any]:
        """Run one shard task of ``model`` when the policy places it; blocks; returns the worker's result."""
        fut: Future = Future()
        t = Pending(model, kind, shard, pin, next(self._seq), payload=(payload, fut))
        with self._cv:
            self._ready.append(t)
            self._dispatch()
        return self._check(fut.result())

    @contextlib.contextmanager
    def host(self, model: int) -> Iterator[None]:
        """Hold a host core for ``model``'s optimizer step (granted in the policy's order)."""
        fut: Future = Future()
        t = Pending(model, HOST_KIND, 0, None, next(self._seq), payload=(None, fut))
        with self._cv:
            self._ready.append(t)
            self._dispatch()
        fut.result()
        t0 = time.monotonic()
        try:
            yield
        finally:
            t1 = time.monotonic()
            with self._cv:
                self.timeline.append(Span(model, HOST_KIND, 0, None, t0, t1))
                self.res.give(None)
                self._done(model, HOST_KIND, 0)
                self._dispatch()

    def finish(self, model: int) -> None:
        """``model`` has no task left (its run ended, or failed): the policy stops waiting for it."""
        with self._cv:
            self.policy.finish(model)
            self._dispatch()

    def _check(self, res: dict[str, Any]) -> dict[str, Any]:
        if "error" in res:
            raise SweepTaskError(f"device {res.get('worker')}: {res['error']}")
        return res

    def _done(self, model: int, kind: str, shard: int) -> None:
        pred = self.predict.get(model, {}).get((kind, shard), 0.0)
        self.remaining[model] = max(0.0, self.remaining.get(model, 0.0) - pred)

    def _dispatch(self) -> None:
        """Place what can run now (caller holds the lock)."""
        if self._closed:
            return
        for t, dev in assign(self._ready, self.res, self.policy, self.remaining):
            self._ready.remove(t)
            payload, fut = t.payload
            if dev is None:  # a host core: the waiting thread runs the step itself
                fut.set_result({})
                continue
            tid = next(self._ids)
            self._futures[tid] = fut
            self._running[tid] = (t, dev, time.monotonic())
            self._tasks[dev].put({**payload, "op": "task", "id": tid, "model": t.model, "kind": t.kind,
                                  "shard": t.shard})

    def _read(self) -> None:
        while True:
            try:
                res = self._results.get()
            except (EOFError, OSError):
                return
            if res is None:
                return
            with self._cv:
                fut = self._futures.pop(res.get("id"), None)
                run = self._running.pop(res.get("id"), None)
                if run is not None:
                    t, dev, _ = run
                    self.timeline.append(Span(t.model, t.kind, t.shard, dev, res.get("t0", 0.0), res.get("t1", 0.0)))
                    self.res.give(dev)
                    self._done(t.model, t.kind, t.shard)
                    self._dispatch()
            if fut is not None:
                fut.set_result(res)

    def _kill(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()

    def close(self) -> None:
        with self._cv:
            self._closed = True
        for q in self._tasks:
            with contextlib.suppress(Exception):
                q.put(None)
        for p in self._procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        with contextlib.suppress(Exception):
            self._results.put(None)
        self._reader.join(timeout=5)

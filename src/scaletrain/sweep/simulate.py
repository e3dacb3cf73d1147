"""Predict a sweep before it runs: its makespan, each device's utilisation and its timeline.

A discrete-event simulation of the very decisions the hub makes (:func:`.policy.assign` with
the same resources and policy) over each run's task program, with every task's predicted
duration (:class:`Durations`, from the shard profile: each shard task measured on the devices
under the sweep's own load, seconds) and a per-task latency between a model's tasks (its
thread's hand-over through the queues: the model waits, the device is free for others).

A run's program, per optimizer step: ``accum`` x (``F_0 .. F_{K-2}, FB_{K-1}, B_{K-2} .. B_0``)
then ``H`` (clip + optimizer step on a host core); at every evaluation ``eval_micro`` x
``E_0 .. E_{K-1}``. A backward is pinned to its forward's device, as in the run.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Iterator

from scaletrain.sweep.hub import Span
from scaletrain.sweep.policy import HOST_KIND, Pending, Policy, Resources, assign

CHECKPOINT = "C"


@dataclass
class Durations:
    """Predicted seconds per task of one model: ``tasks[(kind, shard)]``, ``host`` (H), ``latency``,
    ``checkpoint`` (C: writing a checkpoint, in the run's own thread: the run waits, no device or
    core is held)."""

    tasks: dict[tuple[str, int], float]
    host: float
    latency: float = 0.0
    checkpoint: float = 0.0

    def of(self, kind: str, shard: int) -> float:
        if kind == HOST_KIND:
            return self.host
        if kind == CHECKPOINT:
            return self.checkpoint
        return self.tasks[(kind, shard)]


@dataclass
class RunProgram:
    """What one run will execute (from its config): steps left, accumulation, shards, evaluations."""

    shards: int
    steps: int
    accum: int = 1
    eval_steps: list[int] = field(default_factory=list)
    """Steps (1-based, among those left) after which an evaluation runs."""
    eval_micro: int = 1
    """Micro-batches per evaluation."""
    checkpoint_steps: list[int] = field(default_factory=list)
    """Steps (1-based, among those left) after which a checkpoint is written."""

    def tasks(self) -> Iterator[tuple[str, int]]:
        k = self.shards
        evals = set(self.eval_steps)
        for step in range(1, self.steps + 1):
            for _ in range(self.accum):
                yield from (("F", s) for s in range(k - 1))
                yield ("FB", k - 1)
                yield from (("B", s) for s in range(k - 2, -1, -1))
            yield (HOST_KIND, 0)
            if step in evals:
                for _ in range(self.eval_micro):
                    yield from (("E", s) for s in range(k))
            if step in self.checkpoint_steps:
                yield (CHECKPOINT, 0)

    def total(self, d: Durations) -> float:
        return sum(d.of(kind, s) for kind, s in self.tasks())


@dataclass
class Prediction:
    makespan_s: float
    utilisation: list[float]
    """Busy fraction of each device over the makespan."""
    finish_s: list[float]
    """When each run ends (seconds from the start)."""
    timeline: list[Span]


def simulate(programs: list[RunProgram], durations: list[Durations], devices: int, cores: int, policy: str,
             device_holds_core: bool = True) -> Prediction:
    """Replay the hub's scheduling of ``programs`` with predicted ``durations``; times from 0."""
    res = Resources(devices, cores, device_holds_core)
    pol = Policy(policy, len(programs), devices)
    remaining = {m: p.total(d) for m, (p, d) in enumerate(zip(programs, durations))}
    its = [p.tasks() for p in programs]
    where: list[dict[int, int]] = [{} for _ in programs]
    ready: list[Pending] = []
    seq = 0
    arrivals: list[tuple[float, int, int]] = []  # (time, seq, model): the model's next task becomes ready
    running: list[tuple[float, int, Pending, int | None]] = []
    spans: list[Span] = []
    finish = [0.0] * len(programs)
    now = 0.0

    def next_task(m: int, t: float) -> None:
        nonlocal seq
        kind_shard = next(its[m], None)
        if kind_shard is None:
            finish[m] = t
            pol.finish(m)
            return
        kind, s = kind_shard
        seq += 1
        if kind == CHECKPOINT:  # the run's thread writes it, holding nothing; the run goes on after it
            heapq.heappush(arrivals, (t + durations[m].checkpoint, seq, m))
            pend[m] = None
            return
        pin = where[m].get(s) if kind == "B" else None
        heapq.heappush(arrivals, (t, seq, m))
        pend[m] = Pending(m, kind, s, pin, seq)

    pend: dict[int, Pending | None] = {}
    for m in range(len(programs)):
        next_task(m, 0.0)
    while arrivals or running or ready:
        while arrivals and arrivals[0][0] <= now + 1e-12:
            at, _, m = heapq.heappop(arrivals)
            task = pend.pop(m)
            if task is None:
                next_task(m, at)
            else:
                ready.append(task)
        for t, dev in assign(ready, res, pol, remaining):
            ready.remove(t)
            dur = durations[t.model].of(t.kind, t.shard)
            if t.kind == "F" and dev is not None:
                where[t.model][t.shard] = dev
            heapq.heappush(running, (now + dur, t.seq, t, dev))
            spans.append(Span(t.model, t.kind, t.shard, dev, now, now + dur))
        nxt = [x for x in (running[0][0] if running else None, arrivals[0][0] if arrivals else None) if x is not None]
        if not nxt and not ready:
            break
        if not nxt:  # tasks wait that nothing will ever place: a policy bug, never a short makespan
            raise RuntimeError(f"simulated sweep deadlocked with {len(ready)} tasks waiting ({pol.name})")
        now = min(nxt)
        while running and running[0][0] <= now + 1e-12:
            end, _, t, dev = heapq.heappop(running)
            res.give(dev)
            remaining[t.model] = max(0.0, remaining[t.model] - durations[t.model].of(t.kind, t.shard))
            next_task(t.model, end + durations[t.model].latency)
    makespan = max(finish, default=0.0)
    busy = [0.0] * devices
    for s in spans:
        if s.device is not None:
            busy[s.device] += s.end - s.start
    return Prediction(makespan, [b / makespan if makespan else 0.0 for b in busy], finish, spans)


def utilisation(spans: list[Span], devices: int) -> tuple[float, list[float]]:
    """(makespan, busy fraction per device) of a measured timeline (times relative to its start)."""
    if not spans:
        return 0.0, [0.0] * devices
    t0 = min(s.start for s in spans)
    t1 = max(s.end for s in spans)
    busy = [0.0] * devices
    for s in spans:
        if s.device is not None:
            busy[s.device] += s.end - s.start
    span = t1 - t0
    return span, [b / span if span else 0.0 for b in busy]


def plot_timelines(panels: list[tuple[str, list[Span], int]], names: list[str], path: str) -> None:
    """One row per device (and one for host steps) per panel, a colour per run; PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 1.2 + 0.9 * sum(p[2] + 1 for p in panels) / len(panels)
                                                      * len(panels)), squeeze=False)
    colours = plt.get_cmap("tab10")
    for ax, (title, spans, devices) in zip(axes[:, 0], panels):
        t0 = min((s.start for s in spans), default=0.0)
        for s in spans:
            row = devices if s.device is None else s.device
            alpha = {"F": 0.55, "FB": 0.9, "B": 0.9, "E": 0.3, HOST_KIND: 0.7}[s.kind]
            ax.barh(row, s.end - s.start, left=s.start - t0, height=0.8, color=colours(s.model % 10), alpha=alpha,
                    edgecolor="none")
        ax.set_yticks(range(devices + 1), [f"device {d}" for d in range(devices)] + ["host steps"])
        ax.invert_yaxis()
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("seconds")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colours(i % 10)) for i in range(len(names))]
    fig.legend(handles, names, loc="lower center", ncol=min(len(names), 6), fontsize=8)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)

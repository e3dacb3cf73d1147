"""Which ready shard task runs next, and where: the one scheduling rule of a sweep.

The same :func:`assign` drives the live sweep (:mod:`.hub`) and its simulator (:mod:`.simulate`),
so the prediction replays exactly the decisions the run makes.

Resources. ``devices`` logical devices run shard tasks (``F``/``FB``/``B``/``E``); ``cores`` host
cores run host tasks (``H``: a model's clipping and optimizer step on its host-resident states,
ZeRO-Offload's placement). On a machine without accelerators every logical device is itself a
process on a host core, so a device task also holds a core (``device_holds_core``): an optimizer
step then competes with shard tasks for the same cores, as it does in reality there.

Policies (Hydra, Nagrecha & Kumar 2023, "shard alternator parallelism"):

- ``lrtf`` — Sharded-LRTF: of the ready tasks, the model with the *longest remaining* predicted
  time goes first, so the long jobs never become the tail of the sweep;
- ``round_robin`` — models take turns in a fixed cycle (the simple baseline);
- ``sequential`` — one model at a time, to its end, its shards spread over all devices: plain
  model parallelism (and, with one device, "one run after another with offloading");
- ``task`` — task parallelism: model *m* stays on device ``m mod devices``; models run
  concurrently but a model never moves (only sensible when a model fits a device).

A backward task is *pinned* to the device that ran its forward: the autograd graph and the
spilled activations live in that process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

POLICIES = ("lrtf", "round_robin", "sequential", "task")
DEVICE_KINDS = ("F", "FB", "B", "E")
HOST_KIND = "H"


@dataclass
class Pending:
    """A task whose model is waiting for it (each model has at most one)."""

    model: int
    kind: str
    shard: int
    pin: int | None = None
    """Device it must run on (a backward: where its forward ran); None = any."""
    seq: int = 0
    """Arrival order (ties)."""
    payload: Any = field(default=None, repr=False, compare=False)


@dataclass
class Resources:
    devices: int
    cores: int
    device_holds_core: bool = True
    free_devices: list[int] = field(default_factory=list)
    free_cores: int = 0

    def __post_init__(self) -> None:
        self.free_devices = list(range(self.devices))
        self.free_cores = self.cores

    def take(self, device: int | None) -> None:
        if device is not None:
            self.free_devices.remove(device)
        if device is None or self.device_holds_core:
            self.free_cores -= 1

    def give(self, device: int | None) -> None:
        if device is not None:
            self.free_devices.append(device)
            self.free_devices.sort()
        if device is None or self.device_holds_core:
            self.free_cores += 1


class Policy:
    """Orders the ready tasks; :func:`assign` places them in that order."""

    def __init__(self, name: str, n_models: int, devices: int):
        if name not in POLICIES:
            raise ValueError(f"unknown policy {name!r}; allowed: {', '.join(POLICIES)}")
        self.name = name
        self.n_models = n_models
        self.devices = devices
        self._turn = -1
        self.done: set[int] = set()
        """Models with no task left (told by :meth:`finish`)."""

    def finish(self, model: int) -> None:
        self.done.add(model)

    def pin(self, task: Pending) -> int | None:
        if self.name == "task" and task.kind != HOST_KIND:
            return task.model % self.devices
        return task.pin

    def order(self, ready: list[Pending], remaining: dict[int, float]) -> list[Pending]:
        if self.name == "lrtf":
            return sorted(ready, key=lambda t: (-remaining.get(t.model, 0.0), t.model))
        if self.name == "round_robin":
            return sorted(ready, key=lambda t: ((t.model - self._turn - 1) % self.n_models, t.seq))
        if self.name == "sequential":  # the lowest-numbered model not finished, alone
            first = min((m for m in range(self.n_models) if m not in self.done), default=None)
            return [t for t in ready if t.model == first or t.kind == HOST_KIND]
        return sorted(ready, key=lambda t: (t.seq, t.model))  # task: first come first served per device

    def note(self, task: Pending) -> None:
        if task.kind != HOST_KIND:
            self._turn = task.model


def assign(ready: list[Pending], res: Resources, policy: Policy,
           remaining: dict[int, float]) -> list[tuple[Pending, int | None]]:
    """Greedy placement of ``ready`` in the policy's order; takes the resources it uses."""
    out: list[tuple[Pending, int | None]] = []
    for t in policy.order(ready, remaining):
        if res.free_cores <= 0 and (t.kind == HOST_KIND or res.device_holds_core):
            continue
        if t.kind == HOST_KIND:
            res.take(None)
            out.append((t, None))
            continue
        want = policy.pin(t)
        if want is None:
            if not res.free_devices:
                continue
            dev = res.free_devices[0]
        elif want in res.free_devices:
            dev = want
        else:
            continue
        res.take(dev)
        policy.note(t)
        out.append((t, dev))
    return out

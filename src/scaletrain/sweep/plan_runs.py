"""``scaletrain plan --runs N``: N training runs of one model on one cluster — spilled shards (the sweep's
shard alternator), task parallelism, or N independent plans — priced on paper (seconds per step of all N).

Nagrecha's survey (§5) asks hybrid-parallel search to weigh task parallelism for multi-model training and
CPU spilling; Hydra (Nagrecha & Kumar) is the shard alternator ``scaletrain sweep`` runs. Three layouts:

* **independent plans**: the planner's best plan for one run (:func:`scaletrain.planner.api.rank`), either
  N of them side by side on D/N devices each (when N divides the D devices) or one after another on all D;
  the faster of the two is kept;
* **task parallelism, resident**: each run on one device with the planner's best one-device plan (offload
  included), ⌈N/D⌉ waves; impossible when no one-device plan fits;
* **shard alternator** (and task parallelism over the same spilled shards): every model cut into the
  fewest equal-layer shards that fit a device; fp32 parameters, gradients and optimizer states on the
  host (ZeRO-Offload's placement, :mod:`scaletrain.sweep.worker`); each task promotes its shard's fp32
  parameters host -> device, runs, spills its saved activations (forward) or fetches them (backward) and
  sends its fp32 gradients back; the optimizer step runs on the host (``cpu_adam_params_per_s``). Task
  seconds = compute (the analytic roofline, :func:`~scaletrain.planner.cost.layer_times`) + parameter and
  gradient copies, serial as in the worker; activation spills overlap the compute where the platform's copy
  engines do (``copy_overlaps_compute``), else add. The sweep's own simulator
  (:func:`scaletrain.sweep.simulate.simulate`) then schedules all N runs' tasks on the D devices with
  the Sharded-LRTF policy (and ``task``: model m pinned to device m mod D), one host lane for the steps per
  host CPU (``devices_per_host``: a DGX node's one host, each GH200's own Grace).

The host link is the platform's ``h2d_bytes_per_s`` / ``d2h_bytes_per_s``: PCIe on the DGX presets, NVLink-C2C
on ``gh200``, where spilling costs a seventh of PCIe Gen5's time and the alternator wins.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from scaletrain.errors import UserError
from scaletrain.platform import Platform

GiB = 1024**3


@dataclass
class RunsLayout:
    """One way to train the N runs: seconds per step of all of them (every run one optimizer step)."""

    name: str
    step_s: float
    """inf when it does not fit."""
    detail: str

    def to_dict(self) -> dict[str, Any]:
        return {"layout": self.name, "step_s": None if math.isinf(self.step_s) else self.step_s, "detail": self.detail}


def _shard_bytes(shape: Any, layers: int, *, seq: int, mb: int, elem: int, last: bool, first: bool) -> float:
    """Device bytes of a shard's worst task: fp32 parameters + gradients, its saved activations, its
    input and output (and their gradients), the logits of the last."""
    from scaletrain.planner.memory import layer_activation_bytes, logits_bytes, rank_params

    params = rank_params(shape, tp=1, pp=1, first=first, last=last, layers=layers) if (first or last) else \
        layers * shape.layer_params()
    io = 4 * seq * mb * shape.hidden * elem
    return 8 * params + layers * layer_activation_bytes(shape, seq, mb, elem=elem) + io + (
        logits_bytes(shape, seq, mb) if last else 0.0)


def shards(shape: Any, plat: Platform, *, seq: int, mb: int, elem: int, reserve: float = 2 * GiB) -> list[int]:
    """Layers per shard: the fewest equal-layer shards whose every task fits the device; UserError if one
    layer does not."""
    from scaletrain.planner.hetero import even_split

    room = plat.device_memory_bytes - reserve
    for k in range(1, shape.layers + 1):
        split = even_split(shape.layers, k)
        if all(_shard_bytes(shape, n, seq=seq, mb=mb, elem=elem, first=i == 0, last=i == k - 1) <= room
               for i, n in enumerate(split)):
            return split
    raise UserError(f"one layer of the model at micro-batch {mb} does not fit a {plat.name} "
                    f"({plat.device_memory_bytes / GiB:.0f} GiB): no shard alternator")


def durations(shape: Any, plat: Platform, split: list[int], *, seq: int, mb: int, precision: str) -> Any:
    """The sweep simulator's :class:`~scaletrain.sweep.simulate.Durations` of one run (module docstring)."""
    from scaletrain.planner.hetero import _head_s, _layer_s
    from scaletrain.planner.memory import layer_activation_bytes, rank_params
    from scaletrain.sweep.simulate import Durations

    elem = 4 if precision == "fp32" else 2
    per_layer = _layer_s(shape, plat, seq, mb, precision)  # forward + backward = 3 forwards (bwd = 2 fwd)
    fwd_l, bwd_l = per_layer / 3, 2 * per_layer / 3
    tasks: dict[tuple[str, int], float] = {}
    K = len(split)
    for i, n in enumerate(split):
        first, last = i == 0, i == K - 1
        pbytes = 4 * (rank_params(shape, tp=1, pp=1, first=first, last=last, layers=n) if (first or last)
                      else n * shape.layer_params())
        act = n * layer_activation_bytes(shape, seq, mb, elem=elem)
        promote, grads = plat.h2d_time(pbytes), plat.d2h_time(pbytes)

        def with_spill(compute: float, copy: float) -> float:
            return max(compute, copy) if plat.copy_overlaps_compute else compute + copy
        if last:
            tasks[("FB", i)] = promote + n * per_layer + _head_s(shape, plat, seq, mb, precision) + grads
        else:
            tasks[("F", i)] = promote + with_spill(n * fwd_l, plat.d2h_time(act))
            tasks[("B", i)] = promote + with_spill(n * bwd_l, plat.h2d_time(act)) + grads
    return Durations(tasks, host=shape.params() / plat.cpu_adam_params_per_s)


def alternator(shape: Any, plat: Platform, devices: int, runs: int, *, global_batch: int, seq: int,
               precision: str, optimizer: str = "adamw", policy: str = "lrtf") -> RunsLayout:
    """The N runs' spilled shards on D devices, scheduled by the sweep's simulator; the micro-batch (a power
    of two, at most 64 micro-batches a step) whose simulated step is shortest."""
    from scaletrain.planner.cost import optim_state_bytes
    from scaletrain.sweep.simulate import RunProgram, simulate

    elem = 4 if precision == "fp32" else 2
    per_host = plat.devices_per_host or plat.devices_per_node or devices
    lanes = max(1, math.ceil(devices / per_host))  # host CPUs: optimizer-step lanes and host memory
    name = "shard alternator" if policy == "lrtf" else "task parallel (spilled shards)"
    host_need = runs * shape.params() * (8 + optim_state_bytes(optimizer, shape.hidden))
    if host_need > lanes * plat.host_memory_bytes:
        return RunsLayout(name, math.inf, f"the {runs} runs' fp32 parameters, gradients and optimizer states "
                          f"({host_need / 1e9:.0f} GB) exceed the host memory ({lanes} x "
                          f"{plat.host_memory_bytes / 1e9:.0f} GB)")
    best, why = None, "no micro-batch fits"
    mb = 1
    while mb <= global_batch:
        if global_batch % mb == 0 and global_batch // mb <= 64:
            try:
                split = shards(shape, plat, seq=seq, mb=mb, elem=elem)
            except UserError as e:
                why = str(e)
                break
            d = durations(shape, plat, split, seq=seq, mb=mb, precision=precision)
            steps = 8  # several steps: the steady state, where one run's host step overlaps the others' shards
            prog = RunProgram(shards=len(split), steps=steps, accum=global_batch // mb)
            sim = simulate([prog] * runs, [d] * runs, devices, lanes, policy, device_holds_core=False)
            step = sim.makespan_s / steps
            if best is None or step < best.step_s:
                busy = sum(sim.utilisation) / devices
                layers = "+".join(map(str, split))
                best = RunsLayout(name, step, f"{len(split)} shards of {layers} layers, micro-batch {mb}"
                                        f" x {global_batch // mb}, devices busy {busy:.0%} (sweep simulator, {policy})")
        mb *= 2
    return best or RunsLayout(name, math.inf, why)


def price_runs(model: str, overrides: dict, plat: Platform, *, nodes: int, gpus_per_node: int, runs: int,
               global_batch: int, seq: int, precision: str = "bf16", optimizer: str = "adamw") -> list[RunsLayout]:
    """Every layout of the module docstring, fastest first (those that do not fit last, step inf)."""
    from scaletrain.planner.api import rank
    from scaletrain.planner.shape import Shape, analytic

    if not analytic(model):
        raise UserError(f"--runs prices decoder shapes (gpt2-*, hf:llama, ...); {model} is not one")
    D = nodes * gpus_per_node
    shape = Shape.of(model, **overrides)
    seq = seq or shape.positions

    def best_step(n_nodes: int, per_node: int) -> tuple[float, str]:
        try:
            _, _, res = rank(model, overrides, [plat], [n_nodes], gpus_per_node=per_node, global_batch=global_batch,
                             seq=seq, precision=precision, optimizer=optimizer)
        except UserError as e:
            return math.inf, str(e)[:160]
        c = res.ranked[0].cost
        return c.step_time_s, c.plan.describe()

    out = []
    whole, whole_plan = best_step(nodes, gpus_per_node)
    seqn = RunsLayout("independent plans", runs * whole, f"one after another on all {D} devices: {whole_plan}")
    if runs <= D and D % runs == 0 and runs > 1:
        g = D // runs
        n_nodes, per_node = (g // gpus_per_node, gpus_per_node) if g >= gpus_per_node else (1, g)
        side, side_plan = best_step(n_nodes, per_node)
        if side < seqn.step_s:
            seqn = RunsLayout("independent plans", side, f"{runs} side by side on {g} device(s) each: {side_plan}")
    out.append(seqn)
    one, one_plan = best_step(1, 1)
    out.append(RunsLayout("task parallel (resident)", math.ceil(runs / D) * one,
                          f"{math.ceil(runs / D)} wave(s) of one run per device: {one_plan}"))
    for policy in ("lrtf", "task"):
        out.append(alternator(shape, plat, D, runs, global_batch=global_batch, seq=seq, precision=precision,
                              optimizer=optimizer, policy=policy))
    return sorted(out, key=lambda r: r.step_s)

"""Heterogeneous devices: uneven pipeline stages and per-replica batches sized to each device.

Metis (Um et al., ATC'24), HetPipe (Park et al., ATC'20) and Whale (Jia et al., ATC'22) give a faster
device more of the work instead of the even split, which runs at the pace of the slowest device. Here
each device is a :class:`~scaletrain.platform.Platform` (``--platform a100-80g:2,v100:2``: two of each, in
that order; or a cluster file), and the planner prices two layouts on paper (seconds, bytes):

* **data parallel** (every device holds the whole model): device d runs b_d of the global batch's
  samples, in micro-batches of the largest size whose activations fit its memory; b_d minimises the
  slowest device's compute time max_d b_d·τ_d (τ_d: seconds per sample at that micro-batch, the
  analytic roofline of :func:`~scaletrain.planner.cost.layer_times`); then one ring all-reduce of the fp32
  gradients over the slowest link and the optimizer step (not overlapped: an upper bound);
* **pipeline** (one stage per device, in the order given, 1F1B): device d holds l_d layers (the
  embedding on the first, the head on the last) minimising the slowest stage's time per micro-batch,
  with l_d capped by what its memory holds (model states + 1F1B's in-flight activations);
  step = (m + p − 1)·T_slowest.

Both splits are the one integer min–max allocation :func:`min_max_split` (greedy: the next unit goes
where it finishes earliest, optimal for increasing per-device costs). The even split is priced beside
it, so the predicted margin (even / planned step) is what a run should measure. :func:`min_max_split`
also takes measured per-device rates, which is how ``benchmarks/planner/hetero_dp.py`` plans its CPU run.
"""

from __future__ import annotations

import heapq
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from scaletrain.errors import UserError
from scaletrain.platform import Platform

GiB = 1024**3


def is_cluster(spec: str) -> bool:
    """Whether a ``--platform`` value lists several devices (``name:count,...``) or is a cluster file."""
    if spec.endswith(".json") and Path(spec).is_file():
        try:
            data = json.loads(Path(spec).read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError):
            return False
        return isinstance(data, dict) and "devices" in data
    return ":" in spec or "," in spec


def parse_cluster(spec: str, resolve: Callable[[str], Platform]) -> list[Platform]:
    """One Platform per device, in stage order, from ``a100-80g:2,v100:2`` or a cluster file
    ``{"devices": [{"platform": "a100-80g" | {platform fields}, "count": 2}, ...]}``; ``resolve``
    turns a preset name or a platform file into a Platform. One-line UserError on bad input."""
    if spec.endswith(".json") and Path(spec).is_file():
        data = json.loads(Path(spec).read_text(encoding="utf-8"))
        items = data.get("devices")
        if not isinstance(items, list) or not items:
            raise UserError(f"--platform {spec}: \"devices\" must be a non-empty list of {{platform, count}}")
        entries = []
        for it in items:
            if not isinstance(it, dict) or "platform" not in it:
                raise UserError(f"--platform {spec}: each device entry needs \"platform\" (a preset name or fields)")
            p = it["platform"]
            try:
                plat = Platform.from_dict(p) if isinstance(p, dict) else resolve(str(p))
            except TypeError as e:  # a field object without "name" or another required field
                raise UserError(f"--platform {spec}: a device's platform fields: {e}") from None
            entries.append((plat, it.get("count", 1)))
    else:
        entries = []
        for part in spec.split(","):
            name, _, n = part.strip().partition(":")
            if not name:
                raise UserError(f"--platform {spec!r}: expected NAME:COUNT[,NAME:COUNT...], e.g. a100-80g:2,v100:2")
            entries.append((resolve(name), n or "1"))
    out: list[Platform] = []
    for plat, n in entries:
        ok = (isinstance(n, int) and not isinstance(n, bool)) or (isinstance(n, str) and n.strip().isdigit())
        count = int(n) if ok else 0
        if count < 1:
            raise UserError(f"--platform {spec!r}: count of {plat.name} must be an integer >= 1 (got {n!r})")
        out += [plat] * count
    if len(out) < 2:
        raise UserError(f"--platform {spec!r}: a heterogeneous cluster needs at least 2 devices")
    return out


def min_max_split(total: int, unit_s: list[float], fixed_s: list[float] | None = None,
                  caps: list[int] | None = None, least: int = 1) -> list[int]:
    """Integer counts n_d summing to ``total`` that minimise max_d (fixed_s[d] + n_d·unit_s[d]) with
    ``least`` <= n_d <= caps[d] (seconds; units are samples or layers; every device takes part). Greedy:
    each unit goes to the device where it would finish earliest. UserError when the caps hold fewer than
    ``total`` or less than ``least`` each."""
    k = len(unit_s)
    fixed = fixed_s or [0.0] * k
    cap = caps or [total] * k
    if sum(min(c, total) for c in cap) < total or min(cap) < least or least * k > total:
        raise UserError(f"{total} units (samples or layers) cannot be placed {least} or more per device on {k} "
                        f"devices that hold {', '.join(map(str, cap))} (memory)")
    n = [least] * k
    heap = [(fixed[d] + (least + 1) * unit_s[d], d) for d in range(k) if cap[d] > least]
    heapq.heapify(heap)
    for _ in range(total - least * k):
        t, d = heapq.heappop(heap)
        n[d] += 1
        if n[d] < cap[d]:
            heapq.heappush(heap, (fixed[d] + (n[d] + 1) * unit_s[d], d))
    return n


def even_split(total: int, k: int) -> list[int]:
    """``total`` units over ``k`` devices as evenly as integers allow (the first get the remainder)."""
    return [total // k + (1 if d < total % k else 0) for d in range(k)]


def slowest(split: list[int], unit_s: list[float], fixed_s: list[float] | None = None) -> float:
    """Seconds of the slowest device under ``split``."""
    fixed = fixed_s or [0.0] * len(split)
    return max(f + n * u for n, u, f in zip(split, unit_s, fixed))


@dataclass
class HeteroPlan:
    """One layout on a heterogeneous cluster, planned and even (seconds, bytes)."""

    kind: str
    """"data" (per-replica batches) or "pipeline" (layers per stage)."""
    devices: list[str]
    split: list[int]
    """Samples (data) or layers (pipeline) per device, in device order."""
    even: list[int]
    step_s: float
    even_step_s: float
    """The even split's step; inf when it does not fit."""
    peak_bytes: list[float]
    device_bytes: list[float]
    micro_batch: list[int] = field(default_factory=list)
    notes: str = ""

    @property
    def margin(self) -> float:
        """Predicted speed-up of the planned split over the even one (even step / planned step)."""
        return self.even_step_s / self.step_s

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "devices": self.devices, "split": self.split, "even": self.even,
                "step_s": self.step_s, "even_step_s": None if math.isinf(self.even_step_s) else self.even_step_s,
                "margin": None if math.isinf(self.even_step_s) else self.margin, "peak_bytes": self.peak_bytes,
                "device_bytes": self.device_bytes, "micro_batch": self.micro_batch, "notes": self.notes}


def _state_bytes_per_param(optimizer: str, hidden: int) -> float:
    """fp32 parameter + fp32 gradient + the optimizer's states, bytes per parameter (scaletrain's runtime
    keeps fp32 parameters under autocast)."""
    from scaletrain.planner.cost import optim_state_bytes

    return 8 + optim_state_bytes(optimizer, hidden)


def _layer_s(shape: Any, plat: Platform, seq: int, b: int, precision: str) -> float:
    from scaletrain.planner.cost import Options, layer_times

    t = layer_times(shape, plat, seq=seq, b=b, tp=1, sp=False, precision=precision, opts=Options(),
                    autocast=precision != "fp32")
    return t["fwd"] + t["bwd"]


def _head_s(shape: Any, plat: Platform, seq: int, b: int, precision: str) -> float:
    """Forward + backward of the output head (3 matmuls of b·s × V × h)."""
    from scaletrain.planner.cost import _mm

    return 3 * _mm(plat, precision, b * seq, shape.vocab, shape.hidden)


def plan_data(shape: Any, plats: list[Platform], *, global_batch: int, seq: int, precision: str = "bf16",
              optimizer: str = "adamw", reserve: float = 2 * GiB) -> HeteroPlan:
    """Per-replica batches (module docstring); UserError when a device cannot hold the whole model."""
    from scaletrain.cost import collective_seconds
    from scaletrain.planner.memory import layer_activation_bytes, logits_bytes

    elem = 4 if precision == "fp32" else 2
    states = shape.params() * _state_bytes_per_param(optimizer, shape.hidden)
    unit, mbs, fixed_peak = [], [], []
    top = max(1, math.ceil(global_batch / len(plats)))
    for p in plats:
        free = p.device_memory_bytes - reserve - states
        act = (lambda m: shape.layers * layer_activation_bytes(shape, seq, m, elem=elem) + logits_bytes(shape, seq, m))
        if free < act(1):
            raise UserError(f"data parallel on {p.name}: the model's states ({states / GiB:.1f} GiB) and one sample's "
                            f"activations do not fit its {p.device_memory_bytes / GiB:.0f} GiB; plan a pipeline")
        m = 1
        while m * 2 <= top and act(m * 2) <= free:
            m *= 2
        mbs.append(m)
        fixed_peak.append(states + act(m))
        unit.append((shape.layers * _layer_s(shape, p, seq, m, precision) + _head_s(shape, p, seq, m, precision)) / m)
    split = min_max_split(global_batch, unit)
    even = even_split(global_batch, len(plats))
    # one ring all-reduce of the fp32 gradients over the slowest link the replicas share
    links = [p.inter_node_bytes_per_s * p.inter_node_efficiency or p.intra_node_bytes_per_s * p.intra_node_efficiency
             for p in plats]
    n = len(plats)
    grads = 4.0 * shape.params()
    allreduce = collective_seconds(2 * (n - 1) / n * grads, 2 * (n - 1), min(links),
                                   max(p.inter_node_latency_s for p in plats))
    opt = max(p.memory_bound_seconds(_state_bytes_per_param(optimizer, shape.hidden) * shape.params() * 2)
              for p in plats)
    tail = allreduce + opt
    return HeteroPlan("data", [p.name for p in plats], split, even, slowest(split, unit) + tail,
                      slowest(even, unit) + tail, fixed_peak, [p.device_memory_bytes for p in plats], mbs,
                      notes=f"all-reduce {allreduce * 1e3:.1f} ms + optimizer {opt * 1e3:.1f} ms after the slowest "
                            "replica (not overlapped)")


def plan_pipeline(shape: Any, plats: list[Platform], *, global_batch: int, seq: int, micro_batch: int = 1,
                  precision: str = "bf16", optimizer: str = "adamw", reserve: float = 2 * GiB) -> HeteroPlan:
    """Layers per stage, one stage per device in the given order, 1F1B (module docstring)."""
    from scaletrain.planner.memory import inflight, layer_activation_bytes, logits_bytes, rank_params

    P, m = len(plats), max(1, global_batch // micro_batch)
    if shape.layers < P:
        raise UserError(f"pipeline over {P} devices needs at least {P} layers (the model has {shape.layers})")
    elem = 4 if precision == "fp32" else 2
    per_param = _state_bytes_per_param(optimizer, shape.hidden)
    unit, fixed_s, caps, base_bytes, per_layer = [], [], [], [], []
    for k, p in enumerate(plats):
        first, last = k == 0, k == P - 1
        base = per_param * rank_params(shape, tp=1, pp=P, first=first, last=last, layers=0)
        live = inflight("1f1b", P, m, rank=k)
        layer_b = per_param * shape.layer_params() + live * layer_activation_bytes(shape, seq, micro_batch, elem=elem)
        if last:
            base += logits_bytes(shape, seq, micro_batch)
        caps.append(max(0, int((p.device_memory_bytes - reserve - base) // layer_b)))
        base_bytes.append(base)
        per_layer.append(layer_b)
        unit.append(_layer_s(shape, p, seq, micro_batch, precision))
        fixed_s.append(_head_s(shape, p, seq, micro_batch, precision) if last else 0.0)
    split = min_max_split(shape.layers, unit, fixed_s, caps)
    even = even_split(shape.layers, P)
    fits_even = all(e <= c for e, c in zip(even, caps))
    step = (m + P - 1) * slowest(split, unit, fixed_s)
    even_step = (m + P - 1) * slowest(even, unit, fixed_s) if fits_even else math.inf
    return HeteroPlan("pipeline", [p.name for p in plats], split, even, step, even_step,
                      [b + n * l for b, n, l in zip(base_bytes, split, per_layer)],
                      [p.device_memory_bytes for p in plats], [micro_batch] * P,
                      notes=f"1F1B, {m} micro-batches of {micro_batch}; p2p not priced"
                            + ("" if fits_even else "; the even split does not fit"))


def plan_cluster(shape: Any, plats: list[Platform], *, global_batch: int, seq: int, precision: str = "bf16",
                 optimizer: str = "adamw", micro_batch: int = 1) -> list[HeteroPlan]:
    """Both layouts that fit, fastest first; UserError naming both reasons when neither does."""
    out, why = [], []
    for fn, kw in ((plan_data, {}), (plan_pipeline, {"micro_batch": micro_batch})):
        try:
            out.append(fn(shape, plats, global_batch=global_batch, seq=seq, precision=precision,
                          optimizer=optimizer, **kw))
        except UserError as e:
            why.append(str(e))
    if not out:
        raise UserError("no heterogeneous plan fits: " + "; ".join(why))
    return sorted(out, key=lambda h: h.step_s)

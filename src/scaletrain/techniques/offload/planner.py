"""Joint planning of keep / recompute / offload per block and of parameter and optimizer placement,
and the predictions (device peak, bytes moved, step time) every run reports next to its measurements.

**Prediction** (:func:`predict`) composes the cost faces of the offload modules:

- bytes moved per optimizer step are exact: activations (``activations.offload_bytes``), streamed
  weights (``weights.replay_claims``, the runtime's own state machine), gradients (every trainable
  parameter's bytes per micro-batch), parameter upload after a host update, disk reads/writes;
- the device peak is a storage-level replay (:func:`simulate_device`) of one micro-batch at block
  granularity: the storages held (saved by kept blocks, inputs of recomputed blocks, the output in
  flight, prefetched records of offloaded blocks), plus each block's transient bytes from the probe,
  resident/streamed parameters, device gradients and optimizer states, the batch and buffers;
- the step time: compute (+ recomputation) and, where copies cannot overlap compute (the CPU's
  logical device), every copy at the platform's bandwidth; on a GPU, a two-queue replay
  (:func:`_overlapped_time`): copies on their own engines, a block waits only for the copies it
  needs (parameters fetched w blocks ahead, activations prefetched d blocks ahead). The host update
  costs Ψ / ``cpu_adam_params_per_s`` (hidden behind the next step with DPU), the disk tier
  max(update, I/O).

**Planning** (:func:`plan_offload`), a method of our own (Beaumont et al. 2021 combine
rematerialization and offloading with a DP over the chain; ours keeps their choice per block but
fits this runtime's one-graph execution):

1. enumerate placements (params device/host x optimizer device/host/disk, DPU only if asked),
   drop those whose predicted host bytes exceed the host budget;
2. for each, choose a mode per block by a *multiple-choice knapsack DP*: each block i offers
   keep (memory |S_i|, cost 0), recompute (memory |input_i|, cost f_i) and offload (memory 0,
   cost = its copies not hidden by the neighbouring block's compute), where |S_i| are the bytes
   it saves; minimise the summed cost with summed memory <= the budget left after the static
   bytes and the largest transient. Memory is discretised in ``slots`` units, rounded up;
3. replay the chosen modes exactly (:func:`simulate_device`); if the replayed peak exceeds the
   budget (transients, prefetch windows), lower the knapsack capacity by the excess and repeat;
4. keep the placement with the least predicted step time among those that fit.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Sequence

from scaletrain.errors import UserError
from scaletrain.platform import Platform
from scaletrain.techniques.offload.activations import offload_bytes
from scaletrain.techniques.offload.disk import predict_disk
from scaletrain.techniques.offload.optimizer import predict_optimizer
from scaletrain.techniques.offload.probe import ChainCosts
from scaletrain.techniques.offload.weights import ParamClaims, replay_claims

SCALAR_SLACK_BYTES = 256
"""Allowance for scalar tensors (loss, reductions) the block-level replay does not itemise."""

ADAM_DEVICE_BYTES_PER_PARAM = 28
"""fp32 Adam reads p, g, m, v and writes p, m, v: 7 x 4 bytes per parameter (memory-bound update)."""


@dataclass
class Prediction:
    device_peak_bytes: int
    h2d_bytes: int
    d2h_bytes: int
    disk_read_bytes: int
    disk_write_bytes: int
    host_peak_bytes: int
    step_time_s: float
    compute_time_s: float
    detail: dict = field(default_factory=dict)

    @property
    def offload_bytes(self) -> int:
        return self.h2d_bytes + self.d2h_bytes

    def as_row(self) -> dict[str, Any]:
        """The predicted counterparts of the runtime's measured figures."""
        return {"predicted_device_peak_bytes": self.device_peak_bytes, "predicted_offload_bytes": self.offload_bytes,
                "predicted_h2d_bytes": self.h2d_bytes, "predicted_d2h_bytes": self.d2h_bytes,
                "predicted_disk_read_bytes": self.disk_read_bytes, "predicted_disk_write_bytes": self.disk_write_bytes,
                "predicted_host_peak_bytes": self.host_peak_bytes, "predicted_step_time_s": self.step_time_s}


def _modes(costs: ChainCosts, options) -> list[str]:
    if options.modes is not None:
        return list(options.modes)
    from scaletrain.techniques.offload.activations import parse_blocks

    names = [b.name for b in costs.blocks]
    modes = ["keep"] * len(costs)
    for i in parse_blocks(options.recompute, names):
        modes[i] = "recompute"
    for i in parse_blocks(options.activations, names):
        modes[i] = "offload"
    return modes


def _bwd_blocks(costs: ChainCosts) -> list[int]:
    return [i for i, b in enumerate(costs.blocks) if b.out_requires_grad]


def device_optimizer_bytes(costs: ChainCosts) -> tuple[int, int]:
    """(state bytes, step transient bytes) of fp32 Adam on the device (CPU for-loop model)."""
    states = sum(2 * b + 4 for b in costs.param_bytes)
    return states, 3 * max(costs.param_bytes, default=0)


def simulate_device(costs: ChainCosts, modes: Sequence[str], *, prefetch: int = 1, stream: bool = False,
                    window: int = 1, grads_on_device: bool = True, static_bytes: int = 0) -> dict[str, Any]:
    """Replay one micro-batch at block granularity; returns the peak and where it happened (bytes)."""
    sb = costs.storage_bytes
    blocks = costs.blocks
    n = len(blocks)
    held: dict[int, set] = {}
    offl: dict[int, set[int]] = {}
    fetched: set[int] = set()
    pres = {"now": 0 if stream else sum(costs.param_bytes)}
    claims = None
    if stream:
        def fetch(p: int) -> None:
            pres["now"] += costs.param_bytes[p]

        def release(p: int) -> None:
            pres["now"] -= costs.param_bytes[p]

        claims = ParamClaims([b.params for b in blocks], window, fetch, release)
    state = {"peak": 0, "where": ""}
    grads = 0
    pending: set[int] = set()

    def live(extra: set[int] = frozenset(), add: int = 0) -> int:
        ids = set(held) | fetched | set(extra)
        return sum(sb[s] for s in ids) + add + pres["now"] + static_bytes + grads

    trace = state["trace"] = []

    def note(v: int, where: str) -> None:
        trace.append((where, v))
        if v > state["peak"]:
            state["peak"], state["where"] = v, where

    def hold(s: int, why) -> None:
        if s >= 0:
            held.setdefault(s, set()).add(why)

    def unhold(s: int, why) -> None:
        if s in held:
            held[s].discard(why)
            if not held[s]:
                del held[s]

    for i, b in enumerate(blocks):
        if claims:
            claims.forward_start(i)
        note(live(set(b.saved) | {b.out_storage}, b.fwd_temp_bytes), f"forward {b.name}")
        if modes[i] == "keep":
            for s in b.saved:
                hold(s, ("saved", i))
        elif modes[i] == "recompute":
            hold(b.in_storage, ("saved", i))
        else:
            for s in b.saved:
                offl.setdefault(s, set()).add(i)
        unhold(b.in_storage, ("out", i - 1))
        hold(b.out_storage, ("out", i))
        if claims:
            claims.forward_end(i)
    note(live(add=costs.loss_saved_bytes + costs.loss_fwd_temp_bytes), "loss forward")
    unhold(blocks[-1].out_storage, ("out", n - 1))  # the runtime drops the logits before backward
    note(live(add=costs.loss_saved_bytes + costs.loss_bwd_temp_bytes), "loss backward")
    delta = blocks[-1].out_bytes
    for i in reversed(range(n)):
        b = blocks[i]
        if not b.out_requires_grad:
            continue
        if claims:
            claims.backward_start(i)
        for j in range(i, max(i - prefetch, 0) - 1, -1):
            if modes[j] == "offload":
                fetched.update(s for s in blocks[j].saved if s in offl)
        if modes[i] == "recompute":
            note(live(set(b.saved) | {b.out_storage}, delta + max(b.fwd_temp_bytes, b.bwd_temp_bytes)),
                 f"backward {b.name} (recomputed)")
        else:
            note(live(add=delta + b.bwd_temp_bytes), f"backward {b.name}")
        for s in list(held):
            unhold(s, ("saved", i))
        for s in list(fetched):
            offl[s].discard(i)
            if not offl[s]:
                fetched.discard(s)
        delta = blocks[i - 1].out_bytes if i > 0 and blocks[i - 1].out_requires_grad else 0
        for p in b.params:
            if costs.param_owner[p] < i and p not in pending:  # a tied parameter's gradient waits in
                pending.add(p)                                # autograd's buffer for its first user
                grads += costs.param_bytes[p]
            elif costs.param_owner[p] == i:
                if p in pending:
                    pending.discard(p)
                    grads -= costs.param_bytes[p]
                if grads_on_device:
                    grads += costs.param_bytes[p]
    if claims:
        claims.finish()
    return {"peak_bytes": state["peak"] + SCALAR_SLACK_BYTES, "where": state["where"], "trace": trace}


def _overlapped_time(costs: ChainCosts, modes: Sequence[str], platform: Platform, *, prefetch: int, stream: bool,
                     window: int, grads_to_host: bool) -> float:
    """Two copy queues (h2d, d2h) beside the compute stream; a block waits for the copies it needs."""
    blocks, sb = costs.blocks, costs.storage_bytes
    n = len(blocks)
    bp = [sum(costs.param_bytes[p] for p in b.params) for b in blocks]
    act = [sum(sb[s] for s in b.saved) if modes[i] == "offload" else 0 for i, b in enumerate(blocks)]
    c = lh = ld = 0.0
    ready = [0.0] * n
    if stream:
        for i in range(min(window + 1, n)):
            lh += bp[i] / platform.h2d_bytes_per_s
            ready[i] = lh
    for i, b in enumerate(blocks):
        start = max(c, ready[i])
        if stream and i + window + 1 < n:  # issued when block i starts
            lh = max(lh, start) + bp[i + window + 1] / platform.h2d_bytes_per_s
            ready[i + window + 1] = lh
        c = start + b.fwd_time_s
        if act[i]:
            ld = max(ld, c) + act[i] / platform.d2h_bytes_per_s
    aready = [0.0] * n
    pready = [0.0] * n
    for i in reversed(range(n)):
        b = blocks[i]
        if not b.out_requires_grad:
            continue
        for j in range(i, max(i - prefetch, 0) - 1, -1):
            if act[j] and aready[j] == 0.0:
                lh = max(lh, c, ld) + act[j] / platform.h2d_bytes_per_s
                aready[j] = lh
        if stream and pready[i] == 0.0:
            for j in range(i, max(i - window, 0) - 1, -1):
                if pready[j] == 0.0:
                    lh = max(lh, c) + bp[j] / platform.h2d_bytes_per_s
                    pready[j] = lh
        start = max(c, aready[i], pready[i] if stream else 0.0)
        c = start + b.bwd_time_s + (b.fwd_time_s if modes[i] == "recompute" else 0.0)
        if grads_to_host:
            own = sum(costs.param_bytes[p] for p in b.params if costs.param_owner[p] == i)
            ld = max(ld, c) + own / platform.d2h_bytes_per_s
    return max(c, ld, lh)


def predict(costs: ChainCosts, options, platform: Platform, accum: int = 1) -> Prediction:
    """Predicted device peak, bytes moved per optimizer step, host peak and step time."""
    modes = _modes(costs, options)
    stream = options.params == "host"
    on_host = options.optimizer in ("host", "disk")
    nparams = costs.total_params
    pbytes = costs.total_param_bytes
    offl = [i for i, m in enumerate(modes) if m == "offload"]
    act = offload_bytes([b.saved for b in costs.blocks], costs.storage_bytes, offl)
    fetched = replay_claims([b.params for b in costs.blocks], costs.param_bytes, options.param_window,
                            _bwd_blocks(costs))[0] if stream else 0
    grads = pbytes if on_host else 0
    masters_on_disk = options.optimizer == "disk" and options.disk_masters
    upload = pbytes if on_host and not stream else 0
    h2d = accum * (act + fetched) + upload
    d2h = accum * (act + grads)
    static = costs.input_bytes + costs.target_bytes + costs.buffer_bytes
    states, step_tmp = device_optimizer_bytes(costs) if not on_host else (0, 0)
    grads_dev = not on_host
    fb_static = static + states + (pbytes if grads_dev and accum > 1 else 0)
    sim = simulate_device(costs, modes, prefetch=options.prefetch, stream=stream, window=options.param_window,
                          grads_on_device=grads_dev, static_bytes=fb_static)
    peak = sim["peak_bytes"]
    if not on_host:
        peak = max(peak, static + pbytes * 2 + states + step_tmp)
    # host side
    disk_r = disk_w = 0
    host = 0
    opt_time = ADAM_DEVICE_BYTES_PER_PARAM * nparams / platform.device_mem_bytes_per_s
    if on_host:
        oc = predict_optimizer([costs.param_numel[i] for i in range(len(costs.param_numel))],
                               platform.cpu_adam_params_per_s, resident_params=not stream, dpu=options.dpu,
                               states_on_disk=options.optimizer == "disk")
        host = oc.host_bytes - (4 * nparams if masters_on_disk else 0)
        opt_time = oc.update_time_s
        if options.optimizer == "disk":
            dc = predict_disk(nparams, platform, masters_on_disk=masters_on_disk,
                              chunk_bytes=options.disk_chunk_bytes)
            disk_r, disk_w = dc.read_bytes_per_step, dc.write_bytes_per_step
            host += dc.host_staging_bytes
            opt_time = dc.time_s
        opt_time += upload / platform.h2d_bytes_per_s
    host += act  # offloaded activations of one micro-batch, all on the host at the turnaround
    compute = costs.loss_time_s + sum(b.fwd_time_s + b.bwd_time_s + (b.fwd_time_s if m == "recompute" else 0.0)
                                      for b, m in zip(costs.blocks, modes))
    if platform.copy_overlaps_compute:
        micro = costs.loss_time_s + _overlapped_time(costs, modes, platform, prefetch=options.prefetch,
                                                     stream=stream, window=options.param_window, grads_to_host=on_host)
    else:
        micro = compute + (act + fetched) / platform.h2d_bytes_per_s + (act + grads) / platform.d2h_bytes_per_s
    fwd_bwd = accum * micro
    step = fwd_bwd + (max(0.0, opt_time - fwd_bwd) if options.dpu else opt_time)
    return Prediction(int(peak), int(h2d), int(d2h), int(disk_r), int(disk_w), int(host), float(step),
                      float(accum * compute), detail={"peak_at": sim["where"], "modes": modes,
                                                      "optimizer_time_s": opt_time, "activation_bytes": act,
                                                      "param_fetch_bytes": fetched})


# --------------------------------------------------------------------------- planning


def _knapsack(mem: list[list[int]], cost: list[list[float]], capacity: int, slots: int = 400) -> list[int] | None:
    """Multiple-choice knapsack: one option per item, Σ mem <= capacity, least Σ cost (option indices)."""
    n = len(mem)
    if capacity < 0:
        return None
    unit = max(1, -(-capacity // slots)) if capacity else 1
    cap = capacity // unit
    INF = float("inf")
    best = [0.0] + [INF] * cap  # best[m]: least cost using <= m units (monotone after the pass)
    choice: list[list[int]] = []
    for i in range(n):
        new = [INF] * (cap + 1)
        ch = [-1] * (cap + 1)
        for k, (mb, c) in enumerate(zip(mem[i], cost[i])):
            u = -(-mb // unit)
            for m in range(u, cap + 1):
                v = best[m - u] + c
                if v < new[m]:
                    new[m], ch[m] = v, k
        best = new
        choice.append(ch)
    m = min(range(cap + 1), key=lambda j: best[j])
    if best[m] == INF:
        return None
    # walk back: recompute the memory used by each choice
    picks = [0] * n
    for i in reversed(range(n)):
        k = choice[i][m]
        picks[i] = k
        m -= -(-mem[i][k] // unit)
    return picks


@dataclass
class OffloadPlan:
    options: Any
    prediction: Prediction
    candidates: list[dict] = field(default_factory=list)


def _block_options(costs: ChainCosts, platform: Platform, i: int) -> tuple[list[int], list[float]]:
    """(memory, cost) of keep / recompute / offload for block i."""
    b = costs.blocks[i]
    sb = costs.storage_bytes
    saved = sum(sb[s] for s in b.saved)
    inp = sb.get(b.in_storage, 0) if b.in_storage >= 0 else 0
    copy = saved / platform.d2h_bytes_per_s + saved / platform.h2d_bytes_per_s
    if platform.copy_overlaps_compute:
        nxt = costs.blocks[i + 1] if i + 1 < len(costs) else b
        copy = max(0.0, saved / platform.d2h_bytes_per_s - nxt.fwd_time_s) + \
            max(0.0, saved / platform.h2d_bytes_per_s - nxt.bwd_time_s)
    tie = 1e-9  # on equal predicted time, keep (no moving parts) wins
    return [saved, min(inp, saved), 0], [0.0, b.fwd_time_s + tie, copy + 2 * tie]


def choose_modes(costs: ChainCosts, platform: Platform, options, budget: int | None) -> list[str] | None:
    """Per-block modes minimising predicted time with the replayed device peak <= ``budget``."""
    n = len(costs)
    names = ("keep", "recompute", "offload")
    if budget is None:
        return ["keep"] * n
    opts = [_block_options(costs, platform, i) for i in range(n)]
    mem = [o[0] for o in opts]
    cost = [o[1] for o in opts]
    base = dataclasses.replace(options, modes=["offload"] * n)
    floor = predict(costs, base, platform).device_peak_bytes
    if floor > budget:
        return None
    cap = budget - floor  # room above "everything offloaded", shared by the blocks that keep or recompute
    for _ in range(12):
        picks = _knapsack(mem, cost, max(cap, 0))
        if picks is None:
            return ["offload"] * n
        modes = [names[k] for k in picks]
        peak = predict(costs, dataclasses.replace(options, modes=modes), platform).device_peak_bytes
        if peak <= budget:
            return modes
        cap -= peak - budget
        if cap < 0:
            return ["offload"] * n
    return ["offload"] * n


def plan_offload(costs: ChainCosts, platform: Platform, options, accum: int = 1) -> OffloadPlan:
    """The fastest predicted placement + modes that fits ``options.device_budget`` and ``host_budget``."""
    budget = options.device_budget if options.device_budget is not None else platform.device_memory_bytes
    host_budget = options.host_budget if options.host_budget is not None else platform.host_memory_bytes
    best: tuple[float, Any, Prediction] | None = None
    cands = []
    # Prefetch distance / weight window: the asked ones first; 0 (no look-ahead) lowers the floor.
    lookahead = list(dict.fromkeys([(options.prefetch, options.param_window), (0, options.param_window), (0, 0)]))
    for params in ("device", "host"):
        for opt in ("device", "host", "disk"):
            if params == "host" and opt == "device":
                continue
            for masters in ((False, True) if opt == "disk" and params == "device" else (False,)):
                for prefetch, window in lookahead if params == "host" else lookahead[:2]:
                    o = dataclasses.replace(options, params=params, optimizer=opt, disk_masters=masters,
                                            dpu=options.dpu and opt != "device" and not masters, modes=None,
                                            plan="manual", prefetch=prefetch, param_window=window)
                    modes = choose_modes(costs, platform, o, budget)
                    row = {"params": params, "optimizer": opt, "disk_masters": masters, "prefetch": prefetch,
                           "param_window": window, "fits": modes is not None}
                    if modes is None:  # this placement's floor: every block offloaded
                        o.modes = ["offload"] * len(costs)
                        low = predict(costs, o, platform, accum)
                        if low.host_peak_bytes <= host_budget:
                            row["min_device_budget_bytes"] = low.device_peak_bytes
                        o.modes = None
                    if modes is not None:
                        o.modes = modes
                        pred = predict(costs, o, platform, accum)
                        row.update(step_time_s=pred.step_time_s, device_peak_bytes=pred.device_peak_bytes,
                                   host_peak_bytes=pred.host_peak_bytes)
                        if pred.host_peak_bytes > host_budget:
                            row["fits"] = False
                        elif best is None or pred.step_time_s < best[0]:
                            best = (pred.step_time_s, o, pred)
                    cands.append(row)
    if best is None:
        floors = [r["min_device_budget_bytes"] for r in cands if "min_device_budget_bytes" in r]
        if floors:
            raise UserError(f"no offload plan fits memory.device_budget={budget} B; the smallest device budget that "
                            f"works for this model and batch is {min(floors)} B ({min(floors) / 2**20:.2f} MiB): "
                            f"raise memory.device_budget or lower train.micro_batch")
        raise UserError(f"no offload plan fits memory.device_budget={budget} B and host budget {host_budget} B: "
                        f"every placement needs more host memory; raise memory.offload.host_budget")
    return OffloadPlan(best[1], best[2], cands)

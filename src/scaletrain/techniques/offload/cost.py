"""Offloading's bytes face: the device peak of a plan whose ``memory.offload.*`` keys are set.

:func:`.plan_cost.plan_costs` composes the other families' faces; this one replaces the bytes it found
for the same plan without offload by what the offload runtimes hold on the device:

- **one process** — the offload runtime (:class:`.runtime.OffloadRuntime`) places everything itself,
  and its own prediction (:func:`.planner.predict` on :func:`.probe.probe_chain`'s fake-tensor probe of
  one micro-batch) is the figure it reports beside its measured device peak each step
  (``offload_device_peak_pred_bytes``); the planner takes that very number, so plan and run agree by
  construction. Categories: the resident parameters (0 when streamed), device gradients and
  optimizer states (0 with the optimizer on the host or disk), the rest activations and transients;
- **several processes** (ZeRO-Offload under ZeRO-1/2, the only offload the compatibility table allows
  there: rule ``offload-world``) — each rank's fp32 masters and optimizer states live on the host, so
  the rank's optimizer bytes leave its device; parameters, gradients and activations stay as priced.

The time face is :func:`scaletrain.techniques.time_cost._offload` (copies and the host update). Units: bytes.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable

import torch
from torch import nn


def _autocast(precision: str) -> Callable[[], Any]:
    """The runtime's autocast for ``precision`` (the probe dispatches on the CPU's fake tensors)."""
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    if half is None:
        return contextlib.nullcontext
    return lambda: torch.autocast("cpu", dtype=half)


def one_process_prediction(plan: Any, chain: nn.Module, example: torch.Tensor, target: torch.Tensor,
                           loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], *, accum: int,
                           platform: Any = None) -> Any:
    """The offload runtime's own :class:`.planner.Prediction` for ``plan.offload`` on one process (one
    micro-batch ``example``/``target``, ``accum`` micro-batches per step), probed with fake tensors."""
    from scaletrain.platform import Platform
    from scaletrain.techniques.offload.planner import plan_offload, predict
    from scaletrain.techniques.offload.probe import probe_chain
    from scaletrain.techniques.offload.runtime import options_from_cfg

    plat = platform or Platform(name="bytes only")  # the device peak does not depend on the rates
    costs = probe_chain(chain, example, target, loss_fn, _autocast(plan.precision))
    costs.estimate_times(plat.flops("fp32"), plat.device_mem_bytes_per_s)
    opts = options_from_cfg(dataclasses.asdict(plan.offload))
    if opts.plan == "auto":
        opts = plan_offload(costs, plat, opts, accum=accum).options
    return predict(costs, opts, plat, accum=accum), costs, opts


def offload_bytes(costs: list[Any], plan: Any, *, world: int, chain: nn.Module, example: torch.Tensor,
                  target: torch.Tensor, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], accum: int,
                  platform: Any = None) -> None:
    """Rewrite each :class:`.plan_cost.RankCost` in ``costs`` to the device bytes of ``plan``'s offloading
    (module docstring); nothing when ``plan.offload`` is all defaults."""
    if not plan.offload.active:
        return
    if world == 1:
        pred, probe, opts = one_process_prediction(plan, chain, example, target, loss_fn, accum=accum,
                                                   platform=platform)
        c = costs[0]
        on_host = opts.optimizer in ("host", "disk")
        params = 0.0 if opts.params == "host" else float(probe.total_param_bytes)
        grads = 0.0 if on_host else float(probe.total_param_bytes)
        optim = 0.0 if on_host else float(c.bytes.get("optimizer", 0.0))
        peak = float(pred.device_peak_bytes)
        c.peak_bytes, c.host_bytes = peak, float(pred.host_peak_bytes)
        c.bytes = {"params": params, "grads": grads, "optimizer": optim,
                   "activations_and_transients": max(0.0, peak - params - grads - optim)}
        return
    for c in costs:  # ZeRO-Offload: this rank's masters and optimizer states on the host
        off = float(c.bytes.get("optimizer", 0.0))
        c.bytes = {**c.bytes, "optimizer": 0.0}
        c.peak_bytes, c.host_bytes = float(c.peak_bytes) - off, off

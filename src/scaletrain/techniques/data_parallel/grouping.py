"""``parallel.fsdp_group=auto`` under a memory budget: the fastest ZeRO-3 grouping whose predicted peak fits.

Alone, ``auto`` takes the grouping :func:`.cost.fsdp_group_seconds` prices fastest — on a CPU one group, the
whole model gathered at once — whatever memory that needs. With a budget (bytes one rank may hold: the
planner's device, ``memory.device_budget``, a CUDA device's memory) the candidates are tried fastest first
(:func:`.cost.fsdp_group_candidates`) and the first whose predicted peak
(:func:`scaletrain.techniques.plan_cost.plan_costs`: the gathered units of
:func:`.fsdp.gathered_peak_bytes` beside the sharded states and the activations) fits is kept; when none
fits, the one with the smallest peak. The result is a concrete setting (``block`` or a byte limit), so the
runtime, ``estimate`` and the planner form the same groups. Units: bytes.
"""

from __future__ import annotations

from typing import Any

from torch import nn


def group_settings(model: nn.Module, dp: int, accum: int, device_type: str) -> list[str]:
    """``parallel.fsdp_group`` values ``auto`` may become, fastest first: ``block`` or a byte limit
    (distinct groupings only; :func:`.cost.fsdp_group_candidates` over :func:`.fsdp.shardable_blocks`)."""
    from scaletrain.techniques.data_parallel.cost import fsdp_group_candidates
    from scaletrain.techniques.data_parallel.fsdp import shardable_blocks

    sizes = [float(sum(p.numel() * p.element_size() for p in b.parameters())) for b in shardable_blocks(model)]
    return ["block" if lim <= 0 else str(int(lim)) for lim in fsdp_group_candidates(sizes, dp, accum, device_type)]


def fit_fsdp_group(plan: Any, model: nn.Module, budget: float | None, *, world: int, global_batch: int, seq: int,
                   micro_batch: int = 0, device: str = "cpu") -> tuple[Any, float]:
    """``plan`` (a :class:`~scaletrain.plan.Plan`) with ``fsdp_group=auto`` resolved under ``budget`` bytes
    (module docstring), and that plan's predicted peak bytes (0.0 when nothing was resolved: not ZeRO-3
    without a pipeline, a pinned grouping, or no budget). ``model`` may live on the meta device."""
    from scaletrain.measure.estimate import trace_cache
    from scaletrain.techniques.plan_cost import heaviest, plan_costs

    if plan.zero != 3 or plan.pp > 1 or str(plan.fsdp_group).strip() != "auto" or budget is None:
        return plan, 0.0
    resolved = plan.resolved(world)  # dp=0: every process left
    n = resolved.hsdp or max(resolved.dp, 1) * resolved.cp
    accum = max(global_batch // max(n * (micro_batch or global_batch // n), 1), 1)
    best: tuple[float, Any] | None = None
    with trace_cache():
        for setting in group_settings(model, n, accum, device):
            candidate = plan.with_(fsdp_group=setting)
            peak = float(heaviest(plan_costs(candidate, model, world=world, global_batch=global_batch, seq=seq,
                                             micro_batch=micro_batch, device=device)).peak_bytes)
            if peak <= budget:
                return candidate, peak
            if best is None or peak < best[0]:
                best = (peak, candidate)
    assert best is not None  # group_settings lists at least one grouping
    return best[1], best[0]


def rank_budget(device: Any, local_ranks: int) -> float:
    """Bytes one rank may hold: its CUDA device's memory, or on a CPU the host's memory shared by the
    ``local_ranks`` processes on it (the logical device pool's, :func:`scaletrain.platform.calibrate`)."""
    import torch

    if getattr(device, "type", str(device)) == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    from scaletrain.platform import _host_memory_bytes

    return float(_host_memory_bytes()) / max(local_ranks, 1)


def runtime_fsdp_group(plan: Any, model: nn.Module, *, world: int, dp: int, micro_batch: int, accum: int,
                       seq: int, device: Any, local_ranks: int) -> tuple[str, str]:
    """The ``parallel.fsdp_group`` a ZeRO-3 run forms (``auto`` fitted to :func:`rank_budget`, as
    :func:`fit_fsdp_group` prices it) and a note for the log ("" when nothing was resolved). A model the cost
    model cannot trace keeps ``auto`` (the fastest grouping, unbounded) and says why."""
    if plan.zero != 3 or plan.pp > 1 or str(plan.fsdp_group).strip() != "auto":
        return plan.fsdp_group, ""
    budget = rank_budget(device, local_ranks)
    try:
        fitted, peak = fit_fsdp_group(plan, model, budget, world=world, global_batch=micro_batch * accum * dp,
                                      seq=seq, micro_batch=micro_batch, device=getattr(device, "type", str(device)))
    except Exception as e:  # noqa: BLE001 - a model the traced cost model cannot price: auto's unbounded choice
        why = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
        return plan.fsdp_group, f"note: parallel.fsdp_group=auto not fitted to the device's memory ({why})"
    return fitted.fsdp_group, (f"parallel.fsdp_group=auto -> {fitted.fsdp_group} (predicted peak "
                               f"{peak / 2**20:.1f} MiB of {budget / 2**20:.0f} MiB)")

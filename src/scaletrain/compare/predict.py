"""The cost model's prediction for each cell, made before the cell runs.

- **Peak bytes** (every model): :func:`scaletrain.techniques.plan_cost.plan_costs`, the estimator of
  the real modules on the meta device, per pipeline rank; the heaviest rank's peak is compared with the
  tracked peak of the heaviest rank (``tracked_peak_bytes_max``).
- **Step seconds** (GPT-2 shapes only: the planner prices transformers on paper):
  :func:`scaletrain.planner.cost.plan_cost` on this machine as measured by N processes at once
  (:func:`scaletrain.planner.local.measure`, what ``plan=auto`` uses), one calibration per device
  count, kept in ``platform_<N>.json`` of the study's directory so a resumed study reuses it.

The calibration runs ``python -m torch.distributed.run --nproc-per-node N -m scaletrain.planner.local OUT MODEL``
(rank 0 writes the Platform as JSON). Units: seconds, bytes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from scaletrain.compare.environment import child_env
from scaletrain.compare.matrix import STRATEGIES, Cell
from scaletrain.errors import UserError
from scaletrain.platform import Platform


def calibrate(devices: int, model: str, directory: Path, timeout_s: float = 300.0) -> Platform | None:
    """This machine for one of ``devices`` processes (cached in ``directory``); None if it failed."""
    from scaletrain.planner.local import calibrate_to_file

    return calibrate_to_file(devices, directory / f"platform_{devices}.json", model, "fp32", timeout_s, child_env())


def predict(cell: Cell, platform: Platform | None) -> dict[str, Any]:
    """``predicted_step_time_s``, ``predicted_peak_bytes`` and ``predicted_time_breakdown_s`` (the cost model's
    phases folded into forward+backward, optimizer and exposed communication; the pipeline bubble counts as
    exposed communication, as the measured breakdown sees it) of ``cell``. None where the cost model has no
    answer, with the reason in ``predicted_note``. A peer gets the prediction of the scaletrain strategy that
    computes the same step (``Strategy.like``: DeepSpeed ZeRO-3 and fully_shard ~ zero3, DeepSpeed ZeRO-2 ~
    zero2, DDP ~ ddp), named in ``predicted_like`` and the note."""
    from scaletrain import models
    from scaletrain.plan import Plan
    from scaletrain.planner.cost import plan_cost
    from scaletrain.planner.shape import Shape
    from scaletrain.techniques.plan_cost import heaviest, plan_costs
    from scaletrain.train.config import load_config

    like = STRATEGIES[cell.strategy].like
    if like:  # a peer computes the step of a scaletrain strategy: that one's prediction, said so in the cell
        out = predict(Cell(cell.model, like, cell.devices, cell.settings), platform)
        said = f"predicted as scaletrain's {like} (the same computation)"
        out["predicted_note"] = said + (f"; {out['predicted_note']}" if out.get("predicted_note") else "")
        out["predicted_like"] = like
        return out
    out: dict[str, Any] = {"predicted_step_time_s": None, "predicted_peak_bytes": None}
    notes = []
    s = cell.settings
    cfg = load_config(None, cell.train_overrides())
    plan = Plan.from_config(cfg).resolved(cell.devices)
    try:
        model = models.get(cfg.model.name, device="meta", **cfg.model.overrides)
        costs = plan_costs(plan, model, world=cell.devices, global_batch=s.global_batch, seq=s.seq_len or 1,
                           device="cpu")
        out["predicted_peak_bytes"] = float(heaviest(costs).peak_bytes)
    except (UserError, ValueError, RuntimeError) as e:
        notes.append(f"peak: {str(e).splitlines()[0][:160]}")
    try:
        shape = Shape.of(s.name)
        if platform is None:
            raise UserError("no calibration of this machine for this device count")
        m = plan.microbatches if plan.pp > 1 else 1
        priced = plan.with_(micro_batch=s.global_batch // (plan.dp * m))
        cost = plan_cost(shape, priced, platform, global_batch=s.global_batch, seq=s.seq_len)
        out["predicted_step_time_s"] = float(cost.step_time_s)
        ph = cost.phases_s
        out["predicted_time_breakdown_s"] = {
            "forward+backward": ph.get("compute", 0.0) + ph.get("recompute", 0.0),
            "optimizer": ph.get("optimizer", 0.0),
            "comm_exposed": sum(ph.get(k, 0.0) for k in ("tp_comm", "pipeline_bubble", "p2p", "dp_comm"))}
    except (UserError, ValueError, ZeroDivisionError) as e:
        notes.append(f"step time: {str(e).splitlines()[0][:160]}")
    if notes:
        out["predicted_note"] = "; ".join(notes)
    return out

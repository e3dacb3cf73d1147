"""Predictions without running, by short path: ``from scaletrain.estimate import estimate_step``.

- :func:`estimate_step` — one training step's memory (bytes by category, the peak and where) and per-block
  costs of a model (a reference name, ``hf:...``, ``py:...`` or any module an adapter understands),
  from fake tensors: nothing is allocated;
- :func:`plan_costs` — every rank's peak and traffic under a :class:`~scaletrain.plan.Plan`;
- :func:`simulate_step` — the cross-check: a whole step on fake tensors under the tracker.

What ``scaletrain estimate`` prints. Implementations: :mod:`scaletrain.measure.estimate`,
:mod:`scaletrain.techniques.plan_cost`.
"""

from scaletrain.measure.compose import StepEstimate
from scaletrain.measure.estimate import estimate_chain, estimate_step, simulate_step
from scaletrain.techniques.plan_cost import heaviest, plan_costs

__all__ = ["StepEstimate", "estimate_chain", "estimate_step", "heaviest", "plan_costs", "simulate_step"]

"""The planner on paper: an analytic cost of a transformer :class:`~scaletrain.plan.Plan` on a
:class:`~scaletrain.platform.Platform` (:mod:`.cost`) and a pruned search over plans (:mod:`.search`).

It needs no module, no tensor and no device: a decoder shape, GPT-2 or Llama (:mod:`.shape`), the plan
and the platform's figures are enough, so it prices GPT-3 175B on 1024 A100s on a laptop. What it prices is
what ``scaletrain train --plan`` runs (fp32 parameters under autocast with tp/pp, the compatibility
table's combinations); where a published system differs (Megatron-LM's materialised softmax) a
:class:`~.cost.Options` field says so.
"""

from scaletrain.planner.cost import Options, PlanCost, plan_cost
from scaletrain.planner.search import SearchResult, search

from scaletrain.planner.shape import Shape

__all__ = ["Options", "PlanCost", "SearchResult", "Shape", "plan_cost", "search"]

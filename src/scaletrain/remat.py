"""Rematerialization (activation recomputation), by short path: ``from scaletrain import remat``.

``remat.plan(model_or_chain, budget_bytes=..., example_input=x)`` gives the recompute schedule that fits a
memory budget (methods ``METHODS``: periodic, revolve, optimal, ilp, dtr); ``remat.apply(chain, schedule)``
returns a module that follows it under ordinary autograd. The implementation lives in
:mod:`scaletrain.techniques.remat`; these names are the stable ones.
"""

from scaletrain.techniques.remat import (METHODS, RematChain, Schedule, apply, graph_of, min_budget, plan,
                                         run_schedule, solve)
from scaletrain.techniques.remat.schedule import parse_bytes

__all__ = ["METHODS", "RematChain", "Schedule", "apply", "graph_of", "min_budget", "parse_bytes", "plan",
           "run_schedule", "solve"]

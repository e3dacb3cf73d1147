"""Rematerialization: the best recompute schedule for a memory budget the user names.

Cost face: :func:`plan` returns a :class:`Schedule` (ops in the survey's notation F_i^n /
F_i^c / F_i^e / B_i, predicted peak bytes and time, replayed by :mod:`.simulate`).
Apply face: :func:`apply` (a module following the schedule under ordinary autograd) and
:func:`run_schedule` (one forward + backward of a Chain with a loss function).

Methods (``METHODS``):

- ``none``: store everything; ``periodic``: √n segments (Chen et al. 2016), the fastest
  segment count within the budget;
- ``revolve``: binomial checkpointing (Griewank & Walther 2000), optimal for homogeneous chains;
- ``optimal``: dynamic programming for heterogeneous chains (Beaumont et al. 2019);
- ``ilp``: Checkmate's MILP (Jain et al. 2020) on any graph, HiGHS with a time limit;
- ``dtr``: dynamic tensor rematerialization's eviction heuristic (Kirisame et al. 2021).

Inside one block, :mod:`.intrablock` traces the block's aten ops, chooses the ops whose
outputs to keep under a byte budget with Checkmate's MILP restricted to the two-stage schedules
PyTorch's selective activation checkpointing runs, and applies the plan with SAC
(``plan_block`` / ``apply_block_plan``).

Example::

    from scaletrain.techniques import remat
    sched = remat.plan(chain, profile, "1.5GiB", method="optimal")
    loss = remat.run_schedule(chain, sched, x, loss_fn, y)      # or: remat.apply(model, sched)
"""

from __future__ import annotations

from typing import Any, Callable

from scaletrain.errors import UserError
from scaletrain.schema import BY_FIELD
from scaletrain.measure.types import Profile
from scaletrain.techniques.remat.executor import RematChain, Runner, apply, run_schedule
from scaletrain.techniques.remat.schedule import (Graph, Node, Op, Schedule, as_graph, fmt_bytes,
                                                  ops_from_str, parse_bytes)
from scaletrain.techniques.remat.simulate import Replay, baseline_time, simulate

METHODS = BY_FIELD["remat.method"].choices
"""The solvers, as the plan key ``memory.remat.method`` declares them (:mod:`scaletrain.schema`)."""

__all__ = ["METHODS", "Graph", "Node", "Op", "Profile", "Replay", "RematChain", "Runner", "Schedule", "apply",
           "baseline_time", "fmt_bytes", "graph_of", "min_budget", "ops_from_str", "parse_bytes", "plan",
           "run_schedule", "simulate", "solve"]


def graph_of(chain_or_profile: Any, profile: Profile | Graph | None = None, *, example_input=None,
             target=None, loss_fn: Callable | None = None, precision: str = "fp32") -> Graph:
    """The cost graph: from a Profile/Graph, or by estimating the chain on ``example_input``.

    Estimation uses :func:`scaletrain.measure.estimate.estimate_chain` (fake tensors: nothing
    is allocated; times from FLOPs at a nominal rate, enough to rank schedules) and reads the
    activation-only backward temporaries from its traces (:mod:`.fromtrace`).
    """
    if isinstance(chain_or_profile, (Profile, Graph)):
        return as_graph(chain_or_profile)
    if profile is not None:
        g = as_graph(profile)
        blocks = getattr(chain_or_profile, "blocks", None)
        if blocks is not None and len(blocks) != len(g):
            raise UserError(f"profile has {len(g)} blocks but the chain has {len(blocks)}")
        return g
    if example_input is None:
        raise UserError("plan() needs a Profile, or example_input= to estimate one from the chain")
    from scaletrain.techniques.remat.fromtrace import estimate_graph

    return estimate_graph(chain_or_profile, example_input, target=target, loss_fn=loss_fn, precision=precision)[0]


def solve(graph: Graph, budget_bytes: int | None, method: str = "optimal", **options: Any) -> Schedule:
    """Run one solver on a graph (see :func:`plan`)."""
    from scaletrain.techniques.remat import dtr, ilp, optimal, periodic, revolve

    if method == "none":
        return periodic.solve_none(graph, budget_bytes)
    if method == "periodic":
        return periodic.solve_periodic(graph, budget_bytes, **options)
    if method == "revolve":
        return revolve.solve_revolve(graph, budget_bytes, **options)
    if method == "optimal":
        return optimal.solve_optimal(graph, _need(budget_bytes, method), **options)
    if method == "ilp":
        return ilp.solve_ilp(graph, _need(budget_bytes, method), **options)
    if method == "dtr":
        return dtr.solve_dtr(graph, _need(budget_bytes, method))
    raise UserError(f"unknown rematerialization method {method!r}; allowed: {', '.join(METHODS)}")


def _need(budget: int | None, method: str) -> int:
    if budget is None:
        raise UserError(f"method {method!r} needs a budget (bytes, or a size like '1.5GiB')")
    return budget


def plan(chain_or_profile: Any, profile: Profile | Graph | None = None, budget_bytes: int | str | None = None,
         method: str = "optimal", *, example_input=None, target=None, loss_fn: Callable | None = None,
         precision: str = "fp32", **options: Any) -> Schedule:
    """The schedule of ``method`` for ``budget_bytes`` (int, or a string like '1.5GiB').

    ``chain_or_profile`` is a Chain (with ``profile``, or ``example_input`` to estimate one), a
    Profile or a Graph. Solver options: ``segments`` (periodic), ``slots`` (revolve: checkpoint
    slots; optimal: memory discretisation steps), ``unit_bytes`` (optimal), ``time_limit`` and
    ``persistent`` (ilp). Raises UserError if the budget is below the method's minimum.
    """
    g = graph_of(chain_or_profile, profile, example_input=example_input, target=target, loss_fn=loss_fn,
                 precision=precision)
    return solve(g, parse_bytes(budget_bytes), method, **options)


def min_budget(graph: Graph | Profile, method: str = "optimal") -> int:
    """Least budget (bytes) at which ``method`` finds a schedule."""
    from scaletrain.techniques.remat import dtr, ilp, optimal, periodic, revolve

    g = as_graph(graph)
    if method == "none":
        return simulate(g, periodic.none_ops(len(g))).peak_bytes
    if method == "periodic":
        return periodic.min_budget_periodic(g)
    if method == "revolve":
        return revolve.min_budget_revolve(g)
    if method == "optimal":
        return optimal.min_budget_optimal(g)
    if method == "ilp":
        return optimal.min_budget_optimal(g) if g.is_chain else ilp.min_budget_ilp(g)
    if method == "dtr":
        return dtr.min_budget_dtr(g)
    raise UserError(f"unknown rematerialization method {method!r}; allowed: {', '.join(METHODS)}")

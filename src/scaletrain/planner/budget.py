"""Budgeted training: which plan, on how many devices of which platform, trains a stated run for the
least money (or in the least time), within a deadline and a budget.

The survey "Systems for Parallel and Distributed Large-Model Deep Learning Training" (§5) names
budgeted training — the cost of the whole run, not of one step — as what a strategy finder should
optimise when devices are rented. Here a *run* is N tokens (or N samples) and a *rental* is one
plan on ``nodes × gpus_per_node`` devices of one platform. With a global batch of B sequences of s
tokens, one optimizer step trains B·s tokens, so (units: seconds, USD):

* ``steps = ceil(N / (B·s))`` (tokens) or ``ceil(N / B)`` (samples) — whole steps, as a run takes them;
* ``train_time_s = steps × step_time_s`` — the plan's predicted step (:mod:`.cost`);
* ``train_cost = devices × train_time_s / 3600 × price_per_device_hour`` (the platform's field).

Only the steps are priced: start-up, evaluation, checkpoints, restarts after failures and idle
devices while a job waits are not, so real bills are higher by what those take.

The search itself is :func:`.search.search`, called once per (platform, node count); this module
ranks the union by the objective, drops what breaks ``deadline_s`` / ``max_cost`` (kept as rejected
regions with the reason) and says why each runner-up lost.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass
from typing import Any

from scaletrain.errors import UserError
from scaletrain.planner.cost import Options, PlanCost
from scaletrain.planner.search import SearchResult, search, why_lost as step_why_lost
from scaletrain.planner.shape import Shape
from scaletrain.planner.traced import search as traced_search
from scaletrain.platform import Platform

OBJECTIVES = ("time", "cost")
"""What ``--objective`` ranks by: predicted step (= train) time, or the run's cost."""
_UNITS_S = {"s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(text: str) -> float:
    """``"7200"`` / ``"90m"`` / ``"2h"`` / ``"3d"`` / ``"1.5h"`` -> seconds (UserError in one line otherwise)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*(s|m|min|h|d)?\s*", str(text).lower())
    if not m or float(m.group(1)) <= 0:
        raise UserError(f"--deadline {text!r}: expected a positive number of seconds or one with a unit "
                        f"(s, m, h, d), e.g. 36000, 90m, 2h, 3d")
    return float(m.group(1)) * _UNITS_S[m.group(2) or "s"]


MAX_NODE_COUNTS = 1024
"""Node counts one search may compare (each is a whole planner search: 1-10000000 ran for minutes)."""
MAX_NODES = 1 << 20
"""Nodes one plan may name."""


def parse_nodes(text: str) -> list[int]:
    """``"4"`` / ``"1,2,4"`` / ``"1-4"`` / ``"16,32-34"`` -> sorted distinct node counts (ranges inclusive)."""
    out: set[int] = set()
    for part in str(text).split(","):
        lo, sep, hi = part.strip().partition("-")
        try:
            a, b = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            a = b = 0
        if a < 1 or b < a:
            raise UserError(f"--nodes {text!r}: expected node counts >= 1 as a list or ranges, e.g. 4, 1,2,4 or 1-8")
        if b > MAX_NODES or len(out) + b - a + 1 > MAX_NODE_COUNTS:
            raise UserError(f"--nodes {text!r}: at most {MAX_NODE_COUNTS} node counts, each <= {MAX_NODES:,}")
        out.update(range(a, b + 1))
    return sorted(out)


def parse_count(flag: str, text: str) -> float:
    """``"300e9"`` / ``"1000000"`` -> a positive whole count (UserError naming ``flag`` otherwise)."""
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not (v >= 1 and math.isfinite(v)):
        raise UserError(f"{flag} {text!r}: expected a positive count, e.g. 300e9")
    return v


def fmt_duration(seconds: float) -> str:
    """Seconds as the largest unit that keeps the number >= 1 (s, min, h, d), 4 significant figures."""
    for unit, size in (("d", 86400.0), ("h", 3600.0), ("min", 60.0)):
        if seconds >= size:
            return f"{seconds / size:#.4g} {unit}"
    return f"{seconds:#.4g} s"


def fmt_usd(x: float) -> str:
    return f"${x:,.0f}" if x >= 100 else f"${x:,.2f}"


@dataclass(frozen=True)
class Workload:
    """The training run to price: ``tokens`` or ``samples`` in total (one of them; 0 = not stated)."""

    tokens: float = 0.0
    """Tokens to train on, in total (all epochs)."""
    samples: float = 0.0
    """Sequences (samples) to train on, in total."""

    @property
    def stated(self) -> bool:
        return self.tokens > 0 or self.samples > 0

    def steps(self, global_batch: int, seq: int) -> int:
        """Optimizer steps the run takes: whole steps of ``global_batch`` sequences of ``seq`` tokens."""
        if self.tokens > 0:
            return math.ceil(self.tokens / (global_batch * seq))
        return math.ceil(self.samples / global_batch)

    def describe(self) -> str:
        return f"{self.tokens:.3g} tokens" if self.tokens > 0 else f"{self.samples:.3g} samples"


@dataclass
class Rental:
    """One priced plan on ``nodes × gpus_per_node`` devices of ``platform``, and what the run costs there."""

    cost: PlanCost
    platform: Platform
    nodes: int
    gpus_per_node: int
    steps: int = 0
    """Optimizer steps of the run (0: no run stated)."""

    @property
    def devices(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def train_time_s(self) -> float | None:
        """Seconds the run's steps take at the predicted step time; None without a run."""
        return self.steps * self.cost.step_time_s if self.steps else None

    @property
    def train_cost(self) -> float | None:
        """USD: devices × hours × price per device-hour; None without a run or a price."""
        t, price = self.train_time_s, self.platform.price_per_device_hour
        return train_cost(self.devices, t, price) if t is not None and price > 0 else None

    @property
    def where(self) -> str:
        return f"{self.devices} x {self.platform.name}"


def train_cost(devices: int, seconds: float, price_per_device_hour: float) -> float:
    """USD to rent ``devices`` for ``seconds`` at ``price_per_device_hour`` USD per device and hour."""
    return devices * seconds / 3600.0 * price_per_device_hour


@dataclass
class BudgetResult:
    """Rentals that fit and meet the constraints, best first by ``objective``; everything ruled out."""

    ranked: list[Rental]
    rejected: list[dict[str, Any]]
    """Each ``{"region", "kind", "reason", "count"}``; kinds of the search plus ``deadline`` and ``budget``."""
    searches: list[tuple[Platform, int, SearchResult]]
    objective: str
    evaluated: int
    seconds: float


def check_request(platforms: list[Platform], *, objective: str, workload: Workload, deadline_s: float | None,
                  max_cost: float | None) -> None:
    """What the cost objective and the constraints need, present: a stated run, and a price on each platform."""
    if objective not in OBJECTIVES:
        raise UserError(f"--objective {objective!r}: allowed: {', '.join(OBJECTIVES)}")
    needs_run = [flag for flag, on in (("--objective cost", objective == "cost"), ("--deadline", deadline_s is not None),
                                       ("--max-cost", max_cost is not None)) if on]
    if needs_run and not workload.stated:
        raise UserError(f"{needs_run[0]} prices a whole training run: give --tokens N or --samples N")
    if max_cost is not None and not max_cost > 0:
        raise UserError(f"--max-cost {max_cost}: expected an amount > 0 (USD)")
    if objective == "cost" or max_cost is not None:
        flag = "--objective cost" if objective == "cost" else "--max-cost"
        for p in platforms:
            if not p.price_per_device_hour > 0:
                raise UserError(f"platform {p.name!r} has no price_per_device_hour (USD per device-hour), which "
                                f"{flag} needs; set it in the platform file or with --price {p.name}=USD")


def _rank_key(objective: str):
    # time: step time (the run's steps are the same for every rental: one global batch), then cost, then fewer
    # devices; cost: the run's cost to 6 significant digits, then time, then devices. Stable: the search's own
    # order (simpler, then lighter plans first) breaks the remaining ties inside one rental.
    if objective == "cost":
        return lambda r: (float(f"{r.train_cost:.6g}"), round(r.cost.step_time_s, 6), r.devices)
    return lambda r: (round(r.cost.step_time_s, 6), r.train_cost or 0.0, r.devices)


def plan_rentals(shape: Shape, platforms: list[Platform], nodes: list[int], *, gpus_per_node: int,
                 global_batch: int, seq: int, workload: Workload = Workload(), objective: str = "time",
                 deadline_s: float | None = None, max_cost: float | None = None,
                 fixed: dict[str, Any] | None = None, precision: str = "bf16", optimizer: str = "adamw",
                 options: Options | None = None) -> BudgetResult:
    """Search every (platform, node count), price the run on each plan that fits, keep those within
    ``deadline_s`` seconds and ``max_cost`` USD and rank them by ``objective`` (module docstring)."""
    check_request(platforms, objective=objective, workload=workload, deadline_s=deadline_s, max_cost=max_cost)
    t0 = time.perf_counter()
    steps = workload.steps(global_batch, seq) if workload.stated else 0
    several = len(platforms) * len(nodes) > 1
    searches: list[tuple[Platform, int, SearchResult]] = []
    kept: list[Rental] = []
    rejected: list[dict[str, Any]] = []
    late: dict[tuple[str, int], list[Rental]] = {}
    over: dict[tuple[str, int], list[Rental]] = {}
    for plat in platforms:
        for n in nodes:
            find = search if isinstance(shape, Shape) else traced_search
            res = find(shape, plat, nodes=n, gpus_per_node=gpus_per_node, global_batch=global_batch, seq=seq,
                         fixed=fixed, precision=precision, optimizer=optimizer, options=options)
            searches.append((plat, n, res))
            where = f"{n * gpus_per_node} x {plat.name}"
            for r in res.rejected:  # the search's regions, named by rental when several are compared
                rejected.append({**r, "region": f"{where} {r['region']}" if several else r["region"]})
            for c in res.ranked:
                rent = Rental(c, plat.with_(devices_per_node=gpus_per_node), n, gpus_per_node, steps)
                if deadline_s is not None and rent.train_time_s > deadline_s:
                    late.setdefault((plat.name, n), []).append(rent)
                elif max_cost is not None and rent.train_cost > max_cost:
                    over.setdefault((plat.name, n), []).append(rent)
                else:
                    kept.append(rent)
    budget: list[dict[str, Any]] = []
    for rents in late.values():
        fastest = min(rents, key=lambda r: r.cost.step_time_s)
        budget.append({"region": fastest.where, "kind": "deadline", "count": len(rents),
                       "reason": f"past the deadline {fmt_duration(deadline_s)} for {workload.describe()}; the "
                                 f"fastest of these takes {fmt_duration(fastest.train_time_s)} "
                                 f"({fastest.cost.plan.describe()})"})
    for rents in over.values():
        cheapest = min(rents, key=lambda r: r.train_cost)
        budget.append({"region": cheapest.where, "kind": "budget", "count": len(rents),
                       "reason": f"over the budget {fmt_usd(max_cost)}; the cheapest of these costs "
                                 f"{fmt_usd(cheapest.train_cost)} ({cheapest.cost.plan.describe()})"})
    kept.sort(key=_rank_key(objective))
    order = {"deadline": 0, "budget": 1, "memory": 2, "batch": 3, "divisibility": 4, "compat": 5}
    rejected = sorted(budget + rejected, key=lambda r: order.get(r["kind"], 6))  # stable: each search's order kept
    return BudgetResult(ranked=kept, rejected=rejected, searches=searches, objective=objective,
                        evaluated=sum(r.evaluated for _, _, r in searches), seconds=time.perf_counter() - t0)


def why_lost(best: Rental, other: Rental, objective: str) -> str:
    """One line: how much ``other`` loses to ``best`` under ``objective`` and where it goes."""
    same = best.platform.name == other.platform.name and best.devices == other.devices
    if objective == "cost":
        pct = (other.train_cost / best.train_cost - 1) * 100
        head = f"+{pct:.1f}% cost ({fmt_usd(other.train_cost)})"
        if same:
            return f"{head}: {step_why_lost(best.cost, other.cost)}"
        speed = best.cost.step_time_s / other.cost.step_time_s
        return (f"{head}: {other.where} train in {fmt_duration(other.train_time_s)}, {speed:.2f}x the speed of "
                f"{best.where} for {other.devices / best.devices:.2f}x the devices at "
                f"{fmt_usd(other.platform.price_per_device_hour)} vs {fmt_usd(best.platform.price_per_device_hour)} "
                f"per device-hour")
    if same:
        return step_why_lost(best.cost, other.cost)
    pct = (other.cost.step_time_s / best.cost.step_time_s - 1) * 100
    return (f"+{pct:.1f}% step time on {other.where} ({other.cost.step_time_s * 1e3:.0f} ms vs "
            f"{best.cost.step_time_s * 1e3:.0f} ms on {best.where})")


def by_rental(result: BudgetResult) -> list[dict[str, Any]]:
    """Per (platform, node count) searched: its best rental kept (``best``), or ``why`` none was kept."""
    out = []
    for plat, n, res in result.searches:
        where = f"{res.world} x {plat.name}"
        mine = next((r for r in result.ranked if r.platform.name == plat.name and r.nodes == n), None)
        row: dict[str, Any] = {"platform": plat.name, "nodes": n, "devices": res.world, "best": mine}
        if mine is None:
            why = [f"{r['count']} plan(s) {r['reason']}" for r in result.rejected
                   if r["kind"] in ("deadline", "budget") and r["region"] == where]
            if why:
                row["why"] = "; ".join(why)
            else:
                first = res.rejected[0] if res.rejected else {"region": where, "reason": "nothing to search"}
                row["why"] = f"no plan fits ({first['region']}: {first['reason']})"
        out.append(row)
    return out

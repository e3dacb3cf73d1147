"""Memory-aware pipeline partitioning of a Chain's profiled blocks (the pipeline cost face).

Splits the blocks of a :class:`~scaletrain.measure.types.Profile` into S contiguous stages
(S = P, or P·v for interleaved) minimising the slowest stage's time

    stage time = Σ (fwd + bwd) of its blocks + boundary communication,
    boundary communication = (bytes received + bytes sent) / bandwidth + latency per message,

counting, per stage k, its input activation arriving and its input-gradient leaving
(k > 0) and its output leaving and the output-gradient arriving (k < S−1) — the load
balance PipeDream (Narayanan et al. SOSP'19 §3.1) and DAPPLE optimise, *with* communication.

Memory of a stage replica on its rank (bytes):

    params × bytes_per_param                      weights + grads + optimizer state (16 for fp32 Adam)
  + (weight versions − 1) × param bytes           PipeDream / 2BW weight stashing
  + in-flight(stage) × Σ(input + saved bytes)     activations kept for backward
  + max transient of its blocks                   forward/backward temporaries

where in-flight(stage) and weight versions are the simulator's per-stage peaks for the
schedule (1F1B: P−k; GPipe: M; ZB-H1: P; ...). With one stage per rank the DP below is
exact (tested against brute force). Interleaved and Chimera put several stage replicas on
one rank (v chunks; Chimera's stages r and P−1−r); the DP then gives each replica an equal
share of the rank's limit (limit / v, limit / 2) — a sufficient condition, so the answer
always fits but may miss a split that only fits with an uneven share; the true per-rank
peaks are reported in :attr:`Partition.rank_memory_bytes`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import accumulate

from scaletrain.errors import UserError
from scaletrain.measure.types import BlockProfile, Profile

from .schedules import build
from .simulate import Link, StageCosts, simulate

GiB = 1024 ** 3


@dataclass
class Partition:
    """Result of :func:`partition`: stage k owns blocks ``bounds[k]:bounds[k+1]``."""

    bounds: list[int]
    stage_time_s: list[float]
    """Compute + boundary communication per stage, seconds."""
    stage_memory_bytes: list[float]
    """Peak bytes of each stage replica (in-flight activations included)."""
    rank_memory_bytes: list[float]
    """Peak bytes per rank: sum over the stage replicas it holds."""
    bottleneck_s: float
    schedule: str
    n_ranks: int
    n_microbatches: int
    virtual: int = 1

    @property
    def sizes(self) -> list[int]:
        return [b - a for a, b in zip(self.bounds, self.bounds[1:])]


def _params(b: BlockProfile) -> float:
    """Parameter elements of a block; falls back to fp32 bytes / 4 when only bytes are known."""
    return b.param_count if b.param_count else b.param_bytes / 4


def equal_bounds(n_blocks: int, n_stages: int) -> list[int]:
    """Equal-blocks split (the baseline the DP must beat): stage k gets blocks
    round(k·n/S) .. round((k+1)·n/S)."""
    if n_blocks < n_stages:
        raise UserError(f"cannot split {n_blocks} blocks into {n_stages} non-empty stages")
    return [round(k * n_blocks / n_stages) for k in range(n_stages + 1)]


class _Model:
    """Prefix sums and the per-(first, end, stage) time and memory formulas."""

    def __init__(self, profile: Profile, schedule: str, P: int, M: int, v: int, bytes_per_param: float,
                 link: Link):
        self.blocks = profile.blocks
        self.n, self.S, self.P = len(self.blocks), P * v, P
        self.link = link
        self.bpp = bytes_per_param
        self.sched = build(schedule, P, M, v)
        unit = simulate(self.sched)  # in-flight counts and versions depend on the order only
        self.pipes = self.sched.n_pipes
        self.inflight = [max(unit.peak_inflight_stage.get((p, k), 0) for p in range(self.pipes))
                         for k in range(self.S)]
        self.versions = [unit.peak_weight_versions[self.sched.rank_of(k)] for k in range(self.S)]
        self.share = v * self.pipes  # stage replicas per rank
        bl = self.blocks
        self.t = [0.0] + list(accumulate(b.fwd_time_s + b.bwd_time_s for b in bl))
        self.ppm = [0.0] + list(accumulate(_params(b) for b in bl))
        self.pb = [0.0] + list(accumulate(float(b.param_bytes) for b in bl))
        self.act = [0.0] + list(accumulate(float(b.input_bytes + b.saved_bytes) for b in bl))
        # temp[i][j - i - 1] = max transient bytes over blocks i..j-1
        self.temp = []
        for i in range(self.n):
            row, m = [], 0.0
            for b in bl[i:]:
                m = max(m, float(b.fwd_temp_bytes), float(b.bwd_temp_bytes))
                row.append(m)
            self.temp.append(row)

    def comm(self, i: int, j: int, k: int) -> float:
        c = 0.0
        if k > 0:  # input arrives, its gradient leaves
            c += 2 * self.link.time(self.blocks[i].input_bytes)
        if k < self.S - 1:  # output leaves, its gradient arrives
            c += 2 * self.link.time(self.blocks[j - 1].output_bytes)
        return c

    def time(self, i: int, j: int, k: int) -> float:
        return self.t[j] - self.t[i] + self.comm(i, j, k)

    def memory(self, i: int, j: int, k: int) -> float:
        temp = self.temp[i][j - i - 1]
        return ((self.ppm[j] - self.ppm[i]) * self.bpp + (self.versions[k] - 1) * (self.pb[j] - self.pb[i])
                + self.inflight[k] * (self.act[j] - self.act[i]) + temp)

    def stage_costs(self, bounds: list[int]) -> StageCosts:
        bl, S = self.blocks, self.S
        seg = [bl[bounds[k]:bounds[k + 1]] for k in range(S)]
        return StageCosts(
            fwd_s=[sum(b.fwd_time_s for b in s) for s in seg],
            bwd_s=[sum(b.bwd_time_s for b in s) for s in seg],
            boundary_bytes=[float(s[-1].output_bytes) for s in seg],
            act_bytes=[float(sum(b.input_bytes + b.saved_bytes for b in s)) for s in seg],
            weight_bytes=[float(sum(b.param_bytes for b in s)) for s in seg],
            state_bytes=[sum(_params(b) for b in s) * self.bpp - sum(b.param_bytes for b in s) for s in seg],
        )

    def result(self, bounds: list[int], name: str, M: int, v: int) -> Partition:
        S = self.S
        times = [self.time(bounds[k], bounds[k + 1], k) for k in range(S)]
        mems = [self.memory(bounds[k], bounds[k + 1], k) for k in range(S)]
        ranks = [0.0] * self.P
        for k in range(S):
            for p in range(self.pipes):
                ranks[self.sched.rank_of(k, p)] += mems[k]
        return Partition(list(bounds), times, mems, ranks, max(times), name, self.P, M, v)


def _minmax(model: _Model, cost, limit: float) -> tuple[float, list[int]] | None:
    """DP over contiguous splits minimising max_k cost(i, j, k) with memory(i, j, k) ≤ limit.

    best[k][j] = min over i of max(best[k-1][i], cost(i, j, k)) — O(S·n²) evaluations."""
    n, S = model.n, model.S
    INF = math.inf
    best = [[INF] * (n + 1) for _ in range(S + 1)]
    arg = [[-1] * (n + 1) for _ in range(S + 1)]
    best[0][0] = 0.0
    lim = limit * (1 + 1e-12)  # slack: float rounding
    bounded = lim != INF  # no limit: no memory to evaluate (the planner's many calls: planner/stages.py)
    memory = model.memory
    for k in range(S):
        prev, cur, where = best[k], best[k + 1], arg[k + 1]
        for j in range(k + 1, n - (S - k - 1) + 1):  # leave a block for each later stage
            bj, aj = cur[j], where[j]
            for i in range(k, j):
                p = prev[i]
                if p == INF or (bounded and memory(i, j, k) > lim):
                    continue
                c = cost(i, j, k)
                val = p if p >= c else c
                if val < bj:
                    bj, aj = val, i
            cur[j], where[j] = bj, aj
    if best[S][n] == INF:
        return None
    bounds = [n]
    for k in range(S, 0, -1):
        bounds.append(arg[k][bounds[-1]])
    return best[S][n], bounds[::-1]


def partition(profile: Profile, n_ranks: int, schedule: str = "1f1b", n_microbatches: int | None = None,
              virtual: int = 1, memory_limit_bytes: float = math.inf, bytes_per_param: float = 16.0,
              bandwidth_Bps: float = math.inf, latency_s: float = 0.0) -> Partition:
    """Best contiguous split of ``profile``'s blocks for ``schedule`` on ``n_ranks`` ranks.

    ``n_microbatches`` defaults to 2·P (even, divisible by P, so every schedule accepts it).
    Raises :class:`UserError` when no split fits ``memory_limit_bytes``, naming the smallest
    limit that would.
    """
    M = n_microbatches if n_microbatches is not None else 2 * n_ranks
    S = n_ranks * virtual
    if len(profile.blocks) < S:
        raise UserError(f"cannot split {len(profile.blocks)} blocks into {S} pipeline stages; "
                        f"use at most {len(profile.blocks)} stages (ranks × virtual)")
    model = _Model(profile, schedule, n_ranks, M, virtual, bytes_per_param, Link(bandwidth_Bps, latency_s))
    per_replica = memory_limit_bytes / model.share
    found = _minmax(model, model.time, per_replica)
    if found is None:
        least = _minmax(model, model.memory, math.inf)
        assert least is not None
        need = least[0] * model.share
        how = "" if model.share == 1 else f" with an equal share per stage replica ({model.share} per rank)"
        raise UserError(f"no split of {model.n} blocks into {S} stages for {schedule} (M={M}) fits "
                        f"{memory_limit_bytes / GiB:.3f} GiB per rank{how}; the smallest feasible limit is "
                        f"{need / GiB:.3f} GiB ({need:.0f} bytes)")
    return model.result(found[1], schedule, M, virtual)


def evaluate(profile: Profile, bounds: list[int], n_ranks: int, schedule: str = "1f1b",
             n_microbatches: int | None = None, virtual: int = 1, bytes_per_param: float = 16.0,
             bandwidth_Bps: float = math.inf, latency_s: float = 0.0) -> tuple[Partition, StageCosts]:
    """Stage times/memory of a given split (e.g. :func:`equal_bounds`) and its StageCosts
    for :func:`~.simulate.simulate`."""
    M = n_microbatches if n_microbatches is not None else 2 * n_ranks
    model = _Model(profile, schedule, n_ranks, M, virtual, bytes_per_param, Link(bandwidth_Bps, latency_s))
    if len(bounds) != model.S + 1 or bounds[0] != 0 or bounds[-1] != model.n or \
            any(b >= c for b, c in zip(bounds, bounds[1:])):
        raise UserError(f"bounds must rise strictly from 0 to {model.n} with {model.S + 1} entries (got {bounds})")
    return model.result(bounds, schedule, M, virtual), model.stage_costs(bounds)

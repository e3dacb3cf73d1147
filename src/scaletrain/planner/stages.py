"""Which layers each pipeline rank holds, by the runtime's own rule, for a decoder shape on paper.

The pipeline runtime splits a model's Chain — embedding, the l layers, the head: l + 2 blocks — into
``pp × v`` contiguous stages with ``parallel.balance``:

* ``profile`` (default): the memory-aware partitioner's min–max over the blocks' forward + backward
  seconds (:func:`scaletrain.techniques.pipeline.partition._minmax`, no memory limit: what
  :func:`~scaletrain.techniques.pipeline.apply.stage_bounds` asks of it). The same DP runs here, over the
  analytic costs of the three kinds of block, so 70 layers on 12 stages or 126 on 16 are expressible,
  and the embedding and the head are units of their own (a stage may hold the head alone);
* ``equal``: equal block counts (:func:`~scaletrain.techniques.pipeline.partition.equal_bounds`).

Stage k of an interleaved schedule runs on rank k mod pp, so a rank's layers are the sum over its v
chunks. The split depends on the block costs only through their ratios, so it is memoised on
(l, pp, v, balance, embedding and head cost in layers rounded to 1/8): one DP per region, not per plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from scaletrain.errors import UserError
from scaletrain.techniques.pipeline.partition import _minmax, equal_bounds

BALANCES = ("profile", "equal")

PIPELINE_REMAT = ("the pipeline runtime rematerialises inside its stages only by a solver's schedule "
                  "(memory.remat.method with memory.remat.budget, per stage and micro-batch); memory.remat.blocks "
                  "and memory.remat.selective are not applied there (techniques/pipeline/strategy.py passes the "
                  "method alone), so a pipeline with full or selective recompute would run without it")
"""Why the planners do not offer full or selective recompute with pp > 1 (a rejected region, kind runtime)."""


@dataclass(frozen=True)
class Split:
    """Layers per pipeline rank and the Chain's stage bounds (blocks: 0 the embedding, l + 1 the head)."""

    layers: tuple[int, ...]
    """Transformer layers on each rank (rank 0 holds the embedding, rank pp − 1 the head)."""
    bounds: tuple[int, ...]
    """Block bounds of the pp × v stages, as the runtime's partitioner returns them."""

    @property
    def even(self) -> bool:
        return len(set(self.layers)) == 1

    def describe(self) -> str:
        return "+".join(str(n) for n in self.layers)


class _Blocks:
    """The partitioner DP's view of the Chain (what :func:`_minmax` reads): n blocks, S stages, the
    prefix sums of their seconds, and no memory limit (the runtime passes none)."""

    def __init__(self, n_layers: int, stages: int, embed: float, head: float):
        self.n, self.S = n_layers + 2, stages
        cost = [embed] + [1.0] * n_layers + [head]
        self.t = [0.0]
        for c in cost:
            self.t.append(self.t[-1] + c)

    def time(self, i: int, j: int, k: int) -> float:
        return self.t[j] - self.t[i]

    def memory(self, i: int, j: int, k: int) -> float:
        return 0.0


@lru_cache(maxsize=4096)
def _bounds(n_layers: int, stages: int, balance: str, embed_q: int, head_q: int) -> tuple[int, ...]:
    if balance == "equal":
        return tuple(equal_bounds(n_layers + 2, stages))
    model = _Blocks(n_layers, stages, embed_q / 8, head_q / 8)
    t = model.t
    found = _minmax(model, lambda i, j, k: t[j] - t[i], float("inf"))  # type: ignore[arg-type]  (duck-typed _Model)
    assert found is not None  # no memory limit: every split into non-empty stages is feasible
    return tuple(found[1])


def split(n_layers: int, pp: int, virtual: int = 1, *, embed_layers: float = 0.0, head_layers: float = 0.0,
          balance: str = "profile") -> Split:
    """The runtime's split of ``n_layers`` layers plus the embedding and the head over ``pp`` ranks ×
    ``virtual`` chunks. ``embed_layers`` / ``head_layers``: the embedding's and the head's forward +
    backward seconds in units of one layer's (they set where the partitioner cuts)."""
    v = max(virtual, 1)
    if balance not in BALANCES:
        raise UserError(f"pp_split={balance}: allowed: {', '.join(BALANCES)} (the runtime's parallel.balance)")
    if n_layers + 2 < pp * v:
        raise UserError(f"cannot split {n_layers + 2} blocks into {pp * v} pipeline stages")
    if pp == 1:
        return Split((n_layers,), (0, n_layers + 2))
    q = (max(0, round(embed_layers * 8)), max(0, round(head_layers * 8)))
    bounds = _bounds(n_layers, pp * v, balance, *q)
    layers = [0] * pp
    for k in range(pp * v):
        lo, hi = bounds[k], bounds[k + 1]
        layers[k % pp] += max(0, min(hi, n_layers + 1) - max(lo, 1))  # blocks 1..l are the layers
    return Split(tuple(layers), bounds)


def uniform(n_layers: int, pp: int) -> Split:
    """l/pp layers on every rank, the embedding and the head beside the first and last ranks' (Megatron-LM's
    split: it needs pp to divide l); for pricing published runs (``Options.stage_split="uniform"``)."""
    if n_layers % pp:
        raise UserError(f"a uniform split needs pp={pp} to divide the {n_layers} layers")
    return Split((n_layers // pp,) * pp, ())

"""The job's one mesh (:mod:`scaletrain.techniques.world`): its groups are the ones the runtimes use.
The runs on it (SPMD and pipeline, with TP / EP / ZeRO-3 / HSDP) are the parity tests of
``test_tensor_parallel_2d.py``, ``test_intralayer_train.py`` and ``test_pipeline_*.py``."""

from __future__ import annotations

import pytest

from scaletrain.errors import UserError
from scaletrain.techniques.pipeline.experts import ep_replicas
from scaletrain.techniques.pipeline.tensor_parallel import layouts
from scaletrain.techniques.world import Dims, rank_groups


def test_pipeline_rank_orders_are_the_meshs_slices():
    """pp=2 x dp=4 (ep=2 inside) x tp=2: each TP index's pipeline, each stage's data-parallel, EP and
    expert-data-parallel groups and each replica's pipeline line are groups of the one mesh."""
    pp, dp, ep, tp = 2, 4, 2, 2
    dims = Dims.of(world=pp * dp * tp, pp=pp, tp=tp, inner=ep, what="parallel.ep=2")
    assert (dims.pp, dims.dp_rep, dims.dp_in, dims.cp, dims.tp) == (2, 2, 2, 1, 2)
    g = rank_groups(dims)
    L = layouts(dp, pp, tp)  # position r·dp + d of TP index t's pipeline
    assert sorted(tuple(sorted(x)) for x in L) == sorted(g["pipe"])
    for t, ranks in enumerate(L):
        for r in range(pp):
            assert tuple(sorted(ranks[r * dp + d] for d in range(dp))) in g["dp"]
            for d in range(dp):
                group, same = ep_replicas(d, dp, ep)
                assert tuple(sorted(ranks[r * dp + i] for i in group)) in g["dp_in"]
                assert tuple(sorted(ranks[r * dp + i] for i in same)) in g["dp_rep"]
        for d in range(dp):
            assert tuple(sorted(ranks[r * dp + d] for r in range(pp))) in g["pp"]
    assert all(b - a == 1 for a, b in g["tp"])  # TP innermost: neighbours
    for name, groups in g.items():  # each a partition of the world
        assert sorted(r for x in groups for r in x) == list(range(dims.world)), name


def test_bad_sizes_are_one_line_user_errors():
    with pytest.raises(UserError, match=r"^parallel.pp=3 x parallel.tp=2 x parallel.cp=1 must divide the 8 processes$"):
        Dims.of(world=8, pp=3, tp=2)
    with pytest.raises(UserError, match=r"^parallel.ep=3 must divide the data-parallel size 4 \(= 8 processes / "
                                        r"\(tp x cp\)\)$"):
        Dims.of(world=8, tp=2, inner=3, what="parallel.ep=3")

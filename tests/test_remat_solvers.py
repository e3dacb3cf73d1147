"""Every solver's schedule: valid, within budget, predictions == simulator replay; the memory model."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scaletrain.errors import UserError
from scaletrain.measure.types import BlockProfile, Profile
from scaletrain.techniques import remat
from scaletrain.techniques.remat import dtr, exhaustive, optimal, periodic, revolve
from scaletrain.techniques.remat.periodic import none_ops, periodic_ops, segment_bounds
from scaletrain.techniques.remat.schedule import Graph, Node, Op, ops_from_str
from scaletrain.techniques.remat.simulate import simulate

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])


def random_chain(n: int, seed: int, scale: int = 1) -> Graph:
    rnd = random.Random(seed)
    return Graph.chain([Node(f"b{i}", rnd.uniform(0.5, 3), rnd.uniform(1, 5), rnd.randint(1, 8) * scale,
                             rnd.randint(0, 12) * scale, rnd.randint(0, 3) * scale, rnd.randint(0, 3) * scale)
                        for i in range(n)], rnd.randint(0, 4) * scale, loss_bytes=rnd.randint(0, 3) * scale)


# -- the memory model, counted by hand -------------------------------------------------------

def test_simulator_counts_by_hand():
    """Two blocks; out 4, saved 2, fwd_temp 1, bwd_temp 3; input 1; loss peak 20 (see simulate.py)."""
    g = Graph.chain([Node("a", 1.0, 2.0, 4, 2, 1, 3), Node("b", 1.5, 2.5, 4, 2, 1, 3)], 1, loss_bytes=20)
    rep = simulate(g, ops_from_str("F0^e F1^e B1 B0"))
    assert rep.during == [
        1 + 4 + 2 + 1,            # F0^e: input + out + saved + fwd_temp
        1 + 6 + 4 + 2 + 1,        # F1^e: + tape 0 (6)
        1 + 6 + 6 + max(20, 4 + 4 + 3),  # B1: tapes + max(loss peak, δ1 + new δ0 + bwd_temp)
        1 + 6 + 4 + 3,            # B0: tape 0 + δ0 + bwd_temp (the input gets no gradient)
    ]
    assert rep.after == [7, 13, 1 + 6 + 4, 1]
    assert rep.peak_bytes == 33 and rep.time_s == pytest.approx(7.0)
    small_loss = Graph(g.nodes, 1, loss_bytes=5)  # now the block's own backward sets the peak
    assert simulate(small_loss, ops_from_str("F0^e F1^e B1 B0")).during[2] == 1 + 6 + 6 + 4 + 4 + 3
    # Recomputing: keep only the input; F0^n cannot forget the caller's input.
    rep2 = simulate(g, ops_from_str("F0^n F1^e B1 F0^e B0"))
    assert rep2.during[:2] == [1 + 4 + 2 + 1, 1 + 4 + 4 + 2 + 1]
    assert rep2.after[2] == 1 + 4  # B1 freed tape 1 and the plain a_0, made δ0
    assert rep2.time_s == pytest.approx(8.0)


@pytest.mark.parametrize("ops,msg", [
    ("F1^e", "not available"), ("F0^e B0", "successor"), ("F0^e F1^c B1", "no tape"),
    ("F0^c F1^e Dp0", "holds it"), ("F0^e F1^e B1", "incomplete"), ("F0^e F0^e", "already exists"),
])
def test_simulator_rejects_invalid_schedules(ops, msg):
    g = Graph.chain([Node("a", 1, 1, 1), Node("b", 1, 1, 1)])
    with pytest.raises(ValueError, match=msg):
        simulate(g, ops_from_str(ops))


def test_graph_validation():
    with pytest.raises(UserError, match="topological"):
        Graph((Node("a", 1, 1, 1, preds=(1,)), Node("b", 1, 1, 1, preds=(0,))))
    with pytest.raises(UserError, match="feed nothing"):
        Graph((Node("a", 1, 1, 1), Node("b", 1, 1, 1), Node("c", 1, 1, 1, preds=(1,))))
    with pytest.raises(UserError, match="chains only"):
        optimal.solve_optimal(Graph((Node("a", 1, 1, 1), Node("b", 1, 1, 1, preds=(0,)),
                                     Node("c", 1, 1, 1, preds=(0, 1)))), 100)


def test_from_profile_and_loss():
    prof = Profile(blocks=[BlockProfile("e", 1e-3, 2e-3, input_bytes=64, output_bytes=128, saved_bytes=16,
                                        fwd_temp_bytes=8, bwd_temp_bytes=4),
                           BlockProfile("h", 2e-3, 3e-3, input_bytes=128, output_bytes=256, saved_bytes=32)],
                   meta={"loss": {"saved_bytes": 100, "fwd_temp_bytes": 7, "bwd_temp_bytes": 9,
                                  "fwd_time_s": 1e-3, "bwd_time_s": 1e-3}})
    g = Graph.from_profile(prof)
    assert g.input_bytes == 64 and g.loss_bytes == 109 and g.is_chain
    assert g.nodes[1].bwd_time_s == pytest.approx(5e-3)
    assert g.nodes[0].tape_bytes == 144


def test_parse_bytes():
    assert remat.parse_bytes("1.5GiB") == 3 * 2**29
    assert remat.parse_bytes("2GB") == 2 * 10**9
    assert remat.parse_bytes("512 MiB") == 2**29
    assert remat.parse_bytes(1000) == 1000 and remat.parse_bytes("1000") == 1000
    assert remat.parse_bytes(None) is None and remat.parse_bytes("") is None
    for bad in ("lots", "1.5XB", "-3"):
        with pytest.raises(UserError, match="budget"):
            remat.parse_bytes(bad)


# -- every solver ------------------------------------------------------------------------------

@settings(max_examples=30, **SETTINGS)
@given(st.integers(1, 9), st.integers(0, 10**6), st.floats(0, 1))
def test_every_solver_fits_and_predicts_its_replay(n, seed, frac):
    g = random_chain(n, seed)
    lo = optimal.min_budget_optimal(g)
    hi = simulate(g, none_ops(n)).peak_bytes
    budget = int(lo + frac * (hi - lo))
    times = {}
    for method in remat.METHODS:
        try:
            s = remat.solve(g, budget, method, **({"unit_bytes": 1} if method == "optimal" else {}))
        except UserError as e:
            assert "minimum feasible" in e.args[0] and method in ("none", "periodic", "revolve", "dtr")
            continue
        rep = simulate(g, s.ops)
        assert s.predicted_peak_bytes == rep.peak_bytes <= budget
        assert s.predicted_time_s == pytest.approx(rep.time_s)
        assert s.method == method and s.budget_bytes == budget
        times[method] = s.predicted_time_s
    # optimal is optimal among persistent schedules, which none/periodic/revolve produce.
    for m in ("none", "periodic", "revolve"):
        if m in times:
            assert times["optimal"] <= times[m] + 1e-9
    assert times["ilp"] <= times["optimal"] + 1e-9
    ex = exhaustive.solve(g, budget).predicted_time_s if n <= 6 else None
    if ex is not None and "dtr" in times:
        assert times["dtr"] >= ex - 1e-9


def test_minimum_is_checked_for_every_method():
    g = random_chain(6, 3, scale=2**20)
    for method in remat.METHODS:
        lo = remat.min_budget(g, method)
        s = remat.solve(g, lo, method)
        assert s.predicted_peak_bytes <= lo
        with pytest.raises(UserError) as e:
            remat.solve(g, lo - 2**20, method)
        msg = e.value.args[0]
        assert "minimum feasible" in msg and " B (" in msg and "GiB)" in msg, msg
    assert remat.min_budget(g, "optimal") <= min(remat.min_budget(g, m) for m in ("none", "periodic", "revolve"))


def test_periodic_structure():
    assert segment_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]
    ops = periodic_ops(4, 2)
    assert " ".join(map(str, ops)) == "F0^c F1^n F2^e F3^e B3 B2 F0^e F1^e B1 B0"
    g = random_chain(16, 1)
    s = periodic.solve_periodic(g)  # no budget: √n segments
    assert s.meta["segments"] == 4
    assert periodic.solve_periodic(g, segments=1).ops == none_ops(16)


def test_optimal_budget_sweep_is_monotone_and_fits():
    g = random_chain(16, 5, scale=2**20)
    lo, hi = optimal.min_budget_optimal(g), simulate(g, none_ops(16)).peak_bytes
    prev = None
    for k in range(6):
        b = lo + (hi - lo) * k // 5
        s = optimal.solve_optimal(g, b)
        assert s.predicted_peak_bytes <= b
        if prev is not None:  # more memory is never slower, up to one discretisation unit of slack
            assert s.predicted_time_s <= prev * 1.02
        prev = s.predicted_time_s
    assert s.predicted_time_s == pytest.approx(sum(x.fwd_time_s + x.bwd_time_s for x in g.nodes))


def test_optimal_at_minimum_with_coarse_units_falls_back():
    g = random_chain(30, 9, scale=1000)
    lo = optimal.min_budget_optimal(g)
    s = optimal.solve_optimal(g, lo, slots=50)
    assert s.predicted_peak_bytes <= lo
    # 50 slots round sizes up too much for the exact minimum: finer units, then the least-peak schedule
    assert s.meta.get("fallback") == "least-peak" or s.meta["unit_bytes"] < -(-lo // 50)


def test_optimal_100_blocks():
    """Issue requirement is < 10 s on this machine; the time goes to benchmarks/remat, not here."""
    g = random_chain(100, 2, scale=2**20)
    lo, hi = optimal.min_budget_optimal(g), simulate(g, none_ops(100)).peak_bytes
    s = optimal.solve_optimal(g, (lo + hi) // 3)
    assert s.predicted_peak_bytes <= (lo + hi) // 3
    assert s.predicted_time_s <= periodic.solve_periodic(g, (lo + hi) // 3).predicted_time_s * 1.01


def test_dtr_evicts_by_heuristic():
    g = random_chain(12, 4)
    lo = dtr.min_budget_dtr(g)
    s = dtr.solve_dtr(g, lo)
    assert s.meta["evictions"] > 0 and any(o.kind in ("Dp", "Dt") for o in s.ops)
    assert dtr.solve_dtr(g, simulate(g, none_ops(12)).peak_bytes).ops == none_ops(12)


def test_revolve_slots():
    g = random_chain(10, 8)
    for c in range(10):
        s = revolve.solve_revolve(g, slots=c)
        assert s.n_forwards == revolve.forwards(10, c)


def test_schedule_json_roundtrip():
    g = random_chain(5, 1)
    s = optimal.solve_optimal(g, simulate(g, none_ops(5)).peak_bytes)
    s2 = remat.Schedule.from_dict(__import__("json").loads(s.to_json()))
    assert s2.ops == s.ops and s2.predicted_peak_bytes == s.predicted_peak_bytes
    assert Op("Fe", 3).__str__() == "F3^e"


def test_ilp_lp_rounding_fallback(monkeypatch):
    """No integral solution in time: the LP relaxation is rounded into a valid schedule."""
    from types import SimpleNamespace

    from scaletrain.techniques.remat import ilp

    real = ilp._Model.solve

    def no_incumbent(self, time_limit, relax=False):
        if relax:
            return real(self, time_limit, relax=True)
        return SimpleNamespace(x=None, status=1, message="Time limit reached (simulated)", fun=None)

    monkeypatch.setattr(ilp._Model, "solve", no_incumbent)
    g = random_chain(8, 11)
    lo, hi = optimal.min_budget_optimal(g), simulate(g, none_ops(8)).peak_bytes
    s = ilp.solve_ilp(g, (lo + 2 * hi) // 3)
    assert s.meta["status"] == "lp-rounding" and not s.meta["optimal"]
    assert simulate(g, s.ops).peak_bytes == s.predicted_peak_bytes <= (lo + 2 * hi) // 3


def test_dtr_on_graphs_with_skip_connections():
    rnd = random.Random(5)
    for trial in range(6):
        n = rnd.randint(3, 6)
        nodes = [Node(f"b{i}", rnd.uniform(1, 3), rnd.uniform(1, 3), rnd.randint(1, 6), rnd.randint(0, 6), 1, 1,
                      () if i == 0 else tuple(sorted({i - 1} | {j for j in range(i - 1) if rnd.random() < 0.4})))
                 for i in range(n)]
        g = Graph(tuple(nodes), 2)
        lo, hi = dtr.min_budget_dtr(g), simulate(g, none_ops(n)).peak_bytes
        for b in (lo, (lo + hi) // 2, hi):
            s = dtr.solve_dtr(g, b)
            assert simulate(g, s.ops).peak_bytes == s.predicted_peak_bytes <= b
            assert s.predicted_time_s >= exhaustive.solve(g, b).predicted_time_s - 1e-9
        with pytest.raises(UserError, match="chains only"):
            periodic.solve_periodic(g, hi)

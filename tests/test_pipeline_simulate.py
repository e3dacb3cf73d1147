"""The simulator pins the published closed forms with unit costs (F = 1, B = 2, I = W = 1 per
rank share), tracks in-flight activations, weight versions and memory, and draws timelines."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest

from scaletrain.cli import main
from scaletrain.techniques.pipeline import Link, StageCosts, build, simulate
from scaletrain.techniques.pipeline.timeline import draw

GRID = [(P, M) for P in (2, 3, 4, 8) for M in (1, 2, P, 2 * P, 4 * P, 4 * P + 1)]


def idle(res) -> float:
    """Total idle time over ranks (P × step − Σ busy)."""
    return res.n_ranks * res.step_time_s - sum(res.busy_s)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_bubble_closed_form(name):
    for P, M in GRID:
        r = simulate(build(name, P, M))
        assert r.step_time_s == 3 * (M + P - 1)  # (M + P − 1) slots of F + B
        assert r.bubble_fraction == pytest.approx((P - 1) / (M + P - 1), abs=1e-12)
        assert r.bubble_per_rank == pytest.approx([(P - 1) / (M + P - 1)] * P, abs=1e-12)


def test_interleaved_bubble_closed_form():
    for P in (2, 3, 4, 8):
        for k in (1, 2, 4):
            M = k * P
            for v in (2, 3, 4):
                r = simulate(build("interleaved", P, M, v))
                # Narayanan et al. SC21 §2.2: bubble (P−1)/(v·M + P − 1)
                assert r.bubble_fraction == pytest.approx((P - 1) / (v * M + P - 1), abs=1e-12), (P, M, v)


def test_inflight_1f1b_P_versus_gpipe_M():
    for P, M in GRID:
        g, f = simulate(build("gpipe", P, M)), simulate(build("1f1b", P, M))
        assert g.peak_inflight == [M] * P
        assert f.peak_inflight == [min(P - r, M) for r in range(P)]


def test_interleaved_inflight_rank0_is_P_plus_P_minus_1_over_v():
    # warm-up 2(P−1) + (v−1)P chunk-forwards + 1 steady one, each chunk 1/v of the rank's share:
    # (2(P−1) + (v−1)P + 1)/v = P + (P−1)/v micro-batch equivalents (more than 1F1B's P)
    for P, v in [(2, 2), (4, 2), (4, 4), (8, 2)]:
        r = simulate(build("interleaved", P, 4 * P, v))
        assert r.peak_inflight[0] == 2 * (P - 1) + (v - 1) * P + 1
        assert r.peak_inflight_equiv[0] == pytest.approx(P + (P - 1) / v)


def test_zb1p_is_a_third_of_1f1b_bubble():
    """ZB-H1 with F = I = W = 1: makespan 3M + P − 1, idle exactly 1/3 of 1F1B's (M ≥ P).

    1F1B idles (P−1)(F+B) = 3(P−1) per rank; ZB-H1 only (P−1)(F+I−W) = P−1 (Qi et al. 2024 §2.1),
    so bubble fractions are (P−1)/(3M+P−1) vs (P−1)/(M+P−1): a ratio (M+P−1)/(3M+P−1) → 1/3."""
    for P in (2, 3, 4, 8):
        for M in (P, 2 * P, 4 * P + 1):
            z, f = simulate(build("zb1p", P, M)), simulate(build("1f1b", P, M))
            assert z.step_time_s == 3 * M + P - 1
            assert Fraction(idle(z)).limit_denominator() == Fraction(idle(f)).limit_denominator() / 3
            assert z.bubble_fraction == pytest.approx((P - 1) / (3 * M + P - 1))
            # same activation memory as 1F1B: every rank ≤ P in-flight, rank 0 exactly 1F1B's P
            assert z.peak_inflight == [P] * P and max(z.peak_inflight) == max(f.peak_inflight)


def test_chimera_matches_paper_with_equal_forward_and_backward():
    """Li & Hoefler SC21 Table 2: bubble ratio (D−2)/(2N+D−2), counted with F and B one slot each.

    With F = B = 1 each direction has P/2 − 1 idle slots in its forward and in its backward
    phase: P − 2 per rank against 2M of work; units of P micro-batches concatenate without
    intermediate bubbles. Activation memory per rank between (P/2+1) and P micro-batches."""
    for P in (2, 4, 6, 8):
        for M in (P, 2 * P, 4 * P):
            s = build("chimera", P, M)
            r = simulate(s, StageCosts(fwd_s=[1.0] * P, bwd_s=[1.0] * P))
            assert r.bubble_fraction == pytest.approx((P - 2) / (2 * M + P - 2), abs=1e-12)
            assert r.step_time_s == 2 * M + P - 2
            assert min(r.peak_inflight) == P // 2 + 1 and max(r.peak_inflight) == P


def test_chimera_with_backward_twice_forward():
    """With B = 2F the merged order no longer packs perfectly: for M = P each rank idles
    2(P−2) units (not the paper's 1.5(P−2)), bubble 2(P−2)/(3P+2(P−2)) — still below 1F1B's
    (P−1)/(2P−1). For M ≫ P direct concatenation leaves intermediate bubbles (the paper's
    reason for forward doubling, not implemented), and 1F1B wins again."""
    for P in (4, 6, 8):
        c, f = simulate(build("chimera", P, P)), simulate(build("1f1b", P, P))
        assert idle(c) == pytest.approx(P * 2 * (P - 2))
        assert c.bubble_fraction == pytest.approx(2 * (P - 2) / (5 * P - 4))
        assert c.bubble_fraction < f.bubble_fraction
    c, f = simulate(build("chimera", 4, 16)), simulate(build("1f1b", 4, 16))
    assert c.bubble_fraction > f.bubble_fraction


def test_async_steady_state_has_no_bubble_and_stashes_weights():
    for P, M in [(2, 4), (4, 4), (4, 8), (8, 16)]:
        pd, bw = simulate(build("pipedream", P, M)), simulate(build("pipedream-2bw", P, M))
        for r in (pd, bw):
            assert r.step_time_s == pytest.approx(3 * M)  # every rank busy F + B per micro-batch
            assert r.bubble_fraction == pytest.approx(0.0, abs=1e-12)
            assert r.peak_inflight == [P - k for k in range(P)]
        assert pd.peak_weight_versions == [P - k for k in range(P)]  # one version per in-flight micro-batch
        assert max(bw.peak_weight_versions) == 2  # double buffer
    assert simulate(build("1f1b", 4, 8)).peak_weight_versions == [1] * 4


def test_peak_memory_counts_stashes_replicas_and_activations():
    P, M = 4, 8
    wb = [100.0, 200.0, 300.0, 400.0]
    costs = lambda s: StageCosts(fwd_s=[1.0] * s.n_stages, bwd_s=[2.0] * s.n_stages,
                                 act_bytes=[10.0] * s.n_stages, weight_bytes=wb, state_bytes=[1.0] * s.n_stages)
    f = simulate(build("1f1b", P, M), costs(build("1f1b", P, M)))
    assert f.peak_memory_bytes == [wb[r] + 1 + 10 * (P - r) for r in range(P)]
    pd = build("pipedream", P, M)
    r = simulate(pd, costs(pd))
    # the runtime's copies: P - k snapshots (one per in-flight micro-batch, each overtaken by an
    # update) plus the live weights; the last rank updates between F and B, so it never stashes
    copies = [P - k + 1 for k in range(P - 1)] + [1]
    assert r.peak_weight_versions == [P - k for k in range(P)]
    assert r.peak_memory_bytes == [wb[k] * copies[k] + 1 + 10 * (P - k) for k in range(P)]
    ch = build("chimera", P, M)
    r = simulate(ch, costs(ch))
    for k in range(P):  # two stage replicas per rank: stage k (down) and P−1−k (up)
        static = wb[k] + wb[P - 1 - k] + 2
        assert static + 10 * (P // 2 + 1) <= r.peak_memory_bytes[k] <= static + 10 * r.peak_inflight[k]


def test_communication_adds_latency_and_serialises_on_the_link():
    s = build("gpipe", 2, 1)
    c = StageCosts(fwd_s=[1.0, 1.0], bwd_s=[2.0, 2.0], boundary_bytes=[8.0, 8.0])
    r = simulate(s, c, Link(bandwidth_Bps=4.0, latency_s=0.5))
    assert r.step_time_s == pytest.approx(1 + (0.5 + 2) + 1 + 2 + (0.5 + 2) + 2)
    # four sends of 2 s each on one link, posted at t = 1, 2, 3, 4: they queue
    s = build("gpipe", 2, 4)
    c = StageCosts(fwd_s=[1.0, 1.0], bwd_s=[2.0, 2.0], boundary_bytes=[8.0, 8.0])
    r = simulate(s, c, Link(bandwidth_Bps=4.0))
    starts = sorted(e.start_s for e in r.events if e.rank == 1 and e.kind == "F")
    assert starts == [3.0, 5.0, 7.0, 9.0]


def test_a_blocking_link_runs_each_receive_on_the_receivers_clock():
    """gloo on a CPU (``Link.blocking``): the bytes move once both sides posted, after the latency when the
    sender waits, and when it computes also after ``busy_latency_s`` or the end of its pass, whichever
    comes first; a send costs its rank ``send_s``."""
    s = build("gpipe", 2, 2)
    c = StageCosts(fwd_s=[1.0, 1.0], bwd_s=[2.0, 2.0], boundary_bytes=[2.0, 2.0])  # 0.5 s on the link
    r = simulate(s, c, Link(bandwidth_Bps=4.0, latency_s=0.5, blocking=True, busy_latency_s=0.75, send_s=0.25))
    at = {(e.rank, e.kind, e.mb): e.start_s for e in r.events}
    assert at[(0, "F", 1)] == 1.25  # F0, then its send's host time
    assert at[(1, "F", 0)] == pytest.approx(1.25 + 0.5 + 0.75 + 0.5)  # posted at 1.25; rank 0 then runs F1
    assert at[(1, "F", 1)] == pytest.approx(4.0 + 0.5 + 0.5)  # after F0; rank 0 waits in RECV_B0 by then
    posted = at[(1, "B", 0)] + 2.0 + 0.25  # B0, then its send
    assert at[(0, "B", 0)] == pytest.approx(posted + 0.5 + 0.75 + 0.5)  # rank 1 runs B1 (2 s) then
    slow = simulate(s, c, Link(bandwidth_Bps=4.0, latency_s=0.5, blocking=True, busy_latency_s=3.0, send_s=0.25))
    at = {(e.rank, e.kind, e.mb): e.start_s for e in slow.events}
    assert at[(1, "F", 0)] == pytest.approx(1.25 + 0.5 + 1.0 + 0.5)  # moved once rank 0's F1 (1 s) ends
    eager = simulate(s, c, Link(bandwidth_Bps=4.0, latency_s=0.5))
    assert eager.makespan_s < r.makespan_s < slow.makespan_s


def test_costs_shape_is_checked():
    from scaletrain.errors import UserError

    with pytest.raises(UserError, match="3 entries"):
        simulate(build("1f1b", 4, 4), StageCosts(fwd_s=[1.0] * 3, bwd_s=[2.0] * 3))


def test_timeline_png_from_simulated_and_measured_events(tmp_path):
    for name in ("gpipe", "zb1p", "chimera", "interleaved", "pipedream"):
        r = simulate(build(name, 4, 8, 2 if name == "interleaved" else 1))
        png = draw(r.events, tmp_path / f"{name}.png", title=name, time_unit="unit")
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    measured = [(0, "F", 0, 0.000, 0.010), (1, "F", 0, 0.011, 0.020), (1, "B", 0, 0.020, 0.041),
                (0, "RECV_B", 0, 0.010, 0.042), (0, "B", 0, 0.042, 0.060)]
    png = draw(measured, tmp_path / "measured.png")
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_cli_json_and_errors(capsys, tmp_path):
    assert main(["pipeline", "--schedule", "1f1b", "--ranks", "4", "--microbatches", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["bubble_fraction"] == pytest.approx(3 / 11) and out["peak_inflight"] == [4, 3, 2, 1]
    png = tmp_path / "t.png"
    assert main(["pipeline", "--schedule", "interleaved", "-P", "4", "-M", "8", "--virtual", "2",
                 "--png", str(png)]) == 0
    text = capsys.readouterr().out
    assert "bubble   0.1579" in text and png.exists()
    assert main(["pipeline", "--schedule", "chimera", "--ranks", "3", "--microbatches", "6"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "even number of ranks" in err
    assert main(["pipeline", "--schedule", "interleaved", "--ranks", "4", "--microbatches", "6"]) == 2
    assert "divisible" in capsys.readouterr().err


def test_peak_memory_counts_transients_gradients_and_held_sends():
    # 1F1B, P = 2, M = 4. Rank 0 holds 2 activation sets before its first backward; rank 1 (last
    # stage) one at a time, plus the input gradients it sent: gradient m is released once
    # activation m + 2 arrives (rank 0 sent m + 1 before receiving gradient m).
    s = build("1f1b", 2, 4)

    def costs(opt_temp: float) -> StageCosts:
        return StageCosts(fwd_s=[1.0] * 2, bwd_s=[2.0] * 2, act_bytes=[10.0] * 2, boundary_bytes=[4.0, 0.0],
                          bwd_temp_bytes=[0.0, 3.0], weight_bytes=[100.0] * 2, state_bytes=[1.0] * 2,
                          grad_bytes=[50.0] * 2, opt_temp_bytes=[opt_temp] * 2)

    # rank 0: weights + state + gradients (from its first backward on) + 2 sets, at F2
    # rank 1: weights + state + gradients + 1 held gradient send + 1 set + backward transient, at B1
    assert simulate(s, costs(7.0)).peak_memory_bytes == [100 + 1 + 50 + 2 * 10, 100 + 1 + 50 + 4 + 10 + 3]
    # a large optimizer transient makes the update the peak; rank 1 still holds its last 2 sends then
    assert simulate(s, costs(100.0)).peak_memory_bytes == [100 + 1 + 50 + 100, 100 + 1 + 50 + 2 * 4 + 100]
    # without grad_bytes, gradients are part of state_bytes and always counted
    c = costs(0.0)
    c.grad_bytes = None
    assert simulate(s, c).peak_memory_bytes == [100 + 1 + 2 * 10, 100 + 1 + 4 + 10 + 3]


def test_chimera_gradient_all_reduce_takes_its_given_time():
    # each rank all-reduces its two stage replicas' gradients with the other replica's holder,
    # one after the other, at the end of the step: both add to the step and count as idle
    s = build("chimera", 2, 2)
    base = simulate(s, StageCosts(fwd_s=[1.0] * 2, bwd_s=[2.0] * 2))
    slow = simulate(s, StageCosts(fwd_s=[1.0] * 2, bwd_s=[2.0] * 2, sync_s=[5.0, 5.0]))
    assert slow.step_time_s == base.step_time_s + 2 * 5.0
    assert slow.busy_s == base.busy_s


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved", "zb1p", "chimera"])
def test_per_pass_durations_replay_a_trace(name):
    """``durations`` overrides single passes: the mean of the per-pass times is not what a
    pipeline takes, the trace is (makespan of random durations >= makespan of their means)."""
    s = build(name, 2, 4, 2 if name == "interleaved" else 1)
    base = simulate(s)
    same = simulate(s, durations={(e.rank, e.kind, e.pipe, e.stage, e.mb): e.end_s - e.start_s
                                  for e in base.events})
    assert same.step_time_s == pytest.approx(base.step_time_s)
    # slow one forward on the critical path (stage 0, first micro-batch) by 3 units: everything
    # downstream waits, so the step grows by exactly that much for a fill-drain start
    slow = {(e.rank, e.kind, e.pipe, e.stage, e.mb): (e.end_s - e.start_s) + (3.0 if (e.kind, e.stage, e.mb, e.pipe)
            == ("F", 0, 0, 0) else 0.0) for e in base.events}
    r = simulate(s, durations=slow)
    assert base.step_time_s < r.step_time_s <= base.step_time_s + 3.0 + 1e-9
    if name in ("gpipe", "1f1b"):
        assert r.step_time_s == pytest.approx(base.step_time_s + 3.0)

"""Pipeline schedules as data: every schedule is dependency-consistent and deadlock-free,
the validator catches broken lists, and invalid shapes are refused with a UserError."""

from __future__ import annotations

import dataclasses

import pytest

from scaletrain.errors import UserError
from scaletrain.techniques.pipeline import (SCHEDULES, Action, DeadlockError, ScheduleError, build,
                                            rendezvous_safe, simulate, validate)
from scaletrain.techniques.pipeline.schedules import (B, F, GRAD_SYNC, I, OPT, RECV_B, RECV_F, SEND_B, SEND_F, W,
                                                      Schedule)

SHAPES = [(1, 1), (1, 3), (2, 2), (2, 4), (3, 3), (3, 7), (4, 4), (4, 8), (4, 12), (8, 16)]


def _cases():
    for name in SCHEDULES:
        for P, M in SHAPES:
            for v in ((1, 2, 3) if name == "interleaved" else (1,)):
                if name == "interleaved" and M % P:
                    continue
                if name == "chimera" and (P % 2 or M % 2):
                    continue
                if name == "pipedream-2bw" and M < P:
                    continue
                yield name, P, M, v


CASES = list(_cases())


@pytest.mark.parametrize("name,P,M,v", CASES, ids=[f"{n}-P{p}-M{m}-v{v}" for n, p, m, v in CASES])
def test_every_schedule_is_valid_and_deadlock_free(name, P, M, v):
    s = build(name, P, M, v)
    validate(s)  # static rules + eager (isend) execution finishes
    validate(rendezvous_safe(s), p2p="rendezvous")  # reordered lists also finish with blocking sends


@pytest.mark.parametrize("name", SCHEDULES)
def test_each_pass_once_per_stage_and_microbatch(name):
    P, M = 4, 8
    s = build(name, P, M, 2 if name == "interleaved" else 1)
    counts: dict[tuple, int] = {}
    for acts in s.actions:
        for a in acts:
            if a.kind in (F, B, I, W):
                counts[(a.kind, a.pipe, a.stage, a.mb)] = counts.get((a.kind, a.pipe, a.stage, a.mb), 0) + 1
    kinds = (F, I, W) if s.split_backward else (F, B)
    expected = {(k, s.mb_pipe[m], st, m) for k in kinds for st in range(s.n_stages)
                for m in range(s.total_microbatches)}
    assert set(counts) == expected and set(counts.values()) == {1}


def test_1f1b_warmup_is_P_minus_1_minus_rank():
    P, M = 4, 8
    s = build("1f1b", P, M)
    for r, acts in enumerate(s.actions):
        compute = [a.kind for a in acts if a.kind in (F, B)]
        assert compute.index(B) == P - 1 - r + 1  # warm-up forwards, then the first F of the steady state
        # strictly alternating F, B in the steady state
        steady = compute[P - 1 - r: P - 1 - r + 2 * (M - (P - 1 - r))]
        assert steady == [F, B] * (M - (P - 1 - r))


def test_interleaved_places_chunks_round_robin():
    P, v = 4, 2
    s = build("interleaved", P, 8, v)
    assert s.n_stages == P * v
    for r, acts in enumerate(s.actions):
        assert {a.stage for a in acts if a.kind == F} == {r, r + P}
    # the wrap-around transfer from the last rank's chunk 0 to rank 0's chunk 1 exists
    assert any(a.kind == SEND_F and a.stage == P - 1 and a.peer == 0 for a in s.actions[P - 1])


def test_chimera_each_rank_holds_two_opposite_stages_and_syncs_them():
    P, M = 4, 8
    s = build("chimera", P, M)
    assert s.n_pipes == 2 and sorted(set(s.mb_pipe)) == [0, 1] and s.mb_pipe.count(0) == M // 2
    for r, acts in enumerate(s.actions):
        held = {(a.pipe, a.stage) for a in acts if a.kind == F}
        assert held == {(0, r), (1, P - 1 - r)}
        syncs = [a for a in acts if a.kind == GRAD_SYNC]
        assert [a.stage for a in syncs] == sorted({r, P - 1 - r})
        assert all(a.peer == P - 1 - r for a in syncs)
        assert [a.kind for a in acts[-4:]] == [GRAD_SYNC, GRAD_SYNC, OPT, OPT]


def test_zb1p_splits_backward_and_delays_w_by_rank():
    P, M = 4, 8
    s = build("zb1p", P, M)
    assert s.split_backward
    for r, acts in enumerate(s.actions):
        order = [(a.kind, a.mb) for a in acts if a.kind in (F, I, W)]
        first_w = order.index((W, 0))
        # before the first W, rank r has done exactly r + 1 input-gradient passes
        assert sum(k == I for k, _ in order[:first_w]) == r + 1


def test_async_schedules_update_per_microbatch_or_per_window():
    P, M = 4, 8
    pd, bw = build("pipedream", P, M), build("pipedream-2bw", P, M)
    assert pd.asynchronous and pd.n_steps == 4
    for r in range(P):
        pd_opt = [a.mb for a in pd.actions[r] if a.kind == OPT]
        bw_opt = [a.mb for a in bw.actions[r] if a.kind == OPT]
        assert pd_opt == list(range(pd.total_microbatches))  # PipeDream: a weight update per micro-batch
        assert bw_opt == list(range(M - 1, bw.total_microbatches, M))  # 2BW: one per M micro-batches
        # no flush: the forward of the next window starts before the current window's last update
        acts = pd.actions[r]
        first_f_next = next(i for i, a in enumerate(acts) if a.kind == F and a.mb == M)
        last_opt = next(i for i, a in enumerate(acts) if a.kind == OPT and a.mb == M - 1)
        assert (first_f_next < last_opt) == (r < P - 1)


@pytest.mark.parametrize("args,needle", [
    (("interleaved", 4, 6, 2), "divisible"),
    (("chimera", 3, 6), "even"),
    (("chimera", 4, 5), "even"),
    (("pipedream-2bw", 4, 2), ">= --ranks"),
    (("1f1b", 4, 8, 2), "only applies to the interleaved"),
    (("nope", 4, 8), "allowed: gpipe"),
    (("gpipe", 0, 8), "positive"),
    (("gpipe", 2, 0), "positive"),
])
def test_invalid_combinations_raise_user_error(args, needle):
    with pytest.raises(UserError, match=needle):
        build(*args)


def _mutate(s: Schedule, rank: int, actions: list[Action]) -> Schedule:
    acts = [list(a) for a in s.actions]
    acts[rank] = actions
    return dataclasses.replace(s, actions=acts)


def test_validator_rejects_missing_pass():
    s = build("1f1b", 2, 4)
    broken = _mutate(s, 1, [a for a in s.actions[1] if not (a.kind == B and a.mb == 2)])
    with pytest.raises(ScheduleError, match="missing"):
        validate(broken)


def test_validator_rejects_use_before_receive():
    s = build("gpipe", 2, 2)
    acts = list(s.actions[1])
    i, j = acts.index(Action(RECV_F, 1, 0, 0)), acts.index(Action(F, 1, 0))
    acts[i], acts[j] = acts[j], acts[i]
    with pytest.raises(ScheduleError, match="receive before use"):
        validate(_mutate(s, 1, acts))


def test_validator_rejects_wrong_peer():
    s = build("gpipe", 3, 2)
    acts = [dataclasses.replace(a, peer=2) if a.kind == SEND_F and a.mb == 1 else a for a in s.actions[0]]
    with pytest.raises(ScheduleError, match="wrong peers"):
        validate(_mutate(s, 0, acts))


def test_validator_rejects_backward_before_forward_on_same_rank():
    s = build("gpipe", 1, 2)  # one rank: stages are local, no transfers
    acts = [Action(B, 0, 0), Action(F, 0, 0), Action(F, 0, 1), Action(B, 0, 1), Action(OPT, 0, 1)]
    with pytest.raises(ScheduleError, match="forward before backward"):
        validate(_mutate(s, 0, acts))


def test_validator_finds_deadlock_by_simulation():
    # rank 0 waits for B0 before sending F1; rank 1 waits for F1 before sending B0: a cycle of receives
    s = build("1f1b", 2, 2)
    r0 = [Action(F, 0, 0), Action(SEND_F, 0, 0, 1), Action(F, 0, 1), Action(RECV_B, 0, 0, 1),
          Action(SEND_F, 0, 1, 1), Action(B, 0, 0), Action(RECV_B, 0, 1, 1), Action(B, 0, 1), Action(OPT, 0, 1)]
    r1 = [Action(RECV_F, 1, 0, 0), Action(F, 1, 0), Action(RECV_F, 1, 1, 0), Action(F, 1, 1), Action(B, 1, 0),
          Action(SEND_B, 1, 0, 0), Action(B, 1, 1), Action(SEND_B, 1, 1, 0), Action(OPT, 1, 1)]
    broken = dataclasses.replace(s, actions=[r0, r1])
    with pytest.raises(ScheduleError, match="deadlocks"):
        validate(broken)


def test_validator_rejects_unpaired_gradient_sync():
    s = build("chimera", 4, 4)
    acts = [dataclasses.replace(a, peer=2) if a.kind == GRAD_SYNC else a for a in s.actions[0]]
    with pytest.raises(ScheduleError, match="no matching gradient sync"):
        validate(_mutate(s, 0, acts))


def test_validator_rejects_update_before_window_is_complete():
    s = build("1f1b", 2, 4)
    acts = [a for a in s.actions[0] if a.kind != OPT]
    acts.insert(3, Action(OPT, 0, 3))
    with pytest.raises(ScheduleError, match="misses backward"):
        validate(_mutate(s, 0, acts))


def test_blocking_sends_deadlock_1f1b_unless_reordered():
    """Documented behaviour: the eager lists need isend; rendezvous_safe makes blocking sends work."""
    s = build("1f1b", 2, 4)
    with pytest.raises(DeadlockError):
        simulate(s, p2p="rendezvous")
    simulate(build("gpipe", 4, 8), p2p="rendezvous")  # fill-drain is safe as built
    safe = rendezvous_safe(s)
    assert simulate(safe, p2p="rendezvous").step_time_s == simulate(s).step_time_s

"""Checking pipeline schedules: :func:`validate` and :func:`rendezvous_safe`.

See the execution model in :mod:`.schedules`: sends are posted without blocking, receives
block. :func:`validate` proves a schedule computes every pass once, respects every data
dependency and finishes under that model (or under blocking sends with ``p2p="rendezvous"``);
:func:`rendezvous_safe` reorders transfers so that blocking sends also finish.
"""

from __future__ import annotations

import dataclasses

from .actions import (B, COMM_KINDS, COMPUTE_KINDS, F, GRAD_SYNC, I, OPT, RECV_B, RECV_F, SEND_B, SEND_F, W, Action,
                      Schedule, send_releases)  # noqa: F401 (send_releases re-exported)
from .simulate import DeadlockError, simulate


class ScheduleError(ValueError):
    """A schedule breaks a dependency, placement or matching rule, or deadlocks."""


def validate(schedule: Schedule, p2p: str = "eager") -> None:
    """Check that ``schedule`` is executable and computes every pass exactly once.

    Static rules: every action sits on the rank holding its stage replica; each
    (pipe, stage, micro-batch) has exactly one F and one B (or one I and one W when split);
    F of stage s+1 comes after F of stage s (backward reversed) — on one rank by list order,
    across ranks through a RECV placed before the pass and a SEND after the producing pass,
    each SEND matched by exactly one RECV on its peer; each OPT follows all backward pieces of
    its accumulation window and precedes later ones. Dynamic rule: the lists, executed in order
    with unit costs under ``p2p`` semantics (see module doc), finish — simulated to prove
    there is no deadlock. Raises :class:`ScheduleError`.
    """

    S, P = schedule.n_stages, schedule.n_ranks
    total = schedule.total_microbatches
    every = schedule.update_every or schedule.n_microbatches
    pieces = (I, W) if schedule.split_backward else (B,)
    pos: dict[tuple, tuple[int, int]] = {}  # (kind, pipe, stage, mb) -> (rank, index in its list)

    def err(msg: str) -> None:
        raise ScheduleError(f"{schedule.name} (P={P}, M={schedule.n_microbatches}): {msg}")

    for r, acts in enumerate(schedule.actions):
        for i, a in enumerate(acts):
            if schedule.rank_of(a.stage, a.pipe) != r:
                err(f"{a} listed on rank {r} but stage {a.stage} (pipe {a.pipe}) lives on rank "
                    f"{schedule.rank_of(a.stage, a.pipe)}")
            if not 0 <= a.mb < total or (a.kind not in (OPT, GRAD_SYNC) and schedule.mb_pipe[a.mb] != a.pipe):
                err(f"{a} on rank {r}: micro-batch out of range or on the wrong pipe")
            key = (a.kind, a.pipe, a.stage, a.mb)
            if key in pos:
                err(f"{a} appears twice")
            pos[key] = (r, i)
    expected = (F,) + pieces
    for m in range(total):
        p = schedule.mb_pipe[m]
        for s in range(S):
            for kind in (F, B, I, W):
                there = (kind, p, s, m) in pos
                if there != (kind in expected):
                    err(f"{kind} of micro-batch {m} at stage {s} is {'unexpected' if there else 'missing'}")

    def before(a: tuple, b: tuple, why: str) -> None:
        (ra, ia), (rb, ib) = pos[a], pos[b]
        if ra != rb or ia >= ib:
            err(f"{a[0]}{a[3]}@s{a[2]} must precede {b[0]}{b[3]}@s{b[2]} on rank {rb} ({why})")

    def need(kind: str, p: int, s: int, m: int, src_stage: int, src_kind: str, recv: str, send: str) -> None:
        me, src = schedule.rank_of(s, p), schedule.rank_of(src_stage, p)
        if me == src:
            before((src_kind, p, src_stage, m), (kind, p, s, m), "same-rank dependency")
            return
        if (recv, p, s, m) not in pos or (send, p, src_stage, m) not in pos:
            err(f"{kind}{m}@s{s} needs {recv} from rank {src} matched by {send} there")
        before((recv, p, s, m), (kind, p, s, m), "receive before use")
        before((src_kind, p, src_stage, m), (send, p, src_stage, m), "send after produce")
        ra, ia = pos[(recv, p, s, m)]
        rs, is_ = pos[(send, p, src_stage, m)]
        if schedule.actions[ra][ia].peer != rs or schedule.actions[rs][is_].peer != ra:
            err(f"{send}/{recv} of micro-batch {m} between stages {src_stage}/{s} name the wrong peers")

    first_bwd = pieces[0]
    for m in range(total):
        p = schedule.mb_pipe[m]
        for s in range(S):
            before((F, p, s, m), (first_bwd, p, s, m), "forward before backward")
            if schedule.split_backward:
                before((I, p, s, m), (W, p, s, m), "input-grad before weight-grad")
            if s > 0:
                need(F, p, s, m, s - 1, F, RECV_F, SEND_F)
            if s < S - 1:
                need(first_bwd, p, s, m, s + 1, first_bwd, RECV_B, SEND_B)
    n_comm = sum(a.kind in COMM_KINDS for acts in schedule.actions for a in acts)
    n_needed = sum(1 for m in range(total) for s in range(S - 1)
                   if schedule.rank_of(s, schedule.mb_pipe[m]) != schedule.rank_of(s + 1, schedule.mb_pipe[m])) * 4
    if n_comm != n_needed:
        err(f"{n_comm} send/receive actions where {n_needed} are needed (unmatched or spurious transfers)")

    for r, acts in enumerate(schedule.actions):
        for p, s in schedule.local_stages(r):
            opts = [i for i, a in enumerate(acts) if a.kind == OPT and a.stage == s and a.pipe == p]
            mine = [m for m in range(total) if schedule.mb_pipe[m] == p]
            ends = [m for m in range(every - 1, total, every)]
            if [acts[i].mb for i in opts] != ends:
                err(f"rank {r} stage {s}: optimizer steps after micro-batches {[acts[i].mb for i in opts]}, "
                    f"expected {ends}")
            for i in opts:
                hi = acts[i].mb
                for m in mine:
                    _, j = pos[(pieces[-1], p, s, m)]
                    if m <= hi and j > i:
                        err(f"rank {r} stage {s}: update after micro-batch {hi} misses backward of {m}")
                    if m > hi and j < i:
                        err(f"rank {r} stage {s}: backward of {m} precedes the update closing {hi}")
                    if not schedule.asynchronous and m > hi and pos[(F, p, s, m)][1] < i:
                        err(f"rank {r} stage {s}: forward of {m} precedes the flush at {hi}")
    for r, acts in enumerate(schedule.actions):  # Chimera: both replicas of a stage sync together
        for a in acts:
            if a.kind == GRAD_SYNC:
                other = pos.get((GRAD_SYNC, 1 - a.pipe, a.stage, a.mb))
                if other is None or other[0] != a.peer or schedule.actions[other[0]][other[1]].peer != r:
                    err(f"{a} on rank {r} has no matching gradient sync on rank {a.peer}")
    try:
        simulate(schedule, p2p=p2p)
    except DeadlockError as e:
        err(str(e))


def rendezvous_safe(schedule: Schedule) -> Schedule:
    """A copy of ``schedule`` whose lists also finish when sends block until received
    (``torch.distributed.send``), not only with ``isend``.

    Blocking sends deadlock the 1F1B family when two neighbours both send first (rank r sends
    F to r+1 while r+1 sends B to r). Rendezvous execution is deterministic, so it is run
    without timing; whenever every rank is stuck, one blocked send has its matching receive
    moved up to the peer's current position (the peer receives first, as in the even/odd
    pairing of classic pipelines) — preferably a receive in the peer's current run of
    transfers, so no compute is reordered, else the nearest one. A receive may move earlier
    without breaking a data dependency, and since the sender is already waiting the peer's
    new receive is satisfiable, so the result stays eager-safe (checked by :func:`validate`).
    Under eager timing it can be slower when transfers take time (a receive now waits where
    the peer used to post its own send first) — use it only for blocking-send runtimes.
    Raises :class:`ScheduleError` when no such repair unblocks the lists.
    """
    acts = [list(a) for a in schedule.actions]
    P = schedule.n_ranks
    ptr = [0] * P

    def matches(send: Action, recv: Action) -> bool:
        if recv.peer is None or recv.kind != {SEND_F: RECV_F, SEND_B: RECV_B}[send.kind]:
            return False
        return (recv.mb, recv.pipe, recv.stage) == (send.mb, send.pipe, send.stage + (1 if send.kind == SEND_F else -1))

    def at(r: int) -> Action | None:
        return acts[r][ptr[r]] if ptr[r] < len(acts[r]) else None

    while True:
        progressed = False
        for r in range(P):
            while (a := at(r)) is not None:
                if a.kind in COMPUTE_KINDS or a.kind == OPT:
                    ptr[r] += 1
                elif a.kind in (SEND_F, SEND_B) and (b := at(a.peer)) is not None and matches(a, b):
                    ptr[r] += 1
                    ptr[a.peer] += 1
                elif a.kind == GRAD_SYNC and (b := at(a.peer)) is not None and b.kind == GRAD_SYNC \
                        and b.stage == a.stage:
                    ptr[r] += 1
                    ptr[a.peer] += 1
                else:
                    break
                progressed = True
        if all(at(r) is None for r in range(P)):
            break
        if progressed:
            continue
        # repair one blocked send: prefer a receive in the peer's current run of transfers
        # (no compute moves), else the nearest one further on
        best = None
        for r in range(P):
            a = at(r)
            if a is None or a.kind not in (SEND_F, SEND_B):
                continue
            q, j, crossed = a.peer, ptr[a.peer], 0
            while j < len(acts[q]) and not matches(a, acts[q][j]):
                crossed += acts[q][j].kind not in COMM_KINDS
                j += 1
            if j < len(acts[q]) and (best is None or (crossed, j - ptr[q]) < best[0]):
                best = ((crossed, j - ptr[q]), q, j)
        if best is None:
            stuck = "; ".join(f"rank {r} at {at(r)}" for r in range(P) if at(r) is not None)
            raise ScheduleError(f"{schedule.name}: cannot order transfers for blocking sends ({stuck})")
        _, q, j = best
        acts[q].insert(ptr[q], acts[q].pop(j))
    return dataclasses.replace(schedule, actions=acts)

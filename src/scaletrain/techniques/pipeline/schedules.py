"""Pipeline schedules as data: one ordered list of :class:`Action` per rank.

A schedule says *what* each rank does and in which order; the simulator
(:mod:`.simulate`) says *when*, and the runtime executes the same lists with
``torch.distributed`` point-to-point. Nothing here depends on costs, except the two
schedules whose published construction is a slot-time layout (``zb1p``, ``chimera``):
their per-rank order is fixed once from the paper's unit-slot picture and then executed
as an order, whatever the real costs.

Execution model (what "no deadlock" means, checked by :func:`validate`):

* a rank executes its list strictly in order;
* ``SEND_F``/``SEND_B`` post a non-blocking send (``torch.distributed.isend``) and go on;
  the runtime waits for all outstanding send handles before the step ends;
* ``RECV_F``/``RECV_B`` block until the matching tensor has arrived;
* ``GRAD_SYNC`` (Chimera only) is a blocking all-reduce between the two ranks holding the
  two replicas of one stage; both ranks list their syncs in ascending stage order.

The simulator can also run the stricter *rendezvous* model (a send blocks until the peer
posts the receive, like ``torch.distributed.send``); ``gpipe`` is safe under it, the 1F1B
family is not (rank r sends F to r+1 while r+1 sends B to r), which is why the runtime
posts sends with ``isend`` as Megatron does with ``batch_isend_irecv`` — or runs the lists
reordered by :func:`.checks.rendezvous_safe`, which finish under blocking sends too.

Stage numbering: stages 0..S-1 of one model replica. For all schedules but Chimera there is
one pipeline (``pipe`` 0) and stage s lives on rank ``s % P`` (S = P·v for ``interleaved``).
Chimera (Li & Hoefler, SC21) has two pipelines: ``pipe`` 0 ("down") puts stage s on rank s,
``pipe`` 1 ("up") on rank P-1-s, so each rank holds two stage replicas.
"""

from __future__ import annotations

from scaletrain.errors import UserError

# the vocabulary lives in .actions and validation in .checks; both re-exported for callers of schedules
from .actions import (ASYNC_SCHEDULES, B, BACKWARD_KINDS, COMM_KINDS, COMPUTE_KINDS, F, GRAD_SYNC, I,  # noqa: F401
                      OPT, RECV_B, RECV_F, SCHEDULES, SEND_B, SEND_F, W, Action, Schedule, message_key, overtaken,
                      send_releases)
from .checks import ScheduleError, rendezvous_safe, validate  # noqa: F401

# --------------------------------------------------------------------------- compute orders
# Each order function returns, per rank, a list of compute actions (kind, pipe, stage, mb)
# for ONE step of M micro-batches numbered 0..M-1; OPT and communication are added later.

def _order_gpipe(P: int, M: int) -> list[list[tuple]]:
    """Fill-drain (Huang et al. 2019): all forwards, then all backwards."""
    return [[(F, 0, r, m) for m in range(M)] + [(B, 0, r, m) for m in range(M)] for r in range(P)]


def _order_1f1b(P: int, M: int) -> list[list[tuple]]:
    """PipeDream-flush / DAPPLE: P-1-r warm-up forwards, then alternate F and B, then drain."""
    orders = []
    for r in range(P):
        w = min(P - 1 - r, M)
        o = [(F, 0, r, m) for m in range(w)]
        for i in range(M - w):
            o += [(F, 0, r, w + i), (B, 0, r, i)]
        o += [(B, 0, r, m) for m in range(M - w, M)]
        orders.append(o)
    return orders


def _order_interleaved(P: int, M: int, v: int) -> list[list[tuple]]:
    """Megatron interleaved 1F1B (Narayanan et al. SC21 §2.2), v model chunks per rank.

    Micro-batches go through the chunks in groups of P: the k-th forward on a rank is chunk
    (k // P) % v of micro-batch (k // (P·v))·P + k % P; backwards visit chunks in reverse.
    Warm-up: 2(P-1-r) + (v-1)·P forwards, as in Megatron's forward_backward_pipelining_with_interleaving.
    """
    total = M * v

    def fwd(k: int, r: int) -> tuple:
        c = (k // P) % v
        return (F, 0, c * P + r, (k // (P * v)) * P + k % P)

    def bwd(k: int, r: int) -> tuple:
        c = v - 1 - (k // P) % v
        return (B, 0, c * P + r, (k // (P * v)) * P + k % P)

    orders = []
    for r in range(P):
        w = min(2 * (P - 1 - r) + (v - 1) * P, total)
        o = [fwd(k, r) for k in range(w)]
        for i in range(total - w):
            o += [fwd(w + i, r), bwd(i, r)]
        o += [bwd(k, r) for k in range(total - w, total)]
        orders.append(o)
    return orders


def _order_zb1p(P: int, M: int) -> list[list[tuple]]:
    """ZB-H1 (Qi et al. 2024 §2.1): 1F1B's order of F and I (input-grad), W delayed.

    Rank r keeps 1F1B's P-1-r warm-up forwards and F/I alternation, but postpones its W
    (weight-grad) passes by r micro-batches, so every rank holds at most P micro-batches
    between F and W — rank 0's 1F1B figure — and the postponed W fill the drain bubble.
    In the drain each I is followed by one W, then the remaining W close the step.
    """
    orders = []
    for r in range(P):
        w = min(P - 1 - r, M)
        o = [(F, 0, r, m) for m in range(w)]
        next_w = 0
        for i in range(M - w):
            o += [(F, 0, r, w + i), (I, 0, r, i)]
            if i >= r:  # W of micro-batch i - r: in-flight stays at P
                o.append((W, 0, r, next_w))
                next_w += 1
        for m in range(M - w, M):
            o.append((I, 0, r, m))
            if next_w <= m:  # a pending W fills the wait for the next input gradient
                o.append((W, 0, r, next_w))
                next_w += 1
        o += [(W, 0, r, m) for m in range(next_w, M)]
        orders.append(o)
    return orders


def _chimera_units(P: int, M: int) -> list[tuple[int, int]]:
    """Chimera basic units: (first micro-batch, micro-batches per direction) each.

    A basic unit has P micro-batches, the first P/2 on the down pipeline, the next P/2 on the
    up pipeline (Li & Hoefler SC21); a last partial unit splits the remaining M mod P evenly.
    """
    units, base = [], 0
    while base < M:
        n = min(P // 2, (M - base) // 2)
        units.append((base, n))
        base += 2 * n
    return units


def _order_chimera(P: int, M: int) -> tuple[list[list[tuple]], list[int]]:
    """Chimera's per-rank order from its unit-slot layout (F and B one slot each).

    In a basic unit each pipeline runs 1F1B on its P/2 micro-batches; micro-batch j of a
    pipeline does its forward of stage s in slot s + 2j and its backward in slot
    P + 2j + (P-1-s). With P even, the two pipelines' passes on one rank always differ in
    slot parity or index range, so they merge without conflict (the paper's claim, checked
    by construction here and by the validator). Units are concatenated directly, unit u
    shifted by 2P·u slots (its compute per rank), which fills the previous unit's tail with
    the next unit's forwards when F = B (the paper's "direct concatenation"; its forward
    doubling / backward halving for B > F change micro-batch sizes and are not done here).
    """
    slots: list[list[tuple[int, tuple]]] = [[] for _ in range(P)]
    mb_pipe = [0] * M
    for u, (base, n) in enumerate(_chimera_units(P, M)):
        off = 2 * P * u
        for pipe in (0, 1):
            for j in range(n):
                m = base + pipe * n + j
                mb_pipe[m] = pipe
                for s in range(P):
                    r = s if pipe == 0 else P - 1 - s
                    slots[r].append((off + s + 2 * j, (F, pipe, s, m)))
                    slots[r].append((off + P + 2 * j + (P - 1 - s), (B, pipe, s, m)))
    orders = []
    for r in range(P):
        taken = [t for t, _ in slots[r]]
        assert len(set(taken)) == len(taken), "chimera slot conflict"  # guaranteed for even P
        orders.append([a for _, a in sorted(slots[r])])
    return orders, mb_pipe


def _order_async(P: int, total: int) -> list[list[tuple]]:
    """PipeDream's 1F1B without flush over a stream of ``total`` micro-batches."""
    return _order_1f1b(P, total)


# --------------------------------------------------------------------------- assembly
def _check(name: str, P: int, M: int, v: int, steps: int) -> None:
    if name not in SCHEDULES:
        raise UserError(f"unknown pipeline schedule {name!r}; allowed: {', '.join(SCHEDULES)}")
    for label, val in (("ranks", P), ("microbatches", M), ("virtual", v), ("steps", steps)):
        if not isinstance(val, int) or val < 1:
            raise UserError(f"--{label} must be a positive integer (got {val!r})")
    if v != 1 and name != "interleaved":
        raise UserError(f"--virtual {v} only applies to the interleaved schedule (got schedule {name!r}); "
                        "use --virtual 1")
    if name == "interleaved" and M % P:
        raise UserError(f"interleaved needs --microbatches divisible by --ranks (got M={M}, P={P})")
    if name == "chimera" and (P % 2 or M % 2):
        raise UserError(f"chimera needs an even number of ranks and of micro-batches (got P={P}, M={M})")
    if name == "pipedream-2bw" and M < P:
        raise UserError(f"pipedream-2bw needs --microbatches >= --ranks so two weight versions suffice "
                        f"(got M={M}, P={P})")


def build(name: str, n_ranks: int, n_microbatches: int, virtual: int = 1, steps: int | None = None) -> Schedule:
    """Build schedule ``name`` for P ranks and M micro-batches per step.

    ``steps`` optimizer steps are laid out back to back (default 1; 4 for the asynchronous
    schedules, whose steady state the simulator measures between windows 1 and steps-1).
    Raises :class:`UserError` naming the violated constraint for an invalid combination.
    """
    asynchronous = name in ASYNC_SCHEDULES
    steps = steps if steps is not None else (4 if asynchronous else 1)
    _check(name, n_ranks, n_microbatches, virtual, steps)
    P, M = n_ranks, n_microbatches
    n_stages = P * virtual
    n_pipes = 2 if name == "chimera" else 1
    one_pipe = [0] * M

    if asynchronous:
        total = M * steps
        orders = _order_async(P, total)
        every = 1 if name == "pipedream" else M  # PipeDream updates per micro-batch; 2BW per M
        actions = []
        for r in range(P):
            seq = []
            for a in orders[r]:
                seq.append(a)
                if a[0] == B and (a[3] + 1) % every == 0:
                    seq.append((OPT, 0, r, a[3]))
            actions.append(seq)
        sched = Schedule(name, P, M, n_stages, [], virtual=virtual, n_steps=steps, asynchronous=True,
                         mb_pipe=one_pipe * steps, update_every=every)
        sched.actions = _with_comm(sched, actions)
        return sched

    if name == "gpipe":
        one, mb_pipe = _order_gpipe(P, M), one_pipe
    elif name == "1f1b":
        one, mb_pipe = _order_1f1b(P, M), one_pipe
    elif name == "interleaved":
        one, mb_pipe = _order_interleaved(P, M, virtual), one_pipe
    elif name == "zb1p":
        one, mb_pipe = _order_zb1p(P, M), one_pipe
    else:  # chimera
        one, mb_pipe = _order_chimera(P, M)
    sched = Schedule(name, P, M, n_stages, [], virtual=virtual, n_steps=steps, split_backward=name == "zb1p",
                     n_pipes=n_pipes, mb_pipe=mb_pipe * steps, update_every=M)
    actions: list[list[tuple]] = [[] for _ in range(P)]
    for k in range(steps):
        last = k * M + M - 1
        for r in range(P):
            actions[r] += [(kind, p, s, m + k * M) for kind, p, s, m in one[r]]
            local = sched.local_stages(r)
            if n_pipes == 2:  # all-reduce the two replicas' gradients, ascending stage order
                for p, s in sorted(local, key=lambda ps: ps[1]):
                    actions[r].append((GRAD_SYNC, p, s, last))
            actions[r] += [(OPT, p, s, last) for p, s in local]
    sched.actions = _with_comm(sched, actions)
    return sched


def _with_comm(sched: Schedule, orders: list[list[tuple]]) -> list[list[Action]]:
    """Turn compute orders into Actions, adding a RECV right before each pass whose input
    lives on another rank and a SEND right after each pass whose output does."""
    S = sched.n_stages
    out: list[list[Action]] = []
    for r, order in enumerate(orders):
        acts: list[Action] = []
        for kind, pipe, s, m in order:
            if kind == GRAD_SYNC:
                other = sched.rank_of(s, 1 - pipe)
                acts.append(Action(GRAD_SYNC, s, m, other, pipe))
                continue
            if kind == OPT:
                acts.append(Action(OPT, s, m, None, pipe))
                continue
            prev_r = sched.rank_of(s - 1, pipe) if s > 0 else None
            next_r = sched.rank_of(s + 1, pipe) if s < S - 1 else None
            if kind == F and prev_r is not None and prev_r != r:
                acts.append(Action(RECV_F, s, m, prev_r, pipe))
            if kind in BACKWARD_KINDS and next_r is not None and next_r != r:
                acts.append(Action(RECV_B, s, m, next_r, pipe))
            acts.append(Action(kind, s, m, None, pipe))
            if kind == F and next_r is not None and next_r != r:
                acts.append(Action(SEND_F, s, m, next_r, pipe))
            if kind in BACKWARD_KINDS and prev_r is not None and prev_r != r:
                acts.append(Action(SEND_B, s, m, prev_r, pipe))
        out.append(acts)
    return out


"""Pipeline actions and the analyses of action lists that every other pipeline module shares.

The vocabulary of a schedule (:class:`Action` kinds, :class:`Schedule`) and three read-only
analyses of the lists — which send feeds which receive (:func:`message_key`), which
micro-batches an update overtakes (:func:`overtaken`, weight stashing) and when a sent tensor
may be dropped (:func:`send_releases`). They sit below the builders (:mod:`.schedules`), the
checks (:mod:`.checks`), the simulator (:mod:`.simulate`) and the runtime, so none of those
needs another to read a list.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scaletrain.schema import ASYNC_SCHEDULES, SCHEDULES  # noqa: F401  (the names of parallel.schedule, declared once)

# Action kinds. Compute: F (forward), B (full backward), I (input-gradient part of a split
# backward), W (weight-gradient part). Communication: SEND_*/RECV_* carry a peer rank.
F, B, I, W = "F", "B", "I", "W"
SEND_F, RECV_F, SEND_B, RECV_B = "SEND_F", "RECV_F", "SEND_B", "RECV_B"
OPT, GRAD_SYNC = "OPT", "GRAD_SYNC"
COMPUTE_KINDS = (F, B, I, W)
COMM_KINDS = (SEND_F, RECV_F, SEND_B, RECV_B)
BACKWARD_KINDS = (B, I)  # kinds that produce the gradient sent to the previous stage



@dataclass(frozen=True)
class Action:
    """One thing a rank does.

    ``stage`` is the stage executing (for a send: the sender's stage; for a receive: the
    receiver's stage). ``mb`` is the micro-batch index counted over the whole list
    (step k owns micro-batches k·M .. k·M+M-1); for ``OPT`` it is the last micro-batch of
    the gradient-accumulation window the update closes. ``peer`` is the other rank of a
    send/receive/sync. ``pipe`` selects the stage replica (Chimera: 0 down, 1 up).
    """

    kind: str
    stage: int
    mb: int
    peer: int | None = None
    pipe: int = 0

    def __str__(self) -> str:  # compact, for debugging and error messages
        p = f"→{self.peer}" if self.kind.startswith("SEND") else (f"←{self.peer}" if self.peer is not None else "")
        return f"{self.kind}{self.mb}@s{self.stage}{'u' if self.pipe else ''}{p}"


@dataclass
class Schedule:
    """Per-rank action lists plus the shape they were built for."""

    name: str
    n_ranks: int
    n_microbatches: int
    """Micro-batches per optimizer step (M)."""
    n_stages: int
    """Stages of one model replica (P, or P·v for interleaved)."""
    actions: list[list[Action]]
    virtual: int = 1
    n_steps: int = 1
    """Optimizer steps (windows of M micro-batches) covered by the lists."""
    split_backward: bool = False
    asynchronous: bool = False
    n_pipes: int = 1
    mb_pipe: list[int] = field(default_factory=list)
    """Pipe (replica) of each micro-batch; all 0 except Chimera."""
    update_every: int = 0
    """Micro-batches per weight update (M; 1 for PipeDream). 0 means M."""

    def rank_of(self, stage: int, pipe: int = 0) -> int:
        if pipe == 1:
            return self.n_ranks - 1 - stage
        return stage % self.n_ranks

    def local_stages(self, rank: int) -> list[tuple[int, int]]:
        """(pipe, stage) pairs held by ``rank``, in ascending (pipe, stage) order."""
        return [(p, s) for p in range(self.n_pipes) for s in range(self.n_stages) if self.rank_of(s, p) == rank]

    @property
    def total_microbatches(self) -> int:
        return self.n_microbatches * self.n_steps

    def __str__(self) -> str:
        return "\n".join(f"rank {r}: " + " ".join(str(a) for a in acts) for r, acts in enumerate(self.actions))


def message_key(a: Action) -> tuple:
    """Key shared by a send and the receive it feeds."""
    if a.kind == SEND_F:
        return (F, a.pipe, a.stage + 1, a.mb)
    if a.kind == RECV_F:
        return (F, a.pipe, a.stage, a.mb)
    if a.kind == SEND_B:
        return (B, a.pipe, a.stage - 1, a.mb)
    return (B, a.pipe, a.stage, a.mb)  # RECV_B


def overtaken(acts: list[Action], pipe: int, stage: int) -> set[int]:
    """Micro-batches of (pipe, stage) with an optimizer update between their forward and their
    backward in one rank's list ``acts``: the ones whose forward weights must be stashed
    (the runtime's weight stashing and the simulator's memory model both use this)."""
    fwd_at: dict[int, int] = {}
    opts: list[int] = []
    out: set[int] = set()
    for i, a in enumerate(acts):
        if a.kind == OPT:
            opts.append(i)
        elif a.pipe == pipe and a.stage == stage and a.kind == F:
            fwd_at[a.mb] = i
        elif a.pipe == pipe and a.stage == stage and a.kind in (B, I) and opts and opts[-1] > fwd_at[a.mb]:
            out.add(a.mb)
    return out


def send_releases(schedule: Schedule) -> list[dict[int, list[int]]]:
    """When a rank may drop each tensor it sent: per rank, {index of a RECV: [indices of the
    SENDs known delivered once that receive completes]}.

    A posted send holds its tensor until the transfer completes, and gloo's ``isend`` reports
    completion only when waited on, so the runtime must decide when to wait. Waiting right away
    would turn eager sends into blocking ones; waiting at the step's end keeps every sent
    tensor of the step (of the whole stream, for the asynchronous schedules) alive. A send to
    peer q is delivered once q has received it; this rank learns that when it receives a
    message q sent *after* that receive (list order on q). The send is released right after
    the first such receive in this rank's list, where waiting on it cannot block. Sends with no
    such receive later in the list are released when the step drains. Only direct causality
    (a message back from the same peer) is used; it depends on the lists, not on timing.
    """
    recv_at: dict[tuple, int] = {}  # matching key -> index of the receive on its rank
    send_at: dict[tuple, int] = {}  # matching key -> index of the send on its rank
    for acts in schedule.actions:
        for i, a in enumerate(acts):
            if a.kind in (RECV_F, RECV_B):
                recv_at[message_key(a)] = i
            elif a.kind in (SEND_F, SEND_B):
                send_at[message_key(a)] = i
    out: list[dict[int, list[int]]] = []
    for acts in schedule.actions:
        # receives on this rank, in order: (index, peer, index of the matching send on the peer)
        recvs = [(i, a.peer, send_at[message_key(a)]) for i, a in enumerate(acts) if a.kind in (RECV_F, RECV_B)]
        rel: dict[int, list[int]] = {}
        for i, a in enumerate(acts):
            if a.kind not in (SEND_F, SEND_B):
                continue
            got = recv_at[message_key(a)]  # the peer's receive of this message
            for ri, q, sj in recvs:
                if ri > i and q == a.peer and sj > got:
                    rel.setdefault(ri, []).append(i)
                    break
        out.append(rel)
    return out

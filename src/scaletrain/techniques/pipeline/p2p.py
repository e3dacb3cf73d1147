"""Point-to-point transfers and small collectives for the pipeline runtime, with timeouts.

Why a layer of its own: every wait in a pipeline is a place where a stuck or crashed peer turns
into a silent hang (Megatron-LM #1027, DeepSpeed #5066). Here every wait carries the runtime's
timeout (seconds) and, when it expires or the peer vanishes, raises one line naming this rank,
the operation (kind, micro-batch, stage), the peer and the timeout — a
:class:`~scaletrain.techniques.data_parallel.CommFailure`, which the CLI prints on one line.

Matching. Sends are posted with ``isend`` and never block (the eager model of :mod:`.schedules`):
each is waited for (and its tensor dropped) once the rank knows it was delivered
(:func:`.actions.send_releases`), the rest when the step drains; a receive posts ``irecv`` and
waits. On gloo every message carries
a tag unique to (direction, pipe, stage, micro-batch), so messages between one pair of ranks are
matched by tag, whatever order the two ranks post them in (interleaved and Chimera send both
activations and gradients over one pair). NCCL ignores tags and matches by posting order, so
with NCCL the runtime runs the lists reordered by :func:`.checks.rendezvous_safe`, in which
every send meets its receive in the same order on both sides.

Process groups are cached by their ranks: creating one is a collective over the world (see
:func:`group`) and costs a TCP rendezvous among its members on gloo. The groups of the job's world
mesh (:mod:`scaletrain.techniques.world`: each stage's data-parallel, EP and TP groups, each replica's
pipeline) come from that mesh (:func:`world`); only groups a mesh cannot name (holders of a tied
weight, Chimera's stage pairs) are created here.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Sequence

import torch
import torch.distributed as dist

from scaletrain.techniques.data_parallel.launch import CommFailure

_GROUPS: dict[tuple, Any] = {}


def group(ranks: Sequence[int], timeout_s: float) -> Any:
    """The process group of ``ranks`` (global ranks, any order), created once per process.

    Collective over the *whole world*: every process must call this for the same groups in the
    same order (non-members get ``GroupMember.NON_GROUP_MEMBER``). ``use_local_synchronization``
    would spare non-members, but torch names such groups by a hash that counts the groups each
    process already has, so members that created different groups before disagree and hang."""
    key = tuple(sorted(ranks))
    if len(key) == dist.get_world_size():
        return dist.group.WORLD
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(list(key), timeout=timedelta(seconds=timeout_s))
    return _GROUPS[key]


def world(*, pp: int, dp: int, tp: int = 1, ep: int = 1, device_type: str = "cpu") -> Any:
    """The world mesh of a pipeline (:mod:`scaletrain.techniques.world`, ``cp = 1``; EP is the inner
    data-parallel dimension), its groups added to this cache so that :func:`group` hands them out
    instead of creating them again. Collective over the world; every process passes the same sizes."""
    from scaletrain.techniques.world import Dims, all_groups, world_mesh

    dims = Dims.of(world=pp * dp * tp, pp=pp, tp=tp, inner=ep, what=f"parallel.ep={ep}")
    w = world_mesh(dims, device_type)
    _GROUPS.update(all_groups(w))
    return w


def forget_groups() -> None:
    """Drop cached groups (after ``destroy_process_group``, whose groups are dead)."""
    _GROUPS.clear()


def tag(direction: int, pipe: int, stage: int, mb: int, n_stages: int) -> int:
    """Unique gloo tag of the message feeding (pipe, stage, micro-batch); direction 0 = activation
    forward, 1 = gradient backward. Stays below 2**31 for any realistic stream."""
    return 1 + ((mb * n_stages + stage) * 2 + pipe) * 2 + direction


class Transport:
    """Sends, receives and collectives of one rank, each wait bounded by ``timeout_s``."""

    def __init__(self, rank: int, timeout_s: float, device: torch.device, use_tags: bool, label: str):
        self.rank = rank
        """This process's global rank (named in error messages)."""
        self.timeout = timedelta(seconds=timeout_s)
        self.timeout_s = timeout_s
        self.device = device
        self.use_tags = use_tags
        self.label = label
        """Prefix of error messages, e.g. "pipeline 1f1b"."""
        self._sends: dict[Any, tuple[Any, torch.Tensor, str, int]] = {}
        self.bytes_sent = 0

    # ------------------------------------------------------------------ errors
    def _fail(self, what: str, peer: int | None, exc: BaseException | None) -> CommFailure:
        first = "" if exc is None else str(exc).strip().splitlines()[0][:160]
        peer_txt = f" with rank {peer}" if peer is not None else ""
        cause = f" ({first})" if first else ""
        return CommFailure(
            f"rank {self.rank}: {self.label}: {what}{peer_txt} did not complete within {self.timeout_s:g} s — "
            f"the peer stopped, crashed or runs a different schedule/configuration{cause}")

    def wait(self, work: Any, what: str, peer: int | None) -> None:
        try:
            ok = work.wait(timeout=self.timeout)
        except Exception as e:  # noqa: BLE001 - gloo raises RuntimeError, NCCL DistBackendError
            raise self._fail(what, peer, e) from None
        if ok is False:
            raise self._fail(what, peer, None)

    # ------------------------------------------------------------------ point to point
    def send(self, t: torch.Tensor, peer: int, tag_: int, what: str, key: Any = None) -> None:
        """Post a non-blocking send of ``t``, kept alive until :meth:`release` of ``key`` (default:
        the tag) or :meth:`drain`. Gloo's ``isend`` work reports completion only once waited on,
        so polling cannot free finished sends: the caller says when a send is surely delivered
        (:func:`.actions.send_releases`)."""
        t = t.detach().contiguous()
        self._sends[tag_ if key is None else key] = (dist.isend(t, peer, tag=tag_ if self.use_tags else 0), t, what,
                                                     peer)
        self.bytes_sent += t.numel() * t.element_size()

    def release(self, keys: Sequence[Any]) -> None:
        """Wait for (delivered) sends ``keys`` and drop their tensors."""
        for k in keys:
            ent = self._sends.pop(k, None)
            if ent is not None:
                self.wait(ent[0], ent[2], ent[3])

    def recv(self, shape: torch.Size, dtype: torch.dtype, peer: int, tag_: int, what: str) -> torch.Tensor:
        """Receive a tensor from ``peer`` (blocks, bounded by the timeout)."""
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        self.wait(dist.irecv(buf, peer, tag=tag_ if self.use_tags else 0), what, peer)
        return buf

    def forget(self) -> None:
        """Drop every posted send without waiting (abandoning a paused stream)."""
        self._sends = {}

    def drain(self) -> None:
        """Wait for every send posted so far (end of a step)."""
        sends, self._sends = self._sends, {}
        for work, _, what, peer in sends.values():
            self.wait(work, what, peer)

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, t: torch.Tensor, grp: Any, what: str) -> None:
        self.wait(dist.all_reduce(t, group=grp, async_op=True), what, None)

    def broadcast(self, t: torch.Tensor, src: int, grp: Any, what: str) -> None:
        self.wait(dist.broadcast(t, src, group=grp, async_op=True), what, None if src == self.rank else src)

    def barrier(self, grp: Any, what: str) -> None:
        # a tiny all-reduce: gloo's barrier has no per-call timeout
        self.all_reduce(torch.zeros(1, device=self.device), grp, what)

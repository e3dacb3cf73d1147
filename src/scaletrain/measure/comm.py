"""Measure what a region of code communicates and keeps in memory, DTensor included.

:class:`CommCounter` is a ``TorchDispatchMode`` that records every collective and point-to-point
op (functional collectives issued by DTensor, and ``torch.distributed`` calls) with its payload
and the bytes each rank puts on the wire under the α-β ring model of ``shared/REFERENCES.md``:

- all-reduce of S bytes: 2 (N-1)/N · S;
- all-gather producing S bytes, reduce-scatter consuming S bytes: (N-1)/N · S;
- all-to-all of S bytes (equal splits): (N-1)/N · S (the own chunk stays); uneven splits: the
  bytes actually sent to other ranks;
- send of S bytes: S; broadcast of S bytes from a root (tree/pipeline): S.

Ops under a DTensor are seen *after* DTensor has lowered them to local ops (the mode returns
``NotImplemented`` when a DTensor is among the arguments, which lets DTensor run first), so the
counts are what really went over the process group.

:class:`DTensorMemoryTracker` is :class:`scaletrain.measure.tracker.MemoryTracker` taught the
same trick and to look through a DTensor at its local shard, so per-rank memory of a
tensor-parallel model can be measured storage by storage.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_iter

from scaletrain.measure.tracker import MemoryTracker


@dataclass
class CommRecord:
    kind: str
    """all_reduce, all_gather, reduce_scatter, all_to_all, send, recv, broadcast."""
    payload_bytes: int
    """Bytes of the full collective tensor (all-reduce: the tensor; all-gather: the output;
    reduce-scatter: the input; all-to-all: this rank's input; send/recv: the message)."""
    wire_bytes: float
    """Bytes this rank sends under the ring model (see module docstring)."""
    group_size: int
    backward: bool
    group: str = ""
    """The process group's name (to attribute traffic to the technique that owns the group)."""


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _group(name_or_group):
    if isinstance(name_or_group, str):  # functional collectives name their group
        from torch.distributed.distributed_c10d import _resolve_process_group

        return _resolve_process_group(name_or_group)
    if isinstance(name_or_group, torch.ScriptObject):  # c10d ops carry a boxed ProcessGroup
        return dist.ProcessGroup.unbox(name_or_group)
    return name_or_group


def _group_name(args) -> str:
    """The name of the process group an op's arguments carry ('' if none is found)."""
    for a in args:
        if isinstance(a, (str, torch.ScriptObject)):
            try:
                return str(getattr(_group(a), "group_name", ""))
            except Exception:  # noqa: BLE001 - a string argument that is not a group name
                continue
    return ""


def _group_size(name_or_group) -> int:
    g = _group(name_or_group)
    return g.size() if hasattr(g, "size") else dist.get_world_size()


def _group_rank(name_or_group) -> int:
    g = _group(name_or_group)
    return g.rank() if hasattr(g, "rank") else dist.get_rank()


def _classify(func, args) -> CommRecord | None:  # noqa: C901 - one table of op signatures
    name = func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else str(func)
    ns = getattr(func, "namespace", "")
    bw = torch._C._current_graph_task_id() != -1
    if ns == "_c10d_functional":
        if name in ("all_reduce", "all_reduce_"):
            n, s = _group_size(args[2]), _nbytes(args[0])
            return CommRecord("all_reduce", s, 2 * (n - 1) / n * s, n, bw)
        if name == "all_gather_into_tensor":
            n = int(args[1])
            s = _nbytes(args[0]) * n
            return CommRecord("all_gather", s, (n - 1) / n * s, n, bw)
        if name == "reduce_scatter_tensor":
            n, s = int(args[2]), _nbytes(args[0])
            return CommRecord("reduce_scatter", s, (n - 1) / n * s, n, bw)
        if name == "all_to_all_single":
            n = _group_size(args[3])
            return CommRecord("all_to_all", _nbytes(args[0]), _a2a_sent(args[0], args[2], n, _group_rank(args[3])),
                              n, bw)
        if name == "broadcast":
            n, s = _group_size(args[2]), _nbytes(args[0])
            return CommRecord("broadcast", s, s, n, bw)
        return None
    if ns == "c10d":
        if name == "allreduce_":
            s = sum(_nbytes(t) for t in args[0])
            n = _group_size(args[1])
            return CommRecord("all_reduce", s, 2 * (n - 1) / n * s, n, bw)
        if name == "_allgather_base_":
            n, s = _group_size(args[2]), _nbytes(args[0])
            return CommRecord("all_gather", s, (n - 1) / n * s, n, bw)
        if name == "_reduce_scatter_base_":
            n, s = _group_size(args[2]), _nbytes(args[1])
            return CommRecord("reduce_scatter", s, (n - 1) / n * s, n, bw)
        if name == "alltoall_base_":
            n = _group_size(args[2])
            return CommRecord("all_to_all", _nbytes(args[1]), _a2a_sent(args[1], args[4], n, _group_rank(args[2])),
                              n, bw)
        if name == "allgather_":
            n = _group_size(args[2])
            s = sum(_nbytes(t) for t in args[1]) * n
            return CommRecord("all_gather", s, (n - 1) / n * s, n, bw)
        if name == "send":
            s = sum(_nbytes(t) for t in args[0])
            return CommRecord("send", s, s, _group_size(args[1]), bw)
        if name == "recv_":
            s = sum(_nbytes(t) for t in args[0])
            return CommRecord("recv", s, 0.0, _group_size(args[1]), bw)
        if name == "broadcast_":
            s = sum(_nbytes(t) for t in args[0])
            return CommRecord("broadcast", s, s, _group_size(args[1]), bw)
    return None


def _a2a_sent(inp: torch.Tensor, in_splits, n: int, group_rank: int) -> float:
    """Bytes of an all-to-all input that leave this rank (its own chunk stays)."""
    s = _nbytes(inp)
    if not in_splits:
        return (n - 1) / n * s
    row = s / max(inp.shape[0], 1)
    return s - in_splits[group_rank] * row


class _Owned(threading.local):
    depth = 0


_OWNED = _Owned()


@contextlib.contextmanager
def ledger_owned() -> Iterator[None]:
    """Collectives issued inside are the ledger's (data-parallel gradient reduction launched from
    backward hooks): counted by :data:`LEDGER` even while it is paused, never by a CommCounter that
    is counting the surrounding forward/backward's model-parallel traffic."""
    _OWNED.depth += 1
    try:
        yield
    finally:
        _OWNED.depth -= 1


class CommCounter(TorchDispatchMode):
    """``with CommCounter() as c: step()`` then ``c.records``, ``c.wire_bytes()``, ``c.summary()``."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[CommRecord] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor lower the op; its collectives come back here
        out = func(*args, **(kwargs or {}))
        if not isinstance(func, torch._ops.HigherOrderOperator) and not _OWNED.depth:
            rec = _classify(func, args)
            if rec is not None:
                rec.group = _group_name(args)
                self.records.append(rec)
        return out

    def wire_bytes(self, backward: bool | None = None, groups: set[str] | None = None,
                   exclude: set[str] | None = None) -> float:
        """Bytes this rank sent (ring model); ``backward`` None = both passes; only on process groups
        named in ``groups`` / not in ``exclude`` when given."""
        return sum(r.wire_bytes for r in self.records if (backward is None or r.backward == backward)
                   and (groups is None or r.group in groups) and (exclude is None or r.group not in exclude))

    def summary(self) -> dict[str, dict[str, float]]:
        """``{kind: {"count", "payload_bytes", "wire_bytes"}}`` over all records."""
        out: dict[str, dict[str, float]] = defaultdict(lambda: {"count": 0, "payload_bytes": 0, "wire_bytes": 0.0})
        for r in self.records:
            d = out[r.kind]
            d["count"] += 1
            d["payload_bytes"] += r.payload_bytes
            d["wire_bytes"] += r.wire_bytes
        return dict(out)


class DTensorMemoryTracker(MemoryTracker):
    """:class:`MemoryTracker` that sees through DTensors to their local shards (per-rank bytes)."""

    def _see(self, t, category, origin, promote=True):  # type: ignore[override]
        if isinstance(t, DTensor):
            t = t._local_tensor
        return super()._see(t, category, origin, promote)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        return super().__torch_dispatch__(func, types, args, kwargs)


def local_tensors(tensors) -> list[torch.Tensor]:
    """Local shards of DTensors (plain tensors unchanged), e.g. to register with a tracker."""
    return [t._local_tensor if isinstance(t, DTensor) else t for t in tree_iter(tensors)]


# --------------------------------------------------------------------------- the traffic ledger
#
# :class:`CommLedger` counts the bytes each collective moves by wrapping the ``torch.distributed``
# functions that DDP comm hooks, FSDP2 and our own ZeRO code call. The convention is *bytes received
# per rank by a bandwidth-optimal (ring) algorithm* for a tensor of ``S`` bytes on ``N`` ranks:
# all-reduce ``2(N-1)/N * S``; reduce-scatter ``(N-1)/N * S_input``; all-gather ``(N-1)/N * S_output``;
# broadcast ``(N-1)/N * S`` (every non-root rank receives S); all-to-all ``(N-1)/N * S``
# (REFERENCES.md, "Communication"). DDP moves ``2 Psi (N-1)/N`` elements per step, ZeRO-3
# ``3 Psi (N-1)/N`` (ZeRO paper section 7). :class:`CommCounter` above sees what the ledger cannot
# (DTensor's functional collectives, point-to-point); its wire bytes are added with ``LEDGER.add``.


def _ledger_group_size(group: Any) -> int:
    return dist.get_world_size(group) if group is not None else dist.get_world_size()


# name -> function(bound arguments, N) -> bytes received per rank (module docstring convention)
_TRAFFIC: dict[str, Callable[[dict[str, Any], int], float]] = {
    "all_reduce": lambda a, n: 2 * (n - 1) / n * _nbytes(a["tensor"]),
    "reduce_scatter_tensor": lambda a, n: (n - 1) / n * _nbytes(a["input"]),
    "reduce_scatter_single": lambda a, n: (n - 1) / n * _nbytes(a["input"]),
    "reduce_scatter": lambda a, n: (n - 1) / n * sum(_nbytes(t) for t in a["input_list"]),
    "all_gather_into_tensor": lambda a, n: (n - 1) / n * _nbytes(a["output_tensor"]),
    "all_gather_single": lambda a, n: (n - 1) / n * _nbytes(a["output_tensor"]),
    "all_gather": lambda a, n: (n - 1) * _nbytes(a["tensor"]),
    "broadcast": lambda a, n: (n - 1) / n * _nbytes(a["tensor"]),
    "all_to_all_single": lambda a, n: (n - 1) / n * _nbytes(a["input"]),
}


class CommLedger:
    """Counts bytes per collective (see the module docstring) and remembers the last one started.

    One ledger per process (:data:`LEDGER`); :meth:`install` wraps the ``torch.distributed``
    functions in :data:`_TRAFFIC` (reference-counted, :meth:`uninstall` restores them).
    ``paused()`` excludes bookkeeping traffic (loss averaging for the log) from the counts.
    """

    def __init__(self) -> None:
        self.bytes: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.last: tuple[str, int, int] | None = None  # (collective, tensor bytes, ranks)
        self._lock = threading.Lock()
        self._paused = 0
        self._installed = 0
        self._originals: dict[str, Callable[..., Any]] = {}

    # -- counting ------------------------------------------------------------------------
    def record(self, name: str, args: dict[str, Any], group: Any) -> None:
        n = _ledger_group_size(group)
        traffic = _TRAFFIC[name](args, n) if n > 1 else 0.0
        size = max((_nbytes(v) for v in args.values() if isinstance(v, torch.Tensor)), default=0)
        with self._lock:
            self.last = (name, size, n)
            if self._paused and not _OWNED.depth:
                return
            self.bytes[name] = self.bytes.get(name, 0.0) + traffic
            self.calls[name] = self.calls.get(name, 0) + 1

    def total(self) -> float:
        """Bytes received per rank so far (all collectives)."""
        with self._lock:
            return sum(self.bytes.values())

    def reset(self) -> None:
        with self._lock:
            self.bytes.clear()
            self.calls.clear()

    def add(self, name: str, nbytes: float, calls: int = 1) -> None:
        """Count traffic measured elsewhere (collectives the wrappers cannot see: DTensor's
        functional collectives, point-to-point rings), in this ledger's convention."""
        with self._lock:
            self.bytes[name] = self.bytes.get(name, 0.0) + nbytes
            self.calls[name] = self.calls.get(name, 0) + calls

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        with self._lock:
            self._paused += 1
        try:
            yield
        finally:
            with self._lock:
                self._paused -= 1

    # -- patching ------------------------------------------------------------------------
    def install(self) -> None:
        if self._installed == 0:
            for name in _TRAFFIC:
                orig = getattr(dist, name, None)
                if orig is None:
                    continue
                self._originals[name] = orig
                setattr(dist, name, self._wrap(name, orig))
        self._installed += 1

    def uninstall(self) -> None:
        self._installed = max(0, self._installed - 1)
        if self._installed == 0:
            for name, orig in self._originals.items():
                setattr(dist, name, orig)
            self._originals.clear()

    def _wrap(self, name: str, orig: Callable[..., Any]) -> Callable[..., Any]:
        sig = inspect.signature(orig)

        @functools.wraps(orig)
        def counted(*args: Any, **kwargs: Any) -> Any:
            bound = sig.bind(*args, **kwargs)
            self.record(name, bound.arguments, bound.arguments.get("group"))
            return orig(*args, **kwargs)

        return counted


LEDGER = CommLedger()
"""The process-wide traffic ledger."""

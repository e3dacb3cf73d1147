"""Activation offloading: tensors saved for backward by chosen blocks go to host memory.

Apply face — :class:`ActivationOffloader` (vDNN, Rhu et al. 2016; the survey's §2.2
"swapping"): while an offloaded block runs its forward, a ``saved_tensors_hooks`` pack hook
records every tensor autograd saves, *by storage* (views of one storage — q, k, v of a fused
projection, a reshape of the input — are one record, copied once). When the block's forward
ends, each record's whole storage is copied to the host pool and the device reference is
dropped, so the storage leaves the device as soon as nothing else holds it. Parameters,
buffers and the step's input are never moved (they stay where their owner put them).

Backward: when block i's backward is about to start (a hook on the gradient of its output),
the records of blocks i, i-1, ..., i-d (d = prefetch distance) are copied back to the device,
ahead of the backward that needs them; on a GPU the copies run on a side stream and the unpack
hook only makes the compute stream wait for them. A record shared by several blocks is fetched
once, by the first of them to run backward, and released after its last unpack.

Cost face — :func:`offload_bytes`: the bytes moved each way are exactly the sum of the distinct
storages saved by the offloaded blocks (excluding parameters, buffers and the step input),
which :mod:`scaletrain.techniques.offload.probe` records per block from a run on fake tensors
(no memory used). The test checks counted == predicted to the byte.

Why the copy happens at the block's end and not inside the pack hook: the copy then sees the
block's final values (a saved tensor modified in place later in the same block is detected by
its version counter and reported, as autograd would) and the copies of one block are issued
together.
"""

from __future__ import annotations

import weakref
from typing import Iterable, Sequence

import torch
from torch.utils._python_dispatch import _disable_current_modes

from scaletrain.techniques.offload.pools import DONE, Pools, Ticket


class _Rec:
    """One offloaded storage."""

    __slots__ = ("nbytes", "dev", "host", "d2h", "h2d", "packed", "unpacked", "wref", "pending")

    def __init__(self, st: torch.UntypedStorage):
        self.nbytes = st.nbytes()
        self.dev: torch.UntypedStorage | None = st
        self.host: torch.UntypedStorage | None = None
        self.d2h: Ticket = DONE
        self.h2d: Ticket = DONE
        self.packed = 0
        self.unpacked = 0
        self.wref = weakref.ref(st)
        self.pending: list[tuple[torch.Tensor, int]] | None = []
        """(saved tensor, its version) until the block ends; None once copied to the host."""


class _Handle(tuple):
    """What autograd keeps for an offloaded saved tensor: (record, dtype, size, stride, offset)."""


class ActivationOffloader:
    """Offload the saved tensors of ``blocks`` (indices) with prefetch distance ``prefetch``."""

    def __init__(self, pools: Pools, blocks: Iterable[int], prefetch: int = 1):
        if prefetch < 0:
            raise ValueError(f"prefetch distance must be >= 0, got {prefetch}")
        self.pools = pools
        self.blocks = frozenset(int(b) for b in blocks)
        self.prefetch = int(prefetch)
        self._skip: set[int] = set()
        self._live: dict[int, _Rec] = {}
        self._by_block: dict[int, list[_Rec]] = {}
        self._current: int | None = None
        self._new: list[_Rec] = []
        self.late_fetches = 0
        """Records fetched by an unpack because no prefetch had brought them (0 when prefetch works)."""

    # -- step lifecycle ---------------------------------------------------------------------
    def begin_step(self, persistent: Iterable[torch.Tensor]) -> None:
        """Start a micro-batch; ``persistent`` tensors (params, buffers, input) are never moved."""
        self._skip = {t.untyped_storage()._cdata for t in persistent}
        self._live.clear()
        self._by_block.clear()

    def hooks(self, block: int):
        """The ``saved_tensors_hooks`` context for block ``block``'s forward (None if not offloaded)."""
        if block not in self.blocks:
            return None
        self._current = block
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def end_block(self, block: int) -> None:
        """Block ``block``'s forward is over: move its new records to the host."""
        for rec in self._new:
            for t, version in rec.pending:
                if t._version != version:
                    raise RuntimeError(
                        f"block {block}: a tensor saved for backward was modified in place during the forward "
                        "(autograd would fail on it too)")
            rec.pending = None
            rec.host, rec.d2h = self.pools.d2h_storage(rec.dev, "activations")
            rec.dev = None
        self._new = []
        self._current = None

    def on_backward_start(self, block: int) -> None:
        """Block ``block``'s backward is next: fetch the records of ``block .. block - prefetch``."""
        for j in range(block, max(block - self.prefetch, 0) - 1, -1):
            for rec in self._by_block.get(j, ()):
                if rec.dev is None and rec.host is not None:
                    self._fetch(rec)

    def end_step(self) -> None:
        """Forget the micro-batch's records (their host copies are freed)."""
        self._live.clear()
        self._by_block.clear()
        self._new = []

    # -- hooks --------------------------------------------------------------------------------
    def _pack(self, t: torch.Tensor):
        st = t.untyped_storage()
        key = st._cdata
        if key in self._skip or st.nbytes() == 0:
            return t
        rec = self._live.get(key)
        if rec is None or rec.wref() is not st:
            rec = _Rec(st)
            self._live[key] = rec
            self._new.append(rec)
        b = self._current
        lst = self._by_block.setdefault(b, [])
        if all(r is not rec for r in lst):
            lst.append(rec)
        rec.packed += 1
        if rec.pending is not None:
            rec.pending.append((t, t._version))
        return _Handle((rec, t.dtype, tuple(t.size()), tuple(t.stride()), t.storage_offset()))

    def _fetch(self, rec: _Rec) -> None:
        rec.dev, rec.h2d = self.pools.h2d_storage(rec.host, "activations", after=rec.d2h)
        rec.host = None  # the host copy is not needed any more

    def _unpack(self, h):
        if not isinstance(h, _Handle):
            return h
        rec, dtype, size, stride, offset = h
        if rec.dev is None:
            if rec.host is None:
                raise RuntimeError("offloaded activation unpacked after it was released (backward run twice?)")
            self.late_fetches += 1
            self._fetch(rec)
        rec.h2d.wait_device()
        with _disable_current_modes():
            out = torch.empty(0, dtype=dtype, device=self.pools.device).set_(rec.dev, offset, size, stride)
        rec.unpacked += 1
        if rec.unpacked == rec.packed:
            rec.dev = None  # autograd holds `out` until the node has run
        return out


# ----------------------------------------------------------------------------- cost face


def offloaded_storages(saved: Sequence[Sequence[int]], blocks: Iterable[int]) -> set[int]:
    """Distinct storage ids saved by the offloaded ``blocks`` (``saved[i]``: ids saved by block i)."""
    out: set[int] = set()
    for b in blocks:
        out.update(saved[b])
    return out


def offload_bytes(saved: Sequence[Sequence[int]], storage_bytes: dict[int, int], blocks: Iterable[int]) -> int:
    """Bytes copied device->host (and the same host->device) per micro-batch (exact)."""
    return sum(storage_bytes[s] for s in offloaded_storages(saved, blocks))


def parse_blocks(spec: str | Sequence[int | str] | None, names: Sequence[str]) -> list[int]:
    """Block indices from "none", "all", "0,3,5", "h.0,h.1" or a list of indices/names."""
    from scaletrain.errors import UserError

    n = len(names)
    if spec is None:
        return []
    if isinstance(spec, str):
        s = spec.strip()
        if s in ("", "none"):
            return []
        if s == "all":
            return list(range(n))
        items: list[int | str] = [x.strip() for x in s.split(",") if x.strip()]
    else:
        items = list(spec)
    out = []
    for it in items:
        if isinstance(it, int) or (isinstance(it, str) and it.lstrip("-").isdigit()):
            i = int(it)
            if not 0 <= i < n:
                raise UserError(f"block index {i} out of range; the chain has blocks 0..{n - 1}")
            out.append(i)
        elif it in names:
            out.append(list(names).index(it))
        else:
            raise UserError(f"unknown block {it!r}; use indices 0..{n - 1}, 'all', 'none' or names: {', '.join(names)}")
    return sorted(set(out))

"""Storage-level memory tracker: what is live, of which kind, at every allocation and free.

:class:`MemoryTracker` is a ``TorchDispatchMode``: every aten op run inside the region passes
through it, and every *storage* an op returns is recorded once (views share their base's
storage, so they are never double-counted) with a weak reference whose callback records the
free. It needs no allocator support, so it works on CPU, CUDA and on fake/meta tensors — the
estimator (:mod:`scaletrain.measure.estimate`) runs the very same accounting on
``FakeTensorMode`` tensors, which allocate nothing.

Categories (a storage's *final role*; a storage may be promoted while it lives, e.g. a gradient
is allocated by a backward op and only becomes ``param.grad`` at AccumulateGrad, and the peak
breakdown and timeline are replayed with each storage's final category):

- ``parameters``: storages of the model's / optimizer's parameters;
- ``gradients``: storages that became ``param.grad`` (post-accumulate-grad hooks, and a scan of
  the optimizer's parameters before each ``step``);
- ``optimizer_states``: tensors found in ``optimizer.state`` (after each ``step``);
- ``activations``: storages saved for backward (a ``saved_tensors_hooks`` pack hook sees each);
- ``temporaries``: everything else allocated inside the region;
- ``other``: storages that existed before the region and are none of the above (model buffers,
  the input batch), counted from their first use.

Priority when roles overlap: parameters > gradients > optimizer_states > activations >
temporaries/other (a parameter saved for backward stays a parameter).

Storages resized in place with ``UntypedStorage.resize_`` (not an aten op: FSDP2 frees an unsharded
parameter after its forward and allocates it again before its backward this way, as do the offload
pools) are followed by wrapping that method while a tracker is active: a storage the tracker holds
changes its bytes at the resize, not when an op next touches it (without this, every FSDP2 unit
gathered once in the step counted whole until the end of its backward).

Limits: memory allocated *inside* a kernel and never returned as a tensor (library workspaces)
is invisible.
On CUDA, sizes are rounded up to the caching allocator's 512-byte blocks so that the peak is
comparable with ``torch.cuda.max_memory_allocated``.
"""

from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_iter

CATEGORIES: tuple[str, ...] = (
    "parameters", "gradients", "optimizer_states", "activations", "temporaries", "other",
)
_RANK = {"parameters": 5, "gradients": 4, "optimizer_states": 3, "activations": 2, "temporaries": 1, "other": 1}
_CUDA_BLOCK = 512  # bytes; c10 CUDACachingAllocator kMinBlockSize (every allocation rounded up to it)
_RESIZE_WATCHERS: list["MemoryTracker"] = []  # active trackers, told of every UntypedStorage.resize_
_RESIZE_ORIG = torch.UntypedStorage.resize_


def _watched_resize(st, size):  # type: ignore[no-untyped-def]
    out = _RESIZE_ORIG(st, size)
    for tr in list(_RESIZE_WATCHERS):
        tr._resized(st)
    return out


@dataclass(eq=False)
class StorageRecord:
    """One storage seen by the tracker. ``nbytes`` is its current size (rounded on CUDA)."""

    uid: int
    nbytes: int
    device: str
    category: str
    origin: str
    """The aten op that allocated it, or ``"pre-existing"``."""
    born: int
    """Index of the event that added it."""
    died: int | None = None
    """Index of the event that freed it, ``None`` while alive."""


def _storage_of(t: torch.Tensor):
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None  # sparse / nested / opaque subclass: no single storage


class MemoryTracker(TorchDispatchMode):
    """Context manager recording every storage allocated and freed inside it.

    ``with MemoryTracker(model=m, optimizer=opt) as t: step()`` then ``t.peak_bytes`` and
    ``t.peak_breakdown``. ``model``/``optimizer``/``extra`` pre-register storages that exist
    before entering (parameters, gradients, buffers, optimizer states, the batch) so the peak is
    the whole footprint. ``device`` restricts accounting to one device type (default: the
    model's parameters' device type, else everything). ``granularity``: sizes are rounded up to a
    multiple of it (default 512 bytes on CUDA, as the caching allocator does, else 1); the
    estimator sets 512 to predict CUDA with fake CPU tensors.
    """

    def __init__(self, model: nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                 *, extra: Iterable[torch.Tensor] = (), device: str | torch.device | None = None,
                 track_saved: bool = True, granularity: int | None = None):
        super().__init__()
        self.model = model
        self.optimizer = optimizer
        self._extra = list(extra)
        if device is None and model is not None:
            p = next(iter(model.parameters()), None)
            device = p.device if p is not None else None
        self.device_type: str | None = torch.device(device).type if device is not None else None
        self.track_saved = track_saved
        self.granularity = granularity
        self._lock = threading.RLock()
        self._live: dict[int, tuple[StorageRecord, weakref.ref]] = {}
        self.records: list[StorageRecord] = []
        self._events: list[tuple[float, StorageRecord, int]] = []  # (time s, record, +/- bytes)
        self.marks: list[tuple[int, str]] = []
        """(event index, label) pairs added by :meth:`mark`, e.g. phase boundaries for the plot."""
        self.current_bytes = 0
        self._peak = 0
        self._peak_event = -1
        self._t0 = 0.0
        self._active = False
        self._handles: list = []
        self._saved_ctx = None

    # ----------------------------------------------------------------- registration
    def _key_rec(self, st) -> StorageRecord | None:
        ent = self._live.get(st._cdata)
        return ent[0] if ent is not None else None

    def _nbytes(self, st, device: torch.device) -> int:
        n = int(st.nbytes())
        g = self.granularity or (_CUDA_BLOCK if device.type == "cuda" else 1)
        return -(-n // g) * g if n > 0 else 0

    def _wanted(self, t: torch.Tensor) -> bool:
        return self.device_type is None or t.device.type == self.device_type

    def _emit(self, rec: StorageRecord, delta: int) -> None:
        self._events.append((time.perf_counter() - self._t0, rec, delta))
        self.current_bytes += delta
        if self.current_bytes > self._peak:
            self._peak = self.current_bytes
            self._peak_event = len(self._events) - 1

    def _on_free(self, key: int, rec: StorageRecord, _ref) -> None:
        with self._lock:
            ent = self._live.get(key)
            if ent is None or ent[0] is not rec:
                return
            del self._live[key]
            if self._active:
                self._emit(rec, -rec.nbytes)
                rec.died = len(self._events) - 1

    def _resized(self, st) -> None:
        """A storage resized in place: its record (if this tracker holds it) takes its new size now."""
        with self._lock:
            rec = self._key_rec(st)
            if rec is None or not self._active:
                return
            n = self._nbytes(st, st.device)
            if n != rec.nbytes:
                self._emit(rec, n - rec.nbytes)
                rec.nbytes = n

    def _see(self, t: torch.Tensor, category: str, origin: str, promote: bool = True) -> StorageRecord | None:
        """Record ``t``'s storage if new; promote its category if ``category`` ranks higher."""
        if not isinstance(t, torch.Tensor) or not self._wanted(t):
            return None
        st = _storage_of(t)
        if st is None:
            return None
        with self._lock:
            rec = self._key_rec(st)
            if rec is None:
                rec = StorageRecord(len(self.records), self._nbytes(st, t.device), str(t.device), category, origin,
                                    born=len(self._events))
                self.records.append(rec)
                key = st._cdata
                ref = weakref.ref(st, lambda r, k=key, rc=rec: self._on_free(k, rc, r))
                self._live[key] = (rec, ref)
                self._emit(rec, rec.nbytes)
                return rec
            if promote and _RANK[category] > _RANK[rec.category]:
                rec.category = category
            n = self._nbytes(st, t.device)
            if n != rec.nbytes:  # resized in place (e.g. an out= op)
                self._emit(rec, n - rec.nbytes)
                rec.nbytes = n
            return rec

    def register(self, tensors: torch.Tensor | Iterable[torch.Tensor], category: str = "other") -> None:
        """Count (and categorise) tensors the region did not allocate, e.g. the input batch."""
        if category not in CATEGORIES:
            raise ValueError(f"unknown category {category!r}; allowed: {', '.join(CATEGORIES)}")
        for t in [tensors] if isinstance(tensors, torch.Tensor) else tensors:
            self._see(t, category, "pre-existing")

    def record_of(self, t: torch.Tensor) -> StorageRecord | None:
        """The live record of ``t``'s storage, if tracked."""
        st = _storage_of(t)
        return None if st is None else self._key_rec(st)

    def _scan_optimizer(self, opt: torch.optim.Optimizer, states: bool) -> None:
        for group in opt.param_groups:
            for p in group["params"]:
                # no promotion: fp32 master copies registered as optimizer states stay so
                self._see(p, "parameters", "pre-existing", promote=False)
                if p.grad is not None:
                    self._see(p.grad, "gradients", "pre-existing")
        if states:
            for st in opt.state.values():
                for v in tree_iter(st):
                    if isinstance(v, torch.Tensor):
                        self._see(v, "optimizer_states", "pre-existing")

    # ----------------------------------------------------------------- context
    def __enter__(self) -> "MemoryTracker":
        self._t0 = time.perf_counter()
        self._active = True
        if self.model is not None:
            for p in self.model.parameters():
                self._see(p, "parameters", "pre-existing")
                if p.grad is not None:
                    self._see(p.grad, "gradients", "pre-existing")
            for b in self.model.buffers():
                self._see(b, "other", "pre-existing")
        if self.optimizer is not None:
            # optimizer-like wrappers (e.g. fp32 master weights) may list what they keep
            for t in getattr(self.optimizer, "state_tensors", lambda: [])():
                self._see(t, "optimizer_states", "pre-existing")
            self._scan_optimizer(self.optimizer, states=True)
        for t in self._extra:
            self._see(t, "other", "pre-existing")
        params = list(self.model.parameters()) if self.model is not None else []
        if self.optimizer is not None:
            params += [p for g in self.optimizer.param_groups for p in g["params"]]
        seen: set[int] = set()
        for p in params:
            if id(p) in seen or not p.requires_grad:
                continue
            seen.add(id(p))
            self._handles.append(p.register_post_accumulate_grad_hook(self._grad_hook))
        self._handles.append(register_optimizer_step_pre_hook(self._opt_pre_hook))
        self._handles.append(register_optimizer_step_post_hook(self._opt_post_hook))
        if self.track_saved:
            self._saved_ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda x: x)
            self._saved_ctx.__enter__()
        if not _RESIZE_WATCHERS:
            torch.UntypedStorage.resize_ = _watched_resize  # type: ignore[method-assign]
        _RESIZE_WATCHERS.append(self)
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        try:
            super().__exit__(*exc)
        finally:
            if self._saved_ctx is not None:
                self._saved_ctx.__exit__(*exc)
                self._saved_ctx = None
            for h in self._handles:
                h.remove()
            self._handles.clear()
            if self in _RESIZE_WATCHERS:
                _RESIZE_WATCHERS.remove(self)
                if not _RESIZE_WATCHERS:
                    torch.UntypedStorage.resize_ = _RESIZE_ORIG  # type: ignore[method-assign]
            with self._lock:
                self._active = False

    def _grad_hook(self, p: torch.Tensor) -> None:
        if p.grad is not None:
            self._see(p.grad, "gradients", "AccumulateGrad")

    def _opt_pre_hook(self, opt, args, kwargs) -> None:
        self._scan_optimizer(opt, states=False)

    def _opt_post_hook(self, opt, args, kwargs) -> None:
        self._scan_optimizer(opt, states=True)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        # Called by autograd for every tensor saved for backward (Korthikanti's "activations").
        self._see(t, "activations", "saved")
        # Detached: returning ``t`` itself would tie the saved value to its own grad_fn, a reference
        # cycle that keeps every graph dropped without a backward alive (and inflates peaks).
        return t.detach()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for a in tree_iter((args, kwargs)):
            if isinstance(a, torch.Tensor):
                self._see(a, "other", "pre-existing")  # no-op when known; first use of a pre-existing one
        out = func(*args, **kwargs)
        name = str(func.overloadpacket.__name__) if hasattr(func, "overloadpacket") else str(func)
        for o in tree_iter(out):
            if isinstance(o, torch.Tensor):
                self._see(o, "temporaries", name)
        return out

    # ----------------------------------------------------------------- results
    def mark(self, label: str) -> None:
        """Label the current moment (e.g. "backward") for the timeline plot."""
        self.marks.append((len(self._events) - 1, label))

    @property
    def peak_bytes(self) -> int:
        """Largest total of live tracked bytes since entering (or since :meth:`reset_peak`)."""
        return self._peak

    @property
    def peak_event(self) -> int:
        """Index of the event at which :attr:`peak_bytes` was reached (-1 if none)."""
        return self._peak_event

    def reset_peak(self) -> None:
        """Forget the peak so far; the next peak is measured from the current live bytes."""
        with self._lock:
            self._peak = self.current_bytes
            self._peak_event = len(self._events) - 1

    def breakdown_at(self, event: int) -> dict[str, int]:
        """Live bytes per category just after event ``event`` (final categories)."""
        out = dict.fromkeys(CATEGORIES, 0)
        for _, rec, delta in self._events[: event + 1]:
            out[rec.category] += delta
        return out

    @property
    def peak_breakdown(self) -> dict[str, int]:
        """Live bytes per category at the peak; sums to :attr:`peak_bytes`."""
        return self.breakdown_at(self._peak_event)

    @property
    def current_breakdown(self) -> dict[str, int]:
        return self.breakdown_at(len(self._events) - 1)

    def iter_timeline(self) -> Iterator[tuple[int, float, dict[str, int]]]:
        """Yields (event index, seconds since entering, bytes per category) after every event."""
        cur = dict.fromkeys(CATEGORIES, 0)
        for i, (t, rec, delta) in enumerate(self._events):
            cur[rec.category] += delta
            yield i, t, dict(cur)

    @property
    def timeline(self) -> list[tuple[int, float, dict[str, int]]]:
        """All of :meth:`iter_timeline` as a list."""
        return list(self.iter_timeline())

    @property
    def events(self) -> list[tuple[float, StorageRecord, int]]:
        """Raw events (seconds since entering, record, byte delta), in order."""
        return self._events

    def live_bytes(self, records: Iterable[StorageRecord], at: int) -> int:
        """Bytes of ``records`` alive just after event ``at``."""
        return sum(r.nbytes for r in records if r.born <= at and (r.died is None or r.died > at))

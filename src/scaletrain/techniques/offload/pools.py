"""Device and host memory pools: where every offloaded byte lives, and every copy between them.

Two implementations of one interface (:class:`Pools`):

- :class:`CudaPools` — the device is the GPU, the host pool is *pinned* CPU memory, and copies
  run on two side streams (one per direction) so they overlap compute; each copy is timed with
  CUDA events, and the device peak is ``torch.cuda.max_memory_allocated``.
- :class:`LogicalPools` — for a machine without an accelerator. Host and "device" are both CPU
  memory, but a *logical device pool* with a byte budget decides which storages count as on the
  device: every storage allocated by an op inside a measured phase (activations, temporaries,
  gradients), plus the tensors placed there explicitly (resident parameters, fetched copies).
  Storages made by the pools for the host are allocated with the dispatch modes switched off,
  so the device accounting never sees them. The accounting is
  :class:`scaletrain.measure.tracker.MemoryTracker` (storage-level, views counted once, frees
  seen through weak references); with ``strict`` it raises :class:`DeviceOutOfMemory` at the
  allocation that crosses the budget, as a GPU would. A "copy" is a real memcpy into a distinct
  storage, so a tensor moved to the host really leaves the device pool and the bytes moved are
  counted exactly. The memcpy runs on the compute thread: no overlap (``Platform.copy_overlaps_compute``
  is False for it).

Counters (:class:`TransferStats`) are kept per direction (h2d, d2h, disk_read, disk_write) and
kind (activations, params, grads, optimizer). Units: bytes, seconds.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

import torch
from torch.utils._python_dispatch import _disable_current_modes

from scaletrain.measure.tracker import MemoryTracker

DIRECTIONS = ("h2d", "d2h", "disk_read", "disk_write")
KINDS = ("activations", "params", "grads", "optimizer")


class DeviceOutOfMemory(RuntimeError):
    """The logical device pool (or a budget on a GPU) would exceed its byte budget."""


class HostOutOfMemory(RuntimeError):
    """The host pool would exceed its byte budget."""


@dataclass
class TransferStats:
    """Bytes (and, on GPUs, seconds) moved, per ``direction/kind``."""

    bytes: dict[str, int] = field(default_factory=dict)
    count: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, direction: str, kind: str, nbytes: int, seconds: float = 0.0) -> None:
        assert direction in DIRECTIONS and kind in KINDS, (direction, kind)
        key = f"{direction}/{kind}"
        with self._lock:
            self.bytes[key] = self.bytes.get(key, 0) + int(nbytes)
            self.count[key] = self.count.get(key, 0) + 1
            if seconds:
                self.seconds[key] = self.seconds.get(key, 0.0) + seconds

    def total(self, direction: str | None = None, kind: str | None = None) -> int:
        """Bytes moved in ``direction`` (all if None) of ``kind`` (all if None)."""
        out = 0
        for key, n in self.bytes.items():
            d, k = key.split("/")
            if (direction is None or d == direction) and (kind is None or k == kind):
                out += n
        return out

    def as_dict(self) -> dict[str, int]:
        return dict(sorted(self.bytes.items()))

    def reset(self) -> None:
        with self._lock:
            self.bytes.clear()
            self.count.clear()
            self.seconds.clear()


class Ticket:
    """Completion of an asynchronous copy. On the logical pool every copy is already done."""

    def __init__(self, event=None):
        self.event = event

    def wait_device(self) -> None:
        """Make the current (compute) stream wait for the copy."""
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def wait_host(self) -> None:
        """Block the CPU until the copy is done (before host code reads its result)."""
        if self.event is not None:
            self.event.synchronize()


DONE = Ticket()


def _storage_tensor(st: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor viewing a whole storage (for registering and record_stream)."""
    return torch.empty(0, dtype=torch.uint8, device=st.device).set_(st)


class HostPool:
    """Host allocations with a byte budget; frees are seen through finalizers on the storages."""

    def __init__(self, budget_bytes: int | None = None, pin: bool = False, strict: bool = True):
        self.budget_bytes = budget_bytes
        self.pin = pin
        self.strict = strict
        self.live_bytes = 0
        self.peak_bytes = 0
        self._lock = threading.Lock()

    def _count(self, st: torch.UntypedStorage, n: int) -> None:
        with self._lock:
            if self.strict and self.budget_bytes is not None and self.live_bytes + n > self.budget_bytes:
                raise HostOutOfMemory(
                    f"host pool: {self.live_bytes + n} B needed, budget {self.budget_bytes} B "
                    f"(raise memory.offload.host_budget or move optimizer states to disk)")
            self.live_bytes += n
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        weakref.finalize(st, self._free, n)

    def _free(self, n: int) -> None:
        with self._lock:
            self.live_bytes -= n

    def storage(self, nbytes: int) -> torch.UntypedStorage:
        """An uninitialised host storage of ``nbytes`` (pinned on CUDA machines), counted."""
        with _disable_current_modes():
            if self.pin:
                st = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).untyped_storage()
            else:
                st = torch.UntypedStorage(nbytes)
        self._count(st, nbytes)
        return st

    def empty(self, shape: Iterable[int] | int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """An uninitialised host tensor, counted."""
        with _disable_current_modes():
            t = torch.empty(shape, dtype=dtype, pin_memory=self.pin)
        self._count(t.untyped_storage(), t.untyped_storage().nbytes())
        return t

    def adopt(self, t: torch.Tensor) -> None:
        """Count a host tensor allocated elsewhere (e.g. by an optimizer) until it is freed."""
        st = t.untyped_storage()
        self._count(st, st.nbytes())

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes


class _BudgetTracker(MemoryTracker):
    """MemoryTracker that raises :class:`DeviceOutOfMemory` when live bytes cross a budget."""

    def __init__(self, budget: int | None, strict: bool, **kw):
        super().__init__(**kw)
        self.budget = budget
        self.strict = strict
        self.over_by = 0

    def _emit(self, rec, delta: int) -> None:  # called on every allocation, free and resize
        super()._emit(rec, delta)
        if self.budget is not None and delta > 0 and self.current_bytes > self.budget:
            self.over_by = max(self.over_by, self.current_bytes - self.budget)
            if self.strict:
                raise DeviceOutOfMemory(
                    f"logical device pool: {self.current_bytes} B live, budget {self.budget} B "
                    f"(allocation of {delta} B by {rec.origin}, category {rec.category}); "
                    "raise memory.device_budget or offload/recompute more")


class Pools:
    """Interface shared by the logical (CPU) and CUDA pools. See the module docstring."""

    device: torch.device
    host: HostPool
    stats: TransferStats
    budget_bytes: int | None
    overlaps: bool = False

    # -- phases and peak ------------------------------------------------------------------
    def phase(self, persistent: Iterable[torch.Tensor] = (), model=None, optimizer=None):
        """Context measuring the device peak of one phase (a micro-batch, an optimizer step)."""
        raise NotImplementedError

    @property
    def device_peak_bytes(self) -> int:
        """Largest device bytes live in any phase since :meth:`reset_peak`."""
        return self._peak

    def reset_peak(self) -> None:
        self._peak = 0
        self.host.reset_peak()

    def register(self, t: torch.Tensor, category: str = "other") -> None:
        """Tell the accounting about a device storage allocated or resized outside an op."""

    # -- copies -----------------------------------------------------------------------------
    def d2h_storage(self, st: torch.UntypedStorage, kind: str) -> tuple[torch.UntypedStorage, Ticket]:
        """Copy a device storage to a new host storage."""
        raise NotImplementedError

    def h2d_storage(self, hst: torch.UntypedStorage, kind: str, after: Ticket = DONE,
                    category: str = "activations") -> tuple[torch.UntypedStorage, Ticket]:
        """Copy a host storage to a new device storage (after ``after`` completes)."""
        raise NotImplementedError

    def h2d_into(self, dst: torch.Tensor, src: torch.Tensor, kind: str, category: str = "parameters") -> Ticket:
        """Copy host ``src`` into the existing device tensor ``dst``."""
        raise NotImplementedError

    def d2h_into(self, dst: torch.Tensor, src: torch.Tensor, kind: str, accumulate: bool = False) -> Ticket:
        """Copy (or add, with ``accumulate``) device ``src`` into host ``dst``."""
        raise NotImplementedError

    def device_empty(self, shape, dtype: torch.dtype, category: str = "parameters") -> torch.Tensor:
        """A new device tensor (its storage counted)."""
        raise NotImplementedError

    def free_device_storage(self, t: torch.Tensor) -> None:
        """Free ``t``'s storage but keep the tensor (shape, views) — FSDP's resize-to-0 trick."""
        with _disable_current_modes():
            t.untyped_storage().resize_(0)
        self.register(t)

    def alloc_device_storage(self, t: torch.Tensor, category: str = "parameters") -> None:
        """Give back a freed storage its bytes (contents undefined until copied into)."""
        need = (t.storage_offset() + t.numel()) * t.element_size()
        with _disable_current_modes():
            t.untyped_storage().resize_(need)
        self.register(t, category)

    def synchronize(self) -> None:
        """Wait for every copy in flight (end of a step)."""


class LogicalPools(Pools):
    """A byte-budgeted logical device pool on the CPU plus a host pool (see module docstring)."""

    overlaps = False

    def __init__(self, budget_bytes: int | None = None, host_budget_bytes: int | None = None,
                 strict: bool = True, track: bool = True):
        self.device = torch.device("cpu")
        self.budget_bytes = budget_bytes
        self.strict = strict
        self.track = track
        """False: no device accounting (for timing runs; the tracker costs Python time per op)."""
        self.host = HostPool(host_budget_bytes, pin=False, strict=strict)
        self.stats = TransferStats()
        self._tracker: _BudgetTracker | None = None
        self._peak = 0
        self.last_peak_breakdown: dict[str, int] = {}
        self.phase_peaks: list[int] = []

    @contextlib.contextmanager
    def phase(self, persistent: Iterable[torch.Tensor] = (), model=None, optimizer=None) -> Iterator[_BudgetTracker]:
        if self._tracker is not None or not self.track:  # nested phase: the outer one measures
            yield self._tracker
            return
        tr = _BudgetTracker(self.budget_bytes, self.strict, model=model, optimizer=optimizer, device="cpu")
        self._tracker = tr
        try:
            with tr:
                tr.register(list(persistent), "other")
                yield tr
        finally:
            self._tracker = None
            self.phase_peaks.append(tr.peak_bytes)
            if tr.peak_bytes >= self._peak:
                self._peak = tr.peak_bytes
                self.last_peak_breakdown = tr.peak_breakdown

    def reset_peak(self) -> None:
        super().reset_peak()
        self.phase_peaks = []

    def register(self, t: torch.Tensor, category: str = "other") -> None:
        if self._tracker is not None:
            with _disable_current_modes():
                self._tracker.register(t, category)

    # Copies are timed with perf_counter (they run on the compute thread), so the runtime can tell
    # compute time from copy time when it measures block times.
    def d2h_storage(self, st, kind):
        n = st.nbytes()
        hst = self.host.storage(n)
        t0 = time.perf_counter()
        with _disable_current_modes():
            hst.copy_(st)
        self.stats.add("d2h", kind, n, time.perf_counter() - t0)
        return hst, DONE

    def h2d_storage(self, hst, kind, after=DONE, category="activations"):
        n = hst.nbytes()
        t0 = time.perf_counter()
        with _disable_current_modes():
            dst = torch.UntypedStorage(n)
            dst.copy_(hst)
            view = _storage_tensor(dst)
        dt = time.perf_counter() - t0
        self.register(view, category)
        self.stats.add("h2d", kind, n, dt)
        return dst, DONE

    def h2d_into(self, dst, src, kind, category="parameters"):
        t0 = time.perf_counter()
        with _disable_current_modes():
            dst.copy_(src)
        dt = time.perf_counter() - t0
        self.register(dst, category)
        self.stats.add("h2d", kind, src.numel() * src.element_size(), dt)
        return DONE

    def d2h_into(self, dst, src, kind, accumulate=False):
        t0 = time.perf_counter()
        with _disable_current_modes():
            if accumulate:
                dst.add_(src)
            else:
                dst.copy_(src)
        self.stats.add("d2h", kind, src.numel() * src.element_size(), time.perf_counter() - t0)
        return DONE

    def device_empty(self, shape, dtype, category="parameters"):
        with _disable_current_modes():
            t = torch.empty(shape, dtype=dtype)
        self.register(t, category)
        return t


class CudaPools(Pools):
    """GPU device, pinned host pool, one side stream per copy direction (timed with events)."""

    overlaps = True

    def __init__(self, budget_bytes: int | None = None, host_budget_bytes: int | None = None,
                 strict: bool = True, device: torch.device | str = "cuda"):
        self.device = torch.device(device)
        self.budget_bytes = budget_bytes
        self.strict = strict
        self.host = HostPool(host_budget_bytes, pin=True, strict=strict)
        self.stats = TransferStats()
        self.h2d_stream = torch.cuda.Stream(self.device)
        self.d2h_stream = torch.cuda.Stream(self.device)
        self._timed: list[tuple[str, str, object, object]] = []
        self._peak = 0
        self.phase_peaks: list[int] = []

    @contextlib.contextmanager
    def phase(self, persistent=(), model=None, optimizer=None):
        torch.cuda.reset_peak_memory_stats(self.device)
        try:
            yield None
        finally:
            peak = torch.cuda.max_memory_allocated(self.device)
            self.phase_peaks.append(peak)
            self._peak = max(self._peak, peak)
            if self.strict and self.budget_bytes is not None and peak > self.budget_bytes:
                raise DeviceOutOfMemory(f"device peak {peak} B exceeded memory.device_budget {self.budget_bytes} B")

    def _copy(self, stream, direction, kind, nbytes, fn, after: Ticket = DONE) -> Ticket:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        if after.event is not None:
            stream.wait_event(after.event)
        with torch.cuda.stream(stream):
            start.record(stream)
            fn()
            end.record(stream)
        self._timed.append((direction, kind, start, end))
        self.stats.add(direction, kind, nbytes)
        return Ticket(end)

    def d2h_storage(self, st, kind):
        hst = self.host.storage(st.nbytes())
        _storage_tensor(st).record_stream(self.d2h_stream)
        t = self._copy(self.d2h_stream, "d2h", kind, st.nbytes(), lambda: hst.copy_(st, non_blocking=True))
        return hst, t

    def h2d_storage(self, hst, kind, after=DONE, category="activations"):
        with torch.cuda.stream(self.h2d_stream):
            dst = torch.UntypedStorage(hst.nbytes(), device=self.device)
        _storage_tensor(dst).record_stream(torch.cuda.current_stream(self.device))
        t = self._copy(self.h2d_stream, "h2d", kind, hst.nbytes(), lambda: dst.copy_(hst, non_blocking=True), after)
        return dst, t

    def h2d_into(self, dst, src, kind, category="parameters"):
        return self._copy(self.h2d_stream, "h2d", kind, src.numel() * src.element_size(),
                          lambda: dst.copy_(src, non_blocking=True))

    def d2h_into(self, dst, src, kind, accumulate=False):
        if not accumulate:
            src.record_stream(self.d2h_stream)
            return self._copy(self.d2h_stream, "d2h", kind, src.numel() * src.element_size(),
                              lambda: dst.copy_(src, non_blocking=True))
        tmp = self.host.empty(src.shape, src.dtype)
        src.record_stream(self.d2h_stream)
        t = self._copy(self.d2h_stream, "d2h", kind, src.numel() * src.element_size(),
                       lambda: tmp.copy_(src, non_blocking=True))
        t.wait_host()
        dst.add_(tmp)
        return DONE

    def device_empty(self, shape, dtype, category="parameters"):
        return torch.empty(shape, dtype=dtype, device=self.device)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)
        for direction, kind, s, e in self._timed:
            key = f"{direction}/{kind}"
            self.stats.seconds[key] = self.stats.seconds.get(key, 0.0) + s.elapsed_time(e) / 1e3
        self._timed.clear()


def make_pools(device: torch.device | str, budget_bytes: int | None, host_budget_bytes: int | None = None,
               strict: bool = True, track: bool = True) -> Pools:
    """CudaPools on a CUDA device, LogicalPools otherwise (``track=False``: no device accounting)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return CudaPools(budget_bytes, host_budget_bytes, strict, dev)
    return LogicalPools(budget_bytes, host_budget_bytes, strict, track)


def storage_key(t: torch.Tensor) -> int:
    """Identity of a tensor's storage (shared by all its views)."""
    return t.untyped_storage()._cdata


PersistentFn = Callable[[], Iterable[torch.Tensor]]

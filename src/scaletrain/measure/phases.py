"""Where one training step's wall-clock time goes, measured with ``torch.profiler`` (``train.profile_step``).

The step runs under the profiler inside a ``scaletrain.step`` range on the calling (main) thread.
Every profiler event on that thread is put in one phase by its name:

- ``data``: the data loader's ``__next__`` (``enumerate(DataLoader)#...``);
- ``backward``: the autograd engine's functions (``autograd::engine::evaluate_function: ...``);
- ``optimizer``: ``Optimizer.step`` / ``zero_grad`` and the ``_foreach`` kernels of clipping;
- ``comm_exposed``: the main thread blocked in a collective or point-to-point call (``c10d::...``,
  ``_c10d_functional::...`` (DTensor: the launch and ``wait_tensor``),
  ``gloo:...``, ``record_param_comms``) — communication nothing else overlaps;
- ``forward``: every other top-level operator (the model's forward and the loss).

Collectives nested inside another phase (a TP all-reduce in the forward, an FSDP all-gather, a
pipeline's send/recv) are taken out of that phase and counted as ``comm_exposed``. ``other`` is
the step's wall time left over (Python between operators, waits the profiler does not name: DDP's
wait for its last bucket happens inside the autograd engine and counts as ``backward``).
``comm_background_s`` is the time collectives ran on gloo's own threads (overlapped or not; a sum,
so it can exceed the step). Units: seconds. The profiler adds a per-operator cost, so the step it
measures is slower than an unprofiled one; the shares are what it is meant for.
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

from torch.autograd.profiler import record_function
from torch.profiler import ProfilerActivity, profile

PHASES = ("forward", "backward", "optimizer", "data", "comm_exposed", "other")
"""The phases of :func:`profile_step`'s result, in the order they are drawn."""
MARKER = "scaletrain.step"
_COMM = ("c10d::", "_c10d_functional::", "c10d_functional::", "gloo:", "record_param_comms", "nccl:")

T = TypeVar("T")


def phase_of(name: str) -> str:
    """The phase an event of this name belongs to (module docstring)."""
    if name.startswith(_COMM):
        return "comm_exposed"
    if "DataLoader" in name:
        return "data"
    if name.startswith("autograd::engine::evaluate_function"):
        return "backward"
    if name.startswith(("Optimizer.", "aten::_foreach")):
        return "optimizer"
    return "forward"


def _union(intervals: list[tuple[int, int]]) -> int:
    """Total length of the union of ``intervals`` (same units as given)."""
    total, end = 0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total, end = total + (b - a), b
        elif b > end:
            total, end = total + (b - end), b
    return total


def breakdown(events: list[tuple[str, int, int, int]], main_thread: int, step: tuple[int, int]) -> dict[str, float]:
    """Seconds per phase of one step from ``(name, thread, start_us, end_us)`` events (module docstring).

    ``step``: the marker's (start_us, end_us) on ``main_thread``. The phases (without
    ``comm_background_s``) sum to the step's wall time.
    """
    main = sorted((e for e in events if e[1] == main_thread and e[0] != MARKER and step[0] <= e[2] <= step[1]),
                  key=lambda e: (e[2], -e[3]))
    comm = [(a, b) for name, _, a, b in main if phase_of(name) == "comm_exposed"]
    us = dict.fromkeys(PHASES, 0.0)
    end = -1
    for name, _, a, b in main:  # top-level events only; nested communication moved to comm_exposed
        if a < end:
            continue
        end = b
        kind = phase_of(name)
        if kind == "comm_exposed":
            continue
        inner = _union([(max(a, c0), min(b, c1)) for c0, c1 in comm if c0 < b and c1 > a])
        us[kind] += (b - a) - inner
    us["comm_exposed"] = float(_union(comm))
    wall = step[1] - step[0]
    us["other"] = max(wall - sum(us[k] for k in PHASES if k != "other"), 0.0)
    background = [(a, b) for name, th, a, b in events if th != main_thread and name.startswith(_COMM)
                  and step[0] <= a <= step[1]]
    out = {k: v / 1e6 for k, v in us.items()}
    out["comm_background_s"] = sum(b - a for a, b in background) / 1e6
    out["step_s"] = wall / 1e6
    return out


def profile_step(fn: Callable[[], T]) -> tuple[T, dict[str, float]]:
    """Run ``fn`` (one training step) under ``torch.profiler``: (its result, :func:`breakdown`)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function(MARKER):
            result = fn()
    rows: list[tuple[str, int, int, int]] = [(e.name, e.thread, int(e.time_range.start), int(e.time_range.end))
                                             for e in prof.events()]
    marker: Any = next(r for r in rows if r[0] == MARKER)
    return result, breakdown(rows, marker[1], (marker[2], marker[3]))

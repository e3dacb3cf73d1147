"""When the loop saves besides its schedule: about every ``train.checkpoint_every_s`` seconds, and
at the step boundary after a SIGINT (Ctrl-C) or SIGTERM (a scheduler's pre-emption).

Why: a run that only saves at its end loses everything to a Ctrl-C. Here the first SIGINT/SIGTERM
only sets a flag; the step in flight finishes, a checkpoint is written and the run stops with
:class:`Interrupted` (exit 130 from the CLI), so ``scaletrain train --out RUN --resume`` continues
exactly where it stopped. A second signal is not caught: it interrupts at once, as before.

Several processes save collectively, so they must agree on the step: the time interval is turned
into a step count once (rank 0's measured step time, broadcast), and a signal seen by any rank is
agreed on with an all-reduce of a flag that is started at one step boundary and read at the next
(under torchrun every rank gets the signal, not necessarily within the same step). The flag travels
on a gloo group of its own and is never waited for in the step it was sent: no blocking collective
is added to a step (issue: no per-step collective outside the plan); the price is one step of delay
before the stop.
"""

from __future__ import annotations

import signal
import statistics
import threading
from typing import Any

import torch
import torch.distributed as dist

_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_MEASURED_STEPS = 3
"""Steps timed before the interval is fixed (the first, with its warm-up, is left out)."""


class Interrupted(KeyboardInterrupt):
    """The run stopped at a step boundary after a signal, its checkpoint written (message: where)."""


class Guard:
    """Decides, at each step boundary, whether to save and whether to stop (same answer on every rank)."""

    def __init__(self, every_s: float, world: int, enabled: bool):
        """``every_s``: seconds of training between periodic saves (0 = none); ``enabled``: the run
        can save at all (a run directory, a checkpoint format)."""
        self.every_s, self.world, self.enabled = every_s, world, enabled
        self.interval: int | None = None
        """Steps between periodic saves, fixed after :data:`_MEASURED_STEPS` steps (0 = none)."""
        self.times: list[float] = []
        self.signum: int | None = None
        self._old: dict[int, Any] = {}
        self._group: Any = None
        self._pending: tuple[Any, torch.Tensor] | None = None
        """The flag all-reduce started at the previous step boundary: (work handle, its tensor)."""

    def install(self) -> None:
        """Catch SIGINT/SIGTERM until :meth:`restore` (main thread only: Python's rule for handlers).
        Collective with several processes: the agreement gets a gloo group of its own, so that its
        per-step flag never interleaves with a runtime's own traffic on the default group."""
        if self.enabled and self.world > 1 and self._group is None:
            self._group = dist.new_group(backend="gloo")
        if self.enabled and threading.current_thread() is threading.main_thread():
            self._old = {s: signal.signal(s, self._on_signal) for s in _SIGNALS}

    def restore(self) -> None:
        """Put back the handlers found by :meth:`install`; wait for a flag still in flight (every rank
        started it, so every rank waits for it and no collective is left behind)."""
        if self._pending is not None:
            self._pending[0].wait()
            self._pending = None
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old = {}

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.signum = signum
        signal.signal(signum, self._old.get(signum, signal.SIG_DFL))  # a second one interrupts at once

    def _agreed(self, flag: bool) -> bool:
        """Any rank's flag as of the previous boundary (this boundary's own, with one process)."""
        if self.world == 1:
            return flag
        from scaletrain.measure.comm import LEDGER

        seen = False
        if self._pending is not None:
            work, prev = self._pending
            work.wait()
            seen = bool(prev.item())
        t = torch.tensor([int(flag)])
        with LEDGER.paused():  # not the run's traffic
            self._pending = (dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._group, async_op=True), t)
        return seen

    def _fix_interval(self) -> None:
        step_s = statistics.median(self.times[1:]) if len(self.times) > 1 else self.times[0]
        n = torch.tensor([max(1, round(self.every_s / max(step_s, 1e-9))) if self.every_s > 0 else 0])
        if self.world > 1:
            from scaletrain.measure.comm import LEDGER

            with LEDGER.paused():
                dist.broadcast(n, src=0, group=self._group)
        self.interval = int(n.item())

    def stop(self) -> bool:
        """True when a signal arrived (on any rank): save, then stop."""
        return self.enabled and self._agreed(self.signum is not None)

    def periodic(self, step: int, step_s: float) -> bool:
        """True when ``step`` is due for a periodic save; ``step_s``: seconds the step took."""
        if not self.enabled or self.every_s <= 0:
            return False
        if self.interval is None:
            self.times.append(step_s)
            if len(self.times) < _MEASURED_STEPS:
                return False
            self._fix_interval()
        return bool(self.interval) and step % self.interval == 0  # type: ignore[operator]

    def interrupted(self, step: int, out_dir: Any) -> Interrupted:
        """The exception that ends the run after the save of ``step`` in run directory ``out_dir``."""
        name = signal.Signals(self.signum).name if self.signum else "a signal on another rank"
        return Interrupted(f"{name}: stopped after step {step}, checkpoint saved in {out_dir}/checkpoints; continue "
                           f"with: scaletrain train --out {out_dir} --resume")

"""Divergence detection in every precision: end a run whose loss has left the numbers, before it writes a
checkpoint of garbage.

- fp32 / bf16: a NaN or infinite loss ends the run at once (nothing recovers from it: the weights or the
  activations are already non-finite).
- fp16 with dynamic loss scaling: an overflow is normal (the scaler skips that step and halves its scale), so
  one bad step is not divergence. The run ends after :data:`FP16_PATIENCE` consecutive steps that the scaler
  skipped or whose loss was not finite — by then the scale has been halved that many times, from torch's
  initial 2^16 down to 2^-8, so the overflow is no matter of scale — or when a step that would write a
  checkpoint (a ``checkpoint_every`` step, the last one) has a non-finite loss: the checkpoint would hold it.

The error says the step and what to try (lower lr, gradient clipping, bf16), exit code 2 by the CLI.
"""

from __future__ import annotations

import math
from typing import Any

from scaletrain.errors import ConfigError

FP16_PATIENCE = 24
"""Consecutive skipped or non-finite fp16 steps that end a run (the scale falls by 2^24)."""


class DivergenceGuard:
    """Watches each step's loss (and, under fp16, whether the loss scaler skipped it); raises on divergence."""

    def __init__(self, precision: str, lr: float, grad_clip: float, scaler: Any = None) -> None:
        self.precision, self.lr, self.grad_clip = precision, lr, grad_clip
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        self.bad = 0
        self._scale = self._current_scale()

    def _current_scale(self) -> float | None:
        return float(self.scaler.get_scale()) if self.scaler is not None else None

    def check(self, step: int, loss: float, saves: bool = False, loss_agreed: bool = True) -> None:
        """After optimizer step ``step`` (1-based) with mean loss ``loss``; ``saves``: a checkpoint follows it;
        ``loss_agreed``: every rank holds this same ``loss`` (several processes average it only on logging
        and saving steps): otherwise only fp16's skipped steps, which every rank sees alike, are counted."""
        finite = math.isfinite(loss) or not loss_agreed
        if self.scaler is None:
            if not finite:
                raise self._error(step, f"loss {loss}")
            return
        scale, self._scale = self._scale, self._current_scale()
        skipped = scale is not None and self._scale is not None and self._scale < scale
        self.bad = self.bad + 1 if (skipped or not finite) else 0
        if self.bad >= FP16_PATIENCE:
            raise self._error(step, f"{self.bad} steps in a row skipped for overflow by fp16 loss scaling (scale "
                                    f"{self._scale:g}, loss {loss})")
        if saves and not finite:
            raise self._error(step, f"loss {loss} at a checkpoint step")

    def _error(self, step: int, what: str) -> ConfigError:
        tips = [f"lower optim.lr={self.lr:g}"]
        tips.append("enable clipping, e.g. optim.grad_clip=1.0" if not self.grad_clip else
                    f"clip harder than optim.grad_clip={self.grad_clip:g}")
        if self.precision == "fp16":
            tips.append("use train.precision=bf16 (fp32's range, no loss scaling)")
        elif self.precision == "bf16":
            tips.append("use train.precision=fp32")
        return ConfigError(f"training diverged at step {step} ({what}); no checkpoint written for it: "
                           + ", ".join(tips))

"""Your code in the loop: ``Trainer(..., callbacks=[...], eval_fn=...)``.

A callback is any object with some of these methods (a missing one is skipped), called on rank 0
only unless the callback has ``all_ranks = True``:

- ``on_step_end(trainer, step, metrics)``: after every optimizer step; ``metrics`` holds ``loss``
  (rank-averaged, nats per target), ``lr`` and ``grad_norm`` of that step.
- ``on_eval(trainer, step, metrics)``: after every evaluation, with the validation metrics
  (``val_loss``, ``val_ppl`` or ``val_acc``, and ``eval_fn``'s).
- ``on_checkpoint(trainer, step, path)``: after a checkpoint is saved (``path``: its file or directory).

``eval_fn(model, batches) -> dict[str, float]``: the user's own metric, run on every rank at every
evaluation (the forward may be collective under ZeRO-3/TP), with ``model`` the module that runs the
forward and ``batches`` this rank's validation batches ``(x, y)`` on the device (the same
``train.eval_batches`` the built-in loss sees). Each value is averaged over ranks and logged in the
validation row of metrics.jsonl (and every ``train.loggers`` sink) next to ``val_loss``.

A callback or ``eval_fn`` that raises ends the run with one line naming it, the hook and the step
(a :class:`~scaletrain.errors.UserError`: exit 2 from the CLI, an exception from Python).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from scaletrain.errors import UserError, one_line

HOOKS = ("on_step_end", "on_eval", "on_checkpoint")


def _name(obj: Any) -> str:
    return getattr(obj, "__name__", None) or type(obj).__name__


class Hooks:
    """The callbacks and ``eval_fn`` of one trainer, called with errors turned into one line."""

    def __init__(self, callbacks: Iterable[Any] | None, eval_fn: Callable[..., dict[str, float]] | None,
                 rank: int) -> None:
        self.callbacks, self.eval_fn, self.rank = list(callbacks or []), eval_fn, rank
        for cb in self.callbacks:
            if not any(callable(getattr(cb, h, None)) for h in HOOKS):
                raise UserError(f"callback {_name(cb)} has none of the methods {', '.join(HOOKS)}")
        if eval_fn is not None and not callable(eval_fn):
            raise UserError(f"eval_fn must be callable (model, batches) -> dict of floats, got {_name(eval_fn)}")

    def call(self, hook: str, trainer: Any, step: int, arg: Any) -> None:
        """Run ``hook`` of every callback that has it (on this rank)."""
        for cb in self.callbacks:
            fn = getattr(cb, hook, None)
            if fn is None or (self.rank != 0 and not getattr(cb, "all_ranks", False)):
                continue
            try:
                fn(trainer, step, arg)
            except Exception as e:  # noqa: BLE001 - the user's code: any failure ends the run in one line
                raise UserError(f"callback {_name(cb)}.{hook} raised {type(e).__name__} at step {step}: "
                                f"{one_line(e)[:200]}") from None

    def user_metrics(self, model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], step: int,
                     mean: Callable[[list[float]], list[float]]) -> dict[str, float]:
        """``eval_fn``'s metrics, averaged over ranks with ``mean`` (a collective: every rank calls it)."""
        if self.eval_fn is None:
            return {}
        try:
            got = self.eval_fn(model, batches)
            if not isinstance(got, dict) or not all(isinstance(v, (int, float, torch.Tensor)) for v in got.values()):
                raise TypeError(f"returned {type(got).__name__}, not a dict of numbers")
            values = {str(k): float(v) for k, v in sorted(got.items())}
        except Exception as e:  # noqa: BLE001
            raise UserError(f"eval_fn {_name(self.eval_fn)} raised {type(e).__name__} at step {step}: "
                            f"{one_line(e)[:200]}") from None
        return dict(zip(values, mean(list(values.values())))) if values else {}

"""``memory.remat = {method, budget}`` in ``scaletrain train``: the Trainer's forward/backward.

:func:`remat_forward_backward` returns the function the Trainer calls per micro-batch
(``fb(x, y, weight) -> unscaled loss``, gradients of ``loss * weight`` accumulated into
``.grad``, fp16 loss scaling applied) that runs the configured schedule over the model's Chain.
The schedule is planned once per batch shape, on a Profile estimated with fake tensors at the
run's precision (nothing allocated), and kept in ``fb.schedules``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from scaletrain.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from scaletrain.train.trainer import Trainer


def remat_forward_backward(trainer: "Trainer") -> Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]:
    from scaletrain.chain import to_chain
    from scaletrain.techniques.remat import METHODS, parse_bytes, run_schedule, solve
    from scaletrain.techniques.remat.fromtrace import estimate_graph

    cfg = trainer.cfg.memory.remat
    if cfg.method not in METHODS:
        raise ConfigError(f"memory.remat.method={cfg.method!r}; allowed: {', '.join(METHODS)}")
    budget = parse_bytes(cfg.budget)
    if getattr(trainer, "world", 1) > 1:
        # The executor runs the plain model's blocks, outside the data-parallel wrapper whose
        # backward hooks synchronise gradients: refuse rather than train unsynchronised.
        raise ConfigError("memory.remat is not supported with data parallelism yet (world size > 1)")
    chain = to_chain(trainer.model)
    schedules: dict = {}

    def fb(x: torch.Tensor, y: torch.Tensor, weight: float) -> torch.Tensor:
        key = (tuple(x.shape), x.dtype, tuple(y.shape), y.dtype)
        if key not in schedules:
            graph, _ = estimate_graph(chain, x, target=y, loss_fn=trainer.loss_fn,
                                      precision=trainer.cfg.train.precision)
            schedules[key] = solve(graph, budget, cfg.method)
        losses: list[torch.Tensor] = []

        def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            loss = trainer.loss_fn(out, target)
            losses.append(loss.detach())
            return trainer.scaler.scale(loss * weight)

        with trainer.autocast():
            run_schedule(chain, schedules[key], x, loss_fn, y)
        return losses[0]

    fb.schedules = schedules  # type: ignore[attr-defined]
    return fb

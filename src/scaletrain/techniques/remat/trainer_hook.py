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
    strategy = getattr(trainer, "parallel", None)
    if strategy is not None and strategy.name == "pipeline":
        # the pipeline runs a schedule inside each of its stages (PipelineRuntime's remat) and
        # never calls the per-micro-batch function
        return trainer.plain_forward_backward
    if strategy is not None and strategy.name not in ("single", "zero"):
        # The executor runs the plain model's blocks, outside a wrapper (DDP, FSDP) whose forward
        # and backward hooks synchronise gradients: refuse rather than train unsynchronised. ZeRO 1/2
        # reduce from per-parameter gradient hooks, which fire under any schedule.
        raise ConfigError(f"memory.remat.method={cfg.method} runs with one process or parallel.zero=1/2, not "
                          f"with the {strategy.name} strategy")
    chain = to_chain(trainer.model)
    if strategy is not None and strategy.name == "zero":  # one backward per block: shared parameters
        counts: dict[int, int] = {}                      # accumulate once per block using them
        for block in chain.blocks:
            for q in {id(q) for q in block.parameters()}:
                counts[q] = counts.get(q, 0) + 1
        strategy.expect_accumulations(counts)
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

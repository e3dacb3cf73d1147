"""The pipeline's apply face in one call, for the trainer: config values → a running pipeline.

``parallel.pp``, ``parallel.dp``, ``parallel.schedule``, ``parallel.microbatches`` and
``parallel.virtual`` map one to one onto :func:`pipeline_runtime`'s arguments. The stage
split is the memory-aware partitioner's (:func:`.partition.partition`) over the fake-tensor
estimate of the model (:func:`scaletrain.measure.estimate.estimate_chain`: nothing allocated),
or an equal-blocks split with ``balance="equal"``. ``parallel.tp`` > 1 shards the stages with
tensor parallelism (:mod:`.tensor_parallel`): the split and the boundary specs are computed on the
model before it is sharded.
"""

from __future__ import annotations

from typing import Callable, ContextManager

import torch
import torch.distributed as dist
from torch import nn

from scaletrain.chain import to_chain
from scaletrain.errors import UserError

from .partition import equal_bounds, partition
from .runtime import LossFn, PipelineRuntime


def default_virtual(schedule: str, virtual: int | None) -> int:
    """Stages per rank: 2 for ``interleaved`` unless given, 1 otherwise."""
    return virtual if virtual else (2 if schedule == "interleaved" else 1)


def example_input(model: nn.Module, micro_batch: int, seq_len: int | None = None) -> torch.Tensor:
    """One micro-batch's input as a meta tensor, from the reference models' ``input_spec``."""
    from scaletrain.models.adapters import input_spec  # the model's own, or its adapter's

    return input_spec(model, micro_batch, seq_len)


def stage_bounds(model: nn.Module, example: torch.Tensor, *, pp: int, schedule: str, microbatches: int,
                 virtual: int = 1, loss_fn: LossFn | None = None, balance: str = "profile",
                 memory_limit_bytes: float = float("inf")) -> list[int]:
    """Block boundaries of the pp × virtual stages: ``"profile"`` (minimise the slowest stage of
    the estimated profile under the memory limit) or ``"equal"`` (equal block counts)."""
    chain = to_chain(model)
    S = pp * virtual
    if balance == "equal":
        return equal_bounds(len(chain), S)
    if balance != "profile":
        raise UserError(f"pipeline balance must be 'profile' or 'equal' (got {balance!r})")
    from scaletrain.measure.estimate import estimate_chain

    prof = estimate_chain(chain, example, loss_fn=loss_fn)
    return partition(prof, pp, schedule, microbatches, virtual, memory_limit_bytes=memory_limit_bytes).bounds


def pipeline_runtime(model: nn.Module, *, pp: int, dp: int, schedule: str, microbatches: int, micro_batch: int,
                     loss_fn: LossFn, seq_len: int | None = None, virtual: int | None = None,
                     device: torch.device | str | None = None, timeout_s: float = 300.0, balance: str = "profile",
                     forward_context: Callable[[], ContextManager] | None = None,
                     record_events: bool = False, remat: str = "none",
                     remat_budget: int | str | list[int] | None = None, remat_precision: str = "fp32",
                     tp: int = 1, sequence_parallel: bool = False,
                     loss_scale: Callable | None = None, stage_aux: Callable | None = None,
                     ep: int = 1) -> PipelineRuntime:
    """Build the :class:`PipelineRuntime` for this process (call on every process of the job).

    ``micro_batch`` is samples per micro-batch: ``global_batch = dp × microbatches × micro_batch``.
    Events are off by default (recording adds a barrier per step and, on CUDA, a synchronize per pass).
    ``remat``, ``remat_budget``, ``remat_precision``: rematerialization inside every stage
    (``memory.remat.*``; see :class:`PipelineRuntime`). ``tp`` > 1: tensor parallelism inside
    the stages over the world mesh's tp dimension (world = pp × dp × tp; the model is sharded in place).
    ``stage_aux``: a stage's own loss term (``model.aux_loss(part)``, see :class:`PipelineRuntime`);
    ``ep`` > 1: expert parallelism inside the stages (:mod:`.experts`; the model's experts sliced in place).
    """
    v = default_virtual(schedule, virtual)
    example = example_input(model, micro_batch, seq_len)
    bounds = stage_bounds(model, example, pp=pp, schedule=schedule, microbatches=microbatches, virtual=v,
                          loss_fn=loss_fn, balance=balance)
    extra: dict = {}
    dev = torch.device(device) if device is not None else next(model.parameters()).device
    world = None
    if dist.is_initialized() and dist.get_world_size() > 1:  # the job's one mesh: every group is its slice
        from . import p2p

        world = p2p.world(pp=pp, dp=dp, tp=tp, ep=ep, device_type=dev.type)
    if (tp > 1 or ep > 1) and remat != "none":  # planned on the whole model, before TP shards it / EP slices experts
        from .stage import stage_remat

        y = torch.zeros(example.shape, dtype=torch.long, device="meta") if seq_len else None
        extra["remat_plans"] = stage_remat(model, bounds, example, remat, remat_budget, loss_fn=loss_fn, target=y,
                                           precision=remat_precision)
    if tp > 1:
        from . import tensor_parallel as tpp
        from .stage import TensorSpec, boundary_specs

        specs = boundary_specs(to_chain(model).blocks, bounds, example, dev)
        if sequence_parallel:  # stage boundaries carry this rank's s / tp positions
            specs = [specs[0], *(TensorSpec(torch.Size((sp.shape[0], sp.shape[1] // tp, *sp.shape[2:])), sp.dtype)
                                 for sp in specs[1:-1]), specs[-1]]
        extra["specs"] = specs
        extra["tp"] = tpp.setup(model, world, sequence_parallel=sequence_parallel)
        extra["backward_context"] = tpp.backward_context
        loss_fn = tpp.vocab_parallel_loss(loss_fn)
    if ep > 1:  # after the fake-tensor passes above (they see the whole experts), before the plan's groups
        from .experts import apply_stage_experts

        apply_stage_experts(model, world)
    rt = PipelineRuntime(model, schedule, microbatches, pp=pp, dp=dp, virtual=v, bounds=bounds, loss_fn=loss_fn,
                         example_input=example, device=device, timeout_s=timeout_s, forward_context=forward_context,
                         record_events=record_events, remat=remat, remat_budget=remat_budget,
                         remat_precision=remat_precision, loss_scale=loss_scale, stage_aux=stage_aux, ep=ep,
                         **extra)
    from .tensor_parallel import free_nonlocal

    free_nonlocal(model, rt.plan.local_tensors)  # keep only this rank's stages (their TP shards)
    return rt

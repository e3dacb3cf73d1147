"""Apply a :class:`~scaletrain.plan.Plan` to a model: the one runtime stack, in a fixed order.

:func:`build_runtime` is the only place a plan becomes running code. It first asks the
compatibility table (:mod:`.compat`), then applies the techniques in this order — the order
matters, and each step says why:

1. **pipeline stages** (``pp``): everything below then happens per stage, inside the pipeline
   runtime (:mod:`.pipeline`), which cuts the Chain and owns the schedule;
2. **tensor / sequence, context and expert parallelism** (:func:`.mesh.apply_model_parallel`): they
   replace the model's modules and parameters (DTensors, expert slices), so everything after
   them — remat, data parallelism, the optimizer — must see the sharded model;
3. **rematerialization** (:mod:`.remat.tree`): the Chain's blocks under nested activation
   checkpoints, planned on the estimated step of one micro-batch; it wraps *modules*, so the data
   parallelism applied next sees its forwards (DDP's reducer, FSDP2's unshard hooks); then
   **torch.compile** (``train.compile``, :mod:`.compile`) compiles each Chain block in place, after
   TP and remat and before data parallelism, as torchtitan does;
4. **data parallelism** over the data-parallel ranks: torch DDP (plain data parallelism, ZeRO-0,
   gradient compression), :class:`.data_parallel.zero.GradSync` (ZeRO-0 on a model-parallel mesh,
   ZeRO-1/2 everywhere) or torch FSDP2 (ZeRO-3, HSDP) around the module step 3 produced;
5. **the optimizer and its placement**: built by the runtime over what it updates (proxies of owned
   rows, a stage's blocks, host-side masters) — the trainer hands over the builder;
6. **the per-micro-batch function** (``ctx.forward_backward``): the runtime's plain forward, loss and
   backward, or a remat executor (``ilp``/``dtr`` schedules that are not nests of checkpoints),
   under 8-bit activation compression when asked.

Offloading (one process) has a runtime of its own that places parameters, optimizer states and
activations itself (:mod:`.offload`).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from scaletrain.errors import ConfigError, UserError
from scaletrain.plan import Plan
from scaletrain.techniques import compat
from scaletrain.techniques import compile as compile_face
from scaletrain.techniques.optim.zero_order import forward_backward as zero_order_step
from scaletrain.techniques.optim.zero_order import is_zero_order
from scaletrain.techniques.runtime import RunContext, Strategy

ForwardBackward = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]


def build_runtime(plan: Plan, model: nn.Module, ctx: RunContext, facts: compat.Facts) -> Strategy:
    """The runtime of ``plan`` for this process; sets ``ctx.forward_backward``. Collective when
    several processes run (every rank calls it with the same plan)."""
    compat.check(plan, facts)
    if plan.pp > 1:  # 1. pipeline stages: the pipeline runtime applies 2-4 per stage
        from scaletrain.techniques.pipeline.strategy import PipelineStrategy

        rt: Strategy = PipelineStrategy.build(model, plan, ctx)
        ctx.forward_backward = _plain(rt, ctx)  # (unused: the schedule runs its own passes)
        return rt
    if plan.offload.active and ctx.world == 1:  # one process: the offload runtime places everything itself
        from scaletrain.techniques.offload.chunk_strategy import ChunkStrategy
        from scaletrain.techniques.offload.strategy import OffloadStrategy

        rt = (ChunkStrategy if plan.offload.plan == "chunks" else OffloadStrategy).build(model, plan, ctx)
        ctx.forward_backward = _plain(rt, ctx)
        return rt
    if ctx.world > 1:
        _broadcast(model)  # every replica starts from rank 0's weights (init is seeded alike; this makes it certain)
    choice = _plan_remat(plan, model, ctx)  # 3a. planned on the whole model's estimate, before it is sharded
    mp, counts = None, None
    if ctx.world > 1 and (plan.tp > 1 or plan.cp > 1 or plan.ep > 1 or plan.zero in (1, 2, 3) or plan.hsdp):
        from scaletrain.techniques.cost import local_param_counts
        from scaletrain.techniques.mesh import apply_model_parallel, build_mesh

        try:
            counts = local_param_counts(model, tp=plan.tp, ep=plan.ep)  # of the unsharded model
        except (AttributeError, KeyError, TypeError) as e:  # a layout the GPT-2 cost faces do not describe
            counts = None
            _no_prediction(ctx, e)
        try:
            mp = build_mesh(world=ctx.world, tp=plan.tp, cp=plan.cp, ep=plan.ep,
                            hsdp=plan.hsdp if plan.zero else 0, sequence_parallel=plan.sp,
                            device_type=ctx.device.type)
            apply_model_parallel(model, mp)  # 2. TP / SP / CP / EP
        except ConfigError:
            raise
        except UserError as e:
            raise ConfigError(str(e)) from None
    forward_module, executor = _apply_remat(plan, model, ctx, choice)  # 3b. rematerialization
    compile_face.apply(plan, model, ctx)  # 3c. torch.compile per Chain block, in place (DDP/FSDP wrap it next)
    rt = _data_parallel(plan, model, ctx, mp, forward_module)  # 4. data parallelism (5: the runtime's optimizer)
    if mp is not None and counts is not None and hasattr(model, "config") and ctx.task == "lm":
        _predict_mesh(plan, model, ctx, mp, counts, rt, choice)
    ctx.forward_backward = _forward_backward(plan, model, ctx, rt, executor)  # 6.
    return rt


def _broadcast(model: nn.Module) -> None:
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(t.data, src=0)


def _plan_remat(plan: Plan, model: nn.Module, ctx: RunContext) -> Any:
    """The remat choice of the plan (a tree of checkpoints, or a schedule for the executor), planned on
    the fake-tensor estimate of one micro-batch's step of the unsharded model; None without remat."""
    r = plan.remat
    if r.method == "none" and r.blocks == "none":
        return None
    from scaletrain.chain import to_chain
    from scaletrain.techniques.remat.tree import plan_remat

    x, y = ctx.example_batch() if ctx.example_batch is not None else (None, None)
    try:
        choice = plan_remat(to_chain(model), r, x, y, ctx.loss_fn, ctx.precision)
    except UserError as e:
        raise ConfigError(f"memory.remat: {e}") from None
    ctx.log(f"remat: {choice.describe()}")
    return choice


def _apply_remat(plan: Plan, model: nn.Module, ctx: RunContext, choice: Any) -> tuple[nn.Module, Any]:
    """(the module that runs the forward, an op-by-op schedule executor or None)."""
    if plan.remat.selective != "none":  # the attention core of every block not recomputed whole
        from scaletrain.chain import to_chain
        from scaletrain.techniques.remat.selective import apply_selective
        from scaletrain.techniques.remat.tree import recompute_counts

        blocks = list(to_chain(model).blocks)
        whole = recompute_counts(choice.tree, len(blocks)) if choice is not None and choice.tree else [0] * len(blocks)
        n = apply_selective([b for b, k in zip(blocks, whole) if k == 0], allow_none=True)
        ctx.log(f"remat: attention core recomputed in {n} blocks (selective)")
    if choice is None:
        return model, None
    if choice.tree is None:
        return model, choice
    from scaletrain.chain import to_chain

    return choice.module(to_chain(model)), None


def _data_parallel(plan: Plan, model: nn.Module, ctx: RunContext, mp: Any, forward_module: nn.Module) -> Strategy:
    from scaletrain.techniques.precision import MasterWeightsStrategy, param_dtype

    stored = param_dtype(plan.params_dtype)
    if ctx.world == 1:
        rt: Strategy = MasterWeightsStrategy(model, stored) if stored is not None else Strategy(model)
        rt.forward_module = forward_module
        return rt
    half = stored or {"bf16": torch.bfloat16, "fp16": torch.float16}.get(plan.precision)
    if mp is None and plan.zero == 0:
        from scaletrain.techniques.data_parallel.ddp import DDPStrategy

        o = plan
        return DDPStrategy(model, ctx.rank, ctx.world, ctx.device, bucket_mb=plan.bucket_mb,
                           compression=o.compression, compression_rank=plan.compression_rank,
                           topk_ratio=plan.topk_ratio, compression_warmup_steps=plan.compression_warmup_steps,
                           seed=ctx.seed, module=forward_module)
    from scaletrain.techniques.spmd import MeshRuntime

    # plain ZeRO-1/2 keeps ZeRO's mixed precision (16-bit parameters and gradients, fp32 masters of the
    # owned rows) under 16-bit autocast, as DeepSpeed does; on a model-parallel mesh parameters stay fp32
    plain = plan.tp == plan.cp == plan.ep == 1
    if plan.zero == 3 and mp is None:  # fsdp_group=auto: the fastest grouping that fits this rank's memory
        plan = plan.with_(fsdp_group=_fsdp_group(plan, model, ctx))
    # several processes with memory.offload.optimizer=host: each rank offloads its own shard (ZeRO-Offload)
    rt = MeshRuntime(model, mp, ctx, zero=plan.zero, bucket_mb=plan.bucket_mb, forward_module=forward_module,
                     fsdp_group=plan.fsdp_group,
                     param_dtype=half if (plain and plan.zero in (1, 2)) or plan.zero == 3 else stored,
                     offload=plan.offload.active)
    if plan.zero or plan.tp > 1:
        _warn_sharded_optimizer(ctx, plan, rt.describe())
    return rt


def _fsdp_group(plan: Plan, model: nn.Module, ctx: RunContext) -> str:
    """``parallel.fsdp_group`` as the run forms it (:func:`.data_parallel.grouping.runtime_fsdp_group`),
    said once on rank 0."""
    import os

    from scaletrain.techniques.data_parallel.grouping import runtime_fsdp_group

    group, note = runtime_fsdp_group(plan, model, world=ctx.world, dp=ctx.dp_world, micro_batch=ctx.micro_batch,
                                     accum=ctx.accum, seq=ctx.seq_len or 0, device=ctx.device,
                                     local_ranks=int(os.environ.get("LOCAL_WORLD_SIZE", ctx.world)))
    if note and ctx.rank == 0:
        ctx.log(note)
    return group


def _predict_mesh(plan: Plan, model: nn.Module, ctx: RunContext, mp: Any, counts: dict[str, int], rt: Any,
                  choice: Any) -> None:
    """Traffic per step and per-rank model states of a mesh run, from the cost faces (logged next to
    the measurement: ``predicted_*`` keys of the metrics rows)."""
    from scaletrain.techniques.cost import mesh_predictions
    from scaletrain.techniques.remat.tree import recompute_counts

    recomputes = recompute_counts(choice.tree, choice.schedule.n_nodes if choice.schedule is not None
                                  else len(choice.tree)) if choice is not None and choice.tree is not None else None
    try:
        rt.predictions = mesh_predictions(model.config, mp, stage=plan.zero, micro_batch=ctx.micro_batch,
                                          accum=ctx.accum, seq=ctx.seq_len or 1, counts=counts,
                                          grad_clip=ctx.grad_clip > 0, world=ctx.world,
                                          optim=(plan.optimizer, [e.local_shape() for e in rt.entries],
                                                 ctx.optim_hyper), recomputes=recomputes,
                                          kept=getattr(getattr(rt, "sync", None), "kept", 0))
    except (AttributeError, KeyError, TypeError) as e:  # a model the GPT-2 cost faces do not describe
        rt.predictions = {}
        _no_prediction(ctx, e)


def _no_prediction(ctx: RunContext, e: Exception) -> None:
    """Say once (rank 0) that this run logs no predicted traffic / model states, and why — never a silent
    empty prediction. Training goes on: the prediction is a check, not a requirement."""
    why = str(e).splitlines()[0][:120] if str(e) else ""
    ctx.log(f"note: no predicted traffic or model-state bytes for this model under this layout (the mesh "
            f"cost faces describe GPT-2-style models: {type(e).__name__}: {why})")


def _warn_sharded_optimizer(ctx: RunContext, plan: Plan, layout: str) -> None:
    if plan.optimizer in ("lamb", "lars", "adafactor", "came"):
        ctx.log(f"warning: optim.name={plan.optimizer} computes per-tensor statistics; under {layout} it sees "
                f"this rank's shard of each tensor, so updates differ from one process")


def _plain(rt: Strategy, ctx: RunContext) -> ForwardBackward:
    return lambda x, y, w: rt.loss_and_backward(ctx, x, y, w)


def _forward_backward(plan: Plan, model: nn.Module, ctx: RunContext, rt: Strategy, executor: Any) -> ForwardBackward:
    """6. The per-micro-batch function: the runtime's own, or an op-by-op schedule (``ilp``/``dtr``)."""
    fb = _plain(rt, ctx)
    if is_zero_order(plan.optimizer):  # two forwards, no backward (compat refuses what needs gradients)
        return zero_order_step(rt.forward_module, ctx)
    if executor is not None:
        fb = executor.forward_backward(model, ctx, rt)
    if plan.activation_compression:
        from scaletrain.techniques.act_compress import compress_activations

        inner = fb

        def fb(x: torch.Tensor, y: torch.Tensor, weight: float) -> torch.Tensor:  # noqa: F811
            with compress_activations(model):  # tensors saved for backward stored 8-bit (ActNN)
                return inner(x, y, weight)

    return fb

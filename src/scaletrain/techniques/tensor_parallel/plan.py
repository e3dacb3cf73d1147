"""Megatron tensor parallelism from a family's :class:`~scaletrain.models.spec.ShardingPlan` (data: which
submodules of each layer are column- or row-parallel), on DTensor's styles, the model's own forward
unchanged — e.g. Hugging Face Llama / Mistral (``models/llama``).

The split (Shoeybi et al. 2019): the ``colwise`` submodules of every layer split over their outputs, the
``rowwise`` ones over their inputs (one all-reduce each in the forward); the ``embedding``
vocabulary-parallel (rows; output replicated), the ``head`` column-parallel over the vocabulary with
``loss_parallel``'s cross-entropy (no full logits on any rank), re-tied to the embedding when it was
tied. Everything else (norms, rotary embeddings) is replicated. A model whose attention reshapes with
``-1`` heads (HF's) runs on its ``heads / t`` local heads with nothing of its code replaced.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from scaletrain.errors import UserError
from scaletrain.models.spec import ShardingPlan

from .megatron import _TP_ATTR, TPInfo, _reduce_partial_grads_eagerly, _replicate_leftovers


def check_divides(model: nn.Module, plan: ShardingPlan, t: int) -> None:
    """One-line UserError unless ``t`` divides every config field the plan names."""
    cfg = getattr(model, "config", None)
    sizes = {k: getattr(cfg, k, None) for k in plan.divides}
    sizes = {k: v for k, v in sizes.items() if isinstance(v, int)}
    if any(v % t for v in sizes.values()):
        raise UserError(f"parallel.tp={t} must divide " + ", ".join(f"{k}={v}" for k, v in sizes.items()))


def apply_plan(model: nn.Module, tp_mesh: DeviceMesh, plan: ShardingPlan) -> nn.Module:
    """Shard ``model`` over the 1-D ``tp_mesh`` in place as ``plan`` says (see the module docstring)."""
    t = tp_mesh.size()
    check_divides(model, plan, t)
    embed = model.get_submodule(plan.embedding) if plan.embedding else None
    if embed is not None:
        parallelize_module(model, tp_mesh, {plan.embedding: RowwiseParallel(input_layouts=Replicate(),
                                                                            output_layouts=Replicate())})
    styles = {**{n: ColwiseParallel() for n in plan.colwise}, **{n: RowwiseParallel() for n in plan.rowwise}}
    for layer in model.get_submodule(plan.layers) if plan.layers else [model]:
        parallelize_module(layer, tp_mesh, styles)
    if plan.head:
        head = model.get_submodule(plan.head)
        tied = embed is not None and head.weight is embed.weight
        parallelize_module(model, tp_mesh, {plan.head: ColwiseParallel(output_layouts=Shard(-1),
                                                                       use_local_output=False)})
        if tied:
            head.weight = embed.weight  # re-tie: both Shard(0) over the vocabulary
    _replicate_leftovers(model, tp_mesh)
    _reduce_partial_grads_eagerly(model)
    setattr(model, _TP_ATTR, TPInfo(t, False, tp_mesh, False))
    return model

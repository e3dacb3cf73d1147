"""ZeRO-3 inside pipeline stages (torchtitan's PP + FSDP): :class:`StageFSDP`.

Every local stage replica is sharded with torch's FSDP2 ``fully_shard`` over this pipeline rank's
data-parallel group (the ``dp`` dimension of a (pp, dp) DeviceMesh): one group per block of the
stage whose parameters no other block of the stage uses, then the stage root — what runs the
stage's forward (its ``nn.Sequential``, or the remat wrapper over its blocks) — which takes the rest.

What a step does, as ``torch.distributed.pipelining`` drives FSDP2 (``backward_maybe_with_nosync``
and ``perform_reduce_grad``):

* ``reshard_after_forward=False`` and, for every micro-batch, ``reshard_after_backward=False`` and
  no gradient sync: a block is all-gathered at the step's first forward and stays whole until the
  step's end, so each block is all-gathered *once per step* (not once per micro-batch and pass, which
  is what made ZeRO-3 and pipelines a bad pair), and each micro-batch's gradients accumulate into the
  whole (unsharded) gradient;
* at the rank's update (``OPT``), :meth:`StageFSDP.reduce` runs FSDP2's post-backward on every group
  with sync on: one reduce-scatter per group (averaging over the dp replicas) into the sharded
  gradients, and the unsharded parameters are freed.

Memory consequence (stated, and priced by :func:`scaletrain.techniques.plan_cost`): *during* a step a
stage holds its whole parameters (in the compute dtype) and its whole fp32 gradient as ZeRO-1 does,
on top of the fp32 shards; only *between* steps (and for the optimizer's states and step) is
everything 1/dp. What this buys over ZeRO-1 is the sharded fp32 masters and states, and under
bf16 whole parameters of 2 bytes instead of 4. Traffic per step: one all-gather of the stage's
parameters (compute dtype) and one reduce-scatter of its gradients (fp32), each (N-1)/N of the
padded bytes — ZeRO-1's 2 Psi (N-1)/N under fp32.

Mixed precision (torchtitan's default): bf16/fp16 parameters for the compute, gradients reduced
and accumulated in fp32 (``reduce_dtype``), so the accumulation over micro-batches stays fp32.

GPT-2's tied ``wte`` lives on the first and the last stage: each shards it over its own dp group in
the same row layout (``Shard(0)``, torch.chunk rows), so after both reduce-scatters the runtime
all-reduces the two *sharded* gradients between the holders of the same dp index — the sum of the
reduce-scattered gradients is the reduce-scatter of the sum.

Chimera (two pipelines, each stage on two ranks): each replica is sharded over its own rank's dp group and
reduce-scattered at the update like any stage; the schedule's mid-step GRAD_SYNC is deferred to then, and the
two replicas' shards are summed between their ranks (:meth:`.grads.ParamPlan.reduce`). A parameter two local
stages share (GPT-2's tied embedding, whose first and last stages Chimera puts on one rank) cannot be in two
FSDP units: refused (compat ``pp-zero3-chimera``).

With tensor parallelism (``parallel.tp`` > 1, :mod:`.tensor_parallel`) the stages' parameters are already
TP DTensors on the ``tp`` dimension of the world mesh; ``fully_shard`` on its ``dp`` sub-mesh makes
them DTensors over (dp, tp) — torchtitan's 3-D: TP first, then FSDP per stage. FSDP then shards (and pads)
dim 0 of each TP-local tensor; a TP-replicated parameter's shard lives on every TP rank (counted 1/tp in the
norm), and the tied ``wte``'s shards of one (dp, tp) index are summed between the first and last stage.

The rest of the face is :class:`~scaletrain.techniques.data_parallel.fsdp.FSDPSync`'s: the optimizer
updates proxies sharing storage with the local shards, the norm counts every element once (a tied
shard held by two pipeline ranks counts 1/2 on each), state dicts go through DTensor.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from scaletrain.errors import UserError
from scaletrain.techniques.data_parallel.fsdp import FSDPEntry, FSDPSync, _local


class StageFSDP(FSDPSync):
    """FSDP2 over ``dp_mesh`` of every stage replica of pipeline runtime ``rt`` (see the module doc).

    ``model``: the whole model (its non-local tensors already emptied); every reference to a sharded
    parameter in it is re-pointed at the sharded DTensor, and the runtime's :class:`.grads.ParamPlan`
    is rebound to the new parameters. ``param_dtype``: the compute dtype under 16-bit autocast (None: fp32).
    """

    stage = 3

    def __init__(self, model: nn.Module, rt: Any, dp_mesh: Any, *, param_dtype: torch.dtype | None = None) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        self.model, self.param_dtype, self.dp = model, param_dtype, dp_mesh.size()
        self.reduce_dtype = torch.float32
        mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
        refs = [(mod, name, p) for mod in model.modules() for name, p in mod._parameters.items() if p is not None]
        from .tensor_parallel import is_replicated, local

        T = rt.tp.tp if rt.tp is not None else 1
        # under TP (the world mesh): a TP-replicated parameter's shard is held by every TP rank (counted 1/T
        # in the norm), and FSDP pads the dim 0 of the TP-local tensor
        tp_reps = {id(p): T if T > 1 and is_replicated(p) else 1 for _, _, p in refs}
        tp_shapes = {id(p): tuple(local(p).shape) for _, _, p in refs}
        seen: dict[int, int] = {}
        for rep in rt.replicas.values():
            for p in {id(p): p for p in rep.module.parameters()}.values():
                seen[id(p)] = seen.get(id(p), 0) + 1
        if any(n > 1 for n in seen.values()):
            raise UserError("parallel.zero=3 with pipelines needs each parameter in one stage per rank; here two local "
                            "stages share one (use parallel.zero=1)")
        self.blocks: list[nn.Module] = []
        self.roots: list[nn.Module] = []
        for rep in rt.replicas.values():
            blocks = list(rep.module)
            users: dict[int, int] = {}
            for b in blocks:
                for p in b.parameters():
                    users[id(p)] = users.get(id(p), 0) + 1
            for b in blocks:  # a block whose parameters no other block of the stage uses: one group
                ps = list(b.parameters())
                if ps and all(users[id(p)] == 1 for p in ps):
                    fully_shard(b, mesh=dp_mesh, reshard_after_forward=False, mp_policy=mp)
                    self.blocks.append(b)
            root = rep.remat if rep.remat is not None else rep.module  # what runs the stage's forward
            fully_shard(root, mesh=dp_mesh, reshard_after_forward=False, mp_policy=mp)
            self.roots.append(root)
        self._accumulate()
        # fully_shard registered sharded DTensors in place of the local modules' parameters: point every
        # other reference (the model's view of a tied weight, the runtime's plan) at them too
        new: dict[int, nn.Parameter] = {}
        for mod, name, p in refs:
            q = mod._parameters.get(name)
            if q is not None and q is not p and isinstance(q, DTensor):
                new[id(p)] = q
        for mod, name, p in refs:
            if id(p) in new:
                mod._parameters[name] = new[id(p)]
        rt.plan.rebind(new)
        old = {id(q): p_id for p_id, q in new.items()}  # sharded parameter -> the one it replaced
        holders = {id(t): len(rt.plan.holders[i]) for i, t in enumerate(rt.plan.tensors)}
        self.entries: list[FSDPEntry] = []
        self.tp_shapes: dict[int, tuple[int, ...]] = {}
        """Each sharded parameter's TP-local shape (its whole shape without TP): what FSDP shards over dp."""
        for name, p in model.named_parameters():
            if isinstance(p, DTensor) and p.requires_grad and id(p) in old:
                reps = holders.get(id(p), 1) * tp_reps[old[id(p)]]
                self.entries.append(FSDPEntry(name, p, reps, nn.Parameter(_local(p))))
                self.tp_shapes[id(p)] = tp_shapes[old[id(p)]]
        self.replicate = 1

    # -------------------------------------------------------------- the step
    def _accumulate(self) -> None:
        """Micro-batches accumulate whole gradients and keep whole parameters (no sync, no reshard)."""
        for root in self.roots:
            root.set_is_last_backward(False)  # type: ignore[operator]
            root.set_reshard_after_backward(False)  # type: ignore[operator]
            root.set_requires_gradient_sync(False)  # type: ignore[operator]

    def reduce(self) -> None:
        """At the update: reduce-scatter every group's accumulated gradient into its shard (averaged over
        the dp replicas) and free the whole parameters — FSDP2's post-backward with sync on, run by hand
        as ``torch.distributed.pipelining``'s ``perform_reduce_grad`` does."""
        from torch.distributed.fsdp import fully_shard

        for root in self.roots:
            root.set_is_last_backward(True)  # type: ignore[operator]
            root.set_reshard_after_backward(True)  # type: ignore[operator]
            root.set_requires_gradient_sync(True)  # type: ignore[operator]
            state = fully_shard.state(root)  # type: ignore[attr-defined]
            for st in state._state_ctx.all_states:
                for group in st._fsdp_param_groups:
                    group.post_backward()
            state._root_post_backward_final_callback()
        self._accumulate()

    def reshard(self) -> None:
        """Free the whole parameters (after an evaluation forward, which leaves them gathered)."""
        for m in self.blocks + self.roots:
            m.reshard()  # type: ignore[operator]

    # -------------------------------------------------------------- the faces ZeRO-1's GradSync also has
    def gather_rows(self, e: FSDPEntry, v: torch.Tensor) -> torch.Tensor:
        """A shard-shaped optimizer state as the whole parameter's (collective over the dp group)."""
        return self.state_full(e, v)

    def owned_rows(self, e: FSDPEntry, v: torch.Tensor) -> torch.Tensor:
        """This rank's part of a parameter-shaped state already in the shard's layout: itself."""
        return v

    def padded_shard_elements(self) -> int:
        """Elements of this rank's padded shards (FSDP2 pads dim 0 to a multiple of the dp size): what one
        all-gather or reduce-scatter moves per rank, summed over every group."""
        total = 0
        for e in self.entries:
            shape = self.tp_shapes[id(e.param)]
            rows = shape[0] if shape else 1
            rest = math.prod(shape) // max(rows, 1)
            total += -(-rows // self.dp) * rest
        return total

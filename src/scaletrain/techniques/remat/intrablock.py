"""Rematerialization *inside* one block: an ILP over its aten operator graph, run by PyTorch SAC.

Trace. :func:`trace_block` runs one forward of the block under a ``TorchDispatchMode`` and
records every aten op it dispatches, in order: its overload, its occurrence number among
calls of that overload (the key ``(str(overload), n)`` identifies the op again when the
forward is replayed), the bytes of its tensor outputs (``numel * element_size``, 0 for view /
alias ops, whose outputs share their input's storage), its FLOPs (``torch.utils.flop_counter``'s
per-op formulas; 0 for ops it does not cover) and its input dependencies (which earlier ops
produced its tensor arguments, by storage).

Cost model. An op's recompute time is ``flops / peak_flops + out_bytes / bandwidth`` seconds
(defaults 1e12 FLOP/s and 1e11 B/s, a nominal accelerator; the relative order of plans is
what matters). Memory is the bytes saved for backward by the block beyond its input.

How SAC executes a plan, and what the ILP therefore is. ``torch.utils.checkpoint`` with
``use_reentrant=False`` and ``context_fn=create_selective_checkpoint_contexts(policy)`` runs
the forward once keeping *only* the outputs of ops the policy marks ``MUST_SAVE`` (and the
block's input); in backward it replays the forward once, taking the saved ops' outputs from
the cache and recomputing every other op. In the terms of Checkmate (Jain et al., "Checkmate:
Breaking the Memory Wall with Optimal Tensor Rematerialization", MLSys 2020) that is the
two-stage schedule (stage 1 = forward, stage 2 = one recomputation stage followed by the whole
block's backward) with ``S[2,i]`` = "op i's output is checkpointed" and ``R[2,i] = 1 - S[2,i]``
for every op (SAC replays all unsaved ops; with early stop it may stop sooner, so the
predicted recompute time is an upper bound on what is done). Checkmate's staged formulation
(:mod:`ilp`, O(N^3) variables, one stage per backward) is for the chain of blocks where our
executor can run any stage structure; SAC cannot express multi-stage schedules, so here
the MILP collapses to its stage-2 restriction::

    minimise   Σ_i  t_i (1 - s_i)          (recompute seconds)
    subject to Σ_i  b_i s_i ≤ budget        (saved bytes, the stage-2 start memory)
               s_i ∈ {0,1}, s_i = 0 for view/alias ops and ops with no tensor output

solved with the same ``scipy.optimize.milp`` (HiGHS) builder as :mod:`ilp` (``ilp._Model``) —
unless the block's own autograd already fits the budget (:func:`plain_saved_bytes`, from
``saved_tensors_hooks``): then the plan is "no checkpoint", which recomputes nothing. SAC's cache
may hold outputs plain autograd would not save (it keeps whatever the policy marks), so a budget
between the plain bytes and the keep-everything bytes is best served by no checkpoint at all.
The plan's kept ops get ``MUST_SAVE``, every other op ``PREFER_RECOMPUTE``. Gradients are those
of the plain block (the replayed forward is the same computation; RNG state is preserved by
checkpoint). ``predicted_saved_bytes`` = Σ b_i over kept ops: the storage the SAC cache holds
after the forward (the block input, held by checkpoint in any case, is not counted).
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from scaletrain.errors import UserError
from scaletrain.techniques.remat.ilp import _Model
from scaletrain.techniques.remat.schedule import parse_bytes

PEAK_FLOPS = 1e12
BANDWIDTH = 1e11


@dataclass
class OpNode:
    key: tuple[str, int]          # (aten overload, occurrence within the forward)
    out_bytes: int                # bytes of new storage its outputs hold (0 for views)
    flops: int
    preds: list[int]              # indices of earlier ops whose outputs it reads
    is_view: bool
    time_s: float = 0.0

    @property
    def candidate(self) -> bool:
        return not self.is_view and self.out_bytes > 0


@dataclass
class BlockPlan:
    ops: list[OpNode]
    budget_bytes: int
    kept: frozenset                 # keys of ops whose outputs are saved (MUST_SAVE)
    predicted_saved_bytes: int
    predicted_recompute_flops: int
    predicted_recompute_time_s: float
    status: str = ""
    meta: dict = field(default_factory=dict)
    no_checkpoint: bool = False
    """True when the block's own autograd fits the budget: plain autograd then keeps what it needs
    and recomputes nothing, which no SAC plan beats (SAC replays every op it does not save)."""


def _flop_registry():
    from torch.utils.flop_counter import flop_registry
    return flop_registry


class _Recorder(TorchDispatchMode):
    def __init__(self, peak_flops: float, bandwidth: float):
        super().__init__()
        self.ops: list[OpNode] = []
        self.count: dict[str, int] = {}
        self.producer: dict[int, int] = {}  # storage data_ptr -> op index
        self.reg = _flop_registry()
        self.pf, self.bw = peak_flops, bandwidth

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = str(func)
        n = self.count.get(name, 0)
        self.count[name] = n + 1
        ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        preds = sorted({self.producer[t.untyped_storage().data_ptr()] for t in ins
                        if t.untyped_storage().data_ptr() in self.producer})
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        in_st = {t.untyped_storage().data_ptr() for t in ins}
        is_view = bool(func.is_view) or any(t.untyped_storage().data_ptr() in in_st for t in outs)
        nbytes = 0 if is_view else sum(t.untyped_storage().nbytes() for t in outs)
        flops = 0
        if func.overloadpacket in self.reg:
            try:
                flops = int(self.reg[func.overloadpacket](*args, **kwargs, out_val=out))
            except Exception:  # noqa: BLE001 - formula not applicable to this call: count 0
                flops = 0
        idx = len(self.ops)
        self.ops.append(OpNode((name, n), nbytes, flops, preds, is_view,
                               flops / self.pf + nbytes / self.bw))
        for t in outs:
            self.producer.setdefault(t.untyped_storage().data_ptr(), idx)
        return out


def _fresh_inputs(example_input) -> tuple:
    """The block's inputs as a tuple of detached copies (floating ones requiring grad, as in training)."""
    inputs = example_input if isinstance(example_input, tuple) else (example_input,)
    return tuple(t.detach().requires_grad_(t.is_floating_point()) if isinstance(t, torch.Tensor) else t
                 for t in inputs)


def trace_block(block: nn.Module, example_input, peak_flops: float = PEAK_FLOPS,
                bandwidth: float = BANDWIDTH) -> list[OpNode]:
    """The aten ops of one forward of ``block`` (see the module docstring)."""
    # traced with autograd on, as in training (some ops, e.g. attention, pick other kernels
    # under no_grad), on detached copies so nothing leaks into the caller's graph
    inputs = _fresh_inputs(example_input)
    rec = _Recorder(peak_flops, bandwidth)
    with torch.enable_grad(), rec:
        block(*inputs)
    if not rec.ops:
        raise UserError("the block dispatched no aten ops")
    return rec.ops


def plain_saved_bytes(block: nn.Module, example_input) -> int:
    """Bytes plain autograd keeps for ``block``'s backward beyond its input and parameters: the
    distinct storages of the tensors it saves (``saved_tensors_hooks``), one forward."""
    inputs = _fresh_inputs(example_input)
    skip = {t.untyped_storage().data_ptr() for t in (*inputs, *block.parameters(), *block.buffers())
            if isinstance(t, torch.Tensor)}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = block(*inputs)
    del out
    return sum(seen.values())


def _solve(ops: list[OpNode], budget: int, time_limit: float) -> tuple[set[int], str]:
    cand = [i for i, o in enumerate(ops) if o.candidate]
    if not cand:
        return set(), "no candidates"
    m = _Model()
    # maximise Σ t_i s_i  <=>  minimise Σ -t_i s_i (the constant Σ t_i dropped); times are
    # normalised to the largest (HiGHS' absolute gap tolerance would swallow ~1e-7 s), bytes in MiB
    tmax = max(ops[i].time_s for i in cand) or 1.0
    s = {i: m.var(True, cost=-ops[i].time_s / tmax) for i in cand}
    m.row([(s[i], ops[i].out_bytes / 2**20) for i in cand], -np.inf, budget / 2**20)
    res = m.solve(time_limit)
    if res.x is None:
        raise UserError(f"intra-block ILP failed: {res.message}")
    kept = {i for i in cand if res.x[s[i]] > 0.5}
    # the MILP works in floats: enforce the budget exactly on the integral answer
    while sum(ops[i].out_bytes for i in kept) > budget:
        kept.remove(min(kept, key=lambda i: ops[i].time_s / ops[i].out_bytes))
    return kept, str(res.message)


def _plan_from(ops: list[OpNode], kept: set[int], budget: int, status: str = "") -> BlockPlan:
    rec = [o for i, o in enumerate(ops) if i not in kept]
    return BlockPlan(ops, budget, frozenset(ops[i].key for i in kept),
                     sum(ops[i].out_bytes for i in kept), sum(o.flops for o in rec),
                     sum(o.time_s for o in rec), status)


def plan_block(block: nn.Module, example_input, budget_bytes: int | str, time_limit: float = 30.0,
               ops: list[OpNode] | None = None) -> BlockPlan:
    """Least-recompute plan whose SAC cache holds ≤ ``budget_bytes`` (bytes or e.g. "2MiB";
    see the module docstring). ``ops`` reuses a :func:`trace_block` result; with ``block=None``
    (``ops`` given) the plan is the ILP's alone, without the no-checkpoint option."""
    if isinstance(budget_bytes, str):
        budget_bytes = parse_bytes(budget_bytes)
    if budget_bytes is None or budget_bytes < 0:
        raise UserError("plan_block needs a budget ≥ 0 bytes")
    ops = ops if ops is not None else trace_block(block, example_input)
    plain = plain_saved_bytes(block, example_input) if block is not None else None  # None: ops only
    if plain is not None and plain <= budget_bytes:  # no checkpoint at all: nothing recomputed
        return BlockPlan(ops, int(budget_bytes), frozenset(), plain, 0, 0.0, "plain autograd fits",
                         no_checkpoint=True)
    kept, status = _solve(ops, int(budget_bytes), time_limit)
    return _plan_from(ops, kept, int(budget_bytes), status)


def brute_force_plan(ops: list[OpNode], budget_bytes: int) -> BlockPlan:
    """Exhaustive enumeration of the kept set (tests; ≤ ~16 candidate ops)."""
    cand = [i for i, o in enumerate(ops) if o.candidate]
    best = None
    for r in range(len(cand) + 1):
        for sub in itertools.combinations(cand, r):
            if sum(ops[i].out_bytes for i in sub) <= budget_bytes:
                p = _plan_from(ops, set(sub), budget_bytes, "brute-force")
                if best is None or p.predicted_recompute_time_s < best.predicted_recompute_time_s:
                    best = p
    return best


def sac_policy(plan: BlockPlan):
    """A fresh SAC policy function for one forward (it counts occurrences per overload)."""
    counts: dict[str, int] = {}

    def policy(ctx, func, *args, **kwargs):
        name = str(func)
        phase = (ctx.is_recompute, name)  # forward and replay count from 0 separately
        n = counts.get(phase, 0)
        counts[phase] = n + 1
        return CheckpointPolicy.MUST_SAVE if (name, n) in plan.kept else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def apply_block_plan(block: nn.Module, plan: BlockPlan) -> nn.Module:
    """Wrap ``block.forward`` so it runs under SAC with ``plan`` (returns ``block``); a
    ``no_checkpoint`` plan leaves the forward as it is."""
    if plan.no_checkpoint:
        remove_block_plan(block)
        return block
    if getattr(block, "_intrablock_orig_forward", None) is None:
        block._intrablock_orig_forward = block.forward
    orig = block._intrablock_orig_forward

    @functools.wraps(orig)
    def forward(*args, **kwargs):
        # one policy per forward: forward and replay then count occurrences identically
        pol = sac_policy(plan)
        return checkpoint(orig, *args, use_reentrant=False,
                          context_fn=lambda: create_selective_checkpoint_contexts(pol), **kwargs)

    block.forward = forward
    block._intrablock_plan = plan
    return block


def remove_block_plan(block: nn.Module) -> nn.Module:
    orig = getattr(block, "_intrablock_orig_forward", None)
    if orig is not None:
        block.forward = orig
        del block._intrablock_orig_forward
        del block._intrablock_plan
    return block

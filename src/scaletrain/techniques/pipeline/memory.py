"""The memory cost face of pipeline stages: what :func:`.simulate.simulate` needs to predict a
rank's peak as the runtime holds it.

:func:`stage_memory` turns the fake-tensor estimate of a Chain
(:func:`scaletrain.measure.estimate.estimate_chain`'s traces, per block: input, output,
saved-for-backward, whether the input and output are saved, forward and backward
temporaries) and the stage split into per-stage bytes for :class:`~.simulate.StageCosts`:

* ``weight_bytes`` / ``grad_bytes``: the stage modules' parameters (a parameter shared by two
  blocks of the stage counted once; GPT-2's tied ``wte`` counts on the first *and* the last
  stage, which both hold it), their gradients;
* ``state_bytes`` / ``opt_temp_bytes``: the optimizer's state and the transient of its step
  (:mod:`scaletrain.measure.optimizers`);
* ``act_bytes``: one in-flight micro-batch — Σ over the stage's blocks (and the loss, on the
  last stage) of the bytes saved for backward, plus each input that something keeps (the stage
  input, which the runtime holds for its gradient; a later block's input when that block saves
  it and the previous block did not save it as its output), plus the stage's output (kept
  for its backward) unless saved already;
* ``fwd_temp_bytes``: the forward's peak above the activation set: at block k, the sets of
  blocks ≤ k, k's output and its forward temporaries;
* ``bwd_temp_bytes``: the backward's peak above the set (the blocks run in reverse, the loss
  first on the last stage): at block k, the sets of blocks ≤ k (later ones are freed), the
  gradient of k's output, k's backward temporaries (the larger of a first backward and one
  accumulating into existing gradients) and its input gradient, plus — not on the
  last stage — the received output gradient and the stage output, which the runtime holds for
  the whole pass;
* ``boundary_bytes``: each stage's output (what a send holds).
"""

from __future__ import annotations

from dataclasses import dataclass

from typing import Any, Callable, Sequence

import torch
from torch import nn

from scaletrain.chain import Chain, to_chain

from .stage import stage_graphs


def _stage_params(blocks: Sequence[nn.Module]) -> list[nn.Parameter]:
    return list({id(p): p for b in blocks for p in b.parameters()}.values())


def _bwd_temp(tr: Any, scale: Sequence[float] | None = None) -> float:
    """Backward transient of a block trace: the larger of its first backward (gradients made;
    ``bwd_temp_bytes``) and a backward into existing gradients, where each parameter gradient
    is a temporary until AccumulateGrad adds it (the input gradient excluded in both).
    ``scale[j]``: the share of parameter j this rank holds (expert parallelism: 1/ep of an expert
    tensor, so its gradient temporary is 1/ep too)."""
    first = float(tr.bwd_temp_bytes)
    ev = tr.accum_bwd_events
    if not ev:
        return first
    cur = peak = 0.0
    for kind, j, d in ev:
        cur += d * scale[j] if scale is not None and kind == "pgrad" and j >= 0 else d
        peak = max(peak, cur)
    gin = sum(d for k, _, d in ev if k == "gin" and d > 0)
    return max(first, float(peak - gin))


def _pgrad_ids(tr: Any) -> dict[int, float]:
    """Bytes of each parameter gradient a block trace makes, by parameter id."""
    return {tr.param_ids[j]: float(n) for j, n in enumerate(tr.pgrad_bytes) if n}


def _first_bwd_peak(tr: Any) -> float:
    """Peak of a block's first backward (no gradients before it) above its start, counting the
    parameter gradients it has made up to that moment and leaving out its input gradient (the
    caller adds it): :attr:`BlockTrace.bwd_temp_bytes` subtracts every gradient the block makes,
    right when the peak comes after them, short by those made before it when it comes earlier
    (hf:gpt2: the MLP's weight gradient exists at the GELU backward's peak, 0.25 MiB)."""
    cur = peak = 0.0
    for kind, _, d in tr.events[tr.fwd_end:]:
        if kind != "gin":
            cur += d
            peak = max(peak, cur)
    return peak


def stage_memory(chain: Chain | nn.Module, bounds: Sequence[int], example_input: torch.Tensor, *,
                 target: torch.Tensor | None = None, loss_fn: Callable | None = None, optimizer: str = "adamw",
                 foreach: bool | None = None, precision: str = "fp32", remat: Sequence[Any] | None = None,
                 params_dtype: str = "fp32", ep: int = 1, deferred: "DeferredGrads | None" = None,
                 grads_in_backward: bool = False, extras: tuple | None = None,
                 **optimizer_kw: Any) -> dict[str, list[float]]:
    """Per-stage memory costs (bytes) for :class:`~.simulate.StageCosts` (see the module doc).

    ``bounds``: the S + 1 block boundaries of the stages; ``example_input`` / ``target``: one
    micro-batch (only shapes and dtypes are read); ``optimizer`` a name from
    :func:`scaletrain.measure.optimizers.names` with ``foreach`` as the runtime builds it (torch's
    own default on CPU: the for-loop). Returns a dict of lists, one entry per stage, with keys
    ``weight_bytes``, ``grad_bytes``, ``state_bytes``, ``opt_temp_bytes``, ``act_bytes``,
    ``fwd_temp_bytes``, ``bwd_temp_bytes``, ``boundary_bytes``, ``bwd_first_temp_bytes`` (a backward's
    transient when the stage has no gradients yet: the first after an update). ``remat``: the stages'
    rematerialization schedules (:func:`.stage.stage_remat`) when the runtime runs them; the
    activation set and transients of each stage then come from replaying its schedule
    (:func:`_remat_stage`). ``params_dtype``: the dtype the stages compute with (``bf16`` for FSDP2's
    16-bit parameters under ZeRO-3: autocast then saves no 16-bit weight copies). ``ep``: expert
    parallelism — a backward's expert-gradient temporaries are 1/ep of the whole experts' (the
    parameter, gradient and state bytes are the caller's to shard: :func:`..plan_cost._shard_experts`).
    ``deferred``: zb1p's deferred weight gradients (:func:`deferred_grads`): the backward is its I pass —
    no gradient temporary of a deferred weight, and each linear's input and output gradient stay (for W)
    once I has passed its block, the output gradients of the block it is in piling up meanwhile.
    ``grads_in_backward``: the backward makes standalone parameter gradients that stay until the pass ends
    (ZeRO-1/2's :class:`~..data_parallel.zero.GradSync` launches a bucket once all its gradients exist),
    so at block k the gradients of the stage's later blocks are live beside its activations.
    ``extras``: (per Chain block forward bytes, per block backward bytes, the loss's bytes) live beside a
    block's activations while it runs (ZeRO-3's gathered units and buffers, :func:`..data_parallel.fsdp.block_extras`).
    """
    from scaletrain.measure import optimizers
    from scaletrain.measure.estimate import estimate_chain

    chain = to_chain(chain)
    # accum=2: also trace each block's backward into existing gradients (later micro-batches)
    _, traces = estimate_chain(chain, example_input, target=target, loss_fn=loss_fn, precision=precision, accum=2,
                               params_dtype=params_dtype, _return_traces=True)
    S = len(bounds) - 1
    graphs = None
    from scaletrain.techniques.experts import expert_param_ids

    experts = expert_param_ids(chain) if ep > 1 else set()
    skip = deferred.weights if deferred is not None else frozenset()
    scales = [[0.0 if id(p) in skip else 1.0 / ep if id(p) in experts else 1.0 for p in blk.parameters()]
              for blk in chain.blocks] if experts or skip else None
    out: dict[str, list[float]] = {k: [] for k in ("weight_bytes", "grad_bytes", "state_bytes", "opt_temp_bytes",
                                                   "act_bytes", "fwd_temp_bytes", "bwd_temp_bytes", "boundary_bytes",
                                                   "bwd_first_temp_bytes")}
    for s in range(S):
        b0, b1 = bounds[s], bounds[s + 1]
        params = _stage_params(chain.blocks[b0:b1])
        shapes = [(tuple(p.shape), p.dtype) for p in params]
        out["weight_bytes"].append(float(sum(p.numel() * p.element_size() for p in params)))
        out["grad_bytes"].append(float(sum(p.numel() * p.element_size() for p in params if p.requires_grad)))
        out["state_bytes"].append(float(optimizers.state_bytes(optimizer, shapes, **optimizer_kw)))
        out["opt_temp_bytes"].append(float(optimizers.step_transient_bytes(optimizer, shapes, foreach=foreach,
                                                                           **optimizer_kw)))
        last = s == S - 1
        items = list(traces[b0:b1]) + ([traces[-1]] if last else [])  # the loss's trace comes last
        # activation set of each item: what it saves (its output included when saved) and its
        # input when something keeps it — the stage input always (the runtime holds it for its
        # gradient), a later input when the item saves it and the previous one did not
        acts = []
        for k, tr in enumerate(items):
            keep_x = k == 0 or (tr.x_saved and not items[k - 1].y_saved)
            acts.append(float(tr.saved_bytes + (tr.x_bytes if keep_x else 0)))
        y = float(items[-1].y_bytes)
        held = 0.0 if last or items[-1].y_saved else y  # the stage output, kept until its backward ends
        total = sum(acts) + held
        out["act_bytes"].append(total)
        out["boundary_bytes"].append(0.0 if last else y)
        fwd = bwd = first = 0.0
        # the first backward after an update: the stage's gradients do not exist yet, each is made
        # as its block's backward runs (the later blocks' before this one's, this block's own up to its peak)
        made = [_pgrad_ids(tr) for tr in items]
        later = [0.0] * len(items)  # gradient bytes of the stage's blocks after item k (made before its backward)
        if grads_in_backward:
            for k in range(min(len(items), b1 - b0)):
                before = {id(p) for p in _stage_params(chain.blocks[b0:b0 + k + 1])}
                later[k] = float(sum(p.numel() * p.element_size() for p in _stage_params(chain.blocks[b0 + k + 1:b1])
                                     if p.requires_grad and id(p) not in before))
        x_f = x_b = [0.0] * len(items)
        if extras is not None:
            x_f = [*extras[0][b0:b1], extras[2]] if last else list(extras[0][b0:b1])
            x_b = [*extras[1][b0:b1], extras[2]] if last else list(extras[1][b0:b1])
        for k, tr in enumerate(items):
            below = sum(acts[:k + 1])
            fwd = max(fwd, below + (0.0 if tr.y_saved else tr.y_bytes) + tr.fwd_temp_bytes + x_f[k])
            # the gradient of k's output: the received buffer for the stage's last block (counted
            # in `recv`), a fresh tensor otherwise; the loss's output gradient is a scalar
            g_out = 0.0 if k == len(items) - 1 else float(tr.y_bytes)
            recv = 0.0 if last else y  # the received output gradient lives all pass
            gin = float(tr.x_bytes) if tr.x_grad else 0.0
            blk = b0 + k if k < b1 - b0 else None  # None: the loss item
            sc = scales[blk] if scales is not None and blk is not None else None
            kept = 0.0
            if deferred is not None:  # zb1p's I pass: later blocks' W inputs stay, this block's output grads pile up
                kept = sum(deferred.block_stash_bytes[(blk + 1 if blk is not None else b1):b1]) + \
                    (deferred.block_grad_bytes[blk] if blk is not None else 0.0)  # an upper bound: the block
                # frees its own activations while its output gradients pile up (measured 0-6 % over, P = 2, 4)
            bwd = max(bwd, below + held + recv + g_out + _bwd_temp(tr, sc) + gin + kept + later[k] + x_b[k])
            after = {pid: n for m in made[k + 1:] for pid, n in m.items()}
            first = max(first, below + held + recv + g_out + _first_bwd_peak(tr) + gin + kept + x_b[k]
                        + sum(n for pid, n in after.items() if pid not in made[k]))
        out["fwd_temp_bytes"].append(max(0.0, fwd - total))
        out["bwd_temp_bytes"].append(max(0.0, bwd - total))
        # zb1p's I pass makes no weight gradient: its first backward is any other's
        out["bwd_first_temp_bytes"].append(max(0.0, (first if deferred is None else bwd) - total))
        if remat is not None:
            if graphs is None:
                graphs = stage_graphs(chain, list(bounds), example_input, target=target, loss_fn=loss_fn,
                                      precision=precision)
            kept, f_extra, b_extra = _remat_stage(graphs[s], remat[s].ops)
            if last:  # the runtime's loss (outside the schedule) saves its tensors until the backward
                kept += float(items[-1].saved_bytes)
            out["act_bytes"][-1], out["fwd_temp_bytes"][-1], out["bwd_temp_bytes"][-1] = kept, f_extra, b_extra
            out["bwd_first_temp_bytes"][-1] = b_extra
    return out


def _remat_stage(graph: Any, ops: Sequence[Any]) -> tuple[float, float, float]:
    """(bytes kept from a stage's forward to its backward, the forward's and the backward's peak
    above them) when the stage runs ``ops``: the remat simulator's replay
    (:mod:`scaletrain.techniques.remat.simulate`) up to the first backward op and after it."""
    from scaletrain.techniques.remat.simulate import simulate as replay

    rep = replay(graph, ops)
    first_b = next(k for k, op in enumerate(ops) if op.kind == "B")
    kept = float(rep.after[first_b - 1])
    return kept, max(0.0, max(rep.during[:first_b]) - kept), max(0.0, max(rep.during[first_b:]) - kept)



@dataclass
class DeferredGrads:
    """zb1p's deferred weight gradients per stage (:class:`.stage.DeferWeightGrad`)."""

    wstash_bytes: list[float]
    """Kept by one micro-batch from its I pass to its W pass: every linear layer's input and output
    gradient (``dW = gᵀ x`` needs both), each tensor once; the rest of its activations I frees."""
    wgrad_temp_bytes: list[float]
    """The W pass's transient: the largest ``gᵀ x`` result (and its cast to the weight's dtype under
    autocast) before it is added to ``.grad``."""
    weights: frozenset[int]
    """ids of the deferred weights: their gradients are not made (no temporary) in the I pass."""
    block_stash_bytes: list[float]
    """Per chain block: its linears' inputs and output gradients (what it keeps once I has passed it)."""
    block_grad_bytes: list[float]
    """Per chain block: its linears' output gradients (made, and kept, while I runs through it)."""


def deferred_grads(chain: Chain | nn.Module, bounds: Sequence[int], example_input: torch.Tensor, *,
                   precision: str = "fp32") -> DeferredGrads:
    """What zb1p's deferred weight gradients cost each stage, from a fake-tensor forward that
    records every linear call whose weight needs a gradient (its output gradient has the output's
    shape and dtype)."""
    import torch.nn.functional as F
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.overrides import TorchFunctionMode

    chain = to_chain(chain)
    calls: list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = []

    class _Record(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            w = args[1] if len(args) > 1 else (kwargs or {}).get("weight")
            if func is F.linear and isinstance(w, torch.Tensor) and w.requires_grad:
                calls[-1].append((args[0], out, w))
            return out

    device = example_input.device.type if example_input.device.type != "meta" else "cpu"
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.zeros(example_input.shape, dtype=example_input.dtype, device="cpu")
        with torch.autocast(device, dtype=half, enabled=half is not None):
            for blk in chain.blocks:
                calls.append([])
                with _Record():
                    x = blk(x)
    block_stash, block_grad, block_temp, weights = [], [], [], set()
    for blk_calls in calls:
        xs: dict[int, float] = {}
        gs: dict[int, float] = {}
        biggest = 0.0
        for xin, y, w in blk_calls:
            xs[id(xin)] = float(xin.numel() * xin.element_size())
            gs[id(y)] = float(y.numel() * y.element_size())
            gw = w.numel() * y.element_size() + (w.numel() * w.element_size() if y.dtype != w.dtype else 0)
            biggest = max(biggest, float(gw))
            weights.add(id(w))
        block_stash.append(sum(xs.values()) + sum(gs.values()))
        block_grad.append(sum(gs.values()))
        block_temp.append(biggest)
    S = range(len(bounds) - 1)
    return DeferredGrads([sum(block_stash[bounds[s]:bounds[s + 1]]) for s in S],
                         [max(block_temp[bounds[s]:bounds[s + 1]], default=0.0) for s in S], frozenset(weights),
                         block_stash, block_grad)

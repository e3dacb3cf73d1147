"""Stage replicas of a :class:`~scaletrain.chain.Chain` on one pipeline rank.

A stage is a contiguous run of chain blocks ``bounds[s]:bounds[s+1]``; a rank holds one stage
replica (1F1B family), v of them (interleaved) or two (Chimera: stage r of the down pipe and
stage P-1-r of the up pipe). Replicas *share* the rank's model modules (nothing is copied), so a
parameter used by two local replicas (GPT-2's tied ``wte``) accumulates both gradients in one
``.grad``, exactly as in the single-process model.

Ways to run a replica's forward and backward:

* plain — ``out = blocks(x)``; ``backward`` accumulates into ``.grad``;
* rematerialized — ``out = RematChain(blocks, schedule)(x)`` (:mod:`scaletrain.techniques.remat`,
  one schedule per stage from :func:`stage_remat`): the forward keeps only what the stage's
  schedule keeps (e.g. √n checkpoints) and the backward recomputes the rest, so each in-flight
  micro-batch holds less; gradients are bitwise those of the plain stage on CPU fp32
  (randomness replayed);
* split backward (``zb1p``, Qi et al. 2024) — the forward runs under :class:`DeferWeightGrad`,
  which routes every ``F.linear`` whose weight needs a gradient through :class:`_DeferredLinear`:
  its backward computes the input gradient (and the bias gradient, a cheap sum) and queues
  (weight, input, output-gradient) instead of the weight-gradient GEMM. The I pass is then an
  ordinary ``backward``; the W pass runs the queued GEMMs ``dW = gᵀ·x`` (what the zero-bubble
  paper's WeightGradStore does in Megatron). Non-linear parameters (norms, embeddings) get their
  gradients in I — they are cheap;
* weight stashing (``pipedream``, ``pipedream-2bw``; Narayanan et al. SOSP'19, ICML'21) — a
  micro-batch whose backward comes after an update of its stage (``stash_mbs``, known from the
  schedule) runs its forward through ``torch.func.functional_call`` on a snapshot of the
  stage's weights, so its backward sees the weights its forward used; the snapshot's gradients
  are added to the live parameters' ``.grad``. Other micro-batches use the live weights. A
  snapshot is taken at the first such forward of a version and dropped once no in-flight
  micro-batch uses it. Because the copy must exist before the update that makes it necessary,
  a rank holds one weight copy more than the distinct versions in use
  (``peak_weight_versions``) between that forward and the update; the simulator's memory
  model counts the copies as taken here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from scaletrain.errors import UserError


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of a boundary tensor (one micro-batch)."""

    shape: torch.Size
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= int(d)
        return n * torch.empty(0, dtype=self.dtype).element_size()


def check_bounds(bounds: list[int], n_blocks: int, n_stages: int) -> list[int]:
    """Validate block boundaries: ``n_stages + 1`` strictly rising integers from 0 to ``n_blocks``."""
    b = [int(x) for x in bounds]
    if len(b) != n_stages + 1 or b[0] != 0 or b[-1] != n_blocks or any(x >= y for x, y in zip(b, b[1:])):
        raise UserError(f"pipeline stage bounds must rise strictly from 0 to {n_blocks} blocks with "
                        f"{n_stages + 1} entries (one stage per rank × virtual); got {bounds}")
    return b


def _meta_run(blk: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Run ``blk`` on a meta tensor with meta stand-ins for its parameters and buffers."""
    state = {n: torch.empty_like(t, device="meta") for n, t in blk.named_parameters()}
    state.update({n: torch.empty_like(t, device="meta") for n, t in blk.named_buffers()})
    return torch.func.functional_call(blk, state, (x,))


def boundary_specs(blocks: nn.ModuleList, bounds: list[int], example: torch.Tensor,
                   device: torch.device) -> list[TensorSpec]:
    """Spec of every stage's input (index s) and of the last stage's output (index S).

    Found by running the whole chain on meta tensors (no memory, no compute, no RNG drawn;
    fake tensors as a fallback for ops without a meta kernel). ``example`` is one micro-batch's
    input (meta, fake or real: only its shape and dtype are read)."""
    specs = [TensorSpec(example.shape, example.dtype)]
    with torch.no_grad():
        try:
            x = torch.empty(example.shape, dtype=example.dtype, device="meta")
            outs = []
            for s in range(len(bounds) - 1):
                for blk in blocks[bounds[s]:bounds[s + 1]]:
                    x = _meta_run(blk, x)
                outs.append(x)
        except (NotImplementedError, RuntimeError):
            from torch._subclasses.fake_tensor import FakeTensorMode

            with FakeTensorMode(allow_non_fake_inputs=True):
                x = torch.zeros(example.shape, dtype=example.dtype, device=device)
                outs = []
                for s in range(len(bounds) - 1):
                    for blk in blocks[bounds[s]:bounds[s + 1]]:
                        x = blk(x)
                    outs.append(x)
    for s, x in enumerate(outs):
        if not isinstance(x, torch.Tensor):
            raise UserError(f"pipeline stage {s} returns a {type(x).__name__}; chain blocks must map one tensor "
                            "to one tensor")
        specs.append(TensorSpec(x.shape, x.dtype))
    for s, sp in enumerate(specs[1:-1], start=1):
        if not sp.dtype.is_floating_point:
            raise UserError(f"the tensor between pipeline stages {s - 1} and {s} is {sp.dtype}; a stage boundary "
                            "must be a floating-point activation (move the cut to another block)")
    return specs


# --------------------------------------------------------------------------- zb1p: deferred weight gradients
class _DeferredLinear(torch.autograd.Function):
    """``F.linear`` whose backward defers the weight-gradient GEMM to a queue (zero-bubble W)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                queue: list) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        # the parameter itself, for the W pass to set .grad on: a saved tensor comes back through any
        # saved-tensor hooks (the memory tracker's), maybe as an alias whose .grad is not the parameter's
        ctx.param = weight
        ctx.queue = queue
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor):  # g: [..., out_features]
        x, weight = ctx.saved_tensors
        # under autocast g is 16-bit while weight/x keep their dtype: compute in g's dtype
        gx = g @ weight.to(g.dtype) if ctx.needs_input_grad[0] else None  # [..., in_features]
        gb = g.reshape(-1, g.shape[-1]).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        if ctx.needs_input_grad[1]:
            ctx.queue.append((ctx.param, x, g))  # dW = gᵀ x, computed in the W pass
        return gx, None, gb, None


class DeferWeightGrad(TorchFunctionMode):
    """Inside this mode, linear layers queue their weight gradients into ``queue`` instead of
    computing them in backward (see module doc)."""

    def __init__(self, queue: list):
        super().__init__()
        self.queue = queue

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and torch.is_grad_enabled():
            x, weight = args[0], args[1] if len(args) > 1 else kwargs["weight"]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if isinstance(weight, torch.Tensor) and weight.requires_grad:
                return _DeferredLinear.apply(x, weight, bias, self.queue)
        return func(*args, **kwargs)


@torch.no_grad()  # dW must not record a graph: a .grad with a grad_fn would keep every queued x and g alive
def run_weight_grads(queue: list) -> None:
    """The W pass: accumulate ``dW = gᵀ·x`` for every queued linear (fp32 accumulate into .grad)."""
    while queue:
        weight, x, g = queue.pop()
        gw = (g.reshape(-1, g.shape[-1]).t() @ x.to(g.dtype).reshape(-1, x.shape[-1])).to(weight.dtype)  # [out, in]
        if weight.grad is None:
            weight.grad = gw
        else:
            weight.grad += gw


# --------------------------------------------------------------------------- replicas
@dataclass
class Replica:
    """One stage replica on this rank and the per-micro-batch tensors in flight through it."""

    pipe: int
    stage: int
    module: nn.Sequential
    first: bool
    last: bool
    defer_weight_grads: bool = False
    stash_weights: bool = False
    inputs: dict[int, torch.Tensor] = field(default_factory=dict)
    """Micro-batch → the stage input (requires grad for stage > 0)."""
    outputs: dict[int, torch.Tensor] = field(default_factory=dict)
    """Micro-batch → output (or the weighted loss on the last stage), graph attached, until backward."""
    grad_out: dict[int, torch.Tensor] = field(default_factory=dict)
    grad_in: dict[int, torch.Tensor] = field(default_factory=dict)
    wqueue: dict[int, list] = field(default_factory=dict)
    """Micro-batch → deferred weight-gradient GEMMs (zb1p)."""
    version: int = 0
    """Weight version: bumped by every optimizer update (weight stashing)."""
    stash_mbs: set[int] | None = None
    """Micro-batches that need a weight snapshot (an update falls between their forward and
    backward); None means all of them."""
    snapshots: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    snap_refs: dict[int, int] = field(default_factory=dict)
    mb_version: dict[int, int] = field(default_factory=dict)
    remat: nn.Module | None = None
    """The stage's blocks under a rematerialization schedule (:func:`stage_remat`): its training
    forward keeps what the schedule keeps and recomputes the rest inside the backward."""

    def __post_init__(self) -> None:
        self.live = dict(self.module.named_parameters())

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor, mb: int) -> torch.Tensor:
        if self.stash_weights and (self.stash_mbs is None or mb in self.stash_mbs):
            v = self.version
            snap = self.snapshots.get(v)
            if snap is None:
                snap = {n: p.detach().clone().requires_grad_(p.requires_grad) for n, p in self.live.items()}
                self.snapshots[v] = snap
            self.snap_refs[v] = self.snap_refs.get(v, 0) + 1
            self.mb_version[mb] = v
            return torch.func.functional_call(self.module, snap, (x,))
        if self.defer_weight_grads:
            q = self.wqueue.setdefault(mb, [])
            with DeferWeightGrad(q):
                return self.module(x)
        return (self.remat or self.module)(x)

    # ------------------------------------------------------------------ backward
    def backward(self, mb: int, out: torch.Tensor, grad: torch.Tensor | None, aux: torch.Tensor | None = None) -> None:
        """Backward of micro-batch ``mb`` (B, or I when weight gradients are deferred). ``aux``: a
        weighted scalar loss this stage adds itself (a mixture of experts' load-balancing loss),
        backpropagated in the same pass as the output gradient."""
        if grad is None:
            out.backward()
        elif aux is None:
            out.backward(grad)
        else:
            torch.autograd.backward([out, aux], [grad, None])
        v = self.mb_version.pop(mb, None)
        if v is not None:  # forwarded with a snapshot: its gradients belong to the live weights
            snap = self.snapshots[v]
            for n, t in snap.items():
                if t.grad is not None:
                    p = self.live[n]
                    if p.grad is None:
                        p.grad = t.grad
                    else:
                        p.grad += t.grad
                    t.grad = None
            self.snap_refs[v] -= 1
            if self.snap_refs[v] == 0 and v != self.version:
                del self.snapshots[v], self.snap_refs[v]

    def weight_grads(self, mb: int) -> None:
        run_weight_grads(self.wqueue.pop(mb, []))

    def bump_version(self) -> None:
        """After an optimizer update: the live weights are a new version."""
        old = self.version
        self.version += 1
        if self.stash_weights and self.snap_refs.get(old, 0) == 0:
            self.snapshots.pop(old, None)
            self.snap_refs.pop(old, None)

    def stashed_versions(self) -> int:
        return len(self.snapshots)


def stage_graphs(chain: nn.Module, bounds: list[int], example_input: torch.Tensor, *,
                 target: torch.Tensor | None = None, loss_fn: Any = None, precision: str = "fp32") -> list[Any]:
    """The rematerialization cost graph of every stage (:mod:`scaletrain.techniques.remat`).

    Estimated once for the whole chain on fake tensors (nothing allocated) and cut at
    ``bounds``: stage s gets its blocks' nodes, its input (the previous stage's output, held by
    the runtime) and, except on the last stage, the received output gradient in place of the
    loss. ``chain``: the whole model's :class:`~scaletrain.chain.Chain` (or the model);
    ``target`` / ``loss_fn``: one micro-batch's target and the loss (default: the model's task).
    """
    from scaletrain.chain import to_chain
    from scaletrain.techniques.remat.fromtrace import estimate_graph
    from scaletrain.techniques.remat.schedule import Graph

    graph, _ = estimate_graph(to_chain(chain), example_input, target=target, loss_fn=loss_fn, precision=precision)
    S = len(bounds) - 1
    out = []
    for s in range(S):
        b0, b1 = bounds[s], bounds[s + 1]
        nodes = graph.nodes[b0:b1]
        inp = graph.input_bytes if s == 0 else graph.nodes[b0 - 1].out_bytes
        tail = graph.loss_bytes if s == S - 1 else nodes[-1].out_bytes
        out.append(Graph.chain(nodes, inp, tail))
    return out


def remat_budgets(remat: Any) -> int | str | list[int] | None:
    """The budget(s) a plan's ``memory.remat`` gives the stages' solvers: ``stage_budgets`` (one per stage,
    bytes) when set, else ``budget`` (every stage's), else None."""
    from scaletrain.techniques.remat.schedule import parse_bytes_list

    if getattr(remat, "stage_budgets", ""):
        return parse_bytes_list(remat.stage_budgets)
    return remat.budget or None


def stage_remat(chain: nn.Module, bounds: list[int], example_input: torch.Tensor, method: str,
                budget: int | str | Sequence[int | str] | None = None, *, target: torch.Tensor | None = None,
                loss_fn: Any = None, precision: str = "fp32") -> list[Any]:
    """One rematerialization schedule per stage (:func:`scaletrain.techniques.remat.solve`) over
    :func:`stage_graphs`. ``budget`` (bytes or a size string; None: the method's default, e.g.
    √n segments for ``periodic``) bounds the peak of *one* micro-batch's forward + backward of
    a stage; a list gives each stage its own (``memory.remat.stage_budgets``: a stage with more slack
    keeps more and recomputes less)."""
    from scaletrain.techniques.remat import parse_bytes, solve

    graphs = stage_graphs(chain, bounds, example_input, target=target, loss_fn=loss_fn, precision=precision)
    per = list(budget) if isinstance(budget, (list, tuple)) else [budget] * len(graphs)
    if len(per) != len(graphs):
        raise UserError(f"memory.remat.stage_budgets has {len(per)} entries for {len(graphs)} pipeline stages; "
                        f"allowed: one size per stage (pp x virtual), comma-separated")
    out = []
    for s, g in enumerate(graphs):
        try:
            out.append(solve(g, parse_bytes(per[s]), method))
        except UserError as e:
            raise UserError(f"rematerialization of pipeline stage {s} (blocks {bounds[s]}..{bounds[s + 1] - 1}): "
                            f"{e}") from None
    return out

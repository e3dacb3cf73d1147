"""Run a schedule on a Chain: the apply face of every rematerialization method.

:func:`run_schedule` performs one forward + backward of a Chain op by op with plain autograd:

- ``Fn``/``Fc``: the block's forward under ``torch.no_grad()`` (nothing recorded);
- ``Fe``: the block's forward with grad on a detached, grad-requiring copy of its input
  (sharing storage): the output's autograd graph is the block's tape;
- ``B``: ``torch.autograd.backward(output, δ)`` (for the last block: ``loss_fn(output,
  target)`` then ``backward``); the input copy's ``.grad`` is δ of the previous block;
  parameter gradients accumulate into ``.grad`` as in an ordinary backward, so gradient
  accumulation over several calls works unchanged;
- ``Dp``/``Dt``: drop the plain output / the tape (keeping its output).

Gradients equal the ordinary ``loss_fn(chain(x), target).backward()`` bitwise on CPU fp32:
each block's backward sees the same saved tensors, and randomness is replayed — the RNG
state (CPU, and CUDA of the input's device) is stashed before a block's *first* forward and
restored for each recomputation inside ``torch.random.fork_rng``, so recomputations draw
the same dropout masks and leave the global RNG stream as the baseline leaves it (what
``torch.utils.checkpoint`` does). A recomputation also restores the block's buffers (e.g.
BatchNorm running statistics), so they are updated once per step as without remat. The
caller's ``torch.autocast`` context applies to every forward, recomputations included.

:func:`apply` wraps a Chain in a module whose ``forward`` follows the schedule under ordinary
autograd: the forward part runs in ``forward`` and the rest (recomputations and backwards)
inside the autograd backward, via a custom Function, with autocast state stashed and
restored like ``torch.utils.checkpoint``.

The executor steps the simulator alongside (an invalid schedule raises before running the
op) and can report the bytes of the tensors it holds (:meth:`Runner.held_bytes`), the check
that it frees exactly what the memory model says it frees.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch import nn

from scaletrain.errors import UserError
from scaletrain.techniques.remat.schedule import Graph, Node, Op, Schedule
from scaletrain.techniques.remat.simulate import SimState


def _sim_graph(n: int) -> Graph:
    """Structure-only chain for validating op order (costs are irrelevant here)."""
    return Graph.chain([Node(str(i), 0.0, 0.0, 0) for i in range(n)])


class Runner:
    """State of one forward+backward of ``blocks`` following ``ops`` (see the module doc)."""

    def __init__(self, blocks: list[nn.Module], ops: list[Op], x: torch.Tensor,
                 loss_fn: Callable | None = None, target=None):
        self.blocks = blocks
        self.ops = ops
        self.n = len(blocks)
        self.x = x
        self.loss_fn, self.target = loss_fn, target
        self.sim = SimState(_sim_graph(self.n))
        self.plain: dict[int, torch.Tensor] = {}
        self.tape: dict[int, tuple[torch.Tensor, torch.Tensor, list]] = {}  # i -> (input leaf, output, saved)
        self.grad: dict[int, torch.Tensor] = {}
        self.rng: dict[int, tuple] = {}
        self.loss: torch.Tensor | None = None
        self.sink_grad: torch.Tensor | None = None
        self.input_grad: torch.Tensor | None = None
        self.pos = 0
        self.track_saved = False
        self._param_ptrs: set[int] | None = None

    # -- helpers -------------------------------------------------------------------------
    def _input(self, i: int) -> torch.Tensor:
        if i == 0:
            return self.x
        if i - 1 in self.plain:
            return self.plain[i - 1]
        if i - 1 in self.tape:
            return self.tape[i - 1][1].detach()
        raise AssertionError(f"input of block {i} missing (simulator should have caught it)")

    def _devices(self, t: torch.Tensor) -> list:
        return [t.device] if t.device.type == "cuda" else []

    def _forward(self, i: int, inp: torch.Tensor) -> torch.Tensor:
        block = self.blocks[i]
        if i not in self.rng:  # first run: the baseline's RNG stream, buffers updated once
            cuda = [torch.cuda.get_rng_state(d) for d in self._devices(inp)]
            self.rng[i] = (torch.get_rng_state(), cuda)
            return block(inp)
        cpu_state, cuda_states = self.rng[i]
        devs = self._devices(inp)
        with _frozen_buffers(block), torch.random.fork_rng(devices=devs):
            torch.set_rng_state(cpu_state)
            for d, s in zip(devs, cuda_states):
                torch.cuda.set_rng_state(s, d)
            return block(inp)

    # -- ops -----------------------------------------------------------------------------
    def step(self, op: Op) -> None:
        self.sim.step(op)  # raises ValueError on an invalid op
        i = op.index
        if op.kind in ("Fn", "Fc"):
            with torch.no_grad():
                self.plain[i] = self._forward(i, self._input(i))
            if op.kind == "Fn" and i > 0 and i not in self.tape:
                self.plain.pop(i - 1, None)
        elif op.kind == "Fe":
            inp = self._input(i)
            needs_grad = inp.is_floating_point() and (i > 0 or inp.requires_grad)
            leaf = inp.detach().requires_grad_(True) if needs_grad else inp.detach()
            saved: list = []
            # Pack a *detached* alias: packing the tensor itself would make a reference cycle
            # (node -> saved output -> grad_fn -> node) that outlives a tape dropped by Dt.
            hooks = (torch.autograd.graph.saved_tensors_hooks(_packer(saved), lambda t: t)
                     if self.track_saved else contextlib.nullcontext())
            with torch.enable_grad(), hooks:
                out = self._forward(i, leaf)
            self.tape[i] = (leaf, out, saved)
            self.plain.pop(i, None)
        elif op.kind == "B":
            leaf, out, saved = self.tape.pop(i)
            saved.clear()  # our aliases must not keep saved tensors alive through the backward
            if i == self.n - 1 and self.sink_grad is not None:
                torch.autograd.backward(out, self.sink_grad)
                self.sink_grad = None
            elif i == self.n - 1:
                if self.loss_fn is None:
                    raise UserError("run_schedule needs a loss_fn for the last block's backward")
                loss = self.loss_fn(out) if self.target is None else self.loss_fn(out, self.target)
                del out  # as in plain autograd, the logits live on only if the graph saved them
                torch.autograd.backward(loss)
                self.loss = loss.detach()
            else:
                torch.autograd.backward(out, self.grad.pop(i))
            out = None
            if leaf.requires_grad:
                g = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                if i > 0:
                    self.grad[i - 1] = g
                else:
                    self.input_grad = g
            if i > 0:
                self.plain.pop(i - 1, None)
        elif op.kind == "Dp":
            del self.plain[i]
        elif op.kind == "Dt":
            _, out, _ = self.tape.pop(i)
            self.plain[i] = out.detach()

    def run(self, stop_before_first_backward: bool = False) -> None:
        while self.pos < len(self.ops):
            op = self.ops[self.pos]
            if stop_before_first_backward and op.kind == "B":
                return
            self.step(op)
            self.pos += 1
        if not self.sim.finished:
            raise ValueError("schedule ended before every backward was done")

    # -- inspection ----------------------------------------------------------------------
    def held_bytes(self) -> int:
        """Bytes of distinct storages the executor holds: input, plain outputs, tapes (output,
        input copy and, with ``track_saved``, the tensors autograd saved, parameters excluded)
        and activation gradients. Parameters and their gradients are not counted."""
        if self._param_ptrs is None:
            self._param_ptrs = {p.untyped_storage().data_ptr() for b in self.blocks for p in b.parameters()}
        seen: dict[int, int] = {}

        def add(t):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                st = t.untyped_storage()
                if st.data_ptr() not in self._param_ptrs:
                    seen[st.data_ptr()] = st.nbytes()

        add(self.x)
        for t in self.plain.values():
            add(t)
        for leaf, out, saved in self.tape.values():
            add(leaf)
            add(out)
            for t in saved:
                add(t)
        for t in self.grad.values():
            add(t)
        return sum(seen.values())


@contextlib.contextmanager
def _frozen_buffers(block: nn.Module):
    """Run a recomputation without changing the block's buffers.

    BatchNorm: momentum 0 makes its in-place update of the running statistics write back the
    same values (r·1 + batch·0), so the version autograd saved stays valid and no copy is kept;
    ``num_batches_tracked`` is put back. Other buffers: their data is swapped back afterwards
    (``.data =`` does not bump the version an in-place copy would); the recomputation's tape
    then holds the updated copy until its backward.
    """
    bns = [m for m in block.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
           and m.training and m.track_running_stats]
    bn_bufs = {id(b) for m in bns for b in m.buffers(recurse=False)}
    saved_bn = [(m, m.momentum, m.num_batches_tracked.clone() if m.num_batches_tracked is not None else None)
                for m in bns]
    others = [b for b in block.buffers() if id(b) not in bn_bufs]
    saved_other = [b.detach().clone() for b in others]
    for m in bns:
        m.momentum = 0.0
    try:
        yield
    finally:
        for m, mom, nbt in saved_bn:
            m.momentum = mom
            if nbt is not None:
                with torch.no_grad():
                    m.num_batches_tracked.copy_(nbt)
        for b, v in zip(others, saved_other):
            b.data = v


def _packer(saved: list):
    def pack(t: torch.Tensor) -> torch.Tensor:
        d = t.detach()
        saved.append(d)
        return d
    return pack


def _check(chain_blocks, schedule: Schedule) -> list[nn.Module]:
    blocks = list(chain_blocks)
    if schedule.n_nodes != len(blocks):
        raise UserError(f"schedule is for {schedule.n_nodes} blocks, the chain has {len(blocks)}")
    return blocks


def run_schedule(chain, schedule: Schedule, x: torch.Tensor, loss_fn: Callable, target=None,
                 on_op: Callable[[Op, Runner], None] | None = None) -> torch.Tensor:
    """One forward + backward of ``chain`` following ``schedule``; returns the loss (detached).

    ``loss_fn(output, target)`` (or ``loss_fn(output)`` when ``target`` is None) must return a
    scalar; parameter gradients are accumulated into ``.grad``. ``on_op(op, runner)`` is
    called after each op (for tests and measurements).
    """
    blocks = _check(chain.blocks, schedule)
    r = Runner(blocks, schedule.ops, x, loss_fn, target)
    r.track_saved = on_op is not None
    for op in schedule.ops:
        r.step(op)
        r.pos += 1
        if on_op is not None:
            on_op(op, r)
    if not r.sim.finished:
        raise ValueError("schedule ended before every backward was done")
    return r.loss


class _ScheduleFn(torch.autograd.Function):
    """Forward part of a schedule in ``forward``; the rest inside the autograd backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, runner: Runner, autocast_state: dict, *params):
        with torch.enable_grad(), _autocast(autocast_state, restore_only=True):
            runner.run(stop_before_first_backward=True)
        ctx.runner = runner
        ctx.autocast_state = autocast_state
        last = runner.n - 1
        if last not in runner.tape:
            raise UserError("the schedule must record the last block (F^e) before its first backward")
        return runner.tape[last][1].detach()

    @staticmethod
    def backward(ctx, grad_out):
        r: Runner = ctx.runner
        r.sink_grad = grad_out  # the last block's backward gets the caller's gradient, not a loss
        with torch.enable_grad(), _autocast(ctx.autocast_state):
            r.run()
        gx = r.input_grad if ctx.needs_input_grad[0] else None
        ctx.runner = None
        return (gx, None, None) + (None,) * (len(ctx.needs_input_grad) - 3)


def _autocast_state(x: torch.Tensor) -> dict:
    dev = x.device.type
    return {"device_type": dev, "enabled": torch.is_autocast_enabled(dev),
            "dtype": torch.get_autocast_dtype(dev), "cache_enabled": torch.is_autocast_cache_enabled()}


@contextlib.contextmanager
def _autocast(state: dict, restore_only: bool = False):
    """Re-enter the caller's autocast state (a no-op inside ``forward``, where it still holds)."""
    if restore_only or not state["enabled"]:
        yield
        return
    with torch.autocast(device_type=state["device_type"], dtype=state["dtype"], cache_enabled=state["cache_enabled"]):
        yield


class RematChain(nn.Module):
    """A Chain whose training forward+backward follow a schedule (:func:`apply`)."""

    def __init__(self, chain, schedule: Schedule):
        super().__init__()
        _check(chain.blocks, schedule)
        self.chain = chain
        self.schedule = schedule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return self.chain(x)
        runner = Runner(list(self.chain.blocks), self.schedule.ops, x)
        params = [p for p in self.chain.parameters() if p.requires_grad]
        # Parameters are passed so autograd calls our backward even when x needs no gradient.
        return _ScheduleFn.apply(x, runner, _autocast_state(x), *params)


def apply(model_or_chain, schedule: Schedule) -> RematChain:
    """Wrap a model (or Chain) so each training step follows ``schedule``.

    ``apply(model, plan)(x)`` returns the output as ``model(x)`` would; ``loss.backward()``
    then runs the schedule's recomputations and backwards. Without grad (evaluation) it is the
    plain forward. The wrapper shares the model's parameters.
    """
    from scaletrain.chain import to_chain

    return RematChain(to_chain(model_or_chain), schedule)

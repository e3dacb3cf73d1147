"""The composable apply face of rematerialization: a schedule as nested activation checkpoints.

Why. The executor (:mod:`.executor`) runs a schedule op by op, with one ``backward`` call per
block, outside any wrapper — exact for one process, but DDP's reducer, FSDP2's unshard/reshard
hooks and the pipeline's stage modules never see its forwards. ``torch.utils.checkpoint``
(non-reentrant) is what all of them are built to compose with (torchtitan applies activation
checkpointing under FSDP2 and TP this way). So a schedule is turned into a *module*:

- every schedule the chain solvers (none, periodic, revolve, optimal) produce has the recursive
  shape of Beaumont et al.'s dynamic programme (:mod:`.optimal`): the sub-problem of blocks s..t
  either stores block s's tape (``F_s^e``, sub-problem s+1..t, ``B_s``) or checkpoints a segment
  s..j (``F_s^c F_{s+1}^n .. F_j^n``, sub-problem j+1..t, then sub-problem s..j for the
  segment's own backward). :func:`schedule_tree` parses the op list back into that tree;
- a checkpointed segment becomes ``checkpoint(run(segment's tree))``: its first forward saves
  only its input (``F^c``/``F^n``); its backward recomputes the segment *following the inner
  tree* — inner checkpoints again save only their inputs — which is the recursion's
  sub-problem s..j. Nested non-reentrant checkpoints do exactly this, so the peak equals the
  simulator's replay of the schedule (measured: within 4 bytes on GPT-2 chains) and gradients
  equal plain autograd's bitwise (dropout masks replayed from the stashed RNG state).

A recomputation must not update module buffers twice: BatchNorm running statistics are frozen
while a segment is recomputed (``context_fn``'s recompute context, the executor's
``_frozen_buffers``), so buffers change once per step as without remat.

Schedules with explicit drops (``ilp`` with ``Dp``/``Dt``, ``dtr``) have no such tree; they keep
the executor (one process, or ZeRO-1/2 whose hooks fire under any schedule); the compatibility
table says so.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Sequence, Union

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from scaletrain.errors import UserError
from scaletrain.techniques.remat.executor import _frozen_buffers
from scaletrain.techniques.remat.schedule import Op, Schedule, fmt_bytes


@dataclass(frozen=True)
class Segment:
    """A checkpointed run of blocks whose recomputation follows ``inner``."""

    inner: tuple["Item", ...]

    @property
    def blocks(self) -> list[int]:
        out: list[int] = []
        for it in self.inner:
            out += it.blocks if isinstance(it, Segment) else [it]
        return out


Item = Union[int, Segment]
"""A block index (stored: its tape kept) or a checkpointed :class:`Segment`."""


def schedule_tree(ops: Sequence[Op], n: int) -> tuple[Item, ...]:
    """Parse a chain schedule into nested segments (see the module docstring); UserError when the
    op list is not of that recursive shape (``ilp``/``dtr`` schedules with drops)."""
    pos = 0

    def expect(kind: str, index: int) -> None:
        nonlocal pos
        if pos >= len(ops) or ops[pos].kind != kind or ops[pos].index != index:
            got = ops[pos] if pos < len(ops) else "the end"
            raise UserError(f"schedule is not a nest of checkpoints: expected {kind}{index} at op {pos}, got {got}")
        pos += 1

    def sub(s: int, t: int) -> list[Item]:
        nonlocal pos
        if pos >= len(ops):
            raise UserError(f"schedule is not a nest of checkpoints: it ends inside blocks {s}..{t}")
        op = ops[pos]
        if op.kind == "Fe" and op.index == s:
            pos += 1
            if s == t:
                expect("B", t)
                return [s]
            rest = sub(s + 1, t)
            expect("B", s)
            return [s, *rest]
        if op.kind == "Fc" and op.index == s:
            pos += 1
            j = s
            while j < t and pos < len(ops) and ops[pos].kind == "Fn" and ops[pos].index == j + 1:
                j += 1
                pos += 1
            later = sub(j + 1, t) if j < t else []
            inner = sub(s, j)
            return [Segment(tuple(inner)), *later]
        raise UserError(f"schedule is not a nest of checkpoints: op {pos} is {op} inside blocks {s}..{t}")

    tree = sub(0, n - 1)
    if pos != len(ops):
        raise UserError(f"schedule is not a nest of checkpoints: {len(ops) - pos} ops left after the last backward")
    return tuple(tree)


def tree_ops(tree: Sequence[Item]) -> list[Op]:
    """The chain schedule of a flat tree (blocks or single-level segments), the inverse of
    :func:`schedule_tree` there: a segment's first block keeps its input (``Fc``), its other blocks
    nothing (``Fn``), a plain block its whole tape (``Fe``); backward in reverse, each segment
    recomputed (``Fe``) just before its blocks' backward."""
    fwd: list[Op] = []
    bwd: list[Op] = []
    for it in tree:
        if isinstance(it, Segment):
            if any(isinstance(x, Segment) for x in it.inner):
                raise UserError("tree_ops takes single-level segments only")
            blocks = it.blocks
            fwd += [Op("Fc", blocks[0])] + [Op("Fn", i) for i in blocks[1:]]
            bwd.append([Op("Fe", i) for i in blocks] + [Op("B", i) for i in reversed(blocks)])
        else:
            fwd.append(Op("Fe", it))
            bwd.append([Op("B", it)])
    return fwd + [op for part in reversed(bwd) for op in part]


def blocks_tree(n: int, spec: str) -> tuple[Item, ...]:
    """Each listed block checkpointed alone (``memory.remat.blocks``: none, all, or '0,3,5')."""
    chosen = parse_block_list(spec, n, "memory.remat.blocks")
    return tuple(Segment((i,)) if i in chosen else i for i in range(n))


def parse_block_list(spec: str, n: int, key: str) -> set[int]:
    """none / all / comma-separated block indices, each in 0..n-1 (ConfigError-worthy UserError)."""
    text = str(spec).strip().lower()
    if text in ("", "none"):
        return set()
    if text == "all":
        return set(range(n))
    try:
        out = {int(x) for x in text.split(",") if x.strip()}
    except ValueError:
        raise UserError(f"{key}={spec!r} is not allowed; allowed: none, all, or block indices like '0,3,5'") from None
    bad = sorted(i for i in out if not 0 <= i < n)
    if bad:
        raise UserError(f"{key}={spec!r}: block {bad[0]} does not exist; the chain has blocks 0..{n - 1}")
    return out


def recompute_counts(tree: Sequence[Item], n: int) -> list[int]:
    """Extra forwards of each block per step: one per checkpointed segment (at any depth) holding it."""
    out = [0] * n

    def walk(items: Sequence[Item]) -> None:
        for it in items:
            if isinstance(it, Segment):
                for b in it.blocks:
                    out[b] += 1
                walk(it.inner)

    walk(tree)
    return out


def count_recomputed(tree: Sequence[Item]) -> int:
    """Block forwards the tree recomputes per step (each segment replays its blocks once per level)."""
    total = 0
    for it in tree:
        if isinstance(it, Segment):
            total += len(it.blocks) + count_recomputed(it.inner)
    return total


class CheckpointedBlocks(nn.Module):
    """Blocks run in order; segments of ``tree`` under nested non-reentrant checkpoints.

    Shares the blocks (no copies), so it can stand in for a Chain (or a pipeline stage's
    ``nn.Sequential``) under DDP, FSDP2 or tensor parallelism. Without grad (evaluation) it is the
    plain forward. ``context`` is entered around every block's forward and recomputation (e.g. a
    selective-checkpoint policy); ``None`` for plain checkpoints.
    """

    def __init__(self, blocks: Sequence[nn.Module], tree: Sequence[Item]):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        covered = sorted(b for it in tree for b in (it.blocks if isinstance(it, Segment) else [it]))
        if covered != list(range(len(self.blocks))):
            raise UserError(f"remat tree covers blocks {covered}, the chain has {len(self.blocks)}")
        self.tree = tuple(tree)

    def _run(self, items: Sequence[Item], x: torch.Tensor) -> torch.Tensor:
        for it in items:
            if isinstance(it, Segment):
                mods = [self.blocks[i] for i in it.blocks]
                # no early stop: the whole segment is replayed, as the schedule's F^e ops say (the
                # simulator's memory, and the collectives a TP block replays, are then exact)
                with set_checkpoint_early_stop(False):
                    x = checkpoint(self._segment_fn(it), x, use_reentrant=False,
                                   context_fn=_recompute_context(mods))
            else:
                x = self.blocks[it](x)
        return x

    def _segment_fn(self, seg: Segment) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda h: self._run(seg.inner, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            for b in self.blocks:
                x = b(x)
            return x
        return self._run(self.tree, x)


def _recompute_context(mods: list[nn.Module]) -> Callable[[], tuple]:
    """(forward context, recompute context) for ``checkpoint``: buffers frozen while recomputing."""
    @contextlib.contextmanager
    def recompute():
        with contextlib.ExitStack() as stack:
            for m in mods:
                stack.enter_context(_frozen_buffers(m))
            yield

    return lambda: (contextlib.nullcontext(), recompute())


def tree_of(schedule: Schedule) -> tuple[Item, ...]:
    """:func:`schedule_tree` of a solver's :class:`~.schedule.Schedule`."""
    return schedule_tree(schedule.ops, schedule.n_nodes)


def describe_tree(tree: Sequence[Item]) -> str:
    """``[0 1] (2 3) 4`` style: plain blocks as numbers, segments in parentheses (nested)."""
    parts = []
    for it in tree:
        parts.append("(" + describe_tree(it.inner) + ")" if isinstance(it, Segment) else str(it))
    return " ".join(parts)


# --------------------------------------------------------------------------- planning


@dataclass
class RematChoice:
    """What :func:`plan_remat` chose: a tree of nested checkpoints (the composable apply face), or
    a schedule only the executor runs (``ilp``/``dtr`` with drops: ``tree`` is None)."""

    tree: tuple[Item, ...] | None
    schedule: Schedule | None
    how: str

    def module(self, chain: nn.Module) -> nn.Module:
        """The blocks of ``chain`` under the tree's checkpoints (a stand-in for the model's forward)."""
        assert self.tree is not None
        return CheckpointedBlocks(list(chain.blocks), self.tree)

    def describe(self) -> str:
        s = self.schedule
        pred = (f"; predicted activation peak {s.predicted_peak_bytes} B, {s.n_forwards} block forwards per step"
                if s is not None else "")
        tree = f": {describe_tree(self.tree)}" if self.tree is not None else " (run op by op by the executor)"
        return f"{self.how}{tree}{pred}"

    def forward_backward(self, model: nn.Module, ctx: object, rt: object) -> Callable:
        """The executor's per-micro-batch function for a schedule that is not a tree (one process, or
        ZeRO-1/2 whose gradient hooks fire under any schedule)."""
        from scaletrain.chain import to_chain
        from scaletrain.techniques.remat.executor import run_schedule

        assert self.schedule is not None
        chain, sched = to_chain(model), self.schedule
        expect = getattr(rt, "expect_accumulations", None)
        if expect is not None:  # one backward per block: a shared parameter accumulates once per user
            counts: dict[int, int] = {}
            for block in chain.blocks:
                for q in {id(q) for q in block.parameters()}:
                    counts[q] = counts.get(q, 0) + 1
            expect(counts)

        def fb(x: torch.Tensor, y: torch.Tensor, weight: float) -> torch.Tensor:
            losses: list[torch.Tensor] = []

            def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
                loss = ctx.loss_fn(out, target)  # type: ignore[attr-defined]
                losses.append(loss.detach())
                scaler = ctx.scaler  # type: ignore[attr-defined]
                return scaler.scale(loss * weight) if scaler is not None else loss * weight

            with ctx.autocast():  # type: ignore[attr-defined]
                run_schedule(chain, sched, x, loss_fn, y)
            return losses[0]

        return fb


def plan_remat(chain: nn.Module, remat: object, x: torch.Tensor | None, y: torch.Tensor | None,
               loss_fn: Callable | None, precision: str) -> RematChoice:
    """Plan ``memory.remat`` (a :class:`~scaletrain.plan.RematPlan`) for ``chain`` on one micro-batch
    ``(x, y)``: explicit blocks, or the solver's schedule on the fake-tensor estimate of the step
    (nothing allocated), as a tree when it is one."""
    from scaletrain.techniques.remat import parse_bytes, solve
    from scaletrain.techniques.remat.fromtrace import estimate_graph

    r = remat
    n = len(chain.blocks)  # type: ignore[attr-defined]
    if r.method == "none":  # type: ignore[attr-defined]
        return RematChoice(blocks_tree(n, r.blocks), None, f"blocks {r.blocks} checkpointed")  # type: ignore[attr-defined]
    if x is None:
        raise UserError("planning rematerialization needs an example micro-batch")
    graph, _ = estimate_graph(chain, x, target=y, loss_fn=loss_fn, precision=precision)
    budget = parse_bytes(r.budget)  # type: ignore[attr-defined]
    how = f"{r.method}" + (f" under {r.budget}" if r.budget else "")  # type: ignore[attr-defined]
    if r.method not in ("none", "periodic", "revolve", "optimal"):  # type: ignore[attr-defined]
        sched = solve(graph, budget, r.method)  # type: ignore[attr-defined]
        try:  # the executor's semantics (one backward per block): no pending gradients
            return RematChoice(schedule_tree(sched.ops, n), sched, how)
        except UserError:
            return RematChoice(None, sched, how)
    # One backward through nested checkpoints: a tied parameter's gradient is pending from its last
    # user's backward to its first's. The solvers do not model it, so they get the budget less
    # those bytes; the schedule's prediction is the replay with them.
    pending = shared_gradients(chain)
    held = sum(b for _, _, b in pending)
    if budget is not None and held:
        from scaletrain.techniques.remat import min_budget

        lowest = min_budget(graph, r.method) + held  # type: ignore[attr-defined]
        if budget < lowest:
            raise UserError(f"budget {fmt_bytes(budget)} is below the minimum feasible {fmt_bytes(lowest)} for "
                            f"method {r.method!r} on this chain ({n} blocks; {held} B of it are tied-parameter "  # type: ignore[attr-defined]
                            f"gradients the backward holds)")
    sched = solve(graph, None if budget is None else budget - held, r.method)  # type: ignore[attr-defined]
    import dataclasses

    from scaletrain.techniques.remat.simulate import simulate

    rep = simulate(dataclasses.replace(graph, pending=pending), sched.ops)
    sched = dataclasses.replace(sched, predicted_peak_bytes=rep.peak_bytes, budget_bytes=budget)
    return RematChoice(schedule_tree(sched.ops, n), sched, how)


def shared_gradients(chain: nn.Module) -> tuple[tuple[int, int, int], ...]:
    """``(first user, last user, gradient bytes)`` of every parameter several blocks use."""
    users: dict[int, list[int]] = {}
    params: dict[int, torch.Tensor] = {}
    for i, b in enumerate(chain.blocks):  # type: ignore[attr-defined]
        for p in b.parameters():
            if p.requires_grad:
                users.setdefault(id(p), [])
                if i not in users[id(p)]:
                    users[id(p)].append(i)
                params[id(p)] = p
    out = []
    for k, us in users.items():
        if len(us) > 1:
            p = params[k]
            out.append((min(us), max(us), p.numel() * p.element_size()))
    return tuple(out)

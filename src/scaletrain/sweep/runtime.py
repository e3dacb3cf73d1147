"""One run of a sweep as its trainer sees it: a :class:`Runtime` whose shards run on the hub's devices.

The trainer is the one ``scaletrain train`` uses, unchanged — same data order, loss bookkeeping,
clipping, optimizer, schedule, metrics rows, evaluation and checkpoints — so a run of a sweep
writes what its solo run writes. Only the places where the model is computed differ:

- :meth:`SpilledRuntime.run_micro_batches`: each micro-batch is the shard program
  ``F_0 .. F_{K-2}, FB_{K-1}, B_{K-2} .. B_0`` (see :mod:`.worker`), each task placed by the hub's
  policy on any free device (a backward on the device of its forward); the boundary activations
  and their gradients pass through shared host memory;
- :meth:`SpilledRuntime.eval_batch`: ``E_0 .. E_{K-1}``;
- the optimizer step (``prepare_step`` .. ``after_step``) runs on the host, holding a host core
  from the hub, on the host-resident parameters and gradients (shared memory the workers copy
  from and accumulate into);
- the RNG: the model's stream is carried from forward task to forward task
  (:meth:`rng_state` is what checkpoints store), as one process would draw it.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch import nn

from scaletrain.sweep.hub import Hub
from scaletrain.sweep.worker import desc_of, rng_bytes, rng_tensor, slot_view
from scaletrain.techniques.offload.probe import ChainCosts
from scaletrain.techniques.runtime import RunContext, Strategy


class SpilledRuntime(Strategy):
    """Shard alternator runtime of one model (``index``) on a :class:`Hub`."""

    name = "spilled-shards"

    def __init__(self, model: nn.Module, hub: Hub, index: int, bounds: list[tuple[int, int]], cfg: Any,
                 costs: ChainCosts):
        super().__init__(model)
        self.hub, self.index, self.bounds = hub, index, list(bounds)
        self.params = list(model.parameters())
        with torch.no_grad():
            for p in self.params:
                p.data = p.data.share_memory_()
        self.grads = [torch.zeros_like(p).share_memory_() for p in self.params]
        self.touched = torch.zeros(len(self.params), dtype=torch.uint8).share_memory_()
        uses = self._uses(model)
        self.pending = {i: torch.zeros_like(self.params[i]).share_memory_() for i, n in uses.items() if n > 1}
        self.pending_set = torch.zeros(len(self.params), dtype=torch.uint8).share_memory_()
        self._rng = rng_bytes(torch.get_rng_state())
        self.slots = self._slots(costs)
        hub.broadcast({"op": "register", "model": index, "cfg": cfg, "host": self.params, "grads": self.grads,
                       "touched": self.touched, "pending": self.pending, "pending_set": self.pending_set,
                       "bounds": self.bounds, "slots": self.slots})

    def _slots(self, c: ChainCosts) -> dict[str, torch.Tensor]:
        """Shared uint8 buffers for the micro-batch and every shard boundary (bytes from the probe)."""
        sizes = {"x": c.input_bytes, "y": c.target_bytes}
        for s, (a, _) in enumerate(self.bounds[1:], start=1):
            sizes[f"a{s}"] = sizes[f"g{s}"] = c.blocks[a - 1].out_bytes
        return {n: torch.empty(max(b, 1), dtype=torch.uint8).share_memory_() for n, b in sizes.items()}

    def _put(self, slot: str, t: torch.Tensor) -> tuple:
        desc = desc_of(slot, t)
        slot_view(self.slots[slot], desc).copy_(t)
        return desc

    def _uses(self, model: nn.Module) -> dict[int, int]:
        """Parameter index -> how many shards use it (tied parameters: more than one)."""
        from scaletrain.models.adapters import adapt

        chain = adapt(model).chain()
        index = {id(p): i for i, p in enumerate(self.params)}
        count: dict[int, int] = {}
        for a, b in self.bounds:
            seen = {index[id(p)] for blk in chain.blocks[a:b] for p in blk.parameters()}
            for i in seen:
                count[i] = count.get(i, 0) + 1
        return count

    # -- RNG: the model's own stream ---------------------------------------------------------
    def capture_rng(self) -> None:
        """Take the process RNG as this model's stream (call right after the trainer is built)."""
        self._rng = rng_bytes(torch.get_rng_state())

    def rng_state(self) -> torch.Tensor:
        return rng_tensor(self._rng)

    def set_rng_state(self, state: torch.Tensor) -> None:
        self._rng = rng_bytes(state)

    # -- one optimizer step's micro-batches -------------------------------------------------------
    def run_micro_batches(self, ctx: RunContext, it: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> float:
        self.touched.zero_()
        self.pending_set.zero_()
        step_loss = 0.0
        for _ in range(ctx.accum):
            x, y = next(it)
            step_loss += self._micro_batch(x, y, 1.0 / ctx.accum) / ctx.accum
        for p, g, t in zip(self.params, self.grads, self.touched.tolist()):
            p.grad = g if t else None  # as autograd leaves it: None where no gradient arrived
        return step_loss

    def _micro_batch(self, x: torch.Tensor, y: torch.Tensor, weight: float) -> float:
        k = len(self.bounds)
        where: list[int] = []
        h, yd = self._put("x", x), self._put("y", y)
        for s in range(k - 1):
            r = self.hub.call(self.index, "F", s, {"x": h, "rng": self._rng})
            self._rng, h = r["rng"], r["out"]
            where.append(r["worker"])
        r = self.hub.call(self.index, "FB", k - 1, {"x": h, "y": yd, "weight": weight, "rng": self._rng})
        self._rng, loss = r["rng"], r["loss"]
        for s in range(k - 2, -1, -1):
            r = self.hub.call(self.index, "B", s, {"grad_out": r["grad_in"]}, pin=where[s])
        return loss

    def eval_batch(self, ctx: RunContext, x: torch.Tensor, y: torch.Tensor) -> tuple[float, int, int]:
        h, yd = self._put("x", x), self._put("y", y)
        k = len(self.bounds)
        for s in range(k):
            r = self.hub.call(self.index, "E", s, {"x": h, "y": yd if s == k - 1 else None, "task": ctx.task})
            h = r.get("out")
        return r["loss"], r["correct"], r["n"]

    # -- the host step ------------------------------------------------------------------------
    def prepare_step(self, optimizer: torch.optim.Optimizer) -> None:
        self._host = self.hub.host(self.index)
        self._host.__enter__()

    def after_step(self) -> None:
        host, self._host = getattr(self, "_host", None), None
        if host is not None:
            host.__exit__(None, None, None)

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        for p in self.params:  # the shared buffers stay; the trainer sees None as after set_to_none
            p.grad = None

    def describe(self) -> str:
        return f"{len(self.bounds)} spilled shards on {self.hub.devices} devices ({self.hub.policy.name})"

"""One logical device of a sweep: a process that runs shard tasks of any model it is given.

A worker holds, per model, a *skeleton* — the model built from its config whose parameters are
device tensors with their storage resized to 0 (FSDP's trick, as weight streaming does in
:mod:`scaletrain.techniques.offload.weights`): the parameter objects, and the views autograd saves
of them, stay valid while the bytes are not on the device. The model's real values live on the
host, in shared memory written by the coordinator's optimizer (ZeRO-Offload's placement: fp32
parameters, gradients and optimizer states on the host).

A task is one shard's piece of a micro-batch (Hydra's spilled model-parallel shards):

- ``F``  forward of a shard that is not the last: promote its parameters (host -> device), run its
  blocks with autograd on, spill every tensor saved for backward to this worker's host memory
  (:class:`~scaletrain.techniques.offload.activations.ActivationOffloader`), copy the output to
  shared host memory for the next shard, demote the parameters. The autograd graph stays in this
  process, so the shard's backward must run here too (the coordinator pins it);
- ``FB`` the last shard: forward, loss, backward at once (nothing to spill);
- ``B``  backward of a shard whose ``F`` ran here: promote the parameters, fetch the spilled
  activations, backward from the output gradient, send the input gradient on;
- ``E``  evaluation forward (no autograd).

Gradients leave the device as each task ends, accumulated into the host buffers exactly as
autograd accumulates ``.grad``: a parameter used by one shard gets ``copy`` on its first
micro-batch of the step and ``add_`` after; a tied parameter (GPT-2's embedding and head, used by
the first and the last shard) first sums its per-shard contributions in backward order, as the
autograd engine's input buffer does, and is accumulated once per micro-batch. So a model trained
in shards on several workers computes bitwise the values of the same model trained in one
process (CPU, same thread count). Dropout: the model's RNG state travels with its forward tasks
and the backward never draws.

Every task runs in a phase of a byte-budgeted :class:`~scaletrain.techniques.offload.pools.LogicalPools`
(CPU) whose tracker raises at the allocation that crosses ``memory.device_budget``; the largest
phase peak is reported. Times are ``time.monotonic()`` (one clock for all processes).
"""

from __future__ import annotations

import os
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from scaletrain.techniques.offload.activations import ActivationOffloader
from scaletrain.techniques.offload.pools import LogicalPools


Desc = tuple
"""A tensor in a model's shared slots: (slot name, dtype name, shape)."""


def slot_view(slot: torch.Tensor, desc: Desc) -> torch.Tensor:
    """The tensor ``desc`` names, viewed in its shared uint8 ``slot`` (no copy)."""
    _, dtype, shape = desc
    dt = getattr(torch, dtype)
    n = dt.itemsize
    for d in shape:
        n *= d
    if n > slot.numel():
        raise RuntimeError(f"boundary tensor {desc} needs {n} B, its slot holds {slot.numel()} B")
    with _disable_current_modes():
        return slot[:n].view(dt).view(shape)


def desc_of(slot: str, t: torch.Tensor) -> Desc:
    return (slot, str(t.dtype).removeprefix("torch."), tuple(t.shape))


def rng_bytes(state: torch.Tensor) -> bytes:
    return state.numpy().tobytes()


def rng_tensor(state: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(state), dtype=torch.uint8).clone()


@dataclass
class Skeleton:
    """One model as this worker sees it (see the module docstring)."""

    chain: Any
    loss: Any
    params: list[nn.Parameter]
    host: list[torch.Tensor]
    grads: list[torch.Tensor]
    touched: torch.Tensor
    """uint8 per parameter: its host gradient holds a value this step."""
    pending: dict[int, torch.Tensor]
    """Tied parameters: the sum of this micro-batch's contributions so far (backward order)."""
    pending_set: torch.Tensor
    bounds: list[tuple[int, int]]
    slots: dict[str, torch.Tensor]
    """Shared host buffers (uint8) for the boundary tensors: ``x`` / ``y`` (the micro-batch), ``a<s>``
    (shard s's input), ``g<s>`` (its gradient). One micro-batch of a model is in flight at a time,
    so one buffer per boundary suffices and tasks carry only names, dtypes and shapes."""
    shard_params: list[list[int]] = field(default_factory=list)
    last_use: dict[int, int] = field(default_factory=dict)
    """Parameter -> the lowest shard using it (the last to run backward)."""
    precision: str = "fp32"


def build_skeleton(spec: dict[str, Any]) -> Skeleton:
    """The model of ``spec['cfg']`` with its parameters emptied and the host tensors attached."""
    from scaletrain.models.adapters import adapt
    from scaletrain.train import preflight

    model = preflight.build_model(spec["cfg"])
    params = list(model.parameters())
    if len(params) != len(spec["host"]):
        raise RuntimeError(f"worker built {len(params)} parameters, the coordinator sent {len(spec['host'])}")
    with torch.no_grad():
        for p, h in zip(params, spec["host"]):
            if p.shape != h.shape or p.dtype != h.dtype:
                raise RuntimeError(f"parameter shape {tuple(p.shape)} != host {tuple(h.shape)}")
            p.data = torch.empty(p.shape, dtype=p.dtype)
            p.data.untyped_storage().resize_(0)
    adapter = adapt(model)
    chain = adapter.chain()
    sk = Skeleton(chain=chain, loss=adapter.loss, params=params, host=spec["host"], grads=spec["grads"],
                  touched=spec["touched"], pending=spec["pending"], pending_set=spec["pending_set"],
                  bounds=[tuple(b) for b in spec["bounds"]], slots=spec["slots"], precision=spec["cfg"].train.precision)
    index = {id(p): i for i, p in enumerate(params)}
    for s, (a, b) in enumerate(sk.bounds):
        seen: list[int] = []
        for blk in chain.blocks[a:b]:
            for p in blk.parameters():
                i = index[id(p)]
                if i not in seen:
                    seen.append(i)
        sk.shard_params.append(seen)
        for i in seen:
            sk.last_use.setdefault(i, s)  # the lowest shard using it: the last to run backward
    return sk


class Worker:
    """The task loop of one logical device (see the module docstring)."""

    def __init__(self, index: int, budget: int | None, track: bool = True):
        self.index = index
        self.pools = LogicalPools(budget, strict=budget is not None, track=track)
        self.models: dict[int, Skeleton] = {}
        self.graphs: dict[tuple[int, int], dict[str, Any]] = {}

    # -- parameters in and out ---------------------------------------------------------------
    def _promote(self, sk: Skeleton, s: int) -> None:
        for i in sk.shard_params[s]:
            p = sk.params[i]
            self.pools.alloc_device_storage(p.data, "parameters")
            self.pools.h2d_into(p.data, sk.host[i], "params")

    def _demote(self, sk: Skeleton, s: int, dry: bool) -> None:
        for i in sk.shard_params[s]:
            p = sk.params[i]
            g, p.grad = p.grad, None
            if g is not None and not dry:
                self._accumulate(sk, i, s, g)
            del g
            self.pools.free_device_storage(p.data)

    def _accumulate(self, sk: Skeleton, i: int, s: int, g: torch.Tensor) -> None:
        """Move one shard's gradient contribution to the host the way autograd would sum it."""
        final = sk.last_use[i] == s
        if i in sk.pending and not final:  # tied, not its last use in backward order: keep the partial sum
            self.pools.d2h_into(sk.pending[i], g, "grads", accumulate=bool(sk.pending_set[i]))
            sk.pending_set[i] = 1
            return
        if i in sk.pending and sk.pending_set[i]:
            with _disable_current_modes():
                g = sk.pending[i] + g  # the engine's input buffer: earlier contributions first
            sk.pending_set[i] = 0
        self.pools.d2h_into(sk.grads[i], g, "grads", accumulate=bool(sk.touched[i]))
        sk.touched[i] = 1

    def _out(self, sk: Skeleton, t: torch.Tensor, slot: str) -> Desc:
        """Copy a boundary tensor (activation or its gradient) to its shared host slot, counted."""
        desc = desc_of(slot, t)
        self.pools.d2h_into(slot_view(sk.slots[slot], desc), t, "activations")
        return desc

    def _input(self, sk: Skeleton, desc: Desc, grad: bool) -> torch.Tensor:
        x = slot_view(sk.slots[desc[0]], desc)
        h = self.pools.device_empty(x.shape, x.dtype, "activations")
        self.pools.h2d_into(h, x, "activations", category="activations")
        return h.requires_grad_(grad and x.is_floating_point())

    def _autocast(self, sk: Skeleton):
        import contextlib

        if sk.precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast("cpu", dtype=torch.bfloat16 if sk.precision == "bf16" else torch.float16)

    # -- tasks -------------------------------------------------------------------------------
    def run(self, msg: dict[str, Any]) -> dict[str, Any]:
        sk = self.models[msg["model"]]
        kind, s = msg["kind"], msg["shard"]
        out: dict[str, Any] = {}
        with self.pools.phase():
            if kind == "E":
                out = self._eval(sk, s, msg)
            elif kind == "F":
                out = self._forward(sk, s, msg)
            elif kind == "FB":
                out = self._forward_backward(sk, s, msg)
            elif kind == "B":
                out = self._backward(sk, s, msg)
            elif kind == "N":  # nothing: the hub's hand-over latency is measured with it
                out = {}
            else:
                raise ValueError(f"unknown task kind {kind!r}")
        return out

    def profile(self, msg: dict[str, Any]) -> dict[tuple[str, int], list[float]]:
        """Seconds of every task of one micro-batch's program (training and evaluation) of model
        ``msg['model']``, run here ``1 + repeats`` times without writing gradients (the first run
        warms up and is dropped). All devices profile at once, so the times include their contention."""
        m = msg["model"]
        sk = self.models[m]
        k = len(sk.bounds)
        times: dict[tuple[str, int], list[float]] = {}
        # private: all devices at once
        shared, sk.slots = sk.slots, {n: torch.empty_like(t) for n, t in sk.slots.items()}
        x, y = desc_of("x", msg["x"]), desc_of("y", msg["y"])
        slot_view(sk.slots["x"], x).copy_(msg["x"])
        slot_view(sk.slots["y"], y).copy_(msg["y"])

        def timed(kind: str, s: int, keep: bool, **kw: Any) -> dict[str, Any]:
            t0 = time.monotonic()
            r = self.run({"model": m, "kind": kind, "shard": s, "dry": True, **kw})
            if keep:
                times.setdefault((kind, s), []).append(time.monotonic() - t0)
            return r

        for rep in range(1 + msg["repeats"]):
            h = x
            for s in range(k - 1):
                h = timed("F", s, rep > 0, x=h)["out"]
            r = timed("FB", k - 1, rep > 0, x=h, y=y, weight=1.0)
            for s in range(k - 2, -1, -1):
                r = timed("B", s, rep > 0, grad_out=r["grad_in"])
            h = x
            for s in range(k):
                h = timed("E", s, rep > 0, x=h, y=y if s == k - 1 else None, task=msg.get("task")).get("out")
        sk.slots = shared
        return times

    def _eval(self, sk: Skeleton, s: int, msg: dict[str, Any]) -> dict[str, Any]:
        from scaletrain.models.adapters.base import logits_of

        a, b = sk.bounds[s]
        sk.chain.train(False)
        self._promote(sk, s)
        with torch.no_grad(), self._autocast(sk):
            h = self._input(sk, msg["x"], grad=False)
            y = sk.chain.run(h, a, b)
            del h
            res: dict[str, Any] = {}
            if s == len(sk.bounds) - 1:
                t = self._input(sk, msg["y"], grad=False)
                res = {"loss": float(sk.loss(y, t)) * len(t), "n": len(t),
                       "correct": int((logits_of(y).argmax(-1) == t).sum()) if msg.get("task") != "lm" else 0}
            else:
                res = {"out": self._out(sk, y, f"a{s + 1}")}
        del y
        self._demote(sk, s, dry=True)
        return res

    def _start_training_task(self, sk: Skeleton, s: int, msg: dict[str, Any]) -> torch.Tensor:
        """Train mode, the model's RNG stream, the shard's parameters in; returns the shard's input."""
        sk.chain.train(True)
        if msg.get("rng") is not None:
            torch.set_rng_state(rng_tensor(msg["rng"]))
        self._promote(sk, s)
        return self._input(sk, msg["x"], grad=s > 0)

    def _forward(self, sk: Skeleton, s: int, msg: dict[str, Any]) -> dict[str, Any]:
        a, b = sk.bounds[s]
        h = self._start_training_task(sk, s, msg)
        off = ActivationOffloader(self.pools, range(a, b), prefetch=b - a)
        off.begin_step([*(sk.params[i] for i in sk.shard_params[s]), *sk.chain.buffers()])
        y = h
        with self._autocast(sk):
            for k in range(a, b):
                with off.hooks(k):
                    y = sk.chain.blocks[k](y)
                off.end_block(k)
        res = {"out": self._out(sk, y.detach(), f"a{s + 1}"), "rng": rng_bytes(torch.get_rng_state())}
        with _disable_current_modes():  # the graph keeps the objects, not the bytes (spilled)
            y.untyped_storage().resize_(0)
            h.untyped_storage().resize_(0)
        self.pools.register(y)
        self.pools.register(h)
        self.graphs[(msg["model"], s)] = {"y": y, "h": h, "off": off, "dry": msg.get("dry", False)}
        self._demote(sk, s, dry=True)  # no gradients yet; frees the parameters' bytes
        return res

    def _forward_backward(self, sk: Skeleton, s: int, msg: dict[str, Any]) -> dict[str, Any]:
        a, b = sk.bounds[s]
        h = self._start_training_task(sk, s, msg)
        with self._autocast(sk):
            loss = sk.loss(sk.chain.run(h, a, b), self._input(sk, msg["y"], grad=False))
        scaled = loss * msg["weight"]
        scaled.backward()
        res: dict[str, Any] = {"loss": float(loss.detach()), "rng": rng_bytes(torch.get_rng_state())}
        if s > 0:
            res["grad_in"] = self._out(sk, h.grad, f"g{s}")
        del h, loss, scaled
        self._demote(sk, s, dry=msg.get("dry", False))
        return res

    def _backward(self, sk: Skeleton, s: int, msg: dict[str, Any]) -> dict[str, Any]:
        g = self.graphs.pop((msg["model"], s))
        self._promote(sk, s)
        a, b = sk.bounds[s]
        off: ActivationOffloader = g["off"]
        for k in range(b - 1, a - 1, -1):
            off.on_backward_start(k)
        grad_out = self._input(sk, msg["grad_out"], grad=False)
        torch.autograd.backward(g["y"], grad_out)
        del grad_out
        res: dict[str, Any] = {}
        h = g["h"]
        if s > 0:
            res["grad_in"] = self._out(sk, h.grad, f"g{s}")
        off.end_step()
        h.grad = None
        del g, h
        self._demote(sk, s, dry=msg.get("dry", False))
        return res


def worker_main(index: int, budget: int | None, threads: int, tasks: Any, results: Any, track: bool = True) -> None:
    """Process entry point: set the thread count, then serve ``tasks`` until ``None`` arrives."""
    torch.set_num_threads(max(1, threads))
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    w = Worker(index, budget, track=track)
    results.put({"ready": index})
    while True:
        msg = tasks.get()
        if msg is None:
            break
        op = msg.get("op", "task")
        try:
            if op == "register":
                w.models[msg["model"]] = build_skeleton(msg)
                res: dict[str, Any] = {}
            elif op == "stats":
                res = {"peak": w.pools.device_peak_bytes, "phase_max": max(w.pools.phase_peaks, default=0),
                       "transfers": w.pools.stats.as_dict()}
            elif op == "profile":
                res = {"times": w.profile(msg)}
            elif op == "reset":
                w.pools.reset_peak()
                w.pools.stats.reset()
                res = {}
            else:
                t0 = time.monotonic()
                res = w.run(msg)
                res["t0"], res["t1"] = t0, time.monotonic()
        except Exception as e:  # noqa: BLE001 - reported to the coordinator, which fails the run in one line
            res = {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}",
                   "trace": traceback.format_exc()}
        res["id"], res["worker"] = msg.get("id"), index
        results.put(res)

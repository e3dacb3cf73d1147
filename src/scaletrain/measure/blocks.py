"""One block's memory, run in isolation: a compact trace of its allocations and frees.

:func:`trace_block` runs ``y = block(x)`` and its backward once under a
:class:`~scaletrain.measure.tracker.MemoryTracker` (on real or on fake tensors) and keeps every
storage event, labelled with the storage's role *relative to the block*:

- ``x``: the input (a private copy, so its free shows when the block stops needing it — after
  the forward, or when the backward node that saved it ran); ``y``: the output; ``saved``:
  other storages saved for backward (e.g. 16-bit weight copies under autocast); ``cache``:
  autocast casts freed only when the autocast region ends; ``temp``: transient; ``g``: the
  output's gradient (freed by the engine during backward); ``gin``: the input's gradient;
  ``pgrad``: a parameter's gradient (with the parameter's index).

The parameters (and the model's own input) exist before and after, so they have no events. The
backward is driven through a root node that hands the engine the output gradient and keeps no
reference to it or to ``y``, so their lifetimes are those they have inside a whole chain.
:mod:`scaletrain.measure.compose` replays these traces in the context of a training step.
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from scaletrain.measure.step import autocast
from scaletrain.measure.tracker import MemoryTracker
from scaletrain.measure.types import BlockProfile, Profile

if TYPE_CHECKING:
    from scaletrain.chain import Chain

aten = torch.ops.aten


def _gqa(query_shape, *shapes) -> list:
    """Key/value shapes with the query's head count: under grouped-query attention (``enable_gqa``, fewer
    KV heads) each KV head serves h_q / h_kv query heads, so the FLOPs are those of the repeated heads —
    and some torch versions' ``sdpa_flop_count`` refuses unequal heads outright (torch 2.11 did on a
    Llama on CUDA)."""
    return [tuple(s[:-3]) + (query_shape[-3],) + tuple(s[-2:]) if len(s) >= 3 else s for s in shapes]


def _sdpa_cpu_flop(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, *_gqa(query_shape, key_shape, value_shape))


def _sdpa_cpu_bwd_flop(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, *_gqa(query_shape, key_shape, value_shape))


# torch.utils.flop_counter knows the CUDA attention kernels but not the CPU flash kernel.
FLOP_MAPPING = {
    aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_cpu_flop,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_cpu_bwd_flop,
}


def flop_counter() -> FlopCounterMode:
    return FlopCounterMode(display=False, custom_mapping=FLOP_MAPPING)


@dataclass
class BlockTrace:
    """Storage events of one block's forward (``events[:fwd_end]``) and backward (the rest)."""

    name: str
    events: list[tuple[str, int, int]]
    """(kind, parameter index or -1, byte delta), in order."""
    fwd_end: int
    x_bytes: int
    x_saved: bool
    """The block saves its input for backward (the input then lives until this block's backward)."""
    x_grad: bool
    """The input receives a gradient (it is floating point and not the model's input)."""
    y_bytes: int
    y_saved: bool
    g_bytes: int
    param_ids: list[int] = field(default_factory=list)
    """``id()`` of each parameter the block uses, in ``block.parameters()`` order."""
    pgrad_bytes: list[int] = field(default_factory=list)
    """Bytes of each parameter's gradient (0 if it got none)."""
    aux_bytes: list[int] = field(default_factory=list)
    """Extra inputs (the loss's target): their bytes."""
    aux_saved: list[bool] = field(default_factory=list)
    buffer_bytes: int = 0
    """Bytes of the block's buffers (e.g. BatchNorm statistics)."""
    buffer_saved_bytes: int = 0
    """Part of ``buffer_bytes`` saved for backward (BatchNorm saves its running statistics)."""
    flops_fwd: float = 0.0
    flops_bwd: float = 0.0
    accum_bwd_events: list[tuple[str, int, int]] | None = None
    """Backward events when the parameters already hold gradients (gradient accumulation)."""

    @property
    def saved_bytes(self) -> int:
        """Bytes saved for backward beyond the input and parameters (the output included if saved)."""
        return sum(d for k, _, d in self.events[: self.fwd_end] if k == "saved" and d > 0) + (
            self.y_bytes if self.y_saved else 0)

    def _peak(self, events, start: int = 0) -> int:
        cur = peak = start
        for _, _, d in events:
            cur += d
            peak = max(peak, cur)
        return peak

    @property
    def fwd_temp_bytes(self) -> int:
        """Peak of the forward above input + output + saved (BlockProfile convention)."""
        fwd = [e for e in self.events[: self.fwd_end] if not (e[0] == "y" and e[2] < 0)]
        return max(0, self._peak(fwd) - self.saved_bytes - (0 if self.y_saved else self.y_bytes))

    @property
    def bwd_temp_bytes(self) -> int:
        """Peak of the backward above its start and the gradients it produces."""
        gin = sum(d for k, _, d in self.events[self.fwd_end:] if k == "gin" and d > 0)
        produced = sum(self.pgrad_bytes) + gin
        return max(0, self._peak(self.events[self.fwd_end:]) - produced)


class _Source(torch.autograd.Function):
    """A private copy of the input, so its storage lives only as long as the block keeps it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g


class _Root(torch.autograd.Function):
    """Starts a backward from ``y`` with a gradient it hands over and forgets (see module doc)."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, holder: list) -> torch.Tensor:
        ctx.holder = holder
        return y.new_empty(0)

    @staticmethod
    def backward(ctx, _g):
        return ctx.holder.pop(), None


def trace_block(name: str, fn: Callable[[torch.Tensor], torch.Tensor], params: list[nn.Parameter],
                x: torch.Tensor, *, x_grad: bool, precision: str = "fp32", aux: tuple[torch.Tensor, ...] = (),
                device_type: str = "cpu", count_flops: bool = True, buffers: tuple[torch.Tensor, ...] = (),
                accumulate: bool = False, granularity: int | None = None) -> tuple[BlockTrace, torch.Tensor]:
    """Run ``fn(x)`` forward and backward once, tracked; return its trace and ``fn(x)`` detached.

    ``params`` are the block's parameters (their ``.grad`` must be None); ``x_grad`` says whether
    the input needs a gradient (False for the model's input). ``aux`` are other inputs (targets).
    With ``accumulate`` the parameters already hold gradients (a later micro-batch of gradient
    accumulation): each new gradient is then a temporary that AccumulateGrad adds and frees.
    """
    x = x.detach()
    if x_grad:
        x.requires_grad_(True)
    holder: list = []
    hooks: list = []
    incoming: dict[int, int] = {}  # record uid of a gradient arriving at a parameter -> its index
    if accumulate:
        for p in params:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
    with MemoryTracker(extra=[x, *aux], device=device_type, granularity=granularity) as t:
        for p in params:
            t.register(p, "parameters")
            if p.grad is not None:
                t.register(p.grad, "gradients")
        t.register(buffers, "other")
        if accumulate:
            for j, p in enumerate(params):
                if p.requires_grad:
                    hooks.append(p.register_hook(
                        lambda g, j=j: incoming.__setitem__(t.record_of(g).uid, j) if t.record_of(g) else None))
        ev = t.events
        # the block's input: the model's input is the caller's (held all along); any other is a
        # private copy (kind "x") that only the block's saved tensors keep alive after the forward
        xin = _Source.apply(x) if x_grad else x
        xin_rec = t.record_of(xin) if x_grad else None
        f0 = len(ev)
        fc = flop_counter() if count_flops else None
        with (fc if fc is not None else contextlib.nullcontext()):
            with autocast(precision, device_type):
                y = fn(xin)
                a0 = len(ev)
        a1 = len(ev)
        src_rec = xin_rec if x_grad else t.record_of(x)
        x_saved = bool(src_rec and src_rec.category == "activations")
        del xin
        flops_fwd = float(fc.get_total_flops()) if fc is not None else 0.0
        y_rec = t.record_of(y)
        out = y.detach().clone()  # the next block's input; its own storage, so y's life is the chain's
        out_rec = t.record_of(out)
        g = torch.ones_like(y)
        g_rec = t.record_of(g)
        holder.append(g)
        del g
        root = _Root.apply(y, holder)
        del y
        f_end = len(ev)
        fc = flop_counter() if count_flops else None
        with (fc if fc is not None else contextlib.nullcontext()):
            torch.autograd.backward(root, torch.empty(0, device=root.device))
        flops_bwd = float(fc.get_total_flops()) if fc is not None else 0.0
        del root
        for h in hooks:
            h.remove()
        pg_recs: dict[int, int] = dict(incoming)
        if not accumulate:
            for j, p in enumerate(params):
                r = t.record_of(p.grad) if p.grad is not None else None
                if r is not None:
                    pg_recs[r.uid] = j
        gin_rec = t.record_of(x.grad) if x.grad is not None else None
        x_rec = t.record_of(x)
        aux_recs = [t.record_of(a) for a in aux]
        skip = {r.uid for r in t.records if r.origin == "pre-existing" and r.uid not in pg_recs}
        skip.add(out_rec.uid if out_rec else -1)
        buf_recs = list({id(r): r for r in map(t.record_of, buffers) if r is not None}.values())
        g_uid = g_rec.uid if g_rec is not None else -1
        events: list[tuple[str, int, int]] = []
        fwd_end = 0
        for i, (_, rec, d) in enumerate(ev):
            if i < f0 or rec.uid in skip:
                continue
            if a1 <= i < f_end and rec.uid == g_uid and d > 0:
                continue  # g exists before the backward starts (it is the next block's input gradient)
            if rec is y_rec:
                kind = "y"
            elif xin_rec is not None and rec is xin_rec:
                kind = "x"
            elif rec.uid == g_uid:
                kind = "g"
            elif rec.uid in pg_recs:
                kind = "pgrad"
            elif gin_rec is not None and rec is gin_rec:
                kind = "gin"
            elif rec.category == "activations":
                kind = "saved"
            elif a0 <= (rec.died if rec.died is not None else -1) < a1:
                kind = "cache"
            else:
                kind = "temp"
            if i < f_end:
                fwd_end += 1
            events.append((kind, pg_recs.get(rec.uid, -1), d))
        pgrad_bytes = [0] * len(params)
        for uid, j in pg_recs.items():
            pgrad_bytes[j] = t.records[uid].nbytes
        trace = BlockTrace(
            name=name, events=events, fwd_end=fwd_end,
            x_bytes=x_rec.nbytes if x_rec else 0, x_saved=x_saved,
            x_grad=x_grad, y_bytes=y_rec.nbytes if y_rec else 0,
            y_saved=bool(y_rec and y_rec.category == "activations"),
            g_bytes=t.records[g_uid].nbytes if g_uid >= 0 else 0, param_ids=[id(p) for p in params],
            pgrad_bytes=pgrad_bytes, aux_bytes=[r.nbytes if r else 0 for r in aux_recs],
            aux_saved=[bool(r and r.category == "activations") for r in aux_recs],
            flops_fwd=flops_fwd, flops_bwd=flops_bwd, buffer_bytes=sum(r.nbytes for r in buf_recs),
            buffer_saved_bytes=sum(r.nbytes for r in buf_recs if r.category == "activations"),
        )
    for p in params:
        p.grad = None
    return trace, out


def _signature(block: nn.Module, x: torch.Tensor, x_grad: bool) -> tuple:
    """Blocks with equal signatures behave identically (same structure, shapes, dtypes, input)."""
    ps = tuple((tuple(p.shape), p.dtype, p.requires_grad) for p in block.parameters())
    return (type(block).__qualname__, repr(block), ps, tuple(x.shape), x.dtype, x_grad, block.training)


def trace_chain(chain, x: torch.Tensor, target: torch.Tensor, loss_fn: Callable, *, precision: str = "fp32",
                accum: int = 1, device_type: str = "cpu", dedupe: bool = False,
                count_flops: bool = True, granularity: int | None = None) -> list[BlockTrace]:
    """Traces of every block of ``chain`` on input ``x``, then of the loss (``loss_fn(out, target) / accum``).

    ``dedupe`` reuses the trace of an identical earlier block (same :func:`_signature`); use it
    on fake tensors, where it makes a 96-layer model cost as much as a 1-layer one.
    """
    traces: list[BlockTrace] = []
    seen: dict[tuple, tuple[BlockTrace, torch.Tensor]] = {}
    h = x
    for i, (name, block) in enumerate(zip(chain.names, chain.blocks)):
        params = list(block.parameters())
        x_grad = i > 0 and h.is_floating_point()
        sig = _signature(block, h, x_grad) if dedupe else None
        if sig is not None and sig in seen:
            tr0, out = seen[sig]
            tr = BlockTrace(**{**tr0.__dict__, "name": name, "param_ids": [id(p) for p in params]})
        else:
            tr, out = trace_block(name, block, params, h, x_grad=x_grad, precision=precision,
                                  device_type=device_type, count_flops=count_flops,
                                  buffers=tuple(block.buffers()), granularity=granularity)
            if accum > 1:
                tr2, _ = trace_block(name, block, params, h, x_grad=x_grad, precision=precision,
                                     device_type=device_type, count_flops=False,
                                     buffers=tuple(block.buffers()), accumulate=True, granularity=granularity)
                tr.accum_bwd_events = tr2.events[tr2.fwd_end:]
            if sig is not None:
                seen[sig] = (tr, out)
        traces.append(tr)
        h = out
    loss, _ = trace_block("loss", lambda z: loss_fn(z, target) / accum, [], h, x_grad=True, precision=precision,
                          aux=(target,), device_type=device_type, count_flops=count_flops, granularity=granularity)
    traces.append(loss)
    return traces


def block_profile(tr: BlockTrace, owned: list[nn.Parameter]) -> BlockProfile:
    """The BlockProfile fields a trace gives (no times)."""
    return BlockProfile(
        name=tr.name, param_bytes=sum(p.numel() * p.element_size() for p in owned),
        param_count=sum(p.numel() for p in owned), input_bytes=tr.x_bytes, output_bytes=tr.y_bytes,
        saved_bytes=tr.saved_bytes, fwd_temp_bytes=tr.fwd_temp_bytes, bwd_temp_bytes=tr.bwd_temp_bytes,
        flops_fwd=tr.flops_fwd, flops_bwd=tr.flops_bwd,
    )


def profile_from_traces(chain: Chain, traces: list[BlockTrace], *, model: str, batch: int, seq: int, precision: str,
                        device: str, measured: bool) -> Profile:
    """Profile (no times) from the chain's traces (the last trace is the loss, kept in meta)."""
    owned = chain.owned_params()
    blocks = [block_profile(tr, own) for tr, own in zip(traces, owned)]
    loss = block_profile(traces[-1], [])
    return Profile(blocks=blocks, model=model, batch=batch, seq=seq, precision=precision, device=device,
                   measured=measured, meta={"loss": asdict(loss)})

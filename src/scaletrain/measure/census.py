"""Each block's operators, counted on fake tensors: what a roofline prices.

A :class:`~scaletrain.measure.types.BlockProfile` holds a block's total FLOPs, but a roofline with
an achieved-efficiency table (:attr:`scaletrain.platform.Platform.matmul_efficiency`, Calculon's
per-matmul-size fractions) needs each kernel: one matmul of 2 GFLOP runs near peak, a thousand of
2 MFLOP do not, and every kernel pays the platform's fixed cost (``kernel_overhead_s``). The census
runs each distinct block forward and backward once on fake tensors (nothing allocated, the same
probe as :mod:`scaletrain.measure.estimate`: identical blocks are counted once) and records every
operator that does work:

- ``flops`` — ``torch.utils.flop_counter``'s formula for the operator (2 per multiply-add; the CPU
  flash-attention kernels by :data:`scaletrain.measure.blocks.FLOP_MAPPING`), 0 for the rest;
- ``nbytes`` — bytes of every tensor it reads plus every tensor it writes (an in-place operator
  reads and writes its operand: counted twice), the memory traffic of a kernel that streams its
  operands once;
- ``half`` — whether it writes a 16-bit result (under autocast the matmuls run in bf16/fp16);
- ``output`` and ``unaligned`` — for a GEMM (``mm``, ``addmm``, ``bmm``, ``baddbmm``) its output's rows,
  columns and batch count, which the roofline tiles on the GPU's SMs (:meth:`~scaletrain.platform.Platform.
  wave_fraction`), and whether any of m, n, k is not a multiple of 8 (cuBLAS's alignment-1 kernels:
  ``Platform.unaligned_matmul_fraction``): the planner's matmuls pass the same (``planner.cost._mm``).

Views and metadata-only operators (``view``, ``t``, ``detach``, ``empty`` ...) move no data and are
left out. Units: FLOPs, bytes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry, shape_wrapper

from scaletrain.measure.blocks import FLOP_MAPPING, _signature
from scaletrain.measure.step import autocast

aten = torch.ops.aten
_NO_WORK = {aten.detach, aten.empty, aten.empty_like, aten.empty_strided, aten.lift_fresh, aten.alias,
            aten._local_scalar_dense, aten.new_empty, aten.new_empty_strided, aten.set_, aten.resize_,
            aten._unsafe_view}
"""Operators that allocate or relabel storage without reading or writing it."""


@dataclass(frozen=True)
class Op:
    """One operator as a kernel: its FLOPs and the bytes it moves."""

    name: str
    flops: float
    nbytes: float
    half: bool = False
    output: tuple[float, float, float] | None = None
    """A GEMM's output (rows m, columns n, batch); None for any other operator."""
    unaligned: bool = False
    """A GEMM with m, n or k not a multiple of 8 (elements)."""


@dataclass
class BlockOps:
    """The operators of one block's forward and of its backward (one micro-batch)."""

    name: str
    fwd: list[Op] = field(default_factory=list)
    bwd: list[Op] = field(default_factory=list)


class _Census(TorchDispatchMode):
    """Records every operator that does work (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[Op] = []
        self.registry = {**flop_registry, **{k: shape_wrapper(v) for k, v in FLOP_MAPPING.items()}}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.record(func, args, kwargs, out)
        return out

    def record(self, func: Any, args: tuple, kwargs: dict, out: Any) -> bool:
        """Append the operator ``func`` (called on ``args``/``kwargs``, giving ``out``) if it does work;
        True when it was appended."""
        packet = func.overloadpacket
        if func.is_view or packet in _NO_WORK:
            return False
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if not outs:  # queries (prim.device, sizes): no kernel
            return False
        ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        nbytes = float(sum(t.numel() * t.element_size() for t in ins + outs))
        fn = self.registry.get(packet)
        flops = float(fn(*args, **kwargs, out_val=out)) if fn is not None else 0.0
        half = any(t.dtype in (torch.bfloat16, torch.float16) for t in outs)
        output, unaligned = gemm_shape(packet, args, outs[0])
        self.ops.append(Op(packet.__name__, flops, nbytes, half, output, unaligned))
        return True


_GEMMS = {aten.mm: 0, aten.addmm: 1, aten.bmm: 0, aten.baddbmm: 1}
"""GEMM operators and the position of their left operand ([.., m, k]) among their arguments."""


def gemm_shape(packet: Any, args: tuple, out: torch.Tensor) -> tuple[tuple[float, float, float] | None, bool]:
    """(output (m, n, batch), unaligned) of a GEMM operator ``packet`` called on ``args`` giving ``out``;
    (None, False) for any other operator. m × n is the output's last two dimensions, batch the product of
    the rest (1 for ``mm``/``addmm``), k the left operand's last dimension."""
    at = _GEMMS.get(packet)
    if at is None or out.dim() < 2 or len(args) <= at or not isinstance(args[at], torch.Tensor):
        return None, False
    m, n, k = out.shape[-2], out.shape[-1], args[at].shape[-1]
    batch = 1
    for d in out.shape[:-2]:
        batch *= d
    return (float(m), float(n), float(batch)), any(d % 8 for d in (m, n, k))


def _run(fn: Callable[[torch.Tensor], torch.Tensor], params: list, h: torch.Tensor, x_grad: bool,
         precision: str) -> tuple[list[Op], list[Op], torch.Tensor]:
    x = h.detach()
    if x_grad:
        x.requires_grad_(True)
    with _Census() as cf:
        with autocast(precision, "cpu"):
            y = fn(x)
    g = torch.ones_like(y)
    with _Census() as cb:
        if y.requires_grad:
            torch.autograd.backward(y, g)
    for p in params:
        p.grad = None
    return cf.ops, cb.ops, y.detach()


def census(chain: Any, example_input: torch.Tensor, target: torch.Tensor, loss_fn: Callable,
           precision: str = "fp32") -> list[BlockOps]:
    """The operators of every block of ``chain`` (a :class:`~scaletrain.chain.Chain` or a module
    :func:`~scaletrain.chain.to_chain` cuts) on one micro-batch, then of the loss (last entry).
    Inputs may be real, meta or fake: only shapes and dtypes are read; nothing is allocated. Inside
    :func:`scaletrain.measure.estimate.trace_cache` an equal call is traced once."""
    from scaletrain.measure import estimate as est

    if est._CACHE is not None:
        key = ("census", est.chain_key(chain), est.spec_key(example_input), est.spec_key(target), id(loss_fn),
               precision)
        return est.cached(key, lambda: _census(chain, example_input, target, loss_fn, precision))
    return _census(chain, example_input, target, loss_fn, precision)


def _census(chain: Any, example_input: torch.Tensor, target: torch.Tensor, loss_fn: Callable,
            precision: str) -> list[BlockOps]:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from scaletrain.chain import to_chain
    from scaletrain.measure.estimate import fake_copy

    chain = to_chain(chain)
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    fchain = fake_copy(chain, mode)
    out: list[BlockOps] = []
    seen: dict[tuple, tuple[BlockOps, torch.Tensor]] = {}
    with mode:
        h = torch.empty(tuple(example_input.shape), dtype=example_input.dtype, device="cpu")
        y = torch.empty(tuple(target.shape), dtype=target.dtype, device="cpu")
        for i, (name, block) in enumerate(zip(chain.names, fchain.blocks)):
            x_grad = i > 0 and h.is_floating_point()
            sig = _signature(block, h, x_grad)
            if sig in seen:
                ops, h = seen[sig]
                out.append(dataclasses.replace(ops, name=name))
                continue
            fwd, bwd, h_next = _run(block, list(block.parameters()), h, x_grad, precision)
            ops = BlockOps(name, fwd, bwd)
            seen[sig] = (ops, h_next)
            out.append(ops)
            h = h_next
        fwd, bwd, _ = _run(lambda z: loss_fn(z, y), [], h, True, precision)
        out.append(BlockOps("loss", fwd, bwd))
    return out

"""8-bit Adam / AdamW: both moments stored block-wise quantized (Dettmers et al. 2021).

State per parameter tensor with >= ``min_8bit_size`` (4096) elements:
  ``m_codes``, ``v_codes``: uint8 [numel]        (1 byte each per value)
  ``m_absmax``, ``v_absmax``: float32 [blocks]   (one scale per 2048 values per moment)
i.e. 2 + 8/2048 = 2.004 bytes/parameter, against 8 for fp32 Adam. Smaller tensors (biases,
norms) keep fp32 ``exp_avg``/``exp_avg_sq`` as in bitsandbytes: quantizing them saves
nothing and hurts most. ``step`` is a Python int (no tensor bytes).

Each step, per block (the paper's order, §2.1): dequantize m and v to fp32, apply the ordinary
Adam update with the *fresh* fp32 moments (so the current gradient is never quantized before
use), update the parameter, then re-quantize the moments with new per-block absmax. m uses the
signed dynamic map, v the unsigned one (see ``quantize.py``), with one safeguard: a positive v
is never stored as 0 (``quantize.encode(keep_nonzero=True)``: values below half the map's
smallest entry, 10^-7 of the block maximum, round up to it). Without it, small-gradient
elements sharing a block with large ones lose v but keep m, and the next update m/eps diverges
(seen on GPT-2 attention weights at step 39 of benchmarks/optim/compare_8bit.py).

Speed: the per-block update is one pure function of block views, applied chunk by chunk of
whole blocks (the loop is over chunks of thousands of blocks, never over blocks).
``fused=True`` runs it through ``torch.compile`` (dynamic shapes: compiled once per process,
~10 s; on CPU it needs a C++ compiler): one fused in-place loop per chunk that reads
p, g and the codes once and writes them once, keeping only the chunk's fp32 m and v (32 MiB per
4 Mi-value chunk). ``fused=False`` runs the same function eagerly (about 15 fp32 temporaries of
a 512 Ki-value chunk, ~10x slower). ``fused=None`` (default) compiles for tensors of at least
``FUSE_MIN_NUMEL`` values and falls back to eager, with a warning, if compilation fails; under
``FakeTensorMode`` (the estimator's dry run) or another ``TorchDispatchMode`` (the memory
tracker, where Dynamo would not compile anyway) it is always eager. Temporary bytes of a step:
:meth:`Adam8bit.step_transient_nbytes` (57 per value of a chunk eager, 8 compiled, which with
the larger compiled chunk is 32 MiB against 28.5 MiB). The two paths agree to float rounding
(compiled code may contract multiply-adds), not bitwise; each is deterministic, so a resumed run
continues bitwise-identically on the same path and device.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable, Iterable

import torch
from torch import Tensor

from scaletrain.techniques.optim import quantize as Q
from scaletrain.techniques.optim._common import DtypePreservingOptimizer, check_beta, check_nonneg

MIN_8BIT_SIZE = 4096
"""Tensors with fewer elements keep fp32 moments (bitsandbytes' rule)."""

CHUNK_BLOCKS = 256
"""Blocks per eager call of the block update (512 Ki values): ~15 fp32 temporaries of 2 MiB."""

CHUNK_BLOCKS_FUSED = 2048
"""Blocks per compiled call (4 Mi values): the fused loop keeps fp32 m and v of the chunk
(8 bytes/value, 32 MiB), and fewer, larger calls pay fewer thread barriers on a busy CPU."""

FUSE_MIN_NUMEL = 1 << 16
"""With ``fused=None``, tensors of at least this many values (64 Ki) use the compiled path."""


def _block_update(
    p: Tensor, g: Tensor, mc: Tensor, vc: Tensor, am: Tensor, av: Tensor,
    qs: Tensor, qu: Tensor, hp: Tensor,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Adam step on [nb, w] block views; returns (p, m_codes, v_codes, m_absmax, v_absmax) new.

    ``hp`` (float32 [8]) = [lr/bc1, 1-beta1, beta2, 1-beta2, 1/sqrt(bc2), eps, decay, l2] with
    bc_i = 1 - beta_i^t (Kingma & Ba bias corrections), decay = 1 - lr*wd for decoupled weight
    decay (Loshchilov & Hutter) else 1, l2 = wd for coupled (Adam) decay else 0.
    """
    pf = p.float()
    g = g.float() + hp[7] * pf  # coupled L2 term (0 for AdamW)
    m = Q.decode(mc, qs) * am
    v = Q.decode(vc, qu) * av
    m = m + hp[1] * (g - m)  # m <- beta1 m + (1-beta1) g
    v = hp[2] * v + hp[3] * g * g  # v <- beta2 v + (1-beta2) g^2
    p_new = pf * hp[6] - hp[0] * m / (v.sqrt() * hp[4] + hp[5])
    am_new = m.abs().amax(dim=1, keepdim=True)
    av_new = v.amax(dim=1, keepdim=True)  # v >= 0
    m_codes = Q.encode(m / am_new.clamp_min(1e-30), signed=True)
    v_codes = Q.encode(v / av_new.clamp_min(1e-30), signed=False, keep_nonzero=True)
    return p_new.to(p.dtype), m_codes, v_codes, am_new, av_new


def _block_update_(
    p: Tensor, g: Tensor, mc: Tensor, vc: Tensor, am: Tensor, av: Tensor,
    qs: Tensor, qu: Tensor, hp: Tensor,
) -> None:
    """:func:`_block_update` written back into its inputs (compiled: one fused in-place loop)."""
    p_new, m_codes, v_codes, am_new, av_new = _block_update(p, g, mc, vc, am, av, qs, qu, hp)
    p.copy_(p_new)
    mc.copy_(m_codes)
    vc.copy_(v_codes)
    am.copy_(am_new)
    av.copy_(av_new)


def _dynamo_would_skip() -> bool:
    """True under a non-infra ``TorchDispatchMode`` (e.g. ``MemoryTracker``), where Dynamo does not
    compile ("non-infra torch dispatch mode present", torch/_dynamo/convert_frame.py) and
    remembers that for the function's code: one call of the compiled kernel there would leave it
    eager — on ``CHUNK_BLOCKS_FUSED`` chunks, 57 bytes of temporaries per value of a 4 Mi-value
    chunk — for the rest of the process. Such steps take the eager path (``CHUNK_BLOCKS``)."""
    from torch.utils import _python_dispatch as pd

    checks = [getattr(pd, n, None) for n in ("any_torch_dispatch_mode_on_stack",
                                              "is_in_any_mode_without_ignore_compile_internals")]
    if not any(checks):  # older torch: any Python dispatch mode
        return pd.is_in_torch_dispatch_mode(include_infra_modes=False)
    return any(c() for c in checks if c is not None)


_compiled: Callable[..., Any] | None = None
_compile_failed = False


def _kernel(fused: bool) -> Callable[..., Any]:
    """The in-place block update, compiled once per process when ``fused`` (else eager)."""
    global _compiled
    if not fused or _compile_failed:
        return _block_update_
    if _compiled is None:
        # Indirect loads index a 256-entry map with uint8 codes, always in bounds, so inductor's
        # per-element bounds assertion is dropped (it costs ~2x on CPU).
        _compiled = torch.compile(
            _block_update_, dynamic=True, options={"assert_indirect_indexing": False}
        )
    return _compiled


class Adam8bit(DtypePreservingOptimizer):
    """Adam with 8-bit block-wise quantized moments (Dettmers et al. 2021).

    Args:
        params: parameters or parameter groups.
        lr: learning rate (default 1e-3).
        betas: (beta1, beta2) moment decay rates (default (0.9, 0.999)).
        eps: denominator term, added to sqrt(v_hat) (default 1e-8).
        weight_decay: L2 coefficient (coupled, added to the gradient) for ``Adam8bit``;
            decoupled (p <- p (1 - lr wd)) for ``AdamW8bit`` (default 0 / 1e-2).
        min_8bit_size: tensors with fewer values keep fp32 moments (default 4096).
        block_size: values per absmax scale (default 2048, as in the paper).
        fused: True = torch.compile the block update, False = eager, None = compile for tensors
            of >= 2^16 values if compilation works here.
        maximize: maximize the objective instead.
    """

    _decoupled = False

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        min_8bit_size: int = MIN_8BIT_SIZE,
        block_size: int = Q.BLOCK_SIZE,
        fused: bool | None = None,
        maximize: bool = False,
    ) -> None:
        check_nonneg("lr", float(lr))
        check_beta("beta1", betas[0])
        check_beta("beta2", betas[1])
        check_nonneg("eps", eps)
        check_nonneg("weight_decay", weight_decay)
        if block_size <= 0:
            raise ValueError(f"invalid block_size: {block_size} (must be > 0)")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        min_8bit_size=min_8bit_size, block_size=block_size, fused=fused,
                        maximize=maximize)
        super().__init__(params, defaults)

    # ---- cost face ---------------------------------------------------------------------
    @staticmethod
    def state_nbytes(numel: int, min_8bit_size: int = MIN_8BIT_SIZE,
                     block_size: int = Q.BLOCK_SIZE) -> int:
        """Exact optimizer-state bytes for one parameter tensor of ``numel`` values (any dtype)."""
        if numel >= min_8bit_size:
            return 2 * numel + 2 * 4 * Q.num_blocks(numel, block_size)
        return 2 * 4 * numel  # fp32 exp_avg + exp_avg_sq

    @staticmethod
    def step_transient_nbytes(
        shapes_and_dtypes: Iterable[tuple[Iterable[int], torch.dtype]],
        *,
        min_8bit_size: int = MIN_8BIT_SIZE,
        block_size: int = Q.BLOCK_SIZE,
        fused: bool | None = None,
        compiled: bool | None = None,
        decoupled: bool = True,
        weight_decay: float = 0.0,
        maximize: bool = False,
        granularity: int = 1,
    ) -> int:
        """Peak bytes one ``step()`` allocates above params + grads + states (one param group).

        Derived from the code below, checked against measured steps by
        ``tests/test_optim_transients.py`` (MemoryTracker for eager, the profiler's allocator
        events for compiled). ``shapes_and_dtypes``: (shape, dtype) of each parameter (its grad
        has the same dtype), contiguous. ``decoupled``: AdamW8bit (True) or Adam8bit (False,
        whose ``weight_decay`` != 0 makes the small-tensor path copy the gradient).
        ``granularity``: each allocation rounded up to it (512 on CUDA). Which block-update path
        each 8-bit tensor takes follows :meth:`_step_8bit`: ``fused`` False = eager, True =
        compiled, None = compiled for >= ``FUSE_MIN_NUMEL`` values; ``compiled`` False (default:
        False once compilation failed in this process) models the eager fallback. The compiled
        figures are torch 2.13's inductor CPU kernel; on CUDA (triton) they are unverified.

        Peaks, in the order ``step()`` runs (4 = bytes of an fp32 value, Ψ = numel):

        - small tensors (< ``min_8bit_size``), :meth:`_step_fp32`, all at once (foreach lists):
          fp32 copies of non-fp32 params (``p32``) and grads, a new gradient list for
          ``maximize`` (``_foreach_neg``) and for Adam's L2 term (``_foreach_add``), each while
          the previous list is alive, then ``denom = _foreach_sqrt(v)``: 4ΣΨ.
        - each 8-bit tensor, :meth:`_step_8bit`: ``hp`` (8 fp32 = 32 B), ``-g`` under
          ``maximize``, and the largest chunk (r blocks, c values) of its block update:

          - eager :func:`_block_update`, peak inside the signed ``Q.encode`` of m (its
            ``encode_magnitude`` at ``torch.round(t).clamp_min(0)``): g, m, v, p_new (4 × 4c),
            ``m / am_new`` and its ``abs`` (2 × 4c), ``k``, ``scale``, ``f``, ``n``, ``t``,
            ``n - 1``, ``round``, ``clamp_min`` (8 × 4c) and the last ``below`` mask (bool, c):
            57c bytes, + am_new, av_new (2 × 4r), + ``pf = p.float()`` (4c) for non-fp32
            params. The unsigned encode of v comes later with less alive (54c).
          - compiled (``torch.compile`` of :func:`_block_update_`, one fused loop): the chunk's
            fp32 m and v buffers and the two block maxima: 8c + 8r.

          Chunks are ``CHUNK_BLOCKS`` (eager) or ``CHUNK_BLOCKS_FUSED`` (compiled) full blocks,
          then the partial tail block (r = 1) alone; each chunk's temporaries die before the next.
        - the two 256-entry fp32 dynamic maps (2 KiB) are cached across steps but first touched
          at the first 8-bit tensor, so a tracker that counts pre-existing storages from their
          first use (MemoryTracker) sees them join there; they are included.

        A step under a ``TorchDispatchMode`` (MemoryTracker, hence ``scaletrain profile``) is
        never compiled (see :func:`_dynamo_would_skip`): it is modelled by ``compiled=False``.
        """
        if compiled is None:
            compiled = not _compile_failed

        def rnd(nbytes: int) -> int:
            return -(-nbytes // granularity) * granularity if nbytes > 0 else 0

        small: list[tuple[int, int]] = []  # (numel, element size)
        large_peak = -1
        for shape, dtype in shapes_and_dtypes:
            n = math.prod(int(s) for s in shape)
            esize = torch.empty((), dtype=dtype, device="meta").element_size()
            if n < min_8bit_size:
                small.append((n, esize))
                continue
            fp32 = dtype == torch.float32
            use_compiled = compiled and (fused if fused is not None else n >= FUSE_MIN_NUMEL)
            peak = rnd(32) + (rnd(n * esize) if maximize else 0)  # hp, -g
            peak += _chunk_peak(n, block_size, use_compiled, fp32, rnd)
            large_peak = max(large_peak, peak)
        # small tensors: one foreach pass (see the list above)
        copies = sum(rnd(4 * n) for n, e in small if e != 4)
        lists = sum(rnd(4 * n) for n, _ in small)
        g = copies  # fp32 gradient copies of non-fp32 grads (fp32 ones are used in place)
        small_peak = copies + g
        for new_list in (maximize, not decoupled and weight_decay != 0):
            if new_list:
                small_peak = max(small_peak, copies + g + lists)
                g = lists
        small_peak = max(small_peak, copies + g + lists) if small else 0  # denom
        maps = 2 * rnd(256 * 4)
        return max(small_peak, maps + large_peak if large_peak >= 0 else 0)

    # ---- apply face --------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimizer step over all parameters that have a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            small, large = [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Adam8bit does not support sparse gradients")
                state = self.state[p]
                if not state:
                    self._init_state(p, state, group)
                state["step"] += 1
                (large if "m_codes" in state else small).append(p)
            if small:
                self._step_fp32(group, small)
            for p in large:
                self._step_8bit(group, p)
        return loss

    def _init_state(self, p: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        state["step"] = 0
        n = p.numel()
        if n >= group["min_8bit_size"]:
            nb = Q.num_blocks(n, group["block_size"])
            state["m_codes"] = torch.full((n,), 127, dtype=torch.uint8, device=p.device)  # 0.0
            state["v_codes"] = torch.zeros(n, dtype=torch.uint8, device=p.device)
            state["m_absmax"] = torch.zeros(nb, dtype=torch.float32, device=p.device)
            state["v_absmax"] = torch.zeros(nb, dtype=torch.float32, device=p.device)
        else:
            state["exp_avg"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            state["exp_avg_sq"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)

    def _hyper(self, group: dict[str, Any], step: int) -> tuple[float, ...]:
        """[lr/bc1, 1-b1, b2, 1-b2, 1/sqrt(bc2), eps, decay, l2] in float64."""
        lr = float(group["lr"])
        b1, b2 = group["betas"]
        wd = group["weight_decay"]
        bc1 = 1.0 - b1**step
        bc2 = 1.0 - b2**step
        decay = 1.0 - lr * wd if self._decoupled else 1.0
        l2 = 0.0 if self._decoupled else wd
        return (lr / bc1, 1.0 - b1, b2, 1.0 - b2, 1.0 / math.sqrt(bc2), group["eps"], decay, l2)

    def _step_fp32(self, group: dict[str, Any], params: list[Tensor]) -> None:
        """Plain Adam for small tensors, vectorised with torch._foreach_* ops (same formulas)."""
        states = [self.state[p] for p in params]
        p32 = [p if p.dtype == torch.float32 else p.float() for p in params]
        grads = [p.grad.float() for p in params]
        if group["maximize"]:
            grads = torch._foreach_neg(grads)
        hyp = [self._hyper(group, s["step"]) for s in states]
        m = [s["exp_avg"] for s in states]
        v = [s["exp_avg_sq"] for s in states]
        if not self._decoupled and group["weight_decay"] != 0:
            grads = torch._foreach_add(grads, p32, alpha=group["weight_decay"])
        torch._foreach_lerp_(m, grads, hyp[0][1])
        torch._foreach_mul_(v, hyp[0][2])
        torch._foreach_addcmul_(v, grads, grads, value=hyp[0][3])
        denom = torch._foreach_sqrt(v)
        torch._foreach_mul_(denom, [h[4] for h in hyp])
        torch._foreach_add_(denom, group["eps"])
        if self._decoupled and group["weight_decay"] != 0:
            torch._foreach_mul_(p32, hyp[0][6])
        torch._foreach_addcdiv_(p32, m, denom, [-h[0] for h in hyp])
        for p, q in zip(params, p32):
            if q is not p:
                p.copy_(q)

    def _step_8bit(self, group: dict[str, Any], p: Tensor) -> None:
        """The quantized update of one large tensor, chunk by chunk of whole blocks."""
        state = self.state[p]
        fused = group["fused"]
        if fused is None:
            fused = p.numel() >= FUSE_MIN_NUMEL
        if fused and (Q.in_fake_mode() or _dynamo_would_skip()):
            fused = False  # fake tensors (the estimator's dry run), a tracker: eager, nothing compiled
        kernel = _kernel(fused)
        hp = torch.tensor(self._hyper(group, state["step"]), dtype=torch.float32, device=p.device)
        qs = Q.dynamic_map(True, p.device)
        qu = Q.dynamic_map(False, p.device)
        bs = group["block_size"]
        pflat = p.view(-1) if p.is_contiguous() else p.reshape(-1).clone()
        g = p.grad.reshape(-1)
        if group["maximize"]:
            g = -g
        mc, vc = state["m_codes"], state["v_codes"]
        am, av = state["m_absmax"], state["v_absmax"]
        n = p.numel()
        full = n // bs
        chunk = CHUNK_BLOCKS_FUSED if kernel is not _block_update_ else CHUNK_BLOCKS
        spans = [(b, min(b + chunk, full)) for b in range(0, full, chunk)]
        for b0, b1 in spans + ([(full, full + 1)] if n % bs else []):
            lo, hi = b0 * bs, min(b1 * bs, n)
            shape = (b1 - b0, -1)
            args = (pflat[lo:hi].view(shape), g[lo:hi].view(shape), mc[lo:hi].view(shape),
                    vc[lo:hi].view(shape), am[b0:b1].view(-1, 1), av[b0:b1].view(-1, 1), qs, qu, hp)
            try:
                kernel(*args)
            except Exception as exc:  # noqa: BLE001 - compiler missing or broken: go eager
                if kernel is _block_update_:
                    raise
                _disable_compile(exc)
                kernel = _block_update_
                kernel(*args)
        if not p.is_contiguous():
            p.copy_(pflat.view(p.shape))


def _chunk_peak(n: int, block_size: int, compiled: bool, fp32: bool, rnd: Callable[[int], int]) -> int:
    """Largest per-chunk temporary bytes of one 8-bit tensor's block update (see
    :meth:`Adam8bit.step_transient_nbytes`); chunks as :meth:`Adam8bit._step_8bit` cuts them."""
    full = n // block_size
    chunk = CHUNK_BLOCKS_FUSED if compiled else CHUNK_BLOCKS
    spans = [(min(chunk, full - b) * block_size, min(chunk, full - b)) for b in range(0, full, chunk)]
    if n % block_size:
        spans.append((n % block_size, 1))  # the partial tail block, alone
    if compiled:  # fp32 m and v of the chunk, block maxima of m and v
        return max(2 * rnd(4 * c) + 2 * rnd(4 * r) for c, r in spans)
    # eager: 14 fp32 chunk-sized tensors + one bool mask + 2 block maxima (+ pf for non-fp32 p)
    return max((14 + (0 if fp32 else 1)) * rnd(4 * c) + rnd(c) + 2 * rnd(4 * r) for c, r in spans)


def _disable_compile(exc: BaseException) -> None:
    global _compile_failed
    _compile_failed = True
    warnings.warn(f"Adam8bit: torch.compile failed ({type(exc).__name__}: {exc}); "
                  "using the eager block update", RuntimeWarning, stacklevel=3)


class AdamW8bit(Adam8bit):
    """:class:`Adam8bit` with decoupled weight decay (Loshchilov & Hutter 2019), default 1e-2."""

    _decoupled = True

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        min_8bit_size: int = MIN_8BIT_SIZE,
        block_size: int = Q.BLOCK_SIZE,
        fused: bool | None = None,
        maximize: bool = False,
    ) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, min_8bit_size=min_8bit_size,
                         block_size=block_size, fused=fused, maximize=maximize)

"""Estimate a model's per-block costs and a training step's memory without allocating anything.

Everything runs on ``FakeTensorMode`` tensors that claim the CPU device (so autocast and the
attention kernel selection behave as on a real CPU) but have no data: the model is copied with
fake parameters, each block runs forward and backward once under the
:class:`~scaletrain.measure.tracker.MemoryTracker` (identical blocks once), and
:func:`~scaletrain.measure.compose.compose_step` replays the traces as a training step with the
optimizer's state and transient (:mod:`scaletrain.measure.optimizers`).

Times in an estimate are FLOPs (``torch.utils.flop_counter``, 2 per multiply-add) divided by a
FLOP/s figure: the ``flops_per_s`` argument, else :data:`NOMINAL_FLOPS_PER_S` for the device —
nominal round numbers, not measurements; pass a calibrated figure for real predictions.

A ``platform`` (a :mod:`scaletrain.platform` preset such as "h100", or a Platform) gives the
device type, the data-sheet FLOP/s for the precision (so times are lower bounds: 100% of peak)
and the device memory, and the estimate says whether the step fits.

Where the device is CUDA, every storage is rounded up to the caching allocator's 512-byte blocks
and Adam's step counters are host tensors; the activations are those of the CPU kernels (flash
attention saves the same output + logsumexp on both; CUDA autocast runs a few more ops in fp32).
"""

from __future__ import annotations

import copy
import itertools
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from scaletrain import models
from scaletrain.chain import Chain, to_chain
from scaletrain.errors import UserError
from scaletrain.measure import optimizers
from scaletrain.measure.blocks import profile_from_traces, trace_chain
from scaletrain.measure.compose import StepEstimate, compose_step, step_from_tracker
from scaletrain.measure.step import DTYPES, check_precision, loss_for, make_batch, make_optimizer, train_step
from scaletrain.measure.tracker import MemoryTracker
from scaletrain.measure.types import Profile

try:  # what FakeTensorMode raises when an op's output depends on tensor values
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    _DATA_DEPENDENT: tuple[type[BaseException], ...] = (
        DataDependentOutputException, DynamicOutputShapeException, GuardOnDataDependentSymNode)
except ImportError:  # pragma: no cover - older torch
    _DATA_DEPENDENT = (RuntimeError,)

NOMINAL_FLOPS_PER_S = {"cpu": 1e11, "cuda": 1e14}
"""FLOP/s used to turn FLOPs into seconds when none is given: 100 GFLOP/s for a multi-core CPU
in fp32, 100 TFLOP/s for a recent data-centre GPU in 16-bit (about a third of an A100/H100's
dense peak). Nominal, not measured."""


def fake_copy(model: nn.Module, mode: FakeTensorMode, *, device: str = "cpu",
              params_dtype: torch.dtype | None = None) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are fake tensors (ties preserved).

    The original (real, meta or fake) is not touched and no parameter data is copied.
    """
    memo: dict[int, Any] = {}
    with mode:
        for t in itertools.chain(model.parameters(), model.buffers()):
            if id(t) in memo:
                continue
            dt = params_dtype if (params_dtype is not None and t.is_floating_point()) else t.dtype
            f = torch.empty(tuple(t.shape), dtype=dt, device=device)
            memo[id(t)] = nn.Parameter(f, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else f
    return copy.deepcopy(model, memo)


def resolve_model(model: str | nn.Module, **overrides: Any) -> tuple[str, nn.Module]:
    """(display name, module): a reference model name is built on the meta device."""
    if isinstance(model, str):
        return model, models.get(model, device="meta", **overrides)
    if overrides:
        raise UserError("model overrides apply only to reference model names")
    return type(model).__name__, model


def _params_dtype(params_dtype: str) -> torch.dtype:
    if params_dtype not in DTYPES:
        raise UserError(f"unknown params dtype {params_dtype!r}; allowed: {', '.join(DTYPES)}")
    return DTYPES[params_dtype]


def _times(profile: Profile, flops_per_s: float) -> None:
    for b in profile.blocks:
        b.fwd_time_s = b.flops_fwd / flops_per_s
        b.bwd_time_s = b.flops_bwd / flops_per_s


_CACHE: dict[tuple, Any] | None = None
"""Traces kept while :func:`trace_cache` is active (None: every call traces)."""


@contextmanager
def trace_cache() -> Iterator[None]:
    """Within it, :func:`estimate_chain` and :func:`~scaletrain.measure.census.census` trace one model on
    one input shape once and hand out copies: the planner prices hundreds of plans of one model, and a
    trace (seconds) depends only on the blocks, the shapes, the precision and the loss, never on the plan."""
    global _CACHE
    outer = _CACHE
    _CACHE = {} if outer is None else outer
    try:
        yield
    finally:
        _CACHE = outer


def cached(key: tuple, make: Callable[[], Any]) -> Any:
    """``make()`` once per ``key`` inside :func:`trace_cache` (a deep copy each time), else every time."""
    if _CACHE is None:
        return make()
    if key not in _CACHE:
        _CACHE[key] = make()
    return copy.deepcopy(_CACHE[key])


def chain_key(chain: Any) -> tuple:
    """Identity of a model's blocks across :func:`to_chain` calls: its parameters' and blocks' ids."""
    ch = to_chain(chain)
    return (tuple(ch.names), tuple(id(p) for p in ch.parameters()), id(getattr(ch, "source", None)))


def spec_key(t: Any) -> tuple | None:
    return None if t is None else (tuple(t.shape), str(t.dtype))


def estimate_chain(chain: Chain | nn.Module, example_input: torch.Tensor, *, target: torch.Tensor | None = None,
                   loss_fn: Callable | None = None, precision: str = "fp32", accum: int = 1,
                   flops_per_s: float | None = None, device: str = "cpu", name: str = "",
                   params_dtype: str = "fp32", platform: Any = None, _return_traces: bool = False):
    """Per-block Profile of ``chain`` from fake tensors (nothing allocated; times from FLOPs).

    ``example_input`` may be real, meta or fake: only its shape and dtype are used. ``target``
    (shape/dtype likewise) and ``loss_fn`` define the loss, profiled into ``meta["loss"]``;
    by default the model's task gives both (see :func:`scaletrain.measure.step.make_batch`).
    Inside :func:`trace_cache` an equal call is traced once.
    """
    if _CACHE is not None:
        key = ("estimate", chain_key(chain), spec_key(example_input), spec_key(target), id(loss_fn), precision,
               accum, flops_per_s, device, name, params_dtype, repr(platform), _return_traces)
        return cached(key, lambda: _estimate_chain(
            chain, example_input, target=target, loss_fn=loss_fn, precision=precision, accum=accum,
            flops_per_s=flops_per_s, device=device, name=name, params_dtype=params_dtype, platform=platform,
            _return_traces=_return_traces))
    return _estimate_chain(chain, example_input, target=target, loss_fn=loss_fn, precision=precision, accum=accum,
                           flops_per_s=flops_per_s, device=device, name=name, params_dtype=params_dtype,
                           platform=platform, _return_traces=_return_traces)


def _estimate_chain(chain: Chain | nn.Module, example_input: torch.Tensor, *, target: torch.Tensor | None,
                    loss_fn: Callable | None, precision: str, accum: int, flops_per_s: float | None, device: str,
                    name: str, params_dtype: str, platform: Any, _return_traces: bool):
    check_precision(precision)
    plat = _platform(platform)
    if plat is not None:
        device = plat.device_type
        flops_per_s = flops_per_s or plat.flops(precision)
    chain = to_chain(chain)
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    fchain = fake_copy(chain, mode, params_dtype=_params_dtype(params_dtype))
    loss_fn = loss_fn or loss_for(chain)
    x_dtype = example_input.dtype
    if x_dtype.is_floating_point and params_dtype != "fp32":
        x_dtype = _params_dtype(params_dtype)  # float inputs follow 16-bit parameters (see make_batch)
    with mode:
        x = torch.empty(tuple(example_input.shape), dtype=x_dtype, device="cpu")
        if target is None:
            _, target = make_batch(chain, example_input.shape[0], _seq(example_input))
        else:
            target = torch.empty(tuple(target.shape), dtype=target.dtype, device="cpu")
        try:
            traces = trace_chain(fchain, x, target, loss_fn, precision=precision, accum=accum, dedupe=True,
                                 granularity=512 if torch.device(device).type == "cuda" else None)
        except _DATA_DEPENDENT as e:
            raise UserError(f"{name or type(chain).__name__} runs data-dependent operations (e.g. boolean-mask "
                            f"indexing: {type(e).__name__}) that fake tensors cannot estimate; measure it with "
                            "`scaletrain profile` instead") from None
    prof = profile_from_traces(chain, traces, model=name or type(getattr(chain, "source", None) or chain).__name__,
                               batch=int(example_input.shape[0]), seq=_seq(example_input), precision=precision,
                               device=device, measured=False)
    fps = flops_per_s or NOMINAL_FLOPS_PER_S.get(torch.device(device).type, NOMINAL_FLOPS_PER_S["cpu"])
    _times(prof, fps)
    prof.meta["flops_per_s"] = fps
    prof.meta["params_dtype"] = params_dtype
    return (prof, traces) if _return_traces else prof


def _platform(platform: Any):
    if platform is None or not isinstance(platform, str):
        return platform
    from scaletrain import platform as platforms

    return platforms.get(platform)


def _check_seq(module: nn.Module, seq: int | None) -> None:
    n_pos = getattr(getattr(module, "config", None), "n_positions", None)
    if seq is not None and n_pos is not None and seq > n_pos:
        raise UserError(f"--seq {seq} exceeds the model's context of {n_pos} positions "
                        f"(raise it with --set n_positions={seq})")


def _seq(x: torch.Tensor) -> int:
    return int(x.shape[1]) if x.dim() == 2 and not x.is_floating_point() else 0


def _round(n: int, device: str) -> int:
    return -(-n // 512) * 512 if torch.device(device).type == "cuda" and n > 0 else n


def estimate_step(model: str | nn.Module, batch: int = 1, seq: int | None = None, *, precision: str = "fp32",
                  optimizer: str = "adamw", accum: int = 1, params_dtype: str = "fp32", device: str = "cpu",
                  foreach: bool | None = None, flops_per_s: float | None = None, loss_fn: Callable | None = None,
                  example_input: torch.Tensor | None = None, target: torch.Tensor | None = None,
                  optimizer_kwargs: dict | None = None, platform: Any = None, **overrides: Any) -> StepEstimate:
    """Memory of one steady-state training step (after the first, so optimizer states exist).

    ``batch`` is the micro-batch; ``accum`` micro-batches per optimizer step. ``precision``:
    autocast dtype with fp32 parameters (bf16/fp16) or none (fp32). ``params_dtype`` bf16/fp16
    stores parameters and gradients in 16 bits with fp32 master weights in the optimizer state
    (ZeRO's 2 + 2 + 12 bytes/parameter with Adam). ``platform`` (preset name or Platform) sets
    the device, the FLOP/s and says whether the step fits (``meta["fits"]``). Nothing is allocated.
    """
    t0 = time.perf_counter()
    check_precision(precision)
    plat = _platform(platform)
    if plat is not None:
        device = plat.device_type
    optimizer = optimizers.check(optimizer)
    if accum < 1 or batch < 1:
        raise UserError(f"batch and accum must be >= 1 (got batch={batch}, accum={accum})")
    name, module = resolve_model(model, **overrides)
    _check_seq(module, seq)
    chain = to_chain(module)
    pdt = _params_dtype(params_dtype)
    if example_input is None:
        with FakeTensorMode():
            example_input, target = make_batch(chain, batch, seq)
    prof, traces = estimate_chain(chain, example_input, target=target, loss_fn=loss_fn, precision=precision,
                                  accum=accum, flops_per_s=flops_per_s, device=device, name=name,
                                  params_dtype=params_dtype, platform=plat, _return_traces=True)
    if optimizers.backward_free(optimizer):  # zero-order: the traced step is two forwards, no gradients
        est = simulate_step(module, batch, seq, precision=precision, optimizer=optimizer, accum=accum,
                            params_dtype=params_dtype, device=device, loss_fn=loss_fn,
                            optimizer_kwargs=optimizer_kwargs)
        est.model, est.profile = name, prof
        est.meta.update(flops_per_s=prof.meta["flops_per_s"], backward_free=True)
        if plat is not None:
            est.meta.update(platform=plat.name, device_memory_bytes=plat.device_memory_bytes,
                            fits=est.bytes["peak"] <= plat.device_memory_bytes)
        est.meta["seconds_to_estimate"] = time.perf_counter() - t0
        return est
    params = list(dict.fromkeys(p for p in module.parameters() if p.requires_grad))
    all_params = list({id(p): p for p in module.parameters()}.values())
    n_params = sum(p.numel() for p in all_params)
    esize = torch.empty((), dtype=pdt).element_size()
    dev = torch.device(device).type
    param_bytes = sum(_round(p.numel() * (esize if p.is_floating_point() else p.element_size()), dev)
                      for p in all_params)
    in_blocks = {id(b) for blk in chain.blocks for b in blk.buffers()}
    buffer_bytes = sum(_round(b.numel() * (esize if b.is_floating_point() else b.element_size()), dev)
                       for b in module.buffers() if id(b) not in in_blocks)
    opt_shapes = [(tuple(p.shape), torch.float32 if params_dtype != "fp32" else p.dtype) for p in params]
    okw = dict(optimizer_kwargs or {})
    state = optimizers.state_bytes(optimizer, opt_shapes, device_type=dev, **okw)
    transient = optimizers.step_transient_bytes(optimizer, opt_shapes, device_type=dev, foreach=foreach, **okw)
    master = 0
    if params_dtype != "fp32":
        master = sum(_round(p.numel() * 4, dev) for p in params)  # fp32 master copy
        state += master
    sim = compose_step(traces, param_bytes=param_bytes, state_bytes=state, step_transient=transient, accum=accum,
                       buffer_bytes=buffer_bytes, master_grad_bytes=master)
    est = StepEstimate(
        model=name, batch=batch, seq=prof.seq, precision=precision, optimizer=optimizer, accum=accum,
        params_dtype=params_dtype, device=device, parameters=n_params,
        bytes={**{k: sim.maxes[k] for k in ("parameters", "gradients", "optimizer_states", "activations")},
               "peak": sim.peak},
        peak_breakdown=sim.peak_breakdown, peak_phase=sim.peak_phase, measured=False, profile=prof,
        timeline=sim.timeline, points=list(enumerate(sim.points)), marks=sim.marks,
        meta={"optimizer_step_transient": transient, "buffers": buffer_bytes,
              "optimizer_step_transient_modelled": optimizers.transient_modelled(optimizer),
              "flops_per_s": prof.meta["flops_per_s"]},
    )
    if plat is not None:
        est.meta.update(platform=plat.name, device_memory_bytes=plat.device_memory_bytes,
                        fits=est.bytes["peak"] <= plat.device_memory_bytes)
    est.meta["seconds_to_estimate"] = time.perf_counter() - t0
    return est


def simulate_step(model: str | nn.Module, batch: int = 1, seq: int | None = None, *, precision: str = "fp32",
                  optimizer: str = "adamw", accum: int = 1, params_dtype: str = "fp32", device: str = "cpu",
                  loss_fn: Callable | None = None, optimizer_kwargs: dict | None = None,
                  **overrides: Any) -> StepEstimate:
    """Cross-check of :func:`estimate_step`: run two whole training steps on fake tensors, track the second.

    Exact for what the tracker sees (same code as a real step), but costs a full step of fake
    ops; the per-block composition is what planners use.
    """
    t0 = time.perf_counter()
    check_precision(precision)
    name, module = resolve_model(model, **overrides)
    mode = FakeTensorMode()
    fmodel = fake_copy(module, mode, params_dtype=_params_dtype(params_dtype))
    with mode:
        opt = make_optimizer(fmodel, optimizers.check(optimizer), params_dtype=params_dtype,
                             **(optimizer_kwargs or {}))
        batches = [make_batch(fmodel, batch, seq) for _ in range(accum)]
        train_step(fmodel, opt, batches, precision=precision, loss_fn=loss_fn)
        with MemoryTracker(model=fmodel, optimizer=opt, extra=[t for b in batches for t in b]) as tr:
            train_step(fmodel, opt, batches, precision=precision, loss_fn=loss_fn, mark=tr.mark)
    est = step_from_tracker(tr, fmodel, name=name, batch=batch, seq=seq or 0, precision=precision,
                            optimizer=optimizer, accum=accum, params_dtype=params_dtype, device=device,
                            measured=False)
    est.meta["seconds_to_estimate"] = time.perf_counter() - t0
    est.meta["method"] = "simulated"
    return est

"""This machine as a :class:`~scaletrain.platform.Platform` for the processes of *this* run.

``plan=auto`` prices plans for the N processes the launcher started, so the figures must be what one
of those N processes gets while the other N − 1 run too. Every figure is therefore measured by all N
ranks *at the same time* (a barrier before each size), each sample long enough (20 ms) for the
scheduler to share the cores among the N processes, and the median sample is kept: a run's step time
is a median over steps that share the cores with whatever else runs, so the rate is the typical one,
not the best slice (:func:`_typical_time`):

* **FLOP/s and the matmul efficiency table** — square fp32 (and bf16 when the run uses it) matmuls of
  n = 16 … 384; the peak is the largest rate, each smaller size's fraction of it becomes a row of
  :attr:`Platform.matmul_efficiency` (threshold in GFLOP). Small matmuls pay PyTorch's dispatch
  overhead, which is exactly what makes a small model's step slower than its FLOPs say.
  With N processes sharing C cores each process's rate is about C/N of one core's (OMP threads: the
  launcher sets 1 per process): measured, not assumed.
* **memory-bound kernels and their table** — what the cost model prices as memory-bound (LayerNorm,
  bias-GELU, bias-dropout-add) measured as such: a tanh-GELU, a LayerNorm and an add over the same
  tensor of 16 KiB … 16 MiB, bytes counted as the cost model counts them (2 + 2 + 3 times the tensor).
  On a CPU these are compute-bound (GELU's tanh): a copy's bandwidth would be ~15x too fast. Measured
  in the run's precision: a bf16 kernel on this CPU converts to fp32 inside and moves half the bytes
  in about the same time, so its bytes/s is half the fp32 one (the cost model halves the bytes).
* **the fixed cost of one kernel** (``Platform.kernel_overhead_s``, added by :mod:`.cost` to every
  kernel it prices) — the run's model cut to one layer, forward and backward on one sequence of 8
  tokens (its kernels do almost no work): measured time minus the roofline's, divided by the number of
  kernels :mod:`.cost` prices for that micro-batch. It is eager PyTorch's dispatch, autograd and Python
  cost per priced kernel (the real model runs several operators per priced kernel: views, dropout,
  reshapes). Without it a micro-batch of 1 looks as fast as one of 16 on a CPU; measured, it is twice
  as slow. Any other model (:func:`traced_kernel_overhead`): the same rule on its Chain and its
  fake-tensor census. No model given: a tiny linear layer's forward and backward / 3.
* **the model's blocks** (``Platform.measured_blocks``, traced models, when the caller gives the
  micro-batches the search may choose): each block forward and backward on real tensors at each size
  (:func:`block_table`, :mod:`scaletrain.measure.block_times`): on a CPU an operator misses the
  roofline by either sign per kind (a convolution's backward 2.7x slower, a ReLU 10x faster), so the
  blocks themselves are the source of the per-block table the traced cost model prices.
* **the optimizer step** (``Platform.optimizer_bytes_per_s``) — the run's optimizer with gradient
  clipping over 2 M parameters, bytes counted as the cost model counts them (:func:`optimizer_rate`).
* **the trainer's host work** (``Platform.host_seconds``, with a model) — the Trainer itself run on the
  model at one sample per micro-batch, ZeRO 0/1/2, 1 and 3 micro-batches, minus the same model's bare
  forward, backward, clipping and optimizer step, in main-thread CPU seconds
  (:mod:`scaletrain.train.host_work`, handed in by the caller: the planner does not import the trainer).
* **collectives** — gloo all-reduces over the run's group: a 4-byte one gives the latency α per ring
  step (t / 2(N − 1)), a 4 MiB one the bandwidth β (ring convention, α removed); one process: none.
  The reduce-scatter and all-gather ZeRO and FSDP call, timed against that ring
  (:func:`sharded_collective_factors`): gloo's reduce-scatter is not a ring (2.2x an all-reduce here).
  FSDP2's own work per ZeRO-3 collective beyond α–β (:func:`fsdp_overhead`: small ``fully_shard``
  units against the same layers unsharded).
* **the pipeline runtime's host work** — per action, per posted send, and a receive while its sender
  computes (:mod:`.pipeline_host`: the runtime's own code on negligible stages).

Device memory is the host's memory divided among the N processes (the CPU "device" is the logical
pool in host memory). Units: FLOP/s, bytes/s, seconds, bytes.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from scaletrain.platform import Platform, _host_memory_bytes

MATMUL_SIZES = (16, 32, 64, 128, 256, 512)
COPY_BYTES = (16 << 10, 128 << 10, 1 << 20, 4 << 20, 16 << 20)


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _typical_time(fn: Callable[[], object], repeats: int, min_s: float = 0.02) -> float:
    """Median seconds of one call of ``fn`` over ``repeats`` samples, each looping until ``min_s`` has
    passed. The median, not the best: a run's step time is a median over steps taken while the other
    processes (its own ranks, other jobs) share the cores, and the best sample is the rare slice in
    which this process had a core to itself (measured here under load ~3 on 2 cores: a 512² fp32
    matmul 76 GFLOP/s best, 47 median; gpt2-mini's matmuls in a run 48)."""
    fn()
    samples = []
    for _ in range(repeats):
        n, t0 = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            dt = time.perf_counter() - t0
            if dt >= min_s:
                break
        samples.append(dt / n)
    samples.sort()
    return max(samples[len(samples) // 2], 1e-9)


def matmul_table(dtype: torch.dtype, repeats: int = 5) -> tuple[float, tuple]:
    """(peak FLOP/s, efficiency rows (GFLOP threshold, fraction of peak), largest first)."""
    rates = []
    for n in MATMUL_SIZES:
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        _barrier()
        rates.append((2 * n**3, 2 * n**3 / _typical_time(lambda: a @ b, repeats)))
    peak = max(r for _, r in rates)
    rows = [(f / 1e9, r / peak) for f, r in rates]
    rows[0] = (0.0, rows[0][1])
    return peak, tuple(sorted(rows, reverse=True))


def elementwise_table(repeats: int = 5, dtype: torch.dtype = torch.float32) -> tuple[float, tuple]:
    """(peak bytes/s of the memory-bound kernels, rows (MB threshold, fraction of peak)): GELU (tanh),
    LayerNorm and add on one tensor of T bytes, counted 2T + 2T + 3T as :mod:`.cost` counts them."""
    import torch.nn.functional as F

    rates = []
    for nbytes in COPY_BYTES:
        x = torch.randn(nbytes // 4 // 128, 128, dtype=dtype)  # the same elements in any dtype: the bytes
        nbytes = x.numel() * x.element_size()                     # the cost model counts are the dtype's
        _barrier()
        t = (_typical_time(lambda: F.gelu(x, approximate="tanh"), repeats)
             + _typical_time(lambda: F.layer_norm(x, (128,)), repeats) + _typical_time(lambda: x + x, repeats))
        rates.append((nbytes, 7 * nbytes / t))
    peak = max(r for _, r in rates)
    rows = [(b / 1e6, r / peak) for b, r in rates]
    rows[0] = (0.0, rows[0][1])
    return peak, tuple(sorted(rows, reverse=True))


def kernel_overhead(repeats: int = 5) -> float:
    """Seconds per operator of a step whose operators do no work (module docstring)."""
    x = torch.randn(1, 8)
    w = torch.randn(8, 8, requires_grad=True)

    def step() -> None:
        x2 = x.requires_grad_(True)
        torch.nn.functional.linear(x2, w).backward(torch.ones(1, 8))

    _barrier()
    return _typical_time(step, repeats) / 3


def model_kernel_overhead(name: str, overrides: dict, plat: Platform, precision: str = "fp32",
                          repeats: int = 5) -> float:
    """Seconds per priced kernel of ``name`` with one layer on one 8-token sequence, in ``precision``
    (autocast's casts are kernels too) (module docstring)."""
    import contextlib

    import torch.nn.functional as F

    from scaletrain import models
    from scaletrain.plan import Plan
    from scaletrain.planner.cost import plan_cost
    from scaletrain.planner.shape import Shape

    over = {**overrides, "n_layer": 1}
    shape, model = Shape.of(name, **over), models.get(name, **over)
    x = torch.randint(0, shape.vocab, (1, 8))

    cast = (torch.autocast("cpu", dtype=torch.bfloat16 if precision == "bf16" else torch.float16)
            if precision != "fp32" else contextlib.nullcontext())

    def step() -> None:
        with cast:
            out = model(x)
        F.cross_entropy(out.flatten(0, 1).float(), x.flatten()).backward()

    _barrier()
    t = _typical_time(step, repeats)

    def priced(overhead: float) -> float:
        return plan_cost(shape, Plan(dp=1, micro_batch=1, precision=precision), plat.with_(kernel_overhead_s=overhead),
                         global_batch=1, seq=8).phases_s["compute"]

    roofline = priced(0.0)
    return max((t - roofline) / (priced(1.0) - roofline), 0.0)


def traced_kernel_overhead(name: str, overrides: dict, plat: Platform, precision: str = "fp32",
                           repeats: int = 5) -> float:
    """Seconds per priced operator of any model the traced cost model prices (VGG, BERT, ...): the
    model's Chain, forward and backward of one sample (8 tokens for a language model), measured,
    minus the roofline of its fake-tensor census (:func:`scaletrain.techniques.time_cost.block_seconds`,
    no fixed cost), divided by the census's operator count — the same rule as
    :func:`model_kernel_overhead`, on the operators the traced cost model adds the fixed cost to."""
    import contextlib

    from scaletrain import models
    from scaletrain.chain import to_chain
    from scaletrain.measure.census import census
    from scaletrain.models.adapters import adapt
    from scaletrain.techniques.plan_cost import _loss
    from scaletrain.techniques.time_cost import block_seconds

    model = models.get(name, **overrides)
    a = adapt(model)
    lm = a.task == "lm"
    spec = a.input_spec(1, 8 if lm else None)
    x = (torch.randn(tuple(spec.shape), dtype=spec.dtype) if spec.is_floating_point()
         else torch.zeros(tuple(spec.shape), dtype=spec.dtype))
    y = torch.zeros(tuple(x.shape) if lm else (1,), dtype=torch.long)
    chain = to_chain(model)
    ops = census(chain, x, y, _loss, precision)
    cast = (torch.autocast("cpu", dtype=torch.bfloat16 if precision == "bf16" else torch.float16)
            if precision != "fp32" else contextlib.nullcontext())

    def step() -> None:
        with cast:
            out = chain(x)
        _loss(out, y).backward()

    _barrier()
    t = _typical_time(step, repeats)

    def priced(overhead: float) -> float:
        fwd, bwd = block_seconds(ops, plat.with_(kernel_overhead_s=overhead))
        return sum(fwd) + sum(bwd)

    roofline = priced(0.0)
    return max((t - roofline) / max(priced(1.0) - roofline, 1.0), 0.0)


def block_table(name: str, overrides: dict, precision: str, micro_batches: tuple[int, ...], seq: int,
                repeats: int = 3, budget_s: float = 20.0) -> tuple:
    """:attr:`Platform.measured_blocks` for one model: its blocks timed forward and backward on real
    tensors (:func:`scaletrain.measure.block_times.time_blocks`) at each of ``micro_batches``, smallest
    first, every rank at once (a barrier before each size). Sizes left once ``budget_s`` seconds have
    gone are not measured (the cost model scales from the largest measured one; every rank stops at the
    same size: rank 0's clock decides). Units: seconds.

    With more than one process and a model whose family has a tensor-parallel split, the blocks are
    timed a second time sharded over all the processes (``parallel.tp`` = world, and with sequence
    parallelism where the family offers it) under key
    :func:`~scaletrain.measure.block_times.tp_key`: a TP block on this CPU is not its
    roofline's share of the whole block plus an α–β all-reduce — measured here (2026-11-28, gpt2-mini,
    2 gloo processes) its DTensor dispatch and the in-layer all-reduces, each waiting for the slower
    rank, made tp=2 steps 1.7-2.4x the plain ones the roofline split predicted faster. Those rows carry
    the in-layer collectives' time; the cost model then prices no separate TP collective time."""
    from scaletrain import models
    from scaletrain.chain import to_chain
    from scaletrain.measure.block_times import model_key, tp_key

    model = models.get(name, **overrides)
    key = model_key(model, to_chain(model))
    t0 = time.perf_counter()
    rows = _timed_rows(model, key, precision, micro_batches, seq, repeats, lambda: time.perf_counter() - t0 < budget_s)
    world = dist.get_world_size() if dist.is_initialized() else 1
    for sp in _tp_layouts(model, world, seq):
        torch.manual_seed(0)
        sharded = models.get(name, **overrides)
        t1 = time.perf_counter()
        rows += _timed_rows(sharded, tp_key(key, world, sp), precision, micro_batches, seq, repeats,
                            lambda: time.perf_counter() - t1 < budget_s / 4, tp=(world, sp))
    return tuple(rows)


def _tp_layouts(model: torch.nn.Module, world: int, seq: int) -> list[bool]:
    """The sequence-parallel flags of the TP layouts :func:`block_table` times at tp = ``world``: none with
    one process, or when the family has no split, or the table refuses tp = ``world`` for this model."""
    from scaletrain.plan import Plan
    from scaletrain.techniques import compat
    from scaletrain.techniques.tensor_parallel import costed

    if world < 2 or not costed(model):
        return []
    facts = compat.Facts.of(model, world=world, device="cpu", seq_len=seq)
    return [sp for sp in (False, True) if not compat.violations(Plan(tp=world, sp=sp), facts)]


def _timed_rows(model: torch.nn.Module, key: str, precision: str, micro_batches: tuple[int, ...], seq: int,
                repeats: int, go_on: Callable[[], bool], tp: tuple[int, bool] | None = None) -> list:
    """The rows of :func:`block_table` for one layout (``tp``: (degree, sequence parallel) to shard
    ``model`` over every process first)."""
    import contextlib

    from scaletrain.chain import to_chain
    from scaletrain.measure.block_times import time_blocks
    from scaletrain.models.adapters import adapt
    from scaletrain.techniques.plan_cost import _loss

    a = adapt(model)
    lm = a.task == "lm"
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    if tp is not None:
        from torch.distributed.device_mesh import init_device_mesh

        from scaletrain.techniques.tensor_parallel import apply_tensor_parallel, loss_context

        apply_tensor_parallel(model, init_device_mesh("cpu", (tp[0],)), sequence_parallel=tp[1])
        context = lambda: loss_context(model)  # noqa: E731 - the vocabulary-parallel loss, forward and backward
    chain = to_chain(model)
    rows = []
    for b in sorted(set(micro_batches)):
        go = torch.tensor([1 if go_on() else 0])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast(go, 0)
        if not go.item():
            break
        spec = a.input_spec(b, seq if lm else None)
        x = (torch.randn(tuple(spec.shape), dtype=spec.dtype) if spec.is_floating_point()
             else torch.zeros(tuple(spec.shape), dtype=spec.dtype))
        y = torch.zeros(tuple(x.shape) if lm else (b,), dtype=torch.long)
        _barrier()
        with context():
            f, g = time_blocks(chain, x, y, _loss, precision, repeats)
        rows.append((key, precision, int(seq if lm else 0), int(b), tuple(f), tuple(g)))
    return rows


def optimizer_rate(name: str = "adamw", n_params: int = 1 << 21, repeats: int = 5,
                   shapes: list[tuple[int, ...]] | None = None) -> float:
    """Bytes/s of the optimizer step as the trainer runs it (:func:`~scaletrain.techniques.optim.registry.
    build_optimizer`, torch's foreach kernels, after clipping the gradients' norm) over the model's own
    parameter ``shapes`` when given, else ``n_params`` parameters in 256 x 256 tensors, the bytes counted
    as the cost model counts them (:func:`~scaletrain.techniques.optim.registry.optimizer_step_bytes`). Its
    kernels are plain streaming arithmetic, several times faster per byte on a CPU than the tanh-GELU and
    LayerNorm that set the memory-bound rate (measured here: AdamW on gpt2-mini's 4.9 M parameters 30 ms +
    clipping 4 ms, where that rate priced 147 ms). The model's shapes matter: a CNN's many small biases
    and norms cost a fixed time per tensor that 256 x 256 tensors hide."""
    from scaletrain.techniques.optim.registry import build_optimizer, optimizer_step_bytes, state_bytes_per_param

    shapes = shapes or [(256, 256)] * max(n_params // 65536, 1)
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = build_optimizer(name, params)

    def step() -> None:
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()

    _barrier()
    t = _typical_time(step, repeats)
    moved = sum(p.numel() * optimizer_step_bytes(name, float(state_bytes_per_param(name, tuple(p.shape))))
                for p in params)
    return moved / t


def _param_shapes(name: str, overrides: dict) -> list[tuple[int, ...]] | None:
    """The trainable parameters' shapes of ``name`` (built on the meta device; tied ones once; up to
    :data:`MAX_OPTIMIZER_PARAMS` values), or None when it cannot be built."""
    from scaletrain import models

    try:
        model = models.get(name, device="meta", **overrides)
    except Exception:  # noqa: BLE001 - the synthetic shapes stand in; the planner reports the model itself
        return None
    shapes, total = [], 0
    for p in dict.fromkeys(model.parameters()):
        if p.requires_grad and total < MAX_OPTIMIZER_PARAMS:  # a large model: its first tensors stand for it
            shapes.append(tuple(p.shape))
            total += p.numel()
    return shapes or None


MAX_OPTIMIZER_PARAMS = 1 << 23
"""Parameters (8 Mi: 128 MiB with AdamW's gradient and states) past which :func:`_param_shapes` stops
listing a model's tensors for the optimizer's measured rate."""


def collective_rates(world: int, repeats: int = 7) -> tuple[float, float]:
    """(bytes/s per direction β, seconds per ring step α) of all-reduce over the default group."""
    if world <= 1 or not dist.is_initialized():
        return 1e12, 0.0
    small, big = torch.zeros(1), torch.zeros(1 << 20)
    _barrier()
    t_small = _typical_time(lambda: dist.all_reduce(small), repeats, min_s=0.0)
    _barrier()
    t_big = _typical_time(lambda: dist.all_reduce(big), repeats, min_s=0.0)
    alpha = t_small / (2 * (world - 1))
    wire = 2 * (world - 1) / world * big.numel() * 4
    return wire / max(t_big - 2 * (world - 1) * alpha, 1e-9), alpha


def sharded_collective_factors(world: int, beta: float, alpha: float, repeats: int = 7) -> tuple[float, float]:
    """(reduce-scatter, all-gather) seconds over their α–β ring time ((n − 1)/n of the bytes at ``beta``
    plus (n − 1) α): :attr:`Platform.reduce_scatter_factor` / ``all_gather_factor``, measured with the
    tensor collectives ZeRO and FSDP call, 4 MiB in all, over the default group; (1, 1) for one process."""
    if world <= 1 or not dist.is_initialized():
        return 1.0, 1.0
    full = torch.zeros(1 << 20)
    shard = torch.zeros(full.numel() // world)
    ring = (world - 1) / world * full.numel() * 4 / beta + (world - 1) * alpha
    _barrier()
    t_rs = _typical_time(lambda: dist.reduce_scatter_tensor(shard, full), repeats, min_s=0.0)
    _barrier()
    t_ag = _typical_time(lambda: dist.all_gather_into_tensor(full, shard), repeats, min_s=0.0)
    return max(t_rs / ring, 1e-3), max(t_ag / ring, 1e-3)


def fsdp_overhead(world: int, beta: float, alpha: float, repeats: int = 7, layers: int = 4) -> float:
    """Seconds FSDP2 adds to each of its collectives beyond α–β (``Platform.fsdp_collective_overhead_s``):
    a stack of ``layers`` small Linear layers, each its own ``fully_shard`` unit over the run's group (as
    ZeRO-3 shards blocks), forward and backward on one tiny batch, against the same stack unsharded;
    the difference, less the α–β time of its 3 collectives per unit (gather, backward re-gather,
    reduce-scatter), divided by their number. One call per sample: every rank runs the same number."""
    if world <= 1 or not dist.is_initialized():
        return 0.0
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from scaletrain.cost import collective_seconds

    torch.manual_seed(0)
    plain = nn.Sequential(*[nn.Linear(32, 32) for _ in range(layers)])
    sharded = nn.Sequential(*[nn.Linear(32, 32) for _ in range(layers)])
    mesh = init_device_mesh("cpu", (world,))
    for layer in sharded:
        fully_shard(layer, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    x = torch.randn(2, 32)

    def step(m: nn.Module) -> None:
        m(x).sum().backward()

    _barrier()
    t_plain = _typical_time(lambda: step(plain), repeats, min_s=0.0)
    _barrier()
    t_fsdp = _typical_time(lambda: step(sharded), repeats, min_s=0.0)
    n = 3 * layers
    unit = 32 * 33 * 4  # bytes of one layer's weight and bias
    wire = n * collective_seconds((world - 1) / world * unit, world - 1, beta, alpha)
    return max((t_fsdp - t_plain - wire) / n, 0.0)


def measure(world: int, precision: str = "fp32", model: tuple[str, dict] | None = None,
            optimizer: str = "adamw", micro_batches: tuple[int, ...] = (), seq: int = 0,
            host: Callable[..., tuple] | None = None) -> Platform:
    """This machine for one of ``world`` processes; every rank calls it at once (module docstring).
    ``model``: (model name, overrides) whose operators set the fixed cost per kernel; ``optimizer``:
    the run's, whose step sets ``optimizer_bytes_per_s``; ``micro_batches`` (with ``seq``, the run's
    sequence length, 0 for a model without one): the sizes at which the model's blocks are timed
    (:attr:`Platform.measured_blocks`; :func:`block_table`); ``host``: with a model, measures the trainer's
    host work per step on it (:attr:`Platform.host_seconds`): :func:`scaletrain.train.host_work.host_seconds`,
    handed in by plan=auto's caller (the trainer) and the benchmarks; None leaves it unmeasured.
    Returns each rank's own measurement (rank 0's is the one ``plan=auto`` uses)."""
    t0 = time.perf_counter()
    f32, mm = matmul_table(torch.float32)
    f16 = f32
    if precision != "fp32":  # CPU autocast runs bf16/fp16 matmuls: their own rate
        f16, mm = matmul_table(torch.bfloat16 if precision == "bf16" else torch.float16)
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    bw, mem = elementwise_table(dtype=half or torch.float32)  # under autocast they run in 16 bits
    overhead = kernel_overhead()
    opt_rate = optimizer_rate(optimizer, shapes=_param_shapes(*model) if model is not None else None)
    beta, alpha = collective_rates(world)
    fsdp = fsdp_overhead(world, beta, alpha)
    rs_factor, ag_factor = sharded_collective_factors(world, beta, alpha)
    from scaletrain.planner.pipeline_host import host_costs

    pipeline = host_costs(world)  # the pipeline runtime's host work per action and its blocking receive
    threads = torch.get_num_threads()
    plat = Platform(
        name=f"local-cpu/{world}", device_type="cpu", device_memory_bytes=_host_memory_bytes() // max(world, 1),
        host_memory_bytes=_host_memory_bytes(), flops_fp32=f32, flops_bf16=f16, device_mem_bytes_per_s=bw,
        h2d_bytes_per_s=bw, d2h_bytes_per_s=bw, host_memcpy_bytes_per_s=bw, copy_overlaps_compute=False,
        matmul_efficiency=mm, mem_efficiency=mem, intra_node_bytes_per_s=beta, inter_node_bytes_per_s=beta,
        intra_node_efficiency=1.0, inter_node_efficiency=1.0, intra_node_latency_s=alpha,
        inter_node_latency_s=alpha, devices_per_node=max(world, 1), kernel_overhead_s=overhead,
        optimizer_bytes_per_s=opt_rate, fsdp_collective_overhead_s=fsdp, reduce_scatter_factor=rs_factor,
        all_gather_factor=ag_factor, **pipeline,
        source=f"planner.local.measure: {world} process(es) x {threads} thread(s) measured at once, "
               f"{time.strftime('%Y-%m-%dT%H:%M:%S')}",
        meta={"threads": threads})
    if model is not None:
        from scaletrain.errors import UserError
        from scaletrain.planner.shape import analytic

        fixed = model_kernel_overhead if analytic(model[0]) else traced_kernel_overhead
        try:
            plat = plat.with_(kernel_overhead_s=fixed(model[0], model[1], plat, precision))
            if micro_batches:  # every model, decoder shapes included: plan=auto prices them by their trace
                plat = plat.with_(measured_blocks=block_table(model[0], model[1], precision, micro_batches, seq))
            if host is not None:  # the trainer's own host work on this model (train.host_work)
                t1 = time.perf_counter()
                plat = plat.with_(host_seconds=host(model[0], model[1], precision, world, optimizer=optimizer))
                plat.meta["host_seconds_measured_in_s"] = time.perf_counter() - t1
        except UserError:  # a model the cost model cannot price: the planner says so later, in its own words
            pass
    plat.meta["seconds"] = time.perf_counter() - t0
    return plat


def calibrate_to_file(devices: int, path: Path, model: str = "gpt2-mini", precision: str = "fp32",
                      timeout_s: float = 300.0, env: dict[str, str] | None = None) -> Platform | None:
    """This machine for one of ``devices`` processes, measured by ``devices`` processes at once under
    ``torch.distributed.run`` (rank 0 writes the Platform's JSON to ``path``; an existing file is reused).
    None if the measurement failed or timed out. ``scaletrain calibrate`` and ``scaletrain compare`` use it."""
    import json
    import subprocess
    import sys

    from scaletrain.errors import UserError

    if not path.is_file():
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={devices}",
               "-m", "scaletrain.planner.local", str(path), model, precision]
        try:
            subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False, env=env)
        except subprocess.TimeoutExpired:
            return None
    try:
        return Platform.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, UserError):
        return None


def _main(argv: list[str]) -> int:
    """Under torchrun: every rank measures at once, rank 0 writes ``argv[0]`` (the Platform's JSON);
    ``argv[1]`` the model whose kernels set the fixed cost per kernel, ``argv[2]`` the precision."""
    import json
    import os

    path, model = Path(argv[0]), argv[1]
    precision = argv[2] if len(argv) > 2 else "fp32"
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    plat = measure(world, precision, (model, {}))
    if int(os.environ.get("RANK", "0")) == 0:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(plat.to_dict()))
        os.replace(tmp, path)
    if world > 1:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":  # pragma: no cover - the calibration subprocess
    import sys

    sys.exit(_main(sys.argv[1:]))

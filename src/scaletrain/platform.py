"""The hardware a plan runs on: memories, FLOP/s and the bandwidths that offloading pays for.

A :class:`Platform` is what every cost face multiplies bytes and FLOPs by. Units: bytes,
bytes per second, FLOP/s (floating-point operations per second), parameters per second.

Presets (``get("h100")`` ...) take the accelerator figures from NVIDIA's data sheets (dense,
i.e. without 2:4 sparsity); host-link and disk figures are the spec figures times an
*achieved fraction* stated next to them, because a plan is predicted with what a copy really
reaches, not with the line rate. Host memory, disk and CPU-Adam rates describe the usual
server these cards sit in (the DGX of the same generation) and are assumptions: run
:func:`calibrate` on the real machine to replace them.

:func:`calibrate` measures *this* machine: memcpy bandwidth, disk read/write bandwidth
(with the page cache dropped for the file read back), CPU Adam parameters/s and matmul
FLOP/s; on CUDA also pinned host<->device bandwidth and the device's memory. On a CPU-only
machine the "device" is the logical device pool of the offload technique (its ``pools``),
so host<->device copies are memcpys (``copy_overlaps_compute=False``: they run on the same
cores as the compute).
"""

from __future__ import annotations

import dataclasses
import math
import os
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from scaletrain.errors import UserError

GB = 10**9
GiB = 1024**3


@dataclass(frozen=True)
class Platform:
    """One device and its host. All rates are *achieved* rates used for prediction."""

    name: str
    device_type: str = "cpu"
    """"cuda" for a GPU, "cpu" for the logical device pool on a CPU-only machine."""
    device_memory_bytes: int = 16 * GiB
    """Memory of one device, bytes."""
    host_memory_bytes: int = 64 * GiB
    """Host (CPU) memory available to the process, bytes."""
    flops_fp32: float = 1e11
    """Dense fp32 FLOP/s of the device (non-tensor-core on GPUs)."""
    flops_bf16: float = 1e11
    """Dense bf16/fp16 FLOP/s of the device (tensor cores on GPUs)."""
    device_mem_bytes_per_s: float = 1e11
    """Device memory (HBM) bandwidth, bytes/s."""
    h2d_bytes_per_s: float = 1e10
    """Host -> device copy bandwidth, bytes/s (pinned memory on GPUs; memcpy on the logical pool)."""
    d2h_bytes_per_s: float = 1e10
    """Device -> host copy bandwidth, bytes/s."""
    host_link: str = ""
    """What carries ``h2d_bytes_per_s`` / ``d2h_bytes_per_s`` (words, e.g. "PCIe Gen5 x16", "NVLink-C2C"):
    the link every offload and spill pays for; "" = not stated (a calibrated CPU: memcpy)."""
    disk_read_bytes_per_s: float = 1e9
    """Sequential read bandwidth of the offload disk, bytes/s."""
    disk_write_bytes_per_s: float = 1e9
    """Sequential write bandwidth of the offload disk, bytes/s."""
    host_memcpy_bytes_per_s: float = 1e10
    """Host memory copy bandwidth (bytes copied per second)."""
    cpu_adam_params_per_s: float = 5e8
    """fp32 Adam updates per second on the host CPU (all cores)."""
    copy_overlaps_compute: bool = False
    """True when copies run on their own engine concurrently with compute (GPU copy engines)."""
    intra_node_bytes_per_s: float = 0.0
    """Device<->device bandwidth inside a node, per direction (NVLink), bytes/s; 0 if none."""
    inter_node_bytes_per_s: float = 0.0
    """Network bandwidth per device between nodes, per direction, bytes/s; 0 if none."""
    devices_per_node: int = 1
    devices_per_host: int = 0
    """Devices sharing one host CPU, its memory and its ``cpu_adam_params_per_s``, a count: a DGX node's
    8 (0 = ``devices_per_node``, one host per node); a Grace Hopper superchip's 1 (each GPU its own Grace)."""
    matmul_efficiency: tuple = ((128.0, 0.86), (16.0, 0.81), (1.0, 0.54), (0.0, 0.09))
    """Achieved fraction of ``flops_*`` for one matmul of at least that many GFLOP (first row whose
    threshold the matmul reaches, rows in decreasing order). The shape of Calculon's table
    (calculon-ai/calculon ``systems/a100_80g.json``, "matrix" ``gflops_efficiency``: 0.95, 0.9, 0.6,
    0.1) scaled so that its top row is the *measured* best A100 SXM bf16 matmul, 267.9 of 312 TFLOP/s
    = 0.86 (Bekman, ml-engineering "Maximum Achievable Matmul FLOPS"); Calculon's 0.95 is not reached.
    H100 / H200 presets scale it to 792.1 / 989 = 0.80 the same way. Per useful output tile: where
    :attr:`sm_count` is set the roofline multiplies it by :meth:`wave_fraction` of the matmul's shape, so
    a preset's top row is the MAMF over the wave fraction of the shape it was measured on."""
    unaligned_matmul_fraction: float = 0.0
    """Achieved fraction of ``flops_bf16`` for a 16-bit matmul with a dimension that is not a multiple of
    8 (a GPT-2 head over its 50,257-word vocabulary): cuBLAS runs it on alignment-1 kernels without the
    tensor-core fast paths. 0 = no such penalty (CPUs, and GPU presets where it was never measured).
    H100/H200: 0.115, measured on one H200 (``benchmarks/results/planner_gpu_h200_profile.json``: the
    gpt2-medium head's three GEMMs, 5.06 TFLOP per step, took 44.2 ms on ``cutlass_75_*_align1``
    kernels, while the aligned GEMMs of the same step ran above 0.8)."""
    sm_count: int = 0
    """Streaming multiprocessors of one GPU, a count: a GEMM runs its output tiles one per SM in waves,
    so a last partial wave idles SMs (:func:`wave_fraction`). A100 SXM: 108 (NVIDIA A100 Tensor Core GPU
    Architecture whitepaper); H100 SXM5: 132 (NVIDIA H100 Tensor Core GPU Architecture whitepaper); H200:
    132 (the same GH100 die and SM count as H100 SXM5); V100: 80 (Volta whitepaper). 0 = not priced (CPUs,
    the logical device pool: ``calibrate`` on a CPU and :mod:`scaletrain.planner.local` leave it 0)."""
    matmul_tile_m: int = 256
    """Rows of the output tile one thread block of a large cuBLAS GEMM computes, elements (with
    :attr:`matmul_tile_n`; source and use there)."""
    matmul_tile_n: int = 128
    """Columns of that output tile, elements (``matmul_tile_m`` × ``matmul_tile_n``; either orientation is
    priced, cuBLAS has both): 256×128 is the largest and most efficient tile NVIDIA's "Matrix Multiplication
    Background User's Guide" (Deep Learning Performance docs, "Dimension Quantization Effects") names for
    A100, with which it shows tile and wave quantization. Used only where :attr:`sm_count` > 0."""
    mem_efficiency: tuple = ((100.0, 0.9), (10.0, 0.75), (1.0, 0.6), (0.0, 0.3))
    """Achieved fraction of ``device_mem_bytes_per_s`` for a memory-bound kernel moving at least that
    many MB (same source, "mem1" ``MB_efficiency``)."""
    intra_node_efficiency: float = 0.65
    """Achieved fraction of ``intra_node_bytes_per_s`` by NCCL rings over NVLink (Calculon a100_80e: 0.65)."""
    inter_node_efficiency: float = 0.9
    """Achieved fraction of ``inter_node_bytes_per_s`` over InfiniBand (Calculon a100_80g: 0.9)."""
    intra_node_latency_s: float = 10e-6
    """Per-step latency alpha of a collective inside a node (Calculon a100_80e: 10 us)."""
    inter_node_latency_s: float = 20e-6
    """Per-step latency alpha of a collective across nodes (Calculon a100_80e: 20 us)."""
    kernel_overhead_s: float = 0.0
    """Fixed seconds per kernel the planner prices (dispatch, autograd bookkeeping, launch), on top of its
    roofline time. 0 on the GPU presets (not modelled there); measured by :mod:`scaletrain.planner.local`
    on a CPU, where eager PyTorch's per-operator cost dominates a small model's small kernels."""
    optimizer_bytes_per_s: float = 0.0
    """Bytes per second of the optimizer step's kernels (torch's foreach update and gradient clipping,
    the bytes :func:`scaletrain.techniques.optim.registry.optimizer_step_bytes` counts), measured by
    :mod:`scaletrain.planner.local` on a CPU, where those streaming kernels run several times faster
    than the tanh-GELU / LayerNorm kernels that set ``device_mem_bytes_per_s``. 0 = not measured: the
    step is priced as memory-bound kernels (:func:`scaletrain.cost.optimizer_seconds`)."""
    fsdp_collective_overhead_s: float = 0.0
    """Seconds each ZeRO-3 (FSDP2) collective costs beyond its α–β time: FSDP2's own work per unit and
    collective (copy into and out of the flat buffer, DTensor views, hooks) — ~10x gloo's α on a CPU.
    Measured by :mod:`scaletrain.planner.local` (:func:`~scaletrain.planner.local.fsdp_overhead`); 0 = not
    measured (the GPU presets: not modelled there)."""
    reduce_scatter_factor: float = 1.0
    """Seconds of the backend's reduce-scatter over the α–β ring time of the same bytes at this platform's
    link rate and α (:func:`scaletrain.cost.collective_seconds`, (n − 1)/n of the bytes in n − 1 steps).
    1.0 on the presets (NCCL's ring reduce-scatter). Measured by :mod:`scaletrain.planner.local`: gloo
    runs ``reduce_scatter_tensor`` as an all-reduce and more (measured here, 2 processes, 8 MiB: 2.2x an
    all-reduce's time, ~4x the ring's), which is what ZeRO-1/2/3 wait for on a CPU."""
    all_gather_factor: float = 1.0
    """The same for the backend's all-gather (1.0 on the presets; measured on the CPU pool)."""
    data_seconds_per_sample: float = 0.0
    """Host seconds the run's input pipeline takes per training sample (the trainer's loader: indexing,
    decoding, augmenting, collating), measured by ``plan=auto`` from the run's own data
    (:func:`scaletrain.measure.data_time.seconds_per_sample`); priced per rank and step because the loader
    runs in the training process, before each micro-batch. 0 = not measured (the presets: a GPU job's
    loader workers overlap it)."""
    # -- host work of the trainer (issue #25), measured by scaletrain.train.host_work --
    host_seconds: tuple = ()
    """The trainer's host work per optimizer step that no other term prices, by ZeRO stage: rows ``(zero
    stage 0/1/2, seconds per step, seconds per micro-batch)`` — the loop's bookkeeping, clipping's Python,
    DDP's bucket hooks and copies, ZeRO-1/2's per-tensor copies into and out of their flat buffers (per step,
    and under ZeRO-2 per micro-batch), the runtime's Python per micro-batch. Measured by
    :func:`scaletrain.train.host_work.host_seconds` (the Trainer itself on the run's model at one sample per
    micro-batch, minus the same model's bare forward, backward and optimizer step, in CPU seconds) inside
    :func:`scaletrain.planner.local.measure`. Priced by :mod:`scaletrain.techniques.time_cost` (the
    ``host`` phase of :class:`~scaletrain.techniques.cost.StepSeconds`). Empty on the presets: on a GPU
    this work runs while the device computes (kernels are queued asynchronously), so a step waits for it
    only where the host is the bottleneck (a few ms per step against a step of 100s of ms); not modelled."""
    # -- host work of the pipeline runtime (issue #25), measured by scaletrain.planner.pipeline_host --
    pipeline_action_s: float = 0.0
    """Host seconds each compute action (F, B, I, W) of the pipeline runtime costs beyond its stage's
    blocks: the action loop, the micro-batch bookkeeping, the loss weighting, the input's gradient
    hand-over (:mod:`scaletrain.techniques.pipeline.runtime`). Priced in every pass of the schedule
    simulator. 0 = not measured (the presets: a GPU's host runs ahead of its kernels)."""
    p2p_send_s: float = 0.0
    """Host seconds one posted pipeline send costs its rank (``isend`` and its bookkeeping), measured on a
    CPU; 0 = not measured."""
    p2p_recv_s: float = 0.0
    """Seconds a pipeline receive takes beyond its bytes while the sender computes, once both sides have
    posted: gloo moves a message's bytes only when the receive is posted, through the sender's
    progress thread, which shares the cores with the sender's compute (measured here, 2 processes on
    2 cores: milliseconds, against ~0.1 ms when the sender waits). Non-zero: the schedule simulator
    prices every receive as blocking (:class:`scaletrain.techniques.pipeline.simulate.Link`); 0 = not
    measured (the presets: NCCL's transfers run beside the compute)."""
    measured_blocks: tuple = ()
    """Forward and backward seconds of every block of one model, measured on this machine by
    :mod:`scaletrain.measure.block_times` (:func:`scaletrain.planner.local.measure` with the run's model):
    entries ``(model key, precision, seq, micro-batch, forward seconds per block, backward seconds per
    block)``, the loss last. The traced cost model (:mod:`scaletrain.techniques.time_cost`) prices that
    model's blocks with them instead of the roofline (linear in the micro-batch between measured sizes),
    because a CPU's operators miss the roofline by either sign per kind. Empty on the presets."""
    compile_factor: float = 0.0
    """Compute seconds of a torch.compile'd block over its eager seconds (forward + backward of one
    gpt2-tiny-sized block, median of paired steps), measured by ``scaletrain calibrate --compile``; the cost model
    multiplies compute by it when a plan sets ``train.compile``. 0 = not measured: compile is not priced
    (the estimate says so)."""
    price_per_device_hour: float = 0.0
    """What renting one device for one hour costs, in USD per device per hour (on-demand; the node's
    share of host, network and storage included if the provider bills it per GPU). 0 = unknown: the
    presets carry none, because a price depends on the provider, the term and the month; give it in a
    platform file or with ``scaletrain plan --price NAME=USD``. ``scaletrain plan --objective cost``
    multiplies it by devices × hours."""
    source: str = ""
    """Where the figures come from (data sheet, calibration date)."""
    meta: dict = field(default_factory=dict, compare=False, hash=False)

    def flops(self, precision: str = "fp32") -> float:
        """Peak dense FLOP/s for a compute precision ("fp32", "bf16", "fp16")."""
        return self.flops_fp32 if precision == "fp32" else self.flops_bf16

    def matmul_fraction(self, flops: float) -> float:
        """Achieved fraction of peak for one matmul of ``flops`` FLOPs (:attr:`matmul_efficiency`)."""
        return _lookup(self.matmul_efficiency, flops / 1e9)

    def wave_fraction(self, m: float, n: float, batch: float = 1.0) -> float:
        """Useful fraction of the SMs' tile slots for a GEMM with an ``m`` × ``n`` output (``batch`` of them
        in one batched launch): :func:`wave_fraction` with this GPU's SMs and tile; 1.0 where
        :attr:`sm_count` is 0 (not priced)."""
        return wave_fraction(m, n, batch, self.sm_count, self.matmul_tile_m, self.matmul_tile_n)

    def mem_fraction(self, nbytes: float) -> float:
        """Achieved fraction of HBM bandwidth for a kernel moving ``nbytes`` (:attr:`mem_efficiency`)."""
        return _lookup(self.mem_efficiency, nbytes / 1e6)

    def memory_bound_seconds(self, nbytes: float) -> float:
        """Seconds of one memory-bound kernel moving ``nbytes`` on this device: the bytes at HBM speed times
        :meth:`mem_fraction`, plus :attr:`kernel_overhead_s` (the planner's and the estimate's roofline)."""
        if nbytes <= 0:
            return 0.0
        return nbytes / (self.device_mem_bytes_per_s * self.mem_fraction(nbytes)) + self.kernel_overhead_s

    def h2d_time(self, nbytes: float) -> float:
        """Seconds to copy ``nbytes`` host -> device."""
        return nbytes / self.h2d_bytes_per_s

    def d2h_time(self, nbytes: float) -> float:
        """Seconds to copy ``nbytes`` device -> host."""
        return nbytes / self.d2h_bytes_per_s

    def with_(self, **changes) -> "Platform":
        """A copy with fields replaced (e.g. a smaller ``device_memory_bytes`` for a budget)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Platform":
        names = {f.name for f in dataclasses.fields(cls)}
        bad = sorted(set(d) - names)
        if bad:
            raise UserError(f"unknown platform field {bad[0]!r}; allowed: {', '.join(sorted(names))}")
        d = dict(d)
        for k in ("matmul_efficiency", "mem_efficiency"):  # JSON lists -> the frozen tables
            if k in d:
                try:
                    d[k] = tuple(sorted(((float(a), float(b)) for a, b in d[k]), reverse=True))
                except (TypeError, ValueError):
                    raise UserError(f"platform field {k!r} must be a list of [size, fraction] pairs") from None
        if "measured_blocks" in d:  # JSON lists -> tuples (the table is data, read as written)
            try:
                d["measured_blocks"] = tuple((str(k), str(p), int(s), int(b), tuple(map(float, f)), tuple(map(float, g)))
                                             for k, p, s, b, f, g in d["measured_blocks"])
            except (TypeError, ValueError):
                raise UserError("platform field 'measured_blocks' must be a list of [model key, precision, seq, "
                                "micro-batch, [forward s...], [backward s...]] entries") from None
        if "host_seconds" in d:  # rows (zero stage, seconds per step, seconds per micro-batch)
            try:
                d["host_seconds"] = tuple((int(z), float(a), float(c)) for z, a, c in d["host_seconds"])
            except (TypeError, ValueError):
                d["host_seconds"] = None
            if d["host_seconds"] is None or not all(z in (0, 1, 2) and a >= 0 and c >= 0 and math.isfinite(a + c)
                                                    for z, a, c in d["host_seconds"]):
                raise UserError("platform field 'host_seconds' must be a list of [zero stage 0-2, seconds per "
                                "step >= 0, seconds per micro-batch >= 0] rows")
        for f in dataclasses.fields(cls):
            if f.name in d and f.name not in ("measured_blocks", "host_seconds"):
                _check_field(f.name, d[f.name], "" if f.name == "name" else f.default)
        return cls(**d)


FRACTIONS = ("unaligned_matmul_fraction", "intra_node_efficiency", "inter_node_efficiency")
"""Fields that are a fraction of a peak, in [0, 1]."""
MAY_BE_ZERO = ("intra_node_bytes_per_s", "inter_node_bytes_per_s", "kernel_overhead_s", "price_per_device_hour",
               "intra_node_latency_s", "inter_node_latency_s", "unaligned_matmul_fraction", "compile_factor",
               "sm_count", "optimizer_bytes_per_s", "fsdp_collective_overhead_s",
               "data_seconds_per_sample", "devices_per_host", "pipeline_action_s", "p2p_send_s", "p2p_recv_s")
"""Numeric fields where 0 is meaningful (no such link, not modelled, unknown price); the others divide."""


def _check_field(name: str, value: object, default: object) -> None:
    """One-line UserError unless a platform file's ``name`` has the type of its default and a sane value:
    every rate, size and count > 0 and finite (they divide or multiply every prediction), fractions in
    [0, 1], efficiency tables of fractions in (0, 1]."""
    where = f"platform field {name!r}"
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise UserError(f"{where} must be true or false (got {value!r})")
    elif isinstance(default, (int, float)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise UserError(f"{where} must be a finite number (got {value!r})")
        if isinstance(default, int) and not float(value).is_integer():
            raise UserError(f"{where} must be a whole number (got {value!r})")
        low_ok = value >= 0 if name in MAY_BE_ZERO else value > 0
        if not low_ok or (name in FRACTIONS and value > 1):
            allowed = "from 0 to 1" if name in FRACTIONS else (">= 0" if name in MAY_BE_ZERO else "> 0")
            raise UserError(f"{where} must be {allowed} (got {value!r})")
    elif isinstance(default, str):
        if not isinstance(value, str):
            raise UserError(f"{where} must be a string (got {value!r})")
        if name == "device_type" and value not in ("cpu", "cuda"):
            raise UserError(f"{where} must be cpu or cuda (got {value!r})")
    elif isinstance(default, tuple):  # an efficiency table, already sorted pairs of floats
        if not value or not all(math.isfinite(a) and a >= 0 and 0 < b <= 1 for a, b in value):
            raise UserError(f"{where} must be a non-empty list of [size >= 0, fraction in (0, 1]] pairs")
    elif name == "meta" and not isinstance(value, dict):
        raise UserError(f"{where} must be an object (got {value!r})")


def wave_fraction(m: float, n: float, batch: float, sm_count: int, tile_m: int, tile_n: int) -> float:
    """Tile and wave quantization of a GEMM (NVIDIA, "Matrix Multiplication Background User's Guide",
    "Dimension Quantization Effects"): its ``m`` × ``n`` output (``batch`` of them) is cut into
    ⌈m/tm⌉·⌈n/tn⌉·batch tiles, one thread block each, run ``sm_count`` at a time, so it takes
    W = ⌈tiles / sm_count⌉ waves of full-tile time and does useful work on m·n·batch of the
    W·sm_count·tm·tn output elements those waves could compute. The better of the two orientations
    (tm × tn, tn × tm) is taken, as cuBLAS's heuristic picks among both; a side longer than the output's
    dimension is cut to that dimension rounded up to 64, the narrowest tile side in the guide's list
    (256×64, 64×256, ..., 64×64), as cuBLAS runs a narrow tile rather than pad half of a wide one (an
    attention AV with head dimension 64 is not priced at half). Returns that fraction, in (0, 1]; 1.0 when
    ``sm_count`` is 0 (not priced). E.g. 110 tiles on 108 SMs: 2 waves, 110/216 ≈ 0.51. Not modelled:
    split-K / stream-K kernels, which cuBLAS may use to fill the SMs when the tiles are few, and a narrow
    tile's lower efficiency per tile."""
    if sm_count <= 0 or m <= 0 or n <= 0 or batch <= 0:
        return 1.0
    best = 0.0
    for tm, tn in ((tile_m, tile_n), (tile_n, tile_m)):
        tm, tn = min(tm, 64 * math.ceil(m / 64)), min(tn, 64 * math.ceil(n / 64))
        tiles = math.ceil(m / tm) * math.ceil(n / tn) * math.ceil(batch)
        waves = math.ceil(tiles / sm_count)
        best = max(best, m * n * batch / (waves * sm_count * tm * tn))
    return best


def _lookup(table: tuple, size: float) -> float:
    """The fraction of the first (largest) threshold ``size`` reaches; 1.0 for an empty table."""
    for threshold, fraction in table:
        if size >= threshold:
            return fraction
    return table[-1][1] if table else 1.0


# Achieved fraction of the PCIe line rate for large pinned copies. 0.8 is what
# cudaMemcpy bandwidthTest typically reports against the x16 line rate on Gen3/Gen4/Gen5
# (e.g. ~12.5 of 15.75 GB/s on Gen3, ~25 of 31.5 GB/s on Gen4); calibrate() measures the real one.
PCIE_ACHIEVED = 0.8

PRESETS: dict[str, Platform] = {
    "h100": Platform(
        name="h100", device_type="cuda",
        host_link="PCIe Gen5 x16",
        device_memory_bytes=80 * GiB,        # H100 SXM5 80GB (5 HBM3 stacks x 16 GiB)
        host_memory_bytes=2048 * GiB,        # DGX H100: 2 TB system memory
        flops_fp32=67e12,                    # data sheet: FP32 67 TFLOPS (SXM)
        flops_bf16=989.4e12,                 # data sheet: BF16 Tensor Core 1,979 TFLOPS with sparsity -> 989.4 dense
        device_mem_bytes_per_s=3.35e12,      # data sheet: 3.35 TB/s
        h2d_bytes_per_s=64 * GB * PCIE_ACHIEVED,  # PCIe Gen5 x16: 64 GB/s per direction
        d2h_bytes_per_s=64 * GB * PCIE_ACHIEVED,
        disk_read_bytes_per_s=8 * 6.5 * GB * 0.5,   # DGX H100: 8x 3.84 TB NVMe U.2; assumed 6.5 GB/s each, 50% in aggregate
        disk_write_bytes_per_s=8 * 3.5 * GB * 0.5,  # assumed 3.5 GB/s write each, 50% in aggregate
        host_memcpy_bytes_per_s=100 * GB,    # assumption (2-socket DDR5 server); calibrate()
        cpu_adam_params_per_s=2e9,           # assumption (112 cores, AVX-512); calibrate()
        copy_overlaps_compute=True,
        intra_node_bytes_per_s=450 * GB,     # NVLink 4: 900 GB/s total = 450 per direction
        inter_node_bytes_per_s=50 * GB,      # DGX H100: 8x ConnectX-7 400 Gb/s, one per GPU
        devices_per_node=8,
        sm_count=132,                        # H100 whitepaper: 132 SMs on H100 SXM5
        source="NVIDIA H100 Tensor Core GPU data sheet (SXM5); DGX H100 data sheet; host/disk/CPU rates assumed",
    ),
    "a100": Platform(
        name="a100", device_type="cuda",
        host_link="PCIe Gen4 x16",
        device_memory_bytes=80 * GiB,        # A100 SXM4 80GB
        host_memory_bytes=2048 * GiB,        # DGX A100 640GB: 2 TB system memory
        flops_fp32=19.5e12,                  # data sheet: FP32 19.5 TFLOPS
        flops_bf16=312e12,                   # data sheet: BF16 Tensor Core 312 TFLOPS (dense)
        device_mem_bytes_per_s=2.039e12,     # data sheet: 2,039 GB/s (80GB SXM)
        h2d_bytes_per_s=31.5 * GB * PCIE_ACHIEVED,  # PCIe Gen4 x16: 31.5 GB/s per direction
        d2h_bytes_per_s=31.5 * GB * PCIE_ACHIEVED,
        disk_read_bytes_per_s=8 * 6.5 * GB * 0.5,   # DGX A100 640GB: 8x 3.84 TB NVMe; assumed as above
        disk_write_bytes_per_s=8 * 3.5 * GB * 0.5,
        host_memcpy_bytes_per_s=80 * GB,     # assumption (2x AMD Rome, DDR4); calibrate()
        cpu_adam_params_per_s=1.5e9,         # assumption (128 cores, AVX2); calibrate()
        copy_overlaps_compute=True,
        intra_node_bytes_per_s=300 * GB,     # NVLink 3: 600 GB/s total = 300 per direction
        inter_node_bytes_per_s=25 * GB,      # DGX A100: 8x ConnectX-6 200 Gb/s HDR, one per GPU
        devices_per_node=8,
        sm_count=108,                        # A100 whitepaper: 108 SMs
        source="NVIDIA A100 Tensor Core GPU data sheet (SXM4 80GB); DGX A100 data sheet; host/disk/CPU rates assumed",
    ),
    "v100": Platform(
        name="v100", device_type="cuda",
        host_link="PCIe Gen3 x16",
        device_memory_bytes=32 * GiB,        # V100 SXM2 32GB
        host_memory_bytes=1536 * GiB,        # DGX-2: 1.5 TB system memory
        flops_fp32=15.7e12,                  # data sheet: FP32 15.7 TFLOPS (SXM2)
        flops_bf16=125e12,                   # data sheet: Tensor (fp16) 125 TFLOPS; V100 has no bf16 -> fp16 figure
        device_mem_bytes_per_s=900 * GB,     # data sheet: 900 GB/s
        h2d_bytes_per_s=15.75 * GB * PCIE_ACHIEVED,  # PCIe Gen3 x16: 15.75 GB/s per direction
        d2h_bytes_per_s=15.75 * GB * PCIE_ACHIEVED,
        disk_read_bytes_per_s=8 * 3.0 * GB * 0.5,   # DGX-2: 8x 3.84 TB NVMe (Gen3); assumed 3 GB/s read each
        disk_write_bytes_per_s=8 * 2.0 * GB * 0.5,
        host_memcpy_bytes_per_s=60 * GB,     # assumption (2x Xeon Platinum 8168, DDR4); calibrate()
        cpu_adam_params_per_s=1e9,           # assumption (48 cores, AVX-512); calibrate()
        copy_overlaps_compute=True,
        intra_node_bytes_per_s=150 * GB,     # NVLink 2: 300 GB/s total = 150 per direction
        inter_node_bytes_per_s=6.25 * GB,    # DGX-2: 8x 100 Gb/s EDR for 16 GPUs
        devices_per_node=16,
        sm_count=80,                         # Volta whitepaper: 80 SMs on Tesla V100
        source="NVIDIA Tesla V100 data sheet (SXM2 32GB); DGX-2 data sheet; host/disk/CPU rates assumed",
    ),
}

# A100 80GB is what "a100" always meant; the 40GB SXM4 differs in memory and HBM bandwidth only.
PRESETS["a100-80g"] = PRESETS["a100"].with_(name="a100-80g")
PRESETS["a100-40g"] = PRESETS["a100"].with_(
    name="a100-40g",
    device_memory_bytes=40 * GiB,            # A100 SXM4 40GB
    host_memory_bytes=1024 * GiB,            # DGX A100 320GB: 1 TB system memory
    device_mem_bytes_per_s=1.555e12,         # data sheet: 1,555 GB/s (40GB SXM)
    source="NVIDIA A100 Tensor Core GPU data sheet (SXM4 40GB); DGX A100 320GB data sheet; host/disk/CPU "
           "rates assumed")
# H100 SXM's best measured bf16 matmul: 792.1 of 989 TFLOP/s = 0.80 (ml-engineering MAMF table), on its best
# shape 6144x17920x2816, whose 3,360 tiles of 256x128 run in 26 waves of 132 SMs (3,360 / 3,432 = 0.979 useful):
# the table is per useful tile, so divided by that (A100's best shape, 6912x16384x2048, is 32 full waves of 108)
_H100_BEST_WAVES = wave_fraction(6144, 17920, 1, 132, 256, 128)
PRESETS["h100"] = PRESETS["h100"].with_(
    matmul_efficiency=tuple((g, f / _H100_BEST_WAVES) for g, f in ((128.0, 0.80), (16.0, 0.76), (1.0, 0.51),
                                                                    (0.0, 0.08))),
    unaligned_matmul_fraction=0.115)  # same SMs as the H200 it was measured on
PRESETS["h200"] = PRESETS["h100"].with_(
    name="h200",
    device_memory_bytes=140 * GiB,           # data sheet: 141 GB HBM3e; nvidia-smi reports ~140 GiB usable
    device_mem_bytes_per_s=4.8e12,           # data sheet: 4.8 TB/s
    # FP32 67 TFLOPS and BF16 1,979 TFLOPS with sparsity (989.4 dense): the H100 SXM figures, kept
    # NVLink 4 (900 GB/s total), PCIe Gen5, 8x ConnectX-7 400 Gb/s (DGX H200): as H100
    source="NVIDIA H200 Tensor Core GPU data sheet (SXM); DGX H200 data sheet; host/disk/CPU rates assumed")


# Grace Hopper: one H100-class GPU and a 72-core Grace CPU joined by NVLink-C2C, 900 GB/s bidirectional
# (450 per direction), "7x the bandwidth of PCIe Gen5" (NVIDIA GH200 Grace Hopper Superchip data sheet):
# ~57x PCIe Gen3's 15.75 GB/s, the "60x cheaper spilling" of Nagrecha's survey (section 5)
PRESETS["gh200"] = PRESETS["h100"].with_(
    name="gh200",
    device_memory_bytes=96 * GiB,            # data sheet: 96 GB HBM3 (the 144 GB HBM3e part: give a platform file)
    device_mem_bytes_per_s=4.0e12,           # data sheet: 4 TB/s
    host_memory_bytes=480 * GB,              # data sheet: up to 480 GB LPDDR5X
    host_link="NVLink-C2C",
    h2d_bytes_per_s=450 * GB * PCIE_ACHIEVED,  # NVLink-C2C 450 GB/s per direction; PCIe's achieved fraction assumed
    d2h_bytes_per_s=450 * GB * PCIE_ACHIEVED,
    host_memcpy_bytes_per_s=512 * GB * 0.8,  # data sheet: LPDDR5X up to 512 GB/s; 0.8 achieved assumed
    cpu_adam_params_per_s=4e9,               # assumption: 72 Neoverse V2 cores, memory-bound (~32 B per update at
                                             # ~410 GB/s = 12.8e9, a third reached); calibrate()
    devices_per_host=1,                      # each GH200 is one Grace CPU + one GPU
    devices_per_node=4,                      # a 4-superchip node (e.g. HPE Cray EX254n), GPUs on NVLink 4
    # FP32 67 / BF16 989.4 dense TFLOPS (data sheet: 1,979 with sparsity), 132 SMs: the H100's
    source="NVIDIA GH200 Grace Hopper Superchip data sheet (96 GB HBM3); node layout, achieved fractions and "
           "CPU-Adam rate assumed")


def names() -> list[str]:
    return list(PRESETS)


def get(name: str) -> Platform:
    """A preset by name (h100, h200, gh200, a100 = a100-80g, a100-40g, v100); ``"local"`` calibrates this machine."""
    key = name.lower()
    if key == "local":
        return calibrate()
    if key not in PRESETS:
        raise UserError(f"unknown platform {name!r}; allowed: {', '.join(PRESETS)}, local")
    return PRESETS[key]


# --------------------------------------------------------------------------- calibration


def _best_time(fn, repeats: int) -> float:
    """Least wall time of ``repeats`` calls (the least-disturbed run on a shared machine)."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return max(best, 1e-9)


def measure_memcpy(nbytes: int = 64 * 2**20, repeats: int = 3) -> float:
    """Host memcpy bandwidth, bytes copied per second (one buffer to another, both warm)."""
    n = max(nbytes // 4, 1)
    src = torch.ones(n)
    dst = torch.empty(n)
    dst.copy_(src)
    return n * 4 / _best_time(lambda: dst.copy_(src), repeats)


def measure_disk(directory: str | None = None, nbytes: int = 64 * 2**20) -> tuple[float, float]:
    """(read, write) bytes/s of the disk holding ``directory`` (default: the temp dir).

    Write = write + fsync of ``nbytes``; read = reading it back after dropping its pages
    from the page cache with ``posix_fadvise(DONTNEED)`` (works without root for clean pages),
    so the read comes from the disk, not from memory.
    """
    buf = os.urandom(1 << 20) * max(nbytes >> 20, 1)
    fd, path = tempfile.mkstemp(prefix="scaletrain-calib-", dir=directory)
    try:
        t0 = time.perf_counter()
        os.write(fd, buf)
        os.fsync(fd)
        write = len(buf) / max(time.perf_counter() - t0, 1e-9)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.lseek(fd, 0, os.SEEK_SET)
        t0 = time.perf_counter()
        got = 0
        while True:
            chunk = os.read(fd, 8 << 20)
            if not chunk:
                break
            got += len(chunk)
        read = got / max(time.perf_counter() - t0, 1e-9)
    finally:
        os.close(fd)
        os.unlink(path)
    return read, write


def cpu_adam_update(numel: int) -> tuple[Callable[[], None], torch.Tensor]:
    """One fp32 AdamW update of a flat buffer of ``numel`` values by torch's fused CPU kernel
    (``torch._fused_adamw_``, lr 1e-3, betas 0.9/0.999, no weight decay): the call the offload technique's
    host optimizer (CPUAdam) makes for a flat group, which is what ``cpu_adam_params_per_s`` prices. Returns
    (the update, the buffer it updates). Defined here, below the techniques, so that calibrating names none."""
    p, g = torch.zeros(numel), torch.full((numel,), 1e-3)
    m, v, step = torch.zeros(numel), torch.zeros(numel), torch.zeros((), dtype=torch.float32)

    def update() -> None:
        torch._foreach_add_([step], 1.0)
        torch._fused_adamw_([p], [g], [m], [v], [], [step], lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.0,
                            eps=1e-8, amsgrad=False, maximize=False)
    return update, p


def measure_cpu_adam(numel: int = 1 << 22, repeats: int = 3) -> float:
    """fp32 AdamW updates per second of the fused CPU kernel on one flat buffer (all threads):
    :func:`cpu_adam_update`."""
    update, _ = cpu_adam_update(numel)
    update()
    return numel / _best_time(update, repeats)


def measure_matmul_flops(n: int = 512, dtype: torch.dtype = torch.float32, device: str = "cpu",
                         repeats: int = 3) -> float:
    """FLOP/s of an n x n x n matmul (2n^3 FLOPs)."""
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)

    def run():
        a @ b
        if device != "cpu":
            torch.cuda.synchronize()

    run()
    return 2 * n**3 / _best_time(run, repeats)


def _host_memory_bytes() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 16 * GiB


def _cuda_copy_rates(nbytes: int) -> tuple[float, float]:
    n = nbytes // 4
    host = torch.empty(n, pin_memory=True)
    dev = torch.empty(n, device="cuda")
    dev.copy_(host)
    torch.cuda.synchronize()

    def h2d():
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()

    def d2h():
        host.copy_(dev, non_blocking=True)
        torch.cuda.synchronize()

    return n * 4 / _best_time(h2d, 3), n * 4 / _best_time(d2h, 3)


def calibrate(disk_dir: str | None = None, quick: bool = False) -> Platform:
    """Measure this machine (a few seconds; ``quick`` uses small sizes, for tests).

    On CUDA the device is the current GPU; otherwise it is the logical device pool, whose
    memory defaults to the host's (a budget is set per run with ``memory.device_budget``).
    """
    size = (8 if quick else 64) * 2**20
    memcpy = measure_memcpy(size)
    read, write = measure_disk(disk_dir, size)
    adam = measure_cpu_adam(1 << (18 if quick else 22))
    host_mem = _host_memory_bytes()
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
    common = dict(host_memory_bytes=host_mem, disk_read_bytes_per_s=read, disk_write_bytes_per_s=write,
                  host_memcpy_bytes_per_s=memcpy, cpu_adam_params_per_s=adam)
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        h2d, d2h = _cuda_copy_rates(size * 4)
        return Platform(
            name=f"local-{props.name}", device_type="cuda", device_memory_bytes=int(props.total_memory),
            flops_fp32=measure_matmul_flops(4096, torch.float32, "cuda"),
            flops_bf16=measure_matmul_flops(4096, torch.bfloat16, "cuda"),
            device_mem_bytes_per_s=memcpy, h2d_bytes_per_s=h2d, d2h_bytes_per_s=d2h,
            copy_overlaps_compute=True, sm_count=int(props.multi_processor_count), source=f"calibrate() {stamp}", **common)
    flops = measure_matmul_flops(256 if quick else 512)
    return Platform(
        name="local-cpu", device_type="cpu", device_memory_bytes=host_mem, flops_fp32=flops,
        flops_bf16=flops, device_mem_bytes_per_s=memcpy, h2d_bytes_per_s=memcpy, d2h_bytes_per_s=memcpy,
        copy_overlaps_compute=False, source=f"calibrate() {stamp}, {torch.get_num_threads()} threads", **common)

"""Each operator of a training step on a platform's roofline (Williams et al., CACM 2009; Gusak et al.'s
survey, §6 and its Table 6: arithmetic intensity and the bottleneck of each operation).

The operators of one forward + backward of every block and the loss are the census's
(:mod:`scaletrain.measure.census`: FLOPs by ``torch.utils.flop_counter``, bytes = every tensor read
plus every tensor written), grouped by ATen operator name. For each group:

- arithmetic intensity = FLOPs / bytes (FLOP/byte);
- the platform's time, Σ over its kernels of :func:`scaletrain.cost.roofline_seconds` (the one
  roofline of the cost model, achieved-efficiency tables included), and which side of the roof bounds
  it: a kernel is memory-bound when its roofline time equals its bytes' time
  (:meth:`~scaletrain.platform.Platform.memory_bound_seconds`), compute-bound otherwise; a group takes
  the side that holds most of its time;
- where measured (:func:`measure_ops`: every operator of one real step timed on this machine, the
  device synchronised around each), the achieved FLOP/s and bytes/s — on *this* device, which need
  not be the platform's;
- one phrase of what would move it.

The ridge point is peak FLOP/s over HBM bytes/s: an operator of lower intensity cannot reach the
peak whatever its kernel. Units: FLOPs, bytes, seconds.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch

from scaletrain.cost import roofline_seconds
from scaletrain.measure.census import BlockOps, Op, _Census


@dataclass
class RooflineRow:
    """One ATen operator summed over a step's forward and backward (one micro-batch)."""

    op: str
    calls: int
    flops: float
    """FLOPs of all its calls."""
    nbytes: float
    """Bytes read plus written by all its calls."""
    intensity: float
    """FLOPs per byte."""
    platform_s: float
    """Seconds on the platform's roofline (Σ roofline_seconds over its calls)."""
    bound: str
    """"compute" or "memory" on the platform."""
    hint: str
    """What would move it."""
    measured_s: float | None = None
    """Seconds measured on this machine (None when not measured)."""
    achieved_flops_per_s: float | None = None
    achieved_bytes_per_s: float | None = None


def ridge_point(plat: Any, precision: str = "fp32") -> float:
    """FLOP/byte where the platform's memory roof meets its compute roof: peak FLOP/s over HBM bytes/s."""
    return plat.flops(precision) / plat.device_mem_bytes_per_s


def _hint(bound: str, flops: float) -> str:
    if bound == "compute":
        return "at the compute roof: 16-bit precision (tensor cores) or less recompute"
    if flops > 0:
        return "bigger micro-batch (more FLOPs per byte of weights)"
    return "fusion with its neighbours (torch.compile): fewer bytes through HBM"


def rows(ops: list[Op], plat: Any, precision: str = "fp32",
         measured: dict[str, float] | None = None) -> list[RooflineRow]:
    """The roofline rows of ``ops`` (one step's operators) on ``plat``, most platform seconds first.
    ``measured``: seconds per operator name measured on this machine."""
    groups: dict[str, list[Op]] = defaultdict(list)
    for o in ops:
        groups[o.name].append(o)
    out = []
    for name, calls in groups.items():
        flops = sum(o.flops for o in calls)
        nbytes = sum(o.nbytes for o in calls)
        compute_s = memory_s = 0.0
        for o in calls:
            t = roofline_seconds(plat, o.flops, o.nbytes, precision=precision if o.half else "fp32",
                                 unaligned=o.unaligned, output=o.output)
            if o.flops > 0 and t > plat.memory_bound_seconds(o.nbytes):
                compute_s += t
            else:
                memory_s += t
        bound = "compute" if compute_s > memory_s else "memory"
        r = RooflineRow(name, len(calls), flops, nbytes, flops / nbytes if nbytes else 0.0, compute_s + memory_s,
                        bound, _hint(bound, flops))
        if measured and measured.get(name):
            s = measured[name]
            r.measured_s, r.achieved_flops_per_s, r.achieved_bytes_per_s = s, flops / s, nbytes / s
        out.append(r)
    return sorted(out, key=lambda r: -r.platform_s)


def step_ops(census: list[BlockOps]) -> list[Op]:
    """Every operator of a census, forward and backward, blocks and loss."""
    return [o for b in census for o in b.fwd + b.bwd]


class _TimedCensus(_Census):
    """The census on real tensors, each operator timed alone (the device synchronised before and after)."""

    def __init__(self, sync: Callable[[], None]) -> None:
        super().__init__()
        self.sync = sync
        self.seconds: dict[str, float] = defaultdict(float)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        self.sync()
        t0 = time.perf_counter()
        out = func(*args, **kwargs)
        self.sync()
        dt = time.perf_counter() - t0
        if self.record(func, args, kwargs, out):
            self.seconds[self.ops[-1].name] += dt
        return out


def measure_ops(module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable,
                precision: str = "fp32", warmup: int = 1) -> tuple[list[Op], dict[str, float]]:
    """One real forward + backward of ``module`` on (``x``, ``y``) after ``warmup`` untimed ones: its
    operators and the seconds measured per operator name (gradients cleared afterwards)."""
    from scaletrain.measure.step import autocast

    dev = x.device
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def step() -> None:
        with autocast(precision, dev.type):
            loss = loss_fn(module(x), y)
        loss.backward()

    for _ in range(warmup):
        step()
    with _TimedCensus(sync) as tc:
        step()
    module.zero_grad(set_to_none=True)
    return tc.ops, dict(tc.seconds)


def to_dict(table: list[RooflineRow], plat: Any, precision: str, meta: dict) -> dict:
    """The JSON object of ``profile --roofline --json``."""
    return {"platform": plat.name, "precision": precision, "peak_flops_per_s": plat.flops(precision),
            "hbm_bytes_per_s": plat.device_mem_bytes_per_s, "ridge_flops_per_byte": ridge_point(plat, precision),
            **meta, "ops": [asdict(r) for r in table]}


def plot(table: list[RooflineRow], plat: Any, precision: str, path: str, title: str = "") -> None:
    """A log-log roofline: the platform's roof (min(peak, bandwidth × intensity)), each operator at its
    intensity and its FLOP/s on the platform (filled) and, where measured, on this machine (hollow).
    Operators without FLOPs (element-wise, norms, copies) have no point on a FLOP/s axis: the table and
    the JSON give them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [r for r in table if r.flops > 0 and r.nbytes > 0]
    peak, bw = plat.flops(precision), plat.device_mem_bytes_per_s
    xs = [r.intensity for r in pts] or [1.0]
    lo, hi = min(min(xs), 0.1) / 2, max(max(xs), 2 * ridge_point(plat, precision)) * 2
    grid = [lo * (hi / lo) ** (i / 99) for i in range(100)]
    fig, ax = plt.subplots(figsize=(7, 5))
    ax.loglog(grid, [min(peak, bw * i) for i in grid], "k-", label=f"{plat.name} roof ({precision})")
    for r in pts:
        # matplotlib's legend hides labels that start with "_" (_scaled_dot_product_...)
        (line,) = ax.loglog([r.intensity], [r.flops / r.platform_s], "o", label=r.op.lstrip("_"))
        if r.achieved_flops_per_s:
            ax.loglog([r.intensity], [r.achieved_flops_per_s], "o", mfc="none", color=line.get_color())
    ax.axvline(ridge_point(plat, precision), color="grey", ls=":", lw=1)
    ax.set_xlabel("arithmetic intensity (FLOP/byte)")
    ax.set_ylabel("FLOP/s (filled: platform roofline; hollow: measured here)")
    ax.set_title(title or "roofline")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

"""Step time of the same tensor-parallel layers in scaletrain's DTensor path and in megatron-core.

A stack of ``--layers`` Megatron MLP pairs (LayerNorm -> column-parallel h->4h -> GELU ->
row-parallel 4h->h, residual), identical weights in both implementations:

- ``dtensor``: plain ``nn.Linear`` modules parallelised with ``ColwiseParallel`` / ``RowwiseParallel``
  (what :func:`scaletrain.techniques.tensor_parallel.apply_tensor_parallel` uses for GPT-2);
- ``megatron``: ``megatron.core.tensor_parallel.ColumnParallelLinear`` / ``RowParallelLinear``
  (hand-written autograd functions around plain tensors, no DTensor dispatch), on CPU gloo.

Both are checked to give the same output and input gradient (max abs difference reported), then
forward+backward is timed. Needs ``pip install -c constraints.txt megatron-core==0.16.1``
(benchmark-only; the last version for Python 3.11). Output:
benchmarks/results/intralayer_vs_megatron.json.

    .venv/bin/python benchmarks/intralayer/vs_megatron.py
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import warnings
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

RESULTS = Path(__file__).resolve().parents[1] / "results"


class Block(nn.Module):
    def __init__(self, h: int):
        super().__init__()
        self.ln = nn.LayerNorm(h)
        self.fc1 = nn.Linear(h, 4 * h)
        self.fc2 = nn.Linear(4 * h, h)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x)), approximate="tanh"))


class MegatronBlock(nn.Module):
    def __init__(self, ref: Block, cfg, rank: int, t: int):
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        super().__init__()
        h = ref.fc1.in_features
        self.ln = nn.LayerNorm(h)
        self.ln.load_state_dict(ref.ln.state_dict())
        noinit = lambda w: None  # noqa: E731 - weights copied below
        self.fc1 = ColumnParallelLinear(h, 4 * h, config=cfg, init_method=noinit, bias=True, gather_output=False)
        self.fc2 = RowParallelLinear(4 * h, h, config=cfg, init_method=noinit, bias=True, input_is_parallel=True,
                                     skip_bias_add=False)
        n = 4 * h // t
        with torch.no_grad():
            self.fc1.weight.copy_(ref.fc1.weight[rank * n:(rank + 1) * n])
            self.fc1.bias.copy_(ref.fc1.bias[rank * n:(rank + 1) * n])
            self.fc2.weight.copy_(ref.fc2.weight[:, rank * n:(rank + 1) * n])
            self.fc2.bias.copy_(ref.fc2.bias)

    def forward(self, x):
        y, _ = self.fc1(self.ln(x))
        z, _ = self.fc2(F.gelu(y, approximate="tanh"))
        return x + z


def _time(fn, x, iters: int) -> list[float]:
    import torch.distributed as dist

    out = []
    for _ in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        fn(x).sum().backward()
        dist.barrier()
        out.append(time.perf_counter() - t0)
    return out


def _worker(rank: int, world: int, a: dict) -> dict:
    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state as ps
    from megatron.core.model_parallel_config import ModelParallelConfig
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    h = a["hidden"]
    ref = nn.Sequential(*[Block(h) for _ in range(a["layers"])])
    x = torch.randn(a["seq"], a["batch"], h)  # [s, b, h]: megatron-core's layout (DTensor does not care)
    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    cfg = ModelParallelConfig(tensor_model_parallel_size=world, use_cpu_initialization=True,
                              perform_initialization=False, params_dtype=torch.float32)
    mc = nn.Sequential(*[MegatronBlock(b, cfg, rank, world) for b in ref])
    mesh = init_device_mesh("cpu", (world,))
    dt = nn.Sequential(*[Block(h) for _ in range(a["layers"])])
    dt.load_state_dict(ref.state_dict())
    for blk in dt:
        parallelize_module(blk, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = dt(xa), mc(xb)
    ya.square().sum().backward()
    yb.square().sum().backward()
    diff = {"output": float((ya - yb).abs().max()), "input_grad": float((xa.grad - xb.grad).abs().max())}
    res = {"diff": diff}
    for name, mod in (("dtensor", dt), ("megatron", mc)):
        _time(mod, x, 2)  # warm-up
        res[name] = _time(mod, x, a["iters"])
    ps.destroy_model_parallel()
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--degrees", default="2,4")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out", type=Path, default=RESULTS / "intralayer_vs_megatron.json")
    args = p.parse_args(argv)
    from scaletrain.testing import run_distributed

    rows = []
    for t in (int(d) for d in args.degrees.split(",")):
        a = dict(hidden=args.hidden, layers=args.layers, seq=args.seq, batch=args.batch, iters=args.iters)
        res = run_distributed(_worker, t, a, timeout_s=1800)
        med = {k: statistics.median(max(r[k][i] for r in res) for i in range(args.iters))
               for k in ("dtensor", "megatron")}
        row = {"tp": t, "dtensor_step_s": med["dtensor"], "megatron_step_s": med["megatron"],
               "ratio_dtensor_over_megatron": med["dtensor"] / med["megatron"], "max_abs_diff": res[0]["diff"]}
        rows.append(row)
        print(f"tp={t}: dtensor {med['dtensor'] * 1e3:.1f} ms, megatron-core {med['megatron'] * 1e3:.1f} ms, "
              f"ratio {row['ratio_dtensor_over_megatron']:.2f}, max |diff| {res[0]['diff']}", flush=True)
    import megatron.core

    doc = {"benchmark": "intralayer_vs_megatron", "date": datetime.now(timezone.utc).isoformat(),
           "machine": {"platform": platform.platform(), "processor": platform.processor()},
           "torch": torch.__version__, "megatron_core": getattr(megatron.core, "__version__", "?"),
           "python": sys.version.split()[0], "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""CPU Adam throughput (parameters updated per second) of the host-side optimizers ZeRO-Offload needs.

Compared on the same fp32 parameter set (the shapes of a reference model's parameters):

- ``scaletrain.CPUAdam (flat)``: our host optimizer's path — one fused kernel call over one flat buffer;
- ``scaletrain.CPUAdam (per-tensor)``: the same kernel called on the list of tensors;
- ``torch.optim.AdamW(fused=True)``, ``(foreach=True)``, ``(foreach=False)``;
- ``deepspeed.ops.adam.DeepSpeedCPUAdam`` when deepspeed is installed (benchmark-only dependency;
  its C++ op is JIT-compiled on first use, minutes, and cached).

Usage: ``python benchmarks/offload/cpu_adam.py [--model gpt2-small] [--repeats 5]``; writes
``benchmarks/results/offload_cpu_adam.json``. Timings are the median of ``repeats`` steps after one
warm-up step; on a shared machine the spread is reported too.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform as pyplatform
import statistics
import sys
import time
from pathlib import Path

import torch

from scaletrain import models
from scaletrain.techniques.offload.optimizer import CPUAdam

OUT = Path(__file__).resolve().parents[1] / "results" / "offload_cpu_adam.json"


def shapes_of(model_name: str) -> list[torch.Size]:
    with torch.device("meta"):
        m = models.get(model_name)
    return [p.shape for p in m.parameters()]


def make_params(shapes, flat: bool):
    n = sum(int(torch.Size(s).numel()) for s in shapes)
    buf = torch.zeros(n) if flat else None
    out, off = [], 0
    g = torch.Generator().manual_seed(0)
    for s in shapes:
        k = int(torch.Size(s).numel())
        p = buf[off:off + k].view(s) if flat else torch.zeros(s)
        p.grad = torch.randn(s, generator=g) * 1e-3
        out.append(p)
        off += k
    return out, buf


def time_steps(step, repeats: int) -> tuple[float, float]:
    step()  # warm-up (state allocation, JIT)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), max(times) - min(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2-small")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0,
                    help="intra-op threads (0: torch's default); on a shared, oversubscribed machine one thread "
                         "gives stable timings (OpenMP barriers make small ops 10x slower with more)")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = shapes_of(args.model)
    numel = sum(int(torch.Size(s).numel()) for s in shapes)
    rows = []

    def bench(name, build, flat=False, grads_flat=False):
        params, buf = make_params(shapes, flat)
        opt = build(params, buf)
        if grads_flat:
            fg = torch.cat([p.grad.reshape(-1) for p in params])
            step = functools.partial(opt.step, grads=[fg])
        else:
            step = opt.step
        med, spread = time_steps(step, args.repeats)
        rows.append({"optimizer": name, "median_s": med, "spread_s": spread, "params_per_s": numel / med})
        print(f"{name:40s} {med * 1e3:9.1f} ms  {numel / med / 1e6:8.1f} M params/s", flush=True)
        del opt, params, buf

    hp = dict(lr=1e-3, weight_decay=0.01)
    bench("scaletrain CPUAdam (flat)", lambda ps, buf: CPUAdam(ps, flat=[buf], **hp), flat=True, grads_flat=True)
    bench("scaletrain CPUAdam (per-tensor)", lambda ps, buf: CPUAdam(ps, **hp))
    bench("torch AdamW fused=True", lambda ps, buf: torch.optim.AdamW(ps, fused=True, **hp))
    bench("torch AdamW foreach=True", lambda ps, buf: torch.optim.AdamW(ps, foreach=True, **hp))
    bench("torch AdamW foreach=False", lambda ps, buf: torch.optim.AdamW(ps, foreach=False, **hp))
    ds_version = None
    try:
        import deepspeed
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        ds_version = deepspeed.__version__
        def ds(ps, buf):
            params = []
            for p in ps:  # DeepSpeedCPUAdam wants nn.Parameters; keep each one's gradient
                q = torch.nn.Parameter(p.detach())
                q.grad = p.grad
                params.append(q)
            return DeepSpeedCPUAdam(params, adamw_mode=True, **hp)

        bench(f"DeepSpeedCPUAdam {ds_version}", ds)
    except Exception as e:  # noqa: BLE001 - optional peer
        print(f"DeepSpeedCPUAdam unavailable: {type(e).__name__}: {e}", file=sys.stderr)
    result = {
        "benchmark": "offload_cpu_adam", "model_shapes": args.model, "numel": numel, "tensors": len(shapes),
        "repeats": args.repeats, "torch": torch.__version__, "deepspeed": ds_version,
        "threads": torch.get_num_threads(), "machine": pyplatform.platform(), "processor": pyplatform.processor(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

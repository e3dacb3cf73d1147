"""Per-operation seconds of two remat schedules at one budget: where "optimal" and "periodic" differ.

gpt2-mini, batch 4, seq 128, 1 thread; both schedules at ``BUDGET`` (argv[1], default 20MiB) run in
alternating order for 15 timed rounds after a warm-up, each operation timed by ``run_schedule``'s
``on_op`` callback (which also turns on saved-tensor tracking, the same for both); printed: step minimum
and median, the sum over operation kinds of each operation's minimum, and every operation's minimum [ms].

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/speed/remat_ops.py 20MiB
"""

from __future__ import annotations

import collections
import statistics
import sys
import time

import torch


def main() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from scaletrain import models
    from scaletrain.chain import to_chain
    from scaletrain.measure.step import loss_for, make_batch
    from scaletrain.techniques import remat
    from scaletrain.techniques.remat.executor import run_schedule
    from scaletrain.techniques.remat.fromtrace import estimate_graph

    torch.set_num_threads(1)
    budget = remat.parse_bytes(sys.argv[1] if len(sys.argv) > 1 else "20MiB")
    meta = to_chain(models.get("gpt2-mini", device="meta"))
    with FakeTensorMode():
        xf, yf = make_batch(meta, 4, 128)
    graph, _ = estimate_graph(meta, xf, target=yf, precision="fp32", name="gpt2-mini")
    torch.manual_seed(0)
    model = models.get("gpt2-mini")
    chain = to_chain(model)
    x, y = make_batch(chain, 4, 128)
    loss_fn = loss_for(model)
    sch = {m: remat.solve(graph, budget, m) for m in ("optimal", "periodic")}
    per: dict = {m: collections.defaultdict(list) for m in sch}
    tot: dict = {m: [] for m in sch}
    for r in range(16):
        for m in (("optimal", "periodic") if r % 2 else ("periodic", "optimal")):
            model.zero_grad(set_to_none=True)
            acc: dict = collections.defaultdict(float)
            last = [time.perf_counter()]

            def on_op(op, runner, acc=acc, last=last):
                t = time.perf_counter()
                acc[f"{op.kind}{op.index}"] += t - last[0]
                last[0] = t
            t0 = last[0] = time.perf_counter()
            run_schedule(chain, sch[m], x, loss_fn, y, on_op=on_op)
            if r:  # round 0: warm-up
                tot[m].append(time.perf_counter() - t0)
                for k, v in acc.items():
                    per[m][k].append(v)
    for m in sch:
        print(m, f"step min {min(tot[m]) * 1e3:.0f} ms, median {statistics.median(tot[m]) * 1e3:.0f} ms")
        kinds: dict = collections.defaultdict(float)
        for k, v in per[m].items():
            kinds[k.rstrip("0123456789")] += min(v)
        print("  by kind (sum of per-op minima, ms):", {k: round(v * 1e3, 1) for k, v in kinds.items()})
        print("  ", " ".join(f"{k}:{min(v) * 1e3:.0f}" for k, v in per[m].items()))


if __name__ == "__main__":
    main()

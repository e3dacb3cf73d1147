"""Megatron tensor parallelism (± sequence parallelism) versus TP degree, on CPU gloo.

Fixed number of processes (``--world``, default 4) and fixed global batch: TP degree t leaves
dp = world / t data-parallel replicas, so each rank's micro-batch is global_batch / dp = t ·
global_batch / world. This is the setting of the Megatron memory curve (seed 002 §V-C): model
states per rank fall as 1/t (16 Ψ / t bytes with fp32 Adam) while activations per rank *rise*
(b grows ∝ t, and the 4·b·s·h of LayerNorm inputs and of the replicated inputs of the column-
parallel layers per layer do not shrink with t: sbh(4 + 12/t) per layer in fp32 elements), so the
total is U-shaped in t — sequence parallelism (2 + 14/t under DTensor) flattens the rising arm.

For every (t, sp) it records, per rank: step time (median over timed steps, no instrumentation),
peak memory and its breakdown measured storage by storage (DTensorMemoryTracker), the bytes saved
for backward at the end of the forward, the collectives of one step (CommCounter), and the cost
face's predictions of all of them. Output: benchmarks/results/intralayer_tp_degree.json (+ .png).

    .venv/bin/python benchmarks/intralayer/tp_degree.py            # ~10 min on 2 busy cores
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parents[1] / "results"


def _worker(rank: int, world: int, a: dict) -> dict:
    import torch.distributed as dist

    from scaletrain import models
    from scaletrain.techniques import tensor_parallel as tp
    from scaletrain.measure.comm import CommCounter, DTensorMemoryTracker
    from scaletrain.techniques.intralayer import setup_intralayer

    torch.manual_seed(0)
    m = models.get("gpt2-tiny", n_layer=a["n_layer"], n_embd=a["n_embd"], n_head=a["n_head"], vocab_size=256,
                   n_positions=a["seq"])
    il = setup_intralayer(m, tp=a["t"], sequence_parallel=a["sp"], world=world)
    b = a["global_batch"] // il.dp
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(il.dp_rank)
    x = torch.randint(0, 256, (b, a["seq"]), generator=g)
    y = torch.randint(0, 256, (b, a["seq"]), generator=g)
    out: dict = {}

    def step(tracker=None):
        with il.loss_context():
            loss = il.loss(m, m(x), y)
            if tracker is not None:
                out["activations_end_of_forward"] = tracker.current_breakdown["activations"]
            loss.backward()
        il.reduce_gradients(m)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # creates the optimizer states
    with DTensorMemoryTracker(model=m, optimizer=opt) as tr:
        step(tr)  # bytes saved for backward (the saved-tensors hook classifies them)
    # The peak is also measured without the saved-tensors hook: a pack hook that returned the
    # DTensor itself (the tracker before it detached) made DTensor's backward take a sharding-
    # propagation slow path allocating global-shape temporaries; both peaks are in the JSON.
    with DTensorMemoryTracker(model=m, optimizer=opt, track_saved=False) as pk:
        step()
    out["peak_bytes"] = pk.peak_bytes
    out["peak_breakdown"] = pk.peak_breakdown
    out["peak_bytes_with_saved_hook"] = tr.peak_bytes
    with CommCounter() as comm:
        with il.loss_context():
            loss = il.loss(m, m(x), y)
            loss.backward()
    out["tp_comm"] = comm.summary()
    with CommCounter() as comm:
        il.reduce_gradients(m)
    out["dp_comm"] = comm.summary()
    opt.zero_grad(set_to_none=True)
    times = []
    for _ in range(a["steps"]):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    out["step_times_s"] = times
    out["local_numel"] = tp.local_numel(m)
    out["micro_batch"] = b
    out["dp"] = il.dp
    return out


def predict(a: dict, world: int) -> dict:
    from scaletrain import models
    from scaletrain.techniques import tensor_parallel as tp

    cfg = models.get("gpt2-tiny", device="meta", n_layer=a["n_layer"], n_embd=a["n_embd"], n_head=a["n_head"],
                     vocab_size=256, n_positions=a["seq"]).config
    t, sp = a["t"], a["sp"]
    dp = world // t
    b = a["global_batch"] // dp
    # peak at the start of the backward (gradients do not exist yet: zero_grad(set_to_none=True))
    mem = tp.tp_memory_per_rank(cfg, t, b, a["seq"], sequence_parallel=sp)
    comm = tp.tp_comm_bytes_per_step(cfg, t, b, a["seq"], sequence_parallel=sp)
    n = tp.tp_param_elements(cfg, t)["total"]
    dp_wire = 2 * (dp - 1) / dp * n * 4  # gradient all-reduce over the dp replicas (fp32)
    return {"memory": mem, "tp_wire_bytes": comm["wire_bytes"], "dp_wire_bytes": dp_wire, "local_numel": n,
            "micro_batch": b}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--degrees", default="1,2,4")
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--n-embd", type=int, default=192)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", type=Path, default=RESULTS / "intralayer_tp_degree.json")
    args = p.parse_args(argv)
    from scaletrain.testing import run_distributed

    rows = []
    for sp in (False, True):
        for t in (int(d) for d in args.degrees.split(",")):
            if sp and t == 1:
                continue
            a = dict(t=t, sp=sp, global_batch=args.global_batch, seq=args.seq, n_embd=args.n_embd,
                     n_layer=args.n_layer, n_head=args.n_head, steps=args.steps)
            res = run_distributed(_worker, args.world, a, timeout_s=1800)
            pred = predict(a, args.world)
            r0 = res[0]
            tp_wire = sum(v["wire_bytes"] for v in r0["tp_comm"].values())
            dp_wire = sum(v["wire_bytes"] for v in r0["dp_comm"].values())
            row = {
                "tp": t, "sequence_parallel": sp, "dp": r0["dp"], "micro_batch": r0["micro_batch"],
                "step_time_s": statistics.median(max(r["step_times_s"][i] for r in res) for i in range(args.steps)),
                "peak_bytes_measured": max(r["peak_bytes"] for r in res),
                "peak_bytes_predicted": pred["memory"]["peak"],
                "peak_breakdown_rank0": r0["peak_breakdown"],
                "peak_bytes_under_saved_tensors_hook": max(r["peak_bytes_with_saved_hook"] for r in res),
                "activations_measured": r0["activations_end_of_forward"],
                "activations_predicted": pred["memory"]["activations"],
                "local_numel_measured": r0["local_numel"], "local_numel_predicted": pred["local_numel"],
                "tp_wire_bytes_measured": tp_wire, "tp_wire_bytes_predicted": pred["tp_wire_bytes"],
                "dp_wire_bytes_measured": dp_wire, "dp_wire_bytes_predicted": pred["dp_wire_bytes"],
                "tp_collectives": r0["tp_comm"],
            }
            row["peak_error"] = row["peak_bytes_measured"] / row["peak_bytes_predicted"] - 1
            rows.append(row)
            print(f"tp={t} sp={sp}: step {row['step_time_s']:.3f} s, peak {row['peak_bytes_measured'] / 2**20:.1f} MiB "
                  f"(predicted {row['peak_bytes_predicted'] / 2**20:.1f}, {100 * row['peak_error']:+.1f}%), "
                  f"TP traffic {tp_wire / 2**20:.2f} MiB (predicted {pred['tp_wire_bytes'] / 2**20:.2f})", flush=True)
    doc = {"benchmark": "intralayer_tp_degree", "date": datetime.now(timezone.utc).isoformat(),
           "machine": {"platform": platform.platform(), "processor": platform.processor(),
                       "cpus": torch.get_num_threads()},
           "torch": torch.__version__, "python": sys.version.split()[0],
           "args": {k: str(v) for k, v in vars(args).items()},
           "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1))
    _plot(rows, args.out.with_suffix(".png"))
    print(f"wrote {args.out}")
    return 0


def _plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for sp, style in ((False, "o-"), (True, "s--")):
        rs = [r for r in rows if r["sequence_parallel"] == sp]
        if not rs:
            continue
        ts = [r["tp"] for r in rs]
        label = "TP+SP" if sp else "TP"
        ax1.plot(ts, [r["peak_bytes_measured"] / 2**20 for r in rs], style, label=f"{label} measured")
        ax1.plot(ts, [r["peak_bytes_predicted"] / 2**20 for r in rs], style, alpha=0.4, label=f"{label} predicted")
        ax2.plot(ts, [r["step_time_s"] for r in rs], style, label=label)
    ts = sorted({r["tp"] for r in rows})
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ts, [str(t) for t in ts])
        ax.minorticks_off()
    ax1.set(xlabel="TP degree t (dp = world / t, fixed global batch)", ylabel="peak memory per rank (MiB)")
    ax2.set(xlabel="TP degree t", ylabel="step time (s)")
    ax1.legend(fontsize=7)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())

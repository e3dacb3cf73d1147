"""PatrickStar-style chunks (``memory.offload.plan=chunks``) beside the static offload modes at one device
budget (several budgets): device peak, bytes moved per step (measured next to predicted) and step time.

Modes (each an :class:`~scaletrain.techniques.offload.runtime.OffloadRuntime` or
:class:`~scaletrain.techniques.offload.chunk_runtime.ChunkRuntime` over the same model and batch):

- ``chunks``: model states in equal chunks, placed by the warm-up step's measured use (Belady eviction,
  device Adam where the chunk is resident with room, CPU Adam otherwise);
- ``zero-offload``: fp32 masters, gradients and Adam on the host, parameters resident (ZeRO-Offload);
- ``streaming``: parameters streamed block by block too (L2L / ZeRO-Infinity's parameter offload);
- ``auto``: the joint static planner (placement + keep/recompute/offload per block) under the budget;
- ``plain`` (no budget): the reference time and the peak the budget is measured against;
- ``deepspeed-zero-offload`` (``--deepspeed``): DeepSpeed's ZeRO-Offload on ``DS_ACCELERATOR=cpu``, time only.

Figures: with device accounting, the third step (the chunks' placement has settled by then: step 1 is
the warm-up, step 2 the first planned one); step times without accounting, one thread, ``--repeats``
rounds in which every mode runs one step in turn (interleaved, so the machine's load drifts alike over
all modes), median per mode.

Usage: ``python benchmarks/offload/chunks.py [--model gpt2-mini] [--batch 2] [--seq 64] [--budgets 40MiB,64MiB]``;
writes ``benchmarks/results/offload_chunks.json`` and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform as pyplatform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from scaletrain import models
from scaletrain.platform import calibrate
from scaletrain.techniques.offload.runtime import OffloadOptions, build_offload_runtime
from scaletrain.techniques.remat.schedule import parse_bytes

OUT = Path(__file__).resolve().parents[1] / "results" / "offload_chunks.json"
MiB = 2**20
MODES = {
    "chunks": {"plan": "chunks"},
    "zero-offload": {"optimizer": "host"},
    "streaming": {"params": "host", "optimizer": "host"},
    "auto": {"plan": "auto"},
}


def lm_loss(o, t):
    return F.cross_entropy(o.flatten(0, 1), t.flatten())


def adamw(m):
    return torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=True)


def build(model, opts: OffloadOptions, plat, x, y):
    return build_offload_runtime(copy.deepcopy(model), adamw, opts, plat, loss_fn=lm_loss, example=(x, y))


def measured(name, model, opts, plat, x, y, steps: int = 3) -> dict:
    """Peak and bytes of step ``steps`` with device accounting, next to their predictions."""
    rt = build(model, opts, plat, x, y)
    for _ in range(steps):
        rt.forward_backward(x, y)
        rt.step()
    st = rt.last_stats()
    rt.close()
    row = {"mode": name, "budget_bytes": opts.device_budget}
    for k in ("device_peak_bytes", "h2d_bytes", "d2h_bytes", "host_peak_bytes"):
        row[k], row["predicted_" + k] = st[k], st["predicted_" + k]
    if name == "chunks":
        row.update(chunks=len(rt.layout), chunk_bytes=rt.S, device_updates=st["device_updates"],
                   host_updates=st["host_updates"])
    elif rt.options.modes is not None:
        o = rt.options
        row["plan"] = {"params": o.params, "optimizer": o.optimizer, "modes": "".join(m[0] for m in o.modes)}
    return row


def deepspeed_step(model, x, y):
    """One DeepSpeed ZeRO-Offload step (ZeRO-2, Adam states and update on the CPU) as a function, one process."""
    import os

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29613"), ("RANK", "0"), ("WORLD_SIZE", "1"),
                 ("LOCAL_RANK", "0")):
        os.environ.setdefault(k, v)
    import deepspeed

    cfg = {"train_batch_size": len(x), "train_micro_batch_size_per_gpu": len(x), "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    m = copy.deepcopy(model)
    eng, *_ = deepspeed.initialize(model=m, model_parameters=m.parameters(), config=cfg, dist_init_required=True)

    def step():
        eng.backward(lm_loss(eng(x), y))
        eng.step()
    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2-mini")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--budgets", default="40MiB,64MiB", help="device budgets (comma-separated) of every offload mode")
    ap.add_argument("--chunk-bytes", default="auto")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--deepspeed", action="store_true", help="also time DeepSpeed ZeRO-Offload (needs deepspeed "
                    "0.19.8; its C++ ops compile on first use, ~9 min on 2 cores)")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = models.get(args.model)
    g = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    x = torch.randint(0, vocab, (args.batch, args.seq), generator=g)
    y = torch.randint(0, vocab, (args.batch, args.seq), generator=g)
    plat = calibrate(quick=True)
    budgets = [parse_bytes(b) for b in args.budgets.split(",")]
    chunk = None if args.chunk_bytes == "auto" else parse_bytes(args.chunk_bytes)
    options = {(name, b): OffloadOptions(**kw, device_budget=b, chunk_bytes=chunk)
               for b in budgets for name, kw in MODES.items()}
    rows = [measured(name, model, o, plat, x, y) for (name, _), o in options.items()]
    rows.append(measured("plain", model, OffloadOptions(), plat, x, y))  # the pool counts the peak; no budget
    # timing: no accounting, every runner one step per round
    steps = {}
    runners = []
    for key, o in options.items():
        t = copy.deepcopy(o)
        t.track, t.strict, t.measure_times = False, False, key[0] == "auto"
        rt = build(model, t, plat, x, y)
        runners.append(rt)
        steps[key] = lambda rt=rt: (rt.forward_backward(x, y), rt.step())
    ref = copy.deepcopy(model)
    opt = adamw(ref)

    def plain_step():
        lm_loss(ref(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    steps[("plain", None)] = plain_step
    if args.deepspeed:
        steps[("deepspeed-zero-offload", None)] = deepspeed_step(model, x, y)
        rows.append({"mode": "deepspeed-zero-offload", "budget_bytes": None,
                     "note": "DeepSpeed 0.19.8 ZeRO-2 + offload_optimizer=cpu, DS_ACCELERATOR=cpu: its device is "
                             "the host, so no device peak or budget; time only (cpu_adam op JIT-compiled beforehand)"})
    for fn in steps.values():  # warm-up steps (the chunks' first one measures its statistics)
        fn()
        fn()
    times: dict[tuple, list[float]] = {k: [] for k in steps}
    for _ in range(args.repeats):
        for key, fn in steps.items():
            t0 = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - t0)
    for rt in runners:
        rt.close()
    for r in rows:
        r["step_times_s"] = times[(r["mode"], r["budget_bytes"])]
        r["step_time_s"] = statistics.median(r["step_times_s"])
    n = sum(p.numel() for p in model.parameters())
    out = {"model": args.model, "parameters": n, "model_state_bytes": 16 * n, "batch": args.batch, "seq": args.seq,
           "budgets_bytes": budgets, "threads": args.threads, "repeats": args.repeats,
           "device": "cpu (logical device pool)", "machine": pyplatform.processor() or pyplatform.machine(),
           "torch": torch.__version__, "command": "python benchmarks/offload/chunks.py " + " ".join(
               f"--{k.replace('_', '-')}" + ("" if isinstance(v, bool) else f" {v}")
               for k, v in vars(args).items() if k != "out" and v is not False),
           "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"{args.model}: {n / 1e6:.2f} M parameters, model states {16 * n / MiB:.1f} MiB, batch {args.batch} x "
          f"{args.seq}, {args.threads} thread(s), median of {args.repeats} interleaved steps\n")
    print("| budget MiB | mode | device peak MiB (pred) | h2d MiB (pred) | d2h MiB (pred) | step ms |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        b = f"{r['budget_bytes'] / MiB:.0f}" if r["budget_bytes"] else "none"
        if "device_peak_bytes" not in r:
            print(f"| {b} | {r['mode']} | - | - | - | {r['step_time_s'] * 1e3:.0f} |")
            continue
        print(f"| {b} | {r['mode']} | {r['device_peak_bytes'] / MiB:.1f} ({r['predicted_device_peak_bytes'] / MiB:.1f})"
              f" | {r['h2d_bytes'] / MiB:.1f} ({r['predicted_h2d_bytes'] / MiB:.1f}) | "
              f"{r['d2h_bytes'] / MiB:.1f} ({r['predicted_d2h_bytes'] / MiB:.1f}) | {r['step_time_s'] * 1e3:.0f} |")


if __name__ == "__main__":
    main()

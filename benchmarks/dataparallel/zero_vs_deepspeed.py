"""scaletrain's ZeRO-2 and ZeRO-3 side by side with DeepSpeed ZeRO-2/3, plain FSDP2 and DDP.

Same GPT-2 shape, same weights (seed), same batches, same AdamW, fp32, gradient clipping 1.0, on
``--world`` CPU processes with gloo (one thread each), in one invocation, rounds interleaved so
that machine load hits every variant alike. Variants:

- ``scaletrain-zero2``: :class:`scaletrain.techniques.data_parallel.zero.GradSync` (stage 2) through the stack;
- ``deepspeed-zero2`` / ``deepspeed-zero3``: ``deepspeed.initialize`` with ``zero_optimization.stage``
  2 / 3, ``overlap_comm``, bucket sizes set to the same 25 MiB as ours (``DS_ACCELERATOR=cpu``);
- ``scaletrain-zero3``: :class:`scaletrain.techniques.data_parallel.fsdp.FSDPSync` (fully_shard per block,
  root resharded too, explicit prefetch, optimizer on local shards);
- ``fully_shard``: plain FSDP2 as its docs show it (per block + root, default resharding, the
  optimizer on the DTensor parameters) — the native path stage 3 builds on;
- ``ddp``: torch DDP, the native replicated baseline for stage 2.

Reported per variant: step time (the slowest rank's; median over a round's timed steps, best
round — the least disturbed by other jobs on a shared machine; the median over all rounds is kept
too), CPU seconds per rank and step (same statistic) (``time.process_time``: all threads of the process, less
sensitive than wall time to other jobs on a shared machine), both as ratios of the scaletrain
variant of the same stage to its peers, per-rank peak RSS growth over the process's
RSS before the model was built (what model states + activations + buffers cost on this rank), and
the losses (they must agree across variants). Output: ``benchmarks/results/dataparallel_zero.json``.

    DS_ACCELERATOR=cpu .venv/bin/python benchmarks/dataparallel/zero_vs_deepspeed.py
    (needs `.venv/bin/pip install -c constraints.txt deepspeed==0.19.8`, benchmark-only)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import time
import warnings
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

RESULTS = Path(__file__).resolve().parents[1] / "results"
VARIANTS = ("ddp", "scaletrain-zero2", "deepspeed-zero2", "fully_shard", "scaletrain-zero3", "deepspeed-zero3")
BUCKET_MB = 25.0


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _model(args):
    from scaletrain import models

    torch.manual_seed(0)
    return models.get("gpt2-tiny", n_layer=args.layers, n_embd=args.hidden, n_head=args.heads,
                      n_positions=args.seq)


def _batches(args, rank: int, world: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(args.warmup + args.steps):
        x = torch.randint(0, 256, (args.micro * world, args.seq + 1), generator=g)
        out.append(x[rank * args.micro:(rank + 1) * args.micro])
    return out


def _loss(logits: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten())


def _run(rank: int, world: int, variant: str, args) -> dict:
    warnings.filterwarnings("ignore")
    base = _rss()
    model = _model(args)
    batches = _batches(args, rank, world)
    device = torch.device("cpu")
    opt_kw = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0, foreach=True)
    if variant.startswith("deepspeed"):
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed

        stage = int(variant[-1])
        elems = int(BUCKET_MB * 2**20 / 4)
        cfg = {"train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": 1,
               "train_batch_size": args.micro * world, "gradient_clipping": 1.0, "steps_per_print": 10**9,
               "zero_allow_untested_optimizer": True,
               "zero_optimization": {"stage": stage, "overlap_comm": True, "contiguous_gradients": True,
                                     "reduce_bucket_size": elems, "allgather_bucket_size": elems,
                                     "stage3_prefetch_bucket_size": elems}}
        opt = torch.optim.AdamW(model.parameters(), **opt_kw)
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg, dist_init_required=False)

        def step_fn(x):
            loss = _loss(engine(x[:, :-1]), x)
            engine.backward(loss)
            engine.step()
            return loss
    elif variant == "fully_shard":
        from torch.distributed.fsdp import fully_shard

        for b in model.h:
            fully_shard(b)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), **opt_kw)

        def step_fn(x):
            loss = _loss(model(x[:, :-1]), x)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss
    else:  # scaletrain's runtime stack, as `scaletrain train` builds it
        from scaletrain.plan import Plan
        from scaletrain.techniques.compat import Facts
        from scaletrain.techniques.runtime import RunContext
        from scaletrain.techniques.stack import build_runtime

        zero = {"ddp": 0, "scaletrain-zero2": 2}.get(variant, 3)
        ctx = RunContext(device=device, rank=rank, world=world, dp_world=world, micro_batch=args.micro,
                         seq_len=args.seq, loss_fn=lambda out, y: F.cross_entropy(out.flatten(0, 1).float(),
                                                                                  y.flatten()))
        plan = Plan(zero=zero, bucket_mb=BUCKET_MB).resolved(world)
        strat = build_runtime(plan, model, ctx, Facts.of(model, world=world, device="cpu", seq_len=args.seq))
        opt = strat.build_optimizer(lambda m: torch.optim.AdamW(m.parameters(), **opt_kw))

        def step_fn(x):
            loss = strat.run_micro_batches(ctx, iter([(x[:, :-1], x[:, 1:])]))
            strat.prepare_step(opt)
            strat.clip_grad_norm(opt, 1.0)
            opt.step()
            strat.after_step()
            strat.zero_grad(opt)
            return torch.tensor(loss)
    times, cpus, losses = [], [], []
    for i, x in enumerate(batches):
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        loss = step_fn(x)
        c1 = time.process_time()  # CPU seconds of all this process's threads: robust to a loaded machine
        dist.barrier()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
            cpus.append(c1 - c0)
        losses.append(float(loss))
    peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
    return {"times": times, "cpu": cpus, "losses": losses, "peak_growth_bytes": peak - base}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro", type=int, default=4, help="samples per rank per step")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--out", default=str(RESULTS / "dataparallel_zero.json"))
    args = p.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from scaletrain.testing import run_distributed

    variants = args.variants.split(",")
    raw: dict[str, list] = {v: [] for v in variants}
    for rnd in range(args.rounds):
        for v in variants:
            t0 = time.time()
            res = run_distributed(_run, args.world, v, args, timeout_s=1800)
            raw[v].append(res)
            print(f"round {rnd} {v}: {time.time() - t0:.0f} s wall, step "
                  f"{statistics.median(max(r['times'][i] for r in res) for i in range(args.steps)) * 1e3:.0f} ms",
                  flush=True)
    n_params = sum(p.numel() for p in _model(args).parameters())
    table = {}
    for v in variants:
        steps = [max(r["times"][i] for r in res) for res in raw[v] for i in range(args.steps)]
        cpu = [sum(r["cpu"][i] for r in res) / len(res) for res in raw[v] for i in range(args.steps)]
        rounds = [statistics.median(steps[k * args.steps:(k + 1) * args.steps]) for k in range(args.rounds)]
        cpu_rounds = [statistics.median(cpu[k * args.steps:(k + 1) * args.steps]) for k in range(args.rounds)]
        table[v] = {"step_time_s": min(rounds),  # the least disturbed round (other jobs share the machine)
                    "step_time_s_median_all": statistics.median(steps),
                    "step_time_s_all": steps,
                    "cpu_s_per_rank": min(cpu_rounds),
                    "peak_rss_growth_bytes_per_rank": max(r["peak_growth_bytes"] for res in raw[v] for r in res),
                    "losses": raw[v][0][0]["losses"]}
    for v, ref in (("deepspeed-zero2", "scaletrain-zero2"), ("ddp", "scaletrain-zero2"),
                   ("deepspeed-zero3", "scaletrain-zero3"), ("fully_shard", "scaletrain-zero3")):
        if v in table and ref in table:
            table[ref].setdefault("step_time_ratio_to", {})[v] = table[ref]["step_time_s"] / table[v]["step_time_s"]
            table[ref].setdefault("cpu_ratio_to", {})[v] = table[ref]["cpu_s_per_rank"] / table[v]["cpu_s_per_rank"]
    out = {"benchmark": "dataparallel_zero", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "machine": {"platform": platform.platform(), "processor": platform.processor(),
                       "cpus": os.cpu_count(), "load_avg_at_end": os.getloadavg()},
           "torch": torch.__version__, "deepspeed": _version("deepspeed"), "python": sys.version.split()[0],
           "setup": {**vars(args), "params": n_params, "dtype": "fp32", "optimizer": "torch AdamW foreach",
                     "bucket_mb": BUCKET_MB, "threads_per_rank": 1, "backend": "gloo"},
           "results": table}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"{'variant':18s} {'step ms':>8s} {'CPU ms/rank':>11s} {'peak MiB/rank':>13s}  losses  (ratios: wall, CPU)")
    for v in variants:
        r = table[v]
        ratio_s = ", ".join(f"{k} {x:.2f}, {r['cpu_ratio_to'][k]:.2f}"
                            for k, x in r.get("step_time_ratio_to", {}).items())
        print(f"{v:18s} {r['step_time_s'] * 1e3:8.0f} {r['cpu_s_per_rank'] * 1e3:11.0f} "
              f"{r['peak_rss_growth_bytes_per_rank'] / 2**20:13.0f}  {r['losses'][0]:.4f} .. {r['losses'][-1]:.4f}  "
              f"{ratio_s}")
    print(f"wrote {args.out}")


def _version(name: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:  # noqa: BLE001
        return None


if __name__ == "__main__":
    main()

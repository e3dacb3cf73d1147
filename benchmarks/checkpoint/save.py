"""Sharded vs consolidated checkpoints: save time, bytes each rank writes, memory each rank allocates.

One training step of ``--model`` under ``--layout`` on ``--world`` gloo CPU processes (one thread
each), then ``--rounds`` saves of each format, interleaved (machine load hits both alike). Per
save and rank: wall seconds (the slowest rank's is the save's time: every rank waits for the
checkpoint to be complete), bytes the rank wrote, and the peak bytes of tensors allocated *during*
the save (the memory tracker's temporaries: a consolidated save gathers whole tensors, a sharded
one should allocate next to nothing; ``sharded-async``: training waits only for the snapshot of
this rank's shards, ``complete_seconds`` is until the checkpoint exists). Output:
``benchmarks/results/checkpoint_save.json``.

    PYTHONPATH=src .venv/bin/python benchmarks/checkpoint/save.py --model gpt2-mini --layout parallel.zero=3
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results"
FORMATS = ("sharded", "sharded-async", "consolidated")


def _run(rank: int, world: int, args: argparse.Namespace, out: str) -> dict:
    import torch

    from scaletrain.measure.comm import DTensorMemoryTracker
    from scaletrain.train.config import load_config
    from scaletrain.train.trainer import Trainer

    cfg = load_config(None, [f"model.name={args.model}", "data.seq_len=64", "train.global_batch=8", "train.steps=1",
                             "train.eval_every=0", "train.progress=off", "train.checkpoint_every=0",
                             "train.keep_checkpoints=1", *args.layout.split()])
    t = Trainer(cfg, Path(out) / "run", log=lambda s: None)
    rows = []
    try:
        t.fit()  # one step: optimizer states exist (its end-of-run checkpoint is not timed)
        from scaletrain.train import checkpoint_io

        for i in range(args.rounds):
            for k, fmt in enumerate(FORMATS):
                t.cfg.train.checkpoint_format = "consolidated" if fmt == "consolidated" else "sharded"
                t.cfg.train.checkpoint_async = fmt == "sharded-async"
                t.cfg.train.steps = 10**9 if fmt == "sharded-async" else 1  # async: not the run's last save
                t.step = 1000 + len(FORMATS) * i + k
                with DTensorMemoryTracker(model=t.model, optimizer=t.optimizer) as tr:
                    t0 = time.perf_counter()
                    path = t.save_checkpoint()
                    dt = time.perf_counter() - t0  # async: what training waits for (the snapshot)
                    checkpoint_io.wait(t)
                    total = time.perf_counter() - t0
                d = Path(out) / "run" / "checkpoints"
                if fmt.startswith("sharded"):
                    wrote = (d / f"step_{t.step:08d}" / f"rank_{rank:05d}.bin").stat().st_size
                else:
                    wrote = path.stat().st_size if rank == 0 else 0
                rows.append({"format": fmt, "round": i, "seconds": dt, "seconds_until_complete": total,
                             "bytes_written": wrote,
                             "peak_temporaries_bytes": int(tr.peak_breakdown.get("temporaries", 0)),
                             "peak_tracked_bytes": int(tr.peak_bytes)})
        states = sum(p.numel() * p.element_size() for p in t.model.parameters())  # logical, not per rank
        return {"rows": rows, "layout": t.parallel.describe(), "param_bytes_total": states,
                "torch_threads": torch.get_num_threads()}
    finally:
        t.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2-mini")
    ap.add_argument("--layout", default="parallel.zero=3", help="space-separated config overrides")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    from scaletrain.testing import run_distributed

    with tempfile.TemporaryDirectory() as out:
        res = run_distributed(_run, args.world, args, out, timeout_s=1200)
    summary = {}
    for fmt in FORMATS:
        idx = [k for k in range(len(res[0]["rows"])) if res[0]["rows"][k]["format"] == fmt]
        per_round = [max(r["rows"][k]["seconds"] for r in res) for k in idx]
        complete = [max(r["rows"][k]["seconds_until_complete"] for r in res) for k in idx]
        rows = [[x for x in r["rows"] if x["format"] == fmt] for r in res]
        summary[fmt] = {"save_seconds_median": statistics.median(per_round), "save_seconds": per_round,
                        "complete_seconds_median": statistics.median(complete),
                        "bytes_written_per_rank": [x[0]["bytes_written"] for x in rows],
                        "peak_temporaries_bytes_per_rank": [max(y["peak_temporaries_bytes"] for y in x) for x in rows]}
    report = {"model": args.model, "layout": res[0]["layout"], "world": args.world, "rounds": args.rounds,
              "command": f"PYTHONPATH=src python benchmarks/checkpoint/save.py --model {args.model} "
                         f"--layout '{args.layout}' --world {args.world} --rounds {args.rounds}", **summary}
    RESULTS.mkdir(exist_ok=True)
    layout = args.layout.replace("parallel.", "").replace("=", "").replace(" ", "_")
    name = f"checkpoint_save_{args.model}_{layout}.json"
    (RESULTS / name).write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

"""Asynchronous pipelines (PipeDream, PipeDream-2BW) versus 1F1B on the shipped text.

The question of seed "How to Train Your Neural Network" (§III-C): what does weight staleness
cost? Each schedule trains GPT-2 tiny (4 layers, 128 hidden, byte vocabulary) from the same
initial weights on the same stream of Shakespeare micro-batches (M = 4 per window of 16
samples × 64 tokens), AdamW at a constant learning rate, for ``--windows`` windows on P ranks:

* ``1f1b`` — synchronous: one update per window on the mean gradient of its M micro-batches;
* ``pipedream-2bw`` — one update per window too, but the pipeline never flushes: a
  micro-batch's gradient is computed on the weights it was forwarded with (double buffering,
  at most two versions), so updates use gradients one version stale;
* ``pipedream`` — an update after every micro-batch (M per window, each on one micro-batch),
  with weight stashing: each stage uses a different version for one micro-batch.

Reported: the training loss per window, the final training loss (mean of the last 5 windows)
and the validation loss (nats/token, first 16 validation batches) of the final weights.

Run: ``python benchmarks/pipeline/async_loss.py [--ranks 2] [--windows 40]``; writes
``benchmarks/results/pipeline_async_loss.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import lm_loss, make_model, write_json  # noqa: E402

from scaletrain.data import build_loader, get_dataset  # noqa: E402
from scaletrain.testing import run_distributed  # noqa: E402

M, MB, SEQ, LR = 4, 4, 64, 2e-3
MODEL = dict(n_layer=4, n_embd=128, n_head=4, n_positions=SEQ)
SCHEDS = ("1f1b", "pipedream-2bw", "pipedream")


def _worker(rank: int, world: int, windows: int) -> dict:
    from scaletrain.techniques.pipeline.runtime import PipelineRuntime

    out = {}
    train = get_dataset("shakespeare", "train", seq_len=SEQ)
    val = get_dataset("shakespeare", "val", seq_len=SEQ)
    for name in SCHEDS:
        model = make_model(**MODEL)
        rt = PipelineRuntime(model, name, M, pp=world, loss_fn=lm_loss,
                             example_input=torch.zeros(MB, SEQ, dtype=torch.long),
                             record_events=False)
        opt = torch.optim.AdamW(rt.parameters(), lr=LR, weight_decay=0.0)
        updates = 0

        def update() -> None:
            nonlocal updates
            opt.step()
            opt.zero_grad(set_to_none=True)
            updates += 1

        loader = iter(build_loader(train, MB, shuffle=True, seed=0, infinite=True))
        t = time.perf_counter()
        losses = rt.train(windows, loader, update)
        wall = time.perf_counter() - t
        rt.sync_full_model()
        val_loss = None
        if rank == 0:
            model.eval()
            with torch.no_grad():
                vl = [float(lm_loss(model(x), y)) for i, (x, y) in
                      zip(range(16), build_loader(val, MB, shuffle=False, seed=0, drop_last=True))]
            val_loss = statistics.fmean(vl)
        out[name] = {"train_loss": losses, "val_loss": val_loss, "updates_per_rank": updates, "wall_s": wall}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--windows", type=int, default=40)
    args = ap.parse_args()
    res = run_distributed(_worker, args.ranks, args.windows, timeout_s=3600)[0]
    summary = {}
    for name in SCHEDS:
        r = res[name]
        final = statistics.fmean(r["train_loss"][-5:])
        summary[name] = {**r, "final_train_loss": final}
        print(f"{name:14s} final train loss {final:.4f}  val loss {r['val_loss']:.4f}  updates {r['updates_per_rank']}"
              f"  wall {r['wall_s']:.1f} s", flush=True)
    base = summary["1f1b"]["val_loss"]
    for name in SCHEDS:
        summary[name]["val_loss_minus_1f1b"] = summary[name]["val_loss"] - base
    out = {"model": f"gpt2-tiny {MODEL}", "data": "shakespeare", "ranks": args.ranks, "microbatches": M,
           "micro_batch": MB, "seq": SEQ, "lr": LR, "optimizer": "AdamW (constant lr, no weight decay)",
           "windows": args.windows, "command": "python benchmarks/pipeline/async_loss.py " + " ".join(sys.argv[1:]),
           "results": summary}
    print("wrote", write_json("pipeline_async_loss.json", out))


if __name__ == "__main__":
    main()

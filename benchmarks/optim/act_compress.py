"""Activation compression (8-bit saved tensors) on gpt2-tiny: memory saved and loss impact.

Two runs from the same initial weights over the same batches of the shipped Shakespeare text,
fp32 AdamW (lr 1e-3): ``baseline`` and ``compressed`` (forward inside
:class:`scaletrain.techniques.act_compress.compress_activations`). Reported per run: bytes of the
non-leaf floating tensors saved for backward per step (counted by a saved-tensors hook; for the
compressed run, the codes + scales actually stored), the train loss curve, validation loss at the
end, and step time (median). Output: ``benchmarks/results/optim_act_compress.json``.

    .venv/bin/python benchmarks/optim/act_compress.py [--steps 200]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

RESULTS = Path(__file__).resolve().parents[1] / "results"


def _batches(split: str, n: int, batch: int, seq: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    from scaletrain.data.text import TextDataset

    ds = TextDataset(split, seq)
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        idx = torch.randint(0, len(ds), (batch,), generator=g)
        out.append((torch.stack([ds[int(i)][0] for i in idx]), torch.stack([ds[int(i)][1] for i in idx])))
    return out


def _saved_bytes(model: torch.nn.Module, x: torch.Tensor) -> int:
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not t.is_leaf and t.is_floating_point() and t.untyped_storage().data_ptr() not in params:
            seen[id(t)] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    return sum(seen.values())


def run(compress: bool, args: argparse.Namespace, train, val) -> dict:
    from scaletrain import models
    from scaletrain.techniques.act_compress import compress_activations

    torch.manual_seed(0)
    model = models.get("gpt2-tiny")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    losses, times, stored = [], [], None
    for x, y in train:
        t0 = time.perf_counter()
        if compress:
            with compress_activations(model) as ctx:
                logits = model(x)
            stored = ctx.stats.compressed_bytes + ctx.stats.kept_bytes
        else:
            logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    with torch.no_grad():
        val_loss = statistics.mean(float(F.cross_entropy(model(x).flatten(0, 1), y.flatten())) for x, y in val)
    baseline_saved = _saved_bytes(model, train[0][0])
    return {"train_loss": losses, "val_loss": val_loss, "step_median_s": statistics.median(times),
            "saved_bytes_per_step": stored if compress else baseline_saved}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--out", type=Path, default=RESULTS / "optim_act_compress.json")
    args = ap.parse_args()
    train = _batches("train", args.steps, args.batch, args.seq, 0)
    val = _batches("val", 8, args.batch, args.seq, 1)
    res = {name: run(name == "compressed", args, train, val) for name in ("baseline", "compressed")}
    b, c = res["baseline"], res["compressed"]
    summary = {"saved_bytes_ratio": b["saved_bytes_per_step"] / c["saved_bytes_per_step"],
               "val_loss_rel_diff": (c["val_loss"] - b["val_loss"]) / b["val_loss"],
               "step_time_ratio": c["step_median_s"] / b["step_median_s"]}
    print(json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "train_loss"} for k, v in res.items()}, indent=1))
    print(json.dumps(summary, indent=1))
    out = {"benchmark": "optim_act_compress", "date": datetime.now(timezone.utc).isoformat(),
           "machine": {"platform": platform.platform(), "torch": torch.__version__, "cpu_count": os.cpu_count(),
                       "torch_threads": torch.get_num_threads(), "loadavg": os.getloadavg()},
           "model": "gpt2-tiny", "args": vars(args) | {"out": str(args.out)}, "runs": res, "summary": summary}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

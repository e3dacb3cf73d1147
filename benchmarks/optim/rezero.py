"""ReZero against the plain pre-LayerNorm GPT-2 on the shipped text: validation loss against step, and the
estimated peak of each (the deeper ReZero model beside the plain one).

``gpt2-tiny`` (4 layers) plain and with ``model.overrides.rezero=true``, and an 8-layer ReZero model,
train on Shakespeare (16 x 64-byte sequences per step, AdamW at its recipe, 10 % warm-up, cosine) through
the Trainer (:func:`convergence.run`). Writes ``benchmarks/results/optim_rezero.json`` and ``.png``.

    .venv/bin/python benchmarks/optim/rezero.py --steps 150
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import warnings
from datetime import datetime, timezone
from pathlib import Path

import torch
from convergence import RESULTS, run

RUNS = {"plain (4 layers)": [], "rezero (4 layers)": ["model.overrides.rezero=true"],
        "rezero (8 layers)": ["model.overrides.rezero=true", "model.overrides.n_layer=8"]}


def main() -> int:
    from scaletrain.measure.estimate import estimate_step
    from scaletrain.techniques.optim.recipes import recipe

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--out", type=Path, default=RESULTS / "optim_rezero.json")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    S = args.steps
    common = ["train.global_batch=16", f"train.steps={S}", f"optim.warmup_steps={S // 10}"] + recipe("adamw")
    runs, summary = {}, {}
    for name, extra in RUNS.items():
        runs[name] = run(common + extra, args.eval_every)
        over = {k.split(".")[-1]: (v == "true" if v in ("true", "false") else int(v))
                for k, v in (e.split("=") for e in extra)}
        est = estimate_step("gpt2-tiny", 16, 64, optimizer="adamw", **over)
        summary[name] = {"final_val_loss": runs[name]["final_val_loss"], "seconds": runs[name]["seconds"],
                         "estimated_peak_bytes": est.bytes["peak"], "parameters": est.parameters}
        print(name, {k: round(v, 4) for k, v in summary[name].items()}, flush=True)
    out = {"benchmark": "optim_rezero", "date": datetime.now(timezone.utc).isoformat(),
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "loadavg": os.getloadavg()},
           "torch": torch.__version__, "setup": {"model": "gpt2-tiny", "data": "shakespeare", "seq": 64, "batch": 16,
                                                  "steps": S, "optimizer": "adamw"},
           "summary": summary, "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    _plot(runs, summary, args.out.with_suffix(".png"))
    return 0


def _plot(runs: dict, summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, r in runs.items():
        ax.plot([c["step"] for c in r["curve"]], [c["val_loss"] for c in r["curve"]], marker="o",
                label=f"{name}, est. peak {summary[name]['estimated_peak_bytes'] / 2**20:.1f} MiB")
    ax.set_xlabel("optimizer step (16 x 64 bytes)")
    ax.set_ylabel("validation loss (nats/byte)")
    ax.set_title("gpt2-tiny on Shakespeare: ReZero vs pre-LayerNorm (AdamW)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())

"""scaletrain's AdamW8bit next to bitsandbytes' and torchao's, on CPU: accuracy, speed, bytes.

Parameter set: the tensors of a GPT-2-shaped model (byte vocabulary, ``--hidden`` x
``--layers``; defaults give 16.0 M parameters). Three measurements, all in one invocation:

1. *Update error vs fp32 AdamW* (open loop, real gradients): a reference model is trained on the
   shipped Shakespeare text with ``torch.optim.AdamW`` (fp32) for ``--steps`` steps; at every step
   its gradient is also handed to each 8-bit optimizer, which updates its own copy of the
   parameters. Reported: ``||theta_8bit - theta_fp32|| / ||theta_fp32 - theta_0||`` over all
   parameters after 10, 25, ... steps — the relative error of the accumulated update, free of the
   chaos of separately trained models.
2. *Step time*: every optimizer steps the same parameter set with the same random gradient;
   after warm-up (which includes torch.compile for the compiled variants), ``--repeats`` rounds
   in which the variants take turns (machine load hits all alike); median and quartiles.
3. *State bytes*: every tensor each optimizer holds, counted once per storage (bitsandbytes
   shares its two 256-entry maps; torchao's state tensors are subclasses: codes + scales).

Variants: ``scaletrain`` (block 2048, the default; compiled block update), ``scaletrain-eager``
(speed only), ``scaletrain-b256`` (block 256: same layout as the peers), ``bitsandbytes``
(``bnb.optim.AdamW8bit``; its CPU path fixes block 256), ``torchao`` (``torchao.optim.AdamW8bit``,
default block 256) and ``torchao-b2048``. Hyperparameters: lr 1e-3, betas (0.9, 0.999), eps
1e-8, weight decay 0.01 (decoupled) for all.

    .venv/bin/python benchmarks/optim/compare_8bit.py        # writes benchmarks/results/optim_8bit.json
    (needs `.venv/bin/pip install -c constraints.txt "bitsandbytes==0.50.*" "torchao==0.18.*"`,
     benchmark-only; a peer that fails to import or run is recorded with its exact error)
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
import traceback
import warnings
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

RESULTS = Path(__file__).resolve().parents[1] / "results"
HP = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def _variants() -> tuple[dict[str, Callable[[list[torch.nn.Parameter]], Any]], dict[str, str]]:
    """Constructors of every variant that imports; errors of those that do not."""
    from scaletrain.techniques.optim import AdamW8bit

    makers: dict[str, Callable[[list[torch.nn.Parameter]], Any]] = {
        "scaletrain": lambda ps: AdamW8bit(ps, **HP, fused=True),
        "scaletrain-eager": lambda ps: AdamW8bit(ps, **HP, fused=False),
        "scaletrain-b256": lambda ps: AdamW8bit(ps, **HP, fused=True, block_size=256),
    }
    errors: dict[str, str] = {}
    try:
        import bitsandbytes as bnb

        makers["bitsandbytes"] = lambda ps: bnb.optim.AdamW8bit(ps, **HP)
    except Exception as exc:  # noqa: BLE001 - record exactly what failed
        errors["bitsandbytes"] = f"{type(exc).__name__}: {exc}"
    try:
        from torchao.optim import AdamW8bit as AOAdamW8bit

        makers["torchao"] = lambda ps: AOAdamW8bit(ps, **HP)
        makers["torchao-b2048"] = lambda ps: AOAdamW8bit(ps, **HP, block_size=2048)
    except Exception as exc:  # noqa: BLE001
        errors["torchao"] = f"{type(exc).__name__}: {exc}"
    return makers, errors


def _model(args: argparse.Namespace) -> torch.nn.Module:
    from scaletrain import models

    torch.manual_seed(0)
    return models.get("gpt2-mini", n_embd=args.hidden, n_layer=args.layers, n_head=args.heads,
                      n_positions=args.seq)


def state_nbytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in ``opt.state``, each storage once; subclass states by their parts."""
    seen: set[int] = set()
    total = 0

    def add(t: torch.Tensor) -> None:
        nonlocal total
        if hasattr(t, "codes") and hasattr(t, "scale"):  # torchao OptimState8bit
            add(t.codes)
            add(t.scale)
            return
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen and t.numel():
            return
        seen.add(ptr)
        total += t.numel() * t.element_size()

    for st in opt.state.values():
        for v in st.values():
            if torch.is_tensor(v):
                add(v)
    return total


def _rel_error(ps: list[torch.Tensor], ref: list[torch.Tensor], p0: list[torch.Tensor]) -> float:
    num = sum(float((a.detach() - b.detach()).double().pow(2).sum()) for a, b in zip(ps, ref))
    den = sum(float((b.detach() - c).double().pow(2).sum()) for b, c in zip(ref, p0))
    return (num / den) ** 0.5


def accuracy(args: argparse.Namespace, makers: dict[str, Callable], errors: dict[str, str]) -> dict:
    from scaletrain.data.text import TextDataset

    model = _model(args)
    ds = TextDataset("train", args.seq)
    p0 = [p.detach().clone() for p in model.parameters()]
    ref_opt = torch.optim.AdamW(model.parameters(), **HP)
    copies: dict[str, tuple[list[torch.nn.Parameter], Any]] = {}
    for name, make in makers.items():
        if name == "scaletrain-eager":
            continue  # same numbers as "scaletrain" to float rounding; speed only
        ps = [torch.nn.Parameter(p.clone()) for p in p0]
        try:
            copies[name] = (ps, make(ps))
        except Exception as exc:  # noqa: BLE001
            errors[name] = f"{type(exc).__name__}: {exc}"
    gen = torch.Generator().manual_seed(0)
    checkpoints = sorted({min(args.steps, c) for c in (10, 25, 50, 100, 200, args.steps)})
    curve: dict[str, dict[int, float]] = {n: {} for n in copies}
    losses = []
    for step in range(1, args.steps + 1):
        idx = torch.randint(0, len(ds), (args.batch,), generator=gen)
        x = torch.stack([ds[int(i)][0] for i in idx])
        y = torch.stack([ds[int(i)][1] for i in idx])
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        model.zero_grad(set_to_none=True)
        loss.backward()
        losses.append(float(loss))
        grads = [p.grad for p in model.parameters()]
        for name, (ps, opt) in list(copies.items()):
            for p, g in zip(ps, grads):
                p.grad = g.clone()
            try:
                opt.step()
            except Exception as exc:  # noqa: BLE001
                errors[name] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}"
                del copies[name]
        ref_opt.step()
        if step in checkpoints:
            ref = list(model.parameters())
            for name, (ps, _) in copies.items():
                curve[name][step] = _rel_error(ps, ref, p0)
            print(f"step {step}: loss {loss.item():.3f} " +
                  " ".join(f"{n}={curve[n][step]:.4f}" for n in copies), flush=True)
    return {"steps": args.steps, "batch": args.batch, "seq": args.seq, "train_loss": losses,
            "relative_update_error": {n: {str(k): v for k, v in c.items()} for n, c in curve.items()}}


def speed(args: argparse.Namespace, makers: dict[str, Callable], errors: dict[str, str]) -> dict:
    model = _model(args)
    shapes = [p.shape for p in model.parameters()]
    del model
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(s, generator=gen) * 1e-3 for s in shapes]
    runs: dict[str, dict[str, Any]] = {}
    for name, make in makers.items():
        ps = [torch.nn.Parameter(torch.randn(s, generator=gen) * 0.02) for s in shapes]
        for p, g in zip(ps, grads):
            p.grad = g
        try:
            opt = make(ps)
            t0 = time.perf_counter()
            opt.step()  # first step: state allocation and (for compiled variants) compilation
            first = time.perf_counter() - t0
            for _ in range(args.warmup):
                opt.step()
        except Exception as exc:  # noqa: BLE001
            errors[name] = f"{type(exc).__name__}: {exc}"
            continue
        runs[name] = {"opt": opt, "first_step_s": first, "times": [],
                      "state_bytes": state_nbytes(opt)}
    for _ in range(args.repeats):  # round-robin: load spikes hit every variant
        for name, r in runs.items():
            t0 = time.perf_counter()
            r["opt"].step()
            r["times"].append(time.perf_counter() - t0)
    n_params = sum(s.numel() for s in shapes)
    out = {}
    for name, r in runs.items():
        q = statistics.quantiles(r["times"], n=4) if len(r["times"]) >= 2 else [r["times"][0]] * 3
        out[name] = {"median_s": statistics.median(r["times"]), "q1_s": q[0], "q3_s": q[2],
                     "times_s": r["times"], "first_step_s": r["first_step_s"],
                     "state_bytes": r["state_bytes"], "bytes_per_param": r["state_bytes"] / n_params}
    return {"parameters": n_params, "tensors": len(shapes), "repeats": args.repeats, "variants": out}


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"platform": platform.platform(), "processor": platform.processor(),
                            "python": platform.python_version(), "torch": torch.__version__,
                            "torch_threads": torch.get_num_threads()}
    try:
        import os

        info["cpu_count"] = os.cpu_count()
        with open("/proc/cpuinfo") as f:
            info["cpu_model"] = next((ln.split(":", 1)[1].strip() for ln in f if "model name" in ln), "")
        info["loadavg_at_start"] = os.getloadavg()
    except OSError:
        pass
    for mod in ("bitsandbytes", "torchao"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception as exc:  # noqa: BLE001
            info[mod] = f"unavailable: {type(exc).__name__}: {exc}"
    return info


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=50, help="accuracy: optimizer steps")
    ap.add_argument("--repeats", type=int, default=9, help="speed: timed rounds")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--skip-accuracy", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULTS / "optim_8bit.json")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    makers, errors = _variants()
    result: dict[str, Any] = {"benchmark": "optim_8bit", "date": datetime.now(timezone.utc).isoformat(),
                              "machine": machine(), "hyperparameters": {**HP, "betas": list(HP["betas"])},
                              "args": {k: str(v) for k, v in vars(args).items()}}
    result["speed"] = speed(args, makers, errors)
    for name, v in result["speed"]["variants"].items():
        print(f"{name:18s} median {v['median_s'] * 1e3:7.1f} ms  first {v['first_step_s']:.1f} s  "
              f"{v['bytes_per_param']:.4f} B/param", flush=True)
    if not args.skip_accuracy:
        result["accuracy"] = accuracy(args, makers, errors)
    result["errors"] = errors
    result["machine"]["loadavg_at_end"] = __import__("os").getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

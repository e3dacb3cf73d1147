"""The survey's findings, each judged on this study's cells by a stated rule.

Every rule reads only cells with status ``ok`` of one model and says ``reproduced``, ``not reproduced``
or ``not testable`` (the cells it needs are missing, failed or not applicable: named). The one-device
DDP cell is the one-process run, so it is the "1 stage" / "t = 1" point of the pipeline and tensor
parallel curves. Peaks are the heaviest rank's tracked peak (bytes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from scaletrain.compare.matrix import ASYNC_PIPELINES, DATA_PARALLEL, MODELS, SYNC_PIPELINES

Cells = list[dict[str, Any]]
ZERO_RANGE = (0.42, 0.66)
"""The survey's ZeRO / DDP per-device memory ratio range."""
STALENESS_MARGIN = 1e-4
"""Relative difference of mean validation metrics below which two runs count as equal: synchronous
schedules equal the one-process run to ~1e-6, so a smaller gap is rounding, not staleness."""


@dataclass(frozen=True)
class Finding:
    """One claim of the survey, its rule (in words) and the figure that shows it."""

    key: str
    claim: str
    rule: str
    figure: str
    judge: Callable[[Cells, str], tuple[str, str]]
    """(verdict, evidence) for one model's cells."""


def _ok(cells: Cells, model: str) -> dict[tuple[str, int], dict[str, Any]]:
    return {(c["strategy"], c["devices"]): c for c in cells if c["model"] == model and c["status"] == "ok"}


def _mib(b: float) -> str:
    return f"{b / 2**20:.1f} MiB"


def _curve(ok: dict[tuple[str, int], dict[str, Any]], strategy: str,
           key: str = "peak_bytes") -> list[tuple[int, float]]:
    """(devices, value) of ``strategy`` with the one-process run (ddp, 1 device) as its 1-device point."""
    pts = {d: c[key] for (s, d), c in ok.items() if s == strategy and c.get(key) is not None and d > 1}
    if ("ddp", 1) in ok and ok[("ddp", 1)].get(key) is not None:
        pts[1] = ok[("ddp", 1)][key]
    return sorted(pts.items())


def zero_memory(cells: Cells, model: str) -> tuple[str, str]:
    ok = _ok(cells, model)
    pairs = [(s, d, c["peak_bytes"] / ok[("ddp", d)]["peak_bytes"]) for (s, d), c in ok.items()
             if s.startswith(("zero", "deepspeed-zero")) and d > 1 and ("ddp", d) in ok and c.get("peak_bytes")]
    if not pairs:
        return "not testable", "needs a ZeRO cell and the ddp cell at the same device count (> 1)"
    top = max(d for _, d, _ in pairs)
    last = [r for _, d, r in pairs if d == top]
    inside = all(ZERO_RANGE[0] <= r <= ZERO_RANGE[1] for r in last)
    text = ", ".join(f"{s} {d}d {r:.0%}" for s, d, r in sorted(pairs, key=lambda p: (p[0], p[1])))
    return ("reproduced" if inside else "not reproduced"), f"peak / DDP's: {text} (verdict at {top} devices)"


def pipeline_memory(cells: Cells, model: str) -> tuple[str, str]:
    ok = _ok(cells, model)
    verdicts, texts = [], []
    for s in SYNC_PIPELINES:
        pts = _curve(ok, s)
        if len(pts) < 3 or not any(d > 1 for d, _ in pts):
            continue
        vals = [v for _, v in pts]
        falls = all(b < a for a, b in zip(vals, vals[1:]))
        drops = [(a - b) / a for a, b in zip(vals, vals[1:])]
        plateaus = drops[-1] < drops[0]
        verdicts.append(falls and plateaus)
        texts.append(f"{s}: " + " → ".join(f"{d} stage{'s' * (d > 1)} {_mib(v)}" for d, v in pts)
                     + f" (drops {', '.join(f'{x:.0%}' for x in drops)})")
    if not verdicts:
        return "not testable", "needs a synchronous pipeline at >= 2 stage counts and the 1-device ddp cell"
    return ("reproduced" if all(verdicts) else "not reproduced"), "; ".join(texts)


def tp_u_shape(cells: Cells, model: str) -> tuple[str, str]:
    ok = _ok(cells, model)
    verdicts, texts = [], []
    for s in ("tp", "tp-sp"):
        pts = _curve(ok, s)
        if len(pts) < 3:
            continue
        vals = [v for _, v in pts]
        low = vals.index(min(vals))
        verdicts.append(0 < low < len(vals) - 1)
        texts.append(f"{s}: " + " → ".join(f"t={d} {_mib(v)}" for d, v in pts))
    for d in sorted({d for (st, d) in ok if st == "tp2-dp"}):  # Megatron's own curve: fixed world, t = 1, 2, d
        if ("ddp", d) in ok and ("tp", d) in ok and d > 2:
            vals = [ok[(st, d)]["peak_bytes"] for st in ("ddp", "tp2-dp", "tp")]
            verdicts.append(0 < vals.index(min(vals)) < 2)
            texts.append(f"{d} devices (t x dp): " + " → ".join(f"t={t} {_mib(v)}" for t, v in zip((1, 2, d), vals)))
    if not verdicts:
        return "not testable", "needs tensor parallelism at >= 2 degrees and the 1-device ddp cell"
    return ("reproduced" if any(verdicts) else "not reproduced"), "; ".join(texts) + " (U: lowest inside)"


def async_staleness(cells: Cells, model: str) -> tuple[str, str]:
    ok = _ok(cells, model)
    lower_better = MODELS[model].metric == "val_loss" if model in MODELS else True
    verdicts, texts = [], []
    for (s, d), c in sorted(ok.items()):
        if s not in ASYNC_PIPELINES or not c.get("val"):
            continue
        ref = next((ok[(r, d)] for r in (*SYNC_PIPELINES, "ddp") if (r, d) in ok and ok[(r, d)].get("val")), None)
        if ref is None:
            continue
        theirs = {v[0]: v[2] for v in ref["val"]}
        shared = [(v[2], theirs[v[0]]) for v in c["val"] if v[0] in theirs]
        if not shared:
            continue
        a, b = (sum(x) / len(shared) for x in zip(*shared))  # mean over the validation points: area per step
        gap = (a - b) / abs(b) if b else a - b
        worse = gap > STALENESS_MARGIN if lower_better else gap < -STALENESS_MARGIN
        verdicts.append(worse)
        texts.append(f"{d}d: mean over steps {', '.join(str(v[0]) for v in c['val'] if v[0] in theirs)} {s} {a:.4f} vs "
                     f"{ref['strategy']} {b:.4f} ({gap:+.1e} relative); final {c['val'][-1][2]:.4f} vs "
                     f"{ref['val'][-1][2]:.4f}")
    if not verdicts:
        return "not testable", "needs an asynchronous pipeline and a synchronous cell at the same device count"
    return ("reproduced" if all(verdicts) else "not reproduced"), "validation: " + "; ".join(texts)


def dp_scales_best(cells: Cells, model: str) -> tuple[str, str]:
    ok = _ok(cells, model)
    multi = [c for (s, d), c in ok.items() if d > 1 and c.get("seconds_per_1000_samples")]
    if not multi:
        return "not testable", "needs timed cells at > 1 device"
    top = max(c["devices"] for c in multi)
    at = sorted((c for c in multi if c["devices"] == top), key=lambda c: c["seconds_per_1000_samples"])
    if len(at) < 2:
        return "not testable", f"only one strategy timed at {top} devices"
    best = at[0]
    text = ", ".join(f"{c['strategy']} {c['seconds_per_1000_samples']:.2f} s" for c in at)
    return ("reproduced" if best["strategy"] in DATA_PARALLEL else "not reproduced"), \
        f"per 1,000 samples at {top} devices: {text}"


FINDINGS = (
    Finding("zero_memory", "ZeRO takes 42–66 % of DDP's memory",
            "every ZeRO cell's peak / DDP's peak at the largest device count lies in 42–66 %", "memory", zero_memory),
    Finding("pipeline_memory", "pipeline memory falls with more stages and plateaus",
            "per synchronous pipeline, the peak falls at every added stage count and the last relative drop is "
            "smaller than the first", "memory", pipeline_memory),
    Finding("tp_u_shape", "Megatron-style tensor parallelism has a U-shaped per-device memory curve",
            "the lowest peak of t = 1, 2, 4 is at an inner degree (tp over all devices with the one-process run as "
            "t = 1, or at a fixed device count: ddp, tp2-dp, tp)", "memory", tp_u_shape),
    Finding("async_staleness", "asynchronous pipelines lose statistical efficiency to weight staleness",
            "at every device count, the asynchronous pipeline's validation metric averaged over the validation "
            "steps (the area under its curve per step: statistical efficiency) is worse than the synchronous "
            "one's by more than 1e-4 (relative)", "validation", async_staleness),
    Finding("dp_scales_best", "data parallelism scales best when the model fits",
            "at the largest device count the fastest strategy per 1,000 samples is data-parallel "
            "(DDP or ZeRO)", "scaling", dp_scales_best),
)


def judge(cells: Cells) -> list[dict[str, Any]]:
    """One row per (finding, model): claim, rule, figure, verdict, evidence."""
    models = list(dict.fromkeys(c["model"] for c in cells))
    rows = []
    for f in FINDINGS:
        for m in models:
            verdict, evidence = f.judge(cells, m)
            rows.append({"key": f.key, "claim": f.claim, "rule": f.rule, "figure": f.figure, "model": m,
                         "verdict": verdict, "evidence": evidence})
    return rows

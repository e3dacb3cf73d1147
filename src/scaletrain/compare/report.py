"""report.html: one self-contained page (figures as base64 PNG, no external file or script).

Sections: the setup (machine, versions, load, dates, fixed hyperparameters, strategies), the
findings table, the peers beside their scaletrain twins, the figures, how each figure was measured
(and what was not), and every cell — failed, out-of-memory, not applicable and not installed ones with
their one-line reason.
"""

from __future__ import annotations

import base64
import html
from pathlib import Path
from typing import Any

from scaletrain.compare import figures as figs
from scaletrain.compare.findings import judge
from scaletrain.compare.matrix import STRATEGIES

Cells = list[dict[str, Any]]
STYLE = """body{font-family:sans-serif;max-width:1400px;margin:1em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;font-size:13px;margin:0.5em 0}td,th{border:1px solid #bbb;padding:3px 6px;
text-align:left;vertical-align:top}th{background:#eee}.reproduced{background:#d8f0d8}.not-reproduced{background:#f6dada}
.not-testable{background:#eee}.failed,.oom{background:#f6dada}.not-applicable,.not-installed{background:#f3f3f3}
img{max-width:100%}figcaption{font-size:13px;color:#444}code{background:#f4f4f4}"""
NOTES = [
    "Step time: the median over the timed steps of each run (after {warmup} warm-up steps, without the "
    "profiled step and the memory-tracked last step), then the median over the repeats; the bars span the "
    "25th–75th percentile of every timed step. Time per 1,000 samples = step time × 1000 / global batch.",
    "Speedup: the best one-device time per 1,000 samples of the model divided by the cell's.",
    "Validation seconds: training seconds up to that step (evaluation excluded; the two instrumented steps "
    "counted at the run's median step).",
    "Memory: <code>train.measure_memory=true</code> tracks the last step on every rank; the heaviest rank's "
    "peak is drawn, split into model states (parameters, gradients, optimizer states), activations (tensors "
    "saved for backward) and other (temporaries, communication buffers).",
    "Time breakdown: one step on rank 0 under torch.profiler (<code>train.profile_step</code>, "
    "<code>scaletrain.measure.phases</code>); the profiler's per-operator cost makes this step slower than "
    "the timed ones. Exposed communication = the main thread blocked in a collective or send/recv (in a "
    "pipeline this includes the bubble: waiting for a neighbour's activation or gradient). Not measured "
    "separately: DDP's wait for its last gradient bucket (inside the autograd engine, counted as backward); "
    "data loading overlapped with compute (the loader is synchronous here); FSDP2's (zero3) waits for its "
    "all-gathers happen in its hooks, and where the profiler does not name them as collectives they count "
    "as forward / backward (a zero3 forward far longer than DDP's on the same model is such waiting). Other "
    "ranks' phases are not measured. The asynchronous pipelines are not profiled (no phase bars): with the "
    "profiler on, vgg-mini's 2-stage PipeDream-2BW run corrupted the heap at exit in 2 of 3 tries, 0 of 3 "
    "without it.",
    "Predictions: peak bytes from <code>techniques.plan_cost.plan_costs</code> (every model); step time from "
    "<code>planner.cost.plan_cost</code> on this machine as measured by N processes at once "
    "(<code>planner.local.measure</code>), for GPT-2 shapes only (the planner prices transformers only).",
    "Peers (framework pytorch / deepspeed): <code>scaletrain.compare.peers</code> trains the same model object "
    "(same seed, same initial weights) on the same per-rank batches (scaletrain's loader), with the same AdamW, "
    "learning-rate schedule, gradient clipping, steps and validation batches; only the step is the framework's "
    "own (plain DDP, plain <code>fully_shard</code>, a DeepSpeed ZeRO-2/3 engine, fp32). Their memory is "
    "measured by the same tracker on the same last step (DeepSpeed's fp32 partitions, a second copy of the "
    "parameters it keeps even in fp32, count as parameters). Their "
    "prediction is that of the scaletrain strategy computing the same step (torch-ddp ~ ddp, deepspeed-zero2 ~ "
    "zero2, deepspeed-zero3 and torch-fsdp ~ zero3, torch-tp ~ tp).",
]


def _img(png: bytes) -> str:
    return f'<img alt="figure" src="data:image/png;base64,{base64.b64encode(png).decode()}">'


def _e(x: Any) -> str:
    return html.escape(str(x))


def _num(x: Any, scale: float = 1.0, fmt: str = "{:.1f}") -> str:
    return fmt.format(x * scale) if isinstance(x, (int, float)) else "—"


def _table(head: list[str], rows: list[list[str]], classes: list[str] | None = None) -> str:
    out = ["<table><tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>"]
    for i, r in enumerate(rows):
        cls = f' class="{classes[i]}"' if classes else ""
        out.append(f"<tr{cls}>" + "".join(f"<td>{v}</td>" for v in r) + "</tr>")
    return "\n".join(out + ["</table>"])


def _setup(study: dict[str, Any]) -> str:
    m, v = study.get("machine", {}), study.get("versions", {})
    mem = m.get("memory_bytes")
    start, end = study.get("start", {}), study.get("end", {})
    load = lambda s: ", ".join(f"{x:.2f}" for x in s.get("load") or []) or "—"  # noqa: E731
    rows = [["command", f"<code>{_e(study.get('command', ''))}</code>"],
            ["date (UTC)", f"{_e(start.get('date', '—'))} → {_e(end.get('date', '—'))} "
                           f"({_num(study.get('seconds'), 1, '{:.0f}')} s)"],
            ["machine", _e(f"{m.get('cpu', '?')}, {m.get('cores', '?')} cores, "
                           f"{mem / 2**30:.1f} GiB" if mem else m.get("cpu", "?")) + f"; {_e(m.get('os', ''))}"],
            ["versions", _e(", ".join(f"{k} {x}" for k, x in v.items()))],
            ["load average (1, 5, 15 min)", f"start {load(start)}; end {load(end)}"],
            ["repeats", f"{_e(study.get('repeats', '—'))} (interleaved, cell order rotated per repeat); "
                        f"{_e(study.get('warmup_steps', '—'))} warm-up steps excluded"]]
    hyper = [[_e(k), _e(s.get("global_batch")), _e(s.get("seq_len") or "—"), _e(s.get("steps")), _e(s.get("lr")),
              _e(s.get("warmup")), _e(s.get("microbatches")), _e(s.get("metric"))]
             for k, s in study.get("settings", {}).items()]
    strat = [[_e(k), _e(d)] for k, d in study.get("strategies", {}).items()]
    return ("<h2>Setup</h2>" + _table(["", ""], rows)
            + "<h3>Fixed hyperparameters (the same for every strategy and device count)</h3>"
            + _table(["model", "global batch [samples]", "sequence [tokens]", "steps", "lr (AdamW, cosine)",
                      "warm-up [steps]", "pipeline micro-batches", "validation metric"], hyper)
            + "<h3>Strategies</h3>" + _table(["strategy", "what"], strat))


def _cells(cells: Cells) -> str:
    rows, classes = [], []
    for c in cells:
        sp = c.get("step_time_spread_s") or [None, None]
        val = c.get("val") or []
        rows.append([_e(c["model"]), _e(c["strategy"]), _e(c["framework"]), _e(c["devices"]), _e(c["status"]),
                     f"{_num(c.get('step_time_s'), 1e3)} [{_num(sp[0], 1e3)}–{_num(sp[1], 1e3)}]",
                     _num(c.get("predicted_step_time_s"), 1e3), _num(c.get("seconds_per_1000_samples"), 1, "{:.2f}"),
                     _num(c.get("peak_bytes"), 2**-20), _num(c.get("predicted_peak_bytes"), 2**-20),
                     _num(val[-1][2], 1, "{:.4f}") if val else "—", _e(len(c.get("runs", []))),
                     _e(c.get("error") or (f"chosen plan: {c['plan']}" if c.get("plan") else "")
                        or c.get("predicted_note") or "")])
        classes.append(c["status"].replace(" ", "-"))
    return _table(["model", "strategy", "framework", "devices", "status", "step ms, median [p25–p75]",
                   "predicted step ms", "s / 1,000 samples", "peak MiB", "predicted peak MiB", "final validation",
                   "repeats", "error / reason / note"], rows, classes)


def _peers(cells: Cells) -> str:
    """Each peer that ran beside its scaletrain twin (``Strategy.like``; on one device the ddp cell, the
    one-process run) of the same model and device count: the ratios of step time and peak, and the largest
    relative difference of their validation values at the same steps — the same computation on the same
    samples, so anything beyond float rounding is a difference in what was computed. Empty without peers."""
    ok = {(c["model"], c["strategy"], c["devices"]): c for c in cells if c["status"] == "ok"}
    rows = []
    for c in cells:
        like = STRATEGIES[c["strategy"]].like if c["strategy"] in STRATEGIES else ""
        twin = ok.get((c["model"], like, c["devices"])) or (ok.get((c["model"], "ddp", 1)) if c["devices"] == 1
                                                            else None)
        if not like or c["status"] != "ok" or twin is None:
            continue
        pairs = [(a[2], b[2]) for a, b in zip(c.get("val") or [], twin.get("val") or []) if a[0] == b[0] and b[2]]
        diff = max((abs(a / b - 1) for a, b in pairs), default=None)
        ratio = lambda k: c[k] / twin[k] if c.get(k) and twin.get(k) else None  # noqa: E731
        rows.append([_e(c["model"]), _e(c["strategy"]), _e(c["devices"]), _e(twin["strategy"]),
                     _num(ratio("step_time_s"), 1, "{:.2f}"), _num(ratio("peak_bytes"), 1, "{:.2f}"),
                     _num(diff, 1, "{:.1e}"), _e(len(pairs))])
    if not rows:
        return ""
    return ("<h2>Peers beside scaletrain</h2><p>Each peer next to the scaletrain strategy computing the same step "
            "on the same samples. Validation values equal up to float rounding (~1e-7 relative in fp32) say the "
            "two trained the same model the same way; the ratios are then the cost of the implementation.</p>"
            + _table(["model", "peer", "devices", "scaletrain twin", "step time ratio (peer / twin)",
                      "peak ratio (peer / twin)", "max relative validation difference", "points compared"], rows))


def render(cells: Cells, study: dict[str, Any]) -> str:
    """The whole page as one HTML string."""
    found = judge(cells)
    f_rows = [[_e(f["claim"]), _e(f["model"]), f"<b>{_e(f['verdict'])}</b>", _e(f["evidence"]), _e(f["rule"]),
               f'<a href="#fig-{f["figure"]}">{_e(f["figure"])}</a>'] for f in found]
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>scaletrain compare</title>"
             f"<style>{STYLE}</style></head><body>",
             "<h1>scaletrain compare: strategies × devices × models</h1>",
             "<p>The comparative evaluation of Lin, Nichols, Singh and Bhatele, <i>How to Train Your Neural "
             "Network: A Comparative Evaluation</i>, re-made on this machine: every cell trains the same model on "
             "the same samples with the same hyperparameters; only the strategy and the device count differ. "
             "Every measured figure has the cost model's prediction beside it.</p>",
             _setup(study), "<h2>Findings of the survey, judged here</h2>",
             _table(["finding", "model", "verdict", "evidence", "rule", "figure"], f_rows,
                    [f["verdict"].replace(" ", "-") for f in found]),
             _peers(cells), "<h2>Figures</h2>"]
    for key, (caption, fn) in figs.FIGURES.items():
        parts.append(f'<figure id="fig-{key}">{_img(fn(cells))}<figcaption>{_e(key)}: {_e(caption)}'
                     f"</figcaption></figure>")
    parts += ["<h2>How it was measured</h2><ul>"
              + "".join(f"<li>{n.format(warmup=study.get('warmup_steps', 2))}</li>" for n in NOTES) + "</ul>",
              "<h2>Every cell</h2>", _cells(cells), "</body></html>"]
    return "\n".join(parts)


def write(cells: Cells, study: dict[str, Any], path: Path) -> Path:
    """Render the page into ``path``; returns it."""
    path.write_text(render(cells, study))
    return path

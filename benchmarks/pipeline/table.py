"""Markdown tables of the pipeline benchmark JSONs (for benchmarks/pipeline/README.md).

Run: ``python benchmarks/pipeline/table.py`` after measured.py, vs_torch.py and async_loss.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS  # noqa: E402


def _load(name: str) -> dict | None:
    p = RESULTS / name
    return json.loads(p.read_text()) if p.exists() else None


def measured(name: str = "pipeline_measured.json") -> str:
    d = _load(name)
    if d is None:
        return ""
    m = d["machine"]
    where = "every rank pinned to CPU " + d["cores"] if d.get("cores", "all") != "all" else f"{m['cpu_count']} CPUs"
    rows = [f"Measured vs simulated ({d['model']}, M={d['microbatches']}, micro-batch {d['micro_batch']}×{d['seq']}; "
            f"{where}, load average {m['load_average_1_5_15']}, torch {m['torch']}, {m['date']}):", "",
            "| P | schedule | step ms meas / sim (ratio) | ratio to replay | message delivery ms median / p90 (link) "
            "| bubble meas / sim | bubble per rank meas / sim | peak MiB per rank meas / sim "
            "| in 10%: step, bubble, memory |",
            "|---|---|---|---|---|---|---|---|---|"]
    for P, res in d["results"].items():
        for name, r in res.items():
            if name in ("link", "wall_s"):
                continue
            me, si, w = r["measured"], r["simulated"], r["within_10pct"]
            per = " ".join(f"{a:.2f}/{b:.2f}" for a, b in zip(me["bubble_per_rank"], si["bubble_per_rank"]))
            mem = " ".join(f"{a / 2**20:.1f}/{b / 2**20:.1f}" for a, b in
                           zip(me["peak_memory_bytes"], si["peak_memory_bytes"]))
            ok = (f"{'y' if w['step_time'] else 'n'}, {''.join('y' if x else 'n' for x in w['bubble_per_rank'])}, "
                  f"{''.join('y' if x else 'n' for x in w['peak_memory_per_rank'])}")
            dl = me.get("delivery") or {}
            deliv = (f"{dl['median_s'] * 1e3:.2f} / {dl['p90_s'] * 1e3:.2f} ({dl['link_model_s'] * 1e3:.2f})"
                     if dl else "-")
            rep = f"{r['replayed']['ratio_step_time']:.2f}" if "replayed" in r else "-"
            rows.append(f"| {P} | {name} | {me['step_time_s'] * 1e3:.0f} / {si['step_time_s'] * 1e3:.0f} "
                        f"({r['ratio_step_time']:.2f}) | {rep} | {deliv} "
                        f"| {me['bubble_fraction']:.3f} / {si['bubble_fraction']:.3f} "
                        f"| {per} | {mem} | {ok} |")
    return "\n".join(rows)


def vs_torch() -> str:
    d = _load("pipeline_vs_torch.json")
    if d is None:
        return ""
    m = d["machine"]
    rows = [f"Ours vs torch.distributed.pipelining ({d['model']}, M={d['microbatches']}; load average "
            f"{m['load_average_1_5_15']}, torch {m['torch']}, {m['date']}):", "",
            "| P | ours | PyTorch | ours ms | PyTorch ms | ratio ours/PyTorch | first loss ours / PyTorch |",
            "|---|---|---|---|---|---|---|"]
    for P, res in d["results"].items():
        for name, r in res.items():
            rows.append(f"| {P} | {name} | {r['torch_schedule']} | {r['ours_step_s'] * 1e3:.0f} | "
                        f"{r['torch_step_s'] * 1e3:.0f} | {r['ratio_ours_over_torch']:.2f} | "
                        f"{r['first_loss_ours']:.5f} / {r['first_loss_torch']:.5f} |")
    return "\n".join(rows)


def async_loss() -> str:
    d = _load("pipeline_async_loss.json")
    if d is None:
        return ""
    rows = [f"Asynchronous vs 1F1B on Shakespeare (P={d['ranks']}, {d['windows']} windows of M={d['microbatches']} × "
            f"{d['micro_batch']} × {d['seq']} tokens, {d['optimizer']}, lr {d['lr']}; {d['machine']['date']}):", "",
            "| schedule | updates | final train loss | val loss | val − 1F1B |", "|---|---|---|---|---|"]
    for name, r in d["results"].items():
        rows.append(f"| {name} | {r['updates_per_rank']} | {r['final_train_loss']:.4f} | {r['val_loss']:.4f} | "
                    f"{r['val_loss_minus_1f1b']:+.4f} |")
    return "\n".join(rows)


if __name__ == "__main__":
    tables = (measured(), measured("pipeline_measured_cores0.json"), vs_torch(), async_loss())
    print("\n\n".join(t for t in tables if t))

"""How fast the analytic planner searches its whole space (issue 25, "Fast"): GPT-3 175B on 1,024 A100s
(goal < 30 s) and a 405B Llama shape on 16,384 H100s with context parallelism in the space (goal < 60 s),
on this machine's CPU. Nothing runs on a GPU.

    PYTHONPATH=src python benchmarks/planner/search_speed.py [--repeats N]

Writes ``benchmarks/results/planner_search_speed.json``: machine, versions, date, the load average before
and after (the machine is shared), and per case every repeat's seconds, the plans priced, the rejected
regions, the dimensions the ranked plans span and the chosen plan. Times are the search alone
(:func:`scaletrain.planner.search.search`); building the shape (Llama's reads transformers' config
class, a few seconds the first time) is timed apart as ``shape_s``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from on_paper import write_result

from scaletrain import platform as platforms
from scaletrain.planner.search import search
from scaletrain.planner.shape import Shape

CASES = [
    # name, goal (s), shape maker, platform, nodes, GPUs per node, global batch, seq
    ("gpt3-175b on 1024 a100-80g", 30.0,
     lambda: Shape.of("gpt2-xl", n_layer=96, n_embd=12288, n_head=96, vocab_size=51200, n_positions=2048,
                      dropout=0.0), "a100-80g", 128, 8, 1536, 2048),
    ("llama-405b on 16384 h100 (cp searched)", 60.0,
     lambda: Shape.of("hf:llama", vocab_size=128256, hidden_size=16384, intermediate_size=53248,
                      num_hidden_layers=126, num_attention_heads=128, num_key_value_heads=8,
                      max_position_embeddings=8192), "h100", 2048, 8, 2048, 8192),
]


def run_case(case: tuple, repeats: int) -> dict:
    name, goal, make, plat_name, nodes, per_node, gb, seq = case
    t0 = time.perf_counter()
    shape = make()
    shape_s = time.perf_counter() - t0
    plat = platforms.get(plat_name)
    seconds, res = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        res = search(shape, plat, nodes=nodes, gpus_per_node=per_node, global_batch=gb, seq=seq)
        seconds.append(time.perf_counter() - t0)
    assert res is not None
    best = res.ranked[0] if res.ranked else None
    spans = {k: sorted({getattr(c.plan, k) for c in res.ranked}) for k in ("tp", "cp", "pp", "zero", "hsdp")}
    row = {"case": name, "goal_s": goal, "platform": plat_name, "devices": nodes * per_node, "global_batch": gb,
           "seq": seq, "params": shape.params(), "shape_s": shape_s, "seconds": seconds, "best_s": min(seconds),
           "within_goal": min(seconds) < goal, "plans_priced": res.evaluated, "plans_fit": len(res.ranked),
           "rejected_regions": len(res.rejected), "ranked_span": spans,
           "chosen": None if best is None else {
               "describe": best.plan.describe(), "plan": best.plan.to_dict(), "step_time_s": best.step_time_s,
               "mfu": best.mfu, "peak_bytes": best.peak_bytes["total"], "stage_layers": list(best.stage_layers)}}
    print(f"{name}: {min(seconds):.1f} s (goal {goal:.0f} s; runs {', '.join(f'{s:.1f}' for s in seconds)}), "
          f"{res.evaluated} plans priced, {len(res.ranked)} fit; chosen: "
          + (f"{best.plan.describe()}, step {best.step_time_s:.2f} s, MFU {best.mfu:.1%}" if best else "none"))
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2, help="searches per case (the best is reported)")
    args = ap.parse_args()
    load_before = os.getloadavg()
    rows = [run_case(c, args.repeats) for c in CASES]
    load_after = os.getloadavg()
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f} on {os.cpu_count()} CPUs")
    write_result("planner_search_speed", "planner search speed (issue 25: GPT-3 175B / 1,024 GPUs, Llama 405B / "
                 "16,384 GPUs with cp)", {"cpus": os.cpu_count(), "load_before": load_before, "load_after": load_after,
                                          "repeats": args.repeats, "rows": rows})
    return 0 if all(r["within_goal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

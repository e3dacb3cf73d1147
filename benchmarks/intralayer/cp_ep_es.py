"""Context, expert and embedding-table parallelism: measured traffic, memory and step time against
the cost faces, per degree, on CPU gloo. Output: benchmarks/results/intralayer_cp_ep_es.json.

- CP (ring attention): a GPT-2 at a sequence C times what one rank holds; ring bytes sent per
  rank vs ``cp_comm_bytes_per_step``, bytes saved for backward vs ``cp_activation_bytes`` (they
  fall as 1/C: every activation is token-wise, and attention keeps no s×s matrix).
- EP: ``gpt2-moe`` with capacity for every token; all-to-all bytes vs ``ep_comm_bytes_per_step``,
  parameters per rank vs ``ep_param_elements``.
- Embedding sharding: ``dlrm-mini``; table bytes per rank vs ``sharded_embedding_bytes_per_rank``,
  collective payloads vs ``sharded_embedding_comm`` (ids all-to-all bytes depend on the ids).

    .venv/bin/python benchmarks/intralayer/cp_ep_es.py
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

RESULTS = Path(__file__).resolve().parents[1] / "results"


def _timed(fn, steps: int) -> list[float]:
    import torch.distributed as dist

    out = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        out.append(time.perf_counter() - t0)
    return out


def _cp(rank: int, world: int, a: dict) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from scaletrain import models
    from scaletrain.measure.tracker import MemoryTracker
    from scaletrain.techniques import context_parallel as sp
    from scaletrain.measure.comm import CommCounter

    torch.manual_seed(0)
    m = models.get("gpt2-tiny", n_layer=a["n_layer"], n_embd=a["n_embd"], n_head=4, vocab_size=256,
                   n_positions=a["seq"])
    mesh = init_device_mesh("cpu", (world,))
    if world > 1:
        sp.apply_context_parallel(m, mesh)
    x = sp.shard_sequence(torch.randint(0, 256, (a["batch"], a["seq"])), rank, world)
    y = sp.shard_sequence(torch.randint(0, 256, (a["batch"], a["seq"])), rank, world)

    def step():
        F.cross_entropy(m(x).flatten(0, 1), y.flatten()).backward()
        sp.average_gradients(m, mesh.get_group())

    with CommCounter() as comm, MemoryTracker(model=m) as mem:
        loss = F.cross_entropy(m(x).flatten(0, 1), y.flatten())
        act = mem.current_breakdown["activations"]
        loss.backward()
    return {"ring_bytes": comm.wire_bytes(), "activations": act, "times": _timed(step, a["steps"])}


def _ep(rank: int, world: int, a: dict) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from scaletrain import models
    from scaletrain.techniques import experts
    from scaletrain.measure.comm import CommCounter

    torch.manual_seed(0)
    m = models.get("gpt2-moe", n_layer=a["n_layer"], n_embd=a["n_embd"], n_head=4, vocab_size=256,
                   n_positions=a["seq"], n_experts=a["experts"], top_k=2, capacity_factor=a["experts"] / 2, moe_every=1)
    if world > 1:
        experts.apply_expert_parallel(m, init_device_mesh("cpu", (world,)))
    x = torch.randint(0, 256, (a["batch"], a["seq"]))

    def step():
        (F.cross_entropy(m(x).flatten(0, 1), x.flatten()) + m.aux_loss()).backward()

    with CommCounter() as comm:
        step()
    return {"comm": comm.summary(), "numel": sum(p.numel() for p in m.parameters()), "times": _timed(step, a["steps"])}


def _es(rank: int, world: int, a: dict) -> dict:
    from scaletrain import models
    from scaletrain.techniques import embedding_sharding as es
    from scaletrain.measure.comm import CommCounter

    torch.manual_seed(0)
    m = es.apply_embedding_sharding(models.get("dlrm-mini"))
    c = m.config
    g = torch.Generator().manual_seed(rank)
    dense = torch.randn(a["batch"], c.n_dense, generator=g)
    sparse = torch.stack([torch.randint(0, n, (a["batch"], c.bag_size), generator=g) for n in c.table_sizes], 1)
    y = torch.randint(0, 2, (a["batch"],), generator=g).float()

    def step():
        F.binary_cross_entropy_with_logits(m(dense, sparse), y).backward()

    with CommCounter() as comm:
        step()
    return {"comm": comm.summary(), "shard_bytes": m.sharded_embeddings.weight.numel() * 4,
            "grad_nnz": m.sharded_embeddings.weight.grad._nnz(), "times": _timed(step, a["steps"])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--degrees", default="1,2,4")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", type=Path, default=RESULTS / "intralayer_cp_ep_es.json")
    args = p.parse_args(argv)
    from scaletrain import models
    from scaletrain.testing import run_distributed
    from scaletrain.techniques import embedding_sharding as es
    from scaletrain.techniques import experts
    from scaletrain.techniques import context_parallel as sp

    degrees = [int(d) for d in args.degrees.split(",")]
    rows: dict[str, list] = {"cp": [], "ep": [], "embedding_sharding": []}
    med = lambda res: statistics.median(max(r["times"][i] for r in res) for i in range(args.steps))  # noqa: E731
    a = dict(n_layer=2, n_embd=128, seq=512, batch=2, steps=args.steps)
    cfg = models.get("gpt2-tiny", device="meta", n_layer=2, n_embd=128, n_head=4, vocab_size=256,
                     n_positions=512).config
    for c in degrees:
        res = run_distributed(_cp, c, a, timeout_s=1800)
        rows["cp"].append({"cp": c, "seq_total": a["seq"], "seq_per_rank": a["seq"] // c, "step_time_s": med(res),
                           "ring_bytes_measured": res[0]["ring_bytes"],
                           "ring_bytes_predicted": sp.cp_comm_bytes_per_step(cfg, c, a["batch"], a["seq"])["total"],
                           "activations_measured": res[0]["activations"],
                           "activations_predicted": sp.cp_activation_bytes(cfg, c, a["batch"], a["seq"])})
        print("cp", rows["cp"][-1], flush=True)
    e = dict(n_layer=2, n_embd=128, seq=128, batch=4, experts=4, steps=args.steps)
    full = models.get("gpt2-moe", device="meta", n_layer=2, n_embd=128, n_head=4, vocab_size=256, n_positions=128,
                      n_experts=4, top_k=2, capacity_factor=2.0, moe_every=1)
    for d in degrees:
        res = run_distributed(_ep, d, e, timeout_s=1800)
        pred = experts.ep_comm_bytes_per_step(2, e["batch"] * e["seq"], 128, 4, 2, 2.0, d)
        rows["ep"].append({"ep": d, "step_time_s": med(res), "numel_measured": res[0]["numel"],
                           "numel_predicted": experts.ep_param_elements(full, d)["total"],
                           "wire_bytes_measured": sum(v["wire_bytes"] for v in res[0]["comm"].values()),
                           "wire_bytes_predicted": pred["wire_bytes"] if d > 1 else 0.0, "collectives": res[0]["comm"]})
        print("ep", {k: v for k, v in rows["ep"][-1].items() if k != "collectives"}, flush=True)
    dc = models.get("dlrm-mini", device="meta").config
    for d in degrees:
        res = run_distributed(_es, d, dict(batch=256, steps=args.steps), timeout_s=1800)
        pred = es.sharded_embedding_comm(256, len(dc.table_sizes), dc.bag_size, dc.embed_dim, d)
        rows["embedding_sharding"].append({
            "ranks": d, "step_time_s": med(res), "shard_bytes_measured": res[0]["shard_bytes"],
            "shard_bytes_predicted": es.sharded_embedding_bytes_per_rank(dc.table_sizes, dc.embed_dim, d)["parameters"],
            "grad_rows_sparse": res[0]["grad_nnz"], "collectives_measured": res[0]["comm"],
            "collectives_predicted": pred})
        print("es", {k: v for k, v in rows["embedding_sharding"][-1].items() if not k.startswith("coll")}, flush=True)
    doc = {"benchmark": "intralayer_cp_ep_es", "date": datetime.now(timezone.utc).isoformat(),
           "machine": {"platform": platform.platform(), "processor": platform.processor()},
           "torch": torch.__version__, "python": sys.version.split()[0], "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Context parallelism (ring attention) on paper: what ``parallel.cp = C`` adds to one layer's seconds.

Each CP rank holds S/C tokens of every sequence (the runtime's balanced causal layout,
:mod:`scaletrain.techniques.context_parallel`), so :func:`~.cost.layer_times` priced at S/C tokens is
the layer's matmuls and elementwise kernels; the attention core sees all S keys, i.e. C blocks of
(S/C)² scores instead of one: C − 1 more forward (and twice that backward). The ring moves K and V
(and dK, dV in the backward) around the C ranks — bytes from the CP cost face
(:func:`~scaletrain.techniques.context_parallel.cp_comm_bytes_per_step`, with the key/value width one
TP rank holds: kv_heads·d/t) — one hop per block, each hidden behind the block's attention compute by
the one overlap rule (:func:`scaletrain.cost.exposed_seconds`); the backward's last hop of dK, dV home
waits. The CP group sits right after TP in the mesh (tp innermost), so it is on NVLink while
tp·cp fits a node and on InfiniBand after. Seconds.
"""

from __future__ import annotations

from types import SimpleNamespace

from scaletrain.cost import collective_seconds, exposed_seconds
from scaletrain.planner.shape import Shape
from scaletrain.platform import Platform
from scaletrain.techniques.context_parallel import cp_comm_bytes_per_step


def ring_layer_times(lt: dict[str, float], shape: Shape, plat: Platform, *, seq: int, b: int, tp: int, cp: int,
                     elem: int) -> dict[str, float]:
    """``lt`` (one layer's seconds at seq/cp tokens) with ring attention's extra attention blocks in
    ``fwd``/``bwd``/``attn_core`` and its exposed communication as ``cp_fwd``/``cp_bwd`` (module docstring)."""
    out = dict(lt, cp_fwd=0.0, cp_bwd=0.0)
    if cp <= 1:
        return out
    block = lt["attn_core"]  # one (S/C)² block of scores and their weighted sum, forward
    out["attn_core"] = cp * block
    out["fwd"] = lt["fwd"] + (cp - 1) * block
    out["bwd"] = lt["bwd"] + 2 * (cp - 1) * block
    one = SimpleNamespace(n_embd=shape.kv_width / tp, n_layer=1)
    ring = cp_comm_bytes_per_step(one, cp, b, seq, act_bytes=elem)
    inter = tp * cp > plat.devices_per_node
    bw = (plat.inter_node_bytes_per_s * plat.inter_node_efficiency if inter
          else plat.intra_node_bytes_per_s * plat.intra_node_efficiency)
    alpha = plat.inter_node_latency_s if inter else plat.intra_node_latency_s
    hops = cp - 1
    fwd_hop = collective_seconds(ring["forward"] / hops, 1, bw, alpha)
    # the backward's C − 1 hops carry K, V, dK, dV; one more brings dK, dV home (2 fp32 blocks)
    home = 2 * b * (seq // cp) * one.n_embd * 4
    bwd_hop = collective_seconds((ring["backward"] - home) / hops, 1, bw, alpha)
    # C − 1 identical hops, each behind its block: one hop's exposure C − 1 times (the same sum, O(1))
    out["cp_fwd"] = hops * exposed_seconds([fwd_hop], [block])
    out["cp_bwd"] = hops * exposed_seconds([bwd_hop], [2 * block]) + exposed_seconds(
        [collective_seconds(home, 1, bw, alpha)], [0.0])
    return out

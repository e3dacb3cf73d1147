"""The cost graph of a Chain read from its per-block memory traces (``scaletrain.measure.blocks``).

``Graph.from_profile`` takes a Profile's fields as given. Two of them are defined there for a
whole-step memory count, not for the activation budget of :mod:`.simulate`, so when the traces
are at hand (the estimator returns them) this module recomputes them from the events:

- ``bwd_temp_bytes``: the Profile's is the backward's peak *above the gradients it produces*,
  parameter gradients included, which can hide activation temporaries entirely (a GPT-2 block:
  0 B in the Profile, 384 KiB of activation temporaries really). Here: the peak, over the
  backward's events, of everything except parameter gradients, above its start, minus the input
  gradient (counted by the simulator as δ). The output and its gradient are held by the
  executor until the backward returns, so their frees are ignored. A parameter's gradient
  counts when the parameter is also used by a *later* block (tied weights, e.g. GPT-2's
  embedding and head): that later block's backward ran first, so this one's gradient is a
  temporary added into ``.grad`` and freed.
- ``loss_bytes``: the exact peak of the loss's forward and backward (``traces[-1]``), with the
  gradient of the logits it produces.
- ``input_bytes``: the batch, i.e. the input *and* the loss's target (the caller holds both),
  and the loss value (a few bytes, kept to the end of the step).
"""

from __future__ import annotations

from scaletrain.measure.types import Profile
from scaletrain.techniques.remat.schedule import Graph, Node


def _peak(events, skip) -> int:
    cur = peak = 0
    for kind, pidx, d in events:
        if skip(kind, pidx, d):
            continue
        cur += d
        peak = max(peak, cur)
    return peak


def graph_from_traces(profile: Profile, traces: list) -> Graph:
    """Graph of the chain whose ``profile`` and block ``traces`` (last = the loss) are given."""
    blocks = traces[:-1]
    loss = traces[-1]
    if len(blocks) != len(profile.blocks):
        raise ValueError(f"{len(blocks)} block traces for a profile of {len(profile.blocks)} blocks")
    later: set[int] = set()  # id()s of parameters used by blocks after the current one
    tied: list[set[int]] = [set() for _ in blocks]
    for i in reversed(range(len(blocks))):
        tied[i] = {j for j, pid in enumerate(blocks[i].param_ids) if pid in later}
        later.update(blocks[i].param_ids)
    nodes = []
    for i, (bp, tr) in enumerate(zip(profile.blocks, blocks)):
        bwd = tr.events[tr.fwd_end:]
        peak = _peak(bwd, lambda k, p, d, t=tied[i]: (k == "pgrad" and p not in t) or (k in ("y", "g") and d < 0))
        gin = sum(d for k, _, d in bwd if k == "gin" and d > 0)
        nodes.append(Node(bp.name, float(bp.fwd_time_s), float(bp.bwd_time_s), int(bp.output_bytes),
                          int(bp.saved_bytes), int(bp.fwd_temp_bytes), max(0, peak - gin)))
    # + the loss's own output gradient (made by backward(loss), not in the trace's events)
    # (the executor holds the loss value through its backward, so its free is ignored)
    loss_peak = _peak(loss.events, lambda k, p, d: k == "pgrad" or (k == "y" and d < 0)) + int(loss.g_bytes)
    loss_time = float((profile.meta or {}).get("loss", {}).get("fwd_time_s", 0.0) or 0.0) + \
        float((profile.meta or {}).get("loss", {}).get("bwd_time_s", 0.0) or 0.0)
    if loss_time:
        last = nodes[-1]
        nodes[-1] = Node(last.name, last.fwd_time_s, last.bwd_time_s + loss_time, last.out_bytes,
                         last.saved_bytes, last.fwd_temp_bytes, last.bwd_temp_bytes)
    # the batch (input + target) and the loss value, which the caller keeps after the backward
    input_bytes = int(profile.blocks[0].input_bytes) + sum(int(b) for b in loss.aux_bytes) + int(loss.y_bytes)
    return Graph.chain(nodes, input_bytes, loss_bytes=loss_peak)


def estimate_graph(chain, example_input, *, target=None, loss_fn=None, precision: str = "fp32",
                   name: str = "") -> tuple[Graph, Profile]:
    """Estimate the chain on fake tensors (nothing allocated) and read its graph from the traces."""
    from scaletrain.measure.estimate import estimate_chain

    profile, traces = estimate_chain(chain, example_input, target=target, loss_fn=loss_fn, precision=precision,
                                     name=name, _return_traces=True)
    return graph_from_traces(profile, traces), profile

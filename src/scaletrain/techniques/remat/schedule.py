"""Rematerialization schedules: the operations, the graph they run on, and the result type.

Notation (survey "Survey on Large Scale Neural Network Training" §2, after Beaumont et al.
2019): a chain of blocks 0..n-1 maps the input ``a_-1`` to activations ``a_0 .. a_{n-1}``; the
loss is applied to ``a_{n-1}``. Indices here are **0-based** (block ``i`` of the Chain).

Operations (``Op.kind``):

- ``Fn`` — F_i^n: forward of block i without recording (no autograd tape); the output
  ``a_i`` is kept, the *plain* copy of the input ``a_{i-1}`` is forgotten afterwards.
- ``Fc`` — F_i^c: the same, but the input is kept (it is a checkpoint).
- ``Fe`` — F_i^e: forward of block i *recording* everything its backward needs (the "tape":
  ``a_i`` with its autograd graph and the tensors saved for backward); the input is kept.
  A plain copy of ``a_i``, if any, is dropped (the tape holds the same values).
- ``B``  — B_i: backward of block i. Needs the tape of i, the input ``a_{i-1}`` and the
  gradient ``δ_i`` of the output (for the last block, produced by the loss); produces
  ``δ_{i-1}``; frees the tape, ``δ_i`` and the plain copies of inputs no other backward needs.
- ``Dp`` — drop the plain copy of ``a_i``; ``Dt`` — drop the tape of block i but keep its output
  as a plain copy (the saved tensors are freed). Deletions cost no time; ``Dp`` is what the
  ILP and DTR use where a chain schedule writes ``Fn``; ``Dt`` is what DTR evicts.

Graphs: besides chains (``Graph.from_profile``), a :class:`Graph` may be any DAG whose nodes
are listed in topological order with their predecessors (skip connections); the last node
is the only sink and takes the loss. ``Fn`` then forgets the plain copies of *all* inputs.
The memory model (what is counted live during each operation) is in
:mod:`scaletrain.techniques.remat.simulate`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Iterable, Sequence

from scaletrain.errors import UserError
from scaletrain.measure.types import Profile

KINDS = ("Fn", "Fc", "Fe", "B", "Dp", "Dt")
FORWARD_KINDS = ("Fn", "Fc", "Fe")
GiB = 1024**3


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "k": 2**10, "m": 2**20, "g": 2**30}


def parse_bytes(value: "int | float | str | None") -> int | None:
    """A budget as bytes: an int, or a string like '1500000000', '1.5GiB', '512MiB', '2GB'.

    Binary units (KiB, MiB, GiB, TiB; K/M/G alone are binary too) and decimal ones (KB, MB,
    GB, TB). None or '' give None (no budget).
    """
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value < 0:
            raise UserError(f"budget must be ≥ 0 bytes, got {value}")
        return int(value)
    text = str(value).strip().replace(" ", "").replace("_", "")
    i = len(text)
    while i > 0 and text[i - 1].isalpha():
        i -= 1
    num, unit = text[:i], text[i:].lower()
    try:
        n = float(num)
    except ValueError:
        n = None
    if n is None or unit not in _UNITS or n < 0:
        raise UserError(f"cannot read budget {value!r}: give bytes (e.g. 1500000000) or a size like "
                        f"'1.5GiB', '512MiB', '2GB'")
    return int(n * _UNITS[unit])


def parse_bytes_list(value: str) -> list[int]:
    """Comma-separated sizes (``memory.remat.stage_budgets``: '900MiB,1.2GiB'), each as :func:`parse_bytes`
    reads it; '' gives []. An empty entry is a UserError (a stage without its budget)."""
    if not value.strip():
        return []
    out = []
    for k, part in enumerate(value.split(",")):
        n = parse_bytes(part)
        if n is None:
            raise UserError(f"entry {k} of {value!r} is empty: give one size per pipeline stage, comma-separated")
        out.append(n)
    return out


def fmt_bytes(n: float) -> str:
    """``n`` bytes as '123456789 B (0.115 GiB)', 3 significant digits for messages."""
    return f"{int(n)} B ({n / GiB:.3g} GiB)"


@dataclass(frozen=True)
class Op:
    """One operation of a schedule: ``kind`` in :data:`KINDS`, ``index`` the 0-based node."""

    kind: str
    index: int

    def __str__(self) -> str:
        if self.kind in FORWARD_KINDS:
            return f"F{self.index}^{self.kind[1]}"
        if self.kind == "B":
            return f"B{self.index}"
        return f"{self.kind}{self.index}"


def ops_from_str(text: str) -> list[Op]:
    """Parse ``"F0^c F1^n F2^e B2 Dp1 ..."`` (the output of ``str(op)``) back into ops."""
    out = []
    for tok in text.split():
        if tok.startswith("F") and "^" in tok:
            i, k = tok[1:].split("^")
            out.append(Op("F" + k, int(i)))
        elif tok.startswith("B"):
            out.append(Op("B", int(tok[1:])))
        elif tok[:2] in ("Dp", "Dt"):
            out.append(Op(tok[:2], int(tok[2:])))
        else:
            raise ValueError(f"bad op {tok!r}")
    return out


@dataclass(frozen=True)
class Node:
    """Costs of one node (block) for one micro-batch. Bytes and seconds.

    ``saved_bytes`` excludes the node's input(s), its parameters *and its output* (the output
    is always held as long as the tape is, and counted in ``out_bytes``).
    """

    name: str
    fwd_time_s: float
    bwd_time_s: float
    out_bytes: int
    saved_bytes: int = 0
    fwd_temp_bytes: int = 0
    bwd_temp_bytes: int = 0
    preds: tuple[int, ...] = ()
    """Indices of the nodes whose outputs this node reads; () means it reads the graph input."""

    @property
    def tape_bytes(self) -> int:
        """Bytes held by a tape: output + saved-for-backward tensors."""
        return self.out_bytes + self.saved_bytes


@dataclass(frozen=True)
class Graph:
    """A DAG of nodes in topological order; the last node is the sink (its output takes the loss).

    The graph input (``input_bytes``) is held by the caller for the whole step and gets no
    gradient (it is data); it is counted live in every operation.
    """

    nodes: tuple[Node, ...]
    input_bytes: int = 0
    loss_bytes: int = 0
    """Peak bytes of the loss's forward + backward above what is stored, the gradient of the
    sink's output it produces included: the sink's backward runs the loss first."""
    pending: tuple[tuple[int, int, int], ...] = ()
    """``(lo, hi, bytes)``: a parameter shared by nodes lo..hi (GPT-2's tied embedding) whose
    gradient the autograd engine holds from ``B_hi`` until ``B_lo`` sums the last part into
    ``.grad`` — in *one* backward (nested checkpoints, plain autograd). The op-by-op executor
    accumulates each block's part at once, so its graphs leave this empty."""

    def __post_init__(self) -> None:
        n = len(self.nodes)
        if n == 0:
            raise UserError("a rematerialization graph needs at least one node")
        has_succ = [False] * n
        for i, nd in enumerate(self.nodes):
            for p in nd.preds:
                if not 0 <= p < i:
                    raise UserError(f"node {i} ({nd.name}) reads node {p}: nodes must be in topological order")
                has_succ[p] = True
            for attr in ("out_bytes", "saved_bytes", "fwd_temp_bytes", "bwd_temp_bytes"):
                if getattr(nd, attr) < 0:
                    raise UserError(f"node {i} ({nd.name}) has negative {attr}")
            if nd.fwd_time_s < 0 or nd.bwd_time_s < 0:
                raise UserError(f"node {i} ({nd.name}) has a negative time")
        dangling = [i for i in range(n - 1) if not has_succ[i]]
        if dangling:
            raise UserError(f"nodes {dangling} feed nothing: only the last node may be a sink")
        succs: list[list[int]] = [[] for _ in range(n)]
        for i, nd in enumerate(self.nodes):
            for p in nd.preds:
                succs[p].append(i)
        object.__setattr__(self, "succs", tuple(tuple(s) for s in succs))

    def __len__(self) -> int:
        return len(self.nodes)

    @property
    def is_chain(self) -> bool:
        return all(nd.preds == ((i - 1,) if i else ()) for i, nd in enumerate(self.nodes))

    @classmethod
    def chain(cls, nodes: Iterable[Node], input_bytes: int = 0, loss_bytes: int = 0) -> "Graph":
        """A chain: node i reads node i-1 (node 0 reads the input); ``preds`` are overwritten."""
        nodes = [Node(**{**asdict(nd), "preds": (i - 1,) if i else ()}) for i, nd in enumerate(nodes)]
        return cls(tuple(nodes), input_bytes, loss_bytes)

    @classmethod
    def from_profile(cls, profile: Profile) -> "Graph":
        """The chain of a :class:`Profile` (one node per block).

        The loss (``profile.meta["loss"]``, a BlockProfile dict, when present) runs inside the
        last block's backward: its bytes go to ``loss_bytes`` and its times to that backward.
        ``saved_bytes`` is taken as given: where a profile counts an output that autograd saves
        in ``saved_bytes`` too, a tape is over-counted by that output (never under-counted).
        """
        if not len(profile):
            raise UserError("the profile has no blocks")
        nodes = [
            Node(b.name, float(b.fwd_time_s), float(b.bwd_time_s), int(b.output_bytes), int(b.saved_bytes),
                 int(b.fwd_temp_bytes), int(b.bwd_temp_bytes))
            for b in profile.blocks
        ]
        loss = (profile.meta or {}).get("loss") or {}
        # saved + the larger of the forward's temporaries and the backward's (δ of the logits
        # = the loss input's size, plus its temporaries): an upper bound of the loss's peak.
        loss_bytes = int(loss.get("saved_bytes", 0)) + max(
            int(loss.get("fwd_temp_bytes", 0)), int(loss.get("input_bytes", 0)) + int(loss.get("bwd_temp_bytes", 0)))
        loss_time = float(loss.get("fwd_time_s", 0.0)) + float(loss.get("bwd_time_s", 0.0))
        if loss_time:
            last = nodes[-1]
            nodes[-1] = Node(**{**asdict(last), "bwd_time_s": last.bwd_time_s + loss_time})
        return cls.chain(nodes, int(profile.blocks[0].input_bytes), loss_bytes)


def as_graph(obj: "Graph | Profile") -> Graph:
    """Accept a Graph or a Profile."""
    if isinstance(obj, Graph):
        return obj
    if isinstance(obj, Profile):
        return Graph.from_profile(obj)
    raise TypeError(f"expected a Graph or a Profile, got {type(obj).__name__}")


def require_chain(graph: Graph, method: str) -> None:
    if not graph.is_chain:
        raise UserError(f"method {method!r} works on chains only; this graph has skip connections (use 'ilp' or 'dtr')")


@dataclass
class Schedule:
    """A schedule and what it is predicted to cost (replayed by ``simulate``).

    ``predicted_peak_bytes`` and ``predicted_time_s`` are always the simulator's replay of
    ``ops`` over the graph the solver was given (every solver builds its Schedule through
    :func:`scaletrain.techniques.remat.simulate.make_schedule`).
    """

    method: str
    ops: list[Op]
    n_nodes: int
    budget_bytes: int | None
    predicted_peak_bytes: int
    predicted_time_s: float
    meta: dict = field(default_factory=dict)

    def __str__(self) -> str:
        return " ".join(str(o) for o in self.ops)

    @property
    def n_forwards(self) -> int:
        return sum(o.kind in FORWARD_KINDS for o in self.ops)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ops"] = str(self)
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, d: dict) -> "Schedule":
        d = dict(d)
        d["ops"] = ops_from_str(d["ops"]) if isinstance(d["ops"], str) else [Op(**o) for o in d["ops"]]
        return cls(**d)


def canonical_chain_ops(graph: Graph, ops: Sequence[Op]) -> list[Op]:
    """Rewrite ``Fc_i, Dp_{i-1}`` as ``Fn_i`` on chains (same costs, the survey's notation)."""
    out: list[Op] = []
    i = 0
    while i < len(ops):
        o = ops[i]
        nxt = ops[i + 1] if i + 1 < len(ops) else None
        if (o.kind == "Fc" and nxt is not None and nxt.kind == "Dp"
                and graph.nodes[o.index].preds == (nxt.index,)):
            out.append(Op("Fn", o.index))
            i += 2
            continue
        out.append(o)
        i += 1
    return out

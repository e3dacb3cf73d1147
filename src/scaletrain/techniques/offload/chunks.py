"""PatrickStar's chunk-based dynamic placement of model states (Fang et al., TPDS 2022; Tang et al.'s
memory survey §4.2): the state machine both faces drive, and the cost face.

**Layout** (:func:`pack_chunks`): the trainable parameters, in the order the Chain first uses them,
each optimizer group into its own chunks, are packed into chunks of one size ``S`` bytes (no
parameter split; the tail of a chunk is zero padding). Chunk ``c`` has four same-size chunk tensors: its parameters (P),
their gradients (G) and Adam's two moments (M, V); the id of kind k of chunk c is ``4c + k``.

**Moments** (:func:`moments`): one optimizer step is a fixed sequence of moments, and each moment
*needs* some chunk tensors on the device:

- forward of block i: the P chunks holding block i's parameters (the loss belongs to the last
  block's forward moment, and so does the loss's backward);
- backward of block i: those P chunks, and the G chunks of the parameters block i owns (their
  gradients are accumulated there) — also in the next backward moment, because autograd may run a
  parameter's gradient accumulation after the gradient of the block's input is ready;
- the optimizer step of chunk c: on the device, P, G, M and V of c (plus a transient of
  :data:`ADAM_TRANSIENT_CHUNKS` chunks) for the chunks whose Adam moments fit in PatrickStar's
  "margin space" (the device memory no moment needs for anything else; the moments stay pinned
  there: :meth:`ChunkPlacer.choose_device_updates`), else on the host (CPU Adam; the four leave the device).

**Placement** (:class:`ChunkPlacer`): a chunk tensor lives on the host always (the master copy)
and on the device as a cache. At each moment the missing needed chunks are fetched (host->device
copy, none for a gradient chunk that is all zeros) after evicting, while the chunks would not fit
the moment's chunk capacity, the resident chunk not needed now whose next use is farthest
(Belady's rule, over the known periodic sequence); evicting a chunk newer on the device (dirty)
copies it back first. The capacity of moment k is ``device_budget - non_model_k`` where
``non_model_k`` is the most device memory anything but chunks (activations, temporaries, the batch,
buffers, gradients not yet in a chunk) used in moment k: measured in the *warm-up* iteration
(PatrickStar's statistics) and, before the run, predicted by the probe (:func:`probe_non_model`).
The warm-up iteration itself keeps only the needed chunks (and updates on the host).

Cost face: :func:`replay` runs the same :class:`ChunkPlacer` over one step's moments without
tensors and returns the bytes moved per direction and kind, the predicted device peak and which
chunk updates run on the device — the runtime executes the very actions it yields, so the counted
bytes equal the predicted ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Sequence

from scaletrain.errors import UserError

KINDS = ("params", "grads", "optimizer", "optimizer")
"""Transfer kind (:mod:`.pools` counters) of chunk tensor kind 0..3: P, G, M, V."""
P, G, M, V = range(4)
ADAM_TRANSIENT_CHUNKS = 3
"""Temporaries of torch's Adam on one chunk, in chunks (sqrt of v, the denominator, Adam's L2 term)."""
CHUNK_ALIGN = 512
"""Chunk sizes are rounded up to this many bytes."""


@dataclass
class ChunkLayout:
    """Where each trainable parameter sits: chunk index and element offset (element size 4 bytes, fp32)."""

    chunk_numel: int
    chunks: list[list[int]]
    """Parameter indices in each chunk, in order."""
    offsets: dict[int, tuple[int, int]]
    """Parameter index -> (chunk, element offset)."""
    group_of: list[int]
    """Optimizer group of each chunk."""
    element_size: int = 4

    @property
    def chunk_bytes(self) -> int:
        return self.chunk_numel * self.element_size

    def __len__(self) -> int:
        return len(self.chunks)


def pack_chunks(param_numel: Sequence[int], groups: Sequence[int], chunk_bytes: int | None,
                element_size: int = 4) -> ChunkLayout:
    """Equal-size chunks over parameters in the given order (``groups[j]``: optimizer group, -1 for a frozen
    parameter, left out); each group fills its own chunks (one group per chunk, as its hyperparameters
    apply to the whole chunk), a new one when the next parameter does not fit.
    ``chunk_bytes`` None: searched between the largest parameter and twice it (in 1/32 steps, multiples
    of :data:`CHUNK_ALIGN`) for the fewest chunk bytes in all (PatrickStar's chunk size search). A
    parameter larger than the chunk is a UserError naming the smallest size."""
    largest = max((n for n, g in zip(param_numel, groups) if g >= 0), default=1) * element_size
    if chunk_bytes is None:  # PatrickStar's chunk size search: the least padded bytes, then the smallest size
        lo = -(-largest // CHUNK_ALIGN) * CHUNK_ALIGN
        step = max(CHUNK_ALIGN, lo // 32 // CHUNK_ALIGN * CHUNK_ALIGN)
        sizes = range(lo, 2 * lo + 1, step)
        return min((pack_chunks(param_numel, groups, b, element_size) for b in sizes),
                   key=lambda lay: (len(lay) * lay.chunk_bytes, lay.chunk_bytes))
    size = -(-int(chunk_bytes) // CHUNK_ALIGN) * CHUNK_ALIGN
    if size < largest:
        raise UserError(f"memory.offload.chunk_bytes={chunk_bytes} B is smaller than the largest parameter "
                        f"({largest} B); use at least {-(-largest // CHUNK_ALIGN) * CHUNK_ALIGN} or auto")
    numel = size // element_size
    chunks: list[list[int]] = []
    group_of: list[int] = []
    offsets: dict[int, tuple[int, int]] = {}
    open_chunk: dict[int, tuple[int, int]] = {}  # group -> (its chunk being filled, elements used)
    for j, (n, g) in enumerate(zip(param_numel, groups)):
        if g < 0:  # frozen: not a model state the chunks manage
            continue
        c, used = open_chunk.get(g, (-1, numel))
        if used + n > numel:
            chunks.append([])
            group_of.append(g)
            c, used = len(chunks) - 1, 0
        offsets[j] = (c, used)
        chunks[c].append(j)
        open_chunk[g] = (c, used + n)
    return ChunkLayout(numel, chunks, offsets, group_of, element_size)


@dataclass(frozen=True)
class Moment:
    """One interval of the step: what it needs on the device (chunk tensor ids) and what it is."""

    name: str
    needs: frozenset[int]
    step_chunk: int = -1
    """The chunk whose update this moment runs (-1: a forward or backward moment)."""


def moments(layout: ChunkLayout, block_params: Sequence[Sequence[int]], param_owner: Sequence[int],
            backward_blocks: Sequence[int], accum: int = 1) -> list[Moment]:
    """The moments of one optimizer step (module docstring), ``accum`` micro-batches then the updates."""
    def pchunks(i: int) -> set[int]:
        return {4 * layout.offsets[p][0] + P for p in block_params[i] if p in layout.offsets}

    def gchunks(i: int) -> set[int]:
        return {4 * layout.offsets[p][0] + G for p in block_params[i]
                if p in layout.offsets and param_owner[p] == i}

    n = len(block_params)
    micro = [Moment(f"forward {i}", frozenset(pchunks(i))) for i in range(n)]
    bwd = sorted(backward_blocks, reverse=True)
    for k, i in enumerate(bwd):
        prev = gchunks(bwd[k - 1]) if k > 0 else set()
        micro.append(Moment(f"backward {i}", frozenset(pchunks(i) | gchunks(i) | prev)))
    step = [Moment(f"update {c}", frozenset(4 * c + k for k in range(4)), c) for c in range(len(layout))]
    return micro * accum + step


@dataclass
class ChunkState:
    """Placement of every chunk tensor: on the device or not, newer there than on the host, all zeros."""

    on_device: list[bool]
    dirty: list[bool]
    zero: list[bool]

    @classmethod
    def initial(cls, n_chunks: int) -> "ChunkState":
        """Everything on the host; gradient chunks zero."""
        k = 4 * n_chunks
        return cls([False] * k, [False] * k, [i % 4 == G for i in range(k)])

    def copy(self) -> "ChunkState":
        return ChunkState(list(self.on_device), list(self.dirty), list(self.zero))


@dataclass
class Action:
    """One placement step: ``fetch`` (host->device, ``nbytes`` 0 when the chunk is zeros), ``evict``
    (device->host, ``nbytes`` 0 when the host copy is current) or ``drop`` (device copy discarded)."""

    op: str
    chunk: int
    nbytes: int


class ChunkPlacer:
    """Belady placement over a periodic moment sequence (module docstring). Drives both faces."""

    def __init__(self, seq: Sequence[Moment], chunk_bytes: int, state: ChunkState):
        self.seq = list(seq)
        self.S = chunk_bytes
        self.state = state
        L = len(self.seq)
        uses: dict[int, list[int]] = {}
        for k, m in enumerate(self.seq):
            for c in m.needs:
                uses.setdefault(c, []).append(k)
        self._uses = uses
        self._L = L
        self.device_chunks: set[int] = set()
        """Chunks updated on the device (their Adam moments pinned there); the others update on the host."""
        self.pinned: set[int] = set()

    def choose_device_updates(self, caps: Sequence[int | None]) -> None:
        """PatrickStar's margin: the device memory no forward/backward moment needs even with every
        parameter chunk resident (the budget less the largest non-model + needed + parameter chunk bytes
        of any moment) holds the Adam moments of as many chunks as fit, pinned there for the whole step;
        those chunks update on the device (their update moment also holds P, G and Adam's transient), the
        others on the host. Chosen: the chunks whose
        parameters are used last before the updates (likeliest still resident then)."""
        if any(c is None for c in caps):
            self.device_chunks = {m.step_chunk for m in self.seq if m.step_chunk >= 0}
            return
        S = self.S
        allp = {c for c in range(len(self.state.on_device)) if c % 4 == P}
        run = [(cap - len(m.needs | allp) * S) for cap, m in zip(caps, self.seq) if m.step_chunk < 0]
        upd = [cap - (2 + ADAM_TRANSIENT_CHUNKS) * S for cap, m in zip(caps, self.seq) if m.step_chunk >= 0]
        n = max(0, min(run + upd) // (2 * S)) if run + upd else 0
        first = min((k for k, m in enumerate(self.seq) if m.step_chunk >= 0), default=len(self.seq))
        last = {}
        for k in range(first):
            for c in self.seq[k].needs:
                if c % 4 == P:
                    last[c // 4] = k
        order = sorted({m.step_chunk for m in self.seq if m.step_chunk >= 0}, key=lambda c: (-last.get(c, -1), c))
        self.device_chunks = set(order[:n])
        self.pinned = {4 * c + kind for c in self.device_chunks for kind in (M, V)}

    def resident_bytes(self) -> int:
        return self.S * sum(self.state.on_device)

    def next_use(self, c: int, k: int) -> int:
        """Index of chunk ``c``'s next use after moment ``k`` (wrapping into the next step), or a large number."""
        us = self._uses.get(c)
        if not us:
            return 1 << 60
        for u in us:
            if u > k:
                return u
        return us[0] + self._L

    def _evict(self, c: int, out: list[Action]) -> None:
        st = self.state
        out.append(Action("evict", c, self.S if st.dirty[c] else 0))
        st.on_device[c] = False
        st.dirty[c] = False

    def place(self, k: int, capacity: int | None, device_step: bool = True) -> tuple[list[Action], bool]:
        """Actions making moment ``k``'s needs resident within ``capacity`` bytes of chunks (None: no limit),
        and for an update moment whether it runs on the device. Infeasible -> UserError."""
        m, st, out = self.seq[k], self.state, []
        need = sorted(m.needs)
        on_dev = m.step_chunk < 0
        if m.step_chunk >= 0 and device_step:  # on the device: the chunks whose moments live in the margin
            on_dev = capacity is None or m.step_chunk in self.device_chunks
            capacity = None if capacity is None else capacity - ADAM_TRANSIENT_CHUNKS * self.S
        if not on_dev:  # host update: the chunk's tensors leave the device (the update writes the host copies)
            for c in need:
                if st.on_device[c]:
                    self._evict(c, out)
            return out, False
        missing = [c for c in need if not st.on_device[c]]
        if capacity is not None:
            if len(need) * self.S > capacity:
                raise UserError(f"chunk placement: {m.name} needs {len(need)} chunks of {self.S} B but only "
                                f"{max(capacity, 0)} B of the device budget are left beside its other memory; "
                                f"raise memory.device_budget or lower memory.offload.chunk_bytes / train.micro_batch")
            while self.resident_bytes() + len(missing) * self.S > capacity:
                cands = [c for c, d in enumerate(st.on_device) if d and c not in m.needs and c not in self.pinned]
                victim = max(cands, key=lambda c: (self.next_use(c, k), c))
                self._evict(victim, out)
        for c in missing:
            out.append(Action("fetch", c, 0 if st.zero[c] else self.S))
            st.on_device[c] = True
            st.dirty[c] = False
        return out, True

    def after(self, k: int, on_device: bool) -> list[Action]:
        """State changes after moment ``k`` ran: gradients written, an update applied (device or host)."""
        m, st, out = self.seq[k], self.state, []
        if m.step_chunk < 0:
            for c in m.needs:
                if c % 4 == G:
                    st.dirty[c], st.zero[c] = True, False
            return out
        c0 = 4 * m.step_chunk
        if on_device:
            for c in (c0 + P, c0 + M, c0 + V):
                st.dirty[c] = True
            out.append(Action("drop", c0 + G, 0))
            st.on_device[c0 + G] = False
        st.dirty[c0 + G], st.zero[c0 + G] = False, True
        return out


def capacities(budget: int | None, non_model: Sequence[int]) -> list[int | None]:
    """Chunk bytes each moment may hold: the budget less the moment's non-model bytes."""
    return [None if budget is None else budget - n for n in non_model]


@dataclass
class Replay:
    """One step replayed: bytes per ``direction/kind``, predicted device peak, updates on the device."""

    bytes: dict[str, int] = field(default_factory=dict)
    device_peak_bytes: int = 0
    device_updates: int = 0
    host_updates: int = 0
    fetches: int = 0
    evictions: int = 0
    peak_parts: dict[str, int] = field(default_factory=dict)
    """At the peak: chunk bytes resident by kind (params, grads, optimizer) and the moment's non-model bytes."""

    def add(self, a: Action) -> None:
        if a.op == "drop" or not a.nbytes:
            return
        key = ("h2d/" if a.op == "fetch" else "d2h/") + KINDS[a.chunk % 4]
        self.bytes[key] = self.bytes.get(key, 0) + a.nbytes

    @property
    def h2d_bytes(self) -> int:
        return sum(v for k, v in self.bytes.items() if k.startswith("h2d/"))

    @property
    def d2h_bytes(self) -> int:
        return sum(v for k, v in self.bytes.items() if k.startswith("d2h/"))


class Walk:
    """One step's moments in order: :meth:`enter` the next (its placement actions, preceded by what the
    previous moment's end changed: a gradient chunk dropped after its update), :meth:`leave` the
    current one when it has run (gradients written, an update applied). After the last moment,
    :meth:`enter` returns (``len(seq)``, the remaining actions, False). Iterating enters each in turn."""

    def __init__(self, placer: ChunkPlacer, caps: Sequence[int | None], warmup: bool = False):
        self.placer, self.caps, self.warmup = placer, caps, warmup
        if not warmup:
            placer.choose_device_updates(caps)
        self.k = -1
        self.open = False
        self.on_dev = False
        self.pending: list[Action] = []

    @property
    def done(self) -> bool:
        return self.k >= len(self.placer.seq)

    def leave(self) -> None:
        if self.open:
            self.pending += self.placer.after(self.k, self.on_dev)
            self.open = False

    def enter(self) -> tuple[int, list[Action], bool]:
        self.leave()
        self.k += 1
        pending, self.pending = self.pending, []
        if self.done:
            return self.k, pending, False
        m = self.placer.seq[self.k]
        cap = len(m.needs) * self.placer.S if self.warmup else self.caps[self.k]
        acts, self.on_dev = self.placer.place(self.k, cap, device_step=not self.warmup)
        self.open = True
        return self.k, pending + acts, self.on_dev

    def __iter__(self) -> Iterator[tuple[int, list[Action], bool]]:
        while not self.done:
            yield self.enter()


def walk(placer: ChunkPlacer, caps: Sequence[int | None], warmup: bool = False) -> Walk:
    """The moments of one step from the placer's state (warm-up: only the needed chunks, host updates)."""
    return Walk(placer, caps, warmup)


def replay(seq: Sequence[Moment], chunk_bytes: int, state: ChunkState, non_model: Sequence[int],
           budget: int | None, warmup: bool = False) -> Replay:
    """The cost face: one step from ``state`` (copied), without tensors."""
    placer = ChunkPlacer(seq, chunk_bytes, state.copy())
    caps = capacities(budget, non_model)
    r = Replay()
    for k, acts, on_dev in walk(placer, caps, warmup):
        if k == len(seq):
            break
        for a in acts:
            r.add(a)
            r.fetches += a.op == "fetch"
            r.evictions += a.op == "evict"
        transient = ADAM_TRANSIENT_CHUNKS * chunk_bytes if seq[k].step_chunk >= 0 and on_dev else 0
        now = placer.resident_bytes() + non_model[k] + transient
        if now > r.device_peak_bytes:
            r.device_peak_bytes = now
            parts = {"params": 0, "grads": 0, "optimizer": 0}
            for c, d in enumerate(placer.state.on_device):
                parts[KINDS[c % 4]] += chunk_bytes * d
            r.peak_parts = {**parts, "activations_and_transients": non_model[k] + transient}
        if seq[k].step_chunk >= 0:
            r.device_updates += on_dev
            r.host_updates += not on_dev
    return r


def steady_replay(seq: Sequence[Moment], chunk_bytes: int, n_chunks: int, non_model: Sequence[int],
                  budget: int | None, steps: int = 3) -> tuple[Replay, ChunkState]:
    """A step once the placement has settled: the warm-up step, then ``steps - 1`` planned ones (the
    last is returned with the state it starts from)."""
    state = ChunkState.initial(n_chunks)
    placer = ChunkPlacer(seq, chunk_bytes, state)
    for _ in walk(placer, capacities(budget, non_model), warmup=True):
        pass
    for _ in range(steps - 2):
        for _ in walk(placer, capacities(budget, non_model)):
            pass
    return replay(seq, chunk_bytes, state, non_model, budget), state


def probe_non_model(costs, seq: Sequence[Moment], accum: int = 1) -> list[int]:
    """Non-model device bytes of each moment predicted from the probe (:mod:`.probe`): the planner's
    block-level replay (:func:`.planner.simulate_device`) with every parameter excluded; the loss folds
    into the last forward moment; an update moment holds the batch and buffers."""
    from scaletrain.techniques.offload.planner import SCALAR_SLACK_BYTES, simulate_device

    n = len(costs.blocks)
    static = costs.input_bytes + costs.target_bytes + costs.buffer_bytes
    sim = simulate_device(costs, ["keep"] * n, grads_on_device=False, static_bytes=static)
    params = costs.total_param_bytes
    fwd = [0] * n
    bwd: dict[int, int] = {}
    names = [b.name for b in costs.blocks]
    for where, v in sim["trace"]:
        v = v - params + SCALAR_SLACK_BYTES
        if where.startswith("forward "):
            fwd[names.index(where[len("forward "):])] = v
        elif where.startswith("loss"):
            fwd[n - 1] = max(fwd[n - 1], v)
        else:
            name = where[len("backward "):].removesuffix(" (recomputed)")
            bwd[names.index(name)] = v
    out = []
    for m in seq:
        kind, _, i = m.name.partition(" ")
        out.append(fwd[int(i)] if kind == "forward" else bwd.get(int(i), 0) if kind == "backward" else static)
    return out



def price(chain, example, target, loss_fn, *, budget: int | None, chunk_bytes: int | None, accum: int,
          platform=None, autocast=None) -> dict:
    """The plan-level cost face (``scaletrain estimate`` / :func:`scaletrain.techniques.plan_cost.plan_costs`):
    the probe's moments replayed until the placement settles (:func:`steady_replay`). Returns the device peak
    and its parts, bytes moved per step by direction, the updates run on the device and on the host, and,
    with a ``platform``, the seconds of copies and of the two kinds of update (bytes, seconds)."""
    from scaletrain.techniques.offload.planner import ADAM_DEVICE_BYTES_PER_PARAM
    from scaletrain.techniques.offload.probe import chain_params, probe_chain

    costs = probe_chain(chain, example, target, loss_fn, autocast)
    params = chain_params(chain)
    groups = [(0 if p.ndim >= 2 else 1) if p.requires_grad else -1 for p in params]  # the trainer's decay split
    layout = pack_chunks([p.numel() for p in params], groups, chunk_bytes)
    seq = moments(layout, [b.params for b in costs.blocks], costs.param_owner,
                  [i for i, b in enumerate(costs.blocks) if b.out_requires_grad], accum)
    non_model = probe_non_model(costs, seq, accum)
    warm = replay(seq, layout.chunk_bytes, ChunkState.initial(len(layout)), non_model, None, warmup=True)
    if budget is not None and warm.device_peak_bytes > budget:
        raise UserError(f"no chunk placement fits memory.device_budget={budget} B: the warm-up step, which keeps "
                        f"only the chunks in use, needs {warm.device_peak_bytes} B; raise memory.device_budget, "
                        f"lower memory.offload.chunk_bytes or train.micro_batch")
    r, _ = steady_replay(seq, layout.chunk_bytes, len(layout), non_model, budget)
    out = {"chunks": len(layout), "chunk_bytes": layout.chunk_bytes, "device_peak_bytes": r.device_peak_bytes,
           "peak_parts": dict(r.peak_parts), "h2d_bytes": r.h2d_bytes, "d2h_bytes": r.d2h_bytes,
           "bytes": dict(r.bytes), "device_updates": r.device_updates, "host_updates": r.host_updates,
           "host_bytes": 4 * layout.chunk_bytes * len(layout)}
    if platform is not None:
        n = layout.chunk_numel
        out["seconds"] = {"h2d": r.h2d_bytes / platform.h2d_bytes_per_s, "d2h": r.d2h_bytes / platform.d2h_bytes_per_s,
                          "cpu_update": r.host_updates * n / platform.cpu_adam_params_per_s,
                          "device_update": r.device_updates * n * ADAM_DEVICE_BYTES_PER_PARAM
                          / platform.device_mem_bytes_per_s}
    return out

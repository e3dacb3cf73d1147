"""What offloading needs to know about a Chain, found with fake tensors (no memory, no data).

:func:`probe_chain` runs each block forward and backward on fake tensors (``FakeTensorMode``;
the parameters replaced by fake tensors of the same shapes through
``torch.func.functional_call``) and records,
per block:

- the *storages* its forward saves for backward (``saved``; parameters, buffers and the step's
  input excluded) and their sizes — exactly what :class:`ActivationOffloader` moves, so the bytes
  predicted from the probe equal the bytes counted at run time;
- which parameters it uses (tied parameters appear in every block that uses them) — what weight
  streaming fetches;
- its output bytes, forward/backward FLOPs (``torch.utils.flop_counter``) and the transient bytes
  above what it keeps (``MemoryTracker`` on the fake tensors), for the device-peak and time predictions;
- the loss's saved and transient bytes (forward and backward).

Storage ids are renumbered 0.. in order of appearance so the result is plain data.
:meth:`ChainCosts.to_profile` gives the same facts as a :class:`Profile`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import weakref

import torch
from torch import nn
from torch.func import functional_call
from torch.utils.flop_counter import FlopCounterMode

from scaletrain.chain import Chain
from scaletrain.measure.tracker import MemoryTracker
from scaletrain.measure.types import BlockProfile, Profile


@dataclass
class BlockCost:
    """One block's offloading-relevant costs for one micro-batch (bytes, FLOPs, seconds)."""

    name: str
    params: list[int]
    """Indices (into ``ChainCosts.param_bytes``) of the parameters the block uses."""
    saved: list[int]
    """Storage ids saved for backward (not parameters, buffers or the step input)."""
    out_bytes: int
    out_storage: int
    in_storage: int
    """Storage id of the block's input (-1 for the step input)."""
    out_requires_grad: bool
    flops_fwd: float = 0.0
    flops_bwd: float = 0.0
    fwd_temp_bytes: int = 0
    """Peak during the forward minus what is live after it."""
    bwd_temp_bytes: int = 0
    """Peak during the backward minus what is live before it (includes the new gradients)."""
    fwd_time_s: float = 0.0
    bwd_time_s: float = 0.0


@dataclass
class ChainCosts:
    blocks: list[BlockCost]
    storage_bytes: dict[int, int]
    param_bytes: list[int]
    param_numel: list[int]
    param_owner: list[int]
    """First block using each parameter (where Chain.owned_params puts it)."""
    input_bytes: int
    target_bytes: int = 0
    loss_saved_bytes: int = 0
    """Bytes the loss saves for its backward (e.g. log-softmax output)."""
    loss_fwd_temp_bytes: int = 0
    """Peak of the loss forward minus what is live after it."""
    loss_bwd_temp_bytes: int = 0
    """Peak of the loss backward minus what is live before it (includes the logits' gradient)."""
    buffer_bytes: int = 0
    loss_time_s: float = 0.0
    """Loss forward + backward time, seconds (measured by the runtime; 0 when estimated)."""
    meta: dict = field(default_factory=dict)
    input_saved: bool = False
    """Whether block 0 saves the step input for backward (an embedding's token ids, a conv's images):
    a runtime that spills the step input with the activations moves these bytes too."""

    def __len__(self) -> int:
        return len(self.blocks)

    def saved_bytes(self, i: int) -> int:
        return sum(self.storage_bytes[s] for s in self.blocks[i].saved)

    def block_param_bytes(self, i: int) -> int:
        return sum(self.param_bytes[p] for p in self.blocks[i].params)

    @property
    def total_param_bytes(self) -> int:
        return sum(self.param_bytes)

    @property
    def total_params(self) -> int:
        return sum(self.param_numel)

    def set_times(self, fwd: list[float], bwd: list[float]) -> None:
        for b, f, g in zip(self.blocks, fwd, bwd):
            b.fwd_time_s, b.bwd_time_s = float(f), float(g)

    def estimate_times(self, flops_per_s: float, mem_bytes_per_s: float | None = None) -> None:
        """Roofline times (used when no measured Profile is given): the larger of FLOPs at
        ``flops_per_s`` and the bytes a block writes (output + saved; twice that backward) at
        ``mem_bytes_per_s``, so FLOP-less blocks (embeddings) are not free."""
        for b in self.blocks:
            touched = b.out_bytes + sum(self.storage_bytes[s] for s in b.saved)
            mem = touched / mem_bytes_per_s if mem_bytes_per_s else 0.0
            b.fwd_time_s = max(b.flops_fwd / flops_per_s, mem)
            b.bwd_time_s = max(b.flops_bwd / flops_per_s, 2 * mem)

    def to_profile(self, model: str = "", batch: int = 1) -> Profile:
        """The probe as a :class:`Profile` (``saved_bytes`` here *includes* a saved input)."""
        out = []
        for i, b in enumerate(self.blocks):
            out.append(BlockProfile(
                name=b.name, fwd_time_s=b.fwd_time_s, bwd_time_s=b.bwd_time_s,
                param_bytes=sum(self.param_bytes[p] for p in b.params if self.param_owner[p] == i),
                param_count=sum(self.param_numel[p] for p in b.params if self.param_owner[p] == i),
                input_bytes=self.input_bytes if i == 0 else self.blocks[i - 1].out_bytes,
                output_bytes=b.out_bytes, saved_bytes=self.saved_bytes(i), fwd_temp_bytes=b.fwd_temp_bytes,
                bwd_temp_bytes=b.bwd_temp_bytes, flops_fwd=b.flops_fwd, flops_bwd=b.flops_bwd))
        return Profile(out, model=model, batch=batch, measured=False, device="fake",
                       meta={"source": "scaletrain.techniques.offload.probe"})

    def apply_profile(self, profile: Profile) -> None:
        """Take measured times from a Profile of the same chain."""
        if len(profile) != len(self.blocks):
            raise ValueError(f"profile has {len(profile)} blocks, the chain {len(self.blocks)}")
        self.set_times([b.fwd_time_s for b in profile.blocks], [b.bwd_time_s for b in profile.blocks])


def runtime_costs(chain: Chain, example: tuple[torch.Tensor, torch.Tensor], loss_fn, autocast, platform,
                  costs: ChainCosts | None = None) -> ChainCosts:
    """What an offload runtime plans with: ``costs`` if given, else the probe of ``chain`` on ``example``
    with block times estimated from the platform's FLOP/s and memory bandwidth (measured ones replace
    them after the first micro-batch)."""
    if costs is not None:
        return costs
    out = probe_chain(chain, example[0], example[1], loss_fn, autocast)
    if platform is not None:
        out.estimate_times(platform.flops("fp32"), platform.device_mem_bytes_per_s)
    return out


def chain_params(chain: Chain) -> list[nn.Parameter]:
    """The Chain's parameters in the order its blocks first use them, each once (tied ones at their first
    user): the indexing of :attr:`ChainCosts.param_bytes` and of the offload runtimes."""
    out: list[nn.Parameter] = []
    seen: set[int] = set()
    for blk in chain.blocks:
        for p in blk.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def _fake_like(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor of ``t``'s shape/dtype on ``device``; fake when called under FakeTensorMode."""
    m = torch.empty(t.shape, dtype=t.dtype, device=device)
    if t.requires_grad:
        m.requires_grad_(True)
    return m


def probe_chain(chain: Chain, x: torch.Tensor, y: torch.Tensor | None = None,
                loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                autocast: Callable[[], object] | None = None) -> ChainCosts:
    """Probe ``chain`` for input ``x`` (and target ``y`` with ``loss_fn``) with fake tensors.

    Fake tensors (``FakeTensorMode``) on the parameters' device allocate nothing but dispatch
    like real ones, so the kernels chosen (e.g. the CPU flash attention, which saves a
    logsumexp where the math path would save the attention matrix) and therefore the tensors
    saved are those of the real run.
    """
    import contextlib

    from torch._subclasses.fake_tensor import FakeTensorMode

    ac = autocast or contextlib.nullcontext
    first = next(iter(chain.parameters()), None)
    device = first.device if first is not None else x.device
    if device.type == "meta":  # a model built on the meta device (the planner's): probe as the CPU dispatches
        device = torch.device("cpu")
    with FakeTensorMode():
        return _probe(chain, x, y, loss_fn, ac, device)


def _probe(chain, x, y, loss_fn, ac, device: torch.device) -> ChainCosts:
    params: list[nn.Parameter] = []
    pindex: dict[int, int] = {}
    for blk in chain.blocks:
        for p in blk.parameters():
            if id(p) not in pindex:
                pindex[id(p)] = len(params)
                params.append(p)
    meta_p = {id(p): _fake_like(p, device) for p in params}
    owner = [-1] * len(params)
    # Storage ids: a dead storage's address may be reused, so an entry counts only while its
    # storage lives (nothing is held here: storages die when autograd frees them, as in a real run).
    ids: dict[int, tuple[int, weakref.ref]] = {}
    sizes: dict[int, int] = {}

    def sid(t: torch.Tensor) -> int:
        st = t.untyped_storage()
        ent = ids.get(st._cdata)
        if ent is None or ent[1]() is not st:
            ent = (len(sizes), weakref.ref(st))
            ids[st._cdata] = ent
            sizes[ent[0]] = st.nbytes()
        return ent[0]

    xm = _fake_like(x, device)
    x_cdata, input_saved = xm.untyped_storage()._cdata, []
    skip = {xm.untyped_storage()._cdata} | {m.untyped_storage()._cdata for m in meta_p.values()}
    blocks: list[BlockCost] = []
    held: list[torch.Tensor] = []
    inp, in_sid = xm, -1
    buffer_bytes = 0
    tr = MemoryTracker(device=device, track_saved=False)
    with tr:
        for i, (name, blk) in enumerate(zip(chain.names, chain.blocks)):
            used = []
            pdict = {}
            for pname, p in blk.named_parameters(remove_duplicate=False):
                pdict[pname] = meta_p[id(p)]
                j = pindex[id(p)]
                if j not in used:
                    used.append(j)
                if owner[j] < 0:
                    owner[j] = i
            for bname, b in blk.named_buffers(remove_duplicate=False):
                mb = _fake_like(b, device)
                pdict[bname] = mb
                skip.add(mb.untyped_storage()._cdata)
                held.append(mb)  # a skipped storage must outlive the probe: its address is never reused
                buffer_bytes += b.untyped_storage().nbytes()
            saved: list[int] = []

            def pack(t: torch.Tensor, saved=saved):
                st = t.untyped_storage()
                if st._cdata == x_cdata:
                    input_saved.append(True)
                if st._cdata not in skip and st.nbytes() > 0:
                    s = sid(t)
                    if s not in saved:
                        saved.append(s)
                return t

            tr.reset_peak()
            with (torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
                  FlopCounterMode(display=False) as fc, ac()):
                out = functional_call(blk, pdict, (inp,))
            fwd_temp = tr.peak_bytes - tr.current_bytes
            bc = BlockCost(name, used, saved, out.untyped_storage().nbytes(), sid(out), in_sid,
                           bool(out.requires_grad), flops_fwd=float(fc.get_total_flops()), fwd_temp_bytes=int(fwd_temp))
            if out.requires_grad:
                g = torch.empty_like(out)
                live = tr.current_bytes
                tr.reset_peak()
                with FlopCounterMode(display=False) as fb:
                    torch.autograd.backward(out, g, inputs=[t for t in [inp, *pdict.values()] if t.requires_grad])
                bc.flops_bwd = float(fb.get_total_flops())
                bc.bwd_temp_bytes = int(tr.peak_bytes - live)
                del g
            blocks.append(bc)
            inp = out.detach().requires_grad_(out.requires_grad)
            del out  # free this block's graph now, not during the next block's measurement
            in_sid = bc.out_storage
        loss_saved = loss_fwd = loss_bwd = 0
        if loss_fn is not None and y is not None:
            ym = _fake_like(y, device)
            skip.add(ym.untyped_storage()._cdata)
            lsaved: dict[int, int] = {}

            def lpack(t: torch.Tensor):
                st = t.untyped_storage()
                if st._cdata not in skip and st._cdata != inp.untyped_storage()._cdata:
                    lsaved[st._cdata] = st.nbytes()
                return t

            tr.reset_peak()
            with torch.autograd.graph.saved_tensors_hooks(lpack, lambda t: t), ac():
                loss = loss_fn(inp, ym)
            loss_saved = sum(lsaved.values())
            loss_fwd = int(tr.peak_bytes - tr.current_bytes)
            live = tr.current_bytes
            tr.reset_peak()
            if loss.requires_grad:
                (loss * 1.0).backward()  # as the runtime does: (loss * weight).backward()
            loss_bwd = int(tr.peak_bytes - live) + loss.numel() * loss.element_size()  # + the loss itself
    return ChainCosts(blocks, sizes, [p.numel() * p.element_size() for p in params], [p.numel() for p in params],
                      owner, x.numel() * x.element_size(), y.numel() * y.element_size() if y is not None else 0,
                      loss_saved, loss_fwd, loss_bwd, buffer_bytes, input_saved=bool(input_saved))

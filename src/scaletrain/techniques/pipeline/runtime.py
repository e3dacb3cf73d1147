"""Pipeline runtime: executes a schedule's per-rank action lists with ``torch.distributed``.

The apply face of :mod:`.schedules` / :mod:`.simulate`: the same lists the simulator times are
executed here, in order, on each rank (gloo on CPU, NCCL on GPU):

* ``F`` / ``B`` run a stage replica's forward / backward (:mod:`.stage`); ``I`` / ``W`` split the
  backward for ``zb1p`` (input gradient now, weight-gradient GEMMs deferred);
* ``SEND_*`` post ``isend``, ``RECV_*`` post ``irecv`` and wait (:mod:`.p2p`, every wait bounded
  by ``timeout_s`` and reported in one line naming the rank, the op and the peer); a sent
  tensor is dropped right after the receive that proves its delivery
  (:func:`.actions.send_releases`), so a rank never holds the step's (or stream's) sends;
* ``GRAD_SYNC`` (Chimera) all-reduces one stage's gradients between its two replicas;
* ``OPT`` — at the first of a window on a rank: finish the gradients (sum over ranks holding a
  shared parameter — GPT-2's tied ``wte`` on the first and last stage, as Megatron all-reduces
  its embedding group — then average over data-parallel replicas), then call ``update``.

Gradient accumulation: each micro-batch's loss is weighted 1/M (1/update_every for the
asynchronous schedules), so after a synchronous step ``.grad`` holds the gradient of the mean
loss over the global batch, as in one-process training.

Layout (pp × dp = the world): the processes form a 2-D mesh with pp outermost, as in Megatron
and torchtitan: pipeline rank r of data-parallel replica d is ``ranks[r * dp + d]`` (``ranks``
defaults to 0..world-1; another order of the world may be given). Under tensor parallelism
(``tp``, :mod:`.tensor_parallel`) the world is dp × pp × tp and each TP index runs its own
pp × dp pipeline over ``tp.layouts[t]`` on its shards of the stages.
Every replica runs the same schedule on its own micro-batches; gradients of a stage are
all-reduced across its dp replicas at ``OPT``.

Asynchronous schedules (``pipedream``, ``pipedream-2bw``) run as one stream without flushes
over :meth:`PipelineRuntime.train`'s ``n_steps`` windows (or window by window,
:meth:`PipelineRuntime.stream`, as the trainer runs them), with weight stashing (each
micro-batch's backward uses the weights its forward used) — a documented approximation of
one-process training, not an equivalent.

Dropout and other randomness draw from each rank's generator in pipeline order, so with
dropout > 0 the runtime is not bitwise equal to one process (fp32 parity holds with dropout 0).
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, ContextManager, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from scaletrain.chain import Chain, to_chain
from scaletrain.errors import UserError

from . import p2p
from .actions import overtaken, send_releases
from .checks import rendezvous_safe, validate
from .grads import ParamPlan
from .partition import equal_bounds
from .schedules import ASYNC_SCHEDULES, GRAD_SYNC, OPT, RECV_B, RECV_F, SEND_B, SEND_F, Action, Schedule, build
from .simulate import Event
from .stage import Replica, TensorSpec, boundary_specs, check_bounds, stage_remat
from .tensor_parallel import TPLayout

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Batch = tuple[torch.Tensor, torch.Tensor]


class _Feed:
    """Micro-batches pulled in order from the caller's iterator, each kept until this rank's
    last use (the first stage reads x, the last stage y; Chimera's ranks hold both ends)."""

    def __init__(self, it: Iterator[Batch] | None, uses: dict[int, int], device: torch.device):
        self.it, self.uses, self.device = it, dict(uses), device
        self.cache: dict[int, Batch] = {}
        self.fetched = 0

    def get(self, m: int) -> Batch:
        while self.fetched <= m:
            if self.it is None:
                raise UserError("this pipeline rank holds the first or last stage and needs micro-batches; "
                                "pass an iterator of (input, target) micro-batches")
            try:
                x, y = next(self.it)
            except StopIteration:
                raise UserError(f"the micro-batch iterator ran out after {self.fetched} micro-batches") from None
            self.cache[self.fetched] = (x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True))
            self.fetched += 1
        return self.cache[m]

    def used(self, m: int) -> None:
        self.uses[m] -= 1
        if self.uses[m] == 0:
            self.cache.pop(m, None)

    def finish(self, total: int) -> None:
        """Pull up to ``total`` micro-batches, so every data-reading rank's iterator advances alike."""
        while self.it is not None and self.fetched < total:
            next(self.it, None)
            self.fetched += 1
        self.cache.clear()


class PipelineRuntime:
    """Runs pipeline schedule ``schedule`` over ``chain`` on a pp × dp mesh of processes.

    Every process passes the *whole* model's chain (built identically; replicated parameters are
    broadcast at construction so copies start equal) and the same arguments. ``example_input``
    is one micro-batch's input (meta allowed: only shape and dtype are read); ``loss_fn(out,
    target)`` runs on the last stage. ``bounds`` are the S + 1 block boundaries of the S = pp ×
    virtual stages (default: an equal split; :func:`.partition.partition` gives a balanced one).
    ``p2p_mode``: "eager" (isend lists, gloo tags), "rendezvous" (lists reordered by
    :func:`.checks.rendezvous_safe`, needed by NCCL), or "auto" (by backend).
    ``forward_context``: a context-manager factory entered around every stage forward and the
    loss (e.g. the trainer's ``autocast``); boundary activations are cast back to the model's
    dtype (the fake-tensor/meta pass's) before they are sent, so both sides agree on sizes.
    ``record_events``: keep per-pass timings in :attr:`events` (and align the ranks' clocks
    with a barrier at each step's start).
    ``remat``: a rematerialization method (:data:`scaletrain.techniques.remat.METHODS`) run
    inside every stage, one schedule per stage (:func:`.stage.stage_remat`, planned on the
    fake-tensor estimate at ``remat_precision`` with ``example_target``, under ``remat_budget``
    per micro-batch and stage, or a list of one budget per stage); not with split backward (zb1p) or
    weight stashing.
    ``remat_plans``: the stages' schedules, planned by the caller (before tensor parallelism shards the
    chain: the estimate runs on the whole model).
    ``tp``: tensor parallelism inside the stages (:class:`.tensor_parallel.TPLayout`; the chain
    already sharded, ``ranks`` this TP index's order); ``specs`` then gives the boundary specs
    (computed on the model before sharding); ``backward_context`` is entered around the last
    stage's backward (``loss_parallel`` for the vocabulary-parallel loss).
    """

    def __init__(self, chain: Chain | nn.Module, schedule: str, microbatches: int, *, pp: int, dp: int = 1,
                 virtual: int = 1, bounds: Sequence[int] | None = None, loss_fn: LossFn,
                 example_input: torch.Tensor, device: torch.device | str | None = None,
                 ranks: Sequence[int] | None = None, timeout_s: float = 300.0, p2p_mode: str = "auto",
                 record_events: bool = True, forward_context: Callable[[], ContextManager] | None = None,
                 remat: str = "none", remat_budget: int | str | list[int] | None = None,
                 remat_precision: str = "fp32",
                 example_target: torch.Tensor | None = None, tp: TPLayout | None = None,
                 specs: Sequence[TensorSpec] | None = None,
                 backward_context: Callable[[], ContextManager] | None = None,
                 remat_plans: Sequence[object] | None = None,
                 loss_scale: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 stage_aux: Callable[[nn.Module], torch.Tensor | None] | None = None, ep: int = 1):
        if not dist.is_initialized():
            raise UserError("the pipeline runtime needs torch.distributed initialised (run under torchrun)")
        self.chain = to_chain(chain)
        self.name, self.M, self.pp, self.dp, self.virtual = schedule, int(microbatches), int(pp), int(dp), int(virtual)
        self.loss_fn = loss_fn
        self.forward_context = forward_context or contextlib.nullcontext
        self.loss_scale = loss_scale
        """fp16: multiplies the last stage's weighted loss by the loss scale before its backward."""
        self.stage_aux = stage_aux
        """A stage's own loss term of its last forward (``model.aux_loss(part)``: a mixture of
        experts' load-balancing loss), or None: read after every stage forward, weighted like the
        task loss, logged with it and backpropagated with the stage's output gradient."""
        self._aux: dict[tuple[int, int, int], torch.Tensor] = {}
        self.backward_context = backward_context or contextlib.nullcontext
        self.timeout_s = float(timeout_s)
        self.record_events = record_events
        self.asynchronous = schedule in ASYNC_SCHEDULES
        world = dist.get_world_size()
        self.tp = tp
        T = tp.tp if tp is not None else 1
        world_ranks = list(ranks) if ranks is not None else (tp.ranks if tp is not None else list(range(world)))
        if world != self.pp * self.dp * T:
            raise UserError(f"pipeline layout parallel.pp={pp} × parallel.dp={dp} × parallel.tp={T} needs "
                            f"{pp * dp * T} processes; this job has {world}")
        every = [list(L) for L in tp.layouts] if tp is not None else [world_ranks]
        if (sorted(r for L in every for r in L) != list(range(world)) or any(len(L) != pp * dp for L in every)
                or world_ranks not in every):
            raise UserError(f"pipeline ranks must order all {world} processes; got {every}")
        self.global_rank = dist.get_rank()
        self.ranks = world_ranks
        idx = world_ranks.index(self.global_rank)
        self.pp_rank, self.dp_rank = divmod(idx, self.dp)
        param0 = next(self.chain.parameters(), None)
        self.device = torch.device(device) if device is not None else (param0.device if param0 is not None
                                                                        else torch.device("cpu"))
        backend = dist.get_backend()
        if p2p_mode == "auto":
            p2p_mode = "rendezvous" if backend == "nccl" else "eager"
        if p2p_mode not in ("eager", "rendezvous"):
            raise UserError(f"p2p_mode must be auto, eager or rendezvous (got {p2p_mode!r})")
        self.p2p_mode = p2p_mode
        self._schedules: dict[int, Schedule] = {}
        self._releases: dict[int, dict[int, list[int]]] = {}  # per schedule: recv index -> sends it releases
        sched = self.schedule_for(1 if not self.asynchronous else 3)  # validates P, M, v
        self.n_stages = sched.n_stages
        self.bounds = check_bounds(list(bounds) if bounds is not None else equal_bounds(len(self.chain), self.n_stages),
                                   len(self.chain), self.n_stages)
        self.specs: list[TensorSpec] = (list(specs) if specs is not None else
                                        boundary_specs(self.chain.blocks, self.bounds, example_input, self.device))
        self.transport = p2p.Transport(self.global_rank, self.timeout_s, self.device, use_tags=p2p_mode == "eager",
                                       label=f"pipeline {schedule} (pipeline rank {self.pp_rank}, dp {self.dp_rank}"
                                             + (f", tp {tp.tp_rank})" if tp is not None else ")"))
        self.replicas: dict[tuple[int, int], Replica] = {}
        for pipe, s in sched.local_stages(self.pp_rank):
            mod = nn.Sequential(*self.chain.blocks[self.bounds[s]:self.bounds[s + 1]])
            self.replicas[(pipe, s)] = Replica(pipe, s, mod, s == 0, s == self.n_stages - 1,
                                               defer_weight_grads=sched.split_backward, stash_weights=self.asynchronous)
        self.remat_schedules: dict[int, object] = {}
        """Stage → its rematerialization schedule (``remat`` given), run as nested checkpoints."""
        if remat != "none" or remat_plans is not None:
            if sched.split_backward or self.asynchronous:
                raise UserError(f"rematerialization inside the stages runs with the synchronous, unsplit schedules; "
                                f"not with {schedule}")
            from scaletrain.techniques.remat.tree import CheckpointedBlocks, tree_of

            plans = list(remat_plans) if remat_plans is not None else stage_remat(
                self.chain, self.bounds, example_input, remat, remat_budget, target=example_target, loss_fn=loss_fn,
                precision=remat_precision)
            for (pipe, s), rep in self.replicas.items():
                self.remat_schedules[s] = plans[s]
                # nested checkpoints (not the op-by-op executor): they compose with TP and ZeRO inside stages
                rep.remat = CheckpointedBlocks(list(rep.module), tree_of(plans[s]))
        self.plan = ParamPlan(self.chain.blocks, self.bounds, sched, self.ranks, self.pp_rank, self.dp_rank,
                              self.dp, self.transport, self.timeout_s, tp=tp, ep=ep)
        self.plan.broadcast_replicated()
        blocks = {id(b): b for rep in self.replicas.values() for b in rep.module}
        self.module = nn.ModuleList(blocks.values())
        """The local blocks (shared with the chain): build the optimizer over this module."""
        self.events: list[Event] = []
        """Measured compute events of the last :meth:`train` call: (pipeline rank, kind, micro-batch,
        start_s, end_s, stage, pipe), seconds from the call's start (after a barrier)."""
        self.comm_events: list[Event] = []
        """Measured time in receives (kinds RECV_F, RECV_B: posting and waiting) and in posting sends
        (SEND_F, SEND_B), same format."""

    # ------------------------------------------------------------------ set-up
    def schedule_for(self, n_steps: int) -> Schedule:
        """The (validated) action lists for ``n_steps`` windows (synchronous schedules: one)."""
        key = n_steps if self.asynchronous else 1
        if key not in self._schedules:
            s = build(self.name, self.pp, self.M, self.virtual, steps=key)
            if self.p2p_mode == "rendezvous":
                s = rendezvous_safe(s)
            validate(s, p2p="rendezvous" if self.p2p_mode == "rendezvous" else "eager")
            self._schedules[key] = s
            self._releases[key] = send_releases(s)[self.pp_rank]
        return self._schedules[key]

    def _global(self, pp_rank: int) -> int:
        return self.plan.global_rank(pp_rank)

    # ------------------------------------------------------------------ public API
    def parameters(self) -> list[nn.Parameter]:
        """This rank's parameters (each once), for the optimizer."""
        return list(self.plan.params)

    @property
    def needs_data(self) -> bool:
        """True on ranks holding a first or last stage (they read micro-batches)."""
        return any(rep.first or rep.last for rep in self.replicas.values())

    def train_step(self, microbatches: Iterable[Batch] | None, update: Callable[[], None] | None = None) -> float:
        """One synchronous step over M micro-batches; returns the mean loss (on every rank).

        ``microbatches`` yields (input, target) micro-batches (used on ranks with a first or last
        stage; others may pass None). At the step's end the gradients of the global batch's mean
        loss are in ``.grad`` (shared parameters summed, data-parallel replicas averaged);
        ``update`` (optimizer step + zero_grad, e.g. with :meth:`clip_grad_norm_` first) is called
        then, or the caller steps after this returns when ``update`` is None.
        """
        if self.asynchronous:
            return self.train(1, microbatches, update)[0]
        return self._run(self.schedule_for(1), microbatches, update)[0]

    def train(self, n_steps: int, microbatches: Iterable[Batch] | None,
              update: Callable[[], None] | None) -> list[float]:
        """``n_steps`` optimizer windows; returns the mean loss of each. Synchronous schedules
        flush after every window; asynchronous ones run one stream (warm-up and drain only at
        the ends), calling ``update`` after every micro-batch (pipedream) or M (2BW)."""
        if n_steps < 1:
            raise UserError(f"n_steps must be >= 1 (got {n_steps})")
        if not self.asynchronous:
            it = iter(microbatches) if microbatches is not None else None
            return [self._run(self.schedule_for(1), it, update)[0] for _ in range(n_steps)]
        if update is None:
            raise UserError(f"asynchronous schedule {self.name} updates weights inside the stream; pass update")
        return self._run(self.schedule_for(n_steps), microbatches, update)

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip the global gradient norm (all stages, shared parameters counted once) to
        ``max_norm``; returns the norm before clipping. Collective over the pipeline replica:
        call it inside ``update``."""
        return self.plan.clip_(max_norm)

    def sync_full_model(self) -> None:
        """Broadcast every parameter and buffer from its first holder to all ranks of this
        pipeline replica, so each process's model is the whole, current model (evaluation or a
        checkpoint in the single-process layout). Collective over the replica."""
        self.plan.sync_full_model()

    def close(self) -> None:
        """Wait for outstanding sends and drop in-flight tensors (a stream left paused mid-way, e.g.
        by an error, is dropped without waiting: its peers may never receive what it sent)."""
        if getattr(self, "_streaming", False):
            self.transport.forget()
            self._streaming = False
        else:
            self.transport.drain()
        for rep in self.replicas.values():
            for d in (rep.inputs, rep.outputs, rep.grad_out, rep.grad_in, rep.wqueue):
                d.clear()

    # ------------------------------------------------------------------ execution
    def _now(self) -> float:
        if self.record_events and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - self._t0

    def _record(self, kind: str, a: Action, start: float, comm: bool = False) -> None:
        if self.record_events:
            (self.comm_events if comm else self.events).append(
                Event(self.pp_rank, kind, a.mb, start, self._now(), a.stage, a.pipe))

    def _run(self, sched: Schedule, microbatches: Iterable[Batch] | Iterator[Batch] | None,
             update: Callable[[], None] | None) -> list[float]:
        return next(self._execute(sched, microbatches, update, pause=False))

    def stream(self, n_steps: int, microbatches: Iterable[Batch] | None,
               update: Callable[[], None]) -> Iterator[float]:
        """An asynchronous schedule's stream of ``n_steps`` windows, one window per ``next()``.

        Each ``next()`` runs this rank's list up to (and with) its update closing the next window
        and returns that window's mean loss (all-reduced over the mesh: every process of the job
        must advance the stream in step). Between two calls the stream is paused, micro-batches
        of later windows possibly in flight — a consistent cut: every message a rank's prefix
        receives is sent in its peer's prefix, so collectives (loss all-reduce, evaluation,
        checkpoint gathering) may run between calls. The last window drains the stream. This is
        how the trainer runs ``pipedream`` / ``pipedream-2bw`` without flushing at its steps.
        """
        if not self.asynchronous:
            raise UserError(f"stream() runs the asynchronous schedules; {self.name} is synchronous (use train_step)")
        if n_steps < 1:
            raise UserError(f"n_steps must be >= 1 (got {n_steps})")
        return self._execute(self.schedule_for(n_steps), microbatches, update, pause=True)

    def _execute(self, sched: Schedule, microbatches: Iterable[Batch] | Iterator[Batch] | None,
                 update: Callable[[], None] | None, pause: bool) -> Iterator:
        """Run this rank's list. ``pause=False``: yield once, the list of every window's mean loss.
        ``pause=True`` (asynchronous): yield each window's mean loss after the update closing it."""
        acts = sched.actions[self.pp_rank]
        S, total = self.n_stages, sched.total_microbatches
        every = sched.update_every or self.M
        self._weight = 1.0 / every
        uses: dict[int, int] = {}
        for a in acts:
            if a.kind == "F" and (a.stage == 0 or a.stage == S - 1):
                uses[a.mb] = uses.get(a.mb, 0) + 1
        it = iter(microbatches) if microbatches is not None else None
        if sched.asynchronous:  # stash weights only for micro-batches that an update overtakes
            for rep in self.replicas.values():
                rep.stash_mbs = overtaken(acts, rep.pipe, rep.stage)
        releases = self._releases[sched.n_steps if sched.asynchronous else 1]
        # the first update of a window's last micro-batch closes the window (summarise's rule)
        closes: dict[int, int] = {}
        for i, a in enumerate(acts):
            if a.kind == OPT and (a.mb + 1) % self.M == 0 and a.mb // self.M not in closes.values():
                closes[i] = a.mb // self.M
        feed = _Feed(it if uses else None, uses, self.device)
        self._losses = torch.zeros(sched.n_steps, dtype=torch.float64, device=self.device)  # NCCL: on device
        self._opt_mb = -1
        self._local_fwd: dict[tuple[int, int, int], torch.Tensor] = {}
        self._local_bwd: dict[tuple[int, int, int], torch.Tensor] = {}
        self.events, self.comm_events = [], []
        mesh = self.plan.mesh_ranks
        if self.record_events and len(mesh) > 1:  # a common time origin for the timeline
            self.transport.barrier(self.plan.group(mesh), "barrier at the start of a pipeline step")
        self._t0 = time.perf_counter()
        self._streaming = pause
        for i, a in enumerate(acts):
            self._do(a, sched, feed, update, i)
            if i in releases:  # sends the peer has surely received: drop their tensors now
                self.transport.release(releases[i])
            if pause and closes.get(i, sched.n_steps - 1) < sched.n_steps - 1:
                yield self._window_losses(closes[i], mesh)[0]
        self.transport.drain()
        self._streaming = False
        feed.finish(total)
        yield self._window_losses(sched.n_steps - 1, mesh)[0] if pause else self._window_losses(None, mesh)

    def _window_losses(self, k: int | None, mesh: list[int]) -> list[float]:
        """Mean loss of window ``k`` (None: of every window), all-reduced over the mesh."""
        losses = self._losses.clone() if k is None else self._losses[k:k + 1].clone()
        if len(mesh) > 1:
            self.transport.all_reduce(losses, self.plan.group(mesh), "loss all-reduce")
        return (losses / (self.M * self.dp)).cpu().tolist()

    def _do(self, a: Action, sched: Schedule, feed: _Feed, update: Callable[[], None] | None, index: int) -> None:
        k = a.kind
        S = self.n_stages
        if k == RECV_F or k == RECV_B:
            rep = self.replicas[(a.pipe, a.stage)]
            t0 = self._now()
            if k == RECV_F:
                spec = self.specs[a.stage]
                x = self.transport.recv(spec.shape, spec.dtype, self._global(a.peer),
                                        p2p.tag(0, a.pipe, a.stage, a.mb, S), f"RECV_F of micro-batch {a.mb} "
                                        f"(activation into stage {a.stage})")
                rep.inputs[a.mb] = x.requires_grad_()
            else:
                spec = self.specs[a.stage + 1]
                rep.grad_out[a.mb] = self.transport.recv(spec.shape, spec.dtype, self._global(a.peer),
                                                         p2p.tag(1, a.pipe, a.stage, a.mb, S),
                                                         f"RECV_B of micro-batch {a.mb} "
                                                         f"(gradient into stage {a.stage})")
            self._record(k, a, t0, comm=True)
        elif k == SEND_F:
            rep = self.replicas[(a.pipe, a.stage)]
            t0 = self._now()
            self.transport.send(rep.outputs[a.mb], self._global(a.peer), p2p.tag(0, a.pipe, a.stage + 1, a.mb, S),
                                f"SEND_F of micro-batch {a.mb} (activation of stage {a.stage})", key=index)
            self._record(k, a, t0, comm=True)
        elif k == SEND_B:
            rep = self.replicas[(a.pipe, a.stage)]
            t0 = self._now()
            self.transport.send(rep.grad_in.pop(a.mb), self._global(a.peer), p2p.tag(1, a.pipe, a.stage - 1, a.mb, S),
                                f"SEND_B of micro-batch {a.mb} (gradient of stage {a.stage}'s input)", key=index)
            self._record(k, a, t0, comm=True)
        elif k == "F":
            self._forward(a, feed)
        elif k in ("B", "I"):
            self._backward(a)
        elif k == "W":
            t0 = self._now()
            self.replicas[(a.pipe, a.stage)].weight_grads(a.mb)
            self._record(k, a, t0)
        elif k == GRAD_SYNC:
            t0 = self._now()
            self.plan.grad_sync(a.stage, a.peer)
            self._record(k, a, t0)
        elif k == OPT:
            if a.mb == self._opt_mb:
                return  # one update per rank and window, at its first OPT
            self._opt_mb = a.mb
            t0 = self._now()
            self.plan.reduce()
            if update is not None:
                update()
            for rep in self.replicas.values():
                rep.bump_version()
            self._record(k, a, t0)
        else:  # pragma: no cover - schedules only emit the kinds above
            raise UserError(f"unknown pipeline action {a}")

    def _forward(self, a: Action, feed: _Feed) -> None:
        rep = self.replicas[(a.pipe, a.stage)]
        t0 = self._now()
        if rep.first:
            x = feed.get(a.mb)[0]
        elif (a.pipe, a.stage, a.mb) in self._local_fwd:  # previous stage on this rank (P = 1)
            x = self._local_fwd.pop((a.pipe, a.stage, a.mb)).requires_grad_()
        else:
            x = rep.inputs[a.mb]
        rep.inputs[a.mb] = x
        with self.forward_context():
            out = rep.forward(x, a.mb)
            if rep.last:
                y = feed.get(a.mb)[1]
                loss = self.loss_fn(out, y)
        aux = self.stage_aux(rep.module) if self.stage_aux is not None else None
        if aux is not None:  # this stage's term of the micro-batch's loss (Megatron adds MoE aux losses per stage)
            self._losses[a.mb // self.M] += aux.detach().double()
            aux = aux * self._weight
            if not rep.last:
                self._aux[(a.pipe, a.stage, a.mb)] = self.loss_scale(aux) if self.loss_scale is not None else aux
        if rep.last:
            self._losses[a.mb // self.M] += loss.detach().double()
            out = loss * self._weight if aux is None else loss * self._weight + aux
            if self.loss_scale is not None:
                out = self.loss_scale(out)
            feed.used(a.mb)
        else:  # activations cross stages in the model's dtype (autocast may have made them 16-bit)
            out = out.to(self.specs[a.stage + 1].dtype)
        if rep.first and not rep.last:
            feed.used(a.mb)
        rep.outputs[a.mb] = out
        if not rep.last and self.replicas.get((a.pipe, a.stage + 1)) is not None:
            self._local_fwd[(a.pipe, a.stage + 1, a.mb)] = out.detach()
        self._record("F", a, t0)

    def _backward(self, a: Action) -> None:
        rep = self.replicas[(a.pipe, a.stage)]
        t0 = self._now()
        out = rep.outputs.pop(a.mb)
        if rep.last:
            grad = None
        elif (a.pipe, a.stage, a.mb) in self._local_bwd:
            grad = self._local_bwd.pop((a.pipe, a.stage, a.mb))
        else:
            grad = rep.grad_out.pop(a.mb)
        with self.backward_context() if rep.last else contextlib.nullcontext():
            rep.backward(a.mb, out, grad, self._aux.pop((a.pipe, a.stage, a.mb), None))
        x = rep.inputs.pop(a.mb)
        if not rep.first:
            gx = x.grad if x.grad is not None else torch.zeros_like(x)
            if (a.pipe, a.stage - 1) in self.replicas:
                self._local_bwd[(a.pipe, a.stage - 1, a.mb)] = gx
            else:
                rep.grad_in[a.mb] = gx
        self._record(a.kind, a, t0)


def split_microbatches(x: torch.Tensor, y: torch.Tensor, m: int) -> list[Batch]:
    """Split a batch into ``m`` equal micro-batches along dim 0 (UserError when it does not divide)."""
    if x.shape[0] % m:
        raise UserError(f"a batch of {x.shape[0]} samples does not split into {m} equal micro-batches; use a "
                        f"batch that is a multiple of parallel.microbatches={m}")
    return list(zip(x.chunk(m), y.chunk(m)))

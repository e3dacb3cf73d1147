"""The pipeline as a trainer strategy: ``parallel.pp > 1`` runs the training loop through
:class:`~.runtime.PipelineRuntime`.

Layout. ``world = pp × dp`` processes (pp outermost, :mod:`.runtime`); every process holds the
whole model (built from the same seed) but computes and updates only its stage(s). The
``dp`` replicas of the pipeline read data shards ``data_rank`` of ``data_world = dp``; every
stage of one replica opens the same shard (only the first stage reads inputs, the last targets).

One optimizer step = one schedule step over ``trainer.accum`` (= ``parallel.microbatches``)
micro-batches of ``trainer.micro_batch`` samples, each loss weighted 1/M, so ``.grad`` holds the
gradient of the global batch's mean loss (tied parameters summed across stages, replicas
averaged); then the trainer clips (the *global* norm: squared norms all-reduced over the
stages, tied parameters counted once) and steps this rank's optimizer, built over this rank's
blocks only. The logged loss is the runtime's mean over all micro-batches and replicas, the same
on every rank, so it equals one process's loss on the same global batch (fp32, dropout 0).

Evaluation runs the stages forward only, micro-batch by micro-batch, and broadcasts the last
stage's (loss sum, correct, samples) to the whole pipeline.

Checkpoints are in the single-process layout: ``model_state_dict`` first broadcasts every
stage's current parameters to all ranks of the replica; ``optimizer_state_dict`` gathers every
stage's optimizer state and renumbers it as the one-process optimizer (``build(model)``) would.
So a pipeline checkpoint resumes at any ``parallel.pp`` (or on one process), and a one-process
checkpoint loads into a pipeline. Optimizer states must be per-parameter (every optimizer of
:mod:`scaletrain.techniques.optim`); a consolidated checkpoint's ZeRO-sharded (per-rank) states are refused
with one line. ZeRO-1 / ZeRO-3 inside the stages gather their shards of every state into this layout.

Data parallelism inside the stages: ``parallel.zero=1`` shards the optimizer states over the replicas
(Megatron's distributed optimizer, :meth:`PipelineStrategy._shard_optimizer_states`); ``parallel.zero=3``
shards parameters, gradients and states with FSDP2, each stage gathered once per step and
reduce-scattered at the update (torchtitan's PP + FSDP, :mod:`.fsdp`).

Asynchronous schedules (``pipedream``, ``pipedream-2bw``) run as *one* stream over the run's
remaining steps (:meth:`.runtime.PipelineRuntime.stream`): a trainer step is one window of M
micro-batches, the stream pauses after each rank's update closing it (logging, evaluation and
checkpoints run at that consistent cut) and resumes at the next step, with no flush in between.
The stream calls the update — the trainer's clipping and optimizer step — after every
micro-batch (pipedream) or window (2BW); the learning-rate schedule steps once per window. Their
losses differ from one process's by design (weight stashing: a micro-batch's backward uses the
weights its forward used, older than the latest). A checkpoint holds the live weights and
optimizer state; micro-batches in flight at the cut are not in it, so a resumed run restarts the
stream (warm-up) from the checkpoint.

Tensor parallelism inside the stages (``parallel.tp`` > 1, :mod:`.tensor_parallel`): world =
dp × pp × tp, every stage's blocks Megatron-sharded over its TP group, the vocabulary-parallel
loss on the last stage; checkpoints stay in the single-process layout (shards gathered, the fused
QKV rows un-permuted; sharded back on load); fp32 and bf16, every schedule. With
``parallel.sequence_parallel`` the stage boundaries carry each TP rank's s/tp positions (1/tp of
the point-to-point bytes); not with zb1p. Refused with TP: context and expert parallelism,
rematerialization, model dropout > 0 (per-rank masks would split a TP group's replicated
activations).

Supported: every schedule, fp32, bf16 and fp16 (synchronous schedules);
``memory.remat.method`` / ``memory.remat.budget`` run a rematerialization schedule inside every
stage (:func:`.stage.stage_remat`; the budget is per stage and micro-batch) with the unsplit
synchronous schedules. Refused with a one-line :class:`~scaletrain.errors.ConfigError` naming
the key (the compatibility table, :mod:`scaletrain.techniques.compat`): ZeRO-2, ZeRO-3 with Chimera on tied parameters,
the asynchronous schedules, gradient compression, context parallelism, expert parallelism beyond
zero=0 or 1 with the synchronous schedules, rematerialization with zb1p or the asynchronous
schedules, offloading inside the stages.

A mixture of experts: each stage adds its own MoE layers' load-balancing loss (``model.aux_loss(part)``)
to its backward, per micro-batch, weighted like the task loss — Megatron's per-stage auxiliary loss — so
the run equals one process with ``train.micro_batch`` = the pipeline's micro-batch. ``parallel.ep``
slices the experts over blocks of ``ep`` data-parallel replicas inside every stage (:mod:`.experts`).
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from scaletrain.errors import ConfigError, UserError
from scaletrain.measure.comm import LEDGER
from scaletrain.techniques.runtime import Strategy

from .apply import default_virtual, example_input, pipeline_runtime
from .runtime import PipelineRuntime

from .simulate import simulate
from .stage import remat_budgets
from .state import PipelineState
from .tensor_parallel import tp_comm_counter


def _forward_context(ctx: Any, model: nn.Module, plan: Any) -> Callable[[], contextlib.AbstractContextManager]:
    """What every stage forward runs under: autocast, and 8-bit storage of the tensors it saves for
    backward (``memory.activation_compression``: the packed tensors live in the graph until backward)."""
    if not plan.activation_compression:
        return ctx.autocast

    @contextlib.contextmanager
    def both():
        from scaletrain.techniques.act_compress import compress_activations

        with ctx.autocast(), compress_activations(model):
            yield

    return both


def _loss_scale(ctx: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """fp16: the trainer's loss scaler (made after the runtime; read at each micro-batch)."""
    def scale(t: torch.Tensor) -> torch.Tensor:
        sc = ctx.scaler
        return sc.scale(t) if sc is not None and sc.is_enabled() else t
    return scale


def _stage_aux(model: nn.Module) -> Callable[[nn.Module], torch.Tensor | None] | None:
    """A mixture of experts' load-balancing loss per stage: ``model.aux_loss(part)`` of the stage's
    blocks (each stage adds its own layers' term to its backward; :class:`.runtime.PipelineRuntime`)."""
    aux = getattr(model, "aux_loss", None)
    if not callable(aux):
        return None
    import inspect

    if not inspect.signature(aux).parameters:
        raise ConfigError(f"parallel.pp on {type(model).__name__}: its aux_loss() covers the whole model; a "
                          f"pipeline needs aux_loss(part) giving one stage's share (as GPT2MoE.aux_loss); allowed: "
                          f"parallel.pp=1")
    return aux


class PipelineStrategy(PipelineState, Strategy):
    """The trainer's hooks over a :class:`PipelineRuntime` (see the module docstring)."""

    name = "pipeline"

    def __init__(self, model: nn.Module, runtime: PipelineRuntime, rank: int, world: int) -> None:
        super().__init__(model, rank, world)
        self.runtime = runtime
        self.data_rank, self.data_world = runtime.dp_rank, runtime.dp
        sched = runtime.schedule_for(1)
        self.sched = sched
        self.bubble_predicted = simulate(sched).bubble_fraction
        """Bubble fraction of the schedule under equal stage costs (the simulator's)."""
        self._sent_before = 0
        self._p2p_bytes = 0
        self._stream: Iterator[float] | None = None
        """The asynchronous schedules' stream over the run (created at the first step)."""
        self._last_norm = float("nan")
        self._tp_bytes = 0.0
        self._tp_predicted = float("nan")
        self._scaled = False
        self._precision = "fp32"
        """train.precision (the all-to-alls' 16-bit half under autocast)."""
        self.zero: Any = None
        """ZeRO-1 inside the stages (:meth:`_shard_optimizer_states`), or None."""
        self._proxy_entry: dict[int, Any] = {}
        self._param_entry: dict[int, Any] = {}
        self._index_parameters()

    @classmethod
    def build(cls, model: nn.Module, plan: Any, ctx: Any) -> "PipelineStrategy":
        """The pipeline of ``plan`` (pp, schedule, microbatches, virtual, balance, tp, sp, remat)
        over ``model`` for this process (the compatibility table has already accepted it)."""
        p = plan
        v = default_virtual(p.schedule, p.virtual)
        seq = ctx.seq_len if ctx.task == "lm" else None
        try:
            from scaletrain.chain import to_chain

            n_blocks = len(to_chain(model))
            example_input(model, ctx.micro_batch, seq)
            if p.tp > 1:  # before any collective: every rank refuses alike
                from scaletrain.techniques.tensor_parallel import check_model

                check_model(model, p.tp)
        except ConfigError:
            raise
        except UserError as e:
            what = "a GPT-2 model whose heads and vocabulary parallel.tp divides" if p.tp > 1 else \
                "a model cut into blocks with an input_spec"
            raise ConfigError(f"parallel.pp={p.pp} needs {what}: {e}") from None
        if n_blocks < p.pp * v:
            raise ConfigError(f"parallel.pp={p.pp} x {v} stage(s) per rank = {p.pp * v} stages, but "
                              f"{ctx.model_name} has {n_blocks} blocks; allowed: parallel.pp <= {n_blocks // v}")
        try:
            rt = pipeline_runtime(model, pp=p.pp, dp=ctx.dp_world, schedule=p.schedule,
                                  microbatches=ctx.accum, micro_batch=ctx.micro_batch,
                                  loss_fn=ctx.loss_fn, seq_len=seq, virtual=v, device=ctx.device,
                                  timeout_s=ctx.timeout_s, balance=p.balance,
                                  forward_context=_forward_context(ctx, model, p),
                                  remat=p.remat.method, remat_budget=remat_budgets(p.remat),
                                  remat_precision=ctx.precision, tp=p.tp, sequence_parallel=p.sp,
                                  loss_scale=_loss_scale(ctx), stage_aux=_stage_aux(model), ep=p.ep)
        except ConfigError:
            raise
        except UserError as e:
            if type(e) is not UserError:  # a communication failure: not a configuration problem
                raise
            raise ConfigError(f"parallel.pp={p.pp} parallel.schedule={p.schedule}: {e}") from None
        strategy = cls(model, rt, ctx.rank, ctx.world)
        strategy._precision = ctx.precision
        if p.zero == 1:
            strategy._shard_optimizer_states()
        elif p.zero == 3:
            strategy._shard_parameters(ctx.precision)
        if rt.tp is not None:
            from .tensor_parallel import predicted_tp_bytes

            strategy._tp_predicted = predicted_tp_bytes(model, rt, ctx.micro_batch, seq or 1,
                                                        sequence_parallel=p.sp, precision=ctx.precision)
        for stage, sch in sorted(rt.remat_schedules.items()):
            from scaletrain.techniques.remat.tree import describe_tree, tree_of

            ctx.log(f"remat: stage {stage}: {describe_tree(tree_of(sch))}; predicted activation peak "
                    f"{sch.predicted_peak_bytes} B per micro-batch, {sch.n_forwards} block forwards")
        if ctx.accum < p.pp:
            ctx.log(f"note: {ctx.accum} micro-batch(es) per step over parallel.pp={p.pp} stages leaves the "
                    f"pipeline idle {strategy.bubble_predicted:.0%} of the time (predicted); set "
                    f"parallel.microbatches to a multiple of {p.pp} (e.g. {4 * p.pp})")
        return strategy

    # ------------------------------------------------------------------ the step
    def run_micro_batches(self, ctx: Any, it: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """One schedule step over ``ctx.accum`` micro-batches; returns the mean loss over all
        micro-batches of all replicas (the same value on every rank). Asynchronous schedules:
        the next window of one stream over the run's remaining steps (see the module doc)."""
        rt = self.runtime
        # TP traffic counted on the steps the trainer logs (the counter sees every op)
        count = rt.tp is not None and ctx.counts_traffic(ctx.step)
        with tp_comm_counter() if count else contextlib.nullcontext(None) as counter:
            if rt.asynchronous:
                if self._stream is None:
                    self._stream = rt.stream(ctx.steps - ctx.step, it, self._async_update(ctx))
                loss = next(self._stream)
            else:
                loss = rt.train_step(itertools.islice(it, ctx.accum))
        if counter is not None:
            self._tp_bytes = counter.wire_bytes()
            LEDGER.add("intra_layer", self._tp_bytes, len(counter.records))
        sent = rt.transport.bytes_sent
        self._p2p_bytes, self._sent_before = sent - self._sent_before, sent
        return loss

    def _async_update(self, ctx: Any) -> Callable[[], None]:
        """The update the stream calls (after every micro-batch for pipedream, every window for
        2BW): the trainer's clipping and optimizer step; the trainer's own step after a window is
        then a no-op (:meth:`optimizer_step`) and its clipping reports this update's norm."""
        def update() -> None:
            clip = ctx.grad_clip
            self._last_norm = self.runtime.clip_grad_norm_(clip) if clip > 0 else float("nan")
            ctx.optimizer.step()
            ctx.optimizer.zero_grad(set_to_none=True)

        return update

    def optimizer_step(self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler) -> None:
        if not self.runtime.asynchronous:  # asynchronous: the stream updated inside the window
            super().optimizer_step(optimizer, scaler)

    def _shard_optimizer_states(self) -> None:
        """ZeRO-1 inside the stages (Megatron's distributed optimizer): each stage's gradients are
        reduce-scattered over its data-parallel replicas at the step (instead of all-reduced), the
        optimizer keeps states for this rank's rows only (:class:`GradSync`), and the updated rows
        are all-gathered back. A parameter held by several pipeline ranks (tied embedding, Chimera's
        replicas) or replicated over TP counts once in the norm (``replicas``)."""
        from scaletrain.techniques.data_parallel.zero import GradSync, SyncGroup

        from .tensor_parallel import is_replicated

        rt = self.runtime
        plan = rt.plan
        T = rt.tp.tp if rt.tp is not None else 1
        index = {id(t): i for i, t in enumerate(plan.tensors)}
        params = []
        for p in plan.params:
            holders = len(plan.holders[index[id(p)]])
            key = "expert" if id(p) in plan.experts else "dense"
            params.append((self._names[id(p)], p, key, holders * (T if T > 1 and is_replicated(p) else 1)))
        group = plan.group(plan.dp_ranks) if rt.dp > 1 else None
        groups = {"dense": SyncGroup(group, rt.dp)}
        if plan.experts:  # expert parallelism: an expert's rows are sharded over the ranks holding the same experts
            same = plan.expert_dp_ranks
            groups["expert"] = SyncGroup(plan.group(same) if len(same) > 1 else None, rt.dp)
        self.zero = GradSync(params, groups, stage=1, device=rt.device, hooks=False)
        self._proxy_entry = {id(e.proxy): e for e in self.zero.entries}
        self._param_entry = {id(e.param): e for e in self.zero.entries}
        plan.zero_sync = self.zero

    def _shard_parameters(self, precision: str) -> None:
        """ZeRO-3 inside the stages (torchtitan's PP + FSDP, :mod:`.fsdp`): every stage FSDP2-sharded
        over its data-parallel replicas, gathered once per step, reduce-scattered at the update."""
        from . import p2p
        from .fsdp import StageFSDP

        rt = self.runtime
        # FSDP over the world mesh's data-parallel ranks, the mesh the stages' TP shards live on (torchtitan's
        # 3-D: TP first, then fully_shard on the dp sub-mesh); pipeline rank r of replica d is (r*dp + d)*tp + t
        world = rt.tp.mesh if rt.tp is not None else p2p.world(pp=rt.pp, dp=rt.dp, ep=rt.plan.ep,
                                                               device_type=rt.device.type)
        dp_mesh = world["dp"]
        half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
        self.zero = StageFSDP(self.model, rt, dp_mesh, param_dtype=half)
        rt.plan.zero_sync = self.zero
        self._proxy_entry = {id(e.proxy): e for e in self.zero.entries}
        self._param_entry = {id(e.param): e for e in self.zero.entries}
        self._index_parameters()

    def make_scaler(self, device: torch.device, enabled: bool) -> torch.amp.GradScaler:
        if not enabled:
            return torch.amp.GradScaler(device.type, enabled=False)
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        # every stage unscales its own gradients; inf/NaN on any rank skips the step on every rank
        self._scaled = True  # its found-inf flag (fp32) is all-reduced over the world at every unscale
        scaler = ShardedGradScaler(device.type, process_group=dist.group.WORLD)
        scaler.scale(torch.ones((), device=device))  # its scale exists on ranks that never scale a loss
        return scaler

    def build_optimizer(self, build: Callable[[nn.Module], torch.optim.Optimizer]) -> torch.optim.Optimizer:
        """The optimizer over this rank's blocks only (with ZeRO-1: over their owned rows)."""
        if self.zero is not None:
            from scaletrain.techniques.data_parallel.zero import swap_in_proxies

            return swap_in_proxies(self.runtime.module, self.zero.proxies_for(self.runtime.module.parameters()), build)
        return build(self.runtime.module)

    def prepare_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.zero is not None:
            self.zero.prepare_step()

    def after_step(self) -> None:
        if self.zero is not None:
            self.zero.after_step()

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)
        if self.zero is not None:
            self.zero.zero_grad()

    def clip_grad_norm(self, optimizer: torch.optim.Optimizer, max_norm: float) -> float:
        """Clip the global norm (all stages; gradients already averaged over replicas).
        Asynchronous schedules clipped inside the stream: the last update's norm."""
        if self.runtime.asynchronous:
            return self._last_norm
        if self.zero is not None:  # owned rows: every element once over the whole job
            sq = self.zero.square_norm()
            with LEDGER.paused():
                self.runtime.transport.all_reduce(sq, dist.group.WORLD, "gradient-norm all-reduce")
            norm = float(sq.sqrt())
            self.zero.scale_grads(max_norm / (norm + 1e-6))
            return norm
        return self.runtime.clip_grad_norm_(max_norm)

    def _dp_reduce(self, values: list[float], average: bool) -> list[float]:
        rt = self.runtime
        if rt.dp == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=rt.device)
        with LEDGER.paused():
            rt.transport.all_reduce(t, rt.plan.group(rt.plan.dp_ranks), "data-parallel reduction of logged values")
        return (t / rt.dp if average else t).cpu().tolist()

    def mean(self, values: list[float]) -> list[float]:
        """Average over the data-parallel replicas (values are already equal across the stages)."""
        return self._dp_reduce(values, average=True)

    def sum(self, values: list[float]) -> list[float]:
        """Sum over the data-parallel replicas (values are already equal across the stages)."""
        return self._dp_reduce(values, average=False)

    @torch.no_grad()
    def eval_batch(self, ctx: Any, x: torch.Tensor, y: torch.Tensor) -> tuple[float, int, int]:
        """Forward only, stage by stage (pipe 0); the last stage's (loss sum, correct, samples) is
        broadcast to every rank of this pipeline replica."""
        rt, sched = self.runtime, self.sched
        S = rt.n_stages
        h: torch.Tensor | None = None
        sent: list[int] = []
        result = torch.zeros(3, dtype=torch.float64, device=rt.device)
        for s in range(S):
            holder = sched.rank_of(s, 0)
            if holder != rt.pp_rank:
                h = None
                continue
            if s == 0:
                h = x
            elif h is None:  # the previous stage lives on another rank
                spec = rt.specs[s]
                h = rt.transport.recv(torch.Size((x.shape[0], *spec.shape[1:])), spec.dtype,
                                      rt._global(sched.rank_of(s - 1, 0)), _eval_tag(s),
                                      f"evaluation activation into stage {s}")
            rep = rt.replicas[(0, s)]
            with ctx.autocast():  # (without grad a remat tree is the plain forward; under ZeRO-3 the FSDP root)
                h = (rep.remat if rep.remat is not None else rep.module)(h)
            if s == S - 1:
                loss = float(rt.loss_fn(h, y)) * len(y)  # vocabulary-parallel under TP
                correct = int((h.argmax(-1) == y).sum()) if ctx.task != "lm" else 0
                result = torch.tensor([loss, correct, len(y)], dtype=torch.float64, device=rt.device)
            else:
                h = h.to(rt.specs[s + 1].dtype)
                nxt = sched.rank_of(s + 1, 0)
                if nxt != rt.pp_rank:
                    rt.transport.send(h, rt._global(nxt), _eval_tag(s + 1), f"evaluation activation of stage {s}")
                    sent.append(_eval_tag(s + 1))
        rt.transport.release(sent)  # not drain(): a paused asynchronous stream may have sends in flight
        if self.zero is not None and self.zero.stage == 3:
            self.zero.reshard()  # the forward left the stages gathered (reshard_after_forward=False)
        self._sent_before = rt.transport.bytes_sent  # p2p_bytes counts training traffic only
        if rt.pp > 1:
            with LEDGER.paused():
                last = rt._global(sched.rank_of(S - 1, 0))
                rt.transport.broadcast(result, last, rt.plan.group(rt.plan.replica_ranks),
                                       "broadcast of the evaluation loss from the last stage")
        loss, correct, n = result.tolist()
        return loss, int(correct), int(n)

    # ------------------------------------------------------------------ reporting
    def metrics(self) -> dict[str, Any]:
        """Predicted bubble fraction (equal stage costs) and bytes this rank sent to other stages in the
        last step (point-to-point; the ledger's ``comm_bytes`` counts only the collectives); with
        TP, the wire bytes of its collectives inside this rank's stages (also in ``comm_bytes``)."""
        out = {"pipeline_bubble_predicted": self.bubble_predicted, "p2p_bytes": self._p2p_bytes}
        if self.runtime.tp is not None:  # DTensor's collectives inside this rank's stages (logged steps)
            out["comm_bytes_intra_layer"] = self._tp_bytes
            out["predicted_comm_bytes_intra_layer"] = self._tp_predicted
        if not self.runtime.asynchronous:
            out.update(self.predicted_collectives())
        return out

    def predicted_collectives(self) -> dict[str, float]:
        """Bytes this rank receives per step in the collectives the ledger counts (ring convention,
        :mod:`scaletrain.measure.comm`), from the layout: the loss all-reduce over the pipeline mesh;
        shared parameters' gradients summed over their holders (GPT-2's tied embedding on the first and
        last stage; Chimera's replicas); this rank's gradients averaged over its data-parallel replicas
        (all-reduce), or with ZeRO-1 reduce-scattered and the updated rows all-gathered (bucket padding
        included); the gradient-norm all-reduces; the TP collectives inside the stages."""
        rt, plan = self.runtime, self.runtime.plan

        def ring_ar(n: int, nbytes: float) -> float:
            return 2 * (n - 1) / n * nbytes if n > 1 else 0.0

        def nbytes(ts: list) -> float:
            from .tensor_parallel import local

            return float(sum(local(t).numel() * local(t).element_size() for t in ts))

        W = len(plan.mesh_ranks)
        total = ring_ar(W, 8.0)  # the window's mean loss (float64)
        for h, ts in plan.tied:
            total += ring_ar(len(h), nbytes(ts))
        for ts in plan.gradsync.values():  # Chimera: a stage's two replicas
            total += ring_ar(2, nbytes(ts))
        if self.zero is not None and self.zero.stage == 3:  # one all-gather (compute dtype) + one fp32 reduce-scatter
            dp, n = rt.dp, self.zero.padded_shard_elements()
            pb = torch.empty(0, dtype=self.zero.param_dtype or torch.float32).element_size()
            total += (dp - 1) * n * (pb + 4)
        elif self.zero is not None:
            for b in self.zero.buckets:  # reduce-scatter of the padded buckets, then their all-gather, per group
                n = self.zero.groups[b.group].size
                total += 2 * (n - 1) / n * n * b.seg * self.zero.entries[b.entries[0]].local.element_size()
        else:
            experts = [p for p in plan.params if id(p) in plan.experts]
            total += ring_ar(rt.dp, nbytes([p for p in plan.params if id(p) not in plan.experts]))
            total += ring_ar(rt.dp // plan.ep, nbytes(experts))  # EP: summed over the same experts' holders
            total += ring_ar(rt.pp, 8.0) if rt.pp > 1 else 0.0  # the norm: over the replica ...
            if rt.tp is not None:
                total += ring_ar(rt.tp.tp, 8.0)  # ... and over the TP group
            if experts:
                total += ring_ar(plan.ep, 8.0)  # ... and the experts' squares over the EP group
        if rt.tp is not None:
            total += self._tp_predicted
        if plan.ep > 1:  # the all-to-alls of this rank's MoE layers
            from .experts import moe_layers_per_block, rank_ep_bytes

            x = rt.specs[0].shape
            total += rank_ep_bytes(self.model.config, self.sched, list(rt.bounds),
                                   moe_layers_per_block(rt.chain.blocks), rt.pp_rank, x[0], x[1], plan.ep,
                                   self._precision, [rt.remat_schedules.get(s) for s in range(rt.n_stages)])
        if self._scaled:  # fp16: the loss scaler's found-inf all-reduce (one fp32) over the world
            total += ring_ar(self.world, 4.0)
        return {"predicted_comm_bytes": total}

    def describe(self) -> str:
        rt = self.runtime
        virt = f" ({rt.virtual} per rank, {rt.n_stages} in all)" if rt.virtual > 1 else ""
        tp = f" x {rt.tp.tp} tp" if rt.tp is not None else ""
        return (f"pipeline {rt.name} over {rt.pp} stages{virt} x {rt.dp} dp{tp}, {rt.M} micro-batches, "
                f"block bounds {list(rt.bounds)}")

    def close(self) -> None:
        super().close()
        if self.runtime is not None:
            self.runtime.close()
        self.runtime = None  # type: ignore[assignment]


def _eval_tag(stage: int) -> int:
    """gloo tag of evaluation activations into ``stage`` (above every training tag of a step)."""
    return 2**30 + stage

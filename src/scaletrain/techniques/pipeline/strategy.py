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
:mod:`scaletrain.techniques.optim`); ZeRO-sharded states are refused with one line.

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

Supported: every schedule, fp32 and bf16;
``memory.remat.method`` / ``memory.remat.budget`` run a rematerialization schedule inside every
stage (:func:`.stage.stage_remat`; the budget is per stage and micro-batch) with the unsplit
synchronous schedules. Refused with a one-line :class:`~scaletrain.errors.ConfigError` naming
the key (see :func:`check_config`): fp16 (per-stage loss scaling would skip steps on some stages only),
ZeRO > 0 and gradient compression, context/expert parallelism, rematerialization with
zb1p or the asynchronous schedules, offloading and activation compression inside the stages.
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
from .schedules import ASYNC_SCHEDULES, build
from .simulate import simulate
from .tensor_parallel import tp_comm_counter


def check_config(cfg: Any, microbatches: int, *, offload: bool = False, device_type: str = "cpu") -> None:
    """Raise a one-line ConfigError for what the pipeline cannot combine with (``cfg.parallel.pp > 1``);
    ``microbatches`` is the resolved count per step, ``offload`` whether memory.offload is requested,
    ``device_type`` the training device's ("cuda": NCCL, whose point-to-point ignores tags)."""
    p, mem = cfg.parallel, cfg.memory
    head = f"parallel.pp={p.pp}"
    for key in ("cp", "ep"):
        if getattr(p, key) > 1:
            raise ConfigError(f"{head} with parallel.{key}={getattr(p, key)} is not supported yet; allowed with a "
                              f"pipeline: parallel.tp >= 1 with parallel.cp=1, parallel.ep=1")
    if getattr(p, "sequence_parallel", False) and p.tp == 1:
        raise ConfigError(f"{head} with parallel.sequence_parallel=true needs parallel.tp > 1; allowed with tp=1: "
                          f"false")
    if p.tp > 1:
        tp_head = f"{head} with parallel.tp={p.tp}"
        if mem.remat.method != "none":
            raise ConfigError(f"{tp_head} and memory.remat.method={mem.remat.method} is not supported yet; "
                              f"allowed: memory.remat.method=none")
        if p.sequence_parallel and p.schedule == "zb1p":
            raise ConfigError(f"{tp_head} parallel.sequence_parallel=true and parallel.schedule=zb1p is not "
                              f"supported yet (deferred weight gradients of sequence-parallel layers); allowed with "
                              f"sequence parallelism: gpipe, 1f1b, interleaved, chimera, pipedream, pipedream-2bw")
        if p.sequence_parallel and cfg.data.seq_len % p.tp:
            raise ConfigError(f"{tp_head} and parallel.sequence_parallel=true needs data.seq_len="
                              f"{cfg.data.seq_len} to be a multiple of parallel.tp={p.tp}")
    if p.zero:
        raise ConfigError(f"{head} with parallel.zero={p.zero} is not supported; allowed: parallel.zero=0 (the "
                          f"pipeline averages each stage's gradients over its data-parallel replicas itself)")
    if p.compression != "none":
        raise ConfigError(f"{head} with parallel.compression={p.compression} is not supported; allowed: "
                          f"parallel.compression=none")
    if mem.remat.method != "none" and (p.schedule == "zb1p" or p.schedule in ASYNC_SCHEDULES):
        raise ConfigError(f"memory.remat.method={mem.remat.method} with {head} parallel.schedule={p.schedule} is not "
                          f"supported (recomputation would undo zb1p's deferred weight gradients / ignore weight "
                          f"stashing); allowed with remat: parallel.schedule=gpipe, 1f1b, interleaved, chimera")
    if offload:
        raise ConfigError(f"memory.offload / memory.device_budget with {head} is not supported yet; allowed: "
                          f"the default memory.offload settings and an empty memory.device_budget")
    if mem.activation_compression:
        raise ConfigError(f"memory.activation_compression=true with {head} is not supported yet; allowed: false")
    if cfg.train.precision == "fp16":
        raise ConfigError(f"train.precision=fp16 with {head} is not supported (the loss scaler would skip steps "
                          f"on some stages only); allowed: fp32, bf16")
    s, M = p.schedule, microbatches
    if s in ASYNC_SCHEDULES and device_type == "cuda" and cfg.train.eval_every:
        # NCCL matches point-to-point messages by order, not tag: evaluation's transfers between
        # two windows would meet the stream's in-flight ones (gloo's tags keep them apart)
        raise ConfigError(f"parallel.schedule={s} on CUDA evaluates only at the end of its stream; set "
                          f"train.eval_every=0 (got {cfg.train.eval_every})")
    if p.virtual > 1 and s != "interleaved":
        raise ConfigError(f"parallel.virtual={p.virtual} only applies to parallel.schedule=interleaved (got {s}); "
                          f"allowed: 0 or 1")
    if s == "interleaved" and M % p.pp:
        raise ConfigError(f"parallel.microbatches={M} must be a multiple of parallel.pp={p.pp} for "
                          f"parallel.schedule=interleaved")
    if s == "chimera" and (p.pp % 2 or M % 2):
        raise ConfigError(f"parallel.schedule=chimera needs an even parallel.pp and parallel.microbatches "
                          f"(got {p.pp} and {M})")
    try:
        build(s, p.pp, M, default_virtual(s, p.virtual))
    except UserError as e:
        raise ConfigError(f"parallel.schedule={s} with parallel.pp={p.pp}, parallel.microbatches={M}: {e}") from None


class PipelineStrategy(Strategy):
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
        # the one-process optimizer's parameter numbering (build(model) groups parameters by
        # scaletrain.techniques.optim.registry.param_groups): the checkpoint layout
        from scaletrain.techniques.optim.registry import param_groups

        groups = param_groups(model, None)
        self._full_index: dict[int, int] = {}
        self._full_group: dict[int, int] = {}
        for g, group in enumerate(groups):
            for p in group["params"]:
                self._full_group[len(self._full_index)] = g
                self._full_index[id(p)] = len(self._full_index)
        self._full_groups = len(groups)
        self._names = {id(p): n for n, p in model.named_parameters()}

    @classmethod
    def from_trainer(cls, trainer: Any) -> "PipelineStrategy":
        cfg = trainer.cfg
        p = cfg.parallel
        check_config(cfg, trainer.accum, offload=trainer._offload_requested(),
                     device_type=torch.device(trainer.device).type)
        v = default_virtual(p.schedule, p.virtual)
        seq = cfg.data.seq_len if trainer.task == "lm" else None
        try:
            from scaletrain.chain import to_chain

            n_blocks = len(to_chain(trainer.model))
            example_input(trainer.model, trainer.micro_batch, seq)
            if p.tp > 1:  # before any collective: every rank refuses alike
                from scaletrain.techniques.tensor_parallel import check_model

                check_model(trainer.model, p.tp)
        except ConfigError:
            raise
        except UserError as e:
            what = "a GPT-2 model whose heads and vocabulary parallel.tp divides" if p.tp > 1 else \
                "a model cut into blocks with an input_spec"
            raise ConfigError(f"parallel.pp={p.pp} needs {what}: {e}") from None
        if p.tp > 1 and getattr(getattr(trainer.model, "config", None), "dropout", 0.0) > 0:
            raise ConfigError(f"parallel.pp={p.pp} with parallel.tp={p.tp} and model dropout="
                              f"{trainer.model.config.dropout} is not supported yet (each rank draws its own "
                              f"masks, but a TP group's replicated activations need the same); allowed: "
                              f"model.overrides.dropout=0")
        if callable(getattr(trainer.model, "aux_loss", None)):
            raise ConfigError(f"parallel.pp={p.pp} with {trainer.model_name}, whose auxiliary loss (mixture-of-experts "
                              f"load balancing) spans all stages, is not supported yet; allowed: parallel.pp=1")
        if n_blocks < p.pp * v:
            raise ConfigError(f"parallel.pp={p.pp} x {v} stage(s) per rank = {p.pp * v} stages, but "
                              f"{trainer.model_name} has {n_blocks} blocks; allowed: parallel.pp <= {n_blocks // v}")
        try:
            rt = pipeline_runtime(trainer.model, pp=p.pp, dp=trainer.dp_world, schedule=p.schedule,
                                  microbatches=trainer.accum, micro_batch=trainer.micro_batch,
                                  loss_fn=trainer.loss_fn, seq_len=seq, virtual=v, device=trainer.device,
                                  timeout_s=p.timeout_s, balance=p.balance, forward_context=trainer.autocast,
                                  remat=cfg.memory.remat.method, remat_budget=cfg.memory.remat.budget or None,
                                  remat_precision=cfg.train.precision, tp=p.tp,
                                  sequence_parallel=p.sequence_parallel)
        except ConfigError:
            raise
        except UserError as e:
            if type(e) is not UserError:  # a communication failure: not a configuration problem
                raise
            raise ConfigError(f"parallel.pp={p.pp} parallel.schedule={p.schedule}: {e}") from None
        strategy = cls(trainer.model, rt, trainer.rank, trainer.world)
        if rt.tp is not None:
            from .tensor_parallel import predicted_tp_bytes

            strategy._tp_predicted = predicted_tp_bytes(trainer.model, rt, trainer.micro_batch, seq or 1,
                                                        sequence_parallel=p.sequence_parallel)
        if trainer.accum < p.pp:
            trainer.log(f"note: {trainer.accum} micro-batch(es) per step over parallel.pp={p.pp} stages leaves the "
                        f"pipeline idle {strategy.bubble_predicted:.0%} of the time (predicted); set "
                        f"parallel.microbatches to a multiple of {p.pp} (e.g. {4 * p.pp})")
        return strategy

    # ------------------------------------------------------------------ the step
    def run_micro_batches(self, trainer: Any, it: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """One schedule step over ``trainer.accum`` micro-batches; returns the mean loss over all
        micro-batches of all replicas (the same value on every rank). Asynchronous schedules:
        the next window of one stream over the run's remaining steps (see the module doc)."""
        rt = self.runtime
        t = trainer.cfg.train  # TP traffic counted on the steps the trainer logs (the counter sees every op)
        count = rt.tp is not None and ((trainer.step + 1) % t.log_every == 0 or trainer.step + 1 >= t.steps)
        with tp_comm_counter() if count else contextlib.nullcontext(None) as counter:
            if rt.asynchronous:
                if self._stream is None:
                    self._stream = rt.stream(trainer.cfg.train.steps - trainer.step, it, self._async_update(trainer))
                loss = next(self._stream)
            else:
                loss = rt.train_step(itertools.islice(it, trainer.accum))
        if counter is not None:
            self._tp_bytes = counter.wire_bytes()
            LEDGER.add("intra_layer", self._tp_bytes, len(counter.records))
        sent = rt.transport.bytes_sent
        self._p2p_bytes, self._sent_before = sent - self._sent_before, sent
        return loss

    def _async_update(self, trainer: Any) -> Callable[[], None]:
        """The update the stream calls (after every micro-batch for pipedream, every window for
        2BW): the trainer's clipping and optimizer step; the trainer's own step after a window is
        then a no-op (:meth:`optimizer_step`) and its clipping reports this update's norm."""
        def update() -> None:
            clip = trainer.cfg.optim.grad_clip
            self._last_norm = self.runtime.clip_grad_norm_(clip) if clip > 0 else float("nan")
            trainer.optimizer.step()
            trainer.optimizer.zero_grad(set_to_none=True)

        return update

    def optimizer_step(self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler) -> None:
        if not self.runtime.asynchronous:  # asynchronous: the stream updated inside the window
            super().optimizer_step(optimizer, scaler)

    def build_optimizer(self, build: Callable[[nn.Module], torch.optim.Optimizer]) -> torch.optim.Optimizer:
        """The optimizer over this rank's blocks only."""
        return build(self.runtime.module)

    def clip_grad_norm(self, optimizer: torch.optim.Optimizer, max_norm: float) -> float:
        """Clip the global norm (all stages; gradients already averaged over replicas).
        Asynchronous schedules clipped inside the stream: the last update's norm."""
        if self.runtime.asynchronous:
            return self._last_norm
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
    def eval_batch(self, trainer: Any, x: torch.Tensor, y: torch.Tensor) -> tuple[float, int, int]:
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
            with trainer.autocast():
                h = rt.replicas[(0, s)].module(h)
            if s == S - 1:
                loss = float(rt.loss_fn(h, y)) * len(y)  # vocabulary-parallel under TP
                correct = int((h.argmax(-1) == y).sum()) if trainer.task != "lm" else 0
                result = torch.tensor([loss, correct, len(y)], dtype=torch.float64, device=rt.device)
            else:
                h = h.to(rt.specs[s + 1].dtype)
                nxt = sched.rank_of(s + 1, 0)
                if nxt != rt.pp_rank:
                    rt.transport.send(h, rt._global(nxt), _eval_tag(s + 1), f"evaluation activation of stage {s}")
                    sent.append(_eval_tag(s + 1))
        rt.transport.release(sent)  # not drain(): a paused asynchronous stream may have sends in flight
        self._sent_before = rt.transport.bytes_sent  # p2p_bytes counts training traffic only
        if rt.pp > 1:
            with LEDGER.paused():
                last = rt._global(sched.rank_of(S - 1, 0))
                rt.transport.broadcast(result, last, rt.plan.group(rt.plan.replica_ranks),
                                       "broadcast of the evaluation loss from the last stage")
        loss, correct, n = result.tolist()
        return loss, int(correct), int(n)

    # ------------------------------------------------------------------ state
    def model_state_dict(self) -> dict[str, Any]:
        """The whole model (single-process layout), current on every rank. Collective."""
        rt = self.runtime
        if rt.tp is not None:  # each stage's TP group gathers its tensors; one rank per stage shares them
            from .tensor_parallel import gather_model_state

            return gather_model_state(self.model, rt.plan.local_tensors, rt.tp.tp_rank == 0 and rt.dp_rank == 0)
        rt.sync_full_model()
        return self.model.state_dict()

    def load_model_state_dict(self, state: dict[str, Any]) -> None:
        if self.runtime.tp is not None:  # this rank's TP shards of its stages' tensors
            from .tensor_parallel import load_full_state

            load_full_state(self.model, state, self.runtime.plan.local_tensors)
            return
        self.model.load_state_dict(state)  # every rank loads the whole model; stages share its tensors

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Every stage's states renumbered as the one-process optimizer's, on every rank. Collective."""
        rt = self.runtime
        mine: dict[str, Any] | None = None
        if rt.dp_rank == 0:  # replicas hold equal states: one copy per stage suffices
            from .tensor_parallel import gather_full

            sd = optimizer.state_dict()
            local = [p for g in optimizer.param_groups for p in g["params"]]
            # TP: DTensor states gathered to full tensors (collective over the TP group)
            state = {self._full_index[id(local[i])]: {k: gather_full(self.model, self._names[id(local[i])], v).cpu()
                                                      if torch.is_tensor(v) else v for k, v in st.items()}
                     for i, st in sd["state"].items()}
            hyper = {self._full_group[self._full_index[id(g["params"][0])]]:
                     {k: v for k, v in gsd.items() if k != "params"}
                     for g, gsd in zip(optimizer.param_groups, sd["param_groups"]) if g["params"]}
            mine = {"state": state, "hyper": hyper} if rt.tp is None or rt.tp.tp_rank == 0 else None
        parts: list[Any] = [None] * self.world
        with LEDGER.paused():
            dist.all_gather_object(parts, mine)
        state, hyper = {}, {}
        for part in parts:
            if part is not None:
                state.update(part["state"])
                hyper.update(part["hyper"])
        members: list[list[int]] = [[] for _ in range(self._full_groups)]
        for i in range(len(self._full_index)):
            members[self._full_group[i]].append(i)
        return {"state": dict(sorted(state.items())),
                "param_groups": [{**hyper[g], "params": members[g]} for g in range(self._full_groups)]}

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Load a single-process-layout optimizer state (from a pipeline run at any pp, or one process)."""
        if state.get("sharded"):
            super().load_optimizer_state_dict(optimizer, state)  # raises its one-line ConfigError
        groups = state["param_groups"]
        n = sum(len(g["params"]) for g in groups)
        if n != len(self._full_index):
            raise ConfigError(f"the checkpoint's optimizer has {n} parameters, this model {len(self._full_index)}; "
                              f"resume with the same model and optimizer")
        group_of = {i: g for g in groups for i in g["params"]}
        sd = optimizer.state_dict()
        new_state: dict[int, Any] = {}
        new_groups = []
        for g, gsd in zip(optimizer.param_groups, sd["param_groups"]):
            full = [self._full_index[id(p)] for p in g["params"]]
            src = group_of[full[0]] if full else {}
            new_groups.append({**{k: v for k, v in src.items() if k != "params"}, "params": gsd["params"]})
            for li, fi, p in zip(gsd["params"], full, g["params"]):
                if fi in state["state"]:  # TP: full parameter-shaped states sharded as the parameter
                    new_state[li] = {k: self._shard_state(p, v) for k, v in state["state"][fi].items()}
        optimizer.load_state_dict({"state": new_state, "param_groups": new_groups})

    def _shard_state(self, p: torch.Tensor, v: Any) -> Any:
        from torch.distributed.tensor import DTensor

        if not isinstance(p, DTensor) or not torch.is_tensor(v) or tuple(v.shape) != tuple(p.shape):
            return v
        from .tensor_parallel import shard_full

        return shard_full(self.model, self._names[id(p)], p, v)

    # ------------------------------------------------------------------ reporting
    def metrics(self) -> dict[str, Any]:
        """Predicted bubble fraction (equal stage costs) and bytes this rank sent to other stages in the
        last step (point-to-point; the ledger's ``comm_bytes`` counts only the collectives); with
        TP, the wire bytes of its collectives inside this rank's stages (also in ``comm_bytes``)."""
        out = {"pipeline_bubble_predicted": self.bubble_predicted, "p2p_bytes": self._p2p_bytes}
        if self.runtime.tp is not None:  # DTensor's collectives inside this rank's stages (logged steps)
            out["comm_bytes_intra_layer"] = self._tp_bytes
            out["predicted_comm_bytes_intra_layer"] = self._tp_predicted
        return out

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

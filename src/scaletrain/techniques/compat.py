"""What combines: the one table of every refusal, each with its reason and what is allowed.

Every combination of techniques a :class:`~scaletrain.plan.Plan` may ask for is either run by the
stack (:mod:`.stack`) or refused here, before any process group, file or tensor is touched, in
one line naming the keys, why, and what would work. Nothing else in the code base decides what
may combine: techniques validate their own values, this table their combinations (with each
other and with the model, whose relevant properties are :class:`Facts`).

:func:`matrix` renders the pairwise table for the README (``scaletrain plan --compat`` prints it);
a test keeps the README's copy equal to it, so the documented matrix is the enforced one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

from scaletrain.errors import ConfigError
from scaletrain.plan import Plan
from scaletrain.schema import ASYNC_SCHEDULES

TREE_METHODS = ("none", "periodic", "revolve", "optimal")
"""Remat solvers whose schedules are nests of checkpoints (:mod:`.remat.tree`), which compose."""
ASYNC = ASYNC_SCHEDULES


@dataclass(frozen=True)
class Facts:
    """What the table needs to know of the run beyond the plan (defaults: gpt2-tiny on CPU)."""

    world: int = 1
    device: str = "cpu"
    task: str = "lm"
    gpt2: bool = True
    """A decoder of a layout tensor / context parallelism know (its family's ``ModelSpec.decoder``: GPT-2,
    scaletrain's or Hugging Face's, Llama / Mistral)."""
    hf: bool = False
    moe: bool = False
    dropout: float = 0.0
    n_head: int = 4
    vocab_size: int = 256
    n_experts: int = 0
    n_blocks: int = 6
    chain: bool = True
    """The model cuts into a Chain of blocks (remat trees, pipelines, offload need it)."""
    input_spec: bool = True
    seq_len: int = 128
    eval_every: int = 200
    microbatches: int = 0
    """Micro-batches per step as resolved (pipeline); 0 = not known yet."""
    sweep: bool = False
    """Trained by ``scaletrain sweep`` (spilled shards on shared devices, :mod:`scaletrain.sweep`)."""
    shared: bool = True
    """Two Chain blocks use one parameter (GPT-2's tied embedding: the first and the last block)."""
    rezero: bool = False
    """ReZero residuals without the blocks' LayerNorms (:attr:`scaletrain.models.gpt2.GPT2Config.rezero`)."""

    @classmethod
    def of(cls, model: Any, *, world: int, device: str, seq_len: int, eval_every: int = 0,
           microbatches: int = 0) -> "Facts":
        """Read the facts off a model (nothing is run)."""
        from scaletrain.chain import to_chain
        from scaletrain.models.spec import is_transformers, moe_layers, spec_of

        cfg = getattr(model, "config", None)
        family = spec_of(model)  # what the model is, as its folder under models/ declares it
        hf = is_transformers(model)
        moe = bool(moe_layers(model))
        shared = False
        try:
            blocks = to_chain(model).blocks
            n_blocks, chain = len(blocks), True
            seen: set[int] = set()
            for blk in blocks:
                ids = {id(p) for p in blk.parameters()}
                shared = shared or bool(ids & seen)
                seen |= ids
        except Exception:  # noqa: BLE001 - not cut into blocks: the table refuses what needs it
            n_blocks, chain = 0, False
        gpt2 = family is not None and family.decoder
        drop = float(getattr(cfg, "dropout", 0.0) or 0.0)
        if hf and cfg is not None:
            drop = max(float(getattr(cfg, k, 0.0) or 0.0) for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop"))
        from scaletrain.models.adapters import adapt

        try:
            a = adapt(model)
            task, spec = a.task, a.knows_input or callable(getattr(model, "input_spec", None))
        except Exception:  # noqa: BLE001 - not adaptable: the table refuses what needs an example input
            task, spec = getattr(model, "task", "lm"), callable(getattr(model, "input_spec", None))
        return cls(world=world, device=device, task=task, gpt2=bool(gpt2), hf=hf, moe=moe,
                   dropout=drop, n_head=int(getattr(cfg, "n_head", 0) or getattr(cfg, "num_attention_heads", 0) or 0),
                   vocab_size=int(getattr(cfg, "vocab_size", 0) or 0),
                   n_experts=int(getattr(cfg, "n_experts", 0) or 0), n_blocks=n_blocks, chain=chain,
                   input_spec=spec, seq_len=seq_len, eval_every=eval_every,
                   microbatches=microbatches, rezero=bool(getattr(cfg, "rezero", False)), shared=shared)


@dataclass(frozen=True)
class Rule:
    """A refusal: ``when(plan, facts)`` is true for what cannot run; the message is ``what: why;
    allowed: allowed`` (each may be a function of plan and facts)."""

    name: str
    when: Callable[[Plan, Facts], bool]
    what: Any
    why: Any
    allowed: Any
    short: str = ""
    """The reason in a few words, for the README matrix."""

    def message(self, plan: Plan, facts: Facts) -> str:
        def text(x: Any) -> str:
            return x(plan, facts) if callable(x) else str(x)
        return f"{text(self.what)}: {text(self.why)}; allowed: {text(self.allowed)}"


def _mp(p: Plan) -> bool:
    return p.tp > 1 or p.cp > 1 or p.ep > 1


def _remat_tree(p: Plan) -> bool:
    return p.remat.active and p.remat.method in TREE_METHODS


def _remat_ops(p: Plan) -> bool:
    return p.remat.method not in TREE_METHODS


def _dp(p: Plan, f: Facts) -> int:
    return p.dp or max(f.world // max(p.model_ranks, 1), 1)


def _offload(p: Plan) -> bool:
    return p.offload.active


def _zero_offload(p: Plan) -> bool:
    """Only the optimizer on the host (what runs with several processes: each rank its shard)."""
    o = p.offload
    return (o.optimizer == "host" and o.params == "device" and o.activations == "none" and o.recompute == "none"
            and o.plan == "manual" and not o.dpu and not o.device_budget)


def _offload_keys(p: Plan) -> str:
    from dataclasses import asdict

    from scaletrain.plan import OffloadPlan

    d, default = asdict(p.offload), asdict(OffloadPlan())
    return ", ".join(f"{k}={v}" for k, v in d.items() if v != default[k]) or "defaults"


def _chunk_keys(p: Plan) -> str:
    """The offload keys plan=chunks decides itself that the plan sets (first one), or ''."""
    from scaletrain.techniques.offload.runtime import CHUNKS_FIXED

    from scaletrain.plan import OffloadPlan

    default = OffloadPlan()
    for k in CHUNKS_FIXED:
        if getattr(p.offload, k) != getattr(default, k):
            return f"{k}={getattr(p.offload, k)}"
    return ""


RULES: list[Rule] = [
    # ---------------------------------------------------------------- data parallelism
    Rule("compression-ddp", lambda p, f: p.compression != "none" and (p.zero != 0 or _mp(p) or p.pp > 1),
         lambda p, f: f"parallel.compression={p.compression} with parallel.zero={p.zero}, tp={p.tp}, cp={p.cp}, "
                      f"ep={p.ep}, pp={p.pp}",
         "gradient compression is a DDP comm hook and runs inside torch DDP's buckets only",
         "parallel.compression with parallel.zero=0 and no tp/cp/ep/pp", "DDP comm hook only"),
    Rule("hsdp-zero", lambda p, f: p.hsdp > 0 and p.zero == 0,
         lambda p, f: f"parallel.hsdp={p.hsdp} with parallel.zero=0", "hybrid sharding shards ZeRO states",
         "parallel.zero=1, 2 or 3 with parallel.hsdp", "needs zero>=1"),
    Rule("hsdp-divides", lambda p, f: p.hsdp > 0 and _dp(p, f) % p.hsdp != 0,
         lambda p, f: f"parallel.hsdp={p.hsdp}", lambda p, f: f"it must divide the {_dp(p, f)} data-parallel ranks",
         lambda p, f: "a divisor of " + str(_dp(p, f)), "must divide dp"),
    Rule("hsdp-mp", lambda p, f: p.hsdp > 0 and (p.ep > 1 or p.cp > 1 or p.pp > 1),
         lambda p, f: f"parallel.hsdp={p.hsdp} with cp={p.cp}, ep={p.ep}, pp={p.pp}",
         "hybrid sharding splits the data-parallel ranks into the world mesh's replicate (dp_rep) and shard "
         "(dp_in) dimensions; with ep, dp_in is already the expert-parallel group (shard and expert groups would "
         "have to be the same ranks); with cp the shard groups would have to take in CP's ranks (they share "
         "parameters), and with pp be cut per stage, which the runtimes and the cost model build for data and "
         "tensor parallelism only",
         "parallel.hsdp with plain data parallelism or tp; parallel.zero=3 (flat) with cp/ep/pp",
         "with dp and tp only"),
    # ---------------------------------------------------------------- tensor / sequence / context / expert
    Rule("sp-tp", lambda p, f: p.sp and p.tp == 1, "parallel.sequence_parallel=true with parallel.tp=1",
         "sequence parallelism splits the regions tensor parallelism replicates", "parallel.tp > 1",
         "needs tp>1"),
    Rule("mp-model", lambda p, f: _mp(p) and (f.task != "lm" or not f.gpt2),
         lambda p, f: f"parallel.tp={p.tp} / cp={p.cp} / ep={p.ep}",
         "tensor, context and expert parallelism need a GPT-2-style language model (embedding, blocks, head)",
         "model.name=gpt2-* / gpt2-moe / hf:gpt2 (hf:llama / hf:mistral: tp), or data parallelism and pipelines "
         "for other models",
         "GPT-2-style LM only"),
    Rule("sp-hf", lambda p, f: p.sp and f.hf, "parallel.sequence_parallel=true on a Hugging Face GPT-2",
         "HF's position handling is inside GPT2Model.forward", "parallel.tp alone", "not for HF GPT-2"),
    Rule("tp-divides", lambda p, f: p.tp > 1 and f.gpt2 and ((f.n_head and f.n_head % p.tp)
                                                             or (f.vocab_size and f.vocab_size % p.tp)),
         lambda p, f: f"parallel.tp={p.tp}",
         lambda p, f: f"it must divide the model's n_head={f.n_head} and vocab_size={f.vocab_size}",
         lambda p, f: "tp in " + ", ".join(str(d) for d in range(1, max(f.n_head, 1) + 1)
                                             if f.n_head % d == 0 and f.vocab_size % d == 0), "must divide heads"),
    Rule("sp-moe", lambda p, f: p.sp and f.moe, "parallel.sequence_parallel=true on a mixture-of-experts model",
         "a MoE layer under TP runs whole on every TP rank; with sequence parallelism each rank would route "
         "other tokens, and the load-balancing statistics would miss the TP group's", "parallel.tp with "
         "sequence_parallel=false, or parallel.ep", "routing per TP rank"),
    Rule("sp-cp", lambda p, f: p.sp and p.cp > 1,
         lambda p, f: f"parallel.sequence_parallel=true with parallel.cp={p.cp}",
         "both split the sequence: ring attention holds each rank's 2 balanced causal chunks and Megatron-SP "
         "would cut those again over the TP group, so positions, the SP regions' all-gathers and the ring's "
         "chunks would all need the nested layout (cp x tp pieces per sequence) that neither builds",
         "parallel.tp with parallel.cp and sequence_parallel=false", "both split the sequence"),
    Rule("ep-moe", lambda p, f: p.ep > 1 and not f.moe, lambda p, f: f"parallel.ep={p.ep}",
         "expert parallelism needs a mixture-of-experts model", "model.name=gpt2-moe", "needs MoE"),
    Rule("ep-divides", lambda p, f: p.ep > 1 and f.moe and (_dp(p, f) % p.ep or (f.n_experts and f.n_experts % p.ep)),
         lambda p, f: f"parallel.ep={p.ep}",
         lambda p, f: f"it must divide the data-parallel size {_dp(p, f)} and the {f.n_experts} experts",
         "a common divisor", "must divide dp and experts"),
    Rule("cp-seq", lambda p, f: p.cp > 1 and f.seq_len % (2 * p.cp) != 0,
         lambda p, f: f"parallel.cp={p.cp} with data.seq_len={f.seq_len}",
         "the balanced causal layout cuts each sequence into 2 x cp chunks",
         lambda p, f: f"data.seq_len a multiple of {2 * p.cp}", "seq % 2cp"),
    Rule("cp-dropout", lambda p, f: p.cp > 1 and f.dropout > 0,
         lambda p, f: f"parallel.cp={p.cp} with model dropout={f.dropout}",
         "ring attention does not implement attention dropout", "model.overrides.dropout=0", "no dropout"),
    Rule("sp-seq", lambda p, f: p.sp and p.tp > 1 and f.seq_len % p.tp != 0,
         lambda p, f: f"parallel.sequence_parallel=true with data.seq_len={f.seq_len}",
         lambda p, f: f"each TP rank holds seq_len / tp={p.tp} positions",
         lambda p, f: f"data.seq_len a multiple of {p.tp}", "seq % tp"),
    Rule("zero3-ep", lambda p, f: p.zero == 3 and p.ep > 1,
         lambda p, f: f"parallel.zero=3 with parallel.ep={p.ep}",
         "expert weights are already split over the expert-parallel group; ZeRO-3 would have to shard dense "
         "parameters over all data-parallel ranks and each expert slice over the ranks holding the same experts "
         "only, two FSDP meshes in one model whose gathers FSDP2 cannot order across units",
         "parallel.zero=0, 1 or 2 with ep, or zero=3 without ep",
         "experts need a 2nd FSDP mesh"),
    # ---------------------------------------------------------------- pipelines
    Rule("pp-chain", lambda p, f: p.pp > 1 and (not f.chain or not f.input_spec),
         lambda p, f: f"parallel.pp={p.pp}", "a pipeline cuts the model's Chain of blocks and needs its input_spec",
         "a model cut into blocks (see scaletrain.chain)", "needs a Chain"),
    Rule("pp-blocks", lambda p, f: p.pp > 1 and f.chain and f.n_blocks < p.pp * _virtual(p),
         lambda p, f: f"parallel.pp={p.pp} x {_virtual(p)} stage(s) per rank",
         lambda p, f: f"the model has {f.n_blocks} blocks", lambda p, f: f"parallel.pp <= {f.n_blocks // _virtual(p)}",
         "more stages than blocks"),
    Rule("pp-zero2", lambda p, f: p.pp > 1 and p.zero == 2,
         lambda p, f: f"parallel.pp={p.pp} with parallel.zero=2",
         "a stage's gradients accumulate over micro-batches interleaved with other stages' work until its last "
         "backward, so reduce-scattering them per micro-batch (ZeRO-2) saves nothing over ZeRO-1 (DeepSpeed and "
         "Megatron-LM refuse it with pipelines too)",
         "parallel.zero=1 with pipelines (Megatron's distributed optimizer), 3 (FSDP inside the stages), or 0",
         "use zero=1 or 3"),
    Rule("pp-zero3-chimera", lambda p, f: p.pp > 1 and p.zero == 3 and p.schedule == "chimera" and f.shared,
         "parallel.zero=3 with parallel.schedule=chimera on a model with tied parameters",
         "Chimera's down and up pipelines put the first and the last stage on one rank, so a parameter they "
         "share (GPT-2's tied embedding) would sit in two FSDP units of that rank, and FSDP2 shards each "
         "parameter in exactly one", "parallel.zero=0 or 1 with chimera; zero=3 with gpipe, 1f1b, interleaved "
         "or zb1p, or with chimera on a model without tied parameters", "tied weight in 2 units"),
    Rule("pp-zero-async", lambda p, f: p.pp > 1 and p.zero in (1, 3) and p.schedule in ASYNC,
         lambda p, f: f"parallel.zero={p.zero} with parallel.schedule={p.schedule}",
         "the asynchronous schedules update inside the stream, between the reduce-scatter and all-gather "
         "a sharded optimizer (or FSDP's sharded parameters) needs", "parallel.zero=0 with pipedream / pipedream-2bw",
         "async updates"),
    Rule("pp-cp", lambda p, f: p.pp > 1 and p.cp > 1,
         lambda p, f: f"parallel.pp={p.pp} with parallel.cp={p.cp}",
         "ring attention runs per micro-batch inside every stage, so each stage's CP group would exchange K/V "
         "blocks between the pipeline's sends and receives and every boundary message would carry 1/cp of the "
         "sequence in the balanced layout; the schedules would have to order those collectives like TP's, and "
         "pipelines are meant for long models, CP for long sequences on few stages",
         "parallel.tp with pp, or parallel.cp without pp", "CP collectives inside stages"),
    Rule("pp-ep", lambda p, f: p.pp > 1 and p.ep > 1 and (p.zero not in (0, 1) or p.tp > 1),
         lambda p, f: f"parallel.ep={p.ep} with parallel.pp={p.pp}, zero={p.zero}, tp={p.tp}, "
                      f"schedule={p.schedule}, remat={p.remat.method if p.remat.active else 'none'}",
         "expert parallelism inside the stages is composed with the plain all-reduce and ZeRO-1's sharded "
         "optimizer only: with zero=3 the experts' FSDP shards would need a second FSDP mesh (as zero3-ep), and "
         "under tp a MoE layer runs whole on every TP rank, so the EP groups would have to be cut per TP index",
         "ep with pp, zero=0 or 1 and tp=1",
         "zero 0/1, tp=1"),
    Rule("pp-virtual", lambda p, f: p.pp > 1 and p.virtual > 1 and p.schedule != "interleaved",
         lambda p, f: f"parallel.virtual={p.virtual} with parallel.schedule={p.schedule}",
         "virtual stages only apply to the interleaved schedule", "parallel.virtual=0 or 1", "interleaved only"),
    Rule("pp-interleaved", lambda p, f: p.pp > 1 and p.schedule == "interleaved" and f.microbatches % p.pp != 0,
         lambda p, f: f"parallel.microbatches={f.microbatches} with parallel.schedule=interleaved",
         lambda p, f: f"the interleaved schedule runs micro-batches in rounds of parallel.pp={p.pp}",
         lambda p, f: f"a multiple of {p.pp}", "M % pp"),
    Rule("pp-chimera", lambda p, f: p.pp > 1 and p.schedule == "chimera" and (p.pp % 2 or f.microbatches % 2),
         lambda p, f: f"parallel.schedule=chimera with parallel.pp={p.pp}, parallel.microbatches={f.microbatches}",
         "Chimera pairs a down and an up pipeline", "an even parallel.pp and parallel.microbatches", "even pp, M"),
    Rule("pp-sp-zb1p", lambda p, f: p.pp > 1 and p.sp and p.schedule == "zb1p",
         "parallel.sequence_parallel=true with parallel.schedule=zb1p",
         "zb1p defers each layer's weight gradient past its input gradient; under sequence parallelism that "
         "weight gradient needs the layer's input all-gathered over the TP group, which would have to be kept "
         "until then (tp times the activations zb1p spares) or all-gathered a second time",
         "gpipe, 1f1b, interleaved, chimera, pipedream, pipedream-2bw", "W needs the SP all-gather"),
    Rule("pp-async-cuda", lambda p, f: p.pp > 1 and p.schedule in ASYNC and f.device == "cuda" and f.eval_every > 0,
         lambda p, f: f"parallel.schedule={p.schedule} on CUDA with train.eval_every={f.eval_every}",
         "NCCL matches point-to-point messages by order: evaluation between windows would meet the stream's",
         "train.eval_every=0", "eval only at end"),
    Rule("fp16-async", lambda p, f: p.pp > 1 and p.precision == "fp16" and p.schedule in ASYNC,
         lambda p, f: f"train.precision=fp16 with parallel.schedule={p.schedule}",
         "the asynchronous schedules update inside the stream, where no loss scaler can skip a step on every "
         "rank at once", "fp32, bf16 with pipedream / pipedream-2bw; fp16 with the synchronous schedules",
         "no scaler in the stream"),
    # ---------------------------------------------------------------- rematerialization
    Rule("remat-chain", lambda p, f: p.remat.active and not f.chain, "memory.remat.*",
         "rematerialization cuts the model's Chain of blocks", "a model cut into blocks (see scaletrain.chain)",
         "needs a Chain"),
    Rule("remat-pp-schedule",
         lambda p, f: p.remat.active and p.pp > 1 and (p.schedule == "zb1p" or p.schedule in ASYNC),
         lambda p, f: f"memory.remat.* with parallel.schedule={p.schedule}",
         "recomputation would undo zb1p's deferred weight gradients / ignore weight stashing",
         "parallel.schedule=gpipe, 1f1b, interleaved, chimera", "not with zb1p/async"),
    Rule("remat-ops-parallel", lambda p, f: p.remat.active and _remat_ops(p) and (
        (f.world > 1 and p.zero in (0, 3)) or _mp(p) or p.pp > 1),
         lambda p, f: f"memory.remat.method={p.remat.method} with zero={p.zero}, tp={p.tp}, cp={p.cp}, ep={p.ep}, "
                      f"pp={p.pp} on {f.world} processes",
         "its schedule drops tensors op by op and runs outside DDP/FSDP/DTensor wrappers",
         "memory.remat.method=optimal, revolve or periodic (nested checkpoints compose with everything)",
         "op-by-op schedule"),
    Rule("remat-pp-kind", lambda p, f: p.pp > 1 and (p.remat.blocks != "none" or p.remat.selective != "none"),
         lambda p, f: f"memory.remat.blocks={p.remat.blocks} / memory.remat.selective={p.remat.selective} "
                      f"with parallel.pp={p.pp}",
         "each pipeline stage rematerializes by its own solver schedule (one per stage, under the per-stage "
         "memory.remat.budget); an explicit block list or selective recompute would be silently dropped",
         "memory.remat.method=optimal, revolve or periodic with memory.remat.budget", "stages solve their own"),
    Rule("remat-stage-budgets", lambda p, f: bool(p.remat.stage_budgets) and (
        p.pp == 1 or p.remat.method == "none" or bool(p.remat.budget)),
         lambda p, f: f"memory.remat.stage_budgets={p.remat.stage_budgets} with parallel.pp={p.pp}, "
                      f"memory.remat.method={p.remat.method}, memory.remat.budget={p.remat.budget or '(empty)'}",
         "each entry is the budget of one pipeline stage's solver, in place of the one memory.remat.budget",
         "parallel.pp > 1, a memory.remat.method solver and memory.remat.budget empty", "pipeline solvers only"),
    Rule("remat-stage-count", lambda p, f: bool(p.remat.stage_budgets) and p.pp > 1 and
         len(p.remat.stage_budgets.split(",")) != p.pp * _virtual(p),
         lambda p, f: f"memory.remat.stage_budgets has {len(p.remat.stage_budgets.split(','))} entries with "
                      f"parallel.pp={p.pp} x {_virtual(p)} stage(s) per rank",
         "one budget per pipeline stage, in stage order",
         lambda p, f: f"{p.pp * _virtual(p)} comma-separated sizes", "one per stage"),
    Rule("remat-mix", lambda p, f: p.remat.method != "none" and p.remat.blocks != "none",
         lambda p, f: f"memory.remat.method={p.remat.method} with memory.remat.blocks={p.remat.blocks}",
         "a solver's schedule and an explicit block list would both decide what is kept", "one of them",
         "one of them"),
    Rule("selective-model", lambda p, f: p.remat.selective != "none" and not f.gpt2,
         "memory.remat.selective=attention", "it recomputes the attention core of GPT-2-style blocks",
         "a GPT-2-style model", "GPT-2-style only"),
    # ---------------------------------------------------------------- offloading
    Rule("offload-world", lambda p, f: _offload(p) and f.world > 1 and not (_zero_offload(p) and p.zero in (1, 2)
                                                                          and p.pp == 1),
         lambda p, f: f"memory.offload ({_offload_keys(p)}) with {f.world} processes and parallel.zero={p.zero}, "
                      f"pp={p.pp}",
         "with several processes each rank offloads its own ZeRO shard (ZeRO-Offload: fp32 masters and "
         "optimizer states on the host); weight streaming, activation offload and the joint planner run with "
         "one process", "memory.offload.optimizer=host alone with parallel.zero=1 or 2 (no pipeline), or one "
         "process", "ZeRO-Offload: optimizer=host, zero 1/2"),
    Rule("offload-remat", lambda p, f: _offload(p) and p.remat.active, "memory.remat.* with memory.offload",
         "the offload planner chooses recomputation itself", "memory.offload.recompute, memory.remat.method=none",
         "planner recomputes"),
    Rule("offload-compress", lambda p, f: _offload(p) and p.activation_compression,
         "memory.activation_compression=true with memory.offload", "both hook the tensors saved for backward",
         "one of them", "both hook saved tensors"),
    Rule("offload-fp16", lambda p, f: _offload(p) and p.precision == "fp16", "train.precision=fp16 with memory.offload",
         "gradients leave the device before a loss scaler could unscale them", "fp32, bf16", "no loss scaler"),
    Rule("offload-moe", lambda p, f: _offload(p) and f.moe, "memory.offload on a mixture-of-experts model",
         "the offload runtime does not run its auxiliary loss", "memory.offload defaults", "aux loss"),
    Rule("offload-pp", lambda p, f: _offload(p) and p.pp > 1, lambda p, f: f"memory.offload with parallel.pp={p.pp}",
         "the offload runtime runs a whole step itself (it moves parameters and saved tensors block by block "
         "around one forward and one backward), while a stage runs its blocks action by action with several "
         "micro-batches in flight; its planner would need the schedule's in-flight activations per stage",
         "memory.remat with pipelines (one solver per stage), or memory.offload without pp",
         "offload runs its own step"),
    Rule("offload-chunks-keys", lambda p, f: p.offload.plan == "chunks" and bool(_chunk_keys(p)),
         lambda p, f: f"memory.offload.plan=chunks with memory.offload.{_chunk_keys(p)}",
         "the chunk manager places parameters, gradients and optimizer states itself and keeps every activation",
         "memory.offload.plan=chunks with memory.device_budget and memory.offload.chunk_bytes (the other "
         "memory.offload keys at their defaults)", "places states itself"),
    Rule("offload-chunks-optimizer", lambda p, f: p.offload.plan == "chunks" and p.optimizer not in ("adam", "adamw"),
         lambda p, f: f"optim.name={p.optimizer} with memory.offload.plan=chunks",
         "the chunk update runs torch's Adam on flat chunks", "adam, adamw", "Adam only"),
    Rule("offload-chunks-dtype", lambda p, f: p.offload.plan == "chunks" and p.params_dtype != "fp32",
         lambda p, f: f"train.params_dtype={p.params_dtype} with memory.offload.plan=chunks",
         "chunks hold fp32 parameters, gradients and Adam moments", "fp32", "fp32 chunks"),
    Rule("compress-mp", lambda p, f: p.activation_compression and _mp(p), "memory.activation_compression=true with "
         "tp/cp/ep", "the 8-bit packing quantizes each tensor saved for backward through its storage; under "
         "tp/cp/ep the saved tensors include DTensors, whose storage is a local shard behind placements the "
         "unpacking hook would have to rebuild", "memory.activation_compression=false, or remat to spare "
         "activations", "DTensor saved tensors"),
    # ---------------------------------------------------------------- torch.compile (train.compile, .compile)
    Rule("compile-chain", lambda p, f: _compiles(p, f) and not f.chain, "train.compile=true on a model without "
         "a Chain of blocks", "torch.compile is applied per Chain block (torchtitan's per-block compile)",
         "a model scaletrain can cut into blocks (see scaletrain.chain), or train.compile=false", "needs a Chain"),
    Rule("compile-pp", lambda p, f: _compiles(p, f) and p.pp > 1, lambda p, f: f"train.compile=true with "
         f"parallel.pp={p.pp}", "a stage runs its blocks' backward in pieces the schedules choose (zb1p's deferred "
         "weight gradients, Chimera's two replicas of a stage sharing parameters, the asynchronous schedules' "
         "stashed weights), which one compiled graph per block fuses; each schedule would need its parity "
         "check under compile before it is allowed",
         "train.compile=false with pipelines", "schedules split the backward"),
    Rule("compile-offload", lambda p, f: _compiles(p, f) and _offload(p), "train.compile=true with memory.offload",
         "the offload runtime moves parameters and saved activations with hooks per block and op, which compiled "
         "graphs are not verified under", "train.compile=false with memory.offload", "not verified with offload"),
    Rule("compile-remat-ops", lambda p, f: _compiles(p, f) and _remat_ops(p),
         lambda p, f: f"train.compile=true with memory.remat.method={p.remat.method}",
         "its executor replays the blocks' operators one by one outside their forward, so the compiled graphs "
         "would never run", "memory.remat.method=optimal, revolve, periodic or blocks", "op-by-op schedule"),
    Rule("compile-parallel", lambda p, f: _compiles(p, f) and (_mp(p) or p.hsdp > 0 or p.compression != "none"),
         lambda p, f: f"train.compile=true with tp={p.tp}, cp={p.cp}, ep={p.ep}, hsdp={p.hsdp}, "
                      f"compression={p.compression}", "compiled blocks over DTensor shards, hybrid sharding or a "
         "compression hook are not verified yet (DDP and ZeRO-1/2/3 are: equal losses over 2 processes)",
         "train.compile=true with plain data parallelism or parallel.zero=1, 2, 3", "not verified yet"),
    Rule("compile-compress", lambda p, f: _compiles(p, f) and p.activation_compression,
         "train.compile=true with memory.activation_compression=true", "it packs saved tensors with autograd "
         "hooks; that they reach the tensors a compiled graph saves is not verified (the losses match, the bytes "
         "were not measured)", "one of them", "not verified with 8-bit act."),
    Rule("compile-selective", lambda p, f: _compiles(p, f) and p.remat.selective != "none",
         "train.compile=true with memory.remat.selective=attention", "dynamo cannot trace the checkpoint around "
         "the attention core (its context_fn is a nested function: NotImplementedError in torch's dynamo)",
         "memory.remat.blocks or memory.remat.method with train.compile", "dynamo cannot trace it"),
    Rule("compile-sweep", lambda p, f: _compiles(p, f) and f.sweep, "train.compile=true in a sweep",
         "the sweep runs shards of blocks in worker processes of its own", "train.compile=false",
         "sweep runs its shards"),
    # ---------------------------------------------------------------- a run of a sweep (spilled shards)
    Rule("sweep-parallel", lambda p, f: f.sweep and (p.model_ranks > 1 or p.pp > 1 or (p.dp or 1) > 1 or p.zero
                                                      or p.compression != "none"),
         "parallel.* in a sweep", "a sweep's parallelism is its shards on the shared devices",
         "no parallel.* keys (set --nproc-per-node on the sweep)", "shards are the parallelism"),
    Rule("sweep-memory", lambda p, f: f.sweep and (p.remat.active or replace(p.offload, device_budget="").active),
         "memory.remat.* / memory.offload.* in a sweep", "the sweep spills each shard's activations and keeps "
         "parameters and optimizer states on the host itself", "memory.device_budget alone", "sweep spills itself"),
    Rule("sweep-precision", lambda p, f: f.sweep and (p.precision == "fp16" or p.params_dtype != "fp32"),
         lambda p, f: f"train.precision={p.precision}, train.params_dtype={p.params_dtype} in a sweep",
         "the host keeps fp32 parameters and gradients and no loss scaler sees the spilled shards",
         "train.precision=fp32 or bf16 with train.params_dtype=fp32", "fp32/bf16 only"),
    Rule("sweep-moe", lambda p, f: f.sweep and f.moe, "a mixture-of-experts model in a sweep",
         "its load-balancing loss is added across blocks, which shards cannot carry", "a dense model", "aux loss"),
    Rule("sweep-cuda", lambda p, f: f.sweep and f.device == "cuda", "train.device=cuda in a sweep",
         "the sweep's devices are CPU worker processes with byte-budgeted pools in this version (no GPU worker yet)",
         "train.device=cpu or auto on a machine without a GPU", "CPU devices only"),
    Rule("sweep-chain", lambda p, f: f.sweep and not f.chain, "a sweep of a model without a Chain of blocks",
         "shards are runs of Chain blocks", "a model scaletrain can cut into blocks (see scaletrain.chain)",
         "needs a Chain"),
    Rule("rezero-tp", lambda p, f: f.rezero and (p.tp > 1 or p.cp > 1),
         lambda p, f: f"model.overrides.rezero=true with parallel.tp={p.tp}, parallel.cp={p.cp}",
         "the tensor/sequence-parallel plan and the mesh cost faces name each block's LayerNorms (ln_1, ln_2), "
         "which ReZero drops, and a replicated alpha under TP is not verified",
         "rezero with data parallelism, ZeRO or pipelines (alpha is a one-element parameter like any other)",
         "ReZero drops the LayerNorms TP names"),
    # ---------------------------------------------------------------- zero-order training (no backward)
    Rule("zero-order", lambda p, f: _zero_order(p) and (
        f.world > 1 or p.pp > 1 or _mp(p) or p.zero or p.remat.active or p.offload.active or p.activation_compression
        or p.precision == "fp16" or p.params_dtype != "fp32" or f.sweep or f.moe),
         lambda p, f: f"optim.name={p.optimizer} with world={f.world}, pp={p.pp}, tp={p.tp}, zero={p.zero}, "
                      f"precision={p.precision}, params_dtype={p.params_dtype}"
                      + (", remat" if p.remat.active else "") + (", offload" if p.offload.active else "")
                      + (", 8-bit activations" if p.activation_compression else "") + (", MoE" if f.moe else ""),
         "a zero-order step runs two forwards and no backward: remat, activation offload/compression and the fp16 "
         "loss scaler act on a backward that never runs; pipelines, TP/ZeRO shards and DDP would need the seed "
         "shared and the two losses all-reduced (MeZO's data parallelism), which is not implemented; a MoE's "
         "load-balancing loss needs gradients", lambda p, f: f"optim.name={p.optimizer} with one process, fp32 or "
         "bf16, no memory.* techniques", "one process, forwards only"),
    # ---------------------------------------------------------------- precision
    Rule("params-dtype", lambda p, f: p.params_dtype != "fp32" and (
        p.pp > 1 or _mp(p) or _offload(p) or (f.world > 1 and p.zero not in (1, 2))),
         lambda p, f: f"train.params_dtype={p.params_dtype} with pp={p.pp}, tp={p.tp}, cp={p.cp}, ep={p.ep}, "
                      f"zero={p.zero}" + (", offload" if _offload(p) else ""),
         "16-bit parameter storage with fp32 masters runs with one process or ZeRO-1/2",
         "train.params_dtype=fp32 with train.precision=bf16 there", "1 process or zero 1/2"),
]


def _zero_order(p: Plan) -> bool:
    from scaletrain.techniques.optim.zero_order import is_zero_order

    return is_zero_order(p.optimizer)


def _compiles(p: Plan, f: Facts) -> bool:
    from scaletrain.techniques.compile import resolve

    return resolve(p.compile, f.device)


def _virtual(p: Plan) -> int:
    return p.stages_per_rank


def violations(plan: Plan, facts: Facts) -> list[Rule]:
    """Every rule ``plan`` breaks on ``facts`` (empty: the stack runs it)."""
    return [r for r in RULES if r.when(plan, facts)]


def check(plan: Plan, facts: Facts) -> None:
    """Raise a one-line ConfigError for the first rule the plan breaks."""
    bad = violations(plan, facts)
    if bad:
        raise ConfigError(bad[0].message(plan, facts))


# --------------------------------------------------------------------------- the README matrix

FEATURES: dict[str, dict[str, Any]] = {
    "DDP": {"dp": 2},
    "ZeRO-1": {"dp": 2, "zero": 1},
    "ZeRO-2": {"dp": 2, "zero": 2},
    "ZeRO-3": {"dp": 2, "zero": 3},
    "HSDP": {"dp": 4, "zero": 3, "hsdp": 2},
    "compression": {"dp": 2, "compression": "powersgd"},
    "TP": {"tp": 2},
    "TP+SP": {"tp": 2, "sp": True},
    "CP": {"cp": 2},
    "EP": {"dp": 2, "ep": 2},
    "PP": {"pp": 2, "schedule": "1f1b"},
    "PP zb1p": {"pp": 2, "schedule": "zb1p"},
    "PP async": {"pp": 2, "schedule": "pipedream-2bw"},
    "remat": {"remat": {"method": "optimal", "budget": "1MiB"}},
    "remat ilp/dtr": {"remat": {"method": "ilp", "budget": "1MiB"}},
    "selective": {"remat": {"selective": "attention"}},
    "act offload": {"offload": {"activations": "all"}},
    "opt offload": {"offload": {"optimizer": "host"}},
    "8-bit act.": {"activation_compression": True},
    "bf16": {"precision": "bf16"},
    "fp16": {"precision": "fp16"},
    "bf16 params": {"params_dtype": "bf16", "precision": "bf16"},
    "compile": {"compile": "true"},
}
"""One minimal plan per technique, combined pairwise for the matrix."""


def _combine(a: dict[str, Any], b: dict[str, Any]) -> tuple[Plan, Facts]:
    merged: dict[str, Any] = {}
    for d in (a, b):
        for k, v in d.items():
            if k in ("remat", "offload") and k in merged:
                merged[k] = {**merged[k], **v}
            elif k in ("dp", "tp", "cp", "pp", "ep"):
                merged[k] = max(merged.get(k, 1), v)
            else:
                merged[k] = v
    if "ep" in merged:
        merged["dp"] = max(merged.get("dp", 1), merged["ep"])
    if merged.get("hsdp"):
        merged["dp"] = max(merged.get("dp", 1), 4)
    plan = Plan().with_(**merged)
    moe = "ep" in merged
    facts = Facts(world=plan.world(), moe=moe, n_experts=4 if moe else 0, microbatches=4)
    return plan, facts


def matrix() -> tuple[list[str], list[list[str]], list[str]]:
    """(feature names, rows of cells, footnotes): a cell is ✓ or a footnote number."""
    names = list(FEATURES)
    notes: list[str] = []
    rows = []
    for a in names:
        row = []
        for b in names:
            plan, facts = _combine(FEATURES[a], FEATURES[b])
            bad = violations(plan, facts)
            if not bad:
                row.append("✓")
                continue
            r = bad[0]
            note = f"{r.name}: {r.short or r.why}"
            if note not in notes:
                notes.append(note)
            row.append(str(notes.index(note) + 1))
        rows.append(row)
    return names, rows, notes


def matrix_markdown() -> str:
    """The matrix as a Markdown table with numbered reasons (what the README shows)."""
    names, rows, notes = matrix()
    head = "| | " + " | ".join(f"{i + 1}" for i in range(len(names))) + " |"
    sep = "|---|" + "---|" * len(names)
    lines = [head, sep]
    for i, (n, row) in enumerate(zip(names, rows)):
        lines.append(f"| {i + 1} {n} | " + " | ".join(row) + " |")
    lines.append("")
    lines.append("Refused (rule: reason; `scaletrain train` prints the full line):")
    lines.append("")
    lines += [f"{i + 1}. {n}" for i, n in enumerate(notes)]
    return "\n".join(lines)


__all__ = ["Facts", "RULES", "Rule", "check", "matrix", "matrix_markdown", "violations"]


def check_config(cfg: Any, model: Any, *, world: int, microbatches: int = 0, device: str = "cpu") -> None:
    """:func:`check` for a :class:`~scaletrain.train.config.Config` and a model (``microbatches``:
    the resolved count per step, for the pipeline rules)."""
    plan = Plan.from_config(cfg).resolved(world)
    m = microbatches or cfg.parallel.microbatches
    check(plan, Facts.of(model, world=world, device=device, seq_len=cfg.data.seq_len,
                         eval_every=cfg.train.eval_every, microbatches=m))

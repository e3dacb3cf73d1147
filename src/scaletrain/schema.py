"""The plan keys, each declared once: its config key, type, default, allowed values, unit and help.

A plan key says *how* a model is trained (mesh, micro-batching, schedule, remat, offload, precision,
optimizer). Everything else that speaks of plan keys is derived from :data:`KEYS`:

- the config (:mod:`scaletrain.train.config`): its sections take their plan-key fields from
  :func:`config_fields` (help, unit, choices and range as ``opt`` metadata), so TOML, overrides and
  ``scaletrain train --help`` validate and document them from here;
- the :class:`scaletrain.plan.Plan` value and its ``PLAN_KEYS`` (plan field -> config key), via
  :func:`plan_fields`;
- what ``plan=auto`` and ``scaletrain plan --fix`` may choose or pin (:attr:`Key.planner`) and the
  planner's remat vocabulary (:data:`REMAT_KINDS`);
- ``scaletrain estimate``'s plan flags (their help and default);
- the pipeline schedules (:data:`SCHEDULES`, :data:`ASYNC_SCHEDULES`) that the config, the pipeline
  package and the compatibility table name;
- the offload runtime's checks (:func:`check`).

Adding a plan key is one :class:`Key` row here; the technique that reads it reads ``plan.<field>``.
This module sits at the bottom (it imports only :mod:`scaletrain.errors`) so every layer may read it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

from scaletrain.errors import ConfigError

MAX_INT = 2**53
"""Largest integer any config field takes unless it states its own ``max``: JSON and float arithmetic hold it
exactly, and no count of steps, samples or ranks comes near it."""


def opt(default: Any, help: str, unit: str = "", choices: tuple | None = None, min: float | None = None,
        max: float | None = None, words: tuple = ()) -> Any:
    """A documented config field (``help`` says what it does, ``unit`` its unit; ``words``: the values a
    ``bytes`` field takes besides sizes)."""
    meta = {"help": help, "unit": unit, "choices": choices, "min": min, "max": max, "words": words}
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


def section(cls: type, help: str) -> Any:
    """A config field holding a section (a dataclass of fields)."""
    return field(default_factory=cls, metadata={"help": help, "section": True})


def check_value(path: str, value: Any, choices: tuple | None = None, lo: float | None = None,
                hi: float | None = None) -> None:
    """ConfigError in one line when ``value`` is not one of ``choices`` or outside ``[lo, hi]`` (the
    one wording of every plan and config value check)."""
    if choices and value not in choices:
        raise ConfigError(f"{path}={value!r} is not allowed; allowed: {', '.join(map(str, choices))}")
    if lo is not None and value < lo:
        raise ConfigError(f"{path}={value!r} is not allowed; must be >= {lo}")
    if hi is not None and value > hi:
        raise ConfigError(f"{path}={value!r} is not allowed; must be <= {hi}")


SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb1p", "chimera", "pipedream", "pipedream-2bw")
"""Pipeline schedules (``parallel.schedule``) the pipeline package builds."""
ASYNC_SCHEDULES = ("pipedream", "pipedream-2bw")
"""The asynchronous ones: weights updated between micro-batches (PipeDream's weight stashing / 2BW)."""

PLANNER_ROLES = ("searched", "pinned", "kept", "")
"""What the planners do with a key (:attr:`Key.planner`)."""


@dataclass(frozen=True)
class Key:
    """One plan key. ``field`` is its name in :class:`scaletrain.plan.Plan` (``remat.method`` for the
    nested ones), ``path`` its dotted config key. The type is the default's."""

    field: str
    path: str
    default: Any
    help: str
    unit: str = ""
    choices: tuple | None = None
    min: float | None = None
    max: float | None = None
    words: tuple = ()
    """Values a ``bytes`` key takes besides sizes (``auto``)."""
    planner: str = ""
    """searched: ``plan=auto`` and ``scaletrain plan`` choose it and a user may pin it (``--fix``, or setting it
    under ``plan=auto``); pinned: not searched, ``--fix`` may pin it, ``plan=auto`` refuses it; kept: the
    user's, kept as given by ``plan=auto``; '': ``plan=auto`` refuses a value away from the default."""

    @property
    def type(self) -> type:
        return type(self.default)

    @property
    def name(self) -> str:
        """The last part of the config key (the config field's name)."""
        return self.path.rsplit(".", 1)[-1]

    def config_field(self) -> Any:
        """The config dataclass field (an :func:`opt`) for this key."""
        return opt(self.default, self.help, self.unit, self.choices, self.min, self.max, self.words)

    def check(self, value: Any) -> Any:
        """``value`` if it is allowed (choices and range), else ConfigError in one line naming the config key."""
        check_value(self.path, value, self.choices, self.min, self.max)
        return value


_P, _M, _O, _R = "parallel.", "memory.", "memory.offload.", "memory.remat."
_BYTES = "bytes"
BYTES_LIST = "bytes per stage"
"""Unit of a comma-separated list of sizes (each read as a ``bytes`` value)."""

KEYS: tuple[Key, ...] = (
    # ---------------------------------------------------------------- data parallelism
    Key("dp", _P + "dp", 0, "data-parallel ranks; 0 = every process the launcher started (torchrun "
        "--nproc-per-node / scaletrain train --nproc-per-node)", "processes", min=0, planner="searched"),
    Key("zero", _P + "zero", 0, "ZeRO stage: 0 = DDP (replicated, bucketed all-reduce overlapped with backward), "
        "1 = + optimizer states sharded, 2 = + gradients sharded (reduce-scatter), 3 = + parameters sharded (FSDP2, "
        "gathered per block with prefetch)", "stage", min=0, max=3, planner="searched"),
    Key("hsdp", _P + "hsdp", 0, "hybrid sharding for zero>=1: shard within groups of this many ranks, replicate "
        "across groups; 0 = shard over all dp ranks", "ranks", min=0, planner="searched"),
    Key("compression", _P + "compression", "none", "gradient compression for zero=0: powersgd (low rank), topk "
        "(sparsification), onebit (scaled sign); all with error feedback",
        choices=("none", "powersgd", "topk", "onebit")),
    Key("compression_rank", _P + "compression_rank", 4, "PowerSGD rank r of the low-rank approximation", "rank",
        min=1, planner="kept"),
    Key("topk_ratio", _P + "topk_ratio", 0.01, "top-k: fraction of gradient entries sent per bucket", "fraction",
        min=0.0, max=1.0, planner="kept"),
    Key("compression_warmup_steps", _P + "compression_warmup_steps", 10, "uncompressed steps before compression "
        "starts (1-bit Adam / DGC warm-up; PowerSGD needs at least 2)", "optimizer steps", min=0, planner="kept"),
    Key("bucket_mb", _P + "bucket_mb", 25.0, "gradient bucket size for all-reduce / reduce-scatter (zero 0-2)",
        "MiB", min=0.0, planner="kept"),
    Key("fsdp_group", _P + "fsdp_group", "auto", "zero=3: consecutive blocks one FSDP all-gather / reduce-scatter "
        "moves: auto (the size the cost model prices fastest), block (one group per block), or a size limit such "
        "as 8MiB; the planner searches it (the fastest grouping that fits its device)", _BYTES,
        words=("auto", "block"), planner="searched"),
    # ---------------------------------------------------------------- model parallelism
    Key("tp", _P + "tp", 1, "tensor-parallel ranks (Megatron column/row parallel, vocab-parallel loss)", "ranks",
        min=1, planner="searched"),
    Key("sp", _P + "sequence_parallel", False, "Megatron sequence parallelism inside the tensor-parallel group "
        "(tp > 1)", planner="searched"),
    Key("cp", _P + "cp", 1, "context-parallel ranks: ring attention over sequence chunks", "ranks", min=1,
        planner="searched"),
    Key("ep", _P + "ep", 1, "expert-parallel ranks for mixture-of-experts layers (divides dp)", "ranks", min=1,
        planner="searched"),
    Key("pp", _P + "pp", 1, "pipeline-parallel stages (ranks); world = dp x pp x tp x cp", "ranks", min=1,
        planner="searched"),
    Key("schedule", _P + "schedule", "1f1b", "pipeline schedule (parallel.pp > 1)", choices=SCHEDULES,
        planner="searched"),
    Key("microbatches", _P + "microbatches", 0, "pipeline micro-batches per optimizer step; 0 = global_batch / "
        "(dp x micro_batch)", "micro-batches", min=0),
    Key("virtual", _P + "virtual", 0, "pipeline stages per rank (interleaved); 0 = 2 for interleaved, else 1",
        "stages", min=0, planner="searched"),
    Key("balance", _P + "balance", "profile", "pipeline stage split: profile (memory-aware partitioner over the "
        "estimated profile) or equal (equal block counts)", choices=("profile", "equal"), planner="kept"),
    Key("micro_batch", "train.micro_batch", 0, "samples per forward/backward on one device; 0 = global_batch / "
        "data-parallel size", "samples", min=0, planner="searched"),
    # ---------------------------------------------------------------- memory
    Key("remat.method", _R + "method", "none", "rematerialization schedule",
        choices=("none", "periodic", "revolve", "optimal", "ilp", "dtr")),
    Key("remat.budget", _R + "budget", "", "memory budget for activations of a step (with parallel.pp > 1: of one "
        "micro-batch in one stage): bytes or a string like '1.5GiB'; empty = none", _BYTES),
    Key("remat.stage_budgets", _R + "stage_budgets", "", "parallel.pp > 1: one memory.remat.budget per pipeline "
        "stage, comma-separated in stage order (pp x virtual entries), e.g. '900MiB,1.2GiB': each stage's solver "
        "gets its own stage's slack (what scaletrain plan writes); empty = memory.remat.budget for every stage",
        BYTES_LIST),
    Key("remat.blocks", _R + "blocks", "none", "blocks recomputed whole in the backward (activation checkpointing "
        "of chosen Chain blocks, as torchtitan's full AC): none, all, or a list like '1,3,5'"),
    Key("remat.selective", _R + "selective", "none", "selective recompute: attention = recompute the attention "
        "core (QK^T, softmax, dropout, x V) of every transformer block, keep the rest (Korthikanti et al. 2022)",
        choices=("none", "attention")),
    Key("activation_compression", _M + "activation_compression", False, "store tensors saved for backward as "
        "8-bit per-channel (ActNN-style)"),
    Key("offload.plan", _O + "plan", "manual", "manual: use the keys below; auto: the joint offload + recompute "
        "planner chooses them; chunks: PatrickStar's chunk manager (parameters, gradients and Adam states in "
        "equal-size chunks placed on the device or the host by the warm-up step's measured use, evicting the "
        "chunk used farthest ahead; the keys below stay at their defaults)", choices=("manual", "auto", "chunks")),
    Key("offload.chunk_bytes", _O + "chunk_bytes", "auto", "memory.offload.plan=chunks: bytes of one chunk, e.g. "
        "'4MiB' (at least the largest parameter's fp32 bytes); auto = the size between the largest parameter and twice "
        "it that pads least (PatrickStar's chunk size search)", _BYTES,
        words=("auto",)),
    Key("offload.activations", _O + "activations", "none", "blocks whose saved tensors go to host memory: none, "
        "all, or a list like '0,3,5'"),
    Key("offload.recompute", _O + "recompute", "none", "blocks recomputed in backward (checkpointed): none, all, "
        "or a list"),
    Key("offload.prefetch", _O + "prefetch", 1, "offloaded activations are fetched this many blocks ahead of "
        "their backward", "blocks", min=0),
    Key("offload.params", _O + "params", "device", "device: parameters stay on the device; host: streamed block "
        "by block (L2L / ZeRO-Infinity)", choices=("device", "host")),
    Key("offload.param_window", _O + "param_window", 1, "streamed weights: blocks fetched ahead of the one "
        "computing", "blocks", min=0),
    Key("offload.optimizer", _O + "optimizer", "device", "where optimizer states and fp32 masters live: device, "
        "host (ZeRO-Offload: Adam on the CPU), disk (ZeRO-Infinity NVMe tier)", choices=("device", "host", "disk")),
    Key("offload.dpu", _O + "dpu", False, "delayed parameter update: the host update overlaps the next step "
        "(weights 1 step stale)"),
    Key("offload.host_budget", _O + "host_budget", "", "host memory the plan may use: bytes or '64GiB'; empty = "
        "the platform's", _BYTES),
    Key("offload.disk_dir", _O + "disk_dir", "", "directory for the disk tier's files; empty = the system temp "
        "dir", "path"),
    Key("offload.disk_max_bytes", _O + "disk_max_bytes", "", "largest size the disk tier may use; empty = the "
        "free space", _BYTES),
    Key("offload.disk_chunk_bytes", _O + "disk_chunk_bytes", "4MiB", "disk tier read/update/write chunk per state "
        "tensor", _BYTES),
    Key("offload.disk_masters", _O + "disk_masters", False, "keep the fp32 master weights on disk too"),
    Key("offload.strict", _O + "strict", True, "CPU logical device: fail like a GPU would when the device budget "
        "is exceeded"),
    Key("offload.device_budget", _M + "device_budget", "", "device memory a plan may use (parameters, gradients, "
        "states, activations): bytes or '1.5GiB'; empty = the whole device. Used by memory.offload", _BYTES),
    # ---------------------------------------------------------------- numerics and optimizer
    Key("precision", "train.precision", "fp32", "compute precision: fp32, bf16 (autocast), fp16 (autocast + "
        "dynamic loss scaling)", choices=("fp32", "bf16", "fp16"), planner="kept"),
    Key("params_dtype", "train.params_dtype", "fp32", "storage dtype of parameters and gradients: fp32, or "
        "bf16/fp16 with fp32 master weights kept by the optimizer (2 + 2 + 4 + K bytes per parameter; one process "
        "or parallel.zero=1/2)", choices=("fp32", "bf16", "fp16"), planner="pinned"),
    Key("optimizer", "optim.name", "adamw", "optimizer",
        choices=("adamw", "adam", "sgd", "adamw8bit", "adam8bit", "adafactor", "came", "lamb", "lars", "zo-sgd",
                 "zo-adam"),
        planner="kept"),
    Key("compile", "train.compile", "false", "torch.compile each block of the model (after TP/remat, before "
        "DDP/FSDP, as torchtitan): true, false, auto (compile on CUDA only: on a CPU the tens of seconds of "
        "compiling outweigh what it saves); the first step pays the compile time",
        choices=("false", "true", "auto")),
)
"""Every plan key, once. Order: the order of ``Plan.to_flat()`` and of error messages listing them."""

BY_FIELD: dict[str, Key] = {k.field: k for k in KEYS}
"""Plan field (``remat.method``) -> its key."""
BY_PATH: dict[str, Key] = {k.path: k for k in KEYS}
"""Dotted config key (``memory.remat.method``) -> its key."""

REMAT_KINDS: dict[str, dict[str, str]] = {
    "none": {},
    "selective": {"remat.selective": "attention"},
    "full": {"remat.blocks": "all"},
}
"""The planners' remat vocabulary (``--fix remat=KIND``, ``plan=auto``): each kind as the plan keys it sets."""


def searched() -> tuple[str, ...]:
    """Plan fields the planners choose (and a user may pin)."""
    return tuple(k.field for k in KEYS if k.planner == "searched")


def kept() -> frozenset[str]:
    """Plan fields ``plan=auto`` keeps as the user gave them."""
    return frozenset(k.field for k in KEYS if k.planner == "kept")


def pinnable() -> tuple[str, ...]:
    """Plan fields ``scaletrain plan --fix`` may pin: the searched ones and those only pinned."""
    return tuple(k.field for k in KEYS if k.planner in ("searched", "pinned"))


def check(field_name: str, value: Any) -> Any:
    """``value`` of plan field ``field_name`` if allowed, else ConfigError in one line (:meth:`Key.check`)."""
    return BY_FIELD[field_name].check(value)


def _add_fields(cls: type, fields: list[tuple[str, type, Any]], after: str | None) -> type:
    """Insert ``(name, type, default)`` fields into ``cls``'s annotations (before ``@dataclass`` sees them),
    at the start or after the field ``after``."""
    own = dict(cls.__dict__.get("__annotations__", {}))
    new: dict[str, Any] = {}
    if after is None:
        new.update({n: t for n, t, _ in fields})
    for name, typ in own.items():
        new[name] = typ
        if name == after:
            new.update({n: t for n, t, _ in fields})
    if after is not None and after not in own:
        raise TypeError(f"{cls.__name__} has no field {after!r} to place the plan keys after")
    for name, _, default in fields:
        setattr(cls, name, default)
    cls.__annotations__ = new
    return cls


def config_fields(section_path: str, after: str | None = None) -> Callable[[type], type]:
    """Class decorator (under ``@dataclass``): the plan keys of config section ``section_path``
    (``parallel``, ``memory.remat``) as documented config fields, at the start or after ``after``."""
    def add(cls: type) -> type:
        rows = [(k.name, k.type, k.config_field()) for k in KEYS if k.path.rsplit(".", 1)[0] == section_path]
        return _add_fields(cls, rows, after)
    return add


def plan_fields(prefix: str = "") -> Callable[[type], type]:
    """Class decorator (under ``@dataclass``): the plan fields named ``prefix + name`` (no further dot) as
    plain fields with the declared defaults, before the class's own (nested plans)."""
    def add(cls: type) -> type:
        rows = [(k.field[len(prefix):], k.type, dataclasses.field(default=k.default)) for k in KEYS
                if k.field.startswith(prefix) and "." not in k.field[len(prefix):]]
        return _add_fields(cls, rows, None)
    return add

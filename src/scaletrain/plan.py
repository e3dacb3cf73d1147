"""How to train: one frozen, serialisable :class:`Plan`.

A plan says *how* a model is trained — the mesh (data, ZeRO/HSDP, tensor + sequence, context,
expert and pipeline parallelism), micro-batching and pipeline schedule, rematerialization,
offloading, precision and optimizer — and nothing about *what* (model, data, steps, learning
rate). It is pure data: techniques read it, :mod:`scaletrain.techniques.compat` decides whether it
combines, :mod:`scaletrain.techniques.stack` applies it, :mod:`scaletrain.techniques.cost` prices it.

One schema. Every plan field *is* a config key, declared once in :mod:`scaletrain.schema`
(:data:`PLAN_KEYS`: plan field -> dotted config key), so a plan file is a config file restricted to
those keys (``[parallel]``, ``[memory]``, ``train.precision`` ...), validated by the config schema with
its one-line errors, and ``scaletrain train --plan FILE`` is the same as giving those keys. JSON (``to_dict``) uses the
flat field names (``dp``, ``tp``, ``pp``, ``zero``, ``micro_batch``, ``remat``, ``offload`` ...).
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scaletrain import schema
from scaletrain.errors import ConfigError


@dataclass(frozen=True)
@schema.plan_fields("remat.")
class RematPlan:
    """Rematerialization (``memory.remat.*``): a solver and its budget, explicit blocks, or
    Megatron's selective recompute of the attention core. Fields: the ``remat.*`` keys of
    :mod:`scaletrain.schema`."""

    @property
    def active(self) -> bool:
        return self.method != "none" or self.blocks != "none" or self.selective != "none"

    @classmethod
    def of_kind(cls, kind: str) -> "RematPlan":
        """The plan of a planner remat kind (none, selective, full: :data:`scaletrain.schema.REMAT_KINDS`)."""
        return cls(**{f.split(".", 1)[1]: v for f, v in schema.REMAT_KINDS[kind].items()})


@dataclass(frozen=True)
@schema.plan_fields("offload.")
class OffloadPlan:
    """Offloading (``memory.offload.*`` and ``memory.device_budget``). Fields: the ``offload.*`` keys of
    :mod:`scaletrain.schema`."""

    @property
    def active(self) -> bool:
        """Any key differs from its default (as ``scaletrain train`` has always read it)."""
        return self != OffloadPlan()


@dataclass(frozen=True)
@schema.plan_fields()
class Plan:
    """How to train (see the module docstring). Degrees are ranks; 0 for ``dp`` means "every
    process left once pp x tp x cp are placed". Fields: the top-level keys of :mod:`scaletrain.schema`
    (``dp``, ``zero``, ``tp``, ``schedule``, ``precision``, ``optimizer``, ``compile`` ...) and the two
    nested plans."""

    remat: RematPlan = field(default_factory=RematPlan)
    offload: OffloadPlan = field(default_factory=OffloadPlan)

    # -------------------------------------------------------------- derived
    def world(self, dp: int | None = None) -> int:
        """Processes the plan needs: dp x pp x tp x cp (``dp`` given when the plan leaves it to the launcher)."""
        return (dp if dp is not None else max(self.dp, 1)) * self.pp * self.tp * self.cp

    @property
    def stages_per_rank(self) -> int:
        """Pipeline stages each pipeline rank runs: ``virtual``, or its default (2 interleaved, else 1)."""
        return self.virtual if self.virtual else (2 if self.schedule == "interleaved" else 1)

    @property
    def model_ranks(self) -> int:
        """Ranks one model replica spans: pp x tp x cp."""
        return self.pp * self.tp * self.cp

    def resolved(self, world: int) -> "Plan":
        """The plan with ``dp`` filled in for ``world`` processes (ConfigError if they do not divide)."""
        if world % self.model_ranks:
            raise ConfigError(f"parallel.pp={self.pp} x parallel.tp={self.tp} x parallel.cp={self.cp} = "
                              f"{self.model_ranks} must divide the {world} process(es) started; launch with "
                              f"`scaletrain train --nproc-per-node {self.model_ranks * max(self.dp, 1)} ...`")
        dp = world // self.model_ranks
        if self.dp and self.dp != dp:
            split = (f" and pp x tp x cp = {self.model_ranks} leaves {dp} data-parallel replicas"
                     if self.model_ranks > 1 else "")
            raise ConfigError(f"parallel.dp={self.dp} but {world} process(es) were started{split}; launch with "
                              f"`scaletrain train --nproc-per-node {self.dp * self.model_ranks} ...` or torchrun, "
                              f"or set parallel.dp=0")
        return dataclasses.replace(self, dp=dp)

    def memory_parts(self) -> list[str]:
        """The rematerialization and offloading the plan does, one phrase each (empty when none)."""
        parts = []
        r = self.remat
        if r.method != "none":
            parts.append(f"remat {r.method}" + (f" {r.budget}" if r.budget else "")
                         + (f" per stage {r.stage_budgets}" if r.stage_budgets else ""))
        if r.blocks != "none":
            parts.append(f"remat blocks {r.blocks}")
        if r.selective != "none":
            parts.append(f"selective remat ({r.selective})")
        if self.offload.active:
            o = self.offload
            bits = [k for k, on in ((o.plan, o.plan in ("auto", "chunks")),
                                    (f"params {o.params}", o.params != "device"),
                                    (f"optimizer {o.optimizer}", o.optimizer != "device"),
                                    (f"activations {o.activations}", o.activations != "none"),
                                    (f"recompute {o.recompute}", o.recompute != "none"), ("dpu", o.dpu)) if on]
            parts.append("offload " + ", ".join(bits or ["(budget)"])
                         + (f" under device budget {o.device_budget}" if o.device_budget else ""))
        return parts

    def describe(self) -> str:
        """One line naming every technique the plan uses (for the run header and reports)."""
        parts = [f"dp={max(self.dp, 1)}"]
        if self.zero:
            parts.append(f"zero={self.zero}" + (f" (hsdp {self.hsdp})" if self.hsdp else ""))
        if self.compression != "none":
            parts.append(f"{self.compression} compression")
        if self.tp > 1:
            parts.append(f"tp={self.tp}" + (" +sp" if self.sp else ""))
        if self.cp > 1:
            parts.append(f"cp={self.cp}")
        if self.ep > 1:
            parts.append(f"ep={self.ep}")
        if self.pp > 1:
            parts.append(f"pp={self.pp} {self.schedule}" + (f" x{self.virtual}" if self.virtual > 1 else ""))
        parts += self.memory_parts()
        if self.activation_compression:
            parts.append("8-bit activations")
        parts.append(self.precision + (f" params {self.params_dtype}" if self.params_dtype != "fp32" else ""))
        parts.append(self.optimizer)
        if self.compile != "false":
            parts.append("compiled" if self.compile == "true" else "compile auto")
        return ", ".join(parts)

    # -------------------------------------------------------------- the one schema
    @classmethod
    def from_config(cls, cfg: Any) -> "Plan":
        """The plan part of a :class:`scaletrain.train.config.Config` (field by field, :data:`PLAN_KEYS`)."""
        def get(key: str) -> Any:
            obj = cfg
            for part in key.split("."):
                obj = getattr(obj, part)
            return obj

        flat = {name: get(key) for name, key in PLAN_KEYS.items()}
        return cls.from_flat(flat)

    @classmethod
    def from_flat(cls, flat: dict[str, Any]) -> "Plan":
        remat = RematPlan(**{k.split(".", 1)[1]: v for k, v in flat.items() if k.startswith("remat.")})
        off = OffloadPlan(**{k.split(".", 1)[1]: v for k, v in flat.items() if k.startswith("offload.")})
        top = {k: v for k, v in flat.items() if "." not in k}
        return cls(**top, remat=remat, offload=off)

    def to_flat(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if dataclasses.is_dataclass(v):
                out.update({f"{f.name}.{k}": x for k, x in dataclasses.asdict(v).items()})
            else:
                out[f.name] = v
        return out

    def to_config_dict(self) -> dict[str, Any]:
        """Nested config sections (``{"parallel": {...}, "memory": {...}, ...}``), only keys that
        differ from the defaults: what a plan file holds."""
        default = Plan().to_flat()
        out: dict[str, Any] = {}
        for name, value in self.to_flat().items():
            if value == default[name]:
                continue
            d = out
            *path, last = PLAN_KEYS[name].split(".")
            for p in path:
                d = d.setdefault(p, {})
            d[last] = value
        return out

    def overrides(self) -> list[str]:
        """``section.key=value`` strings that put this plan into a config (non-default keys)."""
        out = []
        for name, value in self.to_flat().items():
            if value != Plan().to_flat()[name]:
                out.append(f"{PLAN_KEYS[name]}={toml_value(value)}")
        return out

    def to_toml(self) -> str:
        import tomli_w

        return tomli_w.dumps(self.to_config_dict())

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: flat degrees, ``remat`` and ``offload`` as objects."""
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    def with_(self, **changes: Any) -> "Plan":
        """A copy with fields changed (``remat=`` / ``offload=`` accept dicts of their fields)."""
        for k in ("remat", "offload"):
            if isinstance(changes.get(k), dict):
                changes[k] = dataclasses.replace(getattr(self, k), **changes[k])
        return dataclasses.replace(self, **changes)


PLAN_KEYS: dict[str, str] = {k.field: k.path for k in schema.KEYS}
"""Plan field (``remat.method`` for nested ones) -> dotted config key: the plan is this part of the config."""


def toml_value(v: Any) -> str:
    """``v`` written as the TOML value of a ``key=value`` override (strings quoted, booleans lower case)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    return str(v)


def load_plan_overrides(path: str | Path) -> list[str]:
    """The config overrides a plan file stands for. The file is TOML in config sections (what
    :meth:`Plan.to_toml` and ``scaletrain plan --out`` write) or JSON with the flat field names
    (``--json`` output of ``scaletrain plan``: an object with a ``plan`` entry, or the plan itself).
    Keys outside the plan are refused in one line; values are validated with the config schema."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"plan file {str(p)!r} does not exist")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"plan file {str(p)!r} is not UTF-8 text") from None
    if p.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"plan file {str(p)!r} is not valid JSON: {e}") from None
        data = data.get("plan", data) if isinstance(data, dict) else data
        if not isinstance(data, dict):
            raise ConfigError(f"plan file {str(p)!r} must hold a JSON object of plan fields")
        flat: dict[str, Any] = {}
        for k, v in data.items():
            if k in ("remat", "offload") and isinstance(v, dict):
                flat.update({f"{k}.{kk}": vv for kk, vv in v.items()})
            else:
                flat[k] = v
        unknown = sorted(set(flat) - set(PLAN_KEYS))
        if unknown:
            raise ConfigError(f"plan file {str(p)!r}: unknown plan field {unknown[0]!r}; allowed: "
                              f"{', '.join(PLAN_KEYS)}")
        return [f"{PLAN_KEYS[k]}={toml_value(v)}" for k, v in flat.items()]
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"plan file {str(p)!r} is not valid TOML: {e}") from None
    allowed = set(PLAN_KEYS.values())
    out = []

    def walk(d: dict, prefix: str) -> None:
        for k, v in d.items():
            key = f"{prefix}{k}"
            if isinstance(v, dict) and key not in allowed:
                walk(v, key + ".")
            elif key not in allowed:
                raise ConfigError(f"plan file {str(p)!r}: {key!r} is not a plan key (model, data, steps and "
                                  f"learning rate belong in --config); allowed: {', '.join(sorted(allowed))}")
            else:
                out.append(f"{key}={toml_value(v)}")

    walk(data, "")
    return out


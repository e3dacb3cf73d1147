"""One model family, one :class:`ModelSpec`, one :func:`register` call.

Why: what scaletrain knows of a family — how a module is recognised, how it is built by name, where its
blocks are, how tensor parallelism splits it, how the planner prices it on paper, how it is exported to
Hugging Face's layout and what the compatibility table must know of it — used to be read by duck typing
in half a dozen places. Now each family's folder (``models/gpt2/``, ``models/llama/``, ...) declares it
once here and every one of those places asks :func:`spec_of` (a module) or :func:`spec_named` (a name).

A new family is one folder (or one file) and one ``register(ModelSpec(...))``; nothing else changes.
When several families own a module, the one naming its most specific class wins (``moe``'s ``GPT2MoE``
over ``gpt2``'s ``GPT2``), a class over a matcher, and among equals the latest registration (a user's
family over a shipped one).

Models know nothing of parallelism except this declaration: a :class:`ShardingPlan` is data (which
submodules are column- or row-parallel); ``techniques/tensor_parallel`` applies it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from scaletrain.errors import UserError

BUILTIN = ("gpt2", "cnn", "moe", "mlp", "dlrm", "llama", "bert")
"""The shipped families' modules under ``scaletrain.models``, imported (so registered) on first lookup."""


@dataclass(frozen=True)
class ShardingPlan:
    """How tensor parallelism splits a family (Megatron's column/row split; Shoeybi et al. 2019).

    ``style="plan"``: the fields below are applied as they are (DTensor's colwise/rowwise styles on the
    named submodules of every layer). Another style names an applier of ``techniques/tensor_parallel``
    for a layout those styles cannot express (``"megatron"``: scaletrain GPT-2's fused QKV permuted
    head-aligned, vocabulary-parallel loss and sequence parallelism; ``"hf-gpt2"``: HF ``Conv1D``)."""

    style: str = "plan"
    layers: str = ""
    """Dotted path of the repeated layers (an ``nn.ModuleList``), e.g. ``"model.layers"``."""
    colwise: tuple[str, ...] = ()
    """Submodules of each layer split over their outputs (no communication in the forward)."""
    rowwise: tuple[str, ...] = ()
    """Submodules of each layer split over their inputs (one all-reduce each in the forward)."""
    embedding: str = ""
    """Dotted path of a vocabulary-parallel embedding (rows split, output replicated); "" = replicated."""
    head: str = ""
    """Dotted path of a column-parallel output head whose logits stay split over the vocabulary (the
    loss runs under ``loss_parallel``); "" = no vocabulary-parallel head."""
    divides: tuple[str, ...] = ()
    """Config fields the TP degree must divide (heads, widths, vocabulary)."""
    sequence_parallel: bool = False
    """Whether Megatron sequence parallelism is offered for the family."""


@dataclass(frozen=True)
class ModelEntry:
    """A named model of a family: its builder and default arguments (``scaletrain.models.get(name)``)."""

    builder: Callable[..., Any]
    defaults: dict[str, Any]
    description: str
    default_data: str
    """Name of the shipped dataset this model trains on by default."""
    published_params: int | None = None
    """Published parameter count, when the model reproduces a published one."""
    options: dict[str, Any] = field(default_factory=dict)
    """Further overridable arguments with their defaults (beyond :attr:`defaults`)."""


def listed(name: str, builder: Callable[..., Any], options: dict[str, Any] | None = None,
           **defaults: Any) -> ModelEntry:
    """A shipped model: its description, default data and published count are the catalog's
    (:mod:`scaletrain.models.catalog`, read without torch by ``scaletrain models``)."""
    from scaletrain.models.catalog import LISTED

    row = LISTED[name]
    return ModelEntry(builder, defaults, row.description, row.default_data, row.published, options or {})


@dataclass(frozen=True)
class ModelSpec:
    """Everything scaletrain knows of one model family (see the module docstring)."""

    name: str
    classes: tuple[type, ...] = ()
    """Module classes of the family (an instance of one, subclasses included, is the family's)."""
    matches: Callable[[Any], bool] | None = None
    """Recognises a module of the family that :attr:`classes` cannot name (a Hugging Face class by its
    layout, a torchvision layout)."""
    models: dict[str, ModelEntry] = field(default_factory=dict)
    """Models of the family by name (``model.name``)."""
    hf: dict[str, Any] = field(default_factory=dict)
    """``hf:<name>`` families: name -> :class:`~scaletrain.models.external.HFFamily` (transformers class,
    config class and small defaults)."""
    blocks: Callable[[Any], list[tuple[str, Any]] | None] | None = None
    """The module's single-tensor blocks in order (what :func:`~scaletrain.models.chain.to_chain` cuts);
    None: the module's own ``chain_blocks()``, or it has none."""
    tp: ShardingPlan | None = None
    """Its tensor-parallel split; None: tensor parallelism does not apply to it."""
    shape: Callable[[str, dict[str, Any]], dict[str, Any]] | None = None
    """``(model name, overrides) -> fields of planner.shape.Shape``: priced on paper by the analytic
    planner (a decoder). None: priced by its trace (any model)."""
    export: Callable[[Any], tuple[dict[str, Any], Callable[[str], Any] | None]] | None = None
    """``module -> (Hugging Face config dict, tensor rename)`` for ``checkpoint export --to hf``; None:
    the module's own ``config.to_dict()`` when it is a transformers model, else no HF layout."""
    decoder: bool = False
    """A decoder LM of a layout tensor/context parallelism and selective remat know (compat ``Facts.gpt2``)."""
    moe: type | None = None
    """The family's mixture-of-experts layer class (expert parallelism shards it); None: dense."""

    def owns(self, model: Any) -> int | None:
        """How specifically this family owns ``model``: the position in its class's MRO of the most
        specific class of :attr:`classes` it is an instance of (0: that very class), one past the MRO's
        end when only :attr:`matches` says so; None when it is not of this family."""
        mro = type(model).__mro__
        hits = [mro.index(c) for c in self.classes if c in mro]
        if hits:
            return min(hits)
        return len(mro) if self.matches is not None and self.matches(model) else None


_SPECS: list[ModelSpec] = []
MODELS: dict[str, ModelEntry] = {}
"""Every named model of every registered family (``scaletrain.models.MODELS`` lists them in the catalog's order)."""
_loaded = False


def register(spec: ModelSpec) -> ModelSpec:
    """Add ``spec`` (replacing a family of the same name); its models become buildable by name."""
    _load_builtin()
    unregister(spec.name)
    taken = sorted(set(spec.models) & set(MODELS))
    if taken:
        raise UserError(f"model family {spec.name!r}: model name {taken[0]!r} is already registered")
    _SPECS.append(spec)
    MODELS.update(spec.models)
    return spec


def unregister(name: str) -> None:
    """Remove family ``name`` and its models (tests, or a user replacing a family)."""
    for s in [s for s in _SPECS if s.name == name]:
        _SPECS.remove(s)
        for m in s.models:
            MODELS.pop(m, None)


def _load_builtin() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    import importlib

    for fam in BUILTIN:
        importlib.import_module(f"scaletrain.models.{fam}")


def specs() -> list[ModelSpec]:
    """Registered families in registration order (the shipped ones first)."""
    _load_builtin()
    return list(_SPECS)


def spec_of(model: Any) -> ModelSpec | None:
    """The family of ``model`` (a chain answers for its source model), or None when no family owns it."""
    source = getattr(model, "source", None)
    if source is not None and source is not model:
        model = source
    best: tuple[int, int] | None = None
    found = None
    for i, s in enumerate(specs()):
        rank = s.owns(model)
        if rank is not None and (best is None or (rank, -i) < best):
            best, found = (rank, -i), s
    return found


def spec_named(name: str) -> ModelSpec | None:
    """The family of model name ``name`` (a registered model, or ``hf:<family>``), or None."""
    for s in specs()[::-1]:
        if name in s.models or (name.startswith("hf:") and name[3:] in s.hf):
            return s
    return None


def is_moe_layer(module: Any) -> bool:
    """Whether ``module`` is a mixture-of-experts layer of a registered family (:attr:`ModelSpec.moe`)."""
    return any(s.moe is not None and isinstance(module, s.moe) for s in specs())


def moe_layers(model: Any) -> list[Any]:
    """The mixture-of-experts layers inside ``model`` (a whole model or any piece of one, e.g. a stage)."""
    kinds = tuple(s.moe for s in specs() if s.moe is not None)
    return [m for m in model.modules() if isinstance(m, kinds)] if kinds else []


def hf_families() -> dict[str, Any]:
    """Every ``hf:<name>`` family: name -> HFFamily, in the catalog's order (then registration order)."""
    from scaletrain.models.catalog import LISTED

    out: dict[str, Any] = {}
    for s in specs():
        out.update(s.hf)
    listed = [k[3:] for k in LISTED if k.startswith("hf:")]
    return dict(sorted(out.items(), key=lambda kv: listed.index(kv[0]) if kv[0] in listed else len(listed)))


def is_transformers(model: Any) -> bool:
    """Whether ``model`` is a class of the ``transformers`` package (used unmodified)."""
    return type(model).__module__.startswith("transformers")


def positive(model: str, a: dict[str, Any], keys: tuple[str, ...], hidden: str, heads: str) -> None:
    """One-line UserError unless every ``keys`` value is a positive integer and heads divide hidden
    (a family's :attr:`ModelSpec.shape` checks its sizes with it)."""
    for k in keys:
        if not isinstance(a[k], int) or isinstance(a[k], bool) or a[k] < 1:
            raise UserError(f"model {model!r}: {k} must be a positive integer (got {a[k]!r})")
    if a[hidden] % a[heads]:
        raise UserError(f"model {model!r}: {hidden}={a[hidden]} must be divisible by {heads}={a[heads]}")

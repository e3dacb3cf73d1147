"""One configuration schema for the CLI, TOML files and the Python API.

Every field is a dataclass field whose ``metadata`` carries its help text, unit and (where the
set of values is closed) its allowed choices; ``scaletrain train --help`` is generated from it.
The plan keys (parallelism, remat, offload, precision, optimizer...) are declared once in
:mod:`scaletrain.schema` and placed into their sections here by ``schema.config_fields``.
TOML sections map to the sections below; command-line overrides are dotted paths
(``train.steps=200``, ``memory.remat.method=optimal``) whose values are parsed as TOML values
(so ``optim.lr=3e-4`` is a float and ``model.overrides.n_layer=2`` an int), falling back to a
plain string.

Validation rejects an unknown key or a bad value with a :class:`ConfigError` naming the key and
what is allowed; the CLI turns it into one line and exit code 2.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_type_hints

import tomli_w

from scaletrain import schema
from scaletrain.errors import ConfigError, UserError, one_line
from scaletrain.schema import MAX_INT, opt, section


@dataclass
class ModelConfig:
    name: str = opt("gpt2-tiny", "model to train: a reference name, hf:gpt2 / hf:llama / hf:mistral / hf:bert, "
                                 "hf:/path/to/dir or py:package.module:factory (see `scaletrain models`)")
    overrides: dict = opt({}, "model shape overrides, e.g. model.overrides.n_layer=2 (hf: config fields; py: the "
                              "factory's keyword arguments)")


@dataclass
class DataConfig:
    name: str = opt("", "dataset: shakespeare, digits, synthetic-text, synthetic-images, or your own: text:PATH (a "
                        ".txt/.jsonl file, directory or glob), tokens:DIR (scaletrain data prepare), images:PATH "
                        "(class folders), py:module:factory, hf-disk:PATH; empty = the model's default")
    tokenizer: str = opt("", "a local Hugging Face tokenizer directory (tokenizer.json) for text data; its vocabulary "
                             "sizes the model; empty = bytes (vocabulary 256)")
    field: str = opt("text", "the JSON key (.jsonl) or column (hf-disk:) holding the text")
    val_fraction: float = opt(0.1, "share of your data kept for validation when it has no train/val split of its "
                                   "own", min=0.0, max=1.0)
    seq_len: int = opt(128, "tokens per sample for language models", "tokens", min=1)
    image_size: int = opt(0, "image side for vision models; 0 = the model's own", "pixels", min=0)
    num_samples: int = opt(0, "samples in a synthetic dataset; 0 = a default", "samples", min=0)


@dataclass
@schema.config_fields("optim")
class OptimConfig:
    lr: float = opt(2e-3, "peak learning rate (after warm-up)", "1/step", min=0.0)
    weight_decay: float = opt(0.1, "decoupled weight decay (not applied to biases and norms)", min=0.0)
    beta1: float = opt(0.9, "first-moment decay (Adam family) ", min=0.0, max=1.0)
    beta2: float = opt(0.95, "second-moment decay (Adam family)", min=0.0, max=1.0)
    eps: float = opt(1e-8, "denominator epsilon (Adam family)", min=0.0)
    momentum: float = opt(0.9, "momentum (SGD, LARS)", min=0.0, max=1.0)
    warmup_steps: int = opt(50, "linear warm-up from 0 to lr", "optimizer steps", min=0)
    schedule: str = opt("cosine", "learning-rate schedule after warm-up", choices=("cosine", "constant", "linear"))
    min_lr_ratio: float = opt(0.1, "final lr as a fraction of lr (cosine/linear)", min=0.0, max=1.0)
    grad_clip: float = opt(1.0, "clip the global gradient norm to this; 0 = off", min=0.0)
    options: dict = opt({}, "optimizer-specific options passed to its constructor, e.g. "
                            "optim.options.trust_coefficient=0.02 (lars), optim.options.fused=false (adam8bit), "
                            "optim.options.beta1=0.9 (adafactor); `scaletrain optimizers` lists them")


@dataclass
@schema.config_fields("train", after="global_batch")
class TrainConfig:
    steps: int = opt(800, "optimizer steps to run", "steps", min=1)
    global_batch: int = opt(16, "samples per optimizer step, summed over all devices and accumulation", "samples",
                            min=1)
    eval_every: int = opt(200, "validate every N steps (and at the end); 0 = only at the end", "steps", min=0)
    eval_batches: int = opt(8, "validation micro-batches per evaluation", "batches", min=1)
    log_every: int = opt(10, "write a metrics row every N steps", "steps", min=1)
    loggers: str = opt("jsonl", "where metrics rows go, comma-separated: jsonl (metrics.jsonl, always), tensorboard "
                                "(tb/ event files), csv (metrics.csv), wandb (offline, wandb/)")
    checkpoint_every: int = opt(0, "save a checkpoint every N steps; 0 = only at the end (and every "
                                   "train.checkpoint_every_s)", "steps", min=0)
    checkpoint_every_s: float = opt(300.0, "also save a checkpoint about every this many seconds of training (turned "
                                    "into a step count from the measured time of the first steps, the same on every "
                                    "rank); 0 = off. A SIGINT (Ctrl-C) or SIGTERM saves at the next step boundary and "
                                    "stops; --resume continues", "seconds", min=0.0)
    keep_checkpoints: int = opt(2, "checkpoints kept on disk (oldest deleted first)", "files", min=1)
    checkpoint_format: str = opt("auto", "checkpoint layout: sharded (every rank writes only its own shards, in "
                                 "parallel; loads under any other layout), consolidated (one file gathered on rank 0), "
                                 "auto (sharded with several processes), none (never written: benchmark runs, nothing "
                                 "to resume)", choices=("auto", "consolidated", "sharded", "none"))
    checkpoint_async: bool = opt(False, "sharded checkpoints: copy this rank's shards, then write them in a background "
                                 "thread while training goes on (the last one is written before the run ends)")
    seed: int = opt(0, "seed of model init, data order and dropout", min=0, max=2**32 - 1)
    device: str = opt("auto", "device: auto (cuda if available else cpu), cpu, cuda", choices=("auto", "cpu", "cuda"))
    progress: str = opt("auto", "progress bar: auto (only on a terminal), on, off", choices=("auto", "on", "off"))
    measure_memory: bool = opt(False, "run the last step under the memory tracker: every rank's peak bytes of "
                                      "parameters, gradients, optimizer states, activations and temporaries go in "
                                      "its metrics row (tracked_peak_bytes*), next to scaletrain estimate's")
    profile_step: int = opt(0, "run this optimizer step on rank 0 under torch.profiler: seconds of forward, backward, "
                               "optimizer, data, exposed communication and other go in its metrics row "
                               "(time_breakdown_s, scaletrain.measure.phases); 0 = off [step]", min=0)


@dataclass
@schema.config_fields("memory.remat")
class RematConfig:
    """Rematerialization (activation recomputation): every key is a plan key (:mod:`scaletrain.schema`)."""


@dataclass
@schema.config_fields("memory.offload")
class OffloadConfig:
    """Offloading of activations, weights and optimizer states: every key is a plan key (:mod:`scaletrain.schema`)."""


@dataclass
@schema.config_fields("memory")
class MemoryConfig:
    """Memory-saving techniques: plan keys (:mod:`scaletrain.schema`) and the two sections below."""

    remat: RematConfig = section(RematConfig, "rematerialization (activation recomputation)")
    offload: OffloadConfig = section(OffloadConfig, "offloading of activations, weights and optimizer states")


@dataclass
@schema.config_fields("parallel")
class ParallelConfig:
    """Parallelism: the plan keys of :mod:`scaletrain.schema` under ``parallel.``, and the collective timeout."""

    timeout_s: float = opt(600.0, "collective timeout; a rank waiting longer fails with a message naming the "
                                  "collective", "seconds", min=1.0, max=1e7)


@dataclass
class Config:
    plan: str = opt("manual", "how the plan keys are chosen: manual = as given; auto = scaletrain plans dp x tp x pp, "
                              "schedule, virtual stages, micro-batch, ZeRO stage and remat for this machine and the "
                              "processes launched (plan keys set away from their defaults are pinned; precision and "
                              "optimizer are kept), prints its prediction and logs predicted_* next to the measured "
                              "figures. A top-level key: `scaletrain train plan=auto`, TOML `plan = \"auto\"`",
                    choices=("manual", "auto"))
    model: ModelConfig = section(ModelConfig, "the model")
    data: DataConfig = section(DataConfig, "the data")
    optim: OptimConfig = section(OptimConfig, "optimizer and learning-rate schedule")
    train: TrainConfig = section(TrainConfig, "the training loop")
    memory: MemoryConfig = section(MemoryConfig, "memory-saving techniques")
    parallel: ParallelConfig = section(ParallelConfig, "parallelism: data (DDP, ZeRO 1-3, compression), "
                                                        "pipeline, tensor/sequence/context, expert")


# --------------------------------------------------------------------------- loading and validation


def _is_section(f: dataclasses.Field) -> bool:
    return bool(f.metadata.get("section"))


def _coerce(path: str, value: Any, typ: Any, meta: dict) -> Any:
    if typ is bool:
        if isinstance(value, str) and value.lower() in ("true", "false"):
            value = value.lower() == "true"
        if not isinstance(value, bool):
            raise ConfigError(f"{path}={value!r} is not allowed; expected true or false")
    elif typ is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            else:
                raise ConfigError(f"{path}={value!r} is not allowed; expected an integer")
    elif typ is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}={value!r} is not allowed; expected a number")
        value = float(value)
        if not math.isfinite(value):  # nan passes every range check, inf overflows timeouts and sizes
            raise ConfigError(f"{path}={value!r} is not allowed; expected a finite number")
    elif typ is str:
        if not isinstance(value, str):
            value = str(value).lower() if isinstance(value, bool) else str(value)  # TOML true -> "true"
        # read every size now, used or not (a typo must not wait for its feature)
        if meta.get("unit") in ("bytes", schema.BYTES_LIST) and value not in meta.get("words", ()):
            from scaletrain.techniques.remat.schedule import parse_bytes, parse_bytes_list

            try:
                (parse_bytes_list if meta["unit"] == schema.BYTES_LIST else parse_bytes)(value)
            except UserError as e:
                also = f"; or one of {', '.join(meta['words'])}" if meta.get("words") else ""
                raise ConfigError(f"{path}={value!r} is not allowed; {one_line(e)}{also}") from None
    elif typ is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}={value!r} is not allowed; expected a table")
    choices, lo, hi = meta.get("choices"), meta.get("min"), meta.get("max")
    if typ is int and hi is None:
        hi = MAX_INT  # every count and size: a value past this is a typo (train.steps=99999999999999999999)
    schema.check_value(path, value, choices, lo, hi)
    return value


def _fill(obj: Any, data: dict, prefix: str) -> None:
    hints = get_type_hints(type(obj))
    fields = {f.name: f for f in dataclasses.fields(obj)}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if key not in fields:
            raise ConfigError(f"unknown key {path!r}; allowed in [{prefix.rstrip('.') or 'top level'}]: "
                              f"{', '.join(fields)}")
        f = fields[key]
        if _is_section(f):
            if not isinstance(value, dict):
                keys = ", ".join(x.name for x in dataclasses.fields(getattr(obj, key)))
                raise ConfigError(f"{path} must be a table of keys: {keys}")
            _fill(getattr(obj, key), value, f"{path}.")
        else:
            setattr(obj, key, _coerce(path, value, hints[key], dict(f.metadata)))


def parse_value(text: str) -> Any:
    """A command-line value as TOML (numbers, booleans, arrays, quoted strings), else a plain string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def overrides_to_dict(overrides: list[str]) -> dict:
    """``["a.b=1", "a.c.d=x"]`` -> ``{"a": {"b": 1, "c": {"d": "x"}}}``."""
    out: dict = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form section.key=value")
        key, text = item.split("=", 1)
        parts = key.strip().split(".")
        if (len(parts) < 2 and parts[0] not in TOP_LEVEL_KEYS) or not all(parts):
            raise ConfigError(f"override {key!r} must name a section and a key, e.g. train.steps=100")
        d = out
        for p in parts[:-1]:
            d = d.setdefault(p, {})
            if not isinstance(d, dict):
                raise ConfigError(f"override {key!r} conflicts with another override")
        d[parts[-1]] = parse_value(text.strip())
    return out


TOP_LEVEL_KEYS = tuple(f.name for f in dataclasses.fields(Config) if not _is_section(f))
"""Keys outside any section (``plan``): an override names them alone, ``plan=auto``."""


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def from_dict(data: dict) -> Config:
    cfg = Config()
    _fill(cfg, data, "")
    return cfg


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults, then the TOML file, then dotted overrides — validated."""
    data: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        try:
            data = tomllib.loads(p.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {str(p)!r} is not valid TOML: {e}") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {str(p)!r} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset "
                              f"{e.start}); TOML files must be UTF-8") from None
        except OSError as e:
            raise ConfigError(f"config file {str(p)!r} cannot be read ({e.strerror})") from None
    data = _merge(data, overrides_to_dict(overrides or []))
    return from_dict(data)


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def to_toml(cfg: Config) -> str:
    return tomli_w.dumps(to_dict(cfg))


def describe(cls: type = Config, prefix: str = "") -> list[tuple[str, str]]:
    """(dotted key, "help [unit] (choices; default)") for every field, for --help."""
    rows = []
    inst = cls()
    for f in dataclasses.fields(cls):
        if _is_section(f):
            rows += describe(type(getattr(inst, f.name)), f"{prefix}{f.name}.")
            continue
        m = f.metadata
        bits = [m.get("help", "")]
        if m.get("unit"):
            bits.append(f"[{m['unit']}]")
        extra = []
        if m.get("choices"):
            extra.append("one of " + "|".join(m["choices"]))
        extra.append(f"default {getattr(inst, f.name)!r}")
        rows.append((f"{prefix}{f.name}", " ".join(bits) + f" ({'; '.join(extra)})"))
    return rows

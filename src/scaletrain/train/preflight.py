"""Checks that must pass before a run touches the disk or starts a step.

Why: without them a model/data mismatch or an oversized sequence fails inside the first forward
(a conv2d, dtype or position ``RuntimeError``/``ValueError``, once per rank), after the run
directory was made. Each check here names the config keys at fault and what is allowed, as a
:class:`ConfigError` (one line, exit 2, nothing written).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from scaletrain import models as model_registry
from scaletrain.data import DATASETS, build_loader
from scaletrain.errors import ConfigError, UserError, one_line
from scaletrain.train import model_record
from scaletrain.train.config import Config

_KIND_OF_TASK = {"lm": "text", "classify": "image"}
"""Which kind of dataset (``DatasetInfo.kind``) a model's ``task`` reads."""


def build_model(cfg: Config) -> nn.Module:
    """The reference model ``cfg.model.name`` with its overrides; a shape the builder rejects in any
    way (a zero head count, a negative width...) is one line naming ``model.overrides``."""
    model_record.check_buildable(cfg.model.name)  # a model that was passed from Python: say how to resume
    from scaletrain.train.model_data import user_overrides

    overrides = user_overrides(cfg)
    cfg.model.overrides.update(overrides)  # recorded in config.toml and checkpoints: export and resume rebuild it
    try:
        return model_registry.get(cfg.model.name, **overrides)
    except UserError as e:  # a value the builder's ranges refuse: named as the config key the user set
        key = next((k for k in overrides if f": {k}=" in str(e)), None)
        if key is None:
            raise
        raise ConfigError(str(e).replace(f": {key}=", f": model.overrides.{key}=", 1)) from None
    except Exception as e:  # noqa: BLE001 - any builder failure here is caused by the overrides
        raise ConfigError(f"model {cfg.model.name!r} cannot be built with model.overrides={cfg.model.overrides!r} "
                          f"({type(e).__name__}: {one_line(e)[:160]})") from None


_NEEDS: tuple[tuple[str, str, Any], ...] = (
    ("memory.remat.budget", "memory.remat.method=optimal (or periodic, revolve, ilp, dtr)",
     lambda c: c.memory.remat.method != "none"),
    ("memory.offload.prefetch", "memory.offload.activations=all (or a block list)",
     lambda c: c.memory.offload.activations != "none" or c.memory.offload.plan == "auto"),
    ("memory.offload.param_window", "memory.offload.params=host", lambda c: c.memory.offload.params == "host"),
    ("memory.offload.dpu", "memory.offload.optimizer=host or disk", lambda c: c.memory.offload.optimizer != "device"),
    *((f"memory.offload.{k}", "memory.offload.optimizer=disk", lambda c: c.memory.offload.optimizer == "disk")
      for k in ("disk_dir", "disk_max_bytes", "disk_chunk_bytes", "disk_masters")),
    ("memory.offload.chunk_bytes", "memory.offload.plan=chunks", lambda c: c.memory.offload.plan == "chunks"),
)
"""(key, what gives it an effect, whether this config does): a key set away from its default that
nothing reads would train silently without what the user asked for. (The compression knobs are not
here: one base config is commonly run under every ``parallel.compression``.)"""


def check_unused(cfg: Config) -> None:
    """Every value set is used: one line for a key set away from its default whose feature is off."""
    from scaletrain.train.config import Config as Defaults

    base = Defaults()
    for key, needs, active in _NEEDS:
        section, name = key.rsplit(".", 1)
        value = getattr(_walk(cfg, section), name)
        auto = section == "memory.offload" and cfg.memory.offload.plan == "auto"  # the planner may use it
        if value != getattr(_walk(base, section), name) and not active(cfg) and not auto:
            raise ConfigError(f"{key}={value!r} has no effect on its own; add {needs}, or leave {key} out")


def _walk(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def check_model_data(cfg: Config, model: nn.Module, task: str, model_name: str, data_name: str,
                     dataset: Any = None) -> None:
    """The dataset's kind fits the model's task; a language model's positions hold ``data.seq_len``;
    an image classifier takes the dataset's image size; ``train.loggers`` names known, installed sinks."""
    from scaletrain.train.loggers import parse as parse_loggers

    parse_loggers(cfg.train.loggers)
    want = _KIND_OF_TASK.get(task)
    info = DATASETS.get(data_name)
    if want is None:
        raise ConfigError(f"model {model_name!r} (task {task!r}) cannot be trained by `scaletrain train`; allowed "
                          f"tasks: language models (text data) and image classifiers (image data)")
    kind = info.kind if info is not None else getattr(dataset, "kind", None)
    if kind is not None and kind != want:
        allowed = ", ".join(n for n, d in DATASETS.items() if d.kind == want)
        what = "a language model" if task == "lm" else "an image classifier"
        holds = "images" if kind == "image" else kind
        raise ConfigError(f"data.name={data_name!r} holds {holds} but model {model_name!r} is {what}; allowed "
                          f"data.name for it: {allowed}")
    check_params_dtype(cfg, model, task, model_name)
    n_pos = getattr(getattr(model, "config", None), "n_positions", None)
    if task == "lm" and isinstance(n_pos, int) and cfg.data.seq_len > n_pos:
        raise ConfigError(f"data.seq_len={cfg.data.seq_len} exceeds the {n_pos} positions of model {model_name!r}; "
                          f"allowed: 1..{n_pos} (or raise model.overrides.n_positions)")
    plain = dataset is not None and hasattr(dataset, "__len__") and getattr(dataset, "collate_fn", None) is None
    if task != "lm" and plain and len(dataset) and model_name == cfg.model.name:  # ours: meta-safe
        check_image_fits(cfg, model, model_name, tuple(dataset[0][0].shape))  # (x, y) samples, default batching


def check_image_fits(cfg: Config, model: nn.Module, model_name: str, sample_shape: tuple[int, ...]) -> None:
    """One forward of a batch of two on the meta device (shapes only: no memory, no time): an image
    size the model cannot take (a flattening MLP, a VGG pooled below 1x1) fails here, in one line."""
    from torch.func import functional_call

    meta = {k: torch.empty_like(v, device="meta") for k, v in (*model.named_parameters(), *model.named_buffers())}
    try:
        with torch.no_grad():
            functional_call(model, meta, (torch.empty(2, *sample_shape, device="meta"),))
    except (RuntimeError, ValueError) as e:
        own = getattr(model, "image_size", None)
        raise ConfigError(f"data.image_size={cfg.data.image_size or own}: model {model_name!r} cannot take "
                          f"{'x'.join(map(str, sample_shape))} inputs ({one_line(e)[:120]}); allowed: its own size "
                          f"(data.image_size=0{f', {own} pixels' if own else ''})") from None


def check_params_dtype(cfg: Config, model: nn.Module, task: str, model_name: str) -> None:
    """16-bit parameters (``train.params_dtype``) where the model can run them.

    Why: float images meet 16-bit weights outside autocast (``mat1 and mat2 must have the same
    dtype``), and batch norm keeps fp32 statistics that 16-bit activations do not match
    (``expected scalar type Half but found Float``) — both in the first forward, once per rank.
    """
    dtype, precision = cfg.train.params_dtype, cfg.train.precision
    if dtype == "fp32":
        return
    if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        raise ConfigError(f"train.params_dtype={dtype!r}: model {model_name!r} has batch-norm layers, which keep "
                          f"fp32 statistics; allowed: train.params_dtype='fp32' (train.precision='bf16' or 'fp16' "
                          f"still computes in 16 bits)")
    if task != "lm" and precision != dtype:
        raise ConfigError(f"train.params_dtype={dtype!r} with train.precision={precision!r}: model {model_name!r} "
                          f"reads float images, which meet 16-bit weights only under autocast; allowed: "
                          f"train.precision={dtype!r} with it, or train.params_dtype='fp32'")


def check_loaders(trainer: Any) -> None:
    """Every rank's share of the training and validation sets holds at least one batch."""
    par, cfg = trainer.parallel, trainer.cfg
    for split, dataset in (("training", trainer.train_set), ("validation", trainer.val_set)):
        try:  # the loaders the run builds drop incomplete batches
            build_loader(dataset, trainer.micro_batch, shuffle=False, seed=0, rank=par.data_rank,
                         world_size=par.data_world, drop_last=True)
        except UserError as e:
            raise ConfigError(f"the {split} split of data.name={trainer.data_name!r} is too small: {one_line(e)}; "
                              f"raise data.num_samples (now {cfg.data.num_samples or 'default'}) or lower "
                              f"train.global_batch={cfg.train.global_batch}") from None


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """The device of this process; with CUDA, GPU ``local_rank`` (torchrun's LOCAL_RANK)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device='cuda' but no CUDA device is available; allowed here: auto, cpu")
    if name == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise ConfigError(f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} CUDA devices are visible")
        return torch.device("cuda", local_rank)
    return torch.device(name)

"""The study's matrix: strategies x device counts x models, with the fixed settings of each model.

A :class:`Cell` is one (model, strategy, device count); it runs as one ``scaletrain train``
subprocess per repeat (:mod:`.runner`). Every strategy of a model trains with the same global
batch, sequence length, steps, optimizer and learning rate (:data:`MODELS`), so every cell sees the
same samples in the same order: only *how* the step is computed differs (the survey's rule of
fixed hyperparameters across frameworks).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scaletrain.errors import ConfigError


@dataclass(frozen=True)
class Strategy:
    """How a cell splits the work over ``devices`` processes."""

    name: str
    framework: str
    """Who implements it: ``scaletrain`` or a peer's framework (``pytorch``, ``deepspeed``: run by
    :mod:`.peers`, its own loop over the same model, data and settings)."""
    keys: tuple[str, ...]
    """``scaletrain train`` overrides; ``{n}`` is the device count, ``{m}`` the pipeline micro-batches."""
    describe: str
    requires: str = ""
    """Python module a peer needs (``import`` fails: the cell is "not installed")."""
    min_devices: int = 1
    """Fewest processes where it differs from a simpler strategy (a hybrid) [processes]."""
    like: str = ""
    """A peer: the scaletrain strategy that computes the same step (its prediction is the peer's)."""

    def overrides(self, devices: int, microbatches: int) -> list[str]:
        """The config overrides of this strategy on ``devices`` processes."""
        return [k.format(n=devices, m=microbatches) for k in self.keys]


_PP = ("parallel.pp={n}", "parallel.microbatches={m}")
STRATEGIES: dict[str, Strategy] = {s.name: s for s in (
    Strategy("ddp", "scaletrain", ("parallel.zero=0",), "data parallel, replicated (bucketed all-reduce)"),
    Strategy("zero1", "scaletrain", ("parallel.zero=1",), "ZeRO-1: optimizer states sharded"),
    Strategy("zero2", "scaletrain", ("parallel.zero=2",), "ZeRO-2: + gradients sharded"),
    Strategy("zero3", "scaletrain", ("parallel.zero=3",), "ZeRO-3 (FSDP2): + parameters sharded"),
    Strategy("tp", "scaletrain", ("parallel.tp={n}",), "Megatron tensor parallel over all devices"),
    Strategy("tp-sp", "scaletrain", ("parallel.tp={n}", "parallel.sequence_parallel=true"),
             "tensor parallel + sequence parallel"),
    Strategy("gpipe", "scaletrain", (*_PP, "parallel.schedule=gpipe"), "pipeline, GPipe (all forwards first)"),
    Strategy("1f1b", "scaletrain", (*_PP, "parallel.schedule=1f1b"), "pipeline, 1F1B (PipeDream-Flush)"),
    Strategy("interleaved", "scaletrain", (*_PP, "parallel.schedule=interleaved"),
             "pipeline, interleaved 1F1B (2 stages per device)"),
    Strategy("pipedream2bw", "scaletrain", (*_PP, "parallel.schedule=pipedream-2bw"),
             "asynchronous pipeline, PipeDream-2BW (weights one step stale)"),
    Strategy("tp2-dp", "scaletrain", ("parallel.tp=2", "parallel.zero=1"),
             "hybrid: tensor parallel in pairs x data parallel (ZeRO-1) over the pairs", min_devices=4),
    Strategy("pp2-dp", "scaletrain", ("parallel.pp=2", "parallel.microbatches={m}", "parallel.schedule=1f1b",
                                      "parallel.zero=1"),
             "hybrid: 2-stage 1F1B pipeline x data parallel (ZeRO-1) over the pipelines", min_devices=4),
    Strategy("auto", "scaletrain", ("plan=auto",), "the plan scaletrain's planner picks for this machine and N "
             "processes (plan=auto: its own prediction)"),
    Strategy("torch-ddp", "pytorch", (), "plain PyTorch DistributedDataParallel (peer)",
             requires="torch.nn.parallel", like="ddp"),
    Strategy("torch-fsdp", "pytorch", (), "plain PyTorch FSDP2 fully_shard per block + root (peer)",
             requires="torch.distributed.fsdp", like="zero3"),
    Strategy("torch-tp", "pytorch", ("parallel.tp={n}",), "plain PyTorch tensor parallel: parallelize_module with "
             "Colwise/RowwiseParallel over all devices (peer)", requires="torch.distributed.tensor.parallel",
             like="tp"),
    Strategy("deepspeed-zero2", "deepspeed", (), "DeepSpeed ZeRO-2 engine (peer)", requires="deepspeed",
             like="zero2"),
    Strategy("deepspeed-zero3", "deepspeed", (), "DeepSpeed ZeRO-3 engine (peer)", requires="deepspeed",
             like="zero3"),
)}
DATA_PARALLEL = ("ddp", "zero1", "zero2", "zero3", "torch-ddp", "torch-fsdp", "deepspeed-zero2", "deepspeed-zero3")
"""Strategies that replicate the computation (each device runs the whole model on its samples)."""
SYNC_PIPELINES = ("gpipe", "1f1b", "interleaved")
ASYNC_PIPELINES = ("pipedream2bw",)


@dataclass(frozen=True)
class ModelSettings:
    """The fixed hyperparameters of one model, the same for every strategy and device count."""

    name: str
    global_batch: int
    """Samples per optimizer step, summed over all devices [samples]."""
    steps: int
    """Optimizer steps per run [steps]."""
    metric: str
    """Validation metric drawn: ``val_loss`` (lower is better) or ``val_acc`` (higher is better)."""
    seq_len: int = 0
    """Tokens per sample (language models) [tokens]."""
    lr: float = 2e-3
    """Peak learning rate (AdamW, cosine after a linear warm-up) [1/step]."""
    warmup: int = 2
    """Learning-rate warm-up [steps]."""
    eval_every: int = 4
    """Validation every this many steps (and at the end) [steps]."""
    microbatches: int = 4
    """Pipeline micro-batches per step (pipelines only; the others take one micro-batch per device)."""
    extra: tuple[str, ...] = ()
    """More ``scaletrain train`` keys of this entry (model overrides, data set, image size)."""

    def overrides(self) -> list[str]:
        """The ``scaletrain train`` keys that fix these settings."""
        seq = [f"data.seq_len={self.seq_len}"] if self.seq_len else []
        return [f"model.name={self.name}", f"train.global_batch={self.global_batch}", f"train.steps={self.steps}",
                f"optim.lr={self.lr}", f"optim.warmup_steps={self.warmup}", f"train.eval_every={self.eval_every}",
                "train.eval_batches=2", *seq, *self.extra]



MODELS: dict[str, ModelSettings] = {
    "gpt2-mini": ModelSettings("gpt2-mini", global_batch=8, seq_len=128, steps=16, metric="val_loss"),
    "vgg-mini": ModelSettings("vgg-mini", global_batch=32, steps=16, metric="val_loss", lr=3e-3),
    # the survey's ResNet-50 as a layout: bottleneck blocks with batch norm, on digits (32 x 32) ...
    "resnet-mini": ModelSettings("resnet-mini", global_batch=32, steps=16, metric="val_loss", lr=3e-3),
    # ... and on 224 x 224 noise images with the ImageNet stem, for throughput only (nothing to learn)
    "resnet-mini-224": ModelSettings("resnet-mini", global_batch=16, steps=8, metric="val_loss", lr=3e-3,
                                     eval_every=8, extra=("data.name=synthetic-images",
                                                          "model.overrides.image_size=224",
                                                          "model.overrides.imagenet_stem=true")),
}
QUICK_STEPS = 12
"""Steps per run under ``--quick`` (2 warm-up, 1 profiled, 1 memory-tracked: 8 timed)."""
WARMUP_STEPS = 2
"""Steps left out of the step time (allocator, autograd and gloo warm-up)."""
QUICK = dict(models=("gpt2-mini", "vgg-mini"), devices=(1, 2, 4),
             strategies=("ddp", "zero3", "tp", "1f1b", "pipedream2bw", "deepspeed-zero3"), repeats=1)
FULL = dict(models=("gpt2-mini", "vgg-mini"), devices=(1, 2, 4), repeats=3,
            strategies=(*(n for n, s in STRATEGIES.items() if s.framework == "scaletrain"), "torch-fsdp",
                        "deepspeed-zero3", "torch-tp"))
"""The full study: every scaletrain strategy, the two sharded peers and torch's TP (torch-ddp and deepspeed-zero2 on
request: ``--strategies``)."""


@dataclass(frozen=True)
class Cell:
    """One (model, strategy, device count) of the matrix."""

    model: str
    strategy: str
    devices: int
    settings: ModelSettings = field(compare=False, repr=False)

    @property
    def key(self) -> str:
        """The cell's name in results.json and the run directory: ``model/strategy/Nd``."""
        return f"{self.model}/{self.strategy}/{self.devices}d"

    @property
    def framework(self) -> str:
        return STRATEGIES[self.strategy].framework

    @property
    def profile_step(self) -> int:
        """The step run under torch.profiler (the one before the memory-tracked last); 0 = none. The
        asynchronous pipelines are not profiled: with the profiler on, vgg-mini's 2-stage PipeDream-2BW run
        corrupted the heap at exit in 2 of 3 tries (0 of 3 without)."""
        return 0 if self.strategy in ASYNC_PIPELINES else self.settings.steps - 1

    def train_overrides(self) -> list[str]:
        """Every ``scaletrain train`` key of this cell (measurement keys included, see :mod:`.runner`)."""
        s = self.settings
        return [*s.overrides(), *STRATEGIES[self.strategy].overrides(self.devices, s.microbatches),
                "train.log_every=1", "train.measure_memory=true", f"train.profile_step={self.profile_step}",
                "train.progress=off"]


def parse_list(text: str, allowed: tuple[str, ...], noun: str) -> tuple[str, ...]:
    """Comma-separated names of ``noun`` (model, strategy), each one of ``allowed`` (ConfigError naming the
    bad one otherwise)."""
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    if not names:
        raise ConfigError(f"no {noun} given in {text!r}; allowed: {', '.join(allowed)}")
    for n in names:
        if n not in allowed:
            raise ConfigError(f"unknown {noun} {n!r}; allowed: {', '.join(allowed)}")
    return names


def parse_devices(text: str) -> tuple[int, ...]:
    """``"1,2,4"`` -> (1, 2, 4); ConfigError for anything but positive integers."""
    try:
        out = tuple(int(d) for d in text.split(","))
    except ValueError:
        out = ()
    if not out or any(d < 1 for d in out):
        raise ConfigError(f"--devices {text!r} is not allowed; give positive process counts, e.g. --devices 1,2,4")
    return tuple(sorted(set(out)))


def build(models: tuple[str, ...], strategies: tuple[str, ...], devices: tuple[int, ...],
          steps: int | None = None) -> list[Cell]:
    """Every cell of the matrix, models outermost, then strategies, then device counts."""
    cells = []
    for m in models:
        s = MODELS[m]
        if steps is not None:
            s = ModelSettings(**{**s.__dict__, "steps": steps, "eval_every": max(steps // 3, 1)})
        cells += [Cell(m, st, d, s) for st in strategies for d in devices]
    return cells

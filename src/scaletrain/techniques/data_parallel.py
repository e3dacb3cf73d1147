"""Data parallelism: launch detection, process groups with timeouts, traffic accounting, DDP.

Launch. ``scaletrain train`` runs unchanged under ``torchrun`` (one process per device): the
rank, world size and rendezvous come from torchrun's environment variables (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``, multi-node rendezvous
included). The backend is chosen from the device: NCCL for CUDA, gloo for CPU. Every collective
has the process group's timeout (``parallel.timeout_s``); when one expires, the step fails with
one line naming the rank, the collective and its size (:func:`explain_comm_failure`) instead of
waiting forever (the hangs of DeepSpeed #5066 / Megatron-LM #1027).

Teardown. ``destroy_process_group`` is called only after the DDP/FSDP objects are deleted and
garbage-collected; destroying the group while a DDP reducer is still alive is what makes the
interpreter print "terminate called without an active exception" at exit.

Traffic. :class:`CommLedger` counts the bytes each collective moves by wrapping the
``torch.distributed`` functions that DDP comm hooks, FSDP2 and our own ZeRO code call. The
convention is *bytes received per rank by a bandwidth-optimal (ring) algorithm* for a tensor of
``S`` bytes on ``N`` ranks: all-reduce ``2(N-1)/N * S``; reduce-scatter ``(N-1)/N * S_input``;
all-gather ``(N-1)/N * S_output``; broadcast ``(N-1)/N * S`` (every non-root rank receives S);
all-to-all ``(N-1)/N * S`` (REFERENCES.md, "Communication"). DDP moves ``2 Psi (N-1)/N``
elements per step, ZeRO-3 ``3 Psi (N-1)/N`` (ZeRO paper section 7).

Strategies. :class:`Strategy` is the single-process no-op every strategy extends; the trainer
only talks to this interface (forward module, no-sync context, gradient clipping, the hooks
around the optimizer step, state dicts that are always *full* — single-process layout — so a
checkpoint loads at any world size). :class:`DDPStrategy` is stage 0; stages 1-3 live in
:mod:`scaletrain.techniques.zero`.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import inspect
import os
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from scaletrain.errors import ConfigError, UserError

# --------------------------------------------------------------------------- launch


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the job, as torchrun (or any launcher setting its variables) says."""

    rank: int
    world: int
    local_rank: int
    local_world: int

    @property
    def distributed(self) -> bool:
        return self.world > 1


def launch_env() -> LaunchEnv:
    """Read torchrun's environment; a plain ``python`` start is rank 0 of 1."""
    def get(name: str, default: int) -> int:
        value = os.environ.get(name, "")
        try:
            return int(value) if value else default
        except ValueError:
            raise ConfigError(f"environment variable {name}={value!r} is not an integer") from None

    world = get("WORLD_SIZE", 1)
    rank = get("RANK", 0)
    if not 0 <= rank < max(world, 1):
        raise ConfigError(f"RANK={rank} is outside 0..WORLD_SIZE-1 (WORLD_SIZE={world})")
    return LaunchEnv(rank, world, get("LOCAL_RANK", rank), get("LOCAL_WORLD_SIZE", world))


def backend_for(device: torch.device) -> str:
    """NCCL for CUDA devices, gloo otherwise (CPU)."""
    return "nccl" if device.type == "cuda" else "gloo"


def init_process_group(device: torch.device, timeout_s: float) -> bool:
    """Join the job's default process group if the launcher started several processes.

    Returns True if this call created the group (so the caller must tear it down), False if
    there is nothing to do (one process) or a group already exists (a test harness made it).
    """
    env = launch_env()
    if dist.is_initialized() or not env.distributed:
        return False
    if device.type == "cuda":
        torch.cuda.set_device(device)
    kw: dict[str, Any] = {}
    if device.type == "cuda":
        kw["device_id"] = device
    dist.init_process_group(backend_for(device), timeout=timedelta(seconds=timeout_s), **kw)
    return True


def shutdown(created: bool) -> None:
    """Collect garbage (DDP reducers, FSDP states), then destroy the group we created."""
    gc.collect()
    if created and dist.is_initialized():
        dist.destroy_process_group()


def torchrun_command(nproc: int, argv: list[str]) -> list[str]:
    """The command that runs ``scaletrain ARGV`` on ``nproc`` local processes under torchrun.

    It is ``python -m torch.distributed.run --standalone --nproc-per-node N -m scaletrain.cli
    ARGV``, entered through :func:`torchrun_main` so that a failed rank ends the job with that
    rank's own one-line message instead of torchrun's traceback and failure report.
    """
    import sys

    return [sys.executable, "-c", "import sys; from scaletrain.techniques.data_parallel import torchrun_main; "
            "sys.exit(torchrun_main())", "--standalone", f"--nproc-per-node={nproc}", "-m", "scaletrain.cli", *argv]


def torchrun_main(argv: list[str] | None = None) -> int:
    """``torch.distributed.run.main`` with its failure report reduced to one line (or none when the
    failed rank already printed its ``scaletrain: error:`` line, exit code 2)."""
    import logging
    import sys

    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic") or name.startswith("torch.distributed.run"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        torchrun.main(argv if argv is not None else sys.argv[1:])
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        code = failure.exitcode
        if code == 2:  # a UserError: the rank printed its one-line message
            return 2
        how = f"signal {failure.signal_name()}" if code < 0 else f"exit code {code}"
        print(f"scaletrain: error: rank {rank} failed ({how}); its output is above", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


# --------------------------------------------------------------------------- traffic ledger


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _group_size(group: Any) -> int:
    return dist.get_world_size(group) if group is not None else dist.get_world_size()


# name -> function(bound arguments, N) -> bytes received per rank (module docstring convention)
_TRAFFIC: dict[str, Callable[[dict[str, Any], int], float]] = {
    "all_reduce": lambda a, n: 2 * (n - 1) / n * _nbytes(a["tensor"]),
    "reduce_scatter_tensor": lambda a, n: (n - 1) / n * _nbytes(a["input"]),
    "reduce_scatter_single": lambda a, n: (n - 1) / n * _nbytes(a["input"]),
    "reduce_scatter": lambda a, n: (n - 1) / n * sum(_nbytes(t) for t in a["input_list"]),
    "all_gather_into_tensor": lambda a, n: (n - 1) / n * _nbytes(a["output_tensor"]),
    "all_gather_single": lambda a, n: (n - 1) / n * _nbytes(a["output_tensor"]),
    "all_gather": lambda a, n: (n - 1) * _nbytes(a["tensor"]),
    "broadcast": lambda a, n: (n - 1) / n * _nbytes(a["tensor"]),
    "all_to_all_single": lambda a, n: (n - 1) / n * _nbytes(a["input"]),
}


class CommLedger:
    """Counts bytes per collective (see the module docstring) and remembers the last one started.

    One ledger per process (:data:`LEDGER`); :meth:`install` wraps the ``torch.distributed``
    functions in :data:`_TRAFFIC` (reference-counted, :meth:`uninstall` restores them).
    ``paused()`` excludes bookkeeping traffic (loss averaging for the log) from the counts.
    """

    def __init__(self) -> None:
        self.bytes: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.last: tuple[str, int, int] | None = None  # (collective, tensor bytes, ranks)
        self._lock = threading.Lock()
        self._paused = 0
        self._installed = 0
        self._originals: dict[str, Callable[..., Any]] = {}

    # -- counting ------------------------------------------------------------------------
    def record(self, name: str, args: dict[str, Any], group: Any) -> None:
        n = _group_size(group)
        traffic = _TRAFFIC[name](args, n) if n > 1 else 0.0
        size = max((_nbytes(v) for v in args.values() if isinstance(v, torch.Tensor)), default=0)
        with self._lock:
            self.last = (name, size, n)
            if self._paused:
                return
            self.bytes[name] = self.bytes.get(name, 0.0) + traffic
            self.calls[name] = self.calls.get(name, 0) + 1

    def total(self) -> float:
        """Bytes received per rank so far (all collectives)."""
        with self._lock:
            return sum(self.bytes.values())

    def reset(self) -> None:
        with self._lock:
            self.bytes.clear()
            self.calls.clear()

    def add(self, name: str, nbytes: float, calls: int = 1) -> None:
        """Count traffic measured elsewhere (collectives the wrappers cannot see: DTensor's
        functional collectives, point-to-point rings), in this ledger's convention."""
        with self._lock:
            self.bytes[name] = self.bytes.get(name, 0.0) + nbytes
            self.calls[name] = self.calls.get(name, 0) + calls

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        with self._lock:
            self._paused += 1
        try:
            yield
        finally:
            with self._lock:
                self._paused -= 1

    # -- patching ------------------------------------------------------------------------
    def install(self) -> None:
        if self._installed == 0:
            for name in _TRAFFIC:
                orig = getattr(dist, name, None)
                if orig is None:
                    continue
                self._originals[name] = orig
                setattr(dist, name, self._wrap(name, orig))
        self._installed += 1

    def uninstall(self) -> None:
        self._installed = max(0, self._installed - 1)
        if self._installed == 0:
            for name, orig in self._originals.items():
                setattr(dist, name, orig)
            self._originals.clear()

    def _wrap(self, name: str, orig: Callable[..., Any]) -> Callable[..., Any]:
        sig = inspect.signature(orig)

        @functools.wraps(orig)
        def counted(*args: Any, **kwargs: Any) -> Any:
            bound = sig.bind(*args, **kwargs)
            self.record(name, bound.arguments, bound.arguments.get("group"))
            return orig(*args, **kwargs)

        return counted


LEDGER = CommLedger()
"""The process-wide traffic ledger."""


class CommFailure(UserError):
    """A collective timed out or lost a peer; the message names the rank and the collective."""


_TIMEOUT_WORDS = ("timed out", "timeout", "time out")
_PEER_WORDS = ("connection closed by peer", "connection reset by peer", "broken pipe", "connection refused")


def explain_comm_failure(exc: BaseException, rank: int, step: int, timeout_s: float) -> CommFailure | None:
    """One line for a collective that failed, or None when ``exc`` is not a communication failure."""
    text = str(exc).lower()
    if isinstance(exc, CommFailure):
        return exc
    timed_out = any(w in text for w in _TIMEOUT_WORDS)
    lost_peer = any(w in text for w in _PEER_WORDS)
    if not (timed_out or lost_peer or isinstance(exc, getattr(dist, "DistBackendError", ()))):
        return None
    op = "a collective"
    if LEDGER.last is not None:
        name, size, n = LEDGER.last
        op = f"{name} of {size / 2**20:.2f} MiB over {n} ranks"
    if timed_out:
        why = (f"timed out after {timeout_s:g} s: another rank stopped, crashed or took a different path "
               f"(raise parallel.timeout_s if one step legitimately takes longer)")
    else:
        why = "lost its peer: another rank exited or crashed (see that rank's message)"
    return CommFailure(f"rank {rank}: {op} at step {step + 1} {why}")


# --------------------------------------------------------------------------- strategies


class Strategy:
    """Single process (and the interface of every data-parallel strategy).

    The trainer calls, per optimizer step: :meth:`run_micro_batches` (by default: for each
    micro-batch ``micro_batch(last)`` around the trainer's forward/backward, ``after_backward(last)``
    after it), then ``prepare_step`` -> ``clip_grad_norm`` -> :meth:`optimizer_step` ->
    ``after_step`` -> ``zero_grad``. Strategies that are not pure data parallelism (pipeline,
    tensor/context/expert parallelism, offloading) override the hooks they need: their own
    micro-batch loop (a pipeline schedule), their own evaluation forward (:meth:`eval_batch`),
    their own optimizer step (a host-side optimizer), and say which slice of the data this rank
    reads (:attr:`data_rank` of :attr:`data_world` data-parallel replicas).
    """

    name = "single"
    stage = 0

    def __init__(self, model: nn.Module, rank: int = 0, world: int = 1) -> None:
        self.model = model
        self.rank, self.world = rank, world
        self.data_rank, self.data_world = rank, world
        """This rank reads data shard ``data_rank`` of ``data_world`` (the data-parallel replicas)."""
        self.forward_module: nn.Module = model

    # -- the trainer's loop, overridable as a whole ----------------------------------------
    def run_micro_batches(self, trainer: Any, it: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Forward and backward of one optimizer step's ``trainer.accum`` micro-batches (gradients of
        the mean loss accumulate into ``.grad``); returns this rank's mean micro-batch loss."""
        step_loss = 0.0
        for j in range(trainer.accum):
            last = j == trainer.accum - 1
            x, y = next(it)
            x, y = x.to(trainer.device, non_blocking=True), y.to(trainer.device, non_blocking=True)
            with self.micro_batch(last):
                step_loss += float(trainer.forward_backward(x, y, 1.0 / trainer.accum)) / trainer.accum
            self.after_backward(last)
        return step_loss

    def eval_batch(self, trainer: Any, x: torch.Tensor, y: torch.Tensor) -> tuple[float, int, int]:
        """(summed loss, correct predictions, samples) of one validation micro-batch on this rank."""
        with trainer.autocast():
            out = self.model(x)
        loss = float(trainer.loss_fn(out, y)) * len(y)
        correct = int((out.argmax(-1) == y).sum()) if trainer.task != "lm" else 0
        return loss, correct, len(y)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler) -> None:
        """The update (skipped by the fp16 loss scaler on inf/NaN gradients)."""
        scaler.step(optimizer)
        scaler.update()

    def metrics(self) -> dict[str, Any]:
        """Extra per-step figures for the metrics rows (measured next to predicted), if any."""
        return {}

    # -- construction --------------------------------------------------------------------
    def build_optimizer(self, build: Callable[[nn.Module], torch.optim.Optimizer]) -> torch.optim.Optimizer:
        return build(self.model)

    def make_scaler(self, device: torch.device, enabled: bool) -> torch.amp.GradScaler:
        return torch.amp.GradScaler(device.type, enabled=enabled)

    # -- the step ------------------------------------------------------------------------
    def micro_batch(self, last: bool) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def after_backward(self, last: bool) -> None:
        pass

    def prepare_step(self, optimizer: torch.optim.Optimizer) -> None:
        pass

    def clip_grad_norm(self, optimizer: torch.optim.Optimizer, max_norm: float) -> float:
        """Clip the global gradient norm (L2 over all parameters) to ``max_norm``; return it."""
        return float(nn.utils.clip_grad_norm_(self.model.parameters(), max_norm, foreach=True))

    def after_step(self) -> None:
        pass

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)

    # -- reductions for logging ----------------------------------------------------------
    def mean(self, values: list[float]) -> list[float]:
        """Average ``values`` over the data-parallel ranks (bookkeeping: not counted as traffic)."""
        if self.world == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64)
        with LEDGER.paused():
            dist.all_reduce(t)
        return (t / self.world).tolist()

    def sum(self, values: list[float]) -> list[float]:
        if self.world == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64)
        with LEDGER.paused():
            dist.all_reduce(t)
        return t.tolist()

    # -- state ---------------------------------------------------------------------------
    def model_state_dict(self) -> dict[str, Any]:
        """Full (single-process layout) model state; collective in sharded strategies."""
        return self.model.state_dict()

    def load_model_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state)

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return optimizer.state_dict()

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        if state.get("sharded"):  # written by a ZeRO run whose states could not be consolidated
            raise ConfigError(f"the checkpoint's optimizer states are sharded for parallel.dp={state['dp']} "
                              f"parallel.zero={state['stage']} (8-bit or factored states cannot be re-sharded); "
                              f"resume with those values")
        optimizer.load_state_dict(state)

    def describe(self) -> str:
        return "single process"

    def close(self) -> None:
        """Drop references to wrappers so that garbage collection can free them before teardown."""
        self.forward_module = self.model


class DDPStrategy(Strategy):
    """ZeRO stage 0: replicated everything, gradients all-reduced by torch DDP.

    DDP all-reduces gradients in buckets of ``bucket_mb`` MiB (25 by default, Li et al. VLDB
    2020), launching each bucket's all-reduce as soon as backward has produced all its
    gradients, so communication overlaps the rest of backward. ``gradient_as_bucket_view``
    makes ``param.grad`` views of the buckets (no second gradient copy: 4 Psi bytes of fp32
    gradients, not 8). Gradient accumulation runs the first micro-batches under ``no_sync``.
    A Python comm hook (plain all-reduce, or a compressor from
    :mod:`scaletrain.techniques.compression`) routes the traffic through the ledger.
    """

    name = "ddp"

    def __init__(self, model: nn.Module, rank: int, world: int, device: torch.device, *, bucket_mb: float,
                 compression: str = "none", compression_rank: int = 4, topk_ratio: float = 0.01,
                 compression_warmup_steps: int = 10, seed: int = 0) -> None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        from scaletrain.techniques import compression as comp

        super().__init__(model, rank, world)
        ids = [device.index] if device.type == "cuda" else None
        self.ddp = DDP(model, device_ids=ids, bucket_cap_mb=bucket_mb, gradient_as_bucket_view=True, init_sync=True)
        self.compressor = comp.make_hook(compression, world=world, rank=compression_rank, topk_ratio=topk_ratio,
                                         warmup_steps=compression_warmup_steps, seed=seed)
        self.ddp.register_comm_hook(self.compressor.state, self.compressor.hook)
        self.forward_module = self.ddp
        self.compression = compression

    def micro_batch(self, last: bool) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext() if last else self.ddp.no_sync()

    def after_step(self) -> None:
        self.compressor.step_done()

    def describe(self) -> str:
        extra = f", {self.compression} compression" if self.compression != "none" else ""
        return f"DDP over {self.world} ranks (zero=0{extra})"

    def close(self) -> None:
        super().close()
        self.ddp = None  # type: ignore[assignment]
        self.compressor = None  # type: ignore[assignment]

"""ZeRO's cost face (Rajbhandari et al., SC20): per-rank model-state bytes and bytes per step.

With ``P, G, M, K`` bytes per parameter for the compute parameters, gradients, fp32 master
weights and optimizer states, on ``N`` ranks

    stage 0: (P + G + M + K) Psi         stage 2: P Psi + (G + M + K) Psi / N
    stage 1: (P + G) Psi + (M + K) Psi/N stage 3: (P + G + M + K) Psi / N

mixed-precision Adam (P = G = 2, M = 4, K = 8): 16, 4 + 12/N, 2 + 14/N, 16/N;
fp32 Adam (P = G = 4, M = 0, K = 8): 16, 8 + 8/N, 4 + 12/N, 16/N.
:func:`comm_bytes_per_step` — bytes received per rank per optimizer step: 2 Psi (N-1)/N elements for
stages 0-2, 3 Psi (N-1)/N for stage 3 (ZeRO section 7; less the parameters FSDP keeps gathered from
forward into backward), times element sizes.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Sequence

from scaletrain.errors import ConfigError
from scaletrain.measure.model_states import ModelStateBytes
from scaletrain.techniques.data_parallel.sharded import shard_rows



def bytes_per_param(precision: str, optim_state_bytes: float = 8.0) -> dict[str, float]:
    """(P, G, M, K) of the cost face: ``fp32`` or ``mixed`` (bf16/fp16 compute + fp32 master).

    ``optim_state_bytes``: K for the optimizer (Adam 8, SGD momentum 4, 8-bit Adam ~2.004).
    """
    if precision == "fp32":
        return {"param": 4.0, "grad": 4.0, "master": 0.0, "optim": optim_state_bytes}
    if precision in ("mixed", "bf16", "fp16"):
        return {"param": 2.0, "grad": 2.0, "master": 4.0, "optim": optim_state_bytes}
    raise ConfigError(f"precision {precision!r} is not allowed; allowed: fp32, mixed, bf16, fp16")


def model_state_bytes(n_params: float, stage: int, dp: int, *, precision: str = "fp32",
                      optim_state_bytes: float = 8.0) -> ModelStateBytes:
    """Per-rank model-state bytes of ZeRO ``stage`` on ``dp`` ranks (module docstring).

    Stage 3 as run by FSDP2 keeps no separate half-precision copy: its sharded fp32
    parameters *are* the masters and its sharded gradients are fp32, so P + G + M = 4 + 4 + 0
    per Psi/N instead of 2 + 2 + 4 — the same total.
    """
    _check(stage, dp)
    b = bytes_per_param(precision, optim_state_bytes)
    n, N = float(n_params), float(dp)
    P, G, O = b["param"] * n, b["grad"] * n, (b["master"] + b["optim"]) * n
    if stage == 0:
        return ModelStateBytes(P, G, O)
    if stage == 1:
        return ModelStateBytes(P, G, O / N)
    if stage == 2:
        return ModelStateBytes(P, G / N, O / N)
    if precision != "fp32":  # FSDP2: fp32 sharded params (= masters) and fp32 sharded grads
        return ModelStateBytes(4 * n / N, 4 * n / N, b["optim"] * n / N)
    return ModelStateBytes(P / N, G / N, O / N)


def comm_bytes_per_step(n_params: float, stage: int, dp: int, *, grad_bytes: float = 4.0,
                        param_bytes: float = 4.0, accum: int = 1, hsdp: int = 0, kept: float = 0.0) -> float:
    """Bytes received per rank per optimizer step (ring algorithms; see data_parallel's ledger).

    Stage 0: one all-reduce of the gradients (``no_sync`` for the first ``accum - 1``
    micro-batches). Stage 1: one reduce-scatter of gradients (after accumulation) + one
    all-gather of parameters. Stage 2: a reduce-scatter per micro-batch + one all-gather.
    Stage 3: per micro-batch two all-gathers of parameters (forward, backward) + one
    reduce-scatter, less ``kept`` parameters gathered once (not resharded after forward: the root's
    and the last group's, :func:`.fsdp.kept_elements`). ``hsdp=G``: shard within groups of G ranks,
    and all-reduce the gradient shards (Psi/G) across the dp/G replicas.
    """
    _check(stage, dp)
    n, N = float(n_params), dp
    if N <= 1:
        return 0.0
    G = hsdp or N
    if N % G:
        raise ConfigError(f"parallel.hsdp={hsdp} must divide parallel.dp={dp}")
    R = N // G
    ring = (G - 1) / G
    rep = 2 * (R - 1) / R * n / G * grad_bytes if R > 1 else 0.0
    if stage == 0:
        return 2 * (N - 1) / N * n * grad_bytes
    if stage == 1:
        return ring * n * (grad_bytes + param_bytes) + rep
    if stage == 2:
        return accum * (ring * n * grad_bytes + rep) + ring * n * param_bytes
    return accum * (ring * ((2 * n - kept) * param_bytes + n * grad_bytes) + rep)


def data_parallel_estimate(n_params: float, stage: int, dp: int, *, precision: str = "fp32",
                           optim_state_bytes: float = 8.0, accum: int = 1, hsdp: int = 0,
                           kept: float = 0.0) -> dict[str, Any]:
    """What ``scaletrain estimate --dp N --zero S`` adds: per-rank model-state bytes (sharded over
    the ``hsdp`` group when given, else all ``dp`` ranks) and bytes received per rank per step.

    ``precision`` is the *storage* precision of parameters/gradients ("fp32", or "bf16"/"fp16" =
    mixed with fp32 masters); ``optim_state_bytes`` is K of the optimizer (bytes per parameter).
    """
    shard = hsdp or dp
    ms = model_state_bytes(n_params, stage, shard, precision=precision, optim_state_bytes=optim_state_bytes)
    b = bytes_per_param(precision, optim_state_bytes)
    comm = comm_bytes_per_step(n_params, stage, dp, grad_bytes=b["grad"], param_bytes=b["param"], accum=accum,
                               hsdp=hsdp, kept=kept)
    return {"dp": dp, "zero": stage, "hsdp": hsdp, "optim_state_bytes_per_param": optim_state_bytes,
            "model_state_bytes_per_rank": {"params": ms.params, "grads": ms.grads, "optimizer": ms.optimizer,
                                           "total": ms.total},
            "comm_bytes_per_step": comm}


def shard_numel(shapes: Iterable[tuple[int, ...]], dp: int, rank: int) -> int:
    """Exact parameter count rank ``rank`` owns when every tensor is row-sharded over ``dp``."""
    total = 0
    for s in shapes:
        rows = s[0] if s else 1
        total += shard_rows(rows, dp, rank)[2] * (math.prod(s[1:]) if len(s) > 1 else 1)
    return total


def _check(stage: int, dp: int) -> None:
    if stage not in (0, 1, 2, 3):
        raise ConfigError(f"parallel.zero={stage} is not allowed; allowed: 0, 1, 2, 3")
    if dp < 1:
        raise ConfigError(f"parallel.dp={dp} is not allowed; must be >= 1")


# -- ZeRO-3 (FSDP2) grouping: how many consecutive blocks one all-gather / reduce-scatter moves -------------

FSDP_LINK: dict[str, tuple[float, float, bool]] = {
    "cpu": (1e-3, 1e9, False),
    "cuda": (30e-6, 100e9, True),
}
"""Device type -> (alpha: seconds one FSDP group's collective costs beyond its bytes, beta: bytes/s,
overlaps: whether a group's collectives run beside the compute of its neighbours) that price the
grouping. alpha is the collective's latency plus FSDP2's per-group work (copy-in/out, hooks): gloo
measured 0.2-0.35 ms for an 8-byte all-gather between 2 processes on this 2-core machine and ~9 ms a
group inside FSDP under load (issue 32), so 1 ms; NCCL ~10 us + a kernel launch per copy, so 30 us. beta:
gloo ~0.4-1 GB/s here (2-8 MiB all-gathers), NVLink-class intra-node for CUDA. overlaps: the cost model's
own rule (:mod:`scaletrain.techniques.time_cost`, ``Platform.copy_overlaps_compute``): on a CPU gloo's
threads copy and reduce on the cores the compute runs on, so prefetching hides nothing and every byte is
waited for whatever the grouping; on CUDA the collectives run on their own stream. Constants, not the
platform's: the runtime and ``estimate`` must choose the same groups (the predicted peak depends on them)."""


def fsdp_groups(block_bytes: Sequence[float], limit: float) -> list[list[int]]:
    """Consecutive blocks merged greedily: a group takes the next block while its bytes stay <= ``limit``
    (a block larger than ``limit`` is a group alone); ``limit <= 0``: one group per block. Indices."""
    groups: list[list[int]] = []
    size = 0.0
    for i, nbytes in enumerate(block_bytes):
        if groups and limit > 0 and size + nbytes <= limit:
            groups[-1].append(i)
            size += nbytes
        else:
            groups.append([i])
            size = float(nbytes)
    return groups


def fsdp_group_seconds(group_bytes: Sequence[float], dp: int, accum: int, device_type: str) -> float:
    """Seconds the grouping adds to a ZeRO-3 step beyond its (grouping-independent) bytes/beta: every
    group's two all-gathers and one reduce-scatter per micro-batch (the last group: one all-gather, it stays
    gathered from forward into backward) pay ``dp - 1`` ring steps of alpha. Where collectives overlap
    compute (:data:`FSDP_LINK`), prefetch hides all but the first group's all-gather and the last group's
    reduce-scatter, so a larger group is exposed for longer; where they do not (a CPU), every byte is
    exposed in any grouping, so only the collectives' count differs (fewer groups: faster)."""
    if dp <= 1 or not group_bytes:
        return 0.0
    alpha, beta, overlaps = FSDP_LINK.get(device_type, FSDP_LINK["cuda"])
    latency = (3 * len(group_bytes) - 1) * accum * (dp - 1) * alpha
    exposed = (dp - 1) / dp * (group_bytes[0] + group_bytes[-1]) / beta if overlaps else 0.0
    return latency + exposed


def fsdp_group_limit(setting: str, block_bytes: Sequence[float], dp: int, accum: int, device_type: str) -> float:
    """The byte limit of ``parallel.fsdp_group``: ``block`` -> 0 (one group per block), a size such as
    ``8MiB`` -> its bytes, ``auto`` -> the limit whose groups :func:`fsdp_group_seconds` prices lowest
    (candidates: one block each, then k times the largest block up to the whole model; ties: smaller)."""
    from scaletrain.techniques.remat.schedule import parse_bytes

    s = str(setting).strip()
    if s == "block":
        return 0.0
    if s != "auto":
        try:
            return float(parse_bytes(s) or 0)
        except Exception:  # noqa: BLE001 - any unreadable value: one line naming what is allowed
            raise ConfigError(f"parallel.fsdp_group={setting!r} is not allowed; allowed: auto, block, or a size "
                              f"in bytes such as 8MiB") from None
    return fsdp_group_candidates(block_bytes, dp, accum, device_type)[0]


def fsdp_group_candidates(block_bytes: Sequence[float], dp: int, accum: int, device_type: str) -> list[float]:
    """Byte limits ``auto`` chooses among, fastest first by :func:`fsdp_group_seconds` (ties: smaller first):
    one group per block (0), k times the largest block, the whole model. Limits giving the same groups are
    listed once. ``parallel.fsdp_group=auto`` takes the first; with a memory budget
    (:mod:`.grouping`) the first whose gathered bytes fit."""
    if not block_bytes:
        return [0.0]
    big, total = max(block_bytes), sum(block_bytes)
    candidates = [0.0] + [k * big for k in range(1, len(block_bytes) + 1) if k * big < total] + [total]
    seen: dict[tuple, float] = {}
    for lim in sorted(candidates):
        seen.setdefault(tuple(map(tuple, fsdp_groups(block_bytes, lim))), lim)

    def price(limit: float) -> float:
        groups = fsdp_groups(block_bytes, limit)
        return fsdp_group_seconds([sum(block_bytes[i] for i in g) for g in groups], dp, accum, device_type)

    return sorted(seen.values(), key=lambda lim: (price(lim), lim))

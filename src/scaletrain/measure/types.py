"""The per-block cost table every planner reads.

A :class:`Profile` is produced either by *measuring* a Chain on a real device (tracker +
timers) or by *estimating* it from fake/meta tensors; both give the same type so that the
rematerialization, offloading and pipeline planners never care which. Units: bytes, seconds,
FLOPs (floating-point operations, not per second).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field


PRECISIONS = ("fp32", "bf16", "fp16")
"""Compute precisions a step may run in (autocast dtype; fp32 = none)."""

@dataclass
class BlockProfile:
    """Costs of one block of a Chain for one micro-batch.

    Memory fields count *storage bytes* on the block's device. ``saved_bytes`` are the
    tensors autograd keeps from this block's forward until its backward, *excluding* the
    block's input (counted in ``input_bytes``) and its parameters; a rematerialization solver
    that keeps only the input of a block frees ``saved_bytes`` and pays ``fwd_time_s`` again.
    """

    name: str
    fwd_time_s: float = 0.0
    """Median forward time, seconds."""
    bwd_time_s: float = 0.0
    """Median backward time (input and weight gradients), seconds."""
    param_bytes: int = 0
    """Bytes of the parameters this block owns (tied parameters counted once, in the first block)."""
    param_count: int = 0
    """Number of parameter elements this block owns."""
    input_bytes: int = 0
    """Bytes of the block's input activation."""
    output_bytes: int = 0
    """Bytes of the block's output activation."""
    saved_bytes: int = 0
    """Bytes saved for backward by this block beyond its input and parameters."""
    fwd_temp_bytes: int = 0
    """Peak transient bytes above (input + output + saved) during the forward."""
    bwd_temp_bytes: int = 0
    """Peak transient bytes during the backward above the gradients it produces."""
    flops_fwd: float = 0.0
    """Forward FLOPs (torch.utils.flop_counter convention: 2 per multiply-add)."""
    flops_bwd: float = 0.0
    """Backward FLOPs."""
    fwd_time_spread_s: float = 0.0
    """Spread (max - min over repeats) of the forward time, seconds; 0 for estimates."""
    bwd_time_spread_s: float = 0.0
    """Spread of the backward time, seconds; 0 for estimates."""


@dataclass
class Profile:
    """Per-block costs of a Chain for one micro-batch, plus what they were measured under."""

    blocks: list[BlockProfile]
    model: str = ""
    batch: int = 1
    seq: int = 0
    precision: str = "fp32"
    device: str = "cpu"
    measured: bool = False
    """True when times and bytes come from a real run; False when estimated."""
    meta: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.blocks)

    @property
    def param_bytes(self) -> int:
        return sum(b.param_bytes for b in self.blocks)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_dict(cls, d: dict) -> "Profile":
        d = dict(d)
        d["blocks"] = [BlockProfile(**b) for b in d["blocks"]]
        return cls(**d)

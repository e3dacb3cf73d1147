"""torch.compile as a plan key (``train.compile``): its apply face, its auto rule and its cost face.

**Where it sits in the stack** (:mod:`.stack`): after tensor/context/expert parallelism and
rematerialization, before data parallelism, as torchtitan does — each block of the model's
:class:`~scaletrain.chain.Chain` is compiled *in place* (``nn.Module.compile``), so

* parameter names and the state dict are unchanged (checkpoints load either way);
* the model's own forward, the remat tree's checkpoints around the blocks and DDP/FSDP's wrappers
  all call the compiled blocks, because they call the same module objects.

**auto** compiles only on CUDA. On a CPU the default job must never get slower, and measured on this
project's 2-core machine (``measure_factor``, one thread) a compiled gpt2-tiny block's forward + backward
takes 1.02-1.06 x the eager time (median of 50 paired steps, 3 runs: no gain) after ~38 s of compiling
(cold cache) — so ``auto`` keeps eager there (identical to ``false``).

**Cost face**: a compiled block's compute time is the eager time times the platform's measured
``compile_factor`` (``scaletrain calibrate --compile`` times one compiled vs eager transformer block's
forward + backward); 0 means not measured, and then the plan's estimate says compile is not priced.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from scaletrain.errors import ConfigError

CHOICES = ("false", "true", "auto")
"""Values of ``train.compile``."""


def resolve(value: str, device_type: str) -> bool:
    """Whether ``train.compile=value`` compiles on ``device_type`` (``auto``: only on CUDA, see the
    module docstring for why not on a CPU)."""
    if value not in CHOICES:
        raise ConfigError(f"train.compile={value!r} is not allowed; allowed: {', '.join(CHOICES)}")
    return value == "true" or (value == "auto" and device_type == "cuda")


def compile_blocks(model: nn.Module) -> int:
    """Compile every block of ``model``'s Chain in place (step 3c of the stack); returns how many."""
    from scaletrain.chain import to_chain

    blocks = list(to_chain(model).blocks)
    for b in blocks:
        b.compile()  # in place: the module keeps its parameters, names and hooks; its __call__ runs the graph
    return len(blocks)


def apply(plan: Any, model: nn.Module, ctx: Any) -> None:
    """The stack's face: compile the blocks when the plan asks (after TP/remat, before DDP/FSDP)."""
    if not resolve(plan.compile, ctx.device.type):
        if plan.compile == "auto":
            ctx.log("compile: auto -> eager on cpu (compile time exceeds what a CPU run gains; see train.compile)")
        return
    n = compile_blocks(model)
    ctx.log(f"compile: {n} Chain blocks compiled with torch.compile (inductor); the first step compiles them")


# --------------------------------------------------------------------------- the cost face

def priced_note(plan: Any, factor: float, device_type: str = "cpu") -> str:
    """One line for a plan's estimate: how compile is priced ('' when the plan does not compile)."""
    if not resolve(getattr(plan, "compile", "false"), device_type):
        return ""
    if factor > 0:
        return f"compile: compute time x {factor:.2f} (measured compiled/eager block, scaletrain calibrate)"
    return "compile: not priced (no measured factor on this platform; run `scaletrain calibrate --compile`)"


def compute_factor(plan: Any, factor: float, device_type: str = "cpu") -> float:
    """What the cost model multiplies compute time by: the measured factor when the plan compiles
    and a factor was measured, else 1 (and :func:`priced_note` says it is not priced)."""
    return factor if factor > 0 and resolve(getattr(plan, "compile", "false"), device_type) else 1.0


def measure_factor(device: str = "cpu", hidden: int = 128, seq: int = 64, batch: int = 4,
                   repeats: int = 50) -> tuple[float, float]:
    """(compiled / eager seconds of one transformer block's forward + backward, compile seconds):
    a gpt2-tiny-sized block on ``device``: the median of ``repeats`` ratios of a compiled step over the
    eager step run right after it (pairs, so that a neighbour's load on a shared machine hits both alike;
    the median, so that a burst of it does not set the figure)."""
    from scaletrain.models.gpt2 import GPT2Block, GPT2Config

    cfg = GPT2Config(n_embd=hidden, n_head=4, n_layer=1, n_positions=seq, vocab_size=256)
    torch.manual_seed(0)
    block = GPT2Block(cfg).to(device)
    x = torch.randn(batch, seq, hidden, device=device, requires_grad=True)

    def step(fn: Any) -> float:
        t0 = time.perf_counter()
        fn(x).sum().backward()
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    compiled = torch.compile(block)
    step(block)
    compile_s = step(compiled)  # the first call compiles (forward and backward graphs)
    ratios = sorted(step(compiled) / step(block) for _ in range(repeats))
    return ratios[len(ratios) // 2], compile_s

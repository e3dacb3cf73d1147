"""Ranges of the commands' numeric options, declared once next to each ``add_argument`` (``type=``).

A value outside its range is an argparse error: one line naming the option, the value and what is
allowed, plus a pointer to ``--help`` (:class:`scaletrain.cli.Parser`), exit code 2, nothing run.
Upper bounds are where a huge value is a mistake that would fork, allocate or loop without bound
(``--nproc-per-node 1000``, ``pipeline --ranks 100000``), not a limit of the technique.
"""

from __future__ import annotations

import argparse
import math
import os
from typing import Callable

MAX_PROCS = max(8, 4 * (os.cpu_count() or 1))
"""Processes one command may start on this machine (``--nproc-per-node``): 4 per core, at least 8 (one node
of 8 GPUs). More would only oversubscribe the cores; a larger job is several nodes under torchrun."""
MAX_RANKS = 1 << 20
"""Ranks of one parallel dimension a prediction may name (about a million devices)."""
MAX_PIPELINE_RANKS = 4096
"""Pipeline stages a prediction may name (the simulator lays out every pass of every stage)."""
MAX_MICROBATCHES = 1 << 16
"""Micro-batches per step a pipeline prediction may name."""
MAX_VIRTUAL = 64
"""Virtual stages per pipeline rank (interleaved)."""
MAX_PIPELINE_PASSES = 1 << 16
"""Passes (ranks x micro-batches x virtual stages x steps) one pipeline simulation may lay out: 64 x 1024 took
15 s and 0.3 GiB on one shared CPU core, and the time grows faster than the passes (4x the passes: 82 s);
``pipeline --ranks 100000 --microbatches 100000`` would be 10^10."""
MAX_SIZE = 1 << 31
"""Samples, tokens or micro-batches of one step a prediction may name."""


def bounded(kind: type = int, lo: float | None = None, hi: float | None = None, *, infinite: bool = False,
            above: bool = False) -> Callable[[str], int | float]:
    """An argparse ``type``: ``kind`` (int or float) in [lo, hi] (``above``: strictly above ``lo``); NaN never,
    infinity only where ``infinite`` (it means unlimited there)."""
    def parse(text: str) -> int | float:
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") \
                from None
        if isinstance(v, float) and (math.isnan(v) or (math.isinf(v) and not infinite)):
            raise argparse.ArgumentTypeError(f"{text!r} is not allowed; expected a finite number")
        if math.isinf(v):
            return v
        if (lo is not None and (v < lo or (above and v == lo))) or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"{text!r} is not allowed; expected {_range(kind, lo, hi, above)}")
        return v
    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


def _range(kind: type, lo: float | None, hi: float | None, above: bool) -> str:
    what = "an integer" if kind is int else "a number"
    num = (lambda x: f"{int(x):,}") if kind is int else (lambda x: f"{x:g}")
    if lo is not None and hi is not None and not above:
        return f"{what} from {num(lo)} to {num(hi)}"
    parts = ([f"{'>' if above else '>='} {num(lo)}"] if lo is not None else []) \
        + ([f"<= {num(hi)}"] if hi is not None else [])
    return f"{what} {' and '.join(parts)}"


def positive_int(hi: float = MAX_SIZE) -> Callable[[str], int | float]:
    """An integer from 1 to ``hi``."""
    return bounded(int, 1, hi)


def count(hi: float = MAX_SIZE) -> Callable[[str], int | float]:
    """An integer from 0 to ``hi`` (0 = the command's default)."""
    return bounded(int, 0, hi)


def positive_float(hi: float | None = None, infinite: bool = False) -> Callable[[str], int | float]:
    """A finite number > 0 (``infinite``: inf allowed, meaning unlimited)."""
    return bounded(float, 0.0, hi, above=True, infinite=infinite)


def check_output(flag: str, path: str | os.PathLike, directory: bool = False) -> None:
    """One-line UserError, before any work, unless ``path`` can be written: a file (``directory``: a directory)
    that is not the other kind, under a nearest existing ancestor that is a writable directory."""
    from pathlib import Path

    from scaletrain.errors import UserError

    p = Path(path)
    if p.exists() and p.is_dir() != directory:
        raise UserError(f"{flag} {str(p)!r} is {'a file' if directory else 'a directory'}; give "
                        f"{'a directory' if directory else 'a file name'}")
    parent = p if directory else p.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"{flag} {str(p)!r} cannot be written: {str(parent)!r} is not a writable directory")

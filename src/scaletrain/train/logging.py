"""Run outputs a person and a program can read: metrics.jsonl rows (and the other ``train.loggers``) and a
terminal progress bar."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import IO, Any

from scaletrain.train.safe_write import open_append
from scaletrain.train.loggers import parse as parse_loggers


class MetricsWriter:
    """Appends one JSON object per line to ``metrics.jsonl`` (flushed per row, so a crash loses nothing)."""

    def __init__(self, path: Path | None, loggers: str = "jsonl", start_step: int = 0):
        """``loggers``: ``train.loggers``; the other sinks (:mod:`.loggers`) get the same rows."""
        self.path = path
        self._f: IO[str] | None = open_append(path) if path is not None else None  # never a symlink
        self._sinks = None
        names = parse_loggers(loggers)
        if path is not None and names:
            from scaletrain.train.loggers import Sinks

            self._sinks = Sinks(path.parent, names, start_step)

    def write(self, row: dict[str, Any]) -> None:
        if self._f is None:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
        self._f.write(json.dumps(clean) + "\n")
        self._f.flush()
        if self._sinks is not None:
            self._sinks.write(row)

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
        if self._sinks is not None:
            self._sinks.close()
            self._sinks = None


def _fmt_duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def _fmt_rate(x: float) -> str:
    for div, suffix in ((1e6, "M"), (1e3, "k")):
        if x >= div:
            return f"{x / div:.1f}{suffix}"
    return f"{x:.1f}"


class ProgressBar:
    """One self-overwriting line on stderr: step, bar, loss, throughput and ETA. Silent when disabled."""

    def __init__(self, total: int, start: int, unit: str, enabled: bool, stream: IO[str] | None = None):
        # sys.stderr read now, not at import: it may have been replaced since (pytest's capture, a redirect)
        self.total, self.start, self.unit, self.enabled = total, start, unit, enabled
        self.stream = stream if stream is not None else sys.stderr
        self.t0 = time.monotonic()

    def update(self, step: int, loss: float, rate: float) -> None:
        if not self.enabled:
            return
        done = step - self.start
        elapsed = time.monotonic() - self.t0
        eta = elapsed / done * (self.total - step) if done else 0.0
        width = 24
        filled = int(width * step / self.total)
        bar = "#" * filled + "." * (width - filled)
        self.stream.write(f"\rstep {step}/{self.total} [{bar}] loss {loss:.4f} "
                          f"{_fmt_rate(rate)} {self.unit}/s ETA {_fmt_duration(eta)}   ")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()

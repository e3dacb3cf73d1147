"""Where metrics rows go besides ``metrics.jsonl`` (``train.loggers``): TensorBoard, CSV, Weights & Biases.

Every sink gets the same rows ``metrics.jsonl`` gets (rank 0's, after each logged step and
evaluation), reduced to their numbers: nested dicts are flattened with ``/``
(``time_breakdown_s/forward``), lists and strings are left to the JSONL file. The step of a row is the
optimizer step. On a resume each sink drops what it held past the resumed step, as ``metrics.jsonl``
is trimmed: TensorBoard by its ``purge_step``, the CSV file by rewriting, W&B by resuming its run id.

- ``tensorboard``: event files under ``RUN/tb/`` (``torch.utils.tensorboard``; needs the
  ``tensorboard`` package: ``pip install 'scaletrain[tensorboard]'``).
- ``csv``: ``RUN/metrics.csv``, one ``step,name,value`` line per number (rows differ in their keys,
  so the long form keeps every column without rewriting a header).
- ``wandb``: offline only (``RUN/wandb/``, ``wandb sync`` uploads it later); never required.
"""

from __future__ import annotations

import csv
import importlib.util
import math
import os
from pathlib import Path
from typing import Any

from scaletrain.errors import ConfigError

LOGGERS = ("jsonl", "tensorboard", "csv", "wandb")
_PACKAGE = {"tensorboard": "tensorboard", "wandb": "wandb"}


def parse(spec: str) -> list[str]:
    """The sinks ``train.loggers`` names (``jsonl`` always included); a bad name or a missing package
    is one line before anything is written."""
    names = [n.strip() for n in spec.split(",") if n.strip()]
    for n in names:
        if n not in LOGGERS:
            raise ConfigError(f"train.loggers: unknown logger {n!r}; allowed: {', '.join(LOGGERS)} (comma-separated)")
        pkg = _PACKAGE.get(n)
        if pkg and importlib.util.find_spec(pkg) is None:
            raise ConfigError(f"train.loggers={spec!r}: {n} needs the {pkg} package: pip install "
                              f"'scaletrain[{n}]' (or {pkg}); or drop {n} from train.loggers")
    return [n for n in dict.fromkeys(["jsonl", *names]) if n != "jsonl"]


def scalars(row: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """The finite numbers of ``row`` (bools excluded), nested dicts flattened with ``/``."""
    out: dict[str, float] = {}
    for k, v in row.items():
        if isinstance(v, dict):
            out.update(scalars(v, f"{prefix}{k}/"))
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and k != "step":
            out[prefix + k] = float(v)
    return out


class Sinks:
    """The sinks of one run directory; ``write(row)`` with a ``step`` key, ``close()`` at the end."""

    def __init__(self, run: Path, names: list[str], start_step: int) -> None:
        self._tb = self._csv = self._wandb = None
        self._csv_file: Any = None
        if "tensorboard" in names:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(run / "tb"), purge_step=start_step + 1 if start_step else None)
        if "csv" in names:
            path = run / "metrics.csv"
            _trim_csv(path, start_step)
            new = not path.exists()
            self._csv_file = open(path, "a", newline="")
            self._csv = csv.writer(self._csv_file)
            if new:
                self._csv.writerow(["step", "name", "value"])
        if "wandb" in names:
            import wandb

            os.environ.setdefault("WANDB_SILENT", "true")
            self._wandb = wandb.init(mode="offline", dir=str(run), project="scaletrain", name=run.name,
                                     id=run.name.replace("/", "-"), resume="allow")

    def write(self, row: dict[str, Any]) -> None:
        step = row.get("step")
        if not isinstance(step, int):
            return
        values = scalars(row)
        if self._tb is not None:
            for k, v in values.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._csv is not None:
            self._csv.writerows([step, k, repr(v)] for k, v in values.items())
            self._csv_file.flush()
        if self._wandb is not None and values:
            self._wandb.log(values, step=step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._csv_file is not None:
            self._csv_file.close()
        if self._wandb is not None:
            self._wandb.finish()
        self._tb = self._csv = self._wandb = self._csv_file = None


def _trim_csv(path: Path, last_step: int) -> None:
    """Drop lines logged after ``last_step`` (a resume runs those steps again)."""
    if not path.is_file():
        return
    with open(path, newline="") as fh:
        rows = list(csv.reader(fh))
    kept = [r for r in rows if r and (r[0] == "step" or (r[0].isdigit() and int(r[0]) <= last_step))]
    if len(kept) != len(rows):
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w", newline="") as fh:
            csv.writer(fh).writerows(kept)
        os.replace(tmp, path)

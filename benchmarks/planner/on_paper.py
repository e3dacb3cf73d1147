"""What every on-paper planner benchmark writes around its rows: the date, this machine and the versions,
then the JSON under ``benchmarks/results/`` (run from the repository root)."""

from __future__ import annotations

import json
import platform as host
import sys
import time
from pathlib import Path
from typing import Any

import torch

from scaletrain import __version__


def write_result(name: str, benchmark: str, body: dict[str, Any]) -> Path:
    """``benchmarks/results/<name>.json``: ``benchmark``, the UTC date, the machine, then ``body``."""
    out = {"benchmark": benchmark, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "machine": {"host": host.node(), "cpu": host.processor() or host.machine(), "python": sys.version.split()[0],
                       "torch": torch.__version__, "scaletrain": __version__}, **body}
    path = Path("benchmarks/results") / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1, default=str), encoding="utf-8")
    print(f"wrote {path}")
    return path

"""What a study ran on and how: machine, versions, load and dates, settings (``study.json``)."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import datetime as _dt
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

from scaletrain.compare.matrix import MODELS, STRATEGIES, WARMUP_STEPS, Cell


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def child_env() -> dict[str, str]:
    """The environment of the study's subprocesses: this one, with this scaletrain first on PYTHONPATH."""
    import scaletrain

    env = dict(os.environ)
    src = str(Path(scaletrain.__file__).resolve().parents[1])
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def snapshot() -> dict[str, Any]:
    """The moment: UTC date and the 1/5/15-minute load averages (runnable processes)."""
    load = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    return {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "load": load}


def study(before: dict[str, Any], seconds: float, cells: list[Cell], repeats: int, argv: list[str]) -> dict[str, Any]:
    """The record of a finished study (``before``: :func:`snapshot` at its start; ``seconds``: its wall time)."""
    import torch

    import scaletrain

    try:
        import matplotlib

        mpl = matplotlib.__version__
    except ImportError:
        mpl = None
    models = sorted({c.model for c in cells})
    peers = {}
    for name in sorted({STRATEGIES[c.strategy].requires.split(".")[0] for c in cells if c.framework == "deepspeed"}):
        try:  # the installed version, read without importing the package
            peers[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            peers[name] = None
    return {
        "command": "scaletrain " + " ".join(argv[1:]) if argv and argv[0].endswith(("cli.py", "scaletrain")) else
        " ".join(argv),
        "start": before, "end": snapshot(), "seconds": seconds, "repeats": repeats, "warmup_steps": WARMUP_STEPS,
        "machine": {"cpu": _cpu_model(), "cores": os.cpu_count(), "memory_bytes": _memory_bytes(),
                    "os": platform.platform()},
        "versions": {"python": sys.version.split()[0], "torch": torch.__version__, "scaletrain": scaletrain.__version__,
                     "matplotlib": mpl, "backend": "gloo", **peers},
        "settings": {m: dataclasses.asdict(cells[[c.model for c in cells].index(m)].settings) for m in models
                     if m in MODELS},
        "strategies": {s: STRATEGIES[s].describe for s in dict.fromkeys(c.strategy for c in cells)},
        "devices": sorted({c.devices for c in cells}),
    }


def save(record: dict[str, Any], directory: Path, ran: bool = True) -> dict[str, Any]:
    """Write ``study.json`` into ``directory``; a continued study keeps its first start and command, and adds
    this session's seconds (``sessions`` counts the invocations); a session that ran nothing (``ran``
    false: only the report was rendered again) keeps the recorded end too. Returns what was written."""
    path = directory / "study.json"
    if path.is_file():
        before = json.loads(path.read_text())
        end = record["end"] if ran else before.get("end", record["end"])
        record = {**record, "start": before.get("start", record["start"]), "end": end,
                  "command": before.get("command", record["command"]),
                  "seconds": before.get("seconds", 0.0) + record["seconds"],
                  "sessions": before.get("sessions", 1) + 1}
    path.write_text(json.dumps(record, indent=1))
    return record

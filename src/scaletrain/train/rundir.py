"""Run directories that are never damaged.

Why: a run directory is the record of a run (its config, its metrics, its checkpoints). A bad
input must not leave an empty one behind, a new run must not write into an old one, and a resume
that cannot proceed must not change it. So:

- :func:`check_target` refuses, before anything is built, an ``--out`` that is an existing file,
  that cannot be created, or that already holds a run when ``--resume`` is not given;
- :class:`RunDir` touches the disk only after the first optimizer step succeeded (everything was
  validated and planned by then: config, model, data, remat schedule, the resumed checkpoint);
  it then writes ``config.toml`` atomically and trims ``metrics.jsonl`` to the resumed step, so a
  resumed run's metrics continue without duplicate steps;
- every file is written under a fresh temporary name that no symlink can pre-empt, then renamed
  (:mod:`.safe_write`), and one job at a time holds the directory (:mod:`.runlock`).

The launcher's restarts (``--max-restarts``) reuse their own directory: ``SCALETRAIN_ATTEMPT``
> 0 says so, and the time the failure cost is logged as a ``restart`` row (:mod:`.recovery`).
Under the user's own ``torchrun --max-restarts`` a restarted round reuses the directory that its
job accepted in an earlier round (:mod:`.elastic`).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Callable

from scaletrain.errors import ConfigError
from scaletrain.train import runlock
from scaletrain.train.job_env import ATTEMPT_ENV, JOB_DIR_ENV
from scaletrain.train.logging import MetricsWriter
from scaletrain.train.runlock import RunLock
from scaletrain.train.safe_write import read_text, write_atomic

RUN_FILES = ("config.toml", "metrics.jsonl", "checkpoints")
"""What makes a directory a run directory."""


def holds_run(path: Path) -> bool:
    """True when ``path`` is a directory with a run's files in it."""
    return path.is_dir() and any((path / name).exists() for name in RUN_FILES)


def restart_attempt() -> int:
    """The launcher's attempt number (0 when not started by the launcher, or on its first try)."""
    try:
        return int(os.environ.get(ATTEMPT_ENV, "0") or 0)
    except ValueError:
        return 0


def _lock(out: Path) -> RunLock:
    """The run directory's lock, taken by the process that owns it: not a rank other than 0."""
    return runlock.acquire(out) if os.environ.get("RANK", "0") in ("", "0") else runlock.NO_LOCK


def check_target(out: Path | None, resume: bool) -> RunLock:
    """Refuse in one line, before anything is built or written, a run directory that cannot be used
    or that another job holds; returns this job's lock on it (release it when the run ends)."""
    if out is None:
        return runlock.NO_LOCK
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {str(out)!r} is an existing file; name a directory (new, or a run to --resume)")
    from scaletrain.train import elastic

    if resume:
        if not out.is_dir():
            raise ConfigError(f"--resume: no checkpoint in {str(out / 'checkpoints')!r} (the run directory does not "
                              f"exist)")
        lock = _lock(out)
        elastic.claim(out)
        return lock
    if holds_run(out) and restart_attempt() == 0 and not elastic.owns(out):
        raise ConfigError(f"run directory {str(out)!r} already holds a run; continue it with --resume, or choose "
                          f"another --out")
    parent = out
    while not parent.exists():  # the nearest existing ancestor must let us create the directory
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"--out {str(out)!r} cannot be created: {str(parent)!r} is not a writable directory")
    lock = _lock(out)
    elastic.claim(out)  # under torchrun: a restarted round may reuse it (scaletrain.train.elastic)
    return lock


def trim_metrics(path: Path, last_step: int) -> int:
    """Drop rows of ``metrics.jsonl`` logged after ``last_step`` (and a torn last line), atomically.

    Why: those steps are run again after a resume; keeping them would log them twice. Event rows
    (``"event"`` key, e.g. ``restart``) are kept. Returns the number of rows dropped.
    """
    if not path.is_file() and not path.is_symlink():
        return 0
    kept, dropped = [], 0
    for line in read_text(path).splitlines():  # a symlinked metrics file is refused, never read
        try:
            row = json.loads(line)
        except ValueError:
            dropped += 1
            continue
        step = row.get("step") if isinstance(row, dict) else None
        if isinstance(step, int) and step > last_step and "event" not in row:
            dropped += 1
            continue
        kept.append(line)
    if dropped:
        write_atomic(path, "".join(line + "\n" for line in kept))
    return dropped


class RunDir:
    """The run directory of one rank-0 training loop, opened lazily after the first good step.

    Stands in for the :class:`MetricsWriter` (``write`` / ``close``); other ranks hold one with
    ``path=None`` that writes nothing.
    """

    def __init__(self, path: Path | None, start_step: int, config_text: str,
                 log: Callable[[str], None] = lambda s: None, unloadable: list[Path] | None = None,
                 loggers: str = "jsonl"):
        self.path, self.start_step, self.config_text, self.log = path, start_step, config_text, log
        self.loggers = loggers
        """``train.loggers``: the sinks beside metrics.jsonl (:mod:`.loggers`)."""
        self.unloadable = list(unloadable or [])
        """Checkpoints the resume skipped: renamed ``*.corrupt`` on open, out of rotation's reach."""
        self._metrics: MetricsWriter | None = None
        self._pending: list[dict[str, Any]] = []
        from scaletrain.train import recovery

        self.replan: tuple[Any, int] | None = None
        """(:class:`.replan.Replan`, global batch) of a re-planned round: its row is logged with the restart's."""
        self.restart = None
        if path is not None:  # scaletrain's launcher says what failed; under torchrun the run directory does
            from scaletrain.train import elastic

            self.restart = recovery.RestartClock.from_env(start_step) or elastic.restart_clock(path, start_step)
        self.job_dir = Path(os.environ[JOB_DIR_ENV]) if os.environ.get(JOB_DIR_ENV) else None

    @property
    def opened(self) -> bool:
        return self._metrics is not None

    def open(self) -> None:
        """Create the directory, write ``config.toml``, trim the metrics to the start step."""
        if self.path is None or self.opened:
            return
        self.path.mkdir(parents=True, exist_ok=True)
        trim_metrics(self.path / "metrics.jsonl", self.start_step)  # first: a symlinked one stops all writes
        write_atomic(self.path / "config.toml", self.config_text)
        from scaletrain.train import elastic

        elastic.record(self.path)  # under torchrun: the job that owns it, should its agent store be lost
        for bad in self.unloadable:
            if bad.exists():
                os.replace(bad, bad.with_name(bad.name + ".corrupt"))
                self.log(f"set aside unloadable checkpoint {str(bad)!r} as {bad.name}.corrupt")
        self._metrics = MetricsWriter(self.path / "metrics.jsonl", self.loggers, self.start_step)
        for row in self._pending:
            self._metrics.write(row)
        self._pending.clear()

    def after_step(self, step: int) -> None:
        """Called after every successful optimizer step: open the directory the first time, beat the
        launcher's heartbeat, and log the restart row once the lost steps are recomputed."""
        if self.path is None:
            return
        self.open()
        now = time.time()
        if self.job_dir is not None:
            try:
                write_atomic(self.job_dir / "progress.json", json.dumps({"step": step, "time": now}), durable=False)
            except OSError:
                pass  # the launcher is gone; training itself is unaffected
        row = self.restart.caught_up(step, now) if self.restart is not None else None
        if row is not None:
            self.write(row)
            self.log(self.restart.describe(row))
        if self.replan is not None and (row is not None or self.restart is None):  # with the time lost, if any
            self.write(self.replan[0].row(step, self.replan[1], row))
            self.replan = None

    def write(self, row: dict[str, Any]) -> None:
        if self.path is None:
            return
        if self._metrics is None:
            self._pending.append(row)
            return
        self._metrics.write(row)

    def close(self) -> None:
        if self._metrics is not None:
            self._metrics.close()

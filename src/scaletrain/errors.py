"""User-facing errors, and the one path by which they reach the user.

Anything raised as a :class:`UserError` (bad config, budget, checkpoint, model name...) is
printed by the CLI as one line naming what is wrong and what is allowed, with exit code 2 and
no traceback. Library callers get an ordinary exception they can catch.

Several ranks. Under ``scaletrain train --nproc-per-node N`` the launcher sets
``SCALETRAIN_ERROR_DIR``; a rank that fails writes its one line there (``rank<R>.json``) instead of
printing it, and the launcher prints one line naming the rank and the reason — not N copies of
the same message, and not a lost peer's echo of another rank's error (see :func:`summarize`).
Under a plain ``torchrun`` (no error directory) rank 0 prints a config error once and every rank
prints an error only it can know (a lost peer, a timeout).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import IO, Any

ERROR_DIR_ENV = "SCALETRAIN_ERROR_DIR"
"""Directory the launcher reads ranks' one-line errors from (set by the launcher only)."""


class UserError(ValueError):
    """Bad input from the user: the message must name the offending thing and what is allowed."""

    restartable = False
    """True when a fresh attempt of the same job may succeed (a lost peer, a timeout): the launcher's
    ``--max-restarts`` retries those and never a bad input, which would fail the same way again."""


class ConfigError(UserError):
    """A config key or value is unknown or invalid."""


def one_line(exc: BaseException) -> str:
    """The message of ``exc`` on one line (newlines folded), or its type name when it has none."""
    text = " ".join(part.strip() for part in str(exc).strip().splitlines() if part.strip())
    return text or type(exc).__name__


def report(exc: UserError, stream: IO[str] | None = None) -> None:
    """Say ``exc`` once: to the launcher's error directory under it, else on ``stream`` (stderr)."""
    stream = stream or sys.stderr
    rank = os.environ.get("RANK")
    directory = os.environ.get(ERROR_DIR_ENV)
    if directory and rank is not None:
        row = {"rank": int(rank), "message": one_line(exc), "restartable": bool(exc.restartable),
               "time": time.time()}
        try:
            tmp = Path(directory) / f".rank{rank}.json.tmp"
            tmp.write_text(json.dumps(row))
            os.replace(tmp, Path(directory) / f"rank{rank}.json")
            return
        except OSError:
            pass  # the launcher's directory is gone: fall back to printing
    if rank not in (None, "0") and not exc.restartable and isinstance(exc, ConfigError):
        return  # the same config error on every rank: rank 0 says it
    print(f"scaletrain: error: {one_line(exc)}", file=stream)


def read_reports(directory: Path) -> list[dict[str, Any]]:
    """The ranks' error rows left in ``directory`` (unreadable files skipped), in rank order."""
    rows = []
    for p in sorted(Path(directory).glob("rank*.json")):
        try:
            rows.append(json.loads(p.read_text()))
        except (OSError, ValueError):
            continue
    return sorted(rows, key=lambda r: r.get("rank", 0))


def summarize(reports: list[dict[str, Any]], died: dict[str, Any] | None = None) -> tuple[str, bool]:
    """(one line naming the rank and the reason, whether a restart may help) for a failed job.

    A bad input (not restartable) wins over everything: it is the cause, and the other ranks'
    lost peers are its echo. Then a rank killed by a signal or ended by an unexpected exception
    (``died``: torchrun's first failure, ``{"rank", "exitcode", "signal"}``), then the earliest lost
    peer or timeout. Identical messages
    from several ranks are said once, with the count.
    """
    bad = [r for r in reports if not r.get("restartable")]
    if bad:
        first = min(bad, key=lambda r: (r.get("time", 0.0), r.get("rank", 0)))
        same = sum(r.get("message") == first.get("message") for r in bad)
        more = f" (and {same - 1} more rank{'s' * (same > 2)} with the same error)" if same > 1 else ""
        return _with_rank(first) + more, False
    if died and died.get("signal"):
        return f"rank {died.get('rank')} died ({died['signal']})", True
    if died and died.get("exitcode") != 2:  # an unexpected exception: its traceback is the cause
        return f"rank {died.get('rank')} failed (exit code {died.get('exitcode')}); its output is above", True
    if reports:
        return _with_rank(min(reports, key=lambda r: (r.get("time", 0.0), r.get("rank", 0)))), True
    return "the job failed without a message; see the output above", True


def _with_rank(row: dict[str, Any]) -> str:
    msg = str(row.get("message", ""))
    return msg if msg.startswith("rank ") else f"rank {row.get('rank')}: {msg}"

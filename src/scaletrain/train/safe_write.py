"""Every write into a run directory: a fresh temporary name, never a followed symlink, then rename.

Why: a run directory may sit in a shared place, and a name scaletrain writes to at a predictable
path (``config.toml.tmp``, ``metrics.jsonl.tmp``, ``checkpoints/step_N.pt.tmp``) could be a
symlink someone placed there beforehand; opening it for writing would overwrite the file it points
to, outside the run. So a file is written under a temporary name no one can predict or pre-place
(``<name>.tmp-<pid>-<ns>``), opened with ``O_CREAT | O_EXCL | O_NOFOLLOW`` (the open fails rather
than follow or reuse anything already there), fsynced, and renamed over the final name (a rename
replaces a symlink at the final name, never its target). Appends (``metrics.jsonl``) open with
``O_NOFOLLOW``: a symlinked metrics file is refused in one line.

Leftover temporary names of a crash are never read; checkpoint rotation removes its own
(:data:`scaletrain.train.checkpoint._TMP`).
"""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path
from typing import IO, Callable

from scaletrain.errors import UserError

_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def tmp_name(path: Path) -> Path:
    """A fresh temporary name beside ``path``: ``<name>.tmp-<pid>-<ns>`` (unpredictable, never reused)."""
    return path.with_name(f"{path.name}.tmp-{os.getpid()}-{time.time_ns()}")


def _symlink_error(path: Path, e: OSError) -> UserError:
    return UserError(f"{str(path)!r} is a symbolic link; scaletrain writes only plain files in a run directory "
                     f"(remove the link) ({e.strerror})")


def open_new(path: Path, mode: str = "wb") -> IO:
    """Create ``path``, which must not exist (not even as a symlink), for writing (``mode``: wb or w)."""
    try:
        fd = os.open(path, _NEW, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _symlink_error(path, e) from None
        raise
    return os.fdopen(fd, mode)


def fsync_dir(path: Path) -> None:
    """Make a rename in directory ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes | str | Callable[[IO], None], durable: bool = True) -> None:
    """Write ``data`` (bytes, text, or a function writing into the open binary file) as ``path``:
    a fresh temporary file (O_EXCL | O_NOFOLLOW), fsynced, renamed over ``path``; a crash or an
    error keeps the old ``path`` and removes the temporary file. ``durable=False``: no fsync (a
    heartbeat rewritten every step, for which the rename's atomicity is enough)."""
    tmp = tmp_name(path)
    try:
        with open_new(tmp, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)


def open_append(path: Path) -> IO[str]:
    """``path`` opened for appending text (created if missing); a symlink there is refused."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0),
                     0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _symlink_error(path, e) from None
        raise
    return os.fdopen(fd, "a")


def read_text(path: Path) -> str:
    """The text of run-directory file ``path`` (bad bytes replaced); a symlink there is refused."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _symlink_error(path, e) from None
        raise
    with os.fdopen(fd, "rb") as f:
        return f.read().decode(errors="replace")

"""Checkpoints that survive crashes and load without unpickling code: the consolidated format, and
the listing / rotation / resume choice shared with the sharded one (:mod:`.sharded_checkpoint`).

A checkpoint is one ``torch.save`` file holding only tensors, numbers, strings, lists and dicts
(model, optimizer and scheduler state, RNG states, data position), loaded back with
``weights_only=True`` — so a checkpoint from elsewhere cannot execute code. It is written to a
fresh temporary name (``step_N.pt.tmp-<pid>-<ns>``, created with O_EXCL | O_NOFOLLOW: no
pre-placed symlink is followed, :mod:`.safe_write`) and renamed into place (``os.replace`` is
atomic on POSIX), so a crash mid-write leaves the previous checkpoint intact.
"""

from __future__ import annotations

import contextlib
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from scaletrain.errors import UserError
from scaletrain.train import faults
from scaletrain.train.safe_write import write_atomic

_NAME = re.compile(r"^step_(\d+)(\.pt)?$")
_TMP = re.compile(r"^step_\d+(\.pt\.tmp(-.*)?|\.tmp-.*|\.old-.*)$")


def checkpoint_path(directory: Path, step: int) -> Path:
    return directory / f"step_{step:08d}.pt"


def at_step(directory: Path, step: int) -> Path:
    """The checkpoint of ``step`` in ``directory``: the sharded directory if there is one, else the file."""
    d = directory / f"step_{step:08d}"
    return d if d.is_dir() else checkpoint_path(directory, step)


def save(directory: Path, step: int, state: dict[str, Any], keep: int = 2) -> Path:
    """Write ``state`` atomically as the checkpoint of ``step``; keep the newest ``keep`` files."""
    directory.mkdir(parents=True, exist_ok=True)
    final = checkpoint_path(directory, step)

    def write(f: Any) -> None:
        torch.save(state, f)
        f.flush()
        faults.maybe_fire(step, 0, directory.parent, "save")  # tests only: dies before the rename

    try:  # a full disk (or no permission) fails in one line; the previous checkpoints stay
        write_atomic(final, write)  # a fresh temp name, never a pre-placed symlink (.safe_write)
    except (OSError, RuntimeError) as e:  # torch.save reports a failed write as a RuntimeError of its
        # zip writer ("file write failed", or "unexpected pos" when the disk filled up mid-record)
        if isinstance(e, RuntimeError) and not any(k in str(e) for k in ("writ", "inline_container", "unexpected pos")):
            raise
        why = getattr(e, "strerror", None) or str(e).splitlines()[0]
        with contextlib.suppress(OSError):
            why += f"; {shutil.disk_usage(directory).free:,} bytes free there now"
        raise UserError(f"checkpoint of step {step} not written: could not write {final} ({why}); "
                        "the previous checkpoints are intact") from None
    rotate(directory, keep)
    return final


def rotate(directory: Path, keep: int) -> None:
    """Keep the newest ``keep`` checkpoints (either format); remove leftovers of interrupted saves."""
    for old in list_checkpoints(directory)[:-keep]:
        remove(old)
    for p in directory.iterdir():
        if _TMP.match(p.name):
            remove(p)


def remove(path: Path) -> None:
    """Delete a checkpoint or leftover (a symlink is unlinked, never followed)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def list_checkpoints(directory: Path) -> list[Path]:
    """Checkpoints in ``directory`` (``step_N.pt`` files, ``step_N/`` sharded directories), oldest
    first; temporary files and directories of unfinished saves are ignored."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p.is_dir(), p) for p in directory.iterdir()  # a symlink is never a checkpoint
             if (m := _NAME.match(p.name)) and not p.is_symlink() and (p.is_dir() == (m.group(2) is None))]
    return [p for *_, p in sorted(found)]


def latest(directory: Path) -> Path | None:
    c = list_checkpoints(directory)
    return c[-1] if c else None


def load(path: Path) -> dict[str, Any]:
    """Load a checkpoint (a sharded one as whole single-process tensors); a missing, truncated or
    foreign file gives a one-line UserError."""
    if path.is_dir():
        from scaletrain.train import sharded_checkpoint as sharded

        why = sharded.problem(path, crc_files=[])
        if why:
            raise UserError(f"checkpoint {str(path)!r} is damaged: {why}")
        return sharded.Reader(path).state(lazy=False)
    if not path.is_file():
        raise UserError(f"checkpoint {str(path)!r} does not exist")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated zip, pickle with code, etc.
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"checkpoint {str(path)!r} cannot be loaded ({msg[:160]})") from None
    for key in ("step", "model", "optimizer"):
        if not isinstance(state, dict) or key not in state:
            raise UserError(f"checkpoint {str(path)!r} is not a scaletrain checkpoint (missing {key!r})")
    return state

"""The one ``scaletrain`` entry point.

Sub-commands live one per module in :mod:`scaletrain.commands`; each module defines
``NAME``, ``HELP``, ``add_arguments(parser)`` and ``run(args) -> int``. They are discovered
here, so adding a command never touches this file.
"""

from __future__ import annotations

import argparse
import errno
import functools
import importlib
import os
import pkgutil
import sys
from typing import Sequence

from scaletrain import __version__
from scaletrain.errors import UserError, one_line, report


def _command_modules() -> list:
    import scaletrain.commands as pkg

    mods = []
    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        mods.append(importlib.import_module(f"scaletrain.commands.{info.name}"))
    return mods


PATH_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOENT, errno.ENOTDIR,
               errno.EISDIR, errno.EEXIST, errno.ENAMETOOLONG, errno.ELOOP}
"""An OSError with one of these is about a path the user gave or the disk it is on (full, read-only, not
there): one line and exit code 2 like a bad input, not a traceback. Other OSErrors are bugs and raise."""


class Parser(argparse.ArgumentParser):
    """argparse with its errors as one line and a pointer to ``--help`` (not usage plus error), exit code 2.
    Sub-command parsers are of this class too (argparse makes them of their parent's)."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {one_line(ValueError(message))} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="scaletrain",
        description="Train an unmodified PyTorch model as fast as possible without running out of memory.",
    )
    parser.add_argument("--version", action="version", version=f"scaletrain {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for mod in _command_modules():
        p = sub.add_parser(mod.NAME, help=mod.HELP, description=getattr(mod, "DESCRIPTION", mod.HELP),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


@functools.lru_cache(maxsize=1)
def _parser() -> argparse.ArgumentParser:
    """Built once per process (parsing leaves it unchanged): in-process callers (tests, sweeps) parse many argv."""
    return build_parser()


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse: --help (0) or its one-line error (2), returned like every other exit
        return int(e.code or 0)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except UserError as e:  # the one error path: one line (or the launcher's error directory), exit 2
        report(e)
        return 2
    except BrokenPipeError:  # output piped into `head` and closed early: not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as e:  # (after BrokenPipeError, an OSError too)
        if e.errno not in PATH_ERRNOS:
            raise
        report(UserError(f"cannot use {str(e.filename)!r}: {e.strerror}" if e.filename else one_line(e)))
        return 2
    except KeyboardInterrupt as e:  # train/interrupt.py says where its checkpoint went (once: rank 0)
        if os.environ.get("RANK", "0") == "0":
            print(f"scaletrain: interrupted{': ' + str(e) if str(e) else ''}", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

"""The launcher's torchrun agent: the command that starts the ranks of ``--nproc-per-node N``, and
its entry point with torchrun's failure report cut to one line.

Why here, in ``train/``: the agent is the middle of the launcher's process tree (launcher ->
agent -> ranks, :mod:`.recovery`, :mod:`.process_tree`); it dies with the launcher and tells its
ranks its pid (:data:`.job_env.AGENT_PID_ENV`). The techniques only find their place in a job
(:mod:`scaletrain.techniques.data_parallel.launch`), they never start one.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from pathlib import Path

from scaletrain.errors import ERROR_DIR_ENV
from scaletrain.train import process_tree
from scaletrain.train.job_env import AGENT_PID_ENV, LAUNCHER_PID_ENV

SHUTDOWN_S = 3
"""Seconds torchrun waits after SIGTERM before SIGKILL when it stops the other ranks of a failed job
(its default, 30 s, is what a stopped — hung — rank costs in detection time before a restart)."""


def torchrun_command(nproc: int, argv: list[str]) -> list[str]:
    """The command that runs ``scaletrain ARGV`` on ``nproc`` local processes under torchrun.

    It is ``python -m torch.distributed.run --standalone --nproc-per-node N -m scaletrain.cli
    ARGV``, entered through :func:`torchrun_main` so that a failed rank ends the job with that
    rank's own one-line message instead of torchrun's traceback and failure report.
    """
    return [sys.executable, "-c", "import sys; from scaletrain.train.agent import torchrun_main; "
            "sys.exit(torchrun_main())", "--standalone", f"--nproc-per-node={nproc}",
            f"--shutdown-timeout={SHUTDOWN_S}",
            "-m", "scaletrain.cli", *argv]


def torchrun_main(argv: list[str] | None = None) -> int:
    """``torch.distributed.run.main`` with its failure report reduced to one line (or none when the
    failed rank already printed its ``scaletrain: error:`` line, exit code 2)."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    launcher = os.environ.get(LAUNCHER_PID_ENV, "")
    if launcher.isdigit():  # under scaletrain's launcher: this agent (and so its ranks) die with it
        process_tree.die_with_parent(int(launcher))
    os.environ[AGENT_PID_ENV] = str(os.getpid())  # each rank checks it is still this agent's child
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic") or name.startswith("torch.distributed.run"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        torchrun.main(argv if argv is not None else sys.argv[1:])
    except SignalException as e:  # SIGTERM / SIGINT to the agent: it stopped its ranks; no traceback
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        code = failure.exitcode
        errors = os.environ.get(ERROR_DIR_ENV)
        if errors:  # under scaletrain's launcher: it says the one line (scaletrain.train.recovery)
            died = {"rank": rank, "exitcode": code, "signal": failure.signal_name() if code < 0 else None}
            with contextlib.suppress(OSError):
                (Path(errors) / "launcher.json").write_text(json.dumps(died))
            return 2 if code == 2 else 1
        if code == 2:  # a UserError: the rank printed its one-line message
            return 2
        how = f"signal {failure.signal_name()}" if code < 0 else f"exit code {code}"
        print(f"scaletrain: error: rank {rank} failed ({how}); its output is above", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0

"""Fixtures shared by the test modules."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def one_thread():
    """Bytes do not depend on the thread count; one thread keeps memory tests quick on a shared CPU.

    Modules opt in with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def recovery_base(tmp_path_factory):
    """The uninterrupted job of tests/test_recovery.py (2 ranks under ``scaletrain train --nproc-per-node 2``):
    the run directory every recovery test's faulted job must end equal to. One run for both recovery
    modules: torchrun's two agents run the same 2 ranks on the same batches, one thread each."""
    from test_recovery import _train

    out = tmp_path_factory.mktemp("recovery") / "base"
    r = _train(out, None)
    assert r.returncode == 0, r.stderr[-2000:]
    return out

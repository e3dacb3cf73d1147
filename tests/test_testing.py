import pytest
import torch
import torch.distributed as dist

from scaletrain.testing import run_distributed


def _allreduce(rank, world):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return float(t)


def _fail(rank, world):
    if rank == 1:
        raise ValueError("boom on rank 1")
    return rank


@pytest.mark.slow
def test_run_distributed():
    assert run_distributed(_allreduce, 2) == [3.0, 3.0]
    with pytest.raises(RuntimeError, match="boom on rank 1"):
        run_distributed(_fail, 2, timeout_s=30)

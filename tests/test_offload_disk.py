"""ZeRO-Infinity's disk tier: optimizer states (and masters) in memory-mapped files."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from scaletrain import models
from scaletrain.errors import UserError
from scaletrain.platform import Platform
from scaletrain.techniques.offload.disk import PREFIX, DiskStates, cleanup_stale
from scaletrain.techniques.offload.optimizer import CPUAdam
from scaletrain.techniques.offload.pools import LogicalPools
from scaletrain.techniques.offload.runtime import OffloadOptions, OffloadRuntime

PLAT = Platform("test")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One intra-op thread: on a shared, oversubscribed CI machine OpenMP barriers make small ops
    10x slower with more; these tests check bytes and equality, never speed."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def mlp(seed=0):
    torch.manual_seed(seed)
    return models.get("mlp", widths=(48, 128, 128, 128, 10), image_size=4, channels=3)


def data(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(16, 3, 4, 4, generator=g), torch.randint(0, 10, (16,), generator=g)


def adamw(m):
    return torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.01, fused=True)


def test_disk_update_equals_the_host_update(tmp_path):
    torch.manual_seed(0)
    n = 5000
    master = torch.randn(n)
    ref = master.clone()
    pools = LogicalPools()
    disk = DiskStates(pools, str(tmp_path), chunk_bytes=4096)  # 1024 values per chunk: 5 chunks
    hp = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, adamw=True)
    disk.attach([master], [hp])
    host = CPUAdam([ref], **hp)
    for _ in range(3):
        g = torch.randn(n)
        ref.grad = g.clone()
        host.step()
        disk.step(None, [g])
    assert torch.equal(master, ref)
    st = disk.state_tensors(0)
    assert torch.equal(st["m"], host.state[ref]["exp_avg"]) and torch.equal(st["v"], host.state[ref]["exp_avg_sq"])
    assert pools.stats.total("disk_read") == pools.stats.total("disk_write") == 3 * 2 * 4 * n
    path = disk.path
    assert path.is_dir()
    disk.close()
    assert not path.exists()


def test_states_larger_than_the_host_budget_train_from_disk(tmp_path):
    model = mlp()
    x, y = data()
    n = sum(p.numel() for p in model.parameters())
    host_budget = 6 * n  # the Adam states alone are 8n bytes (+4n fp32 masters, also on disk)
    opts = OffloadOptions(optimizer="disk", disk_masters=True, disk_dir=str(tmp_path), disk_chunk_bytes=4 << 10,
                          host_budget=host_budget)
    rt = OffloadRuntime(model, adamw, opts, PLAT, F.cross_entropy, (x, y))
    assert rt.disk.disk_bytes == 12 * n > host_budget
    files = list(rt.disk.path.iterdir())
    assert {f.name for f in files} >= {"owner.json", "group0.m.bin", "group0.v.bin", "group0.master.bin"}
    losses = []
    for _ in range(10):
        losses.append(rt.forward_backward(x, y).item())
        rt.step()
        st = rt.last_stats()
        assert st["host_peak_bytes"] <= host_budget
        assert st["disk_read_bytes"] == st["predicted_disk_read_bytes"] == 12 * n
        assert st["disk_write_bytes"] == st["predicted_disk_write_bytes"]
        assert st["h2d_bytes"] == st["predicted_h2d_bytes"] and st["d2h_bytes"] == st["predicted_d2h_bytes"]
    assert losses[-1] < 0.7 * losses[0]
    path = rt.disk.path
    rt.close()
    assert not path.exists()


def test_disk_training_equals_host_training(tmp_path):
    x, y = data()
    runs = []
    for opts in (OffloadOptions(optimizer="host"),
                 OffloadOptions(optimizer="disk", disk_dir=str(tmp_path), disk_chunk_bytes=8 << 10),
                 OffloadOptions(optimizer="disk", disk_masters=True, disk_dir=str(tmp_path), disk_chunk_bytes=8 << 10)):
        rt = OffloadRuntime(mlp(), adamw, opts, PLAT, F.cross_entropy, (x, y))
        for _ in range(3):
            rt.forward_backward(x, y)
            rt.step()
        runs.append(rt.full_parameters())
        rt.close()
    for other in runs[1:]:
        assert all(torch.equal(other[k], runs[0][k]) for k in runs[0])
    assert not list(tmp_path.glob(PREFIX + "*"))


def test_stale_directories_of_dead_processes_are_removed(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    import socket

    for name, pid in (("dead", dead_pid), ("alive", os.getpid())):
        d = tmp_path / f"{PREFIX}{name}"
        d.mkdir()
        (d / "owner.json").write_text(json.dumps({"pid": pid, "host": socket.gethostname()}))
        (d / "group0.m.bin").write_bytes(b"x" * 10)
    removed = cleanup_stale(tmp_path)
    assert [p.name for p in removed] == [f"{PREFIX}dead"]
    assert (tmp_path / f"{PREFIX}alive").exists()


def test_size_limit_is_checked_before_writing(tmp_path):
    x, y = data()
    opts = OffloadOptions(optimizer="disk", disk_dir=str(tmp_path), disk_max_bytes=1000)
    with pytest.raises(UserError, match="disk_max_bytes"):
        OffloadRuntime(mlp(), adamw, opts, PLAT, F.cross_entropy, (x, y))
    assert not list(tmp_path.glob(PREFIX + "*"))


def test_disk_state_dict_round_trip(tmp_path):
    x, y = data()
    opts = OffloadOptions(optimizer="disk", disk_masters=True, disk_dir=str(tmp_path), disk_chunk_bytes=4 << 10)
    whole = OffloadRuntime(mlp(), adamw, opts, PLAT, F.cross_entropy, (x, y))
    first = OffloadRuntime(mlp(), adamw, opts, PLAT, F.cross_entropy, (x, y))
    for rt, n in ((whole, 3), (first, 2)):
        for _ in range(n):
            rt.forward_backward(x, y)
            rt.step()
    state = first.state_dict()
    first.close()
    resumed = OffloadRuntime(mlp(seed=3), adamw, opts, PLAT, F.cross_entropy, (x, y))
    resumed.load_state_dict(state)
    resumed.forward_backward(x, y)
    resumed.step()
    a, b = whole.full_parameters(), resumed.full_parameters()
    assert all(torch.equal(a[k], b[k]) for k in a)
    whole.close()
    resumed.close()

"""MemoryTracker: storage-level accounting, categories, peak, timeline, plot."""

from __future__ import annotations

import pytest

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from scaletrain import models
from scaletrain.measure.plot import plot_timeline
from scaletrain.measure.step import make_batch, train_step
from scaletrain.measure.tracker import CATEGORIES, MemoryTracker


pytestmark = pytest.mark.usefixtures("one_thread")


def test_views_share_one_storage_and_frees_are_recorded() -> None:
    with MemoryTracker() as t:
        a = torch.empty(1000)  # 4000 bytes
        v1, v2 = a[10:], a.view(10, 100).t()
        assert t.current_bytes == 4000
        b = v1 * 2  # a new 3960-byte storage
        assert t.current_bytes == 4000 + 3960
        del a, v1, v2
        assert t.current_bytes == 3960  # the views kept nothing extra; the base died with them
        del b
    assert t.current_bytes == 0
    assert t.peak_bytes == 7960
    assert sum(t.peak_breakdown.values()) == t.peak_bytes


def test_storages_resized_in_place_are_followed() -> None:
    """FSDP2 frees an unsharded parameter with ``UntypedStorage.resize_(0)`` after its forward and
    allocates it again before its backward: the tracker counts the bytes at each resize, not when an op
    next touches the tensor (before, a freed unit counted whole to the end of the step)."""
    w = torch.ones(1000)  # 4000 bytes, pre-existing
    with MemoryTracker(extra=[w]) as t:
        assert t.current_bytes == 4000
        w.untyped_storage().resize_(0)
        assert t.current_bytes == 0
        b = torch.empty(500)  # 2000 bytes while w is freed: the peak stays w's
        w.untyped_storage().resize_(4000)
        assert t.current_bytes == 6000
        del b
        w.untyped_storage().resize_(0)
    assert t.peak_bytes == 6000 and t.current_bytes == 0
    assert torch.UntypedStorage.resize_ is torch._C.StorageBase.resize_  # the method is restored on exit


def test_categories_of_a_linear_layer() -> None:
    lin = nn.Linear(256, 128)
    x = torch.randn(32, 256)  # pre-existing input: saved by linear for the weight gradient
    with MemoryTracker(model=lin, extra=[x]) as t:
        y = lin(x)
        mid = t.current_breakdown
        y.sum().backward()
    pbytes = (256 * 128 + 128) * 4
    assert mid["parameters"] == pbytes
    assert mid["activations"] == x.numel() * 4  # x is saved for backward; the weight stays a parameter
    assert mid["temporaries"] == y.numel() * 4
    assert t.current_breakdown["gradients"] == pbytes  # .grad of weight and bias


def test_reset_peak_and_timeline() -> None:
    with MemoryTracker() as t:
        a = torch.empty(10_000)
        del a
        t.reset_peak()
        assert t.peak_bytes == 0
        b = torch.empty(100)
        t.mark("small")
    assert t.peak_bytes == 400
    tl = t.timeline
    assert [sum(c.values()) for _, _, c in tl] == [40_000, 0, 400]
    assert all(set(c) == set(CATEGORIES) for _, _, c in tl)
    assert t.marks == [(2, "small")]
    del b


def _step_tracked(fake: bool):
    torch.manual_seed(0)
    ctx = FakeTensorMode() if fake else torch.autograd.grad_mode.set_grad_enabled(True)
    with ctx:
        m = models.get("gpt2-tiny")
        opt = torch.optim.AdamW(m.parameters())
        batches = [make_batch(m, 2, 32)]
        train_step(m, opt, batches)
        with MemoryTracker(model=m, optimizer=opt, extra=[t for b in batches for t in b]) as t:
            train_step(m, opt, batches, mark=t.mark)
    return m, t


def test_training_step_categories_and_fake_equals_real() -> None:
    m, real = _step_tracked(fake=False)
    _, fake = _step_tracked(fake=True)
    pbytes = sum(p.numel() * 4 for p in m.parameters())
    br = real.peak_breakdown
    assert br["parameters"] == pbytes
    assert br["optimizer_states"] == 2 * pbytes + 4 * len(list(m.parameters()))  # exp_avg, exp_avg_sq, step
    maxes = {c: max(cats[c] for _, _, cats in real.iter_timeline()) for c in CATEGORIES}
    assert maxes["gradients"] == pbytes
    assert maxes["activations"] > 0 and maxes["temporaries"] > 0
    assert real.current_breakdown["gradients"] == 0  # zero_grad(set_to_none=True)
    # the same accounting on fake tensors (nothing allocated) gives the same bytes
    assert fake.peak_bytes == real.peak_bytes
    assert fake.peak_breakdown == real.peak_breakdown


def test_agrees_with_pytorch_memtracker() -> None:
    from torch.distributed._tools.mem_tracker import MemTracker

    torch.manual_seed(0)
    m = models.get("gpt2-tiny")
    opt = torch.optim.AdamW(m.parameters())
    batches = [make_batch(m, 4, 64)]
    train_step(m, opt, batches)
    ref = MemTracker()
    ref.track_external(m, opt)
    with ref:
        train_step(m, opt, batches)
    ref_peak = ref.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    with MemoryTracker(model=m, optimizer=opt, extra=[t for b in batches for t in b]) as t:
        train_step(m, opt, batches)
    batch_bytes = sum(x.numel() * x.element_size() for b in batches for x in b)
    # PyTorch's tracker does not count the input batch, which ours registers (extra=)
    assert abs(t.peak_bytes - batch_bytes - ref_peak) <= 0.01 * ref_peak


def test_plot_writes_png(tmp_path) -> None:
    _, t = _step_tracked(fake=True)
    out = plot_timeline(t, tmp_path / "step.png", title="gpt2-tiny step")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_peak_agrees_with_the_caching_allocator() -> None:
    """Issue 3: on CUDA the tracked peak agrees with torch.cuda.max_memory_allocated within 5%."""
    torch.manual_seed(0)
    m = models.get("gpt2-tiny", device="cuda")
    opt = torch.optim.AdamW(m.parameters())
    batches = [make_batch(m, 8, 128, device="cuda")]
    train_step(m, opt, batches)  # optimizer states and library workspaces exist from now on
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with MemoryTracker(model=m, optimizer=opt, extra=[t for b in batches for t in b]) as t:
        untracked = base - t.current_bytes  # e.g. cuBLAS workspaces: allocated, but never a tensor
        train_step(m, opt, batches)
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    assert abs(t.peak_bytes + untracked - peak) <= 0.05 * peak

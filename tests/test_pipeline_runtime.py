"""The pipeline runtime executes the schedules' action lists exactly.

* one process: the zero-bubble split (deferred weight-gradient GEMMs) and weight stashing give
  the gradients of a plain backward; stage boundaries and bounds are checked;
* gloo (slow): gpipe, 1f1b, interleaved, zb1p and chimera give the same losses and final
  parameters as one-process training after k steps (relative 1e-5) — 4 processes: pp = 4 and
  pp = 2 × dp = 2 on GPT-2 (tied embedding across the first and last stage); 2 processes: pp = 2
  on GPT-2 and on an MLP;
* gloo, 2 processes (slow): the asynchronous schedules (pipedream, pipedream-2bw) equal a
  sequential emulation of their weight-stashing semantics, and a stuck peer ends in a one-line
  timeout naming the rank and the operation.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from scaletrain import models
from scaletrain.chain import Chain, to_chain
from scaletrain.errors import UserError
from scaletrain.techniques.pipeline import build, simulate
from scaletrain.techniques.pipeline.runtime import split_microbatches
from scaletrain.techniques.pipeline.stage import Replica, boundary_specs, check_bounds
from scaletrain.testing import run_distributed

SYNC = ("gpipe", "1f1b", "interleaved", "zb1p", "chimera")
M, MB, SEQ, STEPS, LR = 4, 2, 8, 2, 0.5


def lm_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def make(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "gpt2":  # 8 blocks: embed, 6 layers, head (tied to embed)
        return models.get("gpt2-tiny", n_layer=6, n_embd=32, n_head=2, n_positions=SEQ)
    return models.get("mlp", widths=(48, 40, 40, 40, 10), image_size=4, channels=3)


def batch(kind: str, step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    if kind == "gpt2":
        return torch.randint(0, 256, (n, SEQ), generator=g), torch.randint(0, 256, (n, SEQ), generator=g)
    return torch.randn(n, 3, 4, 4, generator=g), torch.randint(0, 10, (n,), generator=g)


def loss_of(kind: str):
    return lm_loss if kind == "gpt2" else F.cross_entropy


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a − b| / max |b| (relative to the tensor's scale, so zero-initialised biases are fine)."""
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


# --------------------------------------------------------------------------- one process
def _gpt2_chain() -> Chain:
    torch.manual_seed(0)
    return to_chain(models.get("gpt2-tiny", n_layer=2, n_embd=32, n_head=2, n_positions=SEQ))


def test_deferred_weight_grads_equal_plain_backward():
    chain = _gpt2_chain()
    x = torch.randint(0, 256, (2, SEQ))
    y = torch.randint(0, 256, (2, SEQ))
    lm_loss(chain(x), y).backward()
    plain = {n: p.grad.clone() for n, p in chain.named_parameters()}
    chain.zero_grad(set_to_none=True)

    rep = Replica(0, 0, nn.Sequential(*chain.blocks), True, True, defer_weight_grads=True)
    out = lm_loss(rep.forward(x, 0), y)
    rep.backward(0, out, None)  # the I pass
    linear_w = [n for n, m in chain.named_modules() if isinstance(m, nn.Linear)]
    assert linear_w, "the model has linear layers"
    for n in linear_w:  # weight-gradient GEMMs deferred ...
        assert chain.get_submodule(n).weight.grad is None or n.endswith("lm_head"), n
    assert chain.blocks[1].ln_1.weight.grad is not None  # ... the cheap ones are not
    assert len(rep.wqueue[0]) >= 4 * 2 + 1
    rep.weight_grads(0)  # the W pass
    for n, p in chain.named_parameters():
        torch.testing.assert_close(p.grad, plain[n], rtol=1e-5, atol=1e-7, msg=n)


def test_weight_stash_backward_uses_the_forward_version():
    chain = _gpt2_chain()
    x0, x1 = torch.randint(0, 256, (2, SEQ)), torch.randint(0, 256, (2, SEQ))
    y0, y1 = torch.randint(0, 256, (2, SEQ)), torch.randint(0, 256, (2, SEQ))
    ref = copy.deepcopy(chain)
    rep = Replica(0, 0, nn.Sequential(*chain.blocks), True, True, stash_weights=True)
    out0 = lm_loss(rep.forward(x0, 0), y0)
    with torch.no_grad():  # an "update" between micro-batch 0's forward and backward
        for p in chain.parameters():
            p.add_(0.01)
    rep.bump_version()
    out1 = lm_loss(rep.forward(x1, 1), y1)
    assert rep.stashed_versions() == 2
    rep.backward(0, out0, None)
    assert rep.stashed_versions() == 1  # version 0 freed once its last micro-batch is done
    g0 = {n: p.grad.clone() for n, p in chain.named_parameters()}
    lm_loss(ref(x0), y0).backward()  # micro-batch 0 at the weights it was forwarded with
    for n, p in ref.named_parameters():
        torch.testing.assert_close(g0[n], p.grad, rtol=1e-5, atol=1e-7, msg=n)
    chain.zero_grad(set_to_none=True)
    rep.backward(1, out1, None)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.01)
    ref.zero_grad(set_to_none=True)
    lm_loss(ref(x1), y1).backward()
    for (n, p), q in zip(chain.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=n)


def test_boundaries_and_bounds_are_checked():
    chain = _gpt2_chain()  # 4 blocks: embed, 2 layers, head
    specs = boundary_specs(chain.blocks, [0, 2, 4], torch.zeros(3, SEQ, dtype=torch.long), torch.device("cpu"))
    assert [tuple(s.shape) for s in specs] == [(3, SEQ), (3, SEQ, 32), (3, SEQ, 256)]
    assert specs[1].nbytes == 3 * SEQ * 32 * 4
    for bad in ([0, 4], [0, 2, 2, 4], [1, 2, 4], [0, 3, 5]):
        with pytest.raises(UserError, match="stage bounds"):
            check_bounds(bad, 4, 2)
    ids = Chain([nn.Identity(), nn.Embedding(10, 4)])
    with pytest.raises(UserError, match="floating-point"):
        boundary_specs(ids.blocks, [0, 1, 2], torch.zeros(2, 3, dtype=torch.long), torch.device("cpu"))
    with pytest.raises(UserError, match="multiple of parallel.microbatches=4"):
        split_microbatches(torch.zeros(6, 2), torch.zeros(6), 4)


def test_summarise_of_simulated_events_reproduces_the_simulation():
    from scaletrain.techniques.pipeline import summarise

    for name, P, M_, v in (("1f1b", 4, 8, 1), ("interleaved", 2, 4, 2), ("zb1p", 3, 6, 1), ("chimera", 4, 4, 1),
                           ("pipedream-2bw", 2, 4, 1)):
        sched = build(name, P, M_, v)
        sim = simulate(sched)
        again = summarise(sched, [tuple(e) for e in reversed(sim.events)])
        assert again.step_time_s == pytest.approx(sim.step_time_s)
        assert again.bubble_per_rank == pytest.approx(sim.bubble_per_rank)
        assert again.peak_inflight == sim.peak_inflight


def test_only_overtaken_microbatches_stash_weights():
    from scaletrain.techniques.pipeline.schedules import overtaken as _overtaken

    pd = build("pipedream", 2, 2, steps=3)  # an update after every micro-batch's backward
    assert _overtaken(pd.actions[1], 0, 1) == set()  # last stage: F then B then update
    assert _overtaken(pd.actions[0], 0, 0) == set(range(1, 6))  # the second in flight is overtaken
    bw = build("pipedream-2bw", 2, 2, steps=3)  # one update per 2 micro-batches
    assert _overtaken(bw.actions[0], 0, 0) == {2, 4}
    assert _overtaken(bw.actions[1], 0, 1) == set()


# --------------------------------------------------------------------------- gloo: synchronous parity
def reference(kind: str, dp: int, clip: float = 0.0,
              bf16: bool = False) -> tuple[list[float], dict[str, torch.Tensor], list[float]]:
    """One process, whole global batch per step, same optimizer (and gradient clipping, autocast)."""
    model = make(kind)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses, norms = [], []
    for k in range(STEPS):
        x, y = batch(kind, k, dp * M * MB)
        with _bf16() if bf16 else contextlib.nullcontext():
            loss = loss_of(kind)(model(x), y)
        loss.backward()
        if clip:
            norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, norms


def _bf16():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def _train(kind: str, schedule: str, pp: int, dp: int, p2p_mode: str = "eager", clip: float = 0.0,
           bf16: bool = False):
    from scaletrain.techniques.pipeline.runtime import PipelineRuntime

    model = make(kind)
    example = batch(kind, 0, MB)[0]
    rt = PipelineRuntime(model, schedule, M, pp=pp, dp=dp, virtual=2 if schedule == "interleaved" else 1,
                         loss_fn=loss_of(kind), example_input=example, timeout_s=60, p2p_mode=p2p_mode,
                         forward_context=_bf16 if bf16 else None)
    opt = torch.optim.SGD(rt.parameters(), lr=LR, momentum=0.9)
    losses, norms = [], []

    def update() -> None:  # what a trainer passes: clip, step, zero
        norms.append(rt.clip_grad_norm_(clip))
        opt.step()
        opt.zero_grad()

    for k in range(STEPS):
        x, y = batch(kind, k, dp * M * MB)
        n = M * MB
        mine = slice(rt.dp_rank * n, (rt.dp_rank + 1) * n)  # this replica's share of the global batch
        losses.append(rt.train_step(split_microbatches(x[mine], y[mine], M), update if clip else None))
        if not clip:
            opt.step()  # update=None: gradients are reduced, the caller steps
            opt.zero_grad()
    rt.sync_full_model()
    events = [tuple(e) for e in rt.events]
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, norms, events


def _sync_worker(rank: int, world: int) -> dict:
    out = {("gpt2", s, 4 // dp, dp): _train("gpt2", s, 4 // dp, dp) for s in SYNC for dp in (1, 2)}
    # the lists NCCL needs (rendezvous_safe order, messages matched by order: gloo without tags)
    out.update({("gpt2", s, 4, 1, "rendezvous"): _train("gpt2", s, 4, 1, "rendezvous") for s in SYNC})
    # gradient clipping across stages and replicas (tied embedding counted once)
    out[("gpt2", "chimera", 2, 2, "clip")] = _train("gpt2", "chimera", 2, 2, clip=0.5)
    out[("gpt2", "interleaved", 4, 1, "clip")] = _train("gpt2", "interleaved", 4, 1, clip=0.5)
    return out


def check_parity(results: list[dict]) -> int:
    refs: dict = {}
    checked = 0
    for rank, res in enumerate(results):
        for key, value in res.items():
            if not isinstance(key, tuple):  # async and timeout results: checked elsewhere
                continue
            (kind, s, pp, dp), (losses, params, norms, events) = key[:4], value
            clip, bf16 = 0.5 if "clip" in key else 0.0, "bf16" in key
            tol = 1e-2 if bf16 else 1e-5  # bf16: the micro-batch GEMMs round differently
            if (kind, dp, clip, bf16) not in refs:
                refs[(kind, dp, clip, bf16)] = reference(kind, dp, clip, bf16)
            ref_losses, ref_params, ref_norms = refs[(kind, dp, clip, bf16)]
            assert losses == pytest.approx(ref_losses, rel=tol), (key, rank)
            assert norms == pytest.approx(ref_norms, rel=1e-5), (key, rank)
            assert params.keys() == ref_params.keys()
            worst = max(rel_err(params[n], ref_params[n]) for n in ref_params)
            assert worst <= tol, (key, rank, worst)
            check_events(build(s, pp, M, 2 if s == "interleaved" else 1), events, rank // dp)
            checked += 1
    return checked


def check_events(sched, events: list[tuple], pp_rank: int) -> None:
    """The last step's measured events: one per compute action of this rank's list, in its order."""
    want = [(a.kind, a.mb, a.stage, a.pipe) for a in sched.actions[pp_rank] if a.kind in ("F", "B", "I", "W")]
    got = [(e[1], e[2], e[5], e[6]) for e in events if e[1] in ("F", "B", "I", "W")]
    assert got == want
    assert all(e[3] <= e[4] for e in events) and sum(e[1] == "OPT" for e in events) == 1


@pytest.mark.slow
def test_synchronous_schedules_match_one_process_pp4_and_pp2_dp2():
    results = run_distributed(_sync_worker, 4, timeout_s=240)
    assert check_parity(results) == 4 * (len(SYNC) * 3 + 2)


# --------------------------------------------------------------------------- gloo: async + timeouts
ASYNC_M, ASYNC_STEPS, ASYNC_LR = 2, 5, 0.1


def emulate_async(schedule: str, n_steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, stage by stage, in the simulator's event order: each stage has its own weights
    and optimizer; a micro-batch's forward snapshots the stage's current weights and its backward
    differentiates that snapshot (weight stashing); OPT steps the stage's optimizer."""
    sched = build(schedule, 2, ASYNC_M, steps=n_steps)
    model = make("mlp")
    chain = to_chain(model)
    stages = [nn.Sequential(*chain.blocks[0:2]), nn.Sequential(*chain.blocks[2:4])]  # equal split
    opts = [torch.optim.SGD(st.parameters(), lr=ASYNC_LR) for st in stages]
    data = [batch("mlp", k, ASYNC_M * MB) for k in range(n_steps)]
    mbs = [mb for x, y in data for mb in split_microbatches(x, y, ASYNC_M)]
    weight = 1.0 / (sched.update_every or ASYNC_M)
    live, grads, losses = {}, {}, [0.0] * n_steps
    for e in simulate(sched).events:  # a valid global order of every rank's list
        s, m, st = e.stage, e.mb, stages[e.stage]
        if e.kind == "F":
            x = mbs[m][0] if s == 0 else live[(0, m)][1].detach().requires_grad_()
            snap = {n: p.detach().clone().requires_grad_() for n, p in st.named_parameters()}
            out = torch.func.functional_call(st, snap, (x,))
            if s == 1:
                loss = F.cross_entropy(out, mbs[m][1])
                losses[m // ASYNC_M] += float(loss.detach()) / ASYNC_M
                out = loss * weight
            live[(s, m)] = (x, out, snap)
        elif e.kind == "B":
            x, out, snap = live.pop((s, m))
            out.backward(None if s == 1 else grads.pop(m))
            for n, p in st.named_parameters():
                p.grad = snap[n].grad if p.grad is None else p.grad + snap[n].grad
            grads[m] = x.grad
        elif e.kind == "OPT":
            opts[s].step()
            opts[s].zero_grad()
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _async_worker(rank: int, world: int) -> dict:
    from scaletrain.techniques.data_parallel.launch import CommFailure
    from scaletrain.techniques.pipeline.runtime import PipelineRuntime

    out: dict = {(kind, s, 2, 1): _train(kind, s, 2, 1) for s in SYNC for kind in ("gpt2", "mlp")}
    # autocast: 16-bit activations are sent in the model's dtype (fp32), the zb1p split copes
    out.update({("gpt2", s, 2, 1, "bf16"): _train("gpt2", s, 2, 1, bf16=True) for s in ("1f1b", "zb1p")})
    for s in ("pipedream", "pipedream-2bw"):
        model = make("mlp")
        rt = PipelineRuntime(model, s, ASYNC_M, pp=2, loss_fn=F.cross_entropy,
                             example_input=batch("mlp", 0, MB)[0], timeout_s=60)
        opt = torch.optim.SGD(rt.parameters(), lr=ASYNC_LR)

        def update() -> None:
            opt.step()
            opt.zero_grad()

        data = [batch("mlp", k, ASYNC_M * MB) for k in range(ASYNC_STEPS)]
        mbs = [mb for x, y in data for mb in split_microbatches(x, y, ASYNC_M)]
        losses = rt.train(ASYNC_STEPS, iter(mbs), update)
        rt.sync_full_model()
        out[s] = (losses, {n: p.detach().clone() for n, p in model.named_parameters()})

    # a stuck peer: rank 0 computes but its sends never leave; both ranks must give up in ~3 s
    model = make("gpt2")
    rt = PipelineRuntime(model, "1f1b", M, pp=2, loss_fn=lm_loss, example_input=batch("gpt2", 0, MB)[0],
                         timeout_s=3, record_events=False)
    if rank == 0:
        rt.transport.send = lambda *args, **kw: None
    x, y = batch("gpt2", 0, M * MB)
    try:
        rt.train_step(split_microbatches(x, y, M))
        out["timeout"] = "no error"
    except CommFailure as e:
        out["timeout"] = str(e)
    return out


@pytest.mark.slow
def test_pp2_sync_parity_async_emulation_and_stuck_peer_timeout():
    results = run_distributed(_async_worker, 2, timeout_s=120)
    assert check_parity(results) == 2 * (len(SYNC) * 2 + 2)
    for s in ("pipedream", "pipedream-2bw"):
        ref_losses, ref_params = emulate_async(s, ASYNC_STEPS)
        for res in results:
            losses, params = res[s]
            assert losses == pytest.approx(ref_losses, rel=1e-5), s
            assert max(rel_err(params[n], ref_params[n]) for n in ref_params) <= 1e-5, s
    msg0, msg1 = results[0]["timeout"], results[1]["timeout"]
    assert "\n" not in msg0 and "\n" not in msg1
    assert msg1.startswith("rank 1:") and "RECV_F of micro-batch 0" in msg1 and "with rank 0" in msg1, msg1
    assert msg0.startswith("rank 0:") and "RECV_B of micro-batch 0" in msg0 and "with rank 1" in msg0, msg0
    assert "within 3 s" in msg0 and "within 3 s" in msg1


def test_deferred_weight_grads_under_bf16_autocast():
    chain = _gpt2_chain()
    x, y = torch.randint(0, 256, (2, SEQ)), torch.randint(0, 256, (2, SEQ))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = lm_loss(chain(x), y)
    loss.backward()
    plain = {n: p.grad.clone() for n, p in chain.named_parameters()}
    chain.zero_grad(set_to_none=True)
    rep = Replica(0, 0, nn.Sequential(*chain.blocks), True, True, defer_weight_grads=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = lm_loss(rep.forward(x, 0), y)
    rep.backward(0, out, None)
    rep.weight_grads(0)
    for n, p in chain.named_parameters():
        assert p.grad.dtype == torch.float32
        assert rel_err(p.grad, plain[n]) < 2e-2, n  # bf16 rounding of a different GEMM order


def test_stage_bounds_for_the_trainer():
    from scaletrain.techniques.pipeline.apply import default_virtual, example_input, stage_bounds

    model = models.get("gpt2-tiny", n_layer=6, n_embd=32, n_head=2, n_positions=SEQ)
    ex = example_input(model, 2, SEQ)
    assert ex.device.type == "meta" and tuple(ex.shape) == (2, SEQ)
    assert default_virtual("interleaved", None) == 2 and default_virtual("1f1b", None) == 1
    eq = stage_bounds(model, ex, pp=4, schedule="1f1b", microbatches=4, balance="equal")
    assert eq == [0, 2, 4, 6, 8]
    for name, v in (("1f1b", 1), ("interleaved", 2), ("chimera", 1)):
        b = stage_bounds(model, ex, pp=2, schedule=name, microbatches=4, virtual=v, loss_fn=lm_loss)
        assert check_bounds(b, 8, 2 * v) == b
    with pytest.raises(UserError, match="balance"):
        stage_bounds(model, ex, pp=2, schedule="1f1b", microbatches=4, balance="fast")
    with pytest.raises(UserError, match="input_spec"):
        example_input(nn.Linear(2, 2), 2)

"""Optimizers of issue 5: quantization bounds, convergence, exact resume, groups, state bytes,
and hand/paper-literal computations of Adafactor, CAME, LAMB and LARS."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from scaletrain.errors import UserError
from scaletrain.techniques.optim import (
    CAME, LAMB, LARS, NAMES, Adafactor, Adam8bit, AdamW8bit, build_optimizer, measured_state_bytes,
    state_bytes, state_bytes_per_param,
)
from scaletrain.techniques.optim import quantize as Q
from scaletrain.techniques.optim.zero_order import is_zero_order

GRADIENT = tuple(n for n in NAMES if not is_zero_order(n))
"""The optimizers that step on gradients (zo-sgd has its own tests: tests/test_zero_order.py)."""

# Learning rates that make each optimizer converge on the toy regression below.
LRS = {"sgd": 0.05, "adam": 3e-3, "adamw": 3e-3, "adam8bit": 3e-3, "adamw8bit": 3e-3,
       "adafactor": None, "came": 2e-3, "lamb": 2e-2, "lars": 2.0}
EXTRA = {"sgd": {"momentum": 0.9}, "adam8bit": {"fused": False}, "adamw8bit": {"fused": False}}


def _problem(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(256, 32, generator=g)
    w = torch.randn(32, 8, generator=g)
    return x, torch.tanh(x @ w) + 0.05 * torch.randn(256, 8, generator=g)


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    # 32*160 = 5120 >= 4096 values: the first weight takes Adam8bit's 8-bit path.
    return nn.Sequential(nn.Linear(32, 160), nn.LayerNorm(160), nn.GELU(), nn.Linear(160, 8))


def _build(name: str, model: nn.Module) -> torch.optim.Optimizer:
    lr = LRS[name]
    return build_optimizer(name, model, **({} if lr is None else {"lr": lr}), **EXTRA.get(name, {}))


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> list[float]:
    x, y = _problem()
    losses = []
    for _ in range(steps):
        loss = ((model(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


# ---- quantization -----------------------------------------------------------------------

@pytest.mark.parametrize("signed", [True, False])
def test_dynamic_map_structure(signed: bool) -> None:
    q = Q.dynamic_map(signed)
    assert q.shape == (256,) and q.dtype == torch.float32
    assert q.max() == 1.0 and (q == 0).any()
    if signed:
        assert q.min() == -1.0
        assert torch.equal(q[127 - torch.arange(1, 128)], -q[127 + torch.arange(1, 128)])
        assert float(q[q > 0].min()) == pytest.approx(1e-6)  # 10^-K, K = 6
    else:
        assert q.min() == 0.0 and torch.all(q[1:] > q[:-1])  # strictly increasing codes
        assert float(q[1]) == pytest.approx(1e-7)  # 10^-K, K = 7


@pytest.mark.parametrize("signed", [True, False])
def test_encode_is_nearest_entry(signed: bool) -> None:
    q = Q.dynamic_map(signed)
    g = torch.Generator().manual_seed(0)
    lo = -1.0 if signed else 0.0
    y = torch.cat([torch.rand(20000, generator=g) * (1 - lo) + lo, q,
                   torch.exp(-torch.rand(20000, generator=g) * 20)])  # dense small values
    y = y.clamp(lo, 1.0)
    got = (Q.decode(Q.encode(y, signed), q) - y).abs()
    best = (y[:, None] - q[None, :]).abs().min(dim=1).values
    assert torch.all(got <= best + 1e-7 * y.abs() + 1e-12)


@pytest.mark.parametrize("signed", [True, False])
def test_quantize_roundtrip_error_bound(signed: bool) -> None:
    # Derived bound: nearest rounding errs by at most half the largest gap of the map, which is
    # the top level's spacing 0.9 / 2^K (K = 6 signed, 7 unsigned): 0.70 % / 0.35 % of absmax.
    bound = Q.max_abs_error(signed)
    k = Q.SIGNED_LEVELS if signed else Q.UNSIGNED_LEVELS
    assert bound == pytest.approx(0.9 / 2**k / 2, rel=1e-5) and bound < 0.01
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5 * 2048 + 777, generator=g) * torch.logspace(-4, 2, 5 * 2048 + 777)
    if not signed:
        x = x.abs()
    codes, absmax = Q.quantize_blockwise(x, signed)
    assert codes.dtype == torch.uint8 and codes.numel() == x.numel()
    assert absmax.shape == (Q.num_blocks(x.numel()),)  # 6 scales: 5 full blocks + tail
    back = Q.dequantize_blockwise(codes, absmax, signed, x.shape)
    per_value_scale = absmax.repeat_interleave(2048)[: x.numel()]
    assert torch.all((back - x).abs() <= bound * per_value_scale * (1 + 1e-5))
    # the block absmax itself is exact (the map contains +-1)
    assert torch.equal(back.abs().reshape(-1)[:5 * 2048].view(5, 2048).amax(1), absmax[:5])


# ---- every optimizer ---------------------------------------------------------------------

@pytest.mark.parametrize("name", GRADIENT)
def test_optimizer_decreases_loss(name: str) -> None:
    model = _model()
    losses = _train(model, _build(name, model), 60)
    assert losses[-1] < 0.5 * losses[0], (name, losses[0], losses[-1])


@pytest.mark.parametrize("name", GRADIENT)
def test_state_dict_roundtrip_continues_bitwise(name: str) -> None:
    model = _model()
    opt = _build(name, model)
    _train(model, opt, 4)
    saved_model = copy.deepcopy(model.state_dict())
    saved_opt = copy.deepcopy(opt.state_dict())
    _train(model, opt, 4)

    resumed = _model(seed=123)  # different init: everything must come from the checkpoint
    resumed.load_state_dict(saved_model)
    opt2 = _build(name, resumed)
    opt2.load_state_dict(saved_opt)
    for p in opt2.state.values():  # dtypes survive loading (uint8 codes stay uint8)
        for k, v in p.items():
            if torch.is_tensor(v) and "codes" in k:
                assert v.dtype == torch.uint8
    _train(resumed, opt2, 4)
    for a, b in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("name", GRADIENT)
def test_param_groups_honoured(name: str) -> None:
    model = _model()
    frozen = model[3]
    others = [p for m in (model[0], model[1]) for p in m.parameters()]
    lr = LRS[name] if LRS[name] is not None else 1e-2
    opt = build_optimizer(name, [{"params": others}, {"params": list(frozen.parameters()), "lr": 0.0}],
                          lr=lr, **EXTRA.get(name, {}))
    before = [p.detach().clone() for p in frozen.parameters()]
    moved = model[0].weight.detach().clone()
    _train(model, opt, 3)
    assert all(torch.equal(a, b) for a, b in zip(before, frozen.parameters()))
    assert not torch.equal(moved, model[0].weight)


@pytest.mark.parametrize("name", NAMES)
def test_state_bytes_match_measured(name: str) -> None:
    shapes = [(96, 64), (64,), (8, 4, 3, 3), (5000,), (3, 40, 50), (70, 70)]
    params = [nn.Parameter(torch.randn(s)) for s in shapes]
    opt = build_optimizer(name, params, **({"momentum": 0.9} if name == "sgd" else {}),
                          **({"fused": False} if "8bit" in name else {}))
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    hyper = {"momentum": 0.9} if name == "sgd" else {}
    assert measured_state_bytes(opt) == state_bytes(name, shapes, **hyper)
    # the estimator's calling convention: (shape, dtype) pairs
    assert state_bytes(name, [(s, torch.float32) for s in shapes], **hyper) == measured_state_bytes(opt)


def test_adam8bit_bytes_per_param_large_matrix() -> None:
    p = nn.Parameter(torch.zeros(1024, 1024))  # 1 Mi values
    opt = AdamW8bit([p], fused=False)
    p.grad = torch.randn_like(p)
    opt.step()
    per_param = measured_state_bytes(opt) / p.numel()
    assert per_param == state_bytes_per_param("adamw8bit", p.shape) == 2 + 8 / 2048
    assert per_param <= 2.1
    assert state_bytes_per_param("adamw", p.shape) == pytest.approx(8.0, abs=1e-5)


def test_bf16_params_keep_fp32_statistics() -> None:
    p = nn.Parameter(torch.randn(128, 64, dtype=torch.bfloat16))
    opt = Adam8bit([p], fused=False)
    p.grad = torch.randn_like(p)
    opt.step()
    assert p.dtype == torch.bfloat16 and opt.state[p]["m_absmax"].dtype == torch.float32
    assert measured_state_bytes(opt) == state_bytes("adam8bit", [(p.shape, torch.bfloat16)])


def test_factored_state_is_o_m_plus_n() -> None:
    m, n = 300, 200
    for cls, kw, expected in [
        (Adafactor, {}, 4 * (m + n)),
        (Adafactor, {"beta1": 0.9}, 4 * (m + n) + 4 * m * n),
        (CAME, {}, 4 * m * n + 2 * 4 * (m + n)),  # CAME's momentum is full size by design
    ]:
        p = nn.Parameter(torch.randn(m, n))
        opt = cls([p], **kw)
        p.grad = torch.randn_like(p)
        opt.step()
        assert measured_state_bytes(opt) == expected == cls.state_nbytes((m, n), **kw)


# ---- 8-bit Adam accuracy -----------------------------------------------------------------

def _adam_trajectory(make, steps: int = 100) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    torch.manual_seed(0)
    p0 = [torch.randn(96, 128) * 0.05, torch.randn(64)]
    params = [nn.Parameter(p.clone()) for p in p0]
    opt = make(params)
    g = torch.Generator().manual_seed(3)
    row_scale = torch.exp(torch.randn(96, 1, generator=g) * 0.5)
    signal = torch.randn(96, 128, generator=g)
    for _ in range(steps):
        params[0].grad = row_scale * (0.3 * signal + torch.randn(96, 128, generator=g)) * 1e-2
        params[1].grad = torch.randn(64, generator=g)
        opt.step()
    return p0, params


def test_adamw8bit_tracks_fp32_adamw() -> None:
    p0, ref = _adam_trajectory(lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01))
    _, q = _adam_trajectory(lambda ps: AdamW8bit(ps, lr=1e-3, weight_decay=0.01, fused=False))
    rel = ((q[0] - ref[0]).norm() / (ref[0] - p0[0]).norm()).item()
    assert rel < 0.05, rel  # measured ~1.5 %: the update error after 100 steps
    # the small (64-value) tensor keeps fp32 moments: same as AdamW to float rounding
    assert torch.allclose(q[1], ref[1], rtol=0, atol=1e-6)


def test_second_moment_never_rounds_to_zero() -> None:
    y = torch.tensor([0.0, 1e-12, 4e-8, 6e-8, 1.0])
    assert Q.encode(y, signed=False).tolist() == [0, 0, 0, 1, 255]  # nearest
    assert Q.encode(y, signed=False, keep_nonzero=True).tolist() == [0, 1, 1, 1, 255]


def test_adam8bit_stable_when_small_gradients_share_a_block() -> None:
    """Rows with gradients 1e-5 of their block-mates' have v below 10^-7 of the block maximum
    but representable m; if v were stored as 0, the first near-zero gradient would give an
    update m/eps ~ 1000 lr (the divergence seen on GPT-2 attention weights)."""
    p = nn.Parameter(torch.zeros(4, 1024))  # each block of 2048 holds a loud and a quiet row
    lr = 1e-3
    opt = AdamW8bit([p], lr=lr, weight_decay=0.0, fused=False)
    g = torch.Generator().manual_seed(0)
    scale = torch.tensor([1.0, 1e-5, 1.0, 1e-5]).view(4, 1)
    for step in range(30):
        before = p.detach().clone()
        quiet = 1e-9 if step >= 20 else 1.0  # the quiet rows then almost stop receiving gradient
        p.grad = torch.randn(4, 1024, generator=g) * scale * torch.tensor([1, quiet, 1, quiet]).view(4, 1)
        opt.step()
        assert (p - before).abs().max() < 10 * lr, step


@pytest.mark.parametrize("cls,ref", [(Adam8bit, torch.optim.Adam), (AdamW8bit, torch.optim.AdamW)])
def test_small_tensors_are_plain_adam(cls, ref) -> None:
    """Below 4096 values the moments stay fp32: the same update as torch's (L2 vs decoupled)."""
    g = torch.Generator().manual_seed(0)
    ours = [nn.Parameter(torch.randn(s, generator=g)) for s in [(30, 40), (17,)]]
    theirs = [nn.Parameter(p.detach().clone()) for p in ours]
    a = cls(ours, lr=1e-2, weight_decay=0.1)
    b = ref(theirs, lr=1e-2, weight_decay=0.1)
    for _ in range(10):
        for p, q in zip(ours, theirs):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        a.step()
        b.step()
    for p, q in zip(ours, theirs):
        assert torch.allclose(p, q, rtol=0, atol=1e-6)


@pytest.mark.slow
def test_adam8bit_compiled_matches_eager() -> None:
    _, eager = _adam_trajectory(lambda ps: Adam8bit(ps, fused=False), steps=10)
    _, fused = _adam_trajectory(lambda ps: Adam8bit(ps, fused=True), steps=10)
    assert torch.allclose(eager[0], fused[0], rtol=0, atol=1e-6)


# ---- hand / paper-literal computations --------------------------------------------------

def test_lamb_one_step_by_hand() -> None:
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(6, 5))
    b = nn.Parameter(torch.randn(5))
    gw, gb = torch.randn(6, 5), torch.randn(5)
    w0, b0 = w.detach().clone(), b.detach().clone()
    lr, wd, eps = 0.1, 0.05, 1e-6
    opt = LAMB([w, b], lr=lr, weight_decay=wd, eps=eps)
    w.grad, b.grad = gw.clone(), gb.clone()
    opt.step()
    # step 1 with bias correction: m_hat = g, v_hat = g^2, r = g / (|g| + eps)
    r = gw / (gw.abs() + eps)
    u = r + wd * w0
    ratio = w0.norm() / u.norm()
    assert torch.allclose(w, w0 - lr * ratio * u, atol=1e-6)
    # 1-D bias: no weight decay, no trust ratio (the papers' exclusion)
    assert torch.allclose(b, b0 - lr * gb / (gb.abs() + eps), atol=1e-6)


def test_lars_one_step_by_hand() -> None:
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(6, 5))
    b = nn.Parameter(torch.randn(5))
    gw, gb = torch.randn(6, 5), torch.randn(5)
    w0, b0 = w.detach().clone(), b.detach().clone()
    lr, wd, eta, mu = 2.0, 1e-3, 1e-3, 0.9
    opt = LARS([w, b], lr=lr, momentum=mu, weight_decay=wd, trust_coefficient=eta)
    for step in range(2):
        w.grad, b.grad = gw.clone(), gb.clone()
        opt.step()
    local = eta * w0.norm() / (gw.norm() + wd * w0.norm())
    v1 = lr * local * (gw + wd * w0)
    w1 = w0 - v1
    local2 = eta * w1.norm() / (gw.norm() + wd * w1.norm())
    w2 = w1 - (mu * v1 + lr * local2 * (gw + wd * w1))
    assert torch.allclose(w, w2, atol=1e-6)
    b2 = b0 - lr * gb - (mu * lr * gb + lr * gb)  # excluded: local_lr = 1, no decay
    assert torch.allclose(b, b2, atol=1e-6)


def test_lars_nesterov_two_steps_by_hand() -> None:
    torch.manual_seed(1)
    w = nn.Parameter(torch.randn(4, 3))
    g = torch.randn(4, 3)
    w0 = w.detach().clone()
    lr, eta, mu = 0.5, 0.05, 0.8
    opt = LARS([w], lr=lr, momentum=mu, weight_decay=0.0, trust_coefficient=eta, nesterov=True)
    for _ in range(2):
        w.grad = g.clone()
        opt.step()
    d1 = lr * eta * w0.norm() / g.norm() * g
    v1 = d1
    w1 = w0 - (d1 + mu * v1)
    d2 = lr * eta * w1.norm() / g.norm() * g
    v2 = mu * v1 + d2
    assert torch.allclose(w, w1 - (d2 + mu * v2), atol=1e-6)
    with pytest.raises(ValueError, match="nesterov"):
        LARS([w], momentum=0.0, nesterov=True)


def test_layer_adaptation_exclusion_overridable() -> None:
    b = nn.Parameter(torch.ones(8))
    opt = LAMB([{"params": [b], "exclude_from_weight_decay": False,
                 "exclude_from_layer_adaptation": False}], lr=0.1, weight_decay=0.5)
    b.grad = torch.zeros(8)
    opt.step()  # r = 0, u = wd * b, ratio = ||b|| / ||wd b|| = 1 / wd: b <- b - lr * b
    assert torch.allclose(b, torch.full((8,), 0.9))


def test_model_groups_exclude_1d_from_weight_decay() -> None:
    model = _model()
    for name in ("adamw", "lamb", "lars", "adamw8bit"):
        opt = build_optimizer(name, model, lr=0.1, weight_decay=0.5)
        groups = {len(g["params"]): g["weight_decay"] for g in opt.param_groups}
        assert groups == {2: 0.5, 4: 0.0}  # 2 weight matrices; 2 biases + LayerNorm gain/offset
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
        for n, p in model.named_parameters():
            if p.ndim == 1:
                assert torch.equal(p, before[n]), (name, n)  # zero grad, no decay: unchanged
            else:
                assert p.norm() < before[n].norm(), (name, n)  # decayed
        model.load_state_dict(before)


def _paper_adafactor(x, grads, beta1=None, eps1=1e-30, eps2=1e-3, d=1.0, c=-0.8):
    """Shazeer & Stern 2018 Algorithm 4 literally (sums, explicit V_hat), relative step 1e-2."""
    x = x.clone().double()
    r = torch.zeros(x.shape[0], dtype=torch.float64)
    col = torch.zeros(x.shape[1], dtype=torch.float64)
    m = torch.zeros_like(x)
    for t, g in enumerate(grads, start=1):
        g = g.double()
        b2 = 1 - t ** c
        alpha = max(eps2, (x.pow(2).mean().sqrt()).item()) * min(1e-2, 1 / math.sqrt(t))
        g2 = g * g + eps1
        r = b2 * r + (1 - b2) * g2.sum(dim=1)
        col = b2 * col + (1 - b2) * g2.sum(dim=0)
        v = torch.outer(r, col) / r.sum()
        u = g / v.sqrt()
        u = u / max(1.0, (u.pow(2).mean().sqrt() / d).item())
        if beta1 is not None:
            m = beta1 * m + (1 - beta1) * u
            u = m
        x = x - alpha * u
    return x


@pytest.mark.parametrize("beta1", [None, 0.9])
def test_adafactor_matches_paper_algorithm(beta1: float | None) -> None:
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(12, 7, generator=g)
    grads = [torch.randn(12, 7, generator=g) * s for s in (1.0, 0.1, 3.0, 1.0, 0.5)]
    p = nn.Parameter(x0.clone())
    opt = Adafactor([p], beta1=beta1)
    for gr in grads:
        p.grad = gr.clone()
        opt.step()
    assert torch.allclose(p.double(), _paper_adafactor(x0, grads, beta1), rtol=1e-5, atol=1e-6)


def test_adafactor_equals_torch_adafactor_without_eps1() -> None:
    # torch.optim.Adafactor differs from the paper only in where e1 goes (see adafactor.py);
    # with e1 = 0 the two must agree.
    g = torch.Generator().manual_seed(0)
    shapes = [(10, 6), (9,), (2, 5, 4)]
    ours = [nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
    theirs = [nn.Parameter(p.detach().clone()) for p in ours]
    a = Adafactor(ours, lr=1e-2, eps=(0.0, 1e-3))
    b = torch.optim.Adafactor(theirs, lr=1e-2, eps=(0.0, 1e-3))
    for _ in range(5):
        for p, q in zip(ours, theirs):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        a.step()
        b.step()
    for p, q in zip(ours, theirs):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-6)


def test_came_matches_paper_algorithm() -> None:
    """Luo et al. 2023 Algorithm 1 literally (sums, explicit V and S), for a matrix."""
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(8, 5, generator=g)
    grads = [torch.randn(8, 5, generator=g) for _ in range(5)]
    lr, (b1, b2, b3), (e1, e2), d = 1e-2, (0.9, 0.999, 0.9999), (1e-30, 1e-16), 1.0
    p = nn.Parameter(x0.clone())
    opt = CAME([p], lr=lr)
    for gr in grads:
        p.grad = gr.clone()
        opt.step()
    x = x0.double()
    r, c = torch.zeros(8, dtype=torch.float64), torch.zeros(5, dtype=torch.float64)
    rr, cc = torch.zeros_like(r), torch.zeros_like(c)
    m = torch.zeros_like(x)
    for gr in grads:
        gr = gr.double()
        r = b2 * r + (1 - b2) * (gr * gr + e1).sum(1)
        c = b2 * c + (1 - b2) * (gr * gr + e1).sum(0)
        u = gr / (torch.outer(r, c) / r.sum()).sqrt()
        u = u / max(1.0, (u.pow(2).mean().sqrt() / d).item())
        m = b1 * m + (1 - b1) * u
        inst = (u - m) ** 2 + e2
        rr = b3 * rr + (1 - b3) * inst.sum(1)
        cc = b3 * cc + (1 - b3) * inst.sum(0)
        x = x - lr * m / (torch.outer(rr, cc) / rr.sum()).sqrt()
    assert torch.allclose(p.double(), x, rtol=1e-4, atol=1e-6)


# ---- registry ----------------------------------------------------------------------------

def test_registry_rejects_bad_input() -> None:
    model = _model()
    with pytest.raises(UserError, match="allowed: sgd, adam, adamw, adam8bit"):
        build_optimizer("adamm", model)
    with pytest.raises(UserError, match="takes no 'momentum'"):
        build_optimizer("adam", model, momentum=0.9)
    with pytest.raises(UserError, match="no option 'amsgradd'"):
        build_optimizer("adamw", model, amsgradd=True)
    with pytest.raises(UserError, match="betas"):
        build_optimizer("adafactor", model, betas=(0.9, 0.999))
    with pytest.raises(UserError):
        build_optimizer("lamb", model, lr=-1.0)
    with pytest.raises(UserError, match="unknown optimizer"):
        state_bytes("nope", [(3, 3)])


def test_registry_builds_every_name_with_torch_foreach() -> None:
    model = _model()
    for name in NAMES:
        opt = build_optimizer(name, model)
        assert isinstance(opt, torch.optim.Optimizer)
        if name in ("sgd", "adam", "adamw"):
            assert opt.defaults["foreach"] is True

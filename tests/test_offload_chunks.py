"""``memory.offload.plan=chunks`` (PatrickStar's chunk manager) on the CPU's logical device pool: the
placement rules on small synthetic sequences, then a GPT whose model states exceed the device budget
trained with the plain run's losses and parameters, within the budget, with the counted bytes equal
to the replayed ones; the trainer's checkpoints resume a plain run; the compatibility rules and the
estimate's cost face."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from scaletrain import models
from scaletrain.errors import ConfigError, UserError
from scaletrain.platform import Platform
from scaletrain.techniques.offload.chunk_runtime import ChunkRuntime
from scaletrain.techniques.offload.chunks import (ADAM_TRANSIENT_CHUNKS, ChunkPlacer, ChunkState, Moment, pack_chunks,
                                                  replay)
from scaletrain.techniques.offload.runtime import OffloadOptions

PLAT = Platform("test")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_pack_chunks_equal_size_group_boundaries_and_too_small():
    lay = pack_chunks([100, 30, 50, 10, 10, 200], [0, 0, 0, 1, 1, 0], 4 * 256)
    assert lay.chunk_numel == 256
    assert lay.chunks == [[0, 1, 2], [3, 4], [5]]
    assert lay.group_of == [0, 1, 0]
    assert lay.offsets[2] == (0, 130)
    assert pack_chunks([100, 100, 100], [0, 0, 0], 4 * 256).chunks == [[0, 1], [2]]  # no parameter is split
    assert pack_chunks([100, 10, 100, 10], [0, 1, 0, 1], 4 * 256).chunks == [[0, 2], [1, 3]]  # each group its own
    auto = pack_chunks([100, 20], [0, 0], None)
    assert auto.chunk_bytes == 512 and auto.chunks == [[0, 1]]  # the largest parameter, rounded up to 512 B
    # searched: 1536 B chunks (the largest, 1200 B, rounded up) hold one 1200 B parameter each; 2560 B two
    auto = pack_chunks([300, 300, 300, 300], [0, 0, 0, 0], None)
    assert auto.chunk_bytes == 2560 and len(auto) == 2
    with pytest.raises(UserError, match="at least 4096"):
        pack_chunks([1000, 5], [0, 0], 512)


def test_placer_evicts_farthest_next_use_and_counts_dirty_copies():
    S = 10
    # chunk tensor ids: P of chunk c is 4c; uses 0, 4, 8, then 0 again, then 8
    seq = [Moment("a", frozenset({0})), Moment("b", frozenset({4})), Moment("c", frozenset({8})),
           Moment("d", frozenset({0})), Moment("e", frozenset({8}))]
    st = ChunkState.initial(3)
    pl = ChunkPlacer(seq, S, st)
    for k in range(2):
        pl.place(k, 2 * S)
    acts, _ = pl.place(2, 2 * S)  # 0 is next used at 3, 4 at 1 + 5 = 6 (next step): Belady evicts 4
    assert [(a.op, a.chunk, a.nbytes) for a in acts] == [("evict", 4, 0), ("fetch", 8, S)]
    st.dirty[0] = True
    acts, _ = pl.place(3, 2 * S)
    assert acts == []  # 0 is resident
    pl.state.on_device[4] = pl.state.dirty[4] = True  # a third chunk resident and dirty: evicting it copies back
    acts, _ = pl.place(4, 2 * S)  # 0 is next used at 0 + 5, 4 at 1 + 5
    assert [(a.op, a.chunk, a.nbytes) for a in acts] == [("evict", 4, S)]
    # a zero gradient chunk is fetched without a copy; an update evicts nothing for itself
    upd = [Moment("update 0", frozenset({0, 1, 2, 3}), 0)]
    r = replay(upd, S, ChunkState.initial(1), [0], (4 + ADAM_TRANSIENT_CHUNKS) * S)
    assert r.device_updates == 1 and r.h2d_bytes == 3 * S  # P, M, V copied; G all zeros
    r = replay(upd, S, ChunkState.initial(1), [0], (4 + ADAM_TRANSIENT_CHUNKS) * S - 1)
    assert r.host_updates == 1 and r.h2d_bytes == 0  # no room: CPU Adam on the host copies


def lm_loss(o, t):
    return F.cross_entropy(o.flatten(0, 1), t.flatten())


def adamw(m):
    decay = [p for p in m.parameters() if p.ndim >= 2]
    other = [p for p in m.parameters() if p.ndim < 2]
    return torch.optim.AdamW([{"params": decay}, {"params": other, "weight_decay": 0.0}], lr=1e-2,
                             weight_decay=0.1, foreach=True)


def test_chunks_match_plain_run_within_budget_with_predicted_bytes():
    torch.manual_seed(0)
    m0 = models.get("gpt2-tiny", n_layer=2, n_embd=128, n_head=2, n_positions=16)
    states = 16 * sum(p.numel() for p in m0.parameters())  # fp32 parameters, gradients, Adam m and v
    g = torch.Generator().manual_seed(1)
    data = [(torch.randint(0, 256, (2, 16), generator=g), torch.randint(0, 256, (2, 16), generator=g))
            for _ in range(4)]
    plain = copy.deepcopy(m0)
    opt = adamw(plain)
    base = []
    for x, y in data:
        loss = lm_loss(plain(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        base.append(loss.item())
    budget = 5_600_000  # 81 % of the model states: chunks move, one chunk's Adam moments fit the margin
    assert budget < 0.82 * states
    rt = ChunkRuntime(copy.deepcopy(m0), adamw, OffloadOptions(plan="chunks", device_budget=budget), PLAT, lm_loss,
                      data[0])
    got, rows = [], []
    for x, y in data:
        got.append(rt.forward_backward(x, y).item())
        rt.clip_grad_norm_(1.0)
        rt.step()
        rows.append(rt.last_stats())
    assert got == base
    final = rt.model_state_dict()
    for k, v in plain.state_dict().items():
        torch.testing.assert_close(final[k], v, rtol=0, atol=0)
    for r in rows:
        assert r["device_peak_bytes"] <= budget
        assert r["h2d_bytes"] == r["predicted_h2d_bytes"] > 0
        assert r["d2h_bytes"] == r["predicted_d2h_bytes"] > 0
        assert r["transfers"] == r["predicted_transfers"]  # per direction and kind
    assert rows[0]["warmup"] and rows[0]["device_updates"] == 0  # the warm-up updates on the host
    planned = rows[-1]
    assert planned["device_updates"] > 0 and planned["host_updates"] > 0
    # an upper bound: the update reserves ADAM_TRANSIENT_CHUNKS chunks of temporaries; foreach Adam uses fewer
    assert planned["device_peak_bytes"] >= 0.9 * planned["predicted_device_peak_bytes"]


BASE = ["model.name=gpt2-tiny", "model.overrides.n_layer=2", "model.overrides.n_positions=16", "data.seq_len=16",
        "train.global_batch=2", "train.micro_batch=1", "train.checkpoint_every=2", "train.eval_every=2",
        "train.eval_batches=1",
        "train.log_every=1", "train.device=cpu", "train.progress=off"]
CHUNKS = ["memory.offload.plan=chunks", "memory.device_budget=9MiB", "memory.offload.chunk_bytes=256KiB"]


def _train(out: Path, extra: list[str], resume: bool = False):
    from scaletrain.train.config import load_config
    from scaletrain.train.trainer import Trainer

    t = Trainer(load_config(None, BASE + extra), out, resume=resume, log=lambda s: None)
    try:
        t.fit()
        state = {k: v.clone() for k, v in t.parallel.model_state_dict().items()}
    finally:
        t.close()
    rows = [json.loads(s) for s in (out / "metrics.jsonl").read_text().splitlines()]
    return state, [r for r in rows if "loss" in r]


def test_train_chunks_checkpoint_resumes_plain(tmp_path):
    """Through the trainer, 2 micro-batches per step: the plain losses; a chunked checkpoint resumes a plain run."""
    import shutil

    plain, plain_rows = _train(tmp_path / "plain", ["train.steps=4"])
    _, rows = _train(tmp_path / "chunks", ["train.steps=2"] + CHUNKS)
    assert [r["loss"] for r in rows] == [r["loss"] for r in plain_rows[:2]]
    for r in rows:
        assert r["device_peak_bytes"] <= r["offload_device_budget_bytes"]
        assert r["offload_bytes"] == r["offload_pred_bytes"] > 0
    (tmp_path / "resumed" / "checkpoints").mkdir(parents=True)
    for f in (tmp_path / "chunks" / "checkpoints").iterdir():
        shutil.copytree(f, tmp_path / "resumed" / "checkpoints" / f.name) if f.is_dir() else \
            shutil.copy(f, tmp_path / "resumed" / "checkpoints" / f.name)
    resumed, _ = _train(tmp_path / "resumed", ["train.steps=4"], resume=True)  # a plain run from the chunked one
    for k, v in plain.items():
        torch.testing.assert_close(resumed[k], v, rtol=0, atol=0)


def test_compat_and_config_refusals():
    from scaletrain.plan import Plan
    from scaletrain.techniques import compat
    from scaletrain.train.config import load_config

    m = models.get("gpt2-tiny", device="meta", n_layer=2)
    facts = compat.Facts.of(m, world=1, device="cpu", seq_len=16, microbatches=1)

    def check(*keys):
        compat.check(Plan.from_config(load_config(None, list(keys))), facts)

    check("memory.offload.plan=chunks", "memory.device_budget=6MiB")
    with pytest.raises(ConfigError, match="memory.offload.activations=all"):
        check("memory.offload.plan=chunks", "memory.offload.activations=all")
    with pytest.raises(ConfigError, match="optim.name=sgd"):
        check("memory.offload.plan=chunks", "optim.name=sgd")
    with pytest.raises(ConfigError, match="chunk_bytes"):
        load_config(None, ["memory.offload.chunk_bytes=lots"])
    from scaletrain.train.preflight import check_unused

    with pytest.raises(ConfigError, match="memory.offload.chunk_bytes='1MiB' has no effect on its own; add "
                                          "memory.offload.plan=chunks"):
        check_unused(load_config(None, ["memory.offload.chunk_bytes=1MiB"]))


def test_estimate_prices_chunks_within_budget():
    """The cost face through plan_costs (what ``scaletrain estimate --plan`` prints): the settled placement's
    peak within the budget, the parts summing to it, and fewer bytes moved with more room."""
    from scaletrain.plan import Plan
    from scaletrain.techniques.plan_cost import plan_costs
    from scaletrain.train.config import load_config

    m = models.get("gpt2-tiny", device="meta", n_layer=2, n_positions=16)
    plat = Platform("test")
    plain = plan_costs(Plan(), m, world=1, global_batch=2, seq=16, platform=plat)[0]
    copies = []
    for mib in (5, 7):
        plan = Plan.from_config(load_config(None, ["memory.offload.plan=chunks", f"memory.device_budget={mib}MiB",
                                                   "memory.offload.chunk_bytes=256KiB"]))
        c = plan_costs(plan, m, world=1, global_batch=2, seq=16, platform=plat)[0]
        assert c.peak_bytes <= mib * 2**20 < plain.peak_bytes
        assert abs(sum(c.bytes.values()) - c.peak_bytes) < 1
        assert c.time_s.step_s > plain.time_s.step_s
        copies.append(c.time_s.copies_s["h2d"] + c.time_s.copies_s["d2h"])
    assert copies[0] > copies[1] > 0

"""train.params_dtype=bf16/fp16: 16-bit parameters and gradients, fp32 masters in the optimizer."""

import pytest
import torch

from scaletrain.errors import ConfigError
from scaletrain.measure import model_states
from scaletrain.techniques.data_parallel import cost as zero
from scaletrain.train.config import load_config
from scaletrain.train.trainer import Trainer

TINY = ["model.overrides.n_layer=2", "model.overrides.n_embd=64", "model.overrides.n_head=2", "data.seq_len=32",
        "train.global_batch=8", "train.eval_batches=2", "train.log_every=1", "optim.warmup_steps=2",
        "train.eval_every=0", "train.progress=off"]


def _trainer(extra, out=None, resume=False):
    return Trainer(load_config(None, TINY + extra), out, resume=resume, log=lambda s: None)


@pytest.mark.slow  # > 20 s: kept out of make test-fast
def test_bf16_parameters_with_fp32_masters_train_like_fp32_and_cost_16_bytes(tmp_path):
    ref = _trainer(["train.steps=25", "train.precision=bf16"])
    ref_r = ref.fit()
    t = _trainer(["train.steps=25", "train.precision=bf16", "train.params_dtype=bf16"], tmp_path / "run")
    r = t.fit()
    assert {p.dtype for p in t.model.parameters()} == {torch.bfloat16}
    masters = [p for g in t.optimizer.param_groups for p in g["params"]]
    assert {p.dtype for p in masters} == {torch.float32}
    for p, m in t.parallel.pairs:  # the stored weights are the masters rounded to bf16
        assert torch.equal(p, m.to(torch.bfloat16))
    assert r.losses[-1] < r.losses[0] - 1.0
    assert r.val_loss == pytest.approx(ref_r.val_loss, rel=0.03)
    # model-state bytes after a backward: ZeRO's 2 + 2 + (4 + 8) per parameter for mixed-precision Adam
    t.parallel.run_micro_batches(t, iter(t._make_train_loader(0)))
    n = sum(p.numel() for p in t.model.parameters())
    got = model_states.measure_model_state_bytes(t.model, t.optimizer)
    want = zero.model_state_bytes(n, 0, 1, precision="bf16")
    for k in ("params", "grads", "optimizer"):
        assert getattr(got, k) == pytest.approx(getattr(want, k), rel=0.01), k
    # the checkpoint holds the fp32 masters in the plain layout: an fp32 run resumes from it
    t.close()
    fp32 = _trainer(["train.steps=26", "train.precision=bf16"], tmp_path / "run", resume=True)
    fp32.fit()
    assert fp32.step == 26 and {p.dtype for p in fp32.model.parameters()} == {torch.float32}


def test_fp16_parameters_with_loss_scaling_train():
    t = _trainer(["train.steps=6", "train.precision=fp16", "train.params_dtype=fp16",
                  "model.overrides.n_embd=32", "data.seq_len=16"])
    r = t.fit()
    assert {p.dtype for p in t.model.parameters()} == {torch.float16}
    assert all(torch.isfinite(torch.tensor(r.losses))) and r.losses[-1] < r.losses[0]
    assert t.scaler.is_enabled()


def test_params_dtype_conflicts_are_one_line():
    with pytest.raises(ConfigError,
                       match="16-bit parameter storage with fp32 masters runs with one process or ZeRO-1/2"):
        _trainer(["train.params_dtype=bf16", "memory.offload.plan=auto", "memory.device_budget=1GiB"])
    with pytest.raises(ConfigError, match="allowed"):
        _trainer(["train.params_dtype=int8"])

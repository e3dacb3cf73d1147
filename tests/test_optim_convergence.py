"""Every optimizer trains gpt2-tiny on the shipped text to within a few per cent of AdamW's
validation loss with its documented hyperparameters (:mod:`scaletrain.techniques.optim.recipes`);
LAMB and LARS at 8x the batch, at equal samples seen, within a few per cent of small-batch AdamW.

The recipes promise 3 % at the 200 steps they were tuned for (measured 2026-11-22/23, 2-core CPU:
AdamW 2.479 at batch 16 x 200 steps; adam, adam8bit, adamw8bit 2.479, adafactor 2.470, came 2.469,
lamb 2.442; small-batch AdamW (batch 2 x 1600 steps) 2.432, LAMB +0.4 %, LARS 2.474 (+1.7 %)).
That check is ``benchmarks/optim/convergence.py --steps 200 --check`` (9 runs: 133 s of the
suite's 22 min until 2026-11-28). No cheaper run keeps 3 % for every optimizer (2026-11-28
sweeps: at 200 steps a 32-byte context or a 2-layer model puts CAME 6-8 % and the large-batch pair
4-8 % behind). Here: the same runs at 100 steps, half the time. Measured (2026-11-28): AdamW 2.565;
adam, adam8bit, adamw8bit, adafactor, lamb, lars within 0.6 % of it; CAME 2.706 (+5.5 %: its lr
3e-4, 1/7 of AdamW's, catches up by step 200); small-batch AdamW (batch 2 x 800 steps) 2.488,
LAMB +3.2 %, LARS +2.5 %. Bounds: 3 % where the 100-step run already shows it, the measured gap
plus ~1.5 points where it does not yet (CAME 7 %, LAMB 4.5 %); an optimizer that does not update
stays near ln 256 = 5.5, and every run must end below 2.75 (83 % of the byte-unigram entropy).
"""

import multiprocessing as mp
from concurrent.futures import ProcessPoolExecutor

import pytest

from scaletrain.techniques.optim.recipes import RECIPES, recipe
from scaletrain.testing import start_method
from scaletrain.train.config import load_config
from scaletrain.train.trainer import Trainer

BASE = ["data.seq_len=64", "train.eval_every=0", "train.eval_batches=16", "train.progress=off",
        "train.log_every=1000"]
LARGE = ["train.global_batch=16", "train.steps=100", "optim.warmup_steps=10"]
SMALL = ["train.global_batch=2", "train.steps=800", "optim.warmup_steps=40"]  # 1/8 the batch, same samples
LATE = {"came": 0.07}  # relative bound vs AdamW at 100 steps where 3 % comes later (module docstring)


def _val(extra):
    t = Trainer(load_config(None, BASE + extra), None, log=lambda s: None)
    val = t.fit().val_loss
    t.close()
    return val


def _val_one_thread(extra):
    import torch

    torch.set_num_threads(1)
    return _val(extra)


def _vals(runs: dict[str, list[str]]) -> dict[str, float]:
    """The runs in two one-thread processes: on 2 cores that is ~1.5x faster than one process with
    two threads (a model this small barely uses the second thread) and degrades gracefully when
    the machine is shared (two spinning intra-op threads do not)."""
    with ProcessPoolExecutor(max_workers=2, mp_context=mp.get_context(start_method())) as ex:
        futures = {name: ex.submit(_val_one_thread, extra) for name, extra in runs.items()}
        return {name: f.result() for name, f in futures.items()}


@pytest.mark.slow
def test_every_optimizer_near_adamw_and_large_batch_lamb_lars():
    fast = {"adam8bit": ["optim.options.fused=false"], "adamw8bit": ["optim.options.fused=false"]}  # no compile
    runs = {"adamw (batch 2)": SMALL + recipe("adamw")}  # the longest run first
    runs.update({name: LARGE + recipe(name) + fast.get(name, []) for name in RECIPES})
    vals = _vals(runs)
    small = vals.pop("adamw (batch 2)")
    ref = vals["adamw"]
    for name, v in vals.items():
        assert v <= ref * (1 + LATE.get(name, 0.03)), (name, v, ref)
    assert vals["lamb"] <= small * 1.045, (vals["lamb"], small)
    assert vals["lars"] <= small * 1.03, (vals["lars"], small)
    assert max(vals.values()) < 2.75 < 3.32  # all far below the byte-unigram entropy of the text

"""Dict samples (what tokenizers and `datasets` give) train a user's model end to end, with the
model's own loss convention; other samples are one line (`train/model_data.py: as_pairs`)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

from scaletrain.errors import ConfigError  # noqa: E402
from scaletrain.train.config import load_config  # noqa: E402
from scaletrain.train.trainer import Trainer  # noqa: E402

KEYS = ["train.global_batch=4", "data.seq_len=12", "train.eval_batches=1", "train.progress=off", "train.steps=1",
        "optim.lr=0", "optim.weight_decay=0"]


class Rows(torch.utils.data.Dataset):
    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def _model():
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=1, n_embd=32, n_head=2, vocab_size=256, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0))


def test_dict_samples_train_with_the_models_own_loss():
    """A dataset of {input_ids, attention_mask} (right-padded, lists as `datasets` gives them): the
    trainer's step loss equals the model's own `labels=` loss on the same batch, padding ignored."""
    ids = [int(t) for t in torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(1))]
    row = {"input_ids": ids, "attention_mask": [1] * 9 + [0] * 3}
    model = _model()
    x = torch.tensor([ids] * 4)
    mask = torch.tensor([row["attention_mask"]] * 4)
    with torch.no_grad():
        want = model(input_ids=x, attention_mask=mask, labels=x.masked_fill(mask == 0, -100)).loss.item()
    tr = Trainer(load_config(None, KEYS), model=model, log=lambda s: None)
    try:
        tr.train_set = tr.val_set = Rows([row] * 8)
        got = tr.fit()
    finally:
        tr.close()
    assert got.losses[0] == pytest.approx(want, rel=1e-5)
    assert got.val_loss == pytest.approx(want, rel=1e-5)


def test_other_samples_are_one_line():
    tr = Trainer(load_config(None, KEYS), model=_model(), log=lambda s: None)
    try:
        tr.train_set = Rows([{"text": "to be or not to be"}] * 8)
        with pytest.raises(ConfigError, match=r"allowed: \(inputs, targets\) pairs, or dicts with input_ids") as e:
            tr.fit()
        assert "\n" not in str(e.value)
    finally:
        tr.close()
